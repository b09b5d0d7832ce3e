"""Argument checks shared by the modules: each raises ValueError naming the setting and its range."""
from __future__ import annotations

from typing import Sequence


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


def _check_choice(name: str, value, allowed: Sequence) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
