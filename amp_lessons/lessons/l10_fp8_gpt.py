"""Lesson 10, FP8 end to end: where it pays on a whole GPT, which recipe, and a prediction from the
model's shapes (notebooks/10_fp8_end_to_end.ipynb).

Lesson 07 measured FP8 on a stack of MLP blocks, where nearly every microsecond is a large GEMM.
A whole GPT also spends its step in attention (which stays in bf16), in norms, activations, the
loss and the optimizer, and it pays FP8's casts. This lesson measures, on this machine:

1. the FP8 gain of every GEMM shape the GPTs use, and the cost of the cast kernels
   (``calibrate``: ``measure.fp8_predict.measure_calibration``);
2. GPTs of several sizes, compiled, in bf16 and in each torchao recipe (``run_sweep``:
   ``measure.gpt_fp8.gpt_speed_sweep``): tokens/s, the step split into GEMM / attention / FP8
   casts / optimizer / other / idle from the profiler, peak memory, compile time;
3. the speed-up predicted from the models' Linear shapes beside the measured one
   (``prediction_rows``: ``measure.fp8_predict.predict_fp8_speedup``);
4. what stands in the way (``obstacle_rows``), and the loss over several seeds per recipe on real
   text (``parity_summary`` of ``measure.gpt_fp8.parity_runs``);
5. FSDP2's FP8 all-gather at 8 GPUs, as a model from bytes and NVLink's bandwidth
   (``all_gather_rows``), labelled as such.

This module holds the lesson's plan, tables and sentences; the measurements are the engine's.
"""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from amp_lessons.data import stdlib_corpus  # noqa: F401 (the lesson's API)
from amp_lessons.measure.float8 import FP8Support, fp8_support  # noqa: F401 (the lesson's API)
from amp_lessons.measure.fp8_predict import (NVLINK_H100_H200_GBPS, PREDICT_RECIPES,  # noqa: F401
                                             Calibration, fp8_all_gather_saving, gpt_body_filter,
                                             linear_shapes, measure_calibration, measure_casts,
                                             predict_fp8_speedup)
from amp_lessons.measure.gpt_fp8 import (GPT_FP8_RECIPES, GPT_RECIPES, KERNEL_KINDS,  # noqa: F401
                                         NOT_MEASURED, GPTShape, gpt_speed_sweep, parity_runs)
from amp_lessons.publish.report import show_table
from amp_lessons.tables import format_value, noisy, not_compared, plural
from amp_lessons.validate import check_choice, check_int, check_positive

LESSON = "10"

# --- the plan: which GPTs, which recipes -----------------------------------------------------------

FULL_SIZES = (GPTShape(768, 12, 12), GPTShape(1024, 24, 16), GPTShape(2048, 24, 16),
              GPTShape(4096, 8, 32))
QUICK_SIZES = (GPTShape(32, 2, 2, vocab_size=512, seq_len=32),)
PARITY_FULL = GPTShape(768, 12, 12, vocab_size=256)  # the smallest GPT's blocks, byte tokens
PARITY_QUICK = GPTShape(32, 2, 2, vocab_size=256, seq_len=32)


def sweep_plan(big: bool, every_recipe: bool = False) -> List[Tuple[GPTShape, Tuple[str, ...]]]:
    """``(shape, recipes)`` for each GPT of the sweep.

    ``big``: the four GPU sizes (163M to 2.0B parameters). Each recipe compiles once per size
    (5 to 20 s), so by default the plan keeps a full run within a few minutes: every recipe on
    the smallest GPT, bf16 / tensorwise / rowwise on the largest, bf16 / tensorwise in between;
    ``every_recipe=True`` runs all four recipes on every size. Otherwise one tiny GPT in every
    recipe (seconds on a CPU)."""
    if not big:
        return [(s, GPT_RECIPES) for s in QUICK_SIZES]
    if every_recipe:
        return [(s, GPT_RECIPES) for s in FULL_SIZES]
    last = len(FULL_SIZES) - 1
    return [(s, GPT_RECIPES if i == 0 else GPT_RECIPES[:3] if i == last else GPT_RECIPES[:2])
            for i, s in enumerate(FULL_SIZES)]


