"""Record values the trainer (``trainer.py``) computes only when they are read, off a step's
critical path (``records.Deferred``): the gradient norm kept as per-parameter norms
(``NormParts``) and the peak memory of a window of steps (``PeakWindow``); ``total_norm`` is the
eager norm they reduce to, bit for bit. On a short, host-bound GPU step every kernel launch and
allocator call shows in the step time (benchmarks/NOTES.md, issue 22)."""
from __future__ import annotations

from typing import List, Optional

import torch

from .records import Deferred


def total_norm(grads: List[torch.Tensor], one_group: bool = False) -> torch.Tensor:
    """The 2-norm of all ``grads`` together. On one device and dtype (``one_group``, the usual
    case): the same three kernels as ``torch.nn.utils.get_total_norm`` (foreach norms, stack,
    norm), so the same bits, without its grouping work on the host (a third of its host time)."""
    if one_group:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    norms = torch._foreach_norm(grads)
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


class NormParts(Deferred):
    """The gradient norm of a step, kept as its per-parameter norms (``torch._foreach_norm``'s
    output, one kernel launch on the step) and reduced when read: ``stack`` and ``vector_norm``
    then, the very ops ``total_norm`` runs, so the same bits. Host-bound short steps pay per
    kernel launch; this moves two of the norm's launches off the step.

    On CUDA ``_foreach_norm`` returns its norms as views, in order, of one 1-D tensor: then only
    that tensor is kept (``parts`` is ``[it]``, ``flat``), which is ``stack(norms)`` already (no
    Python object per parameter and step in a long unread history)."""

    __slots__ = ("parts", "flat")
    dtype = torch.float32  # what it reads as (``tensor()`` casts): the record takes it as is

    def __init__(self, norms: List[torch.Tensor]):
        self.parts, self.flat = norms, None
        base = norms[0]._base
        if base is not None:
            # n views of a 1-D tensor of n elements whose first and last lie n - 1 apart:
            # stride 1, first to last (a few attribute reads a step, no device work)
            n = len(norms)
            if (base.shape == (n,) and norms[-1]._base is base
                    and norms[-1].storage_offset() - norms[0].storage_offset() == n - 1):
                self.parts, self.flat = [base], base

    def tensor(self) -> torch.Tensor:
        stacked = self.flat if self.flat is not None else torch.stack(self.parts)
        norm = torch.linalg.vector_norm(stacked)
        return norm if norm.dtype == torch.float32 else norm.float()

    def read(self) -> float:
        return float(self.tensor().item())


class PeakWindow(Deferred):
    """The peak allocated CUDA memory of a window of steps: the trainer resets the device's
    peak counter when it opens one (the first tracked step after the last window was read) and
    the allocator is asked once, when a record of the window is first read. Two allocator calls
    per window instead of per step (``memory_stats_as_nested_dict`` builds the allocator's whole
    statistics dictionary: several points of a short, host-bound step)."""

    __slots__ = ("device", "value")

    def __init__(self, device: torch.device):
        self.device, self.value = device, None

    def read(self) -> Optional[int]:
        if self.value is None:
            self.value = int(torch.cuda.memory_stats_as_nested_dict(self.device)
                             ["allocated_bytes"]["all"]["peak"])
        return self.value
