"""Lesson 04, ResNet-50 memory and speed: accuracy on real data with each precision, the ops most
sensitive to half precision, and the article claims (B1, R4-R7, R12) decided on ResNet-50."""
from __future__ import annotations

import importlib
import math
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import models as _models
from .. import trainer as _trainer
from .._validate import check_choice, check_int
from ..measure import (BenchConfig, OPTIMIZERS, build_optimizer, free_memory, ratio)
from ..precision import HALF_DTYPES, PRECISIONS, native_bf16



# --- accuracy on real data (claims R4, R5, R6, R7 and the parity table) -------------------------

DIGITS_MODELS = {"resnet50": _models.resnet50, "resnet18": _models.resnet18,
                 "resnet50-r4": _models.optimized_resnet50,
                 "resnet18-r4": _models.optimized_resnet18}


def digits_accuracy(model: str = "resnet18", precision: str = "fp32", device=None,
                    epochs: int = 6, batch_size: int = 64, image_size: int = 32,
                    small_input: bool = True, optimizer: str = "adam", lr: Optional[float] = None,
                    eps: float = 1e-8, amsgrad: bool = False, impl: str = "default",
                    max_train: Optional[int] = None, max_test: Optional[int] = None,
                    one_cycle: bool = True, seed: int = 0) -> Dict[str, object]:
    """Train a ResNet on the digits set with the shared trainer and report test accuracy.

    Adam (lr 1e-3) by default, with a one-cycle schedule so the last steps are small and the
    BatchNorm running statistics match the final weights. Accuracy is measured twice: under the
    training precision's autocast and with autocast off (claim R7). ``max_train`` /
    ``max_test`` keep only the first examples (the quick profile). Returns a row with
    ``accuracy``, ``accuracy_fp32_eval`` (fractions), ``final_loss`` (mean training loss of the
    last epoch), ``skipped_steps``,
    ``steps``, ``test_examples`` and ``seconds``; ``status`` is ``"skipped"`` where the device
    cannot run the precision. The same ``seed`` gives the same initial weights and batches.
    """
    from ..data import TensorBatches, digits

    check_choice("model", model, tuple(DIGITS_MODELS))
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_int("epochs", epochs, 1)
    check_int("batch_size", batch_size, 1)
    for name, value in (("max_train", max_train), ("max_test", max_test)):
        if value is not None:
            check_int(name, value, 1)
    device = torch.device(device) if device is not None else torch.device("cpu")
    label = f"{model}, {precision}, {optimizer}"
    if optimizer != "sgd":
        label += f" eps={eps:g}" + (" amsgrad" if amsgrad else "")
    row: Dict[str, object] = {"label": label, "model": model, "precision": precision,
                              "optimizer": optimizer, "eps": eps, "amsgrad": amsgrad,
                              "status": "ok", "reason": ""}
    if precision == "bf16" and not native_bf16(device):
        row.update(status="skipped", reason="bf16 needs compute capability 8.0+ "
                                            "(torch would only emulate it)")
        return row
    torch.manual_seed(seed)
    net = DIGITS_MODELS[model](num_classes=10, in_channels=1, small_input=small_input).to(device)
    cfg = BenchConfig(optimizer=optimizer, impl=impl, lr=lr, eps=eps, amsgrad=amsgrad)
    opt = build_optimizer(cfg, net.parameters())
    x_train, y_train = digits("train", image_size, device)
    x_test, y_test = digits("test", image_size, device)
    x_train, y_train = x_train[:max_train], y_train[:max_train]
    x_test, y_test = x_test[:max_test], y_test[:max_test]
    # drop_last: a last batch of a few images would give BatchNorm noisy statistics
    train = TensorBatches(x_train, y_train, min(batch_size, len(x_train)), shuffle=True,
                          drop_last=True, seed=seed)
    test = TensorBatches(x_test, y_test, 256, shuffle=False)
    scheduler = None
    if one_cycle:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=opt.param_groups[0]["lr"], total_steps=epochs * len(train),
            pct_start=0.25)
    trainer = _trainer.Trainer(net, opt, _trainer.TrainConfig(precision=precision,
                                                              progress=False, seed=None),
                               device=device, scheduler=scheduler)
    t0 = time.perf_counter()
    history = trainer.fit(train, epochs=epochs)
    same = trainer.evaluate(test)
    fp32 = trainer.evaluate(test, precision="fp32")
    losses = [r.loss for r in history]
    last = history.epochs[-1]["train_loss"] if getattr(history, "epochs", None) else None
    row.update(accuracy=float(same["accuracy"]), accuracy_fp32_eval=float(fp32["accuracy"]),
               final_loss=float(last if last is not None else losses[-1]),
               skipped_steps=_count(getattr(history, "skipped_steps", 0)),
               steps=len(losses), test_examples=int(same["examples"]),
               seconds=time.perf_counter() - t0)
    del trainer, net, opt, scheduler
    free_memory(device)
    return row


