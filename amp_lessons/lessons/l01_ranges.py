"""Lesson 01 (``notebooks/01_fp16_ranges_and_underflow.ipynb``): number ranges, measured.

The lesson's own experiments, built on ``amp_lessons.numerics.formats``:

- ``check_range`` / ``range_checks_text`` / ``verdict_r1``: claim R1 (FP16 spans 5.96e-8 to
  65504, FP32 1.4e-45 to 3.4e38) against the limits measured by arithmetic on this device
  (``formats.measure_limits``); the verdict is a ``claims.Verdict``.
- ``dtypes_under_autocast``: the dtypes one forward and backward under autocast gives the logits,
  the loss and the gradients. Lesson 01 shows them; claim B5 is decided in lesson 02.
"""
from __future__ import annotations

import decimal
import math
import re
from dataclasses import dataclass, field
from typing import Dict, Mapping, Sequence, Union

import torch

from amp_lessons.publish import claims
from amp_lessons.numerics import formats
from amp_lessons.publish.report import show_table

LESSON = "01"

#: Claim R1 as the article writes it: format -> (lowest, highest) magnitude, as written.
R1_CLAIMED = {"fp16": ("5.96e-8", "65504"), "fp32": ("1.4e-45", "3.4e38")}


def matches_written(claimed: str, actual: float) -> bool:
    """Does ``actual`` round to the number written in ``claimed``, at its written precision?
    (``"5.96e-8"`` matches 2**-24 = 5.9605e-08.) ValueError for anything but a plain decimal."""
    text = str(claimed).strip().lower()
    m = re.fullmatch(r"[+-]?(\d+\.?(\d*)|\.(\d+))(?:e[+-]?\d+)?", text)
    if not m:
        raise ValueError(f"claimed values must be plain decimal numbers such as 5.96e-8; "
                         f"got {claimed!r}")
    if not math.isfinite(actual):
        return False
    written = decimal.Decimal(text)        # exact: no float overflow at 1e400, no rounding
    unit = decimal.Decimal(1).scaleb(written.as_tuple().exponent)   # one unit of the last digit
    return abs(written - decimal.Decimal(actual)) <= unit / 2


@dataclass(frozen=True)
class RangeCheck:
    """A claimed range of a format beside the range measured on a device.

    ``low_is`` says which real limit the claimed low end is: ``"smallest subnormal"``,
    ``"smallest normal"`` or ``"neither"``; ``high_holds`` whether the high end is the largest
    finite value.
    """

    fmt: str
    claimed_low: str
    claimed_high: str
    measured: Dict[str, float] = field(repr=False)
    low_is: str
    high_holds: bool

    @property
    def holds(self) -> bool:
        """True when both ends match a real limit of the format at the claim's precision."""
        return self.low_is != "neither" and self.high_holds

    def sentence(self) -> str:
        """One sentence, computed from the measurement."""
        m = self.measured
        low = {"smallest subnormal": f"{self.claimed_low} is the smallest subnormal "
                                     f"({m['smallest_positive']:.6g}); the smallest normal is "
                                     f"{m['smallest_normal']:.6g}, below which precision drops",
               "smallest normal": f"{self.claimed_low} is the smallest normal "
                                  f"({m['smallest_normal']:.6g}); subnormals reach down to "
                                  f"{m['smallest_positive']:.6g}",
               "neither": f"{self.claimed_low} is neither the smallest subnormal "
                          f"({m['smallest_positive']:.6g}) nor the smallest normal "
                          f"({m['smallest_normal']:.6g})"}[self.low_is]
        high = (f"{self.claimed_high} is the largest finite value ({m['max']:.6g})"
                if self.high_holds else
                f"{self.claimed_high} is not the largest finite value ({m['max']:.6g})")
        return f"{'holds' if self.holds else 'does not hold'}: {low}; {high}."


def finfo_limits(fmt: str) -> Dict[str, float]:
    """``fmt``'s limits as ``torch.finfo`` states them (smallest subnormal = smallest normal x
    eps), in ``formats.measure_limits``'s keys: claim R1's second source."""
    name = formats.get_format(fmt).torch_dtype_name
    if name is None:
        raise ValueError(f"fmt must be a format torch has a dtype for; {fmt!r} has none")
    info = torch.finfo(getattr(torch, name))
    return {"smallest_positive": float(info.smallest_normal) * float(info.eps),
            "smallest_normal": float(info.smallest_normal), "max": float(info.max)}


