"""Memory counted tensor by tensor, for devices without a peak-memory counter (a CPU): what a
training step holds at its peak (``counted_step_memory``), a straight line of it against the batch
(``counted_memory_model``), and the bytes each forward saves for backward (``ForwardSaved``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from amp_lessons import models
from amp_lessons.validate import check_int
from amp_lessons.data import synthetic_images
from amp_lessons.numerics.precision import as_device, precision_settings
from amp_lessons.measure.config import BenchConfig
from amp_lessons.measure.memory import SavedActivations, optimizer_state_tensors, tensor_bytes
from amp_lessons.measure.oom import free_memory
from amp_lessons.measure.steps import build_model, build_optimizer, hand_step


def counted_step_memory(config: BenchConfig, device=None,
                        batch_size: Optional[int] = None) -> Dict[str, int]:
    """What a training step of ``config`` holds at its peak, counted tensor by tensor, in bytes.

    For devices without an allocator to read (a CPU): ``state_bytes`` (parameters, gradients,
    optimizer state), ``kept_bytes`` (tensors saved for backward, the inputs that checkpointed
    units keep included), ``recompute_bytes`` (what the largest checkpointed unit saves while
    it is recomputed in backward, 0 without checkpointing) and ``peak_bytes``, their sum. A
    model of the peak, not a measurement of it: temporaries and allocator overhead are left out.
    """
    device = as_device(device)
    batch = config.batch_size if batch_size is None else batch_size
    check_int("batch_size", batch, 1)
    if config.checkpoint == "sac":
        raise ValueError("checkpoint 'sac' cannot be counted: the tensors selective checkpointing "
                         "saves bypass saved-tensor hooks; measure it on a GPU (one of "
                         f"{', '.join(str(m) for m in models.CHECKPOINT_MODES if m != 'sac')})")
    with precision_settings(config.precision, device):
        torch.manual_seed(0)
        model = build_model(config, device)
        optimizer = build_optimizer(config, model.parameters())
        x, y = synthetic_images(batch, config.image_size, config.num_classes, device,
                                channels_last=config.channels_last)
        params = list(model.parameters())
        step = hand_step(model, optimizer, config.precision, device)
        recompute = [0]

        def measure_unit(unit, args, output):
            # the unit's input is already counted: checkpoint saves it through the outer hooks
            t = args[0]
            with torch.enable_grad(), SavedActivations(exclude=params) as inner, \
                    models.KeepBatchNormStats(unit.module):
                unit.module(t.detach().requires_grad_())
            recompute[0] = max(recompute[0], inner.bytes)

        handles = [m.register_forward_hook(measure_unit) for m in model.modules()
                   if isinstance(m, models.Checkpointed)]
        try:
            with SavedActivations(exclude=params) as kept:
                loss = step.forward(x, y)
        finally:
            for h in handles:
                h.remove()
        step.backward(loss)
        grads = tensor_bytes(p.grad for p in params if p.grad is not None)
        step.update()  # creates the optimizer state that every later step holds
        if not optimizer_state_tensors(optimizer):  # fp16: GradScaler skipped that first step
            step(x, y)
        state = (tensor_bytes(params) + grads
                 + tensor_bytes(optimizer_state_tensors(optimizer)))
        kept_bytes = kept.bytes
    del model, optimizer, step, x, y, loss
    free_memory(device)
    return {"state_bytes": state, "kept_bytes": kept_bytes, "recompute_bytes": recompute[0],
            "peak_bytes": state + kept_bytes + recompute[0]}


def counted_memory_model(config: BenchConfig, device=None,
                         batch_sizes: Sequence[int] = (2, 4)) -> Dict[str, float]:
    """A straight line through ``counted_step_memory`` at two batch sizes:
    ``peak_bytes(b) = fixed_bytes + bytes_per_image * b`` (what the CPU's simulated cards use)."""
    if len(batch_sizes) != 2 or batch_sizes[0] >= batch_sizes[1]:
        raise ValueError(f"batch_sizes must be two increasing batch sizes; got {batch_sizes!r}")
    lo, hi = (counted_step_memory(config, device, b)["peak_bytes"] for b in batch_sizes)
    per_image = max(0.0, (hi - lo) / (batch_sizes[1] - batch_sizes[0]))
    return {"fixed_bytes": lo - per_image * batch_sizes[0], "bytes_per_image": per_image}


class ForwardSaved:
    """Bytes saved for backward by each forward of ``model`` (a fresh count per call)."""

    def __init__(self, model: nn.Module):
        self.exclude = list(model.parameters())
        self.counts: List[int] = []
        self._active: List[SavedActivations] = []
        self.handles = [model.register_forward_pre_hook(self._pre),
                        model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        saved = SavedActivations(exclude=self.exclude)
        saved.__enter__()
        self._active.append(saved)

    def _post(self, module, args, output):
        saved = self._active.pop()
        saved.__exit__(None, None, None)
        self.counts.append(saved.bytes)

    def abandon(self) -> None:
        """Close the counts a failed forward left open (its hooks would stay installed)."""
        while self._active:
            self._active.pop().__exit__(None, None, None)

    def remove(self) -> None:
        self.abandon()
        for h in self.handles:
            h.remove()

