"""Precision policies, the trainer's (``trainer.py``): what one optimizer step does about loss
scaling and non-finite values. One small object per policy, one interface, so the step reads
like nanoGPT's::

    policy.backward(loss)                       # per micro-batch
    policy.unscale_()                           # only when something reads true gradients
    found_inf = policy.check(loss, grad_norm)   # 0-dim flag (1.0 = skip) or None, no host sync
    found_inf = policy.step(found_inf)          # the optimizer step, skipped where flagged
    policy.update()                             # after the step (GradScaler's scale update)

- ``ScalerPolicy``: fp16 with GradScaler, exactly PyTorch's AMP recipe (``scaler.step`` skips;
  for non-fused optimizers GradScaler itself reads the flag on the host, as in the recipe). The
  scale each step used is kept by ``_compat.ScaleLog`` (replayed when read, no copy per step).
- ``SkipPolicy`` (``nonfinite="skip"``): the flag from GradScaler's own check kernel at scale 1
  (over the gradients, or over the per-parameter gradient norms when the trainer computes them:
  a gradient holds inf/NaN exactly where its norm does, barring a float32 overflow of the norm);
  fused optimizers skip inside their kernel (``found_inf``), others keep a device copy of
  parameters and optimizer state and put it back where the flag is set, no host sync
  (``TrainConfig(nonfused_skip="copy")``, the default on a GPU), or let one host read decide
  whether to step (``"sync"``: no copies; the default on a CPU, where a read waits for nothing).
- ``RaisePolicy`` (``nonfinite="raise"``): skips like ``SkipPolicy`` and, once a step was
  non-finite, keeps skipping every later step on the device until the host learns of it (a
  pinned copy of the flag, read once its CUDA event has completed: ``Event.query`` never waits);
  the trainer then raises ``NonFiniteError`` naming that step and rolls its counters back.
- ``IgnorePolicy`` (``nonfinite="ignore"``): plain ``optimizer.step()``, no check, no cost.

Private API (GradScaler's internals, the fused ``found_inf`` protocol, the check kernel) is
used through ``_compat`` only.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from amp_lessons._compat import (FOUND_INF_READABLE, NonFiniteCheck, ScaleLog, forget_step, scale_reader,
                      step_skipping, supports_found_inf)
from amp_lessons._compat import found_inf as scaler_found_inf
from amp_lessons.train.config import NONFUSED_SKIPS
from amp_lessons.train.skipsafe import UpdateGuard
from amp_lessons.validate import check_choice
from amp_lessons.train.records import SKIPPED_BY_SCALER, SKIPPED_NONFINITE

SKIPPED_RAISE = "non-finite loss or gradient (nonfinite='raise'; the step raised)"


class Policy:
    """The interface (and the ``ignore`` behaviour). ``cause``: the skip reason recorded for a
    skipped step; ``scaling``: whether losses are scaled (GradScaler)."""

    name = "ignore"
    cause: Optional[str] = None
    scaling = False
    can_skip = False  # whether a step may be skipped (fused SGD then needs primed buffers)

    def __init__(self, optimizer: torch.optim.Optimizer, params: List[torch.Tensor],
                 device: torch.device):
        self.optimizer, self.params, self.device = optimizer, params, device
        self.fused = supports_found_inf(optimizer)

    def unscale_first(self, guard) -> bool:
        """Whether ``unscale_`` must run before the step although nothing reads gradients."""
        return False

    def checks_before_step(self, unscale_first: bool) -> bool:
        """Whether ``check`` can return a flag before the step (else the trainer skips the
        call: host time counts on short steps)."""
        return False

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss."""
        loss.backward()

    def unscale_(self) -> None:
        """Make the gradients true gradients (a no-op without a scaler)."""

    #: the loss scale the last ``step`` used (a 0-dim tensor under GradScaler), else 1.0
    scale = 1.0

    def scale_used(self):
        """The loss scale of the step in progress (a tensor or 1.0), before ``update``."""
        return 1.0

    def check(self, loss: torch.Tensor, grad_norm: Optional[torch.Tensor]):
        """This step's inf/NaN flag if known before the step (0-dim float32, 1.0 = skip)."""
        return None

    def step(self, found_inf):
        """The optimizer step, skipped where ``found_inf`` is set; returns the final flag."""
        self.optimizer.step()
        return found_inf

    def update(self) -> None:
        """After the step (GradScaler: move the scale)."""

    def forget(self) -> None:
        """Forget a step that will not complete (it raised, or a hook cancelled it)."""

    def first_bad(self, wait: bool = False):
        """The first non-finite step the host can see, for ``raise`` (others: None)."""
        return None

    def reset(self) -> None:
        """Forget every step not yet reported (a checkpoint was loaded)."""

    def adopt(self, old: "Policy") -> None:
        """Take over what ``old`` (the policy this one replaces on a config change) still
        tracks."""

    def capturing(self, on: bool) -> None:
        """A CUDA graph of the step is being captured (``on``) or that is over: per-step
        shortcuts whose state lives outside the graph are off meanwhile (pre-zeroed flags)."""
        check = getattr(self, "_check", None)
        if check is not None:
            check.pool = not on


