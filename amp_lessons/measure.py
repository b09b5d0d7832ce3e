"""Speed and memory of a training step, measured: the engine of lessons 04 and 05.

``measure`` times one ``BenchConfig``'s step (CUDA events after a warm-up, median img/s; on a CPU
``time.perf_counter``), reads peak memory after ``torch.cuda.reset_peak_memory_stats()``, breaks
it into parameters, gradients, optimizer state and saved activations (counted, not estimated),
and measures the share of the step the GPU sat idle (``timing.device_busy_ms``). ``run_configs`` measures
many in one process (an out-of-memory error becomes a row, never a dead kernel);
``compare_loops`` times the trainer against a hand-written loop; ``largest_batch`` searches the
largest batch under a memory cap (``memory_cap``). ``STANDARD``: the settings every lesson uses.
"""
from __future__ import annotations

import datetime
import gc
import math
import platform
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import models as _models
from . import trainer as _trainer
from ._validate import check_bool, check_choice, check_int, check_real
from .data import synthetic_images
from .tables import json_safe, percent
# the step timers live in ``timing``; lessons and learners know them as measure.time_steps etc.
from .timing import (device_busy_ms, idle_fraction, interval_union,  # noqa: F401 (re-exported)
                     summarize_times, time_steps)
from .env import allocatable_bytes, device_capability
from .precision import PRECISIONS, as_device, autocast_for, native_bf16, precision_settings

GIB = 2**30
MODELS = {
    "resnet50": _models.resnet50,
    "resnet18": _models.resnet18,
    "resnet50-selective": _models.optimized_resnet50,
    "resnet18-selective": _models.optimized_resnet18,
}
OPTIMIZERS = ("sgd", "adam", "adamw")
OPTIMIZER_IMPLS = ("default", "for-loop", "foreach", "fused")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
LOOPS = ("hand", "trainer")


# --- the standard measurement settings ----------------------------------------------------------
# The settings every speed and memory measurement uses (lessons 04 and 05) unless the lesson is
# about the difference: NHWC, cuDNN autotuning on, SGD (momentum 0.9) with foreach kernels
# (PyTorch's GPU default, named so a CPU runs the same code), 5 warm-up steps, median of 15.
STANDARD = dict(channels_last=True, cudnn_benchmark=True, optimizer="sgd", impl="foreach",
                warmup=5, steps=15)


def standard_settings(quick: bool = False) -> Dict[str, object]:
    """``STANDARD`` as a new dict; ``quick=True`` (the CPU profile) keeps every setting but times
    1 warm-up step and 2 steps, enough to show the method and too few to decide anything."""
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be True or False; got {quick!r}")
    out = dict(STANDARD)
    if quick:
        out.update(warmup=1, steps=2)
    return out


def settings_caption(settings: Optional[Dict[str, object]] = None) -> str:
    """The settings in words, for the line above a table and a published table's title, e.g.
    "channels_last, cuDNN autotuning on, foreach SGD, median of 15 steps after 5 warm-up"."""
    s = dict(STANDARD if settings is None else settings)
    missing = [k for k in STANDARD if k not in s]
    if missing:
        raise ValueError(f"settings must hold {', '.join(STANDARD)}; missing {', '.join(missing)}")
    opt = {"sgd": "SGD (momentum 0.9)", "adam": "Adam", "adamw": "AdamW"}.get(s["optimizer"],
                                                                              s["optimizer"])
    impl = "" if s["impl"] == "default" else f"{s['impl']} "
    return (f"{'channels_last' if s['channels_last'] else 'NCHW'}, cuDNN autotuning "
            f"{'on' if s['cudnn_benchmark'] else 'off'}, {impl}{opt}, median of {s['steps']} "
            f"timed steps after {s['warmup']} warm-up")


