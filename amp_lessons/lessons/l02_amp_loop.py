"""Lesson 02, the basic AMP loop: FP32 against AMP on the digits set and why the small model does
not speed up (the GPU's idle share of a step, measured), the trainer's cost against the recipe's
hand-written loop, the dtypes autocast picks, and the usual mistakes run on purpose.

Built on the engine (``recipes``, ``trainer``, ``measure``, ``precision``, ``claims``); notebook 02
calls these. It decides article B's claims B3, B5, B6 and B7 (``DECIDES``). B1 and B2 are decided by
lesson 04 on ResNet-50: this lesson shows the digits CNN's numbers beside them, never a ruling.
"""
from __future__ import annotations

import copy
import math
import statistics
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from amp_lessons.publish import claims
from amp_lessons import measure as bench
from amp_lessons.validate import check_int, check_positive, is_real
from amp_lessons.data import digits_loaders
from amp_lessons.measure.dtype_trace import AutocastReport, autocast_report, dtype_label  # noqa: F401
from amp_lessons.models import build_digits_model
from amp_lessons.numerics.precision import Device, as_device, check_precision, normalize_precision, precision_settings
from amp_lessons.train.recipes import train_digits
from amp_lessons.measure.amp_mistakes import (SCALE_ORDERS, ClipBeforeUnscale,  # noqa: F401 (the lesson's API)
                                             clip_nan_check, clip_order_experiment, cycle,
                                             custom_function_under_autocast, half_model_errors,
                                             scale_order_experiment, scheduler_on_skipped_steps)
from amp_lessons.publish.report import show_table
from amp_lessons.lineage import traced  # explain names what made the published table
from amp_lessons.tables import percent, plural, text_table
from amp_lessons.train.trainer import Hooks, ScalerSettings, TrainConfig, Trainer, set_loader_epoch

LESSON = "02"
OTHERS_SHOWN = ("B1", "B2")  # shown beside this lesson's numbers, decided by lesson 04


# --- FP32 against AMP on the digits set -------------------------------------------------------

@traced
def compare_precisions(precisions: Sequence[str] = ("fp32", "fp16"), device: Device = None,
                       **train_kwargs) -> List[dict]:
    """Run ``recipes.train_digits`` once per precision from the same seed and initial weights.

    Returns one row per precision: precision, ran, reason (why it could not run here, else ""),
    epoch_time_s, peak_memory_mib, accuracy_pct, skipped_steps, and run (the DigitsRun, its
    trainer dropped so that its model and optimizer state free their memory; None if not run).
    """
    dev = as_device(device)
    if isinstance(precisions, str):  # one precision, not its characters
        precisions = (precisions,)
    if not precisions:
        raise ValueError("precisions must name at least one precision")
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


# --- why the small model does not speed up: the GPU's idle share, and the trainer's cost -------

LOOPS = {"hand": "hand-written (recipe order)", "trainer": "Trainer.train_step"}


@traced
def precision_rows(rows: Sequence[Mapping], cuda: bool) -> List[dict]:
    """The published form of ``compare_precisions``' rows: time per epoch, peak memory, test
    accuracy, skipped steps and a note (why a precision did not run; on a CPU, that there is no
    CUDA memory counter). ``cuda``: whether the rows ran on a GPU."""
    return [{"precision": r["precision"], "time per epoch (s)": r["epoch_time_s"],
             "peak memory (MiB)": r["peak_memory_mib"], "test accuracy (%)": r["accuracy_pct"],
             "skipped steps": r["skipped_steps"],
             "note": r["reason"] or ("" if cuda else "no CUDA memory counter on a CPU")}
            for r in rows]


def gpu_busy(step: Callable, x: torch.Tensor, y: torch.Tensor, device: Device = None,
             steps: int = 20) -> Tuple[Optional[float], str]:
    """GPU busy time per training step in ms (``bench.device_busy_ms``: the union of the
    kernels, copies and memsets ``torch.profiler`` recorded), and a note on how it was measured
    or why it was not: ``(None, why)`` on a CPU, or when the profiler failed or saw no GPU work."""
    check_int("steps", steps, 1)
    dev = as_device(device)
    if dev.type != "cuda":
        return None, f"not measured on a {dev.type.upper()}: there is no GPU to sit idle"
    try:
        busy = bench.device_busy_ms(step, x, y, dev, steps=steps)
    except Exception as exc:  # noqa: BLE001 - a profiler that cannot run must not stop the lesson
        return None, f"the profiler failed: {type(exc).__name__}: {exc}"[:200]
    if not busy:
        return None, "the profiler recorded no GPU work (CUPTI unavailable?)"
    return busy, f"torch.profiler, union of device kernels over {plural(steps, 'step')}"


