"""Lesson 04, ResNet-50 memory and speed: the lesson's table of configurations, accuracy on real
data with each precision, the ops most sensitive to half precision, and the article claims it
decides (B1, B2, R4, R5, R6, R7, R12), each a ``claims.Verdict``.

Every timing verdict passes ``claims.timing_gate`` (a GPU, a warm-up, enough steps, a busy GPU)
and every accuracy verdict ``claims.accuracy_gate`` (trained well above chance): on the quick CPU
profile they all read "not decided here" with the reason.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

from amp_lessons.publish import claims
from amp_lessons import models
from amp_lessons.train import trainer as training
from amp_lessons.validate import check_choice, check_int
from amp_lessons.data import TensorBatches, digits
from amp_lessons.measure import (COMPILE_MODES, OPTIMIZERS, PRECISION_NAMES, STANDARD, BenchConfig,
                     build_optimizer, find_row, free_memory, ratio, wall_clock)
from amp_lessons.numerics.optim import (adam_precision_facts, multi_tensor_status,  # noqa: F401 (the lesson's API)
                     skipped_step_check)
from amp_lessons.numerics.precision import (HALF_DTYPES, PRECISIONS, as_device, autocast_error_by_op,  # noqa: F401
                         autocast_op_list_api, native_bf16)
from amp_lessons.tables import percent, plural, spread_text

LESSON = "04"


# --- the lesson's table of configurations -------------------------------------------------------

def lesson_configs(model: str = "resnet50", batch_size: int = 256, image_size: int = 224,
                   num_classes: int = 1000, amp: str = "fp16",
                   compile_precision: Optional[str] = "bf16",
                   cudnn_benchmark: bool = STANDARD["cudnn_benchmark"],
                   compile_modes: Sequence[str] = ("default", "reduce-overhead")
                   ) -> List[BenchConfig]:
    """Lesson 04's table: precisions x memory formats, fused optimizers, the selective-autocast
    model, Adam's variants and torch.compile.

    Every row uses ``measure.STANDARD``'s optimizer (foreach SGD, momentum 0.9) and cuDNN
    autotuning unless the row is about the difference (its memory format, its optimizer, its
    kernels: the label says). Claim R6's "optimized" row (``OPTIMIZED_LABEL``) is built as
    article R describes it. ``amp`` is the half precision of the optimizer and selective rows
    (fp16 as in the articles; bf16 where fp16 would only be emulated); ``compile_precision`` is
    that of the compiled rows (channels_last, fused SGD), one per mode in ``compile_modes``
    (``None`` leaves torch.compile out)."""
    check_choice("amp", amp, tuple(HALF_DTYPES))
    check_choice("compile_precision", compile_precision, (None,) + tuple(PRECISIONS))
    if not isinstance(cudnn_benchmark, bool):
        raise ValueError(f"cudnn_benchmark must be True or False; got {cudnn_benchmark!r}")
    if isinstance(compile_modes, str) or not compile_modes:
        raise ValueError(f"compile_modes must be a non-empty sequence of modes from "
                         f"{COMPILE_MODES[1:]}; got {compile_modes!r}")
    for mode in compile_modes:
        check_choice("compile_modes", mode, COMPILE_MODES[1:])
    base = dict(model=model, batch_size=batch_size, image_size=image_size,
                num_classes=num_classes, cudnn_benchmark=cudnn_benchmark,
                optimizer=STANDARD["optimizer"], impl=STANDARD["impl"])
    cfgs = [BenchConfig(precision=p, **base) for p in PRECISIONS]
    cfgs += [BenchConfig(precision=p, channels_last=True, **base) for p in PRECISIONS]
    cfgs += [BenchConfig(precision=p, channels_last=True, **dict(base, impl="fused"))
             for p in dict.fromkeys((amp, "bf16"))]
    cfgs += [BenchConfig(precision=amp, **dict(base, model=f"{model}-selective"))]
    adam = dict(base, precision=amp, channels_last=True, optimizer="adam")
    cfgs += [BenchConfig(**dict(adam, impl="foreach")), BenchConfig(**dict(adam, impl="fused")),
             BenchConfig(eps=1e-7, **dict(adam, impl="fused")),
             BenchConfig(amsgrad=True, **dict(adam, impl="fused"))]
    cfgs += [BenchConfig(label=OPTIMIZED_LABEL, eps=1e-7, amsgrad=True,
                         **dict(base, precision=amp, model=f"{model}-selective", optimizer="adam",
                                impl="foreach"))]
    if compile_precision:
        cfgs += [BenchConfig(precision=compile_precision, channels_last=True, compile=mode,
                             **dict(base, impl="fused")) for mode in compile_modes]
    return cfgs


#: Claim R6's "optimized" row as article R builds it: R4's model (layer3/4 + fc in fp32) with R5's
#: Adam (eps 1e-7, amsgrad, ``_multi_tensor`` = foreach). R3's scaler settings change neither speed
#: nor memory (GradScaler's scale is one number), so the row leaves them at the defaults.
OPTIMIZED_LABEL = ("optimized (R3+R4+R5): fp16 + GradScaler, layer3/4+fc in fp32, Adam eps 1e-7 "
                   "amsgrad foreach")


def optimized_row(rows: Sequence[Dict[str, object]]) -> Optional[Dict[str, object]]:
    """Claim R6's "optimized (R3+R4+R5)" row of the table (``OPTIMIZED_LABEL``), or None."""
    return next((r for r in rows if r.get("label") == OPTIMIZED_LABEL), None)


