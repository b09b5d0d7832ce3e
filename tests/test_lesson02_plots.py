"""Lesson 02's chart builders in amp_lessons.plots."""
import pytest

from amp_lessons import plots

ROWS = [
    {"precision": "fp32", "ran": True, "epoch_time_s": 1.2, "peak_memory_mib": 80.0,
     "accuracy_pct": 96.0},
    {"precision": "fp16", "ran": True, "epoch_time_s": 0.8, "peak_memory_mib": 50.0,
     "accuracy_pct": 95.5},
    {"precision": "bf16", "ran": False, "reason": "no native bf16"},
]


def test_precision_comparison_has_three_titled_panels():
    fig = plots.precision_comparison(ROWS)
    assert len(fig.data) == 3
    assert [list(t.x) for t in fig.data] == [["fp32", "fp16"]] * 3
    assert [fig.layout[f"yaxis{i}"].title.text for i in ("", 2, 3)] == \
        ["time per epoch (s)", "peak memory (MiB)", "test accuracy (%)"]
    assert all(fig.layout[f"xaxis{i}"].title.text == "precision" for i in ("", 2, 3))
    assert "bf16 not run here" in fig.layout.title.text


def test_precision_comparison_without_memory_says_so():
    rows = [dict(r, peak_memory_mib=None) for r in ROWS[:2]]
    fig = plots.precision_comparison(rows)
    assert list(fig.data[1].x) == [] and "peak memory not measured" in fig.layout.title.text


def test_precision_comparison_needs_a_run():
    with pytest.raises(ValueError, match="at least one precision that ran"):
        plots.precision_comparison(ROWS[2:])


def test_loss_curves():
    fig = plots.loss_curves({"fp32": {"step": [0, 1], "loss": [2.3, 2.0]},
                             "fp16": {"step": [0, 1], "loss": [2.3, 2.1]}})
    assert [t.name for t in fig.data] == ["fp32", "fp16"]
    assert fig.layout.xaxis.title.text == "optimizer step (count)"
    assert fig.layout.yaxis.title.text == "training loss (nats)" and fig.layout.title.text
    with pytest.raises(ValueError, match="at least one run"):
        plots.loss_curves({})
    with pytest.raises(ValueError, match="same length"):
        plots.loss_curves({"a": {"step": [0], "loss": []}})
