"""Lesson 02, the basic AMP loop: FP32 against AMP on the digits set, the dtypes autocast picks,
clipping before and after ``unscale_``, schedulers on skipped steps, and the usual mistakes run on
purpose. Built on the engine (``trainer``, ``recipes``, ``precision``); the notebook calls these."""
from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import check_positive
from ..models import build_digits_model
from ..precision import Device, as_device, check_precision, normalize_precision
from ..recipes import train_digits
from ..trainer import Hooks, ScalerSettings, TrainConfig, Trainer, set_loader_epoch


def compare_precisions(precisions: Sequence[str] = ("fp32", "fp16"), device: Device = None,
                       **train_kwargs) -> List[dict]:
    """Run ``train_digits`` once per precision from the same seed and initial weights.

    Returns one row per precision: precision, ran, reason (why it could not run here, else ""),
    epoch_time_s, peak_memory_mib, accuracy_pct, skipped_steps, and run (the DigitsRun, its
    trainer dropped so that its model and optimizer state free their memory; None if not run).
    """
    dev = as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    rows = []
    for p in precisions:
        row = {"precision": normalize_precision(p), "ran": False, "reason": "",
               "epoch_time_s": None, "peak_memory_mib": None, "accuracy_pct": None,
               "skipped_steps": None, "run": None}
        try:
            check_precision(p, dev)
        except ValueError as exc:
            row["reason"] = str(exc)
            rows.append(row)
            continue
        run = train_digits(p, device=dev, **train_kwargs)
        run.trainer = None  # free this run's device memory before the next one is measured
        row.update(ran=True, epoch_time_s=run.epoch_time_s, peak_memory_mib=run.peak_memory_mib,
                   accuracy_pct=100 * run.accuracy, skipped_steps=run.skipped_steps, run=run)
        rows.append(row)
    return rows


# --- lesson 02: what autocast does, and the usual mistakes run on purpose -----------------------

def dtype_label(dtype: torch.dtype, low: torch.dtype) -> str:
    """``"16-bit"`` for the autocast dtype ``low`` (fp16 or bf16), else the dtype's short name, so
    a table reads the same whichever half type a device uses."""
    return "16-bit" if dtype == low else str(dtype).replace("torch.", "")


@dataclass
class AutocastReport:
    """What one forward + backward under autocast produced (``autocast_dtypes``).

    ``layers``: ``(name, kind, output dtype, dtype of the gradient flowing back into that
    output)`` per leaf module, in call order; ``loss``: the loss's dtype; ``parameters`` and
    ``gradients``: the set of dtypes of the parameters and of their ``.grad``; ``low``: the
    autocast dtype; ``input``: the input batch's dtype.
    """

    layers: List[Tuple[str, str, torch.dtype, Optional[torch.dtype]]]
    loss: torch.dtype
    parameters: set
    gradients: set
    low: torch.dtype
    input: torch.dtype

    def rows(self) -> List[dict]:
        """Plain rows with dtype labels ("16-bit" = the autocast dtype)."""
        lab = lambda d: "-" if d is None else dtype_label(d, self.low)  # noqa: E731
        out = [{"what": "input batch", "kind": "data", "dtype": lab(self.input), "grad": "-"}]
        out += [{"what": name, "kind": kind, "dtype": lab(dt), "grad": lab(gd)}
                for name, kind, dt, gd in self.layers]
        out.append({"what": "loss", "kind": "cross_entropy", "dtype": lab(self.loss), "grad": "-"})
        out.append({"what": "every parameter", "kind": "weights",
                    "dtype": ", ".join(sorted(lab(d) for d in self.parameters)),
                    "grad": ", ".join(sorted(lab(d) for d in self.gradients))})
        return out

    def format(self) -> str:
        """A fixed-width table: output dtype and the dtype of the gradient that flows back."""
        rows = self.rows()
        widths = [max(len(r[k]) for r in rows + [dict(what="tensor", kind="layer", dtype="dtype",
                                                           grad="gradient dtype")])
                  for k in ("what", "kind", "dtype", "grad")]
        head = ("tensor", "layer", "dtype", "gradient dtype")
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(r[k].ljust(w) for k, w in zip(("what", "kind", "dtype", "grad"),
                                                          widths)).rstrip() for r in rows]
        return "\n".join(lines)