def _seeded_model(model: str, width: int, image_size: Optional[int], seed: int, dev):
    """A digits model from ``seed``, on ``dev`` in training mode, and its input size."""
    torch.manual_seed(seed)
    net, size = build_digits_model(model, width)
    if image_size is not None and size is not None:
        size = image_size
    return net.to(dev).train(), size


def step_overhead(precisions: Sequence[str] = ("fp32", "fp16"), model: str = "cnn",
                  width: int = 32, image_size: Optional[int] = None, batch_size: int = 64,
                  lr: float = 0.05, device: Device = None, warmup: int = 10, steps: int = 30,
                  rounds: int = 4, profile_steps: int = 20, seed: int = 0) -> List[dict]:
    """Time one training step of a digits model two ways per precision, and how busy the GPU was.

    The loops: the recipe's hand-written step (``bench.hand_step``: autocast forward, scaled
    backward, step, update) and ``Trainer.train_step`` with the defaults ``train_digits`` uses,
    sharing one model, optimizer and batch. They run in ``rounds`` interleaved blocks of
    ``steps`` timed steps (order alternating; ``warmup`` untimed steps first), timed with CUDA
    events on a GPU, ``perf_counter`` on a CPU. Then ``gpu_busy`` profiles each loop.

    One row per precision and loop: precision, loop, step_ms (median) with q1/q3, gpu_busy_ms,
    gpu_idle (fraction of the step the GPU did nothing; None on a CPU), idle_note,
    overhead_pct (the trainer against the hand loop at that precision; None on the hand row),
    steps (timed), warmup, timer and device_type.
    """
    for name, value, low in (("warmup", warmup, 1), ("steps", steps, 1), ("rounds", rounds, 1),
                             ("profile_steps", profile_steps, 1), ("batch_size", batch_size, 1),
                             ("width", width, 1)):
        check_int(name, value, low)
    check_positive("lr", lr)
    dev = as_device(device)
    rows: List[dict] = []
    for p in precisions:
        p = check_precision(p, dev)
        net, size = _seeded_model(model, width, image_size, seed, dev)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        x, y = next(iter(digits_loaders(batch_size, size, dev, seed)[0]))
        # Like for like: the hand loop has no non-finite guard, so the trainer's is off here (its
        # default "skip" policy copies parameters and optimizer state for fp32/bf16 each step).
        trainer = Trainer(net, opt, TrainConfig(precision=p, progress=False, seed=None,
                                                nonfinite="ignore"), device=dev)
        loops = {"hand": bench.hand_step(net, opt, p, dev),
                 "trainer": bench.Step(net, opt, trainer.scaler, None, None, None,
                                         trainer=trainer)}
        times: Dict[str, List[float]] = {k: [] for k in loops}
        busy: Dict[str, Tuple[Optional[float], str]] = {}
        timer = ""
        with precision_settings(p, dev):
            for r in range(rounds):
                for name in (list(loops) if r % 2 == 0 else list(reversed(loops))):
                    t = bench.time_steps(loops[name], x, y, warmup=warmup if r == 0 else 1,
                                           steps=steps, device=dev)
                    times[name] += t["times_ms"]
                    timer = t["timer"]
            for name, step in loops.items():
                busy[name] = gpu_busy(step, x, y, dev, profile_steps)
        hand_ms = statistics.median(times["hand"])
        for name in loops:
            s = bench.summarize_times(times[name], batch_size)
            busy_ms, note = busy[name]
            idle = bench.idle_fraction(busy_ms, s["step_ms"])
            rows.append({"precision": p, "loop": LOOPS[name], "step_ms": s["step_ms"],
                         "step_ms_q1": s["step_ms_q1"], "step_ms_q3": s["step_ms_q3"],
                         "gpu_busy_ms": busy_ms, "gpu_idle": idle, "idle_note": note,
                         "overhead_pct": None if name == "hand"
                         else 100 * (s["step_ms"] / hand_ms - 1),
                         "steps": len(times[name]), "warmup": warmup, "timer": timer,
                         "device_type": dev.type})
        del trainer, loops, net, opt
        bench.free_memory(dev)
    return rows


