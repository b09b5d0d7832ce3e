"""One Adam step on float16 weights (``model.half()``, no autocast): where Adam's state is
float16 too, its ``eps`` is added in float16, where 1e-8 rounds to 0. ``half_adam_step`` measures
what one step does to weights whose gradient is 0, small or ordinary, for a given ``eps``.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from amp_lessons.numerics.precision import as_device
from amp_lessons.validate import check_positive


def half_adam_step(eps: float, device=None, grads: Sequence[float] = (0.0, 1e-3, 1.0),
                   lr: float = 1e-3) -> Dict[str, object]:
    """One ``torch.optim.Adam(lr, eps)`` step on float16 weights of 1.0 with ``grads``: ``eps``,
    ``eps_in_fp16`` (what float16 makes of it), ``state_dtype``, ``finite`` (every weight
    finite after the step), ``nonfinite`` (how many are not) and ``largest_change`` (the
    largest finite change of a weight, against Adam's usual ``lr``-sized first step)."""
    check_positive("eps", eps)
    check_positive("lr", lr)
    dev = as_device(device)
    weight = torch.nn.Parameter(torch.ones(len(grads), dtype=torch.float16, device=dev))
    weight.grad = torch.tensor(list(grads), dtype=torch.float16, device=dev)
    opt = torch.optim.Adam([weight], lr=lr, eps=eps)
    opt.step()
    after = weight.detach().float()
    finite = torch.isfinite(after)
    change = (after[finite] - 1.0).abs()
    return {"eps": eps, "eps_in_fp16": float(torch.tensor(eps, dtype=torch.float16)),
            "state_dtype": str(opt.state[weight]["exp_avg_sq"].dtype),
            "finite": bool(finite.all()), "nonfinite": int((~finite).sum()),
            "largest_change": float(change.max()) if change.numel() else None, "lr": lr}
