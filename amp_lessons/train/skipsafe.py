"""Skip safety: a skipped step leaves the model exactly as it was. ``BufferGuard`` puts back the
running statistics of BatchNorm (and of the other layers that write buffers in training) on a
skipped step, on the device; ``prime_momentum_buffers`` works around fused SGD's uninitialised
momentum after a skipped first step (lesson 04 shows the bug)::

    guard = BufferGuard(model)
    guard.snapshot()              # before the step's first forward
    ...                           # forward, backward, optimizer step
    guard.restore_if(found_inf)   # where the step was skipped, the buffers come back
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm


def stateful_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` whose training forward writes their own buffers: normalization
    layers with running statistics (BatchNorm, SyncBatchNorm, InstanceNorm with
    ``track_running_stats``), spectral normalization's vectors (both APIs) and quantization-aware
    training's observers and fake-quantize modules."""
    kinds = (nn.modules.batchnorm._NormBase,) + _quantization_kinds()
    spectral = getattr(torch.nn.utils.parametrizations, "_SpectralNorm", None)
    if spectral is not None:
        kinds += (spectral,)
    found = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and not m.track_running_stats:
            continue
        if isinstance(m, kinds) or any(isinstance(h, SpectralNorm)
                                        for h in m._forward_pre_hooks.values()):
            found.append(m)
    return found


def _quantization_kinds() -> tuple:
    """Quantization-aware training's observer and fake-quantize module classes."""
    try:
        from torch.ao.quantization import FakeQuantizeBase, ObserverBase
    except ImportError:  # pragma: no cover - a torch built without quantization
        return ()
    return (FakeQuantizeBase, ObserverBase)


class BufferGuard:
    """Copies of the buffers ``stateful_modules(model)`` write, taken before a step and put back
    if it was skipped. The copies live in one flat tensor per (device, dtype), so a snapshot or
    a restore is a handful of kernels whatever the number of layers; ``modules`` is empty (and
    the guard does nothing) for a model without such layers. Buffers a custom module writes in
    its own forward are not guarded."""

    def __init__(self, model: nn.Module):
        self.modules = stateful_modules(model)
        self._tensors: list = []
        self._shapes: list = []
        self._groups: list = []  # (tensors, flat [saved, work], views of saved, of work)

    def _buffers(self) -> list:
        return [b for m in self.modules for b in m._buffers.values() if b is not None]

    def snapshot(self) -> None:
        """Copy the buffers aside (call before the step's first forward). Taken every step: no
        counter tells whether something changed the buffers since the last one."""
        tensors = self._buffers()
        if len(tensors) != len(self._tensors) or any(
                a is not b or a.shape != s for a, b, s in zip(tensors, self._tensors, self._shapes)):
            self._tensors, self._shapes, self._groups = tensors, [t.shape for t in tensors], []
            grouped: dict = {}
            for t in tensors:
                grouped.setdefault((t.device, t.dtype), []).append(t)
            for ts in grouped.values():  # a saved copy and a work buffer, as flat tensors
                sizes = [t.numel() for t in ts]
                flat = torch.empty(2, sum(sizes), dtype=ts[0].dtype, device=ts[0].device)
                self._groups.append((ts, flat, *([v.view(t.shape) for v, t in
                                                  zip(half.split(sizes), ts)] for half in flat)))
        with torch.no_grad():
            for ts, _, saved, _ in self._groups:
                torch._foreach_copy_(saved, ts)

    def _resized(self) -> bool:
        """Whether the step resized a buffer in place (an observer's first statistics)."""
        return any(t.shape != s for t, s in zip(self._tensors, self._shapes))

    def restore(self) -> None:
        """Put every buffer back as it was at the snapshot (a step that raised or was
        cancelled)."""
        with torch.no_grad():
            for t, shape in zip(self._tensors, self._shapes):
                if t.shape != shape:
                    t.resize_(shape)
            for ts, _, saved, _ in self._groups:
                torch._foreach_copy_(ts, saved)

    def restore_if(self, skipped: torch.Tensor) -> None:
        """Where ``skipped`` (a 0-dim tensor, nonzero = skipped) is set, put the buffers back,
        on the device: ``torch.where`` on a flat copy, no host sync (a buffer the step resized
        needs the host's decision)."""
        if not self._groups:
            return
        if self._resized():
            if bool(skipped.item()):
                self.restore()
            return
        with torch.no_grad():
            flag = skipped > 0
            for ts, (saved, work), _, views in self._groups:
                torch._foreach_copy_(views, ts)
                torch.where(flag.to(work.device, non_blocking=True), saved, work, out=work)
                torch._foreach_copy_(ts, views)


def prime_momentum_buffers(optimizer: torch.optim.Optimizer) -> int:
    """Give each SGD parameter without one a zero momentum buffer; return how many were made.

    Works around a PyTorch bug: fused SGD allocates its momentum buffers uninitialised on the
    first step, and when GradScaler skips that step the kernel never writes them, so the next
    step reads garbage (NaN parameters on a GPU). A zero buffer gives the same first update as
    SGD's own ``buf = grad`` when ``dampening == 0``, so priming changes no result::

        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        prime_momentum_buffers(opt)

    ValueError for a non-SGD optimizer or a group with ``dampening != 0``.
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


def fused_sgd_needs_priming(optimizer: torch.optim.Optimizer, can_skip: bool) -> bool:
    """Whether ``optimizer`` is a fused SGD with momentum whose steps can be skipped
    (``can_skip``), so ``prime_momentum_buffers`` must run; ValueError for a damped one, which
    priming cannot fix."""
    if not can_skip or not isinstance(optimizer, torch.optim.SGD):
        return False
    groups = [g for g in optimizer.param_groups if g.get("fused") and g.get("momentum")]
    damped = [g["dampening"] for g in groups if g.get("dampening", 0)]
    if damped:
        raise ValueError(f"dampening must be 0 for fused SGD when skipped steps are possible "
                         f"(fp16 with GradScaler, or nonfinite='skip'): its momentum is "
                         f"corrupted by a skipped first step, and only a zero buffer with "
                         f"dampening 0 fixes that; got {damped[0]!r}: use foreach=True, "
                         f"dampening=0 or nonfinite='ignore'")
    return bool(groups)
