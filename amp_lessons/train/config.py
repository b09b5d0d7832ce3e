"""The trainer's configuration (``trainer.py`` re-exports ``TrainConfig`` and these names):
what the loop does besides model, optimizer and data, validated when built."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from amp_lessons.train.scaler import ScalerSettings
from amp_lessons.validate import check_bool, check_choice, check_int, check_positive, check_seed
from amp_lessons.numerics.precision import PRECISION_ALIASES, PRECISIONS, normalize_precision

EVAL_PRECISIONS = ("same",) + PRECISIONS
NONFINITE_POLICIES = ("skip", "raise", "ignore")
#: how a non-fused optimizer's step is skipped under nonfinite "skip"/"raise" (``TrainConfig``)
NONFUSED_SKIPS = ("auto", "copy", "sync")

@dataclass(frozen=True)
class TrainConfig:
    """Everything the loop does besides model, optimizer and data. Validated when built, and
    immutable: change a setting with ``dataclasses.replace(config, clip_norm=...)``, which
    validates the new config (a Trainer takes a new one through ``trainer.config = ...``).

    ``precision``: fp32 | tf32 | fp16 (alias amp) | bf16. ``scaler`` is used for fp16 only.
    ``clip_norm`` / ``clip_value``: clip by total norm / by value, after ``unscale_`` (one of them).
    ``accumulate``: micro-batches per optimizer step (the loss is divided by their number).
    ``eval_precision``: "same" (training's autocast) or a precision name such as "fp32".
    ``track_grad_norm`` / ``track_memory``: record the unscaled gradient norm (one foreach norm
    kernel a step; the stack and the final norm run when it is read) / the peak CUDA memory
    (the device's peak counter is reset at the first step after the last reading and read
    when a record is read: per window of steps, per step if each record's peak is read right
    after its step; ``StepRecord`` says more).
    ``track_time``: record each step's period, from the previous step's end to its own (the
    host's work between steps, such as loading the batch, counts, as in throughput); the first
    step, and the first after anything else the trainer did (evaluate, a checkpoint, capture, a
    config change, a new epoch, a step that raised or was cancelled), from its own start
    (``StepRecord.time_s``). Cost: one clock call a step, on a GPU one CUDA event recorded,
    reused from a pool once read; off, ``time_s`` reads None. Epoch times are wall clock.
    ``seed``: torch's generators are seeded with it when the Trainer is built (None: leave them).

    ``nonfinite``: what a step with a non-finite (inf/NaN) loss or gradient does when no
    GradScaler runs (fp32, tf32, bf16; under fp16 GradScaler always skips such steps, which is
    how its loss scale calibrates itself):

    - ``"skip"`` (default): the optimizer step, and the BatchNorm statistics of the step, are
      undone on the device without a host sync, exactly as GradScaler skips a step; the step
      is recorded with ``skipped=True`` and a ``skip_reason``. The default, because one bad batch
      otherwise turns every weight into NaN for good, silently. Cost: a check of the gradients
      per step; fused optimizers skip inside their kernel, others as ``nonfused_skip`` says.
    - ``"raise"``: stop with ``NonFiniteError`` naming the step; the model, optimizer state and
      BatchNorm statistics are left as they were before it. No per-step sync (but the one
      ``nonfused_skip="sync"`` asks for): the step and
      every later one are skipped on the device (as ``"skip"`` does) until the host sees the
      flag of a finished step, at the next ``train_step`` (on a CPU: at once), at the end of a
      ``fit`` epoch, or at ``trainer.wait()``; the step counter, history (and ``fit``'s place
      in the epoch) are then put back to the non-finite step.
    - ``"ignore"``: train on, as plain PyTorch does: no check, no cost.

    ``nonfused_skip``: how a non-fused optimizer (foreach or for-loop) skips a step under
    ``nonfinite`` "skip" or "raise" (fused ones skip inside their kernel; under fp16 GradScaler
    decides, with one host sync a step for a non-fused optimizer, as PyTorch's recipe does):

    - ``"auto"`` (default): ``"sync"`` on a CPU, where reading a value waits for nothing (there
      is no queue of device work to drain) and the copies only cost time (ResNet-18, batch 2,
      fp32, SGD with momentum, on this repository's 2-core CPU: the hand loop 32.3 ms a step,
      lean with ``"copy"`` +91%, with ``"sync"`` +6% inside a 6.3% noise floor;
      ``benchmarks/cpu_skip_cost.py``); ``"copy"`` on a GPU (or any other device with a
      queue).
    - ``"copy"``: parameters and optimizer state are copied aside before the step and
      put back on the device where it was non-finite: no host sync (it works inside
      ``capture``'s CUDA graph), but two extra copies of parameters and optimizer state in memory
      (the values and a buffer to restore through: for SGD with momentum four times the
      parameters' bytes) and a few multi-tensor kernels a step, which move those bytes about
      nine times: on ResNet-50 (bf16, batch 256, foreach SGD, H200) 35 more kernels and +1.4%
      of a 54.7 ms step (``results/trainer_overhead_h200_resnet50_bf16_after.json``);
    - ``"sync"``: the host reads the step's flag (one sync a step) and calls the optimizer only
      when it is finite: no memory, no copies. On the H200's 2 ms bf16 MLP step (foreach SGD) it
      cost +5.3% to +10.9% over the hand loop against the copy's +10.4% to +16.2%, in five runs
      (``benchmarks/NOTES.md``); on a GPU-bound step the sync leaves the GPU idle while the next
      kernels are launched: the same ResNet-50 step, +5.9% (58.29 against 54.73 ms a step
      with only 0.17 ms more kernel time: about 3.4 ms of idle GPU). Which costs less depends
      on the step, so on a GPU the default is the one without a host sync. ``capture`` needs
      ``"copy"``.

    An optimizer that has not made its state yet (its first step) takes the host's decision for
    that step whatever ``nonfused_skip`` says, and one that keeps state on another device takes
    it every step: on a GPU that is Adam and AdamW unless fused or ``capturable=True`` (their
    step counters live on the host), so for them ``"copy"`` costs no memory but syncs too. So
    does an optimizer whose state holds Python numbers (a third-party one counting steps in an
    ``int``); one that replaces its state tensors each step (``state["buf"] = beta * buf + g``)
    is undone on the device; one whose step makes new state or changes its param groups' values
    has the host read that step's flag and put the old ones back. A stateless one (SGD without
    momentum) copies its parameters only.

    With ``track_grad_norm`` the check reads the per-parameter gradient norms: a gradient whose
    norm overflows float32 (elements beyond about 1e19) counts as non-finite and its step is
    skipped although every element is finite (its reported norm would be inf anyway).

    ``skip_safe_batchnorm``: under fp16, a step GradScaler skips also puts back the running
    statistics its forward moved (BatchNorm, InstanceNorm with ``track_running_stats``,
    spectral normalization's vectors, quantization observers: ``_skipsafe.stateful_modules``);
    ``nonfinite`` "skip" and "raise" always do. Buffers a custom module writes itself are not
    guarded.
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
    track_grad_norm: bool = True
    track_memory: bool = True
    nonfinite: str = "skip"
    track_time: bool = True
    nonfused_skip: str = "auto"

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
                     "track_memory", "track_time"):
            check_bool(flag, getattr(self, flag))
        object.__setattr__(self, "seed", check_seed("seed", self.seed, optional=True))
        for name, choices in (("nonfinite", NONFINITE_POLICIES), ("nonfused_skip", NONFUSED_SKIPS)):
            value = getattr(self, name)  # spelled freely, as precision is: " Skip " is "skip"
            if isinstance(value, str):
                object.__setattr__(self, name, value.strip().lower())
            check_choice(name, getattr(self, name), choices)

    def as_dict(self) -> dict:
        """Plain data (for checkpoints and JSON)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "scaler"}
        out["scaler"] = self.scaler.as_dict()
        return out