def _count(value) -> int:
    return value if isinstance(value, int) else len(value or [])


# --- claim R12: how sensitive is each op to half precision? -------------------------------------

def autocast_error_by_op(device=None, dtype="fp16",
                         logit_scales: Sequence[float] = (1.0, 8.0, 32.0),
                         seed: int = 0) -> List[Dict[str, object]]:
    """Relative error of ops under autocast against a float64 reference, on random inputs.

    A 3x3 convolution and a linear layer (the bulk of a ResNet) against scaled dot-product
    attention whose logits are made larger by ``logit_scale`` (sharper softmax, as trained
    attention gets): the error is ``||out - ref|| / ||ref||``, inf where the output overflows.
    ``dtype``: "fp16", "bf16" or the torch dtype.
    """
    dtype = HALF_DTYPES.get(dtype, dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be 'fp16', 'bf16', torch.float16 or torch.bfloat16; "
                         f"got {dtype!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale)

    def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
        out = out.double().cpu()
        if not torch.isfinite(out).all():
            return float("inf")
        return float((out - ref).norm() / ref.norm())

    rows = []
    x, w = rand(8, 64, 32, 32), rand(64, 64, 3, 3, scale=(1 / 576) ** 0.5)
    ref = F.conv2d(x, w, padding=1)
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = F.conv2d(x.float().to(device), w.float().to(device), padding=1)
    rows.append({"op": "conv2d 3x3, 64 channels", "logit_scale": None, "out_dtype": str(out.dtype),
                 "rel_error": rel(out, ref)})
    a, b = rand(1024, 1024), rand(1024, 1024, scale=1 / 32)
    ref = a @ b
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = F.linear(a.float().to(device), b.t().contiguous().float().to(device))
    rows.append({"op": "linear 1024x1024", "logit_scale": None, "out_dtype": str(out.dtype),
                 "rel_error": rel(out, ref)})
    for scale in logit_scales:
        q, k, v = rand(4, 8, 256, 64), rand(4, 8, 256, 64), rand(4, 8, 256, 64)
        q = q * scale
        ref = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v
        with torch.autocast(device_type=device.type, dtype=dtype):
            out = F.scaled_dot_product_attention(q.float().to(device), k.float().to(device),
                                                 v.float().to(device))
        rows.append({"op": "attention (SDPA), 256 tokens", "logit_scale": scale,
                     "out_dtype": str(out.dtype), "rel_error": rel(out, ref)})
    return rows


# --- claims -------------------------------------------------------------------------------------

R6_SOURCE = ("article R, \"PyTorch 2.0 混合精度训练实战：ResNet-50 显存节省 40% 的 3 个关键配置\": "
             "ResNet-50 on ImageNet")
R6_CLAIM = (
    {"configuration": "FP32", "gib": 15.2, "img_per_s": 320, "top1": 76.3},
    {"configuration": "native AMP", "gib": 10.1, "img_per_s": 580, "top1": 76.1},
    {"configuration": "optimized (R3+R4+R5)", "gib": 9.1, "img_per_s": 620, "top1": 76.2},
)
B1_CLAIM = {"memory_saving_pct": 50.0, "speedup_low": 1.5, "speedup_high": 2.0}


def compare_r6(fp32: Dict[str, object], amp: Dict[str, object],
               optimized: Dict[str, object]) -> List[Dict[str, object]]:
    """Claim R6's table beside three measured rows (fp32, plain AMP, the "optimized" model).

    Absolute numbers depend on the card and the data, so the verdicts compare changes against
    the fp32 row of the same run: memory saved, speedup, and the ordering the claim implies
    (the optimized model at least as fast and as small as plain AMP).
    """
    measured = (fp32, amp, optimized)
    if any(r.get("img_per_s") is None for r in measured):
        raise ValueError("fp32, amp and optimized rows must all hold measurements (status ok)")
    base_c, base_m = R6_CLAIM[0], fp32
    out = []
    for claim, row in zip(R6_CLAIM, measured):
        mem_c = 100 * (1 - claim["gib"] / base_c["gib"])
        speed_c = claim["img_per_s"] / base_c["img_per_s"]
        peak = row.get("peak_allocated_gib")
        mem_m = 100 * (1 - peak / base_m["peak_allocated_gib"]) if peak is not None and \
            base_m.get("peak_allocated_gib") else None
        speed_m = row["img_per_s"] / base_m["img_per_s"]
        out.append({"configuration": claim["configuration"], "measured_label": row["label"],
                    "claimed_gib": claim["gib"], "measured_gib": peak,
                    "claimed_saving_pct": mem_c, "measured_saving_pct": mem_m,
                    "claimed_img_per_s": claim["img_per_s"], "measured_img_per_s": row["img_per_s"],
                    "claimed_speedup": speed_c, "measured_speedup": speed_m})
    for r in out[1:]:
        parts = []
        if r["measured_saving_pct"] is not None:
            parts.append(_verdict_at_least("memory saving", r["measured_saving_pct"],
                                           r["claimed_saving_pct"], "%"))
        parts.append(_verdict_at_least("speedup", r["measured_speedup"], r["claimed_speedup"], "x"))
        r["verdict"] = "; ".join(parts)
    o, a = out[2], out[1]
    faster = o["measured_img_per_s"] >= a["measured_img_per_s"]
    smaller = (o["measured_gib"] is None or a["measured_gib"] is None
               or o["measured_gib"] <= a["measured_gib"])
    o["verdict"] += ("; better than plain AMP as claimed" if faster and smaller else
                     f"; NOT better than plain AMP: {o['measured_img_per_s']:.0f} vs "
                     f"{a['measured_img_per_s']:.0f} img/s"
                     + ("" if o["measured_gib"] is None or a["measured_gib"] is None else
                        f", {o['measured_gib']:.1f} vs {a['measured_gib']:.1f} GiB"))
    out[0]["verdict"] = "baseline"
    return out


def _verdict_at_least(what: str, measured: float, claimed: float, unit: str) -> str:
    held = measured >= claimed
    m = f"{measured:.0f}{unit}" if unit == "%" else f"{measured:.2f}{unit}"
    c = f"{claimed:.0f}{unit}" if unit == "%" else f"{claimed:.2f}{unit}"
    return f"{what} {m} vs claimed {c}: {'held' if held else 'did not hold'}"


def verdict_b1(fp32: Dict[str, object], fp16: Dict[str, object]) -> Dict[str, object]:
    """Claim B1 (fp16 saves about 50% of memory and trains 1.5-2x faster) against two rows."""
    if fp32.get("img_per_s") is None or fp16.get("img_per_s") is None:
        raise ValueError("fp32 and fp16 rows must both hold measurements (status ok)")
    speedup = fp16["img_per_s"] / fp32["img_per_s"]
    saving = None
    if fp32.get("peak_allocated_gib") and fp16.get("peak_allocated_gib") is not None:
        saving = 100 * (1 - fp16["peak_allocated_gib"] / fp32["peak_allocated_gib"])
    lo, hi = B1_CLAIM["speedup_low"], B1_CLAIM["speedup_high"]
    speed = ("within the claimed 1.5-2x" if lo <= speedup <= hi else
             "faster than claimed" if speedup > hi else "slower than claimed")
    if saving is None:
        mem = "memory not measured on this device"
    else:
        mem = ("about the claimed 50%" if abs(saving - 50) <= 10 else
               "more than claimed" if saving > 50 else "less than claimed")
    mem_text = "n/a" if saving is None else f"{saving:.0f}%"
    text = (f"claim B1: fp16 saves ~50% memory and is 1.5-2x faster; measured here: "
            f"{speedup:.2f}x ({speed}), memory saved {mem_text} ({mem})")
    return {"speedup": speedup, "memory_saving_pct": saving, "speed_verdict": speed,
            "memory_verdict": mem, "text": text,
            "held": (lo <= speedup and (saving is None or saving >= 40))}


PUBLISHED_FASTEST = {"img_per_s": 7950.0, "batch_size": 256,
                     "source": "MLPerf Training v4.0, ResNet-50 on H200 with fused MXNet; MLPerf "
                               "publishes time to train, this per-GPU throughput is derived from "
                               "it, the best such figure published"}


def fastest_row(rows: Sequence[Dict[str, object]]) -> Optional[Dict[str, object]]:
    """The row with the most img/s among those that ran (status ok) and kept a finite loss, or None.

    A configuration whose loss went non-finite is fast at nothing useful, so it cannot win.
    """
    ok = [r for r in rows if _trained(r)]
    return max(ok, key=lambda r: r["img_per_s"]) if ok else None


def _trained(row) -> bool:
    """A measured row (status ok, img/s > 0) whose loss stayed finite."""
    return (isinstance(row, dict) and row.get("status") == "ok"
            and isinstance(row.get("img_per_s"), (int, float)) and row["img_per_s"] > 0
            and isinstance(row.get("loss"), (int, float)) and math.isfinite(row["loss"]))


def verdict_fastest(row: Dict[str, object], fp32: Dict[str, object]) -> Dict[str, object]:
    """The fastest measured step against fp32 (same run) and ``PUBLISHED_FASTEST``."""
    for name, r in (("row", row), ("fp32", fp32)):
        if not _trained(r):
            raise ValueError(f"{name} must be a measured row (status ok, img_per_s > 0, finite "
                             f"loss); got {r!r}"[:300])
    ref = PUBLISHED_FASTEST["img_per_s"]
    share = row["img_per_s"] / ref
    text = (f"fastest here: {row['label']} at {row['img_per_s']:,.0f} img/s "
            f"({row['img_per_s'] / fp32['img_per_s']:.2f}x fp32 with TF32 off, batch "
            f"{(row.get('config') or {}).get('batch_size', '?')}); "
            f"{share:.0%} of the published {ref:,.0f} img/s ({PUBLISHED_FASTEST['source']})")
    if row.get("timer") == "perf_counter":
        text += "; timed on a CPU at small sizes here, so not comparable with that GPU figure"
    return {"img_per_s": row["img_per_s"], "share_of_published": share, "beats_published": share > 1,
            "text": text}


R6_COLUMNS = (("configuration", "R6 row"), ("measured_label", "measured as"),
              ("claimed_gib", "claimed GB"), ("measured_gib", "measured GiB"),
              ("claimed_saving_pct", "claimed saved %"), ("measured_saving_pct", "saved %"),
              ("claimed_img_per_s", "claimed img/s"), ("measured_img_per_s", "img/s"),
              ("claimed_speedup", "claimed x"), ("measured_speedup", "x"), ("verdict", "verdict"))

ACCURACY_COLUMNS = (("label", "run"), ("accuracy", "test acc (autocast)"),
                    ("accuracy_fp32_eval", "test acc (fp32 eval)"), ("final_loss", "last epoch loss"),
                    ("skipped_steps", "skipped"), ("steps", "steps"), ("status", "status"))


def verdict_r4(amp: Dict[str, object], r4: Dict[str, object], amp_run: Dict[str, object],
               r4_run: Dict[str, object], tolerance: float = 0.01) -> Dict[str, object]:
    """Claim R4 (layer3/4 + fc in fp32 keep accuracy) in numbers: speed, memory, accuracy.

    ``amp``/``r4`` are benchmark rows, ``amp_run``/``r4_run`` digits runs. The claim holds
    where the fp32 layers buy accuracy (more than ``tolerance``) that plain AMP lacks.
    """
    for name, row, key in (("amp", amp, "img_per_s"), ("r4", r4, "img_per_s"),
                           ("amp_run", amp_run, "accuracy"), ("r4_run", r4_run, "accuracy")):
        if row.get(key) is None:
            raise ValueError(f"{name} must hold a measurement ({key}); got status "
                             f"{row.get('status')!r}")
    speed = r4["img_per_s"] / amp["img_per_s"]
    mem = ratio(r4.get("peak_allocated_gib"), amp.get("peak_allocated_gib"))
    acts = ratio(r4.get("activations_gib"), amp.get("activations_gib"))
    gain = r4_run["accuracy"] - amp_run["accuracy"]
    held = gain > tolerance
    text = (f"claim R4: forcing layer3, layer4 and fc to fp32 keeps accuracy; measured: "
            f"speed x{speed:.2f}, "
            + (f"peak memory x{mem:.2f}, " if mem is not None else "")
            + f"saved activations x{acts:.2f}, accuracy {100 * r4_run['accuracy']:.1f}% vs "
            f"{100 * amp_run['accuracy']:.1f}% with plain AMP: "
            + ("the fp32 layers bought accuracy" if held else
               "no accuracy to win back: plain AMP already matched it"))
    return {"speed_ratio": speed, "memory_ratio": mem, "activations_ratio": acts,
            "accuracy_gain": gain, "held": held, "text": text}


def verdict_r7(runs: Sequence[Dict[str, object]], tolerance: float = 0.01) -> Dict[str, object]:
    """Claim R7 (validate with autocast off if accuracy drops): the largest accuracy difference
    between evaluating under autocast and in fp32, over the half-precision runs."""
    half = [r for r in runs if r.get("precision") in HALF_DTYPES and r.get("accuracy") is not None]
    if not half:
        raise ValueError("runs must hold at least one fp16 or bf16 run that ran")
    diffs = [r["accuracy_fp32_eval"] - r["accuracy"] for r in half]
    worst = max(diffs, key=abs)
    held = worst > tolerance
    text = (f"claim R7: validate with autocast disabled if accuracy drops; measured: fp32 "
            f"evaluation changed accuracy by at most {100 * worst:+.2f} points over "
            f"{len(half)} half-precision runs: "
            + ("fp32 evaluation recovered accuracy" if held else
               "autocast evaluation lost nothing to recover"))
    return {"max_difference": worst, "held": held, "text": text}


def verdict_r12(op_rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """Claim R12 (attention is more precision-sensitive than convolutions) from
    ``autocast_error_by_op`` rows: worst attention error over the convolution's error."""
    conv = [r["rel_error"] for r in op_rows if r["op"].startswith("conv")]
    attn = [r["rel_error"] for r in op_rows if r["op"].startswith("attention")]
    if not conv or not attn:
        raise ValueError("op_rows must hold convolution and attention rows")
    ratio = max(attn) / max(conv)
    held = ratio > 1.5
    text = (f"claim R12: attention is more precision-sensitive than convolutions; measured: "
            f"attention's relative error is up to {ratio:.1f}x the convolution's "
            + ("and grows with sharper softmax logits: held" if held else ": did not hold"))
    return {"ratio": ratio, "held": held, "text": text}


def adam_precision_facts(device=None) -> Dict[str, object]:
    """Claim R5's "fp16 division by zero": which dtype Adam computes in under AMP.

    One fp16 autocast step of a small model with Adam: parameters, gradients and Adam's state
    are float32, so eps never meets float16. For contrast, what float16 would make of 1e-8 and
    1e-7.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = model(torch.randn(4, 8, device=device))
    out.float().pow(2).mean().backward()
    grad_dtype = model[0].weight.grad.dtype
    opt.step()
    state = opt.state[model[0].weight]
    return {"autocast_dtype": str(dtype), "activation_dtype": str(out.dtype),
            "param_dtype": str(model[0].weight.dtype), "grad_dtype": str(grad_dtype),
            "exp_avg_sq_dtype": str(state["exp_avg_sq"].dtype),
            "eps_1e-8_in_fp16": float(torch.tensor(1e-8, dtype=torch.float16)),
            "eps_1e-7_in_fp16": float(torch.tensor(1e-7, dtype=torch.float16)),
            "eps_1e-8_in_fp32": float(torch.tensor(1e-8, dtype=torch.float32))}


def multi_tensor_status() -> Dict[str, object]:
    """Claim R5's ``torch.optim._multi_tensor``: does it exist in this PyTorch, and what is it?

    Where it exists, its ``Adam`` is built on one dummy parameter to read what it really is:
    a subclass of ``torch.optim.Adam`` and the ``foreach`` setting it fixes.
    """
    try:
        mod = importlib.import_module("torch.optim._multi_tensor")
    except ImportError as exc:
        return {"exists": False, "has_adam": False, "subclass_of_adam": False, "foreach": None,
                "error": f"{type(exc).__name__}: {exc}"}
    adam = getattr(mod, "Adam", None)
    out = {"exists": True, "has_adam": adam is not None, "subclass_of_adam": False,
           "foreach": None, "error": ""}
    if adam is not None:
        out["subclass_of_adam"] = isinstance(adam, type) and issubclass(adam, torch.optim.Adam)
        out["foreach"] = adam([nn.Parameter(torch.zeros(1))]).defaults.get("foreach")
    return out
