"""Lesson 03's exercises: implement GradScaler's update rule and replay a run's skips to its exact
scale trace; match scale traces to their causes; predict when a scale that halves every step
falls below 1. Graded against the scale traces the trainer recorded."""
import math
from typing import Callable, Mapping, Optional, Sequence, Tuple

from amp_lessons.tables import plural
from amp_lessons.train.trainer import ScalerSettings
from amp_lessons.exercises.check import (Check, canonical, graded, hint_book, hint_reader,
                                         is_blank, keyed, matching_mistake, not_a_function,
                                         number, passed, unanswered, whole_number, wrong)

RULE = "Exercise 1 (implement): GradScaler's update rule"
CAUSES = "Exercise 3 (match): three scale traces and their causes"
FLOOR = "Exercise 2 (predict, then run): a scale that halves every step"
CAUSE_NAMES = ("init_scale too high", "inf or NaN every step", "healthy")
SETTLING = 3  # a run that skips its first 3+ steps in a row started with too high a scale

HINTS = hint_book("ex03", {
    "rule": (
        "Treat the two kinds of step apart: one whose gradients overflowed (found_inf is True: "
        "the step was skipped) and a clean one. For each, decide what happens to the scale and "
        "to tracker. The demo's trace above shows what to reproduce: where the scale drops, and "
        "after how many clean steps it grows.",
        "A skipped step multiplies the scale by backoff_factor and starts the clean count again. "
        "A clean step adds one to the count, and only when the count gets to growth_interval "
        "does the scale grow by growth_factor (and the count starts again too).",
        "if found_inf: return scale * backoff_factor, 0. Otherwise tracker += 1; if tracker == "
        "growth_interval: return scale * growth_factor, 0; else return scale, tracker.",
    ),
    "floor": (
        "Every step of this run overflows, so every step is skipped and each skip backs the "
        "scale off by the same factor. Write the scale of steps 0, 1, 2, ... as powers of two "
        "and look for the pattern.",
        "Step i uses init_scale * backoff_factor**i. With init_scale = 2**a and backoff_factor "
        "0.5 = 2**-1, that is 2**(a - i).",
        "The scale is below 1 once the exponent a - i is negative. Step a uses exactly 2**0 = 1, "
        "which is not below 1, so the first step below 1 is step a + 1; with PyTorch's default "
        "init_scale of 2**16, that is step 16 + 1.",
    ),
    "causes": (
        "Read each trace for two things: how many of its steps were skipped (an x), and whether "
        "the scale recovers after its drops. A scale that starts too high and a model that "
        "produces inf or NaN look different over time.",
        "A run that starts with too high a scale skips a burst of steps in a row at the start, "
        "then settles and trains. A run whose scale only falls and never recovers skips "
        "everything: no scale fixes that. A healthy trace is flat or grows, with rare skips.",
        "Every step skipped: 'inf or NaN every step'. Three or more skips in a row at the start, "
        "then clean steps: 'init_scale too high'. Otherwise: 'healthy'.",
    ),
})


hint = hint_reader(HINTS, __name__)


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
RULE_MISTAKES = {
    "tracker not reset on a skip":
        "a skipped step restarts the count of clean steps at 0 as well as backing the scale off: "
        "your count carried on across a skip, so the scale grew before growth_interval clean "
        "steps had followed it",
    "grows one step late":
        "your rule grows after growth_interval + 1 clean steps, one too many: either it compares "
        "the count before adding this clean step, or it waits for the count to pass "
        "growth_interval (>) instead of reaching it (==). Count the step first, then grow when "
        "the count equals growth_interval",
}


class NotAPair(TypeError):
    """What ``replay`` raises when an update rule returns something other than (scale, tracker)
    with a number for the scale: the learner's return value, not an error inside their code."""

    def __init__(self, result):
        super().__init__(f"expected (scale, tracker); got {result!r}")
        self.result = result


