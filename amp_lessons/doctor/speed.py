"""Speed and peak memory of this model's training step, per precision, through the engine.

Each precision trains a fresh copy of the model with the engine's hand-written AMP step
(``bench.hand_step``), timed by ``bench.time_steps`` (CUDA events after a warm-up, median),
peak memory read after ``reset_peak_memory_stats``, and the GPU's idle share from
``timing.device_busy_ms``: the same functions and the same standard settings as lesson 04's
table (``bench.STANDARD``: channels_last for image batches, cuDNN autotuning, foreach SGD with
momentum), so a torchvision ResNet-50 here reads as lesson 04's rows do. Every row passes
``claims.rows_timing_gate``: on a CPU, with too few steps or with an idle GPU it is "not decided".
"""
from __future__ import annotations

import inspect
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from amp_lessons import measure as bench
from amp_lessons.publish.claims import rows_timing_gate
from amp_lessons.numerics.precision import PRECISIONS, check_precision, precision_settings
from amp_lessons.doctor.inputs import batch_size as _batch_size
from amp_lessons.doctor.scale import failure_text

GIB = 2 ** 30


def trainable(model: nn.Module) -> List[nn.Parameter]:
    """The parameters of ``model`` an optimizer steps: those with ``requires_grad`` (a frozen
    part, 16-bit or not, is not the optimizer's, as in a learner's
    ``filter(lambda p: p.requires_grad, ...)``)."""
    return [p for p in model.parameters() if p.requires_grad]


def standard_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The engine's standard optimizer (``bench.STANDARD``: SGD, momentum 0.9, foreach) over the
    model's trainable parameters."""
    config = bench.BenchConfig(optimizer=bench.STANDARD["optimizer"],
                                 impl=bench.STANDARD["impl"])
    return bench.build_optimizer(config, trainable(model))


def like(optimizer: Optional[torch.optim.Optimizer]) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """A factory of optimizers like ``optimizer`` (same class and defaults) for a model copy's
    trainable parameters; the standard one when ``optimizer`` is None."""
    if optimizer is None:
        return standard_optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer (or None for the standard "
                         f"foreach SGD); got {type(optimizer).__name__}")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    # ``defaults`` can hold entries the constructor does not take (AdamW's decoupled_weight_decay)
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return lambda model: cls(trainable(model), **defaults)


def skip_reason(precision: str, device) -> Optional[str]:
    """Why ``precision`` is not timed on ``device`` (the engine's rule), or None."""
    reason = bench.skip_reason(bench.BenchConfig(precision=precision), device)
    if reason:
        return reason
    try:
        check_precision(precision, device)
    except ValueError as exc:
        return str(exc)
    return None


def time_precision(make_model: Callable[[], nn.Module], inputs, target, loss_fn: Callable,
                   make_optimizer: Callable, precision: str, device, warmup: int, steps: int,
                   channels_last: bool, idle: bool = True) -> Dict[str, object]:
    """One row: ``precision``'s training step of a fresh model copy, timed and measured; its
    samples per step are the rows of the first input tensor (of a tuple/list/dict too)."""
    row: Dict[str, object] = {"precision": precision, "status": "ok", "reason": "",
                              "samples_per_s": None, "step_ms": None, "peak_gib": None,
                              "gpu_idle_fraction": None, "speedup": None, "memory_ratio": None}
    reason = skip_reason(precision, device)
    if reason:
        return dict(row, status="skipped", reason=reason, decided=False, gate=reason)
    t0 = time.perf_counter()
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = bench.STANDARD["cudnn_benchmark"]
    try:
        with precision_settings(precision, device):
            torch.manual_seed(0)
            model = make_model()
            x = inputs
            if channels_last:
                model = model.to(memory_format=torch.channels_last)
                x = inputs.contiguous(memory_format=torch.channels_last)
            optimizer = make_optimizer(model)
            step = bench.hand_step(model, optimizer, precision, device, loss_fn=loss_fn)
            timing = bench.time_steps(step, x, target, warmup=warmup, steps=steps,
                                        device=device)
            row.update(bench.summarize_times(timing["times_ms"], _batch_size(x)))
            row["samples_per_s"] = row.pop("img_per_s")
            row.update(loss=timing["loss"], timer=timing["timer"], steps=steps, warmup=warmup)
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
                if idle:
                    busy = bench.device_busy_ms(step, x, target, device)
                    row["gpu_idle_fraction"] = bench.idle_fraction(busy or None, row["step_ms"])
    except Exception as exc:  # noqa: BLE001 - a precision that fails is a row, never a dead kernel
        status = "out of memory" if bench.is_out_of_memory(exc) else "error"
        row.update(status=status, reason=failure_text(exc))
    finally:
        torch.backends.cudnn.benchmark = old
        step = model = optimizer = None  # noqa: F841 - released before the next precision
        bench.free_memory(device)
    row["seconds"] = time.perf_counter() - t0
    # the one timing gate of the course: a GPU, a warm-up, enough steps, a busy GPU
    gate = rows_timing_gate(dict(row, label=precision), busy=idle)
    row.update(decided=gate is None, gate=(gate or "").replace(" the claim is about", ""))
    return row


def speed_rows(make_model: Callable[[], nn.Module], inputs, target, loss_fn: Callable,
               make_optimizer: Callable, device, precisions: Sequence[str] = PRECISIONS,
               warmup: int = 5, steps: int = 15,
               channels_last: Optional[bool] = None) -> List[Dict[str, object]]:
    """``time_precision`` for each precision, with ``speedup`` and ``memory_ratio`` against the
    fp32 row (TF32 off) of the same run. ``channels_last`` defaults to the standard setting for
    4-D image batches (NCHW otherwise)."""
    device = torch.device(device)
    if channels_last is None:
        channels_last = bool(bench.STANDARD["channels_last"]) and \
            isinstance(inputs, torch.Tensor) and inputs.dim() == 4
    rows = [time_precision(make_model, inputs, target, loss_fn, make_optimizer, p, device,
                           warmup, steps, channels_last)
            for p in precisions]
    base = next((r for r in rows if r["precision"] == "fp32"), None)
    for r in rows:
        r["channels_last"] = channels_last
        if base is not None:
            r["speedup"] = bench.ratio(r["samples_per_s"], base["samples_per_s"])
            r["memory_ratio"] = bench.ratio(r["peak_gib"], base["peak_gib"])
    return rows
