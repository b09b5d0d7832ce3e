"""The doctor's diagnoses: from what its passes measured, one finding per failure class found, each
naming the site (module path, parameter, op), the evidence and the fix with the lesson that
teaches it (``findings.finding`` with severity ``alarm``); checks that need the learner's own
code are ``not checked`` with what to pass; parameters without a gradient are a ``warn``.

The classes (``findings.CLASSES``) are the mixed-precision problems users report most in the
issue trackers of PyTorch, transformers, accelerate, Lightning, torchao and Transformer Engine;
``doctor/bench_cases.py`` holds a small reproduction of each.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from amp_lessons.doctor.findings import finding
from amp_lessons.doctor.probes import ROOT
from amp_lessons.doctor.scale import LAYER_LOSS_LIMIT, MAX_FLUSHED
from amp_lessons.doctor.weights import share_text
from amp_lessons.tables import plural

ATTENTION_OPS = ("aten.bmm", "aten.baddbmm", "aten.matmul", "aten.mm", "aten.einsum",
                 "aten._scaled_dot_product_attention_math", "aten.scaled_dot_product_attention")


# aten ops that CUDA's fp16 autocast runs in float32 (its "ops that can autocast to float32":
# torch's AMP docs) and CPU autocast runs in fp16 (measured on torch 2.14): an inf/NaN or a
# reduction error a CPU sees at one of them does not happen on a CUDA GPU
CUDA_FLOAT32_OPS = frozenset((
    "exp", "expm1", "log", "log10", "log1p", "log2", "pow", "reciprocal", "rsqrt", "acos", "asin",
    "cosh", "sinh", "tan", "erfinv", "softmax", "_softmax", "log_softmax", "_log_softmax", "sum",
    "cumsum", "cumprod", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
    "norm", "linalg_vector_norm", "softplus", "cdist", "dist", "renorm", "logsumexp"))


def cpu_only(op: str, device_type: str) -> bool:
    """Whether ``op`` (``aten.exp``, ``aten.sum.dim_IntList``) misbehaved in fp16 only because
    the doctor ran on a CPU: CPU autocast runs it in fp16, CUDA autocast in float32."""
    name = str(op).split(".")[1] if str(op).startswith("aten.") else str(op)
    return device_type == "cpu" and name in CUDA_FLOAT32_OPS


def _cpu_only_text(op: str) -> str:
    return (f" (on this CPU only: CPU autocast runs {op} in fp16, CUDA autocast runs it in "
            f"float32, so a CUDA GPU does not see this)")


def cast_site(site: Optional[Mapping]) -> str:
    """Where a float32 pass made inf/NaN from 16-bit inputs only (the learner's own ``.half()``
    or ``.to(torch.float16)``: fp16's range applies there without autocast), as words
    ("aten.sum in the loss on float16 inputs"); "" where the op's inputs were float32 or none
    was located."""
    dtypes = set((site or {}).get("input_dtypes") or ())
    if not dtypes or not dtypes <= {"float16", "bfloat16"}:
        return ""
    where = site["module"] if site["module"] == "the loss" else f"module {site['module']}"
    return f"{site['op']} in {where} on {'/'.join(sorted(dtypes))} inputs"


def _is_attention(site: Mapping) -> bool:
    where = f"{site.get('module', '')} {site.get('kind', '')}".lower()
    return site.get("op") in ATTENTION_OPS and (
        "attn" in where or "attention" in where or site.get("op") in ATTENTION_OPS[:2])


def _op_site(site: Mapping) -> str:
    kind = f" ({site['kind']})" if site.get("kind") else ""
    return f"{site['module']}{kind}, op {site['op']}"


def overflow_alarms(overflow: Sequence[Mapping], fp16_watch: Optional[Mapping],
                    alt: str, device_type: str = "cuda") -> List[Dict[str, str]]:
    """Activation and attention-score overflow: the first layer whose fp32 output passes fp16's
    65,504, else the first op whose fp16 output was inf/NaN from finite inputs (said to be this
    CPU's alone where CUDA autocast runs that op in float32: ``cpu_only``)."""
    out = []
    site = (fp16_watch or {}).get("forward_nonfinite")
    if overflow:
        first = overflow[0]
        worst = max(overflow, key=lambda r: r["value"])
        op = f"; under fp16 autocast the first inf/NaN came from {_op_site(site)}" if site else ""
        cls = "attention-overflow" if site and _is_attention(site) and \
            site["module"] == first["layer"] else "activation-overflow"
        out.append(finding(
            "overflow", f"fp16 overflows in the forward pass at {first['layer']} "
            f"({first['kind']}): its output reaches {first['value']:.4g} > 65,504"
            + (f" ({plural(len(overflow), 'layer')} in all, worst {worst['layer']} at "
               f"{worst['value']:.4g})" if len(overflow) > 1 else ""),
            f"fp32 forward, largest |output| per layer; {first['share']:.2%} of that layer's "
            f"values pass 65,504{op}", "alarm", cls, first["layer"],
            f"train in {alt}, or keep {first['layer']} in fp32 (selective autocast: "
            f"torch.autocast(..., enabled=False) around it, its input .float()); no loss scale "
            f"helps: GradScaler scales gradients, not activations"))
    elif site:
        attention = _is_attention(site)
        cls = "attention-overflow" if attention else "activation-overflow"
        between = site["module"] in (ROOT, "the loss")  # not inside any submodule
        fix = ("scale the scores by 1/sqrt(head_dim) before the softmax (or use "
               "F.scaled_dot_product_attention), or compute them in fp32" if attention else
               f"run that {site['op']} in float32 at the line of {site['module']} that calls it "
               f"(its input .float(), or torch.autocast(..., enabled=False) around that line)"
               if between
               else f"keep {site['module']} in fp32 (selective autocast)")
        largest = (f"; its largest input was {site['largest_input']:.4g}"
                   if site.get("largest_input") is not None else "")
        zero = (f"; it divided by (or took the log of) a 16-bit zero: a value fp16 flushed to "
                f"0 (an underflow: below 6e-08), not one too large"
                if site.get("zero_operand") else "")
        out.append(finding(
            "overflow", f"fp16 {'gives inf/NaN' if zero else 'overflows'} inside "
            f"{site['module']}"
            + (f" ({site['kind']})" if site.get("kind") else "") + f": {site['op']} returned "
            f"inf/NaN from finite {'/'.join(site['input_dtypes'])} inputs under fp16 autocast, "
            f"although no layer's fp32 output passes 65,504{zero}"
            + (_cpu_only_text(site["op"]) if cpu_only(site["op"], device_type) else ""),
            f"one forward under fp16 autocast, every op's output checked{largest}", "alarm", cls,
            _op_site(site), f"{fix}; or train in {alt}"))
    return out


def collapse_alarm(fp16_watch: Optional[Mapping], trial: Sequence[Mapping],
                   alt: str, device_type: str = "cuda") -> List[Dict[str, str]]:
    """A loss scale that collapses: gradients inf/NaN under fp16 at loss scale 1 (so at every
    scale GradScaler can reach) while the forward was finite. Names the first parameter whose
    gradient was non-finite and the backward op that made it (said to be maybe this CPU's alone
    where CUDA autocast runs that op in float32: ``cpu_only``)."""
    w = fp16_watch or {}
    if w.get("forward_nonfinite") or not w.get("first_nonfinite_parameter") or \
            w.get("loss_finite") is False:
        return []
    op = w.get("backward_nonfinite")
    skipped = [t for t in trial if t.get("skipped") is not None and t["skipped"] == t["steps"]]
    return [finding(
        "nonfinite", f"the loss scale collapses: under fp16 the forward is finite but the "
        f"gradients are inf/NaN even at loss scale 1, so GradScaler skips every step whatever "
        f"its scale; first non-finite gradient: {w['first_nonfinite_parameter']}"
        + (f" (maybe on this CPU only: CPU autocast runs {op['op']} in fp16, CUDA autocast "
           f"runs it in float32)" if op and cpu_only(op["op"], device_type) else ""),
        f"fp16 autocast forward and backward at scale 1: {w['nonfinite_parameters']} "
        f"parameter gradients inf/NaN"
        + (f"; first made by {op['op']} in the backward of {op['module']}" if op else "")
        + (f"; the fp16 trial skipped {skipped[0]['skipped']} of {skipped[0]['steps']} steps"
           if skipped else ""), "alarm", "scale-collapse",
        f"{w['first_nonfinite_parameter']}" + (f" (backward of {op['module']}, {op['op']})"
                                                if op else ""),
        f"keep {op['module'] if op else 'that part'} in fp32 (an op whose backward divides by a "
        f"value fp16 rounds to 0: a sqrt, a norm, a division), or train in {alt}")]


def _lost(v) -> float:
    return v if isinstance(v, float) and v == v else 0.0


def underflow_alarm(ranking: Sequence[Mapping], k: Optional[int], default_k: int,
                    alt: str, flushed_at_k: float = 0.0,
                    layers: Sequence[Mapping] = (),
                    outputs: Sequence[Mapping] = ()) -> List[Dict[str, str]]:
    """Gradient underflow confined to some parameters: the worst one by how much of its gradient
    fp16 loses (relative error after the round trip) at the scale GradScaler reaches, and at the
    default init_scale where that is lower. Where no parameter loses that much but more than
    ``scale.MAX_FLUSHED`` of all gradient values (``flushed_at_k``) are flushed to zero at the
    reached scale (which makes the advice bf16), the layer whose output gradient fp16 changes
    most (``outputs``: ``layer``, ``error_k``, worst first), else the one holding the most
    flushed values (of ``layers``, ``ranges.table``'s rows), is named instead: the verdict never
    calls fp16 unsafe without a site."""
    if not ranking or k is None:
        return []

    def bad(r):
        return max(_lost(r["error_k"]), _lost(r["error_default"]) if default_k < k else 0.0)
    over = [r for r in ranking if bad(r) > LAYER_LOSS_LIMIT]
    if not over and flushed_at_k > MAX_FLUSHED:
        def flushed(r):
            return ((r.get("grad_fp16_counts") or {}).get("flushed") or 0)
        most = sorted((r for r in layers if flushed(r)), key=flushed, reverse=True)[:3]
        if not most:
            return []
        w = most[0]
        if outputs and _lost(outputs[0]["error_k"]) > LAYER_LOSS_LIMIT:
            w = next((r for r in layers if r["layer"] == outputs[0]["layer"] and flushed(r)), w)
            most = [w] + [r for r in most if r is not w][:2]
        c = w["grad_fp16_counts"]
        return [finding(
            "underflow", f"gradient underflow at {w['layer']}: at 2^{k}, the highest loss scale "
            f"GradScaler reaches, fp16 flushes {share_text(flushed_at_k)} of all gradient values "
            f"to zero, most in the gradient of {w['layer']}'s output ({c['flushed']:,} of "
            f"{c['nonzero']:,} values)"
            + (f"; the gradient into {outputs[0]['layer']}'s output changes by "
               f"{share_text(_lost(outputs[0]['error_k']))} (relative error)" if outputs else
               f", although no parameter's gradient changes by more than "
               f"{share_text(max(_lost(r['error_k']) for r in ranking))} (relative error)")
            + ": the gradients span more than fp16's range", f"fp32 backward, each layer's output "
            f"gradient at 2^{k} counted against fp16's range: "
            + ", ".join(f"{r['layer']} {r['grad_fp16_counts']['flushed']:,} flushed"
                        for r in most), "alarm", "grad-underflow", w["layer"],
            f"train in {alt}; with fp16, keep {w['layer']} in fp32 (selective autocast) or check "
            f"that training converges as in fp32")]
    if not over:
        return []
    w = max(over, key=bad)
    at_k, at_default = _lost(w["error_k"]), _lost(w["error_default"])
    evidence = (f"fp32 backward, each parameter's gradient rounded to fp16: at the default "
                f"init_scale 2^{default_k} {w['parameter']}'s gradient changes by "
                f"{share_text(at_default)} (relative error; {share_text(w['share_default'])} of "
                f"its values flushed to zero), at 2^{k} (where GradScaler settles) by "
                f"{share_text(at_k)} ({share_text(w['share_k'])})"
                + (f"; {plural(len(over) - 1, 'more parameter')} over {LAYER_LOSS_LIMIT:.0%}: "
                   + ", ".join(r["parameter"] for r in over if r is not w)[:200]
                   if len(over) > 1 else ""))
    if at_k > LAYER_LOSS_LIMIT:
        text = (f"gradient underflow in {w['parameter']}: fp16 loses {share_text(at_k)} of its "
                f"gradient even at 2^{k}, the highest loss scale GradScaler reaches")
        fix = f"train in {alt}, or keep that layer in fp32 (selective autocast)"
    else:
        text = (f"gradient underflow in {w['parameter']} at the default init_scale: fp16 loses "
                f"{share_text(at_default)} of its gradient at 2^{default_k}, "
                f"{share_text(at_k)} at 2^{k}")
        fix = f"GradScaler(init_scale=2**{k - 1}) (one halving under where it settles)"
    return [finding("underflow", text, evidence, "alarm", "grad-underflow", w["parameter"], fix)]


def weights_alarms(diag: Mapping) -> List[Dict[str, str]]:
    """16-bit weights without fp32 masters, and optimizer state whose eps is 0 in 16 bits."""
    out = []
    low = diag.get("low") or {}
    rounded = diag.get("rounded")
    if low and rounded:
        names = [n for ns in low.values() for n in ns]
        remedies = "; ".join(f"{r['recipe']}: {r['bytes_per_parameter']:g} bytes per parameter "
                             f"({r['mib']:.3g} MiB here)" for r in diag.get("remedies", []))
        half = rounded.get("half_stop_update")
        later = (f"; half of them stop moving once an update falls below {half:.2g} (half a "
                 f"unit in the last place of the median weight: a decayed learning rate, a "
                 f"small gradient)" if half else "")
        out.append(finding(
            "weights", f"the weights are stored in {' and '.join(low)} without fp32 master "
            f"weights: {share_text(rounded['share'])} of them would not move in an optimizer step "
            f"at lr {rounded['lr']:g} (the update is below half a unit in the last place)"
            + later,
            f"{plural(rounded['weights'], 'weight')} of {plural(len(names), 'parameter')} "
            f"({names[0]}{' ...' if len(names) > 1 else ''}): w + update rounded back to its "
            f"dtype, {rounded['unchanged']:,} unchanged", "alarm", "16bit-weights",
            f"{names[0]}" + (f" and {plural(len(names) - 1, 'more parameter')}"
                             if len(names) > 1 else ""),
            f"keep fp32 weights and train under autocast (model.float()), or keep the 16-bit "
            f"weights with one of lesson 08's remedies: {remedies}"))
    for row in diag.get("state") or []:
        if row.get("group") is None:
            continue
        out.append(finding(
            "weights", f"the optimizer's eps={row['eps']:g} is {row['eps_stored']:g} in "
            f"{row['dtype']}, the dtype its state is kept in: sqrt(v) + eps can be 0 and the "
            f"update inf/NaN", f"torch.tensor({row['eps']:g}, dtype={row['dtype']}) == 0",
            "alarm", "16bit-optimizer-state", f"optimizer param group {row['group']}",
            "keep the weights and the optimizer state in fp32 (autocast for the forward), or "
            "raise eps to at least 1e-7 where the state must stay 16-bit (lesson 08)"))
    return out


def function_alarms(functions: Mapping[str, Mapping], error: Optional[str],
                    error_site: Optional[str], device_type: str) -> List[Dict[str, str]]:
    """Custom autograd Functions that ran under autocast without ``torch.amp.custom_fwd`` /
    ``custom_bwd`` and broke: an error raised in them, inputs of mixed dtypes, or a backward
    that runs matmuls in float32 where the forward ran them in 16 bits (a recompute outside
    autocast, as a hand-written checkpoint does)."""
    out = []
    fix = (f"decorate its forward with @torch.amp.custom_fwd(device_type='{device_type}', "
           f"cast_inputs=torch.float32) (or without cast_inputs, to run it in the autocast "
           f"dtype) and its backward with @torch.amp.custom_bwd(device_type='{device_type}')")
    for name, r in functions.items():
        if not r.get("autocast") or (r.get("custom_fwd") and r.get("custom_bwd")):
            continue
        failed = r.get("error") or (error and error_site == f"custom Function {name}" and error)
        mixed = len([d for d in r.get("input_dtypes", []) if d != "float64"]) > 1
        recompute = r.get("backward_fp32_ops", 0) and r.get("forward_low_ops", 0)
        where = f"custom Function {name} (called in {r.get('module')})"
        if failed or mixed:
            out.append(finding(
                "custom", f"the custom autograd Function {name}: it runs under autocast without "
                f"torch.amp.custom_fwd/custom_bwd" + (f" and fails: {failed}" if failed else
                                                        f": it receives mixed dtypes "
                                                        f"({', '.join(r['input_dtypes'])})"),
                f"fp16 autocast forward and backward; its inputs were "
                f"{', '.join(r['input_dtypes']) or 'not tensors'}; its backward runs outside "
                f"autocast", "alarm", "custom-function", where, fix))
        elif recompute:
            out.append(finding(
                "custom", f"the custom autograd Function {name} recomputes in float32: its "
                f"backward ran {plural(r['backward_fp32_ops'], 'matmul')} in float32 where its "
                f"forward ran them in 16 bits (a checkpoint recomputed outside autocast: "
                f"slower, more memory, and gradients of another computation than the forward's)",
                "fp16 autocast forward and backward, matmul output dtypes inside the Function",
                "alarm", "checkpoint-recompute", where,
                fix + "; or use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), "
                      "which recomputes under the forward's autocast state (lesson 05)"))
    return out


def error_alarm(error: Optional[str], error_site: Optional[str],
                functions: Mapping[str, Mapping], device_type: str = "cuda"
                ) -> List[Dict[str, str]]:
    """An fp16 pass that raised where no custom Function explains it (a custom op registered
    with ``torch.library`` and no autocast rule, a checkpoint whose recompute differs from its
    forward, an op without a 16-bit kernel)."""
    if not error:
        return []
    if error_site and error_site.startswith("custom Function ") and \
            error_site[len("custom Function "):] in functions:
        return []
    if error_site and error_site.startswith("custom op "):
        op = error_site[len("custom op "):].split(" ")[0]
        return [finding(
            "custom", f"the custom op {op} fails under fp16 autocast: {error}", "one forward "
            "and backward under fp16 autocast: autocast casts no input of an op registered "
            "outside torch, so it received the 16-bit activations beside float32 weights",
            "alarm", "custom-function", error_site,
            f"give it an autocast rule: torch.library.register_autocast('{op}', "
            f"'{device_type}', torch.float32) (lesson 04 names it), or cast its inputs to one "
            f"dtype inside it")]
    cls = "checkpoint-recompute" if "CheckpointError" in error or "Recomputed" in error \
        else "fp16-failed"
    fix = ("make the checkpointed function compute the same dtypes when recomputed: keep "
           "autocast outside it and use torch.utils.checkpoint.checkpoint(..., "
           "use_reentrant=False)" if cls == "checkpoint-recompute" else
           "run that part in fp32 (selective autocast) or train in bf16")
    return [finding("recompute" if cls == "checkpoint-recompute" else "trace",
                    f"the model fails under fp16 autocast: {error}",
                    "one forward and backward under fp16 autocast", "alarm", cls,
                    error_site or "not located (no module or custom Function in the traceback)",
                    fix)]


def recompute_alarms(recomputes: Sequence[Mapping]) -> List[Dict[str, str]]:
    """Modules whose forward ran again in the backward (a checkpoint's recompute) with matmuls
    in another dtype than their forward's: the gradients are of another computation."""
    out = []
    for r in recomputes[:3]:
        out.append(finding(
            "recompute", f"the checkpointed region {r['module']} recomputes in another dtype: its "
            f"forward ran its matmuls in {'/'.join(r['forward'])}, the recompute in the backward "
            f"in {'/'.join(r['recompute'])}, so the gradients are those of another computation "
            f"than the forward's", "fp16 autocast forward and backward, matmul output dtypes "
            "per module in the forward and when run again during the backward", "alarm",
            "checkpoint-recompute", r["module"],
            "make the region compute the same in both passes: no branch on "
            "torch.is_grad_enabled() or autocast state inside it (a reentrant checkpoint runs "
            "its first pass under no_grad); use torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=False), which raises when the recompute differs"))
    return out


def loss_alarms(loss_dtype: Optional[str], reductions: Sequence[Mapping],
                loss_name: str, device_type: str = "cuda") -> List[Dict[str, str]]:
    """A loss computed in 16 bits, and reductions whose 16-bit result differs from float32 by
    more than ``probes.REDUCTION_LIMIT`` (said to be this CPU's alone where CUDA autocast runs
    that reduction in float32: ``cpu_only``)."""
    out = []
    if loss_dtype in ("float16", "bfloat16"):
        out.append(finding(
            "loss", f"the loss is computed in {loss_dtype} under autocast ({loss_name}): a "
            f"mean or sum of many values in 16 bits loses digits or overflows",
            f"the loss tensor's dtype under fp16 autocast: {loss_dtype}", "alarm", "loss-16bit",
            loss_name, "compute the loss in float32: loss_fn(output.float(), target), or use a "
                       "loss autocast runs in float32 (F.cross_entropy, F.mse_loss)"))
    for r in reductions:
        out.append(finding(
            "loss", f"a reduction runs in {r['dtype']}: {r['op']} in {r['module']} differs from "
                    f"its float32 result by {share_text(r['relative_difference'])}"
                    + (_cpu_only_text(r["op"]) if cpu_only(r["op"], device_type) else ""),
            f"the op again in float32 on the same {plural(r['values'], 'value')}", "alarm",
            "reduction-16bit", f"{r['module']}, op {r['op']}",
            "reduce in float32: x.float().sum(...) / x.mean(..., dtype=torch.float32), or keep "
            "that module in fp32 (selective autocast)"))
        break  # the first one; the report's table lists them all
    return out


def check_findings(step: Mapping, checkpoint: Mapping) -> List[Dict[str, str]]:
    """The learner's step and checkpoint: each misuse an alarm, or "not checked" and why."""
    out = []
    for check, topic, cls in ((step, "step", "scaler-misuse"),
                              (checkpoint, "resume", "scaler-resume")):
        if check.get("status") == "not checked":
            out.append(finding(topic, f"not checked: {check['reason']}", "needs your code",
                               "not checked"))
        elif check.get("status") == "error":
            out.append(finding(topic, f"not checked: {check['reason']}", "your function raised",
                               "not checked"))
        for p in check.get("problems", []):
            out.append(finding(topic, f"{p['misuse']}: {p['what']}", p["evidence"], "alarm",
                               cls, p["misuse"], p["fix"]))
    if step.get("status") == "checked" and step.get("scheduler", "").startswith("not checked"):
        out.append(finding("step", f"scheduler on skipped steps: {step['scheduler']}",
                           "needs a step_fn that takes scheduler=", "not checked"))
    return out


def gradient_warnings(no_gradient: Sequence[str], output_text: str) -> List[Dict[str, str]]:
    """Parameters that received no gradient from the loss."""
    if not no_gradient:
        return []
    shown = ", ".join(no_gradient[:6]) + (" ..." if len(no_gradient) > 6 else "")
    return [finding("outputs", f"{plural(len(no_gradient), 'parameter')} received no gradient: "
                    f"{shown}", f"fp32 backward of the loss taken of {output_text}", "warn",
                    "", shown, "if they should train, take the loss of the output they feed "
                               "(output=KEY, --output KEY) or remove them")]