# --- configurations -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """One training-step configuration to measure. ``label`` defaults to a description."""

    label: str = ""
    model: str = "resnet50"
    precision: str = "fp32"            # fp32 (TF32 off), tf32, fp16 (+ GradScaler), bf16
    channels_last: bool = False
    batch_size: int = 256
    image_size: int = 224
    num_classes: int = 1000
    optimizer: str = "sgd"
    impl: str = "default"              # for-loop, foreach or fused optimizer kernels
    lr: Optional[float] = None         # default 0.1 for SGD, 1e-3 for Adam(W)
    eps: float = 1e-8                  # Adam(W) only
    amsgrad: bool = False              # Adam(W) only
    compile: Optional[str] = None      # a torch.compile mode, or None for eager
    cuda_graph: bool = False           # capture the whole eager step in one CUDA graph
    checkpoint: Optional[str] = None   # None, "block" or "stage" (activation checkpointing)
    loop: str = "hand"                 # "hand": hand-written loop; "trainer": Trainer.train_step
    cudnn_benchmark: bool = True       # let cuDNN pick the fastest convolution algorithms

    def __post_init__(self):
        for name, choices in (("model", tuple(MODELS)), ("precision", PRECISIONS),
                              ("optimizer", OPTIMIZERS), ("impl", OPTIMIZER_IMPLS),
                              ("compile", COMPILE_MODES), ("loop", LOOPS),
                              ("checkpoint", _models.CHECKPOINT_MODES)):
            check_choice(name, getattr(self, name), choices)
        if not isinstance(self.label, str):
            raise ValueError(f"label must be a string; got {self.label!r}")
        fixed = {"batch_size": check_int("batch_size", self.batch_size, 1),
                 "image_size": check_int("image_size", self.image_size, 8),
                 "num_classes": check_int("num_classes", self.num_classes, 2)}
        for name in ("channels_last", "amsgrad", "cuda_graph", "cudnn_benchmark"):
            fixed[name] = check_bool(name, getattr(self, name))
        if self.lr is not None:
            fixed["lr"] = check_real("lr", self.lr, 0.0, low_open=True)
        fixed["eps"] = check_real("eps", self.eps, 0.0, 1.0, low_open=True, high_open=True)
        for name, value in fixed.items():  # NumPy scalars kept as plain Python values
            object.__setattr__(self, name, value)
        if not self.label:
            object.__setattr__(self, "label", self.describe())

    def describe(self) -> str:
        """A readable name, e.g. "fp16 + GradScaler, channels_last, compile, fused SGD"."""
        parts = [{"fp32": "fp32, TF32 off", "tf32": "fp32, TF32 on",
                  "fp16": "fp16 + GradScaler", "bf16": "bf16"}[self.precision]]
        if self.model.endswith("-selective"):
            parts.append("layer3/4+fc in fp32")
        if self.channels_last:
            parts.append("channels_last")
        if self.checkpoint:
            parts.append(f"checkpoint per {self.checkpoint}")
        if self.compile:
            parts.append("compile" if self.compile == "default" else f"compile {self.compile}")
        if self.cuda_graph:
            parts.append("CUDA graph")
        opt = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[self.optimizer]
        if self.impl != "default":
            opt = f"{self.impl} {opt}"
        if self.optimizer != "sgd" and self.eps != 1e-8:
            opt += f" eps={self.eps:g}"
        if self.amsgrad:
            opt += " amsgrad"
        if self.impl != "default" or self.optimizer != "sgd":
            parts.append(opt)
        if self.loop == "trainer":
            parts.append("Trainer")
        return ", ".join(parts)


