"""Memory accounting: bytes held by tensors (each storage once), the activations autograd saves
for backward, and the breakdown of one step's memory into parameters, gradients and activations.
It runs outside the timed steps (``runner`` calls it before the warm-up)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

GIB = 2**30


def storage_key(t: torch.Tensor):
    """What identifies ``t``'s storage (address, device); None for a tensor without one."""
    try:
        return t.untyped_storage().data_ptr(), t.device
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
        return None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors``, each storage counted once (views share their storage)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        key = storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every tensor in the optimizer's per-parameter state (momentum, exp_avg, exp_avg_sq...)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


class SavedActivations:
    """Count the bytes autograd saves for backward inside the ``with`` block.

    A ``torch.autograd.graph.saved_tensors_hooks`` pair sees every tensor saved for backward;
    each storage is counted once and parameters are left out (they are held anyway), so what
    remains is the activations (and, under autocast, the half-precision copies of weights).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {storage_key(t) for t in exclude}
        self._sizes: Dict[object, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in self._exclude and key not in self._sizes:
            self._sizes[key] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved so far."""
        return sum(self._sizes.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def memory_breakdown(step: "Step", x: torch.Tensor, y: torch.Tensor,
                     device) -> Dict[str, Optional[float]]:
    """Run one training step of ``step`` and measure where its memory goes, in GiB.

    Parameters and gradients (read between backward and the optimizer step) are summed over
    their tensors; activations are the storages saved for backward (``SavedActivations``). On a
    GPU, ``activations_allocated_gib`` also gives the growth of allocated memory across the
    forward pass, which includes what checkpointing keeps and saved-tensor hooks cannot see.
    Optimizer state exists only after a step that was not skipped: read it with
    ``optimizer_state_tensors`` once training ran.
    """
    params = list(step.model.parameters())
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
    with SavedActivations(exclude=params) as saved:
        loss = step.forward(x, y)
    after_forward = torch.cuda.memory_allocated(device) if cuda else None
    step.backward(loss)
    grads = tensor_bytes(p.grad for p in params if p.grad is not None)
    step.update()
    return {
        "params_gib": tensor_bytes(params) / GIB,
        "grads_gib": grads / GIB,
        "activations_gib": saved.bytes / GIB,
        "activations_allocated_gib": (after_forward - before) / GIB if cuda else None,
    }