def autocast_dtypes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device_type: str,
                    dtype: torch.dtype, loss_fn: Callable = F.cross_entropy) -> AutocastReport:
    """Run one forward + backward of ``model`` under ``torch.autocast(device_type, dtype)`` and
    record the dtype of every leaf layer's output, of the gradient flowing back into it, of the
    loss, of the parameters and of their gradients (lesson 02, claim B5). Gradients are cleared
    afterwards; BatchNorm statistics move as in any training forward."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16; got {dtype!r}")
    layers: list = []
    grads: Dict[int, torch.dtype] = {}
    handles = []

    def hook(module, inputs, output, name=None):
        index = len(layers)
        layers.append([name, type(module).__name__, output.dtype, None])
        if output.requires_grad:
            output.register_hook(lambda g, i=index: grads.__setitem__(i, g.dtype))

    for name, module in model.named_modules():
        if name and not list(module.children()):
            handles.append(module.register_forward_hook(
                lambda m, i, o, name=name: hook(m, i, o, name)))
    was_training = model.training
    model.train()
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss = loss_fn(model(x), y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    report = AutocastReport(
        layers=[(n, k, d, grads.get(i)) for i, (n, k, d, _) in enumerate(layers)],
        loss=loss.dtype, parameters={p.dtype for p in model.parameters()},
        gradients={p.grad.dtype for p in model.parameters() if p.grad is not None},
        low=dtype, input=x.dtype)
    model.zero_grad(set_to_none=True)
    return report


def claim_b5_verdicts(report: AutocastReport) -> List[dict]:
    """Article B's claim B5 ("loss computed in FP16", "backward in FP16", gradients "restored to
    FP32") against an ``autocast_dtypes`` report: one row per part, verdict computed."""
    low = report.low
    layer_grads = {g for _, _, _, g in report.layers if g is not None}
    matmul_grads = {g for _, k, _, g in report.layers if k in ("Linear", "Conv2d") and g}
    rows = [
        {"claim": "B5: the loss is computed in FP16",
         "measured": f"loss dtype {dtype_label(report.loss, low)}",
         "verdict": "held" if report.loss == low else "did not hold: the loss is float32 "
                    "(cross_entropy is on autocast's float32 list)"},
        {"claim": "B5: backward runs in FP16",
         "measured": "gradients into layer outputs: " + ", ".join(
             sorted(dtype_label(d, low) for d in layer_grads)),
         "verdict": ("partly: backward of 16-bit layers runs in 16-bit" if low in matmul_grads
                     else "did not hold") + (", but the loss's backward is float32"
                                              if report.loss != low else "")},
        {"claim": "B5: gradients are restored to FP32",
         "measured": "parameter gradients: " + ", ".join(
             sorted(dtype_label(d, low) for d in report.gradients)),
         "verdict": ("held in effect, but nothing is restored: the parameters never left float32;"
                     " autocast's casts are recorded by autograd, whose backward returns float32"
                     if report.gradients == {torch.float32} else "did not hold")},
    ]
    return rows


class ClipBeforeUnscale(Hooks):
    """Claim B3's order, on purpose: ``clip_grad_norm_`` while the gradients are still SCALED.

    Records ``scaled_norms`` (the norm clip saw) and ``scales`` per step. The true gradient is then
    clipped to ``max_norm / scale`` instead of ``max_norm``. Use with ``accumulate=1``.
    """

    def __init__(self, max_norm: float = 1.0):
        check_positive("max_norm", max_norm, optional=True)
        self.max_norm = float(max_norm)
        self.scaled_norms: List[float] = []
        self.scales: List[float] = []

    def after_backward(self, trainer: "Trainer", micro_step: int) -> None:
        norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), self.max_norm)
        self.scaled_norms.append(float(norm))
        self.scales.append(float(trainer.scaler.get_scale()))