def build_model(config: BenchConfig, device, in_channels: int = 3) -> nn.Module:
    """The configuration's model on ``device`` (channels_last if asked), in training mode."""
    model = MODELS[config.model](num_classes=config.num_classes, checkpoint=config.checkpoint,
                                 in_channels=in_channels)
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def build_optimizer(config: BenchConfig, params: Iterable[torch.Tensor],
                    prime_momentum: bool = True) -> torch.optim.Optimizer:
    """SGD (momentum 0.9) or Adam/AdamW with the configuration's kernels, eps and amsgrad.

    ``prime_momentum``: give fused SGD zero momentum buffers up front
    (``trainer.prime_momentum_buffers``), so a first step that GradScaler skips cannot leave
    them uninitialised; the updates are the same as without priming.
    """
    if not isinstance(prime_momentum, bool):
        raise ValueError(f"prime_momentum must be True or False; got {prime_momentum!r}")
    kwargs: Dict[str, object] = {}
    if config.impl == "for-loop":
        kwargs["foreach"] = False
    elif config.impl == "foreach":
        kwargs["foreach"] = True
    elif config.impl == "fused":
        kwargs["fused"] = True
    if config.optimizer == "sgd":
        sgd = torch.optim.SGD(params, lr=config.lr or 0.1, momentum=0.9, **kwargs)
        if prime_momentum and config.impl == "fused":
            _trainer.prime_momentum_buffers(sgd)
        return sgd
    if config.cuda_graph:
        kwargs["capturable"] = True
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=config.lr or 1e-3, eps=config.eps, amsgrad=config.amsgrad, **kwargs)


def skip_reason(config: BenchConfig, device) -> Optional[str]:
    """Why ``config`` cannot run on ``device`` (a sentence), or None when it can."""
    device = torch.device(device)
    if config.precision in ("bf16", "tf32") and device.type == "cuda" and not native_bf16(device):
        major, minor = device_capability(device)
        return (f"{config.precision} needs compute capability 8.0+ (native bf16, TF32 tensor "
                f"cores); this GPU is sm_{major}{minor}")
    if config.compile and device.type != "cuda":
        return "torch.compile is measured on a GPU only (compiling a ResNet takes minutes on a CPU)"
    if config.cuda_graph:
        if device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if config.compile:
            return "a manual CUDA graph wraps the eager step; use compile='reduce-overhead' instead"
        if config.loop == "trainer":
            return "the trainer's step is not captured in a CUDA graph"
        if config.precision == "fp16" and config.impl != "fused":
            return "GradScaler waits for the host in step() unless the optimizer is fused"
    if config.impl == "fused" and device.type not in ("cuda", "cpu"):
        return f"fused optimizers do not run on {device.type}"
    return None


# --- memory -------------------------------------------------------------------------------------
def storage_key(t: torch.Tensor):
    """What identifies ``t``'s storage (address, device); None for a tensor without one."""
    try:
        return t.untyped_storage().data_ptr(), t.device
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``, each storage counted once (views share their storage)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every tensor in the optimizer's per-parameter state (momentum, exp_avg, exp_avg_sq...)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


