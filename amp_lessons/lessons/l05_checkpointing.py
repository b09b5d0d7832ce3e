"""Lesson 05, checkpointing and accumulation: the checkpoint_sequential pitfall, checkpointing per
block and its cheaper variants, memory against time per technique and its Pareto frontier, the
largest batch per card, gradient accumulation and exact resume.

Decides claims R8 (checkpointing's cost), R9 (accumulation at the same memory) and R10a/R10b (what
to use on one small or large card). Timing and GPU-memory verdicts pass ``claims.timing_gate``: a
CPU run (the quick profile) reports them as "not decided here", with the reason.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from amp_lessons.publish import claims
from amp_lessons.validate import check_choice, check_int, is_int, is_real
from amp_lessons.env import allocatable_bytes
from amp_lessons.measure import (GIB, BenchConfig, ratio, run_configs,
                     settings_caption, standard_settings)
from amp_lessons.measure.accumulation import (accumulation_equivalence,  # noqa: F401 (lesson API)
                                  accumulation_memory)
from amp_lessons.measure.activation_checkpointing import (checkpoint_equivalence,  # noqa: F401 (the lesson's API)
                             checkpoint_sequential_pitfall)
from amp_lessons.measure.cards import largest_per_card
from amp_lessons.measure.counted import counted_memory_model, counted_step_memory  # noqa: F401
from amp_lessons.measure.resume import resume_experiment  # noqa: F401 (the lesson's API)
from amp_lessons.numerics.precision import as_device, native_tf32
from amp_lessons.tables import (format_value, largest_batch_report_rows,  # noqa: F401 (lesson API)
                      plural, shown_technique, technique_report_rows, technique_with_math)
from amp_lessons.lineage import traced  # explain names what made each row

LESSON = "05"

# --- the techniques ------------------------------------------------------------------------------
# fp32 runs with TF32 tensor-core math where the GPU has it (cuDNN's default for convolutions);
# its memory is the same as with TF32 off. "checkpoint" is a mode of models.resnet50(checkpoint=).

TECHNIQUES: Dict[str, Dict[str, object]] = {
    "fp32": {"precision": "tf32", "checkpoint": None},
    "fp32 + checkpointing": {"precision": "tf32", "checkpoint": "block"},
    "AMP": {"precision": "fp16", "checkpoint": None},
    "AMP + checkpointing": {"precision": "fp16", "checkpoint": "block"},
    "AMP + checkpointing per stage": {"precision": "fp16", "checkpoint": "stage"},
    "AMP + checkpointing layer1-2": {"precision": "fp16", "checkpoint": "stage1-2"},
    "AMP + checkpointing stem+layer1": {"precision": "fp16", "checkpoint": "stem+stage1"},
    "AMP + checkpointing stem+layer1-2": {"precision": "fp16", "checkpoint": "stem+stage1-2"},
    "AMP + selective checkpointing": {"precision": "fp16", "checkpoint": "sac"},
    "bf16": {"precision": "bf16", "checkpoint": None},
    "bf16 + checkpointing": {"precision": "bf16", "checkpoint": "block"},
    "bf16 + checkpointing stem+layer1": {"precision": "bf16", "checkpoint": "stem+stage1"},
    "bf16 + checkpointing stem+layer1-2": {"precision": "bf16", "checkpoint": "stem+stage1-2"},
    # the whole step captured in one CUDA graph (fused SGD, as GradScaler needs there): the
    # host work of checkpointing (its Python, per unit, in backward) is gone from replays
    "AMP + CUDA graph": {"precision": "fp16", "checkpoint": None, "cuda_graph": True},
    "AMP + checkpointing + CUDA graph": {"precision": "fp16", "checkpoint": "block",
                                         "cuda_graph": True},
    "AMP + checkpointing stem+layer1-2 + CUDA graph": {"precision": "fp16",
                                                       "checkpoint": "stem+stage1-2",
                                                       "cuda_graph": True},
}
"""Lesson 05's techniques: name -> precision, ``models.CHECKPOINT_MODES`` mode and, for some, a
CUDA graph of the whole step. "+ checkpointing" alone is per residual block (the classic recipe);
``models.CHECKPOINT_HELP`` says what each mode recomputes."""
CARD_TECHNIQUES = ("fp32", "AMP", "AMP + checkpointing stem+layer1-2", "AMP + checkpointing")
CARD_SIZES_GB = (8, 12, 16, 24, 40, 80)

R8_MEMORY_PCT, R8_TIME_PCT = (20.0, 30.0), (20.0, 40.0)  # "about 30%": 20-40% counts as held
# The pairs R8 can be decided on, in order of preference (see ``verdict_r8``).
R8_PAIRS = (("AMP", "AMP + checkpointing"),
            ("AMP + CUDA graph", "AMP + checkpointing + CUDA graph"),
            ("bf16", "bf16 + checkpointing"), ("fp32", "fp32 + checkpointing"))
R10A_SAVED_PCT, R10B_SAVED_PCT = (50.0, 60.0), (40.0, 50.0)


def _check_techniques(techniques: Sequence[str]) -> List[str]:
    techniques = list(techniques)
    if not techniques:
        raise ValueError(f"techniques must name at least one of {', '.join(TECHNIQUES)}")
    for t in techniques:
        check_choice("technique", t, tuple(TECHNIQUES))
    if len(set(techniques)) != len(techniques):
        raise ValueError(f"techniques must not repeat; got {techniques!r}")
    return techniques


def _settings(settings: Optional[Dict[str, object]], device: torch.device) -> Dict[str, object]:
    """The standard measurement settings (``measure.standard_settings``; the quick ones on a CPU)
    with the caller's overrides."""
    out = standard_settings(quick=device.type != "cuda")
    out.update(settings or {})
    return out