def replay(update: Callable, scales: Sequence[float], skipped: Sequence[bool],
           settings: ScalerSettings) -> list:
    """The scale trace ``update`` gives from ``scales[0]`` with the run's ``skipped`` flags
    (None where ``update`` returns None: the stub); raises ``NotAPair`` where it returns
    anything else that is not a (scale, tracker) pair."""
    scale, tracker, out = float(scales[0]), 0, [float(scales[0])]
    for found_inf in skipped[:-1]:
        result = update(scale, tracker, bool(found_inf), settings.growth_factor,
                        settings.backoff_factor, settings.growth_interval)
        if result is None:
            return None
        if not (isinstance(result, (tuple, list)) and len(result) == 2) \
                or number(result[0]) is None:
            raise NotAPair(result)
        scale, tracker = result
        out.append(number(scale))
    return out


# Settings other than any demo's, with skips at other places: a rule that hard-codes the
# demo's factors or interval (0.5, 2, 10) instead of using its arguments differs here. The run
# ends with 8 skips in a row, which take the scale below 1 (no demo's scale goes there), then
# clean steps: a rule that puts a floor under the scale (max(scale * backoff_factor, 1)),
# which GradScaler does not, differs there.
# backoff_factor is not 1 / growth_factor here (the demo's 2 and 0.5 are): a rule that backs off
# by dividing by growth_factor reproduces the demo and shows only under these settings
OTHER_SETTINGS = ScalerSettings(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.125,
                                growth_interval=3)
OTHER_SKIPPED = ((False,) * 7 + (True, True) + (False,) * 5 + (True,) + (False,) * 4
                 + (True,) * 8 + (False,) * 4)


def _first_difference(mine: Sequence[float], scales: Sequence[float]) -> Optional[int]:
    return next((i for i, (a, b) in enumerate(zip(mine, scales)) if a != float(b)), None)


def _replayed(update: Callable, scales, skipped, settings, hint, context: str = ""):
    """(the learner's rule replayed, None), or (None, the "wrong" grade) where it raised or
    returned something other than (scale, tracker); ``context`` starts that message."""
    try:
        return replay(update, scales, skipped, settings), None
    except NotAPair as exc:
        return None, wrong(RULE, f"{context}update must return (scale, tracker); it returned "
                           f"{exc.result!r}", hint.after(
                               "return two values, the new scale and the new tracker: return "
                               "scale, tracker (on every path, a skipped step's too)"))
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return None, wrong(RULE, f"{context}update raised {type(exc).__name__}: {exc}", hint)


