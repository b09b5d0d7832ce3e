"""amp_lessons.records: lazy StepRecords, History columns and JSON, epoch summaries."""
import json
import math

import pytest
import torch

from amp_lessons import records as R
from amp_lessons import trainer as T
from trainer_helpers import Inject, batches, fresh


def test_step_records_are_lazy_device_values():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    record = trainer.train_step([batches(1)[0]])
    raw = record.__dict__
    assert all(isinstance(raw[f"_{k}"], torch.Tensor) for k in ("loss", "scale", "skipped",
                                                                  "grad_norm"))
    cols = trainer.history.columns()  # materialises
    assert isinstance(record.__dict__["_loss"], float) and isinstance(record.skipped, bool)
    assert cols["loss"][0] == record.loss and cols["scale"][0] == 65536.0
    assert cols["lr"] == [0.1] and cols["time_s"][0] > 0 and cols["peak_memory_bytes"] == [None]
    assert set(cols) == set(R.STEP_FIELDS)


def test_history_json_is_strict_and_round_trips(tmp_path):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        hooks=[Inject({0})])
    trainer.fit(batches(2), epochs=1)
    text = trainer.history.to_json(tmp_path / "h.json")
    data = json.loads(text)  # strict JSON: the NaN/inf norm became null
    assert data["steps"]["grad_norm"][0] is None and data["steps"]["skipped"] == [True, False]
    assert data["epochs"][0]["steps"] == 2
    again = T.History.from_columns(trainer.history.columns(), trainer.history.epochs)
    assert again.columns()["loss"] == trainer.history.columns()["loss"]


