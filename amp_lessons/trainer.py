"""The shared training loop of the course (introduced in lesson 02, used by lessons 03-05).

One loop for every precision, in the order of PyTorch's AMP examples page::

    for each micro-batch:  autocast forward, loss / accumulate, scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # true gradients from here on
    clip (by norm or by value)          # optional, always AFTER unscale_
    scaler.step(optimizer); scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()                    # only when the optimizer really stepped

Precisions: ``fp32`` (TF32 off), ``tf32`` (TF32 matmuls and convolutions on CUDA), ``fp16``
(autocast + GradScaler; ``amp`` is an alias) and ``bf16`` (autocast, no scaler).

Cheap on purpose: ``Trainer.train_step`` never waits for the GPU unless a scheduler has to know
whether the step was skipped. Loss, scale, gradient norm, the skipped flag and the step time are
kept in each ``StepRecord`` as device tensors (or CUDA events) and turned into Python numbers the
first time they are read; ``History.columns()`` reads them all with one copy per field.
Turn off what you do not need with ``TrainConfig(track_grad_norm=False, track_memory=False)``.

Skip-safe BatchNorm: when GradScaler skips a step (inf/NaN gradients), BatchNorm running statistics
are put back to their values before that step, without a host sync (``torch.where`` on a flat
copy), so a skipped step leaves the whole model exactly as it was.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
PRECISION_ALIASES = {"amp": "fp16"}
EVAL_PRECISIONS = ("same",) + PRECISIONS
CHECKPOINT_FORMAT = "amp-lessons-trainer/1"

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}

Device = Union[str, int, torch.device, None]


# --- precision -----------------------------------------------------------------------------------

def _as_device(device: Device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def normalize_precision(precision: str) -> str:
    """``"AMP"`` -> ``"fp16"``, ``" bf16 "`` -> ``"bf16"``; ValueError for anything not in PRECISIONS."""
    if not isinstance(precision, str):
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (or 'amp' for fp16); "
                         f"got {precision!r}")
    name = precision.strip().lower()
    name = PRECISION_ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (or 'amp' for fp16); "
                         f"got {precision!r}")
    return name


@lru_cache(maxsize=None)
def _fp16_problem(device_type: str) -> Optional[str]:
    """Why fp16 autocast + GradScaler cannot run on this device type, or None when it can."""
    if not hasattr(torch.amp, "GradScaler"):
        return "this torch has no torch.amp.GradScaler (needs torch >= 2.3)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unsupported dtype only warns and disables autocast
            a = torch.ones(2, 2, device=device_type)
            with torch.autocast(device_type=device_type, dtype=torch.float16):
                out = a @ a
            if out.dtype != torch.float16:
                return f"torch {torch.__version__} has no float16 autocast on {device_type}"
            grads = [torch.ones(2, device=device_type)]
            found = torch.zeros((), device=device_type)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, torch.ones((), device=device_type))
            torch.amp.GradScaler(device_type)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot run here"
        return f"torch {torch.__version__} cannot run fp16 AMP on {device_type}: {exc}"
    return None


def _cuda_bf16_native() -> bool:
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.3 has no including_emulation
        return torch.cuda.get_device_capability() >= (8, 0)


def check_precision(precision: str, device: Device = None) -> str:
    """Normalise ``precision`` (``"amp"`` -> ``"fp16"``) and make sure it can run on ``device``.

    Raises ValueError naming the setting and why: an unknown name, a CUDA device without CUDA,
    fp16 where this torch cannot autocast/scale fp16, bf16 on a GPU without native bf16 (a T4:
    torch would emulate it, slowly). ``tf32`` runs everywhere; off CUDA it is plain fp32.
    """
    name = normalize_precision(precision)
    dev = _as_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device must be an available device; got {dev} but CUDA is not available")
    if name == "fp16":
        problem = _fp16_problem(dev.type)
        if problem:
            raise ValueError(f"precision 'fp16' cannot run on {dev.type}: {problem}; "
                             f"use fp32 or bf16")
    if name == "bf16" and dev.type == "cuda" and not _cuda_bf16_native():
        gpu = torch.cuda.get_device_name(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        raise ValueError(f"precision 'bf16' needs a GPU with native bfloat16 (compute capability "
                         f">= 8.0); {gpu} has {major}.{minor}, where torch would only emulate it. "
                         f"Use fp16 (autocast + GradScaler) instead")
    return name


def autocast_for(precision: str, device_type: str):
    """The autocast context of a precision: ``torch.autocast`` for fp16/bf16, a no-op otherwise."""
    name = normalize_precision(precision)
    if name in _HALF:
        return torch.autocast(device_type=device_type, dtype=_HALF[name])
    return contextlib.nullcontext()


def _tf32_api() -> str:
    """``"new"`` where torch has the fp32_precision switches (torch >= 2.9), else ``"legacy"``."""
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018 - probing
        torch.backends.cudnn.conv.fp32_precision  # noqa: B018
        return "new"
    except (AttributeError, RuntimeError):
        return "legacy"


def _get_tf32() -> Tuple[str, Any, Any]:
    if _tf32_api() == "new":
        return ("new", torch.backends.cuda.matmul.fp32_precision,
                torch.backends.cudnn.conv.fp32_precision)
    return ("legacy", torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _set_tf32(state: Tuple[str, Any, Any]) -> None:
    api, matmul, conv = state
    if api == "new":
        torch.backends.cuda.matmul.fp32_precision = matmul
        torch.backends.cudnn.conv.fp32_precision = conv
    else:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = conv


def _tf32_target(on: bool) -> Tuple[str, Any, Any]:
    if _tf32_api() == "new":
        value = "tf32" if on else "ieee"
        return ("new", value, value)
    return ("legacy", on, on)


@contextlib.contextmanager
def precision_settings(precision: str, device: Device = None):
    """Within the block, TF32 is off for ``fp32`` and on for ``tf32`` (matmuls and cuDNN
    convolutions); fp16/bf16 leave the switches as they are. The previous settings come back on
    exit. Uses ``fp32_precision`` where torch has it (>= 2.9), else the ``allow_tf32`` flags, so no
    deprecation warning is triggered.
    """
    name = normalize_precision(precision)
    if name not in ("fp32", "tf32"):
        yield
        return
    before = _get_tf32()
    target = _tf32_target(name == "tf32")
    if before == target:
        yield
        return
    _set_tf32(target)
    try:
        yield
    finally:
        _set_tf32(before)


# --- scaler settings -----------------------------------------------------------------------------

def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        if not _is_real(self.init_scale) or self.init_scale <= 0:
            raise ValueError(f"init_scale must be a finite number > 0; got {self.init_scale!r}")
        if not _is_real(self.growth_factor) or self.growth_factor <= 1:
            raise ValueError(f"growth_factor must be a finite number > 1; got {self.growth_factor!r}")
        if not _is_real(self.backoff_factor) or not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in the open interval (0, 1); "
                             f"got {self.backoff_factor!r}")
        if (not isinstance(self.growth_interval, int) or isinstance(self.growth_interval, bool)
                or self.growth_interval < 1):
            raise ValueError(f"growth_interval must be a whole number >= 1; "
                             f"got {self.growth_interval!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be True or False; got {self.enabled!r}")

    def make(self, device_type: str) -> "torch.amp.GradScaler":
        """A ``torch.amp.GradScaler(device_type, ...)`` with these settings."""
        return torch.amp.GradScaler(device_type, init_scale=float(self.init_scale),
                                    growth_factor=float(self.growth_factor),
                                    backoff_factor=float(self.backoff_factor),
                                    growth_interval=self.growth_interval, enabled=self.enabled)

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
        tracker = getattr(scaler, "_growth_tracker", None)
        if tracker is not None:
            # torch grows the scale when the count of good steps EQUALS the interval: lowering the
            # interval below the count would stall growth until the next overflow. Cap the count
            # (no sync), so the scale grows at the next good step instead.
            tracker.clamp_(max=self.growth_interval - 1)
        if float(self.init_scale) != float(scaler._init_scale):
            scaler._init_scale = float(self.init_scale)  # used when the scale tensor is made
            if self.enabled and scaler._get_scale_async() is not None:
                scaler.update(new_scale=float(self.init_scale))

    def as_dict(self) -> dict:
        """Plain data (for checkpoints and JSON)."""
        return dict(init_scale=float(self.init_scale), growth_factor=float(self.growth_factor),
                    backoff_factor=float(self.backoff_factor),
                    growth_interval=self.growth_interval, enabled=self.enabled)


# --- configuration -------------------------------------------------------------------------------

def _optional_positive(name: str, value) -> None:
    if value is not None and (not _is_real(value) or value <= 0):
        raise ValueError(f"{name} must be None or a finite number > 0; got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


@dataclass
class TrainConfig:
    """Everything the loop does besides model, optimizer and data. Validated when built.

    ``precision``: fp32 | tf32 | fp16 (alias amp) | bf16. ``scaler`` is used for fp16 only.
    ``clip_norm`` / ``clip_value``: clip by total norm / by value, after ``unscale_`` (one of them).
    ``accumulate``: micro-batches per optimizer step (the loss is divided by their number).
    ``eval_precision``: "same" (training's autocast) or a precision name such as "fp32".
    ``track_grad_norm`` / ``track_memory``: record the unscaled gradient norm / the step's peak
    CUDA memory (``train_step`` then resets the device's peak counter at its start).
    ``seed``: torch's generators are seeded with it when the Trainer is built (None: leave them).
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

    def __post_init__(self):
        self.precision = normalize_precision(self.precision)
        if not isinstance(self.scaler, ScalerSettings):
            raise ValueError(f"scaler must be a ScalerSettings; got {type(self.scaler).__name__}")
        _optional_positive("clip_norm", self.clip_norm)
        _optional_positive("clip_value", self.clip_value)
        if self.clip_norm is not None and self.clip_value is not None:
            raise ValueError("clip_norm and clip_value: set at most one of them; got both")
        if (not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool)
                or self.accumulate < 1):
            raise ValueError(f"accumulate must be a whole number >= 1; got {self.accumulate!r}")
        name = self.eval_precision.strip().lower() if isinstance(self.eval_precision, str) else None
        name = PRECISION_ALIASES.get(name, name)
        if name not in EVAL_PRECISIONS:
            raise ValueError(f"eval_precision must be one of {', '.join(EVAL_PRECISIONS)}; "
                             f"got {self.eval_precision!r}")
        self.eval_precision = name
        for flag in ("skip_safe_batchnorm", "channels_last", "progress", "track_grad_norm",
                     "track_memory"):
            _check_bool(flag, getattr(self, flag))
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or self.seed < 0):
            raise ValueError(f"seed must be None or a whole number >= 0; got {self.seed!r}")

    def as_dict(self) -> dict:
        """Plain data (for checkpoints and JSON)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "scaler"}
        out["scaler"] = self.scaler.as_dict()
        return out


# --- history -------------------------------------------------------------------------------------

class _Lazy:
    """A StepRecord field that may hold a device tensor (or a pair of CUDA events) until first read.

    Reading it converts to a Python number once and caches it; the trainer never waits for the GPU.
    """

    def __init__(self, kind: str):
        self.kind = kind  # "float" | "bool" | "events"

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__.get(self.slot)
        if isinstance(value, torch.Tensor):
            value = _to_python(value.item(), self.kind)
            obj.__dict__[self.slot] = value
        elif isinstance(value, tuple):  # (start, end) CUDA events
            value[1].synchronize()
            value = value[0].elapsed_time(value[1]) / 1e3
            obj.__dict__[self.slot] = value
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value

    def pending(self, obj):
        """The raw tensor if not yet materialised, else None."""
        value = obj.__dict__.get(self.slot)
        return value if isinstance(value, torch.Tensor) else None


def _to_python(value, kind: str):
    return bool(value) if kind == "bool" else float(value)


@dataclass
class StepRecord:
    """One optimizer step. Numbers read as Python values (materialised lazily from the device).

    ``loss``: mean training loss over the step's micro-batches; ``scale``: the loss scale used for
    this step's backward (1.0 without a scaler); ``skipped``: the scaler skipped the optimizer step
    (inf/NaN gradients); ``grad_norm``: total 2-norm of the unscaled gradients before clipping
    (None when not tracked); ``lr``: learning rate of the first parameter group during the step;
    ``time_s``: the step's duration (CUDA events on a GPU, wall clock on a CPU);
    ``peak_memory_bytes``: the step's peak allocated CUDA memory (None on a CPU).
    """

    step: int
    epoch: int
    loss: float = _Lazy("float")
    scale: float = _Lazy("float")
    skipped: bool = _Lazy("bool")
    grad_norm: Optional[float] = _Lazy("float")
    lr: Optional[float] = _Lazy("float")
    time_s: Optional[float] = _Lazy("events")
    peak_memory_bytes: Optional[int] = None


STEP_FIELDS = ("step", "epoch", "loss", "scale", "skipped", "grad_norm", "lr", "time_s",
               "peak_memory_bytes")
_LAZY_FIELDS = ("loss", "scale", "skipped", "grad_norm", "lr")


class History(list):
    """The StepRecords of a run, in order, plus ``epochs``: one summary dict per finished epoch
    (epoch, steps, time_s, peak_memory_bytes, train_loss, skipped, and test_loss/test_accuracy
    when an evaluation loader was given)."""

    def __init__(self, records: Iterable[StepRecord] = (), epochs: Iterable[dict] = ()):
        super().__init__(records)
        self.epochs: List[dict] = list(epochs)

    def materialize(self) -> "History":
        """Read every pending device value with one device-to-host copy per field (and the step
        times of CUDA events, releasing the events)."""
        timed = [r for r in self if isinstance(r.__dict__.get("_time_s"), tuple)]
        if timed:
            timed[-1].__dict__["_time_s"][1].synchronize()
            for r in timed:
                start, end = r.__dict__["_time_s"]
                r.time_s = start.elapsed_time(end) / 1e3
        for name in _LAZY_FIELDS:
            descriptor = StepRecord.__dict__[name]
            pending = [(r, descriptor.pending(r)) for r in self]
            pending = [(r, t) for r, t in pending if t is not None]
            by_device: Dict[torch.device, list] = {}
            for r, t in pending:
                by_device.setdefault(t.device, []).append((r, t))
            for items in by_device.values():
                values = torch.stack([t.reshape(()).float() for _, t in items]).tolist()
                for (r, _), v in zip(items, values):
                    setattr(r, name, _to_python(v, descriptor.kind))
        return self

    def columns(self) -> Dict[str, list]:
        """Plain data for plots: ``{field: [value per step]}`` for every StepRecord field."""
        self.materialize()
        return {name: [getattr(r, name) for r in self] for name in STEP_FIELDS}

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps the scaler skipped."""
        self.materialize()
        return sum(1 for r in self if r.skipped)

    @property
    def skipped_step_numbers(self) -> List[int]:
        """The ``step`` numbers of the skipped steps."""
        self.materialize()
        return [r.step for r in self if r.skipped]

    def to_json(self, path: Union[str, Path, None] = None, indent: Optional[int] = None) -> str:
        """Steps and epochs as strict JSON (non-finite numbers become null); written to ``path``
        when given."""
        text = json.dumps(_json_safe({"steps": self.columns(), "epochs": self.epochs}),
                          indent=indent)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_columns(cls, columns: Dict[str, list], epochs: Iterable[dict] = ()) -> "History":
        """Rebuild a History from ``columns()`` output (used when loading a checkpoint)."""
        n = len(columns.get("step", []))
        records = [StepRecord(**{name: columns[name][i] for name in STEP_FIELDS})
                   for i in range(n)]
        return cls(records, [dict(e) for e in epochs])


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


