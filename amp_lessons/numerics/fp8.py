"""FP8 casts with dynamic scaling, and what they lose: the scale that puts a tensor's largest
magnitude at the top of e4m3's or e5m2's range (one per tensor, or per row), the cast and its
inverse, and the quantization error of real tensors (lesson 07's numerics), with the formats'
facts from ``formats.get_format`` (``fp8_format_facts``)."""
from __future__ import annotations

import statistics
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

from amp_lessons.validate import check_choice
from amp_lessons.numerics.formats import get_format


FP8_FORMATS: Dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


SCALINGS = ("none", "tensorwise", "rowwise")


TENSOR_KINDS = ("activation", "weight", "gradient")


def fp8_max(fmt: str) -> float:
    """The largest finite value of an FP8 format (448 for e4m3, 57,344 for e5m2)."""
    check_choice("fmt", fmt, tuple(FP8_FORMATS))
    return float(torch.finfo(FP8_FORMATS[fmt]).max)


def amax_scale(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensorwise",
               power_of_2: bool = False) -> torch.Tensor:
    """Dynamic scale for casting ``x`` to FP8: the format's largest value over ``amax(|x|)``.

    ``tensorwise``: one scale (a 0-d tensor); ``rowwise``: one per row, over the last dimension
    (shape ``... x 1``); ``none``: 1. ``power_of_2`` rounds scales down to a power of two (torchao's
    rowwise recipe does, so scaling itself adds no rounding error). Multiplying by the scale puts
    the largest magnitude exactly at the top of the format's range.
    """
    check_choice("fmt", fmt, tuple(FP8_FORMATS))
    check_choice("granularity", granularity, SCALINGS)
    x = x.detach().float()
    if granularity == "none":
        return torch.ones((), device=x.device)
    rows = granularity == "rowwise" and x.dim() > 0
    if x.numel() == 0:  # nothing to scale: scale 1, in the shape a non-empty x would give
        return torch.ones(x.shape[:-1] + (1,) if rows else (), device=x.device)
    amax = x.abs().amax(dim=-1, keepdim=True) if rows else x.abs().amax()
    # the floor caps the scale at 2^127, finite in fp32 for an all-zero tensor or row (and a
    # power of two, so power_of_2 keeps it), and no lower: a tensor of tiny normal values
    # (amax 1e-18) still reaches the top of the range
    scale = fp8_max(fmt) / amax.clamp(min=fp8_max(fmt) * 2.0 ** -127)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def to_fp8(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensorwise",
           power_of_2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to FP8 with a dynamic scale: ``(x * scale)`` saturated to the range, then cast.

    Returns ``(x_fp8, scale)``; ``from_fp8(x_fp8, scale)`` undoes the scale. Saturating first
    matters: e4m3fn has no infinity, and values past 448 would cast to NaN.
    """
    scale = amax_scale(x, fmt, granularity, power_of_2)
    top = fp8_max(fmt)
    return (x.detach().float() * scale).clamp(-top, top).to(FP8_FORMATS[fmt]), scale


def from_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to fp32: the FP8 values divided by the scale they were cast with."""
    if x_fp8.dtype not in FP8_FORMATS.values():
        raise ValueError(f"x_fp8 must have an FP8 dtype ({', '.join(map(str, FP8_FORMATS.values()))}); "
                         f"got {x_fp8.dtype}")
    return x_fp8.float() / scale


def fake_quantize(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensorwise",
                  power_of_2: bool = False) -> torch.Tensor:
    """``x`` after a round trip through FP8 (in fp32): what a matmul on FP8 inputs sees."""
    return from_fp8(*to_fp8(x, fmt, granularity, power_of_2))


def quantization_error(x: torch.Tensor, fmt: str = "e4m3",
                       granularity: str = "tensorwise") -> Dict[str, float]:
    """How much of ``x`` a round trip through FP8 loses.

    ``rel_error``: ``||q(x) - x|| / ||x||``; ``underflow``: the fraction of non-zero values that
    became 0; ``saturated``: the fraction clipped at the format's largest value.
    """
    x = x.detach().float()
    if x.numel() == 0 or not torch.isfinite(x).all():
        raise ValueError("x must be a non-empty tensor of finite values")
    q = fake_quantize(x, fmt, granularity)
    norm = float(x.norm())
    nonzero = x != 0
    scale = amax_scale(x, fmt, granularity)
    # clipped beyond the rounding of the scale itself: a dynamic scale puts amax at the top of
    # the range give or take an fp32 ulp or two, and that value is not clipped (it round-trips)
    saturated = (x.abs() * scale) > fp8_max(fmt) * (1 + 2 ** -20)
    return {"rel_error": float((q - x).norm()) / norm if norm > 0 else 0.0,
            "underflow": float(((q == 0) & nonzero).sum()) / max(int(nonzero.sum()), 1),
            "saturated": float(saturated.float().mean())}


def error_summary(rows: Sequence[Mapping]) -> List[dict]:
    """Lesson 07's ``error_table`` rows averaged over layers: one row per tensor kind, format and scaling."""
    if not rows:
        raise ValueError("rows must hold at least one row (see error_table)")
    groups: Dict[Tuple[str, str, str], List[Mapping]] = {}
    for r in rows:
        groups.setdefault((r["tensor"], r["format"], r["scaling"]), []).append(r)
    return [{"tensor": k[0], "format": k[1], "scaling": k[2],
             "rel_error": statistics.fmean(r["rel_error"] for r in g),
             "underflow": statistics.fmean(r["underflow"] for r in g)}
            for k, g in groups.items()]



FP8_USE = {
    "e4m3": "weights and activations (forward): one more mantissa bit",
    "e5m2": "gradients (backward): more range, less precision",
    "bf16": "the baseline's half type, for scale",
}


def fp8_format_facts() -> List[dict]:
    """e4m3, e5m2 (and bf16 for scale) from ``get_format``: bits, range, smallest values, spacing
    at 1, use in training."""
    rows = []
    for name in ("e4m3", "e5m2", "bf16"):
        info = get_format(name)
        rows.append({"format": name, "dtype": info.torch_dtype_name,
                     "exponent bits": info.exponent_bits, "mantissa bits": info.mantissa_bits,
                     "largest": float(info.max), "smallest normal": float(info.smallest_normal),
                     "smallest subnormal": float(info.smallest_subnormal),
                     "step at 1.0": float(info.eps), "used for": FP8_USE[name]})
    return rows

