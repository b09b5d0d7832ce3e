"""Gradient accumulation measured: the memory and time of one optimizer step over ``n``
micro-batches (the trainer's ``accumulate=n``) against one batch of the same examples
(``accumulation_memory``), and how far the two steps' results differ (``accumulation_equivalence``)."""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from amp_lessons import models
from amp_lessons.validate import check_choice, check_int, is_int
from amp_lessons.measure.activation_checkpointing import relative_diff
from amp_lessons.data import digits, synthetic_images
from amp_lessons.numerics.precision import as_device, check_precision
from amp_lessons.train.trainer import Hooks, Trainer, TrainConfig
from amp_lessons.measure.config import MODELS
from amp_lessons.measure.counted import ForwardSaved
from amp_lessons.measure.memory import GIB
from amp_lessons.measure.oom import free_memory, is_out_of_memory
from amp_lessons.measure.timer import time_steps


def accumulation_memory(micro_batch: int = 32, counts: Sequence[int] = (1, 2, 4, 8),
                        precision: str = "fp16", device=None, model: str = "resnet50",
                        image_size: int = 224, num_classes: int = 1000,
                        channels_last: bool = False) -> List[Dict[str, object]]:
    """Memory of one optimizer step with ``n`` micro-batches of ``micro_batch`` (the trainer's
    ``accumulate=n``) against one batch of ``n * micro_batch``, for each ``n`` in ``counts``.

    Each row: ``micro_batches``, ``effective_batch``, the step's ``accumulated_peak_gib`` (peak
    allocated on a GPU, None on a CPU), ``accumulated_saved_gib`` (largest bytes saved for
    backward by one forward, counted), ``accumulated_step_ms``, and the same three for the one
    big batch (``one_batch_*``; ``one_batch_status`` says "out of memory" where it did not fit).
    Each is the second of two steps, so optimizer state and lazy buffers exist.
    """
    check_int("micro_batch", micro_batch, 1)
    counts = list(counts)
    if not counts or any(not is_int(n) or n < 1 for n in counts):
        raise ValueError(f"counts must hold whole numbers >= 1; got {counts!r}")
    counts = [int(n) for n in counts]
    check_choice("model", model, ("resnet18", "resnet50"))
    device = as_device(device)
    precision = check_precision(precision, device)
    torch.manual_seed(0)
    net = MODELS[model](num_classes=num_classes).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    # batches wait on the host, as a loader's would: one micro-batch is on the device at a time
    x_all, y_all = synthetic_images(micro_batch * max(counts), image_size, num_classes, "cpu")
    counter = ForwardSaved(net)

    def two_steps(n_micro: int, size: int) -> Dict[str, object]:
        net.zero_grad(set_to_none=True)  # a step that ran out of memory may have left some
        trainer = Trainer(net, opt, TrainConfig(precision=precision, accumulate=n_micro,
                                                channels_last=channels_last, progress=False,
                                                seed=None, track_grad_norm=False),
                          device=device)
        batches = [(x_all[i * size:(i + 1) * size], y_all[i * size:(i + 1) * size])
                   for i in range(n_micro)]
        try:
            # the second of two steps, timed and its peak read by the one timer
            timed = time_steps(lambda _x, _y: trainer.train_step(batches).loss, None, None,
                               warmup=1, steps=1, device=device)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            return {"peak_gib": peak / GIB if peak is not None else None,
                    "saved_gib": max(counter.counts) / GIB, "step_ms": timed["times_ms"][0],
                    "status": "ok"}
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_memory(exc):
                raise
            return {"peak_gib": None, "saved_gib": None, "step_ms": None,
                    "status": "out of memory"}
        finally:
            counter.abandon()
            del trainer
            free_memory(device)

    rows = []
    try:
        for n in counts:
            acc = two_steps(n, micro_batch)
            one = two_steps(1, n * micro_batch)
            rows.append({"micro_batches": n, "micro_batch": micro_batch,
                         "effective_batch": n * micro_batch,
                         "accumulated_peak_gib": acc["peak_gib"],
                         "accumulated_saved_gib": acc["saved_gib"],
                         "accumulated_step_ms": acc["step_ms"],
                         "one_batch_peak_gib": one["peak_gib"],
                         "one_batch_saved_gib": one["saved_gib"],
                         "one_batch_step_ms": one["step_ms"],
                         "one_batch_status": one["status"]})
    finally:
        counter.remove()
        del net, opt
        free_memory(device)
    return rows



def accumulation_equivalence(model: str = "mlp", precision: str = "fp32", micro_batch: int = 16,
                             micro_batches: int = 4, device=None,
                             seed: int = 0) -> Dict[str, object]:
    """One optimizer step of the trainer on ``micro_batches`` micro-batches of ``micro_batch``
    digits (``accumulate=micro_batches``) against one step on the same examples as one batch.

    ``model`` is a digits model of ``models.build_digits_model`` ("mlp" has no BatchNorm;
    "cnn" has, and BatchNorm normalises each micro-batch by its own statistics, so the two
    differ by more than rounding there). Returns ``loss_diff``, ``grad_rel_diff`` (largest
    relative difference of the gradients, unscaled), ``weight_rel_diff`` (after the step), the
    ``scale`` each used and whether either step was ``skipped``. ``micro_batch *
    micro_batches`` must not exceed the digits training split (a ValueError names the count
    available): every micro-batch holds exactly ``micro_batch`` examples.
    """
    check_int("micro_batch", micro_batch, 1)
    check_int("micro_batches", micro_batches, 1)
    device = as_device(device)
    precision = check_precision(precision, device)
    _, size = models.build_digits_model(model)
    x_all, y_all = digits("train", size, device)
    wanted = micro_batch * micro_batches
    if wanted > len(x_all):
        raise ValueError(f"micro_batch * micro_batches must be at most {len(x_all)} (the digits "
                         f"training examples available); got micro_batch={micro_batch} * "
                         f"micro_batches={micro_batches} = {wanted}")
    x_all, y_all = x_all[:wanted], y_all[:wanted]

    class KeepGrads(Hooks):
        grads: List[torch.Tensor] = []

        def after_unscale(self, trainer_):
            self.grads = [p.grad.detach().clone() for p in trainer_.model.parameters()]

    results = []
    for n in (micro_batches, 1):
        torch.manual_seed(seed)
        net, _ = models.build_digits_model(model)
        x, y = x_all, y_all
        hook = KeepGrads()
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1),
                          TrainConfig(precision=precision, accumulate=n, progress=False,
                                      seed=None, track_grad_norm=False),
                          device=device, hooks=[hook])
        size_each = wanted // n  # micro_batch examples each (n micro-batches) or all of them
        record = trainer.train_step([(x[i * size_each:(i + 1) * size_each],
                                      y[i * size_each:(i + 1) * size_each]) for i in range(n)])
        results.append((float(record.loss), hook.grads, list(net.parameters()),
                        float(record.scale), bool(record.skipped)))
    (la, ga, pa, sa, ka), (lb, gb, pb, sb, kb) = results
    return {"model": model, "precision": precision, "micro_batch": micro_batch,
            "micro_batches": micro_batches, "loss_diff": abs(la - lb),
            "grad_rel_diff": relative_diff(ga, gb), "weight_rel_diff": relative_diff(pa, pb),
            "scale": (sa, sb), "skipped": (ka, kb)}

