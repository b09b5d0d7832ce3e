"""What the trainer records: one ``StepRecord`` per optimizer step and ``History``, the list of
them plus one summary per finished epoch (``epoch_summary``). A record keeps its numbers as device
tensors until they are read, so recording a step never waits for the GPU::

    record = trainer.train_step([(x, y)])
    record.loss, record.scale, record.skipped        # Python values, read on first use
    trainer.history.columns()["scale"]               # one list per field, for plots
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import torch

from amp_lessons.files import write_atomic
from amp_lessons.tables import json_safe

SKIPPED_BY_SCALER = "GradScaler: inf/NaN gradients at this loss scale"
SKIPPED_NONFINITE = "non-finite loss or gradient (nonfinite='skip')"
STEP_FIELDS = ("step", "epoch", "loss", "scale", "skipped", "grad_norm", "lr", "skip_reason")
_LAZY = {"loss": float, "scale": float, "skipped": bool, "grad_norm": float, "lr": float}


class _Lazy:
    """A StepRecord field that may hold a 0-dim device tensor until it is first read; reading
    converts it to a Python number once."""

    def __set_name__(self, owner, name):
        self.name, self.slot, self.kind = name, "_" + name, _LAZY[name]

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__.get(self.slot)
        if isinstance(value, torch.Tensor):
            value = obj.__dict__[self.slot] = self.kind(value.item())
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value


@dataclass
class StepRecord:
    """One optimizer step; numbers read as Python values.

    ``loss``: the mean training loss over the step's micro-batches; ``scale``: the loss scale its
    backward used (1.0 without a GradScaler); ``skipped``: the optimizer did not step (GradScaler
    found inf/NaN, the non-finite policy, or ``cancel_step``); ``grad_norm``: the total 2-norm of
    the unscaled gradients before clipping (None unless clipped by norm or
    ``track_grad_norm``); ``lr``: the first param group's learning rate during the step;
    ``skip_reason``: why it was skipped, None when it was not.
    """

    step: int
    epoch: int
    loss: float = _Lazy()
    scale: float = _Lazy()
    skipped: bool = _Lazy()
    grad_norm: Optional[float] = _Lazy()
    lr: Optional[float] = _Lazy()
    skip_cause: Optional[str] = None  # what would have skipped this step (read skip_reason)

    @property
    def skip_reason(self) -> Optional[str]:
        """Why the step was skipped, or None when it was not (reads ``skipped``)."""
        return self.skip_cause if self.skipped else None


class History(list):
    """The StepRecords of a run, in order, plus ``epochs``: one ``epoch_summary`` per finished
    epoch (with test_loss/test_accuracy where ``fit`` had an evaluation loader)."""

    def __init__(self, records: Iterable[StepRecord] = (), epochs: Iterable[dict] = ()):
        super().__init__(records)
        self.epochs: List[dict] = list(epochs)

    def materialize(self) -> "History":
        """Read every pending device value, with one device-to-host copy per field and device."""
        for name, kind in _LAZY.items():
            slot, pending = "_" + name, {}
            for r in self:
                t = r.__dict__.get(slot)
                if isinstance(t, torch.Tensor):
                    pending.setdefault(t.device, []).append((r, t))
            for items in pending.values():
                values = torch.stack([t.reshape(()).float() for _, t in items]).tolist()
                for (r, _), v in zip(items, values):
                    r.__dict__[slot] = kind(v)
        return self

    def columns(self) -> Dict[str, list]:
        """Plain data for plots: ``{field: [value per step]}`` for every StepRecord field."""
        self.materialize()
        return {name: [getattr(r, name) for r in self] for name in STEP_FIELDS}

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps were skipped."""
        return len(self.skipped_step_numbers)

    @property
    def skipped_step_numbers(self) -> List[int]:
        """The ``step`` numbers of the skipped steps."""
        self.materialize()
        return [r.step for r in self if r.skipped]

    def to_json(self, path: Union[str, Path, None] = None, indent: Optional[int] = None) -> str:
        """Steps and epochs as strict JSON (non-finite numbers become null); written to ``path``
        when given, atomically (``files.write_atomic``: a failed write leaves the earlier file)."""
        text = json.dumps(json_safe({"steps": self.columns(), "epochs": self.epochs}),
                          indent=indent)
        if path is not None:
            write_atomic(path, text, "history")
        return text

    @classmethod
    def from_columns(cls, columns: Dict[str, list], epochs: Iterable[dict] = ()) -> "History":
        """Rebuild a History from ``columns()`` output (a checkpoint's); columns of older
        releases that records no longer keep are ignored."""
        n = len(columns.get("step", []))
        names = [name for name in STEP_FIELDS if name != "skip_reason"]
        reasons = columns.get("skip_reason") or [None] * n
        records = [StepRecord(**{name: columns[name][i] for name in names},
                              skip_cause=reasons[i]) for i in range(n)]
        return cls(records, [dict(e) for e in epochs])


def epoch_summary(epoch: int, records: List[StepRecord], time_s: float,
                  peak_memory_bytes: Optional[int] = None, resumed_at_batch: int = 0) -> dict:
    """One finished epoch as plain data.

    ``steps``: optimizer steps it covers; ``skipped``: how many were skipped; ``train_loss``: the
    mean loss of the steps that were not skipped and whose loss is finite (None when there is
    none); ``nonfinite_loss_steps``: steps trained on a non-finite loss (only with
    ``nonfinite="ignore"``); ``time_s``: wall clock; ``peak_memory_bytes``: the epoch's peak
    allocated CUDA memory (None on a CPU or untracked); ``partial``: the epoch was resumed from
    a checkpoint after ``resumed_at_batch`` batches, so the summary covers only that part.
    """
    trained = [r.loss for r in records if not r.skipped]
    finite = [v for v in trained if math.isfinite(v)]
    return {"epoch": epoch, "steps": len(records), "time_s": time_s,
            "peak_memory_bytes": peak_memory_bytes,
            "train_loss": sum(finite) / len(finite) if finite else None,
            "skipped": sum(1 for r in records if r.skipped),
            "nonfinite_loss_steps": len(trained) - len(finite),
            "partial": resumed_at_batch > 0, "resumed_at_batch": resumed_at_batch}
