"""The largest batch per simulated card: for each configuration, peak memory is fitted against
the batch from a few measured batches (``search.fit_batch_memory``; on a CPU the counted memory
model), and the prediction for each card is verified with real training steps under the card's
memory cap (``search.verified_batch``), which walks from the prediction to the boundary however
far off the prediction was. Each verified boundary joins the fit for the larger cards. Every card
that fits on this device gets its exact cell: no time budget and no search window decide which
cells stay empty or only bounded."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from amp_lessons.data import synthetic_images
from amp_lessons.numerics.precision import check_precision, precision_settings
from amp_lessons.measure.config import BenchConfig, skip_reason
from amp_lessons.measure.counted import counted_memory_model
from amp_lessons.measure.memory import GIB
from amp_lessons.measure.oom import free_memory, is_out_of_memory
from amp_lessons.measure.search import LargestBatch, fit_batch_memory, verified_batch
from amp_lessons.measure.steps import build_model, build_optimizer, hand_step


def gpu_trials(config: BenchConfig, device: torch.device):
    """A model and optimizer that live through every trial (they would be on the card anyway);
    ``make(batch)`` returns a callable that runs one training step on a fresh batch."""
    torch.manual_seed(0)
    model = build_model(config, device)
    optimizer = build_optimizer(config, model.parameters())

    def make(batch: int) -> Callable[[], object]:
        model.zero_grad(set_to_none=True)  # a failed trial may have left gradients behind
        step = hand_step(model, optimizer, config.precision, device)
        x, y = synthetic_images(batch, config.image_size, config.num_classes, device,
                                channels_last=config.channels_last)
        return lambda: step(x, y)

    return model, optimizer, make


def reserved_peak(make: Callable[[int], Callable[[], object]], batch: int,
                  device: torch.device) -> int:
    """Peak bytes reserved by two uncapped training steps at ``batch`` (``make`` of
    ``gpu_trials``), memory released before and after."""
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    run = make(batch)
    run()
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    del run
    free_memory(device)
    return peak


def card_row(card: float, technique: str, **values) -> Dict[str, object]:
    """One cell of the largest-batch table, every key present (``values`` override)."""
    row = {"card_gb": card, "technique": technique, "largest_batch": None, "resolution": None,
           "peak_gib": None, "predicted": None, "trials": 0, "seconds": 0.0, "status": "ok",
           "reason": "", "how": ""}
    row.update(values)
    return row


FIT_BATCHES = (8, 16, 32)  # the uncapped batches whose peaks the fit goes through, on a GPU


def largest_per_card(config: BenchConfig, cards: Sequence[float], device: torch.device,
                     total_gib: Optional[float], resolution_parts: int = 16,
                     max_batch: int = 8192) -> List[Dict[str, object]]:
    """The largest batch of ``config`` on each card of ``cards`` (GiB), smallest card first.

    Peak memory against the batch is fitted from a few measured batches (``FIT_BATCHES``,
    uncapped, on a GPU; ``counted_memory_model`` on a CPU); each card's prediction is then
    verified by training steps under the card's cap (``verified_batch``), in units of
    ``resolution`` images (the largest power of two at most the prediction divided by
    ``resolution_parts``), up to ``max_batch``: a low prediction costs a few more trials (the
    search gallops), never a cell. On a GPU each card's verified boundary (the card's bytes at
    the batch between the largest that fit and the first that did not) joins the fit, so larger
    cards are predicted from measured points near them rather than from ``FIT_BATCHES`` alone. A
    card larger than the device (``total_gib``) is skipped with the reason; every other card
    gets its answer.
    """
    reason = skip_reason(config, device)
    if reason is None:
        try:
            check_precision(config.precision, device)
        except ValueError as exc:
            reason = str(exc)
    if reason:
        return [card_row(c, config.label, status="skipped", reason=reason) for c in cards]
    cuda = device.type == "cuda"
    rows: List[Dict[str, object]] = []
    model = optimizer = make = None
    with precision_settings(config.precision, device):
        try:
            if cuda:
                try:
                    model, optimizer, make = gpu_trials(config, device)
                    free_memory(device)
                    make(2)()  # optimizer state exists from here on
                    peaks = {b: reserved_peak(make, b, device) for b in FIT_BATCHES}
                    fit = refit(peaks)
                except Exception as exc:  # noqa: BLE001 - a device too small for the fit
                    if not is_out_of_memory(exc):
                        raise
                    return [card_row(c, config.label, status="skipped",
                                     reason=f"out of memory at batch {FIT_BATCHES[-1]} without "
                                            f"any cap") for c in cards]
                peak_bytes, how = None, "CUDA allocator capped at {card:g} GiB"
            else:
                line = counted_memory_model(config, device)
                fit = {"fixed": line["fixed_bytes"], "per_sample": max(line["bytes_per_image"], 1.0)}
                make = lambda b: (lambda: None)  # noqa: E731 - the model decides, no step runs
                peak_bytes = lambda b: int(line["fixed_bytes"] + line["bytes_per_image"] * b)  # noqa: E731
                how = "counted memory model (a CPU has no allocator cap)"
            for card in cards:
                if cuda and card > total_gib:
                    rows.append(card_row(card, config.label, status="skipped",
                                         reason=f"this device has {total_gib:.1f} GiB: a "
                                                f"{card:g} GB card cannot be simulated"))
                    continue
                t0 = time.perf_counter()
                predicted = max(1.0, (card * GIB - fit["fixed"]) / max(fit["per_sample"], 1.0))
                resolution = 1
                while resolution * 2 <= predicted / resolution_parts:
                    resolution *= 2
                limit = max(1, max_batch // resolution)
                found = verified_batch(
                    lambda k, r=resolution: make(k * r), int(card * GIB),
                    int(predicted // resolution), device=device if cuda else None, limit=limit,
                    peak_bytes=None if cuda else (lambda k, r=resolution: peak_bytes(k * r)))
                rows.append(finish_row(card, config.label, found, resolution,
                                       limit * resolution, time.perf_counter() - t0,
                                       how.format(card=card), int(predicted)))
                if cuda and 0 < found.batch_size < limit:  # the boundary, measured: refit
                    peaks[(2 * found.batch_size + 1) * resolution // 2] = card * GIB
                    fit = refit(peaks)
        finally:
            del model, optimizer, make
            free_memory(device)
    return rows


def refit(peaks: Dict[int, float]) -> Dict[str, float]:
    """``fit_batch_memory`` of ``peaks`` (batch -> bytes); where the allocator's blocks hid the
    growth (no slope), all of the largest batch's peak counts as per-sample: a low prediction,
    which the verified search walks up from."""
    try:
        return fit_batch_memory(peaks)
    except ValueError:
        top = max(peaks)
        return {"fixed": 0.0, "per_sample": max(peaks[top] / top, 1.0)}


def finish_row(card: float, technique: str, found: LargestBatch, resolution: int, limit: int,
               seconds: float, how: str, predicted: Optional[int] = None) -> Dict[str, object]:
    """A ``card_row`` from what ``verified_batch`` found (in units of ``resolution`` images)."""
    batch = found.batch_size * resolution
    fit = [t for t in found.trials if t["fits"] and t["batch_size"] == found.batch_size]
    row = card_row(card, technique, largest_batch=batch, resolution=resolution,
                   peak_gib=fit[-1]["peak_gib"] if fit else None, predicted=predicted,
                   trials=len(found.trials), seconds=seconds, how=how)
    if batch == 0:
        row["reason"] = "not even the smallest batch fits"
    elif batch >= limit:
        row["reason"] = f"fits at the search limit ({limit}): the largest batch is at least this"
    return row
