"""The usual AMP mistakes, run on purpose and measured: clipping before ``unscale_``
(``ClipBeforeUnscale``, ``clip_order_experiment``), GradScaler called after backward
(``scale_order_experiment``), clipping a gradient that holds a NaN (``clip_nan_check``), a
scheduler stepped on skipped steps (``scheduler_on_skipped_steps``), ``.half()`` on the model
(``half_model_errors``) and a custom autograd Function under autocast
(``custom_function_under_autocast``). Lesson 02 shows them.
"""
from __future__ import annotations

import copy
import math
import statistics
import warnings
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from amp_lessons.data import digits_loaders
from amp_lessons.models import build_digits_model
from amp_lessons.numerics.precision import Device, as_device, check_precision
from amp_lessons.train.recipes import train_digits
from amp_lessons.train.trainer import (Hooks, ScalerSettings, TrainConfig, Trainer,
                                       set_loader_epoch)
from amp_lessons.validate import check_int, check_positive


def _label(dtype: torch.dtype, low: torch.dtype) -> str:
    return "16-bit" if dtype == low else str(dtype).replace("torch.", "")


def custom_function_under_autocast(function: type, device: Device = None,
                                   dtype: Optional[torch.dtype] = None, seed: int = 0) -> dict:
    """Run ``function.apply(x, w)`` (a custom ``torch.autograd.Function`` computing ``x @ w.T``)
    forward under autocast and backward outside it, as the AMP recipe does, and compare the
    gradients with a float32 run of the same function.

    Returns: function (its name), ran, error ("" or ``"Type: first line"``), output (dtype
    label), grad (dtype labels of the input and weight gradients), grad_error (largest
    relative difference from the float32 gradients; None if it did not run) and dtype (the
    autocast dtype, e.g. "float16").
    """
    dev = as_device(device)
    low = dtype or (torch.bfloat16 if dev.type == "cpu" else torch.float16)
    if low not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16; got {dtype!r}")
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise ValueError(f"function must be a torch.autograd.Function subclass; got {function!r}")
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(16, 32, generator=gen).to(dev)
    w0 = torch.randn(8, 32, generator=gen).to(dev)

    def grads(autocast: bool):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast(device_type=dev.type, dtype=low, enabled=autocast):
            out = function.apply(x, w)
            loss = out.float().square().mean()
        loss.backward()
        return out.dtype, x.grad, w.grad

    row = {"function": function.__name__, "ran": False, "error": "", "output": "-",
           "grad": "-", "grad_error": None, "dtype": str(low).replace("torch.", "")}
    _, ref_x, ref_w = grads(False)
    try:
        out_dtype, gx, gw = grads(True)
    except RuntimeError as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        return row
    err = max(float(((g.float() - r).norm() / r.norm().clamp_min(1e-30)))
              for g, r in ((gx, ref_x), (gw, ref_w)))
    row.update(ran=True, output=_label(out_dtype, low),
               grad=", ".join(_label(g.dtype, low) for g in (gx, gw)), grad_error=err)
    return row



class ClipBeforeUnscale(Hooks):
    """Clipping before ``unscale_``, on purpose: ``clip_grad_norm_`` while the gradients are
    still SCALED.

    Records ``scaled_norms`` (the norm clip saw) and ``scales`` per step. The true gradient is then
    clipped to ``max_norm / scale`` instead of ``max_norm``. Use with ``accumulate=1``.
    """

    def __init__(self, max_norm: float = 1.0):
        check_positive("max_norm", max_norm)
        self.max_norm = float(max_norm)
        self.scaled_norms: List[float] = []
        self.scales: List[float] = []

    def after_backward(self, trainer: "Trainer", micro_step: int) -> None:
        norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), self.max_norm)
        self.scaled_norms.append(float(norm))
        self.scales.append(float(trainer.scaler.get_scale()))


