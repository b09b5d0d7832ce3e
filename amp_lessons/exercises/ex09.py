"""Lesson 09's exercises, answered from the doctor's reports (``amp_lessons.doctor``): name the
layer that overflows fp16 (graded against the report's overflow sites), compute the loss scale
GradScaler settles at from the report's gradient ranges (graded against the report's own
``scale_exponent``, from ``doctor.scale.reached_scale``), and answer three questions about the
report on your own model (graded against that report)."""
import copy
import math
import sys
from typing import Callable, Iterable, Mapping, Optional

from amp_lessons.numerics import formats
from amp_lessons.tables import plural
from amp_lessons.exercises.check import (Check, hint_book, hint_reader, is_blank, matching_mistake, not_a_function,
                    number, passed, skipped, text_key, unanswered, whole_number, wrong)

OVERFLOW = "Exercise 2 (read the report): the layer that overflows fp16"
SCALE = "Exercise 1 (implement): the loss scale from the report's ranges"
YOURS = "Exercise 3 (run it): your model's report"
QUESTIONS = ("fp16 safe", "scale exponent", "largest activation")

HINTS = hint_book("ex09", {
    "overflow": (
        "Under fp16 autocast, inf appears in many layers of this model, but it is born in only "
        "one: look for the layer whose own activations are larger than the biggest finite "
        "number fp16 holds, not for one that merely receives an inf from upstream.",
        "The report's 'overflow sites' table (report.overflow) lists each layer whose "
        "activations pass fp16's 65,504, with the value found; report.fp16_nonfinite lists "
        "where inf/NaN shows up, in call order, and its first entry is where it starts.",
        "my_overflow_layer = over.overflow[0]['layer'] (also over.fp16_nonfinite[0]): the MLP "
        "output Linear of the first block that section 4 scaled.",
    ),
    "scale": (
        "GradScaler multiplies the loss, and so every gradient, by a power of two, and grows "
        "it until something overflows fp16. Which single gradient value in the report decides "
        "how far it can grow, and which fp16 limit must it stay under?",
        "Take the largest grad_absmax over report.layers (a finite one); the scale 2**k must "
        "keep it at or below fp16's largest value (65,504, ex09.fp16_max()): the largest "
        "whole k with g * 2**k <= 65504.",
        "g = max(r['grad_absmax'] for r in report.layers if r['grad_absmax']); "
        "return math.floor(math.log2(65504 / g))",
    ),
    "yours": (
        "Everything asked is in the report printed above the cell: its advice section, its "
        "loss-scale line, and its table of layers. Read them rather than guessing from the "
        "model's code.",
        "fp16 safe: mine.advice['fp16_safe']; scale exponent: the k of 2^k in the advice's "
        "first line (mine.scale_exponent); largest activation: the layer with the largest "
        "act_absmax in mine.layers.",
        "{'fp16 safe': mine.advice['fp16_safe'], 'scale exponent': mine.scale_exponent, "
        "'largest activation': max(mine.layers, key=lambda r: r['act_absmax'] or 0)['layer']}",
    ),
})


hint = hint_reader(HINTS, __name__)


def fp16_max() -> float:
    """fp16's largest finite value (65,504), from ``formats``."""
    return formats.get_format("fp16").max


def _layer(report, name) -> Optional[Mapping]:
    return next((r for r in report.layers if r["layer"] == name), None)


def _layer_name(report, answer) -> str:
    """``answer`` as one of ``report``'s layer names: stripped, and matched without regard to
    case where exactly one layer matches so; else the stripped text, as given."""
    name = str(answer).strip()
    names = [r["layer"] for r in report.layers]
    if name in names:
        return name
    same = [n for n in names if n.lower() == name.lower()]
    return same[0] if len(same) == 1 else name


def _absmax(row: Optional[Mapping]) -> str:
    """A row's act_absmax for a message: "none recorded" where the doctor left it None (a
    layer whose output was all zeros, for one)."""
    value = (row or {}).get("act_absmax")
    return f"{value:.3g}" if number(value) is not None else "none recorded"


# --- exercise 1 ---------------------------------------------------------------------------------

def reference_overflow_layer(report) -> str:
    """The reference answer: the first overflow site in the report."""
    return report.overflow[0]["layer"]


WRONG_OVERFLOW = {"a layer inf only reaches": lambda r: r.fp16_nonfinite[-1],
                  "not a layer of the report": lambda r: "the MLP"}


