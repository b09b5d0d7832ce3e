"""Lesson 02's helpers in amp_lessons.trainer: digits runs, autocast dtypes, the mistakes, claims."""
import json

import pytest
import torch

from amp_lessons import trainer as T
from amp_lessons.data import digits_loaders

QUICK = dict(model="cnn", width=4, image_size=16, batch_size=128, progress=False)


def test_train_digits_checkpoint_and_resume_to_a_total(tmp_path):
    seen = []
    run = T.train_digits("bf16", epochs=1, checkpoint=tmp_path / "c.pt", on_epoch=seen.append,
                         **QUICK)
    assert len(seen) == 1 and run.epochs == seen and 0 <= run.accuracy <= 1
    more = T.train_digits("bf16", epochs=2, resume=tmp_path / "c.pt", **QUICK)
    assert len(more.epochs) == 2 and more.trainer.epoch == 2
    whole = T.train_digits("bf16", epochs=2, **QUICK)
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
])
def test_train_digits_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        T.train_digits(**{**dict(epochs=1, progress=False), **kwargs})


def test_compare_precisions_rows_and_reasons(monkeypatch):
    real = T.check_precision

    def no_bf16(precision, device=None):
        if T.normalize_precision(precision) == "bf16":
            raise ValueError("precision 'bf16' needs a GPU with native bfloat16")
        return real(precision, device)

    monkeypatch.setattr(T, "check_precision", no_bf16)
    rows = T.compare_precisions(["fp32", "amp", "bf16"], epochs=1, **QUICK)
    assert [r["precision"] for r in rows] == ["fp32", "fp16", "bf16"]
    assert [r["ran"] for r in rows] == [True, True, False]
    assert "native bfloat16" in rows[2]["reason"] and rows[2]["run"] is None
    assert all(0 <= r["accuracy_pct"] <= 100 and r["epoch_time_s"] > 0 for r in rows[:2])
    # the same start: identical first losses up to fp16 rounding
    first = [r["run"].history[0].loss for r in rows[:2]]
    assert first[0] == pytest.approx(first[1], rel=1e-2)


def test_autocast_dtypes_table_is_device_agnostic_and_settles_b5():
    torch.manual_seed(0)
    net, _ = T.build_digits_model("cnn", 4)
    x, y = next(iter(digits_loaders(8, 16)[0]))
    before = net.features[0][1].running_mean.clone()
    texts = []
    for dtype in (torch.bfloat16, torch.float16):
        report = T.autocast_dtypes(net, x, y, "cpu", dtype)
        kinds = {k: d for _, k, d, _ in report.layers}
        assert kinds["Conv2d"] == kinds["Linear"] == kinds["BatchNorm2d"] == dtype
        assert report.loss == torch.float32
        assert report.parameters == report.gradients == {torch.float32}
        assert all(g == dtype for _, _, _, g in report.layers)
        texts.append(report.format())
        verdicts = T.claim_b5_verdicts(report)
        assert verdicts[0]["verdict"].startswith("did not hold")
        assert verdicts[1]["verdict"].startswith("partly")
        assert verdicts[2]["verdict"].startswith("held in effect")
    assert texts[0] == texts[1]  # fp16 and bf16 print the same table
    assert "16-bit" in texts[0] and "float32" in texts[0]
    assert all(p.grad is None for p in net.parameters())
    assert not torch.equal(before, net.features[0][1].running_mean)  # a real training forward
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        T.autocast_dtypes(net, x, y, "cpu", torch.float32)


def test_dtype_label():
    assert T.dtype_label(torch.bfloat16, torch.bfloat16) == "16-bit"
    assert T.dtype_label(torch.float32, torch.float16) == "float32"


