"""FP8 candidates: which ``nn.Linear`` layers are large enough that FP8 pays on this GPU.

FP8 matmuls need FP8 tensor cores (compute capability 8.9+: Ada, Hopper) and torchao. Whether a
layer pays depends on its size: lesson 07 measures, per width, FP8's speed-up over compiled bf16
and finds the smallest width from which FP8 is faster (the crossover). A layer is a candidate
when both its dimensions reach that width and are multiples of 16 (FP8 GEMMs need it).
"""
from __future__ import annotations

import importlib.util
from typing import Dict, List, Optional

import torch
from torch import nn

from ..env import device_capability
from ..tables import plural

MIN_CAPABILITY = (8, 9)


def fp8_unavailable(device) -> Optional[str]:
    """Why FP8 matmuls do not run on ``device`` (a sentence), or None when they do."""
    device = torch.device(device)
    reasons = []
    if device.type != "cuda":
        reasons.append(f"no CUDA GPU (running on the {device.type.upper()})")
    else:
        cap = device_capability(device)
        if cap is None or tuple(cap) < MIN_CAPABILITY:
            shown = "unknown" if cap is None else f"{cap[0]}.{cap[1]}"
            reasons.append(f"compute capability {shown} is below 8.9 (no FP8 tensor cores)")
    if importlib.util.find_spec("torchao") is None:
        reasons.append("torchao is not installed")
    return "; ".join(reasons) or None


def candidates(model: nn.Module, device, crossover: Optional[int],
               source: str = "") -> Dict[str, object]:
    """The FP8 verdict for ``model`` on ``device``: ``status`` ("no FP8 on this GPU",
    "not decided" without a measured crossover, or "measured"), ``reason``, and ``layers``: every
    Linear with its size and whether it is a candidate, and why not."""
    why = fp8_unavailable(device)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    base = {"crossover": crossover, "source": source, "linear_layers": len(linears)}
    if why:
        return {**base, "status": "no FP8 on this GPU", "reason": why, "layers": []}
    if crossover is None:
        return {**base, "status": "not decided",
                "reason": "no measured crossover width: run lesson 07 on this GPU (its speed "
                          "sweep) and pass fp8_crossover=", "layers": []}
    rows: List[Dict[str, object]] = []
    for name, m in linears:
        k, n = m.in_features, m.out_features
        if k % 16 or n % 16:
            reason = "a dimension is not a multiple of 16"
        elif min(k, n) < crossover:
            reason = f"small: {min(k, n):,} < {crossover:,} (FP8's casts cost more than it saves)"
        else:
            reason = ""
        rows.append({"layer": name, "in": k, "out": n, "params": k * n,
                     "candidate": not reason, "reason": reason or f"both dimensions >= {crossover:,}"})
    chosen = [r for r in rows if r["candidate"]]
    total = sum(r["params"] for r in rows)
    share = sum(r["params"] for r in chosen) / total if total else 0.0
    return {**base, "status": "measured", "layers": rows,
            "reason": f"{len(chosen)} of {plural(len(rows), 'Linear layer')} ({share:.0%} of Linear "
                      f"weights) reach the crossover width {crossover:,}"}