def loops_agree(precision: str = "fp16", steps: int = 5, model: str = "cnn", width: int = 32,
                image_size: Optional[int] = None, batch_size: int = 64, lr: float = 0.05,
                device: Device = None, seed: int = 0) -> dict:
    """Train two copies of one digits model from the same weights on the same ``steps`` batches:
    one with the recipe's hand-written step (``bench.hand_step``), one with
    ``Trainer.train_step`` (defaults). Returns precision, steps, equal (every parameter and
    buffer bitwise equal afterwards) and max_abs_diff: the trainer's bookkeeping must not change
    the arithmetic."""
    check_int("steps", steps, 1)
    check_int("batch_size", batch_size, 1)
    check_int("width", width, 1)
    check_positive("lr", lr)
    dev = as_device(device)
    p = check_precision(precision, dev)
    hand_net, size = _seeded_model(model, width, image_size, seed, dev)
    trained_net = copy.deepcopy(hand_net)
    train, _ = digits_loaders(batch_size, size, dev, seed)
    batches = [b for _, b in zip(range(steps), cycle(train))]
    hand = bench.hand_step(hand_net, torch.optim.SGD(hand_net.parameters(), lr=lr,
                                                       momentum=0.9), p, dev)
    trainer = Trainer(trained_net, torch.optim.SGD(trained_net.parameters(), lr=lr, momentum=0.9),
                      TrainConfig(precision=p, progress=False, seed=None), device=dev)
    with precision_settings(p, dev):
        for x, y in batches:
            hand(x, y)
            trainer.train_step([(x, y)])
    a, b = hand_net.state_dict(), trained_net.state_dict()
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a
               if a[k].is_floating_point())
    return {"precision": p, "steps": steps, "equal": equal, "max_abs_diff": diff}


OVERHEAD_COLUMNS = (("precision", "precision"), ("loop", "loop"),
                    ("step_ms", "step (ms, median)", ".3f"), ("gpu_busy_ms", "GPU busy (ms)", ".3f"),
                    ("idle", "GPU idle"), ("cost", "vs hand loop"))


def overhead_rows(rows: Sequence[Mapping]) -> List[dict]:
    """``step_overhead`` rows as shown under ``OVERHEAD_COLUMNS``: the idle share via
    ``tables.percent`` (a small nonzero share never reads 0%), the trainer's cost in percent."""
    if not rows:
        raise ValueError("rows must hold at least one step_overhead row")
    return [dict(r, idle=("n/a" if r["gpu_idle"] is None else percent(r["gpu_idle"], 1.0)),
                 cost=("" if r["overhead_pct"] is None else f"{r['overhead_pct']:+.1f}%"))
            for r in rows]


def overhead_table(rows: Sequence[Mapping]) -> str:
    """``overhead_rows`` as a text table."""
    return text_table(overhead_rows(rows), OVERHEAD_COLUMNS)


def show_overhead(rows: Sequence[Mapping]) -> None:
    """``overhead_rows`` as the notebook's table (``report.show_table``: HTML, text fallback)."""
    show_table(overhead_rows(rows), OVERHEAD_COLUMNS)


def _row(rows: Sequence[Mapping], precision: str, loop: str) -> Optional[Mapping]:
    return next((r for r in rows if r["precision"] == precision and r["loop"] == LOOPS[loop]), None)


def overhead_summary(rows: Sequence[Mapping]) -> str:
    """What ``step_overhead`` found, in sentences, honest about what the timing can show: on a
    CPU, or with too few steps, the numbers are printed but decide nothing
    (``claims.timing_gate`` says why)."""
    if not rows:
        raise ValueError("rows must hold at least one step_overhead row")
    first = rows[0]
    gate = claims.timing_gate(first["device_type"], first["steps"], first["warmup"])
    lines = []
    for p in dict.fromkeys(r["precision"] for r in rows):
        hand, trained = _row(rows, p, "hand"), _row(rows, p, "trainer")
        if hand is None or trained is None:
            continue
        idle = ("; GPU idle " + percent(trained["gpu_idle"], 1.0) + " of each trainer step"
                if trained["gpu_idle"] is not None else "")
        lines.append(f"{p}: Trainer.train_step {trained['step_ms']:.3f} ms against the hand loop's "
                     f"{hand['step_ms']:.3f} ms ({trained['overhead_pct']:+.1f}%, medians of "
                     f"{trained['steps']} interleaved steps each){idle}.")
    if gate:
        lines.append(f"These timings decide nothing: {gate}.")
    elif all(r["gpu_idle"] is not None for r in rows):
        worst = max(r["gpu_idle"] for r in rows)
        lines.append(f"The GPU sat idle up to {percent(worst, 1.0)} of a step: the step time is "
                     + ("mostly host and launch overhead, not arithmetic, so 16-bit math cannot "
                        "shorten it much." if worst > claims.MAX_IDLE_FRACTION else
                        "mostly GPU work."))
    return "\n".join(lines)


