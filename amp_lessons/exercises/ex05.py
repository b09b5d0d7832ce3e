"""Lesson 05's exercises: gradient accumulation (checked against one large batch), activation
checkpointing (checked against the plain forward: same gradients, fewer saved tensors), and a
resume that keeps the scaler's state (checked against an uninterrupted ``Trainer`` run)."""
import dataclasses
import io
import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.validate import check_int
from amp_lessons.numerics.precision import as_device, check_precision
from amp_lessons.tables import plural
from amp_lessons.train.trainer import ScalerSettings, TrainConfig, Trainer
from amp_lessons.measure.memory import SavedActivations
from amp_lessons.exercises.check import (Check, graded, hint_book, hint_reader, is_blank,
                                         matching_mistake, not_a_function, passed, same_values,
                                         skipped, tensor_problem, unanswered, wrong)

ACCUMULATE = "Exercise 2 (implement): gradient accumulation"
CHECKPOINT = "Exercise 1 (implement): activation checkpointing"
RESUME = "Exercise 3 (implement): a resume that keeps the scaler's state"
RESUME_STEPS, RESUME_AT = 12, 6
RESUME_GROWTH_INTERVAL = 4  # at step 6 the scaler's growth tracker is 2: a resume must carry it
BATCH = 32  # the accumulation check's batch, rounded up to a multiple of micro_batches

HINTS = hint_book("ex05", {
    "checkpoint": (
        "Checkpointing trades compute for memory: a checkpointed region keeps only its input "
        "for backward and runs again to rebuild the rest. Decide which regions of this forward "
        "should be such regions (section 1 says which unit is safe, and what happens to a region "
        "left out), and which PyTorch function makes one.",
        "Loop over the blocks as the plain forward does, but let "
        "torch.utils.checkpoint.checkpoint call each block, the last one too, with its input. "
        "Pass use_reentrant explicitly (PyTorch warns when you leave it out): the reentrant "
        "variant runs the block under no_grad and, when the block's input needs no gradient, "
        "no gradient reaches the block's weights; the non-reentrant one is the current API.",
        "for block in blocks: x = torch.utils.checkpoint.checkpoint(block, x, "
        "use_reentrant=False); then return x.",
    ),
    "accumulate": (
        "One backward over the whole batch differentiates the mean loss over all its samples. "
        "Each micro-batch's loss is a mean over its own samples only: how do those means relate "
        "to the big one, and what does a second backward do to what is already in .grad?",
        "backward adds into .grad, so the micro-batches' gradients sum up; each cross-entropy is "
        "a mean over its slice, so the plain sum is micro_batches times the whole batch's "
        "gradient. Split with x.chunk and y.chunk.",
        "for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)): "
        "(F.cross_entropy(model(xs), ys) / micro_batches).backward()",
    ),
    "resume": (
        "A resumed run must take its next step exactly as the uninterrupted run would. List "
        "everything that next step depends on, not only the weights, and ask for each where it "
        "lives and whether it changed since the run started.",
        "Three objects change as the run trains: the model (weights), the optimizer (SGD's "
        "momentum buffers) and the GradScaler (its scale and its count of clean steps). Each has "
        "state_dict() and load_state_dict().",
        "my_save: return {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), "
        "'scaler': scaler.state_dict()}. my_load: model.load_state_dict(state['model']), "
        "optimizer.load_state_dict(state['optimizer']), scaler.load_state_dict(state['scaler']).",
    ),
})


hint = hint_reader(HINTS, __name__)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _data(n: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def reference_accumulate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int):
    """The reference solution: split the batch, divide each micro-batch's loss by their number,
    call backward on each (gradients add up in ``.grad``)."""
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        (F.cross_entropy(model(xs), ys) / micro_batches).backward()


def _no_division(model, x, y, micro_batches):
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        F.cross_entropy(model(xs), ys).backward()


def _zero_each_time(model, x, y, micro_batches):
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        model.zero_grad()
        (F.cross_entropy(model(xs), ys) / micro_batches).backward()


WRONG_ACCUMULATE = {"loss not divided": _no_division, "gradients zeroed per micro-batch":
                    _zero_each_time}


