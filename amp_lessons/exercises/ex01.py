"""Lesson 01's exercises: predict fp16 rounding, find the smallest loss scale that flushes no
gradient, keep an fp32 master weight. Graded with ``amp_lessons.numerics.formats``."""
import math
from typing import Callable, Mapping, Sequence

import torch

from amp_lessons.numerics import formats
from amp_lessons.exercises.check import (Check, close, graded, hint_book, hint_reader, is_blank,
                                         passed, read_number, skipped, unanswered, whole_number,
                                         wrong)

PREDICT = "Exercise 1 (predict, then run): fp16 rounding"
SCALE = "Exercise 3 (find it): the smallest loss scale that flushes nothing"
MASTER = "Exercise 2 (implement): an fp32 master weight"

HINTS = hint_book("ex01", {
    "predict": (
        "Reason with the spacing of fp16 numbers, not with decimal arithmetic: section 1's table "
        "gives the gap between 1 and the next fp16 value, and every addition is rounded to the "
        "nearest value fp16 can hold before the next one starts.",
        "Next to 1 the fp16 gap is 2**-10 = 0.000977: is 1e-4 more or less than half of it? For "
        "the sum, the gap doubles at every power of two (2, 4, 8...), so the larger the running "
        "total, the coarser each added 0.01 is rounded.",
        "1e-4 is less than half the gap, so 1 + 1e-4 rounds back to exactly 1 (the update is "
        "swamped). The exact sum is 10, but above 8 the gap is 2**-7 = 0.0078 and each 0.01 lands "
        "on a neighbour: the errors add up to a little below 10 "
        "(al.formats.accumulate(0.01, 1000, 'fp16') computes it).",
    ),
    "master": (
        "Section 3 showed where a small update gets lost: in the addition into a 16-bit weight. A "
        "master weight is the copy that is never rounded to 16 bits between steps; the 16-bit "
        "copy is made from it, not the other way round.",
        "Hold the running weight as a 32-bit tensor and the update as a torch.float16 tensor; at "
        "each step cast the update up and add it to the 32-bit weight. Make the 16-bit copy once, "
        "at the end, and return it as a Python float.",
        "master = torch.tensor(start, dtype=torch.float32); u = torch.tensor(update, "
        "dtype=torch.float16); then `steps` times: master = master + u.float(); finally return "
        "float(master.half()).",
    ),
    "scale": (
        "A loss scale multiplies every gradient by the same power of two, so it only has to lift "
        "the smallest nonzero gradient into fp16's range. Measure rather than guess: "
        "al.formats.scaled_fractions(grads, 2.0**k, 'fp16')['flushed'] is the share a scale of "
        "2**k still flushes to zero.",
        "Try k = 0, 1, 2, ... and stop at the first k whose 'flushed' share is exactly 0. "
        "As a cross-check: fp16's smallest subnormal is 2**-24, so the smallest |gradient| "
        "times 2**k must reach about half of it (anything smaller rounds to zero).",
        "smallest_k = next(k for k in range(33) if al.formats.scaled_fractions(grads, 2.0**k, "
        "'fp16')['flushed'] == 0)",
    ),
})


hint = hint_reader(HINTS, __name__)


def fp16_truths() -> dict:
    """What fp16 really gives: ``1 + 1e-4`` and the sum of 0.01 added 1,000 times (from 0)."""
    return {"one_plus": float(formats.accumulate(1e-4, 1, "fp16", start=1.0)[-1]),
            "hundredths": float(formats.accumulate(0.01, 1000, "fp16", start=0.0)[-1])}


