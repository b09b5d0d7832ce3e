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

from amp_lessons.numerics import formats
from amp_lessons.tables import plural
from amp_lessons.train.trainer import ScalerSettings, TrainConfig, Trainer

DEFAULT = ScalerSettings()
DEFAULT_EXPONENT = int(math.log2(DEFAULT.init_scale))
# float32's normal range, where ScalerSettings accepts an init_scale
EXPONENT_RANGE = (-126, 127)
# above this share of gradient values flushed to zero by fp16 even at the reached scale, the
# advice is bf16 (fp32's range): the scale cannot rise without overflowing the largest gradient
MAX_FLUSHED = 0.01
# a higher init_scale is advised only where it saves more than this share of gradient values
MIN_GAIN = 0.001
# a parameter whose gradient fp16 changes by more than this share (the relative error of the
# whole gradient after the round trip: what the update loses) is named: at the scale GradScaler
# reaches it makes fp16 unsafe, at the default init_scale it makes the advice start higher
LAYER_LOSS_LIMIT = 0.01


def reached_scale(largest_gradient: Optional[float]) -> Optional[int]:
    """The exponent ``k`` of the scale ``2**k`` GradScaler settles at: the largest power of two
    with ``largest_gradient * 2**k <= 65504`` (None when no gradient was nonzero)."""
    if largest_gradient is None or not largest_gradient > 0 or not math.isfinite(largest_gradient):
        return None
    k = math.floor(math.log2(formats.get_format("fp16").max / largest_gradient))
    return int(min(max(k, EXPONENT_RANGE[0]), EXPONENT_RANGE[1]))


def trial_nonfinite(trial: Sequence[Dict[str, object]]) -> List[str]:
    """The ``scaler_trial`` settings whose fp16 run ended with a loss that is inf or NaN."""
    return [str(r["settings"]) for r in trial
            if r.get("final_loss") is not None and not math.isfinite(r["final_loss"])]


def _not_safe(bf16_native: bool, lines: List[str]) -> Dict[str, object]:
    return {"precision": "bf16" if bf16_native else "fp16 with fp32 layers", "fp16_safe": False,
            "settings": None, "lines": lines}