def _grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _accumulated(fn: Callable, x, y, micro_batches: int, device) -> list:
    """The gradients ``fn`` leaves in a fresh copy of the exercise's model."""
    model = _mlp().to(device)
    fn(model, x, y, micro_batches)
    return _grads(model)


def _same_grads(mine: list, theirs: list) -> bool:
    return len(mine) == len(theirs) and all(
        a is not None and b is not None and torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        for a, b in zip(mine, theirs))


def _uniform_factor(mine: list, want: list) -> Optional[float]:
    """``c`` when every gradient in ``mine`` is ``c`` times its counterpart in ``want`` (a right
    direction at a wrong size), else None."""
    num = sum(float((a.double() * b.double()).sum()) for a, b in zip(mine, want))
    den = sum(float(b.double().square().sum()) for b in want)
    c = num / den if den else 0.0
    if c <= 0 or not all(torch.allclose(a, c * b, rtol=1e-3, atol=1e-6)
                         for a, b in zip(mine, want)):
        return None
    return c


def _batch_size(micro_batches: int) -> int:
    """``BATCH`` rounded up to a multiple of ``micro_batches``: every micro-batch the same size,
    so that dividing each mean loss by their number gives the whole batch's mean."""
    return micro_batches * math.ceil(BATCH / micro_batches)


@graded
def check_accumulation(fn: Callable, micro_batches: int = 4, device=None) -> Check:
    """Grade ``fn(model, x, y, micro_batches)``: the gradients it leaves must equal one backward
    over the whole batch (a model without BatchNorm: to float rounding), and they must have been
    accumulated: no forward over more than one micro-batch of samples, and one backward per
    micro-batch (hooks on the model count them). The batch is 32 samples, rounded up to a
    multiple of ``micro_batches`` (a whole number >= 1; ValueError otherwise). A wrong answer is
    named from all its gradients: a typical mistake (``WRONG_ACCUMULATE``) that leaves the same
    ones, else the right direction at a wrong size, else only that they differ."""
    micro_batches = check_int("micro_batches", micro_batches, 1)
    hint = HINTS["accumulate"]
    if (stub := not_a_function(ACCUMULATE, fn, hint)) is not None:
        return stub
    device = as_device(device)
    result = _grade_accumulation(fn, micro_batches, device)
    if not result.passed:
        return result
    other = HIDDEN_FACTOR * micro_batches  # a second run the notebook never shows
    second = _grade_accumulation(fn, other, device)
    if not second.passed:  # the symptom is the second run's; the likely cause, a fixed count
        return wrong(ACCUMULATE, f"right with {plural(micro_batches, 'micro-batch', 'micro-batches')}, "
                     f"but not in the check's second run, with micro_batches={other}: "
                     f"{second.message or 'no gradients'}", hint.after(HIDDEN_MISTAKE))
    return dataclasses.replace(result, message=f"{result.message} (and "
                               f"{plural(other, 'micro-batch', 'micro-batches')} of "
                               f"{_batch_size(other)})")


# The accumulation check's second run uses this many times the micro-batches it is given: an
# answer that reads the count from the notebook's call (x.chunk(4), / 4) instead of from its
# argument fails there. More micro-batches, not fewer: a hard-coded 4 then runs a forward over
# more than one micro-batch of samples, which the check names.
HIDDEN_FACTOR = 2
HIDDEN_MISTAKE = ("use the argument micro_batches everywhere (the split and the division), "
                  "not the number the notebook's check passes: the check runs your function "
                  "with another count too")