def trainer_fastest_config(model: str = "resnet50", batch_size: int = 512, image_size: int = 224,
                           num_classes: int = 1000, precision: str = "fp16",
                           cudnn_benchmark: bool = STANDARD["cudnn_benchmark"],
                           compile: str = "reduce-overhead") -> BenchConfig:
    """The row measured through the course's ``Trainer`` on its fastest path: ``precision``
    (fp16 + GradScaler or bf16), channels_last, fused SGD, ``torch.compile(mode=compile)``
    (``"max-autotune"`` also tunes kernels, for minutes), grad-norm and memory tracking off;
    ``batch_size``: twice the table's where memory allows. The label writes every setting out."""
    check_choice("precision", precision, tuple(HALF_DTYPES))
    check_int("batch_size", batch_size, 1)
    check_choice("compile", compile, tuple(m for m in COMPILE_MODES if m))
    label = (f"Trainer, fastest path: {PRECISION_NAMES[precision]}, channels_last, SGD(fused=True), "
             f"torch.compile(mode='{compile}'), batch {batch_size}, "
             f"TrainConfig(track_grad_norm=False, track_memory=False)")
    return BenchConfig(label=label, model=model, precision=precision, channels_last=True,
                       batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                       optimizer="sgd", impl="fused", compile=compile, loop="trainer",
                       trainer_tracking=False, cudnn_benchmark=cudnn_benchmark)


def default_row(rows: Sequence[Dict[str, object]], model: str,
                channels_last: bool = False) -> Optional[Dict[str, object]]:
    """fp32 as a learner gets it by default: the "fp32, TF32 on" row where it ran (PyTorch
    computes convolutions in TF32 by default on GPUs that have it), else the plain fp32 row (a
    GPU without TF32, where the default is plain fp32)."""
    tf32 = plain_row(rows, "tf32", model, channels_last)
    if tf32 is not None and tf32.get("status") == "ok":
        return tf32
    return plain_row(rows, "fp32", model, channels_last)


def plain_row(rows: Sequence[Dict[str, object]], precision: str, model: str,
              channels_last: bool = False) -> Optional[Dict[str, object]]:
    """The table's row for ``precision`` with the standard optimizer, eager, of ``model``."""
    return find_row(rows, precision=precision, channels_last=channels_last, model=model,
                    optimizer=STANDARD["optimizer"], impl=STANDARD["impl"], compile=None,
                    cuda_graph=False)