def clip_order_experiment(max_norm: float = 1.0, device: Device = None, precision: str = "fp16",
                          **train_kwargs) -> List[dict]:
    """Train twice in ``precision`` (fp16 + GradScaler; bf16 runs without a scaler, scale 1)
    from the same start: clipping before ``unscale_`` and after it (PyTorch's order). One row
    each: the scale, the true gradient norm (median and largest), the threshold really applied
    to the true gradient, the norm of the gradient the optimizer used, and the final test
    accuracy (medians over the steps not skipped)."""
    check_positive("max_norm", max_norm)
    rows = []
    for wrong in (True, False):
        hook = ClipBeforeUnscale(max_norm) if wrong else None
        run = train_digits(precision, device=device, hooks=[hook] if hook else (),
                           clip_norm=None if wrong else max_norm, **train_kwargs)
        cols = run.history.columns()
        ok = [i for i, s in enumerate(cols["skipped"]) if not s]
        scales = [float(cols["scale"][i] or 1.0) for i in ok]
        if wrong:
            true = [hook.scaled_norms[i] / hook.scales[i] for i in ok]
            used = [cols["grad_norm"][i] for i in ok]
            thresholds = [max_norm / s for s in scales]
        else:
            true = [cols["grad_norm"][i] for i in ok]
            used = [min(t, max_norm) for t in true]
            thresholds = [max_norm for _ in ok]
        rows.append({
            "order": "clip, then unscale_ (the article's order)" if wrong
            else "unscale_, then clip (PyTorch's order)", "precision": precision,
            "scale": statistics.median(scales), "true_grad_norm": statistics.median(true),
            "max_true_grad_norm": max(true),
            "threshold_applied": statistics.median(thresholds),
            "grad_norm_used": statistics.median(used), "accuracy_pct": 100 * run.accuracy,
            "skipped_steps": run.skipped_steps})
    return rows


def scheduler_on_skipped_steps(steps: int = 20, warmup: int = 40, init_scale: float = 2.0 ** 24,
                               model: str = "mlp", batch_size: int = 64, lr: float = 0.05,
                               device: Device = None, seed: int = 0) -> List[dict]:
    """A linear warm-up schedule under fp16 with a scale high enough to overflow at first.

    Runs the naive loop (``scheduler.step()`` every iteration) and the trainer (only after real
    optimizer steps) from the same start. One row each: optimizer steps taken, steps skipped,
    scheduler steps, the learning rate reached and what it should be after that many real steps,
    and the warning torch gave (empty if none)."""
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 1)
    dev = as_device(device)
    check_precision("fp16", dev)
    schedule = lambda s: min(1.0, (s + 1) / warmup)  # noqa: E731
    rows = []
    for naive in (True, False):
        torch.manual_seed(seed)
        net, size = build_digits_model(model)
        net.to(dev)
        train, _ = digits_loaders(batch_size, size, dev, seed)
        data = [b for _, b in zip(range(steps), cycle(train))]
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        settings = ScalerSettings(init_scale=init_scale)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if naive:
                scaler, skipped = settings.make(dev.type), 0
                for x, y in data:
                    with torch.autocast(device_type=dev.type, dtype=torch.float16):
                        loss = F.cross_entropy(net(x), y)
                    scaler.scale(loss).backward()
                    before = scaler.get_scale()
                    scaler.step(opt)
                    scaler.update()
                    skipped += scaler.get_scale() < before
                    sched.step()  # the mistake: also after a skipped step
                    opt.zero_grad(set_to_none=True)
            else:
                trainer = Trainer(net, opt, TrainConfig(precision="fp16", scaler=settings,
                                                        progress=False, seed=None),
                                  scheduler=sched)
                for batch in data:
                    trainer.train_step([batch])
                skipped = trainer.history.skipped_steps
        messages = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
        real = steps - int(skipped)
        rows.append({"loop": "naive: scheduler.step() every iteration" if naive
                     else "trainer: scheduler.step() only after a real step",
                     "optimizer_steps": real, "skipped_steps": int(skipped),
                     "scheduler_steps": sched.last_epoch,
                     "lr": opt.param_groups[0]["lr"], "lr_expected": lr * schedule(real),
                     "warning": messages[0] if messages else ""})
    return rows


def cycle(loader):
    """Yield ``loader``'s batches epoch after epoch (``set_loader_epoch`` first), for runs
    counted in steps."""
    epoch = 0
    while True:
        set_loader_epoch(loader, epoch)
        yield from loader
        epoch += 1


