"""Lesson 07's exercises: per-tensor and per-row amax scaling (graded against the e4m3 format's
limits in ``amp_lessons.numerics.formats``), and a module filter for ``convert_to_float8_training``
(graded against a conversion plan: which Linear layers to keep in bf16, and why)."""
import re
from typing import Callable, List, Mapping, Optional, Sequence

import torch
from torch import nn

from amp_lessons.numerics import formats
from amp_lessons.tables import plural
from amp_lessons.exercises.check import (Check, graded, hint_book, hint_reader, is_blank,
                                         not_a_function, passed, read_bool, tensor_problem,
                                         unanswered, wrong)

TENSOR = "Exercise 1 (implement): per-tensor amax scaling"
ROW = "Exercise 2 (implement): per-row amax scaling"
FILTER = "Exercise 3 (implement): which layers to convert"

HINTS = hint_book("ex07", {
    "tensor": (
        "The scale must carry the tensor's largest magnitude exactly onto the largest finite "
        "value e4m3 holds. Which single number measures 'largest magnitude' when the tensor has "
        "negative values too, and what is e4m3's top value (section 1's table)?",
        "amax is the largest |x| over the whole tensor; e4m3's largest finite value is 448 "
        "(ex07.e4m3_max()). The scale multiplies x, so amax * scale must equal that maximum.",
        "return 448.0 / x.abs().max()",
    ),
    "row": (
        "The same as the per-tensor scale, with one amax for each row: reduce over the dimension "
        "that runs along a row only, and keep the result shaped so that x * scales multiplies "
        "every row by its own scale.",
        "x.abs().amax(dim=...) reduces one dimension; a row's values run along the last one. "
        "keepdim=True leaves a (rows, 1) column, which broadcasts over each row.",
        "return 448.0 / x.abs().amax(dim=-1, keepdim=True)",
    ),
    "filter": (
        "Section 4 lists three reasons to keep a Linear in bf16. Your filter sees one layer at a "
        "time, with its name (fqn) and its module (in_features, out_features): test each reason "
        "on it and return False if any applies.",
        "Keep in bf16 (return False): the first and the last Linear of big_gpt (compare fqn with "
        "the first and last names of the list in the cell's comment), any layer with a "
        "dimension that is not a multiple of 16, and any with a dimension under MIN_FEATURES. "
        "Return True for the rest.",
        "names = [n for n, m in big_gpt.named_modules() if type(m).__name__ == 'Linear']; in "
        "my_filter: if fqn in (names[0], names[-1]): return False; then return "
        "all(d % 16 == 0 and d >= MIN_FEATURES for d in (module.in_features, "
        "module.out_features)).",
    ),
})


hint = hint_reader(HINTS, __name__)


def e4m3_max() -> float:
    """The largest finite e4m3 value (448), from ``formats``."""
    return formats.get_format("e4m3").max