def layout_effects(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per precision: img/s with NCHW and with channels_last (standard optimizer), and the gain."""
    out = []
    for precision in PRECISIONS:
        pair = [r for r in (find_row(rows, precision=precision, channels_last=cl,
                                     optimizer=STANDARD["optimizer"], impl=STANDARD["impl"],
                                     compile=None, cuda_graph=False) for cl in (False, True))]
        if None in pair or pair[0]["config"]["model"].endswith("-selective"):
            continue
        a, b = pair[0].get("img_per_s"), pair[1].get("img_per_s")
        out.append({"label": pair[0]["label"], "nchw_img_per_s": a, "channels_last_img_per_s": b,
                    "channels_last_gain": ratio(b, a)})
    return out


LAYOUT_COLUMNS = (("label", "precision"), ("nchw_img_per_s", "NCHW img/s"),
                  ("channels_last_img_per_s", "channels_last img/s"),
                  ("channels_last_gain", "gain x"))


# --- accuracy on real data (claims R4, R5, R7 and the parity table) -----------------------------

RESNET_DIGITS_MODELS = {"resnet50": models.resnet50, "resnet18": models.resnet18,
                        "resnet50-selective": models.optimized_resnet50,
                        "resnet18-selective": models.optimized_resnet18}


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
    last epoch), ``skipped_steps``, ``steps``, ``classes``, ``test_examples`` and ``seconds``;
    ``status`` is ``"skipped"`` where the device cannot run the precision. The same ``seed``
    gives the same initial weights and batches."""
    check_choice("model", model, tuple(RESNET_DIGITS_MODELS))
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_int("epochs", epochs, 1)
    check_int("batch_size", batch_size, 1)
    for name, value in (("max_train", max_train), ("max_test", max_test)):
        if value is not None:
            check_int(name, value, 1)
    device = as_device(device)
    label = f"{model}, {precision}, {optimizer}"
    if optimizer != "sgd":
        label += f" eps={eps:g}" + (" amsgrad" if amsgrad else "")
    row: Dict[str, object] = {"label": label, "model": model, "precision": precision,
                              "optimizer": optimizer, "eps": eps, "amsgrad": amsgrad,
                              "classes": 10, "status": "ok", "reason": ""}
    if precision == "bf16" and not native_bf16(device):
        row.update(status="skipped", reason="bf16 needs compute capability 8.0+ "
                                            "(torch would only emulate it)")
        return row
    torch.manual_seed(seed)
    net = RESNET_DIGITS_MODELS[model](num_classes=10, in_channels=1,
                                      small_input=small_input).to(device)
    opt = build_optimizer(BenchConfig(optimizer=optimizer, impl=impl, lr=lr, eps=eps,
                                      amsgrad=amsgrad), net.parameters())
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
    run = training.Trainer(net, opt, training.TrainConfig(precision=precision, progress=False,
                                                          seed=None),
                           device=device, scheduler=scheduler)
    with wall_clock() as clock:
        history = run.fit(train, epochs=epochs)
        same = run.evaluate(test)
        fp32 = run.evaluate(test, precision="fp32")
    losses = [r.loss for r in history]
    last = history.epochs[-1]["train_loss"] if getattr(history, "epochs", None) else None
    skipped = getattr(history, "skipped_steps", 0)
    row.update(accuracy=float(same["accuracy"]), accuracy_fp32_eval=float(fp32["accuracy"]),
               final_loss=float(last if last is not None else losses[-1]),
               skipped_steps=skipped if isinstance(skipped, int) else len(skipped or []),
               steps=len(losses), test_examples=int(same["examples"]),
               seconds=clock["seconds"])
    del run, net, opt, scheduler
    free_memory(device)
    return row


ACCURACY_COLUMNS = (("label", "run"), ("accuracy", "test acc (autocast)"),
                    ("accuracy_fp32_eval", "test acc (fp32 eval)"),
                    ("final_loss", "last epoch loss"), ("skipped_steps", "skipped"),
                    ("steps", "steps"), ("status", "status"))


# --- claim R12: how sensitive is each op to half precision? -------------------------------------

# --- when can this run decide? ------------------------------------------------------------------

def rows_caption(*rows: Dict[str, object]) -> str:
    """The settings of exactly these table rows in words, generated from their configurations
    (memory format, precision, optimizer, cuDNN autotuning, steps): the line above a verdict or
    a published table, so a caption never names a setting its rows did not use."""
    if not rows or any(not isinstance(r, dict) for r in rows):
        raise ValueError("rows must hold at least one measured table row")
    cfgs = [r.get("config") or {} for r in rows]

    def values(key, show):
        return "/".join(dict.fromkeys(show(c.get(key)) for c in cfgs))
    opt = values("optimizer", lambda v: {"sgd": "SGD (momentum 0.9)", "adam": "Adam",
                                         "adamw": "AdamW"}.get(v, str(v)))
    impl = values("impl", str)
    steps = min(int(r.get("steps") or 0) for r in rows)
    warmup = min(int(r.get("warmup") or 0) for r in rows)
    return (f"{values('channels_last', lambda v: 'channels_last' if v else 'NCHW')}, "
            f"{values('label', str).replace('/', ' / ')}; cuDNN autotuning "
            f"{values('cudnn_benchmark', lambda v: 'on' if v else 'off')}, {impl} {opt}, median "
            f"of {plural(steps, 'timed step')} after {warmup} warm-up")


def timing_caveat(rows: Sequence[Dict[str, object]]) -> str:
    """What to read beside a chart or table of speeds and ratios from ``rows``: why they decide
    nothing (``claims.rows_timing_gate``, the gate of every timing verdict), or ``""`` where
    they could."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("img_per_s") is not None]
    why = claims.rows_timing_gate(*ok) if ok else None
    steps = min((int(r.get("steps") or 0) for r in ok), default=0)
    return "" if why is None else (f"Not a speed comparison: {why}; each img/s is the median of "
                                   f"{plural(steps, 'timed step')}.")


def accuracy_reason(*runs: Dict[str, object]) -> Optional[str]:
    """Why an accuracy comparison of these digits runs cannot decide a claim
    (``claims.accuracy_gate`` on the least accurate of them), or None when it can."""
    if not runs:
        raise ValueError("runs must hold at least one digits run")
    if any(r.get("accuracy") is None for r in runs):
        return "a run did not train (" + ", ".join(f"{r.get('label')}: {r.get('status')}"
                                                    for r in runs if r.get("accuracy") is None) + ")"
    for r in runs:  # a NaN would hide from min(): every run passes the gate on its own
        why = claims.accuracy_gate(r["accuracy"], int(r.get("classes", 10)))
        if why is not None:
            return why
    return None


def _idle_text(*rows) -> str:
    idle = [r.get("gpu_idle_fraction") for r in rows]
    if any(v is None for v in idle):
        return "GPU idle share not measured"
    return "GPU idle " + ", ".join(percent(v, 1.0) for v in idle) + " of the step"


def _saving(row, base) -> Optional[float]:
    """Percent of ``base``'s peak memory that ``row`` saves (None without peaks: a CPU)."""
    peak, ref = row.get("peak_allocated_gib"), base.get("peak_allocated_gib")
    return 100 * (1 - peak / ref) if peak is not None and ref else None


def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:,.1f} ms"