def half_model_errors(device: Device = None, model: str = "mlp") -> Dict[str, str]:
    """What ``.half()`` on the model leads to under fp16 AMP: ``"torch"``: the error GradScaler
    raises in ``step`` ("Attempting to unscale FP16 gradients."); ``"trainer"``: the trainer's
    earlier, explained refusal. Messages as ``"ValueError: ..."``."""
    dev = as_device(device)
    check_precision("fp16", dev)
    net, size = build_digits_model(model)
    net = net.to(dev).half()  # the mistake
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(dev.type)
    x, y = next(iter(digits_loaders(32, size, dev)[0]))
    with torch.autocast(device_type=dev.type, dtype=torch.float16):
        loss = F.cross_entropy(net(x), y)
    scaler.scale(loss).backward()
    out = {}
    try:
        scaler.step(opt)
        out["torch"] = ""
    except ValueError as exc:
        out["torch"] = f"ValueError: {exc}"
    try:
        Trainer(net, opt, TrainConfig(precision="fp16", progress=False, seed=None), device=dev)
        out["trainer"] = ""
    except ValueError as exc:
        out["trainer"] = f"ValueError: {exc}"
    return out


SCALE_ORDERS = ("scaler.scale(loss).backward(), then scaler.step (PyTorch's order)",
                "loss.backward(), then scaler.scale and scaler.step (GradScaler after backward)")


def scale_order_experiment(device: Device = None, dtype: torch.dtype = torch.float16,
                           init_scale: float = 2.0 ** 16, model: str = "mlp", lr: float = 0.1,
                           seed: int = 0) -> List[dict]:
    """One SGD step from the same weights and batch in each order of ``SCALE_ORDERS``, under
    ``torch.autocast(device, dtype)`` with a GradScaler (enabled for float16 only, as the
    recipe does): one row each with ``order``, ``scale`` and ``update_norm`` (the norm of the
    change the step made to the weights), and ``ratio`` (this order's update against PyTorch's
    order's)."""
    check_positive("init_scale", init_scale)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16; got {dtype!r}")
    dev = as_device(device)
    torch.manual_seed(seed)
    net, size = build_digits_model(model)
    net = net.to(dev)
    x, y = next(iter(digits_loaders(64, size, dev, seed)[0]))
    start = copy.deepcopy(net.state_dict())
    rows = []
    for order in SCALE_ORDERS:
        net.load_state_dict(start)
        net.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(dev.type, init_scale=init_scale,
                                      enabled=dtype == torch.float16)
        before = [p.detach().clone() for p in net.parameters()]
        with torch.autocast(device_type=dev.type, dtype=dtype):
            loss = F.cross_entropy(net(x), y)
        if order == SCALE_ORDERS[0]:
            scaler.scale(loss).backward()
        else:
            loss.backward()
            scaler.scale(loss)  # the diagram's GradScaler, after backward
        scaler.step(opt)
        scaler.update()
        moved = math.sqrt(sum(float((p.detach() - b).float().pow(2).sum())
                              for p, b in zip(net.parameters(), before)))
        rows.append({"order": order, "dtype": str(dtype).replace("torch.", ""),
                     "scale": float(scaler.get_scale()) if scaler.is_enabled() else 1.0,
                     "update_norm": moved})
    for r in rows:
        r["ratio"] = r["update_norm"] / rows[0]["update_norm"] if rows[0]["update_norm"] else None
    return rows


def clip_nan_check(max_norm: float = 1.0, device: Device = None) -> Dict[str, object]:
    """``clip_grad_norm_`` on a gradient holding one NaN (produced on purpose): the total norm
    it returns and whether the gradient is still NaN after clipping. ``clipped_finite`` is
    False when clipping left the NaN in place."""
    check_positive("max_norm", max_norm)
    dev = as_device(device)
    weight = torch.nn.Parameter(torch.ones(8, device=dev))
    weight.grad = torch.ones(8, device=dev)
    weight.grad[0] = float("nan")
    norm = torch.nn.utils.clip_grad_norm_([weight], max_norm)
    return {"total_norm": float(norm), "clipped_finite": bool(torch.isfinite(weight.grad).all())}
