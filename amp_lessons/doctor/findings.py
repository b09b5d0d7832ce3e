"""The doctor's findings: one sentence each, the measurement behind it, and the lesson of the
course that explains it (so a learner can go back and see the mechanism on a small example).

Each finding has a ``severity``: ``alarm`` (a failure class was found: its ``site`` names the
module path, parameter or op, its ``fix`` what to change), ``warn`` (something to look at that
is not a precision failure: parameters without a gradient), ``note`` (a measurement) or
``not checked`` (a check that needs something the doctor was not given, with what to pass). An
alarm's ``class`` is one of ``CLASSES``."""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

from amp_lessons.tables import percent, plural

# where each topic is taught
LESSONS = {"ranges": ("01", "fp16/bf16/fp8 ranges, underflow and overflow"),
           "overflow": ("04", "selective autocast: layers kept in fp32"),
           "scale": ("03", "GradScaler's loss-scale dynamics and its four knobs"),
           "trace": ("02", "which ops autocast runs in 16 bits and which in fp32"),
           "speed": ("04", "speed and memory per precision, the timing gate"),
           "idle": ("02", "a launch-bound step: the GPU's idle share"),
           "compile": ("04", "torch.compile"),
           "fp8": ("07", "FP8 training and the width where it pays"),
           "underflow": ("03", "per-layer gradients against fp16's range, init_scale"),
           "nonfinite": ("03", "skipped steps: inf/NaN gradients and the loss scale"),
           "weights": ("08", "16-bit weights and optimizer state: fp32 masters, stochastic "
                             "rounding, Kahan updates"),
           "custom": ("02", "custom autograd Functions under autocast: torch.amp.custom_fwd / "
                            "custom_bwd"),
           "loss": ("02", "the loss and reductions in float32 under autocast"),
           "recompute": ("05", "activation checkpointing: the recompute must run as the forward "
                               "did"),
           "step": ("02", "the AMP step's order: scale, backward, unscale_, clip, step, update"),
           "resume": ("05", "training checkpoints that resume exactly, scaler state included"),
           "outputs": ("09", "what the doctor measures: the output, the loss, the gradients")}
# the failure classes an alarm names (the doctor bench scores them: doctor/bench_cases.py)
CLASSES = ("fp32-nonfinite", "activation-overflow", "attention-overflow", "grad-underflow",
           "scale-collapse", "16bit-weights", "16bit-optimizer-state", "custom-function",
           "checkpoint-recompute", "loss-16bit", "reduction-16bit", "scaler-misuse",
           "scaler-resume", "fp16-failed")


def finding(topic: str, text: str, evidence: str, severity: str = "note", cls: str = "",
            site: str = "", fix: str = "") -> Dict[str, str]:
    """One finding row: ``topic``, ``finding``, ``evidence``, ``lesson`` ("lesson NN: what"),
    ``severity`` (alarm, warn, note, not checked), and for an alarm its ``class`` (one of
    ``CLASSES``), ``site`` and ``fix``."""
    number, what = LESSONS[topic]
    if severity not in ("alarm", "warn", "note", "not checked"):
        raise ValueError(f"severity must be alarm, warn, note or not checked; got {severity!r}")
    if cls and cls not in CLASSES:
        raise ValueError(f"cls must be one of {', '.join(CLASSES)}; got {cls!r}")
    return {"topic": topic, "finding": text, "evidence": evidence,
            "lesson": f"lesson {number}: {what}", "severity": severity, "class": cls,
            "site": site, "fix": fix}


def _share(counts: Mapping[str, int], key: str) -> str:
    return percent(counts[key], counts["nonzero"]) if counts["nonzero"] else "n/a"


def _counts(rows: Sequence[Mapping], key: str) -> str:
    return ", ".join(f"{r['layer']} ({r[key]:,})" for r in rows if r.get(key))


def fp32_broken(rows: Sequence[Mapping], loss_finite: bool) -> bool:
    """True when the fp32 pass itself is not finite: its loss or any layer's gradients hold
    inf/NaN. Layer outputs alone may hold -inf on purpose (a mask before a softmax)."""
    return not loss_finite or any(r.get("grad_nonfinite") for r in rows)


def _trial_evidence(r: Mapping) -> str:
    if r.get("status", "ok") != "ok":
        return f"{r['settings']}: failed ({r.get('reason', '')})"
    loss = r.get("final_loss")
    bad = "" if loss is None or math.isfinite(loss) else f", final loss {loss}"
    return (f"{r['settings']}: {r['skipped']} of {plural(r['steps'], 'step')} skipped, "
            f"scale ended at {r['final_scale']:g}{bad}")


