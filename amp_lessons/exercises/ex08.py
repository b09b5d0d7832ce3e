"""Lesson 08's exercises: stochastic rounding of fp32 to bf16 (checked to be unbiased, against
round-to-nearest and the package's ``optim.stochastic_round_bf16``), a Kahan-compensated bf16
update (checked against the exact sum and ``optim.add_rounded``), and the memory of a large
model's training state per recipe (checked against the bytes per parameter the lesson measured,
``optim.memory_rows``)."""
from typing import Callable, Mapping, Sequence

import torch

from amp_lessons.numerics import formats
from amp_lessons.measure import optim
from amp_lessons.exercises.check import (Check, canonical, graded, hint_book, hint_reader,
                                         is_blank, not_a_function, passed, read_number, skipped,
                                         tensor_problem, unanswered, within, wrong)

STOCHASTIC = "Exercise 1 (implement): stochastic rounding to bf16"
KAHAN = "Exercise 2 (implement): a Kahan-compensated bf16 update"
MEMORY = "Exercise 3 (predict): the training state of a 7 B-parameter model"
PARAMETERS = 7e9
GIB = 2 ** 30
MEMORY_RECIPES = ("fp32 master", "bf16", "bf16 + Kahan")
KAHAN_STEPS = 300

HINTS = hint_book("ex08", {
    "stochastic": (
        "A bf16 value is an fp32 value whose low 16 bits are zero. Between the two bf16 "
        "neighbours of x, the result must land on the upper one with a probability equal to "
        "the share of the gap x has already covered: which random quantity, added to x's "
        "bits before they are cut, does that?",
        "View x as int32 (x.view(torch.int32)), add a random integer drawn uniformly from "
        "[0, 2**16), then clear the low 16 bits (& -65536, which is 0xFFFF0000 as an int32) "
        "and view the result as float32 again: it is exactly representable in bf16.",
        "noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32); "
        "return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)",
    ),
    "kahan": (
        "Rounding the new weight to bf16 drops a small remainder. Keep that remainder in the "
        "compensation buffer and give it back on the next step: what must be added to the "
        "update before rounding, and how do you measure what this rounding dropped?",
        "Form everything in fp32: y = update + compensation; the new weight is (w + y) rounded "
        "to bf16; what was dropped is y minus what the weight really moved, (new - w).",
        "w = weight.float(); y = update + compensation.float(); new = (w + y).to(torch.bfloat16); "
        "return new, (y - (new.float() - w)).to(torch.bfloat16)",
    ),
    "memory": (
        "Count every tensor training keeps for each parameter, not only the weight: what else "
        "has one value per parameter, and how many bytes does each take in each recipe (section "
        "2's table)? Then mind the unit the answer asks for.",
        "Per parameter: the weight, its gradient and AdamW's two moments (Kahan adds a "
        "compensation buffer); in bf16 recipes all of them are 2 bytes. Multiply by 7e9 and "
        "divide by 2**30 (GiB, not GB).",
        "16, 8 and 10 bytes per parameter: 16 * 7e9 / 2**30 = 104.3, 8 * 7e9 / 2**30 = 52.2 and "
        "10 * 7e9 / 2**30 = 65.2 GiB.",
    ),
})


hint = hint_reader(HINTS, __name__)


# --- exercise 1: stochastic rounding ------------------------------------------------------------

def reference_stochastic_round(x: torch.Tensor) -> torch.Tensor:
    """The reference solution: the package's ``optim.stochastic_round_bf16``."""
    return optim.stochastic_round_bf16(x)


def _nearest(x):
    return x.to(torch.bfloat16)


def _truncate(x):
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def _noise_then_nearest(x):
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32)
    return (x.view(torch.int32) + noise).view(torch.float32).to(torch.bfloat16)


WRONG_STOCHASTIC = {"round to nearest": _nearest, "truncate": _truncate,
                    "noise, then round to nearest": _noise_then_nearest}

# (value, copies): fractions of the gap from the lower bf16 neighbour of 0.128, 0.7 and 0.35,
# positive and negative, so that nearest, truncation and a double rounding all show a bias.
_POINTS = (1.0 + 1e-3, -(2.5 + 0.7 * 2 ** -6), 0.37 + 0.35 * 2 ** -9)
_COPIES = 40_000


def _sr_input() -> torch.Tensor:
    return torch.tensor(_POINTS, dtype=torch.float32).repeat_interleave(_COPIES)


