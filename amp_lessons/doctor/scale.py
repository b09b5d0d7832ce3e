"""The loss scale: where GradScaler would settle on this model, and which settings to use.

GradScaler multiplies the loss (so every gradient) by its scale, halves it whenever a scaled
gradient overflows fp16, and doubles it after ``growth_interval`` clean steps (lesson 03). So it
settles at the largest power of two at which the largest gradient still fits under fp16's
65,504: ``reached_scale``. ``advice`` turns that, the overflow sites and the underflow share at
that scale into settings (``trainer.ScalerSettings``) or the reason to use bf16, and
``scaler_trial`` checks them by training a copy of the model a few steps with the shared trainer.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .. import formats
from ..tables import plural
from ..trainer import ScalerSettings, TrainConfig, Trainer

DEFAULT = ScalerSettings()
# float32's normal range, where ScalerSettings accepts an init_scale
EXPONENT_RANGE = (-126, 127)
# above this share of gradient values flushed to zero by fp16 even at the reached scale, the
# advice is bf16 (fp32's range): the scale cannot rise without overflowing the largest gradient
MAX_FLUSHED = 0.01
# a higher init_scale is advised only where it saves more than this share of gradient values
MIN_GAIN = 0.001


def reached_scale(largest_gradient: Optional[float]) -> Optional[int]:
    """The exponent ``k`` of the scale ``2**k`` GradScaler settles at: the largest power of two
    with ``largest_gradient * 2**k <= 65504`` (None when no gradient was nonzero)."""
    if largest_gradient is None or not largest_gradient > 0 or not math.isfinite(largest_gradient):
        return None
    k = math.floor(math.log2(formats.get_format("fp16").max / largest_gradient))
    return int(min(max(k, EXPONENT_RANGE[0]), EXPONENT_RANGE[1]))


def advice(k: Optional[int], overflow: Sequence[Dict[str, object]], underflow_at_k: float,
           underflow_at_default: float, bf16_native: bool,
           flushed_at_k: float = 0.0) -> Dict[str, object]:
    """What to train this model in, as data: ``precision`` (fp16 or bf16), ``fp16_safe``,
    ``settings`` (ScalerSettings as a dict, for fp16), and ``lines``: the advice in sentences,
    each with the measurement behind it. ``overflow``: the fp16 overflow sites of the forward
    pass; the underflow shares (flushed or subnormal) are of all nonzero gradient values at
    ``2**k`` and at the default init_scale; ``flushed_at_k``: the share flushed to zero at
    ``2**k`` (lost, not only less precise), which decides for bf16 above ``MAX_FLUSHED``."""
    lines: List[str] = []
    alt = "bf16 (fp32's range in 16 bits)" if bf16_native else \
        "keep those layers in fp32 (this GPU has no native bf16)"
    if overflow:
        worst = max(overflow, key=lambda r: r["value"])
        lines.append(f"fp16 is not safe: the forward pass overflows fp16 in "
                     f"{plural(len(overflow), 'layer')}, worst {worst['layer']} at {worst['value']:.4g} > 65,504. A loss "
                     f"scale only scales gradients, so no GradScaler setting helps: train in "
                     f"{alt}, or run those layers in fp32 (selective autocast).")
        return {"precision": "bf16" if bf16_native else "fp16 with fp32 layers",
                "fp16_safe": False, "settings": None, "lines": lines}
    if k is None:
        lines.append("No nonzero gradient was found, so no loss scale can be derived.")
        return {"precision": "bf16" if bf16_native else "fp16", "fp16_safe": None,
                "settings": None, "lines": lines}
    init_k = min(k - 1, EXPONENT_RANGE[1])
    settings = ScalerSettings(init_scale=2.0 ** init_k)
    default_k = int(math.log2(DEFAULT.init_scale))
    lines.append(f"GradScaler would settle near 2^{k} = {2.0 ** k:,.6g}: the largest power of two "
                 f"at which the largest gradient still fits under fp16's 65,504.")
    if flushed_at_k > MAX_FLUSHED:
        lines.append(f"Even there, {flushed_at_k:.2%} of the nonzero gradient values are flushed "
                     f"to zero by fp16 ({underflow_at_k:.2%} flushed or subnormal): the gradients "
                     f"span more than fp16's range. Train in {alt}.")
        return {"precision": "bf16" if bf16_native else "fp16", "fp16_safe": False,
                "settings": settings.as_dict(), "lines": lines}
    if init_k < default_k:
        lines.append(f"The default init_scale 2^{default_k} is too high: the first "
                     f"{plural(default_k - k, 'step')} would overflow and be skipped while the scale backs "
                     f"off. Start at init_scale=2^{init_k} (one halving of headroom).")
    elif init_k > default_k and underflow_at_default - underflow_at_k <= MIN_GAIN:
        lines.append(f"The default init_scale 2^{default_k} is safe and loses hardly more gradient "
                     f"values than 2^{k} ({underflow_at_default:.3%} against {underflow_at_k:.3%} "
                     f"flushed or subnormal): keep it.")
        settings = DEFAULT
    elif init_k > default_k:
        steps = (init_k - default_k) * DEFAULT.growth_interval
        lines.append(f"The default init_scale 2^{default_k} is safe but low: "
                     f"{underflow_at_default:.3%} of gradient values underflow there against "
                     f"{underflow_at_k:.3%} at 2^{k}, and growing there at one doubling per "
                     f"growth_interval={DEFAULT.growth_interval} clean steps takes {plural(steps, 'step')}. "
                     f"Start at init_scale=2^{init_k}.")
    else:
        lines.append(f"The default init_scale 2^{default_k} is one halving below that ceiling: "
                     f"keep it.")
        settings = DEFAULT
    lines.append(f"growth_interval: keep the default {DEFAULT.growth_interval}; with the scale "
                 f"started at or under its ceiling it only needs to track gradients that "
                 f"shrink over training (a shorter interval means more skipped steps).")
    lines.append(f"fp16 with GradScaler is safe here: at the settled scale {flushed_at_k:.3%} of "
                 f"gradient values are flushed to zero ({underflow_at_k:.3%} flushed or "
                 f"subnormal).")
    return {"precision": "fp16", "fp16_safe": True, "settings": settings.as_dict(),
            "lines": lines}


def scaler_trial(make_model: Callable[[], nn.Module], inputs, target, loss_fn: Callable,
                 make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 settings: Dict[str, ScalerSettings], device, steps: int = 5
                 ) -> List[Dict[str, object]]:
    """Train a fresh copy (``make_model()``) for ``steps`` fp16 steps with the shared trainer
    under each named ``ScalerSettings``, on the same batch: skipped steps and the scale each run
    ended at, so the advice is checked, not only derived."""
    rows = []
    for name, s in settings.items():
        model = make_model()
        optimizer = make_optimizer(model)
        config = TrainConfig(precision="fp16", scaler=s, progress=False, seed=None,
                             track_grad_norm=False, track_memory=False)
        trainer = Trainer(model, optimizer, config, loss_fn=loss_fn)
        records = [trainer.train_step([(inputs, target)]) for _ in range(steps)]
        rows.append({"settings": name, "init_scale": s.init_scale, "steps": steps,
                     "skipped": sum(bool(r.skipped) for r in records),
                     "final_scale": float(trainer.scaler.get_scale()),
                     "final_loss": float(records[-1].loss)})
        del model, optimizer, trainer
    return rows