def technique_configs(techniques: Sequence[str] = tuple(TECHNIQUES), model: str = "resnet50",
                      batch_size: int = 64, image_size: int = 224, num_classes: int = 1000,
                      settings: Optional[Dict[str, object]] = None,
                      cudnn_benchmark: Optional[bool] = None, device=None) -> List[BenchConfig]:
    """One ``BenchConfig`` per technique of ``TECHNIQUES``, labelled with the technique's name.

    The fp32 techniques use TF32 tensor-core math where ``device`` has it and plain fp32 on a GPU
    that does not (a T4: capability 7.5), so they run on every GPU.

    Memory format, cuDNN autotuning and the optimizer come from ``settings`` (default:
    ``measure.STANDARD``, the settings of lesson 04; a CUDA-graph technique uses fused SGD, which
    GradScaler needs inside a graph); ``cudnn_benchmark`` overrides autotuning alone (the largest-batch search turns it off: every new batch size would be tuned again).
    """
    s = dict(standard_settings())
    s.update(settings or {})
    if cudnn_benchmark is not None:
        if not isinstance(cudnn_benchmark, bool):
            raise ValueError(f"cudnn_benchmark must be None, True or False; got {cudnn_benchmark!r}")
        s["cudnn_benchmark"] = cudnn_benchmark
    configs = []
    for t in _check_techniques(techniques):
        graph = bool(TECHNIQUES[t].get("cuda_graph"))
        precision = TECHNIQUES[t]["precision"]
        if precision == "tf32" and device is not None and as_device(device).type == "cuda" \
                and not native_tf32(device):
            precision = "fp32"
        configs.append(BenchConfig(
            label=t, model=model, precision=precision,
            checkpoint=TECHNIQUES[t]["checkpoint"], channels_last=bool(s["channels_last"]),
            batch_size=batch_size, image_size=image_size, num_classes=num_classes,
            optimizer=s["optimizer"], impl="fused" if graph else s["impl"], cuda_graph=graph,
            cudnn_benchmark=bool(s["cudnn_benchmark"])))
    return configs


# --- the checkpoint_sequential pitfall, and checkpointing done per block -------------------------

# --- memory counted tensor by tensor (CPUs have no peak-memory counter) -------------------------

# --- memory against time per technique (claim R8), and the frontier ------------------------------

def technique_table(techniques: Sequence[str] = tuple(TECHNIQUES), device=None,
                    model: str = "resnet50", batch_size: int = 64, image_size: int = 224,
                    num_classes: int = 1000,
                    settings: Optional[Dict[str, object]] = None) -> List[Dict[str, object]]:
    """Step time and memory of each technique at one batch size (``run_configs`` rows).

    ``settings`` are the measurement settings (``measure.standard_settings``: the full ones on a
    GPU, the quick ones on a CPU; the caption comes from ``settings_caption``). Adds
    ``technique``, ``device_type``, ``settings``, ``memory_gib``, ``state_gib`` (parameters,
    gradients and optimizer state) and ``memory_source``: the peak allocated memory on a GPU; on
    a CPU, ``counted_step_memory``'s model of the peak (``activations_gib`` there holds what is
    kept for backward). Rows that cannot run here say why (``status``, ``reason``).
    """
    device = as_device(device)
    s = _settings(settings, device)
    configs = technique_configs(techniques, model=model, batch_size=batch_size,
                                image_size=image_size, num_classes=num_classes, settings=s,
                                device=device)
    cuda = device.type == "cuda"
    rows = run_configs(configs, device, warmup=s["warmup"], steps=s["steps"], breakdown=cuda,
                       progress=False)
    for config, row in zip(configs, rows):
        row.update(technique=config.label, device_type=device.type, settings=dict(s),
                   memory_gib=None, state_gib=None, memory_source="")
        if row["status"] != "ok":
            continue
        if cuda:
            row["memory_gib"] = row["peak_allocated_gib"]
            row["state_gib"] = row["params_gib"] + row["grads_gib"] + row["optimizer_state_gib"]
            row["memory_source"] = "peak allocated (CUDA)"
        else:
            try:
                counted = counted_step_memory(config, device)
            except ValueError as exc:  # selective checkpointing cannot be counted
                row.update(status="skipped", reason=str(exc).split(" (one of")[0])
                continue
            row["memory_gib"] = counted["peak_bytes"] / GIB
            row["state_gib"] = counted["state_bytes"] / GIB
            row["activations_gib"] = (counted["kept_bytes"] + counted["recompute_bytes"]) / GIB
            row["memory_source"] = "counted (no peak counter on a CPU)"
    return rows


