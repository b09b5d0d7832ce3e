"""Speed and memory of a training step, measured (lessons 04 and 05).

- ``BenchConfig`` names one configuration (model, precision, memory format, optimizer, compile,
  CUDA graph, checkpointing, batch); ``measure`` times its training step with CUDA events after a
  warm-up (median over steps, in img/s), reads peak allocated and reserved memory after
  ``torch.cuda.reset_peak_memory_stats()``, and breaks the memory down into parameters,
  gradients, optimizer state and activations saved for backward (counted, not estimated).
  On a CPU it times with ``time.perf_counter`` and reports no peak ("n/a").
- ``run_configs`` measures many configurations in one process, one after another, freeing
  memory between them; an out-of-memory error becomes a row that says so, never a dead kernel.
- ``compare_loops`` times the shared trainer's ``train_step`` against a hand-written loop on the
  same model, interleaved, so lesson 04 can show what the trainer costs.
- ``largest_batch`` finds the largest batch that trains within a memory cap (lesson 05).
- ``digits_accuracy``, ``autocast_error_by_op`` and the claim helpers answer article claims B1,
  R4-R7 and R12 with measurements.
"""
from __future__ import annotations

import gc
import importlib
import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import models as _models
from . import trainer as _trainer
from .data import synthetic_images
from .trainer import precision_settings

GIB = 2**30
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
MODELS = {
    "resnet50": _models.resnet50,
    "resnet18": _models.resnet18,
    "resnet50-r4": _models.optimized_resnet50,
    "resnet18-r4": _models.optimized_resnet18,
}
OPTIMIZERS = ("sgd", "adam", "adamw")
OPTIMIZER_IMPLS = ("default", "for-loop", "foreach", "fused")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
LOOPS = ("hand", "trainer")
_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# --- precision ----------------------------------------------------------------------------------

def autocast_for(precision: str, device_type: str, cache_enabled: bool = True):
    """The trainer's ``autocast_for``; with ``cache_enabled=False`` (what CUDA graph capture
    needs: the cast-weight cache would hold tensors from outside the graph's pool) built here."""
    if cache_enabled or precision not in _AMP_DTYPES:
        return _trainer.autocast_for(precision, device_type)
    return torch.autocast(device_type=device_type, dtype=_AMP_DTYPES[precision],
                          cache_enabled=False)


