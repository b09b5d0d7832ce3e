"""What the trainer records: one ``StepRecord`` per optimizer step, kept lazy (device tensors read on
first use), and ``History``, the list of them plus per-epoch summaries. Results become JSON through
``tables.json_safe``."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import numpy as np
import torch

from amp_lessons.files import write_atomic
from amp_lessons.tables import json_safe

# --- history -------------------------------------------------------------------------------------

class Deferred:
    """A StepRecord value the trainer computes only when it is read (``read()``), off the
    step's critical path: ``trainer.py`` uses it for the gradient norm (kept as per-parameter
    norms) and the peak memory of a window of steps. ``tensor()``: the value as a 0-dim tensor
    still on the device, or None where it is a host value (``History.materialize`` then copies
    the tensors of many records at once)."""

    def read(self):
        """The value as a Python number (or None)."""
        raise NotImplementedError

    def tensor(self) -> Optional[torch.Tensor]:
        """The value as a 0-dim device tensor, or None when it is not one."""
        return None


class _Lazy:
    """A StepRecord field that may hold a device tensor (or a ``Deferred``: the step time's
    CUDA events are one) until first read.

    Reading it converts to a Python number once and caches it; the trainer never waits for the GPU.
    """

    def __init__(self, kind: str):
        self.kind = kind  # "float" | "bool" | "events" | "int"

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None  # the dataclass default
        value = obj.__dict__.get(self.slot)
        if isinstance(value, Deferred):
            tensor = value.tensor()
            value = value.read() if tensor is None else tensor
            obj.__dict__[self.slot] = value
        if isinstance(value, torch.Tensor):
            value = _to_python(value.item(), self.kind)
            obj.__dict__[self.slot] = value
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.slot] = value

    def pending(self, obj):
        """The raw tensor if not yet materialised, else None (a ``Deferred`` device value is
        turned into its tensor here; a ``Deferred`` host value is read)."""
        value = obj.__dict__.get(self.slot)
        if isinstance(value, Deferred):
            tensor = value.tensor()
            value = value.read() if tensor is None else tensor
            obj.__dict__[self.slot] = value
        return value if isinstance(value, torch.Tensor) else None


def _to_python(value, kind: str):
    if value is None:
        return None
    return bool(value) if kind == "bool" else int(value) if kind == "int" else float(value)


@dataclass
class StepRecord:
    """One optimizer step. Numbers read as Python values (materialised lazily from the device).

    ``loss``: mean training loss over the step's micro-batches; ``scale``: the loss scale used for
    this step's backward (1.0 without a scaler); ``skipped``: the scaler skipped the optimizer step
    (inf/NaN gradients); ``grad_norm``: total 2-norm of the unscaled gradients before clipping
    (None when not tracked); ``lr``: learning rate of the first parameter group during the step;
    ``time_s``: the step's period, in seconds (None when ``track_time`` is off): from the end
    of the previous step to the end of this one, so it includes what the host did between the
    two (loading the batch, a hook, reading a record), as throughput sees it, and the periods of
    consecutive steps add up to their span. The first step, and the first one after anything
    else the trainer did (``evaluate``, a checkpoint saved or loaded, ``capture``,
    ``set_scaler`` or a config change, a new ``fit`` epoch, a step that raised or was
    cancelled), is timed from its own start instead. On a GPU the time between CUDA events (the
    device's clock: one event a step, from a pool), on a CPU the wall clock
    (``time.perf_counter``). An epoch's ``time_s`` (``epoch_summary``) is the epoch's wall
    clock, not a sum of these;
    ``peak_memory_bytes``: the peak allocated CUDA memory of the step's memory window (None on
    a CPU or untracked): the trainer resets the device's peak counter once, at the first step
    after a peak was last read, and reads it when one of the window's records is read (or
    ``History.materialize``, an epoch's end); every step of the window shows that peak.
    Reading each record's peak right after its step (before the next) gives that step's own
    peak; an epoch's maximum is the same either way.
    ``skip_reason``: why the step was skipped (None when it was not): GradScaler's inf/NaN
    check under fp16, or the trainer's non-finite policy (``TrainConfig.nonfinite="skip"``).
    """

    step: int
    epoch: int
    loss: float = _Lazy("float")
    scale: float = _Lazy("float")
    skipped: bool = _Lazy("bool")
    grad_norm: Optional[float] = _Lazy("float")
    lr: Optional[float] = _Lazy("float")
    time_s: Optional[float] = _Lazy("events")
    peak_memory_bytes: Optional[int] = _Lazy("int")
    skip_cause: Optional[str] = None  # what would have skipped this step (read skip_reason)

    @classmethod
    def lazy(cls, step: int, epoch: int, loss, scale, skipped, grad_norm, lr, time_s,
             peak_memory_bytes: Optional[int] = None,
             skip_cause: Optional[str] = None) -> "StepRecord":
        """The same record as ``StepRecord(...)``, built with one dict update instead of a
        descriptor call per field (the trainer makes one per step; host time counts there)."""
        record = cls.__new__(cls)
        record.__dict__.update(step=step, epoch=epoch, _loss=loss, _scale=scale,
                               _skipped=skipped, _grad_norm=grad_norm, _lr=lr, _time_s=time_s,
                               _peak_memory_bytes=peak_memory_bytes, skip_cause=skip_cause)
        return record

    @property
    def skip_reason(self) -> Optional[str]:
        """Why the step was skipped, or None when it was not (reads ``skipped``)."""
        return self.skip_cause if self.skipped else None


SKIPPED_BY_SCALER = "GradScaler: inf/NaN gradients at this loss scale"
SKIPPED_NONFINITE = "non-finite loss or gradient (nonfinite='skip')"
STEP_FIELDS = ("step", "epoch", "loss", "scale", "skipped", "grad_norm", "lr", "time_s",
               "peak_memory_bytes", "skip_reason")
_LAZY_FIELDS = ("loss", "scale", "skipped", "grad_norm", "lr", "peak_memory_bytes")


class History(list):
    """The StepRecords of a run, in order, plus ``epochs``: one summary dict per finished epoch
    (see ``epoch_summary``; test_loss/test_accuracy are added when an evaluation loader was
    given)."""

    def __init__(self, records: Iterable[StepRecord] = (), epochs: Iterable[dict] = ()):
        super().__init__(records)
        self.epochs: List[dict] = list(epochs)

    def materialize(self) -> "History":
        """Read every pending device value with one device-to-host copy per field (and the step
        times of CUDA events, waiting for the last one only and giving the events back to the
        trainer's pool)."""
        spans = [r.__dict__["_time_s"] for r in self
                 if isinstance(r.__dict__.get("_time_s"), Deferred)]
        if spans:  # the last span's end event waited for: every earlier one has completed
            spans[-1].read()
            for r in self:
                span = r.__dict__.get("_time_s")
                if isinstance(span, Deferred):
                    r.time_s = span.read(synced=True)
        for name in _LAZY_FIELDS:
            descriptor = StepRecord.__dict__[name]
            pending = [(r, descriptor.pending(r)) for r in self]
            pending = [(r, t) for r, t in pending if t is not None]
            by_device: Dict[torch.device, list] = {}
            for r, t in pending:
                by_device.setdefault(t.device, []).append((r, t))
            for items in by_device.values():
                values = torch.stack([t.reshape(()).float() for _, t in items]).tolist()
                for (r, _), v in zip(items, values):
                    setattr(r, name, _to_python(v, descriptor.kind))
        return self

    def columns(self) -> Dict[str, list]:
        """Plain data for plots: ``{field: [value per step]}`` for every StepRecord field."""
        self.materialize()
        return {name: [getattr(r, name) for r in self] for name in STEP_FIELDS}

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps the scaler skipped."""
        self.materialize()
        return sum(1 for r in self if r.skipped)

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
        """Rebuild a History from ``columns()`` output (used when loading a checkpoint)."""
        n = len(columns.get("step", []))
        fields = [name for name in STEP_FIELDS if name != "skip_reason"]
        reasons = columns.get("skip_reason") or [None] * n  # absent in older checkpoints
        records = [StepRecord(**{name: columns[name][i] for name in fields},
                              skip_cause=reasons[i]) for i in range(n)]
        return cls(records, [dict(e) for e in epochs])


def epoch_summary(epoch: int, records: List[StepRecord], time_s: float,
                  resumed_at_batch: int = 0) -> dict:
    """One finished epoch as plain data.

    ``steps``: optimizer steps this summary covers; ``skipped``: how many of them were skipped;
    ``train_loss``: the mean loss of the steps that were not skipped and whose loss is finite (a
    skipped step's NaN loss does not turn the mean into NaN), None when there is none;
    ``nonfinite_loss_steps``: steps that trained on a non-finite loss (only possible with
    ``nonfinite="ignore"``); ``partial``: True when the epoch was resumed from a checkpoint after
    ``resumed_at_batch`` batches, so the summary covers only the resumed part;
    ``peak_memory_bytes``: the highest peak of its steps (None on a CPU; ``Trainer.fit`` reads
    the peak per epoch, see ``StepRecord``).
    """
    peaks = [r.peak_memory_bytes for r in records if r.peak_memory_bytes is not None]
    trained = [r.loss for r in records if not r.skipped]
    finite = [v for v in trained if math.isfinite(v)]
    return {"epoch": epoch, "steps": len(records), "time_s": time_s,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "train_loss": float(np.mean(finite)) if finite else None,
            "skipped": sum(1 for r in records if r.skipped),
            "nonfinite_loss_steps": len(trained) - len(finite),
            "partial": resumed_at_batch > 0, "resumed_at_batch": resumed_at_batch}