def technique_caption(rows: Sequence[Dict[str, object]]) -> str:
    """How ``technique_table`` measured, in words, for the table's title: memory format, cuDNN
    autotuning, optimizer, steps (``measure.settings_caption``), precision of fp32 and memory."""
    if not rows:
        raise ValueError("rows must hold at least one technique_table row")
    settings = rows[0].get("settings") or standard_settings()
    memory = next((r["memory_source"] for r in rows if r.get("memory_source")), "not measured")
    return (f"{settings_caption(settings)}; TF32 = fp32 storage with TF32 tensor-core math (lesson "
            f"04's \"fp32, TF32 on\"; fp32 where there is none); AMP = fp16 autocast + GradScaler; "
            f"memory: {memory}")


def _range_verdict(measured: float, low: float, high: float, what: str) -> str:
    if not is_real(measured):
        return f"{what} {measured}: not a finite number, so not set against the claimed range"
    if measured < low:
        return f"{what} {measured:.0f}%: less than the claimed {low:.0f}-{high:.0f}%"
    if measured > high:
        return f"{what} {measured:.0f}%: more than the claimed {low:.0f}-{high:.0f}%"
    return f"{what} {measured:.0f}%: within the claimed {low:.0f}-{high:.0f}%"


def _more(saved: Optional[float], claimed: Sequence[float]) -> Optional[str]:
    """By how much a saving beyond the claimed range undersold it (``claims.one_sided``)."""
    if not is_real(saved) or not math.isfinite(saved):
        return None
    return claims.one_sided(saved, *claimed, "%")[1]


def _by_technique(rows: Sequence[Dict[str, object]]) -> Dict[str, Dict[str, object]]:
    return {r.get("technique", r.get("label")): r for r in rows if r.get("status") == "ok"}


