"""Training checkpoints, resumed: ``resume_experiment`` trains a digits model without a break, and
resumed from a checkpoint with and without the GradScaler's state, and compares their steps
(lesson 05).
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Dict

import torch

from amp_lessons import models
from amp_lessons.data import digits_loaders
from amp_lessons.measure.activation_checkpointing import deterministic_kernels
from amp_lessons.measure.oom import free_memory
from amp_lessons.numerics.precision import as_device, check_precision
from amp_lessons.train.trainer import ScalerSettings, Trainer, TrainConfig
from amp_lessons.validate import check_int

def resume_experiment(precision: str = "fp16", model: str = "mlp", total_steps: int = 40,
                      resume_at: int = 20, batch_size: int = 64, lr: float = 0.05,
                      init_scale: float = 2.0 ** 24, device=None, seed: int = 0,
                      directory=None) -> Dict[str, object]:
    """Train a digits model three ways from the same seed and compare their steps.

    ``uninterrupted``: ``total_steps`` steps in one go. ``resumed with scaler state``:
    ``resume_at`` steps, ``save_checkpoint``, a fresh Trainer (new model, optimizer, scaler)
    ``load_checkpoint``, then the rest. ``resumed without scaler state``: the same with
    ``load_checkpoint(load_scaler=False)``: the new GradScaler starts again at ``init_scale``
    (set high, as a scale that has not settled yet would be), so the steps after the resume
    overflow until it has halved back down. Returns ``runs`` (name -> ``History.columns()``),
    ``resume_step``, ``saved_scale`` (the scale in the checkpoint), ``init_scale`` and
    ``summary`` (one row per resumed run, compared with the uninterrupted one from the resume
    step on). cuDNN runs deterministically, so a GPU repeats a step bit for bit, as a CPU does.
    """
    check_int("total_steps", total_steps, 2)
    check_int("resume_at", resume_at, 1)
    if resume_at >= total_steps:
        raise ValueError(f"resume_at must be in [1, {total_steps - 1}] (before total_steps); "
                         f"got {resume_at}")
    device = as_device(device)
    precision = check_precision(precision, device)
    settings = ScalerSettings(init_scale=init_scale)

    def new_trainer() -> "Trainer":
        torch.manual_seed(seed)
        net, size = models.build_digits_model(model)
        trainer_ = Trainer(net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
                           TrainConfig(precision=precision, scaler=settings, progress=False,
                                       seed=seed), device=device)
        trainer_.image_size = size
        return trainer_

    def loader(trainer_):
        return digits_loaders(batch_size, trainer_.image_size, device, seed)[0]

    runs: Dict[str, dict] = {}
    with deterministic_kernels(), tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "checkpoint.pt"
        whole = new_trainer()
        whole.fit(loader(whole), epochs=total_steps, max_steps=total_steps)
        runs["uninterrupted"] = whole.history.columns()
        first = new_trainer()
        first.fit(loader(first), epochs=total_steps, max_steps=resume_at)
        first.save_checkpoint(path)
        saved_scale = float(first.scaler.get_scale()) if first.scaler.is_enabled() else 1.0
        del whole, first
        for name, load_scaler in (("resumed with scaler state", True),
                                  ("resumed without scaler state", False)):
            again = new_trainer()
            again.load_checkpoint(path, load_scaler=load_scaler)
            again.fit(loader(again), epochs=total_steps, max_steps=total_steps - resume_at)
            runs[name] = again.history.columns()
            del again
    free_memory(device)
    ref = runs["uninterrupted"]
    summary = []
    for name in ("resumed with scaler state", "resumed without scaler state"):
        cols = runs[name]
        after = range(resume_at, total_steps)
        burst = 0
        for i in after:
            if not cols["skipped"][i]:
                break
            burst += 1
        summary.append({
            "run": name,
            "steps": len(cols["step"]),
            "same_history_before_resume": all(cols[k][:resume_at] == ref[k][:resume_at]
                                              for k in ("loss", "scale", "skipped")),
            "first_scale_after_resume": cols["scale"][resume_at],
            "max_loss_diff_after_resume": max(abs(cols["loss"][i] - ref["loss"][i])
                                              for i in after),
            "same_scales_after_resume": [cols["scale"][i] for i in after]
                                        == [ref["scale"][i] for i in after],
            "skipped_after_resume": sum(1 for i in after if cols["skipped"][i]),
            "skipped_in_a_row_at_resume": burst,
            "uninterrupted_skipped_after_resume": sum(1 for i in after if ref["skipped"][i]),
        })
    return {"runs": runs, "resume_step": resume_at, "saved_scale": saved_scale,
            "init_scale": float(init_scale), "precision": precision, "summary": summary,
            "expected_burst": max(0, round(math.log2(float(init_scale) / saved_scale)))
            if saved_scale > 0 else None}