class SavedActivations:
    """Count the bytes autograd saves for backward inside the ``with`` block.

    A ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor saved for backward;
    each storage is counted once and parameters are left out (they are held anyway), so what
    remains is the activations (and, under autocast, the half-precision copies of weights).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {storage_key(t) for t in exclude}
        self._sizes: Dict[object, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in self._exclude and key not in self._sizes:
            self._sizes[key] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved so far."""
        return sum(self._sizes.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def memory_breakdown(step: "Step", x: torch.Tensor, y: torch.Tensor,
                     device) -> Dict[str, Optional[float]]:
    """Run one training step of ``step`` and measure where its memory goes, in GiB.

    Parameters and gradients (read between backward and the optimizer step) are summed over
    their tensors; activations are the storages saved for backward (``SavedActivations``). On a
    GPU, ``activations_allocated_gib`` also gives the growth of allocated memory across the
    forward pass, which includes what checkpointing keeps and saved-tensor hooks cannot see.
    Optimizer state exists only after a step that was not skipped: read it with
    ``optimizer_state_tensors`` once training ran.
    """
    params = list(step.model.parameters())
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    with SavedActivations(exclude=params) as saved:
        loss = step.forward(x, y)
    after_forward = torch.cuda.memory_allocated(device) if cuda else None
    step.backward(loss)
    grads = tensor_bytes(p.grad for p in params if p.grad is not None)
    step.update()
    return {
        "params_gib": tensor_bytes(params) / GIB,
        "grads_gib": grads / GIB,
        "activations_gib": saved.bytes / GIB,
        "activations_allocated_gib": (after_forward - before) / GIB if cuda else None,
    }


def free_memory(device=None, reset_compiler: bool = False) -> None:
    """Release what the last measurement left: garbage, cached CUDA blocks, compiled graphs."""
    if reset_compiler and hasattr(torch, "_dynamo"):  # a torch without dynamo compiled nothing
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a CUDA (or CPU allocator) out-of-memory error, whatever its class."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, (oom, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "cuda_error_out_of_memory" in text)


# --- the training step --------------------------------------------------------------------------
@dataclass
class Step:
    """A training step in three parts: ``forward(x, y) -> loss``, ``backward(loss)``,
    ``update()`` (optimizer step, scaler update, zero_grad). ``step(x, y)`` runs all three and
    returns the detached loss; with ``trainer`` set it calls ``trainer.train_step`` instead."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    forward: Callable
    backward: Callable
    update: Callable
    trainer: object = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor):
        if self.trainer is not None:
            return _RecordLoss(self.trainer.train_step([(x, y)]))
        loss = self.forward(x, y)
        self.backward(loss)
        self.update()
        return loss.detach()


class _RecordLoss:
    """A StepRecord's loss, read (with its host sync) only when converted with ``float()``."""

    def __init__(self, record):
        self.record = record

    def __float__(self) -> float:
        return float(self.record.loss)


def hand_step(model: nn.Module, optimizer: torch.optim.Optimizer, precision: str, device,
              loss_fn: Callable = F.cross_entropy, cache_enabled: bool = True,
              mark_step: bool = False) -> Step:
    """The canonical AMP step written out: autocast forward, scaled backward, step, update.

    ``scaler`` is enabled for fp16 only; for fp32/tf32/bf16 it passes everything through.
    ``mark_step`` tells torch.compile's CUDA graphs that a new iteration begins.
    """
    device_type = torch.device(device).type
    scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    def forward(x, y):
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast_for(precision, device_type, cache_enabled=cache_enabled):
            return loss_fn(model(x), y)

    def backward(loss):
        scaler.scale(loss).backward()

    def update():
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return Step(model, optimizer, scaler, forward, backward, update)


def trainer_step(model: nn.Module, optimizer: torch.optim.Optimizer, config: BenchConfig,
                 device) -> Step:
    """A ``Step`` that calls the shared ``Trainer.train_step`` (lesson 02's trainer)."""
    tcfg = _trainer.TrainConfig(precision=config.precision, channels_last=config.channels_last,
                                progress=False, seed=None)
    trainer = _trainer.Trainer(model, optimizer, tcfg, device=device)
    base = hand_step(model, optimizer, config.precision, device)
    return Step(model, optimizer, trainer.scaler, base.forward, base.backward, base.update,
                trainer=trainer)


def cuda_graph_step(step: Step, x: torch.Tensor, y: torch.Tensor, warmup: int = 3) -> Callable:
    """Capture one whole training step in a CUDA graph; returns ``replay(x, y) -> loss``.

    The graph reads ``x`` and ``y`` from their addresses at capture time, so replays train on
    those same tensors (copy new data into them to change it). Warm-up runs on a side stream,
    as PyTorch's CUDA-graph recipe does, so lazily created state exists before capture.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    step.optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(x, y)

    def replay(x_in: torch.Tensor, y_in: torch.Tensor) -> torch.Tensor:
        if x_in.data_ptr() != x.data_ptr() or y_in.data_ptr() != y.data_ptr():
            x.copy_(x_in)
            y.copy_(y_in)
        graph.replay()
        return static_loss

    replay.graph = graph  # keep it alive with the callable
    return replay


# --- one configuration, many configurations -----------------------------------------------------
ROW_KEYS = ("label", "status", "reason", "img_per_s", "step_ms", "step_ms_q1", "step_ms_q3",
            "peak_allocated_gib", "peak_reserved_gib", "params_gib", "grads_gib",
            "optimizer_state_gib", "activations_gib", "activations_allocated_gib", "loss",
            "gpu_busy_ms", "gpu_idle_fraction", "timer", "steps", "warmup", "seconds")


def _empty_row(config: BenchConfig, status: str, reason: str = "") -> Dict[str, object]:
    row = {k: None for k in ROW_KEYS}
    row.update(label=config.label, status=status, reason=reason, config=asdict(config))
    return row


def _measure(config: BenchConfig, device: torch.device, warmup: int, steps: int,
             breakdown: bool, idle: bool) -> Dict[str, object]:
    torch.manual_seed(0)
    model = build_model(config, device)
    optimizer = build_optimizer(config, model.parameters())
    x, y = synthetic_images(config.batch_size, config.image_size, config.num_classes, device,
                            channels_last=config.channels_last)
    compiled = model if not config.compile else torch.compile(model, mode=config.compile)
    cudagraph_mode = bool(config.compile) and config.compile in ("reduce-overhead", "max-autotune")
    if config.loop == "trainer":
        step = trainer_step(compiled, optimizer, config, device)
    else:
        step = hand_step(compiled, optimizer, config.precision, device,
                         cache_enabled=not config.cuda_graph, mark_step=cudagraph_mode)
    row = _empty_row(config, "ok")
    if breakdown:  # on the eager model: saved-tensor hooks do not see inside compiled graphs
        row.update(memory_breakdown(hand_step(model, optimizer, config.precision, device),
                                    x, y, device))
    graphed = config.cuda_graph or cudagraph_mode
    if graphed and device.type == "cuda":
        # a CUDA graph's memory pool is set aside during warm-up and capture and held for the
        # whole run: count it, so the row's peak is what the configuration really needs
        free_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
    run = step
    if config.cuda_graph:
        run = cuda_graph_step(step, x, y, warmup=max(warmup, 2))
    timing = time_steps(run, x, y, warmup=warmup, steps=steps, device=device,
                        reset_peak=not graphed)
    row.update(summarize_times(timing["times_ms"], config.batch_size))
    row.update(loss=timing["loss"], timer=timing["timer"], steps=steps, warmup=warmup)
    row["optimizer_state_gib"] = tensor_bytes(optimizer_state_tensors(optimizer)) / GIB
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        if idle:  # a few more steps under the profiler, after the peak was read
            try:
                row["gpu_busy_ms"] = device_busy_ms(run, x, y, device)
            except RuntimeError as exc:  # a profiler that cannot start leaves the share unknown
                row["reason"] = f"GPU idle share not measured ({exc})"[:200]
            if not row["gpu_busy_ms"]:  # no device events recorded (no CUPTI): unknown, not idle
                row["gpu_busy_ms"] = None
            row["gpu_idle_fraction"] = idle_fraction(row["gpu_busy_ms"], row["step_ms"])
        if graphed:
            row["reason"] = ("peak over warm-up, capture and timed steps: a CUDA graph holds "
                             "its memory pool for the whole run")
    if not math.isfinite(row["loss"]):
        row["status"] = "error"
        row["reason"] = f"loss is {row['loss']} after {warmup + steps} steps (timing kept)"
    return row


def measure(config: BenchConfig, device, warmup: int = 5, steps: int = 15,
            breakdown: bool = True, idle: bool = True) -> Dict[str, object]:
    """Measure one configuration; returns a row (a dict) whatever happens.

    On a GPU, ``idle`` adds ``gpu_busy_ms`` and ``gpu_idle_fraction`` (``device_busy_ms`` over 3
    more steps, after the timing and the peak-memory reading): whether the step kept the GPU
    busy, which a comparison between precisions must state.

    ``status`` is ``"ok"``, ``"skipped"`` (``reason`` says why: no bf16, no GPU for compile...),
    ``"out of memory"`` or ``"error"``. Memory is freed before returning, also after a failure.
    """
    if not isinstance(config, BenchConfig):
        raise ValueError(f"config must be a BenchConfig; got {type(config).__name__}")
    # bad arguments are the caller's mistake, not the configuration's result: raise, no row
    warmup, steps = check_int("warmup", warmup, 0), check_int("steps", steps, 1)
    check_bool("breakdown", breakdown)
    check_bool("idle", idle)
    device = torch.device(device)
    reason = skip_reason(config, device)
    if reason:
        return _empty_row(config, "skipped", reason)
    t0 = time.perf_counter()
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    try:
        with precision_settings(config.precision, device):
            row = _measure(config, device, warmup, steps, breakdown, idle)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, never a dead kernel
        if is_out_of_memory(exc):
            total = allocatable_bytes(device) / GIB if device.type == "cuda" else None
            where = f" of this device's {total:.1f} GiB" if total else ""
            row = _empty_row(config, "out of memory",
                             f"batch {config.batch_size} needs more than the free memory{where}")
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            row = _empty_row(config, "error", f"{type(exc).__name__}: {first}"[:300])
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
        free_memory(device, reset_compiler=bool(config.compile))
    row["seconds"] = time.perf_counter() - t0
    return row


def run_configs(configs: Sequence[BenchConfig], device, warmup: int = 5, steps: int = 15,
                breakdown: bool = True, progress: bool = True, idle: bool = True,
                on_row: Optional[Callable[[Dict[str, object]], None]] = None
                ) -> List[Dict[str, object]]:
    """Measure every configuration in turn, in this process, freeing memory between them."""
    configs = list(configs)
    if not configs or not all(isinstance(c, BenchConfig) for c in configs):
        raise ValueError("configs must hold at least one BenchConfig, and nothing else")
    check_int("warmup", warmup, 0)
    check_int("steps", steps, 1)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError("configuration labels must be unique")
    rows = []
    iterator: Iterable = configs
    if progress:
        try:
            from .progress import progress_bar as tqdm
            iterator = tqdm(configs, desc="configurations", leave=False)
        except ImportError:
            pass
    free_memory(device)
    for config in iterator:
        row = measure(config, device, warmup=warmup, steps=steps, breakdown=breakdown, idle=idle)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def with_ratios(rows: Sequence[Dict[str, object]], baseline: str) -> List[Dict[str, object]]:
    """Copies of ``rows`` with ``speedup`` (img/s over the baseline's) and ``memory_ratio``.

    ``baseline`` is the label of a row of the same run. A ratio is None where a number is missing.
    """
    base = next((r for r in rows if r["label"] == baseline), None)
    if base is None:
        raise ValueError(f"baseline must be the label of one of the rows; got {baseline!r}")
    return [dict(r, speedup=ratio(r.get("img_per_s"), base.get("img_per_s")),
                 memory_ratio=ratio(r.get("peak_allocated_gib"), base.get("peak_allocated_gib")))
            for r in rows]


def ratio(a, b) -> Optional[float]:
    """``a / b``, or None where either is missing (or ``b`` is 0): a ratio of two rows' numbers."""
    return a / b if a is not None and b else None


DEFAULT_COLUMNS = (("label", "configuration"), ("img_per_s", "img/s"),
                   ("speedup", "x fp32"), ("peak_allocated_gib", "peak GiB"),
                   ("memory_ratio", "mem x fp32"), ("activations_gib", "act. GiB"),
                   ("optimizer_state_gib", "opt. GiB"),
                   ("gpu_idle_fraction", "GPU idle", lambda v: percent(v, 1.0)),
                   ("status", "status"))


def published_rows(rows: Sequence[Dict[str, object]], columns=DEFAULT_COLUMNS) -> List[Dict[str, object]]:
    """Rows keyed by column heading, for ``report.publish`` (the README's results section): the
    columns and status text of ``tables.text_table``; numbers stay numbers, except in a column
    with a format function (a share: ``"0.61%"``, never rounded to zero), which gives its text."""
    columns = [c for c in columns if any(c[0] in r for r in rows)]
    if not columns:
        raise ValueError("columns must name at least one key present in the rows")

    def cell(r, c):
        v = r.get(c[0])
        if c[0] == "status" and v != "ok" and r.get("reason"):
            return f"{v}: {r['reason']}"
        return c[2](v) if len(c) > 2 and callable(c[2]) and v is not None else v
    return [{c[1]: cell(r, c) for c in columns} for r in rows]


# --- batch size, rows, results -----------------------------------------------------------------
def batch_size_for(total_memory_gib: Optional[float], image_size: int = 224,
                   largest: int = 256, fp32_gib_per_image: float = 0.085,
                   fraction: float = 0.6) -> int:
    """A power-of-two batch whose fp32 ResNet-50 step fits in ``fraction`` of the device memory.

    ``fp32_gib_per_image`` is the peak per 224x224 image of an fp32 step (about 21.4 GiB at batch
    256 on an H200); it scales with the pixel count. ``None`` memory (a CPU) gives ``largest``.
    """
    check_int("largest", largest, 1)
    check_int("image_size", image_size, 8)
    if not (0 < fraction <= 1):
        raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}")
    if total_memory_gib is None:
        return largest
    per_image = fp32_gib_per_image * (image_size / 224) ** 2
    batch = 1
    while batch * 2 <= largest and batch * 2 * per_image <= fraction * total_memory_gib:
        batch *= 2
    return batch


def find_row(rows: Sequence[Dict[str, object]], **match) -> Optional[Dict[str, object]]:
    """The first row whose configuration has every ``key=value`` in ``match`` (None if none)."""
    for r in rows:
        cfg = r.get("config", {})
        if all(cfg.get(k) == v for k, v in match.items()):
            return r
    return None


def results_document(rows: Sequence[Dict[str, object]], device=None,
                     **extra) -> Dict[str, object]:
    """Rows plus what produced them (GPU name, torch version, date) as JSON-ready data."""
    device = as_device(device)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine() or "CPU")
    doc = {"device": str(device), "device_name": name, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}
    doc.update(extra)
    doc["rows"] = [json_safe(r) for r in rows]
    return doc