def checkpointing_costs(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per technique pair of ``R8_PAIRS`` (X, X + checkpointing per block) in ``technique_table``
    rows: memory saved and time added by checkpointing, in percent, against claim R8's ranges,
    and ``gpu_idle_fraction``, the larger idle share of the pair's two steps (None where not
    measured)."""
    ok = _by_technique(rows)
    out = []
    for base, ckpt_name in R8_PAIRS:
        plain, ckpt = ok.get(base), ok.get(ckpt_name)
        if plain is None or ckpt is None or not plain.get("memory_gib"):
            continue
        saved = 100 * (1 - ckpt["memory_gib"] / plain["memory_gib"])
        times = (plain.get("step_ms"), ckpt.get("step_ms"))
        # a missing, zero or NaN step time gives NaN: claims.decide then rules nothing
        added = (100 * (times[1] / times[0] - 1) if all(is_real(t) and t > 0 for t in times)
                 else math.nan)
        idle = [r.get("gpu_idle_fraction") for r in (plain, ckpt)]
        fp32 = ok.get("fp32")
        points = (100 * (plain["memory_gib"] - ckpt["memory_gib"]) / fp32["memory_gib"]
                  if fp32 and fp32.get("memory_gib") else math.nan)
        out.append({"pair": f"{base} -> {ckpt_name}", "points_of_fp32": points,
                    "gpu_idle_fraction": max((v for v in idle if v is not None), default=None),
                    "memory_gib": plain["memory_gib"],
                    "memory_gib_checkpointed": ckpt["memory_gib"],
                    "memory_saved_pct": saved, "time_added_pct": added,
                    "memory_verdict": _range_verdict(saved, *R8_MEMORY_PCT, "memory saved"),
                    "time_verdict": _range_verdict(added, *R8_TIME_PCT, "time added")})
    return out


def _r8_rule(c: Dict[str, object], by_name: Mapping[str, Dict[str, object]]):
    """R8's rule on one ``checkpointing_costs`` pair: ``(held, why, understated, reason,
    measured)``; ``reason`` says why this pair cannot decide (None when it can)."""
    pair_rows = [by_name[name] for name in c["pair"].split(" -> ")]
    points, added = c["points_of_fp32"], c["time_added_pct"]
    pair = " -> ".join(shown_technique(r) for r in pair_rows)  # as the tables name them
    measured = (f"{pair}: {c['memory_gib']:.3g} -> {c['memory_gib_checkpointed']:.3g} GiB "
                f"({c['memory_saved_pct']:.0f}% of its memory, {points:.0f} points of the "
                f"{technique_with_math(by_name.get('fp32'))} row's), step time {added:+.0f}%")
    if c.get("gpu_idle_fraction") is not None:
        measured += f" (GPU idle at most {c['gpu_idle_fraction']:.0%} of a step)"
    reason = claims.rows_timing_gate(*pair_rows)
    if reason and any(r.get("device_type") == "cpu" for r in pair_rows):
        reason += "; memory on a CPU is counted, not a GPU's peak"
    if not (is_real(points) and is_real(added) and math.isfinite(points)
            and math.isfinite(added)):
        return None, "", None, reason or (
            f"a measured number is not finite (points_of_fp32={points!r}, time_added_pct="
            f"{added!r}): no fp32 row, or the run diverged or was not measured, so it cannot "
            f"rule"), measured
    mem_ok, mem_more = claims.one_sided(points, *R8_MEMORY_PCT, " points")
    time_ok, time_less = claims.one_sided(added, *R8_TIME_PCT, "%", larger_is_better=False)
    why = (f"memory saved {points:.0f} points of fp32's memory "
           f"({'>=' if mem_ok else '<'} {R8_MEMORY_PCT[0]:g}); time added {added:.0f}% "
           f"({'<=' if time_ok else '>'} {R8_TIME_PCT[1]:g}%)")
    understated = "; ".join(filter(None, (mem_more and f"memory: {mem_more}",
                                          time_less and f"time: {time_less}"))) or None
    return mem_ok and time_ok, why, understated, reason, measured


@claims.decides("R8")
def verdict_r8(rows: Sequence[Dict[str, object]]) -> claims.Verdict:
    """Claim R8 ("another 20-30% of memory for about 30% more compute time") against the first
    pair of ``R8_PAIRS`` in ``technique_table`` rows whose steps kept the GPU busy (GPU idle at
    most ``claims.MAX_IDLE_FRACTION``): AMP eager, else AMP in a CUDA graph (no launch overhead,
    so the step time is the recomputation's compute time the claim is about), else bf16 or fp32.
    One-sided, in points of fp32's memory: held when checkpointing saves at least 20 points of
    the fp32 row's memory and adds at most 40% step time; more than 30 points saved, or under 20%
    added, is "held, understated" (saying by how much). The other pairs are its sensitivity
    rows, each decided by the same rule and gate. A CPU run, too few timed steps, or only
    host-bound pairs cannot decide: the verdict says so."""
    costs = checkpointing_costs(rows)
    if not costs:
        return claims.not_decided("R8", LESSON, "no technique ran both with and without "
                                  "checkpointing", "nothing to compare")
    by_name = _by_technique(rows)
    ruled = [(c, _r8_rule(c, by_name)) for c in costs]
    c, (held, why, understated, reason, measured) = next(
        (x for x in ruled if x[1][3] is None), ruled[0])
    alts = [claims.alternative(f"with the {o['pair']} pair", held=r[0], why=r[1] or "-",
                               cannot_decide=r[3]) for o, r in ruled if o is not c]
    if held is None:
        return claims.not_decided("R8", LESSON, measured, reason,
                                  numbers={"points_of_fp32": c["points_of_fp32"],
                                           "time_added_pct": c["time_added_pct"]},
                                  sensitivity=alts)
    return claims.decide("R8", LESSON, measured, held, why,
                         numbers={"points_of_fp32": c["points_of_fp32"],
                                  "time_added_pct": c["time_added_pct"],
                                  "memory_saved_pct": c["memory_saved_pct"]},
                         cannot_decide=reason, understated=understated, sensitivity=alts,
                         condition=f"with the {c['pair']} pair")


def pareto_front(rows: Sequence[Dict[str, object]]) -> List[str]:
    """The techniques no other technique beats on both memory and step time (the frontier of
    memory against time), fastest first. ``technique_table`` rows; unmeasured rows left out."""
    ok = sorted(_by_technique(rows).items(), key=lambda kv: (kv[1]["step_ms"], kv[1]["memory_gib"]))
    front, best = [], math.inf
    for name, r in ok:
        if r.get("memory_gib") is not None and r["memory_gib"] < best:
            front.append(name)
            best = r["memory_gib"]
    return front


@traced
def frontier_rows(rows: Sequence[Dict[str, object]],
                  reference: str = "AMP", baseline: str = "fp32") -> List[Dict[str, object]]:
    """Every measured technique with its memory as a share of ``baseline``'s (fp32) and its step
    time against ``reference``'s (AMP), and whether it is on the frontier: the table beside the
    frontier chart."""
    ok = _by_technique(rows)
    front = set(pareto_front(rows))
    ref, base = ok.get(reference), ok.get(baseline)
    out = []
    for name, r in sorted(ok.items(), key=lambda kv: kv[1]["step_ms"]):
        out.append({"technique": shown_technique(r),
                    "checkpoint": TECHNIQUES.get(name, {}).get("checkpoint") or "-",
                    "img/s": r["img_per_s"], "memory GiB": r["memory_gib"],
                    "repeat spread %": 100 * r["spread"] if r.get("spread") is not None else None,
                    f"memory x {shown_technique(base) if base else baseline}":
                    ratio(r["memory_gib"], base["memory_gib"]) if base else None,
                    f"time x {reference}": ratio(r["step_ms"], ref["step_ms"]) if ref else None,
                    "on the frontier": "yes" if name in front else "no"})
    return out


@traced
def card_advice(rows: Sequence[Dict[str, object]], card_gib: float,
                batches: Sequence[int] = (128, 256, 384, 512, 768, 1024)) -> List[Dict[str, object]]:
    """For a card of ``card_gib`` GiB usable memory, the fastest measured technique that fits
    each batch size in ``batches``, predicted from ``technique_table`` rows: memory grows
    linearly with the batch from the fixed ``state_gib`` (weights, gradients, optimizer state),
    and time per image stays as measured. One row per batch: ``batch``, ``pick`` (None when
    nothing fits: accumulate micro-batches), ``predicted GiB``, ``predicted img/s`` and
    ``slower choices that fit``."""
    if not (is_real(card_gib) and card_gib > 0):
        raise ValueError(f"card_gib must be a number > 0 (GiB); got {card_gib!r}")
    batches = list(batches)
    if not batches or any(not is_int(b) or b < 1 for b in batches):
        raise ValueError(f"batches must hold whole numbers >= 1; got {batches!r}")
    batches = [int(b) for b in batches]
    ok = [(name, r) for name, r in _by_technique(rows).items()
          if r.get("state_gib") is not None and r.get("memory_gib") is not None]
    if not ok:
        raise ValueError("rows must hold at least one measured technique_table row")
    out = []
    for b in batches:
        fits = []
        for name, r in ok:
            measured_batch = r["config"]["batch_size"]
            memory = r["state_gib"] + (r["memory_gib"] - r["state_gib"]) * b / measured_batch
            if memory <= card_gib:
                fits.append((r["step_ms"] / measured_batch, shown_technique(r), memory))
        fits.sort()
        pick = fits[0] if fits else None
        out.append({"batch": b, "pick": pick[1] if pick else None,
                    "predicted GiB": pick[2] if pick else None,
                    "predicted img/s": 1e3 / pick[0] if pick else None,
                    "slower choices that fit": ", ".join(f[1] for f in fits[1:3]) or "-"})
    return out


# --- the largest batch per simulated card (claim R10) -------------------------------------------

def largest_batch_table(card_sizes_gb: Sequence[float] = CARD_SIZES_GB,
                        techniques: Sequence[str] = CARD_TECHNIQUES, device=None,
                        model: str = "resnet50", image_size: int = 224, num_classes: int = 1000,
                        settings: Optional[Dict[str, object]] = None, resolution_parts: int = 16,
                        max_batch: int = 8192) -> List[Dict[str, object]]:
    """The largest batch that trains per simulated card size and technique
    (``bench.cards.largest_per_card``).

    Memory format and optimizer come from ``settings`` (``bench.STANDARD``); cuDNN autotuning
    is off in the search (it tries many batch sizes, and each would be tuned again). On a GPU
    each card is simulated by capping this process's allocator at ``card`` GiB
    (``bench.memory_cap``); a card larger than the device is skipped with the reason. Peak memory
    is fitted against the batch from a few uncapped batches, and each card's prediction is
    verified under its cap, in units of ``resolution`` images (the largest power of two at most
    the prediction divided by ``resolution_parts``): a handful of trials of two steps each, so
    every card that fits on the device gets its cell.

    On a CPU there is no allocator to cap: the same search runs on ``counted_memory_model``
    (memory counted tensor by tensor at two batch sizes) instead, without running steps.
    One row per card and technique: ``largest_batch`` (images; None if skipped), ``predicted``,
    ``resolution``, ``peak_gib`` (of the largest trial that fit), ``trials``, ``seconds``,
    ``status`` ("ok" | "skipped"), ``reason`` and ``how`` (what enforced the cap).
    """
    techniques = _check_techniques(techniques)
    cards = list(card_sizes_gb)
    if not cards or any(not is_real(c) or c <= 0 for c in cards):
        raise ValueError(f"card_sizes_gb must hold numbers > 0 (GB); got {card_sizes_gb!r}")
    check_int("resolution_parts", resolution_parts, 1)
    check_int("max_batch", max_batch, 1)
    cards = sorted(cards)
    device = as_device(device)
    total_gib = allocatable_bytes(device) / GIB if device.type == "cuda" else None
    configs = technique_configs(techniques, model=model, batch_size=8, image_size=image_size,
                                num_classes=num_classes, settings=settings,
                                cudnn_benchmark=False, device=device)
    rows: List[Dict[str, object]] = []
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False  # no autotuning per new batch size
    try:
        for config in configs:
            rows += [dict(r, precision=config.precision, device_type=device.type) for r in
                     largest_per_card(config, cards, device, total_gib, resolution_parts, max_batch)]
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
    return rows


@traced
def accumulation_plan(rows: Sequence[Dict[str, object]], target_batch: int) -> Dict[str, object]:
    """How to reach an effective batch of ``target_batch`` on each card with each technique:
    the fewest micro-batches whose size fits (``largest_batch_table`` rows), as ``"n x m"``
    (n micro-batches of m images, n * m >= target_batch), or None where nothing was measured.
    Returns ``rows`` (one per card), ``columns`` and ``note``, like ``largest_batch_report_rows``."""
    check_int("target_batch", target_batch, 1)
    if not rows:
        raise ValueError("rows must hold at least one largest_batch_table row")
    techniques = list(dict.fromkeys(r["technique"] for r in rows))
    shown = {r["technique"]: shown_technique(r) for r in rows}  # TF32 where the math is TF32
    table = []
    for card in sorted({r["card_gb"] for r in rows}):
        line: Dict[str, object] = {"card (GB)": f"{card:g}"}
        for t in techniques:
            cell = next((r for r in rows if r["card_gb"] == card and r["technique"] == t), None)
            largest = cell["largest_batch"] if cell and cell["status"] == "ok" else None
            if not largest:
                line[shown[t]] = None
                continue
            n = math.ceil(target_batch / largest)
            line[shown[t]] = f"{n} x {math.ceil(target_batch / n)}"
        table.append(line)
    return {"rows": table, "columns": ["card (GB)"] + [shown[t] for t in techniques],
            "note": f"n x m: n micro-batches of m images per optimizer step (accumulate=n), the "
                    f"fewest that reach {plural(target_batch, 'image')} with micro-batches that fit."}


@claims.decides("R10a", "R10b")
def verdict_r10(card_rows: Sequence[Dict[str, object]],
              technique_rows: Sequence[Dict[str, object]],
              small_card_gb: float = 12.0, devices: Optional[int] = None) -> List[claims.Verdict]:
    """Claim R10's recommendations (R10a-R10d) beside what was measured, as ``claims.Verdict``s.

    R10a (a card under ``small_card_gb``: AMP + checkpointing, 50-60% saved) holds when AMP with
    per-block checkpointing fits the largest batch on every such card and saves at least 50%
    of fp32's memory at the same batch; R10b (a larger card: AMP + accumulation, 40-50% saved)
    holds when AMP saves at least 40% and trains faster than AMP + checkpointing (so
    accumulating micro-batches is the faster way to a batch that does not fit; that speed
    comparison passes the busy-GPU gate). Both are one-sided: a saving above the claimed range
    is "held, understated". Both need GPU
    memory: on a CPU (counted memory, simulated cards of a few hundred MB) they are "not decided
    here". R10c and R10d need several GPUs: lesson 06 decides R10c, the course does not measure
    R10d. Where AMP (fp16) did not run but bf16 did, bf16 stands in for it and says so.
    Sensitivity rows: R10a with bf16 autocast and with the cheaper checkpointing in place of
    AMP + checkpointing, R10b with bf16 in place of AMP (each on its memory saving).
    ``devices``: the GPUs this run had (default: counted), named in R10c's and R10d's text.
    """
    if not (is_real(small_card_gb) and small_card_gb > 0):
        raise ValueError(f"small_card_gb must be a number > 0 (GB); got {small_card_gb!r}")
    ok = _by_technique(technique_rows)
    fp32 = ok.get("fp32")
    amp = "AMP" if "AMP" in ok or "bf16" not in ok else "bf16"
    amp_ckpt = f"{amp} + checkpointing"
    note = "" if amp == "AMP" else " (bf16 autocast standing in for AMP)"
    device_types = {r.get("device_type") for r in technique_rows if r.get("status") == "ok"}
    on_cpu = None
    if device_types != {"cuda"}:
        on_cpu = ("memory was counted on a CPU (no allocator to cap; simulated cards of a few "
                  "hundred MB): the claim is about GPU cards")

    def saved(name: str) -> Optional[float]:
        row = ok.get(name)
        if fp32 is None or row is None or not fp32.get("memory_gib"):
            return None
        return 100 * (1 - row["memory_gib"] / fp32["memory_gib"])

    measured_cards = sorted({r["card_gb"] for r in card_rows if r["status"] == "ok"})

    def batches(card: float) -> Dict[str, int]:
        return {r["technique"]: r["largest_batch"] for r in card_rows
                if r["card_gb"] == card and r["status"] == "ok"}

    shown = {r["technique"]: shown_technique(r) for r in card_rows}  # TF32 where the math is

    def describe(card: float) -> str:
        return f"{card:g} GB: " + ", ".join(f"{shown[t]} {b}" for t, b in batches(card).items())

    def saving_rows(names, low):
        return [claims.alternative(f"with {shown_technique(ok[n])} in place of it", held=(
            saved(n) >= low), why=_range_verdict(saved(n), low, low + 10, "memory saved"),
            cannot_decide=on_cpu) for n in names if saved(n) is not None]

    if devices is None:
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_int("devices", devices, 0)
    here = (f"{plural(devices, 'GPU')} in this run" if devices else "no GPU in this run")
    out = []
    small = [c for c in measured_cards if c < small_card_gb]
    ckpt_saved = saved(amp_ckpt)
    if not small or ckpt_saved is None:
        out.append(claims.not_decided(
            "R10a", LESSON, f"no simulated card under {small_card_gb:g} GB, or no fp32 and "
                            f"{amp_ckpt} rows", "nothing to compare"))
    else:
        per_card = [b for b in (batches(c) for c in small) if b]
        # a tie counts: the recommendation fits as large a batch as anything measured
        wins = sum(1 for b in per_card if b.get(amp_ckpt, -1) == max(b.values()))
        others = sorted({shown[max(b, key=b.get)] for b in per_card
                         if b.get(amp_ckpt, -1) < max(b.values())})
        pick = (f"{amp_ckpt} fit the largest batch (ties included) on {wins} of {len(per_card)} "
                f"such cards" + (f" ({', '.join(others)} larger on the rest)" if others else ""))
        out.append(claims.decide(
            "R10a", LESSON,
            "; ".join(describe(c) for c in small)
            + f"; {amp_ckpt} saved {ckpt_saved:.0f}% against {technique_with_math(fp32)} at the "
              f"same batch{note}",
            wins == len(per_card) and ckpt_saved >= R10A_SAVED_PCT[0],
            f"{pick}; " + _range_verdict(ckpt_saved, *R10A_SAVED_PCT, "memory saved"),
            numbers={"memory_saved_pct": ckpt_saved, "wins": wins, "cards": len(per_card)},
            cannot_decide=on_cpu, understated=_more(ckpt_saved, R10A_SAVED_PCT),
            sensitivity=saving_rows(("bf16 + checkpointing", "AMP + checkpointing stem+layer1-2"),
                                    R10A_SAVED_PCT[0]), condition=f"with {amp_ckpt}"))
    large = [c for c in measured_cards if c >= small_card_gb]
    amp_saved = saved(amp)
    if not large or amp_saved is None:
        out.append(claims.not_decided(
            "R10b", LESSON, f"no simulated card of {small_card_gb:g} GB or more, or no fp32 "
                            f"and {amp} rows", "nothing to compare"))
    else:
        faster, speed, reason = True, "", on_cpu
        # the speed comparison passes the busy-GPU gate: eager, else both in a CUDA graph (no
        # host overhead), as R8 chooses its pair
        pairs = [(a, c) for a, c in ((amp, amp_ckpt),
                                     (f"{amp} + CUDA graph", f"{amp_ckpt} + CUDA graph"))
                 if a in ok and c in ok]
        if pairs:
            a, c = next((p for p in pairs if claims.rows_timing_gate(ok[p[0]], ok[p[1]]) is None),
                        pairs[0])
            fast, slow = ok[a]["img_per_s"], ok[c]["img_per_s"]
            faster = fast >= slow
            speed = (f"; {a} trains at {format_value(fast)} img/s against {format_value(slow)} "
                     f"with checkpointing, so accumulating micro-batches is "
                     f"{'the faster' if faster else 'NOT the faster'} way to a batch that does "
                     f"not fit")
            reason = on_cpu or claims.rows_timing_gate(ok[a], ok[c])
        out.append(claims.decide(
            "R10b", LESSON,
            "; ".join(describe(c) for c in large)
            + f"; {amp} saved {amp_saved:.0f}% against {technique_with_math(fp32)} at the same "
              f"batch{note}",
            amp_saved >= R10B_SAVED_PCT[0] and faster,
            _range_verdict(amp_saved, *R10B_SAVED_PCT, "memory saved") + speed,
            numbers={"memory_saved_pct": amp_saved}, cannot_decide=reason,
            understated=_more(amp_saved, R10B_SAVED_PCT),
            sensitivity=saving_rows(("bf16",) if amp == "AMP" else (), R10B_SAVED_PCT[0]),
            condition=f"with {amp}"))
    out.append(claims.not_decided("R10c", LESSON, here,
                                  "lesson 06 decides it: it measures ZeRO-1's memory per rank on "
                                  "the ranks it has"))
    out.append(claims.not_decided("R10d", LESSON, here,
                                  "the course trains no model-parallel setup"))
    return out


# --- gradient accumulation: memory per micro-batch count (claim R9) ------------------------------

#: How closely an accumulated step must match the large batch's (relative gradient difference):
#: 1e-4 in fp32; 10 units of the format's epsilon in 16 bits (their own rounding is that coarse).
R9_STEP_TOLERANCE = {"fp32": 1e-4, "tf32": 1e-4, "fp16": 10 * 2.0 ** -10, "bf16": 10 * 2.0 ** -7}
R9_MODELS = {"mlp": "the digits MLP (no BatchNorm)", "cnn": "the digits SmallCNN (BatchNorm)"}


def _same_step(e: Mapping[str, object], step_tolerance: Optional[float]) -> claims.Part:
    tol = step_tolerance if step_tolerance is not None else R9_STEP_TOLERANCE.get(
        e["precision"], 1e-4)
    diff = float(e["grad_rel_diff"])
    return claims.Part("a larger virtual batch (the same step)", bool(diff <= tol), (
        f"{e['micro_batches']} x {e['micro_batch']} against 1 x "
        f"{e['micro_batches'] * e['micro_batch']} ({R9_MODELS.get(e['model'], e['model'])}, "
        f"{e['precision']}): gradients differ by {diff:.1e} (relative; at most {tol:.0e} "
        f"counts as equal)"))


@claims.decides("R9")
def verdict_r9(rows: Sequence[Dict[str, object]], equivalence=None, tolerance: float = 0.15,
               step_tolerance: Optional[float] = None) -> claims.Verdict:
    """Claim R9 in two parts: memory (``accumulation_memory`` rows: the accumulated steps'
    memory varies by at most ``tolerance``, a fraction, across micro-batch counts; peak
    allocated memory where measured, a GPU, else the bytes one forward saves for backward,
    counted) and the step (an ``accumulation_equivalence`` result: the accumulated gradients
    equal the big batch's within ``step_tolerance``, default ``R9_STEP_TOLERANCE`` for its
    precision). ``equivalence``: one result, or a list whose first decides and whose others
    (an fp16 model, a model with BatchNorm as the article's ResNet-50 has) are the sensitivity
    rows. Both parts are arithmetic, not timing: a CPU run decides too."""
    if not rows:
        raise ValueError("rows must hold at least one accumulation_memory row")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1); got {tolerance!r}")
    if step_tolerance is not None and not 0 < step_tolerance < 1:
        raise ValueError(f"step_tolerance must be in (0, 1); got {step_tolerance!r}")
    gpu = all(r["accumulated_peak_gib"] is not None for r in rows)
    key = "peak_gib" if gpu else "saved_gib"
    what = "peak allocated" if gpu else "saved for backward (counted)"
    acc = [r[f"accumulated_{key}"] for r in rows]
    counts = sorted({r.get("micro_batches", r.get("effective_batch")) for r in rows})
    if len(counts) < 2 or not all(is_real(a) and a > 0 for a in acc):
        return claims.not_decided(
            "R9", LESSON, f"{what}: {acc} GiB at micro-batch counts {counts}",
            "needs memory measured at two or more micro-batch counts" if len(counts) < 2 else
            "a run's memory was not measured (out of memory, or not a number > 0)")
    one = [(r["effective_batch"], r[f"one_batch_{key}"]) for r in rows
           if r[f"one_batch_{key}"] is not None]
    spread = max(acc) / min(acc) - 1
    measured = (f"{what}: {min(acc):.3g}-{max(acc):.3g} GiB for effective batches "
                f"{rows[0]['effective_batch']}-{rows[-1]['effective_batch']} by accumulation")
    if len(one) > 1:
        measured += (f"; one batch: {one[0][1]:.3g} GiB at {one[0][0]} -> {one[-1][1]:.3g} GiB "
                     f"at {one[-1][0]}")
    oom = [r["effective_batch"] for r in rows if r["one_batch_status"] != "ok"]
    if oom:
        measured += f"; one batch of {', '.join(map(str, oom))} did not fit"
    memory = claims.Part("at the same memory", bool(spread <= tolerance),
                         f"memory moved {100 * spread:.0f}% across micro-batch counts (at most "
                         f"{100 * tolerance:.0f}% counts as the same)")
    equivalence = ([equivalence] if isinstance(equivalence, Mapping)
                   else list(equivalence or ()))
    parts = [memory] + ([_same_step(equivalence[0], step_tolerance)] if equivalence else [
        claims.Part("a larger virtual batch (the same step)", None,
                    "the step itself was not compared here")])
    alts = [claims.alternative(f"with {R9_MODELS.get(e['model'], e['model'])} in "
                               f"{e['precision']}", parts=[memory, _same_step(e, step_tolerance)])
            for e in equivalence[1:]]
    if equivalence:
        measured += "; " + parts[1].why.split(" (relative")[0]
    numbers = {"spread": spread, "memory": what}
    if equivalence:
        numbers["grad_rel_diff"] = float(equivalence[0]["grad_rel_diff"])  # NaN: undecided
    main = equivalence[0] if equivalence else None
    return claims.decide("R9", LESSON, measured, None, "", numbers=numbers, parts=parts,
                         sensitivity=alts, condition=(
                             f"with {R9_MODELS.get(main['model'], main['model'])} in "
                             f"{main['precision']}" if main else "in the run shown"))


#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)