# --- hooks ---------------------------------------------------------------------------------------

class Hooks:
    """Observe (or meddle with) each step without copying the loop. Override any of these; the
    trainer calls them in this order every optimizer step."""

    def after_backward(self, trainer: "Trainer", micro_step: int) -> None:
        """After one micro-batch's backward: gradients are still SCALED (inject inf/NaN here)."""

    def after_unscale(self, trainer: "Trainer") -> None:
        """After ``unscale_``: the true gradients, before clipping (histograms go here)."""

    def after_step(self, trainer: "Trainer", record: StepRecord) -> None:
        """After the optimizer step, scaler update and scheduler, with the step's record."""


def _overrides(hooks: Sequence[Hooks], name: str) -> list:
    base = getattr(Hooks, name)
    return [h for h in hooks if getattr(type(h), name, base) is not base]


# --- skip-safe BatchNorm -------------------------------------------------------------------------

class _BatchNormGuard:
    """Snapshot BatchNorm buffers before a step; put them back if the step was skipped.

    No host sync: the buffers are gathered into one flat tensor per (device, dtype) and
    ``torch.where(skipped, saved, current)`` is copied back, a handful of kernels per step. The
    trainer calls ``restore_if`` before ``scaler.step``, whose host sync would otherwise leave the
    GPU idle while these kernels are launched. The snapshot is taken at every step: tensor version
    counters cannot tell whether something changed the buffers in between (BatchNorm's own
    kernels and ``.data`` writes leave ``running_mean``'s counter alone).
    """

    _NAMES = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules()
                        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self._buffers: list = []
        self._groups: list = []  # (views, saved_flat, current_flat, current_splits)

    def _current(self) -> list:
        return [b for m in self.modules for b in (m._buffers.get(k) for k in self._NAMES)
                if b is not None]

    def _rebuild(self, buffers: list) -> None:
        self._buffers = buffers
        grouped: Dict[tuple, list] = {}
        for b in buffers:
            grouped.setdefault((b.device, b.dtype), []).append(b)
        self._groups = []
        for bufs in grouped.values():
            views = [b.view(-1) for b in bufs]
            total = sum(v.numel() for v in views)
            saved = torch.empty(total, dtype=bufs[0].dtype, device=bufs[0].device)
            current = torch.empty_like(saved)
            splits = current.split([v.numel() for v in views])
            self._groups.append((views, saved, current, splits))

    def snapshot(self) -> None:
        """Copy the buffers aside (call before the step's first forward)."""
        if not self.modules:
            return
        buffers = self._current()
        if len(buffers) != len(self._buffers) or any(
                a is not b for a, b in zip(buffers, self._buffers)):
            self._rebuild(buffers)
        for views, saved, _, _ in self._groups:
            torch.cat(views, out=saved)

    def restore_if(self, skipped: torch.Tensor) -> None:
        """Where ``skipped`` (a 0-dim tensor, nonzero = skipped) is set, put the snapshot back."""
        if not self.modules or not self._groups:
            return
        flag = skipped > 0
        for views, saved, current, splits in self._groups:
            torch.cat(views, out=current)
            torch.where(flag.to(current.device, non_blocking=True), saved, current, out=current)
            torch._foreach_copy_(views, splits)


