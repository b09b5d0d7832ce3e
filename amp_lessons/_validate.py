"""Argument checks, defined once and used by every module: each raises ValueError naming the
setting and its allowed range (the course's rule for bad input)."""
from __future__ import annotations

import math
from typing import Sequence


def is_real(value) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value, low: int, high: int = None) -> None:
    """``value`` must be a whole number in ``[low, high]`` (no upper bound when ``high`` is None)."""
    if (not isinstance(value, int) or isinstance(value, bool) or value < low
            or (high is not None and value > high)):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be a whole number {allowed}; got {value!r}")


def check_choice(name: str, value, allowed: Sequence) -> None:
    """``value`` must be one of ``allowed``."""
    try:
        ok = value in allowed
    except TypeError:  # unhashable value against a dict or set
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_bool(name: str, value) -> None:
    """``value`` must be True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def check_positive(name: str, value, optional: bool = False) -> None:
    """``value`` must be a finite number > 0 (or None when ``optional``)."""
    if optional and value is None:
        return
    if not is_real(value) or value <= 0:
        prefix = "None or " if optional else ""
        raise ValueError(f"{name} must be {prefix}a finite number > 0; got {value!r}")