@graded
def check_fp16_predictions(one_plus, hundredths) -> Check:
    """Grade the two predictions: ``one_plus`` (fp16 ``1 + 1e-4``) exactly, ``hundredths`` (the
    fp16 sum of 0.01 added 1,000 times) within 0.03 of what fp16 computes. A wrong grade says
    which prediction is off and which way, never the value (shown from the third attempt)."""
    hint = HINTS["predict"]
    if is_blank(one_plus) or is_blank(hundredths):
        return unanswered(PREDICT, hint)
    a, bad_a = read_number(one_plus, "one_plus_small")
    b, bad_b = read_number(hundredths, "sum_of_hundredths")
    if bad_a or bad_b:
        return wrong(PREDICT, bad_a or bad_b, hint)
    truth = fp16_truths()
    reveal = (f"1 + 1e-4 = {truth['one_plus']!r} in fp16, and the sum is "
              f"{truth['hundredths']:.6g}")
    near = close(b, truth["hundredths"], abs_tol=0.03)
    if a != truth["one_plus"] and not near and a == 1 + 1e-4 \
            and b == 10.0:  # both graded before a hint is chosen: one mistake gives both
        return wrong(PREDICT, f"{a!r} and {b!r} are what exact decimal arithmetic gives; fp16 "
                     f"gives something else for both", hint.after(
                         "both answers are the exact decimal results: fp16 rounds every addition "
                         "to the nearest value it holds, and that gap grows with the number (next "
                         "to 1 it is 2**-10, above 8 it is 2**-7): work out each sum with the gap "
                         "where it happens"), reveal)
    if a != truth["one_plus"]:
        return wrong(PREDICT, f"1 + 1e-4 in fp16 is not {a!r}",
                     hint.after("compare 1e-4 with half the gap 2**-10 between 1 and the next "
                                "fp16 value: an addition's result is rounded to the nearest value "
                                "fp16 holds"), reveal)
    if not near:
        if b == 10.0:
            why = hint.after("10.0 is the exact sum; in fp16 every addition rounds, and above 8 "
                             "the gap is 2**-7 = 0.0078, so each 0.01 lands a little off and the "
                             "errors add up")
        else:
            why = hint
        way = "high" if b > truth["hundredths"] else "low"
        return wrong(PREDICT, f"your sum {b:.6g} is too {way}: more than 0.03 from what fp16 "
                     f"computes", why, reveal)
    return passed(PREDICT, f"1 + 1e-4 = {truth['one_plus']!r} and the sum is "
                  f"{truth['hundredths']:.6g} in fp16 (exact: 10)")


def smallest_safe_exponent(grads, exponents: Sequence[int] = range(0, 33), fmt: str = "fp16"):
    """The smallest ``k`` whose scale ``2**k`` flushes no nonzero gradient to zero in ``fmt``
    (``formats.scale_sweep``), or None when every scale tried flushes some."""
    rows = formats.scale_sweep(grads, exponents, fmt)
    return next((r["k"] for r in rows if r["flushed"] == 0), None)


def _nonzero_count(grads) -> int:
    """How many nonzero finite values ``grads`` (a tensor, array, or a list or dict of them)
    holds: what the flushed share is a share of."""
    parts = grads.values() if isinstance(grads, dict) else (
        [grads] if hasattr(grads, "shape") else grads)
    total = 0
    for g in parts:
        t = torch.as_tensor(g).detach().cpu().flatten()
        total += int((torch.isfinite(t) & (t != 0)).sum())
    return total


def _share(fraction: float, total: int) -> str:
    """A share of ``total`` values as a count ("3 of 254,130"), which never reads 0 where some
    are: a percentage of a few values rounds to 0.000%."""
    n = int(round(fraction * total))
    if fraction > 0 and n == 0:
        n = 1
    return f"{n:,} of the {total:,}"