def flops_rows(plan: Sequence[Tuple[GPTShape, Sequence[str]]], batch_size: int) -> List[dict]:
    """Where a GPT's arithmetic is, from its shapes alone: per step, the FLOPs of the blocks'
    Linear layers (what FP8 converts), of the LM head (kept in bf16) and of attention's two
    batched products (``4 b T^2 d`` per layer forward, times 3 with backward, halved by the
    causal mask as flash kernels skip it), each as a share of the three."""
    check_int("batch_size", batch_size, 1)
    rows = []
    for shape, _ in plan:
        tokens = batch_size * shape.seq_len
        d, h = shape.d_model, shape.mlp_ratio * shape.d_model
        body = 6 * tokens * shape.n_layers * (d * 3 * d + d * d + 2 * d * h)
        head = 6 * tokens * d * shape.vocab_size
        attention = 3 * 4 * batch_size * shape.seq_len ** 2 * d * shape.n_layers / 2
        total = body + head + attention
        rows.append({"model": shape.label, "params": shape.params(), "tokens/step": tokens,
                     "TFLOP/step": total / 1e12, "blocks' Linears %": 100 * body / total,
                     "LM head %": 100 * head / total, "attention %": 100 * attention / total})
    return rows


# --- 1. the calibration: GEMMs and casts on this GPU -----------------------------------------------

def plan_shapes(plan, batch_size: int):
    """``{model label: linear_shapes(model on the meta device)}`` for every GPT of the plan, the
    blocks' Linears converted (``gpt_body_filter``)."""
    import torch
    out = {}
    for shape, _ in plan:
        with torch.device("meta"):
            model = shape.build()
        out[shape.label] = (model, linear_shapes(model, tokens=batch_size * shape.seq_len,
                                                 module_filter_fn=gpt_body_filter))
    return out


def calibrate(plan, batch_size: int, support: FP8Support, device) -> Dict[str, Calibration]:
    """``measure_calibration`` of every recipe in the plan over all the plan's GEMM shapes (the
    cast kernels timed once and shared); ``{}`` where FP8 does not run here."""
    if not support.available:
        return {}
    shapes = [s for _, (_, layers) in plan_shapes(plan, batch_size).items() for s in layers]
    recipes = [r for r in PREDICT_RECIPES if any(r in rs for _, rs in plan)]
    casts = measure_casts(device)
    return {r: measure_calibration(shapes, r, device, casts=casts) for r in recipes}


LAYER_KINDS = {"qkv": "qkv", "proj": "attention out", "mlp.0": "MLP up", "mlp.2": "MLP down"}


def gemm_rows(calibrations: Mapping[str, Calibration], plan, batch_size: int) -> List[dict]:
    """One row per GPT width and Linear kind: its three GEMMs (forward, grad-input,
    grad-weight) in bf16 and in each recipe, as measured, and each recipe's gain."""
    rows, seen = [], set()
    for label, (_, layers) in plan_shapes(plan, batch_size).items():
        for s in layers:
            kind = next((v for k, v in LAYER_KINDS.items() if s.name.endswith(k)), None)
            if not s.converted or kind is None or (s.k, s.n) in seen:
                continue
            seen.add((s.k, s.n))
            row = {"width": min(s.k, s.n), "layer": kind, "M x K x N": f"{s.m}x{s.k}x{s.n}"}
            for recipe, cal in calibrations.items():
                times = [cal.gemm_ms(*s.gemm(r), r) for r in ("forward", "grad_input",
                                                              "grad_weight")]
                row.setdefault("bf16 ms", sum(t[0] for t in times))
                row[f"{recipe} ms"] = sum(t[1] for t in times)
                row[f"{recipe} gain"] = row["bf16 ms"] / row[f"{recipe} ms"]
            rows.append(row)
    return rows


def cast_rows(calibration: Calibration) -> List[dict]:
    """The cast kernels as measured: fixed cost and cost per million elements, and the
    bandwidth that implies for their bytes (``fp8_predict.CAST_BYTES``)."""
    from amp_lessons.measure.fp8_predict import CAST_BYTES, COPY_BYTES
    rows = []
    for kind, (fixed_us, ns) in calibration.casts.items():
        moved = COPY_BYTES if kind == "copy" else CAST_BYTES["bf16"]
        rows.append({"kernel": {"tensorwise": "amax + cast, one scale (bf16 -> e4m3)",
                                "rowwise": "amax + cast, a scale per row (bf16 -> e4m3)",
                                "copy": "transposed FP8 copy"}[kind],
                     "fixed us": fixed_us, "ms per 10M elements": ns * 1e7 / 1e6,
                     "GB/s implied": moved / ns if ns > 0 else None})
    return rows


