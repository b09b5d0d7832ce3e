"""The trainer's settings: ``TrainConfig`` (what the loop does besides model, optimizer and data)
and ``ScalerSettings`` (GradScaler's knobs, lesson 03). Both are checked when built and immutable:
change one with ``dataclasses.replace(config, clip_norm=1.0)``, which checks again."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from amp_lessons._compat import cap_growth_tracker, reset_scale
from amp_lessons._compat import init_scale as current_init_scale
from amp_lessons.numerics.precision import PRECISION_ALIASES, PRECISIONS, normalize_precision
from amp_lessons.validate import (check_bool, check_choice, check_int, check_positive, check_real,
                                  check_seed, is_real)

EVAL_PRECISIONS = ("same",) + PRECISIONS
NONFINITE_POLICIES = ("skip", "raise", "ignore")


@dataclass(frozen=True)
class ScalerSettings:
    """GradScaler's four knobs (lesson 03) plus ``enabled``; the defaults are torch's.

    ``init_scale`` in float32's normal range; ``growth_factor`` in (1, 2**127]; ``backoff_factor`` in (0, 1);
    ``growth_interval`` a whole number >= 1. ``make(device_type)`` builds the GradScaler::

        scaler = ScalerSettings(init_scale=2.0**12).make("cuda")
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
        # (the scale is a float32 tensor: a factor past float32's range makes it inf at once)
        growth = check_real("growth_factor", self.growth_factor, 1.0, 2.0 ** 127, low_open=True)
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
        scale to it; an interval lowered below the good steps already counted makes the scale
        grow at the next good step (torch alone would wait for the next overflow). ``enabled``
        cannot change on a live scaler (``Trainer.set_scaler`` builds a new one)."""
        if scaler.is_enabled() != self.enabled:
            raise ValueError(f"enabled cannot change on a live GradScaler (it is "
                             f"{scaler.is_enabled()}); build a new one with make()")
        scaler.set_growth_factor(float(self.growth_factor))
        scaler.set_backoff_factor(float(self.backoff_factor))
        scaler.set_growth_interval(self.growth_interval)
        cap_growth_tracker(scaler, self.growth_interval)
        if float(self.init_scale) != current_init_scale(scaler):
            reset_scale(scaler, self.init_scale)

    def as_dict(self) -> dict:
        """Plain data (for checkpoints and JSON)."""
        return asdict(self)


@dataclass(frozen=True)
class TrainConfig:
    """Everything the loop does besides model, optimizer and data::

        config = TrainConfig(precision="fp16", clip_norm=1.0)
        trainer = Trainer(model, optimizer, config)

    ``precision``: fp32 (TF32 off) | tf32 | fp16 (alias amp: autocast + GradScaler) | bf16
    (autocast). ``scaler``: GradScaler's settings, used under fp16 only.
    ``clip_norm`` / ``clip_value``: clip by total norm / by value, after ``unscale_`` (one of
    them). ``accumulate``: micro-batches per optimizer step (each loss divided by their number).
    ``eval_precision``: "same" (training's autocast) or a precision name such as "fp32".
    ``channels_last``: the model and 4-D inputs in channels_last memory format.
    ``progress``: a progress bar in ``fit``. ``seed``: torch's generators are seeded with it when
    the Trainer is built (None leaves them alone).
    ``track_grad_norm``: record each step's unscaled gradient norm (``clip_norm`` records it
    anyway: ``clip_grad_norm_`` returns it). ``track_memory``: ``fit`` records each epoch's peak
    CUDA memory in its summary.

    ``nonfinite``: what a step with an inf/NaN loss or gradient does without a GradScaler (fp32,
    tf32, bf16; under fp16 GradScaler skips such steps, which is how its scale calibrates):

    - ``"skip"`` (default): the step is skipped as GradScaler skips one: a fused optimizer skips
      inside its kernel (no host sync), any other steps only after one host read of the flag,
      as ``GradScaler.step`` does for it. BatchNorm statistics are put back. Recorded with
      ``skipped=True`` and a ``skip_reason``.
    - ``"raise"``: ``NonFiniteError`` naming the step, before the optimizer steps (one host read
      a step): model, optimizer state and BatchNorm statistics stay as they were.
    - ``"ignore"``: train on, as plain PyTorch does: no check, no cost.

    ``skip_safe_batchnorm``: a skipped step also puts back the running statistics its forward
    moved (BatchNorm, InstanceNorm with running stats, spectral norm, quantization observers).
    """

    precision: str = "fp32"
    scaler: ScalerSettings = field(default_factory=ScalerSettings)
    clip_norm: Optional[float] = None
    clip_value: Optional[float] = None
    accumulate: int = 1
    skip_safe_batchnorm: bool = True
    eval_precision: str = "same"
    channels_last: bool = False
    progress: bool = True
    seed: Optional[int] = 0
    track_grad_norm: bool = False
    track_memory: bool = True
    nonfinite: str = "skip"

    def __post_init__(self):
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        if not isinstance(self.scaler, ScalerSettings):
            raise ValueError(f"scaler must be a ScalerSettings; got {type(self.scaler).__name__}")
        check_positive("clip_norm", self.clip_norm, optional=True)
        check_positive("clip_value", self.clip_value, optional=True)
        if self.clip_norm is not None and self.clip_value is not None:
            raise ValueError("clip_norm and clip_value: set at most one of them; got both")
        object.__setattr__(self, "accumulate", check_int("accumulate", self.accumulate, 1))
        name = self.eval_precision.strip().lower() if isinstance(self.eval_precision, str) else None
        name = PRECISION_ALIASES.get(name, name)
        if name not in EVAL_PRECISIONS:
            raise ValueError(f"eval_precision must be one of {', '.join(EVAL_PRECISIONS)}; "
                             f"got {self.eval_precision!r}")
        object.__setattr__(self, "eval_precision", name)
        for flag in ("skip_safe_batchnorm", "channels_last", "progress", "track_grad_norm",
                     "track_memory"):
            check_bool(flag, getattr(self, flag))
        object.__setattr__(self, "seed", check_seed("seed", self.seed, optional=True))
        if isinstance(self.nonfinite, str):  # spelled freely, as precision is: " Skip " is "skip"
            object.__setattr__(self, "nonfinite", self.nonfinite.strip().lower())
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)

    def as_dict(self) -> dict:
        """Plain data (for checkpoints and JSON)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "scaler"}
        out["scaler"] = self.scaler.as_dict()
        return out