@graded
def check_scale_exponent(k, grads) -> Check:
    """Grade ``k``: the smallest loss-scale exponent at which fp16 flushes none of ``grads``.
    A wrong grade says what the learner's own ``k`` does (how many gradients it still flushes,
    as a count), never the smallest one (shown from the third attempt)."""
    hint = HINTS["scale"]
    if is_blank(k):
        return unanswered(SCALE, hint)
    given, k = k, whole_number(k)
    if k is None:
        return wrong(SCALE, f"k must be a whole-number exponent (the scale is 2**k); got "
                     f"{given!r}", hint)
    best = smallest_safe_exponent(grads)
    if best is None:
        return skipped(SCALE, "no scale up to 2**32 keeps every gradient here")
    reveal = f"k = {best}: 2**{best} is the smallest scale that flushes no gradient"
    if k > 32 and k & (k - 1) == 0:  # a power of two this large is a scale, not an exponent
        return wrong(SCALE, f"{given!r} is a scale, 2**{k.bit_length() - 1}, not an exponent",
                     hint.after("answer with k, the power of two: the scale is 2**k, so a scale "
                                "of 65536 is k = 16"), reveal)
    # 2.0 ** k overflows a Python float past k = 1023; past 2**200 everything is inf in fp16
    # and fp32 alike, so the fractions at k are those at the clamped exponent
    at_k = formats.scaled_fractions(grads, 2.0 ** max(-200, min(k, 200)), "fp16")
    if k < best:
        return wrong(SCALE, f"at 2**{k}, {_share(at_k['flushed'], _nonzero_count(grads))} "
                     f"nonzero gradients are still flushed to zero",
                     hint.after("a larger scale moves every gradient up by the same factor: "
                                "keep raising k"), reveal)
    if k > best:
        over = (f" (and {_share(at_k['overflow'], _nonzero_count(grads))} overflow)"
                if at_k["overflow"] else "")
        return wrong(SCALE, f"2**{k} flushes nothing{over}, but so does a smaller scale",
                     hint.after("the smallest safe scale leaves the most headroom below 65504: "
                                "lower k until one more step down flushes a gradient"), reveal)
    return passed(SCALE, f"2**{best} is the smallest scale that flushes none of these "
                  f"gradients ({at_k['overflow']:.3%} overflow at it)")


def reference_master_weight(start: float, update: float, steps: int) -> float:
    """The reference solution: an fp32 master weight, each step adding an fp16 update, and
    the fp16 copy of the model cast from it at the end."""
    master = torch.tensor(start, dtype=torch.float32)
    u = torch.tensor(update, dtype=torch.float16)
    for _ in range(steps):
        master = master + u.float()
    return float(master.half())


def _fp16_only(start: float, update: float, steps: int) -> float:
    w = torch.tensor(start, dtype=torch.float16)
    for _ in range(steps):
        w = w + torch.tensor(update, dtype=torch.float16)
    return float(w)


def _update_in_fp32_weight_in_fp16(start: float, update: float, steps: int) -> float:
    w = torch.tensor(start, dtype=torch.float16)
    for _ in range(steps):
        w = (w.float() + update).half()
    return float(w)


def _update_left_in_fp32(start: float, update: float, steps: int) -> float:
    master = torch.tensor(start, dtype=torch.float32)
    for _ in range(steps):
        master = master + update  # the update never made an fp16 tensor: not what AMP adds
    return float(master.half())


WRONG_MASTER = {"fp16 weight": _fp16_only, "rounded to fp16 every step": _update_in_fp32_weight_in_fp16}

_FP32_UPDATE_HINT = ("the update must be the fp16 number a 16-bit backward pass gives: make it "
                     "torch.tensor(update, dtype=torch.float16) and cast it up (u.float()) as "
                     "you add it; added as the fp32 number `update` it misses fp16's rounding of "
                     "the update, which adds up over many steps")

# Other inputs a train function is run on after the default one: a start other than 1 (an
# ignored ``start`` shows), an update above half the fp16 gap at 0.5 and few enough steps that
# one step more or less moves the fp16 result (an off-by-one loop shows), a single step, and an
# update that fp16 rounds by 0.03% over 300 steps (an update left in fp32, the mistake the
# second hint warns about, ends one fp16 value off).
MASTER_INPUTS = ((0.5, 3e-4, 200), (0.5, 3e-4, 1), (-2.0, 7e-4, 37), (0.1, 2.9e-3, 300))