def check_overflow_layer(answer, report) -> Check:
    """Grade ``answer`` (a layer name): the layer whose activations pass fp16's largest value
    in ``report`` (its ``overflow`` sites; any of them counts)."""
    hints = HINTS["overflow"]
    if is_blank(answer):
        return unanswered(OVERFLOW, hints)
    if not report.overflow:
        return skipped(OVERFLOW, "nothing overflows fp16 in this report")
    sites = {o["layer"]: o for o in report.overflow}
    name = _layer_name(report, answer)
    if name in sites:
        return passed(OVERFLOW, f"{name} ({sites[name]['kind']}) reaches "
                      f"{sites[name]['value']:,.0f}, past fp16's {fp16_max():,.0f}")
    row = _layer(report, name)
    if row is None:
        return wrong(OVERFLOW, f"{name!r} is not a layer of the report", hints.after(
            "answer with a name from the report's layer column (a module's name as "
            "named_modules() gives it, such as blocks.0.qkv), not a description"))
    largest = row.get("act_absmax") or 0.0
    if name in report.fp16_nonfinite:
        return wrong(OVERFLOW, f"inf reaches {name}, but its own activations stay at "
                     f"{largest:.3g} in fp32", hints.after(
                         "inf flows downstream from where it is born: every layer after the "
                         "first overflow receives it. Find the first one, whose own output is "
                         "past fp16's largest value"))
    return wrong(OVERFLOW, f"{name}'s largest activation is {largest:.3g}, under fp16's "
                 f"{fp16_max():,.0f}", hints)


# --- exercise 2 ---------------------------------------------------------------------------------

def _finite_max(report, key: str) -> Optional[float]:
    values = [r[key] for r in report.layers if isinstance(r.get(key), (int, float))
              and math.isfinite(r[key]) and r[key] > 0]
    return max(values) if values else None


def reference_scale_exponent(report) -> int:
    """The reference solution: the largest ``k`` with the largest gradient times ``2**k`` at or
    under fp16's largest value."""
    return math.floor(math.log2(fp16_max() / _finite_max(report, "grad_absmax")))


def _from_activations(report):
    return math.floor(math.log2(fp16_max() / _finite_max(report, "act_absmax")))


def _rounded_up(report):
    return math.ceil(math.log2(fp16_max() / _finite_max(report, "grad_absmax")))


def _from_smallest(report):
    smallest = min(r["grad_min"] for r in report.layers if r.get("grad_min"))
    return math.floor(math.log2(fp16_max() / smallest))


WRONG_SCALE = {"from the activations": _from_activations, "rounded up": _rounded_up,
               "from the smallest gradient": _from_smallest,
               "the default init_scale": lambda report: 16}


class _LayersOnly:
    """What ``my_scale_exponent`` is given: a report's ``model`` name and a copy of its
    ``layers``; the doctor's own answer (``scale_exponent``, the advice) is held back, and
    asking for it says so."""

    def __init__(self, report):
        self.model = report.model
        self.layers = copy.deepcopy(report.layers)

    def __getattr__(self, name):
        raise AttributeError(f"the check gives your function report.layers only (and "
                             f"report.model), not report.{name}: compute k from the layers")

    def __repr__(self) -> str:
        return f"<{self.model}: {plural(len(self.layers), 'layer')}>"


def _scale_mistake(report, k, known: Optional[str]) -> str:
    """What is wrong with exponent ``k`` for ``report``, for the hint after the check."""
    want, g = report.scale_exponent, _finite_max(report, "grad_absmax")
    overflow = k == want + 1 and g * 2.0 ** k > fp16_max()  # the one case it is asked about
    if k == 2.0 ** want:
        return ("that is the scale 2**k itself: return k, the exponent (the scale is 2**k), not "
                "the scale")
    if known == "the default init_scale" or (known is None and k == 16 and want != 16):
        return ("2^16 is GradScaler's default init_scale, where it starts, not where it "
                "settles: compute k from the report's gradients")
    if known == "from the activations" or (known is None and k == _from_activations(report)
                                           and not overflow):
        return ("the loss scale multiplies the gradients, not the activations: use the "
                "gradients' largest value")
    if known == "from the smallest gradient":
        return ("at that scale the largest gradient overflows fp16 and GradScaler halves it: the "
                "largest gradient decides the ceiling, not the smallest")
    if known == "rounded up" or overflow:
        return (f"at 2^{k:g} the largest gradient becomes {g * 2.0 ** k:,.0f}, past "
                f"{fp16_max():,.0f}: round the exponent down, to the largest k that fits")
    if k > want:
        return ("at that scale the largest gradient overflows fp16 and GradScaler halves it: the "
                "largest gradient decides the ceiling, not the smallest")
    return "GradScaler keeps growing the scale while the largest gradient still fits"