def b1_b2_context(precision_rows: Sequence[Mapping], overhead_rows: Sequence[Mapping],
                  device_type: str) -> List[claims.Verdict]:
    """Claims B1 and B2 beside the digits CNN's numbers, as "not decided here" verdicts: lesson 04
    decides both on ResNet-50. The reason names the GPU's idle share measured by
    ``step_overhead`` (or why the timing cannot decide, e.g. a CPU). Needs an fp32 and an fp16
    ``compare_precisions`` row that ran."""
    by = {r["precision"]: r for r in precision_rows if r.get("ran")}
    if "fp32" not in by or "fp16" not in by:
        raise ValueError("precision_rows must hold an fp32 and an fp16 row that ran")
    fp32, amp = by["fp32"], by["fp16"]
    for r in (fp32, amp):
        if not (is_real(r.get("epoch_time_s")) and r["epoch_time_s"] > 0):
            raise ValueError(f"precision_rows: the {r['precision']} row's epoch_time_s must be a "
                             f"number > 0 seconds; got {r.get('epoch_time_s')!r}")
    speedup = fp32["epoch_time_s"] / amp["epoch_time_s"]
    mem = (None if not fp32["peak_memory_mib"] or amp["peak_memory_mib"] is None
           else 1 - amp["peak_memory_mib"] / fp32["peak_memory_mib"])
    idle = {r["precision"]: r["gpu_idle"] for r in overhead_rows
            if r["loop"] == LOOPS["trainer"] and r["gpu_idle"] is not None}
    steps = min((r["steps"] for r in overhead_rows), default=0)
    warmup = min((r["warmup"] for r in overhead_rows), default=0)
    gate = claims.timing_gate(device_type, steps, warmup, idle.get("fp16"))
    memory = ("no CUDA memory counter on a CPU" if mem is None else
              f"{fp32['peak_memory_mib']:.0f} -> {amp['peak_memory_mib']:.0f} MiB peak "
              f"({mem:.0%} {'saved' if mem >= 0 else 'more'})")
    measured = (f"SmallCNN on digits: fp16 ran at {speedup:.2f}x fp32's speed per epoch "
                f"({fp32['epoch_time_s']:.3g} -> {amp['epoch_time_s']:.3g} s); {memory}")
    if idle:
        measured += "; GPU idle " + ", ".join(f"{percent(v, 1.0)} ({p})" for p, v in idle.items())
    if device_type == "cuda" and idle and max(idle.values()) > claims.MAX_IDLE_FRACTION:
        because = (f"the digits CNN is launch-bound: the GPU is idle "
                   f"{percent(max(idle.values()), 1.0)} of each step")
    else:
        because = gate or "the digits CNN is not the workload the claim is about"
    numbers = {"speedup": speedup, "memory_saved": mem, "gpu_idle": idle}
    return [claims.not_decided(cid, LESSON, measured,
                               because=f"{because}; lesson 04 decides {cid} on ResNet-50, the "
                                       f"workload the claim is about", numbers=numbers)
            for cid in OTHERS_SHOWN]


# --- the dtype claims B5 and B7 are about ------------------------------------------------------

def claim_dtype(device: Device = None) -> torch.dtype:
    """The autocast dtype claims B5 and B7 are decided in: ``torch.float16`` (article B's FP16)
    wherever autocast runs it on ``device`` (every CUDA GPU; a CPU on recent torch), else the
    device's bf16, whose verdicts then say they cannot decide an FP16 claim."""
    dev = as_device(device)
    try:
        with torch.autocast(device_type=dev.type, dtype=torch.float16):
            ok = (torch.ones(2, 2, device=dev) @ torch.ones(2, 2, device=dev)).dtype
    except (RuntimeError, AssertionError):
        return torch.bfloat16
    return torch.float16 if ok == torch.float16 else torch.bfloat16


# --- what autocast does (claim B5) ---------------------------------------------------------------

# The dtype trace (``AutocastReport``, ``autocast_report``, ``dtype_label``) lives in the engine,
# ``measure.dtype_trace``, where the doctor reuses it on any model; this lesson introduces it.


def b5_parts(report: AutocastReport) -> List[dict]:
    """Claim B5's three statements beside what ``report`` recorded: one row each with the part,
    what was measured and what it means (data for a table; the ruling is ``verdict_b5``)."""
    return [{"part": p.says, "measured": m, "finding": f"{p.outcome} ({p.why})"}
            for p, m in _b5_parts(report)]


