"""Lesson 02's exercises: name the dtypes autocast gives, fix a loop with three bugs (graded
bitwise against ``trainer.Trainer``), write an autograd Function that survives autocast."""
import contextlib
import functools
import math
import re
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.numerics.precision import as_device, check_precision
from amp_lessons.train.trainer import ScalerSettings, TrainConfig, Trainer
from amp_lessons.exercises.check import (Check, graded, hint_book, hint_reader, is_blank, keyed,
                                         not_a_function, passed, same_code, skipped,
                                         tensor_problem, unanswered, wrong)

DTYPES = "Exercise 2 (predict, then run): dtypes under autocast"
LOOP = "Exercise 3 (fix the bug): a loop with three bugs"
FUNCTION = "Exercise 1 (implement): an autograd Function that survives autocast"
LAYERS = ("fc1", "norm", "fc2", "loss")
LOOP_STEPS, LOOP_INIT_SCALE, LOOP_CLIP = 20, 2.0 ** 24, 1.0

HINTS = hint_book("ex02", {
    "function": (
        "Section 1 ran the same matmul Function twice: as written for float32, and a version "
        "that survives autocast. Compare the two classes line by line: the working one has two "
        "extra lines, one over forward and one over backward. Forward saves a and b for backward "
        "(ctx.save_for_backward) and returns a @ b.",
        "The two extra lines are decorators from torch.amp, written under @staticmethod, each "
        "given the device type (env.device_type). Without them backward runs outside autocast, "
        "where the 16-bit gradient meets the float32 tensors forward saved.",
        "Over forward: @staticmethod then @torch.amp.custom_fwd(device_type=env.device_type); "
        "over backward: @staticmethod then @torch.amp.custom_bwd(device_type=env.device_type). "
        "forward: ctx.save_for_backward(a, b); return a.mm(b). backward: a, b = "
        "ctx.saved_tensors; return grad.mm(b.t()), a.t().mm(grad).",
    ),
    "dtypes": (
        "autocast decides per operation, not per model: ask what each layer computes (a matrix "
        "multiply? a normalization over many values? a log and a sum?) and look it up in the "
        "op lists of section 2, whose last cell printed a few ops on this very device.",
        "Matrix multiplies, so Linear layers, are on the list autocast runs in 16 bits; losses "
        "such as cross_entropy are on its float32 list (they take logs and sum). The lists are "
        "per device, and layer_norm is one of the ops where a CPU and CUDA differ.",
        "fc1 and fc2: '16-bit'; loss: 'fp32'; norm: 'fp32' on CUDA (layer_norm is on CUDA's "
        "float32 list) but '16-bit' on a CPU (CPU autocast keeps it in its 16-bit type).",
    ),
    "loop": (
        "Three lines of this loop break mixed-precision training. Go through it asking three "
        "questions: in which dtype are the weights and their gradients kept, what do the "
        "gradients hold at the moment clipping measures them, and what should happen to the "
        "learning rate on a step the scaler skipped? Run the check after each fix: it names the "
        "mistake it still finds.",
        "The model must stay as it was built (autocast casts per operation; GradScaler needs "
        "float32 gradients). Clipping must see the true gradients, not the ones multiplied by "
        "the scale. And a step the scaler skipped is one where scaler.update() lowered the "
        "scale: the schedule should not advance on it.",
        "Delete model.half(). Call scaler.unscale_(optimizer) before "
        "torch.nn.utils.clip_grad_norm_. Read scale = scaler.get_scale() before "
        "scaler.update(), and call scheduler.step() only if scaler.get_scale() >= scale.",
    ),
})


hint = hint_reader(HINTS, __name__)


