"""The one out-of-memory classifier (``is_out_of_memory``), the one answer to "how much memory
may this process still use" (``free_bytes``), releasing what a measurement left
(``free_memory``) and capping the allocator to simulate a smaller card (``memory_cap``)."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from amp_lessons.env import allocatable_bytes


def free_memory(device=None, reset_compiler: bool = False) -> None:
    """Release what the last measurement left: garbage, cached CUDA blocks, compiled graphs."""
    if reset_compiler and hasattr(torch, "_dynamo"):  # a torch without dynamo compiled nothing
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an out-of-memory error, whatever its class: CUDA's or the CPU allocator's, and
    cuDNN's or cuBLAS's own words for it (``CUDNN_STATUS_ALLOC_FAILED``,
    ``CUBLAS_STATUS_ALLOC_FAILED``). The one classifier every measurement uses."""
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    if isinstance(exc, (oom, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "cuda_error_out_of_memory" in text
                                              or "alloc_failed" in text
                                              or "can't allocate memory" in text)


def free_bytes(device=None) -> Optional[int]:
    """Bytes this process may still allocate on ``device``: the driver's free memory plus what
    PyTorch's cache holds unused, never more than ``env.allocatable_bytes`` (a simulated card's
    memory) less what is allocated. None for a device without a CUDA allocator (a CPU)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    cap = allocatable_bytes(device) - torch.cuda.memory_allocated(device)
    return max(0, min(free + cached, cap))


@contextmanager
def memory_cap(cap_bytes: int, device) -> Iterator[None]:
    """Make this process's CUDA allocator refuse to hold more than ``cap_bytes`` on ``device``.

    Simulates a smaller card with ``torch.cuda.set_per_process_memory_fraction``; the previous
    fraction is restored afterwards. Memory already held by this process counts toward the cap.
    """
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    usable = allocatable_bytes(device)  # a simulated card's memory where one is simulated
    if not (0 < cap_bytes <= usable):
        raise ValueError(f"cap_bytes must be in (0, {usable}] (the memory this process may use "
                         f"on this device); got {cap_bytes!r}")
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None) or \
        getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    old = getter(index) if getter else usable / total  # older torch: the card's own cap
    free_memory(device)
    torch.cuda.set_per_process_memory_fraction(cap_bytes / total, index)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(old, index)
        free_memory(device)