def _b5_parts(report: AutocastReport) -> List[Tuple[claims.Part, str]]:
    low = report.low
    layer_grads = {g for _, _, _, g in report.layers if g is not None}
    half_layers = [k for _, k, d, _ in report.layers if d == low]
    lab = lambda ds: ", ".join(sorted(dtype_label(d, low) for d in ds)) or "none"  # noqa: E731
    loss = claims.Part(
        "the loss is computed in FP16", report.loss == low,
        "the loss is 16-bit" if report.loss == low else
        "the loss is float32: cross_entropy is on autocast's float32 list")
    back = claims.Part(
        "backward runs in FP16", (low in layer_grads) if layer_grads else None,
        ("the gradients flowing back through the 16-bit ops are 16-bit"
         + ("; the loss's own backward starts in float32" if report.loss != low else ""))
        if low in layer_grads else "no gradient flowed back in 16 bits" if layer_grads else
        "no layer gradient was recorded")
    weights_16 = bool(half_layers) and report.parameters == {torch.float32}
    restored = claims.Part(
        "gradients are restored to FP32",
        (report.gradients == {torch.float32}) if weights_16 else None,
        ("the 16-bit ops used 16-bit copies of their float32 weights, made by autocast's cast, "
         "and the backward of that cast returns the weight gradients in float32"
         if report.gradients == {torch.float32} else
         f"the parameter gradients are {lab(report.gradients)}, not float32") if weights_16 else
        "no layer ran in 16 bits with float32 parameters, so nothing needed restoring")
    return [(loss, f"loss {dtype_label(report.loss, low)}"),
            (back, f"gradients into layer outputs: {lab(layer_grads)}"),
            (restored, f"parameters {lab(report.parameters)}, their gradients "
                       f"{lab(report.gradients)}")]


def absolute_error_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss written by hand from ops autocast does not list (subtract, abs, mean): the mean
    absolute error between the logits and the one-hot targets. Under autocast it stays in the
    logits' 16-bit dtype, where ``cross_entropy`` (on autocast's float32 list) returns float32:
    claim B5's sensitivity row."""
    return (logits - F.one_hot(target, logits.shape[-1])).abs().mean()


@claims.decides("B5")
def verdict_b5(report: AutocastReport,
               alternatives: Sequence[Tuple[str, AutocastReport]] = ()) -> claims.Verdict:
    """Claim B5 against an ``autocast_report`` of a float16 run, split into its three parts
    (``claims.Part``): the loss in FP16, backward in FP16 (through the 16-bit ops), gradients
    restored to FP32 (the backward of autocast's weight cast returns float32 gradients). The
    claim is about FP16: a bf16 report decides nothing. ``alternatives``: ``(setting,
    report)`` pairs decided the same way (e.g. a loss written by hand,
    ``absolute_error_loss``), the sensitivity rows."""
    parts = _b5_parts(report)
    measured = "; ".join(m for _, m in parts) + f" (autocast dtype {dtype_label(report.low, None)})"
    cannot = (None if report.low == torch.float16 else
              f"autocast ran in {dtype_label(report.low, None)}; the claim is about FP16, so run "
              f"the report with dtype=torch.float16")
    alts = [claims.alternative(setting, parts=[p for p, _ in _b5_parts(r)],
                               cannot_decide=None if r.low == torch.float16 else "not float16")
            for setting, r in alternatives]
    return claims.decide("B5", LESSON, measured, None, "", parts=[p for p, _ in parts],
                         numbers={"loss": str(report.loss), "parts": b5_parts(report)},
                         cannot_decide=cannot, sensitivity=alts,
                         condition=f"with {report.loss_name} as the loss")


B7_GRAD_TOLERANCE = 0.05  # 16-bit rounding of a 32-wide dot product stays well below this