def test_tensor(seed: int = 0) -> torch.Tensor:
    """Rows at very different magnitudes, one outlier, negative values: what a scale must
    handle."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-4, 1, 8).unsqueeze(1)
    x[3, 5] = -900.0
    return x


def reference_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """The reference solution: e4m3's max over the tensor's largest magnitude."""
    return e4m3_max() / x.abs().max()


def reference_per_row(x: torch.Tensor) -> torch.Tensor:
    """The reference solution: one scale per row, shape (rows, 1)."""
    return e4m3_max() / x.abs().amax(dim=-1, keepdim=True)


def _round_trip_error(x: torch.Tensor, scale: torch.Tensor) -> float:
    back = formats.round_to(x.double() * scale.double(), "e4m3") / scale.double()
    return float(((back - x.double()).abs() / x.double().abs().clamp(min=1e-30)).median())


WRONG_TENSOR = {"inverted": lambda x: x.abs().max() / 448.0,
                "no abs": lambda x: 448.0 / x.max(),
                "e5m2's max": lambda x: 57344.0 / x.abs().max()}
WRONG_ROW = {"per column": lambda x: 448.0 / x.abs().amax(dim=0, keepdim=True),
             "per tensor": lambda x: 448.0 / x.abs().max()}


def _scale_hint(pairs, what, hints, no_abs=None):
    """The hint for wrong scales: ``pairs`` holds (the learner's, the right) scales for each
    input tensor the scale was computed on, the graded one first. Each typical mistake is tested
    for itself on the graded tensor (``no_abs`` is the scale from amax without ``abs``); scales
    off by one factor on every value of every input (so amax is found) are told to check the
    format's maximum; a zero, negative or non-finite scale is told what a scale must be;
    anything else gets the exercise's own hints."""
    g, w = (torch.as_tensor(t, dtype=torch.float64) for t in pairs[0])
    if torch.allclose(g, 1 / w, rtol=1e-4):
        return hints.after("that is the inverse: the scale multiplies x up to e4m3's max, so "
                           "max / amax")
    if torch.allclose(g, w * 57344.0 / e4m3_max(), rtol=1e-4):
        return hints.after("57344 is e5m2's max (gradients); forward tensors use e4m3, whose "
                           "max is 448")
    if no_abs is not None and torch.allclose(g, torch.as_tensor(no_abs, dtype=torch.float64),
                                             rtol=1e-4):
        return hints.after(f"amax is the largest |x| ({what}): use x.abs(), not x, so negative "
                           f"outliers count")
    if not bool(torch.isfinite(g).all()) or bool((g <= 0).any()):
        bad = "a scale of 0" if bool((g == 0).any()) else "a NaN or infinite scale" if not bool(
            torch.isfinite(g).all()) else "a negative scale"
        return hints.after(f"{bad} cannot carry amax onto e4m3's maximum: x * scale "
                           f"must reach {e4m3_max():g} at amax, so the scale is a positive, "
                           f"finite max / amax")
    ratios = torch.cat([(torch.as_tensor(a, dtype=torch.float64)
                         / torch.as_tensor(b, dtype=torch.float64)).flatten() for a, b in pairs])
    if len(ratios) > 1 and bool(torch.isfinite(ratios).all()) and torch.allclose(
            ratios, ratios[:1].expand_as(ratios), rtol=1e-4):
        return hints.after(f"your scales are {float(ratios[0]):.4g}x the right ones everywhere, "
                           f"so amax is found: the maximum it divides is not e4m3's "
                           f"{e4m3_max():g} (torch.float8_e4m3fn's)")
    return hints


def _other_tensor() -> torch.Tensor:
    """A second input for a per-tensor scale, without the outlier: one number cannot tell a
    wrong maximum from a wrong amax, two tensors can."""
    x = test_tensor(seed=1)
    x[3, 5] = 0.5
    return x


def _scale_on(fn, x):
    """``fn``'s per-tensor scale of a copy of ``x`` as a 0-dim float64 tensor, or None."""
    try:
        got = fn(x.clone())
        if tensor_problem(got, x.device, x.dtype) is not None:
            return None
        return torch.as_tensor(got, dtype=torch.float64).reshape(())
    except Exception:  # noqa: BLE001 - the learner's code on a second input: no more to learn
        return None


def _held_out(fn, reference, hint, name: str = TENSOR) -> Optional[Check]:
    """A wrong grade where ``fn``, right on the graded tensor, is not right on ``_other_tensor()``
    (a scale computed once and returned as a constant is right on one tensor only), else None."""
    other = _other_tensor()
    want = reference(other)
    try:
        got = torch.as_tensor(fn(other.clone()), dtype=torch.float64)
        right = got.shape == want.shape and torch.allclose(got, want.double(), rtol=1e-4)
    except Exception:  # noqa: BLE001 - the learner's code on a second input
        right = False
    if right:
        return None
    return wrong(name, "right on the lesson's tensor, but not on another tensor of the same "
                 "shape", hint.after("compute the scale from the x your function receives, "
                                     "not from the lesson's tensor or a number worked out once"))


_SAME_DEVICE = ("compute the scale from x with torch operations, on x's device, and return it "
                "in x's dtype (no .to(...), no .double())")


def _answer(name: str, fn: Callable, x: torch.Tensor, hint, what: str):
    """``(fn's answer, None)`` for ``fn`` called on a copy of ``x``, or ``(None, the Check to
    return)`` where it raised, returned nothing, changed ``x`` in place, or returned a tensor
    on another device or of another dtype (``what`` names the answer in that message)."""
    given = x.clone()
    try:
        got = fn(given)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return None, wrong(name, f"{type(exc).__name__}: {exc}", hint)
    if is_blank(got):
        return None, unanswered(name, hint)
    if not torch.equal(given, x):
        return None, wrong(name, "your function changed x in place", hint.after(
            "a scale is read from x, never written into it: use out-of-place operations "
            "(x.abs(), not x.abs_(); no x *= ...)"))
    if (problem := tensor_problem(got, x.device, x.dtype, what)) is not None:
        return None, wrong(name, problem, hint.after(_SAME_DEVICE))
    return got, None


@graded
def check_per_tensor_scale(fn: Callable) -> Check:
    """Grade ``fn(x) -> scale``: e4m3's max over ``amax(|x|)`` (a 0-dim tensor or a number).
    The reference is computed first; ``fn`` gets a copy of ``x`` (an answer that changes its
    input in place changes nothing the grade reads); a tensor must come back on ``x``'s device,
    in its dtype. A wrong grade never shows the right scale before the third attempt."""
    hint = HINTS["tensor"]
    if (stub := not_a_function(TENSOR, fn, hint)) is not None:
        return stub
    x = test_tensor()
    want = reference_per_tensor(x)  # the reference first, on the grader's own x
    got, failed = _answer(TENSOR, fn, x, hint, "the scale")
    if failed is not None:
        return failed
    try:
        g = torch.as_tensor(got, dtype=torch.float64).reshape(())
    except (RuntimeError, TypeError, ValueError):
        what = (f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor)
                else f"{got!r:.80}")
        return wrong(TENSOR, f"expected one scale for the whole tensor; got {what}", hint)
    if not torch.allclose(g, want.double(), rtol=1e-4):
        pairs = [(g, want)]
        other = _other_tensor()
        g2 = _scale_on(fn, other)
        if g2 is not None:
            pairs.append((g2, reference_per_tensor(other)))
        return wrong(TENSOR, f"your scale, {float(g):.4g}, does not put the tensor's largest "
                     f"magnitude on e4m3's largest value",
                     _scale_hint(pairs, "over the whole tensor", hint, e4m3_max() / x.max()),
                     f"{float(want):.4g} (448 / amax(|x|))")
    if (held := _held_out(fn, reference_per_tensor, hint)) is not None:
        return held
    return passed(TENSOR, f"scale {float(want):.4g}; median relative error after an e4m3 round "
                  f"trip {_round_trip_error(x, want):.2%}")