def master_truth(start: float, update: float, steps: int) -> float:
    """Where an fp32 master weight ends, cast to fp16: ``formats.accumulate`` with an fp32
    weight and an fp16 update."""
    master = formats.accumulate(update, steps, "fp32", start=start, update_fmt="fp16")[-1]
    return float(torch.tensor(master, dtype=torch.float32).half())


def _run_train(train: Callable, start: float, update: float, steps: int):
    """(the number ``train`` returns, None) or (None, a wrong Check)."""
    hint = HINTS["master"]
    try:
        got = train(start, update, steps) if callable(train) else train
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return None, wrong(MASTER, f"train({start}, {update}, {steps}) raised "
                           f"{type(exc).__name__}: {exc}", hint)
    if is_blank(got):
        return None, unanswered(MASTER, hint)
    v, bad = read_number(got, "the final weight train returns")
    if bad:
        return None, wrong(MASTER, bad, hint)
    return v, None


@graded
def check_master_weight(train: Callable, start: float = 1.0, update: float = 1e-4,
                        steps: int = 1000) -> Check:
    """Grade ``train(start, update, steps) -> float``: it must keep an fp32 master weight and end
    where ``formats.accumulate`` (fp32 weight, fp16 update) ends, cast to fp16: on the given
    inputs first, then on ``MASTER_INPUTS`` (another start, one step, a few steps: a loop that
    runs one step too few or ignores ``start`` differs there)."""
    hint = HINTS["master"]
    want = master_truth(start, update, steps)  # the references first: nothing the answer does
    fp16 = float(formats.accumulate(update, steps, "fp16", start=start)[-1])  # can move them
    truths = {other: master_truth(*other) for other in MASTER_INPUTS}
    v, bad = _run_train(train, start, update, steps)
    if bad is not None:
        return bad
    if v == fp16 and v != want:
        return wrong(MASTER, f"the weight stayed at {v:.6g}: every update was swamped",
                     hint.after("the weight that accumulates the updates is (or becomes again, "
                                "each step) a 16-bit one, fp16 or bf16, and 1e-4 is below half "
                                "its gap next to 1 (2**-10 in fp16, 2**-7 in bf16): keep the "
                                "running weight in torch.float32 from start to end"),
                     f"an fp32 master ends at {want:.6g}")
    if v != want and v == _update_left_in_fp32(start, update, steps):
        return wrong(MASTER, f"the weight ended at {v:.6g}, where an fp32 master ends when the "
                     f"update is added as an fp32 number, never rounded to fp16",
                     hint.after(_FP32_UPDATE_HINT), f"an fp32 master ends at {want:.6g}")
    if v != want:
        return wrong(MASTER, f"the weight ended at {v:.6g}, not where an fp32 master ends",
                     hint.after("add the fp16 update, cast up, to the fp32 master at every step, "
                                "and cast to fp16 once, at the end: any other rounding in between "
                                "moves the result"), f"an fp32 master ends at {want:.6g}")
    for other, truth in truths.items():
        got, bad = _run_train(train, *other)
        if bad is not None:
            return bad if bad.status == "wrong" else wrong(
                MASTER, f"train{other} returned nothing", hint)
        if got != truth and got == _update_left_in_fp32(*other):
            return wrong(MASTER, f"train{other} ends at {got:.6g}, where an fp32 master ends "
                         f"when the update is added as an fp32 number, never rounded to fp16",
                         hint.after(_FP32_UPDATE_HINT), f"train{other} should end at {truth:.6g}")
        if got != truth:
            return wrong(MASTER, f"right at start={start}, update={update}, steps={steps}, but "
                         f"train{other} ends at {got:.6g}, not where an fp32 master ends",
                         hint.after("use every argument: start from `start`, add the update "
                                    "exactly `steps` times (range(steps)), and return the fp16 "
                                    "copy of the fp32 master"),
                         f"train{other} should end at {truth:.6g}")
    return passed(MASTER, f"the weight moved from {start} to {v:.6g}; stored in fp16 it "
                  f"would have stayed at {fp16:.6g}")