@claims.decides("B7")
def verdict_b7(unchanged: Mapping, with_custom_fwd: Mapping,
               plain_layers: Optional[Mapping] = None) -> claims.Verdict:
    """Claim B7 ("AMP needs no change to any layer's code") from two
    ``custom_function_under_autocast`` rows: the same custom Function as written for float32,
    and with ``torch.amp.custom_fwd``/``custom_bwd``. Holds if the unchanged one runs under
    autocast with gradients within ``B7_GRAD_TOLERANCE`` of float32's. Decided only on float16
    rows (the claim is about FP16; ``claim_dtype``). Sensitivity row: ``plain_layers``, a model
    of torch.nn layers trained under autocast unchanged (``{"model": name, "accuracy":
    fraction, "classes": n}``): held where it trained above chance (``claims.accuracy_gate``)."""
    for name, row in (("unchanged", unchanged), ("with_custom_fwd", with_custom_fwd)):
        if not isinstance(row, Mapping) or "ran" not in row:
            raise ValueError(f"{name} must be a custom_function_under_autocast row; got {row!r}")

    def outcome(row):
        if not row["ran"]:
            return f"failed in backward ({row['error']})"
        return f"ran, gradients {row['grad']} within {row['grad_error']:.2g} of float32's"

    ok = lambda r: bool(r["ran"]) and is_real(r["grad_error"]) \
        and r["grad_error"] <= B7_GRAD_TOLERANCE  # noqa: E731
    measured = (f"a custom autograd Function under autocast: unchanged {outcome(unchanged)}; "
                f"with torch.amp.custom_fwd/custom_bwd {outcome(with_custom_fwd)}")
    held = True if ok(unchanged) else False if ok(with_custom_fwd) else None
    dtypes = {r.get("dtype", "float16") for r in (unchanged, with_custom_fwd)}
    cannot = (None if dtypes == {"float16"} else
              f"autocast ran in {', '.join(sorted(dtypes))}; the claim is about FP16, so run "
              f"both functions with dtype=torch.float16")
    if ok(unchanged):
        why = "the unchanged custom Function ran under autocast with correct gradients"
    elif ok(with_custom_fwd):
        why = ("a layer written as a custom autograd Function must change: its backward gets a "
               "16-bit gradient but float32 saved tensors; torch.amp.custom_fwd/custom_bwd fix it")
    else:  # the control failed too: the experiment, not the claim, is what broke
        why = ("the custom Function did not run correctly under autocast even with custom_fwd, "
               "so this experiment cannot tell whether the unchanged code is at fault")
    alts = []
    if plain_layers is not None:
        gate = claims.accuracy_gate(plain_layers.get("accuracy"), int(plain_layers["classes"]))
        alts.append(claims.alternative(
            f"with a model built only from torch.nn layers ({plain_layers['model']})",
            held=None if gate else True, why=gate or f"it trained under autocast unchanged to "
                                          f"{plain_layers['accuracy']:.1%} test accuracy"))
    return claims.decide("B7", LESSON, measured + f" (autocast {', '.join(sorted(dtypes))})",
                         held, why, numbers={"unchanged": dict(unchanged),
                                             "with_custom_fwd": dict(with_custom_fwd)},
                         cannot_decide=cannot, sensitivity=alts,
                         condition="with a layer written as a custom autograd Function")


# --- clipping before unscale_ (claim B3) ---------------------------------------------------------

EXPLODING = 10.0  # a true gradient norm this many times the run's median counts as exploding


def _clip_parts(rows: Sequence[Mapping], max_norm: float,
                nan_check: Optional[Mapping] = None) -> List[claims.Part]:
    wrong, right = rows
    at = lambda r: math.isclose(r["threshold_applied"], max_norm, rel_tol=0.01)  # noqa: E731
    shown = claims.Part(
        f"clip_grad_norm_(max_norm={max_norm:g}) as shown (before unscale_) clips at "
        f"{max_norm:g}", at(wrong),
        "the article's order clips at the stated norm" if at(wrong) else
        f"without unscale_ the threshold applies to the scaled gradients, so the true gradients "
        f"are clipped to max_norm / scale = {wrong['threshold_applied']:.3g}, not {max_norm:g}; "
        f"call scaler.unscale_(optimizer) before clipping")
    after = claims.Part(f"the same call after unscale_ clips at {max_norm:g}", at(right),
                        f"clipped the true gradients at {right['threshold_applied']:.3g}")
    top, median = right.get("max_true_grad_norm"), right["true_grad_norm"]
    nan = ("" if not nan_check else
           f"; produced on purpose, a gradient holding a NaN stays NaN through clip_grad_norm_ "
           f"(total norm {nan_check['total_norm']}), so GradScaler's skipped step, not "
           f"clipping, is what guards against NaN")
    exploded = is_real(top) and top >= EXPLODING * median
    guards = claims.Part(
        "clipping guards against exploding gradients or NaN", None,
        (f"not decided: gradients exploded on their own (largest true norm {top:.3g}, "
         f"{top / median:.0f}x the median) but no unclipped run was compared" if exploded else
         f"not decided here: the condition did not occur on its own (largest true gradient norm "
         f"{'not measured' if top is None else f'{top:.3g}'}, under {EXPLODING:g}x the median "
         f"{median:.3g})") + nan)
    return [shown, after, guards]