def check_range(fmt: str, claimed_low: str, claimed_high: str,
                device: Union[str, torch.device, None] = None,
                measured: Union[Mapping[str, float], None] = None) -> RangeCheck:
    """Measure ``fmt``'s limits on ``device`` (``formats.measure_limits``; or take ``measured``,
    e.g. ``finfo_limits``) and set "``fmt`` spans ``claimed_low`` to ``claimed_high``" beside
    them. The claimed values are strings so their written precision counts."""
    info = formats.get_format(fmt)
    measured = dict(measured) if measured is not None else formats.measure_limits(info, device)
    if matches_written(claimed_low, measured["smallest_positive"]):
        low_is = "smallest subnormal"
    elif matches_written(claimed_low, measured["smallest_normal"]):
        low_is = "smallest normal"
    else:
        low_is = "neither"
    return RangeCheck(info.name, claimed_low, claimed_high, measured, low_is,
                      matches_written(claimed_high, measured["max"]))


def check_r1(device: Union[str, torch.device, None] = None,
             claimed: Mapping[str, tuple] = R1_CLAIMED, finfo: bool = False) -> list:
    """``check_range`` for every format of claim R1 (or ``claimed``: format -> (low, high)),
    measured on ``device``, or read from ``torch.finfo`` with ``finfo=True``."""
    if not claimed:
        raise ValueError("claimed must name at least one format")
    return [check_range(fmt, low, high, device, finfo_limits(fmt) if finfo else None)
            for fmt, (low, high) in claimed.items()]


def range_checks_text(checks: Sequence[RangeCheck]) -> str:
    """Claimed versus measured range, one block per format."""
    lines = []
    for c in checks:
        m = c.measured
        lines += [f"{c.fmt}: claimed {c.claimed_low} to {c.claimed_high}",
                  f"  measured smallest subnormal {m['smallest_positive']:.6g}, "
                  f"smallest normal {m['smallest_normal']:.6g}, max {m['max']:.6g}",
                  f"  {c.sentence()}"]
    return "\n".join(lines)


def _r1_why(checks: Sequence[RangeCheck]) -> str:
    return "; ".join(
        f"{c.fmt}: {c.claimed_low} is {'the ' + c.low_is if c.low_is != 'neither' else 'no limit'}"
        f", {c.claimed_high} {'is' if c.high_holds else 'is not'} the largest finite value"
        for c in checks)


@claims.decides("R1")
def verdict_r1(checks: Sequence[RangeCheck], device_type: str = "cpu",
               alternatives: Sequence = ()) -> claims.Verdict:
    """Claim R1's verdict: held when every claimed range names real limits of its format, as
    measured by arithmetic on ``device_type`` (a format fact: any device decides it).
    ``alternatives``: ``(setting, checks)`` pairs decided the same way, the sensitivity rows
    (the CPU's arithmetic beside a GPU's, ``torch.finfo``'s constants: ``check_r1(finfo=True)``)."""
    if not checks:
        raise ValueError("checks must hold at least one RangeCheck")
    measured = "; ".join(
        f"{c.fmt} measured on {device_type}: smallest subnormal "
        f"{c.measured['smallest_positive']:.6g}, smallest normal "
        f"{c.measured['smallest_normal']:.6g}, max {c.measured['max']:.6g}" for c in checks)
    held = all(c.holds for c in checks)
    why = _r1_why(checks)
    if held and any(c.low_is == "smallest subnormal" for c in checks):
        why += " (the low ends are subnormal minima: full precision stops at the smallest normal)"
    numbers = {c.fmt: dict(c.measured) for c in checks}
    alts = [claims.alternative(setting, held=all(c.holds for c in alt), why=_r1_why(alt))
            for setting, alt in alternatives]
    return claims.decide("R1", LESSON, measured, held, why, numbers, sensitivity=alts,
                         condition=f"measured on {device_type}")


def dtypes_under_autocast(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                          device_type: str, dtype: torch.dtype) -> Dict[str, torch.dtype]:
    """One forward under ``torch.autocast(device_type, dtype)`` and a backward: the dtypes of the
    logits, the loss (cross-entropy), the gradient that flows back into the logits, a
    parameter's ``.grad`` and the parameter itself."""
    seen: Dict[str, torch.dtype] = {}

    def hook(grad):
        seen["grad of logits"] = grad.dtype

    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device_type, dtype=dtype):
        logits = model(x)
        logits.register_hook(hook)
        loss = torch.nn.functional.cross_entropy(logits, y)
    loss.backward()
    param = next(p for p in model.parameters() if p.grad is not None)
    return {"logits": logits.dtype, "loss": loss.dtype, "grad of logits": seen["grad of logits"],
            "parameter .grad": param.grad.dtype, "parameter": param.dtype}


#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)


def show_gradient_summary(grads: Mapping, fmt: str) -> None:
    """Show ``formats.gradient_summary`` of captured gradients in ``fmt`` as the notebook's table
    (``report.show_table``: HTML, the text table as the fallback), titled by the format."""
    rows = formats.gradient_summary_rows(formats.gradient_summary(grads, fmt=fmt))
    show_table(rows, list(rows[0]), title=f"in {fmt}")
