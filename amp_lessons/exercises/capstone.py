"""The capstone's graders: the learner builds a whole mixed-precision setup for a model the
lessons never used, a small U-Net that denoises synthetic images (``TinyUNet``,
``denoising_batches``), and the graders check it the way a course assignment's autograder does:

1. ``check_precision_choice``: the precision chosen from the doctor's advice (``al.doctor``);
2. ``check_training``: the step (autocast, GradScaler for fp16, clipping after ``unscale_``, the
   scheduler held on skipped steps): no non-finite loss, clipping sees unscaled gradients, a
   skipped step leaves the schedule where it was, the weights stay fp32;
3. ``check_resume``: save and load that resume bit for bit, across a skipped step;
4. ``check_speed_memory``: speed and memory against fp32, decided on a GPU, "not decided here"
   with the reason on a CPU.

Every part has graded hints (``hint(part, level)``); the reference solutions (``reference_*``)
stay in this module, out of the notebook. Like every grader, these compute their references
first, give the learner's functions fresh objects, and never show the expected value before the
third wrong attempt.
"""
import copy
import io
import math
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.numerics.precision import as_device
from amp_lessons.exercises.check import (Check, graded, hint_book, hint_reader, is_blank,
                                         not_a_function, passed, read_number, same_values, skipped,
                                         tensor_problem, unanswered, wrong)

CHOOSE = "Part 1: the precision, from the doctor's advice"
TRAIN = "Part 2: the training step"
RESUME = "Part 3: a resume that is bit for bit"
SPEED = "Part 4: speed and memory against fp32"
PRECISIONS = ("fp16", "bf16", "fp32")
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}
STEPS, RESUME_AT, SKIP_AT = 8, 4, 2  # graded runs: 8 steps, saved after 4, step 2 overflows
IMAGE, BATCH, WIDTH = 16, 4, 8       # the graded runs' sizes: seconds on a CPU

HINTS = hint_book("capstone", {
    "choose": (
        "The doctor's report already weighed your model's ranges: its advice says what to train "
        "in and whether fp16 is safe. Read that part of the report rather than a rule of thumb, "
        "and decide what to do when neither 16-bit type is advised.",
        "report.advice is a dict: 'precision' holds 'fp16' or 'bf16' when one of them is "
        "advised (anything else, such as 'none (inf/NaN in fp32)', means neither is), and "
        "'fp16_safe' says whether fp16 with GradScaler is safe. Return one of 'fp16', 'bf16', "
        "'fp32'.",
        "p = report.advice.get('precision'); return p if p in ('fp16', 'bf16') else 'fp32'",
    ),
    "train": (
        "Lesson 02's loop is the whole recipe: which pieces does a precision need (autocast, a "
        "scaler), where must clipping sit against the scaler so that it sees the true "
        "gradients, and what must the learning-rate schedule do on a step the scaler skipped?",
        "make_state: AdamW on the model's parameters, torch.amp.GradScaler(device type, "
        "enabled only for fp16), a scheduler. train_step: autocast(device type, the half dtype; "
        "off for fp32) around forward and loss; scaler.scale(loss).backward(); "
        "scaler.unscale_(optimizer) before clip_grad_norm_; remember scaler.get_scale(), "
        "scaler.step, scaler.update, and step the scheduler only if the scale did not drop.",
        "dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(precision); with "
        "torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None): "
        "loss = F.mse_loss(model(x), y); scaler.scale(loss).backward(); "
        "scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); "
        "scale = scaler.get_scale(); scaler.step(optimizer); scaler.update(); if "
        "scaler.get_scale() >= scale: scheduler.step(); optimizer.zero_grad(set_to_none=True); "
        "return loss.detach()",
    ),
    "resume": (
        "A resumed run must take its next step exactly as the uninterrupted one would. List "
        "every object whose state decides that next step: after a skipped step, more of them "
        "hold state than on a clean run.",
        "Four objects hold state: the model (weights), the optimizer (AdamW's moments and step "
        "counts), the GradScaler (its scale and its count of clean steps) and the scheduler (its "
        "step count). Each has state_dict() and load_state_dict().",
        "save: return {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), "
        "'scaler': scaler.state_dict(), 'scheduler': scheduler.state_dict()}; load: each "
        "load_state_dict from its entry.",
    ),
    "speed": (
        "Compare like with like: the same model, batch and steps in fp32 and in your precision, "
        "a few warm-up steps before timing, and the peak memory counted from a reset. Which "
        "clock and which memory counter does a GPU need (lesson 04, section 1)?",
        "Time the steps after a warm-up with torch.cuda.Event (or time.perf_counter after "
        "torch.cuda.synchronize()); reset torch.cuda.reset_peak_memory_stats() after the "
        "warm-up and read torch.cuda.max_memory_allocated() after the steps. Return "
        "{'step_ms': median milliseconds, 'peak_bytes': the peak or None where there is none}.",
        "model = capstone.unet(MEASURE['width'], device=device); data = "
        "capstone.denoising_batches(MEASURE['warmup'] + MEASURE['steps'], MEASURE['batch'], "
        "MEASURE['size'], device=device); make_state/train_step as in part 2; after the "
        "warm-up steps torch.cuda.synchronize() and reset the peak; time each later step with "
        "perf_counter around train_step and torch.cuda.synchronize(); return {'step_ms': "
        "statistics.median(times), 'peak_bytes': torch.cuda.max_memory_allocated() if "
        "device.type == 'cuda' else None}",
    ),
})


