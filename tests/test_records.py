"""amp_lessons.train.records: StepRecords read on first use, History columns and JSON, epoch
summaries."""
import json

import torch

from amp_lessons.train import records as R
from amp_lessons.train import trainer as T
from trainer_helpers import Inject, batches, fresh


def test_a_record_keeps_device_values_until_read():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    record = trainer.train_step([batches(1)[0]])
    assert all(isinstance(record.__dict__[f"_{k}"], torch.Tensor)
               for k in ("loss", "scale", "skipped"))
    cols = trainer.history.columns()  # reads every pending value at once
    assert isinstance(record.__dict__["_loss"], float) and isinstance(record.skipped, bool)
    assert cols["loss"][0] == record.loss and cols["scale"][0] == 65536.0
    assert cols["lr"] == [0.1] and cols["grad_norm"] == [None]
    assert set(cols) == set(R.STEP_FIELDS)


def test_history_json_is_strict_and_round_trips(tmp_path):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False,
                                                  track_grad_norm=True),
                        hooks=[Inject({0})])
    trainer.fit(batches(2), epochs=1)
    text = trainer.history.to_json(tmp_path / "h.json")
    data = json.loads(text)  # strict JSON: the NaN/inf norm became null
    assert data["steps"]["grad_norm"][0] is None and data["steps"]["skipped"] == [True, False]
    assert data["epochs"][0]["steps"] == 2
    again = T.History.from_columns(trainer.history.columns(), trainer.history.epochs)
    assert again.columns() == trainer.history.columns()
    older = dict(trainer.history.columns(), time_s=[0.1, 0.2])  # a column records no longer keep
    assert T.History.from_columns(older).columns()["loss"] == data["steps"]["loss"]


def test_epoch_summary_of_a_resumed_part():
    recs = [R.StepRecord(i, 0, torch.tensor(float(v)), 1.0, torch.tensor(float(s)), None, 0.1)
            for i, (v, s) in enumerate([(1, 0), (float("nan"), 1), (3, 0)])]
    summary = R.epoch_summary(0, recs, 1.5, resumed_at_batch=4)
    assert summary["train_loss"] == 2.0 and summary["skipped"] == 1 and summary["steps"] == 3
    assert summary["partial"] is True and summary["resumed_at_batch"] == 4
    assert summary["nonfinite_loss_steps"] == 0 and summary["peak_memory_bytes"] is None
    none = R.epoch_summary(1, recs[1:2], 0.1, peak_memory_bytes=5)
    assert none["train_loss"] is None and none["partial"] is False
    assert none["peak_memory_bytes"] == 5
    trained_on_nan = R.StepRecord(0, 0, float("nan"), 1.0, False, None, 0.1)
    assert R.epoch_summary(0, [trained_on_nan], 0.1)["nonfinite_loss_steps"] == 1