# --- 2. the sweep ------------------------------------------------------------------------------------

def run_sweep(plan, batch_size: int, steps: int, warmup: int, profile_steps: int,
              support: FP8Support, device, compile: bool = True, progress=None) -> List[dict]:
    """``gpt_speed_sweep`` of each GPT of the plan with its recipes."""
    rows: List[dict] = []
    for shape, recipes in plan:
        rows += gpt_speed_sweep([shape], recipes, batch_size, steps, warmup, profile_steps,
                                support, device, compile, progress)
    return rows


def progress_line(row: Mapping) -> str:
    """One line per measured row while the sweep runs."""
    if row.get("step_ms") is None:
        return f"{row['model']}, {row['recipe']}: {row['status']}"
    return (f"{row['model']}, {row['recipe']}: {row['tokens_per_s']:,.0f} tokens/s, "
            f"step {row['step_ms']:.1f} ms, compile {row['compile_s']:.1f} s")


def _status(row: Mapping) -> str:
    if row.get("step_ms") is None:
        return row["status"]
    return f"measured ({noisy(row)})" if noisy(row) else "measured"


def speed_rows(rows: Sequence[Mapping]) -> List[dict]:
    """The sweep as the lesson shows it: tokens/s (median step), the spread of the timed steps
    (min to max, % of the median) and of their repeats, the speed-up over compiled bf16 of the
    same GPT, peak memory and what FP8 saved of it, the compile time (first step minus a timed
    one), and a status (``measured (noisy: ...)`` where the repeats disagree by over 10%)."""
    out = []
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["recipe"] == "bf16"), {})
        saved = (base["peak_gib"] - r["peak_gib"]) if r.get("peak_gib") is not None and \
            base.get("peak_gib") is not None else None
        out.append({"model": r["model"], "recipe": r["recipe"],
                    "tokens/s": r.get("tokens_per_s"), "step ms": r.get("step_ms"),
                    "min-max %": r.get("spread_pct"),
                    "repeat spread %": 100 * r["spread"] if r.get("spread") is not None else None,
                    "speed-up": r.get("speedup"), "peak GiB": r.get("peak_gib"),
                    "GiB saved": saved, "compile s": r.get("compile_s"), "status": _status(r)})
    return out


def split_rows(rows: Sequence[Mapping]) -> List[dict]:
    """Where each step's time went (ms per step, from the profiler's kernels): GEMM, attention,
    FP8 casts, optimizer, other kernels, and ``idle``: the median step minus the union of the
    GPU's busy intervals (the GPU waiting for the host)."""
    out = []
    for r in rows:
        sp = r.get("split")
        if not sp:
            continue
        row = {"model": r["model"], "recipe": r["recipe"], "step ms": r["step_ms"]}
        row.update({f"{k} ms": sp[k] for k in KERNEL_KINDS})
        row["idle ms"] = r.get("idle_ms")
        row.update({"GEMM %": 100 * sp["gemm"] / r["step_ms"],
                    "attention %": 100 * sp["attention"] / r["step_ms"],
                    "casts %": 100 * sp["fp8 cast"] / r["step_ms"],
                    "idle %": 100 * (r.get("idle_ms") or 0.0) / r["step_ms"]})
        out.append(row)
    return out


def _bf16_row(rows, model):
    return next((b for b in rows if b["model"] == model and b["recipe"] == "bf16"
                 and b.get("step_ms")), None)


def smallest_paying(rows: Sequence[Mapping], recipe: str = "tensorwise",
                    at_least: float = 1.0) -> Optional[str]:
    """The smallest GPT (by parameters) from which ``recipe`` stays faster than ``at_least`` x
    compiled bf16 for every larger GPT measured; None when none does. Noisy rows count as not
    measured."""
    check_choice("recipe", recipe, GPT_FP8_RECIPES)
    check_positive("at_least", at_least)
    measured = sorted((r["params"], r["model"], r["speedup"]) for r in rows
                      if r["recipe"] == recipe and r.get("speedup") is not None and not noisy(r))
    for i, (_, model, _) in enumerate(measured):
        if all(s > at_least for _, _, s in measured[i:]):
            return model
    return None