@graded
def check_update_rule(update: Callable, scales: Sequence[float], skipped: Sequence[bool],
                      settings: ScalerSettings) -> Check:
    """Replay the run's ``skipped`` flags through ``update(scale, tracker, found_inf,
    growth_factor, backoff_factor, growth_interval) -> (scale, tracker)`` and compare with the
    ``scales`` the run used, step for step (the run must start with a fresh tracker); then replay
    ``OTHER_SKIPPED`` under ``OTHER_SETTINGS`` against ``reference_update``: the rule must use
    its arguments, not the demo's values."""
    hint = HINTS["rule"]
    if (stub := not_a_function(RULE, update, hint)) is not None:
        return stub
    if len(scales) != len(skipped) or len(scales) < 2:
        raise ValueError("scales and skipped must be the same run's columns, 2 steps or more")
    mine, failed = _replayed(update, scales, skipped, settings, hint)
    if failed is not None:
        return failed
    if mine is None:
        return unanswered(RULE, hint)
    i = _first_difference(mine, scales)
    if i is not None:
        a, b = mine[i], scales[i]
        prev = "skipped" if skipped[i - 1] else "clean"
        known = matching_mistake(  # the whole trace decides it, not step i alone
            {name: lambda run, rule=rule: replay(rule, *run)
             for name, rule in WRONG_RULES.items()}, [((scales, skipped, settings), mine)])
        why = hint.after(RULE_MISTAKES[known]) if known else hint.after(
            "after a skipped step the scale is multiplied by backoff_factor and the clean "
            "count restarts at 0" if skipped[i - 1] else
            "the scale grew (or stayed) at the wrong step: count only the clean steps since "
            "the last change of scale (a growth and a skip both restart the count) and grow "
            "when that count reaches growth_interval, not a step earlier or later")
        return wrong(RULE, f"step {i} (after a {prev} step): your rule gives {a:g}, the run "
                     f"used {float(b):g}", why)
    st = OTHER_SETTINGS
    want = replay(reference_update, [st.init_scale] * len(OTHER_SKIPPED), OTHER_SKIPPED, st)
    other, failed = _replayed(update, want, OTHER_SKIPPED, st, hint, "with other settings, ")
    if failed is not None:
        return failed
    i = None if other is None else _first_difference(other, want)
    if i is not None and want[i] < 1 <= other[i]:
        return wrong(RULE, f"your rule reproduces the run, but where a run skips step after "
                     f"step it keeps the scale at {other[i]:g} at step {i}: it does not let the "
                     f"scale fall below 1", hint.after(
                         "GradScaler puts no floor under the scale: every skipped step multiplies "
                         "it by backoff_factor, below 1 too (exercise 2's run goes there)"))
    if other is None or i is not None:
        said = "nothing" if other is None else f"{other[i]:g}"
        return wrong(RULE, f"your rule reproduces the run, but with growth_factor="
                     f"{st.growth_factor:g}, backoff_factor={st.backoff_factor:g} and "
                     f"growth_interval={st.growth_interval} it gives {said} at step "
                     f"{i if i is not None else 1}, where the rule gives "
                     f"{want[i if i is not None else 1]:g}", hint.after(
                         "use the arguments growth_factor, backoff_factor and growth_interval, "
                         "not the demo's numbers: the same rule runs under any settings"))
    return passed(RULE, f"your rule reproduces all {len(scales)} scales of the run, "
                  f"{plural(sum(map(bool, skipped)), 'skip')} included (and a run under other "
                  f"settings)")


def trace_cause(scales: Sequence[float], skipped: Sequence[bool]) -> str:
    """One of ``CAUSE_NAMES`` for a run's scale trace: every step skipped means a non-finite
    loss or gradient every step; a run of ``SETTLING`` or more skips at the start means the
    scale started too high; otherwise the trace is healthy."""
    if skipped and all(skipped):
        return "inf or NaN every step"
    first = next((i for i, s in enumerate(skipped) if not s), len(skipped))
    return "init_scale too high" if first >= SETTLING else "healthy"


@graded
def check_trace_causes(answer: Mapping[str, str],
                       traces: Mapping[str, Tuple[Sequence[float], Sequence[bool]]]) -> Check:
    """Grade ``answer`` (trace letter -> one of ``CAUSE_NAMES``) against ``trace_cause`` of each
    of ``traces`` (letter -> (scales, skipped)). A wrong grade names the first wrong letter and
    what to look at in its trace, never its cause (shown from the third attempt)."""
    hint = HINTS["causes"]
    if is_blank(answer):
        return unanswered(CAUSES, hint)
    truth = {letter: trace_cause(*traces[letter]) for letter in traces}
    reveal = ", ".join(f"{k}: {truth[k]}" for k in sorted(traces))
    given = keyed(answer, traces)
    if given is None:
        return wrong(CAUSES, f"answer must map each of {', '.join(sorted(traces))} to a cause",
                     hint)
    answer = {k: canonical(v, CAUSE_NAMES) for k, v in given.items()}
    for letter in sorted(traces):
        said = answer[letter]
        if said not in CAUSE_NAMES:
            return wrong(CAUSES, f"{letter}: the causes are {', '.join(map(repr, CAUSE_NAMES))}; "
                         f"got {said!r}", hint)
        real = truth[letter]
        if said != real:
            why = {"inf or NaN every step":
                   f"read trace {letter} to its end: count its skipped steps against all its "
                   f"steps, and see whether its scale ever rises again after a drop",
                   "init_scale too high":
                   f"look at where trace {letter}'s skipped steps sit: how many in a row at the "
                   f"very start, and what the run does after them",
                   "healthy":
                   f"look at how few of trace {letter}'s steps were skipped and where they sit: "
                   f"a scale that probes upward now and then skips a step, and that is its "
                   f"job"}[real]
            return wrong(CAUSES, f"trace {letter} is not '{said}'", hint.after(why), reveal)
    return passed(CAUSES, ", ".join(f"{k}: {answer[k]}" for k in sorted(traces)))


