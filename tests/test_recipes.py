"""amp_lessons.train.recipes: train_digits end to end in tiny sizes, DigitsRun's numbers."""
import json

import pytest

from amp_lessons.train import recipes
from amp_lessons.train.records import History
from amp_lessons.train.checkpoint import CheckpointError, check_optimizer_state

QUICK = dict(model="cnn", width=4, image_size=16, batch_size=128, progress=False)


def test_train_digits_checkpoint_and_resume_to_a_total(tmp_path):
    seen = []
    run = recipes.train_digits("bf16", epochs=1, checkpoint=tmp_path / "c.pt",
                               on_epoch=seen.append, **QUICK)
    assert len(seen) == 1 and run.epochs == seen and 0 <= run.accuracy <= 1
    more = recipes.train_digits("bf16", epochs=2, resume=tmp_path / "c.pt", **QUICK)
    assert len(more.epochs) == 2 and more.trainer.epoch == 2
    whole = recipes.train_digits("bf16", epochs=2, **QUICK)
    assert more.history.columns()["loss"] == whole.history.columns()["loss"]
    assert more.accuracy == whole.accuracy
    summary = more.summary()
    assert summary["precision"] == "bf16" and summary["peak_memory_mib"] is None
    assert json.dumps(summary)


@pytest.mark.parametrize("kwargs,message", [
    (dict(epochs=0), "epochs must be a whole number >= 1"),
    (dict(batch_size=0), "batch_size must be a whole number >= 1"),
    (dict(lr=0), "lr must be a finite number > 0"),
    (dict(lr_schedule="step"), "lr_schedule must be 'constant' or 'cosine'"),
    (dict(model="vgg"), "model must be one of"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(nonfinite="warn"), "nonfinite must be one of 'skip', 'raise', 'ignore'"),
    # checked before anything trains (a second review: these failed after a whole epoch)
    (dict(seed=None), r"seed must be a whole number >= 0 \(at most 2\*\*63 - 1"),
    (dict(seed=2 ** 64), r"seed must be a whole number >= 0 \(at most 2\*\*63 - 1"),
    (dict(scaler={}), "scaler must be None or a ScalerSettings; got dict"),
    (dict(on_epoch=1), "on_epoch must be None or a function"),
    (dict(checkpoint="tests"), "checkpoint must name a file, not a folder"),
])
def test_train_digits_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        recipes.train_digits(**{**dict(epochs=1, progress=False), **kwargs})


def test_train_digits_passes_the_nonfinite_policy():
    run = recipes.train_digits("fp32", epochs=1, nonfinite="ignore", **QUICK)
    assert run.trainer.config.nonfinite == "ignore"
    assert recipes.train_digits("fp32", epochs=1, **QUICK).trainer.config.nonfinite == "skip"


def test_digits_run_numbers_leave_out_warm_up_and_baseline():
    epochs = [{"time_s": 3.0, "peak_memory_bytes": 5 * 2 ** 20, "test_accuracy": 0.5},
              {"time_s": 1.0, "peak_memory_bytes": 6 * 2 ** 20, "test_accuracy": 0.9},
              {"time_s": 2.0, "peak_memory_bytes": 4 * 2 ** 20, "test_accuracy": 0.95}]
    run = recipes.DigitsRun("fp16", "cnn", "cuda:0", epochs, History(), None,
                            baseline_bytes=2 * 2 ** 20)
    assert run.peak_memory_mib == 4.0
    assert run.epoch_time_s == 1.5  # median without the warm-up epoch
    assert run.accuracy == 0.95 and run.skipped_steps == 0
    empty = recipes.DigitsRun("fp32", "cnn", "cpu", [], History(), None)
    assert empty.epoch_time_s is None and empty.accuracy is None and empty.peak_memory_mib is None


def test_cosine_schedule_decays_to_zero():
    run = recipes.train_digits("fp32", epochs=2, lr_schedule="cosine", **QUICK)
    lrs = run.history.columns()["lr"]
    assert lrs[0] == pytest.approx(0.05) and lrs[-1] < 0.01 * lrs[0]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_resuming_in_another_precision_is_refused(tmp_path):
    """``train --resume`` ran epoch 1 in fp32 and epoch 2 in fp16 and reported the run as fp16
    (an outside review of the CLI): a resumed run continues exactly as it started."""
    from amp_lessons.train.recipes import train_digits

    ck = tmp_path / "ck.pt"
    train_digits("fp32", model="mlp", epochs=1, device="cpu", checkpoint=ck, progress=False)
    with pytest.raises(ValueError, match=r"resume: '.*ck.pt' was trained in fp32; this run asks "
                                         r"for bf16: resume with precision 'fp32'"):
        train_digits("bf16", model="mlp", epochs=2, device="cpu", resume=ck, progress=False)
    run = train_digits("fp32", model="mlp", epochs=2, device="cpu", resume=ck, progress=False)
    assert len(run.epochs) == 2
