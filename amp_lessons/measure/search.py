"""Searches: a batch size that fits a device, and the largest batch under a memory cap."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from amp_lessons.validate import check_int
from amp_lessons.numerics.precision import as_device
from amp_lessons.measure.memory import GIB
from amp_lessons.measure.oom import free_memory, is_out_of_memory, memory_cap


def batch_size_for(total_memory_gib: Optional[float], image_size: int = 224,
                   largest: int = 256, fp32_gib_per_image: float = 0.085,
                   fraction: float = 0.6) -> int:
    """A power-of-two batch whose fp32 ResNet-50 step fits in ``fraction`` of the device memory.

    ``fp32_gib_per_image`` is the peak per 224x224 image of an fp32 step (about 21.4 GiB at batch
    256 on an H200); it scales with the pixel count. ``None`` memory (a CPU) gives ``largest``.
    """
    check_int("largest", largest, 1)
    check_int("image_size", image_size, 8)
    if not (0 < fraction <= 1):
        raise ValueError(f"fraction must be in (0, 1]; got {fraction!r}")
    if total_memory_gib is None:
        return largest
    per_image = fp32_gib_per_image * (image_size / 224) ** 2
    batch = 1
    while batch * 2 <= largest and batch * 2 * per_image <= fraction * total_memory_gib:
        batch *= 2
    return batch



# --- the largest batch under a memory cap -------------------------------------------------------
@dataclass
class LargestBatch:
    """What ``largest_batch`` found: the batch size (0 if none fits) and every trial made."""

    batch_size: int
    cap_bytes: int
    trials: List[Dict[str, object]] = field(default_factory=list)



def _trial_runner(make_step, cap_bytes: int, device, cuda: bool, peak_bytes,
                  result: LargestBatch) -> Callable[[int], bool]:
    """``fits(batch)``: one trial of the search (two training steps), recorded in ``result``."""

    def fits(batch: int) -> bool:
        trial = {"batch_size": batch, "fits": False, "peak_gib": None, "reason": ""}
        step = None
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            step = make_step(batch)
            step()
            step()
            if cuda:
                torch.cuda.synchronize(device)
                trial["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
                trial["fits"] = True
            else:
                need = int(peak_bytes(batch))
                trial["peak_gib"] = need / GIB
                trial["fits"] = need <= cap_bytes
                if not trial["fits"]:
                    trial["reason"] = "out of memory (simulated)"
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            trial["reason"] = "out of memory"
        finally:
            del step
            free_memory(device if cuda else None)
        result.trials.append(trial)
        return bool(trial["fits"])

    return fits


def _search_setup(make_step, cap_bytes, device, peak_bytes):
    """What both searches start from: the checked cap, the device, whether the real allocator
    is capped (CUDA without a fake ``peak_bytes``), an empty result and its trial function."""
    if not isinstance(cap_bytes, int) or cap_bytes < 1:
        raise ValueError(f"cap_bytes must be an integer >= 1; got {cap_bytes!r}")
    device = as_device(device)
    cuda = device.type == "cuda" and peak_bytes is None
    if not cuda and peak_bytes is None:
        raise ValueError("peak_bytes is required when device is not a CUDA device")
    result = LargestBatch(0, cap_bytes)
    return device, cuda, result, _trial_runner(make_step, cap_bytes, device, cuda, peak_bytes,
                                               result)


def largest_batch(make_step: Callable[[int], Callable[[], object]], cap_bytes: int, device=None,
                  start: int = 1, limit: int = 4096,
                  peak_bytes: Optional[Callable[[int], int]] = None) -> LargestBatch:
    """The largest batch size whose training step runs within ``cap_bytes`` of memory.

    ``make_step(batch_size)`` builds what one trial needs and returns a callable that runs a
    training step (it is called twice, so optimizer state exists on the second). The search
    doubles from ``start`` until a trial fails or ``limit`` is reached, then bisects between the
    last batch that fit and the first that did not. On a GPU ``memory_cap`` enforces the cap;
    elsewhere ``peak_bytes(batch_size)`` (a fake memory model, for tests) says what a trial needs.
    Out-of-memory errors are caught and memory is released after every trial.
    """
    check_int("start", start, 1)
    check_int("limit", limit, start)
    device, cuda, result, fits = _search_setup(make_step, cap_bytes, device, peak_bytes)

    with memory_cap(cap_bytes, device) if cuda else nullcontext():
        good, bad = 0, None
        batch = start
        while batch <= limit:
            if fits(batch):
                good = batch
                if batch == limit:
                    break
                batch = min(batch * 2, limit)
            else:
                bad = batch
                break
        while bad is not None and bad - good > 1:  # bisect between what fit and what did not
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    result.batch_size = good
    return result


def fit_batch_memory(peaks: Dict[int, float]) -> Dict[str, float]:
    """Fit peak memory against batch size, ``peak = fixed + per_sample * batch``, by least
    squares over a few measured batches (``{batch_size: peak_bytes}``, at least two sizes).

    Memory grows linearly with the batch (activations scale with it; weights, gradients and
    optimizer state do not), so a few small batches predict the largest that fits a card:
    ``predict(cap) = (cap - fixed) / per_sample``. Returns ``fixed``, ``per_sample`` (bytes).
    """
    if not isinstance(peaks, dict) or len(peaks) < 2:
        raise ValueError("peaks must map at least two batch sizes to their peak bytes")
    xs = [check_int("batch size", b, 1) for b in peaks]
    ys = [float(v) for v in peaks.values()]
    if any(not (v > 0) for v in ys):
        raise ValueError(f"peaks must be positive byte counts; got {sorted(peaks.items())}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    per = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if not per > 0:
        raise ValueError(f"peaks must grow with the batch size; got {sorted(peaks.items())}")
    return {"fixed": my - per * mx, "per_sample": per}


def predicted_batch(fit: Dict[str, float], cap_bytes: float, limit: int) -> int:
    """The largest batch the fit (``fit_batch_memory``) says fits ``cap_bytes``, within
    [0, ``limit``]."""
    check_int("limit", limit, 1)
    batch = int((cap_bytes - fit["fixed"]) // fit["per_sample"])
    return max(0, min(limit, batch))


def verified_batch(make_step: Callable[[int], Callable[[], object]], cap_bytes: int,
                   predicted: int, device=None, limit: int = 4096,
                   peak_bytes: Optional[Callable[[int], int]] = None) -> LargestBatch:
    """The largest batch under ``cap_bytes``, searched from a prediction (``fit_batch_memory``).

    The first trial runs at ``predicted``; from there the search gallops (1, 2, 4... batches) up
    while trials fit, or down while they do not, then bisects between the last batch that fit and
    the first that did not. With a good prediction that is two or three trials, whatever the
    card. Trials are ``largest_batch``'s: two training steps, out-of-memory errors caught, memory
    released after each; ``memory_cap`` enforces the cap on a GPU, ``peak_bytes`` elsewhere.
    """
    check_int("limit", limit, 1)
    check_int("predicted", predicted, 0)
    device, cuda, result, fits = _search_setup(make_step, cap_bytes, device, peak_bytes)
    with memory_cap(cap_bytes, device) if cuda else nullcontext():
        first = max(1, min(limit, predicted))
        if fits(first):
            good, bad, jump = first, None, 1
            while good < limit:
                nxt = min(limit, good + jump)
                if fits(nxt):
                    good, jump = nxt, jump * 2
                else:
                    bad = nxt
                    break
        else:
            good, bad, jump = 0, first, 1
            while bad > 1:
                nxt = max(1, bad - jump)
                if fits(nxt):
                    good = nxt
                    break
                bad, jump = nxt, jump * 2
        while bad is not None and bad - good > 1:  # bisect between what fit and what did not
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(mid) else (good, mid)
    result.batch_size = good
    return result
