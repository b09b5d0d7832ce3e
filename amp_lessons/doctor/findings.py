"""The doctor's findings: one sentence each, the measurement behind it, and the lesson of the
course that explains it (so a learner can go back and see the mechanism on a small example)."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from ..tables import percent, plural

# where each topic is taught
LESSONS = {"ranges": ("01", "fp16/bf16/fp8 ranges, underflow and overflow"),
           "overflow": ("04", "selective autocast: layers kept in fp32"),
           "scale": ("03", "GradScaler's loss-scale dynamics and its four knobs"),
           "trace": ("02", "which ops autocast runs in 16 bits and which in fp32"),
           "speed": ("04", "speed and memory per precision, the timing gate"),
           "idle": ("02", "a launch-bound step: the GPU's idle share"),
           "compile": ("04", "torch.compile"),
           "fp8": ("07", "FP8 training and the width where it pays")}


def finding(topic: str, text: str, evidence: str) -> Dict[str, str]:
    """One finding row: ``topic``, ``finding``, ``evidence`` and ``lesson`` ("lesson NN: what")."""
    number, what = LESSONS[topic]
    return {"topic": topic, "finding": text, "evidence": evidence,
            "lesson": f"lesson {number}: {what}"}


def _share(counts: Mapping[str, int], key: str) -> str:
    return percent(counts[key], counts["nonzero"]) if counts["nonzero"] else "n/a"


def collect(overflow: Sequence[Mapping], nonfinite_fp16: Sequence[str], k: Optional[int],
            grad_totals: Mapping[str, Mapping[str, int]], act_totals: Mapping[str, Mapping[str, int]],
            advice: Mapping, trial: Sequence[Mapping], trace: Mapping, compiled: Mapping,
            speed: Sequence[Mapping], fp8: Mapping) -> List[Dict[str, str]]:
    """Every finding of one doctor run, in the order a learner should read them."""
    out = []
    if overflow:
        worst = max(overflow, key=lambda r: r["value"])
        out.append(finding("overflow", f"fp16 overflows in the forward pass: "
                           f"{plural(len(overflow), 'layer')}, first {overflow[0]['layer']}, worst {worst['layer']} "
                           f"({worst['value']:.4g} > 65,504)",
                           "fp32 forward, largest |activation| per layer"
                           + (f"; under fp16 autocast inf/NaN first appeared in "
                              f"{nonfinite_fp16[0]}" if nonfinite_fp16 else "")))
    else:
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
                       "; ".join(f"{r['settings']}: {r['skipped']} of {plural(r['steps'], 'step')} skipped, "
                                 f"scale ended at {r['final_scale']:g}" for r in trial)
                       or "derived from the largest gradient"))
    if trace:
        out.append(finding("trace", f"under {trace['low']} autocast, {trace['low_ops']} op kinds ran "
                           f"in 16 bits and {trace['fp32_ops']} in float32 "
                           f"({', '.join(trace['fp32_examples'][:5]) or 'none'})",
                           "one forward under autocast, ops counted by output dtype"))
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
    out.append(finding("fp8", f"{fp8['status']}: {fp8['reason']}",
                       f"crossover width {fp8['crossover']:,} ({fp8['source']})"
                       if fp8.get("crossover") else "no crossover measured"))
    return out
