"""Record values the trainer (``trainer.py``) computes only when they are read, off a step's
critical path (``records.Deferred``): the gradient norm kept as per-parameter norms
(``NormParts``), the peak memory of a window of steps (``PeakWindow``) and the step time
(``StepClock``: one CUDA event a step, from a pool, read as an ``EventSpan``); ``total_norm`` is
the eager norm they reduce to, bit for bit. On a short, host-bound GPU step every kernel launch and
allocator call shows in the step time (benchmarks/NOTES.md, issue 22)."""
from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch

from amp_lessons.train.records import Deferred


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


def _timing_event():
    return torch.cuda.Event(enable_timing=True)


class StepClock:
    """The trainer's step time (``TrainConfig.track_time``), one clock call a step.

    Chained: each step marks only its end (a CUDA event on a GPU, ``time.perf_counter()`` on a
    CPU), and its time is the span from the previous step's end mark to its own: the step's
    period, which includes what the host did between the two steps (loading the batch), as
    throughput sees it. Where the chain is broken (``reset``: the first step, and the first
    one after anything else the trainer did: evaluate, a checkpoint, capture, a scaler or config
    change, a new ``fit`` epoch, a step that raised or was cancelled) ``begin`` marks a start
    first, as the step starts.

    On CUDA no event is created per step: events come from a pool, each with a count of who
    still needs it (the record(s) whose span it bounds, the chain); an event goes back to the
    pool when the last of them has read it (``EventSpan.read``), and the pool grows when it is
    empty. ``make_event`` builds one (a stand-in on the CPU in tests); ``created`` counts them.
    """

    __slots__ = ("cuda", "make_event", "pool", "last", "created")

    def __init__(self, cuda: bool, make_event: Optional[Callable] = None):
        self.cuda = cuda
        self.make_event = make_event if make_event is not None else _timing_event
        self.pool: list = []  # [event, users] cells free to record again
        self.last = None  # where the next step's span starts: a cell (CUDA) or a time (CPU)
        self.created = 0

    def _new(self) -> list:
        self.created += 1
        return [self.make_event(), 0]

    def _mark(self, users: int) -> list:
        pool = self.pool
        cell = pool.pop() if pool else self._new()
        cell[1] = users
        cell[0].record()
        return cell

    def begin(self) -> None:
        """At a step's start: mark a start only where the chain is broken (no call otherwise)."""
        if self.last is None:
            self.last = self._mark(1) if self.cuda else time.perf_counter()

    def end(self):
        """At a step's end: its time, an ``EventSpan`` (CUDA) or seconds (CPU); None where the
        chain was broken inside the step (``begin`` ran before the ``reset``)."""
        if self.cuda:
            pool = self.pool  # ``_mark(2)`` inlined: host calls count on a short step
            cell = pool.pop() if pool else self._new()
            cell[1] = 2  # this step's span and the chain (the next step's span)
            cell[0].record()
            start, self.last = self.last, cell
            # no start: a reset inside the step (a hook evaluated, say): its time is unknown
            return EventSpan(self, start, cell) if start is not None else self.release(cell)
        now = time.perf_counter()
        start, self.last = self.last, now
        return now - start if start is not None else None

    def reset(self) -> None:
        """Break the chain: the next step marks its own start."""
        last, self.last = self.last, None
        if self.cuda and last is not None:
            self.release(last)

    def release(self, cell: list) -> None:
        """One user of ``cell``'s event is done with it; the last one gives it back."""
        cell[1] -= 1
        if cell[1] == 0:
            self.pool.append(cell)


class EventSpan(Deferred):
    """A step's time on a GPU: the span between two events of a ``StepClock`` (the previous
    step's end, or the step's own start, and its end), read in seconds once; reading gives both
    events back to the clock (``StepClock.release``). ``read(synced=True)`` when the end event
    is known to have completed (``History.materialize`` waits for the last one only)."""

    __slots__ = ("clock", "start", "end", "value")

    def __init__(self, clock: StepClock, start: list, end: list):
        self.clock, self.start, self.end, self.value = clock, start, end, None

    def read(self, synced: bool = False) -> float:
        """Seconds between the two events (waiting for the end one unless ``synced``); the
        first read gives the events back to the clock."""
        if self.value is None:
            end = self.end[0]
            if not synced:
                end.synchronize()
            self.value = self.start[0].elapsed_time(end) / 1e3
            self.clock.release(self.start)
            self.clock.release(self.end)
        return self.value
