"""Weights and optimizer state kept in 16 bits: what the doctor measures on them (lesson 08).

- ``bf16`` or ``fp16`` weights (``model.to(torch.bfloat16)``, ``model.half()``) without fp32
  master weights: the share of this model's weights that one optimizer step would leave
  unchanged, because the update is below half a unit in the last place (ulp) of the weight;
- the remedies lesson 08 measures (fp32 master weights, stochastic rounding, Kahan-compensated
  updates), each with the bytes it takes for this model's parameters, counted on the optimizers
  themselves (``measure.optim``);
- an optimizer whose ``eps`` is 0 in the dtype its state is kept in (Adam's default 1e-8 is 0 in
  float16, so ``sqrt(v) + eps`` can be 0 and the update inf/NaN).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import nn

from amp_lessons.measure import optim

LOW = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
RECIPES = ("fp32 master", "bf16 + stochastic rounding", "bf16 + Kahan")
ADAM_LIKE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "BF16AdamW", "Adafactor", "Lamb")


def low_parameters(model: nn.Module) -> Dict[str, List[str]]:
    """The names of the model's trainable parameters stored in 16 bits, per dtype name."""
    out: Dict[str, List[str]] = {}
    for n, p in model.named_parameters():
        if p.requires_grad and p.dtype in LOW:
            out.setdefault(LOW[p.dtype], []).append(n)
    return out


def bytes_per_parameter(recipe: str) -> float:
    """Bytes per parameter of weights plus optimizer state under lesson 08's ``recipe``
    (``measure.optim.RECIPES``), counted on a small parameter after one step of the recipe's
    own optimizer on the CPU (torch's AdamW for fp32 masters, ``BF16AdamW`` otherwise)."""
    r = optim.get_recipe(recipe)
    dtype = torch.bfloat16 if r.weights == "bf16" else torch.float32
    p = nn.Parameter(torch.ones(4096, dtype=dtype))
    opt = optim.build_optimizer(r, [p], lr=1e-3)
    p.grad = torch.full_like(p, 1e-3)
    opt.step()
    return (p.numel() * p.element_size() + optim.state_bytes(opt)) / p.numel()


def rounded_away(model: nn.Module, lr: float, grads: Optional[Dict[str, torch.Tensor]] = None,
                 adam_like: bool = True) -> Dict[str, object]:
    """Of the model's 16-bit weights: how many one step would leave unchanged (the update below
    half an ulp of the weight in its own dtype). The update is ``lr`` for Adam-like optimizers
    (their first step moves each weight by about lr) and ``lr * |grad|`` otherwise (``grads``:
    float32 gradients by parameter name). ``half_stop_update``: the update below which half of
    the weights would not move (the median half-ulp), for a learning rate that decays."""
    total = lost = 0
    half_ulps = []
    for n, p in model.named_parameters():
        if not (p.requires_grad and p.dtype in LOW):
            continue
        w = p.detach().float()
        nz = w[w != 0].abs()
        if nz.numel():  # half a unit in the last place of each nonzero weight, in its dtype
            mant = {torch.float16: 10, torch.bfloat16: 7}[p.dtype]  # stored mantissa bits
            half_ulps.append(torch.exp2(torch.floor(torch.log2(nz)) - mant - 1))
        if adam_like or grads is None or n not in grads:
            u = torch.full_like(w, lr)
        else:
            u = lr * grads[n].detach().float().abs()
        moved = (w + u).to(p.dtype).float() != w
        total += w.numel()
        lost += int((~moved & (u > 0)).sum())
    median = float(torch.cat(half_ulps).median()) if half_ulps else None
    return {"weights": total, "unchanged": lost, "share": lost / total if total else 0.0,
            "lr": lr, "half_stop_update": median}


def eps_in(dtype: torch.dtype, eps: float) -> float:
    """``eps`` stored in ``dtype`` (Adam's 1e-8 is 0.0 in float16)."""
    return float(torch.tensor(eps, dtype=dtype))


def optimizer_state(optimizer: Optional[torch.optim.Optimizer], model: nn.Module
                    ) -> List[Dict[str, object]]:
    """Problems of the optimizer's state in 16 bits: per param group, an ``eps`` that is 0 in
    the dtype of its parameters (where the state is kept: torch's optimizers keep it like the
    parameter), and 16-bit moment tensors already in its state."""
    if optimizer is None:
        return []
    rows = []
    for i, group in enumerate(optimizer.param_groups):
        dtypes = {p.dtype for p in group["params"] if p.dtype in LOW}
        eps = group.get("eps")
        for d in sorted(dtypes, key=str):
            if isinstance(eps, (int, float)) and eps > 0 and eps_in(d, eps) == 0.0:
                rows.append({"group": i, "dtype": LOW[d], "eps": eps, "eps_stored": 0.0,
                             "what": f"eps={eps:g} is 0 in {LOW[d]}"})
    low_state = sorted({LOW[v.dtype] for s in optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dtype in LOW and v.dim()})
    if low_state:
        rows.append({"group": None, "dtype": ", ".join(low_state), "eps": None,
                     "eps_stored": None, "what": f"moments kept in {', '.join(low_state)}"})
    return rows


def diagnose(model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             grads: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, object]:
    """Everything this module measures, as data: ``low`` (16-bit parameters per dtype),
    ``rounded`` (``rounded_away`` at the optimizer's learning rate, 1e-4 without one),
    ``remedies`` (lesson 08's recipes with their bytes for this model) and ``state`` (the
    optimizer's 16-bit state problems)."""
    low = low_parameters(model)
    state = optimizer_state(optimizer, model)
    out: Dict[str, object] = {"low": low, "rounded": None, "remedies": [], "state": state}
    if not low:
        return out
    lr = 1e-4
    adam_like = True
    if optimizer is not None:
        lr = float(optimizer.param_groups[0].get("lr", lr))
        adam_like = type(optimizer).__name__ in ADAM_LIKE
    out["rounded"] = rounded_away(model, lr, grads, adam_like)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    remedies = []
    for name in RECIPES:
        per = bytes_per_parameter(name)
        remedies.append({"recipe": name, "bytes_per_parameter": per,
                         "mib": per * n / 2 ** 20,
                         "about": optim.get_recipe(name).about})
    out["remedies"] = remedies
    return out


def share_text(share: float) -> str:
    """A share as the findings write it: one decimal, never '0.0%' for a nonzero share."""
    if share and share < 0.001:
        return "<0.1%"
    return f"{100 * share:.1f}%" if not math.isnan(share) else "n/a"
