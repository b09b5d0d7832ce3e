"""Lesson 03's exercises: implement GradScaler's update rule and replay a run's skips to its exact
scale trace; match scale traces to their causes; predict when a scale that halves every step
falls below 1. Graded against the scale traces the trainer recorded."""
import math
from typing import Callable, Mapping, Optional, Sequence, Tuple

from ..trainer import ScalerSettings
from .check import Check, is_blank, passed, unanswered, wrong

RULE = "Exercise 1 (implement): GradScaler's update rule"
CAUSES = "Exercise 3 (match): three scale traces and their causes"
FLOOR = "Exercise 2 (predict, then run): a scale that halves every step"
CAUSE_NAMES = ("init_scale too high", "inf or NaN every step", "healthy")
SETTLING = 3  # a run that skips its first 3+ steps in a row started with too high a scale


def reference_update(scale: float, tracker: int, found_inf: bool, growth_factor: float,
                     backoff_factor: float, growth_interval: int) -> Tuple[float, int]:
    """The reference solution: torch's ``_amp_update_scale_`` rule, one step."""
    if found_inf:
        return scale * backoff_factor, 0
    tracker += 1
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker


def _no_reset_on_skip(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf:
        return scale * backoff_factor, tracker
    tracker += 1
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker


def _grows_one_step_late(scale, tracker, found_inf, growth_factor, backoff_factor,
                         growth_interval):
    if found_inf:
        return scale * backoff_factor, 0
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker + 1


WRONG_RULES = {"tracker not reset on a skip": _no_reset_on_skip,
               "grows one step late": _grows_one_step_late}


def replay(update: Callable, scales: Sequence[float], skipped: Sequence[bool],
           settings: ScalerSettings) -> list:
    """The scale trace ``update`` gives from ``scales[0]`` with the run's ``skipped`` flags."""
    scale, tracker, out = float(scales[0]), 0, [float(scales[0])]
    for found_inf in skipped[:-1]:
        result = update(scale, tracker, bool(found_inf), settings.growth_factor,
                        settings.backoff_factor, settings.growth_interval)
        if result is None:
            return None
        scale, tracker = result
        out.append(float(scale))
    return out


def check_update_rule(update: Callable, scales: Sequence[float], skipped: Sequence[bool],
                      settings: ScalerSettings) -> Check:
    """Replay the run's ``skipped`` flags through ``update(scale, tracker, found_inf,
    growth_factor, backoff_factor, growth_interval) -> (scale, tracker)`` and compare with the
    ``scales`` the run used, step for step (the run must start with a fresh tracker)."""
    hint = ("on a skipped step: scale *= backoff_factor and the count of clean steps restarts at "
            "0; on a clean step: count it, and when the count reaches growth_interval, "
            "scale *= growth_factor and the count restarts at 0")
    if len(scales) != len(skipped) or len(scales) < 2:
        raise ValueError("scales and skipped must be the same run's columns, 2 steps or more")
    try:
        mine = replay(update, scales, skipped, settings)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(RULE, f"update raised {type(exc).__name__}: {exc}", hint)
    if mine is None:
        return unanswered(RULE, hint)
    for i, (a, b) in enumerate(zip(mine, scales)):
        if a != float(b):
            prev = "skipped" if skipped[i - 1] else "clean"
            why = ("after a skipped step the scale is multiplied by backoff_factor and the clean "
                   "count restarts" if skipped[i - 1] else
                   "count the clean steps since the last change (growth or skip) and grow when "
                   "that count reaches growth_interval: not a step earlier or later")
            return wrong(RULE, f"step {i} (after a {prev} step): your rule gives {a:g}, the run "
                         f"used {float(b):g}", why)
    return passed(RULE, f"your rule reproduces all {len(scales)} scales of the run, "
                  f"{sum(map(bool, skipped))} skips included")


def trace_cause(scales: Sequence[float], skipped: Sequence[bool]) -> str:
    """One of ``CAUSE_NAMES`` for a run's scale trace: every step skipped means a non-finite
    loss or gradient every step; a run of ``SETTLING`` or more skips at the start means the
    scale started too high; otherwise the trace is healthy."""
    if skipped and all(skipped):
        return "inf or NaN every step"
    first = next((i for i, s in enumerate(skipped) if not s), len(skipped))
    return "init_scale too high" if first >= SETTLING else "healthy"


def check_trace_causes(answer: Mapping[str, str],
                       traces: Mapping[str, Tuple[Sequence[float], Sequence[bool]]]) -> Check:
    """Grade ``answer`` (trace letter -> one of ``CAUSE_NAMES``) against ``trace_cause`` of each
    of ``traces`` (letter -> (scales, skipped))."""
    hint = ("a scale that halves at every step and never recovers means every step overflows "
            "(a bug, not a scale to tune); a burst of halvings at the start that then settles "
            "means init_scale was too high; a flat or slowly doubling trace is healthy")
    if is_blank(answer):
        return unanswered(CAUSES, hint)
    if not isinstance(answer, Mapping) or set(answer) != set(traces):
        return wrong(CAUSES, f"answer must map each of {', '.join(sorted(traces))} to a cause",
                     hint)
    for letter in sorted(traces):
        said = answer[letter]
        if said not in CAUSE_NAMES:
            return wrong(CAUSES, f"{letter}: the causes are {', '.join(map(repr, CAUSE_NAMES))}; "
                         f"got {said!r}", hint)
        real = trace_cause(*traces[letter])
        if said != real:
            scales, skipped = traces[letter]
            return wrong(CAUSES, f"trace {letter} is not '{said}': it skipped "
                         f"{sum(map(bool, skipped))} of {len(skipped)} steps and ended at "
                         f"{float(scales[-1]):g}", hint)
    return passed(CAUSES, ", ".join(f"{k}: {answer[k]}" for k in sorted(traces)))


def first_below_one(scales: Sequence[float]) -> Optional[int]:
    """The first step whose scale is below 1, or None."""
    return next((i for i, s in enumerate(scales) if s < 1), None)


def overflow_trace(settings: ScalerSettings, steps: int = 40) -> list:
    """The scales a run with ``settings`` uses when every step overflows (``reference_update``
    replayed with every step skipped)."""
    return replay(reference_update, [settings.init_scale] * steps, [True] * steps, settings)


def check_steps_below_one(answer, settings: ScalerSettings) -> Check:
    """Grade ``answer``: the first step at which a run with ``settings`` whose every step
    overflows uses a scale below 1 (``overflow_trace``)."""
    k = math.log2(settings.init_scale)
    hint = (f"step 0 uses init_scale = 2**{k:g}; every skipped step multiplies the scale by "
            f"backoff_factor = {settings.backoff_factor:g}, so step i uses init_scale * "
            f"{settings.backoff_factor:g}**i")
    if is_blank(answer):
        return unanswered(FLOOR, hint)
    scales = overflow_trace(settings, 4 * int(max(k, 1)) + 8)
    truth = first_below_one(scales)
    if truth is None:
        raise ValueError("settings whose scale never falls below 1 while every step overflows")
    if not isinstance(answer, int) or isinstance(answer, bool):
        return wrong(FLOOR, f"answer must be a step number (an int); got {answer!r}", hint)
    if answer != truth:
        off = (f"step {truth - 1} uses {scales[truth - 1]:g}, which is not below 1"
               if answer == truth - 1 else hint)
        return wrong(FLOOR, f"the first scale below 1 is used at step {truth}, not {answer}", off)
    return passed(FLOOR, f"step {truth} uses {scales[truth]:g}: the scale now shrinks the "
                  f"gradients, and no step of such a run ever updates the weights")


def traces_text(traces: Mapping[str, Tuple[Sequence[float], Sequence[bool]]],
                first: int = 12) -> str:
    """Each trace's first ``first`` scales as powers of two (``x`` marks a skipped step), with
    its skipped-step count and last scale: what the learner reads to match the causes."""
    lines = []
    for letter in sorted(traces):
        scales, skipped = traces[letter]
        steps = " ".join(f"{math.log2(s):g}{'x' if k else ''}"
                         for s, k in zip(scales[:first], skipped[:first]))
        lines.append(f"{letter}: log2(scale) per step: {steps} ...  skipped {sum(map(bool, skipped))} "
                     f"of {len(skipped)}, last scale {float(scales[-1]):g}")
    return "\n".join(lines)