def native_bf16(device) -> bool:
    """True where bf16 runs natively: any CPU, or a GPU of compute capability 8.0 or newer."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


# --- configurations -----------------------------------------------------------------------------

from ._validate import _check_choice, _check_int  # noqa: E402 - shared checks


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
        _check_choice("model", self.model, tuple(MODELS))
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("impl", self.impl, OPTIMIZER_IMPLS)
        _check_choice("compile", self.compile, COMPILE_MODES)
        _check_choice("checkpoint", self.checkpoint, _models.CHECKPOINT_MODES)
        _check_choice("loop", self.loop, LOOPS)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("image_size", self.image_size, 8)
        _check_int("num_classes", self.num_classes, 2)
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0; got {self.lr!r}")
        if not (0 < self.eps < 1):
            raise ValueError(f"eps must be in (0, 1); got {self.eps!r}")
        if not self.label:
            object.__setattr__(self, "label", self.describe())

    def describe(self) -> str:
        """A readable name, e.g. "fp16 + GradScaler, channels_last, compile, fused SGD"."""
        parts = [{"fp32": "fp32, TF32 off", "tf32": "fp32, TF32 on",
                  "fp16": "fp16 + GradScaler", "bf16": "bf16"}[self.precision]]
        if self.model.endswith("-r4"):
            parts.append("R4 layer3/4+fc in fp32")
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
    if config.precision == "bf16" and not native_bf16(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"bf16 needs native support (compute capability 8.0+); this GPU is sm_{major}{minor}"
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

def _storage_key(t: torch.Tensor):
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
        key = _storage_key(t)
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
        self._exclude = {_storage_key(t) for t in exclude}
        self._sizes: Dict[object, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
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
    if reset_compiler:
        try:
            torch._dynamo.reset()
        except Exception:  # noqa: BLE001 - torch without dynamo; nothing compiled then
            pass
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


# --- timing -------------------------------------------------------------------------------------

def time_steps(step: Callable, x: torch.Tensor, y: torch.Tensor, warmup: int = 5,
               steps: int = 15, device=None, reset_peak: bool = True) -> Dict[str, object]:
    """Run ``warmup`` untimed steps, then time ``steps`` steps one by one.

    On a GPU each step is bracketed by CUDA events (device time, no host sync inside the loop);
    on a CPU by ``time.perf_counter``. Returns ``times_ms`` (per step), ``loss`` (last, float)
    and ``timer``. With ``reset_peak`` the GPU's peak-memory counter is reset after the warm-up
    (leave it off to count memory set aside during the warm-up, such as a CUDA graph's pool).
    """
    _check_int("warmup", warmup, 0)
    _check_int("steps", steps, 1)
    if not isinstance(reset_peak, bool):
        raise ValueError(f"reset_peak must be True or False; got {reset_peak!r}")
    device = torch.device(device) if device is not None else x.device
    loss = None
    for _ in range(warmup):
        loss = step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for i in range(steps):
            starts[i].record()
            loss = step(x, y)
            ends[i].record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        timer = "CUDA events"
    else:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step(x, y)
            times.append((time.perf_counter() - t0) * 1e3)
        timer = "perf_counter"
    return {"times_ms": times, "loss": float(loss) if loss is not None else float("nan"),
            "timer": timer}


def summarize_times(times_ms: Sequence[float], batch_size: int) -> Dict[str, float]:
    """Median step time, img/s from it, and the spread (quartiles) of the step times."""
    if not times_ms:
        raise ValueError("times_ms must hold at least one step time")
    median = statistics.median(times_ms)
    q1, q3 = (statistics.quantiles(times_ms, n=4)[i] for i in (0, 2)) if len(times_ms) > 1 \
        else (median, median)
    return {"step_ms": median, "step_ms_q1": q1, "step_ms_q3": q3,
            "img_per_s": batch_size / (median / 1e3)}


# --- one configuration, many configurations -----------------------------------------------------

ROW_KEYS = ("label", "status", "reason", "img_per_s", "step_ms", "step_ms_q1", "step_ms_q3",
            "peak_allocated_gib", "peak_reserved_gib", "params_gib", "grads_gib",
            "optimizer_state_gib", "activations_gib", "activations_allocated_gib", "loss",
            "timer", "steps", "warmup", "seconds")


def _empty_row(config: BenchConfig, status: str, reason: str = "") -> Dict[str, object]:
    row = {k: None for k in ROW_KEYS}
    row.update(label=config.label, status=status, reason=reason, config=asdict(config))
    return row


def _measure(config: BenchConfig, device: torch.device, warmup: int, steps: int,
             breakdown: bool) -> Dict[str, object]:
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
        if graphed:
            row["reason"] = ("peak over warm-up, capture and timed steps: a CUDA graph holds "
                             "its memory pool for the whole run")
    if not math.isfinite(row["loss"]):
        row["status"] = "error"
        row["reason"] = f"loss is {row['loss']} after {warmup + steps} steps (timing kept)"
    return row


def measure(config: BenchConfig, device, warmup: int = 5, steps: int = 15,
            breakdown: bool = True) -> Dict[str, object]:
    """Measure one configuration; returns a row (a dict) whatever happens.

    ``status`` is ``"ok"``, ``"skipped"`` (``reason`` says why: no bf16, no GPU for compile...),
    ``"out of memory"`` or ``"error"``. Memory is freed before returning, also after a failure.
    """
    device = torch.device(device)
    reason = skip_reason(config, device)
    if reason:
        return _empty_row(config, "skipped", reason)
    t0 = time.perf_counter()
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    try:
        with precision_settings(config.precision, device):
            row = _measure(config, device, warmup, steps, breakdown)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, never a dead kernel
        if is_out_of_memory(exc):
            total = (torch.cuda.get_device_properties(device).total_memory / GIB
                     if device.type == "cuda" else None)
            where = f" of this device's {total:.0f} GiB" if total else ""
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
                breakdown: bool = True, progress: bool = True,
                on_row: Optional[Callable[[Dict[str, object]], None]] = None
                ) -> List[Dict[str, object]]:
    """Measure every configuration in turn, in this process, freeing memory between them."""
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError("configuration labels must be unique")
    rows = []
    iterator: Iterable = configs
    if progress:
        try:
            from tqdm.auto import tqdm
            iterator = tqdm(configs, desc="configurations", leave=False)
        except ImportError:
            pass
    free_memory(device)
    for config in iterator:
        row = measure(config, device, warmup=warmup, steps=steps, breakdown=breakdown)
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
    out = []
    for row in rows:
        new = dict(row)
        new["speedup"] = _ratio(row.get("img_per_s"), base.get("img_per_s"))
        new["memory_ratio"] = _ratio(row.get("peak_allocated_gib"), base.get("peak_allocated_gib"))
        out.append(new)
    return out


def _ratio(a, b) -> Optional[float]:
    return a / b if a is not None and b else None


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e7:  # beyond any img/s or MiB figure: a blown-up value, say so briefly
            return f"{value:.{digits + 1}g}"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if value == 0 or abs(value) >= 0.995:
            return f"{value:.{digits}f}"
        return f"{value:.{digits + 1}g}"
    return str(value)


DEFAULT_COLUMNS = (("label", "configuration"), ("img_per_s", "img/s"),
                   ("speedup", "x fp32"), ("peak_allocated_gib", "peak GiB"),
                   ("memory_ratio", "mem x fp32"), ("activations_gib", "act. GiB"),
                   ("optimizer_state_gib", "opt. GiB"), ("status", "status"))


def format_table(rows: Sequence[Dict[str, object]], columns=DEFAULT_COLUMNS) -> str:
    """Rows as an aligned text table; missing numbers read "n/a", skipped rows give the reason.

    ``columns`` is a sequence of ``(key, heading)``; keys absent from every row are left out.
    """
    columns = [(k, h) for k, h in columns if any(k in r for r in rows)]
    if not columns:
        raise ValueError("columns must name at least one key present in the rows")
    cells = []
    for r in rows:
        line = []
        for k, _ in columns:
            v = r.get(k)
            if k == "status" and v != "ok" and r.get("reason"):
                v = f"{v}: {r['reason']}"
            line.append(_fmt(v))
        cells.append(line)
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, (_, h) in enumerate(columns)]
    numeric = [all(_is_number(r.get(k)) or r.get(k) is None for r in rows) for k, _ in columns]

    def fmt_line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    lines = [fmt_line([h for _, h in columns]), fmt_line(["-" * w for w in widths])]
    lines += [fmt_line(c) for c in cells]
    return "\n".join(lines)


def published_rows(rows: Sequence[Dict[str, object]], columns=DEFAULT_COLUMNS) -> List[Dict[str, object]]:
    """Rows keyed by column heading, for ``report.publish`` (the README's results section).

    Same columns and status text as ``format_table``; numbers stay numbers.
    """
    columns = [(k, h) for k, h in columns if any(k in r for r in rows)]
    if not columns:
        raise ValueError("columns must name at least one key present in the rows")
    out = []
    for r in rows:
        row = {}
        for k, h in columns:
            v = r.get(k)
            if k == "status" and v != "ok" and r.get("reason"):
                v = f"{v}: {r['reason']}"
            row[h] = v
        out.append(row)
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --- the lesson's configurations ----------------------------------------------------------------

def batch_size_for(total_memory_gib: Optional[float], image_size: int = 224,
                   largest: int = 256, fp32_gib_per_image: float = 0.085,
                   fraction: float = 0.6) -> int:
    """A power-of-two batch whose fp32 ResNet-50 step fits in ``fraction`` of the device memory.

    ``fp32_gib_per_image`` is the peak per 224x224 image of an fp32 step (about 21.4 GiB at batch
    256 on an H200); it scales with the pixel count. ``None`` memory (a CPU) gives ``largest``.
    """
    _check_int("largest", largest, 1)
    _check_int("image_size", image_size, 8)
    if not (0 < fraction <= 1):
        raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}")
    if total_memory_gib is None:
        return largest
    per_image = fp32_gib_per_image * (image_size / 224) ** 2
    batch = 1
    while batch * 2 <= largest and batch * 2 * per_image <= fraction * total_memory_gib:
        batch *= 2
    return batch


def lesson_configs(model: str = "resnet50", batch_size: int = 256, image_size: int = 224,
                   num_classes: int = 1000, amp: str = "fp16",
                   compile_precision: Optional[str] = "bf16",
                   cudnn_benchmark: bool = True,
                   compile_modes: Sequence[str] = ("default", "reduce-overhead")
                   ) -> List[BenchConfig]:
    """Lesson 04's table: precisions x memory formats, optimizer kernels, R4, R5, torch.compile.

    ``amp`` is the half precision of the optimizer and R4 rows (fp16 as in the articles; bf16
    where fp16 would only be emulated); ``compile_precision`` is the precision of the compiled
    rows, channels_last with fused SGD, one per mode in ``compile_modes`` (``None`` leaves
    torch.compile out; ``"reduce-overhead"`` adds CUDA graphs). ``cudnn_benchmark=False`` saves
    the minutes cuDNN's autotuning takes for every new precision and memory format.
    """
    _check_choice("amp", amp, tuple(_AMP_DTYPES))
    if isinstance(compile_modes, str) or not compile_modes:
        raise ValueError(f"compile_modes must be a non-empty sequence of modes from "
                         f"{COMPILE_MODES[1:]}; got {compile_modes!r}")
    for mode in compile_modes:
        _check_choice("compile_modes", mode, COMPILE_MODES[1:])
    base = dict(model=model, batch_size=batch_size, image_size=image_size,
                num_classes=num_classes, cudnn_benchmark=cudnn_benchmark)
    r4 = f"{model}-r4"
    cfgs = [BenchConfig(precision=p, **base) for p in PRECISIONS]
    cfgs += [BenchConfig(precision=p, channels_last=True, **base) for p in PRECISIONS]
    cfgs += [BenchConfig(precision=p, channels_last=True, impl=i, **base)
             for p in dict.fromkeys((amp, "bf16")) for i in ("foreach", "fused")]
    cfgs += [BenchConfig(precision=amp, **dict(base, model=r4))]
    adam = dict(base, precision=amp, channels_last=True, optimizer="adam")
    cfgs += [BenchConfig(impl="foreach", **adam), BenchConfig(impl="fused", **adam),
             BenchConfig(impl="fused", eps=1e-7, **adam),
             BenchConfig(impl="fused", amsgrad=True, **adam)]
    if compile_precision:
        cfgs += [BenchConfig(precision=compile_precision, channels_last=True, impl="fused",
                             compile=mode, **base) for mode in compile_modes]
    return cfgs


def find_row(rows: Sequence[Dict[str, object]], **match) -> Optional[Dict[str, object]]:
    """The first row whose configuration has every ``key=value`` in ``match`` (None if none)."""
    for r in rows:
        cfg = r.get("config", {})
        if all(cfg.get(k) == v for k, v in match.items()):
            return r
    return None


def skipped_step_check(optimizer: str = "sgd", impl: str = "fused", device=None,
                       size: int = 1024, prime_momentum: bool = False) -> Dict[str, object]:
    """Does a step that GradScaler skips leave the optimizer exactly as it was?

    One parameter vector, two steps: the first step's gradient holds an inf (GradScaler skips
    it, as it does early in fp16 training while the scale settles), the second is finite. The
    parameters after step two are compared with those of the for-loop optimizer, which skips
    cleanly. Returns ``max_abs_diff`` (0.0 when ``impl`` agrees), ``finite`` and ``state_after_skip``
    (whether the skipped step created optimizer state). ``prime_momentum=True`` applies the
    course's workaround (zero SGD momentum buffers before the first step) to a fused SGD being
    checked; ``primed`` says whether it was applied.
    """
    if not isinstance(prime_momentum, bool):
        raise ValueError(f"prime_momentum must be True or False; got {prime_momentum!r}")
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("impl", impl, OPTIMIZER_IMPLS)
    device = torch.device(device) if device is not None else torch.device("cpu")
    results = {}
    primed = prime_momentum and optimizer == "sgd" and impl == "fused"

    def state_count(opt) -> int:  # state tensors of the parameter's size (not step counters)
        return sum(1 for t in optimizer_state_tensors(opt) if t.numel() > 1)

    for name in ("for-loop", impl):
        p = nn.Parameter(torch.linspace(-1, 1, size, device=device))
        opt = build_optimizer(BenchConfig(optimizer=optimizer, impl=name), [p],
                              prime_momentum=prime_momentum and name == impl)
        before = state_count(opt)  # primed buffers exist before any step
        scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
        bad = torch.ones(size, device=device)
        bad[0] = float("inf")
        state_after_skip = None
        for c in (bad, torch.ones(size, device=device)):
            scaler.scale((p * c).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if state_after_skip is None:
                state_after_skip = state_count(opt) > before
        results[name] = (p.detach().clone(), state_after_skip)
    ref, got = results["for-loop"][0], results[impl][0]
    diff = (got - ref).abs().max().item() if torch.isfinite(got).all() else float("inf")
    return {"optimizer": optimizer, "impl": impl, "primed": primed,
            "device": str(device), "max_abs_diff": diff,
            "finite": bool(torch.isfinite(got).all()),
            "state_after_skip": results[impl][1], "reference_state_after_skip": results["for-loop"][1]}


def results_document(rows: Sequence[Dict[str, object]], device=None,
                     **extra) -> Dict[str, object]:
    """Rows plus what produced them (GPU name, torch version, date) as JSON-ready data."""
    import datetime as _dt
    import platform

    device = torch.device(device) if device is not None else torch.device("cpu")
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine() or "CPU")
    doc = {"device": str(device), "device_name": name, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()}
    doc.update(extra)
    doc["rows"] = [_json_ready(r) for r in rows]
    return doc


def _json_ready(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


MEMORY_COLUMNS = (("label", "configuration"), ("params_gib", "params GiB"),
                  ("grads_gib", "grads GiB"), ("optimizer_state_gib", "optimizer GiB"),
                  ("activations_gib", "saved activations GiB"),
                  ("peak_allocated_gib", "peak allocated GiB"),
                  ("peak_reserved_gib", "peak reserved GiB"))


def layout_effects(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per precision: img/s with NCHW and with channels_last (plain SGD rows), and the gain."""
    out = []
    for precision in PRECISIONS:
        nchw = find_row(rows, precision=precision, channels_last=False, optimizer="sgd",
                        impl="default", compile=None, cuda_graph=False)
        nhwc = find_row(rows, precision=precision, channels_last=True, optimizer="sgd",
                        impl="default", compile=None, cuda_graph=False)
        if nchw is None or nhwc is None or nchw["config"]["model"].endswith("-r4"):
            continue
        a, b = nchw.get("img_per_s"), nhwc.get("img_per_s")
        out.append({"label": nchw["label"], "nchw_img_per_s": a, "channels_last_img_per_s": b,
                    "channels_last_gain": _ratio(b, a)})
    return out


LAYOUT_COLUMNS = (("label", "precision"), ("nchw_img_per_s", "NCHW img/s"),
                  ("channels_last_img_per_s", "channels_last img/s"),
                  ("channels_last_gain", "gain x"))


# --- the trainer against a hand-written loop ----------------------------------------------------

def compare_loops(config: BenchConfig, device, warmup: int = 5, steps: int = 15,
                  rounds: int = 3) -> Dict[str, object]:
    """Time ``Trainer.train_step`` and the hand-written step on one model, interleaved.

    Both train the same model with the same optimizer; ``rounds`` alternating blocks of
    ``steps`` timed steps each cancel slow drifts (clocks, other processes). Returns the median
    img/s of each and ``overhead_pct`` (how much slower the trainer is; negative: faster).
    """
    _check_int("rounds", rounds, 1)
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
    if not (0 < cap_bytes <= total):
        raise ValueError(f"cap_bytes must be in (0, {total}] (this device's memory); "
                         f"got {cap_bytes!r}")
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None) or \
        getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    old = getter(index) if getter else 1.0
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
    last batch that fit and the first that did not. On a GPU the cap is enforced with
    ``memory_cap``; elsewhere ``peak_bytes(batch_size)`` says what a trial would need (a fake
    memory model, for tests and CPUs) and a trial fails when it exceeds the cap. Out-of-memory
    errors are caught and memory is released after every trial.
    """
    _check_int("start", start, 1)
    _check_int("limit", limit, start)
    if not isinstance(cap_bytes, int) or cap_bytes < 1:
        raise ValueError(f"cap_bytes must be an integer >= 1; got {cap_bytes!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
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
        if bad is not None:
            while bad - good > 1:
                mid = (good + bad) // 2
                if fits(mid):
                    good = mid
                else:
                    bad = mid
    result.batch_size = good
    return result


# --- accuracy on real data (claims R4, R5, R6, R7 and the parity table) -------------------------

DIGITS_MODELS = {"resnet50": _models.resnet50, "resnet18": _models.resnet18,
                 "resnet50-r4": _models.optimized_resnet50,
                 "resnet18-r4": _models.optimized_resnet18}


def digits_accuracy(model: str = "resnet18", precision: str = "fp32", device=None,
                    epochs: int = 6, batch_size: int = 64, image_size: int = 32,
                    small_input: bool = True, optimizer: str = "adam", lr: Optional[float] = None,
                    eps: float = 1e-8, amsgrad: bool = False, impl: str = "default",
                    max_train: Optional[int] = None, max_test: Optional[int] = None,
                    one_cycle: bool = True, seed: int = 0) -> Dict[str, object]:
    """Train a ResNet on the digits set with the shared trainer and report test accuracy.

    Adam (lr 1e-3) by default, with a one-cycle schedule so the last steps are small and the
    BatchNorm running statistics match the final weights. Accuracy is measured twice: under the
    training precision's autocast and with autocast off (claim R7). ``max_train`` /
    ``max_test`` keep only the first examples (the quick profile). Returns a row with
    ``accuracy``, ``accuracy_fp32_eval`` (fractions), ``final_loss`` (mean training loss of the
    last epoch), ``skipped_steps``,
    ``steps``, ``test_examples`` and ``seconds``; ``status`` is ``"skipped"`` where the device
    cannot run the precision. The same ``seed`` gives the same initial weights and batches.
    """
    from .data import TensorBatches, digits

    _check_choice("model", model, tuple(DIGITS_MODELS))
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_int("epochs", epochs, 1)
    _check_int("batch_size", batch_size, 1)
    for name, value in (("max_train", max_train), ("max_test", max_test)):
        if value is not None:
            _check_int(name, value, 1)
    device = torch.device(device) if device is not None else torch.device("cpu")
    label = f"{model}, {precision}, {optimizer}"
    if optimizer != "sgd":
        label += f" eps={eps:g}" + (" amsgrad" if amsgrad else "")
    row: Dict[str, object] = {"label": label, "model": model, "precision": precision,
                              "optimizer": optimizer, "eps": eps, "amsgrad": amsgrad,
                              "status": "ok", "reason": ""}
    if precision == "bf16" and not native_bf16(device):
        row.update(status="skipped", reason="bf16 needs compute capability 8.0+ "
                                            "(torch would only emulate it)")
        return row
    torch.manual_seed(seed)
    net = DIGITS_MODELS[model](num_classes=10, in_channels=1, small_input=small_input).to(device)
    cfg = BenchConfig(optimizer=optimizer, impl=impl, lr=lr, eps=eps, amsgrad=amsgrad)
    opt = build_optimizer(cfg, net.parameters())
    x_train, y_train = digits("train", image_size, device)
    x_test, y_test = digits("test", image_size, device)
    x_train, y_train = x_train[:max_train], y_train[:max_train]
    x_test, y_test = x_test[:max_test], y_test[:max_test]
    # drop_last: a last batch of a few images would give BatchNorm noisy statistics
    train = TensorBatches(x_train, y_train, min(batch_size, len(x_train)), shuffle=True,
                          drop_last=True, seed=seed)
    test = TensorBatches(x_test, y_test, 256, shuffle=False)
    scheduler = None
    if one_cycle:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=opt.param_groups[0]["lr"], total_steps=epochs * len(train),
            pct_start=0.25)
    trainer = _trainer.Trainer(net, opt, _trainer.TrainConfig(precision=precision,
                                                              progress=False, seed=None),
                               device=device, scheduler=scheduler)
    t0 = time.perf_counter()
    history = trainer.fit(train, epochs=epochs)
    same = trainer.evaluate(test)
    fp32 = trainer.evaluate(test, precision="fp32")
    losses = [r.loss for r in history]
    last = history.epochs[-1]["train_loss"] if getattr(history, "epochs", None) else None
    row.update(accuracy=float(same["accuracy"]), accuracy_fp32_eval=float(fp32["accuracy"]),
               final_loss=float(last if last is not None else losses[-1]),
               skipped_steps=_count(getattr(history, "skipped_steps", 0)),
               steps=len(losses), test_examples=int(same["examples"]),
               seconds=time.perf_counter() - t0)
    del trainer, net, opt, scheduler
    free_memory(device)
    return row


def _count(value) -> int:
    return value if isinstance(value, int) else len(value or [])


# --- claim R12: how sensitive is each op to half precision? -------------------------------------

def autocast_error_by_op(device=None, dtype="fp16",
                         logit_scales: Sequence[float] = (1.0, 8.0, 32.0),
                         seed: int = 0) -> List[Dict[str, object]]:
    """Relative error of ops under autocast against a float64 reference, on random inputs.

    A 3x3 convolution and a linear layer (the bulk of a ResNet) against scaled dot-product
    attention whose logits are made larger by ``logit_scale`` (sharper softmax, as trained
    attention gets): the error is ``||out - ref|| / ||ref||``, inf where the output overflows.
    ``dtype``: "fp16", "bf16" or the torch dtype.
    """
    dtype = _AMP_DTYPES.get(dtype, dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be 'fp16', 'bf16', torch.float16 or torch.bfloat16; "
                         f"got {dtype!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale)

    def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
        out = out.double().cpu()
        if not torch.isfinite(out).all():
            return float("inf")
        return float((out - ref).norm() / ref.norm())

    rows = []
    x, w = rand(8, 64, 32, 32), rand(64, 64, 3, 3, scale=(1 / 576) ** 0.5)
    ref = F.conv2d(x, w, padding=1)
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = F.conv2d(x.float().to(device), w.float().to(device), padding=1)
    rows.append({"op": "conv2d 3x3, 64 channels", "logit_scale": None, "out_dtype": str(out.dtype),
                 "rel_error": rel(out, ref)})
    a, b = rand(1024, 1024), rand(1024, 1024, scale=1 / 32)
    ref = a @ b
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = F.linear(a.float().to(device), b.t().contiguous().float().to(device))
    rows.append({"op": "linear 1024x1024", "logit_scale": None, "out_dtype": str(out.dtype),
                 "rel_error": rel(out, ref)})
    for scale in logit_scales:
        q, k, v = rand(4, 8, 256, 64), rand(4, 8, 256, 64), rand(4, 8, 256, 64)
        q = q * scale
        ref = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v
        with torch.autocast(device_type=device.type, dtype=dtype):
            out = F.scaled_dot_product_attention(q.float().to(device), k.float().to(device),
                                                 v.float().to(device))
        rows.append({"op": "attention (SDPA), 256 tokens", "logit_scale": scale,
                     "out_dtype": str(out.dtype), "rel_error": rel(out, ref)})
    return rows


# --- claims -------------------------------------------------------------------------------------

R6_SOURCE = ("article R, \"PyTorch 2.0 混合精度训练实战：ResNet-50 显存节省 40% 的 3 个关键配置\": "
             "ResNet-50 on ImageNet")
R6_CLAIM = (
    {"configuration": "FP32", "gib": 15.2, "img_per_s": 320, "top1": 76.3},
    {"configuration": "native AMP", "gib": 10.1, "img_per_s": 580, "top1": 76.1},
    {"configuration": "optimized (R3+R4+R5)", "gib": 9.1, "img_per_s": 620, "top1": 76.2},
)
B1_CLAIM = {"memory_saving_pct": 50.0, "speedup_low": 1.5, "speedup_high": 2.0}


def compare_r6(fp32: Dict[str, object], amp: Dict[str, object],
               optimized: Dict[str, object]) -> List[Dict[str, object]]:
    """Claim R6's table beside three measured rows (fp32, plain AMP, the "optimized" model).

    Absolute numbers depend on the card and the data, so the verdicts compare changes against
    the fp32 row of the same run: memory saved, speedup, and the ordering the claim implies
    (the optimized model at least as fast and as small as plain AMP).
    """
    measured = (fp32, amp, optimized)
    if any(r.get("img_per_s") is None for r in measured):
        raise ValueError("fp32, amp and optimized rows must all hold measurements (status ok)")
    base_c, base_m = R6_CLAIM[0], fp32
    out = []
    for claim, row in zip(R6_CLAIM, measured):
        mem_c = 100 * (1 - claim["gib"] / base_c["gib"])
        speed_c = claim["img_per_s"] / base_c["img_per_s"]
        peak = row.get("peak_allocated_gib")
        mem_m = 100 * (1 - peak / base_m["peak_allocated_gib"]) if peak is not None and \
            base_m.get("peak_allocated_gib") else None
        speed_m = row["img_per_s"] / base_m["img_per_s"]
        out.append({"configuration": claim["configuration"], "measured_label": row["label"],
                    "claimed_gib": claim["gib"], "measured_gib": peak,
                    "claimed_saving_pct": mem_c, "measured_saving_pct": mem_m,
                    "claimed_img_per_s": claim["img_per_s"], "measured_img_per_s": row["img_per_s"],
                    "claimed_speedup": speed_c, "measured_speedup": speed_m})
    for r in out[1:]:
        parts = []
        if r["measured_saving_pct"] is not None:
            parts.append(_verdict_at_least("memory saving", r["measured_saving_pct"],
                                           r["claimed_saving_pct"], "%"))
        parts.append(_verdict_at_least("speedup", r["measured_speedup"], r["claimed_speedup"], "x"))
        r["verdict"] = "; ".join(parts)
    o, a = out[2], out[1]
    faster = o["measured_img_per_s"] >= a["measured_img_per_s"]
    smaller = (o["measured_gib"] is None or a["measured_gib"] is None
               or o["measured_gib"] <= a["measured_gib"])
    o["verdict"] += ("; better than plain AMP as claimed" if faster and smaller else
                     f"; NOT better than plain AMP: {o['measured_img_per_s']:.0f} vs "
                     f"{a['measured_img_per_s']:.0f} img/s"
                     + ("" if o["measured_gib"] is None or a["measured_gib"] is None else
                        f", {o['measured_gib']:.1f} vs {a['measured_gib']:.1f} GiB"))
    out[0]["verdict"] = "baseline"
    return out


def _verdict_at_least(what: str, measured: float, claimed: float, unit: str) -> str:
    held = measured >= claimed
    m = f"{measured:.0f}{unit}" if unit == "%" else f"{measured:.2f}{unit}"
    c = f"{claimed:.0f}{unit}" if unit == "%" else f"{claimed:.2f}{unit}"
    return f"{what} {m} vs claimed {c}: {'held' if held else 'did not hold'}"


def verdict_b1(fp32: Dict[str, object], fp16: Dict[str, object]) -> Dict[str, object]:
    """Claim B1 (fp16 saves about 50% of memory and trains 1.5-2x faster) against two rows."""
    if fp32.get("img_per_s") is None or fp16.get("img_per_s") is None:
        raise ValueError("fp32 and fp16 rows must both hold measurements (status ok)")
    speedup = fp16["img_per_s"] / fp32["img_per_s"]
    saving = None
    if fp32.get("peak_allocated_gib") and fp16.get("peak_allocated_gib") is not None:
        saving = 100 * (1 - fp16["peak_allocated_gib"] / fp32["peak_allocated_gib"])
    lo, hi = B1_CLAIM["speedup_low"], B1_CLAIM["speedup_high"]
    speed = ("within the claimed 1.5-2x" if lo <= speedup <= hi else
             "faster than claimed" if speedup > hi else "slower than claimed")
    if saving is None:
        mem = "memory not measured on this device"
    else:
        mem = ("about the claimed 50%" if abs(saving - 50) <= 10 else
               "more than claimed" if saving > 50 else "less than claimed")
    mem_text = "n/a" if saving is None else f"{saving:.0f}%"
    text = (f"claim B1: fp16 saves ~50% memory and is 1.5-2x faster; measured here: "
            f"{speedup:.2f}x ({speed}), memory saved {mem_text} ({mem})")
    return {"speedup": speedup, "memory_saving_pct": saving, "speed_verdict": speed,
            "memory_verdict": mem, "text": text,
            "held": (lo <= speedup and (saving is None or saving >= 40))}


PUBLISHED_FASTEST = {"img_per_s": 7950.0, "batch_size": 256,
                     "source": "MLPerf Training v4.0, ResNet-50 on H200 with fused MXNet; MLPerf "
                               "publishes time to train, this per-GPU throughput is derived from "
                               "it, the best such figure published"}


def fastest_row(rows: Sequence[Dict[str, object]]) -> Optional[Dict[str, object]]:
    """The row with the most img/s among those that ran (status ok) and kept a finite loss, or None.

    A configuration whose loss went non-finite is fast at nothing useful, so it cannot win.
    """
    ok = [r for r in rows if _trained(r)]
    return max(ok, key=lambda r: r["img_per_s"]) if ok else None


def _trained(row) -> bool:
    """A measured row (status ok, img/s > 0) whose loss stayed finite."""
    return (isinstance(row, dict) and row.get("status") == "ok"
            and isinstance(row.get("img_per_s"), (int, float)) and row["img_per_s"] > 0
            and isinstance(row.get("loss"), (int, float)) and math.isfinite(row["loss"]))


def verdict_fastest(row: Dict[str, object], fp32: Dict[str, object]) -> Dict[str, object]:
    """The fastest measured step against fp32 (same run) and ``PUBLISHED_FASTEST``."""
    for name, r in (("row", row), ("fp32", fp32)):
        if not _trained(r):
            raise ValueError(f"{name} must be a measured row (status ok, img_per_s > 0, finite "
                             f"loss); got {r!r}"[:300])
    ref = PUBLISHED_FASTEST["img_per_s"]
    share = row["img_per_s"] / ref
    text = (f"fastest here: {row['label']} at {row['img_per_s']:,.0f} img/s "
            f"({row['img_per_s'] / fp32['img_per_s']:.2f}x fp32 with TF32 off, batch "
            f"{(row.get('config') or {}).get('batch_size', '?')}); "
            f"{share:.0%} of the published {ref:,.0f} img/s ({PUBLISHED_FASTEST['source']})")
    if row.get("timer") == "perf_counter":
        text += "; timed on a CPU at small sizes here, so not comparable with that GPU figure"
    return {"img_per_s": row["img_per_s"], "share_of_published": share, "beats_published": share > 1,
            "text": text}


R6_COLUMNS = (("configuration", "R6 row"), ("measured_label", "measured as"),
              ("claimed_gib", "claimed GB"), ("measured_gib", "measured GiB"),
              ("claimed_saving_pct", "claimed saved %"), ("measured_saving_pct", "saved %"),
              ("claimed_img_per_s", "claimed img/s"), ("measured_img_per_s", "img/s"),
              ("claimed_speedup", "claimed x"), ("measured_speedup", "x"), ("verdict", "verdict"))

ACCURACY_COLUMNS = (("label", "run"), ("accuracy", "test acc (autocast)"),
                    ("accuracy_fp32_eval", "test acc (fp32 eval)"), ("final_loss", "last epoch loss"),
                    ("skipped_steps", "skipped"), ("steps", "steps"), ("status", "status"))


def verdict_r4(amp: Dict[str, object], r4: Dict[str, object], amp_run: Dict[str, object],
               r4_run: Dict[str, object], tolerance: float = 0.01) -> Dict[str, object]:
    """Claim R4 (layer3/4 + fc in fp32 keep accuracy) in numbers: speed, memory, accuracy.

    ``amp``/``r4`` are benchmark rows, ``amp_run``/``r4_run`` digits runs. The claim holds
    where the fp32 layers buy accuracy (more than ``tolerance``) that plain AMP lacks.
    """
    for name, row, key in (("amp", amp, "img_per_s"), ("r4", r4, "img_per_s"),
                           ("amp_run", amp_run, "accuracy"), ("r4_run", r4_run, "accuracy")):
        if row.get(key) is None:
            raise ValueError(f"{name} must hold a measurement ({key}); got status "
                             f"{row.get('status')!r}")
    speed = r4["img_per_s"] / amp["img_per_s"]
    mem = _ratio(r4.get("peak_allocated_gib"), amp.get("peak_allocated_gib"))
    acts = _ratio(r4.get("activations_gib"), amp.get("activations_gib"))
    gain = r4_run["accuracy"] - amp_run["accuracy"]
    held = gain > tolerance
    text = (f"claim R4: forcing layer3, layer4 and fc to fp32 keeps accuracy; measured: "
            f"speed x{speed:.2f}, "
            + (f"peak memory x{mem:.2f}, " if mem is not None else "")
            + f"saved activations x{acts:.2f}, accuracy {100 * r4_run['accuracy']:.1f}% vs "
            f"{100 * amp_run['accuracy']:.1f}% with plain AMP: "
            + ("the fp32 layers bought accuracy" if held else
               "no accuracy to win back: plain AMP already matched it"))
    return {"speed_ratio": speed, "memory_ratio": mem, "activations_ratio": acts,
            "accuracy_gain": gain, "held": held, "text": text}


def verdict_r7(runs: Sequence[Dict[str, object]], tolerance: float = 0.01) -> Dict[str, object]:
    """Claim R7 (validate with autocast off if accuracy drops): the largest accuracy difference
    between evaluating under autocast and in fp32, over the half-precision runs."""
    half = [r for r in runs if r.get("precision") in _AMP_DTYPES and r.get("accuracy") is not None]
    if not half:
        raise ValueError("runs must hold at least one fp16 or bf16 run that ran")
    diffs = [r["accuracy_fp32_eval"] - r["accuracy"] for r in half]
    worst = max(diffs, key=abs)
    held = worst > tolerance
    text = (f"claim R7: validate with autocast disabled if accuracy drops; measured: fp32 "
            f"evaluation changed accuracy by at most {100 * worst:+.2f} points over "
            f"{len(half)} half-precision runs: "
            + ("fp32 evaluation recovered accuracy" if held else
               "autocast evaluation lost nothing to recover"))
    return {"max_difference": worst, "held": held, "text": text}


def verdict_r12(op_rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """Claim R12 (attention is more precision-sensitive than convolutions) from
    ``autocast_error_by_op`` rows: worst attention error over the convolution's error."""
    conv = [r["rel_error"] for r in op_rows if r["op"].startswith("conv")]
    attn = [r["rel_error"] for r in op_rows if r["op"].startswith("attention")]
    if not conv or not attn:
        raise ValueError("op_rows must hold convolution and attention rows")
    ratio = max(attn) / max(conv)
    held = ratio > 1.5
    text = (f"claim R12: attention is more precision-sensitive than convolutions; measured: "
            f"attention's relative error is up to {ratio:.1f}x the convolution's "
            + ("and grows with sharper softmax logits: held" if held else ": did not hold"))
    return {"ratio": ratio, "held": held, "text": text}