IgnorePolicy = Policy


class ScalerPolicy(Policy):
    """fp16 with a GradScaler: PyTorch's AMP recipe, step for step."""

    name, cause, scaling, can_skip = "scaler", SKIPPED_BY_SCALER, True, True

    def __init__(self, optimizer, params, device, scaler):
        super().__init__(optimizer, params, device)
        self.scaler = scaler
        self._check = NonFiniteCheck()
        self._unscaled = False  # unscale_ ran this step (then GradScaler's flag is known)
        self._scale = scale_reader(scaler)
        self._early = False
        # the scale each step used, without a copy per step (``ScaleLog``)
        self.log = ScaleLog(scaler)
        self.lazy_scale = self.log.usable
        self.update = self.log.update  # scaler.update(), then the log's note: bound once

    def capturing(self, on):
        super().capturing(on)
        self.lazy_scale = self.log.usable and not on  # a graph copies its scale itself
        self.log.invalidate()

    def unscale_first(self, guard) -> bool:
        # with a BatchNorm guard and an optimizer GradScaler steps from the host (not fused),
        # unscale_ before step (as step would), so the guard's restore is queued before step()'s
        # host sync instead of after it
        self._early = guard is not None and not self.fused
        return self._early

    def checks_before_step(self, unscale_first):
        # GradScaler's flag is set by unscale_, and step() reads it: fetching it after step
        # costs the same. Before it only where the BatchNorm guard restores before step, or
        # where the flag is unreadable (our own check must see the gradients before clipping)
        return unscale_first and (self._early or not FOUND_INF_READABLE)

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def unscale_(self):
        self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def scale_used(self):
        current = self._scale()
        return current.clone() if current is not None else self.scaler.get_scale()

    def check(self, loss, grad_norm):
        # known before the step only after an explicit unscale_ (clip by value comes after this)
        return self.step_flag() if self._unscaled else None

    def step_flag(self):
        """GradScaler's flag for this step, or our own check where it cannot be read."""
        found = scaler_found_inf(self.scaler, self.optimizer)
        if found is None:  # GradScaler's flag unreadable: check the gradients ourselves
            found = self._check([p.grad for p in self.params if p.grad is not None], self.device)
        return found

    def step(self, found_inf):
        # the scale this step used, before update() changes it in place: kept by the log (a
        # lazy value, no device work) or copied
        current = self._scale()
        lazy = self.lazy_scale and current is not None
        if lazy:
            self.scale = self.log.used()
        else:
            self.scale = current.clone() if current is not None else self.scaler.get_scale()
        self.scaler.step(self.optimizer)  # unscales here if not done before; skips on inf/NaN
        self._unscaled = False
        if found_inf is None:
            found_inf = scaler_found_inf(self.scaler, self.optimizer)
            if found_inf is None:
                found_inf = self.step_flag()
        if lazy:  # the flag update() consumes (GradScaler's own: the log is usable)
            self.log.flag = found_inf
        return found_inf

    def forget(self):
        forget_step(self.scaler, self.optimizer)
        self._unscaled = False
        self.log.flag = None


