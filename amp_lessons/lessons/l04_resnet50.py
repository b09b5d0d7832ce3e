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
from amp_lessons.validate import check_choice, check_int
from amp_lessons.measure import (COMPILE_MODES, PRECISION_NAMES, STANDARD, BenchConfig, find_row,
                                 ratio)
from amp_lessons.measure.adam_eps import half_adam_step  # noqa: F401 (the lesson's API)
from amp_lessons.measure.captions import LAYOUT_COLUMNS, layout_effects, rows_caption  # noqa: F401
from amp_lessons.measure.resnet_digits import (ACCURACY_COLUMNS, RESNET_DIGITS_MODELS,  # noqa: F401
                                               digits_accuracy)
from amp_lessons.measure.optim import (adam_precision_facts, multi_tensor_status,  # noqa: F401 (the lesson's API)
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


# --- accuracy on real data (claims R4, R5, R7 and the parity table) -----------------------------

# --- claim R12: how sensitive is each op to half precision? -------------------------------------

# --- when can this run decide? ------------------------------------------------------------------

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


def _numbers(numbers: Dict[str, object]) -> Dict[str, object]:
    return {k: v for k, v in numbers.items() if v is not None}


def _gate(default, fp16) -> Optional[str]:
    reason = claims.rows_timing_gate(default, fp16)
    if reason is None and _saving(fp16, default) is None:
        reason = "peak memory was not measured on this device"
    return reason


def _b1_parts(default, fp16) -> List[claims.Part]:
    speedup = ratio(fp16.get("img_per_s"), default.get("img_per_s"))
    return [claims.at_least("saves about 50% of memory", _saving(fp16, default), 40),
            claims.at_least("trains 1.5 to 2x faster", speedup, 1.5, "x", 2,
                            f" against {default.get('label')}")]


def _b2_parts(default, fp16) -> List[claims.Part]:
    a, b = default.get("step_ms"), fp16.get("step_ms")
    shorter = 100 * (1 - b / a) if a and b is not None else None
    return [claims.at_least("over 40% less memory", _saving(fp16, default), 40,
                            note=" (article: 43%)"),
            claims.at_least("about 39% less time", shorter, 30, note=" (article: 40%)")]


def _pair_rows(make_parts, pairs) -> List[claims.Alternative]:
    """A B1/B2 sensitivity row per ``(setting, baseline row, fp16 row)`` that ran."""
    return [claims.alternative(f"{setting} ({fp16.get('label')} vs {base.get('label')})",
                               parts=make_parts(base, fp16), cannot_decide=_gate(base, fp16))
            for setting, base, fp16 in pairs if base is not None and fp16 is not None]


@claims.decides("B1")
def verdict_b1(default: Dict[str, object], fp16: Dict[str, object],
               tf32_off: Optional[Dict[str, object]] = None,
               fp16_channels_last: Optional[Dict[str, object]] = None,
               default_channels_last: Optional[Dict[str, object]] = None) -> claims.Verdict:
    """Claim B1 (fp16 saves about 50% of memory and trains 1.5-2x faster on tensor cores) from
    rows of the same run, against what a learner gets by default: ``default`` is fp32 with TF32
    convolutions (PyTorch's default for cuDNN; ``default_row``), ``fp16`` the fp16 + GradScaler
    row in the same memory format (NCHW). Two parts: memory saved at least 40%, and a speed-up
    of at least 1.5x (above 2x the claim understated it). Sensitivity rows, decided by the same
    rule: channels_last on both sides (``default_channels_last``, ``fp16_channels_last``) and
    fp32 with TF32 off (``tf32_off``). Decided only on a busy GPU."""
    _check_pair(default, fp16)
    reason = _gate(default, fp16)
    speedup = ratio(fp16.get("img_per_s"), default.get("img_per_s"))
    saving = _saving(fp16, default)
    measured = (f"{fp16.get('label')} vs {default.get('label')} (PyTorch's default here): "
                f"{'n/a' if speedup is None else f'{speedup:.2f}x'} the speed, memory saved "
                f"{_pct(saving)} ({_idle_text(default, fp16)})")
    alts = _pair_rows(_b1_parts, [("with channels_last on both sides", default_channels_last,
                                   fp16_channels_last), ("against fp32 with TF32 off", tf32_off,
                                                         fp16)])
    return claims.decide("B1", LESSON, measured, None, "" if reason is None else "-",
                         parts=_b1_parts(default, fp16) if reason is None else (),
                         numbers=_numbers({"speedup": speedup, "memory_saving_pct": saving}),
                         cannot_decide=reason, sensitivity=alts,
                         condition=f"on NCHW against {default.get('label')}",
                         understated=(f"{speedup:.2f}x is faster than the claimed 1.5-2x"
                                      if speedup is not None and speedup > 2 else None))


@claims.decides("B2")
def verdict_b2(default: Dict[str, object], fp16: Dict[str, object],
               tf32_off: Optional[Dict[str, object]] = None,
               fp16_channels_last: Optional[Dict[str, object]] = None,
               default_channels_last: Optional[Dict[str, object]] = None) -> claims.Verdict:
    """Claim B2 (article B's ``train.py`` on an RTX 3090: AMP over 40% less memory and about 39%
    less time than fp32) on a stand-in, named as one: ResNet-50 on this GPU (the article's own
    code trains a ``Linear(784, 10)``, which cannot fill 10 GB). Against the default fp32 (TF32
    convolutions), same run and memory format: two parts, memory saved at least 40% and step
    time at least 30% shorter. Sensitivity rows as B1's. Decided only on a busy GPU."""
    _check_pair(default, fp16)
    reason = _gate(default, fp16)
    saving = _saving(fp16, default)
    a, b = default.get("step_ms"), fp16.get("step_ms")
    shorter = 100 * (1 - b / a) if a and b is not None else None
    change = ("n/a" if shorter is None else f"{shorter:.0f}% shorter" if shorter >= 0 else
              f"{-shorter:.0f}% longer")
    measured = (f"{fp16.get('label')} step {_ms(b)} vs {_ms(a)} with {default.get('label')} "
                f"(PyTorch's default) ({change}), memory saved {_pct(saving)} "
                f"({_idle_text(default, fp16)})")
    alts = _pair_rows(_b2_parts, [("with channels_last on both sides", default_channels_last,
                                   fp16_channels_last), ("against fp32 with TF32 off", tf32_off,
                                                         fp16)])
    batch = (fp16.get("config") or {}).get("batch_size", "?")
    return claims.decide("B2", LESSON, measured, None, "" if reason is None else "-",
                         parts=_b2_parts(default, fp16) if reason is None else (),
                         numbers=_numbers({"memory_saving_pct": saving,
                                           "step_time_shorter_pct": shorter}),
                         cannot_decide=reason, sensitivity=alts,
                         condition=f"on NCHW against {default.get('label')}",
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


def _r6_parts(r6_rows: Sequence[Dict[str, object]]) -> List[claims.Part]:
    """R6's measurable parts on ``compare_r6`` rows, each one-sided, and its untested top-1."""
    fp32, amp, opt = r6_rows
    parts = []
    for r in (amp, opt):
        name = r["configuration"]
        saving, speedup = round(r["claimed_saving_pct"], 1), round(r["claimed_speedup"], 2)
        parts += [claims.at_least(f"{name} saves {saving:g}%", r["measured_saving_pct"], saving),
                  claims.at_least(f"{name} +{100 * (r['claimed_speedup'] - 1):.0f}% img/s",
                                  r["measured_speedup"], speedup, "x", 2,
                                  f" against {fp32['measured_label']}")]
    smaller = opt["measured_gib"] is None or amp["measured_gib"] is None \
        or opt["measured_gib"] <= amp["measured_gib"]
    parts.append(claims.Part(
        "optimized beats native AMP", bool(opt["measured_img_per_s"] >= amp["measured_img_per_s"]
                                           and smaller),
        f"{opt['measured_img_per_s']:,.0f} vs {amp['measured_img_per_s']:,.0f} img/s, "
        f"{opt['measured_gib']} vs {amp['measured_gib']} GiB"))
    parts.append(claims.Part("untested: top-1 on ImageNet (76.3%, 76.1%, 76.2%)", None,
                             "the course trains no ImageNet run, and the digits runs cannot show "
                             "a 0.1-0.2 point difference"))
    return parts


def _r6_gate(r6_rows) -> Optional[str]:
    as_rows = [{"label": r["measured_label"], "status": r["status"], "img_per_s":
                r["measured_img_per_s"], "timer": r["timer"], "steps": r["steps"],
                "warmup": r["warmup"], "gpu_idle_fraction": r["gpu_idle_fraction"]}
               for r in r6_rows]
    reason = claims.rows_timing_gate(*as_rows)
    if reason is None and any(r["measured_saving_pct"] is None for r in r6_rows[1:]):
        reason = "peak memory was not measured on this device"
    return reason


@claims.decides("R6")
def verdict_r6(r6_rows: Sequence[Dict[str, object]],
               tf32_off_rows: Optional[Sequence[Dict[str, object]]] = None) -> claims.Verdict:
    """Claim R6 from ``compare_r6``'s rows (fp32 as a learner gets it by default, TF32
    convolutions; plain AMP; "optimized" built as article R describes it, ``OPTIMIZED_LABEL``),
    part by part (``_r6_parts``): plain AMP and "optimized" each save at least the claimed
    memory and reach the claimed speed-up against fp32 (one-sided), "optimized" beats plain AMP
    (faster, no bigger), and top-1 on ImageNet is untested. Sensitivity row: ``tf32_off_rows``,
    ``compare_r6`` against fp32 with TF32 off. Decided only on a busy GPU."""
    for rows in (r6_rows, tf32_off_rows or [None] * 3):
        if len(rows) != 3:
            raise ValueError(f"r6_rows must be compare_r6's 3 rows; got {len(rows)}")
    fp32, amp, opt = r6_rows
    measured = "; ".join(
        f"{r['configuration']}: {r['measured_speedup']:.2f}x (claimed {r['claimed_speedup']:.2f}x), "
        f"memory saved {_pct(r['measured_saving_pct'])} (claimed {r['claimed_saving_pct']:.0f}%)"
        for r in (amp, opt)) + f" against {fp32['measured_label']}"
    alts = [] if tf32_off_rows is None else [claims.alternative(
        f"against {tf32_off_rows[0]['measured_label']}", parts=_r6_parts(tf32_off_rows),
        cannot_decide=_r6_gate(tf32_off_rows))]
    reason = _r6_gate(r6_rows)
    return claims.decide("R6", LESSON, measured, None, "" if reason is None else "-",
                         parts=_r6_parts(r6_rows) if reason is None else (),
                         numbers={"amp_speedup": amp["measured_speedup"],
                                  "optimized_speedup": opt["measured_speedup"],
                                  "amp_saving_pct": amp["measured_saving_pct"],
                                  "optimized_saving_pct": opt["measured_saving_pct"]},
                         cannot_decide=reason, sensitivity=alts,
                         condition=f"against {fp32['measured_label']}")


R6_COLUMNS = (("configuration", "R6 row"), ("measured_label", "measured as"),
              ("claimed_gib", "claimed GB"), ("measured_gib", "measured GiB"),
              ("claimed_saving_pct", "claimed saved %"), ("measured_saving_pct", "saved %"),
              ("claimed_img_per_s", "claimed img/s"), ("measured_img_per_s", "img/s"),
              ("claimed_speedup", "claimed x"), ("measured_speedup", "x"),
              ("gpu_idle_fraction", "GPU idle", lambda v: percent(v, 1.0)),
              ("spread", "repeat spread", spread_text))


# --- claims R4, R5, R7 (accuracy) and R12 (op error) --------------------------------------------

def _runs(runs, name: str) -> List[Dict[str, object]]:
    """Digits runs as a list (one run, or one per seed), each with an accuracy."""
    runs = [runs] if isinstance(runs, dict) else list(runs or ())
    if not runs or any(not isinstance(r, dict) or r.get("accuracy") is None for r in runs):
        raise ValueError(f"{name} must hold digits runs with an accuracy (status ok); got "
                         f"{[(r or {}).get('status') for r in runs] if runs else runs!r}")
    return runs


def accuracy_part(says: str, base, variant, min_gain: float = 0.01) -> claims.Part:
    """``claims.accuracy_effect`` on digits runs (one per seed): ``variant`` gains more than
    ``min_gain`` over ``base``, decided only with enough seeds below the task's ceiling."""
    base, variant = _runs(base, "base"), _runs(variant, "variant")
    return claims.accuracy_effect(says, [r["accuracy"] for r in base],
                                  [r["accuracy"] for r in variant], min_gain,
                                  int(min(r.get("test_examples") or 1 for r in base + variant)),
                                  int(base[0].get("classes", 10)))


@claims.decides("R4")
def verdict_r4(amp: Dict[str, object], selective: Dict[str, object], amp_run, selective_run,
               tolerance: float = 0.01, bf16_run=None) -> claims.Verdict:
    """Claim R4 (layer3/4 + fc in fp32 "to avoid vanishing gradients" and "guarantee
    classification accuracy"): the accuracy of the selective-autocast model (``selective_run``:
    a digits run, or one per seed) against plain AMP (``amp_run``), decided by
    ``accuracy_part`` (a gain of more than ``tolerance``, at least 3 seeds, below the task's
    ceiling, against the seed spread); the vanishing-gradient part is untested. What the fp32
    layers cost in speed and memory (table rows ``amp``, ``selective``) is shown. Sensitivity
    row: ``bf16_run``, plain bf16 autocast as the baseline."""
    for name, row in (("amp", amp), ("selective", selective)):
        if not isinstance(row, dict) or row.get("img_per_s") is None:
            raise ValueError(f"{name} must hold a measurement (img_per_s); got status "
                             f"{(row or {}).get('status')!r}")
    amp_runs, sel_runs = _runs(amp_run, "amp_run"), _runs(selective_run, "selective_run")
    speed = selective["img_per_s"] / amp["img_per_s"]
    mem = ratio(selective.get("peak_allocated_gib"), amp.get("peak_allocated_gib"))
    acts = ratio(selective.get("activations_gib"), amp.get("activations_gib"))
    mean = lambda runs: sum(r["accuracy"] for r in runs) / len(runs)  # noqa: E731
    gain = mean(sel_runs) - mean(amp_runs)
    cost_reason = claims.rows_timing_gate(amp, selective)
    measured = (f"accuracy {100 * mean(sel_runs):.1f}% vs {100 * mean(amp_runs):.1f}% with plain "
                f"AMP ({plural(len(sel_runs), 'seed')}); cost: speed x{speed:.2f}"
                + (f", peak memory x{mem:.2f}" if mem is not None else "")
                + (f", saved activations x{acts:.2f}" if acts is not None else "")
                + (f" (speed not comparable: {cost_reason})" if cost_reason else ""))
    says = "guarantee classification accuracy"
    parts = [accuracy_part(says, amp_runs, sel_runs, tolerance),
             claims.Part("untested: to avoid vanishing gradients", None,
                         "the course does not count vanished gradients per layer of this "
                         "model (lesson 03's histograms set a CNN's gradients against fp16's "
                         "range)")]
    alts = [] if bf16_run is None else [claims.alternative(
        "against plain bf16 autocast", parts=[accuracy_part(says, bf16_run, sel_runs, tolerance)])]
    return claims.decide("R4", LESSON, measured, None, "", parts=parts, sensitivity=alts,
                         numbers={"speed_ratio": speed, "memory_ratio": mem,
                                  "activations_ratio": acts, "accuracy_gain": gain},
                         condition="against plain fp16 autocast")


def _r7_rule(half: Sequence[Dict[str, object]], full: Sequence[Dict[str, object]],
             tolerance: float):
    """R7 on these runs: ``(held, why, numbers)``; held None where no run dropped."""
    reference = max(r["accuracy"] for r in full)
    drops = [(reference - r["accuracy"], r) for r in half]
    worst_drop, worst = max(drops, key=lambda d: d[0])
    dropped = [r for d, r in drops if d > tolerance]
    numbers = {"largest_drop": worst_drop, "reference": reference, "worst": worst.get("label")}
    if not dropped:
        return None, (f"the condition did not occur: no half-precision run's validation accuracy "
                      f"fell more than {100 * tolerance:.0f} point below fp32's (largest drop "
                      f"{100 * worst_drop:+.2f})"), numbers
    gain = max(r["accuracy_fp32_eval"] - r["accuracy"] for r in dropped)
    return gain > tolerance, (f"{len(dropped)} run(s) dropped; evaluating with autocast disabled "
                              f"won back {100 * gain:+.2f} points"
                              + ("" if gain > tolerance else ": the drop is in training, not "
                                                             "evaluation")), dict(numbers,
                                                                                 recovered=gain)


@claims.decides("R7")
def verdict_r7(runs: Sequence[Dict[str, object]], tolerance: float = 0.01) -> claims.Verdict:
    """Claim R7 ("if validation accuracy drops, validate with autocast disabled") is conditional:
    decided only where its condition occurred on its own, a half-precision run whose validation
    accuracy (evaluated under autocast) is more than ``tolerance`` below the fp32 run's. There it
    holds when evaluating with autocast disabled wins back more than ``tolerance`` on a dropped
    run. Where no run dropped: "not decided here", saying what would trigger it. ``runs``:
    digits runs, at least one fp32 and one fp16 or bf16, trained above chance. Sensitivity rows:
    the fp16 runs alone and the bf16 runs alone."""
    half = [r for r in runs if r.get("precision") in HALF_DTYPES and r.get("accuracy") is not None]
    full = [r for r in runs if r.get("precision") == "fp32" and r.get("accuracy") is not None]
    if not half:
        raise ValueError("runs must hold at least one fp16 or bf16 run that ran")
    if not full:
        return claims.not_decided("R7", LESSON, f"{len(half)} half-precision run(s), no fp32 run",
                                  "no fp32 run to tell whether validation accuracy dropped")
    held, why, numbers = _r7_rule(half, full, tolerance)
    recovered = max((r["accuracy_fp32_eval"] - r["accuracy"] for r in half), key=abs)
    measured = (f"largest drop of autocast-evaluated accuracy below fp32's "
                f"{100 * numbers['reference']:.1f}%: {100 * numbers['largest_drop']:+.2f} points "
                f"({numbers['worst']}); evaluating with autocast disabled changed accuracy by at "
                f"most {100 * recovered:+.2f} points over "
                f"{plural(len(half), 'half-precision run')}")
    alts = []
    for p in HALF_DTYPES:
        mine = [r for r in half if r["precision"] == p]
        if mine:
            h, w, _ = _r7_rule(mine, full, tolerance)
            alts.append(claims.alternative(f"with {p} alone ({plural(len(mine), 'run')})",
                                           held=h, why=w))
    if held is None:
        why += (f". It would trigger on a run that evaluates more than {100 * tolerance:.0f} "
                f"point below fp32; then evaluating that run with autocast disabled tells "
                f"whether the loss is in evaluation or in training")
    return claims.decide("R7", LESSON, measured, held, why,
                         dict(numbers, max_difference=recovered, worst=None),
                         cannot_decide=accuracy_reason(*half, *full), sensitivity=alts,
                         condition="over every half-precision run")


def _eps_part(facts: Dict[str, object], half_steps: Optional[Sequence[Dict]] = None) -> claims.Part:
    """R5's eps part: under autocast from ``adam_precision_facts`` (where Adam's state lives);
    with ``half_steps`` (``half_adam_step`` at eps 1e-8 and 1e-7), on float16 weights."""
    says = "raise eps to 1e-7 to prevent FP16 division by zero"
    if half_steps:
        low, high = sorted(half_steps, key=lambda r: r["eps"])
        held = not low["finite"] and high["finite"]
        return claims.Part(says, held, (
            f"Adam's state is {low['state_dtype']}; eps {low['eps']:g} is {low['eps_in_fp16']:g} "
            f"in float16 and the step wrote {low['nonfinite']} non-finite weight(s); eps "
            f"{high['eps']:g} ({high['eps_in_fp16']:.3g} in float16) kept every weight finite"
            + (f", though a weight moved {high['largest_change']:.3g} for lr {high['lr']:g} "
               f"(the second moment underflows float16 too)" if high["finite"] else "")))
    state = facts["exp_avg_sq_dtype"]
    half = state in ("torch.float16", "torch.bfloat16")
    return claims.Part(says, True if half else False, (
        f"under autocast Adam's state is {state} (parameters {facts['param_dtype']}): eps "
        + ("meets 16 bits" if half else "is added in float32, where 1e-8 is not 0, so it "
                                        "never meets FP16")))


@claims.decides("R5")
def verdict_r5(facts: Dict[str, object], multi_tensor: Dict[str, object],
               runs: Sequence[Dict[str, object]], tolerance: float = 0.01,
               half_steps: Optional[Sequence[Dict[str, object]]] = None) -> claims.Verdict:
    """Claim R5 (raise Adam's eps "against fp16 division by zero", amsgrad "for stability",
    ``_multi_tensor.Adam`` as a mixed-precision wrapper), in three parts: eps (``_eps_part``,
    from ``adam_precision_facts``), amsgrad (``accuracy_part``: the amsgrad run against the
    default Adam run, decided only where a difference can show), and ``_multi_tensor.Adam``
    (``multi_tensor_status``: held if it is more than foreach Adam). ``runs``: digits runs with
    Adam's defaults first, then the eps and amsgrad variants (one per seed each). Sensitivity
    row: ``half_steps`` (``half_adam_step`` at eps 1e-8 and 1e-7), pure float16 weights."""
    if len(runs) < 2 or any(not isinstance(r, dict) for r in runs):
        raise ValueError("runs must hold the default Adam run and at least one variant")
    plain = bool(not multi_tensor["exists"] or (multi_tensor["subclass_of_adam"]
                                                and multi_tensor["foreach"] is True))
    mt = ("absent" if not multi_tensor["exists"] else
          "plain Adam with foreach=True" if plain else "something other than foreach Adam")
    default = [r for r in runs if not r.get("amsgrad") and r.get("eps") == runs[0].get("eps")]
    amsgrad = [r for r in runs if r.get("amsgrad")]
    parts = [_eps_part(facts),
             accuracy_part("enable amsgrad for stability", default, amsgrad, tolerance)
             if amsgrad else claims.Part("enable amsgrad for stability", None,
                                         "not decided: no amsgrad run"),
             claims.Part("_multi_tensor.Adam as the mixed-precision wrapper", not plain,
                         f"torch.optim._multi_tensor.Adam is {mt}: no mixed-precision wrapper"
                         if plain else f"torch.optim._multi_tensor.Adam is {mt}")]
    measured = (f"Adam's state under autocast is {facts['exp_avg_sq_dtype']}, params "
                f"{facts['param_dtype']}; torch.optim._multi_tensor.Adam: {mt}; accuracy "
                + ", ".join(f"{r.get('label')} {100 * r['accuracy']:.1f}%" for r in runs
                            if r.get("accuracy") is not None))
    alts = [] if not half_steps else [claims.alternative(
        "with pure fp16 weights (model.half()), where Adam's state is fp16 too",
        parts=[_eps_part(facts, half_steps)])]
    return claims.decide("R5", LESSON, measured, None, "", parts=parts, sensitivity=alts,
                         numbers={"state_dtype": facts["exp_avg_sq_dtype"],
                                  "multi_tensor_plain": plain},
                         condition="under autocast (fp32 weights and Adam state)")


#: Why R12's threshold is 1.5: about half a bit of fp16's 11-bit precision (sqrt(2) = 1.41,
#: rounded up); a smaller ratio is a fraction of one rounding step.
R12_RATIO = 1.5


def _r12_part(ratio_: float, scale: float) -> claims.Part:
    return claims.Part("attention is more precision-sensitive than convolutions",
                       bool(ratio_ > R12_RATIO),
                       f"at {scale:g}x the standard 1/sqrt(d) logit scale, attention's error is "
                       f"{ratio_:.2f}x the convolution's ({'>' if ratio_ > R12_RATIO else '<='} "
                       f"{R12_RATIO:g}, about half a bit of fp16's precision)")


@claims.decides("R12")
def verdict_r12(op_rows: Sequence[Dict[str, object]],
                api: Optional[Dict[str, object]] = None) -> claims.Verdict:
    """Claim R12 in its two parts: "attention is more precision-sensitive than convolutions"
    (from ``autocast_error_by_op`` rows: held when attention's error at the standard
    1/sqrt(d) logit scale is over ``R12_RATIO`` times the convolution's) and "may need a
    changed autocast op list" (from ``autocast_op_list_api``, ``api``: held only if
    torch.autocast takes an op list; ``torch.library.register_autocast`` gives custom ops a
    cast rule, not built-in ones such as attention, whose way to stay in fp32 is a nested
    ``autocast(enabled=False)`` region). Sensitivity rows: the sharper logit scales measured.
    Decided only on a GPU, whose kernels the claim is about."""
    conv = [r["rel_error"] for r in op_rows if r["op"].startswith("conv")]
    attn = {float(r.get("logit_scale") or 1.0): r["rel_error"] for r in op_rows
            if r["op"].startswith("attention")}
    if not conv or not attn:
        raise ValueError("op_rows must hold convolution and attention rows")
    api = api or autocast_op_list_api()
    ratios = {k: (v / max(conv) if max(conv) > 0 else float("inf")) for k, v in attn.items()}
    standard = min(ratios)  # the smallest logit scale measured: 1 is the standard scaling
    device = {r.get("device", "cpu") for r in op_rows}
    reason = None if device == {"cuda"} else (
        f"measured on {', '.join(sorted(device))}: the claim is about GPU kernels, whose "
        f"accumulation differs from a CPU's")
    listy = api["op_list_parameters"]
    custom = hasattr(torch.library, "register_autocast")
    measured = ("attention's relative error against the convolution's: "
                + ", ".join(f"{r:.2f}x at logit scale {k:g}" for k, r in sorted(ratios.items()))
                + f"; torch.autocast takes {', '.join(api['parameters'])}")
    parts = [_r12_part(ratios[standard], standard),
             claims.Part("may need a changed autocast op list", bool(listy),
                         f"autocast takes an op list ({', '.join(listy)})" if listy else
                         "torch.autocast has no op list to change for built-in ops such as "
                         "attention; "
                         + ("torch.library.register_autocast gives a custom op a cast rule; "
                            if custom else "") + "keep an op in fp32 with a nested "
                         "torch.autocast(enabled=False) region and .float() inputs, as R4's "
                         "model does")]
    alts = [claims.alternative(f"with sharper softmax logits ({k:g}x the standard scaling)",
                               parts=[_r12_part(r, k)]) for k, r in sorted(ratios.items())
            if k != standard]
    return claims.decide("R12", LESSON, measured, None, "", {"ratio": ratios[standard]},
                         parts=parts, cannot_decide=reason, sensitivity=alts,
                         condition=f"at the standard 1/sqrt(d) logit scale (x{standard:g})")


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
