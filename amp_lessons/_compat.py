"""The one place the package touches private PyTorch API: GradScaler's internals, the fused
optimizers' ``found_inf`` protocol and the inf/NaN check kernel. Each use is guarded, so that a
torch release that renames one of them degrades to an exact public fallback instead of failing
(``tests/test_policies.py``, its ``test_compat_*`` tests, checks every accessor against the
installed torch: ``make test`` runs them on torch 2.14.1 and, in ``make test-oldest``, on the
oldest torch the package supports, 2.4.1; the attributes read here exist unchanged from torch 2.4
to 2.14). ``torch_version`` is the one place versions are compared.

What GradScaler keeps (``torch/amp/grad_scaler.py``, 2.4 to 2.14):

- ``_scale`` / ``_growth_tracker``: 0-dim tensors made lazily by the first ``scale()``;
  ``_init_scale``: the float the scale tensor is made from; ``_get_scale_async()``: ``_scale``.
- ``_per_optimizer_states``: a ``defaultdict`` keyed by ``id(optimizer)`` of
  ``{"stage": OptState, "found_inf_per_device": {device: 0-dim float32 tensor}}``, filled by
  ``unscale_`` (or by ``step`` for an optimizer with ``_step_supports_amp_scaling``) and reset by
  ``update()``. ``_found_inf_per_device(optimizer)`` reads it.
- An optimizer whose ``_step_supports_amp_scaling`` is true (Adam, AdamW, SGD with
  ``fused=True``) reads ``optimizer.grad_scale`` and ``optimizer.found_inf`` during ``step()``:
  its kernel divides by the scale and leaves parameters and state untouched where
  ``found_inf == 1`` (the step counters are put back by ``_foreach_sub_``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["torch_version", "FOUND_INF_READABLE", "scale_tensor", "scale_reader", "found_inf",
           "forget_step", "cap_growth_tracker", "init_scale", "reset_scale", "supports_found_inf",
           "step_skipping", "NonFiniteCheck"]


def torch_version() -> "tuple[int, int]":
    """(major, minor) of the installed torch: ``(2, 4)`` for ``2.4.1+cu121``."""
    import re
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None:
        raise ValueError(f"cannot read a version from torch.__version__ {torch.__version__!r}")
    return int(found.group(1)), int(found.group(2))


#: whether this torch's GradScaler lets its per-step inf/NaN flag be read
FOUND_INF_READABLE = hasattr(torch.amp.GradScaler, "_found_inf_per_device")


def scale_tensor(scaler) -> Optional[torch.Tensor]:
    """GradScaler's live scale (a 0-dim float32 device tensor), or None when it has not been
    made yet (before the first ``scale()``) or the attribute is gone."""
    return scale_reader(scaler)()


def scale_reader(scaler) -> Callable[[], Optional[torch.Tensor]]:
    """A function returning ``scale_tensor(scaler)``, looked up once (the trainer calls it
    every step)."""
    get = getattr(scaler, "_get_scale_async", None)
    if callable(get):
        return get
    return lambda: getattr(scaler, "_scale", None)


def found_inf(scaler, optimizer) -> Optional[torch.Tensor]:
    """This step's inf/NaN flag as GradScaler computed it for ``optimizer`` (a 0-dim float32
    tensor, 1.0 = skipped), without a host sync; None when ``unscale_``/``step`` has not run
    for it yet this step, or GradScaler no longer exposes it (then the caller checks itself)."""
    try:
        per_device = scaler._found_inf_per_device(optimizer)
    except (AttributeError, KeyError, TypeError):
        return None
    try:
        (one,) = per_device.values()  # the usual case: one device
        return one
    except (ValueError, AttributeError):
        values = list(per_device.values()) if isinstance(per_device, dict) else []
    if not values:
        return None
    total = values[0]
    for v in values[1:]:  # several devices: any one of them set means skipped
        total = torch.maximum(total, v.to(total.device, non_blocking=True))
    return total


def forget_step(scaler, optimizer) -> bool:
    """Forget GradScaler's record of ``optimizer``'s current step (after ``unscale_`` without
    ``step``/``update``, e.g. a step that raised or was cancelled): the next step starts fresh
    instead of failing with "unscale_() has already been called". Returns whether it could."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return False
    states.pop(id(optimizer), None)  # a defaultdict: the next access makes a fresh state
    return True


def cap_growth_tracker(scaler, interval: int) -> None:
    """Cap GradScaler's count of good steps at ``interval - 1`` on the device (no sync). torch
    grows the scale when the count EQUALS the interval, so an interval lowered below the count
    would stall growth until the next overflow; capped, the scale grows at the next good step."""
    tracker = getattr(scaler, "_growth_tracker", None)
    if isinstance(tracker, torch.Tensor):
        tracker.clamp_(max=interval - 1)