def _pct(v: Optional[float]) -> str:
    return "n/a (no peak counter here)" if v is None else f"{v:.0f}%"


# --- claims B1 and B2: fp16 against fp32 on ResNet-50 -------------------------------------------

def _check_pair(fp32, fp16) -> None:
    for name, r in (("fp32", fp32), ("fp16", fp16)):
        if not isinstance(r, dict):
            raise ValueError(f"{name} must be a measured row (a dict); got {r!r}")


def _beside(default, fp16, tf32_off, fp16_channels_last) -> str:
    """The comparisons shown beside a B1/B2 verdict: fp16 against fp32 with TF32 off, and fp16
    with channels_last against the same default baseline."""
    out = []
    if tf32_off is not None and tf32_off.get("img_per_s") and fp16.get("img_per_s"):
        out.append(f"against {tf32_off.get('label')}: "
                   f"{fp16['img_per_s'] / tf32_off['img_per_s']:.2f}x")
    if (fp16_channels_last is not None and fp16_channels_last.get("img_per_s")
            and default.get("img_per_s")):
        out.append(f"{fp16_channels_last.get('label')} against the default: "
                   f"{fp16_channels_last['img_per_s'] / default['img_per_s']:.2f}x")
    return ("; beside it: " + "; ".join(out)) if out else ""


def _numbers(numbers: Dict[str, object]) -> Dict[str, object]:
    return {k: v for k, v in numbers.items() if v is not None}


@claims.decides("B1")
def verdict_b1(default: Dict[str, object], fp16: Dict[str, object],
               tf32_off: Optional[Dict[str, object]] = None,
               fp16_channels_last: Optional[Dict[str, object]] = None) -> claims.Verdict:
    """Claim B1 (fp16 saves about 50% of memory and trains 1.5-2x faster on tensor cores) from
    rows of the same run, against what a learner gets by default: ``default`` is fp32 with TF32
    convolutions (PyTorch's default for cuDNN; ``default_row``), ``fp16`` the
    fp16 + GradScaler row in the same memory format. Two parts: memory saved at least 40%, and a
    speed-up of at least 1.5x (above 2x the claim understated it). ``tf32_off`` and
    ``fp16_channels_last`` are shown beside it, never ruling. Decided only on a busy GPU."""
    _check_pair(default, fp16)
    reason = claims.rows_timing_gate(default, fp16)
    speedup = ratio(fp16.get("img_per_s"), default.get("img_per_s"))
    saving = _saving(fp16, default)
    speed_text = "n/a" if speedup is None else f"{speedup:.2f}x"
    measured = (f"{fp16.get('label')} vs {default.get('label')} (PyTorch's default here): "
                f"{speed_text} the speed, memory saved {_pct(saving)} "
                f"({_idle_text(default, fp16)})"
                + _beside(default, fp16, tf32_off, fp16_channels_last))
    if reason is None and saving is None:
        reason = "peak memory was not measured on this device"
    parts = []
    if reason is None:
        parts = [claims.at_least("saves about 50% of memory", saving, 40),
                 claims.at_least("trains 1.5 to 2x faster", speedup, 1.5, "x", 2,
                                 " against the default fp32")]
    return claims.decide("B1", LESSON, measured, None, "" if parts else "-", parts=parts,
                         numbers=_numbers({"speedup": speedup, "memory_saving_pct": saving}),
                         cannot_decide=reason,
                         understated=(f"{speedup:.2f}x is faster than the claimed 1.5-2x"
                                      if speedup is not None and speedup > 2 else None))