def clip_order_experiment(max_norm: float = 1.0, device: Device = None, **train_kwargs) -> List[dict]:
    """Train twice in fp16 from the same start: clipping before ``unscale_`` (claim B3 as shown)
    and after it (PyTorch's order). One row each: the scale, the true gradient norm, the
    threshold really applied to the true gradient, the norm of the gradient the optimizer used,
    and the final test accuracy (medians over steps)."""
    check_positive("max_norm", max_norm, optional=True)
    rows = []
    for wrong in (True, False):
        hook = ClipBeforeUnscale(max_norm) if wrong else None
        run = train_digits("fp16", device=device, hooks=[hook] if hook else (),
                           clip_norm=None if wrong else max_norm, **train_kwargs)
        cols = run.history.columns()
        ok = [i for i, s in enumerate(cols["skipped"]) if not s]
        scales = [cols["scale"][i] for i in ok]
        if wrong:
            true = [hook.scaled_norms[i] / hook.scales[i] for i in ok]
            used = [cols["grad_norm"][i] for i in ok]
            thresholds = [max_norm / s for s in scales]
        else:
            true = [cols["grad_norm"][i] for i in ok]
            used = [min(t, max_norm) for t in true]
            thresholds = [max_norm for _ in ok]
        rows.append({
            "order": "clip, then unscale_ (claim B3 as shown)" if wrong
            else "unscale_, then clip (PyTorch's order)",
            "scale": statistics.median(scales), "true_grad_norm": statistics.median(true),
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
    from ..data import digits_loaders

    for name, value in (("steps", steps), ("warmup", warmup)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1; got {value!r}")
    dev = as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    check_precision("fp16", dev)
    schedule = lambda s: min(1.0, (s + 1) / warmup)  # noqa: E731
    rows = []
    for naive in (True, False):
        torch.manual_seed(seed)
        net, size = build_digits_model(model)
        net.to(dev)
        train, _ = digits_loaders(batch_size, size, dev, seed)
        data = [b for _, b in zip(range(steps), _cycle(train))]
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


def _cycle(loader):
    epoch = 0
    while True:
        set_loader_epoch(loader, epoch)
        yield from loader
        epoch += 1


def half_model_errors(device: Device = None, model: str = "mlp") -> Dict[str, str]:
    """What ``.half()`` on the model leads to under fp16 AMP: ``"torch"``: the error GradScaler
    raises in ``step`` ("Attempting to unscale FP16 gradients."); ``"trainer"``: the trainer's
    earlier, explained refusal. Messages as ``"ValueError: ..."``."""
    from ..data import digits_loaders

    dev = as_device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
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


# Article B's claims B1 and B2 (CLAIMS.md): the figures, and when a measurement counts as holding.
ARTICLE_B2 = {"fp32": {"memory_gb": 10.2, "epoch_s": 18.7}, "fp16": {"memory_gb": 5.8, "epoch_s": 11.2}}
B1_MEMORY_SAVED, B1_SPEEDUP, B2_MEMORY_SAVED, B2_TIME_SAVED = 0.40, 1.5, 0.40, 0.30


def speed_memory_claims(rows: Sequence[dict], tensor_cores: bool) -> List[dict]:
    """Claims B1 and B2 beside ``compare_precisions`` rows (needs an fp32 and an fp16 row that
    ran): one row per claim part with the claim, when it counts as holding, the measurement and a
    computed verdict. ``tensor_cores``: whether this device has fp16 Tensor Cores (B1's premise)."""
    by = {r["precision"]: r for r in rows if r.get("ran")}
    if "fp32" not in by or "fp16" not in by:
        raise ValueError("rows must hold an fp32 and an fp16 row that ran")
    fp32, amp = by["fp32"], by["fp16"]
    speedup = fp32["epoch_time_s"] / amp["epoch_time_s"]
    time_saved = 1 - amp["epoch_time_s"] / fp32["epoch_time_s"]
    mem = (None if fp32["peak_memory_mib"] is None or amp["peak_memory_mib"] is None
           else 1 - amp["peak_memory_mib"] / fp32["peak_memory_mib"])
    premise = "" if tensor_cores else " (B1 is about Tensor Core GPUs; this device has none)"

    def change(fraction: float, less: str) -> str:
        return f"{fraction:.0%} {less}" if fraction >= 0 else f"{-fraction:.0%} more"

    def verdict(ok: Optional[bool]) -> str:
        return "not measured: no CUDA memory counter on a CPU" if ok is None else (
            "held" if ok else "did not hold")

    return [
        {"claim": "B1: about 50% less memory", "holds if": f">= {B1_MEMORY_SAVED:.0%} saved",
         "measured": "-" if mem is None else change(mem, "saved"),
         "verdict": verdict(None if mem is None else mem >= B1_MEMORY_SAVED)},
        {"claim": "B1: 1.5-2x faster", "holds if": f">= {B1_SPEEDUP}x",
         "measured": f"{speedup:.2f}x",
         "verdict": verdict(speedup >= B1_SPEEDUP) + premise},
        {"claim": "B2: 10.2 -> 5.8 GB (over 40% less)",
         "holds if": f">= {B2_MEMORY_SAVED:.0%} saved",
         "measured": "-" if mem is None else
         f"{fp32['peak_memory_mib']:.0f} -> {amp['peak_memory_mib']:.0f} MiB "
         f"({change(mem, 'saved')})",
         "verdict": verdict(None if mem is None else mem >= B2_MEMORY_SAVED)},
        {"claim": "B2: 18.7 -> 11.2 s per epoch (about 39% less)",
         "holds if": f">= {B2_TIME_SAVED:.0%} less time",
         "measured": f"{fp32['epoch_time_s']:.3g} -> {amp['epoch_time_s']:.3g} s "
                     f"({change(time_saved, 'less')})",
         "verdict": verdict(time_saved >= B2_TIME_SAVED)},
    ]
