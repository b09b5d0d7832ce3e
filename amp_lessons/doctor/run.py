"""``doctor(model, batch)``: the course's measurements on one model, in order, into a report."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from amp_lessons.numerics.modes import keeps_rng
from amp_lessons.validate import check_bool, check_int
from amp_lessons.measure import free_memory
from amp_lessons.numerics.precision import PRECISIONS, as_device, available_device, check_precision, native_bf16
from amp_lessons.doctor import compiled as _compiled
from amp_lessons.doctor import findings as _findings
from amp_lessons.doctor import fp8 as _fp8
from amp_lessons.doctor import inputs as _inputs
from amp_lessons.doctor import ranges as _ranges
from amp_lessons.doctor import scale as _scale
from amp_lessons.doctor import speed as _speed
from amp_lessons.doctor.dtype_trace import op_dtypes, trace
from amp_lessons.doctor.report import DoctorReport


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


def check_device(device, model: Optional[nn.Module] = None,
                 name: str = "device") -> torch.device:
    """The device to measure on (``device``; when None, the model's), checked: a CPU, or a CUDA
    device this machine has; ValueError naming the setting (``name``) otherwise."""
    if device is None and model is None:
        raise ValueError(f"{name}: give a device or a model to take it from")
    dev = as_device(device) if device is not None else _inputs.model_device(model)
    given = (f"the model's device {str(dev)!r}" if device is None else
             repr(device) if isinstance(device, (str, int)) else repr(str(device)))
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be 'cpu' or a CUDA device ('cuda', 'cuda:0'); got {given}")
    return available_device(dev, name, given)


def _check_fp8_crossover(value) -> Tuple[Optional[int], str]:
    """``(width, where it was measured)`` from ``fp8_crossover``: None, a whole number >= 1, or a
    ``(width, where)`` pair; ValueError naming the setting otherwise."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not isinstance(value[1], str):
            raise ValueError(f"fp8_crossover must be None, a whole number >= 1 (the width) or a "
                             f"pair (width, where it was measured); got {value!r}")
        width, source = value
    else:
        width, source = value, "given"
    if width is not None:
        width = check_int("fp8_crossover", width, 1)
    return width, source


def _check_parameters(model: nn.Module) -> None:
    """ValueError for float16 parameters: fp16 mixed precision keeps the weights in float32
    (autocast casts per op; GradScaler cannot unscale float16 gradients)."""
    half = [n for n, p in model.named_parameters() if p.dtype == torch.float16]
    if half:
        raise ValueError(f"model parameters must not be float16 (fp16 mixed precision keeps the "
                         f"weights in float32: autocast casts per op, GradScaler cannot unscale "
                         f"float16 gradients); got float16 in {half[0]!r}"
                         f"{f' and {len(half) - 1} more' if len(half) > 1 else ''}: was .half() "
                         f"called on the model? Pass model.float()")


def _fp32_nonfinite(rows: Sequence[Dict[str, object]], loss_finite: bool) -> List[str]:
    """Where the fp32 pass is broken: when the fp32 loss or a gradient holds inf/NaN
    (``findings.fp32_broken``), the names of ``rows`` (the layers with ``act_nonfinite`` or
    ``grad_nonfinite`` counts above 0), then "the loss" when it was not finite; else none (an
    inf in a layer's output alone, with a finite loss and gradients, is a -inf mask)."""
    if not _findings.fp32_broken(rows, loss_finite):
        return []
    return [str(r["layer"]) for r in rows] + ([] if loss_finite else ["the loss"])


@keeps_rng
def doctor(model: nn.Module, batch, loss_fn: Optional[Callable] = None,
           optimizer: Optional[torch.optim.Optimizer] = None, device=None,
           precisions: Sequence[str] = PRECISIONS, warmup: int = 5, steps: int = 15,
           compile: Optional[bool] = None, trial_steps: int = 5,
           fp8_crossover: Union[None, int, Tuple[int, str]] = None,
           name: Optional[str] = None) -> DoctorReport:
    """Measure ``model`` on ``batch`` and say what precision to train it in.

    ``batch``: the inputs (a tensor, or a tuple/list/dict of tensors) or ``(inputs, target)``,
    at least one sample; without a target the doctor makes one (``inputs.made_target``).
    ``loss_fn(output, target)`` defaults to cross-entropy for integer targets, MSE otherwise.
    ``optimizer``: its class and defaults are used on copies (default: the engine's foreach
    SGD). ``device``: 'cpu' or an available CUDA device (default: the model's). ``warmup`` /
    ``steps``: per precision's timing (``precisions``; an empty tuple skips timing).
    ``compile``: compare eager and ``torch.compile`` forwards (default: on a GPU only).
    ``trial_steps``: fp16 steps per GradScaler setting checked with the trainer (0: none).
    ``fp8_crossover``: the width from which FP8 pays on this GPU (lesson 07's measurement), or
    ``(width, where it was measured)``. ``name``: the model's name in the report (a string).
    Bad arguments raise ValueError naming the setting; float16 parameters are refused (fp16
    mixed precision keeps float32 weights).

    The model is never changed: every pass runs on copies (``inputs.work_copy``), in the modes
    its modules have (a frozen BatchNorm is measured frozen). A measurement that fails (a layer
    fp16 autocast cannot run here, a model that does not compile) becomes a row or finding with
    the reason; the report is still made.
    """
    t0 = time.perf_counter()
    _inputs.check_model(model)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be None or a string (the model's name in the report); "
                         f"got {name!r}")
    device = check_device(device, model)
    _check_parameters(model)
    if precisions is None or (isinstance(precisions, (tuple, list, str)) and not precisions):
        precisions = ()
    else:
        precisions = _inputs.as_sequence(precisions, "precisions", PRECISIONS)
    warmup, steps = check_int("warmup", warmup, 0), check_int("steps", steps, 1)
    trial_steps = check_int("trial_steps", trial_steps, 0)
    if compile is not None:
        check_bool("compile", compile)
    crossover, source = _check_fp8_crossover(fp8_crossover)
    make_optimizer = _speed.like(optimizer)

    work = _inputs.work_copy(model, device)
    b = _inputs.check_batch(work, batch, loss_fn, device)
    call = _inputs.Call(work)
    failures: List[Dict[str, str]] = []  # measurements that failed: (topic, what, reason)

    def run():
        torch.manual_seed(0)  # the same dropout masks in every pass
        return b.loss_fn(call(b.inputs), b.target)

    fp32_losses: List[torch.Tensor] = []

    def run_fp32():
        loss = run()
        fp32_losses.append(loss.detach())
        return loss

    # the numerics, on the working copy
    clock = _Clock()
    try:
        stats = _ranges.layer_ranges(work, run_fp32)
        k = _scale.reached_scale(_ranges.largest_gradient(stats))
        grad_scale = 2.0 ** k if k is not None else 1.0
        counts = _ranges.format_shares(work, run, grad_scale,
                                       default_scale=_scale.DEFAULT.init_scale)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is a finding, not a dead report
        stats, counts, k = {}, {}, None
        failures.append({"topic": "ranges", "what": "the fp32 forward and backward (per-layer "
                         "ranges)", "reason": _scale.failure_text(exc)})
    kinds = {n: type(m).__name__ for n, m in _ranges.leaf_layers(work).items()}
    layers = _ranges.table(stats, counts, kinds)
    overflow = _ranges.overflow_sites(layers)
    grad_totals, act_totals = _totals(counts, "grad"), _totals(counts, "act")
    under_k, under_default = (_share(grad_totals.get("fp16"), "underflow"),
                              _share(grad_totals.get(DEFAULT_KEY), "underflow"))
    flushed_k = _share(grad_totals.get("fp16"), "flushed")
    bf16 = native_bf16(device)
    fp32_loss_finite = all(bool(torch.isfinite(t).all()) for t in fp32_losses)
    fp32_rows = [r for r in layers if r.get("act_nonfinite") or r.get("grad_nonfinite")]
    fp32_bad = _fp32_nonfinite(fp32_rows, fp32_loss_finite) if stats else []
    clock.lap("ranges")

    # what autocast does; the fp16 trace also finds where inf/NaN first appears
    fp16_problem = _fp16_problem(device)
    nonfinite: List[str] = []
    trace_doc: Dict[str, object] = {"low": "fp16", "reason": fp16_problem or "", "ops": [],
                                    "low_ops": 0, "fp32_ops": 0, "fp32_examples": [], "layers": [],
                                    "both_ops": 0, "both_examples": [], "loss_finite": None}
    fp16_unchecked = fp16_problem
    if not fp16_problem:
        try:
            fp16_trace = trace(work, run, device.type, torch.float16,
                               _inputs.input_dtype(b.inputs), b.loss_name)
            nonfinite = fp16_trace.nonfinite
            trace_doc.update(layers=fp16_trace.rows(), loss_finite=fp16_trace.loss_finite)
        except Exception as exc:  # noqa: BLE001
            fp16_unchecked = _scale.failure_text(exc)
            trace_doc["reason"] = f"the fp16 autocast forward failed: {fp16_unchecked}"
            failures.append({"topic": "trace", "what": "the fp16 autocast trace (dtypes and "
                             "inf/NaN per layer)", "reason": fp16_unchecked})
        try:
            ops = op_dtypes(lambda: call(b.inputs), device.type, torch.float16)
            trace_doc.update(ops=ops, **_op_kinds(ops))
        except Exception as exc:  # noqa: BLE001
            failures.append({"topic": "trace", "what": "the op count under fp16 autocast",
                             "reason": _scale.failure_text(exc)})
    # fp16's own inf/NaN: layers whose output was finite in fp32 (a -inf mask is not fp16's)
    fp32_inf = {r["layer"] for r in fp32_rows if r.get("act_nonfinite")}
    fp16_new = [n for n in nonfinite if n not in fp32_inf]
    fp16_bad = fp16_new or (["the loss"] if trace_doc["loss_finite"] is False else [])
    advice_args = (k, overflow, under_k, under_default, bf16, flushed_k)
    advice_kw = dict(fp16_nonfinite=fp16_bad, fp32_nonfinite=fp32_bad,
                     fp16_unchecked=fp16_unchecked)
    advice = _scale.advice(*advice_args, **advice_kw)

    clock.lap("dtype trace")
    trial = []
    if trial_steps and not fp16_problem:
        settings = {"default": _scale.DEFAULT}
        if advice.get("settings") and advice["settings"]["init_scale"] != _scale.DEFAULT.init_scale:
            settings["advised"] = _scale.ScalerSettings(**advice["settings"])
        trial = _scale.scaler_trial(lambda: _inputs.Call(_inputs.work_copy(model, device)),
                                    b.inputs, b.target, b.loss_fn,
                                    make_optimizer, settings, device, trial_steps)
        failures += [{"topic": "scale", "what": f"the fp16 trial ({r['settings']} settings)",
                      "reason": r["reason"]} for r in trial if r.get("status") == "error"]
        # the trial is measured fp16 evidence: an inf/NaN loss there makes fp16 not safe
        advice = _scale.advice(*advice_args, trial=trial, **advice_kw)

    clock.lap("scaler trial")
    why_not = _compiled.compile_skip_reason(device)
    if compile is False:
        compiled_doc = {"reason": "compile=False", "rows": []}
    elif why_not and (compile is None or not hasattr(torch, "compile")):
        compiled_doc = {"reason": why_not, "rows": []}
    else:
        try:
            compiled_doc = {"reason": "", "rows": _compiled.compare_compiled(call, b.inputs,
                                                                             device=device)}
        except Exception as exc:  # noqa: BLE001
            compiled_doc = {"reason": "", "rows": [_compiled.error_row("fp32", exc)]}
    del work, call
    free_memory(device)
    clock.lap("compile")

    speed = _speed.speed_rows(lambda: _inputs.Call(_inputs.work_copy(model, device)), b.inputs,
                              b.target, b.loss_fn, make_optimizer, device, precisions,
                              warmup, steps) if precisions else []
    clock.lap("speed")
    try:
        fp8 = _fp8.candidates(model, device, crossover, source)
    except Exception as exc:  # noqa: BLE001
        fp8 = {"crossover": crossover, "source": source, "status": "error", "layers": [],
               "reason": f"the FP8 conversion plan failed: {_scale.failure_text(exc)}"}
    found = _findings.collect(overflow, fp16_new, k, grad_totals, act_totals, advice,
                              trial, trace_doc, compiled_doc, speed, fp8,
                              fp32_nonfinite=fp32_rows,
                              fp32_loss_finite=fp32_loss_finite, failures=failures)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return DoctorReport(
        model=name or type(model).__name__, parameters=sum(p.numel() for p in model.parameters()),
        device=str(device), device_name=device_name, torch=torch.__version__, batch=b.shape,
        loss=b.loss_text, layers=layers, scale_exponent=k, overflow=overflow,
        fp16_nonfinite=nonfinite, advice=advice, scaler_trial=trial, trace=trace_doc,
        compiled=compiled_doc, speed=speed, fp8=fp8, findings=found,
        seconds=time.perf_counter() - t0, extra={"seconds_by_part": clock.laps})


def _op_kinds(ops: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """The trace's op-kind counts, each kind counted once: ``low_ops`` (kinds that ran in 16
    bits), ``fp32_ops`` / ``fp32_examples`` (kinds that ran only in float32), ``both_ops`` /
    ``both_examples`` (kinds that ran in 16 bits at some calls and in float32 at others)."""
    low = {r["op"] for r in ops if r["dtype"] == "16-bit"}
    wide = {r["op"] for r in ops if r["dtype"] != "16-bit"}
    only32, both = sorted(wide - low), sorted(wide & low)
    return {"low_ops": len(low), "fp32_ops": len(only32), "fp32_examples": only32,
            "both_ops": len(both), "both_examples": both}
