"""FP8 candidates: which ``nn.Linear`` layers of a model the engine would train in FP8 here.

FP8 matmuls need FP8 tensor cores (compute capability 8.9+: Ada, Hopper) and torchao; whether
they run is the engine's answer (``bench.float8.fp8_support``). Which layers pay is the engine's
conversion plan (``bench.float8.conversion_plan``, the one lesson 07 trains with), with lesson
07's measured crossover width (the smallest width from which FP8 beat compiled bf16) as its size
threshold: both dimensions at least that width and multiples of 16, and neither the first nor
the last Linear. The doctor adds no rule of its own; where a model has one Linear only (ResNet's
``fc``), its row says so instead of calling it the first layer.

``from_shapes`` decides, on any device, whether FP8 would be slower than bf16 for this model:
every Linear narrower than the crossover in either dimension (lesson 07 measured FP8 losing to
compiled bf16 below it) means it would.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from amp_lessons.measure.float8 import conversion_plan, fp8_support
from amp_lessons.tables import plural


@functools.lru_cache(maxsize=1)
def lesson07_crossover() -> Tuple[Optional[int], str]:
    """Lesson 07's measured crossover width (``lessons.l09_your_model.lesson07_crossover``: the
    smallest width from which FP8 beat compiled bf16 in its committed run) and where it was
    measured; ``(None, why)`` where that run is not here."""
    from amp_lessons.lessons.l09_your_model import lesson07_crossover as crossover

    try:
        return crossover()
    except (OSError, ValueError, KeyError) as exc:
        return None, f"lesson 07's run could not be read ({exc})"


def from_shapes(model: nn.Module, crossover: Optional[int], source: str) -> Dict[str, object]:
    """Whether FP8 would be slower than bf16 here, from the Linear shapes alone: ``linear`` (the
    number of Linear layers), ``wide`` (those at least ``crossover`` wide in both dimensions),
    ``slower`` (True where none is; None without a crossover) and ``text``."""
    shapes = [(n, m.in_features, m.out_features) for n, m in model.named_modules()
              if isinstance(m, nn.Linear)]
    wide = [s for s in shapes if crossover and min(s[1], s[2]) >= crossover]
    if not shapes:
        return {"linear": 0, "wide": 0, "slower": None, "widest": None,
                "text": "no Linear layers: FP8 training (torchao's Float8Linear) has nothing to "
                        "convert"}
    widest = max(shapes, key=lambda s: min(s[1], s[2]))
    if crossover is None:
        return {"linear": len(shapes), "wide": None, "slower": None, "widest": widest[0],
                "text": f"not decided from the shapes: no crossover width measured ({source})"}
    slower = not wide
    text = (f"FP8 would be slower than bf16: none of the {plural(len(shapes), 'Linear layer')} "
            f"is {crossover:,} wide in both dimensions (widest: layer {widest[0]}, "
            f"{widest[1]:,}x{widest[2]:,}), and FP8 only beat compiled bf16 from width "
            f"{crossover:,} on ({source})" if slower else
            f"{len(wide)} of {plural(len(shapes), 'Linear layer')} are at least {crossover:,} "
            f"wide in both dimensions, where FP8 beat compiled bf16 ({source}): FP8 may pay for "
            f"those on an FP8 GPU")
    return {"linear": len(shapes), "wide": len(wide), "slower": slower, "widest": widest[0],
            "text": text}


def predicted(call: nn.Module, inputs, device, bf16_step_ms: Optional[float] = None
              ) -> Dict[str, object]:
    """FP8's end-to-end speed-up predicted from this model's Linear shapes, GEMMs and casts
    measured on this GPU (``measure.fp8_predict.predict_fp8_speedup``: ``call`` is run once on
    ``inputs`` to read each Linear's rows; ``bf16_step_ms``: the doctor's bf16 step, eager, so
    the prediction is of the eager step). Where FP8 does not run here, ``status`` is "not run"
    with the reason and nothing is measured."""
    why = fp8_unavailable(device)
    if why:
        return {"status": "not run", "reason": why, "speedup": None, "linear_speedup": None}
    from amp_lessons.measure.fp8_predict import predict_fp8_speedup

    p = predict_fp8_speedup(call, example_inputs=(inputs,), bf16_step_ms=bf16_step_ms,
                            device=device)
    return {"status": p.status, "reason": p.reason, "speedup": p.speedup,
            "linear_speedup": p.linear_speedup, "bf16_step_ms": bf16_step_ms,
            "gemm_share": p.gemm_share}


def prediction_text(pred: Dict[str, object]) -> str:
    """The predictor's answer in one sentence (slower or faster, and by how much)."""
    if pred.get("speedup") is not None:
        v = pred["speedup"]
        return (f"predicted from this GPU's GEMM and cast timings: FP8 would be "
                f"{'slower' if v < 1 else 'faster'} than bf16, {v:.2f}x the bf16 step")
    if pred.get("linear_speedup") is not None:
        v = pred["linear_speedup"]
        return (f"predicted from this GPU's GEMM and cast timings: the converted layers alone "
                f"would run {v:.2f}x ({'slower' if v < 1 else 'faster'}); no bf16 step was timed, "
                f"so the whole step's speed-up lies between 1 and that")
    return f"FP8 speed-up not predicted: {pred.get('reason', '')}"


