"""State the course's measurements leave as they found it.

``model.train(was_training)`` after an evaluation sets every submodule to the model's own mode,
which silently un-freezes a BatchNorm (or dropout) that the learner had put in eval mode on
purpose. ``kept_modes`` puts each module's own flag back instead. ``keeps_rng`` does the same
for torch's random generators: a measurement that seeds itself must not replace the learner's
random stream with a fixed one.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator, List, Tuple

import torch
from torch import nn


def keeps_rng(fn: Callable) -> Callable:
    """Decorator: run ``fn`` with torch's random generators (the CPU's and every GPU's) put back
    afterwards, so its own ``torch.manual_seed`` leaves the caller's stream where it was."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=gpus):
            return fn(*args, **kwargs)
    return wrapper


def saved_modes(model: nn.Module) -> List[Tuple[nn.Module, bool]]:
    """Every module of ``model`` with its ``training`` flag, in ``model.modules()`` order."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    return [(m, m.training) for m in model.modules()]


def restore_modes(saved: List[Tuple[nn.Module, bool]]) -> None:
    """Put back the flags ``saved_modes`` read (each module's own, not its parent's)."""
    for module, training in saved:
        module.training = training


@contextmanager
def kept_modes(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    """Run the block with ``model.train(training)``; afterwards every module has its own mode
    back, also when the block raised."""
    saved = saved_modes(model)
    model.train(bool(training))
    try:
        yield model
    finally:
        restore_modes(saved)