def _grade_accumulation(fn: Callable, micro_batches: int, device) -> Check:
    """``check_accumulation``'s grade of ``fn`` at one number of micro-batches (ungraded: the
    attempt is counted once, by the caller)."""
    hint = HINTS["accumulate"]
    x, y = (t.to(device) for t in _data(_batch_size(micro_batches)))
    big = _mlp().to(device)
    F.cross_entropy(big(x), y).backward()
    model = _mlp().to(device)
    seen, backwards = [], [0]
    hooks = [model.register_forward_pre_hook(
                 lambda mod, args: seen.append(args[0].shape[0] if args and hasattr(
                     args[0], "shape") and args[0].dim() else 0)),
             model[-1].weight.register_hook(lambda g: backwards.__setitem__(0, backwards[0] + 1))]
    try:
        fn(model, x.clone(), y.clone(), micro_batches)  # copies: the grader's x and y stay as
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(ACCUMULATE, f"{type(exc).__name__}: {exc}", hint)
    finally:
        for h in hooks:
            h.remove()
    mine, want = _grads(model), _grads(big)
    if (bad := next((tensor_problem(g, device, want[0].dtype, "a gradient") for g in mine
                     if g is not None and tensor_problem(g, device, want[0].dtype)), None)):
        return wrong(ACCUMULATE, bad, hint)
    if all(g is None for g in mine):
        return unanswered(ACCUMULATE, hint)
    if any(g is None for g in mine):
        return wrong(ACCUMULATE, "some parameters got no gradient", hint)
    if _same_grads(mine, want):
        size = len(x) // micro_batches
        if seen and max(seen) > size:
            return wrong(ACCUMULATE, f"the gradients are right, but the model ran a forward over "
                         f"{plural(max(seen), 'sample')} at once: no accumulation happened (a micro-batch "
                         f"holds {size} of the {len(x)})", hint.after(
                             "one forward and backward over the whole batch gives these "
                             "gradients too, but needs the memory of the whole batch: split x "
                             "and y into micro_batches slices (x.chunk) and run forward and "
                             "backward on each slice"))
        if micro_batches > 1 and backwards[0] < micro_batches:
            return wrong(ACCUMULATE, f"the gradients are right, but backward ran "
                         f"{plural(backwards[0], 'time')} for "
                         f"{plural(micro_batches, 'micro-batch', 'micro-batches')}: every "
                         f"micro-batch's graph was kept until then", hint.after(
                             "call backward on each micro-batch's loss inside the loop: .grad "
                             "adds them up, and each graph is freed before the next forward "
                             "(adding the losses first keeps every graph in memory)"))
        return passed(ACCUMULATE, f"{plural(micro_batches, 'micro-batch', 'micro-batches')} give the gradients of one "
                      f"batch of {len(x)}")
    ratio = float(mine[0].norm() / want[0].norm())
    known = matching_mistake(
        {name: lambda _, bad=bad: _accumulated(bad, x, y, micro_batches, device)
         for name, bad in WRONG_ACCUMULATE.items()}, [(None, mine)], _same_grads)
    factor = _uniform_factor(mine, want) if known is None else None
    if known == "loss not divided" or (
            factor is not None and abs(factor - micro_batches) < 0.05 * micro_batches):
        return wrong(ACCUMULATE, f"the gradients are {ratio:.2f}x those of one large batch",
                     hint.after("each micro-batch's loss is a mean over its own samples: divide "
                                "it by micro_batches, or the sum is micro_batches times too large"))
    if known == "gradients zeroed per micro-batch":
        return wrong(ACCUMULATE, f"the gradients differ from one large batch's (norm ratio "
                     f"{ratio:.2f})", hint.after(
                         "only the last micro-batch counts if the gradients are zeroed in "
                         "between: backward adds into .grad, zero once per optimizer step, not "
                         "per micro-batch"))
    if factor is not None:
        return wrong(ACCUMULATE, f"the gradients point the right way but are {factor:.2f}x those "
                     f"of one large batch", hint.after(
                         "the micro-batch losses you back-propagate must add up to the whole "
                         "batch's mean loss: count the slices your split makes (x.chunk(n) "
                         "makes n slices, x.split(n) slices of n samples) and what you divide "
                         "each loss by"))
    return wrong(ACCUMULATE, f"the gradients differ from one large batch's (norm ratio "
                 f"{ratio:.2f}), in direction, not only in size", hint)


