"""Skip safety, the trainer's (``trainer.py``): put tensors back on the device, without a host
sync, when a step turns out to be skipped. ``BufferGuard`` keeps the running statistics of
BatchNorm (and of the other layers that write buffers in training) from moving on a skipped
step; ``UpdateGuard`` undoes an optimizer step whose gradients were not finite
(``TrainConfig(nonfinite="skip")`` with a non-fused optimizer). ``prime_momentum_buffers``
works around fused SGD's uninitialised momentum after a skipped first step."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm


# --- skip-safe state: BatchNorm buffers, parameters and optimizer state -------------------------

def dense_strides(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``t.numel()`` consecutive elements in some order of its
    dimensions (contiguous, ``channels_last``, any permutation); size-1 dimensions ignored."""
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=t.stride):
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return t.numel() > 0


def _like(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` (``t.numel()`` elements) with ``t``'s shape and, where ``t`` is dense,
    its strides: ``torch._foreach_copy_`` takes its multi-tensor kernel only where every source
    and destination share strides. A ``channels_last`` weight against a contiguous view sent the
    whole list to one copy kernel per tensor (966 of them a step for ResNet-50 with SGD
    momentum, +5% of its step time on the H200: ``benchmarks/results/skip_profile_h200*``)."""
    if t.dim() and dense_strides(t) and not t.is_contiguous():
        return flat.as_strided(t.shape, t.stride())
    return flat.view(t.shape)


class Snapshot:
    """Copies of a list of tensors, put back where a 0-dim flag is set, without a host sync.

    The copies live in one flat tensor per (device, dtype); ``restore_if`` gathers the current
    values into a second flat tensor, ``torch.where(flag, saved, current)`` on it and copies
    back: a handful of kernels whatever the number of tensors. Each copy has its tensor's layout
    (``channels_last`` too), so the copies stay multi-tensor kernels.
    """

    def __init__(self):
        self._tensors: list = []
        self._shapes: list = []
        self._groups: list = []  # (tensors, saved, current, saved_views, current_views)

    @staticmethod
    def _grouped(tensors: list) -> List[list]:
        """``tensors`` in lists of one (device, dtype), in order of first appearance."""
        grouped: Dict[tuple, list] = {}
        for t in tensors:
            grouped.setdefault((t.device, t.dtype), []).append(t)
        return list(grouped.values())

    def _reshaped(self, tensors: list) -> bool:
        """Whether a tensor's shape differs from the one taken at its place (resized in place)."""
        return any(t.shape != s for t, s in zip(tensors, self._shapes))

    def _rebuild(self, tensors: list) -> None:
        self._tensors = tensors
        self._shapes = [t.shape for t in tensors]
        self._groups = []
        for ts in self._grouped(tensors):
            sizes = [t.numel() for t in ts]
            saved = torch.empty(sum(sizes), dtype=ts[0].dtype, device=ts[0].device)
            current = torch.empty_like(saved)
            self._groups.append((ts, saved, current,
                                 [_like(v, t) for v, t in zip(saved.split(sizes), ts)],
                                 [_like(v, t) for v, t in zip(current.split(sizes), ts)]))

    def take(self, tensors: list, resizable: bool = False) -> None:
        """Copy ``tensors`` aside (the buffers are reused while the list stays the same, or
        holds new tensors of the same shapes: an optimizer that replaces its state each step).
        ``resizable``: the tensors may have been resized in place since (a quantization
        observer's per-channel statistics start empty): their shapes are compared too."""
        if len(tensors) != len(self._tensors) or any(
                a is not b for a, b in zip(tensors, self._tensors)):
            if not self._retarget(tensors):
                self._rebuild(tensors)
        elif resizable and self._reshaped(tensors):
            self._rebuild(tensors)
        for ts, _, _, saved_views, _ in self._groups:
            torch._foreach_copy_(saved_views, ts)

    def _retarget(self, tensors: list) -> bool:
        """Point the snapshot at ``tensors`` (same number, shapes, strides, dtypes and devices,
        in the same order as the tensors taken) without new buffers; False where they differ."""
        if len(tensors) != len(self._tensors) or any(
                a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                or a.stride() != b.stride() for a, b in zip(tensors, self._tensors)):
            return False
        for (ts, *_), new in zip(self._groups, self._grouped(tensors)):
            ts[:] = new
        self._tensors = list(tensors)
        return True

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


def stateful_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` whose forward pass in training mode writes their own buffers:
    normalization layers with running statistics (BatchNorm, SyncBatchNorm, InstanceNorm with
    ``track_running_stats``), spectral normalization's power-iteration vectors (both
    ``torch.nn.utils.spectral_norm`` and ``parametrizations.spectral_norm``) and quantization-aware
    training's observers and fake-quantize modules (``torch.ao.quantization``)."""
    kinds = [nn.modules.batchnorm._NormBase]
    spectral = getattr(torch.nn.utils.parametrizations, "_SpectralNorm", None)
    if spectral is not None:
        kinds.append(spectral)
    kinds = tuple(kinds) + _quantization_kinds()
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


