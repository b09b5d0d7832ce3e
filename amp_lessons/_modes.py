"""Train/eval modes kept module by module.

``model.train(was_training)`` after an evaluation sets every submodule to the model's own mode,
which silently un-freezes a BatchNorm (or dropout) that the learner had put in eval mode on
purpose. ``kept_modes`` puts each module's own flag back instead.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Tuple

from torch import nn


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
