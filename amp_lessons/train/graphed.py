"""What ``Trainer.capture`` returns (``trainer.py``): one training step replayed as a CUDA graph,
with the trainer's records, history and step counter kept as ``train_step`` keeps them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from amp_lessons.train.records import StepRecord

if TYPE_CHECKING:  # pragma: no cover
    from amp_lessons.train.trainer import Trainer


class GraphedStep:
    """What ``Trainer.capture`` returns: ``step(x, y) -> StepRecord`` replaying one CUDA graph."""

    def __init__(self, trainer: "Trainer", graph, x: torch.Tensor, y: torch.Tensor, outs: tuple,
                 packed: torch.Tensor):
        self.trainer, self.graph, self.x, self.y, self.packed = trainer, graph, x, y, packed
        self.cause = outs[4]
        # where each of loss, grad_norm, found_inf, scale sits in ``packed`` (or its constant)
        self.slots, i = [], 0
        for t in outs[:4]:
            if isinstance(t, torch.Tensor):
                self.slots.append((True, i))
                i += 1
            else:
                self.slots.append((False, t))

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepRecord:
        trainer = self.trainer
        if x is not self.x:
            self.x.copy_(x, non_blocking=True)
        if y is not self.y:
            self.y.copy_(y, non_blocking=True)
        window = trainer._memory_window() if trainer._track_memory else None
        timed, clock = trainer._timed, trainer._clock
        if timed and clock.last is None:  # the chain of step ends is broken: mark a start
            clock.begin()
        self.graph.replay()
        # a replay changes GradScaler's scale unseen (no version bump): the scale log starts
        # afresh; the trainer's current one (a config change since capture builds a new policy)
        log = getattr(trainer._policy, "log", None)
        if log is not None:
            log.invalidate()
        elapsed = clock.end() if timed else None  # the replay's end: its period, as a step's
        values = self.packed.clone()  # the next replay overwrites ``packed``
        loss, norm, found, scale = (values[v] if packed else v for packed, v in self.slots)
        return trainer._record(loss, norm, found if found is not None else False, scale,
                               self.cause, trainer.optimizer.param_groups[0]["lr"],
                               elapsed, window)