def first_below_one(scales: Sequence[float]) -> Optional[int]:
    """The first step whose scale is below 1, or None."""
    return next((i for i, s in enumerate(scales) if s < 1), None)


def overflow_trace(settings: ScalerSettings, steps: int = 40) -> list:
    """The scales a run with ``settings`` uses when every step overflows (``reference_update``
    replayed with every step skipped)."""
    return replay(reference_update, [settings.init_scale] * steps, [True] * steps, settings)


@graded
def check_steps_below_one(answer, settings: ScalerSettings) -> Check:
    """Grade ``answer``: the first step at which a run with ``settings`` whose every step
    overflows uses a scale below 1 (``overflow_trace``). A wrong grade says whether the answer is
    too early or too late, never the step (shown from the third attempt)."""
    k = math.log2(settings.init_scale)
    hint = HINTS["floor"]
    if is_blank(answer):
        return unanswered(FLOOR, hint)
    scales = overflow_trace(settings, 4 * int(max(k, 1)) + 8)
    truth = first_below_one(scales)
    if truth is None:
        raise ValueError("settings whose scale never falls below 1 while every step overflows")
    given, answer = answer, whole_number(answer)
    if answer is None:
        return wrong(FLOOR, f"answer must be a step number (a whole number); got {given!r}", hint)
    if answer != truth:
        off = (hint.after("'below 1' is strict: a scale of exactly 2**0 = 1 is not below 1; and "
                          "count the steps from 0, the first step using init_scale")
               if abs(answer - truth) == 1 else hint.after(
                   "write the scale each step uses as a power of two: step 0 uses init_scale, "
                   "and every skipped step multiplies it by backoff_factor"))
        way = "early" if answer < truth else "late"
        return wrong(FLOOR, f"step {answer} is too {way}", off,
                     f"step {truth}, the first to use a scale below 1 ({scales[truth]:g})")
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


# The fixed order in which ``lettered_traces`` hands out letters: the i-th run given gets letter
# LETTER_ORDER[i]. Fixed, so that a notebook reads the same everywhere; not the order given, so
# that the cell that builds the traces does not say which run is which letter.
LETTER_ORDER = "CAB"


def lettered_traces(runs: Sequence) -> dict:
    """The scale traces of ``runs`` (up to three objects with ``scales`` and ``skipped``, such
    as lesson 03's ``train_with_scaler`` results) under the letters A, B, C, handed out in the
    fixed order ``LETTER_ORDER`` rather than the order given: what the trace-matching exercise
    shows, without its source saying which run became which letter. Raises ValueError for more
    than three runs."""
    runs = list(runs)
    if not 1 <= len(runs) <= len(LETTER_ORDER):
        raise ValueError(f"runs must hold 1 to {plural(len(LETTER_ORDER), 'run')}; got {len(runs)}")
    letters = [c for c in LETTER_ORDER if c < chr(ord("A") + len(runs))]
    return {letter: (list(run.scales), list(run.skipped))
            for letter, run in sorted(zip(letters, runs))}


def floor_result(prediction, run) -> str:
    """The line lesson 03 prints after its overflow-on-every-step run: the step at which ``run``
    (an object with ``scales`` and ``final_scale``) first used a scale below 1, beside the
    learner's ``prediction``, and only once that prediction is written, so that the notebook's
    saved output does not answer exercise 2 before it is tried."""
    if is_blank(prediction):
        return ("the step at which this run first used a scale below 1 shows here once "
                "exercise 2 above holds your prediction")
    below = first_below_one(list(run.scales) + [run.final_scale])
    return (f"this run first used a scale below 1 at step {below}; you predicted "
            f"{prediction!r}")
