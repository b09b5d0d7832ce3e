"""What the trainer checks before it trains (``trainer.Trainer``): that the optimizer owns the
model's parameters, that the scheduler can be stepped once per optimizer step, and that the loss
function returns one number per batch. Each refusal names the setting and what it accepts.
Also how it reads what it is given: batches of nested tensors, their rows, class scores, a
``torch.compile``d model's own module."""
from __future__ import annotations

import inspect

import torch
from torch import nn

#: loss reductions a trainer can train and evaluate with (``loss_fn.reduction``)
LOSS_REDUCTIONS = ("mean", "sum")


def check_owns_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless every trainable parameter of ``model`` is in ``optimizer``."""
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in owned]
    if missing:
        which = ("none of them" if len(missing) == len(trainable)
                 else f"{len(trainable) - len(missing)} of {len(trainable)}")
        names = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ValueError(f"optimizer must own every trainable parameter of the model; it holds "
                         f"{which} (missing: {names}). Build it from this model's parameters, "
                         f"e.g. torch.optim.SGD(model.parameters(), ...), or freeze the others "
                         f"with requires_grad_(False)")


def check_scheduler(scheduler, optimizer: torch.optim.Optimizer) -> None:
    """ValueError unless ``scheduler`` is None or can be stepped as ``scheduler.step()`` once per
    optimizer step, and schedules ``optimizer`` (where it says which optimizer it schedules).

    ``ReduceLROnPlateau.step(metrics)`` needs a measurement the trainer does not have: step it
    yourself after ``trainer.evaluate(...)`` and pass ``scheduler=None``."""
    if scheduler is None:
        return
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise ValueError(f"scheduler must be None or have a step() method (a torch.optim."
                         f"lr_scheduler); got {type(scheduler).__name__}")
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        params = ()
    required = [p.name for p in params if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise ValueError(f"scheduler.step() must run without arguments (the trainer steps it once "
                         f"per optimizer step that was not skipped); {type(scheduler).__name__}"
                         f".step needs {', '.join(required)}: pass scheduler=None and call "
                         f"scheduler.step({required[0]}) yourself, e.g. after trainer.evaluate()")
    owner = getattr(scheduler, "optimizer", None)
    if isinstance(owner, torch.optim.Optimizer) and owner is not optimizer:
        raise ValueError(f"scheduler must schedule the trainer's optimizer; got a "
                         f"{type(scheduler).__name__} built on another "
                         f"{type(owner).__name__}: build it on the optimizer you pass the trainer")


def loss_reduction(loss_fn) -> str:
    """How ``loss_fn`` reduces a batch: its ``reduction`` attribute ("mean" or "sum"; a plain
    function counts as "mean"). ValueError for "none" or anything else: the trainer needs one
    number per batch to call backward on."""
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, target); got {loss_fn!r}")
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_fn.reduction must be one of {', '.join(LOSS_REDUCTIONS)} (the "
                         f"trainer calls backward on one number per batch); got {reduction!r}")
    return reduction


def moved(obj, device: torch.device, what: str):
    """A tuple, list or dict of tensors (nested too) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)((k, moved(v, device, what)) for k, v in obj.items())
    if isinstance(obj, (tuple, list)):
        return type(obj)(moved(v, device, what) for v in obj)
    raise ValueError(f"{what} must be a tensor, or a tuple, list or dict of tensors; got "
                     f"{type(obj).__name__}")


def batch_rows(y) -> int:
    """The number of examples in a batch's target: its (first) tensor's leading dimension."""
    while not isinstance(y, torch.Tensor):
        y = next(iter(y.values() if isinstance(y, dict) else y))
    return int(y.shape[0]) if y.dim() else 1


def class_ids(out, y) -> bool:
    """Whether ``out`` holds class scores for the integer class ids ``y`` (``[N, C, ...]`` and
    ``[N, ...]``): then accuracy means something."""
    return (isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor) and out.dim() >= 2
            and not y.is_floating_point() and not y.is_complex()
            and y.shape == out.shape[:1] + out.shape[2:])


def length_text(batch) -> str:
    """" of length n" where ``batch`` has a length, for error messages."""
    try:
        return f" of length {len(batch)}"
    except TypeError:
        return ""


def plain_module(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its state dict has no ``_orig_mod.`` prefix), else
    ``model``: a checkpoint of a compiled model loads into the plain one and back."""
    return getattr(model, "_orig_mod", model)
