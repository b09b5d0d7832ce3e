"""Per-layer ranges of a model's activations and gradients, and what each number format does
to them (the measurement of lesson 01, run on any model).

One fp32 forward and backward (no autocast: the values the model really computes) with a forward
hook on every leaf layer and a tensor hook on its output records, per layer, the largest
magnitude and the smallest nonzero one of the output (activation) and of the gradients (the
gradient flowing back into the output, and the layer's own parameter gradients). A second,
identical pass counts the values that would overflow or underflow (flushed to zero or made
subnormal) in fp16, bf16, e4m3 and e5m2: activations as they are, gradients multiplied by the
loss scale GradScaler would reach (``scale.reached_scale``). The format limits come from
``formats.band_limits``, with the rounding rules of ``formats.scale_sweep``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from amp_lessons.numerics import formats
from amp_lessons.measure.dtype_trace import first_tensor

FORMATS = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")
SHORT = {"fp16": "fp16", "bf16": "bf16", "fp8_e4m3fn": "e4m3", "fp8_e5m2": "e5m2"}
KINDS = ("act", "grad")


def leaf_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """Every leaf module (one without children) by name, in registration order."""
    return {name: m for name, m in model.named_modules() if name and not list(m.children())}


def _hooked_pass(model: nn.Module, run: Callable[[], torch.Tensor],
                 on_tensor: Callable[[str, str, torch.Tensor], None],
                 on_param: Optional[Callable[[str, torch.Tensor], None]] = None,
                 on_output_grad: Optional[Callable[[str, torch.Tensor], None]] = None) -> float:
    """One forward + backward of ``run()``; ``on_tensor(layer, kind, tensor)`` sees every leaf
    layer's output (``act``), the gradient into it and its parameter gradients (``grad``);
    ``on_param(name, grad)`` each parameter's gradient by its full name; ``on_output_grad(layer,
    grad)`` the gradient into each leaf layer's output alone. Returns the loss. Gradients are
    cleared afterwards."""
    layers = leaf_layers(model)
    handles = []

    def hook(name):
        def forward_hook(module, inputs, output):
            out = first_tensor(output)
            if out is None or not out.is_floating_point():
                return
            on_tensor(name, "act", out.detach())
            if out.requires_grad:
                def grad_hook(g):
                    on_tensor(name, "grad", g.detach())
                    if on_output_grad is not None:
                        on_output_grad(name, g.detach())
                out.register_hook(grad_hook)
        return forward_hook

    for name, module in layers.items():
        handles.append(module.register_forward_hook(hook(name)))
    model.zero_grad(set_to_none=True)
    try:
        loss = run()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    for name, module in layers.items():
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                on_tensor(name, "grad", p.grad.detach())
    if on_param is not None:
        for name, p in model.named_parameters():
            if p.grad is not None:
                on_param(name, p.grad.detach())
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def _magnitudes(t: torch.Tensor) -> torch.Tensor:
    a = t.float().abs().reshape(-1)
    return a[torch.isfinite(a)]


def layer_ranges(model: nn.Module, run: Callable[[], torch.Tensor]) -> Dict[str, Dict[str, object]]:
    """Pass one: per leaf layer (call order), for ``act`` and ``grad``: ``absmax``, ``min``
    (smallest nonzero magnitude), ``values``, ``nonzero`` and ``nonfinite`` (already inf/NaN)."""
    stats: Dict[str, Dict[str, object]] = {}

    def on_tensor(name, kind, t):
        a = t.float().abs().reshape(-1)
        finite = torch.isfinite(a)
        nz = a[finite & (a > 0)]
        row = stats.setdefault(name, {"layer": name})
        s = row.setdefault(kind, {"absmax": 0.0, "min": math.inf, "values": 0, "nonzero": 0,
                                  "nonfinite": 0})
        s["values"] += a.numel()
        s["nonfinite"] += int((~finite).sum())
        if nz.numel():
            s["nonzero"] += nz.numel()
            s["absmax"] = max(s["absmax"], float(nz.max()))
            s["min"] = min(s["min"], float(nz.min()))

    _hooked_pass(model, run, on_tensor)
    for row in stats.values():
        for kind in KINDS:
            s = row.get(kind)
            if s is not None and s["min"] == math.inf:
                s["min"] = None
    return stats


SMALLEST_FP32 = 2.0 ** -149  # the smallest positive float32: no |value| lies below it but zero


def format_counts(a: torch.Tensor, plan: Sequence[Tuple[str, str, float]],
                  per_threshold: Optional[bool] = None) -> Dict[str, Dict[str, int]]:
    """Of the finite magnitudes ``a`` (float32), per ``(key, format, scale)`` of ``plan``: how
    many are nonzero, and of those how many overflow, underflow (flushed to zero or subnormal)
    and are flushed to zero once multiplied by ``scale`` (a power of two, so exact) and rounded
    to the format: the thresholds and tie rules of ``formats.scale_sweep``, counted on the
    device (on a CPU with two ``torch.bucketize`` calls whatever the number of formats; on a GPU
    one comparison and sum per threshold, since a histogram of a few bins serialises there;
    ``per_threshold`` chooses explicitly)."""
    below, at_or_below = [0.0], [0.0]   # thresholds t counted as |x| < t and |x| <= t
    keys = []
    for key, fmt, scale in plan:
        info = formats.get_format(fmt)
        limits = formats.band_limits(info)
        normal_from = info.smallest_normal - info.smallest_subnormal / 2
        flushed = limits["flushed_max"] / scale
        keys.append((key, len(below), len(at_or_below), info.has_inf))
        below.append(max(normal_from / scale, SMALLEST_FP32))
        at_or_below.append(flushed if flushed >= SMALLEST_FP32 else 0.0)
        (below if info.has_inf else at_or_below).append(limits["overflow_from"] / scale)

    def counts(thresholds, right):
        if per_threshold if per_threshold is not None else a.is_cuda:  # one reduction per threshold: memory-bound passes, no atomics on few bins
            cmp = torch.le if right is False else torch.lt
            return torch.stack([cmp(a, float(t)).sum() for t in thresholds]).tolist()
        t = torch.tensor(thresholds, dtype=torch.float64)
        order = torch.argsort(t)
        bounds = t[order].to(device=a.device, dtype=torch.float32)
        index = torch.bucketize(a, bounds, right=right)
        per_bin = torch.bincount(index, minlength=len(thresholds) + 1).cumsum(0)[:-1].cpu()
        out = torch.empty(len(thresholds), dtype=torch.int64)
        out[order] = per_bin
        return out.tolist()

    lt, le = counts(below, True), counts(at_or_below, False)
    n, zeros = a.numel(), le[0]
    result = {}
    for key, i, j, ieee in keys:
        result[key] = {"nonzero": n - zeros,
                       "overflow": n - (lt[i + 1] if ieee else le[j + 1]),
                       "underflow": max(lt[i] - zeros, 0), "flushed": max(le[j] - zeros, 0)}
    return result


def format_shares(model: nn.Module, run: Callable[[], torch.Tensor], grad_scale: float,
                  names=FORMATS, default_scale: Optional[float] = None,
                  on_param: Optional[Callable[[str, torch.Tensor], None]] = None,
                  on_output_grad: Optional[Callable[[str, torch.Tensor], None]] = None
                  ) -> Dict[str, Dict[str, Dict[str, Dict[str, int]]]]:
    """Pass two: per layer, per kind (``act`` at scale 1, ``grad`` times ``grad_scale``), per
    format: the counts of ``format_counts`` summed over the layer's tensors. With
    ``default_scale``, gradients are also counted in fp16 at that scale (key ``fp16@init``).
    ``on_param(name, grad)`` sees each parameter's gradient of the same pass
    (``gradient_loss`` per parameter), ``on_output_grad(layer, grad)`` the gradient into each
    leaf layer's output."""
    counts: Dict[str, Dict[str, Dict[str, Dict[str, int]]]] = {}

    def on_tensor(name, kind, t):
        scale = grad_scale if kind == "grad" else 1.0
        plan = [(SHORT[formats.get_format(f).name], f, scale) for f in names]
        if kind == "grad" and default_scale is not None:
            plan.append(("fp16@init", "fp16", default_scale))
        per_kind = counts.setdefault(name, {}).setdefault(kind, {})
        for key, c in format_counts(_magnitudes(t), plan).items():
            total = per_kind.setdefault(key, dict.fromkeys(c, 0))
            for field, value in c.items():
                total[field] += value

    _hooked_pass(model, run, on_tensor, on_param, on_output_grad)
    return counts