def _low_dtype(device_type: str) -> torch.dtype:
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def _kind(value) -> Optional[str]:
    """"16-bit" or "fp32" for what a learner may write (a dtype or its name), else None."""
    if isinstance(value, torch.dtype):
        return "16-bit" if value in (torch.float16, torch.bfloat16) else (
            "fp32" if value == torch.float32 else None)
    name = re.sub(r"[\s_\-]", "", str(value).lower().replace("torch.", ""))
    if name in ("16bit", "16", "fp16", "bf16", "float16", "bfloat16", "half", "low",
                "halfprecision", "b16"):
        return "16-bit"
    if name in ("fp32", "32", "float32", "float", "32bit", "single", "singleprecision",
                "full", "fullprecision", "f32"):
        return "fp32"
    return None


def autocast_dtypes(device=None) -> Dict[str, torch.dtype]:
    """What a Linear -> LayerNorm -> Linear model and its cross-entropy loss return under
    autocast on ``device`` (fp16 on CUDA, bf16 on a CPU), from forward hooks."""
    device = as_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    names = dict(zip(("fc1", "norm", "fc2"), model))
    seen: Dict[str, torch.dtype] = {}
    hooks = [m.register_forward_hook(lambda mod, i, out, n=n: seen.__setitem__(n, out.dtype))
             for n, m in names.items()]
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)
    with torch.autocast(device.type, dtype=_low_dtype(device.type)):
        seen["loss"] = F.cross_entropy(model(x), y).dtype
    for h in hooks:
        h.remove()
    return seen


WRONG_DTYPES = {"everything 16-bit": dict.fromkeys(LAYERS, "16-bit"),
                "everything fp32": dict.fromkeys(LAYERS, "fp32")}
_LAYER_WHY = {"fc1": "a Linear is a matrix multiply: look up which of autocast's op lists holds "
                     "matmuls, and what that list runs them in",
              "fc2": "a Linear is a matrix multiply: look up which of autocast's op lists holds "
                     "matmuls, and what that list runs them in",
              "loss": "cross_entropy takes a log and sums over many values: which of autocast's "
                      "op lists holds ops that need range more than speed?",
              "norm": "the op lists differ by device, and layer_norm is one of the ops where they "
                      "differ: look it up for this device (section 2's last cell printed it)"}
_UNIFORM_WHY = {
    "16-bit": "autocast does not turn the whole model to 16 bits: it decides per operation, "
              "from op lists, and some ops are on a list that keeps float32 inside the context: "
              "ask which of these four ops need range more than speed",
    "fp32": "autocast does change what some layers return: inside the context the ops on its "
            "16-bit list run and return 16 bits, though the weights stay float32: ask which of "
            "these four ops are on that list",
}


@graded
def check_autocast_dtypes(answer: Dict[str, object], device=None) -> Check:
    """Grade ``answer`` ({"fc1", "norm", "fc2", "loss"} -> "16-bit" | "fp32" or a dtype) against
    ``autocast_dtypes(device)``. Every layer is graded before a hint is chosen: one answer for
    the whole model (``WRONG_DTYPES``) that misses two layers or more is told that autocast
    decides per operation, not given the first wrong layer's fact."""
    hint = HINTS["dtypes"]
    if is_blank(answer):
        return unanswered(DTYPES, hint)
    given = keyed(answer, LAYERS)
    if given is None:
        return wrong(DTYPES, f"answer must be a dict with the keys {', '.join(LAYERS)}", hint)
    answer = given
    real = autocast_dtypes(device)
    said = {name: _kind(answer[name]) for name in LAYERS}
    for name in LAYERS:
        if said[name] is None:
            return wrong(DTYPES, f"{name}: write '16-bit' or 'fp32' (or a torch dtype); got "
                         f"{answer[name]!r}", hint)
    off = [name for name in LAYERS if said[name] != _kind(real[name])]
    if not off:
        return passed(DTYPES, ", ".join(f"{n}: {real[n]}" for n in LAYERS))
    message = (f"{len(off)} of {len(LAYERS)} wrong: {', '.join(off)} "
               f"({'does' if len(off) == 1 else 'do'} not return what you said on this device)")
    reveal = ", ".join(f"{n}: {real[n]}" for n in LAYERS)
    kinds = set(said.values())
    if len(off) >= 2 and len(kinds) == 1:
        return wrong(DTYPES, message, hint.after(_UNIFORM_WHY[kinds.pop()]), reveal)
    return wrong(DTYPES, message, hint.after(_LAYER_WHY[off[0]]), reveal)