class SkipPolicy(Policy):
    """``nonfinite="skip"`` without a GradScaler (fp32, tf32, bf16)."""

    name, cause, can_skip = "skip", SKIPPED_NONFINITE, True
    #: non-fused optimizers: "copy" (device copy put back, no sync) or "sync" (one host sync a
    #: step); ``TrainConfig(nonfused_skip=...)``
    non_fused = "copy"

    def __init__(self, optimizer, params, device):
        super().__init__(optimizer, params, device)
        self._check = NonFiniteCheck()
        self._update_guard = UpdateGuard(params, optimizer)
        # float32 parameters on one device (the usual case): gradients and a float32 loss
        # need no grouping, the check is one kernel call
        kinds = {(p.device, p.dtype) for p in params}
        self._f32_device = next(iter(kinds))[0] if kinds and all(
            dt == torch.float32 for _, dt in kinds) and len(kinds) == 1 else None

    def checks_before_step(self, unscale_first):
        return True

    def check(self, loss, grad_norm):
        if loss.dtype != torch.float32:
            loss = loss.float()
        if isinstance(grad_norm, torch.Tensor):  # a non-finite gradient makes it non-finite
            return self._check([loss, grad_norm.float()], self.device)
        if grad_norm is not None:  # the per-parameter norms (trainer._NormParts): one kernel
            tensors = [loss]
            tensors.extend(grad_norm.parts)
            if self._f32_device is not None and loss.device == self._f32_device:
                return self._check(tensors, self._f32_device, uniform=True)
            return self._check(tensors, self.device)
        tensors = [p.grad for p in self.params if p.grad is not None]
        tensors.append(loss)
        if self._f32_device is not None and loss.device == self._f32_device:
            return self._check(tensors, self._f32_device, uniform=True)
        return self._check(tensors, self.device)

    def step(self, found_inf):
        opt = self.optimizer
        if self.fused:  # the kernel reads found_inf and leaves everything as it was
            step_skipping(opt, found_inf)
            return found_inf
        guard = self._update_guard
        tensors = None if self.non_fused == "sync" else guard.tensors()
        if tensors is None:  # no state yet (first step), state elsewhere, or chosen: the host
            if not bool(found_inf.item()):
                opt.step()
                guard.stepped = True
            return found_inf
        with torch.no_grad():  # parameters are written in place
            guard.take(tensors)
            opt.step()
            guard.stepped = True
            guard.restore_if(found_inf)
        return found_inf


class HostFlags:
    """How ``RaisePolicy`` gets each step's flag to the host without waiting: on CUDA a pinned
    slot the flag is copied into (non-blocking) and a CUDA event recorded after the copy, read
    once ``event.query()`` says it is done; elsewhere the flag itself.

    The slots are views of pinned blocks of ``POOL`` floats made at once, and a slot and its
    event go back to a free list when their step has been read (``give_back``): per step one
    copy and one event record, instead of a pinned allocation, a new event, a copy and a
    record (before issue 22's fourth round). ``block`` and ``event`` make a block of n floats
    and an event (tests pass stand-ins to run the CUDA path on a CPU)."""

    POOL = 64

    def __init__(self, device: torch.device, block=None, event=None):
        self.cuda = torch.device(device).type == "cuda"
        self._block = block or (lambda n: torch.empty(n, dtype=torch.float32, pin_memory=True))
        self._event = event or torch.cuda.Event
        self._free: list = []   # (slot, event) pairs whose step was read
        self._slots: list = []  # slots of the newest block never handed out

    def send(self, flag: torch.Tensor):
        """(host tensor, event or None): the host tensor holds ``flag`` once the event is done."""
        if not self.cuda:
            return flag, None
        if self._free:
            slot, event = self._free.pop()
        else:
            if not self._slots:
                self._slots = list(self._block(self.POOL).unbind())
                self._slots.reverse()  # handed out in address order
            slot, event = self._slots.pop(), self._event()
        slot.copy_(flag, non_blocking=True)
        event.record()
        return slot, event

    def give_back(self, host, event) -> None:
        """Reuse ``send``'s pair once its event is done (the host has read the slot)."""
        if self.cuda and event is not None:
            self._free.append((host, event))


