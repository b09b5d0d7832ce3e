"""The lesson 04-09 figures (perf, fp8, weight and doctor plots) with rows not measured: None,
NaN and absent keys show as such instead of raising or plotting NaN as a value, and bad settings
raise ValueError naming the setting."""
import math
import types

import numpy as np
import pytest

from amp_lessons.ui import doctor_plots as D
from amp_lessons.ui import fp8_plots as F
from amp_lessons.ui import perf_plots as P
from amp_lessons.ui import weight_plots as Wp

NAN = float("nan")


def _tech(**k):
    return {"technique": "AMP", "status": "ok", "step_ms": 10.0, "memory_gib": 1.0,
            "memory_source": "peak", **k}


def test_technique_memory_time_names_a_nan_row_instead_of_breaking_the_axes():
    fig = P.technique_memory_time([_tech(), _tech(technique="fp32", step_ms=NAN)])
    assert all(math.isfinite(v) for v in fig.layout.xaxis.range)
    assert "not measured here: fp32" in fig.layout.title.text


def test_throughput_memory_leaves_out_nan_speed_and_unlabelled_rows_do_not_raise():
    row = {"label": "fp16", "status": "ok", "img_per_s": 100.0, "peak_allocated_gib": 1.0,
           "config": {"precision": "fp16"}}
    fig = P.throughput_memory([row, dict(row, label="bf16", img_per_s=NAN)])
    assert "not shown: bf16" in fig.layout.title.text
    assert all(math.isfinite(y) for t in fig.data for y in t.y)
    P.throughput_memory([{"status": "ok", "img_per_s": 1.0, "peak_allocated_gib": 1.0}])


def test_memory_per_rank_refuses_world_size_zero_and_skips_nan_peaks():
    row = {"label": "ddp", "rank": 0, "world_size": 2, "param_mib": 1.0, "grad_mib": 1.0,
           "optimizer_state_mib": 2.0, "peak_gib": NAN}
    with pytest.raises(ValueError, match="world_size"):
        P.memory_per_rank_figure([row], world_size=0)
    assert len(P.memory_per_rank_figure([row]).data) == 3  # no peak marker from NaN


def test_scaling_figure_nan_efficiency_is_not_written_as_nan_percent():
    rows = [{"label": "ddp", "world_size": 1, "per_s": NAN, "efficiency": 1.0},
            {"label": "ddp", "world_size": 2, "per_s": 180.0, "efficiency": NAN}]
    fig = P.scaling_figure(rows)
    assert "nan%" not in str(fig.data[0].text) and len(fig.data) == 1  # no perfect line from NaN


def test_fp8_error_figure_not_measured_kind_has_no_bar():
    row = {"tensor": "activation", "format": "e4m3", "scaling": "tensorwise", "rel_error": None,
           "underflow": None}
    fig = F.error_figure([row])
    assert fig.data[0].y == (None,) and fig.data[0].text == ("not measured",)


def test_fp8_speed_figure_without_status_and_with_nan_speedup():
    row = {"width": 256, "recipe": "tensorwise", "speedup": NAN, "step_ms": None, "status": None}
    fig = F.speed_figure([row])
    assert not fig.data and "not measured" in fig.layout.annotations[-1].text


def test_one_trailing_mean_keeps_a_nan_loss_at_its_step_in_every_loss_figure():
    """Lessons 07 and 08 smooth loss curves with one helper (``plots.trailing_mean``; lesson 08's
    own convolution carried one NaN into the next ``window - 1`` points): a non-finite or
    missing loss is a gap at its own step, the other points average the finite values."""
    from amp_lessons.ui import weight_plots
    from amp_lessons.ui.plots import trailing_mean

    got = trailing_mean([1.0, NAN, 3.0, None, 5.0, 7.0], 3)
    assert np.isnan(got[1]) and np.isnan(got[3])
    assert got[[0, 2, 4, 5]].tolist() == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([], 4).tolist() == [] and trailing_mean([2.0, 4.0], 1).tolist() == [2.0, 4.0]
    assert np.isnan(trailing_mean([NAN, NAN], 2)).all()
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="window must be a whole number >= 1"):
            trailing_mean([1.0], bad)
    losses = [1.0] * 100
    losses[10] = NAN
    fig = weight_plots.recipe_losses([_wrow(losses=losses)])
    y = np.asarray(fig.data[0].y, dtype=float)
    assert np.isnan(y[10]) and np.isfinite(np.delete(y, 10)).all()
    run = {"label": "bf16, seed 0", "recipe": "bf16", "seed": 0, "losses": [2.0, NAN, 1.0, 1.0],
           "status": "trained"}
    fig = F.loss_figure([run], smooth=2)
    assert list(fig.data[0].y[2:]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="smooth"):
        F.loss_figure([run], smooth=0)  # was taken as "the default"