# --- checkpoint files ----------------------------------------------------------------------------

def atomic_save(obj: Any, path: Union[str, Path]) -> Path:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``.

    A failure at any point leaves the previous file at ``path`` untouched and no temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def rng_state() -> dict:
    """Python's, NumPy's and torch's (CPU and initialised CUDA) generator states, as tensors and
    plain numbers only, so ``torch.load(weights_only=True)`` reads them."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state()`` returned."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [s.cpu() for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


# --- the trainer ---------------------------------------------------------------------------------

def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_loader_epoch(loader, epoch: int) -> None:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)


def _total_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    norms = torch._foreach_norm(grads)
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def prime_momentum_buffers(optimizer: torch.optim.Optimizer) -> int:
    """Give each SGD parameter without one a zero momentum buffer; return how many were made.

    Works around a PyTorch bug (seen on 2.11 CUDA and 2.14 CPU): fused SGD allocates its momentum
    buffers uninitialised on the first step, and when GradScaler skips that step the kernel never
    writes them, so the next step reads garbage (NaN parameters on a GPU). A zero buffer gives the
    same first update as SGD's own ``buf = grad`` when ``dampening == 0``, so priming changes no
    result; groups with ``momentum == 0`` need no buffer and are left alone.

    Raises ``ValueError`` for a non-SGD optimizer, or a group with ``dampening != 0`` (priming
    would change its first update; such a group must not be fused under GradScaler).
    """
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"optimizer must be a torch.optim.SGD; got {type(optimizer).__name__}")
    made = 0
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        if group.get("dampening", 0):
            raise ValueError(f"dampening must be 0 to prime momentum buffers (a zero buffer "
                             f"would change the first update); got {group['dampening']!r}")
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made += 1
    return made


def _fused_sgd_groups(optimizer: torch.optim.Optimizer) -> list:
    """The param groups of a fused SGD that keep momentum buffers."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [g for g in optimizer.param_groups if g.get("fused") and g.get("momentum")]


