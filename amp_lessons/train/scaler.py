"""GradScaler's settings, the trainer's (``trainer.py`` re-exports ``ScalerSettings``): the four
knobs of lesson 03 plus ``enabled``, checked when built, applied to a live scaler between steps."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from amp_lessons._compat import cap_growth_tracker, reset_scale
from amp_lessons._compat import init_scale as current_init_scale
from amp_lessons.validate import check_bool, check_int, check_real, is_real


@dataclass(frozen=True)
class ScalerSettings:
    """GradScaler's four knobs (lesson 03) plus ``enabled``, validated when built.

    ``init_scale`` > 0; ``growth_factor`` > 1; ``backoff_factor`` in (0, 1); ``growth_interval``
    a whole number >= 1. Defaults are torch's.
    """

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def __post_init__(self):
        v = self.init_scale
        if not is_real(v) or not 2.0 ** -126 <= v <= 2.0 ** 127:
            raise ValueError(f"init_scale must be a finite number > 0 in float32's normal range "
                             f"[2**-126, 2**127] (the scale is a float32 tensor); got {v!r}")
        growth = check_real("growth_factor", self.growth_factor, 1.0, low_open=True)
        if not is_real(self.backoff_factor) or not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1); "
                             f"got {self.backoff_factor!r}")
        interval = check_int("growth_interval", self.growth_interval, 1)
        if interval >= 2 ** 63:
            raise ValueError(f"growth_interval must be a whole number >= 1 and below 2**63 "
                             f"(GradScaler hands it to a kernel as a 64-bit integer); "
                             f"got {interval}")
        # NumPy scalars (a sweep over np.arange) are kept as plain Python numbers
        for name, value in (("init_scale", float(v)), ("growth_factor", growth),
                            ("backoff_factor", float(self.backoff_factor)),
                            ("growth_interval", interval),
                            ("enabled", check_bool("enabled", self.enabled))):
            object.__setattr__(self, name, value)

    def make(self, device_type: str) -> "torch.amp.GradScaler":
        """A ``torch.amp.GradScaler(device_type, ...)`` with these settings."""
        return torch.amp.GradScaler(device_type, **self.as_dict())

    def apply_to(self, scaler: "torch.amp.GradScaler") -> None:
        """Change a live scaler's knobs between steps. A changed ``init_scale`` resets the current
        scale to it; an interval lowered below the good steps already counted makes the scale grow
        at the next good step (torch alone would stall). ``enabled`` cannot change on a live
        scaler (use ``Trainer.set_scaler``)."""
        if scaler.is_enabled() != self.enabled:
            raise ValueError(f"enabled cannot change on a live GradScaler (it is "
                             f"{scaler.is_enabled()}); build a new one with make()")
        scaler.set_growth_factor(float(self.growth_factor))
        scaler.set_backoff_factor(float(self.backoff_factor))
        scaler.set_growth_interval(self.growth_interval)
        # torch grows the scale when the count of good steps EQUALS the interval: lowering the
        # interval below the count would stall growth until the next overflow. Cap the count
        # (no sync), so the scale grows at the next good step instead.
        cap_growth_tracker(scaler, self.growth_interval)
        if float(self.init_scale) != current_init_scale(scaler):
            reset_scale(scaler, self.init_scale)

    def as_dict(self) -> dict:
        """Plain data (for checkpoints and JSON)."""
        return asdict(self)  # plain Python numbers: __post_init__ converted them