def _wrow(**k):
    return {"workload": "mlp", "recipe": "bf16", "seed": 0, "losses": [1.0, 0.5, 0.25],
            "rounded_away": [(1, 0.1), (2, 0.2)], **k}


def test_recipe_losses_max_points_is_checked_and_none_losses_are_gaps():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="max_points"):
            Wp.recipe_losses([_wrow()], max_points=bad)
    Wp.recipe_losses([_wrow(losses=[1.0, None, 0.5])])


def test_rounded_away_none_share_is_a_gap():
    fig = Wp.rounded_away([_wrow(rounded_away=[(1, None), (2, 0.2)])])
    assert math.isnan(fig.data[0].y[0]) and fig.data[0].y[1] == pytest.approx(20.0)


def test_memory_by_category_names_parts_not_measured():
    fig = Wp.memory_by_category([{"workload": "mlp", "recipe": "bf16", "weights MiB": 1.0,
                                  "activations MiB": None}])
    assert "not measured: bf16 gradients" in fig.layout.title.text


def _report(layers=None, speed=None, k=10):
    return types.SimpleNamespace(
        model="m", scale_exponent=k,
        layers=layers or [{"layer": "fc1", "act_absmax": 2.0, "grad_absmax": 1e-2}],
        speed=speed or [{"precision": "fp16", "status": "ok", "samples_per_s": 100.0,
                         "decided": True}])


def test_doctor_ranges_figure_without_a_scale_and_with_nan():
    fig = D.ranges_figure(_report(layers=[{"layer": "fc1", "act_absmax": NAN,
                                           "grad_absmax": 1.0}], k=None))
    assert "None" not in fig.layout.title.text and "unscaled" in fig.layout.title.text
    assert fig.data[0].y == (None,)  # NaN activation is not a point
    assert all("2^None" not in t.name for t in fig.data)


def test_doctor_speed_figure_rows_without_decided_or_speed():
    fig = D.speed_figure(_report(speed=[
        {"precision": "fp16", "status": "ok", "samples_per_s": 100.0},
        {"precision": "bf16", "status": "ok", "samples_per_s": NAN, "decided": False}]))
    assert fig.data[0].y == (100.0, None)
    assert "not measured: bf16" in fig.layout.title.text


def test_largest_batch_chart_nan_batch_and_missing_status_are_not_bars():
    rows = [{"card_gb": 16, "technique": "AMP", "largest_batch": NAN, "status": "ok"},
            {"card_gb": 24, "technique": "AMP", "largest_batch": 64, "status": "ok"},
            {"card_gb": 24, "technique": "fp32", "largest_batch": None}]
    fig = P.largest_batch_chart(rows)
    assert fig.data[0].y == (None, 64) and "nan" not in str(fig.data[0].text)
    assert all(math.isfinite(v) for v in fig.layout.yaxis.range)


def test_accumulation_memory_chart_nan_is_a_gap():
    row = {"effective_batch": 8, "micro_batch": 4, "micro_batches": 2,
           "accumulated_saved_gib": NAN, "one_batch_saved_gib": NAN}
    fig = P.accumulation_memory_chart([row])
    assert fig.data[0].y == (None,) and len(fig.data) == 1


def test_technique_memory_time_refuses_a_frontier_string():
    with pytest.raises(ValueError, match="frontier must be a list"):
        P.technique_memory_time([_tech()], frontier="AMP")