class Trainer:
    """Train ``model`` with ``optimizer`` under ``config`` (see the module docstring for the order).

    ``device``: where batches go (the model is moved there); None keeps the model's device.
    ``scheduler`` steps once per optimizer step that was not skipped. ``hooks``: Hooks instances.
    Attributes: model, optimizer, scheduler, scaler (a GradScaler, enabled only for fp16), config,
    history (a History), step (optimizer steps taken, skipped ones included), epoch (finished
    epochs). Under fp16, a fused SGD gets zero momentum buffers before its first step (see
    ``prime_momentum_buffers``; param groups added later are not primed).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: Optional[TrainConfig] = None, device: Device = None, scheduler=None,
                 loss_fn: Callable = F.cross_entropy, hooks: Sequence[Hooks] = ()):
        self.config = config if config is not None else TrainConfig()
        if not isinstance(self.config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig; got {type(self.config).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; "
                             f"got {type(optimizer).__name__}")
        self.device = _as_device(device) if device is not None else _model_device(model)
        self.config.precision = check_precision(self.config.precision, self.device)
        if self.config.eval_precision != "same":
            check_precision(self.config.eval_precision, self.device)
        if device is not None:
            model.to(self.device)
        if self.config.channels_last:
            model.to(memory_format=torch.channels_last)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.config.precision == "fp16" and self.config.scaler.enabled:
            half = [p for p in self._params if p.dtype == torch.float16]
            if half:
                raise ValueError("model parameters must stay float32 under fp16 AMP (autocast "
                                 "casts per operation, GradScaler cannot unscale float16 "
                                 "gradients); got float16 parameters: was .half() called on "
                                 "the model?")
        self.model, self.optimizer, self.scheduler, self.loss_fn = model, optimizer, scheduler, loss_fn
        self.hooks = list(hooks)
        for h in self.hooks:
            if not isinstance(h, Hooks):
                raise ValueError(f"hooks must be Hooks instances; got {type(h).__name__}")
        self._after_backward = _overrides(self.hooks, "after_backward")
        self._after_unscale = _overrides(self.hooks, "after_unscale")
        self._after_step = _overrides(self.hooks, "after_step")
        # unscale_ explicitly only when something reads the gradients between backward and step;
        # otherwise scaler.step unscales (fused optimizers then do it inside their kernel)
        self._unscale_first = bool(self.config.clip_norm is not None
                                   or self.config.clip_value is not None
                                   or self.config.track_grad_norm or self._after_unscale)
        self.scaler = self._make_scaler(self.config.scaler)
        self._prime_fused_sgd()
        self._bn_guard = _BatchNormGuard(model)
        self.history = History()
        self.step = 0
        self.epoch = 0
        self._batches_done = 0  # micro-batches consumed in the current epoch (for exact resume)
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)

    # -- pieces ---------------------------------------------------------------------------------

    def _prime_fused_sgd(self) -> None:
        """Under fp16 (GradScaler), give fused SGD zero momentum buffers (see
        ``prime_momentum_buffers``); refuse a damped fused group, which priming cannot fix."""
        groups = _fused_sgd_groups(self.optimizer)
        if not groups or self.config.precision != "fp16":
            return
        damped = [g["dampening"] for g in groups if g.get("dampening", 0)]
        if damped:
            raise ValueError(f"dampening must be 0 for fused SGD under fp16 with GradScaler (its "
                             f"momentum is corrupted by a skipped first step, and only a zero "
                             f"buffer with dampening 0 fixes that); got {damped[0]!r}: use "
                             f"foreach=True or dampening=0")
        prime_momentum_buffers(self.optimizer)

    def _make_scaler(self, settings: ScalerSettings):
        if self.config.precision != "fp16":
            settings = replace(settings, enabled=False)
        return settings.make(self.device.type)

    def set_scaler(self, settings: ScalerSettings) -> None:
        """Change the scaler's knobs mid-run (lesson 03's widgets). Switching ``enabled`` builds a
        new GradScaler (its scale starts again at ``init_scale``)."""
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"settings must be a ScalerSettings; got {type(settings).__name__}")
        self.config.scaler = settings
        if self.config.precision != "fp16":
            return
        if self.scaler.is_enabled() == settings.enabled:
            settings.apply_to(self.scaler)
        else:
            self.scaler = settings.make(self.device.type)

    def _to_device(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.config.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def _skip_flag(self, grad_norm: Optional[torch.Tensor]) -> torch.Tensor:
        """Whether this step is (or was) skipped, as a 0-dim tensor (> 0 = skipped), no sync."""
        found_inf = self._found_inf()
        if found_inf is None:  # private API gone: a non-finite norm means a skip
            norm = grad_norm if grad_norm is not None else _total_norm(
                [p.grad for p in self._params if p.grad is not None])
            found_inf = (~torch.isfinite(norm)).float()
        return found_inf

    def _found_inf(self) -> Optional[torch.Tensor]:
        """The scaler's inf/NaN flag for this step (a 0-dim tensor, > 0 = skipped), no sync."""
        try:
            per_device = self.scaler._found_inf_per_device(self.optimizer)
        except (AttributeError, KeyError):
            return None
        values = list(per_device.values())
        if not values:
            return None
        total = values[0]
        for v in values[1:]:
            total = total + v.to(total.device)
        return total

    # -- one optimizer step ---------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> StepRecord:
        """One optimizer step over ``micro_batches`` (a list of ``(x, y)``; their number is
        normally ``config.accumulate``: the loss of each is divided by that number).

        Never waits for the GPU itself, except to decide whether a scheduler may step after an
        fp16 step. With ``track_memory`` on CUDA it resets the device's peak-memory counter first,
        so ``peak_memory_bytes`` is this step's own peak.

        Cost beyond a hand-written loop (lesson 04 measures it): two CUDA events; one detach per
        micro-batch; with ``track_grad_norm`` a foreach norm over the gradients (and an explicit
        ``unscale_``, which ``scaler.step`` would do anyway); for fp16 a copy of the 0-dim scale;
        with skip-safe BatchNorm about ten small kernels over one flat copy of the BN buffers, the
        restore queued before ``scaler.step`` (for non-fused optimizers through an explicit ``unscale_``,
        which ``scaler.step`` would do anyway), so GradScaler's host sync does not leave the GPU
        idle while they are launched; with ``track_memory`` two allocator queries. No
        ``.item()``, no host sync of its own.
        ``TrainConfig(track_grad_norm=False, track_memory=False, skip_safe_batchnorm=False)``
        leaves only the events, the detach and the scale copy.
        """
        n = len(micro_batches)
        if n < 1:
            raise ValueError("micro_batches must hold at least one (x, y) batch; got none")
        cfg, model, opt, scaler = self.config, self.model, self.optimizer, self.scaler
        scaling = scaler.is_enabled()
        cuda = self.device.type == "cuda"
        track_memory = cuda and cfg.track_memory
        if not model.training:
            model.train()
        if track_memory:
            torch.cuda.reset_peak_memory_stats(self.device)
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        guard = self._bn_guard if scaling and cfg.skip_safe_batchnorm else None

        with precision_settings(cfg.precision, self.device):
            if guard is not None:
                guard.snapshot()
            loss_sum = None
            for i, (x, y) in enumerate(micro_batches):
                x, y = self._to_device(x, y)
                with autocast_for(cfg.precision, self.device.type):
                    loss = self.loss_fn(model(x), y)
                    if n > 1:
                        loss = loss / n
                scaler.scale(loss).backward()
                d = loss.detach()
                loss_sum = d if loss_sum is None else loss_sum + d
                for h in self._after_backward:
                    h.after_backward(self, i)

            # with skip-safe BatchNorm and an optimizer that GradScaler steps from the host
            # (everything but fused), unscale_ here, as scaler.step would, so the skip flag is
            # known and the BN restore is queued before step()'s host sync, not after it
            early_guard = guard is not None and not getattr(opt, "_step_supports_amp_scaling", False)
            if self._unscale_first or early_guard:  # true gradients from here on
                scaler.unscale_(opt)
            for h in self._after_unscale:
                h.after_unscale(self)
            grad_norm = None
            if cfg.clip_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(self._params, cfg.clip_norm)
            else:
                if cfg.track_grad_norm:
                    grads = [p.grad for p in self._params if p.grad is not None]
                    grad_norm = _total_norm(grads) if grads else None
                if cfg.clip_value is not None:
                    if scaling and grad_norm is None and self._found_inf() is None:
                        # private API gone: the fallback flag must see the gradients unclipped
                        grad_norm = _total_norm([p.grad for p in self._params
                                                 if p.grad is not None])
                    torch.nn.utils.clip_grad_value_(self._params, cfg.clip_value)
            lr = opt.param_groups[0]["lr"]
            found_inf, scale = None, 1.0
            if scaling:  # the scale this step used, before update() changes it in place
                current = getattr(scaler, "_scale", None)
                scale = (current.detach().clone() if current is not None
                         else torch.tensor(scaler.get_scale()))
            if early_guard:
                found_inf = self._skip_flag(grad_norm)
                guard.restore_if(found_inf)

            scaler.step(opt)  # unscales here if not done above; skips on inf/NaN
            if scaling and found_inf is None:
                found_inf = self._skip_flag(grad_norm)  # set by unscale_/step, cleared by update()
            scaler.update()
            if guard is not None and not early_guard:
                guard.restore_if(found_inf)
            opt.zero_grad(set_to_none=True)

        if self.scheduler is not None:
            if found_inf is None or not bool(found_inf.item()):  # the one sync, only with both
                self.scheduler.step()

        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            elapsed = (start, end)
        else:
            elapsed = time.perf_counter() - t0
        if loss_sum.dtype != torch.float32:
            loss_sum = loss_sum.float()
        if grad_norm is not None and grad_norm.dtype != torch.float32:
            grad_norm = grad_norm.float()
        record = StepRecord(step=self.step, epoch=self.epoch, loss=loss_sum, scale=scale,
                            skipped=found_inf if found_inf is not None else False,
                            grad_norm=grad_norm, lr=lr, time_s=elapsed,
                            peak_memory_bytes=(torch.cuda.memory_stats_as_nested_dict(self.device)
                                               ["allocated_bytes"]["all"]["peak"]
                                               if track_memory else None))
        self.step += 1
        self.history.append(record)
        for h in self._after_step:
            h.after_step(self, record)
        return record

    # -- epochs ---------------------------------------------------------------------------------

    def fit(self, loader, epochs: int = 1, max_steps: Optional[int] = None,
            eval_loader=None) -> History:
        """Train for ``epochs`` more epochs (a resumed, half-done epoch counts as one), grouping
        ``config.accumulate`` batches per optimizer step; stop early after ``max_steps`` steps of
        this call. Calls ``loader.set_epoch(epoch)`` where it exists and skips the batches a
        resumed epoch already used. An epoch's last, shorter group is one step with its loss
        divided by its own size. With ``eval_loader``, each finished epoch is evaluated.
        Returns ``self.history``; ``history.epochs`` gets one summary per finished epoch.
        """
        if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
            raise ValueError(f"epochs must be a whole number >= 1; got {epochs!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool)
                                      or max_steps < 1):
            raise ValueError(f"max_steps must be None or a whole number >= 1; got {max_steps!r}")
        from tqdm.auto import tqdm

        acc, taken = self.config.accumulate, 0
        for _ in range(epochs):
            _set_loader_epoch(loader, self.epoch)
            skip = self._batches_done
            try:
                remaining = max(0, len(loader) - skip)
                total = -(-remaining // acc)
            except TypeError:
                total = None
            _sync(self.device)
            t0, first = time.perf_counter(), len(self.history)
            bar = tqdm(total=total, desc=f"epoch {self.epoch + 1}", leave=False,
                       disable=not self.config.progress)
            every = max(1, (total or 50) // 10)
            group, stopped = [], False
            iterator = iter(loader)
            for _ in range(skip):
                if next(iterator, None) is None:
                    break
            for batch in iterator:
                group.append(batch)
                if len(group) < acc:
                    continue
                self._run(group, bar, every)
                group, taken = [], taken + 1
                if max_steps is not None and taken >= max_steps:
                    stopped = total is None or self._batches_done < len(loader)
                    break
            if group and not stopped:
                self._run(group, bar, every)
                taken += 1
            bar.close()
            if stopped:
                return self.history
            self._end_epoch(first, t0, eval_loader)
            if max_steps is not None and taken >= max_steps:
                break
        return self.history

    def _run(self, group, bar, every) -> None:
        record = self.train_step(group)
        self._batches_done += len(group)
        bar.update(1)
        if not bar.disable and bar.n % every == 0:
            bar.set_postfix(loss=f"{record.loss:.4f}", scale=f"{record.scale:g}")

    def _end_epoch(self, first: int, t0: float, eval_loader) -> None:
        _sync(self.device)
        seconds = time.perf_counter() - t0
        steps = self.history[first:]
        self.history.materialize()
        peaks = [r.peak_memory_bytes for r in steps if r.peak_memory_bytes is not None]
        losses = [r.loss for r in steps]
        summary = {"epoch": self.epoch, "steps": len(steps), "time_s": seconds,
                   "peak_memory_bytes": max(peaks) if peaks else None,
                   "train_loss": float(np.mean(losses)) if losses else None,
                   "skipped": sum(1 for r in steps if r.skipped)}
        if eval_loader is not None:
            result = self.evaluate(eval_loader)
            summary["test_loss"], summary["test_accuracy"] = result["loss"], result["accuracy"]
        self.history.epochs.append(summary)
        self.epoch += 1
        self._batches_done = 0

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, loader, precision: Optional[str] = None) -> dict:
        """Mean loss and accuracy (a fraction in [0, 1]) over ``loader``, without gradients.

        ``precision``: None uses ``config.eval_precision``; "same" is training's autocast; a
        precision name (e.g. "fp32") runs under that one instead. The model's train/eval mode is
        restored afterwards.
        """
        name = self.config.eval_precision if precision is None else precision
        if not isinstance(name, str):
            raise ValueError(f"precision must be None or one of {', '.join(EVAL_PRECISIONS)}; "
                             f"got {name!r}")
        name = self.config.precision if name.strip().lower() == "same" else check_precision(
            name, self.device)
        was_training = self.model.training
        self.model.eval()
        total_loss = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        count = 0
        try:
            with torch.no_grad(), precision_settings(name, self.device), \
                    autocast_for(name, self.device.type):
                for x, y in loader:
                    x, y = self._to_device(x, y)
                    out = self.model(x)
                    total_loss += self.loss_fn(out, y).float() * len(y)
                    correct += (out.argmax(dim=1) == y).sum()
                    count += len(y)
        finally:
            self.model.train(was_training)
        if count == 0:
            raise ValueError("loader must yield at least one batch; got none")
        return {"loss": total_loss.item() / count, "accuracy": correct.item() / count,
                "examples": count, "precision": name}

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs, as tensors and plain containers only."""
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step": self.step, "epoch": self.epoch, "batches_done": self._batches_done,
            "config": self.config.as_dict(),
            "history": {"steps": self.history.columns(),
                        "epochs": [dict(e) for e in self.history.epochs]},
            "rng": rng_state(),
        }

    def save_checkpoint(self, path: Union[str, Path]) -> Path:
        """Write a training checkpoint atomically (temp file + rename): a failed save leaves the
        previous checkpoint intact."""
        return atomic_save(self.state_dict(), path)

    def load_checkpoint(self, path: Union[str, Path], load_scaler: bool = True) -> dict:
        """Load a checkpoint written by ``save_checkpoint`` with ``weights_only=True`` and continue
        exactly where it stopped (model, optimizer, scaler, scheduler, counters, history, RNG).
        ``load_scaler=False`` keeps this trainer's scaler. Returns the loaded dict."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path must be an existing checkpoint file; got {str(path)!r}")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"path must be a checkpoint written by Trainer.save_checkpoint "
                             f"({CHECKPOINT_FORMAT}); got {str(path)!r}")
        if state["scheduler"] is not None and self.scheduler is None:
            raise ValueError("scheduler: the checkpoint holds a scheduler state but this Trainer "
                             "has no scheduler; pass the same kind of scheduler")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._prime_fused_sgd()  # a checkpoint saved before the first step holds no buffers
        if load_scaler and state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self._batches_done = int(state["batches_done"])
        self.history = History.from_columns(state["history"]["steps"], state["history"]["epochs"])
        set_rng_state(state["rng"])
        return state