@claims.decides("B2")
def verdict_b2(default: Dict[str, object], fp16: Dict[str, object],
               tf32_off: Optional[Dict[str, object]] = None) -> claims.Verdict:
    """Claim B2 (article B's ``train.py`` on an RTX 3090: AMP over 40% less memory and about 39%
    less time than fp32) on a stand-in, named as one: ResNet-50 on this GPU (the article's own
    code trains a ``Linear(784, 10)``, which cannot fill 10 GB). Against the default fp32 (TF32
    convolutions), same run: two parts, memory saved at least 40% and step time at least 30%
    shorter; ``tf32_off`` shown beside. Decided only on a busy GPU."""
    _check_pair(default, fp16)
    reason = claims.rows_timing_gate(default, fp16)
    saving = _saving(fp16, default)
    a, b = default.get("step_ms"), fp16.get("step_ms")
    shorter = 100 * (1 - b / a) if a and b is not None else None
    change = ("n/a" if shorter is None else f"{shorter:.0f}% shorter" if shorter >= 0 else
              f"{-shorter:.0f}% longer")
    measured = (f"{fp16.get('label')} step {_ms(b)} vs {_ms(a)} with {default.get('label')} "
                f"(PyTorch's default) ({change}), memory saved {_pct(saving)} "
                f"({_idle_text(default, fp16)})" + _beside(default, fp16, tf32_off, None))
    if reason is None and saving is None:
        reason = "peak memory was not measured on this device"
    parts = []
    if reason is None:
        parts = [claims.at_least("over 40% less memory", saving, 40, note=" (article: 43%)"),
                 claims.at_least("about 39% less time", shorter, 30, note=" (article: 40%)")]
    batch = (fp16.get("config") or {}).get("batch_size", "?")
    return claims.decide("B2", LESSON, measured, None, "" if parts else "-", parts=parts,
                         numbers=_numbers({"memory_saving_pct": saving,
                                           "step_time_shorter_pct": shorter}),
                         cannot_decide=reason,
                         stand_in=f"ResNet-50 at batch {batch} on this GPU for article B's "
                                  f"train.py on an RTX 3090")


# --- claim R6: article R's table -----------------------------------------------------------------

R6_SOURCE = ("article R, \"PyTorch 2.0 混合精度训练实战：ResNet-50 显存节省 40% 的 3 个关键配置\": "
             "ResNet-50 on ImageNet")
R6_CLAIM = (
    {"configuration": "FP32", "gib": 15.2, "img_per_s": 320, "top1": 76.3},
    {"configuration": "native AMP", "gib": 10.1, "img_per_s": 580, "top1": 76.1},
    {"configuration": "optimized (R3+R4+R5)", "gib": 9.1, "img_per_s": 620, "top1": 76.2},
)


def compare_r6(fp32: Dict[str, object], amp: Dict[str, object],
               optimized: Dict[str, object]) -> List[Dict[str, object]]:
    """Claim R6's table beside three measured rows (fp32, plain AMP, the "optimized" model).

    Absolute numbers depend on the card and the data, so each row compares changes against the
    fp32 row of the same run: memory saved and speed-up, claimed and measured, and the GPU's
    idle share. ``verdict_r6`` rules on these rows.
    """
    measured = (fp32, amp, optimized)
    if any(not isinstance(r, dict) or r.get("img_per_s") is None for r in measured):
        raise ValueError("fp32, amp and optimized rows must all hold measurements (status ok)")
    base = R6_CLAIM[0]
    out = []
    for claim, row in zip(R6_CLAIM, measured):
        out.append({"configuration": claim["configuration"], "measured_label": row["label"],
                    "claimed_gib": claim["gib"], "measured_gib": row.get("peak_allocated_gib"),
                    "claimed_saving_pct": 100 * (1 - claim["gib"] / base["gib"]),
                    "measured_saving_pct": _saving(row, fp32),
                    "claimed_img_per_s": claim["img_per_s"], "measured_img_per_s": row["img_per_s"],
                    "claimed_speedup": claim["img_per_s"] / base["img_per_s"],
                    "measured_speedup": row["img_per_s"] / fp32["img_per_s"],
                    "gpu_idle_fraction": row.get("gpu_idle_fraction"),
                    "spread": row.get("spread"), "timer": row.get("timer"), "steps": row.get("steps"),
                    "warmup": row.get("warmup"), "status": row.get("status")})
    return out