MEMORY_COLUMNS = (("label", "configuration"), ("params_gib", "params GiB"),
                  ("grads_gib", "grads GiB"), ("optimizer_state_gib", "optimizer GiB"),
                  ("activations_gib", "saved activations GiB"),
                  ("peak_allocated_gib", "peak allocated GiB"),
                  ("peak_reserved_gib", "peak reserved GiB"))


# --- the trainer against a hand-written loop ----------------------------------------------------
def compare_loops(config: BenchConfig, device, warmup: int = 5, steps: int = 15,
                  rounds: int = 3) -> Dict[str, object]:
    """Time ``Trainer.train_step`` and the hand-written step on one model, interleaved.

    Both train the same model with the same optimizer; ``rounds`` alternating blocks of
    ``steps`` timed steps each cancel slow drifts (clocks, other processes). Returns the median
    img/s of each and ``overhead_pct`` (how much slower the trainer is; negative: faster).
    """
    check_int("rounds", rounds, 1)
    device = torch.device(device)
    reason = skip_reason(config, device)
    if reason:
        return {"label": config.label, "status": "skipped", "reason": reason}
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    try:
        with precision_settings(config.precision, device):
            torch.manual_seed(0)
            model = build_model(config, device)
            optimizer = build_optimizer(config, model.parameters())
            x, y = synthetic_images(config.batch_size, config.image_size, config.num_classes,
                                    device, channels_last=config.channels_last)
            hand = hand_step(model, optimizer, config.precision, device)
            trained = trainer_step(model, optimizer, config, device)
            times: Dict[str, List[float]] = {"hand": [], "trainer": []}
            for r in range(rounds):
                for name, step in (("hand", hand), ("trainer", trained)) if r % 2 == 0 else \
                        (("trainer", trained), ("hand", hand)):
                    t = time_steps(step, x, y, warmup=warmup if r == 0 else 1, steps=steps,
                                   device=device)
                    times[name] += t["times_ms"]
    except Exception as exc:  # noqa: BLE001
        status = "out of memory" if is_out_of_memory(exc) else "error"
        return {"label": config.label, "status": status, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
        free_memory(device)
    hand_s = summarize_times(times["hand"], config.batch_size)
    trainer_s = summarize_times(times["trainer"], config.batch_size)
    return {"label": config.label, "status": "ok", "reason": "",
            "hand_img_per_s": hand_s["img_per_s"], "trainer_img_per_s": trainer_s["img_per_s"],
            "overhead_pct": 100 * (hand_s["img_per_s"] / trainer_s["img_per_s"] - 1),
            "steps_each": len(times["hand"]), "timer": "CUDA events" if device.type == "cuda"
            else "perf_counter"}


# --- the largest batch under a memory cap -------------------------------------------------------
@dataclass
class LargestBatch:
    """What ``largest_batch`` found: the batch size (0 if none fits) and every trial made."""

    batch_size: int
    cap_bytes: int
    trials: List[Dict[str, object]] = field(default_factory=list)


@contextmanager
def memory_cap(cap_bytes: int, device) -> Iterator[None]:
    """Make this process's CUDA allocator refuse to hold more than ``cap_bytes`` on ``device``.

    Simulates a smaller card with ``torch.cuda.set_per_process_memory_fraction``; the previous
    fraction is restored afterwards. Memory already held by this process counts toward the cap.
    """
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    usable = allocatable_bytes(device)  # a simulated card's memory where one is simulated
    if not (0 < cap_bytes <= usable):
        raise ValueError(f"cap_bytes must be in (0, {usable}] (the memory this process may use "
                         f"on this device); got {cap_bytes!r}")
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None) or \
        getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    old = getter(index) if getter else usable / total  # older torch: the card's own cap
    free_memory(device)
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(old, index)
        free_memory(device)