class RaisePolicy(SkipPolicy):
    """``nonfinite="raise"``: skip on the device, stay skipped, tell the host without waiting."""

    name, cause = "raise", SKIPPED_RAISE

    def __init__(self, optimizer, params, device):
        super().__init__(optimizer, params, device)
        self.tripped = torch.zeros((), dtype=torch.float32, device=device)
        self.pending: list = []  # (step, epoch, batches_done, host flag, CUDA event or None)
        self.host_flags = HostFlags(device)
        self._undo = None  # (sticky flag, queue length) before this step's check

    def check(self, loss, grad_norm):
        flag = super().check(loss, grad_norm)
        self._undo = (self.tripped, len(self.pending))
        # sticky: once a step was non-finite, every later step is skipped too, until raised
        # into the step's own fresh flag (NonFiniteCheck's), which becomes the sticky one: one
        # kernel, and no earlier step's flag (a record's) is ever written again
        self.tripped = torch.maximum(self.tripped, flag, out=flag)
        return flag

    def update(self):
        self._undo = None  # the step completed: its flag stays

    def forget(self):
        """A step cancelled by a hook, or one that raised, never happened: its flag is not
        sticky and is not reported (a NaN step a hook cancelled raises nothing)."""
        if self._undo is None:
            return
        self.tripped, kept = self._undo
        self._undo = None
        for *_, host, event in self.pending[kept:]:
            if event is not None and event.query():
                self.host_flags.give_back(host, event)
        del self.pending[kept:]

    def watch(self, flag: torch.Tensor, step: int, epoch: int, batches_done: int) -> None:
        """Queue a host copy of ``flag`` for ``step`` (pinned, non-blocking on CUDA)."""
        host, event = self.host_flags.send(flag)
        self.pending.append((step, epoch, batches_done, host, event))

    def _drop_pending(self) -> None:
        """Forget every queued step; the pairs whose copy is done go back to the pool (one still
        in flight is left to the garbage collector, never written again)."""
        for *_, host, event in self.pending:
            if event is not None and event.query():
                self.host_flags.give_back(host, event)
        self.pending.clear()

    def reset(self):
        self._drop_pending()
        self.tripped = torch.zeros((), dtype=torch.float32, device=self.device)
        self._undo = None

    def adopt(self, old):
        if isinstance(old, RaisePolicy):
            self.pending, self.tripped = old.pending, old.tripped
            self.host_flags = old.host_flags  # the queued steps' slots come from its pool

    def first_bad(self, wait: bool = False):
        """(step, epoch, batches_done) of the first non-finite step the host can see, or None;
        ``wait``: wait for every queued step. Steps found finite are dropped from the queue."""
        while self.pending:
            step, epoch, done, host, event = self.pending[0]
            if event is not None and not event.query():
                if not wait:
                    return None
                event.synchronize()
            if host.tolist():
                self.reset()
                return step, epoch, done
            self.pending.pop(0)
            self.host_flags.give_back(host, event)
        return None


POLICIES = {"skip": SkipPolicy, "raise": RaisePolicy, "ignore": IgnorePolicy}


def make_policy(precision: str, nonfinite: str, scaler, optimizer, params, device,
                nonfused_skip: str = "auto") -> Policy:
    """The policy for a trainer: GradScaler's when it is enabled (fp16), else ``nonfinite``'s;
    ``nonfused_skip`` ("auto", "copy" or "sync"): how skip and raise skip a non-fused optimizer
    ("auto": "sync" on a CPU, where a read waits for nothing, else "copy")."""
    if scaler.is_enabled():
        return ScalerPolicy(optimizer, params, device, scaler)
    policy = POLICIES[nonfinite](optimizer, params, device)
    if isinstance(policy, SkipPolicy):
        policy.non_fused = resolve_nonfused_skip(nonfused_skip, device)
    return policy


def resolve_nonfused_skip(nonfused_skip: str, device) -> str:
    """``"auto"`` made concrete for ``device``: ``"sync"`` on a CPU (reading a flag there waits for
    no queued work, and copying parameters and state costs time), ``"copy"`` elsewhere; "copy"
    and "sync" stay as they are."""
    check_choice("nonfused_skip", nonfused_skip, NONFUSED_SKIPS)
    if nonfused_skip != "auto":
        return nonfused_skip
    return "sync" if torch.device(device).type == "cpu" else "copy"