def buggy_loop(model, optimizer, scheduler, batches, device_type, init_scale):
    """The fix-the-bug exercise's stub, exactly as lesson 02 shows it: three bugs."""
    model.half()
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    for x, y in batches:
        with torch.autocast(device_type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def reference_loop(model, optimizer, scheduler, batches, device_type, init_scale):
    """The reference solution: fp32 weights, clip after ``unscale_``, and the scheduler steps
    only where the scaler did not skip (its scale did not drop)."""
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    for x, y in batches:
        with torch.autocast(device_type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= scale:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _loop_setup(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 64, generator=g).to(device),
                torch.randint(0, 10, (32,), generator=g).to(device)) for _ in range(LOOP_STEPS)]
    return model, optimizer, scheduler, batches


@functools.lru_cache(maxsize=4)
def trainer_result(device=None):
    """The weights (a state dict) and the last learning rate after ``Trainer`` ran the loop's
    20 steps (fp16, GradScaler from 2**24, clip_norm 1.0, the scheduler skipping skipped
    steps). Cached per device: every check compares against the same run."""
    device = as_device(device)
    model, optimizer, scheduler, batches = _loop_setup(device)
    config = TrainConfig(precision="fp16", scaler=ScalerSettings(init_scale=LOOP_INIT_SCALE),
                         clip_norm=LOOP_CLIP, progress=False, seed=None, track_memory=False)
    trainer = Trainer(model, optimizer, config, scheduler=scheduler)
    for batch in batches:
        trainer.train_step([batch])
    return {k: v.clone() for k, v in model.state_dict().items()}, scheduler.get_last_lr()[0]