def adam_precision_facts(device=None) -> Dict[str, object]:
    """Claim R5's "fp16 division by zero": which dtype Adam computes in under AMP.

    One fp16 autocast step of a small model with Adam: parameters, gradients and Adam's state
    are float32, so eps never meets float16. For contrast, what float16 would make of 1e-8 and
    1e-7.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = model(torch.randn(4, 8, device=device))
    out.float().pow(2).mean().backward()
    grad_dtype = model[0].weight.grad.dtype
    opt.step()
    state = opt.state[model[0].weight]
    return {"autocast_dtype": str(dtype), "activation_dtype": str(out.dtype),
            "param_dtype": str(model[0].weight.dtype), "grad_dtype": str(grad_dtype),
            "exp_avg_sq_dtype": str(state["exp_avg_sq"].dtype),
            "eps_1e-8_in_fp16": float(torch.tensor(1e-8, dtype=torch.float16)),
            "eps_1e-7_in_fp16": float(torch.tensor(1e-7, dtype=torch.float16)),
            "eps_1e-8_in_fp32": float(torch.tensor(1e-8, dtype=torch.float32))}


def multi_tensor_status() -> Dict[str, object]:
    """Claim R5's ``torch.optim._multi_tensor``: does it exist in this PyTorch, and what is it?

    Where it exists, its ``Adam`` is built on one dummy parameter to read what it really is:
    a subclass of ``torch.optim.Adam`` and the ``foreach`` setting it fixes.
    """
    try:
        mod = importlib.import_module("torch.optim._multi_tensor")
    except ImportError as exc:
        return {"exists": False, "has_adam": False, "subclass_of_adam": False, "foreach": None,
                "error": f"{type(exc).__name__}: {exc}"}
    adam = getattr(mod, "Adam", None)
    out = {"exists": True, "has_adam": adam is not None, "subclass_of_adam": False,
           "foreach": None, "error": ""}
    if adam is not None:
        out["subclass_of_adam"] = isinstance(adam, type) and issubclass(adam, torch.optim.Adam)
        out["foreach"] = adam([nn.Parameter(torch.zeros(1))]).defaults.get("foreach")
    return out


# --- Lesson 05: techniques, card sizes, accumulation ---------------------------------------------
# What lesson 05 measures: the checkpoint_sequential pitfall on torchvision's ResNet-50, that
# per-block checkpointing computes the same step (BatchNorm statistics included), memory against
# time per technique (claim R8), the largest batch per simulated card (claim R10), memory per
# micro-batch count (claim R9) and exact resume with and without the scaler's state.

TECHNIQUES: Dict[str, Dict[str, object]] = {
    # fp32 runs with TF32 tensor-core math where the GPU has it (cuDNN's default for
    # convolutions); its memory is the same as with TF32 off, and the searches run twice as fast.
    "fp32": {"precision": "tf32", "checkpoint": False},
    "fp32 + checkpointing": {"precision": "tf32", "checkpoint": True},
    "AMP": {"precision": "fp16", "checkpoint": False},
    "AMP + checkpointing": {"precision": "fp16", "checkpoint": True},
    "bf16": {"precision": "bf16", "checkpoint": False},
    "bf16 + checkpointing": {"precision": "bf16", "checkpoint": True},
}
CARD_TECHNIQUES = ("fp32", "AMP", "AMP + checkpointing", "bf16 + checkpointing")
CARD_SIZES_GB = (8, 12, 16, 24, 40, 80)

R8_CLAIM = ("R8: gradient checkpointing saves another 20-30% of memory for about 30% more "
            "compute time")
R8_MEMORY_PCT, R8_TIME_PCT = (20.0, 30.0), (20.0, 40.0)  # "about 30%": 20-40% counts as held
R9_CLAIM = "R9: gradient accumulation gives a larger virtual batch at the same memory"
R10_CLAIMS = (
    "R10: one card under 12 GB: AMP + checkpointing, 50-60% memory saved",
    "R10: one card of 12 GB or more: AMP + gradient accumulation, 40-50% memory saved",
    "R10: several 8 GB cards: AMP + ZeRO stage 1, 60-70% saved",
    "R10: AMP + model parallelism, 40-50% saved",
)


def _check_techniques(techniques: Sequence[str]) -> List[str]:
    techniques = list(techniques)
    if not techniques:
        raise ValueError(f"techniques must name at least one of {', '.join(TECHNIQUES)}")
    for t in techniques:
        _check_choice("technique", t, tuple(TECHNIQUES))
    if len(set(techniques)) != len(techniques):
        raise ValueError(f"techniques must not repeat; got {techniques!r}")
    return techniques


def technique_configs(techniques: Sequence[str] = tuple(TECHNIQUES), model: str = "resnet50",
                      batch_size: int = 64, image_size: int = 224, num_classes: int = 1000,
                      channels_last: bool = False, checkpoint: str = "block") -> List[BenchConfig]:
    """One ``BenchConfig`` per technique of ``TECHNIQUES``, labelled with the technique's name.

    ``checkpoint`` is the unit a checkpointing technique recomputes: ``"block"`` (each residual
    block) or ``"stage"`` (each of layer1..layer4). cuDNN's benchmark mode is left off, so a
    new batch size costs no autotuning (the largest-batch search tries many).
    """
    _check_choice("checkpoint", checkpoint, ("block", "stage"))
    return [BenchConfig(label=t, model=model, precision=TECHNIQUES[t]["precision"],
                        checkpoint=checkpoint if TECHNIQUES[t]["checkpoint"] else None,
                        channels_last=channels_last, batch_size=batch_size,
                        image_size=image_size, num_classes=num_classes, cudnn_benchmark=False)
            for t in _check_techniques(techniques)]


# --- the checkpoint_sequential pitfall, and checkpointing done per block -------------------------

def checkpoint_sequential_pitfall(segments: int = 4, image_size: int = 32, batch_size: int = 2,
                                  device=None, seed: int = 0,
                                  model: str = "resnet50") -> Dict[str, object]:
    """``checkpoint_sequential`` over torchvision's ResNet-50 children: the error, and why.

    The children (conv1, bn1, relu, maxpool, layer1..4, avgpool, then flatten and fc) are cut
    into ``segments`` equal segments, as ``torch.utils.checkpoint.checkpoint_sequential(...,
    use_reentrant=False)`` does; with 4 or more, one segment starts with the stem's
    ``ReLU(inplace=True)``, which overwrites that segment's input: the tensor the checkpoint keeps
    to replay the segment in backward. Returns ``error`` (the message, "" if backward ran),
    ``segments`` (module names per segment; the last runs without checkpointing),
    ``inplace_first`` (checkpointed segments that start with an in-place module) and
    ``batchnorm_updates_per_step``: how often bn1's statistics moved in one step once the ReLU
    is made out-of-place (2: recomputation runs BatchNorm again). ``model="resnet18"`` uses
    torchvision's ResNet-18, whose stem is the same (a quicker run on a CPU).
    """
    from collections import OrderedDict

    import torchvision.models
    from torch.utils.checkpoint import checkpoint_sequential

    _check_choice("model", model, ("resnet18", "resnet50"))

    _check_int("segments", segments, 2)
    _check_int("image_size", image_size, 32)
    _check_int("batch_size", batch_size, 2)
    device = torch.device(device) if device is not None else torch.device("cpu")
    torch.manual_seed(seed)
    net = getattr(torchvision.models, model)(weights=None, num_classes=10).to(device).train()
    children = list(net.named_children())
    seq = nn.Sequential(OrderedDict(children[:-1] + [("flatten", nn.Flatten())] + children[-1:]))
    names = list(seq._modules)
    if segments > len(names):
        raise ValueError(f"segments must be in [2, {len(names)}]; got {segments}")
    size = len(names) // segments  # the split checkpoint_sequential makes
    cut = size * (segments - 1)
    parts = [names[i:i + size] for i in range(0, cut, size)] + [names[cut:]]
    inplace_first = [p for p in parts[1:-1] if getattr(seq._modules[p[0]], "inplace", False)]
    x, y = synthetic_images(batch_size, image_size, 10, device, seed=seed)

    def step() -> None:
        out = checkpoint_sequential(seq, segments, x, use_reentrant=False)
        F.cross_entropy(out, y).backward()
        net.zero_grad(set_to_none=True)

    error = ""
    try:
        step()
    except RuntimeError as exc:
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.split(' Hint:')[0]}"
    net.relu.inplace = False  # the stem's ReLU out of place: the segments no longer clash
    before = int(net.bn1.num_batches_tracked)
    step()
    updates = int(net.bn1.num_batches_tracked) - before
    del net, seq, x, y
    free_memory(device)
    return {"error": error, "segments": parts, "inplace_first": inplace_first,
            "batchnorm_updates_per_step": updates}


class CheckpointedWithoutBatchNormFix(_models.Checkpointed):
    """``models.Checkpointed`` without its BatchNorm fix, for comparison only: recomputing the
    block in backward runs its BatchNorm layers in training mode again, so their running
    statistics move twice per step."""

    def _contexts(self):
        return nullcontext(), nullcontext()


def without_batchnorm_fix(model: nn.Module) -> nn.Module:
    """Turn every ``Checkpointed`` unit of ``model`` into ``CheckpointedWithoutBatchNormFix``
    (in place; returns ``model``)."""
    for m in model.modules():
        if type(m) is _models.Checkpointed:
            m.__class__ = CheckpointedWithoutBatchNormFix
    return model


def _batchnorm_buffers(model: nn.Module) -> List[torch.Tensor]:
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for name, b in m.named_buffers() if name != "num_batches_tracked"]


def _relative_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for s, t in zip(a, b):
        s, t = s.detach().double(), t.detach().double()
        worst = max(worst, float((s - t).abs().max() / t.abs().max().clamp_min(1e-12)))
    return worst


@contextmanager
def deterministic_kernels() -> Iterator[None]:
    """cuDNN in deterministic mode, benchmark off (restored on exit), so two runs of the same
    step on a GPU give the same bits, as they do on a CPU."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