@graded
def check_per_row_scale(fn: Callable) -> Check:
    """Grade ``fn(x) -> scales``: one e4m3 scale per row, shape ``(rows, 1)``. The reference is
    computed first; ``fn`` gets a copy of ``x``; a tensor must come back on ``x``'s device, in
    its dtype."""
    hint = HINTS["row"]
    if (stub := not_a_function(ROW, fn, hint)) is not None:
        return stub
    x = test_tensor()
    want = reference_per_row(x)  # the reference first, on the grader's own x
    got, failed = _answer(ROW, fn, x, hint, "the tensor of scales")
    if failed is not None:
        return failed
    try:
        g = torch.as_tensor(got, dtype=torch.float64)
    except (RuntimeError, TypeError, ValueError):
        try:  # a list of one-value tensors, one per row
            g = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()) for v in got])
        except Exception:  # noqa: BLE001 - not numbers: say so
            return wrong(ROW, f"expected a tensor of scales, one per row; got "
                         f"{type(got).__name__} {got!r:.80}", hint)
    if g.shape != want.shape:
        if g.numel() == x.shape[1]:
            what, why = "one scale per column", hint.after(
                "amax over dim 0 takes each column's largest value, across the rows: reduce "
                "over the last dimension instead, the one a row runs along")
        elif g.numel() == 1:
            what, why = "one scale for the whole tensor", hint.after(
                "reduce over each row's own values only (one dimension), not over everything")
        else:
            what, why = f"shape {tuple(g.shape)}", hint.after(
                "keep the reduced dimension (keepdim=True): a (rows, 1) column broadcasts over "
                "each row")
        return wrong(ROW, f"expected shape {tuple(want.shape)}; got {what}", why)
    if not torch.allclose(g, want.double(), rtol=1e-4):
        return wrong(ROW, "your scales do not put each row's largest magnitude on e4m3's "
                     "largest value",
                     _scale_hint([(g, want)], "of each row", hint,
                                 e4m3_max() / x.amax(dim=-1, keepdim=True)),
                     "448 / amax(|row|) for each row, shape (rows, 1)")
    if (held := _held_out(fn, reference_per_row, hint, ROW)) is not None:
        return held
    tensor_err = _round_trip_error(x, reference_per_tensor(x))
    return passed(ROW, f"median relative error after an e4m3 round trip {_round_trip_error(x, want):.2%} "
                  f"(one scale for the tensor: {tensor_err:.2%})")