def collect(overflow: Sequence[Mapping], nonfinite_fp16: Sequence[str], k: Optional[int],
            grad_totals: Mapping[str, Mapping[str, int]], act_totals: Mapping[str, Mapping[str, int]],
            advice: Mapping, trial: Sequence[Mapping], trace: Mapping, compiled: Mapping,
            speed: Sequence[Mapping], fp8: Mapping, fp32_nonfinite: Sequence[Mapping] = (),
            fp32_loss_finite: bool = True, failures: Sequence[Mapping] = (),
            fp32_site: Optional[Mapping] = None, output_text: str = "",
            read_as: str = "", speed_reason: str = "",
            loss_name: str = "") -> List[Dict[str, str]]:
    """The measurement findings of one doctor run, in the order a learner should read them (the
    diagnoses of ``diagnose`` go before them). ``fp32_nonfinite``: the layer rows whose fp32
    output or gradients held inf/NaN (their ``act_nonfinite`` / ``grad_nonfinite`` counts are
    named; a model broken in fp32 is an alarm, with ``fp32_site``: the first op that made inf/NaN
    there); ``fp32_loss_finite``: whether the fp32 loss was finite; ``failures``: measurements
    that failed (``topic``, ``what``, ``reason``), each a finding; ``output_text`` and
    ``read_as``: which output the loss was taken of and how the batch was read;
    ``speed_reason``: why no speed row was timed; ``loss_name``: the loss function's name (the
    site of an inf/NaN the loss made from 16-bit inputs in the float32 pass)."""
    out = []
    if fp32_nonfinite or not fp32_loss_finite:
        acts, grads = _counts(fp32_nonfinite, "act_nonfinite"), _counts(fp32_nonfinite,
                                                                        "grad_nonfinite")
        where = "; ".join(part for part in (
            f"layer outputs: {acts}" if acts else "", f"gradients: {grads}" if grads else "",
            "" if fp32_loss_finite else "the loss") if part)
        low = set((fp32_site or {}).get("input_dtypes") or ()) or {"float32"}
        if fp32_broken(fp32_nonfinite, fp32_loss_finite) and low <= {"float16", "bfloat16"}:
            # the op ran on 16-bit inputs in the float32 pass: the learner's code casts there
            in_loss = fp32_site["module"] == "the loss"
            cls = "loss-16bit" if in_loss else "reduction-16bit" if any(
                fp32_site["op"].startswith(f"aten.{r}") for r in ("sum", "mean", "norm", "var",
                                                                    "std", "cumsum", "prod")) \
                else "activation-overflow"
            out.append(finding("loss" if cls != "activation-overflow" else "overflow",
                               f"your code computes {'the loss' if in_loss else 'in 16 bits'} "
                               f"in {'/'.join(sorted(low))} itself and it overflows: "
                               f"{fp32_site['op']} in {fp32_site['module']} returned inf/NaN "
                               f"from finite {'/'.join(sorted(low))} inputs in the float32 run "
                               f"(no autocast), so fp16's 65,504 applies there whatever the "
                               f"precision you train in",
                               "fp32 forward and backward without autocast, every op's output "
                               "and input dtypes checked", "alarm", cls,
                               (f"{loss_name} (the loss)" if in_loss and loss_name else
                                fp32_site["module"]) + f", op {fp32_site['op']}",
                               "compute it in float32: drop the .half() / .to(torch.float16) "
                               "before it (for a loss: loss_fn(output.float(), target.float()))"
                               "; under autocast the model's output is already 16-bit where it "
                               "should be"))
        elif fp32_broken(fp32_nonfinite, fp32_loss_finite):
            site = (f"{fp32_site['module']}, op {fp32_site['op']}" if fp32_site else
                    "not located to an op")
            out.append(finding("ranges", f"the model is not finite in fp32: inf/NaN values "
                               f"already in the float32 pass ({where}); no precision helps, fix "
                               f"the model first", "fp32 forward and backward, inf/NaN values "
                               "counted per layer, every op's output checked", "alarm",
                               "fp32-nonfinite", site, "fix the op in fp32 first (an exp, a "
                               "division, a large weight), then measure again"))
        else:
            out.append(finding("ranges", f"inf/NaN values in fp32 layer outputs ({where}) while "
                               f"the loss and every gradient stay finite: fine for a -inf mask "
                               f"before a softmax, a bug otherwise", "fp32 forward and backward, "
                               "inf/NaN values counted per layer"))
    if not overflow:
        out.append(finding("ranges", "no activation passes fp16's 65,504",
                           "fp32 forward, largest |activation| per layer"))
    if grad_totals:
        g = grad_totals
        where = f"at the loss scale 2^{k}" if k is not None else "unscaled"
        out.append(finding("ranges", f"gradients {where}: fp16 underflows {_share(g['fp16'], 'underflow')} "
                           f"of the nonzero values, bf16 {_share(g['bf16'], 'underflow')}, e4m3 "
                           f"{_share(g['e4m3'], 'underflow')} (overflow {_share(g['e4m3'], 'overflow')}), "
                           f"e5m2 {_share(g['e5m2'], 'underflow')}",
                           "fp32 backward, every layer's output and parameter gradients, counted "
                           "against each format's limits (no per-tensor FP8 scaling)"))
    if act_totals:
        a = act_totals
        out.append(finding("ranges", f"activations: e4m3 overflows {_share(a['e4m3'], 'overflow')} "
                           f"and underflows {_share(a['e4m3'], 'underflow')} without per-tensor "
                           f"scaling; fp16 underflows {_share(a['fp16'], 'underflow')}",
                           "fp32 forward, every leaf layer's output"))
    out.append(finding("scale", " ".join(advice["lines"][:2]),
                       "; ".join(_trial_evidence(r) for r in trial)
                       or "derived from the largest gradient"))
    if trace and trace.get("ops"):
        both = trace.get("both_ops") or 0
        text = (f"under {trace['low']} autocast, {trace['low_ops']} op kinds ran in 16 bits and "
                f"{trace['fp32_ops']} {'only ' if both else ''}in float32 "
                f"({', '.join(trace['fp32_examples'][:5]) or 'none'})")
        if both:
            text += (f"; {plural(both, 'kind')} of the 16-bit ones also ran in float32 at some "
                     f"calls ({', '.join(trace['both_examples'][:5])})")
        out.append(finding("trace", text,
                           "one forward under autocast, ops counted by output dtype"))
    elif trace and trace.get("reason") and not any(f["topic"] == "trace" for f in failures):
        out.append(finding("trace", "the dtype trace was not run", trace["reason"]))
    for f in failures:
        out.append(finding(f["topic"], f"not measured: {f['what']} failed on this model here",
                           f["reason"]))
    if compiled.get("rows"):
        ok = [r for r in compiled["rows"] if r["status"] == "ok"]
        if ok:
            worst = max(ok, key=lambda r: r["max_rel_diff"] or 0.0)
            out.append(finding("compile", f"torch.compile changes the forward output by at most "
                               f"{worst['max_abs_diff']:.3g} ({worst['max_rel_diff'] or 0:.2g} of "
                               f"its largest value, {worst['precision']})",
                               "eager against compiled forward, eval mode, same input"))
        else:
            out.append(finding("compile", "torch.compile failed on this model",
                               compiled["rows"][0]["reason"]))
    else:
        out.append(finding("compile", "eager against compiled: not run", compiled.get("reason", "")))
    if speed_reason:
        out.append(finding("speed", speed_reason, "no timing run"))
    measured = [r for r in speed if r["status"] == "ok"]
    if measured:
        best = max(measured, key=lambda r: r["samples_per_s"])
        decided = [r for r in measured if r["decided"]]
        gate = next((r["gate"] for r in measured if not r["decided"]), "")
        text = (f"fastest: {best['precision']} at {best['samples_per_s']:,.0f} samples/s"
                + (f" ({best['speedup']:.2f}x fp32)" if best.get("speedup") else ""))
        out.append(finding("speed", text if len(decided) == len(measured) else
                           f"not decided: {gate}",
                           f"median of {measured[0]['steps']} steps after "
                           f"{measured[0]['warmup']} warm-up, per precision"))
        idle = [r["gpu_idle_fraction"] for r in measured if r["gpu_idle_fraction"] is not None]
        if idle and max(idle) > 0.25:
            out.append(finding("idle", f"the GPU sat idle up to {max(idle):.0%} of a step: the "
                               f"model is too small (or the batch) for precision to matter",
                               "torch.profiler, kernel time against the median step"))
    if output_text:
        out.append(finding("outputs", f"the loss is taken of {output_text}; the batch was read "
                           f"as {read_as}", "one forward of the batch"))
    if fp8.get("shapes"):
        out.append(finding("fp8", fp8["shapes"]["text"], "the model's Linear shapes against "
                           "lesson 07's crossover width"))
    out.append(finding("fp8", f"{fp8.get('summary', fp8['status'])}: {fp8['reason']}",
                       f"crossover width {fp8['crossover']:,} ({fp8['source']})"
                       if fp8.get("crossover") else "no crossover measured"))
    return out