def best_row(rows: Sequence[Mapping]) -> Optional[Mapping]:
    """The measured FP8 row with the highest speed-up over bf16, or None."""
    fp8 = [r for r in rows if r["recipe"] != "bf16" and r.get("speedup") is not None]
    return max(fp8, key=lambda r: r["speedup"]) if fp8 else None


# --- 3. prediction against measurement ----------------------------------------------------------------

def prediction_rows(rows: Sequence[Mapping], calibrations: Mapping[str, Calibration], plan,
                    batch_size: int, tolerance: float = 0.10) -> List[dict]:
    """For every FP8 row of the sweep: the speed-up ``predict_fp8_speedup`` gives from the GPT's
    Linear shapes, this GPU's calibration and the measured bf16 step (nothing from the FP8 run),
    beside the measured one; the error in % of the measurement and whether it is within
    ``tolerance``; and the prediction's two terms against what the profiler measured: GEMM time
    saved (bf16's GEMM kernels minus FP8's) and the time FP8 added outside GEMMs (its non-GEMM
    kernel time minus bf16's: casts with whatever inductor fused into them)."""
    models = {label: model for label, (model, _) in plan_shapes(plan, batch_size).items()}
    out = []
    for r in rows:
        if r["recipe"] == "bf16":
            continue
        base = _bf16_row(rows, r["model"])
        row = {"model": r["model"], "recipe": r["recipe"], "GEMM share": None, "predicted": None,
               "measured": r.get("speedup"), "error %": None, "within 10%": None,
               "GEMM saved ms (pred.)": None, "GEMM saved ms (meas.)": None,
               "added ms (pred.)": None, "added ms (meas.)": None, "status": ""}
        cal = calibrations.get(r["recipe"])
        if cal is None or base is None:
            row["status"] = ("not decided here: needs an FP8 GPU (capability 8.9+) and torchao"
                             if cal is None else "not decided: no bf16 row measured")
            out.append(row)
            continue
        pred = predict_fp8_speedup(models[r["model"]], cal, tokens=batch_size * r["shape"]["seq_len"],
                                   bf16_step_ms=base["step_ms"], recipe=r["recipe"],
                                   module_filter_fn=gpt_body_filter)
        row.update({"GEMM share": pred.gemm_share, "predicted": pred.speedup,
                    "GEMM saved ms (pred.)": pred.gemm_saved_ms, "added ms (pred.)": pred.cast_ms,
                    "status": pred.status})
        if r.get("speedup") is not None and pred.speedup is not None:
            err = (pred.speedup - r["speedup"]) / r["speedup"]
            row.update({"error %": 100 * err, "within 10%": abs(err) <= tolerance})
        if r.get("split") and base.get("split"):
            b, f = base["split"], r["split"]
            row["GEMM saved ms (meas.)"] = b["gemm"] - f["gemm"]
            row["added ms (meas.)"] = (f["busy_ms"] - f["gemm"]) - (b["busy_ms"] - b["gemm"])
        if r.get("speedup") is None:
            row["status"] = f"predicted; {r['status']}"
        out.append(row)
    return out


# --- 4. what stands in the way -------------------------------------------------------------------------

def obstacle_rows(rows: Sequence[Mapping]) -> List[dict]:
    """Per measured FP8 row, the limits, measured: the bf16 step's shares (GEMM, attention,
    idle), FP8's cast kernels and all its added non-GEMM time as shares of its own step, and
    two ceilings: ``if GEMMs were 2x``: bf16's step with every GEMM twice as fast and nothing
    added (Amdahl's bound, head included); ``without added time``: FP8's step less the time it
    added outside GEMMs (casts fused into the norms, or free)."""
    out = []
    for r in rows:
        base = _bf16_row(rows, r["model"])
        if r["recipe"] == "bf16" or not r.get("split") or base is None or not base.get("split"):
            continue
        b, f = base["split"], r["split"]
        added = (f["busy_ms"] - f["gemm"]) - (b["busy_ms"] - b["gemm"])
        out.append({"model": r["model"], "recipe": r["recipe"], "speed-up": r["speedup"],
                    "bf16 GEMM %": 100 * b["gemm"] / base["step_ms"],
                    "bf16 attention %": 100 * b["attention"] / base["step_ms"],
                    "bf16 idle %": 100 * (base.get("idle_ms") or 0) / base["step_ms"],
                    "FP8 cast kernels %": 100 * f["fp8 cast"] / r["step_ms"],
                    "FP8 added %": 100 * added / r["step_ms"],
                    "if GEMMs were 2x": base["step_ms"] / (base["step_ms"] - b["gemm"] / 2),
                    "without added time": base["step_ms"] / max(r["step_ms"] - added, 1e-9)})
    return out