def _only_linear(rows):
    """The conversion plan's rows, with the reason of a model's only Linear saying so."""
    if len(rows) == 1:
        rows = [dict(rows[0], reason="the only Linear layer (the last too): produces the "
                                     "output the loss reads")
                if rows[0].get("precision") != "float8" else rows[0]]
    return rows


def fp8_unavailable(device) -> Optional[str]:
    """Why FP8 matmuls do not run on ``device`` (``fp8_support(device).reason``), or None when
    they do."""
    return fp8_support(device).reason or None


def candidates(model: nn.Module, device, crossover: Optional[int],
               source: str = "") -> Dict[str, object]:
    """The FP8 verdict for ``model`` on ``device``: ``status`` ("no FP8 on this GPU",
    "not decided" without a measured crossover, or "measured"), ``summary`` (the status as the
    report shows it: "not on a GPU" off CUDA), ``reason``, and ``layers``: the
    engine's ``conversion_plan(model, min_features=crossover)``, each row with ``candidate``
    (True where the plan trains it in float8) beside the plan's ``precision`` and ``reason``."""
    why = fp8_unavailable(device)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    base = {"crossover": crossover, "source": source, "linear_layers": linears,
            "shapes": from_shapes(model, crossover, source)}
    if why:
        # ``status`` stays the one key for "FP8 does not run here" (lesson 09 asserts it); the
        # report's words say what is missing: off CUDA there is no GPU at all
        shown = "no FP8 on this GPU" if torch.device(device).type == "cuda" else "not on a GPU"
        return {**base, "status": "no FP8 on this GPU", "summary": shown, "reason": why,
                "layers": []}
    if crossover is None:
        return {**base, "status": "not decided", "summary": "not decided",
                "reason": "no measured crossover width: run lesson 07 on this GPU (its speed "
                          "sweep) and pass fp8_crossover=", "layers": []}
    rows = [{**r, "candidate": r["precision"] == "float8"}
            for r in _only_linear(conversion_plan(model, min_features=crossover))]
    chosen = [r for r in rows if r["candidate"]]
    total = sum(r["params"] for r in rows)
    share = sum(r["params"] for r in chosen) / total if total else 0.0
    return {**base, "status": "measured", "summary": "measured", "layers": rows,
            "reason": f"{len(chosen)} of {plural(len(rows), 'Linear layer')} ({share:.0%} of Linear "
                      f"weights) would train in FP8 (the engine's conversion plan at lesson 07's "
                      f"crossover width {crossover:,})"}
