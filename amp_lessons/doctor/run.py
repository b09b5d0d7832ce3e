"""``doctor(model, batch)``: the course's measurements on one model, in order, into a report."""
from __future__ import annotations

import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from amp_lessons.numerics.modes import keeps_rng
from amp_lessons.validate import check_bool, check_int
from amp_lessons.measure import free_memory
from amp_lessons.lineage import traced  # explain names the report's makers
from amp_lessons.numerics.precision import PRECISIONS, as_device, available_device, check_precision, native_bf16
from amp_lessons.doctor import compiled as _compiled
from amp_lessons.doctor import diagnose as _diagnose
from amp_lessons.doctor import probes as _probes
from amp_lessons.doctor import training as _training
from amp_lessons.doctor import verdict as _verdict
from amp_lessons.doctor import weights as _weights
from amp_lessons.doctor import findings as _findings
from amp_lessons.doctor import fp8 as _fp8
from amp_lessons.doctor import inputs as _inputs
from amp_lessons.doctor import ranges as _ranges
from amp_lessons.doctor import scale as _scale
from amp_lessons.doctor import speed as _speed
from amp_lessons.measure.dtype_trace import op_dtypes, trace
from amp_lessons.doctor.report import DoctorReport
from amp_lessons.tables import plural


GPU_TRIAL_STEPS, CPU_TRIAL_STEPS = 5, 2  # the fp16 trial's default steps per setting
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


def _fp32_nonfinite(rows: Sequence[Dict[str, object]], loss_finite: bool) -> List[str]:
    """Where the fp32 pass is broken: when the fp32 loss or a gradient holds inf/NaN
    (``findings.fp32_broken``), the names of ``rows`` (the layers with ``act_nonfinite`` or
    ``grad_nonfinite`` counts above 0), then "the loss" when it was not finite; else none (an
    inf in a layer's output alone, with a finite loss and gradients, is a -inf mask)."""
    if not _findings.fp32_broken(rows, loss_finite):
        return []
    return [str(r["layer"]) for r in rows] + ([] if loss_finite else ["the loss"])


