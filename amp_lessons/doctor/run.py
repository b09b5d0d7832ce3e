"""``doctor(model, batch)``: the course's measurements on one model, in order, into a report."""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .._validate import check_bool, check_int
from ..bench import free_memory
from ..precision import PRECISIONS, as_device, check_precision, native_bf16
from . import compiled as _compiled
from . import findings as _findings
from . import fp8 as _fp8
from . import inputs as _inputs
from . import ranges as _ranges
from . import scale as _scale
from . import speed as _speed
from .dtype_trace import op_dtypes, trace
from .report import DoctorReport


DEFAULT_KEY = "fp16@init"  # fp16 gradient counts at GradScaler's default init_scale


def _share(counts, key: str) -> float:
    return counts[key] / counts["nonzero"] if counts and counts["nonzero"] else 0.0


def _totals(counts, kind: str):
    out = {}
    for per_layer in counts.values():
        for short, c in per_layer.get(kind, {}).items():
            t = out.setdefault(short, {"nonzero": 0, "overflow": 0, "underflow": 0, "flushed": 0})
            for key in t:
                t[key] += c[key]
    return out


class _Clock:
    """Seconds spent in each part of a doctor run (``DoctorReport.extra["seconds_by_part"]``)."""

    def __init__(self):
        self.laps: Dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.laps[part] = round(now - self._last, 3)
        self._last = now


def _fp16_problem(device) -> str:
    """Why fp16 autocast with GradScaler cannot run on ``device`` ("" when it can)."""
    try:
        check_precision("fp16", device)
    except ValueError as exc:
        return str(exc)
    return ""