def checkpoint_equivalence(model: str = "resnet18", checkpoint: str = "block",
                           image_size: int = 32, batch_size: int = 4, num_classes: int = 10,
                           device=None, seed: int = 0) -> Dict[str, object]:
    """One SGD step of a plain ResNet and of the same weights checkpointed, compared.

    Three models start from the same weights: plain, checkpointed (``models.Checkpointed``,
    which restores BatchNorm buffers after recomputation) and checkpointed without that fix.
    Returns ``loss_diff`` (absolute), ``grad_rel_diff`` and ``weight_rel_diff`` (largest
    relative difference over parameters after the step), ``bn_rel_diff`` and
    ``bn_rel_diff_without_fix`` (running mean and variance against the plain model), and the
    ``num_batches_tracked`` of bn1 in the first residual block for each: 1, 1 and 2.
    """
    _check_choice("model", model, ("resnet18", "resnet50"))
    _check_choice("checkpoint", checkpoint, ("block", "stage"))
    device = torch.device(device) if device is not None else torch.device("cpu")
    x, y = synthetic_images(batch_size, image_size, num_classes, device, seed=seed)
    out: Dict[str, object] = {"model": model, "checkpoint": checkpoint}
    nets = {}
    with deterministic_kernels():
        for name, mode in (("plain", None), ("checkpointed", checkpoint),
                           ("without_fix", checkpoint)):
            torch.manual_seed(seed)  # same construction order, so the same initial weights
            net = MODELS[model](num_classes=num_classes, checkpoint=mode).to(device).train()
            if name == "without_fix":
                without_batchnorm_fix(net)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            grads = [p.grad.detach().clone() for p in net.parameters()]
            opt.step()
            nets[name] = (net, float(loss.detach()), grads)
    plain, ckpt, unfixed = nets["plain"], nets["checkpointed"], nets["without_fix"]

    def first_block_bn1(net: nn.Module) -> int:
        bn = [m for n, m in net.named_modules() if n.startswith("layer1")
              and isinstance(m, nn.BatchNorm2d)][0]
        return int(bn.num_batches_tracked)

    out.update(
        loss_diff=abs(ckpt[1] - plain[1]),
        grad_rel_diff=_relative_diff(ckpt[2], plain[2]),
        weight_rel_diff=_relative_diff(list(ckpt[0].parameters()), list(plain[0].parameters())),
        bn_rel_diff=_relative_diff(_batchnorm_buffers(ckpt[0]), _batchnorm_buffers(plain[0])),
        bn_rel_diff_without_fix=_relative_diff(_batchnorm_buffers(unfixed[0]),
                                               _batchnorm_buffers(plain[0])),
        batches_tracked={"plain": first_block_bn1(plain[0]),
                         "checkpointed": first_block_bn1(ckpt[0]),
                         "checkpointed without the fix": first_block_bn1(unfixed[0])})
    del nets, plain, ckpt, unfixed
    free_memory(device)
    return out


