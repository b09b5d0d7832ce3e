"""Lesson 09's exercises, around the doctor's reports (``amp_lessons.doctor``): find the layer
where fp16's inf is born (graded on models the grader builds, each with a hidden overflowing
layer, so that no report printed in the lesson gives it away), compute the loss scale
GradScaler settles at from the report's gradient ranges (graded against the report's own
``scale_exponent``, from ``doctor.scale.reached_scale``), and answer three questions about the
report on your own model (graded against that report)."""
import copy
import math
import sys
from types import SimpleNamespace
from typing import Callable, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from amp_lessons.numerics import formats
from amp_lessons.numerics.precision import as_device
from amp_lessons.tables import plural
from amp_lessons.exercises.check import (Check, graded, hint_book, hint_reader, is_blank,
                                         matching_mistake, not_a_function, number, passed,
                                         skipped, text_key, unanswered, whole_number, wrong)

OVERFLOW = "Exercise 2 (implement): where fp16's inf is born"
SCALE = "Exercise 1 (implement): the loss scale from the report's ranges"
YOURS = "Exercise 3 (run it): your model's report"
QUESTIONS = ("fp16 safe", "scale exponent", "largest activation")

HINTS = hint_book("ex09", {
    "overflow": (
        "inf is born in one layer and only flows through the ones after it. You are looking "
        "for the first layer, in the order the forward pass calls them, whose own output is "
        "past fp16's largest finite value: not the layer with the largest output, and not one "
        "that merely receives an inf from upstream.",
        "Register a forward hook on every leaf module (a module of model.named_modules() "
        "without children) that appends (name, the output's largest magnitude) in call order; "
        "run the forward once in float32 under torch.no_grad(), remove the hooks, and return "
        "the first name whose value is above ex09.fp16_max() (65,504).",
        "seen = []; hooks = [m.register_forward_hook(lambda mod, i, out, n=n: "
        "seen.append((n, float(out.detach().abs().max())))) for n, m in model.named_modules() "
        "if not list(m.children())]; with torch.no_grad(): model(x); then remove each hook and "
        "return next(n for n, v in seen if v > ex09.fp16_max()).",
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


# --- exercise 2: where inf is born ----------------------------------------------------------------

def _leaf_outputs(model: nn.Module, x) -> List[Tuple[str, float]]:
    """(name, largest |output|) of every leaf module of ``model``, in call order, from one
    float32 forward of ``x`` without gradients."""
    seen: List[Tuple[str, float]] = []
    hooks = [m.register_forward_hook(
        lambda mod, i, out, n=n: seen.append((n, float(out.detach().float().abs().max())))
        if isinstance(out, torch.Tensor) else None)
        for n, m in model.named_modules() if n and not list(m.children())]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def first_overflow(model: nn.Module, x) -> Optional[str]:
    """The reference: the first leaf module, in call order, whose own float32 output passes
    fp16's largest finite value (where fp16 autocast's inf is born), or None."""
    return next((n for n, v in _leaf_outputs(model, x) if v > fp16_max()), None)


def reference_first_overflow(model: nn.Module, x) -> Optional[str]:
    """The reference solution, as a learner writes it: forward hooks on the leaf modules, one
    float32 forward, the first output past 65,504."""
    seen = []
    hooks = [m.register_forward_hook(
        lambda mod, i, out, n=n: seen.append((n, float(out.detach().abs().max()))))
        for n, m in model.named_modules() if not list(m.children())]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return next(n for n, v in seen if v > fp16_max())


def _scale_to(model: nn.Module, x, name: str, target: float) -> None:
    """Multiply the Linear ``name`` of ``model`` (weight and bias) by the factor that brings its
    largest output on ``x`` to ``target``."""
    layer = dict(model.named_modules())[name]
    largest = dict(_leaf_outputs(model, x))[name]
    factor = target / largest
    with torch.no_grad():
        layer.weight.mul_(factor)
        if layer.bias is not None:
            layer.bias.mul_(factor)


def overflow_cases(device=None) -> List[Tuple[str, nn.Module, object]]:
    """The models exercise 2 is graded on, each with its input: (description, model, x).
    None of them is the lesson's model, and their overflowing layers sit elsewhere: a small GPT
    whose second block's attention output passes fp16's range, and an MLP where an early layer
    comes close (0.9 x 65,504, still finite), a middle one passes it and a later one is the
    largest of all (8 x): the answer is the middle one, neither the near miss nor the
    largest."""
    from amp_lessons.models import TinyTransformer
    device = as_device(device)
    torch.manual_seed(3)
    gpt = TinyTransformer(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16).to(device)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(4)).to(device)
    _scale_to(gpt, tokens, "blocks.1.proj", 4 * fp16_max())
    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                        nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(6)).to(device)
    for name, target in (("2", 0.9 * fp16_max()), ("5", 2 * fp16_max()), ("7", 8 * fp16_max())):
        _scale_to(mlp, x, name, target)
    return [("a small GPT (tokens in, logits out)", gpt, tokens),
            ("an 8-layer MLP", mlp, x)]


WRONG_OVERFLOW = {
    "the largest output": lambda model, x: max(_leaf_outputs(model, x), key=lambda t: t[1])[0],
    "the last layer inf reaches": lambda model, x: [n for n, v in _leaf_outputs(model, x)
                                                    if v > fp16_max()][-1],
}


@graded
def check_first_overflow(fn: Callable, device=None) -> Check:
    """Grade ``fn(model, x) -> name``: on each of ``overflow_cases`` (built here, never shown in
    the lesson), the name of the first leaf module whose own output passes fp16's largest
    value (``first_overflow``). The references are computed first; ``fn`` gets a copy of each
    model and input. A wrong grade says on which model and what the named layer is (not the
    first past 65,504, or not past it at all), never the right name before the third attempt."""
    hints = HINTS["overflow"]
    if (stub := not_a_function(OVERFLOW, fn, hints)) is not None:
        return stub
    cases = [(what, model, x, first_overflow(model, x), dict(_leaf_outputs(model, x)))
             for what, model, x in overflow_cases(device)]
    reveal = "; ".join(f"{what}: {want}" for what, _, _, want, _ in cases)
    for what, model, x, want, outputs in cases:
        try:
            got = fn(copy.deepcopy(model), x.clone())
        except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
            return wrong(OVERFLOW, f"on {what}: {type(exc).__name__}: {exc}", hints)
        if is_blank(got):
            return unanswered(OVERFLOW, hints)
        if not isinstance(got, str):
            return wrong(OVERFLOW, f"on {what}: expected a layer name (a string, as "
                         f"named_modules() gives it); got {type(got).__name__} {got!r:.60}",
                         hints.after("return the module's name from model.named_modules(), such "
                                     "as 'blocks.0.mlp.2', not the module or its output"))
        name = got.strip()
        if name == want:
            continue
        if name not in outputs:
            return wrong(OVERFLOW, f"on {what}: {name!r} is not one of its leaf modules",
                         hints.after("name a leaf module (one without children) as "
                                     "model.named_modules() names it"), reveal)
        if outputs[name] <= fp16_max():
            near = outputs[name] > 0.5 * fp16_max()
            return wrong(OVERFLOW, f"on {what}: {name}'s own output stays within fp16's range",
                         hints.after("a value close to 65,504 is still finite in fp16: the layer "
                                     "you want returns more than 65,504, in float32" if near else
                                     "measure the model you are given, on its input: the check "
                                     "runs models of its own, not the lesson's"), reveal)
        order = list(outputs)
        if order.index(name) > order.index(want):
            known = next((k for k, bad in WRONG_OVERFLOW.items()
                          if _safe(bad, model, x) == name), None)
            why = ("the largest output is not where inf is born: an earlier layer already "
                   "passed 65,504, and everything after it only carries its inf along"
                   if known == "the largest output" else
                   "inf flows downstream from where it is born: every layer after the first "
                   "overflow receives it. Find the first one, in call order")
            return wrong(OVERFLOW, f"on {what}: {name} passes 65,504, but an earlier layer "
                         f"already did", hints.after(why), reveal)
        return wrong(OVERFLOW, f"on {what}: {name} is not the first to pass 65,504", hints,
                     reveal)
    return passed(OVERFLOW, "; ".join(f"{what}: inf is born in {want} ({outputs[want]:,.0f} > "
                                      f"{fp16_max():,.0f})" for what, _, _, want, outputs in cases))


def _safe(fn, model, x):
    try:
        return fn(model, x)
    except Exception:  # noqa: BLE001 - a mistake that cannot be made here is not this one
        return None


def reference_overflow_layer(report) -> str:
    """The first overflow site in a doctor ``report``: what the lesson's report names."""
    return report.overflow[0]["layer"]


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


@graded
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
        return wrong(SCALE, f"{report.model}: k = {k:g} is not where GradScaler settles",
                     hints.after(_scale_mistake(report, k,
                                                  matching_mistake(WRONG_SCALE, answers))),
                     "; ".join(f"{r.model}: k = {r.scale_exponent}" for r, _ in answers))
    held = held_out_report(reports[0])
    try:
        got = fn(_LayersOnly(held))
        k = whole_number(got)
        said = (f"gives k = {k}" if k is not None else f"returns {got!r:.80}") + \
            ", not where GradScaler settles"
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        k, said = None, f"raised {type(exc).__name__}: {exc}"
    if k != held.scale_exponent:
        return wrong(SCALE, f"right on {', '.join(r.model for r in reports)}, but on a report "
                     f"the check made ({held.model}) your function {said}", hints.after(
                         "compute k from the gradients in report.layers, whatever the report: "
                         "not from report.model or a number read off the lesson's reports"),
                     f"{held.model}: k = {held.scale_exponent}")
    return passed(SCALE, "; ".join(f"{r.model}: 2^{r.scale_exponent}" for r in reports)
                  + ", as the doctor found (and on a report the check made)")


HELD_OUT_SHIFT = 5  # the held-out report's gradients are 2**-5 of a given report's


def held_out_report(report, shift: int = HELD_OUT_SHIFT) -> SimpleNamespace:
    """A report no lesson prints, for ``check_scale_exponent``: ``report``'s layers with every
    gradient magnitude (``grad_absmax``, ``grad_min``) times ``2**-shift``, so that GradScaler
    settles ``shift`` powers of two higher, and its ``scale_exponent`` computed from those
    layers as the doctor computes it (``doctor.scale.reached_scale``). A function that looks k
    up by ``report.model``, or returns a number read off the lesson's report, fails on it."""
    from amp_lessons.doctor.scale import reached_scale
    layers = copy.deepcopy(report.layers)
    for row in layers:
        for key in ("grad_absmax", "grad_min"):
            if number(row.get(key)) is not None and math.isfinite(row[key]):
                row[key] = row[key] * 2.0 ** -shift
    held = SimpleNamespace(model=f"{report.model}, gradients x 2^-{shift}", layers=layers)
    held.scale_exponent = reached_scale(_finite_max(held, "grad_absmax"))
    return held


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


@graded
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
    reveal = ", ".join(f"{q}: {want[q]!r}" for q in QUESTIONS)
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
        return wrong(YOURS, f"fp16 safe: the report does not say {got['fp16 safe']!r}",
                     hints.after(
                         "the advice's last line says whether fp16 with GradScaler is safe "
                         "here; True or False"), reveal)
    if want["scale exponent"] is not None and whole_number(got["scale exponent"]) \
            != want["scale exponent"]:
        return wrong(YOURS, f"scale exponent: {got['scale exponent']!r} is not the report's",
                     hints.after(
                         "2^16 is GradScaler's default start, not where it settles: the "
                         "advice's first line names the power of two it would settle near"
                         if whole_number(got["scale exponent"]) == 16 else
                         "the advice's first line names the power of two GradScaler would settle "
                         "near: give its exponent"), reveal)
    name = _layer_name(report, got["largest activation"])
    row = _layer(report, name)
    best = _layer(report, want["largest activation"])
    if row is None or (row.get("act_absmax") or 0) < (best.get("act_absmax") or 0):
        said = (f"{name}'s act absmax is {_absmax(row)}" if row
                else f"{got['largest activation']!r} is not a layer of the report")
        return wrong(YOURS, f"largest activation: {said}, not the largest", hints.after(
                         "the largest output is not always the last layer's: compare the act "
                         "absmax column over all layers"), reveal)
    return passed(YOURS, f"{report.model}: fp16 {'safe' if want['fp16 safe'] else 'not safe'}, "
                  f"scale 2^{want['scale exponent']}, largest activation in "
                  f"{want['largest activation']} ({_absmax(best)})")
