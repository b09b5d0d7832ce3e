"""FP8 candidates: which ``nn.Linear`` layers of a model the engine would train in FP8 here.

FP8 matmuls need FP8 tensor cores (compute capability 8.9+: Ada, Hopper) and torchao; whether
they run is the engine's answer (``bench.float8.fp8_support``). Which layers pay is the engine's
conversion plan (``bench.float8.conversion_plan``, the one lesson 07 trains with), with lesson
07's measured crossover width (the smallest width from which FP8 beat compiled bf16) as its size
threshold: both dimensions at least that width and multiples of 16, and neither the first nor
the last Linear. The doctor adds no rule and no reason text of its own.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from amp_lessons.measure.float8 import conversion_plan, fp8_support
from amp_lessons.tables import plural


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
    base = {"crossover": crossover, "source": source, "linear_layers": linears}
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
            for r in conversion_plan(model, min_features=crossover)]
    chosen = [r for r in rows if r["candidate"]]
    total = sum(r["params"] for r in rows)
    share = sum(r["params"] for r in chosen) / total if total else 0.0
    return {**base, "status": "measured", "summary": "measured", "layers": rows,
            "reason": f"{len(chosen)} of {plural(len(rows), 'Linear layer')} ({share:.0%} of Linear "
                      f"weights) would train in FP8 (the engine's conversion plan at lesson 07's "
                      f"crossover width {crossover:,})"}