hint = hint_reader(HINTS, __name__)


# --- the model and the data ---------------------------------------------------------------------

class TinyUNet(nn.Module):
    """A two-level U-Net for image denoising (3 channels in and out): convolutions with
    GroupNorm and SiLU, a max-pool down, a transposed convolution up and a skip connection
    concatenated at the top. ``width`` is the first level's channels (even, >= 2)."""

    def __init__(self, width: int = 16):
        super().__init__()
        if not (isinstance(width, int) and width >= 2 and width % 2 == 0):
            raise ValueError(f"width must be an even whole number >= 2; got {width!r}")

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout),
                                 nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1),
                                 nn.GroupNorm(2, cout), nn.SiLU())
        self.down1, self.down2 = block(3, width), block(width, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = block(2 * width, width)
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.down1(x)
        low = self.down2(F.max_pool2d(top, 2))
        return self.out(self.dec(torch.cat([self.up(low), top], dim=1)))


def unet(width: int = WIDTH, seed: int = 0, device=None) -> TinyUNet:
    """A ``TinyUNet`` with seeded weights on ``device``."""
    torch.manual_seed(seed)
    return TinyUNet(width).to(as_device(device))


def denoising_batches(n: int, batch: int = BATCH, size: int = IMAGE, seed: int = 0,
                      device=None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (noisy, clean) batches of ``batch`` smooth synthetic images (``size`` x ``size``,
    3 channels, a multiple of 2): random low-frequency patterns, upsampled, plus Gaussian noise
    of standard deviation 0.3. Seeded: the same ``seed`` gives the same batches everywhere."""
    if size % 2 or size < 4:
        raise ValueError(f"size must be an even whole number >= 4; got {size!r}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        coarse = torch.randn(batch, 3, 4, 4, generator=g)
        clean = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
        noisy = clean + 0.3 * torch.randn(clean.shape, generator=g)
        out.append((noisy.to(as_device(device)), clean.to(as_device(device))))
    return out


# --- reference solutions (what the checks compare with; never printed in the notebook) ---------

def reference_choose_precision(report) -> str:
    """The reference solution: the doctor's advised half type, else fp32."""
    p = report.advice.get("precision")
    return p if p in ("fp16", "bf16") else "fp32"


def reference_make_state(model: nn.Module, precision: str):
    """The reference solution: AdamW, a GradScaler enabled for fp16 only, a cosine schedule."""
    device_type = next(model.parameters()).device.type
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler(device_type, enabled=(precision == "fp16"))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    return optimizer, scaler, scheduler


def reference_train_step(model, optimizer, scaler, scheduler, x, y, precision):
    """The reference solution: autocast around forward and loss, scaled backward, clipping after
    ``unscale_``, the scheduler held on a skipped step."""
    dtype = HALF[precision]
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if scaler.get_scale() >= scale:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def reference_save(model, optimizer, scaler, scheduler) -> dict:
    """The reference solution, saving: the four state dicts."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict()}


def reference_load(state, model, optimizer, scaler, scheduler) -> None:
    """The reference solution, loading: the four state dicts back."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    scheduler.load_state_dict(state["scheduler"])


def reference_measure(precision: str, device=None, width: int = 32, size: int = 128,
                      batch: int = 32, warmup: int = 5, steps: int = 20) -> dict:
    """The reference solution: ``{"step_ms": median step, "peak_bytes": peak allocated memory
    (None on a CPU)}`` of the reference step at ``precision`` after ``warmup`` steps."""
    import statistics
    device = as_device(device)
    model = unet(width, device=device)
    optimizer, scaler, scheduler = reference_make_state(model, precision)
    data = denoising_batches(warmup + steps, batch, size, device=device)
    cuda = device.type == "cuda"
    times = []
    for i, (x, y) in enumerate(data):
        if i == warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        reference_train_step(model, optimizer, scaler, scheduler, x, y, precision)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - start))
    return {"step_ms": statistics.median(times),
            "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


# --- part 1 -------------------------------------------------------------------------------------

def advice_reports() -> List[SimpleNamespace]:
    """The doctor advice the precision choice is graded on: fp16 safe, fp16 overflowing (bf16
    advised), and a model that is not finite even in fp32 (neither)."""
    return [SimpleNamespace(model="safe in fp16", advice={"precision": "fp16", "fp16_safe": True}),
            SimpleNamespace(model="overflows fp16", advice={"precision": "bf16",
                                                            "fp16_safe": False}),
            SimpleNamespace(model="inf in fp32", advice={"precision": "none (inf/NaN in fp32)",
                                                         "fp16_safe": False})]


@graded
def check_precision_choice(fn: Callable, reports: Sequence = ()) -> Check:
    """Grade ``fn(report) -> "fp16" | "bf16" | "fp32"`` on ``advice_reports`` and on
    ``reports`` (real doctor reports, such as the capstone model's): the doctor's advised half
    type where it advises one, fp32 otherwise. ``fn`` gets a copy of each report."""
    hints = HINTS["choose"]
    if (stub := not_a_function(CHOOSE, fn, hints)) is not None:
        return stub
    cases = advice_reports() + list(reports)
    wants = [reference_choose_precision(r) for r in cases]  # the references first
    for report, want in zip(cases, wants):
        try:
            got = fn(copy.deepcopy(report))
        except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
            return wrong(CHOOSE, f"on {report.model!r}: {type(exc).__name__}: {exc}", hints)
        if is_blank(got):
            return unanswered(CHOOSE, hints)
        if got not in PRECISIONS:
            return wrong(CHOOSE, f"on {report.model!r}: return one of "
                         f"{', '.join(map(repr, PRECISIONS))}; got {got!r:.60}", hints)
        if got != want:
            why = ("the doctor found no 16-bit type that trains this model: stay in fp32"
                   if want == "fp32" else
                   "read which 16-bit type the advice names, not the fastest one on paper: "
                   "the doctor already weighed this model's ranges")
            return wrong(CHOOSE, f"on {report.model!r}: {got!r} is not what the advice leads "
                         f"to", hints.after(why),
                         "; ".join(f"{r.model}: {w}" for r, w in zip(cases, wants)))
    return passed(CHOOSE, "; ".join(f"{r.model}: {w}" for r, w in zip(cases, wants)))


# --- part 2 -------------------------------------------------------------------------------------

@contextmanager
def _watch_clipping(seen: list):
    """Record the gradient norm every ``clip_grad_norm_`` call sees (the module function and
    the one ``torch.nn.utils`` exports), restoring both on exit."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_module
    original = clip_module.clip_grad_norm_

    def watched(parameters, *args, **kwargs):
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        grads = [p.grad.detach().float() for p in parameters if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0)
        return original(parameters, *args, **kwargs)
    saved = (nn_utils.clip_grad_norm_, clip_module.clip_grad_norm_)
    nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = watched
    try:
        yield
    finally:
        nn_utils.clip_grad_norm_, clip_module.clip_grad_norm_ = saved


def _true_norm(model: nn.Module, x, y, precision: str) -> float:
    """The unscaled gradient norm of one step at ``precision`` on a copy of ``model``."""
    clone = copy.deepcopy(model)
    dtype = HALF[precision]
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = F.mse_loss(clone(x), y)
    loss.float().backward()
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad.float()) for p in clone.parameters()
         if p.grad is not None])))


def _make(make_state, model, precision):
    state = make_state(model, precision)
    if is_blank(state):
        return None, None
    if not (isinstance(state, (tuple, list)) and len(state) == 3):
        return None, (f"make_state must return (optimizer, scaler, scheduler); got "
                      f"{type(state).__name__}")
    optimizer, scaler, scheduler = state
    for part, value, ok, kind in (
            ("optimizer", optimizer, isinstance(optimizer, torch.optim.Optimizer),
             "a torch.optim optimizer"),
            ("scaler", scaler, isinstance(scaler, torch.amp.GradScaler),
             "a torch.amp.GradScaler (enabled for fp16 only)"),
            ("scheduler", scheduler, _count(scheduler) is not None
             and callable(getattr(scheduler, "step", None)),
             "a learning-rate scheduler (torch.optim.lr_scheduler)")):
        if not ok:  # without one, the steps that grade it (a held schedule) cannot run
            return None, (f"make_state(model, {precision!r}) must return (optimizer, scaler, "
                          f"scheduler): its {part} is {type(value).__name__}, not {kind}")
    return tuple(state), None


def _count(scheduler) -> Optional[int]:
    """How many times ``scheduler`` stepped (``last_epoch``), or None for another object."""
    count = getattr(scheduler, "last_epoch", None)
    return count if isinstance(count, int) else None


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    """``x`` with one value past fp16's range: an fp16 forward overflows, the scaler skips."""
    x = x.clone()
    x.view(-1)[0] = 1e6
    return x


@graded
def check_training(make_state: Callable, train_step: Callable, device=None) -> Check:
    """Grade ``make_state(model, precision) -> (optimizer, scaler, scheduler)`` and
    ``train_step(model, optimizer, scaler, scheduler, x, y, precision) -> loss`` on the U-Net:
    8 fp16 steps whose step 2 overflows fp16 (one input value past 65,504), then 4 bf16 steps.
    It checks: every loss but the overflowing one is finite; the first layer computed in the
    half type and the weights stay float32; clipping was called and saw the unscaled gradients
    (within 25% of the true norm, against the scale's factor of thousands when it clips
    scaled ones); the overflowing step changed no weight and did not advance the schedule; the
    others did. The true norms are computed first, on copies."""
    hints = HINTS["train"]
    for fn in (make_state, train_step):
        if (stub := not_a_function(TRAIN, fn, hints)) is not None:
            return stub
    device = as_device(device)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        plan = (("fp16", STEPS),)
    else:
        plan = (("fp16", STEPS), ("bf16", 4))
    for precision, steps in plan:
        result = _train_checked(make_state, train_step, precision, steps, device, hints)
        if result is not None:
            return result
    return passed(TRAIN, "fp16: finite losses, clipping on unscaled gradients, the overflowing "
                  "step skipped with the schedule held; " + (
                      "bf16 without a scaler: finite losses" if len(plan) > 1 else
                      "bf16 not run: no native bf16 on this GPU"))


def _train_checked(make_state, train_step, precision, steps, device, hints) -> Optional[Check]:
    model = unet(device=device)
    data = denoising_batches(steps, device=device, seed=1)
    if precision == "fp16":
        data[SKIP_AT] = (_poisoned(data[SKIP_AT][0]), data[SKIP_AT][1])
    try:
        state, bad = _make(make_state, model, precision)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(TRAIN, f"make_state(model, {precision!r}) raised {type(exc).__name__}: "
                     f"{exc}", hints)
    if bad:
        return wrong(TRAIN, bad, hints)
    if state is None:
        return unanswered(TRAIN, hints)
    optimizer, scaler, scheduler = state
    dtypes: list = []
    first_conv = model.down1[0]  # the learner's model's own: the copies _true_norm makes carry
    hook = first_conv.register_forward_hook(  # this hook too, and run in the reference's dtype
        lambda m, i, out: dtypes.append(out.dtype) if m is first_conv else None)
    try:
        for i, (x, y) in enumerate(data):
            skip = precision == "fp16" and i == SKIP_AT
            true = None if skip or i > 1 else _true_norm(model, x, y, precision)
            before = [p.detach().clone() for p in model.parameters()]
            count_before, seen = _count(scheduler), []
            with _watch_clipping(seen):
                loss = train_step(model, optimizer, scaler, scheduler, x.clone(), y.clone(),
                                  precision)
            if is_blank(loss):
                return unanswered(TRAIN, hints)
            if (problem := tensor_problem(loss, what="the loss train_step returns")):
                return wrong(TRAIN, problem, hints)
            value, bad = read_number(loss, "the loss train_step returns")
            if bad and not skip:
                return wrong(TRAIN, f"{precision} step {i}: {bad}", hints.after(
                    "a finite loss on a clean batch is the first thing a precision must keep: "
                    "look at what runs in 16 bits and whether the scaler is there for fp16"))
            if any(p.dtype != torch.float32 for p in model.parameters()):
                return wrong(TRAIN, f"{precision} step {i}: the weights are no longer float32",
                             hints.after("the weights stay float32 (never .half() or "
                                         ".to(torch.bfloat16)): autocast casts per operation"))
            if not seen:
                return wrong(TRAIN, f"{precision} step {i}: no clipping", hints.after(
                    "clip the gradients in every step, with "
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"))
            if true is not None and seen[0] > 1.25 * true:
                return wrong(TRAIN, f"{precision} step {i}: clipping saw gradients "
                             f"{seen[0] / true:,.0f} times their true size", hints.after(
                                 "clipping measured the scaled gradients: call "
                                 "scaler.unscale_(optimizer) before clip_grad_norm_"))
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            count_after = _count(scheduler)
            if skip:
                if moved:
                    return wrong(TRAIN, f"step {i} overflowed fp16, yet the weights changed",
                                 hints.after("let GradScaler decide: scaler.step(optimizer) "
                                             "skips a step whose gradients are inf or NaN"))
                if count_after != count_before:
                    return wrong(TRAIN, f"step {i} overflowed fp16 and was skipped, but the "
                                 f"schedule advanced", hints.after(
                                     "a skipped step is one where scaler.update() lowered the "
                                     "scale: remember scaler.get_scale() before update() and "
                                     "step the scheduler only when it did not drop"))
            else:
                if not moved:
                    return wrong(TRAIN, f"{precision} step {i}: the weights did not change",
                                 hints)
                if count_after == count_before and count_before is not None:
                    return wrong(TRAIN, f"{precision} step {i}: the schedule did not advance "
                                 f"on a step that was not skipped", hints.after(
                                     "step the scheduler after every step the optimizer really "
                                     "took"))
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(TRAIN, f"{precision}: {type(exc).__name__}: {str(exc).splitlines()[0]}",
                     hints)
    finally:
        hook.remove()
    want = HALF[precision]
    if want is not None and want not in dtypes:
        return wrong(TRAIN, f"{precision}: the first convolution computed in "
                     f"{', '.join(sorted(map(str, set(dtypes))))}", hints.after(
                         "run forward and loss under torch.autocast(device_type, dtype=...) "
                         "with the precision's 16-bit type"))
    return None


# --- part 3 -------------------------------------------------------------------------------------

def _states(model, optimizer, scaler, scheduler) -> Dict[str, object]:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "scheduler": scheduler.state_dict()}


@graded
def check_resume(make_state: Callable, train_step: Callable, save: Callable, load: Callable,
                 device=None) -> Check:
    """Grade ``save(model, optimizer, scaler, scheduler) -> dict`` and ``load(state, model,
    optimizer, scaler, scheduler)`` with the learner's own ``make_state`` and ``train_step``
    (part 2): 8 fp16 steps straight, against 4 steps, a save through ``torch.save`` and
    ``torch.load(weights_only=True)``, a load into fresh objects (other initial weights) and
    the last 4 steps; step 2 overflows, so the scaler's state differs from a fresh one. The two
    runs must end bit for bit equal: weights, AdamW's state, the scaler's and the scheduler's.
    The reference step is used where ``train_step`` is not answered yet."""
    hints = HINTS["resume"]
    for fn in (save, load):
        if (stub := not_a_function(RESUME, fn, hints)) is not None:
            return stub
    if not_a_function(RESUME, make_state, hints) is not None or \
            not_a_function(RESUME, train_step, hints) is not None:
        return skipped(RESUME, "part 2 (make_state, train_step) is not written yet: the "
                       "resume runs the learner's own training step")
    device = as_device(device)
    data = denoising_batches(STEPS, device=device, seed=2)
    data[SKIP_AT] = (_poisoned(data[SKIP_AT][0]), data[SKIP_AT][1])
    try:
        straight = unet(device=device)
        objs, bad = _make(make_state, straight, "fp16")
        if bad:  # part 2 grades it; the resume cannot run on it
            return skipped(RESUME, f"part 2 first: {bad}")
        if objs is None:
            return skipped(RESUME, "part 2's make_state returns nothing yet")
        for x, y in data:
            train_step(straight, *objs, x.clone(), y.clone(), "fp16")
        want = _states(straight, *objs)
        first = unet(device=device)
        first_objs = _make(make_state, first, "fp16")[0]
        for x, y in data[:RESUME_AT]:
            train_step(first, *first_objs, x.clone(), y.clone(), "fp16")
        state = save(first, *first_objs)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(RESUME, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", hints)
    if is_blank(state):
        return unanswered(RESUME, hints)
    try:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        second = unet(seed=1, device=device)  # other initial weights: only what was saved counts
        second_objs = _make(make_state, second, "fp16")[0]
        load(state, second, *second_objs)
        saved, loaded = _states(first, *first_objs), _states(second, *second_objs)
        not_back = [k for k in saved if not same_values(saved[k], loaded[k])]
        for x, y in data[RESUME_AT:]:
            train_step(second, *second_objs, x.clone(), y.clone(), "fp16")
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(RESUME, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", hints)
    got = _states(second, *second_objs)
    off = [k for k in want if not same_values(want[k], got[k])]
    off = [k for k in not_back if k in off] + [k for k in off if k not in not_back]
    if off:
        why = {"scaler": "the scaler's state did not come back: after the skipped step its "
                         "scale is not the initial one; save and load scaler.state_dict()",
               "scheduler": "the schedule restarted: save and load scheduler.state_dict()",
               "optimizer": "AdamW's moments or step counts did not come back: save and load "
                            "optimizer.state_dict()",
               "model": "the weights differ: save and load model.state_dict()"}
        return wrong(RESUME, f"after resuming, {', '.join(off)} differ from the uninterrupted "
                     f"run", hints.after(why[off[0]]))
    return passed(RESUME, f"steps {RESUME_AT}-{STEPS - 1} after the resume end bit for bit where "
                  f"the uninterrupted run ends: weights, AdamW, scaler and scheduler")


# --- part 4 -------------------------------------------------------------------------------------

def _measured(fn, precision, device) -> Tuple[Optional[dict], Optional[str]]:
    try:
        got = fn(precision, device)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return None, f"measure({precision!r}) raised {type(exc).__name__}: {exc}"
    if is_blank(got):
        return None, None
    if not isinstance(got, dict) or "step_ms" not in got or "peak_bytes" not in got:
        return None, f"measure must return {{'step_ms': ..., 'peak_bytes': ...}}; got {got!r:.80}"
    ms, bad = read_number(got["step_ms"], "step_ms")
    if bad or ms <= 0:
        return None, bad or f"step_ms must be above 0; got {ms!r}"
    peak = got["peak_bytes"]
    if peak is not None:
        peak, bad = read_number(peak, "peak_bytes")
        if bad or peak <= 0:
            return None, bad or f"peak_bytes must be above 0 or None; got {peak!r}"
    return {"step_ms": ms, "peak_bytes": peak}, None


QUICK_SIZES = dict(width=8, size=16, batch=4, warmup=1, steps=3)    # a CPU: seconds
FULL_SIZES = dict(width=32, size=128, batch=32, warmup=5, steps=20)  # a GPU: busy enough to time


@graded
def check_speed_memory(fn: Callable, precision: str, device=None,
                       reference: Optional[Callable] = None, sizes: Optional[dict] = None
                       ) -> Check:
    """Grade ``fn(precision, device) -> {"step_ms", "peak_bytes"}`` (the learner's measurement
    of the capstone model) at ``precision`` against fp32: the speed ratio (fp32's step time over
    the precision's) and the memory ratio (the precision's peak over fp32's) must agree with the
    grader's own measurement (``reference_measure``, or ``reference``) within 30% and 15%.
    Decided only on a GPU: on a CPU the check says "not decided here" and why, after checking
    that the function runs and returns what it should."""
    hints = HINTS["speed"]
    if (stub := not_a_function(SPEED, fn, hints)) is not None:
        return stub
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    device = as_device(device)
    mine = {}
    for p in ("fp32", precision):
        got, bad = _measured(fn, p, device)
        if bad:
            return wrong(SPEED, bad, hints)
        if got is None:
            return unanswered(SPEED, hints)
        mine[p] = got
    speed = mine["fp32"]["step_ms"] / mine[precision]["step_ms"]
    if device.type != "cuda":
        return skipped(SPEED, f"not decided here: a CPU has no GPU memory counter, and CPU step "
                       f"times say nothing about a GPU's tensor cores (your function ran: "
                       f"{precision} at {speed:.2f}x fp32's speed on this CPU)")
    if precision == "fp32":
        return skipped(SPEED, "not decided here: the doctor advised fp32, so there is no "
                       "mixed precision to compare")
    sizes = dict(sizes or FULL_SIZES)
    ref = reference or (lambda p, d: reference_measure(p, d, **sizes))
    theirs = {p: ref(p, device) for p in ("fp32", precision)}
    return grade_measurements(mine, theirs, precision)


def grade_measurements(mine: Dict[str, dict], theirs: Dict[str, dict], precision: str) -> Check:
    """Part 4's ruling on a GPU: the learner's measurements ``mine`` and the grader's ``theirs``
    (each {"fp32": {...}, precision: {...}} of ``step_ms`` and ``peak_bytes``) must give speed
    ratios within 30% and memory ratios within 15% of each other."""
    hints = HINTS["speed"]
    speed = mine["fp32"]["step_ms"] / mine[precision]["step_ms"]
    ref_speed = theirs["fp32"]["step_ms"] / theirs[precision]["step_ms"]
    if mine[precision]["peak_bytes"] is None or mine["fp32"]["peak_bytes"] is None:
        return wrong(SPEED, "peak_bytes is None on a GPU", hints.after(
            "read torch.cuda.max_memory_allocated() after resetting the peak"))
    memory = mine[precision]["peak_bytes"] / mine["fp32"]["peak_bytes"]
    ref_memory = theirs[precision]["peak_bytes"] / theirs["fp32"]["peak_bytes"]
    reveal = f"{ref_speed:.2f}x the speed and {ref_memory:.2f}x the memory of fp32"
    if not math.isfinite(speed) or abs(speed / ref_speed - 1) > 0.30:
        return wrong(SPEED, f"your speed ratio {speed:.2f} is more than 30% off the grader's",
                     hints.after("time the same work in both: warm up first, synchronize "
                                 "before reading the clock, and take the median"), reveal)
    if abs(memory / ref_memory - 1) > 0.15:
        return wrong(SPEED, f"your memory ratio {memory:.2f} is more than 15% off the grader's",
                     hints.after("reset the peak after the warm-up with "
                                 "torch.cuda.reset_peak_memory_stats() and read "
                                 "torch.cuda.max_memory_allocated() after the steps"), reveal)
    return passed(SPEED, f"{precision}: {speed:.2f}x fp32's speed and {memory:.2f}x its memory "
                  f"on this GPU (the grader measured {ref_speed:.2f}x and {ref_memory:.2f}x)")


def advised_precision(report) -> str:
    """The precision the doctor's advice in ``report`` leads to (what part 1 computes): the
    notebook's part 4 measures it against fp32 whatever part 1's answer is."""
    return reference_choose_precision(report)


def summary(checks: Sequence[Check]) -> str:
    """The capstone's score sheet: one line per part with its status, and the count passed."""
    if not checks or not all(isinstance(c, Check) for c in checks):
        raise ValueError("checks must be the parts' Check results, one or more")
    lines = [f"{c.exercise}: {c.status}" for c in checks]
    done = sum(c.passed for c in checks)
    decided = [c for c in checks if c.status != "skipped"]
    lines.append(f"{done} of {len(decided)} gradable parts passed here"
                 + (f" ({len(checks) - len(decided)} not decided on this machine)"
                    if len(decided) < len(checks) else ""))
    return "\n".join(lines)