@claims.decides("B3")
def verdict_b3(rows: Sequence[Mapping], max_norm: float = 1.0,
               nan_check: Optional[Mapping] = None,
               unscaled_rows: Optional[Sequence[Mapping]] = None) -> claims.Verdict:
    """Claim B3 from ``clip_order_experiment`` rows (the article's order first, PyTorch's
    second), in three parts: the call as shown (before ``unscale_``) clips the true gradients
    at ``max_norm`` (within 1%); after ``unscale_`` it does; clipping guards against exploding
    gradients or NaN, conditional (decided only where they occurred on their own;
    ``nan_check``, ``clip_nan_check``, shows on purpose what clipping does to a NaN).
    Accuracy is reported beside it, not used to rule. Sensitivity row: ``unscaled_rows``, the
    same two orders in bf16 without a GradScaler (no scale to undo)."""
    check_positive("max_norm", max_norm)
    if len(rows) != 2 or not all("threshold_applied" in r for r in rows):
        raise ValueError("rows must be the two rows of clip_order_experiment")
    wrong, right = rows
    broken = [f"{name} {k}={r.get(k)!r}" for name, r in (("clip first", wrong),
                                                          ("unscale_ first", right))
              for k in ("scale", "threshold_applied", "true_grad_norm", "grad_norm_used",
                        "accuracy_pct") if not is_real(r.get(k))]
    if broken:
        return claims.not_decided(
            "B3", LESSON, f"clip_grad_norm_(max_norm={max_norm:g}) before and after unscale_: "
            f"{', '.join(broken)}", f"a measured number is not finite ({', '.join(broken)}): the "
            f"run diverged or skipped every step, so it cannot rule")
    measured = (f"clip_grad_norm_(max_norm={max_norm:g}) before unscale_ at scale "
                f"{wrong['scale']:g}: true gradients clipped to {wrong['threshold_applied']:.3g} "
                f"(median true norm {wrong['true_grad_norm']:.3g}, norm used "
                f"{wrong['grad_norm_used']:.3g}); after unscale_: clipped at "
                f"{right['threshold_applied']:.3g}; test accuracy {wrong['accuracy_pct']:.1f}% "
                f"vs {right['accuracy_pct']:.1f}%")
    alts = []
    if unscaled_rows is not None:
        alts.append(claims.alternative(
            f"with {unscaled_rows[0].get('precision', 'bf16')} autocast and no GradScaler (scale "
            f"{unscaled_rows[0]['scale']:g}: nothing to undo)",
            parts=_clip_parts(unscaled_rows, max_norm)[:2]))
    return claims.decide("B3", LESSON, measured, None, "",
                         parts=_clip_parts(rows, max_norm, nan_check), sensitivity=alts,
                         numbers={"wrong": dict(wrong), "right": dict(right), "max_norm": max_norm},
                         condition=f"with {wrong.get('precision', 'fp16')} and a GradScaler "
                                   f"(scale {wrong['scale']:g})")


# --- the deprecated import (claim B6) ------------------------------------------------------------