@claims.decides("R6")
def verdict_r6(r6_rows: Sequence[Dict[str, object]]) -> claims.Verdict:
    """Claim R6 from ``compare_r6``'s rows (fp32 as a learner gets it by default, TF32
    convolutions; plain AMP; "optimized" built as article R describes it, ``OPTIMIZED_LABEL``):
    holds when plain AMP and "optimized" each save at least the claimed memory and reach the
    claimed speed-up against fp32 (one-sided: more is not a refutation), and "optimized" beats
    plain AMP (faster, no bigger). Decided only on a busy GPU."""
    if len(r6_rows) != 3:
        raise ValueError(f"r6_rows must be compare_r6's 3 rows; got {len(r6_rows)}")
    fp32, amp, opt = r6_rows
    as_rows = [{"label": r["measured_label"], "status": r["status"], "img_per_s":
                r["measured_img_per_s"], "timer": r["timer"], "steps": r["steps"],
                "warmup": r["warmup"], "gpu_idle_fraction": r["gpu_idle_fraction"]}
               for r in r6_rows]
    reason = claims.rows_timing_gate(*as_rows)
    if reason is None and any(r["measured_saving_pct"] is None for r in (amp, opt)):
        reason = "peak memory was not measured on this device"
    parts, fails = [], []
    for r in (amp, opt):
        s = r["measured_saving_pct"]
        parts.append(f"{r['configuration']}: {r['measured_speedup']:.2f}x (claimed "
                     f"{r['claimed_speedup']:.2f}x), memory saved "
                     f"{'n/a' if s is None else f'{s:.0f}%'} (claimed "
                     f"{r['claimed_saving_pct']:.0f}%)")
        if r["measured_speedup"] < r["claimed_speedup"]:
            fails.append(f"{r['configuration']} slower than claimed")
        if s is not None and s < r["claimed_saving_pct"]:
            fails.append(f"{r['configuration']} saves {s:.0f}% < claimed "
                         f"{r['claimed_saving_pct']:.0f}%")
    better = opt["measured_img_per_s"] >= amp["measured_img_per_s"] and (
        opt["measured_gib"] is None or amp["measured_gib"] is None
        or opt["measured_gib"] <= amp["measured_gib"])
    if not better:
        fails.append(f"optimized is not better than plain AMP ({opt['measured_img_per_s']:,.0f} "
                     f"vs {amp['measured_img_per_s']:,.0f} img/s)")
    measured = "; ".join(parts) + f" ({_idle_text(*as_rows)})"
    why = "; ".join(fails) if fails else "every row reached its claim and optimized beat plain AMP"
    return claims.decide("R6", LESSON, measured, not fails, why,
                         {"amp_speedup": amp["measured_speedup"],
                          "optimized_speedup": opt["measured_speedup"],
                          "amp_saving_pct": amp["measured_saving_pct"],
                          "optimized_saving_pct": opt["measured_saving_pct"]},
                         cannot_decide=reason)


R6_COLUMNS = (("configuration", "R6 row"), ("measured_label", "measured as"),
              ("claimed_gib", "claimed GB"), ("measured_gib", "measured GiB"),
              ("claimed_saving_pct", "claimed saved %"), ("measured_saving_pct", "saved %"),
              ("claimed_img_per_s", "claimed img/s"), ("measured_img_per_s", "img/s"),
              ("claimed_speedup", "claimed x"), ("measured_speedup", "x"),
              ("gpu_idle_fraction", "GPU idle", lambda v: percent(v, 1.0)),
              ("spread", "repeat spread", spread_text))


# --- claims R4, R5, R7 (accuracy) and R12 (op error) --------------------------------------------

@claims.decides("R4")
def verdict_r4(amp: Dict[str, object], selective: Dict[str, object], amp_run: Dict[str, object],
               selective_run: Dict[str, object], tolerance: float = 0.01) -> claims.Verdict:
    """Claim R4 (layer3/4 + fc in fp32 keep accuracy): accuracy of the selective-autocast model
    against plain AMP on the digits set, and what it costs in speed and memory (table rows).

    Holds where the fp32 layers buy accuracy (more than ``tolerance``) that plain AMP lacks;
    decided only when both runs trained well above chance (``accuracy_reason``).
    """
    for name, row, key in (("amp", amp, "img_per_s"), ("selective", selective, "img_per_s"),
                           ("amp_run", amp_run, "accuracy"),
                           ("selective_run", selective_run, "accuracy")):
        if not isinstance(row, dict) or row.get(key) is None:
            raise ValueError(f"{name} must hold a measurement ({key}); got status "
                             f"{(row or {}).get('status')!r}")
    speed = selective["img_per_s"] / amp["img_per_s"]
    mem = ratio(selective.get("peak_allocated_gib"), amp.get("peak_allocated_gib"))
    acts = ratio(selective.get("activations_gib"), amp.get("activations_gib"))
    gain = selective_run["accuracy"] - amp_run["accuracy"]
    cost_reason = claims.rows_timing_gate(amp, selective)
    measured = (f"accuracy {100 * selective_run['accuracy']:.1f}% vs "
                f"{100 * amp_run['accuracy']:.1f}% with plain AMP; cost: speed x{speed:.2f}"
                + (f", peak memory x{mem:.2f}" if mem is not None else "")
                + (f", saved activations x{acts:.2f}" if acts is not None else "")
                + (f" (speed not comparable: {cost_reason})" if cost_reason else ""))
    held = gain > tolerance
    why = ("the fp32 layers bought accuracy" if held else
           f"no accuracy to win back: plain AMP already matched it ({100 * gain:+.1f} points)")
    return claims.decide("R4", LESSON, measured, held, why,
                         {"speed_ratio": speed, "memory_ratio": mem, "activations_ratio": acts,
                          "accuracy_gain": gain},
                         cannot_decide=accuracy_reason(amp_run, selective_run))