def wrong_filter_all_linear(module: nn.Module, fqn: str) -> bool:
    """A typical wrong answer: convert every Linear."""
    return isinstance(module, nn.Linear)


def plan_threshold(plan: Sequence[Mapping]) -> Optional[int]:
    """The width under which ``plan`` (``measure.float8.conversion_plan`` rows) calls a layer
    small, read from its reasons ("large GEMM: both dimensions >= 2,048", "small: 256 < 2,048
    features"); None where no reason names it."""
    for r in plan:
        m = re.search(r">= ([\d,]+)$|< ([\d,]+) features", str(r.get("reason", "")))
        if m:
            return int((m.group(1) or m.group(2)).replace(",", ""))
    return None


def held_out_models(min_features: int) -> List[nn.Module]:
    """Two GPTs the lesson never shows, on the meta device (no memory), planned by the same
    rules: one with three blocks at ``min_features`` wide (the middle layers go to FP8), one a
    little wider but with a width that is not a multiple of 16 (every layer stays bf16). A
    filter that copies the lesson's plan instead of applying its rules fails on them."""
    from amp_lessons.models import TinyTransformer
    width = 16 * max(2, -(-min_features // 16))
    with torch.device("meta"):
        return [TinyTransformer(vocab_size=1000, d_model=width, n_layers=3, n_heads=8,
                                seq_len=64),
                TinyTransformer(vocab_size=1000, d_model=width + 8, n_layers=1, n_heads=8,
                                seq_len=64)]


class NotABool(Exception):
    """A filter returned something other than True or False for a layer (the message says
    what, for which layer)."""


def _filter_answers(fn: Callable, model: nn.Module) -> dict:
    """``fn``'s answer for every Linear of ``model``, each read with ``read_bool`` (None and
    ``...`` kept: the stub's); ``NotABool`` for any other value: a string such as "no" is true
    to Python, a tensor of several values has no truth, and neither is an answer."""
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        said = fn(m, name)
        if said is None or said is Ellipsis:
            out[name] = said
            continue
        value, why = read_bool(said, f"your filter's answer for {name}")
        if why:
            raise NotABool(why)
        out[name] = value
    return out


@graded
def check_module_filter(fn: Callable, model: nn.Module, plan: Sequence[Mapping]) -> Check:
    """Grade ``fn(module, fqn) -> bool`` (torchao's ``module_filter_fn``: True = convert to FP8)
    on every ``nn.Linear`` of ``model`` against ``plan`` (rows with ``layer``, ``precision``
    "float8" | "bf16" and ``reason``), then on ``held_out_models`` planned by the same rules
    (``measure.float8.conversion_plan`` at the plan's threshold) where ``model`` is a GPT of
    that family (``models.TinyTransformer``, whose layer names they share): the plan of
    ``model`` is printed in the lesson, so a filter must apply the rules, not copy the table."""
    hint = HINTS["filter"]
    if (stub := not_a_function(FILTER, fn, hint)) is not None:
        return stub
    from amp_lessons.measure.float8 import conversion_plan
    from amp_lessons.models import TinyTransformer
    threshold = plan_threshold(plan)
    others = ([(m, conversion_plan(m, threshold)) for m in held_out_models(threshold)]
              if threshold and isinstance(model, TinyTransformer) else [])
    rows = {r["layer"]: r for r in plan}
    try:
        answers = _filter_answers(fn, model)
    except NotABool as exc:
        return wrong(FILTER, str(exc), hint.after(
            "return a bool for each layer: True to convert it to FP8, False to keep it in bf16 "
            "(a comparison such as min(m.in_features, m.out_features) >= MIN_FEATURES gives one)"))
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(FILTER, f"{type(exc).__name__}: {exc}", hint)
    if all(v is None or v is Ellipsis for v in answers.values()):
        return unanswered(FILTER, hint)
    off = [(name, bool(said)) for name, said in answers.items()
           if bool(said) != (rows[name]["precision"] == "float8")]
    if len(off) == 1:
        (name, said), = off
        verb = "converts" if said else "keeps"
        return wrong(FILTER, f"your filter {verb} {name} ({rows[name]['in']} -> "
                     f"{rows[name]['out']}), against the plan's rules",
                     hint.after(rows[name]["reason"]))
    if off:  # every layer it gets wrong, with each one's reason: not the first layer's alone
        parts = [f"{verb} {', '.join(n for n, s in off if s == converts)}"
                 for verb, converts in (("converts", True), ("keeps", False))
                 if any(s == converts for _, s in off)]
        reasons = []
        for name, _ in off:
            reason = rows[name]["reason"]
            if reason not in [r for _, r in reasons]:
                reasons.append((name, reason))
        return wrong(FILTER, f"your filter disagrees with the plan on {len(off)} of "
                     f"{len(answers)} Linear layers: it {' and '.join(parts)}",
                     hint.after("; ".join(f"{name}: {reason}" for name, reason in reasons)))
    for other, other_plan in others:
        width = other_plan[0]["in"]
        try:
            said = _filter_answers(fn, other)
        except NotABool as exc:
            return wrong(FILTER, f"on another GPT (d_model {width:,}): {exc}", hint)
        except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
            return wrong(FILTER, f"on another GPT (d_model {width:,}): {type(exc).__name__}: "
                         f"{exc}", hint)
        wrong_layers = [r for r in other_plan if bool(said[r["layer"]]) != (
            r["precision"] == "float8")]
        if wrong_layers:
            r = wrong_layers[0]
            verb = "converts" if said[r["layer"]] else "keeps"
            return wrong(FILTER, f"right on big_gpt, but on another GPT (d_model {width:,}, "
                         f"{len(other_plan)} Linear layers) your filter {verb} {r['layer']} "
                         f"({r['in']:,} -> {r['out']:,}) against the rules: it follows "
                         f"big_gpt's table, not the rules behind it", hint.after(
                             "decide from the layer in front of you: its place (first or last "
                             "Linear of the model it belongs to), its two dimensions against 16 "
                             "and MIN_FEATURES; not from a list of big_gpt's names"))
    n = sum(r["precision"] == "float8" for r in plan)
    more = f", and on {plural(len(others), 'other GPT')}" if others else ""
    return passed(FILTER, f"{n} of {len(plan)} Linear layers to FP8, as the plan says{more}")
