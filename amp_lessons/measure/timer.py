"""The one timer: how a training step is timed: ``time_steps`` (CUDA events after a warm-up on a GPU,
``time.perf_counter`` on a CPU), ``device_busy_ms`` (the union of the device's kernel intervals
under the profiler), ``idle_fraction`` (the share of a step the device sat idle) and
``summarize_times`` (median, quartiles, img/s and the repeat spread, ``repeat_spread``).
``runner.measure`` builds its rows from these; lesson 02 times its loops with them, and the
trainer keeps no step clock of its own (``time_steps`` times ``train_step`` too). A row whose
repeats disagree by more than ``NOISY_SPREAD`` (10%) decides nothing (``claims.rows_timing_gate``)."""
from __future__ import annotations

import contextlib
import math
import os
import re
import statistics
import time
import warnings
from typing import Callable, Dict, Iterable, Iterator, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from amp_lessons.validate import check_choice, check_int, is_real
from amp_lessons.tables import NOISY_SPREAD, plural  # NOISY_SPREAD: where tables call a row noisy


def time_steps(step: Callable, x: torch.Tensor, y: torch.Tensor, warmup: int = 5,
               steps: int = 15, device=None, reset_peak: bool = True,
               keep_losses: bool = False) -> Dict[str, object]:
    """Run ``warmup`` untimed steps, then time ``steps`` steps one by one.

    On a GPU each step is bracketed by CUDA events (device time, no host sync inside the loop);
    on a CPU by ``time.perf_counter``. Returns ``times_ms`` (per step), ``loss`` (last, float)
    and ``timer``. With ``reset_peak`` the GPU's peak-memory counter is reset after the warm-up
    (leave it off to count memory set aside during the warm-up, such as a CUDA graph's pool).
    ``keep_losses``: also return ``losses``, what every timed step returned (not synchronised).
    """
    check_int("warmup", warmup, 0)
    check_int("steps", steps, 1)
    if not isinstance(reset_peak, bool):
        raise ValueError(f"reset_peak must be True or False; got {reset_peak!r}")
    if not isinstance(keep_losses, bool):
        raise ValueError(f"keep_losses must be True or False; got {keep_losses!r}")
    kept = []
    device = torch.device(device) if device is not None else x.device
    loss = None
    for _ in range(warmup):
        loss = step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for i in range(steps):
            starts[i].record()
            loss = step(x, y)
            ends[i].record()
            if keep_losses:
                kept.append(loss)
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        timer = "CUDA events"
    else:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step(x, y)
            times.append((time.perf_counter() - t0) * 1e3)
            if keep_losses:
                kept.append(loss)
        timer = "perf_counter"
    out = {"times_ms": times, "loss": float(loss) if loss is not None else float("nan"),
           "timer": timer}
    if keep_losses:
        out["losses"] = kept
    return out