@claims.decides("R7")
def verdict_r7(runs: Sequence[Dict[str, object]], tolerance: float = 0.01) -> claims.Verdict:
    """Claim R7 ("if validation accuracy drops, validate with autocast disabled") is conditional:
    decided only where its condition occurred, a half-precision run whose validation accuracy
    (evaluated under autocast) is more than ``tolerance`` below the fp32 run's. There it holds
    when evaluating with autocast disabled wins back more than ``tolerance`` on a dropped run.
    Where no run dropped: "not decided here", saying what would trigger it. ``runs``: digits
    runs, at least one fp32 and one fp16 or bf16, trained above chance."""
    half = [r for r in runs if r.get("precision") in HALF_DTYPES and r.get("accuracy") is not None]
    full = [r for r in runs if r.get("precision") == "fp32" and r.get("accuracy") is not None]
    if not half:
        raise ValueError("runs must hold at least one fp16 or bf16 run that ran")
    if not full:
        return claims.not_decided("R7", LESSON, f"{len(half)} half-precision run(s), no fp32 run",
                                  "no fp32 run to tell whether validation accuracy dropped")
    reference = max(r["accuracy"] for r in full)
    drops = [(reference - r["accuracy"], r) for r in half]
    worst_drop, worst = max(drops, key=lambda d: d[0])
    recovered = max((r["accuracy_fp32_eval"] - r["accuracy"] for r in half), key=abs)
    measured = (f"largest drop of autocast-evaluated accuracy below fp32's "
                f"{100 * reference:.1f}%: {100 * worst_drop:+.2f} points ({worst.get('label')}); "
                f"evaluating with autocast disabled changed accuracy by at most "
                f"{100 * recovered:+.2f} points over {plural(len(half), 'half-precision run')}")
    dropped = [r for d, r in drops if d > tolerance]
    numbers = {"largest_drop": worst_drop, "max_difference": recovered}
    gate = accuracy_reason(*half, *full)
    if not dropped:
        return claims.decide(
            "R7", LESSON, measured, None,
            f"the condition did not occur: no half-precision run's validation accuracy fell more "
            f"than {100 * tolerance:.0f} point below fp32's (largest drop "
            f"{100 * worst_drop:+.2f}). It would trigger on a run that evaluates more than "
            f"{100 * tolerance:.0f} point below fp32; then evaluating that run with autocast "
            f"disabled tells whether the loss is in evaluation or in training", numbers,
            cannot_decide=gate)
    gain = max(r["accuracy_fp32_eval"] - r["accuracy"] for r in dropped)
    held = gain > tolerance
    why = (f"{len(dropped)} run(s) dropped; evaluating with autocast disabled won back "
           f"{100 * gain:+.2f} points" + ("" if held else ": the drop is in training, not "
                                                         "evaluation"))
    return claims.decide("R7", LESSON, measured, held, why, dict(numbers, recovered=gain),
                         cannot_decide=gate)


@claims.decides("R5")
def verdict_r5(facts: Dict[str, object], multi_tensor: Dict[str, object],
               runs: Sequence[Dict[str, object]], tolerance: float = 0.01) -> claims.Verdict:
    """Claim R5 (raise Adam's eps "against fp16 division by zero", amsgrad "for stability",
    ``_multi_tensor.Adam`` as a mixed-precision wrapper).

    ``facts`` from ``adam_precision_facts``, ``multi_tensor`` from ``multi_tensor_status``,
    ``runs``: digits runs with Adam's default settings first, then the eps and amsgrad variants.
    Holds where Adam's state lives in half precision (so eps could meet fp16), a variant trains
    better than the default by more than ``tolerance``, or ``_multi_tensor.Adam`` is more than
    foreach Adam. Decided only on runs trained above chance.
    """
    if len(runs) < 2 or any(not isinstance(r, dict) for r in runs):
        raise ValueError("runs must hold the default Adam run and at least one variant")
    state_dtype = facts["exp_avg_sq_dtype"]
    half_state = state_dtype in ("torch.float16", "torch.bfloat16")
    plain = bool(not multi_tensor["exists"] or (multi_tensor["subclass_of_adam"]
                                                and multi_tensor["foreach"] is True))
    reason = accuracy_reason(*runs)
    gains = [r["accuracy"] - runs[0]["accuracy"] for r in runs[1:]] if reason is None else []
    best = max(gains) if gains else None
    mt = ("absent" if not multi_tensor["exists"] else
          "plain Adam with foreach=True" if plain else "something other than foreach Adam")
    measured = (f"Adam's state under autocast is {state_dtype}, params {facts['param_dtype']}; "
                f"torch.optim._multi_tensor.Adam: {mt}"
                + ("" if best is None else
                   f"; best variant vs default Adam: {100 * best:+.1f} accuracy points"))
    held = half_state or not plain or (best is not None and best > tolerance)
    why = ("" if held else
           f"eps is applied in fp32 ({state_dtype} state), the eps/amsgrad variants trained no "
           f"better, and _multi_tensor.Adam is {mt}: no mixed-precision wrapper")
    return claims.decide("R5", LESSON, measured, held, why or "the premise held on this torch",
                         {"state_dtype": state_dtype, "multi_tensor_plain": plain,
                          "best_variant_gain": best}, cannot_decide=reason)