# --- lesson 02: runs on the digits set -----------------------------------------------------------

def build_digits_model(name: str = "cnn", width: int = 32) -> Tuple[nn.Module, Optional[int]]:
    """A fresh digits model and the input it wants: ``("simplenet" | "mlp" | "cnn")`` ->
    ``(model, image_size)`` where image_size None means flat 64-vectors."""
    from .models import MLP, SimpleNet, SmallCNN

    if name == "simplenet":
        return SimpleNet(), None
    if name == "mlp":
        return MLP(hidden=(4 * width, 2 * width)), None
    if name == "cnn":
        return SmallCNN(width=width), 32
    raise ValueError(f"model must be one of {', '.join(DIGITS_MODELS)}; got {name!r}")


DIGITS_MODELS = ("simplenet", "mlp", "cnn")


@dataclass
class DigitsRun:
    """What ``train_digits`` measured. ``epochs`` are History.epochs (per-epoch summaries)."""

    precision: str
    model: str
    device: str
    epochs: List[dict]
    history: History
    trainer: Optional[Trainer]
    baseline_bytes: Optional[int] = None  # CUDA memory already allocated when the run began

    @property
    def epoch_time_s(self) -> Optional[float]:
        """Median seconds per epoch, the first (warm-up) epoch left out when there are more."""
        times = [e["time_s"] for e in self.epochs]
        return statistics.median(times[1:] if len(times) > 1 else times) if times else None

    @property
    def peak_memory_mib(self) -> Optional[float]:
        """Highest per-step peak of allocated CUDA memory, MiB, minus what was already allocated
        when the run began (so runs made one after another compare fairly); None on a CPU."""
        peaks = [e["peak_memory_bytes"] for e in self.epochs if e["peak_memory_bytes"] is not None]
        if not peaks:
            return None
        return (max(peaks) - (self.baseline_bytes or 0)) / 2 ** 20

    @property
    def accuracy(self) -> Optional[float]:
        """Test accuracy after the last epoch, as a fraction."""
        return self.epochs[-1].get("test_accuracy") if self.epochs else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the scaler skipped."""
        return self.history.skipped_steps

    def summary(self) -> dict:
        """Plain data for tables and JSON."""
        return {"precision": self.precision, "model": self.model, "device": self.device,
                "epochs": len(self.epochs), "epoch_time_s": self.epoch_time_s,
                "peak_memory_mib": self.peak_memory_mib, "accuracy": self.accuracy,
                "skipped_steps": self.skipped_steps}


def train_digits(precision: str = "fp32", model: str = "cnn", epochs: int = 3,
                 batch_size: int = 64, lr: float = 0.05, width: int = 32,
                 image_size: Optional[int] = None, scaler: Optional[ScalerSettings] = None,
                 clip_norm: Optional[float] = None, accumulate: int = 1,
                 eval_precision: str = "same", device: Device = None, seed: int = 0,
                 progress: bool = True, checkpoint: Union[str, Path, None] = None,
                 resume: Union[str, Path, None] = None, hooks: Sequence[Hooks] = (),
                 on_epoch: Optional[Callable[[dict], None]] = None,
                 lr_schedule: str = "constant") -> DigitsRun:
    """Train a digits model (SGD, momentum 0.9) and evaluate it on the test split every epoch.

    ``lr_schedule``: ``"constant"`` (``lr`` throughout) or ``"cosine"`` (``lr`` decayed to 0 over
    ``epochs``; the schedule then depends on the total, so resume with the same ``epochs``).

    ``epochs`` is the total: a run resumed from ``resume`` trains only the epochs still missing.
    ``checkpoint``: saved (atomically) after every epoch. ``image_size`` overrides the CNN's 32.
    ``on_epoch`` gets each epoch's summary as it finishes (the CLI prints it).
    """
    from .data import digits_loaders

    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
    if not _is_real(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite number > 0; got {lr!r}")
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine'; got {lr_schedule!r}")
    dev = _as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    precision = check_precision(precision, dev)
    baseline = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    torch.manual_seed(seed)
    net, size = build_digits_model(model, width)
    if image_size is not None and size is not None:
        size = image_size
    train, test = digits_loaders(batch_size, size, dev, seed)
    config = TrainConfig(precision=precision, scaler=scaler or ScalerSettings(),
                         clip_norm=clip_norm, accumulate=accumulate,
                         eval_precision=eval_precision, progress=progress, seed=seed)
    net.to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    schedule = None
    if lr_schedule == "cosine":
        # Decay to zero over the run: the final weights settle, so precisions are compared on
        # converged runs, not on where a constant learning rate happened to leave them.
        steps = epochs * -(-len(train) // accumulate)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    trainer = Trainer(net, opt, config, device=dev, scheduler=schedule, hooks=hooks)
    if resume is not None:
        trainer.load_checkpoint(resume)
    while trainer.epoch < epochs:
        trainer.fit(train, epochs=1, eval_loader=test)
        if checkpoint is not None:
            trainer.save_checkpoint(checkpoint)
        if on_epoch is not None:
            on_epoch(trainer.history.epochs[-1])
    return DigitsRun(precision, model, str(dev), trainer.history.epochs, trainer.history, trainer,
                     baseline)


def compare_precisions(precisions: Sequence[str] = ("fp32", "fp16"), device: Device = None,
                       **train_kwargs) -> List[dict]:
    """Run ``train_digits`` once per precision from the same seed and initial weights.

    Returns one row per precision: precision, ran, reason (why it could not run here, else ""),
    epoch_time_s, peak_memory_mib, accuracy_pct, skipped_steps, and run (the DigitsRun, its
    trainer dropped so that its model and optimizer state free their memory; None if not run).
    """
    dev = _as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    rows = []
    for p in precisions:
        row = {"precision": normalize_precision(p), "ran": False, "reason": "",
               "epoch_time_s": None, "peak_memory_mib": None, "accuracy_pct": None,
               "skipped_steps": None, "run": None}
        try:
            check_precision(p, dev)
        except ValueError as exc:
            row["reason"] = str(exc)
            rows.append(row)
            continue
        run = train_digits(p, device=dev, **train_kwargs)
        run.trainer = None  # free this run's device memory before the next one is measured
        row.update(ran=True, epoch_time_s=run.epoch_time_s, peak_memory_mib=run.peak_memory_mib,
                   accuracy_pct=100 * run.accuracy, skipped_steps=run.skipped_steps, run=run)
        rows.append(row)
    return rows


# --- lesson 02: what autocast does, and the usual mistakes run on purpose -----------------------

def dtype_label(dtype: torch.dtype, low: torch.dtype) -> str:
    """``"16-bit"`` for the autocast dtype ``low`` (fp16 or bf16), else the dtype's short name, so
    a table reads the same whichever half type a device uses."""
    return "16-bit" if dtype == low else str(dtype).replace("torch.", "")


@dataclass
class AutocastReport:
    """What one forward + backward under autocast produced (``autocast_dtypes``).

    ``layers``: ``(name, kind, output dtype, dtype of the gradient flowing back into that
    output)`` per leaf module, in call order; ``loss``: the loss's dtype; ``parameters`` and
    ``gradients``: the set of dtypes of the parameters and of their ``.grad``; ``low``: the
    autocast dtype; ``input``: the input batch's dtype.
    """

    layers: List[Tuple[str, str, torch.dtype, Optional[torch.dtype]]]
    loss: torch.dtype
    parameters: set
    gradients: set
    low: torch.dtype
    input: torch.dtype

    def rows(self) -> List[dict]:
        """Plain rows with dtype labels ("16-bit" = the autocast dtype)."""
        lab = lambda d: "-" if d is None else dtype_label(d, self.low)  # noqa: E731
        out = [{"what": "input batch", "kind": "data", "dtype": lab(self.input), "grad": "-"}]
        out += [{"what": name, "kind": kind, "dtype": lab(dt), "grad": lab(gd)}
                for name, kind, dt, gd in self.layers]
        out.append({"what": "loss", "kind": "cross_entropy", "dtype": lab(self.loss), "grad": "-"})
        out.append({"what": "every parameter", "kind": "weights",
                    "dtype": ", ".join(sorted(lab(d) for d in self.parameters)),
                    "grad": ", ".join(sorted(lab(d) for d in self.gradients))})
        return out

    def format(self) -> str:
        """A fixed-width table: output dtype and the dtype of the gradient that flows back."""
        rows = self.rows()
        widths = [max(len(r[k]) for r in rows + [dict(what="tensor", kind="layer", dtype="dtype",
                                                           grad="gradient dtype")])
                  for k in ("what", "kind", "dtype", "grad")]
        head = ("tensor", "layer", "dtype", "gradient dtype")
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(r[k].ljust(w) for k, w in zip(("what", "kind", "dtype", "grad"),
                                                          widths)).rstrip() for r in rows]
        return "\n".join(lines)


def autocast_dtypes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device_type: str,
                    dtype: torch.dtype, loss_fn: Callable = F.cross_entropy) -> AutocastReport:
    """Run one forward + backward of ``model`` under ``torch.autocast(device_type, dtype)`` and
    record the dtype of every leaf layer's output, of the gradient flowing back into it, of the
    loss, of the parameters and of their gradients (lesson 02, claim B5). Gradients are cleared
    afterwards; BatchNorm statistics move as in any training forward."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16; got {dtype!r}")
    layers: list = []
    grads: Dict[int, torch.dtype] = {}
    handles = []

    def hook(module, inputs, output, name=None):
        index = len(layers)
        layers.append([name, type(module).__name__, output.dtype, None])
        if output.requires_grad:
            output.register_hook(lambda g, i=index: grads.__setitem__(i, g.dtype))

    for name, module in model.named_modules():
        if name and not list(module.children()):
            handles.append(module.register_forward_hook(
                lambda m, i, o, name=name: hook(m, i, o, name)))
    was_training = model.training
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss = loss_fn(model(x), y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    report = AutocastReport(
        layers=[(n, k, d, grads.get(i)) for i, (n, k, d, _) in enumerate(layers)],
        loss=loss.dtype, parameters={p.dtype for p in model.parameters()},
        gradients={p.grad.dtype for p in model.parameters() if p.grad is not None},
        low=dtype, input=x.dtype)
    model.zero_grad(set_to_none=True)
    return report


def claim_b5_verdicts(report: AutocastReport) -> List[dict]:
    """Article B's claim B5 ("loss computed in FP16", "backward in FP16", gradients "restored to
    FP32") against an ``autocast_dtypes`` report: one row per part, verdict computed."""
    low = report.low
    layer_grads = {g for _, _, _, g in report.layers if g is not None}
    matmul_grads = {g for _, k, _, g in report.layers if k in ("Linear", "Conv2d") and g}
    rows = [
        {"claim": "B5: the loss is computed in FP16",
         "measured": f"loss dtype {dtype_label(report.loss, low)}",
         "verdict": "held" if report.loss == low else "did not hold: the loss is float32 "
                    "(cross_entropy is on autocast's float32 list)"},
        {"claim": "B5: backward runs in FP16",
         "measured": "gradients into layer outputs: " + ", ".join(
             sorted(dtype_label(d, low) for d in layer_grads)),
         "verdict": ("partly: backward of 16-bit layers runs in 16-bit" if low in matmul_grads
                     else "did not hold") + (", but the loss's backward is float32"
                                              if report.loss != low else "")},
        {"claim": "B5: gradients are restored to FP32",
         "measured": "parameter gradients: " + ", ".join(
             sorted(dtype_label(d, low) for d in report.gradients)),
         "verdict": ("held in effect, but nothing is restored: the parameters never left float32;"
                     " autocast's casts are recorded by autograd, whose backward returns float32"
                     if report.gradients == {torch.float32} else "did not hold")},
    ]
    return rows


class ClipBeforeUnscale(Hooks):
    """Claim B3's order, on purpose: ``clip_grad_norm_`` while the gradients are still SCALED.

    Records ``scaled_norms`` (the norm clip saw) and ``scales`` per step. The true gradient is then
    clipped to ``max_norm / scale`` instead of ``max_norm``. Use with ``accumulate=1``.
    """

    def __init__(self, max_norm: float = 1.0):
        _optional_positive("max_norm", max_norm)
        self.max_norm = float(max_norm)
        self.scaled_norms: List[float] = []
        self.scales: List[float] = []

    def after_backward(self, trainer: "Trainer", micro_step: int) -> None:
        norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), self.max_norm)
        self.scaled_norms.append(float(norm))
        self.scales.append(float(trainer.scaler.get_scale()))