def interval_union(intervals: Iterable[Sequence[float]]) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once (kernels on
    several streams, or nested events, must not count their shared time twice)."""
    total, reach = 0.0, -math.inf  # reach: the end of everything counted so far
    for start, end in sorted((float(a), float(b)) for a, b in intervals):
        if end < start:
            raise ValueError(f"intervals must have end >= start; got ({start}, {end})")
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def device_busy_ms(step: Callable, x: torch.Tensor, y: torch.Tensor, device=None,
                   steps: int = 3, activity: str = "cuda") -> Optional[float]:
    """Milliseconds per step during which the device ran something (kernels, copies, memsets).

    ``steps`` steps run under ``torch.profiler`` (device activity only, to keep its own cost
    small); the union of the device events' intervals, divided by ``steps``, is the busy time.
    Against the timed median step this gives the share of the step the GPU sat idle waiting for
    the host (``gpu_idle_fraction``). None where ``device`` is not a GPU (``activity="cpu"``
    measures CPU operator time instead, for tests). CUPTI is released when the session ends
    (``cupti_teardown``), so the pass leaves no cost behind for steps timed later.
    """
    check_int("steps", steps, 1)
    check_choice("activity", activity, ("cuda", "cpu"))
    device = torch.device(device) if device is not None else x.device
    if activity == "cuda" and device.type != "cuda":
        return None
    kind = {"cuda": ProfilerActivity.CUDA, "cpu": ProfilerActivity.CPU}[activity]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda d: None)
    sync(device)
    with warnings.catch_warnings(), cupti_teardown(activity == "cuda"):
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with profile(activities=[kind]) as prof:  # one cycle: its "clears events" notice is moot
            for _ in range(steps):
                step(x, y)
            sync(device)
    wanted = "CUDA" if activity == "cuda" else "CPU"
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if getattr(e.device_type, "name", str(e.device_type)).upper().endswith(wanted)]
    return interval_union(spans) / 1e3 / steps


@contextlib.contextmanager
def wall_clock() -> Iterator[Dict[str, float]]:
    """Wall-clock seconds of a whole block (a training run's duration, not a step time: steps are
    timed by ``time_steps``): ``with wall_clock() as clock: ...`` then ``clock["seconds"]``."""
    clock = {"seconds": float("nan")}
    t0 = time.perf_counter()
    try:
        yield clock
    finally:
        clock["seconds"] = time.perf_counter() - t0


@contextlib.contextmanager
def cupti_teardown(enabled: bool = True) -> Iterator[None]:
    """Within the block, a profiler session that ends releases CUPTI (``TEARDOWN_CUPTI=1``).

    Kineto leaves CUPTI attached after a session unless told otherwise, and an attached CUPTI
    slows every later kernel launch (10-20% on a host-bound step, pytorch/pytorch#144455): the
    profiler pass of one row would slow the timed steps of every row after it. Not on CUDA
    older than 12.6, where a teardown can crash a later CUDA graph (torch keeps CUPTI there),
    nor where the variable is already set; the previous value comes back on exit.
    """
    version = tuple(int(v) for v in re.findall(r"\d+", torch.version.cuda or "0")[:2])
    if not enabled or version < (12, 6) or "TEARDOWN_CUPTI" in os.environ:
        yield
        return
    os.environ["TEARDOWN_CUPTI"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TEARDOWN_CUPTI", None)


def idle_fraction(busy_ms: Optional[float], step_ms: Optional[float]) -> Optional[float]:
    """The share of a step the device was idle: ``1 - busy / step``, clipped to [0, 1]; None when
    either is unknown or not a finite time (a NaN never reads as "busy")."""
    if busy_ms is None or step_ms is None or not is_real(busy_ms) or not is_real(step_ms) \
            or busy_ms < 0 or step_ms <= 0:
        return None  # unknown, or not a time (nan, inf, negative): never "fully busy"
    return min(1.0, max(0.0, 1.0 - busy_ms / step_ms))


REPEATS = 3          # the timed steps are split into this many consecutive repeats


def repeat_spread(times_ms: Sequence[float], repeats: int = REPEATS) -> Optional[float]:
    """How much the repeats of one measurement disagree: the timed steps are split into
    ``repeats`` consecutive blocks, and the spread is (slowest block's median - fastest block's
    median) / the median of all steps. None when there are fewer than two steps per block (too
    few to tell noise from a step)."""
    check_int("repeats", repeats, 2)
    times = [float(t) for t in times_ms]
    per = len(times) // repeats
    if per < 2:
        return None
    medians = [statistics.median(times[i * per:(i + 1) * per]) for i in range(repeats)]
    overall = statistics.median(times)
    if not overall > 0:
        return None
    return (max(medians) - min(medians)) / overall


def summarize_times(times_ms: Sequence[float], batch_size: int) -> Dict[str, float]:
    """Median step time, img/s from it, the spread (quartiles) of the step times, and
    ``spread``: how much the repeats disagree (``repeat_spread``; None with too few steps).

    ``times_ms``: at least one finite time >= 0 with a median above 0 ms (a ValueError
    otherwise: no rate follows from a 0 ms step); ``batch_size``: a whole number >= 1.
    """
    check_int("batch_size", batch_size, 1)
    times_ms = list(times_ms)
    if not times_ms:
        raise ValueError("times_ms must hold at least one step time")
    if not all(is_real(t) and t >= 0 for t in times_ms):
        bad = next(t for t in times_ms if not (is_real(t) and t >= 0))
        raise ValueError(f"times_ms must hold finite step times >= 0 ms; got {bad!r}")
    median = statistics.median(times_ms)
    if not median > 0:
        raise ValueError(f"times_ms must have a median above 0 ms (a step too short for the timer "
                         f"gives no img/s); got a median of {median!r} over "
                         f"{plural(len(times_ms), 'step time')}")
    q1, q3 = (statistics.quantiles(times_ms, n=4)[i] for i in (0, 2)) if len(times_ms) > 1 \
        else (median, median)
    return {"step_ms": median, "step_ms_q1": q1, "step_ms_q3": q3,
            "img_per_s": batch_size / (median / 1e3), "spread": repeat_spread(times_ms)}