# --- memory counted tensor by tensor (CPUs have no peak-memory counter) -------------------------

def counted_step_memory(config: BenchConfig, device=None,
                        batch_size: Optional[int] = None) -> Dict[str, int]:
    """What a training step of ``config`` holds at its peak, counted tensor by tensor, in bytes.

    For devices without an allocator to read (a CPU): ``state_bytes`` (parameters, gradients,
    optimizer state), ``kept_bytes`` (tensors saved for backward, and the inputs that
    checkpointed units keep), ``recompute_bytes`` (what the largest checkpointed unit saves while
    it is recomputed in backward, 0 without checkpointing) and ``peak_bytes``, their sum. A
    model of the peak, not a measurement of it: temporaries and allocator overhead are left out.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    batch = config.batch_size if batch_size is None else batch_size
    _check_int("batch_size", batch, 1)
    with precision_settings(config.precision, device):
        torch.manual_seed(0)
        model = build_model(config, device)
        optimizer = build_optimizer(config, model.parameters())
        x, y = synthetic_images(batch, config.image_size, config.num_classes, device,
                                channels_last=config.channels_last)
        params = list(model.parameters())
        step = hand_step(model, optimizer, config.precision, device)
        inputs: Dict[object, int] = {}
        recompute = [0]

        def measure_unit(unit, args, output):
            t = args[0]
            key = _storage_key(t)
            if key is not None:
                inputs[key] = t.untyped_storage().nbytes()
            with torch.enable_grad(), SavedActivations(exclude=params) as inner, \
                    _models._KeepBatchNormStats(unit.module):
                unit.module(t.detach().requires_grad_())
            recompute[0] = max(recompute[0], inner.bytes)

        handles = [m.register_forward_hook(measure_unit) for m in model.modules()
                   if isinstance(m, _models.Checkpointed)]
        try:
            with SavedActivations(exclude=params) as kept:
                loss = step.forward(x, y)
        finally:
            for h in handles:
                h.remove()
        step.backward(loss)
        grads = tensor_bytes(p.grad for p in params if p.grad is not None)
        step.update()  # creates the optimizer state that every later step holds
        if not optimizer_state_tensors(optimizer):  # fp16: GradScaler skipped that first step
            step(x, y)
        state = (tensor_bytes(params) + grads
                 + tensor_bytes(optimizer_state_tensors(optimizer)))
        kept_bytes = kept.bytes + sum(v for k, v in inputs.items() if k not in kept._sizes)
    del model, optimizer, step, x, y, loss
    free_memory(device)
    return {"state_bytes": state, "kept_bytes": kept_bytes, "recompute_bytes": recompute[0],
            "peak_bytes": state + kept_bytes + recompute[0]}


def counted_memory_model(config: BenchConfig, device=None,
                         batch_sizes: Sequence[int] = (2, 4)) -> Dict[str, float]:
    """A straight line through ``counted_step_memory`` at two batch sizes:
    ``peak_bytes(b) = fixed_bytes + bytes_per_image * b`` (what the CPU's simulated cards use)."""
    if len(batch_sizes) != 2 or batch_sizes[0] >= batch_sizes[1]:
        raise ValueError(f"batch_sizes must be two increasing batch sizes; got {batch_sizes!r}")
    lo, hi = (counted_step_memory(config, device, b)["peak_bytes"] for b in batch_sizes)
    per_image = max(0.0, (hi - lo) / (batch_sizes[1] - batch_sizes[0]))
    return {"fixed_bytes": lo - per_image * batch_sizes[0], "bytes_per_image": per_image}


# --- memory against time per technique (claim R8) ------------------------------------------------

def technique_table(techniques: Sequence[str] = tuple(TECHNIQUES), device=None,
                    model: str = "resnet50", batch_size: int = 64, image_size: int = 224,
                    num_classes: int = 1000, channels_last: bool = False,
                    checkpoint: str = "block", warmup: int = 3,
                    steps: int = 10) -> List[Dict[str, object]]:
    """Step time and memory of each technique at one batch size (``run_configs`` rows).

    Adds ``technique``, ``memory_gib`` and ``memory_source``: the peak allocated memory on a
    GPU; on a CPU, ``counted_step_memory``'s model of the peak (``activations_gib`` there holds
    what is kept for backward). Rows that cannot run here say why (``status``, ``reason``).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    configs = technique_configs(techniques, model=model, batch_size=batch_size,
                                image_size=image_size, num_classes=num_classes,
                                channels_last=channels_last, checkpoint=checkpoint)
    cuda = device.type == "cuda"
    rows = run_configs(configs, device, warmup=warmup, steps=steps, breakdown=cuda,
                       progress=False)
    for config, row in zip(configs, rows):
        row["technique"] = config.label
        row["memory_gib"], row["memory_source"] = None, ""
        if row["status"] != "ok":
            continue
        if cuda:
            row["memory_gib"] = row["peak_allocated_gib"]
            row["memory_source"] = "peak allocated (CUDA)"
        else:
            counted = counted_step_memory(config, device)
            row["memory_gib"] = counted["peak_bytes"] / GIB
            row["activations_gib"] = (counted["kept_bytes"] + counted["recompute_bytes"]) / GIB
            row["memory_source"] = "counted (no peak counter on a CPU)"
    return rows


def _range_verdict(measured: float, low: float, high: float, what: str) -> str:
    if measured < low:
        return f"{what} {measured:.0f}%: less than the claimed {low:.0f}-{high:.0f}%"
    if measured > high:
        return f"{what} {measured:.0f}%: more than the claimed {low:.0f}-{high:.0f}%"
    return f"{what} {measured:.0f}%: within the claimed {low:.0f}-{high:.0f}%"


def _by_technique(rows: Sequence[Dict[str, object]]) -> Dict[str, Dict[str, object]]:
    return {r.get("technique", r.get("label")): r for r in rows if r.get("status") == "ok"}


def checkpointing_costs(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per technique pair (X, X + checkpointing) in ``technique_table`` rows: memory saved and
    time added by checkpointing, in percent, with claim R8's verdict on each."""
    ok = _by_technique(rows)
    out = []
    for base in ("AMP", "bf16", "fp32"):
        plain, ckpt = ok.get(base), ok.get(f"{base} + checkpointing")
        if plain is None or ckpt is None or not plain.get("memory_gib"):
            continue
        saved = 100 * (1 - ckpt["memory_gib"] / plain["memory_gib"])
        added = 100 * (ckpt["step_ms"] / plain["step_ms"] - 1)
        out.append({"pair": f"{base} -> {base} + checkpointing",
                    "memory_gib": plain["memory_gib"],
                    "memory_gib_checkpointed": ckpt["memory_gib"],
                    "memory_saved_pct": saved, "time_added_pct": added,
                    "memory_verdict": _range_verdict(saved, *R8_MEMORY_PCT, "memory saved"),
                    "time_verdict": _range_verdict(added, *R8_TIME_PCT, "time added")})
    return out


def claim_r8(rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """Claim R8 ("another 20-30% of memory for about 30% more time") against the AMP pair of
    ``technique_table`` rows (the bf16 or fp32 pair when AMP could not run): claim, measured,
    verdict, and ``held`` (both halves within the claim's ranges)."""
    costs = checkpointing_costs(rows)
    if not costs:
        return {"claim": R8_CLAIM, "measured": "-", "held": None,
                "verdict": "not measured: no technique ran both with and without checkpointing"}
    c = costs[0]
    mem_ok = R8_MEMORY_PCT[0] <= c["memory_saved_pct"] <= R8_MEMORY_PCT[1]
    time_ok = R8_TIME_PCT[0] <= c["time_added_pct"] <= R8_TIME_PCT[1]
    return {"claim": R8_CLAIM, "pair": c["pair"],
            "measured": f"{c['memory_gib']:.3g} -> {c['memory_gib_checkpointed']:.3g} GiB "
                        f"({c['memory_saved_pct']:.0f}% saved), step time "
                        f"{c['time_added_pct']:+.0f}%",
            "held": mem_ok and time_ok,
            "verdict": f"{c['memory_verdict']}; {c['time_verdict']}"}


# --- the largest batch per simulated card (claim R10) -------------------------------------------

def _allocation_failure(exc: BaseException) -> bool:
    text = str(exc).upper()
    return is_out_of_memory(exc) or "ALLOC_FAILED" in text


def _gpu_trials(config: BenchConfig, device: torch.device):
    """A model and optimizer that live through every trial (they would be on the card anyway);
    ``make(batch)`` returns a callable that runs one training step on a fresh batch."""
    torch.manual_seed(0)
    model = build_model(config, device)
    optimizer = build_optimizer(config, model.parameters())

    def make(batch: int) -> Callable[[], object]:
        model.zero_grad(set_to_none=True)  # a failed trial may have left gradients behind
        step = hand_step(model, optimizer, config.precision, device)
        x, y = synthetic_images(batch, config.image_size, config.num_classes, device,
                                channels_last=config.channels_last)

        def run():
            try:
                return step(x, y)
            except RuntimeError as exc:
                if _allocation_failure(exc):  # cuDNN/cuBLAS say so in their own words
                    raise MemoryError(str(exc)) from None
                raise

        return run

    return model, optimizer, make


def _reserved_peak(make: Callable[[int], Callable[[], object]], batch: int,
                   device: torch.device) -> int:
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    run = make(batch)
    run()
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    del run
    free_memory(device)
    return peak


def _card_row(card: float, technique: str, **values) -> Dict[str, object]:
    row = {"card_gb": card, "technique": technique, "largest_batch": None, "resolution": None,
           "peak_gib": None, "trials": 0, "seconds": 0.0, "status": "ok", "reason": "",
           "how": ""}
    row.update(values)
    return row


def largest_batch_table(card_sizes_gb: Sequence[float] = CARD_SIZES_GB,
                        techniques: Sequence[str] = CARD_TECHNIQUES, device=None,
                        model: str = "resnet50", image_size: int = 224, num_classes: int = 1000,
                        channels_last: bool = False, checkpoint: str = "block",
                        time_budget_s: Optional[float] = None, resolution_parts: int = 16,
                        max_batch: int = 8192) -> List[Dict[str, object]]:
    """The largest batch that trains per simulated card size and technique, with ``largest_batch``.

    On a GPU each card is simulated by capping this process's allocator at ``card`` GiB
    (``memory_cap``); a card larger than the device is skipped with the reason. The model and
    optimizer are built once per technique and stay through the search (they would be on the
    card anyway). Two uncapped steps at small batches predict the answer; the search then runs
    in units of ``resolution`` images (the largest power of two at most the prediction divided
    by ``resolution_parts``) from just below the prediction, so each card takes a handful of
    trials of two steps each.
    ``time_budget_s`` is shared equally among the techniques; cards left when a technique's share
    is spent are skipped with the reason (largest cards first, since cards run smallest first).

    On a CPU there is no allocator to cap: the same search runs on ``counted_memory_model``
    (memory counted tensor by tensor at two batch sizes) instead, without running steps.
    One row per card and technique: ``largest_batch`` (images; None if skipped),
    ``resolution``, ``peak_gib`` (of the largest trial that fit), ``trials``, ``seconds``,
    ``status`` ("ok" | "skipped"), ``reason`` and ``how`` (what enforced the cap).
    """
    techniques = _check_techniques(techniques)
    cards = list(card_sizes_gb)
    if not cards or any(not isinstance(c, (int, float)) or isinstance(c, bool) or c <= 0
                        for c in cards):
        raise ValueError(f"card_sizes_gb must hold numbers > 0 (GB); got {card_sizes_gb!r}")
    _check_int("resolution_parts", resolution_parts, 1)
    _check_int("max_batch", max_batch, 1)
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s must be None or > 0 seconds; got {time_budget_s!r}")
    cards = sorted(cards)
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    total_gib = torch.cuda.get_device_properties(device).total_memory / GIB if cuda else None
    configs = technique_configs(techniques, model=model, batch_size=8, image_size=image_size,
                                num_classes=num_classes, channels_last=channels_last,
                                checkpoint=checkpoint)
    share = time_budget_s / len(configs) if time_budget_s else None
    rows: List[Dict[str, object]] = []
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # no autotuning per new batch size
    try:
        for config in configs:
            rows += _largest_for_technique(config, cards, device, total_gib, share,
                                           resolution_parts, max_batch)
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
    return rows


def _largest_for_technique(config: BenchConfig, cards: Sequence[float], device: torch.device,
                           total_gib: Optional[float], share: Optional[float],
                           resolution_parts: int, max_batch: int) -> List[Dict[str, object]]:
    reason = skip_reason(config, device)
    if reason is None:
        try:
            _trainer.check_precision(config.precision, device)
        except ValueError as exc:
            reason = str(exc)
    if reason:
        return [_card_row(c, config.label, status="skipped", reason=reason) for c in cards]
    start = time.perf_counter()
    cuda = device.type == "cuda"
    rows: List[Dict[str, object]] = []
    model = optimizer = make = None
    with precision_settings(config.precision, device):
        try:
            if cuda:
                lo, hi = 8, 32
                try:
                    model, optimizer, make = _gpu_trials(config, device)
                    free_memory(device)
                    make(2)()  # optimizer state exists from here on
                    p_lo, p_hi = (_reserved_peak(make, b, device) for b in (lo, hi))
                except Exception as exc:  # noqa: BLE001 - a device too small for the prediction
                    if not is_out_of_memory(exc):
                        raise
                    return [_card_row(c, config.label, status="skipped",
                                      reason=f"out of memory at batch {hi} without any cap")
                            for c in cards]
                per_image = (p_hi - p_lo) / (hi - lo)
                fixed = p_lo - per_image * lo
                peak_bytes, how = None, "CUDA allocator capped at {card:g} GiB"
            else:
                line = counted_memory_model(config, device)
                fixed, per_image = line["fixed_bytes"], line["bytes_per_image"]
                make = lambda b: (lambda: None)  # noqa: E731 - the model decides, no step runs
                peak_bytes = lambda b: int(fixed + per_image * b)  # noqa: E731
                how = "counted memory model (a CPU has no allocator cap)"
            for card in cards:
                if cuda and card > total_gib:
                    rows.append(_card_row(card, config.label, status="skipped",
                                          reason=f"this device has {total_gib:.1f} GiB: a "
                                                 f"{card:g} GB card cannot be simulated"))
                    continue
                if share is not None and time.perf_counter() - start > share:
                    rows.append(_card_row(card, config.label, status="skipped",
                                          reason=f"left out: this technique's share of the "
                                                 f"time budget ({share:.0f} s) was spent"))
                    continue
                t0 = time.perf_counter()
                predicted = max(1.0, (card * GIB - fixed) / max(per_image, 1.0))
                resolution = 1
                while resolution * 2 <= predicted / resolution_parts:
                    resolution *= 2
                first = max(1, int(0.85 * predicted / resolution))
                limit = max(first, min(max_batch // resolution,
                                       math.ceil(1.5 * predicted / resolution)))
                found = largest_batch(
                    lambda k, r=resolution: make(k * r), int(card * GIB),
                    device=device if cuda else None, start=first, limit=limit,
                    peak_bytes=None if cuda else (lambda k, r=resolution: peak_bytes(k * r)))
                rows.append(_finish_row(card, config.label, found, resolution,
                                        limit * resolution, time.perf_counter() - t0,
                                        how.format(card=card)))
        finally:
            del model, optimizer, make
            free_memory(device)
    return rows


def _finish_row(card: float, technique: str, found: LargestBatch, resolution: int, limit: int,
                seconds: float, how: str) -> Dict[str, object]:
    batch = found.batch_size * resolution
    fit = [t for t in found.trials if t["fits"] and t["batch_size"] == found.batch_size]
    row = _card_row(card, technique, largest_batch=batch, resolution=resolution,
                    peak_gib=fit[-1]["peak_gib"] if fit else None, trials=len(found.trials),
                    seconds=seconds, how=how)
    if batch == 0:
        row["reason"] = "not even the smallest batch fits"
    elif batch >= limit:
        row["reason"] = f"fits at the search limit ({limit}): the largest batch is at least this"
    return row


def technique_report_rows(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """``technique_table`` rows as a table to show and publish: step time, throughput, memory,
    and memory and time against the fp32 row (None where a number is missing)."""
    ok = _by_technique(rows)
    base = ok.get("fp32")
    out = []
    for r in rows:
        good = r.get("status") == "ok"
        out.append({
            "technique": r.get("technique", r.get("label")),
            "batch": r.get("config", {}).get("batch_size"),
            "step ms": r.get("step_ms") if good else None,
            "img/s": r.get("img_per_s") if good else None,
            "memory GiB": r.get("memory_gib") if good else None,
            "memory x fp32": _ratio(r.get("memory_gib"), base.get("memory_gib"))
            if good and base else None,
            "time x fp32": _ratio(r.get("step_ms"), base.get("step_ms")) if good and base else None,
            "status": "ok" if good else f"{r.get('status')}: {r.get('reason')}"})
    return out


def largest_batch_report_rows(rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """``largest_batch_table`` rows pivoted to one row per card, one column per technique (the
    largest batch in images; None where skipped). Returns ``rows``, ``columns`` and ``note``
    (the search's resolution and every reason a cell was skipped or capped, once each)."""
    if not rows:
        raise ValueError("rows must hold at least one largest_batch_table row")
    techniques = list(dict.fromkeys(r["technique"] for r in rows))
    cards = sorted({r["card_gb"] for r in rows})
    table = []
    for card in cards:
        line: Dict[str, object] = {"card (GB)": f"{card:g}"}
        for t in techniques:
            cell = next((r for r in rows if r["card_gb"] == card and r["technique"] == t), None)
            line[t] = cell["largest_batch"] if cell and cell["status"] == "ok" else None
        table.append(line)
    reasons = list(dict.fromkeys(f"{r['technique']}: {r['reason']}" for r in rows if r["reason"]))
    how = sorted({r["how"].split(" at ")[0] for r in rows if r["how"]})
    steps = sorted({r["resolution"] for r in rows if r["resolution"]})
    note = (f"Images per training step; searched in steps of {', '.join(map(str, steps))} "
            f"images ({'; '.join(how)}). " if steps else "") + \
        (f"Not measured or capped: {'; '.join(reasons)}." if reasons else "")
    return {"rows": table, "columns": ["card (GB)"] + techniques, "note": note.strip()}


def accumulation_plan(rows: Sequence[Dict[str, object]], target_batch: int) -> Dict[str, object]:
    """How to reach an effective batch of ``target_batch`` on each card with each technique:
    the fewest micro-batches whose size fits (``largest_batch_table`` rows), as ``"n x m"``
    (n micro-batches of m images, n * m >= target_batch), or None where nothing was measured.
    Returns ``rows`` (one per card), ``columns`` and ``note``, like ``largest_batch_report_rows``."""
    _check_int("target_batch", target_batch, 1)
    if not rows:
        raise ValueError("rows must hold at least one largest_batch_table row")
    techniques = list(dict.fromkeys(r["technique"] for r in rows))
    table = []
    for card in sorted({r["card_gb"] for r in rows}):
        line: Dict[str, object] = {"card (GB)": f"{card:g}"}
        for t in techniques:
            cell = next((r for r in rows if r["card_gb"] == card and r["technique"] == t), None)
            largest = cell["largest_batch"] if cell and cell["status"] == "ok" else None
            if not largest:
                line[t] = None
                continue
            n = math.ceil(target_batch / largest)
            line[t] = f"{n} x {math.ceil(target_batch / n)}"
        table.append(line)
    return {"rows": table, "columns": ["card (GB)"] + techniques,
            "note": f"n x m: n micro-batches of m images per optimizer step (accumulate=n), the "
                    f"fewest that reach {target_batch} images with micro-batches that fit."}


def claim_r10(card_rows: Sequence[Dict[str, object]],
              technique_rows: Sequence[Dict[str, object]],
              small_card_gb: float = 12.0) -> List[Dict[str, object]]:
    """Claim R10's recommendations beside what was measured: one row per recommendation with
    ``claim``, ``measured`` and ``verdict`` (computed from ``largest_batch_table`` rows and
    ``technique_table`` rows; the several-card setups say where they are measured instead).
    Where AMP (fp16) did not run but bf16 did, bf16 stands in for it and the row says so.
    ``small_card_gb`` is the claim's line between small and large cards (12 GB)."""
    ok = _by_technique(technique_rows)
    fp32 = ok.get("fp32")
    amp = "AMP" if "AMP" in ok or "bf16" not in ok else "bf16"
    amp_ckpt = f"{amp} + checkpointing"
    note = "" if amp == "AMP" else " (bf16 autocast standing in for AMP)"

    def saved(name: str) -> Optional[float]:
        row = ok.get(name)
        if fp32 is None or row is None or not fp32.get("memory_gib"):
            return None
        return 100 * (1 - row["memory_gib"] / fp32["memory_gib"])

    measured_cards = sorted({r["card_gb"] for r in card_rows if r["status"] == "ok"})

    def batches(card: float) -> Dict[str, int]:
        return {r["technique"]: r["largest_batch"] for r in card_rows
                if r["card_gb"] == card and r["status"] == "ok"}

    def describe(card: float) -> str:
        return f"{card:g} GB: " + ", ".join(f"{t} {b}" for t, b in batches(card).items())

    out = []
    small = [c for c in measured_cards if c < small_card_gb]
    ckpt_saved = saved(amp_ckpt)
    if not small or ckpt_saved is None:
        out.append({"claim": R10_CLAIMS[0], "measured": "-",
                    "verdict": f"not measured here: no simulated card under {small_card_gb:g} "
                               f"GB, or no fp32 and {amp_ckpt} rows"})
    else:
        best = [max(b, key=b.get) for b in (batches(c) for c in small) if b]
        wins = sum(1 for t in best if t == amp_ckpt)
        others = sorted({t for t in best if t != amp_ckpt})
        pick = (f"{amp_ckpt} fit the largest batch on {wins} of {len(best)} such cards"
                + (f" ({', '.join(others)} on the rest)" if others else ""))
        out.append({"claim": R10_CLAIMS[0],
                     "measured": "; ".join(describe(c) for c in small)
                                 + f"; {amp_ckpt} saved {ckpt_saved:.0f}% against fp32 at the "
                                   f"same batch{note}",
                     "verdict": f"{pick}; " + _range_verdict(ckpt_saved, 50, 60, "memory saved")})
    large = [c for c in measured_cards if c >= small_card_gb]
    amp_saved = saved(amp)
    if not large or amp_saved is None:
        out.append({"claim": R10_CLAIMS[1], "measured": "-",
                    "verdict": f"not measured here: no simulated card of {small_card_gb:g} GB "
                               f"or more, or no fp32 and {amp} rows"})
    else:
        speed = ""
        if amp_ckpt in ok:
            fast, slow = ok[amp]["img_per_s"], ok[amp_ckpt]["img_per_s"]
            speed = (f"; {amp} trains at {_fmt(fast)} img/s against {_fmt(slow)} with "
                     f"checkpointing, so accumulating micro-batches is "
                     f"{'the faster' if fast >= slow else 'NOT the faster'} way to a batch that "
                     f"does not fit")
        out.append({"claim": R10_CLAIMS[1],
                    "measured": "; ".join(describe(c) for c in large)
                                + f"; {amp} saved {amp_saved:.0f}% against fp32 at the same "
                                  f"batch{note}",
                    "verdict": _range_verdict(amp_saved, 40, 50, "memory saved") + speed})
    for claim in R10_CLAIMS[2:]:
        out.append({"claim": claim, "measured": "-",
                    "verdict": "not measured here: several GPUs (lesson 06 measures sharded "
                               "optimizer state)"})
    return out


# --- gradient accumulation: memory per micro-batch count (claim R9) ------------------------------

class _ForwardSaved:
    """Bytes saved for backward by each forward of ``model`` (a fresh count per call)."""

    def __init__(self, model: nn.Module):
        self.exclude = list(model.parameters())
        self.counts: List[int] = []
        self._active: List[SavedActivations] = []
        self.handles = [model.register_forward_pre_hook(self._pre),
                        model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        saved = SavedActivations(exclude=self.exclude)
        saved.__enter__()
        self._active.append(saved)

    def _post(self, module, args, output):
        saved = self._active.pop()
        saved.__exit__(None, None, None)
        self.counts.append(saved.bytes)

    def abandon(self) -> None:
        """Close the counts a failed forward left open (its hooks would stay installed)."""
        while self._active:
            self._active.pop().__exit__(None, None, None)

    def remove(self) -> None:
        self.abandon()
        for h in self.handles:
            h.remove()


def accumulation_memory(micro_batch: int = 32, counts: Sequence[int] = (1, 2, 4, 8),
                        precision: str = "fp16", device=None, model: str = "resnet50",
                        image_size: int = 224, num_classes: int = 1000,
                        channels_last: bool = False) -> List[Dict[str, object]]:
    """Memory of one optimizer step with ``n`` micro-batches of ``micro_batch`` (the trainer's
    ``accumulate=n``) against one batch of ``n * micro_batch``, for each ``n`` in ``counts``.

    Each row: ``micro_batches``, ``effective_batch``, the step's ``accumulated_peak_gib`` (peak
    allocated on a GPU, None on a CPU), ``accumulated_saved_gib`` (largest bytes saved for
    backward by one forward, counted), ``accumulated_step_ms``, and the same three for the one
    big batch (``one_batch_*``; ``one_batch_status`` says "out of memory" where it did not fit).
    Each is the second of two steps, so optimizer state and lazy buffers exist.
    """
    from .trainer import Trainer, TrainConfig

    _check_int("micro_batch", micro_batch, 1)
    counts = list(counts)
    if not counts or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
        raise ValueError(f"counts must hold whole numbers >= 1; got {counts!r}")
    _check_choice("model", model, ("resnet18", "resnet50"))
    device = torch.device(device) if device is not None else torch.device("cpu")
    precision = _trainer.check_precision(precision, device)
    torch.manual_seed(0)
    net = MODELS[model](num_classes=num_classes).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    # batches wait on the host, as a loader's would: one micro-batch is on the device at a time
    x_all, y_all = synthetic_images(micro_batch * max(counts), image_size, num_classes, "cpu")
    counter = _ForwardSaved(net)

    def two_steps(n_micro: int, size: int) -> Dict[str, object]:
        net.zero_grad(set_to_none=True)  # a step that ran out of memory may have left some
        trainer = Trainer(net, opt, TrainConfig(precision=precision, accumulate=n_micro,
                                                channels_last=channels_last, progress=False,
                                                seed=None, track_grad_norm=False),
                          device=device)
        batches = [(x_all[i * size:(i + 1) * size], y_all[i * size:(i + 1) * size])
                   for i in range(n_micro)]
        try:
            trainer.train_step(batches)
            counter.counts.clear()
            record = trainer.train_step(batches)
            peak = record.peak_memory_bytes
            return {"peak_gib": peak / GIB if peak is not None else None,
                    "saved_gib": max(counter.counts) / GIB, "step_ms": 1e3 * record.time_s,
                    "status": "ok"}
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            return {"peak_gib": None, "saved_gib": None, "step_ms": None,
                    "status": "out of memory"}
        finally:
            counter.abandon()
            del trainer
            free_memory(device)

    rows = []
    try:
        for n in counts:
            acc = two_steps(n, micro_batch)
            one = two_steps(1, n * micro_batch)
            rows.append({"micro_batches": n, "micro_batch": micro_batch,
                         "effective_batch": n * micro_batch,
                         "accumulated_peak_gib": acc["peak_gib"],
                         "accumulated_saved_gib": acc["saved_gib"],
                         "accumulated_step_ms": acc["step_ms"],
                         "one_batch_peak_gib": one["peak_gib"],
                         "one_batch_saved_gib": one["saved_gib"],
                         "one_batch_step_ms": one["step_ms"],
                         "one_batch_status": one["status"]})
    finally:
        counter.remove()
        del net, opt
        free_memory(device)
    return rows


def accumulation_equivalence(model: str = "mlp", precision: str = "fp32", micro_batch: int = 16,
                             micro_batches: int = 4, device=None,
                             seed: int = 0) -> Dict[str, object]:
    """One optimizer step of the trainer on ``micro_batches`` micro-batches of ``micro_batch``
    digits (``accumulate=micro_batches``) against one step on the same examples as one batch.

    ``model`` is a digits model of ``trainer.build_digits_model`` ("mlp" has no BatchNorm;
    "cnn" has, and BatchNorm normalises each micro-batch by its own statistics, so the two
    differ by more than rounding there). Returns ``loss_diff``, ``grad_rel_diff`` (largest
    relative difference of the gradients, unscaled), ``weight_rel_diff`` (after the step), the
    ``scale`` each used and whether either step was ``skipped``.
    """
    from .data import digits
    from .trainer import Hooks, Trainer, TrainConfig, build_digits_model

    _check_int("micro_batch", micro_batch, 1)
    _check_int("micro_batches", micro_batches, 1)
    device = torch.device(device) if device is not None else torch.device("cpu")
    precision = _trainer.check_precision(precision, device)

    class KeepGrads(Hooks):
        grads: List[torch.Tensor] = []

        def after_unscale(self, trainer_):
            self.grads = [p.grad.detach().clone() for p in trainer_.model.parameters()]

    results = []
    for n in (micro_batches, 1):
        torch.manual_seed(seed)
        net, size = build_digits_model(model)
        x, y = digits("train", size, device)
        x, y = x[:micro_batch * micro_batches], y[:micro_batch * micro_batches]
        hook = KeepGrads()
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1),
                          TrainConfig(precision=precision, accumulate=n, progress=False,
                                      seed=None, track_grad_norm=False),
                          device=device, hooks=[hook])
        size_each = len(x) // n
        record = trainer.train_step([(x[i * size_each:(i + 1) * size_each],
                                      y[i * size_each:(i + 1) * size_each]) for i in range(n)])
        results.append((float(record.loss), hook.grads, list(net.parameters()),
                        float(record.scale), bool(record.skipped)))
    (la, ga, pa, sa, ka), (lb, gb, pb, sb, kb) = results
    return {"model": model, "precision": precision, "micro_batch": micro_batch,
            "micro_batches": micro_batches, "loss_diff": abs(la - lb),
            "grad_rel_diff": _relative_diff(ga, gb), "weight_rel_diff": _relative_diff(pa, pb),
            "scale": (sa, sb), "skipped": (ka, kb)}


def claim_r9(rows: Sequence[Dict[str, object]], tolerance: float = 0.15) -> Dict[str, object]:
    """Claim R9 against ``accumulation_memory`` rows: held when the accumulated steps' memory
    varies by at most ``tolerance`` (a fraction) across micro-batch counts. Peak allocated memory
    where measured (a GPU), else the counted bytes saved for backward."""
    if not rows:
        raise ValueError("rows must hold at least one accumulation_memory row")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1); got {tolerance!r}")
    gpu = all(r["accumulated_peak_gib"] is not None for r in rows)
    key = "peak_gib" if gpu else "saved_gib"
    what = "peak allocated" if gpu else "saved for backward (counted)"
    acc = [r[f"accumulated_{key}"] for r in rows]
    one = [(r["effective_batch"], r[f"one_batch_{key}"]) for r in rows
           if r[f"one_batch_{key}"] is not None]
    spread = max(acc) / min(acc) - 1
    held = spread <= tolerance
    measured = (f"{what}: {min(acc):.3g}-{max(acc):.3g} GiB for effective batches "
                f"{rows[0]['effective_batch']}-{rows[-1]['effective_batch']} by accumulation")
    if len(one) > 1:
        measured += (f"; one batch: {one[0][1]:.3g} GiB at {one[0][0]} -> {one[-1][1]:.3g} GiB "
                     f"at {one[-1][0]}")
    oom = [r["effective_batch"] for r in rows if r["one_batch_status"] != "ok"]
    if oom:
        measured += f"; one batch of {', '.join(map(str, oom))} did not fit"
    verdict = (f"held: memory moved {100 * spread:.0f}% (at most {100 * tolerance:.0f}% counts "
               f"as the same)" if held else
               f"did not hold: memory moved {100 * spread:.0f}% across micro-batch counts")
    return {"claim": R9_CLAIM, "measured": measured, "verdict": verdict, "held": held,
            "spread": spread}


# --- training checkpoints: exact resume, and resume without the scaler's state --------------------

def resume_experiment(precision: str = "fp16", model: str = "mlp", total_steps: int = 40,
                      resume_at: int = 20, batch_size: int = 64, lr: float = 0.05,
                      init_scale: float = 2.0 ** 24, device=None, seed: int = 0,
                      directory=None) -> Dict[str, object]:
    """Train a digits model three ways from the same seed and compare their steps.

    ``uninterrupted``: ``total_steps`` steps in one go. ``resumed with scaler state``:
    ``resume_at`` steps, ``save_checkpoint``, a fresh Trainer (new model, optimizer, scaler)
    ``load_checkpoint``, then the rest. ``resumed without scaler state``: the same with
    ``load_checkpoint(load_scaler=False)``: the new GradScaler starts again at ``init_scale``
    (set high, as a scale that has not settled yet would be), so the steps after the resume
    overflow until it has halved back down. Returns ``runs`` (name -> ``History.columns()``),
    ``resume_step``, ``saved_scale`` (the scale in the checkpoint), ``init_scale`` and
    ``summary`` (one row per resumed run, compared with the uninterrupted one from the resume
    step on). cuDNN runs deterministically, so a GPU repeats a step bit for bit, as a CPU does.
    """
    import tempfile as _tempfile
    from pathlib import Path as _Path

    from .data import digits_loaders
    from .trainer import ScalerSettings, Trainer, TrainConfig, build_digits_model

    _check_int("total_steps", total_steps, 2)
    _check_int("resume_at", resume_at, 1)
    if resume_at >= total_steps:
        raise ValueError(f"resume_at must be in [1, {total_steps - 1}] (before total_steps); "
                         f"got {resume_at}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    precision = _trainer.check_precision(precision, device)
    settings = ScalerSettings(init_scale=init_scale)

    def new_trainer() -> "Trainer":
        torch.manual_seed(seed)
        net, size = build_digits_model(model)
        trainer_ = Trainer(net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
                           TrainConfig(precision=precision, scaler=settings, progress=False,
                                       seed=seed), device=device)
        trainer_.image_size = size
        return trainer_

    def loader(trainer_):
        return digits_loaders(batch_size, trainer_.image_size, device, seed)[0]

    runs: Dict[str, dict] = {}
    with deterministic_kernels(), _tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = _Path(tmp) / "checkpoint.pt"
        whole = new_trainer()
        whole.fit(loader(whole), epochs=total_steps, max_steps=total_steps)
        runs["uninterrupted"] = whole.history.columns()
        first = new_trainer()
        first.fit(loader(first), epochs=total_steps, max_steps=resume_at)
        first.save_checkpoint(path)
        saved_scale = float(first.scaler.get_scale()) if first.scaler.is_enabled() else 1.0
        del whole, first
        for name, load_scaler in (("resumed with scaler state", True),
                                  ("resumed without scaler state", False)):
            again = new_trainer()
            again.load_checkpoint(path, load_scaler=load_scaler)
            again.fit(loader(again), epochs=total_steps, max_steps=total_steps - resume_at)
            runs[name] = again.history.columns()
            del again
    free_memory(device)
    ref = runs["uninterrupted"]
    summary = []
    for name in ("resumed with scaler state", "resumed without scaler state"):
        cols = runs[name]
        after = range(resume_at, total_steps)
        burst = 0
        for i in after:
            if not cols["skipped"][i]:
                break
            burst += 1
        summary.append({
            "run": name,
            "steps": len(cols["step"]),
            "same_history_before_resume": all(cols[k][:resume_at] == ref[k][:resume_at]
                                              for k in ("loss", "scale", "skipped")),
            "first_scale_after_resume": cols["scale"][resume_at],
            "max_loss_diff_after_resume": max(abs(cols["loss"][i] - ref["loss"][i])
                                              for i in after),
            "same_scales_after_resume": [cols["scale"][i] for i in after]
                                        == [ref["scale"][i] for i in after],
            "skipped_after_resume": sum(1 for i in after if cols["skipped"][i]),
            "skipped_in_a_row_at_resume": burst,
            "uninterrupted_skipped_after_resume": sum(1 for i in after if ref["skipped"][i]),
        })
    return {"runs": runs, "resume_step": resume_at, "saved_scale": saved_scale,
            "init_scale": float(init_scale), "precision": precision, "summary": summary,
            "expected_burst": max(0, round(math.log2(float(init_scale) / saved_scale)))
            if saved_scale > 0 else None}