def clip_order_experiment(max_norm: float = 1.0, device: Device = None, **train_kwargs) -> List[dict]:
    """Train twice in fp16 from the same start: clipping before ``unscale_`` (claim B3 as shown)
    and after it (PyTorch's order). One row each: the scale, the true gradient norm, the
    threshold really applied to the true gradient, the norm of the gradient the optimizer used,
    and the final test accuracy (medians over steps)."""
    _optional_positive("max_norm", max_norm)
    rows = []
    for wrong in (True, False):
        hook = ClipBeforeUnscale(max_norm) if wrong else None
        run = train_digits("fp16", device=device, hooks=[hook] if hook else (),
                           clip_norm=None if wrong else max_norm, **train_kwargs)
        cols = run.history.columns()
        ok = [i for i, s in enumerate(cols["skipped"]) if not s]
        scales = [cols["scale"][i] for i in ok]
        if wrong:
            true = [hook.scaled_norms[i] / hook.scales[i] for i in ok]
            used = [cols["grad_norm"][i] for i in ok]
            thresholds = [max_norm / s for s in scales]
        else:
            true = [cols["grad_norm"][i] for i in ok]
            used = [min(t, max_norm) for t in true]
            thresholds = [max_norm for _ in ok]
        rows.append({
            "order": "clip, then unscale_ (claim B3 as shown)" if wrong
            else "unscale_, then clip (PyTorch's order)",
            "scale": statistics.median(scales), "true_grad_norm": statistics.median(true),
            "threshold_applied": statistics.median(thresholds),
            "grad_norm_used": statistics.median(used), "accuracy_pct": 100 * run.accuracy,
            "skipped_steps": run.skipped_steps})
    return rows