def check_scale_exponent(fn: Callable, reports: Iterable) -> Check:
    """Grade ``fn(report) -> k`` on each of ``reports``: the exponent of the loss scale ``2**k``
    GradScaler settles at, equal to the report's own ``scale_exponent``. ``fn`` is given a copy
    of the report's ``layers`` (and its ``model`` name) only, so that returning the doctor's
    answer, or changing the report, is not possible."""
    hints = HINTS["scale"]
    if (stub := not_a_function(SCALE, fn, hints)) is not None:
        return stub
    reports = [r for r in reports if r.scale_exponent is not None]
    if not reports:
        return skipped(SCALE, "no report here has a nonzero gradient")
    answers = []
    for report in reports:
        try:
            got = fn(_LayersOnly(report))
        except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
            return wrong(SCALE, f"{type(exc).__name__}: {exc}", hints)
        if is_blank(got):
            return unanswered(SCALE, hints)
        k = number(got)
        if k is None or not math.isfinite(k) or k != int(k):
            return wrong(SCALE, f"{report.model}: expected a whole exponent k; got {got!r}",
                         hints.after("return k, the exponent, not the scale 2**k: a whole "
                                     "number"))
        answers.append((report, k))
    off = [(report, k) for report, k in answers if k != report.scale_exponent]
    if off:
        report, k = off[0]
        want = report.scale_exponent
        return wrong(SCALE, f"{report.model}: k = {k:g}; GradScaler settles at 2^{want}",
                     hints.after(_scale_mistake(report, k,
                                                  matching_mistake(WRONG_SCALE, answers))))
    return passed(SCALE, "; ".join(f"{r.model}: 2^{r.scale_exponent}" for r in reports)
                  + ", as the doctor found")


# --- exercise 3 ---------------------------------------------------------------------------------

def reference_answers(report) -> dict:
    """The reference answers, read from ``report``."""
    return {"fp16 safe": report.advice["fp16_safe"], "scale exponent": report.scale_exponent,
            "largest activation": max(report.layers,
                                      key=lambda r: r.get("act_absmax") or 0)["layer"]}


WRONG_ANSWERS = {"the default init_scale": lambda r: {**reference_answers(r),
                                                      "scale exponent": 16},
                 "the last layer": lambda r: {**reference_answers(r),
                                              "largest activation": r.layers[-1]["layer"]}}


def _is_bool(value) -> bool:
    """True for True/False, also as numpy's bool (what a comparison on report values gives)."""
    numpy = sys.modules.get("numpy")  # loaded wherever a value is a numpy bool
    return isinstance(value, bool) or numpy is not None and isinstance(value, numpy.bool_)


def check_report_answers(answers, report) -> Check:
    """Grade ``answers`` ({"fp16 safe": bool, "scale exponent": int, "largest activation":
    layer name}) against ``report`` (the doctor's report on your model)."""
    hints = HINTS["yours"]
    if not isinstance(answers, Mapping):
        return wrong(YOURS, f"expected a dict with {', '.join(QUESTIONS)}; got "
                     f"{type(answers).__name__}", hints)
    if is_blank(answers):
        return unanswered(YOURS, hints)
    want = reference_answers(report)
    names = {text_key(q): q for q in QUESTIONS}
    got = {names[text_key(k)]: v for k, v in answers.items() if text_key(k) in names}
    missing = [q for q in QUESTIONS if q not in got]
    if missing:
        return wrong(YOURS, f"no answer for {', '.join(map(repr, missing))}: the dict needs the "
                     f"keys {', '.join(map(repr, QUESTIONS))}", hints)
    if not _is_bool(got["fp16 safe"]):
        return wrong(YOURS, f"fp16 safe: expected True or False; got {got['fp16 safe']!r}",
                     hints.after("answer fp16 safe with the bool True or False (no quotes), "
                                 "as the advice's last line decides it"))
    if bool(got["fp16 safe"]) != want["fp16 safe"]:
        return wrong(YOURS, f"fp16 safe: {got['fp16 safe']!r}; the report says "
                     f"{want['fp16 safe']}", hints.after(
                         "the advice's last line says whether fp16 with GradScaler is safe "
                         "here; True or False"))
    if want["scale exponent"] is not None and whole_number(got["scale exponent"]) \
            != want["scale exponent"]:
        return wrong(YOURS, f"scale exponent: {got['scale exponent']!r}; the report's is "
                     f"{want['scale exponent']}", hints.after(
                         "2^16 is GradScaler's default start, not where it settles: the "
                         "advice's first line names the power of two it would settle near"
                         if whole_number(got["scale exponent"]) == 16 else
                         "the advice's first line names the power of two GradScaler would settle "
                         "near: give its exponent"))
    name = _layer_name(report, got["largest activation"])
    row = _layer(report, name)
    best = _layer(report, want["largest activation"])
    if row is None or (row.get("act_absmax") or 0) < (best.get("act_absmax") or 0):
        said = (f"{name}'s act absmax is {_absmax(row)}" if row
                else f"{got['largest activation']!r} is not a layer of the report")
        return wrong(YOURS, f"largest activation: {said}; the largest is {best['layer']}'s "
                     f"({_absmax(best)})", hints.after(
                         "the largest output is not always the last layer's: compare the act "
                         "absmax column over all layers"))
    return passed(YOURS, f"{report.model}: fp16 {'safe' if want['fp16 safe'] else 'not safe'}, "
                  f"scale 2^{want['scale exponent']}, largest activation in "
                  f"{want['largest activation']} ({_absmax(best)})")
