"""Skip safety, the trainer's (``trainer.py``): put tensors back on the device, without a host
sync, when a step turns out to be skipped. ``BatchNormGuard`` keeps BatchNorm running statistics
of a skipped step from moving; ``UpdateGuard`` undoes an optimizer step whose gradients were not
finite (``TrainConfig(nonfinite="skip")`` with a non-fused optimizer). ``prime_momentum_buffers``
works around fused SGD's uninitialised momentum after a skipped first step."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn


# --- skip-safe state: BatchNorm buffers, parameters and optimizer state -------------------------

class Snapshot:
    """Copies of a list of tensors, put back where a 0-dim flag is set, without a host sync.

    The copies live in one flat tensor per (device, dtype); ``restore_if`` gathers the current
    values into a second flat tensor, ``torch.where(flag, saved, current)`` on it and copies
    back: a handful of kernels whatever the number of tensors. Layouts (channels_last) are kept.
    """

    def __init__(self):
        self._tensors: list = []
        self._groups: list = []  # (tensors, saved, current, saved_views, current_views)

    def _rebuild(self, tensors: list) -> None:
        self._tensors = tensors
        grouped: Dict[tuple, list] = {}
        for t in tensors:
            grouped.setdefault((t.device, t.dtype), []).append(t)
        self._groups = []
        for ts in grouped.values():
            sizes = [t.numel() for t in ts]
            saved = torch.empty(sum(sizes), dtype=ts[0].dtype, device=ts[0].device)
            current = torch.empty_like(saved)
            self._groups.append((ts, saved, current,
                                 [v.view(t.shape) for v, t in zip(saved.split(sizes), ts)],
                                 [v.view(t.shape) for v, t in zip(current.split(sizes), ts)]))

    def take(self, tensors: list) -> None:
        """Copy ``tensors`` aside (the buffers are reused while the list stays the same)."""
        if len(tensors) != len(self._tensors) or any(
                a is not b for a, b in zip(tensors, self._tensors)):
            self._rebuild(tensors)
        for ts, _, _, saved_views, _ in self._groups:
            torch._foreach_copy_(saved_views, ts)

    def restore(self) -> None:
        """Put every copy back, whatever happened since ``take`` (a step that raised)."""
        with torch.no_grad():
            for ts, _, _, saved_views, _ in self._groups:
                torch._foreach_copy_(ts, saved_views)

    def restore_if(self, skipped: torch.Tensor) -> None:
        """Where ``skipped`` (a 0-dim tensor, nonzero = skipped) is set, put the copies back."""
        if not self._groups:
            return
        flag = skipped > 0
        for ts, saved, current, _, current_views in self._groups:
            torch._foreach_copy_(current_views, ts)
            torch.where(flag.to(current.device, non_blocking=True), saved, current, out=current)
            torch._foreach_copy_(ts, current_views)


class BatchNormGuard(Snapshot):
    """Snapshot BatchNorm buffers before a step; put them back if the step was skipped.

    The trainer calls ``restore_if`` before ``scaler.step``, whose host sync would otherwise leave
    the GPU idle while these kernels are launched. The snapshot is taken at every step: tensor
    version counters cannot tell whether something changed the buffers in between (BatchNorm's
    own kernels and ``.data`` writes leave ``running_mean``'s counter alone). A model without
    BatchNorm gets no guard at all (no kernels).
    """

    _NAMES = ("running_mean", "running_var", "num_batches_tracked")

    def __init__(self, model: nn.Module):
        super().__init__()
        self.modules = [m for m in model.modules()
                        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

    def snapshot(self) -> None:
        """Copy the buffers aside (call before the step's first forward)."""
        self.take([b for m in self.modules for b in (m._buffers.get(k) for k in self._NAMES)
                   if b is not None])


class UpdateGuard(Snapshot):
    """Undo an optimizer step on the device: parameters and optimizer state are copied before
    ``optimizer.step()`` and put back where the step's non-finite flag is set (the non-fused path
    of ``nonfinite="skip"``)."""

    def __init__(self, params: List[torch.Tensor], optimizer: torch.optim.Optimizer):
        super().__init__()
        self.params, self.optimizer = params, optimizer

    def tensors(self) -> Optional[list]:
        """Parameters with a gradient and their optimizer-state tensors; None when some state is
        missing or lives on another device (then only a host-side decision is exact)."""
        out = []
        for p in self.params:
            if p.grad is None:
                continue
            state = self.optimizer.state.get(p)
            if not state:
                return None
            out.append(p)
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    if v.device != p.device:
                        return None
                    out.append(v)
        return out


# --- fused SGD and skipped first steps -------------------------------------------------------

def prime_momentum_buffers(optimizer: torch.optim.Optimizer) -> int:
    """Give each SGD parameter without one a zero momentum buffer; return how many were made.

    Works around a PyTorch bug (seen on 2.11 CUDA and 2.14 CPU): fused SGD allocates its momentum
    buffers uninitialised on the first step, and when GradScaler skips that step the kernel never
    writes them, so the next step reads garbage (NaN parameters on a GPU). A zero buffer gives the
    same first update as SGD's own ``buf = grad`` when ``dampening == 0``, so priming changes no
    result; groups with ``momentum == 0`` need no buffer and are left alone.

    Raises ``ValueError`` for a non-SGD optimizer, or a group with ``dampening != 0`` (priming
    would change its first update; such a group must not be fused under GradScaler).
    """
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"optimizer must be a torch.optim.SGD; got {type(optimizer).__name__}")
    made = 0
    for group in optimizer.param_groups:
        if not group.get("momentum"):
            continue
        if group.get("dampening", 0):
            raise ValueError(f"dampening must be 0 to prime momentum buffers (a zero buffer "
                             f"would change the first update); got {group['dampening']!r}")
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made += 1
    return made


def fused_sgd_groups(optimizer: torch.optim.Optimizer) -> list:
    """The param groups of a fused SGD that keep momentum buffers."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [g for g in optimizer.param_groups if g.get("fused") and g.get("momentum")]
