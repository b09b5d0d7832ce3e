"""The two policies of a training step: ``Precision`` (what a precision name changes: autocast,
the TF32 switches, whether the GradScaler is enabled) and ``NonFinite`` (what a step with an
inf/NaN loss or gradient does). ``Trainer._step`` is written once against them, as nanoGPT writes
its loop once against ``ctx`` and ``GradScaler(enabled=...)``.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import List, Optional

import torch

from amp_lessons._compat import (FOUND_INF_READABLE, NonFiniteCheck, scale_tensor, step_skipping,
                                 supports_found_inf)
from amp_lessons._compat import found_inf as scaler_found_inf
from amp_lessons.numerics.precision import HALF_DTYPES, precision_settings
from amp_lessons.train.config import ScalerSettings
from amp_lessons.train.records import SKIPPED_BY_SCALER, SKIPPED_NONFINITE


class Precision:
    """A precision name made concrete for one device: ``autocast()`` for the forward pass,
    ``settings()`` for the whole step (TF32 off for fp32, on for tf32; fp16/bf16 leave the
    switches alone) and ``scaler``, a ``torch.amp.GradScaler`` enabled for fp16 only, exactly
    as nanoGPT builds it: ``GradScaler(enabled=(dtype == 'float16'))``."""

    def __init__(self, name: str, device: torch.device, settings: ScalerSettings):
        self.name, self.device = name, device
        self.dtype = HALF_DTYPES.get(name)  # the autocast dtype; None for fp32 and tf32
        self.scaler = self.make_scaler(settings)

    def make_scaler(self, settings: ScalerSettings) -> "torch.amp.GradScaler":
        """A GradScaler with ``settings``, enabled only under fp16."""
        if self.name != "fp16":
            settings = replace(settings, enabled=False)
        return settings.make(self.device.type)

    def autocast(self):
        """The forward pass's context: ``torch.autocast`` for fp16/bf16, a no-op otherwise."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def settings(self):
        """The whole step's context: the TF32 switches of fp32/tf32 (restored on exit)."""
        return precision_settings(self.name, self.device)

    def scale_used(self):
        """The loss scale of the step in progress (a 0-dim tensor copied before ``update``
        changes it in place), or 1.0 without an enabled scaler."""
        current = scale_tensor(self.scaler) if self.scaler.is_enabled() else None
        return current.clone() if current is not None else float(self.scaler.get_scale())


class NonFinite:
    """What a step does about inf/NaN: ``mode`` is "scaler" under an enabled GradScaler (it
    skips such steps itself), else ``TrainConfig.nonfinite``: "skip", "raise" or "ignore".

    ``check(loss)`` returns the step's flag (0-dim float32, 1.0 = non-finite) where the policy
    decides before the step ("skip", "raise"), else None; ``step(flag)`` steps the optimizer,
    skipping where the flag is set, and returns the flag of the step (GradScaler's under fp16,
    None under "ignore"). A fused optimizer skips inside its kernel (no host sync); others
    after one host read of the flag, as ``GradScaler.step`` does for them."""

    CAUSES = {"scaler": SKIPPED_BY_SCALER, "skip": SKIPPED_NONFINITE, "raise": None,
              "ignore": None}

    def __init__(self, mode: str, scaler, optimizer: torch.optim.Optimizer,
                 params: List[torch.Tensor], device: torch.device):
        self.mode = "scaler" if scaler.is_enabled() else mode
        self.cause = self.CAUSES[self.mode]
        self.scaler, self.optimizer, self.params, self.device = scaler, optimizer, params, device
        self.fused = supports_found_inf(optimizer)
        self._check = NonFiniteCheck()

    @property
    def can_skip(self) -> bool:
        """Whether an optimizer step may run with its update skipped (fused SGD then needs its
        momentum buffers primed: ``skipsafe.prime_momentum_buffers``)."""
        return self.mode in ("scaler", "skip")

    def _flag(self, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        tensors = [p.grad for p in self.params if p.grad is not None]
        if extra is not None:
            tensors.append(extra.float())
        return self._check(tensors, self.device)

    def check(self, loss: torch.Tensor) -> Optional[torch.Tensor]:
        """The flag of the loss and the gradients, where this policy decides before the step
        (and under GradScaler where this torch hides its flag: checked before any clipping)."""
        if self.mode in ("skip", "raise"):
            return self._flag(loss)
        return self._flag() if self.mode == "scaler" and not FOUND_INF_READABLE else None

    def step(self, found_inf: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The optimizer step, skipped where the step is non-finite; returns the step's flag."""
        opt = self.optimizer
        if self.mode == "scaler":
            self.scaler.step(opt)  # unscales if not done yet; skips on inf/NaN
            flag = scaler_found_inf(self.scaler, opt)
            if flag is None:
                flag = found_inf if found_inf is not None else self._flag()
            return flag
        if self.mode != "skip":
            opt.step()  # "ignore"; "raise" has raised before a non-finite step
        elif self.fused:
            step_skipping(opt, found_inf)
        elif not bool(found_inf.item()):
            opt.step()
        return found_inf