def advice(k: Optional[int], overflow: Sequence[Dict[str, object]], underflow_at_k: float,
           underflow_at_default: float, bf16_native: bool,
           flushed_at_k: float = 0.0, fp16_nonfinite: Sequence[str] = (),
           fp32_nonfinite: Sequence[str] = (), trial: Sequence[Dict[str, object]] = (),
           fp16_unchecked: str = "", worst_layer: Optional[Dict[str, object]] = None,
           fp16_failed: Sequence[str] = (), fp32_cast: str = "",
           worst_output: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """What to train this model in, as data: ``precision`` (fp16 or bf16), ``fp16_safe``,
    ``settings`` (ScalerSettings as a dict, for fp16), and ``lines``: the advice in sentences,
    each with the measurement behind it. ``overflow``: the fp16 overflow sites of the forward
    pass; the underflow shares (flushed or subnormal) are of all nonzero gradient values at
    ``2**k`` and at the default init_scale; ``flushed_at_k``: the share flushed to zero at
    ``2**k`` (lost, not only less precise), which decides for bf16 above ``MAX_FLUSHED``.

    The measured fp16 evidence overrides what the ranges predict: ``fp16_nonfinite``, where the
    forward under fp16 autocast gave inf/NaN (layer names, or "the loss"), and ``trial``, the
    ``scaler_trial`` rows (a run that ended with an inf/NaN loss), make fp16 not safe even where
    no layer's fp32 output passes 65,504 (an op inside or between layers overflowed).
    ``fp32_nonfinite``: where the fp32 forward or backward already held inf/NaN; then no
    precision helps and the advice says so, unless ``fp32_cast`` names the op that made it: an
    op the learner's own code ran on 16-bit inputs (an explicit ``.half()``), which is to be
    computed in float32. ``worst_output``: the layer whose output gradient fp16 changes most
    (``layer``, ``error_k``, ``share_k``, as ``worst_layer``'s): with it or ``worst_layer``
    given, more than ``MAX_FLUSHED`` of all gradient values flushed makes fp16 unsafe only where
    a gradient changes by more than ``LAYER_LOSS_LIMIT`` (the flushed values of a saturated
    softmax are the smallest of their gradient and change no update). ``fp16_unchecked``: why the fp16 forward could not be
    run on this device; then ``fp16_safe`` is None (not checked). ``fp16_failed``: fp16 runs that
    raised or whose gradients were inf/NaN at every scale (sentences); a ``trial`` row that
    raised counts too: either makes fp16 not safe. ``worst_layer``: the parameter whose gradient
    fp16 flushes most (``parameter``, ``share_k`` / ``share_default``: the share of its nonzero
    values flushed to zero at ``2**k`` and at the default init_scale, ``error_k`` /
    ``error_default``: the relative error of its gradient): above ``LAYER_LOSS_LIMIT`` at ``2**k``
    fp16 is not safe; above it at the default only, the advice starts higher and names it. The
    words "safe" and "keep it" are written only where every fp16 check passed."""
    lines: List[str] = []
    alt = "bf16 (fp32's range in 16 bits)" if bf16_native else \
        "keep those layers in fp32 (this GPU has no native bf16)"
    if fp32_nonfinite and fp32_cast:
        lines.append(f"fp16 is not safe as your code is written: the float32 run is already "
                     f"inf/NaN because your own code computes in 16 bits ({fp32_cast}), where "
                     f"fp16's 65,504 applies even without autocast. Compute that part in float32 "
                     f"(drop the .half() / .to(torch.float16) before it) and measure again; no "
                     f"loss scale is advised until then.")
        return {"precision": "none (16 bits in your code)", "fp16_safe": False,
                "settings": None, "lines": lines}
    if fp32_nonfinite:
        shown = ", ".join(fp32_nonfinite[:3]) + (" ..." if len(fp32_nonfinite) > 3 else "")
        lines.append(f"The model is not finite in fp32: the float32 forward or backward already "
                     f"holds inf/NaN (in {shown}). No precision helps (bf16 has float32's range, "
                     f"fp16 less): find the op that makes it (an exp, a division, a large weight) "
                     f"and fix the model in fp32 first; no loss scale is advised until then.")
        return {"precision": "none (inf/NaN in fp32)", "fp16_safe": False, "settings": None,
                "lines": lines}
    if overflow:
        worst = max(overflow, key=lambda r: r["value"])
        lines.append(f"fp16 is not safe: the forward pass overflows fp16 in "
                     f"{plural(len(overflow), 'layer')}, worst {worst['layer']} at {worst['value']:.4g} > 65,504. A loss "
                     f"scale only scales gradients, so no GradScaler setting helps: train in "
                     f"{alt}, or run those layers in fp32 (selective autocast).")
        return _not_safe(bf16_native, lines)
    if fp16_nonfinite:
        lines.append(f"fp16 is not safe: under fp16 autocast the forward pass gives inf/NaN, first "
                     f"in {fp16_nonfinite[0]}, although no layer's fp32 output passes 65,504: an "
                     f"op inside or between layers (a matmul such as q @ k^T, a sum, an exp) "
                     f"overflows fp16. A loss scale only scales gradients, so no GradScaler "
                     f"setting helps: train in {alt}, or run that part in fp32 (selective "
                     f"autocast).")
        return _not_safe(bf16_native, lines)
    failed = list(fp16_failed) + [f"the fp16 trial ({r['settings']} settings) raised "
                                  f"{r.get('reason', '')}" for r in trial
                                  if r.get("status") == "error"]
    if failed:
        lines.append(f"fp16 is not safe as measured: {failed[0]}. Fix that first; until an fp16 "
                     f"run completes with finite gradients, train in {alt}.")
        return _not_safe(bf16_native, lines)
    bad_trial = trial_nonfinite(trial)
    if bad_trial:
        lines.append(f"fp16 is not safe as measured: the fp16 trial with the shared trainer ended "
                     f"with an inf/NaN loss ({', '.join(bad_trial)} settings) although the fp32 "
                     f"ranges fit fp16. Either an op overflows fp16 during training or training "
                     f"diverges on this batch (compare an fp32 run, lower the learning rate); "
                     f"until an fp16 run stays finite, train in {alt}.")
        return _not_safe(bf16_native, lines)
    if k is None:
        lines.append("No nonzero gradient was found, so no loss scale can be derived.")
        return {"precision": "bf16" if bf16_native else "fp16", "fp16_safe": None,
                "settings": None, "lines": lines}
    init_k = max(min(k - 1, EXPONENT_RANGE[1]), EXPONENT_RANGE[0])
    settings = ScalerSettings(init_scale=2.0 ** init_k)
    default_k = int(math.log2(DEFAULT.init_scale))
    lines.append(f"GradScaler would settle near 2^{k} = {2.0 ** k:,.6g}: the largest power of two "
                 f"at which the largest gradient still fits under fp16's 65,504.")
    w = worst_layer or {}
    def lost(key, row=None):
        v = (w if row is None else row).get(key)
        return v if isinstance(v, float) and v == v else 0.0
    wo = worst_output or {}
    measured = bool(w or wo)  # per-gradient relative errors, not only the share of values
    flushed_note = ""
    if flushed_at_k > MAX_FLUSHED and (not measured or lost("error_k", wo) > LAYER_LOSS_LIMIT):
        where = (f"; the gradient into {wo['layer']}'s output changes by {wo['error_k']:.1%} "
                 f"(relative error)" if wo else "")
        lines.append(f"Even there, {flushed_at_k:.2%} of the nonzero gradient values are flushed "
                     f"to zero by fp16 ({underflow_at_k:.2%} flushed or subnormal){where}: the "
                     f"gradients span more than fp16's range. Train in {alt}.")
        return {"precision": "bf16" if bf16_native else "fp16", "fp16_safe": False,
                "settings": settings.as_dict(), "lines": lines, "reason": "flushed"}
    if flushed_at_k > MAX_FLUSHED:
        worst_error = max(lost("error_k"), lost("error_k", wo))
        flushed_note = (f"{flushed_at_k:.2%} of the nonzero gradient values are flushed to zero "
                        f"at 2^{k}, but they are the smallest of their gradients (a saturated "
                        f"softmax's, say): no layer's or parameter's gradient changes by more "
                        f"than {worst_error:.2%} (relative error).")
        lines.append(flushed_note)
    if w and lost("error_k") > LAYER_LOSS_LIMIT:
        lines.append(f"fp16 is not safe: the gradient of {w['parameter']} loses "
                     f"{w['error_k']:.1%} of its size to underflow (relative error; "
                     f"{w['share_k']:.1%} of its values flushed to zero) even at 2^{k}, the highest "
                     f"scale GradScaler reaches before the largest gradient overflows (more than "
                     f"the {LAYER_LOSS_LIMIT:.0%} this advice allows a layer). Train in {alt}.")
        return {"precision": "bf16" if bf16_native else "fp16 with fp32 layers",
                "fp16_safe": False, "settings": None, "lines": lines}
    named = w and lost("error_default") > LAYER_LOSS_LIMIT and init_k > default_k
    # the default fits when 2^default_k <= 2^k: only a default above the ceiling overflows
    if named:
        settings = ScalerSettings(init_scale=2.0 ** init_k)
        steps = (init_k - default_k) * DEFAULT.growth_interval
        lines.append(f"Start at init_scale=2^{init_k}, not the default 2^{default_k}: at the "
                     f"default the gradient of {w['parameter']} loses {w['error_default']:.1%} "
                     f"of its size to underflow (relative error; {w['share_default']:.1%} of its "
                     f"values flushed to zero) against {w['error_k']:.1%} at 2^{k} "
                     f"({w['share_k']:.1%}), and GradScaler would take "
                     f"{plural(steps, 'step')} to grow there.")
    elif k < default_k:
        lines.append(f"The default init_scale 2^{default_k} is too high: the first "
                     f"{plural(default_k - k, 'step')} would overflow and be skipped while the scale backs "
                     f"off. Start at init_scale=2^{init_k} (one halving of headroom).")
    elif k == default_k:
        lines.append(f"The default init_scale 2^{default_k} is that ceiling: the largest gradient "
                     f"fits there, so no step is skipped at the start: keep it.")
        settings = DEFAULT
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
    if fp16_unchecked:
        lines.append(f"fp16 with GradScaler: not checked here, the fp16 forward could not run on "
                     f"this device ({fp16_unchecked}); at the settled scale {flushed_at_k:.3%} "
                     f"of gradient values would be flushed to zero ({underflow_at_k:.3%} flushed "
                     f"or subnormal).")
        return {"precision": "fp16", "fp16_safe": None, "settings": settings.as_dict(),
                "lines": lines}
    worst_words = (f"; the worst parameter, {w['parameter']}, loses {lost('error_k'):.2%} of its "
                   f"gradient (relative error)" if w else "")
    lines.append(f"fp16 with GradScaler is safe here: at the settled scale {flushed_at_k:.3%} of "
                 f"gradient values are flushed to zero ({underflow_at_k:.3%} flushed or "
                 f"subnormal){worst_words}.")
    return {"precision": "fp16", "fp16_safe": True, "settings": settings.as_dict(),
            "lines": lines}


def scaler_trial(make_model: Callable[[], nn.Module], inputs, target, loss_fn: Callable,
                 make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                 settings: Dict[str, ScalerSettings], device, steps: int = 5
                 ) -> List[Dict[str, object]]:
    """Train a fresh copy (``make_model()``) for ``steps`` fp16 steps with the shared trainer
    under each named ``ScalerSettings``, on the same batch: skipped steps and the scale each run
    ended at, so the advice is checked, not only derived. A setting whose run fails (a layer
    fp16 autocast cannot run on this device) becomes a row with ``status`` "error" and the
    reason, never an exception."""
    rows = []
    for name, s in settings.items():
        row: Dict[str, object] = {"settings": name, "init_scale": s.init_scale, "steps": steps,
                                  "skipped": None, "final_scale": None, "final_loss": None,
                                  "status": "ok", "reason": ""}
        model = optimizer = trainer = None
        try:
            model = make_model()
            optimizer = make_optimizer(model)
            config = TrainConfig(precision="fp16", scaler=s, progress=False, seed=None,
                                 track_grad_norm=False, track_memory=False)
            trainer = Trainer(model, optimizer, config, loss_fn=loss_fn)
            records = [trainer.train_step([(inputs, target)]) for _ in range(steps)]
            row.update(skipped=sum(bool(r.skipped) for r in records),
                       final_scale=float(trainer.scaler.get_scale()),
                       final_loss=float(records[-1].loss))
        except Exception as exc:  # noqa: BLE001 - a trial that fails is a row, not a dead report
            row.update(status="error", reason=failure_text(exc))
        finally:
            del model, optimizer, trainer
        rows.append(row)
    return rows


def failure_text(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters): a failed
    measurement's reason, as its row or finding shows it."""
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}".rstrip(": ")