def scheduler_on_skipped_steps(steps: int = 20, warmup: int = 40, init_scale: float = 2.0 ** 24,
                               model: str = "mlp", batch_size: int = 64, lr: float = 0.05,
                               device: Device = None, seed: int = 0) -> List[dict]:
    """A linear warm-up schedule under fp16 with a scale high enough to overflow at first.

    Runs the naive loop (``scheduler.step()`` every iteration) and the trainer (only after real
    optimizer steps) from the same start. One row each: optimizer steps taken, steps skipped,
    scheduler steps, the learning rate reached and what it should be after that many real steps,
    and the warning torch gave (empty if none)."""
    from .data import digits_loaders

    for name, value in (("steps", steps), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
    dev = _as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    check_precision("fp16", dev)
    schedule = lambda s: min(1.0, (s + 1) / warmup)  # noqa: E731
    rows = []
    for naive in (True, False):
        torch.manual_seed(seed)
        net, size = build_digits_model(model)
        net.to(dev)
        train, _ = digits_loaders(batch_size, size, dev, seed)
        data = [b for _, b in zip(range(steps), _cycle(train))]
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        settings = ScalerSettings(init_scale=init_scale)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if naive:
                scaler, skipped = settings.make(dev.type), 0
                for x, y in data:
                    with torch.autocast(device_type=dev.type, dtype=torch.float16):
                        loss = F.cross_entropy(net(x), y)
                    scaler.scale(loss).backward()
                    before = scaler.get_scale()
                    scaler.step(opt)
                    scaler.update()
                    skipped += scaler.get_scale() < before
                    sched.step()  # the mistake: also after a skipped step
                    opt.zero_grad(set_to_none=True)
            else:
                trainer = Trainer(net, opt, TrainConfig(precision="fp16", scaler=settings,
                                                        progress=False, seed=None),
                                  scheduler=sched)
                for batch in data:
                    trainer.train_step([batch])
                skipped = trainer.history.skipped_steps
        messages = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
        real = steps - int(skipped)
        rows.append({"loop": "naive: scheduler.step() every iteration" if naive
                     else "trainer: scheduler.step() only after a real step",
                     "optimizer_steps": real, "skipped_steps": int(skipped),
                     "scheduler_steps": sched.last_epoch,
                     "lr": opt.param_groups[0]["lr"], "lr_expected": lr * schedule(real),
                     "warning": messages[0] if messages else ""})
    return rows


def _cycle(loader):
    epoch = 0
    while True:
        _set_loader_epoch(loader, epoch)
        yield from loader
        epoch += 1


def half_model_errors(device: Device = None, model: str = "mlp") -> Dict[str, str]:
    """What ``.half()`` on the model leads to under fp16 AMP: ``"torch"``: the error GradScaler
    raises in ``step`` ("Attempting to unscale FP16 gradients."); ``"trainer"``: the trainer's
    earlier, explained refusal. Messages as ``"ValueError: ..."``."""
    from .data import digits_loaders

    dev = _as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    check_precision("fp16", dev)
    net, size = build_digits_model(model)
    net = net.to(dev).half()  # the mistake
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(dev.type)
    x, y = next(iter(digits_loaders(32, size, dev)[0]))
    with torch.autocast(device_type=dev.type, dtype=torch.float16):
        loss = F.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    out = {}
    try:
        scaler.step(opt)
        out["torch"] = ""
    except ValueError as exc:
        out["torch"] = f"ValueError: {exc}"
    try:
        Trainer(net, opt, TrainConfig(precision="fp16", progress=False, seed=None), device=dev)
        out["trainer"] = ""
    except ValueError as exc:
        out["trainer"] = f"ValueError: {exc}"
    return out


# Article B's claims B1 and B2 (CLAIMS.md): the figures, and when a measurement counts as holding.
ARTICLE_B2 = {"fp32": {"memory_gb": 10.2, "epoch_s": 18.7}, "fp16": {"memory_gb": 5.8, "epoch_s": 11.2}}
B1_MEMORY_SAVED, B1_SPEEDUP, B2_MEMORY_SAVED, B2_TIME_SAVED = 0.40, 1.5, 0.40, 0.30


def speed_memory_claims(rows: Sequence[dict], tensor_cores: bool) -> List[dict]:
    """Claims B1 and B2 beside ``compare_precisions`` rows (needs an fp32 and an fp16 row that
    ran): one row per claim part with the claim, when it counts as holding, the measurement and a
    computed verdict. ``tensor_cores``: whether this device has fp16 Tensor Cores (B1's premise)."""
    by = {r["precision"]: r for r in rows if r.get("ran")}
    if "fp32" not in by or "fp16" not in by:
        raise ValueError("rows must hold an fp32 and an fp16 row that ran")
    fp32, amp = by["fp32"], by["fp16"]
    speedup = fp32["epoch_time_s"] / amp["epoch_time_s"]
    time_saved = 1 - amp["epoch_time_s"] / fp32["epoch_time_s"]
    mem = (None if fp32["peak_memory_mib"] is None or amp["peak_memory_mib"] is None
           else 1 - amp["peak_memory_mib"] / fp32["peak_memory_mib"])
    premise = "" if tensor_cores else " (B1 is about Tensor Core GPUs; this device has none)"

    def change(fraction: float, less: str) -> str:
        return f"{fraction:.0%} {less}" if fraction >= 0 else f"{-fraction:.0%} more"

    def verdict(ok: Optional[bool]) -> str:
        return "not measured: no CUDA memory counter on a CPU" if ok is None else (
            "held" if ok else "did not hold")

    return [
        {"claim": "B1: about 50% less memory", "holds if": f">= {B1_MEMORY_SAVED:.0%} saved",
         "measured": "-" if mem is None else change(mem, "saved"),
         "verdict": verdict(None if mem is None else mem >= B1_MEMORY_SAVED)},
        {"claim": "B1: 1.5-2x faster", "holds if": f">= {B1_SPEEDUP}x",
         "measured": f"{speedup:.2f}x",
         "verdict": verdict(speedup >= B1_SPEEDUP) + premise},
        {"claim": "B2: 10.2 -> 5.8 GB (over 40% less)",
         "holds if": f">= {B2_MEMORY_SAVED:.0%} saved",
         "measured": "-" if mem is None else
         f"{fp32['peak_memory_mib']:.0f} -> {amp['peak_memory_mib']:.0f} MiB "
         f"({change(mem, 'saved')})",
         "verdict": verdict(None if mem is None else mem >= B2_MEMORY_SAVED)},
        {"claim": "B2: 18.7 -> 11.2 s per epoch (about 39% less)",
         "holds if": f">= {B2_TIME_SAVED:.0%} less time",
         "measured": f"{fp32['epoch_time_s']:.3g} -> {amp['epoch_time_s']:.3g} s "
                     f"({change(time_saved, 'less')})",
         "verdict": verdict(time_saved >= B2_TIME_SAVED)},
    ]