def _neighbours(x: torch.Tensor):
    low = _truncate(x).float()  # toward zero
    gaps = torch.tensor([formats.ulp(v, "bf16") for v in _POINTS], dtype=torch.float32)
    ulp = gaps.repeat_interleave(_COPIES)
    return low, low + torch.sign(x) * ulp, ulp


def _seeded(fn: Callable, x: torch.Tensor, seed: int):
    """``fn`` on a copy of ``x`` with torch's CPU generator seeded ``seed``; the caller's random
    state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn(x.clone())


@graded
def check_stochastic_rounding(fn: Callable) -> Check:
    """Grade ``fn(x) -> bf16 tensor`` (``x`` fp32): every value must be one of the two bf16
    neighbours of its input, and the mean over many copies of three values must be the input
    (within 2% of a bf16 ulp: round-to-nearest and truncation miss by 13-70%); a second call
    (another seed) must round differently: a fixed pattern repeats its error at every step."""
    hints = HINTS["stochastic"]
    if (stub := not_a_function(STOCHASTIC, fn, hints)) is not None:
        return stub
    x = _sr_input()
    try:
        got = _seeded(fn, x, 0)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(STOCHASTIC, f"{type(exc).__name__}: {exc}", hints)
    if is_blank(got):
        return unanswered(STOCHASTIC, hints)
    if (problem := tensor_problem(got, x.device, what="the result")) is not None:
        return wrong(STOCHASTIC, problem, hints.after(
            "round x where it is: work on its bits with torch operations on x's device"))
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        doubled = isinstance(got, torch.Tensor) and got.numel() == 2 * x.numel()
        return wrong(STOCHASTIC, f"expected a tensor shaped like x {tuple(x.shape)}; got "
                     f"{type(got).__name__} {tuple(getattr(got, 'shape', ()))}", hints.after(
                         "twice as many values: 64-bit integers (torch.randint's default "
                         "dtype) viewed as float32 split each into two; keep the bits in "
                         "torch.int32 before .view(torch.float32)") if doubled else hints)
    if got.dtype != torch.bfloat16:
        return wrong(STOCHASTIC, f"the result is {got.dtype}, not torch.bfloat16", hints.after(
            "the weights are stored in bf16: return the rounded values as torch.bfloat16 "
            "(.to(torch.bfloat16) after the low 16 bits are cleared is exact)"))
    if torch.equal(got, x.to(torch.bfloat16)):
        return wrong(STOCHASTIC, "every value is round-to-nearest's: nothing random happened",
                     hints.after("x.to(torch.bfloat16) rounds to nearest, so an update under half "
                                 "an ulp is lost every time: the randomness must decide up or down"))
    low, high, ulp = _neighbours(x)
    g = got.float()
    if not bool(((g == low) | (g == high)).all()):
        beyond = ((g - low) * torch.sign(x) > ulp * 1.5).any()
        return wrong(STOCHASTIC, "some results are not one of the two bf16 neighbours of their "
                     "input", hints.after(
                         "after adding the noise, cut the low 16 bits off (& -65536): rounding "
                         "the noisy value to nearest again (.to(torch.bfloat16)) can jump past "
                         "the upper neighbour" if beyond else
                         "the result must be the bf16 value just below or just above x (toward "
                         "or away from zero), nothing further"))
    lines = []
    for i, v in enumerate(_POINTS):
        part = slice(i * _COPIES, (i + 1) * _COPIES)
        bias = float((g[part].double().mean() - float(x[part][0])) / ulp[part][0])
        lines.append((v, bias))
    worst = max(lines, key=lambda t: abs(t[1]))
    if abs(worst[1]) > 0.02:
        if torch.equal(got, _truncate(x)):
            mistake = ("clearing the low 16 bits alone always rounds toward zero: add random bits "
                       "below the cut first, so that x rounds up as often as it is close to the "
                       "upper neighbour")
        # every value up: +0.3 to +0.9 ulp of bias, which the double rounding's test below
        # also matches; tested first, for itself
        elif bool((g == high).all()):
            mistake = ("every value went to its upper neighbour (away from zero): that is as "
                       "biased as truncating, the other way; x must round up only as often as "
                       "it is close to the upper neighbour, so the bits added below the cut "
                       "must be random")
        elif all(b > 0.3 for _, b in lines if _ > 0):
            mistake = ("after adding the noise, cut the low 16 bits off (& -65536); converting "
                       "with .to(torch.bfloat16) rounds to nearest a second time and adds about "
                       "half an ulp on average")
        else:
            mistake = ("the probability of rounding up must equal how far x is from the lower "
                       "neighbour, in units of the gap: a uniform 16-bit integer added below the "
                       "cut does exactly that")
        return wrong(STOCHASTIC, f"biased: on average {worst[1]:+.2f} of an ulp away from "
                     f"{worst[0]:.6g}", hints.after(mistake))
    try:
        again = _seeded(fn, x, 1)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(STOCHASTIC, f"on a second call: {type(exc).__name__}: {exc}", hints)
    if isinstance(again, torch.Tensor) and again.shape == got.shape and torch.equal(again, got):
        return wrong(STOCHASTIC, "a second call rounded every value the same way: the choice is "
                     "fixed, not random", hints.after(
                         "a weight rounded the same way at every step keeps the same error: "
                         "draw fresh random numbers on each call (torch's global generator, "
                         "not a generator seeded inside the function or a fixed pattern)"))
    return passed(STOCHASTIC, "every value lands on a bf16 neighbour of its input, and the mean "
                  "of each value's " + f"{_COPIES:,} roundings is within "
                  f"{max(abs(b) for _, b in lines):.3f} of an ulp of it: unbiased")


# --- exercise 2: Kahan-compensated update --------------------------------------------------------

def reference_kahan_add(weight: torch.Tensor, compensation: torch.Tensor,
                        update: torch.Tensor):
    """The reference solution: ``optim.add_rounded(..., "kahan")`` on copies; returns the new
    bf16 weight and the new bf16 compensation."""
    w, c = weight.clone(), compensation.clone()
    optim.add_rounded(w, update, "kahan", c)
    return w, c


def _no_compensation(weight, compensation, update):
    return (weight.float() + update).to(torch.bfloat16), compensation


def _flipped_sign(weight, compensation, update):
    w = weight.float()
    y = update + compensation.float()
    new = (w + y).to(torch.bfloat16)
    return new, ((new.float() - w) - y).to(torch.bfloat16)


def _compensation_not_added(weight, compensation, update):
    w = weight.float()
    new = (w + update).to(torch.bfloat16)
    return new, (compensation.float() + update - (new.float() - w)).to(torch.bfloat16)


WRONG_KAHAN = {"no compensation": _no_compensation, "sign flipped": _flipped_sign,
               "compensation kept but never added": _compensation_not_added}


def _kahan_case():
    g = torch.Generator().manual_seed(0)
    start = (torch.rand(256, generator=g) * 3 + 0.5).to(torch.bfloat16)
    update = (torch.rand(256, generator=g) * 4e-3 + 1e-4) * torch.where(
        torch.rand(256, generator=g) < 0.5, -1.0, 1.0)
    return start, update.float()


class NotAPairOfTensors(Exception):
    """A Kahan update returned something other than (new_weight, new_compensation), two tensors
    (the message says what it returned)."""


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: " + ", ".join(
            _describe(v) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value[:4])
    return f"{type(value).__name__} {value!r:.60}"


def _run_kahan(fn, start, update, steps):
    """``fn`` applied ``steps`` times from ``start`` with a zero buffer, each call on copies;
    None for the stub; ``NotAPairOfTensors`` where a call returns anything but two tensors
    (read before the next call uses them)."""
    w, c = start.clone(), torch.zeros_like(start)
    for _ in range(steps):
        out = fn(w.clone(), c.clone(), update.clone())
        if out is None or out is Ellipsis:
            return None
        if not (isinstance(out, (tuple, list)) and len(out) == 2
                and all(isinstance(t, torch.Tensor) for t in out)):
            raise NotAPairOfTensors(f"expected (new_weight, new_compensation), two tensors; got "
                                    f"{_describe(out)}")
        w, c = out
    return w, c


def _bitwise_same(a, b) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all()) if a.is_floating_point() \
        else torch.equal(a, b)


def _kahan_mistake(fn, start, update) -> str:
    """What a failing Kahan update does wrong, from one step taken where the compensation
    buffer already holds something (after a few reference steps)."""
    w, c = _run_kahan(reference_kahan_add, start, update, 5)
    want_w, want_c = reference_kahan_add(w, c, update)
    try:
        got_w, got_c = fn(w.clone(), c.clone(), update.clone())
    except Exception:  # noqa: BLE001 - it ran before: any failure here says nothing new
        return HINTS["kahan"].levels[0]
    got_c = torch.as_tensor(got_c)
    if torch.equal(torch.as_tensor(got_w), w) and not torch.equal(want_w, w):
        return ("the weight comes back unchanged: the update must move it, w + update (plus the "
                "compensation) rounded to bf16 is the new weight")
    if torch.equal(got_c, c):
        return ("the compensation buffer never changes: after rounding, store in it what the "
                "rounding dropped, y - (new - w)")
    if torch.equal(torch.as_tensor(got_w), (w.float() + update).to(torch.bfloat16)) and not \
            torch.equal(torch.as_tensor(got_w), want_w):
        return ("the buffer collects what was dropped but the update never receives it: add "
                "the compensation to the update before rounding (y = update + compensation)")
    if torch.allclose(got_c.float(), -want_c.float()):
        return ("the buffer holds the negative of what was dropped: it must be y - (new - w), "
                "the sum wanted minus the move made, so that adding it back restores the loss")
    return HINTS["kahan"].levels[0]


@graded
def check_kahan_update(fn: Callable) -> Check:
    """Grade ``fn(weight, compensation, update) -> (new_weight, new_compensation)`` (bf16, bf16,
    fp32): 300 small updates to 256 bf16 weights must end within one bf16 ulp of the exact sum,
    as ``optim.add_rounded(..., "kahan")`` does, where round-to-nearest loses most of them.
    The first step, taken again after the run, must give the same outputs: the weight and the
    compensation are the whole state (an fp32 copy kept between calls is not Kahan)."""
    hints = HINTS["kahan"]
    if (stub := not_a_function(KAHAN, fn, hints)) is not None:
        return stub
    start, update = _kahan_case()
    try:
        first = _run_kahan(fn, start, update, 1)  # taken again after the run: must not change
        out = _run_kahan(fn, start, update, KAHAN_STEPS)
        if first is None or out is None:
            return unanswered(KAHAN, hints)
        w, c = out
        problem = (tensor_problem(w, start.device, what="the new weight")
                   or tensor_problem(c, start.device, what="the new compensation"))
        if problem:
            return wrong(KAHAN, problem, hints.after(
                "compute on the device the weight is on, and return the two bf16 tensors there"))
        w, c = torch.as_tensor(w), torch.as_tensor(c)
        again = _run_kahan(fn, start, update, 1)
        same = again is not None and all(_bitwise_same(a, b) for a, b in zip(first, again))
    except NotAPairOfTensors as exc:
        return wrong(KAHAN, str(exc), hints.after(
            "return both parts of the state, in this order: return new_weight, new_compensation "
            "(two bf16 tensors shaped like the weight)"))
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(KAHAN, f"{type(exc).__name__}: {exc}", hints)
    if w.dtype != torch.bfloat16 or c.dtype != torch.bfloat16 or w.shape != start.shape:
        return wrong(KAHAN, f"expected two bf16 tensors shaped like the weight; got {w.dtype} "
                     f"{tuple(w.shape)} and {c.dtype} {tuple(c.shape)}", hints.after(
                         "both the weight and its compensation buffer are stored in bf16 "
                         "(2 bytes each): compute in fp32, store with .to(torch.bfloat16)"))
    if not same:
        return wrong(KAHAN, "the same inputs gave different outputs on a later call: the update "
                     "keeps something of its own between calls", hints.after(
                         "everything a step knows must come in through its arguments and go out "
                         "through what it returns: the bf16 weight and the bf16 compensation "
                         "buffer are the whole state, with no fp32 copy kept on the side"))
    exact = start.double() + KAHAN_STEPS * update.double()
    ulp = torch.tensor([formats.ulp(v, "bf16") for v in exact.tolist()], dtype=torch.float64)
    err = ((w.double() - exact).abs() / ulp)
    nearest = _run_kahan(_no_compensation, start, update, KAHAN_STEPS)[0]
    nearest_err = float(((nearest.double() - exact).abs() / ulp).mean())
    if float(err.max()) <= 1.0:
        return passed(KAHAN, f"after {KAHAN_STEPS} updates every weight is within "
                      f"{float(err.max()):.2f} ulp of the exact sum (round-to-nearest: "
                      f"{nearest_err:.1f} ulp off on average)")
    mistake = _kahan_mistake(fn, start, update)
    return wrong(KAHAN, f"after {KAHAN_STEPS} updates the weights are {float(err.mean()):.1f} ulp "
                 f"off the exact sum on average (worst {float(err.max()):.1f}; round-to-nearest "
                 f"{nearest_err:.1f})",
                 hints.after(mistake) if mistake != hints.levels[0] else hints)


# --- exercise 3: memory of the training state ----------------------------------------------------

def measured_bytes(memory: Sequence[Mapping]) -> dict:
    """{recipe: its memory row} for the first workload in ``memory`` (``l08.memory_table``
    rows, or ``optim.memory_rows`` rows without a workload)."""
    rows = list(memory)
    if not rows:
        return {}
    first = rows[0].get("workload")
    return {r["recipe"]: r for r in rows if r.get("workload") == first}


def reference_state_gib(memory: Sequence[Mapping], parameters: float = PARAMETERS) -> dict:
    """The reference answer: measured bytes per parameter times ``parameters``, in GiB."""
    by = measured_bytes(memory)
    return {r: by[r]["bytes per parameter"] * parameters / GIB for r in MEMORY_RECIPES if r in by}


def _bytes_per_parameter(row: Mapping, *parts: str) -> float:
    total = row["weights MiB"] + row["gradients MiB"] + row["optimizer state MiB"]
    return row["bytes per parameter"] * sum(row[p] for p in parts) / total


@graded
def check_state_gib(answers: Mapping, memory: Sequence[Mapping],
                    parameters: float = PARAMETERS) -> Check:
    """Grade ``answers`` ({recipe: GiB} for ``MEMORY_RECIPES``): the model state (weights,
    gradients, optimizer state) of a model with ``parameters`` parameters, within 3% of the bytes
    per parameter measured in ``memory`` (the lesson's memory table; its first workload)."""
    hints = HINTS["memory"]
    if not isinstance(answers, Mapping):
        return wrong(MEMORY, f"expected a dict {{recipe: GiB}}; got {type(answers).__name__}",
                     hints)
    if is_blank(answers):
        return unanswered(MEMORY, hints)
    answers = {canonical(k, MEMORY_RECIPES): v for k, v in answers.items()}
    by = measured_bytes(memory)
    if "fp32 master" not in by:
        return skipped(MEMORY, "the fp32-master reference was not measured in this run")
    right, missing = [], [r for r in MEMORY_RECIPES if r not in by]
    reveal = ", ".join(f"{r}: {by[r]['bytes per parameter'] * parameters / GIB:.1f} GiB "
                       f"({by[r]['bytes per parameter']:.1f} bytes per parameter)"
                       for r in MEMORY_RECIPES if r in by)
    for recipe in MEMORY_RECIPES:
        if recipe not in by:
            continue
        row = by[recipe]
        want = row["bytes per parameter"] * parameters / GIB
        if recipe not in answers:
            return wrong(MEMORY, f"no answer for {recipe!r}: the dict needs the keys "
                         f"{', '.join(map(repr, MEMORY_RECIPES))}; it has "
                         f"{', '.join(map(repr, answers))}", hints)
        got, bad = read_number(answers[recipe], recipe)
        if bad:
            return wrong(MEMORY, f"{bad} (GiB)", hints)
        if within(got, want, 0.03):
            right.append(f"{recipe} {want:.1f}")
            continue
        implied = got * GIB / parameters
        msg = (f"{recipe}: {got:.4g} GiB is {implied:.1f} bytes per parameter, "
               f"{'more' if got > want else 'less'} than this run measured")
        if within(got, want * GIB / 1e9, 0.03):
            mistake = "that is GB (10**9 bytes): the question asks for GiB, 2**30 bytes"
        elif recipe == "bf16 + Kahan" and "bf16" in by and within(
                implied, by["bf16"]["bytes per parameter"], 0.03):
            mistake = "Kahan keeps one more bf16 buffer per weight: its compensation"
        elif within(implied, _bytes_per_parameter(row, "weights MiB", "optimizer state MiB"),
                    0.03):
            mistake = ("one tensor the size of the weights is missing: every weight has a "
                       "gradient of the same dtype during the step (count the gradients too), "
                       "and AdamW keeps two moments per weight, not one")
        elif within(implied, _bytes_per_parameter(row, "weights MiB"), 0.03):
            mistake = ("the weights are not all: training also keeps a gradient and the "
                       "optimizer's state for each parameter")
        elif recipe != "fp32 master" and within(implied, 2 * row["bytes per parameter"], 0.03):
            mistake = ("in the pure-bf16 recipes the gradients and AdamW's moments are bf16 too "
                       "(torch keeps the state in the weights' dtype): 2 bytes each, not 4")
        else:
            mistake = hints.levels[0]
        return wrong(MEMORY, msg, hints.after(mistake) if mistake != hints.levels[0] else hints,
                     reveal)
    note = f"; not measured here: {', '.join(missing)}" if missing else ""
    return passed(MEMORY, f"GiB for {parameters / 1e9:g} B parameters, as measured: "
                  + ", ".join(right) + note)