def largest_batch(make_step: Callable[[int], Callable[[], object]], cap_bytes: int, device=None,
                  start: int = 1, limit: int = 4096,
                  peak_bytes: Optional[Callable[[int], int]] = None) -> LargestBatch:
    """The largest batch size whose training step runs within ``cap_bytes`` of memory.

    ``make_step(batch_size)`` builds what one trial needs and returns a callable that runs a
    training step (it is called twice, so optimizer state exists on the second). The search
    doubles from ``start`` until a trial fails or ``limit`` is reached, then bisects between the
    last batch that fit and the first that did not. On a GPU ``memory_cap`` enforces the cap;
    elsewhere ``peak_bytes(batch_size)`` (a fake memory model, for tests) says what a trial needs.
    Out-of-memory errors are caught and memory is released after every trial.
    """
    check_int("start", start, 1)
    check_int("limit", limit, start)
    if not isinstance(cap_bytes, int) or cap_bytes < 1:
        raise ValueError(f"cap_bytes must be an integer >= 1; got {cap_bytes!r}")
    device = as_device(device)
    cuda = device.type == "cuda" and peak_bytes is None
    if not cuda and peak_bytes is None:
        raise ValueError("peak_bytes is required when device is not a CUDA device")
    result = LargestBatch(0, cap_bytes)

    def fits(batch: int) -> bool:
        trial = {"batch_size": batch, "fits": False, "peak_gib": None, "reason": ""}
        step = None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            step = make_step(batch)
            step()
            step()
            if cuda:
                torch.cuda.synchronize(device)
                trial["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
                trial["fits"] = True
            else:
                need = int(peak_bytes(batch))
                trial["peak_gib"] = need / GIB
                trial["fits"] = need <= cap_bytes
                if not trial["fits"]:
                    trial["reason"] = "out of memory (simulated)"
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            trial["reason"] = "out of memory"
        finally:
            del step
            free_memory(device if cuda else None)
        result.trials.append(trial)
        return bool(trial["fits"])

    with memory_cap(cap_bytes, device) if cuda else nullcontext():
        good, bad = 0, None
        batch = start
        while batch <= limit:
            if fits(batch):
                good = batch
                if batch == limit:
                    break
                batch = min(batch * 2, limit)
            else:
                bad = batch
                break
        while bad is not None and bad - good > 1:  # bisect between what fit and what did not
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    result.batch_size = good
    return result