# --- 5. loss parity -------------------------------------------------------------------------------------

def parity_summary(runs: Sequence[Mapping], min_steps: int = 50, min_seeds: int = 3,
                   resolution: float = 0.02, metric: str = "val_loss") -> dict:
    """Each FP8 recipe's loss against bf16's, seed by seed, beside bf16's seed spread.

    ``metric``: ``val_loss`` (held-out loss on the same fixed batches for every run: the
    comparison this lesson decides on) or ``final_loss`` (mean training loss of the last 10% of
    steps, whose batches differ between seeds). Per recipe: mean final and held-out loss over
    seeds, the paired differences of ``metric`` from bf16 with the same seed (same weights, same
    batches; mean, smallest, largest) and ``within``: whether the mean difference is no larger
    than bf16's seed spread (largest minus smallest ``metric`` over bf16's seeds).
    ``decided`` is False, with the reasons, when the runs cannot tell: fewer than ``min_steps``
    steps or ``min_seeds`` seeds, an FP8 recipe that did not run, a loss that is not finite, or
    a bf16 spread wider than ``resolution`` (too wide to resolve the differences in question).
    """
    check_int("min_steps", min_steps, 1)
    check_int("min_seeds", min_seeds, 2)
    check_positive("resolution", resolution)
    check_choice("metric", metric, ("val_loss", "final_loss"))
    trained = [r for r in runs if r.get("status") == "trained"]
    bf16 = {r["seed"]: r for r in trained if r["recipe"] == "bf16"}
    finals = [r[metric] for r in bf16.values() if math.isfinite(r[metric])]
    spread = max(finals) - min(finals) if len(finals) >= 2 else None
    reasons = []
    if len(finals) < min_seeds:
        reasons.append(f"bf16 has {plural(len(finals), 'finite run')}; a seed spread needs "
                       f"{min_seeds}")
    steps = min((r["steps"] for r in trained), default=0)
    if steps < min_steps:
        reasons.append(f"{plural(steps, 'step')} per run, fewer than {min_steps}")
    if spread is not None and spread > resolution:
        reasons.append(f"bf16's seeds spread {spread:.4f}, wider than the {resolution} this "
                       f"comparison should resolve")
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in runs):
        mine = [r for r in runs if r["recipe"] == recipe]
        done = [r for r in mine if r.get("status") == "trained"]
        row = {"recipe": recipe, "seeds": len(done),
               "final loss": statistics.fmean(r["final_loss"] for r in done) if done else None,
               "held-out loss": statistics.fmean(r["val_loss"] for r in done) if done else None,
               "mean diff": None, "min diff": None, "max diff": None,
               "bf16 seed spread": spread, "within": None, "status": "measured"}
        if not done:
            row["status"] = next((r.get("status") for r in mine), "not run")
            if recipe != "bf16":
                reasons.append(f"{recipe} {row['status']}")
        elif not all(r["finite"] for r in done):
            reasons.append(f"{recipe} ended with a loss that is not finite")
        if recipe != "bf16" and done:
            diffs = [r[metric] - bf16[r["seed"]][metric] for r in done if r["seed"] in bf16]
            if diffs:
                mean = statistics.fmean(diffs)
                row.update({"mean diff": mean, "min diff": min(diffs), "max diff": max(diffs),
                            "within": abs(mean) <= spread if spread is not None else None})
            if len(done) < min_seeds:
                reasons.append(f"{recipe} has {plural(len(done), 'seed')}, fewer than {min_seeds}")
        rows.append(row)
    decided = not reasons
    for row in rows:
        if row["status"] == "measured" and not decided and row["recipe"] != "bf16":
            row["status"] = not_compared("; ".join(dict.fromkeys(reasons)))
    return {"rows": rows, "spread": spread, "steps": steps, "decided": decided, "metric": metric,
            "reason": "; ".join(dict.fromkeys(reasons))}