def reference_checkpointed_forward(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The reference solution: each block through ``checkpoint(..., use_reentrant=False)``."""
    for block in blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return x


def _saved_bytes(forward: Callable, params=()) -> tuple:
    """(output, bytes the autograd graph saved for backward) of ``forward()``: each storage
    once, ``params`` left out (they are held anyway), as ``measure.memory.SavedActivations``
    counts them."""
    with SavedActivations(exclude=params) as saved:
        out = forward()
    return out, saved.bytes


def _all_but_last(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The mistake the lesson warns about: every block checkpointed but the last, which runs
    plainly (what ``checkpoint_sequential`` does with its last segment)."""
    for block in blocks[:-1]:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return blocks[-1](x)


def _reentrant_symptom(fn: Callable, blocks, x) -> bool:
    """True when ``fn``'s output needs a gradient once its input does: reentrant checkpointing
    (``use_reentrant=True``) with an input that needs none, not a forward under no_grad or a
    detach (those lose the graph whatever the input)."""
    try:
        out = fn(blocks, x.detach().clone().requires_grad_())
        return isinstance(out, torch.Tensor) and out.requires_grad
    except Exception:  # noqa: BLE001 - the learner's code on a probe: no more to learn
        return False
    finally:
        blocks.zero_grad(set_to_none=True)


CHECKPOINT_SLACK = 1.25  # at most this times what every block checkpointed saves


@graded
def check_checkpointing(fn: Callable, device=None) -> Check:
    """Grade ``fn(blocks, x) -> output``: it must give the plain forward's output and gradients
    and save for backward (each storage once, parameters left out) at most ``CHECKPOINT_SLACK``
    times what checkpointing every block saves: a forward that runs one block plainly, as
    ``checkpoint_sequential`` does with its last segment, saves that block's whole activations
    and fails. The references (the plain forward, every block checkpointed, all but the last)
    are measured first; ``fn`` gets a copy of the input."""
    hint = HINTS["checkpoint"]
    if (stub := not_a_function(CHECKPOINT, fn, hint)) is not None:
        return stub
    reentrant = hint.after("use_reentrant=True runs the block under no_grad and, with an input "
                           "that needs no gradient, nothing reaches the weights: pass "
                           "use_reentrant=False")
    device = as_device(device)
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                           for _ in range(4)).to(device)
    params = list(blocks.parameters())
    x = torch.randn(16, 64, device=device)

    def plain():
        h = x
        for b in blocks:
            h = b(h)
        return h
    out, plain_bytes = _saved_bytes(plain, params)
    out.square().mean().backward()
    want = _grads(blocks)
    blocks.zero_grad(set_to_none=True)
    _, reference_bytes = _saved_bytes(lambda: reference_checkpointed_forward(blocks, x), params)
    _, last_plain_bytes = _saved_bytes(lambda: _all_but_last(blocks, x), params)
    blocks.zero_grad(set_to_none=True)
    no_graph = hint.after("the output must carry the autograd graph: run the blocks without "
                          "torch.no_grad() and without .detach(); checkpoint itself frees the "
                          "blocks' inner activations and recomputes them in backward")
    try:
        mine, mine_bytes = _saved_bytes(lambda: fn(blocks, x.clone()), params)
        if mine is None or mine is Ellipsis:
            return unanswered(CHECKPOINT, hint)
        if not isinstance(mine, torch.Tensor):
            return wrong(CHECKPOINT, f"expected the last block's output, a tensor; got "
                         f"{type(mine).__name__}", hint)
        if (problem := tensor_problem(mine, device, out.dtype, "the output")) is not None:
            return wrong(CHECKPOINT, problem, hint.after(
                "return the last block's output as it comes: checkpointing changes what is "
                "saved for backward, not the output's device, dtype or shape"))
        if not mine.requires_grad:
            return wrong(CHECKPOINT, "the output has no autograd graph, so no gradient can "
                         "reach the blocks' weights",
                         reentrant if _reentrant_symptom(fn, blocks, x) else no_graph)
        mine.float().square().mean().backward()
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(CHECKPOINT, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", hint)
    got = _grads(blocks)
    if any(g is None for g in got):
        return wrong(CHECKPOINT, "the blocks' weights got no gradient", hint)
    if mine.shape != out.shape:
        return wrong(CHECKPOINT, f"the output is {tuple(mine.shape)}; the plain forward's is "
                     f"{tuple(out.shape)}", hint.after(
                         "return the last block's output as it comes: checkpointing changes "
                         "what is saved for backward, not the output's dtype or shape"))
    if not torch.allclose(mine, out) or not all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                                                  for a, b in zip(got, want)):
        return wrong(CHECKPOINT, "the output or the gradients differ from the plain forward's",
                     hint.after("run every block once, in order, each on the previous block's "
                                "output: checkpointing recomputes exactly the same blocks on the "
                                "same input"))
    if mine_bytes > CHECKPOINT_SLACK * reference_bytes:
        share = f"{100 * mine_bytes / plain_bytes:.0f}% of what the plain forward saves"
        if mine_bytes >= plain_bytes:
            return wrong(CHECKPOINT, f"the graph saved as much as the plain forward ({share}): "
                         f"nothing was checkpointed", hint.after(
                             "calling block(x) yourself keeps everything the block computes for "
                             "backward: hand the block and its input to "
                             "torch.utils.checkpoint.checkpoint instead, which keeps only the "
                             "input"))
        if abs(mine_bytes - last_plain_bytes) <= 0.1 * last_plain_bytes:
            return wrong(CHECKPOINT, f"the graph saved {share}, what it saves when every block "
                         f"but the last is checkpointed: the last block ran plainly",
                         hint.after("checkpoint_sequential runs its last segment plainly (section "
                                    "1), and so does a loop that calls the last block itself: "
                                    "checkpoint every block, the last one too"))
        return wrong(CHECKPOINT, f"the graph saved {share}: only part of the forward was "
                     f"checkpointed", hint.after(
                         "a block called as block(x), or the last segment of "
                         "checkpoint_sequential, keeps everything it computes: checkpoint every "
                         "block"))
    return passed(CHECKPOINT, f"same gradients; the graph saved {plural(mine_bytes, 'byte')} "
                  f"instead of {plain_bytes:,}")


