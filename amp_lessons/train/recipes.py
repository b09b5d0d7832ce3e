"""Ready-made training runs on the Trainer: ``train_digits`` trains a digits model end to end
(the CLI's ``train`` command and lessons 02-03 call it) and returns a ``DigitsRun``."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

import torch

from amp_lessons.data import digits, digits_loaders
from amp_lessons.models import build_digits_model
from amp_lessons.numerics.precision import Device, as_device, check_precision
from amp_lessons.train.records import History
from amp_lessons.validate import check_int, check_real, check_seed, is_real
from amp_lessons.files import check_writable
from amp_lessons.train.trainer import Hooks, ScalerSettings, TrainConfig, Trainer


@dataclass
class DigitsRun:
    """What ``train_digits`` measured. ``epochs`` are History.epochs (per-epoch summaries)."""

    precision: str
    model: str
    device: str
    epochs: List[dict]
    history: History
    trainer: Optional[Trainer]
    baseline_bytes: Optional[int] = None  # CUDA memory already allocated when the run began

    @property
    def epoch_time_s(self) -> Optional[float]:
        """Median seconds per epoch, the first (warm-up) epoch left out when there are more."""
        times = [e["time_s"] for e in self.epochs]
        return statistics.median(times[1:] if len(times) > 1 else times) if times else None

    @property
    def peak_memory_mib(self) -> Optional[float]:
        """Highest peak of allocated CUDA memory over an epoch's steps, MiB, minus what was already allocated
        when the run began (so runs made one after another compare fairly); None on a CPU."""
        peaks = [e["peak_memory_bytes"] for e in self.epochs if e["peak_memory_bytes"] is not None]
        if not peaks:
            return None
        return (max(peaks) - (self.baseline_bytes or 0)) / 2 ** 20

    @property
    def accuracy(self) -> Optional[float]:
        """Test accuracy after the last epoch, as a fraction."""
        return self.epochs[-1].get("test_accuracy") if self.epochs else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the scaler skipped."""
        return self.history.skipped_steps

    def summary(self) -> dict:
        """Plain data for tables and JSON."""
        return {"precision": self.precision, "model": self.model, "device": self.device,
                "epochs": len(self.epochs), "epoch_time_s": self.epoch_time_s,
                "peak_memory_mib": self.peak_memory_mib, "accuracy": self.accuracy,
                "skipped_steps": self.skipped_steps}


def check_train_sizes(lr: float, batch_size: int, accumulate: int) -> None:
    """ValueError naming the setting for sizes ``train_digits`` would not honour (the CLI's
    ``train`` names them as its flags): a learning rate float32 cannot hold (SGD's update on
    float32 weights fails with torch's 'cannot be converted to type float without overflow'), a
    batch larger than the training set (it would train on batches of the whole set, unsaid), or
    more micro-batches per step than one epoch has (each epoch would be one shorter step)."""
    check_real("lr", lr, 0.0, float(torch.finfo(torch.float32).max))
    examples = len(digits("train")[1])
    check_int("batch_size", batch_size, 1, examples)
    batches = -(-examples // batch_size)
    if check_int("accumulate", accumulate, 1) > batches:
        raise ValueError(f"accumulate must be a whole number in [1, {batches}] (the batches in "
                         f"one epoch of {examples:,} examples in batches of {batch_size}); "
                         f"got {accumulate}")


def train_digits(precision: str = "fp32", model: str = "cnn", epochs: int = 3,
                 batch_size: int = 64, lr: float = 0.05, width: int = 32,
                 image_size: Optional[int] = None, scaler: Optional[ScalerSettings] = None,
                 clip_norm: Optional[float] = None, accumulate: int = 1,
                 eval_precision: str = "same", device: Device = None, seed: int = 0,
                 progress: bool = True, checkpoint: Union[str, Path, None] = None,
                 resume: Union[str, Path, None] = None, hooks: Sequence[Hooks] = (),
                 on_epoch: Optional[Callable[[dict], None]] = None,
                 lr_schedule: str = "constant", nonfinite: str = "skip") -> DigitsRun:
    """Train a digits model (SGD, momentum 0.9) and evaluate it on the test split every epoch.

    ``lr_schedule``: ``"constant"`` (``lr`` throughout) or ``"cosine"`` (``lr`` decayed to 0 over
    ``epochs``; the schedule then depends on the total, so resume with the same ``epochs``).

    ``epochs`` is the total: a run resumed from ``resume`` trains only the epochs still missing.
    ``checkpoint``: saved (atomically) after every epoch. ``image_size`` overrides the CNN's 32.
    ``on_epoch`` gets each epoch's summary as it finishes (the CLI prints it).
    ``nonfinite``: the trainer's policy for inf/NaN without a GradScaler (``TrainConfig``).
    Each step records its gradient norm (lesson 02 plots it).
    """
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("width", width)):
        check_int(name, value, 1)
    seed = check_seed("seed", seed)  # checked before anything trains (torch takes < 2**63)
    if scaler is not None and not isinstance(scaler, ScalerSettings):
        raise ValueError(f"scaler must be None or a ScalerSettings; got {type(scaler).__name__}")
    if on_epoch is not None and not callable(on_epoch):
        raise ValueError(f"on_epoch must be None or a function of the epoch's summary; "
                         f"got {on_epoch!r}")
    if checkpoint is not None:
        check_writable(checkpoint, "checkpoint")  # not after the first epoch has trained
    if not is_real(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite number > 0; got {lr!r}")
    check_train_sizes(lr, batch_size, accumulate)
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine'; got {lr_schedule!r}")
    dev = as_device(device)
    precision = check_precision(precision, dev)
    baseline = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    torch.manual_seed(seed)
    net, size = build_digits_model(model, width)
    if image_size is not None and size is not None:
        size = image_size
    train, test = digits_loaders(batch_size, size, dev, seed)
    config = TrainConfig(precision=precision,
                         scaler=scaler if scaler is not None else ScalerSettings(),
                         clip_norm=clip_norm, accumulate=accumulate,
                         eval_precision=eval_precision, progress=progress, seed=seed,
                         nonfinite=nonfinite, track_grad_norm=True)
    net.to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    schedule = None
    if lr_schedule == "cosine":
        # Decay to zero over the run: the final weights settle, so precisions are compared on
        # converged runs, not on where a constant learning rate happened to leave them.
        steps = epochs * -(-len(train) // accumulate)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    trainer = Trainer(net, opt, config, device=dev, scheduler=schedule, hooks=hooks)
    if resume is not None:
        saved = trainer.load_checkpoint(resume)["config"].get("precision")
        if saved != config.precision:  # the run would continue in another precision, unsaid
            raise ValueError(f"resume: '{resume}' was trained in {saved}; this run asks for "
                             f"{config.precision}: resume with precision {saved!r} (a resumed "
                             f"run continues exactly as it started)")
    while trainer.epoch < epochs:
        trainer.fit(train, epochs=1, eval_loader=test)
        if checkpoint is not None:
            trainer.save_checkpoint(checkpoint)
        if on_epoch is not None:
            on_epoch(trainer.history.epochs[-1])
    return DigitsRun(precision, model, str(dev), trainer.history.epochs, trainer.history, trainer,
                     baseline)