class _Progress:
    """One line per part on stderr as the doctor runs (``progress=True``), and the seconds each
    took (``DoctorReport.extra["seconds_by_part"]``)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.clock = _Clock()

    def start(self, part: str) -> None:
        if self.enabled:
            print(f"doctor: {part} ...", file=sys.stderr, flush=True)

    def lap(self, part: str) -> None:
        self.clock.lap(part)
        if self.enabled:
            print(f"doctor: {part} done in {self.clock.laps[part]:.1f} s", file=sys.stderr,
                  flush=True)


def _lost(v) -> float:
    """A relative error for ranking: NaN (an overflow: GradScaler skips that step) counts 0."""
    return v if isinstance(v, float) and v == v else 0.0


def _ranking(losses: Dict[str, Dict[str, Dict[str, float]]]) -> List[Dict[str, object]]:
    """Parameters by how much of their gradient fp16 loses at the reached scale (then at the
    default init_scale): the relative error of the gradient after the fp16 round trip, worst
    first (a share of values flushed to zero alone would rank the negligible gradients of a
    saturated softmax first)."""
    rows = [{"parameter": name, "values": v["reached"]["nonzero"],
             "share_k": v["reached"]["flushed"], "share_default": v["default"]["flushed"],
             "error_k": v["reached"]["relative_error"],
             "error_default": v["default"]["relative_error"]}
            for name, v in losses.items() if v["reached"]["nonzero"]]
    def lost(v):  # NaN (an overflow: GradScaler skips that step instead) ranks as nothing lost
        return v if v == v else 0.0
    return sorted(rows, key=lambda r: (lost(r["error_k"]), lost(r["error_default"])),
                  reverse=True)


def _watch_doc(w) -> Dict[str, object]:
    return {k: getattr(w, k) for k in ("forward_nonfinite", "backward_nonfinite",
                                        "first_nonfinite_parameter", "nonfinite_parameters",
                                        "functions", "reductions", "no_gradient", "error",
                                        "error_site", "recomputes")} if w is not None else {}


@keeps_rng
@traced
def doctor(model: nn.Module, batch=None, loss_fn: Optional[Callable] = None,
           optimizer: Optional[torch.optim.Optimizer] = None, device=None,
           precisions: Optional[Sequence[str]] = None, warmup: int = 5, steps: int = 15,
           compile: Optional[bool] = None, trial_steps: Optional[int] = None,
           fp8_crossover: Union[None, int, Tuple[int, str]] = None,
           name: Optional[str] = None, *, inputs=_inputs._UNSET, target=None, output=None,
           step_fn: Optional[Callable] = None, checkpoint_fn: Optional[Callable] = None,
           time_cpu: bool = False, progress: bool = False) -> DoctorReport:
    """Measure ``model`` on a batch, diagnose the mixed-precision problems it has, and say what
    to train it in (the report's ``verdict``, first in every form of the report).

    The batch: ``batch`` (a tensor of inputs, a dict or tuple/list of input tensors, or
    ``((inputs...), target)``; a pair ``(x, y)`` is read as (inputs, target) where the model's
    forward takes one input and refused as ambiguous otherwise), or explicitly ``inputs=`` (a
    tensor, a tuple/list of positional inputs, a dict of keyword inputs) and ``target=``.
    Without a target the doctor makes one (``inputs.made_target``). ``output``: which output to
    take the loss of where the model returns a dict, dataclass or tuple (a key or index; by
    default ``logits``, else ``loss``: a one-number ``loss`` output is the loss itself, as is a
    lone 0-dim output without a target, and so is a one-number ``loss`` beside
    ``logits`` where no target is given: the loss of the labels the model was given); the
    report says which was used. ``loss_fn(output, target)`` defaults to cross-entropy for
    integer targets, MSE otherwise. ``optimizer``: its class and defaults are used on copies
    (default: the engine's foreach SGD), and its state is checked (an eps that is 0 in 16 bits).

    ``step_fn(model, optimizer, scaler, batch)`` (and ``scheduler=`` where it takes it): your
    training step, checked for GradScaler misuse (``training.check_step``);
    ``checkpoint_fn(model, optimizer, scaler)``: your save and load, returning the GradScaler a
    resumed run uses (``training.check_checkpoint``). Without them the report says "not checked".

    ``device``: 'cpu' or an available CUDA device (default: the model's). ``precisions``: those
    to time (default: all four on a GPU; none on a CPU, where timing decides nothing, unless
    ``time_cpu=True``); ``warmup`` / ``steps``: per precision. ``compile``: compare eager and
    ``torch.compile`` forwards (default: on a GPU only). ``trial_steps``: fp16 steps per
    GradScaler setting checked with the trainer (0: none; default 5 on a GPU, 2 on a CPU, where
    fp16 kernels are slow). ``fp8_crossover``: the width from
    which FP8 pays on this GPU, or ``(width, where it was measured)`` (default: lesson 07's
    committed run). ``name``: the model's name in the report. ``progress``: print a line per
    part to stderr. Bad arguments raise ValueError naming the setting.

    The model is never changed: every pass runs on copies (``inputs.work_copy``; float32 copies
    where the weights are 16-bit, which is itself diagnosed), in the modes its modules have. A
    measurement that fails becomes a row or finding with the reason; the report is still made.
    """
    t0 = time.perf_counter()
    _inputs.check_model(model)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name must be None or a string (the model's name in the report); "
                         f"got {name!r}")
    device = check_device(device, model)
    check_bool("time_cpu", time_cpu)
    check_bool("progress", progress)
    cpu_untimed = device.type != "cuda" and not time_cpu
    if precisions is None:
        precisions = () if cpu_untimed else PRECISIONS
    elif isinstance(precisions, (tuple, list, str)) and not precisions:
        precisions = ()
    else:
        precisions = _inputs.as_sequence(precisions, "precisions", PRECISIONS)
    if cpu_untimed:
        precisions = ()
    warmup, steps = check_int("warmup", warmup, 0), check_int("steps", steps, 1)
    if trial_steps is None:  # fp16 steps are slow on a CPU: the trial there counts skips only
        trial_steps = CPU_TRIAL_STEPS if device.type != "cuda" else GPU_TRIAL_STEPS
    trial_steps = check_int("trial_steps", trial_steps, 0)
    if compile is not None:
        check_bool("compile", compile)
    if fp8_crossover is None:
        crossover, source = _fp8.lesson07_crossover()
    else:
        crossover, source = _check_fp8_crossover(fp8_crossover)
    for fn, what in ((step_fn, "step_fn(model, optimizer, scaler, batch)"),
                     (checkpoint_fn, "checkpoint_fn(model, optimizer, scaler)")):
        if fn is not None and not callable(fn):
            raise ValueError(f"{what.split('(')[0]} must be None or callable as {what}; got "
                             f"{fn!r}")
    make_optimizer = _speed.like(optimizer)
    bar = _Progress(progress)

    # 16-bit weights are diagnosed; every measurement runs on float32 copies (and inputs)
    low_weights = bool(_weights.low_parameters(model))

    def fresh() -> nn.Module:
        copy = _inputs.work_copy(model, device)
        return copy.float() if low_weights else copy

    work = fresh()
    if low_weights:
        batch = _inputs.as_float32(batch)
        inputs = inputs if inputs is _inputs._UNSET else _inputs.as_float32(inputs)
        target = _inputs.as_float32(target)
    b = _inputs.check_batch(work, batch, loss_fn, device, inputs=inputs, target=target,
                            output=output)
    bar.start("weights and optimizer state")
    weights_diag = _weights.diagnose(model, optimizer)
    call = _inputs.Call(work, b.output)
    failures: List[Dict[str, str]] = []  # measurements that failed: (topic, what, reason)
    bar.lap("weights and optimizer state")

    def run():
        torch.manual_seed(0)  # the same dropout masks in every pass
        return b.loss_fn(call(b.inputs), b.target)

    fp32_losses: List[torch.Tensor] = []

    def run_fp32():
        loss = run()
        fp32_losses.append(loss.detach())
        return loss

    # the numerics, on the working copy
    bar.start("ranges (fp32 forward and backward, per layer and parameter)")
    grad_losses: Dict[str, Dict[str, Dict[str, float]]] = {}
    output_losses: Dict[str, Dict[str, Dict[str, float]]] = {}  # gradient into each layer output

    def on_output(name, g):
        loss = _ranges.gradient_loss(g, scales)
        old = output_losses.get(name)
        if old is None or _lost(loss["reached"]["relative_error"]) > \
                _lost(old["reached"]["relative_error"]):
            output_losses[name] = loss
    fp32_watch = None
    try:
        with _probes.watch(work) as fp32_watch:
            stats = _ranges.layer_ranges(work, run_fp32)
        k = _scale.reached_scale(_ranges.largest_gradient(stats))
        grad_scale = 2.0 ** k if k is not None else 1.0
        scales = {"default": _scale.DEFAULT.init_scale, "reached": grad_scale}
        counts = _ranges.format_shares(
            work, run, grad_scale, default_scale=_scale.DEFAULT.init_scale,
            on_param=lambda n, g: grad_losses.__setitem__(n, _ranges.gradient_loss(g, scales)),
            on_output_grad=on_output)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is a finding, not a dead report
        if _inputs.is_out_of_memory(exc):
            raise
        _inputs.check_trains(work, run, b.shape)  # the model's own failure: a ValueError
        stats, counts, k = {}, {}, None
        failures.append({"topic": "ranges", "what": "the fp32 forward and backward (per-layer "
                         "ranges)", "reason": _scale.failure_text(exc)})
    ranking = _ranking(grad_losses) if k is not None else []
    outputs = [{**r, "layer": r.pop("parameter")} for r in _ranking(output_losses)] \
        if k is not None else []
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
    fp32_cast = _diagnose.cast_site(fp32_watch.forward_nonfinite or fp32_watch.backward_nonfinite
                                    if fp32_watch is not None else None) if fp32_bad else ""
    bar.lap("ranges (fp32 forward and backward, per layer and parameter)")

    # what autocast does; the watch finds where inf/NaN first appears, custom Functions, ...
    bar.start("fp16 autocast trace (ops, inf/NaN sites, custom Functions, reductions)")
    fp16_problem = _fp16_problem(device)
    nonfinite: List[str] = []
    fp16_watch = None
    fp16_failed: List[str] = []
    trace_doc: Dict[str, object] = {"low": "fp16", "reason": fp16_problem or "", "ops": [],
                                    "low_ops": 0, "fp32_ops": 0, "fp32_examples": [], "layers": [],
                                    "both_ops": 0, "both_examples": [], "loss_finite": None,
                                    "loss_dtype": None}
    fp16_unchecked = fp16_problem
    if not fp16_problem:
        try:
            with _probes.watch(work, torch.float16) as fp16_watch:
                fp16_trace = trace(work, run, device.type, torch.float16,
                                   _inputs.input_dtype(b.inputs), b.loss_name)
            nonfinite = fp16_trace.nonfinite
            trace_doc.update(layers=fp16_trace.rows(), loss_finite=fp16_trace.loss_finite,
                             loss_dtype=_probes.dtype_name(fp16_trace.loss))
        except Exception as exc:  # noqa: BLE001
            if _inputs.is_out_of_memory(exc):
                raise
            fp16_unchecked = _scale.failure_text(exc)
            site = fp16_watch.error_site if fp16_watch is not None else None
            fp16_failed.append(f"the fp16 autocast forward and backward raised {fp16_unchecked}"
                               + (f" in {site}" if site else ""))
            trace_doc["reason"] = f"the fp16 autocast forward failed: {fp16_unchecked}"
        if not fp16_failed:
            try:
                with _inputs.quiet_no_grad():
                    ops = op_dtypes(lambda: call(b.inputs), device.type, torch.float16)
                trace_doc.update(ops=ops, **_op_kinds(ops))
            except Exception as exc:  # noqa: BLE001
                failures.append({"topic": "trace", "what": "the op count under fp16 autocast",
                                 "reason": _scale.failure_text(exc)})
    if fp16_watch is not None and not fp16_watch.forward_nonfinite and \
            fp16_watch.first_nonfinite_parameter and trace_doc["loss_finite"] is not False:
        fp16_failed.append(f"under fp16 the gradients are inf/NaN even at loss scale 1 (first "
                           f"{fp16_watch.first_nonfinite_parameter}): the loss scale collapses")
    # fp16's own inf/NaN: layers whose output was finite in fp32 (a -inf mask is not fp16's)
    fp32_inf = {r["layer"] for r in fp32_rows if r.get("act_nonfinite")}
    fp16_new = [n for n in nonfinite if n not in fp32_inf]
    fp16_bad = fp16_new or (["the loss"] if trace_doc["loss_finite"] is False else [])
    if fp16_watch is not None and fp16_watch.forward_nonfinite:  # the op, where the watch saw it
        site = fp16_watch.forward_nonfinite
        fp16_bad = [f"{site['module']} ({site['op']})"]
    worst = ranking[0] if ranking else None
    advice_args = (k, overflow, under_k, under_default, bf16, flushed_k)
    advice_kw = dict(fp16_nonfinite=fp16_bad, fp32_nonfinite=fp32_bad,
                     fp16_unchecked="" if fp16_failed else fp16_unchecked, worst_layer=worst,
                     fp16_failed=fp16_failed, fp32_cast=fp32_cast,
                     worst_output=outputs[0] if outputs else None)
    advice = _scale.advice(*advice_args, **advice_kw)
    bar.lap("fp16 autocast trace (ops, inf/NaN sites, custom Functions, reductions)")

    trial = []
    fp16_raised = fp16_watch is not None and fp16_watch.error is not None
    if trial_steps and not fp16_problem and not fp16_raised:
        bar.start(f"fp16 trial with GradScaler ({plural(trial_steps, 'step')} per setting)")
        settings = {"default": _scale.DEFAULT}
        if advice.get("settings") and advice["settings"]["init_scale"] != _scale.DEFAULT.init_scale:
            settings["advised"] = _scale.ScalerSettings(**advice["settings"])
        trial = _scale.scaler_trial(lambda: _inputs.Call(fresh(), b.output), b.inputs,
                                    _inputs.trainer_target(b.inputs, b.target), b.loss_fn,
                                    make_optimizer, settings, device, trial_steps)
        failures += [{"topic": "scale", "what": f"the fp16 trial ({r['settings']} settings)",
                      "reason": r["reason"]} for r in trial if r.get("status") == "error"]
        # the trial is measured fp16 evidence: an inf/NaN loss there makes fp16 not safe
        advice = _scale.advice(*advice_args, trial=trial, **advice_kw)
        bar.lap(f"fp16 trial with GradScaler ({plural(trial_steps, 'step')} per setting)")

    # the learner's own step and checkpoint
    if step_fn is not None or checkpoint_fn is not None:
        bar.start("your training step and checkpoint")
    step_check = _training.check_step(step_fn, fresh, make_optimizer, b.inputs, b.target,
                                      device, k)
    loss_of = lambda m: b.loss_fn(_inputs.Call(m, b.output)(b.inputs), b.target)  # noqa: E731
    checkpoint_check = _training.check_checkpoint(checkpoint_fn, fresh, make_optimizer,
                                                  _training.amp_step(loss_of, device.type),
                                                  device, k)
    if step_fn is not None or checkpoint_fn is not None:
        bar.lap("your training step and checkpoint")

    why_not = _compiled.compile_skip_reason(device)
    if compile is False:
        compiled_doc = {"reason": "compile=False", "rows": []}
    elif why_not and (compile is None or not hasattr(torch, "compile")):
        compiled_doc = {"reason": why_not, "rows": []}
    else:
        bar.start("eager against torch.compile")
        try:
            compiled_doc = {"reason": "", "rows": _compiled.compare_compiled(call, b.inputs,
                                                                             device=device)}
        except Exception as exc:  # noqa: BLE001
            compiled_doc = {"reason": "", "rows": [_compiled.error_row("fp32", exc)]}
        bar.lap("eager against torch.compile")
    del work, call
    if device.type == "cuda":  # a CPU gets its memory back as it is; gc.collect costs 0.4 s there
        free_memory(device)

    if precisions:
        bar.start(f"speed and memory ({', '.join(precisions)})")
    speed = _speed.speed_rows(lambda: _inputs.Call(fresh(), b.output), b.inputs,
                              _inputs.trainer_target(b.inputs, b.target), b.loss_fn, make_optimizer, device, precisions,
                              warmup, steps) if precisions else []
    if precisions:
        bar.lap(f"speed and memory ({', '.join(precisions)})")
    speed_reason = ("not timed: on a CPU speed rows decide nothing (the course's timing gate "
                    "needs a GPU); pass time_cpu=True (--time-cpu) to time anyway"
                    if cpu_untimed else "" if precisions else "no precision asked for")
    try:
        fp8 = _fp8.candidates(model, device, crossover, source)
    except Exception as exc:  # noqa: BLE001
        fp8 = {"crossover": crossover, "source": source, "status": "error", "layers": [],
               "reason": f"the FP8 conversion plan failed: {_scale.failure_text(exc)}",
               "shapes": _fp8.from_shapes(model, crossover, source)}

    try:
        bf16_row = next((r for r in speed if r["precision"] == "bf16" and r["status"] == "ok"),
                        None)
        fp8["prediction"] = _fp8.predicted(_inputs.Call(fresh(), b.output), b.inputs, device,
                                           bf16_row["step_ms"] if bf16_row else None)
    except Exception as exc:  # noqa: BLE001
        fp8["prediction"] = {"status": "error", "reason": _scale.failure_text(exc),
                             "speedup": None, "linear_speedup": None}
    if fp8["prediction"]["status"] != "not run" and fp8.get("shapes"):
        fp8["shapes"]["text"] += "; " + _fp8.prediction_text(fp8["prediction"])

    # the diagnoses first, then the measurements
    alt = "bf16 (fp32's range in 16 bits)" if bf16 else \
        "fp32 for those layers (this GPU has no native bf16)"
    fw = _watch_doc(fp16_watch)
    if fp16_watch is not None:
        fw["loss_finite"] = trace_doc["loss_finite"]
    alarms: List[Dict[str, str]] = []
    if not fp32_bad:
        alarms += _diagnose.overflow_alarms(overflow, fw, alt, device.type)
        alarms += _diagnose.collapse_alarm(fw, trial, alt, device.type)
        alarms += _diagnose.underflow_alarm(ranking, k, _scale.DEFAULT_EXPONENT, alt,
                                            flushed_k if advice.get("reason") == "flushed"
                                            else 0.0, layers, outputs)
        alarms += _diagnose.function_alarms(fw.get("functions", {}), fw.get("error"),
                                            fw.get("error_site"), device.type)
        alarms += _diagnose.error_alarm(fw.get("error"), fw.get("error_site"),
                                        fw.get("functions", {}), device.type)
        alarms += _diagnose.recompute_alarms(fw.get("recomputes", []))
        alarms += _diagnose.loss_alarms(trace_doc.get("loss_dtype"), fw.get("reductions", []),
                                        b.loss_name, device.type)
    alarms += _diagnose.weights_alarms(weights_diag)
    alarms += _diagnose.check_findings(step_check, checkpoint_check)
    no_gradient = fp32_watch.no_gradient if fp32_watch is not None else []
    alarms += _diagnose.gradient_warnings(no_gradient, b.output_text)
    found = _findings.collect(overflow, fp16_new, k, grad_totals, act_totals, advice,
                              trial, trace_doc, compiled_doc, speed, fp8,
                              fp32_nonfinite=fp32_rows,
                              fp32_loss_finite=fp32_loss_finite, failures=failures,
                              fp32_site=(fp32_watch.forward_nonfinite or
                                         fp32_watch.backward_nonfinite)
                              if fp32_watch is not None else None,
                              output_text=b.output_text, read_as=b.read_as,
                              speed_reason=speed_reason, loss_name=b.loss_name)
    order = {"alarm": 0, "warn": 1, "note": 2, "not checked": 3}
    found = sorted(alarms + found, key=lambda f: order[f["severity"]])  # stable: ties keep order
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    fix_first = [f"{f['class']} at {f['site']}" for f in alarms if f["severity"] == "alarm"
                 and f["class"] in _verdict.FIX_FIRST]
    verdict = _verdict.verdict(device.type, device_name, bf16, advice, fix_first,
                               sorted(weights_diag["low"]))
    if device.type != "cuda":
        site = fw.get("forward_nonfinite") or (
            fw.get("backward_nonfinite") if fw.get("first_nonfinite_parameter") else None) or {}
        cpu_op = site.get("op") if not overflow and _diagnose.cpu_only(site.get("op", ""),
                                                                        device.type) else ""
        verdict["on_gpu"] = _verdict.gpu_outlook(advice, fp16_unchecked if fp16_raised else "",
                                                 cpu_op)
    return DoctorReport(
        model=name or type(model).__name__, parameters=sum(p.numel() for p in model.parameters()),
        device=str(device), device_name=device_name, torch=torch.__version__, batch=b.shape,
        loss=b.loss_text, layers=layers, scale_exponent=k, overflow=overflow,
        fp16_nonfinite=nonfinite, advice=advice, scaler_trial=trial, trace=trace_doc,
        compiled=compiled_doc, speed=speed, fp8=fp8, findings=found,
        seconds=time.perf_counter() - t0,
        extra={"seconds_by_part": bar.clock.laps, "speed_reason": speed_reason},
        verdict=verdict, output=b.output_text, read_as=b.read_as, gradient_loss=ranking[:20],
        probes={"fp32": _watch_doc(fp32_watch), "fp16": fw}, weights=weights_diag,
        step_check=step_check, checkpoint_check=checkpoint_check, no_gradient=no_gradient)


def _op_kinds(ops: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """The trace's op-kind counts, each kind counted once: ``low_ops`` (kinds that ran in 16
    bits), ``fp32_ops`` / ``fp32_examples`` (kinds that ran only in float32), ``both_ops`` /
    ``both_examples`` (kinds that ran in 16 bits at some calls and in float32 at others)."""
    low = {r["op"] for r in ops if r["dtype"] == "16-bit"}
    wide = {r["op"] for r in ops if r["dtype"] != "16-bit"}
    only32, both = sorted(wide - low), sorted(wide & low)
    return {"low_ops": len(low), "fp32_ops": len(only32), "fp32_examples": only32,
            "both_ops": len(both), "both_examples": both}