def reference_save(model, optimizer, scaler) -> dict:
    """The reference solution, saving: model, optimizer and scaler state."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict()}


def reference_load(state: dict, model, optimizer, scaler) -> None:
    """The reference solution, loading: all three back."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])


def _save_without_scaler(model, optimizer, scaler):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _load_without_scaler(state, model, optimizer, scaler):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def _save_model_only(model, optimizer, scaler):
    return {"model": model.state_dict()}


def _load_model_only(state, model, optimizer, scaler):
    model.load_state_dict(state["model"])


WRONG_RESUME = {"no scaler state": (_save_without_scaler, _load_without_scaler),
                "model only": (_save_model_only, _load_model_only)}


def _trainer(seed: int, device) -> Trainer:
    model = _mlp(seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = TrainConfig(precision="fp16", progress=False, seed=None, track_memory=False,
                         scaler=ScalerSettings(init_scale=2.0 ** 10,
                                                 growth_interval=RESUME_GROWTH_INTERVAL))
    return Trainer(model, opt, config)


def _not_resumed(saved: Trainer, resumed: Trainer) -> list:
    """Which of the run's three stateful objects ("model", "optimizer", "scaler") the learner's
    load did not bring back: all three compared at once, so that a resume missing two of them
    is told so, not only the one whose symptom shows first."""
    pairs = {"model": (saved.model.state_dict(), resumed.model.state_dict()),
             "optimizer": (saved.optimizer.state_dict()["state"],
                           resumed.optimizer.state_dict()["state"]),
             "scaler": (saved.scaler.state_dict(), resumed.scaler.state_dict())}
    return [name for name, (a, b) in pairs.items() if not same_values(a, b)]


_RESUME_MISSING = {
    ("optimizer", "scaler"): "neither the scaler's state nor SGD's momentum buffers came back, "
                             "only the weights: save and load optimizer.state_dict() and "
                             "scaler.state_dict() as well as the model's",
    ("model",): "the weights did not come back (the optimizer and the scaler did): save "
                "model.state_dict() and load it with model.load_state_dict()",
    ("optimizer",): "the weights or SGD's momentum buffers did not come back: save and load "
                    "optimizer.state_dict() as well as the model's",
    ("scaler",): "the scaler's state did not come back whole (its scale, or its count of clean "
                 "steps since the last growth, which decides when it next grows): save "
                 "scaler.state_dict() and load it with scaler.load_state_dict()",
}


def _resume_mistake(missing: Sequence[str]) -> str:
    """The hint for a resume that did not bring back the objects ``missing``."""
    key = tuple(missing)
    if key in _RESUME_MISSING:
        return _RESUME_MISSING[key]
    calls = " and ".join(f"{name}.state_dict()" for name in missing)
    return f"these did not come back: {', '.join(missing)}; save and load {calls}"


@graded
def check_resume(save: Callable, load: Callable, device=None) -> Check:
    """Grade ``save(model, optimizer, scaler) -> dict`` and ``load(state, model, optimizer,
    scaler)``: a run stopped at step 6 of 12, saved (through ``torch.save`` and
    ``torch.load(weights_only=True)``) and loaded into fresh objects, must continue exactly as
    the uninterrupted run: same losses and loss scales, bit for bit, and the loaded model,
    optimizer and scaler states (the scaler's growth tracker included: it is 2 at the save)
    equal to the saved ones."""
    hint = HINTS["resume"]
    for fn in (save, load):
        if (stub := not_a_function(RESUME, fn, hint)) is not None:
            return stub
    device = as_device(device)
    try:
        check_precision("fp16", device)
    except ValueError as exc:
        return skipped(RESUME, f"fp16 AMP cannot run here: {exc}")
    probe = nn.Linear(2, 2)
    try:  # an unanswered stub returns nothing: say so before training anything
        if is_blank(save(probe, torch.optim.SGD(probe.parameters(), lr=0.1),
                         torch.amp.GradScaler(device.type))):
            return unanswered(RESUME, hint)
    except Exception:  # noqa: BLE001 - graded below, on the real objects
        pass
    batches = [_data(16, seed) for seed in range(RESUME_STEPS)]
    first = _trainer(0, device)
    for b in batches[:RESUME_AT]:
        first.train_step([b])
    try:
        state = save(first.model, first.optimizer, first.scaler)
        if is_blank(state):
            return unanswered(RESUME, hint)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        second = _trainer(1, device)  # other initial weights: only what was saved can match
        load(state, second.model, second.optimizer, second.scaler)
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(RESUME, f"{type(exc).__name__}: {str(exc).splitlines()[0]}", hint)
    missing = _not_resumed(first, second)
    full = _trainer(0, device)
    want = [full.train_step([b]) for b in batches]
    got = [second.train_step([b]) for b in batches[RESUME_AT:]]
    for i, (a, b) in enumerate(zip(got, want[RESUME_AT:]), start=RESUME_AT):
        if float(a.scale) != float(b.scale):
            return wrong(RESUME, f"step {i}: the resumed run used a loss scale of "
                         f"{float(a.scale):g}, the uninterrupted run {float(b.scale):g}: the "
                         f"scaler's state was not resumed",
                         hint.after(_resume_mistake(missing if "scaler" in missing
                                                    else ["scaler"])))
        if float(a.loss) != float(b.loss):
            return wrong(RESUME, f"step {i}: loss {float(a.loss):.6f} after resuming, "
                         f"{float(b.loss):.6f} without the interruption, with the same loss "
                         f"scale", hint.after(_resume_mistake(missing or ["optimizer"])))
    if missing:  # the same losses and scales here, but not the saved state
        return wrong(RESUME, f"steps {RESUME_AT}-{RESUME_STEPS - 1} gave the same losses and "
                     f"scales, but after loading, the state of {', '.join(missing)} differs "
                     f"from the saved run's", hint.after(_resume_mistake(missing)))
    return passed(RESUME, f"steps {RESUME_AT}-{RESUME_STEPS - 1} after resuming: same losses "
                  f"and loss scales as the uninterrupted run, bit for bit")