def test_clip_before_unscale_applies_max_norm_over_scale():
    rows = T.clip_order_experiment(max_norm=1.0, epochs=1, model="mlp", progress=False)
    wrong, right = rows
    assert wrong["threshold_applied"] == pytest.approx(1.0 / wrong["scale"])
    assert wrong["grad_norm_used"] == pytest.approx(wrong["threshold_applied"], rel=1e-3)
    assert wrong["true_grad_norm"] > 100 * wrong["grad_norm_used"]
    assert right["threshold_applied"] == 1.0
    assert right["grad_norm_used"] <= 1.0 + 1e-6
    assert right["accuracy_pct"] > wrong["accuracy_pct"]
    with pytest.raises(ValueError, match="max_norm must be None or a finite number > 0"):
        T.ClipBeforeUnscale(-1.0)


def test_scheduler_on_skipped_steps():
    naive, fixed = T.scheduler_on_skipped_steps(steps=12, warmup=40)
    assert naive["skipped_steps"] == fixed["skipped_steps"] >= 1
    assert naive["scheduler_steps"] == 12 and fixed["scheduler_steps"] == fixed["optimizer_steps"]
    assert "before `optimizer.step()`" in naive["warning"] and fixed["warning"] == ""
    assert naive["lr"] > naive["lr_expected"]  # the warm-up ran ahead
    assert fixed["lr"] == pytest.approx(fixed["lr_expected"])
    with pytest.raises(ValueError, match="warmup must be a whole number >= 1"):
        T.scheduler_on_skipped_steps(warmup=0)


def test_half_model_errors():
    out = T.half_model_errors()
    assert out["torch"] == "ValueError: Attempting to unscale FP16 gradients."
    assert out["trainer"].startswith("ValueError: model parameters must stay float32")


def _row(p, t, m):
    return {"precision": p, "ran": True, "epoch_time_s": t, "peak_memory_mib": m}


def test_speed_memory_claims_verdicts_follow_the_numbers():
    held = T.speed_memory_claims([_row("fp32", 2.0, 100.0), _row("fp16", 1.0, 50.0)], True)
    assert [r["verdict"] for r in held] == ["held"] * 4
    assert held[2]["measured"] == "100 -> 50 MiB (50% saved)"
    failed = T.speed_memory_claims([_row("fp32", 1.0, 100.0), _row("fp16", 0.95, 98.0)], False)
    assert [r["verdict"].split(" (")[0] for r in failed] == ["did not hold"] * 4
    assert "this device has none" in failed[1]["verdict"]
    slower = T.speed_memory_claims([_row("fp32", 1.0, 100.0), _row("fp16", 2.0, 150.0)], True)
    assert slower[0]["measured"] == "50% more" and slower[3]["measured"].endswith("(100% more)")
    cpu = T.speed_memory_claims([_row("fp32", 1.0, None), _row("fp16", 2.0, None)], False)
    assert cpu[0]["verdict"].startswith("not measured") and cpu[0]["measured"] == "-"
    with pytest.raises(ValueError, match="an fp32 and an fp16 row that ran"):
        T.speed_memory_claims([_row("fp32", 1.0, None)], True)


def test_digits_run_peak_memory_leaves_out_what_was_allocated_before():
    epochs = [{"time_s": 3.0, "peak_memory_bytes": 5 * 2 ** 20, "test_accuracy": 0.5},
              {"time_s": 1.0, "peak_memory_bytes": 6 * 2 ** 20, "test_accuracy": 0.9},
              {"time_s": 2.0, "peak_memory_bytes": 4 * 2 ** 20, "test_accuracy": 0.95}]
    run = T.DigitsRun("fp16", "cnn", "cuda:0", epochs, T.History(), None,
                      baseline_bytes=2 * 2 ** 20)
    assert run.peak_memory_mib == 4.0
    assert run.epoch_time_s == 1.5  # median without the warm-up epoch
    assert run.accuracy == 0.95
    empty = T.DigitsRun("fp32", "cnn", "cpu", [], T.History(), None)
    assert empty.epoch_time_s is None and empty.accuracy is None and empty.peak_memory_mib is None


def test_cosine_schedule_decays_to_zero():
    run = T.train_digits("fp32", epochs=2, lr_schedule="cosine", **QUICK)
    lrs = run.history.columns()["lr"]
    assert lrs[0] == pytest.approx(0.05) and lrs[-1] < 0.01 * lrs[0]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