@claims.decides("R12")
def verdict_r12(op_rows: Sequence[Dict[str, object]],
                api: Optional[Dict[str, object]] = None) -> claims.Verdict:
    """Claim R12 in its two parts: "attention is more precision-sensitive than convolutions"
    (from ``autocast_error_by_op`` rows: held when attention's worst error is over 1.5x the
    convolution's) and "may need a changed autocast op list" (from ``autocast_op_list_api``,
    ``api``: held only if torch.autocast takes an op list; otherwise there is nothing to change,
    and the way to keep an op in fp32 is a nested ``autocast(enabled=False)`` region). Decided
    only on a GPU, whose kernels the claim is about (a CPU's autocast runs other kernels with
    other accumulation)."""
    conv = [r["rel_error"] for r in op_rows if r["op"].startswith("conv")]
    attn = [r["rel_error"] for r in op_rows if r["op"].startswith("attention")]
    if not conv or not attn:
        raise ValueError("op_rows must hold convolution and attention rows")
    api = api or autocast_op_list_api()
    worst = max(attn) / max(conv) if max(conv) > 0 else float("inf")
    device = {r.get("device", "cpu") for r in op_rows}
    reason = None if device == {"cuda"} else (
        f"measured on {', '.join(sorted(device))}: the claim is about GPU kernels, whose "
        f"accumulation differs from a CPU's")
    grows = len(attn) > 1 and attn[-1] > attn[0]
    measured = (f"attention's relative error is up to {worst:.1f}x the convolution's"
                + (" and grows with sharper softmax logits" if grows else "")
                + f"; torch.autocast takes {', '.join(api['parameters'])}")
    listy = api["op_list_parameters"]
    parts = [claims.Part("attention is more precision-sensitive than convolutions", worst > 1.5,
                         f"ratio {worst:.1f} {'>' if worst > 1.5 else '<='} 1.5"),
             claims.Part("may need a changed autocast op list", bool(listy),
                         f"autocast takes an op list ({', '.join(listy)})" if listy else
                         "torch.autocast has no op list to change (no such parameter, no public "
                         "API); keep an op in fp32 with a nested torch.autocast(enabled=False) "
                         "region and .float() inputs, as R4's model does")]
    return claims.decide("R12", LESSON, measured, None, "", {"ratio": worst}, parts=parts,
                         cannot_decide=reason)


# --- the fastest step: a measurement beside a published figure, not a claim ----------------------

PUBLISHED_FASTEST = {"img_per_s": 7950.0, "batch_size": 256,
                     "source": "MLPerf Training v4.0, ResNet-50 on H200 with fused MXNet; MLPerf "
                               "publishes time to train, this per-GPU throughput is derived from "
                               "it, the best such figure published"}


def trained(row) -> bool:
    """A measured row (status ok, img/s > 0) whose loss stayed finite."""
    return (isinstance(row, dict) and row.get("status") == "ok"
            and isinstance(row.get("img_per_s"), (int, float)) and row["img_per_s"] > 0
            and isinstance(row.get("loss"), (int, float)) and math.isfinite(row["loss"]))


def fastest_row(rows: Sequence[Dict[str, object]]) -> Optional[Dict[str, object]]:
    """The row with the most img/s among those that trained (``trained``), or None.

    A configuration whose loss went non-finite is fast at nothing useful, so it cannot win."""
    ok = [r for r in rows if trained(r)]
    return max(ok, key=lambda r: r["img_per_s"]) if ok else None


def fastest_against_published(row: Dict[str, object], fp32: Dict[str, object]) -> Dict[str, object]:
    """The fastest measured step against fp32 (same run) and ``PUBLISHED_FASTEST``.

    The share of the published figure is given only where the timing could decide anything
    (``claims.rows_timing_gate``): a CPU at tiny sizes is not compared with a GPU's figure, and ``text``
    says why.
    """
    for name, r in (("row", row), ("fp32", fp32)):
        if not trained(r):
            raise ValueError(f"{name} must be a measured row (status ok, img_per_s > 0, finite "
                             f"loss); got {r!r}"[:300])
    reason = claims.rows_timing_gate(row, fp32)
    ref = PUBLISHED_FASTEST["img_per_s"]
    share = None if reason else row["img_per_s"] / ref
    text = (f"fastest here: {row['label']} at {row['img_per_s']:,.0f} img/s "
            f"({row['img_per_s'] / fp32['img_per_s']:.2f}x fp32 with TF32 off, batch "
            f"{(row.get('config') or {}).get('batch_size', '?')}); ")
    text += (f"not compared with the published {ref:,.0f} img/s: {reason}" if reason else
             f"{share:.0%} of the published {ref:,.0f} img/s ({PUBLISHED_FASTEST['source']})")
    return {"img_per_s": row["img_per_s"], "share_of_published": share,
            "beats_published": None if share is None else share > 1, "comparable": not reason,
            "text": text}


#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)