class BufferGuard(Snapshot):
    """Snapshot the buffers a training forward writes before a step; put them back if the step
    was skipped: the running statistics of BatchNorm and every other normalization layer that
    keeps them, spectral normalization's vectors, quantization observers (``stateful_modules``).
    Other buffers a custom module writes in its forward are not guarded.

    The trainer calls ``restore_if`` before ``scaler.step``, whose host sync would otherwise leave
    the GPU idle while these kernels are launched. The snapshot is taken at every step: tensor
    version counters cannot tell whether something changed the buffers in between (BatchNorm's
    own kernels and ``.data`` writes leave ``running_mean``'s counter alone). A model without
    such modules gets no guard at all (no kernels).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.modules = stateful_modules(model)
        kinds = _quantization_kinds()  # observers resize their statistics in place
        self._resizable = bool(kinds) and any(isinstance(m, kinds) for m in self.modules)

    def snapshot(self) -> None:
        """Copy the buffers aside (call before the step's first forward)."""
        self.take([b for m in self.modules for b in m._buffers.values() if b is not None],
                  self._resizable)

    def _resized(self) -> bool:
        """Whether the step's forward resized a buffer (an observer's first statistics)."""
        return self._resizable and self._reshaped(self._tensors)

    def restore(self) -> None:
        """Put every buffer back, with its shape before the step."""
        if self._resized():
            with torch.no_grad():
                for t, shape in zip(self._tensors, self._shapes):
                    if t.shape != shape:
                        t.resize_(shape)
        super().restore()

    def restore_if(self, skipped: torch.Tensor) -> None:
        """Where ``skipped`` is set, put the buffers back; a buffer the step resized makes the
        host read the flag (a shape cannot follow a device value)."""
        if self._resized():
            if bool(skipped.item()):
                self.restore()
            return
        super().restore_if(skipped)


class UpdateGuard(Snapshot):
    """Undo an optimizer step on the device: parameters and optimizer state are copied before
    ``optimizer.step()`` and put back where the step's non-finite flag is set (the non-fused path
    of ``nonfinite="skip"``).

    On the device, without a host sync: parameters and optimizer-state tensors on their
    parameter's device, whether the optimizer writes into them (PyTorch's optimizers) or
    replaces them with new tensors of the same shape (``state["buf"] = beta * buf + grad``: the
    old values are written into the new tensors); a stateless optimizer (SGD without momentum)
    needs its parameters only. Where that cannot be exact, the host decides (one sync):
    ``tensors`` returns None before the first step (its state does not exist yet) and for state
    on another device or holding Python numbers (the caller then steps only if the flag is
    clear), and ``restore_if`` reads the flag itself when the step made or reshaped state, or
    changed a param group's values (a custom optimizer's counters), and puts the old ones back
    where it was set."""

    def __init__(self, params: List[torch.Tensor], optimizer: torch.optim.Optimizer):
        super().__init__()
        self.params, self.optimizer = params, optimizer
        self.stepped = False  # the optimizer has stepped once: a param without state then has none
        # PyTorch's own optimizers write their state in place and leave their param groups
        # alone: only the state a step makes is looked at after it (host work counts on short
        # steps); any other optimizer is checked in full
        self._trusted = type(optimizer).__module__.startswith("torch.optim")
        self._slots: list = []  # per tensor taken: (its state dict, key), None for a parameter
        self._states: list = []  # (parameter, its state dict or None, the dict's keys)
        self._hyper: list = []  # (param group, its values) of an optimizer not trusted

    def tensors(self) -> Optional[list]:
        """Parameters with a gradient and their optimizer-state tensors; None when only a
        host-side decision is exact (see the class)."""
        out, states = [], []
        slots = None if self._trusted else []
        state_of = self.optimizer.state
        for p in self.params:
            if p.grad is None:
                continue
            state = state_of.get(p)
            out.append(p)
            if slots is not None:
                slots.append(None)
            if not state:
                if not self.stepped:
                    return None
                states.append((p, None, ()))
                continue
            if slots is not None:
                states.append((p, state, tuple(state)))
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    if v.device != p.device:
                        return None
                    out.append(v)
                    if slots is not None:
                        slots.append((state, k))
                elif v is not None:  # a Python number: only the host can put it back
                    return None
        self._slots, self._states = slots, states
        if slots is not None:
            self._hyper = [(g, {k: v for k, v in g.items() if k != "params"})
                           for g in self.optimizer.param_groups]
        return out

    def _held_now(self) -> Optional[list]:
        """The tensors the optimizer holds now in the places taken, or None where the step made,
        dropped or reshaped state, or changed a param group's values."""
        state_of = self.optimizer.state
        for p, state, keys in self._states:
            now = state_of.get(p)
            if (now is not state and (state is not None or now)) or (
                    state is not None and len(state) != len(keys)):
                return None
        if self._trusted:
            return self._tensors
        for group, values in self._hyper:
            if any(group.get(k) is not v for k, v in values.items()):
                return None
        held = []
        for slot, t in zip(self._slots, self._tensors):
            if slot is None:
                held.append(t)
                continue
            v = slot[0].get(slot[1])
            if v is not t and not (isinstance(v, torch.Tensor) and v.shape == t.shape
                                   and v.dtype == t.dtype and v.device == t.device):
                return None
            held.append(v)
        return held

    def restore_if(self, skipped: torch.Tensor) -> None:
        """Where ``skipped`` is set, put parameters and state back (on the device where it can)."""
        held = self._held_now() if self._states or not self._trusted else self._tensors
        if held is not None:
            if held is not self._tensors and any(a is not b for a, b in zip(held, self._tensors)):
                self._retarget(held)  # the optimizer replaced state tensors: restore into those
            super().restore_if(skipped)
            return
        old = list(self._tensors)
        super().restore_if(skipped)  # what was written in place gets its old values back
        if not bool(skipped.item()):  # the host decides: the step made or reshaped state
            return
        state_of = self.optimizer.state
        for p, state, keys in self._states:
            if state is None:
                state_of.pop(p, None)
                continue
            state_of[p] = state
            for k in [k for k in state if k not in keys]:
                del state[k]
        for slot, t in zip(self._slots or (), old):
            if slot is not None:
                slot[0][slot[1]] = t
        for group, values in self._hyper:
            group.update(values)


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


def fused_sgd_needs_priming(optimizer: torch.optim.Optimizer, can_skip: bool) -> bool:
    """Whether ``optimizer`` has fused SGD groups with momentum that need
    ``prime_momentum_buffers`` (``can_skip``: steps can be skipped); where they can, ValueError
    for a damped one, which priming cannot fix."""
    groups = fused_sgd_groups(optimizer)
    if not groups or not can_skip:
        return False
    damped = [g["dampening"] for g in groups if g.get("dampening", 0)]
    if damped:
        raise ValueError(f"dampening must be 0 for fused SGD when skipped steps are possible "
                         f"(fp16 with GradScaler, or nonfinite 'skip'/'raise'): its momentum "
                         f"is corrupted by a skipped first step, and only a zero buffer with "
                         f"dampening 0 fixes that; got {damped[0]!r}: use foreach=True, "
                         f"dampening=0 or nonfinite='ignore'")
    return True