def _keeps_rng(fn):
    """Run ``fn`` with torch's random generators (CPU and every GPU) put back afterwards: the
    doctor seeds its passes, and the learner's own random stream must not move."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=gpus):
            return fn(*args, **kwargs)
    return wrapper


@_keeps_rng
def doctor(model: nn.Module, batch, loss_fn: Optional[Callable] = None,
           optimizer: Optional[torch.optim.Optimizer] = None, device=None,
           precisions: Sequence[str] = PRECISIONS, warmup: int = 5, steps: int = 15,
           compile: Optional[bool] = None, trial_steps: int = 5,
           fp8_crossover: Union[None, int, Tuple[int, str]] = None,
           name: Optional[str] = None) -> DoctorReport:
    """Measure ``model`` on ``batch`` and say what precision to train it in.

    ``batch``: the inputs (a tensor, or a tuple/list/dict of tensors) or ``(inputs, target)``;
    without a target the doctor makes one (``inputs.made_target``). ``loss_fn(output, target)``
    defaults to cross-entropy for integer targets, MSE otherwise. ``optimizer``: its class and
    defaults are used on copies (default: the engine's foreach SGD). ``device``: default the
    model's. ``warmup`` / ``steps``: per precision's timing (``precisions``; an empty tuple skips
    timing). ``compile``: compare eager and ``torch.compile`` forwards (default: on a GPU only).
    ``trial_steps``: fp16 steps per GradScaler setting checked with the trainer (0: none).
    ``fp8_crossover``: the width from which FP8 pays on this GPU (lesson 07's measurement), or
    ``(width, where it was measured)``.

    The model is never changed: every pass runs on copies (``inputs.work_copy``).
    """
    t0 = time.perf_counter()
    _inputs.check_model(model)
    device = as_device(device) if device is not None else _inputs.model_device(model)
    precisions = _inputs.as_sequence(precisions, "precisions", PRECISIONS) if precisions else ()
    warmup, steps = check_int("warmup", warmup, 0), check_int("steps", steps, 1)
    trial_steps = check_int("trial_steps", trial_steps, 0)
    if compile is not None:
        check_bool("compile", compile)
    crossover, source = (fp8_crossover if isinstance(fp8_crossover, tuple)
                         else (fp8_crossover, "given"))
    if crossover is not None:
        crossover = check_int("fp8_crossover", crossover, 1)
    make_optimizer = _speed.like(optimizer)

    work = _inputs.work_copy(model, device)
    b = _inputs.check_batch(work, batch, loss_fn, device)
    call = _inputs.Call(work)

    def run():
        torch.manual_seed(0)  # the same dropout masks in every pass
        return b.loss_fn(call(b.inputs), b.target)

    # the numerics, on the working copy
    clock = _Clock()
    stats = _ranges.layer_ranges(work, run)
    k = _scale.reached_scale(_ranges.largest_gradient(stats))
    grad_scale = 2.0 ** k if k is not None else 1.0
    counts = _ranges.format_shares(work, run, grad_scale,
                                   default_scale=_scale.DEFAULT.init_scale)
    kinds = {n: type(m).__name__ for n, m in _ranges.leaf_layers(work).items()}
    layers = _ranges.table(stats, counts, kinds)
    overflow = _ranges.overflow_sites(layers)
    grad_totals, act_totals = _totals(counts, "grad"), _totals(counts, "act")
    under_k, under_default = (_share(grad_totals.get("fp16"), "underflow"),
                              _share(grad_totals.get(DEFAULT_KEY), "underflow"))
    flushed_k = _share(grad_totals.get("fp16"), "flushed")
    bf16 = native_bf16(device)
    advice = _scale.advice(k, overflow, under_k, under_default, bf16, flushed_k)
    clock.lap("ranges")

    # what autocast does; the fp16 trace also finds where inf/NaN first appears
    fp16_problem = _fp16_problem(device)
    nonfinite: List[str] = []
    trace_doc: Dict[str, object] = {"low": "fp16", "reason": fp16_problem or "", "ops": [],
                                    "low_ops": 0, "fp32_ops": 0, "fp32_examples": [], "layers": []}
    if not fp16_problem:
        fp16_trace = trace(work, run, device.type, torch.float16)
        nonfinite = fp16_trace.nonfinite
        ops = op_dtypes(lambda: call(b.inputs), device.type, torch.float16)
        fp32_ops = sorted({r["op"] for r in ops if r["dtype"] != "16-bit"})
        trace_doc.update(ops=ops, low_ops=len({r["op"] for r in ops if r["dtype"] == "16-bit"}),
                         fp32_ops=len(fp32_ops), fp32_examples=fp32_ops,
                         layers=fp16_trace.rows())

    clock.lap("dtype trace")
    trial = []
    if trial_steps and not fp16_problem:
        settings = {"default": _scale.DEFAULT}
        if advice.get("settings") and advice["settings"]["init_scale"] != _scale.DEFAULT.init_scale:
            settings["advised"] = _scale.ScalerSettings(**advice["settings"])
        trial = _scale.scaler_trial(lambda: _inputs.Call(_inputs.work_copy(model, device)),
                                    b.inputs, b.target, b.loss_fn,
                                    make_optimizer, settings, device, trial_steps)

    clock.lap("scaler trial")
    why_not = _compiled.compile_skip_reason(device)
    if compile is False:
        compiled_doc = {"reason": "compile=False", "rows": []}
    elif why_not and (compile is None or not hasattr(torch, "compile")):
        compiled_doc = {"reason": why_not, "rows": []}
    else:
        compiled_doc = {"reason": "", "rows": _compiled.compare_compiled(call, b.inputs,
                                                                         device=device)}
    del work, call
    free_memory(device)
    clock.lap("compile")

    speed = _speed.speed_rows(lambda: _inputs.Call(_inputs.work_copy(model, device)), b.inputs,
                              b.target, b.loss_fn, make_optimizer, device, precisions,
                              warmup, steps) if precisions else []
    clock.lap("speed")
    fp8 = _fp8.candidates(model, device, crossover, source)
    found = _findings.collect(overflow, nonfinite, k, grad_totals, act_totals, advice,
                              trial, trace_doc, compiled_doc, speed, fp8)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return DoctorReport(
        model=name or type(model).__name__, parameters=sum(p.numel() for p in model.parameters()),
        device=str(device), device_name=device_name, torch=torch.__version__, batch=b.shape,
        loss=b.loss_text, layers=layers, scale_exponent=k, overflow=overflow,
        fp16_nonfinite=nonfinite, advice=advice, scaler_trial=trial, trace=trace_doc,
        compiled=compiled_doc, speed=speed, fp8=fp8, findings=found,
        seconds=time.perf_counter() - t0, extra={"seconds_by_part": clock.laps})
