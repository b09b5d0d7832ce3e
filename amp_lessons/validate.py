"""Argument checks, defined once and used by every module: each raises ValueError naming the
setting and its allowed range (the course's rule for bad input)."""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence


def is_int(value) -> bool:
    """A whole number that is not a bool: a Python int or a NumPy integer (``np.int64(5)``, as a
    sweep over ``np.arange`` hands out), never 5.0 or True."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite real number that is not a bool: int, float or a NumPy scalar of either."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def plain_number(value):
    """A 0-d torch tensor or NumPy array (``loss.detach()``, ``acc.mean()``) as its Python
    number; anything else as it is: checks that see only ``numbers.Real`` missed them."""
    if callable(getattr(value, "item", None)) and tuple(getattr(value, "shape", (1,))) == ():
        return value.item()
    return value


def check_int(name: str, value, low: int, high: int = None) -> int:
    """``value`` must be a whole number in ``[low, high]`` (no upper bound when ``high`` is None);
    returns it as a Python ``int``."""
    if not is_int(value) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be a whole number {allowed}; got {value!r}")
    return int(value)


def check_real(name: str, value, low: Optional[float] = None, high: Optional[float] = None,
               low_open: bool = False, high_open: bool = False) -> float:
    """``value`` must be a finite number in the interval from ``low`` to ``high`` (either end
    open when asked, no bound where None); returns it as a Python ``float``."""
    ok = is_real(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            allowed = (f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")
        elif low is not None:
            allowed = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            allowed = f"{'<' if high_open else '<='} {high:g}"
        else:
            allowed = ""
        raise ValueError(f"{name} must be a finite number {allowed}".rstrip() + f"; got {value!r}")
    return float(value)


MAX_SEED = 2**63 - 1  # what torch.manual_seed and torch.Generator accept


def check_seed(name: str, value, optional: bool = False) -> Optional[int]:
    """``value`` must be a whole number in ``[0, MAX_SEED]`` (or None when ``optional``): a seed
    that torch takes; returns it as a Python ``int``."""
    if optional and value is None:
        return None
    if not is_int(value) or not 0 <= value <= MAX_SEED:
        prefix = "None or " if optional else ""
        raise ValueError(f"{name} must be {prefix}a whole number >= 0 (at most 2**63 - 1, what "
                         f"torch.manual_seed takes); got {value!r}")
    return int(value)


def check_choice(name: str, value, allowed: Sequence) -> None:
    """``value`` must be one of ``allowed``."""
    try:
        ok = value in allowed
    except TypeError:  # unhashable value against a dict or set
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def check_bool(name: str, value) -> bool:
    """``value`` must be True or False (a NumPy bool too; not 0/1, not a string)."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        value = bool(value)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value


def check_positive(name: str, value, optional: bool = False) -> None:
    """``value`` must be a finite number > 0 (or None when ``optional``)."""
    if optional and value is None:
        return
    if not is_real(value) or value <= 0:
        prefix = "None or " if optional else ""
        raise ValueError(f"{name} must be {prefix}a finite number > 0; got {value!r}")