@functools.lru_cache(maxsize=4)
def _unscaled_grad(device) -> float:
    """The largest |gradient| of the last Linear's weight after the first batch's fp16 forward
    and an unscaled backward: what a loop without a GradScaler sees (a scaled one sees about
    ``LOOP_INIT_SCALE`` times more, or inf)."""
    model, _, _, batches = _loop_setup(device)
    x, y = batches[0]
    with torch.autocast(device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return float(model[-1].weight.grad.abs().max())


def _clip_before_unscale(model, optimizer, scheduler, batches, device_type, init_scale):
    """The reference loop with the clipping bug put back (what ``check_fixed_loop`` compares a
    loop with to tell that bug from other differences)."""
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    for x, y in batches:
        with torch.autocast(device_type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(optimizer)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= scale:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _same_weights(mine, theirs, device) -> bool:
    """Bitwise on a CPU; on a GPU within rounding (kernels may pick other reduction orders)."""
    return all(torch.equal(a, b) if device.type == "cpu" else
               torch.allclose(a, b.to(a.device), rtol=1e-3, atol=1e-5)
               for a, b in zip(mine.values(), theirs.values()))


@contextlib.contextmanager
def _growing_scalers(interval: int = 2):
    """``torch.amp.GradScaler`` made to grow its scale every ``interval`` clean steps while the
    block runs (20 steps at the default 2,000 never grow it, so a loop that steps the scheduler
    only while the scale stays *equal* looks right); yields the list of scalers built under it
    (empty where a loop bound the class before the block: then nothing can be told)."""
    original, made = torch.amp.GradScaler, []

    class Growing(original):
        def __init__(self, *args, **kwargs):
            kwargs["growth_interval"] = interval
            super().__init__(*args, **kwargs)
            made.append(self)

    torch.amp.GradScaler = Growing
    try:
        yield made
    finally:
        torch.amp.GradScaler = original


def _lr_when_the_scale_grows(loop: Callable, device) -> Optional[tuple]:
    """(the loop's final learning rate, the reference loop's) with scalers that grow every two
    clean steps, or None where the loop's scaler could not be made to grow (or it raised)."""
    rates = []
    for candidate in (reference_loop, loop):
        model, optimizer, scheduler, batches = _loop_setup(device)
        with _growing_scalers() as made:
            try:
                candidate(model, optimizer, scheduler, batches, device.type, LOOP_INIT_SCALE)
            except Exception:  # noqa: BLE001 - the learner's loop, run a second time
                return None
        if not made:
            return None
        rates.append(scheduler.get_last_lr()[0])
    return rates[1], rates[0]


@graded
def check_fixed_loop(loop: Callable, device=None) -> Check:
    """Run ``loop(model, optimizer, scheduler, batches, device_type, init_scale)`` for 20 fp16
    steps and compare the weights bitwise with ``Trainer`` on the same model and data."""
    hint = HINTS["loop"]
    if (stub := not_a_function(LOOP, loop, hint)) is not None:
        return stub
    half = hint.after("delete the model.half() line: the weights stay float32 and autocast casts "
                      "each operation's inputs to 16 bits where that pays")
    if same_code(loop, buggy_loop):
        return unanswered(LOOP, hint)
    device = as_device(device)
    try:
        check_precision("fp16", device)
    except ValueError as exc:
        return skipped(LOOP, f"fp16 AMP cannot run here: {exc}")
    ref, ref_lr = trainer_result(device)  # the reference first, on its own model and batches
    unscaled = _unscaled_grad(device)
    model, optimizer, scheduler, batches = _loop_setup(device)
    dtypes, first_grad, stale = set(), [], []
    last = model[-1].weight

    def on_grad(g):  # runs before the new gradient is added to last.grad
        if not first_grad:
            first_grad.append(float(g.detach().abs().max()))
        elif last.grad is not None and bool(last.grad.any()):
            stale.append(True)  # last step's gradient is still there: nothing cleared it

    hooks = [model[0].register_forward_hook(lambda mod, i, out: dtypes.add(out.dtype)),
             last.register_hook(on_grad)]
    try:
        loop(model, optimizer, scheduler, batches, device.type, LOOP_INIT_SCALE)
    except Exception as exc:  # noqa: BLE001 - the learner's loop: report, do not crash
        if "FP16 gradients" in str(exc) or any(p.dtype == torch.float16 for p in model.parameters()):
            return wrong(LOOP, f"the .half() bug is still there: the model's weights, so its "
                         f"gradients, are fp16, and GradScaler refused to unscale them "
                         f"({type(exc).__name__}: {exc})", half)
        return wrong(LOOP, f"the loop raised {type(exc).__name__}: {exc}", hint)
    finally:
        for h in hooks:
            h.remove()
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return wrong(LOOP, "the .half() bug is still there: the weights are not float32 after "
                     "the loop", half)
    lr = scheduler.get_last_lr()[0]
    mine = model.state_dict()
    if lr == ref_lr and _same_weights(mine, ref, device):
        grown = _lr_when_the_scale_grows(loop, device)
        if grown is not None and grown[0] != grown[1]:
            what = ("skipped the steps where the scale grew" if grown[0] > grown[1] else
                    "stepped on steps the scaler skipped")
            return wrong(LOOP, f"the weights and the learning rate match over these {LOOP_STEPS} "
                         f"steps, in which the scale never grows (growth_interval 2000); with "
                         f"scalers that grow every 2 clean steps your learning rate ends at "
                         f"{grown[0]:.4g} and the reference loop's at {grown[1]:.4g}: your "
                         f"scheduler {what}",
                         hint.after("a step was skipped only where scaler.update() lowered the "
                                    "scale; where it kept or raised the scale, the optimizer "
                                    "stepped, so the scheduler steps too"))
        how = "bit for bit" if device.type == "cpu" else "to rounding"
        return passed(LOOP, f"after {LOOP_STEPS} steps your weights equal the trainer's {how} "
                      f"(final learning rate {lr:.4g})")
    if dtypes and torch.float16 not in dtypes:
        return wrong(LOOP, f"the first Linear computed in "
                     f"{', '.join(sorted(str(d) for d in dtypes))}, not torch.float16: this loop "
                     f"is an fp16 one, graded against the trainer's fp16 run", hint.after(
                         "keep torch.autocast(device_type, dtype=torch.float16) around the "
                         "forward and the loss, and the GradScaler that fp16 needs"))
    if first_grad and math.isfinite(first_grad[0]) \
            and first_grad[0] < 2.0 ** 8 * unscaled:
        return wrong(LOOP, "the first backward's gradients were not multiplied by a loss scale: "
                     "no GradScaler scaled the loss", hint.after(
                         "fp16 training keeps the GradScaler: scaler.scale(loss).backward(), "
                         "scaler.unscale_(optimizer) before clipping, scaler.step(optimizer), "
                         "scaler.update()"))
    if stale:
        return wrong(LOOP, "each backward added its gradients to those of the step before: "
                     "nothing cleared them between steps, so every update used the sum of all "
                     "the gradients so far", hint.after(
                         "gradients accumulate in .grad until something clears them: what does "
                         "every training step need after the optimizer step?"))
    fixed = (f"the weights stay float32 and the learning rate matches (the .half() and "
             f"scheduler bugs are fixed), but the weights after {LOOP_STEPS} steps differ "
             f"from the trainer's")
    clip_first = _loop_setup(device)
    _clip_before_unscale(*clip_first, device.type, LOOP_INIT_SCALE)
    clip_lr = clip_first[2].get_last_lr()[0]
    # The whole result decides, weights and rate together: clipping the scaled gradients moves
    # the weights less, which can move a later overflow, and so the number of skipped steps and
    # the final rate; the rate alone then reads like the scheduler bug.
    if lr == clip_lr and _same_weights(mine, clip_first[0].state_dict(), device):
        said = (f"{fixed}: they equal a loop that clips before unscale_" if lr == ref_lr else
                f"the weights stay float32 (the .half() bug is fixed), and the weights and the "
                f"learning rate ({lr:.4g}, the trainer's {ref_lr:.4g}) after {LOOP_STEPS} steps "
                f"equal a loop that clips before unscale_ (its scaler skipped other steps)")
        return wrong(LOOP, f"{said}, so the clipping bug is the one left", hint.after(
            "clip after scaler.unscale_(optimizer): before it, the gradients are multiplied by "
            "the scale and clip_grad_norm_ shrinks them far too much"))
    if lr < ref_lr:  # StepLR only lowers the rate: a lower one means extra scheduler steps
        return wrong(LOOP, f"the scheduler bug is still there: it stepped on the steps the scaler "
                     f"skipped, so the learning rate ends at {lr:.4g}, the trainer's at "
                     f"{ref_lr:.4g}", hint.after(
                         "a skipped step is one where scaler.update() lowered the scale: remember "
                         "scaler.get_scale() before update() and step the scheduler only when the "
                         "scale did not drop"))
    if lr != ref_lr:
        return wrong(LOOP, f"the scheduler stepped less often than the optimizer did: the learning "
                     f"rate ends at {lr:.4g}, the trainer's at {ref_lr:.4g}", hint.after(
                         "skip scheduler.step() only on the steps the scaler skipped (its scale "
                         "dropped in scaler.update()), and step it after every other one"))
    return wrong(LOOP, f"{fixed}, and not because of the clipping order alone: something "
                 f"else in the loop changed", hint.after(
                     "keep everything else exactly as the lesson's loop has it: autocast "
                     "around forward and loss, scaler.scale(loss).backward(), unscale_, clip "
                     "to 1.0, scaler.step, scaler.update, zero_grad"))


def reference_function(device_type: str):
    """The reference solution: a matmul Function whose forward and backward run under the
    caller's autocast state (``torch.amp.custom_fwd`` / ``custom_bwd``)."""
    class MatMul(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)
    return MatMul


def undecorated_function():
    """A typical wrong answer: the same Function without custom_fwd / custom_bwd."""
    class MatMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)
    return MatMul


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _rel_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """True when ``got`` is within ``tol`` of ``want`` relative to its norm (NaN never is): a
    16-bit matmul rounds each value by about its precision, not a whole tensor by percents."""
    err = float((got.detach().float().cpu() - want.float()).norm())
    return err == err and err <= tol * float(want.float().norm())


@graded
def check_autograd_function(fn, device=None) -> Check:
    """Grade ``fn`` (a ``torch.autograd.Function`` computing ``a @ b``): under autocast its
    forward and backward must run, and its output and gradients match fp32 autograd's to 16-bit
    rounding: within twice the 16-bit type's eps of their norm (1.6% in bf16 on a CPU, 0.2% in
    fp16 on CUDA), so that a result a few percent off fails."""
    hint = HINTS["function"]
    device = as_device(device)
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        return unanswered(FUNCTION, hint) if is_blank(fn) else wrong(
            FUNCTION, f"expected a torch.autograd.Function subclass; got {fn!r}", hint)
    g = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    ra, rb = a0.clone().requires_grad_(), b0.clone().requires_grad_()  # the reference first,
    ref = ra.mm(rb)                                                    # on copies of the inputs
    ref.square().sum().backward()
    a, b = a0.to(device).requires_grad_(), b0.to(device).requires_grad_()
    try:
        with torch.autocast(device.type, dtype=_low_dtype(device.type)):
            out = fn.apply(a, b)
    except Exception as exc:  # noqa: BLE001 - the learner's Function: report, do not crash
        return wrong(FUNCTION, f"forward raised {type(exc).__name__}: {_first_line(exc)}", hint)
    if out is None:
        return unanswered(FUNCTION, hint)
    if not isinstance(out, torch.Tensor):
        return wrong(FUNCTION, f"forward must return a tensor, a @ b; got {type(out).__name__}",
                     hint)
    if (problem := tensor_problem(out, device, what="forward's output")) is not None:
        return wrong(FUNCTION, problem, hint.after(
            "compute a @ b from the inputs forward receives, on their device: no .to(...) of "
            "the result"))
    if out.dtype not in (_low_dtype(device.type), torch.float32):
        return wrong(FUNCTION, f"forward's output is {out.dtype}, expected "
                     f"{_low_dtype(device.type)} (autocast's) or torch.float32", hint.after(
                         "return a @ b in the dtype autocast gives it: no .double() or other "
                         "cast of the inputs or the result inside forward"))
    try:
        out.float().square().sum().backward()
    except Exception as exc:  # noqa: BLE001 - the learner's Function: report, do not crash
        first = _first_line(exc)
        if "dtype" in first or "Half" in first or "BFloat16" in first:
            return wrong(FUNCTION, f"backward failed on mixed dtypes ({type(exc).__name__}: "
                         f"{first}): it ran outside autocast", hint.after(
                             "backward ran outside autocast, so the 16-bit gradient met the "
                             "float32 tensors forward saved: the decorator pair of section 1's "
                             "autocast-aware version runs backward under forward's autocast state"))
        return wrong(FUNCTION, f"{type(exc).__name__}: {first}", hint)
    tol = 2 * torch.finfo(_low_dtype(device.type)).eps  # 16-bit rounding: 1.6% bf16, 0.2% fp16
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape \
            or not _rel_close(out, ref.detach(), tol):
        return wrong(FUNCTION, "forward does not compute a @ b",
                     hint.after("forward must return a.mm(b) (a @ b), after saving a and b"))
    for name, got, want in (("a", a.grad, ra.grad), ("b", b.grad, rb.grad)):
        if got is not None and (problem := tensor_problem(
                got, device, what=f"the gradient of {name}")) is not None:
            return wrong(FUNCTION, problem, hint)
        if got is None or got.shape != want.shape or not _rel_close(got, want, tol):
            return wrong(FUNCTION, f"the gradient of {name} is wrong",
                         hint.after("d(a@b)/da is grad @ b.T and d(a@b)/db is a.T @ grad, "
                                    "returned in that order"))
    return passed(FUNCTION, f"forward ran in {out.dtype} under autocast; backward ran and both "
                  f"gradients match fp32 autograd")