@claims.decides("B6")
def verdict_b6(caught: Sequence, import_error: Optional[BaseException] = None,
               replacement: Optional[Sequence] = None) -> claims.Verdict:
    """Claim B6 from what ``from torch.cuda.amp import autocast, GradScaler`` (and using them)
    raised and warned, caught in the notebook's warning cell: ``caught`` is the list from
    ``warnings.catch_warnings(record=True)``. Holds if the import and the calls work; where they
    only warn (FutureWarning since torch 2.4, raised by the calls), "held, deprecated", naming the
    ``torch.amp`` replacement; does not hold where the import fails. Sensitivity row:
    ``replacement``, the warnings caught running the ``torch.amp`` replacement the same way."""
    if isinstance(caught, (str, bytes)) or not isinstance(caught, Sequence):
        raise ValueError(f"caught must be the list of warnings.catch_warnings(record=True); "
                         f"got {caught!r}")
    if not all(isinstance(getattr(w, "category", None), type) and hasattr(w, "message")
               for w in caught):
        raise ValueError(f"caught must hold warnings.WarningMessage records (with category and "
                         f"message); got {list(caught)[:3]!r}")
    deprecations = [w for w in caught
                    if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    messages = [str(w.message) for w in deprecations]
    deprecated = None
    if import_error is not None:
        measured = f"the import failed on torch {torch.__version__}: {import_error}"
        held, why = False, "this torch no longer has torch.cuda.amp's autocast/GradScaler"
    else:
        measured = (f"the import works on torch {torch.__version__} with "
                    f"{len(messages)} deprecation warning(s)"
                    + (": " + " | ".join(messages) if messages else ""))
        held = True
        why = ("the import and the calls run" + (", and only warn" if messages else
                                                 " without a deprecation warning"))
        if messages:
            deprecated = ("use torch.amp.GradScaler(device_type) and "
                          "torch.autocast(device_type, dtype) (torch.amp)")
    alts = []
    if replacement is not None:
        old = [str(w.message) for w in replacement
               if issubclass(w.category, (FutureWarning, DeprecationWarning))]
        alts.append(claims.alternative(
            "with the torch.amp replacement (torch.amp.GradScaler, torch.autocast)", held=True,
            why=("runs without a deprecation warning" if not old else
                 "runs, warning: " + " | ".join(old))))
    return claims.decide("B6", LESSON, measured, held, why, numbers={"warnings": messages},
                         deprecated=deprecated, sensitivity=alts,
                         condition="with the article's torch.cuda.amp import")


# --- GradScaler after backward (claim B8) -----------------------------------------------------------

def _order_rule(rows: Sequence[Mapping]) -> Tuple[Optional[bool], str]:
    right, diagram = rows
    ratio = diagram.get("ratio")
    if not (is_real(ratio) and math.isfinite(ratio)):
        return None, f"the update's size was not measured (ratio {ratio!r})"
    same = math.isclose(ratio, 1.0, rel_tol=0.01)
    return same, (f"{diagram['dtype']}, scale {diagram['scale']:g}: GradScaler after backward "
                  f"made an update {ratio:.3g} times the right one"
                  + ("" if same else f" (about 1/scale = {1 / diagram['scale']:.3g}): step() "
                                     f"divided gradients that were never scaled"))


@claims.decides("B8")
def verdict_b8(rows: Sequence[Mapping], unscaled_rows: Optional[Sequence[Mapping]] = None,
               low_scale_rows: Optional[Sequence[Mapping]] = None) -> claims.Verdict:
    """Claim B8 (article B's diagram puts GradScaler after backward) from
    ``scale_order_experiment`` rows (PyTorch's order first, the diagram's second), float16 with
    a GradScaler: held when the diagram's order makes the same update (within 1%). Shown beside
    it: ``unscaled_rows``, the same in bf16 with the scaler disabled, where no loss scaling
    means the order cannot matter (a row that cannot rule on a GradScaler). Sensitivity row:
    ``low_scale_rows``, the same at a low ``init_scale``."""
    if len(rows) != 2 or any("ratio" not in r for r in rows):
        raise ValueError("rows must be the two rows of scale_order_experiment")
    held, why = _order_rule(rows)
    alts = []
    if low_scale_rows is not None:
        h, w = _order_rule(low_scale_rows)
        alts.append(claims.alternative(f"with init_scale {low_scale_rows[1]['scale']:g}", held=h,
                                       why=w))
    if unscaled_rows is not None:  # no loss scaling: shown, but it cannot rule on a GradScaler
        alts.append(claims.alternative(
            f"with {unscaled_rows[1]['dtype']} autocast and the GradScaler disabled", why=(
                f"not decided: without loss scaling the order cannot matter "
                f"({_order_rule(unscaled_rows)[1]})")))
    measured = (f"one SGD step from the same weights and batch: update norm "
                f"{rows[0]['update_norm']:.3g} in PyTorch's order, {rows[1]['update_norm']:.3g} "
                f"with GradScaler after backward")
    return claims.decide("B8", LESSON, measured, held, why, sensitivity=alts,
                         numbers={"ratio": rows[1]["ratio"]},
                         condition=f"with {rows[1]['dtype']} and a GradScaler",
                         cannot_decide=None if rows[1]["dtype"] == "float16" else
                         "the claim's GradScaler scales only float16; run it with float16")


# --- the published claims table ------------------------------------------------------------------

def own_verdicts(verdicts: Sequence[claims.Verdict]) -> List[claims.Verdict]:
    """The verdicts lesson 02 publishes (``report.publish_verdicts``), checked: only claims this
    lesson decides (``DECIDES``), each once, from this lesson; ValueError for anything else."""
    seen = set()
    for v in verdicts:
        if not isinstance(v, claims.Verdict):
            raise ValueError(f"verdicts must be claims.Verdict objects; got {v!r}")
        if v.claim not in DECIDES or v.lesson != LESSON:
            raise ValueError(f"verdicts must be lesson {LESSON}'s own, for claims "
                             f"{', '.join(sorted(DECIDES))}; got {v.claim} from lesson {v.lesson}")
        if v.claim in seen:
            raise ValueError(f"verdicts must hold each claim once; {v.claim} appears twice")
        seen.add(v.claim)
    return list(verdicts)


# --- the LR scheduler and .half() mistakes ---------------------------------------------------------

#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)