def gradient_loss(grad: torch.Tensor, scales: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """What fp16 does to one parameter's (or layer output's) gradient at each loss scale of ``scales`` (name ->
    scale): ``nonzero`` values, the share ``flushed`` to zero, and the ``relative_error`` of the
    whole gradient after the round trip (``||fp16(g * s) / s - g|| / ||g||``, NaN where a value
    overflows at that scale: GradScaler skips that step instead)."""
    a = _magnitudes(grad)
    g = grad.detach().float()
    norm = float(torch.linalg.vector_norm(g)) if g.numel() else 0.0
    out = {}
    plan = [(name, "fp16", s) for name, s in scales.items()]
    counts = format_counts(a, plan)
    for name, s in scales.items():
        c = counts[name]
        back = (g * s).half().float() / s
        finite = bool(torch.isfinite(back).all())
        err = float(torch.linalg.vector_norm(back - g)) / norm if norm and finite else \
            (0.0 if finite else math.nan)
        out[name] = {"nonzero": c["nonzero"], "flushed": c["flushed"] / c["nonzero"]
                     if c["nonzero"] else 0.0, "relative_error": err}
    return out


def largest_gradient(stats: Dict[str, Dict[str, object]]) -> Optional[float]:
    """The largest finite gradient magnitude of any layer (None when no gradient was nonzero)."""
    values = [row["grad"]["absmax"] for row in stats.values()
              if row.get("grad") and row["grad"]["nonzero"]]
    return max(values) if values else None


def table(stats: Dict[str, Dict[str, object]], counts: Dict[str, Dict[str, Dict]],
          kinds: Dict[str, str]) -> List[Dict[str, object]]:
    """One row per layer: its kind (module class), the ranges, and per format the share of
    nonzero values that overflow / underflow (``act`` as is, ``grad`` at the loss scale)."""
    rows = []
    for name, row in stats.items():
        out: Dict[str, object] = {"layer": name, "kind": kinds.get(name, "")}
        for kind in KINDS:
            s = row.get(kind) or {}
            out[f"{kind}_absmax"] = s.get("absmax") if s.get("nonzero") else None
            out[f"{kind}_min"] = s.get("min")
            out[f"{kind}_nonfinite"] = s.get("nonfinite", 0)
            for short, c in counts.get(name, {}).get(kind, {}).items():
                if "@" in short:
                    continue
                n = c["nonzero"]
                out[f"{kind}_{short}_overflow"] = c["overflow"] / n if n else 0.0
                out[f"{kind}_{short}_underflow"] = c["underflow"] / n if n else 0.0
                out[f"{kind}_{short}_counts"] = dict(c)
        rows.append(out)
    return rows


def overflow_sites(rows: List[Dict[str, object]], fmt: str = "fp16") -> List[Dict[str, object]]:
    """The layers whose activations pass ``fmt``'s largest finite value, with the value found
    (fp32 forward) and the share of the layer's values that overflow."""
    limit = formats.band_limits(fmt)["overflow_from"]
    short = SHORT[formats.get_format(fmt).name]
    return [{"layer": r["layer"], "kind": r["kind"], "value": r["act_absmax"],
             "share": r.get(f"act_{short}_overflow"), "limit": formats.get_format(fmt).max}
            for r in rows if r["act_absmax"] is not None and r["act_absmax"] >= limit]