def init_scale(scaler) -> float:
    """The float GradScaler makes its scale tensor from (``_init_scale``; where that is gone,
    the current scale, which costs a host sync)."""
    value = getattr(scaler, "_init_scale", None)
    return float(value) if value is not None else float(scaler.get_scale())


def reset_scale(scaler, init_scale: float) -> None:
    """Make ``init_scale`` GradScaler's initial scale, and its current one when the scale tensor
    already exists (``update(new_scale=...)``, public API, which also resets the good-step
    count)."""
    if hasattr(scaler, "_init_scale"):
        scaler._init_scale = float(init_scale)  # used when the scale tensor is made lazily
    if scaler.is_enabled() and scale_tensor(scaler) is not None:
        scaler.update(new_scale=float(init_scale))


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` honours ``found_inf`` inside its kernel (fused Adam, AdamW,
    SGD): then a skipped step costs nothing beyond the flag."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_skipping(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """``optimizer.step()`` that does nothing where ``flag`` (0-dim float32, exactly 0.0 or 1.0)
    is 1, decided inside the fused kernel: no host sync, no copy. Only for optimizers where
    ``supports_found_inf`` is true; gradients must already be unscaled (``grad_scale`` None)."""
    optimizer.grad_scale, optimizer.found_inf = None, flag
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


class NonFiniteCheck:
    """1.0 where any of the given tensors holds inf/NaN, else 0.0: a fresh 0-dim float32 tensor
    per call, no host sync. GradScaler's own check kernel
    (``torch._amp_foreach_non_finite_check_and_unscale_``) runs with an inverse scale of exactly 1,
    which leaves every value bitwise as it was: one kernel per (device, dtype) group. Without
    that kernel (not expected on torch >= 2.4) it falls back to ``isfinite``.

    The flags are views of a block of ``POOL`` zeros made at once (one fill kernel per
    ``POOL`` checks instead of one per check; each flag is used once and never reused).
    ``pool = False`` (set while a CUDA graph is captured, which must zero its flag at every
    replay) makes each flag with its own ``torch.zeros``."""

    POOL = 256

    def __init__(self):
        self._ones: Dict[torch.device, torch.Tensor] = {}
        self._kernel = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
        self._zeros: Dict[torch.device, List[torch.Tensor]] = {}
        self.pool = True

    def zero_flag(self, device: torch.device) -> torch.Tensor:
        """A 0-dim float32 zero on ``device`` no one else holds: from the pre-zeroed block."""
        if not self.pool:
            return torch.zeros((), dtype=torch.float32, device=device)
        free = self._zeros.get(device)
        if not free:
            free = self._zeros[device] = list(
                torch.zeros(self.POOL, dtype=torch.float32, device=device).unbind())
            free.reverse()  # handed out in address order
        return free.pop()

    def __call__(self, tensors: Sequence[torch.Tensor], device: torch.device,
                 uniform: bool = False) -> torch.Tensor:
        """``uniform``: the caller knows every tensor is float32 on ``device`` (no checks).
        Sparse gradients (``nn.Embedding(sparse=True)``) are checked through their coalesced
        values: the kernel takes dense tensors, and a sparse tensor holds inf/NaN exactly
        where those do."""
        try:
            free = self._zeros.get(device) if self.pool else None
            found = free.pop() if free else self.zero_flag(device)
            if uniform and self._kernel is not None:
                self._kernel(tensors, found, self._one(found.device))
                return found
            first = tensors[0]
            kind = (first.device, first.dtype)
            if self._kernel is not None and kind[0] == found.device and \
                    kind[1] in self.DTYPES and all((t.device, t.dtype) == kind for t in tensors):
                self._kernel(tensors, found, self._one(kind[0]))  # one call
                return found
            grouped: Dict[tuple, List[torch.Tensor]] = {}
            for t in tensors:
                grouped.setdefault((t.device, t.dtype), []).append(t)
            for (dev, dtype), group in grouped.items():
                if self._kernel is None or dtype not in self.DTYPES:
                    bad = torch.stack([(~torch.isfinite(t)).any() for t in group]).any()
                    found = torch.maximum(found, bad.float().to(device))
                    continue
                flag = found if dev == found.device else torch.zeros((), device=dev)
                self._kernel(group, flag, self._one(dev))
                if flag is not found:
                    found = torch.maximum(found, flag.to(device, non_blocking=True))
            return found
        except (NotImplementedError, RuntimeError):
            if not any(t.is_sparse for t in tensors):
                raise
        return self([t.coalesce()._values() if t.is_sparse else t for t in tensors], device,
                    uniform)

    DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

    def _one(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return one
