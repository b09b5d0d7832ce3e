"""amp_lessons.train.records: lazy StepRecords, History columns and JSON, epoch summaries."""
import json
import math

import pytest
import torch

from amp_lessons.train import records as R
from amp_lessons.train import trainer as T
from trainer_helpers import Inject, batches, fresh


def test_step_records_are_lazy_device_values():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    record = trainer.train_step([batches(1)[0]])
    raw = record.__dict__
    assert all(isinstance(raw[f"_{k}"], torch.Tensor) for k in ("loss", "skipped"))
    # the norm is kept as per-parameter norms, the scale in GradScaler's log: both computed
    # on the device when read (issue 22)
    for k in ("scale", "grad_norm"):
        assert isinstance(raw[f"_{k}"], R.Deferred)
        assert isinstance(raw[f"_{k}"].tensor(), torch.Tensor)
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




def test_lazy_constructor_builds_the_same_record():
    t = torch.tensor(2.5)
    a = R.StepRecord(step=3, epoch=1, loss=t, scale=1.0, skipped=torch.tensor(1.0),
                     grad_norm=None, lr=0.1, time_s=0.5, peak_memory_bytes=7,
                     skip_cause=R.SKIPPED_BY_SCALER)
    b = R.StepRecord.lazy(3, 1, t, 1.0, torch.tensor(1.0), None, 0.1, 0.5, 7, R.SKIPPED_BY_SCALER)
    assert a.__dict__.keys() == b.__dict__.keys()
    for name in R.STEP_FIELDS:
        assert getattr(a, name) == getattr(b, name), name
    assert b.skip_reason == R.SKIPPED_BY_SCALER and b.loss == 2.5 and b.skipped is True


def test_epoch_summary_of_a_resumed_part():
    recs = [R.StepRecord.lazy(i, 0, torch.tensor(float(v)), 1.0, torch.tensor(float(s)), None,
                              0.1, 0.2) for i, (v, s) in enumerate([(1, 0), (float("nan"), 1),
                                                                     (3, 0)])]
    summary = R.epoch_summary(0, recs, 1.5, resumed_at_batch=4)
    assert summary["train_loss"] == 2.0 and summary["skipped"] == 1 and summary["steps"] == 3
    assert summary["partial"] is True and summary["resumed_at_batch"] == 4
    assert summary["nonfinite_loss_steps"] == 0
    none = R.epoch_summary(1, recs[1:2], 0.1)
    assert none["train_loss"] is None and none["partial"] is False