# --- 6. beyond one GPU, on paper ------------------------------------------------------------------------

def all_gather_rows(plan, rows: Sequence[Mapping], world_size: int = 8,
                    bandwidth_gbps: float = NVLINK_H100_H200_GBPS) -> List[dict]:
    """``fp8_all_gather_saving`` for each GPT of the plan (the blocks' Linears, as converted
    here), beside that GPT's measured tensorwise step on one GPU (the step each GPU would run with
    the same per-GPU batch): the saving as a share of it. A model: nothing ran on several GPUs."""
    import torch
    out = []
    for shape, _ in plan:
        with torch.device("meta"):
            model = shape.build()
        m = fp8_all_gather_saving(model, world_size, bandwidth_gbps, gpt_body_filter)
        step = next((r["step_ms"] for r in rows if r["model"] == shape.label
                     and r["recipe"] == "tensorwise" and r.get("step_ms")), None)
        out.append({"model": shape.label, "GPUs": world_size,
                    "gathered GB/step (bf16)": m["bf16_bytes"] / 1e9,
                    "gathered GB/step (FP8)": m["fp8_bytes"] / 1e9,
                    "bf16 ms": m["bf16_ms"], "FP8 ms": m["fp8_ms"], "saved ms": m["saved_ms"],
                    "% of the FP8 step": 100 * m["saved_ms"] / step if step else None,
                    "kind": "model"})
    return out


# --- 7. sentences and tables -----------------------------------------------------------------------------

def findings(support: FP8Support, rows: Sequence[Mapping], predictions: Sequence[Mapping],
             parity: Mapping) -> List[str]:
    """What this run measured, in sentences: where FP8 starts paying, the best speed-up and
    its GPT, how close the predictions came, and the loss comparison (or why it is not decided)."""
    lines = [support.line()]
    fp8 = [r for r in rows if r["recipe"] != "bf16"]
    if not any(r.get("speedup") is not None for r in fp8):
        why = next((r["status"] for r in fp8), "no FP8 row")
        lines.append(f"Speed of FP8 on a whole GPT: not decided here ({why}).")
    else:
        for recipe in GPT_FP8_RECIPES:
            parts = [f"{r['speedup']:.2f}x on {r['model']}" for r in fp8
                     if r["recipe"] == recipe and r.get("speedup") is not None]
            if parts:
                first = smallest_paying(rows, recipe)
                lines.append(f"float8 {recipe} against compiled bf16: " + ", ".join(parts) + ". "
                             + (f"It pays from {first} up." if first else
                                "It does not pay on every larger GPT measured here."))
        top = best_row(rows)
        lines.append(f"Best: {top['recipe']} at {top['speedup']:.2f}x on {top['model']}.")
    errs = [p for p in predictions if p.get("error %") is not None]
    if errs:
        inside = sum(bool(p["within 10%"]) for p in errs)
        worst = max(errs, key=lambda p: abs(p["error %"]))
        lines.append(f"Prediction from shapes: {inside} of {plural(len(errs), 'FP8 row')} within "
                     f"10% of the measurement; the worst is {worst['recipe']} on "
                     f"{worst['model']}: predicted {worst['predicted']:.2f}x, measured "
                     f"{worst['measured']:.2f}x ({worst['error %']:+.0f}%).")
    if parity.get("decided"):
        for r in parity["rows"]:
            if r["recipe"] != "bf16" and r["mean diff"] is not None:
                what = "held-out loss" if parity.get("metric") == "val_loss" else "final loss"
                lines.append(f"{what.capitalize()} after {plural(parity['steps'], 'step')}: "
                             f"{r['recipe']} ends {r['mean diff']:+.4f} from bf16 (mean over seeds), "
                             f"{'within' if r['within'] else 'outside'} bf16's seed spread of "
                             f"{parity['spread']:.4f}.")
    else:
        lines.append(f"Loss parity: not decided here: {parity.get('reason')}.")
    return lines


def show(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None, title: str = "",
         note: str = "") -> None:
    """Show rows as a table (``report.show_table``, the course's cell formatter)."""
    if not rows:
        print(f"{title}: no rows" if title else "no rows")
        return
    show_table(rows, list(columns or rows[0].keys()), title=title, note=note, cell=format_value)
