"""amp_lessons.ui.plots: every figure has a title, axis titles with units and the traces it
promises; the numbers it draws are the formats module's numbers; shares never read as zero while
a value is lost; long runs grow by appending (ScaleSeries) and the scale axis keeps few ticks."""
import math

import numpy as np
import pytest
import torch

from amp_lessons.numerics import formats as F
from amp_lessons.ui import plots as P

GRADS = {"fc1": np.array([2.0**-26, 2.0**-20, 2.0**-10, 0.0, 1.0], dtype=np.float32),
         "fc2": torch.tensor([3e-3, -2e-3, 0.0, 0.0])}


def axis_titles(fig):
    return fig.layout.xaxis.title.text, fig.layout.yaxis.title.text


def test_format_ranges_number_line():
    fig = P.format_ranges()
    x_title, y_title = axis_titles(fig)
    assert fig.layout.title.text and "log scale" in x_title and y_title == "format"
    assert [t.name for t in fig.data] == ["subnormal range", "normal range", "limits"]
    assert fig.layout.xaxis.type == "log"
    normal = fig.data[1]
    assert list(normal.x[6:8]) == [2.0**-14, 65504.0]           # fp16 (third row): normal range
    assert list(fig.data[0].x[6:8]) == [2.0**-24, 2.0**-14]      # and its subnormal range
    assert len(fig.data[2].x) == 3 * len(F.FORMATS)
    assert any("65504" in a.text for a in fig.layout.annotations)
    small = P.format_ranges(["fp16", "bf16"])
    assert set(small.data[1].y) - {None} == {"fp16", "bf16"}
    with pytest.raises(ValueError, match="fmt must be one of"):
        P.format_ranges(["fp12"])


def test_gradient_histogram_bars_bands_and_title():
    fig = P.gradient_histogram(GRADS, scale=1.0, fmt="fp16")
    x_title, y_title = axis_titles(fig)
    assert "loss scale" in x_title and "(count)" in y_title
    assert len(fig.data) == 2 and fig.layout.barmode == "stack"
    assert fig.data[0].name == "fc1 (1 exact zeros)" and fig.data[1].name == "fc2 (2 exact zeros)"
    assert sum(fig.data[0].y) == 4 and sum(fig.data[1].y) == 2      # nonzero values only
    centers = dict(zip(fig.data[0].x, fig.data[0].y))
    assert centers[-25.5] == 1 and centers[-19.5] == 1 and centers[0.5] == 1
    names = [s.name for s in fig.layout.shapes]
    assert names == ["flushed", "subnormal", "normal", "overflow"]
    sub = fig.layout.shapes[1]
    assert (sub.x0, sub.x1) == (-25.0, -14.0)
    assert fig.layout.shapes[2].x1 == pytest.approx(math.log2(65520))
    labels = " ".join(a.text for a in fig.layout.annotations)
    assert "flushed to zero" in labels and "subnormal" in labels and "overflow (inf)" in labels
    assert "16.7% flushed to zero, 16.7% subnormal, 0% overflow" in fig.layout.title.text
    assert "× 2^0" in fig.layout.title.text


def test_gradient_histogram_scale_log_y_and_other_formats():
    fig = P.gradient_histogram(GRADS, scale=2.0**10, fmt="fp16", log_y=True)
    assert "× 2^10" in fig.layout.title.text and fig.layout.yaxis.type == "log"
    assert 0.5 + 10 in fig.data[0].x and dict(zip(fig.data[0].x, fig.data[0].y))[10.5] == 1
    e4 = P.gradient_histogram(GRADS, fmt="e4m3fn")
    assert "overflow (NaN)" in " ".join(a.text for a in e4.layout.annotations)
    assert "in fp8_e4m3fn" in e4.layout.title.text
    assert "× 3" in P.gradient_histogram(GRADS, scale=3.0).layout.title.text


def test_gradient_histogram_fixed_range_clips_into_end_bins():
    fig = P.gradient_histogram(GRADS, x_range=(-20.0, 4.0))
    assert tuple(fig.layout.xaxis.range) == (-20.0, 4.0)
    assert min(fig.data[0].x) == -19.5 and sum(fig.data[0].y) == 4
    assert dict(zip(fig.data[0].x, fig.data[0].y))[-19.5] == 2   # 2^-26 and 2^-20 share it


def test_gradient_histogram_range_covers_every_scale():
    lo, hi = P.gradient_histogram_range(GRADS, (1.0, 2.0**32), "fp16")
    assert lo <= -26 and hi >= 33 and lo == math.floor(lo)
    lo1, hi1 = P.gradient_histogram_range(GRADS)
    assert lo1 <= math.log2(2.0**-25) - 3 and hi1 >= 16 + 3


@pytest.mark.parametrize("kwargs,match", [({"magnitudes_by_layer": {}}, "at least one layer"),
                                          ({"scale": 0}, "scale must be"),
                                          ({"fmt": "fp64"}, "fmt must be one of")])
def test_gradient_histogram_bad_input(kwargs, match):
    args = dict(magnitudes_by_layer=GRADS) | kwargs
    with pytest.raises(ValueError, match=match):
        P.gradient_histogram(**args)


def test_update_gradient_histogram_in_place():
    x_range = P.gradient_histogram_range(GRADS, (1.0, 2.0**20))
    fig = P.gradient_histogram(GRADS, scale=1.0, x_range=x_range)
    shapes = [s.to_plotly_json() for s in fig.layout.shapes]
    P.update_gradient_histogram(fig, GRADS, scale=2.0**12)
    fresh = P.gradient_histogram(GRADS, scale=2.0**12, x_range=x_range)
    assert [list(t.y) for t in fig.data] == [list(t.y) for t in fresh.data]
    assert fig.layout.title.text == fresh.layout.title.text and "× 2^12" in fig.layout.title.text
    assert [s.to_plotly_json() for s in fig.layout.shapes] == shapes      # the bands stay put
    with pytest.raises(ValueError, match="layer traces"):
        P.update_gradient_histogram(fig, {"fc1": GRADS["fc1"]}, 1.0)


def test_scale_sweep_figure():
    rows = F.scale_sweep(GRADS["fc1"], range(0, 33))
    fig = P.scale_sweep_figure(rows, marks={"default": 16, "best": 12})
    x_title, y_title = axis_titles(fig)
    assert fig.layout.title.text and "loss scale" in x_title and "(%)" in y_title
    assert [t.name for t in fig.data] == ["underflow (flushed + subnormal)", "flushed to zero",
                                          "overflow"]
    assert list(fig.data[0].x) == list(range(33)) and fig.data[0].y[0] == 50.0
    assert fig.data[2].y[16] == 25.0
    assert sorted(s.x0 for s in fig.layout.shapes) == [12, 16]
    with pytest.raises(ValueError, match="at least one"):
        P.scale_sweep_figure([])


def test_accumulation_figure():
    fig = P.accumulation_figure({"fp16": [0, 1, 1], "fp32": [0, 1, 2]}, exact=[0, 1, 2])
    assert [t.name for t in fig.data] == ["fp16", "fp32", "exact"]
    assert fig.layout.title.text and all("(" in t for t in axis_titles(fig))
    assert list(fig.data[0].x) == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one line"):
        P.accumulation_figure({})


def test_bit_layout_html():
    html = P.bit_layout_html([F.decode(65504.0, "fp16"), F.decode(70000.0, "fp16"),
                              F.decode(0.1, "bf16")], caption="x = 65504")
    assert html.startswith("<table") and "x = 65504" in html
    assert "0x7BFF" in html and "0x7C00" in html and "inf (overflow)" in html
    assert html.count(P.BIT_COLORS["sign"]) >= 3 + 1            # one sign box per row + legend
    assert "<td>15</td>" in html and "0.10009765625" in html            # 65504 = 1.11.. x 2^15
    with pytest.raises(ValueError, match="at least one"):
        P.bit_layout_html([])


def test_accumulation_figure_thins_long_runs():
    ys = np.arange(10_001) * 1e-4
    fig = P.accumulation_figure({"fp32": ys}, exact=ys, max_points=1000)
    x = np.asarray(fig.data[0].x)
    assert len(x) <= 1001 and x[0] == 0 and x[-1] == 10_000
    assert np.allclose(fig.data[0].y, x * 1e-4)
    with pytest.raises(ValueError, match="max_points must be"):
        P.accumulation_figure({"a": ys}, max_points=1)


# ---- lesson 02's figures --------------------------------------------------------------------------

ROWS = [
    {"precision": "fp32", "ran": True, "epoch_time_s": 1.2, "peak_memory_mib": 80.0,
     "accuracy_pct": 96.0},
    {"precision": "fp16", "ran": True, "epoch_time_s": 0.8, "peak_memory_mib": 50.0,
     "accuracy_pct": 95.5},
    {"precision": "bf16", "ran": False, "reason": "no native bf16"},
]


def test_precision_comparison_has_three_titled_panels():
    fig = P.precision_comparison(ROWS)
    assert len(fig.data) == 3
    assert [list(t.x) for t in fig.data] == [["fp32", "fp16"]] * 3
    assert [fig.layout[f"yaxis{i}"].title.text for i in ("", 2, 3)] == \
        ["time per epoch (s)", "peak memory (MiB)", "test accuracy (%)"]
    assert all(fig.layout[f"xaxis{i}"].title.text == "precision" for i in ("", 2, 3))
    assert "bf16 not run here" in fig.layout.title.text


def test_precision_comparison_without_memory_says_so():
    rows = [dict(r, peak_memory_mib=None) for r in ROWS[:2]]
    fig = P.precision_comparison(rows)
    assert list(fig.data[1].x) == [] and "peak memory not measured" in fig.layout.title.text


def test_precision_comparison_needs_a_run():
    with pytest.raises(ValueError, match="at least one precision that ran"):
        P.precision_comparison(ROWS[2:])


def test_loss_curves():
    fig = P.loss_curves({"fp32": {"step": [0, 1], "loss": [2.3, 2.0]},
                             "fp16": {"step": [0, 1], "loss": [2.3, 2.1]}})
    assert [t.name for t in fig.data] == ["fp32", "fp16"]
    assert fig.layout.xaxis.title.text == "optimizer step (count)"
    assert fig.layout.yaxis.title.text == "training loss (nats)" and fig.layout.title.text
    with pytest.raises(ValueError, match="at least one run"):
        P.loss_curves({})
    with pytest.raises(ValueError, match="same length"):
        P.loss_curves({"a": {"step": [0], "loss": []}})


# ---- lesson 03's figures --------------------------------------------------------------------------

def test_scale_and_loss_figure_is_labelled():
    fig = P.scale_and_loss([0, 1, 2], [8.0, 4.0, 4.0], [True, False, False], [2.0, 1.5, 1.0])
    assert [t.name for t in fig.data] == ["loss scale", "skipped step", "loss"]
    assert fig.layout.title.text and "loss scale" in fig.layout.yaxis.title.text
    assert "nats" in fig.layout.yaxis2.title.text and "step" in fig.layout.xaxis2.title.text
    assert list(fig.data[1].x) == [0] and list(fig.data[1].y) == [3.0]
    with pytest.raises(ValueError, match="same length"):
        P.scale_and_loss([0], [1.0, 2.0], [False], [1.0])


def test_preset_comparison_figure_one_legend_entry_per_preset():
    cols = {"steps": [0, 1], "scales": [2.0, 4.0], "skipped": [False, False], "losses": [1, 1]}
    fig = P.preset_comparison({"x": cols, "y": cols})
    assert [t.name for t in fig.data if t.showlegend is not False] == ["x", "y"]
    assert fig.layout.title.text and fig.layout.yaxis2.title.text
    with pytest.raises(ValueError):
        P.preset_comparison({})


def test_preset_scale_line_keeps_only_its_change_points():
    """A long preset's scale line is stored at its change points (drawn "hv": the same steps),
    so lesson 03's notebook stays small; the loss line keeps every step."""
    n = 1500
    scales = [2.0 ** 16 if i < 400 else 2.0 ** 15 if i < 900 else 2.0 ** 17 for i in range(n)]
    cols = {"steps": list(range(n)), "scales": scales, "skipped": [i == 400 for i in range(n)],
            "losses": [1.0] * n}
    scale, _, loss = P.preset_comparison({"x": cols}).data
    assert list(scale.x) == [0, 400, 900, n - 1] and list(scale.customdata) == \
        [2.0 ** 16, 2.0 ** 15, 2.0 ** 17, 2.0 ** 17]
    assert scale.line.shape == "hv" and len(loss.x) == n
    assert P.change_points([0, 1], [5, 5]) == ([0, 1], [5, 5])
    assert P.change_points([], []) == ([], [])
    with pytest.raises(ValueError, match="same length"):
        P.change_points([0], [])


def test_pow2_text():
    assert P.pow2_text(65536.0) == "2^16 = 65,536"
    assert P.pow2_text(2.0**-3, html=True) == "2<sup>-3</sup> = 0.125"
    assert P.pow2_text(40000.0) == "2^15.29 = 40,000"
    assert P.pow2_text(0.0) == "0 (underflowed)"      # not "-", which reads as "not measured"
    assert P.pow2_text(None) == "n/a"


def test_scale_ticks_stay_few_when_the_scale_falls_to_nothing():
    # an overflow on every step: 2^24 halves down to 2^-149 and then to 0
    scales = [2.0 ** k for k in range(24, -150, -1)] + [0.0]
    n = len(scales)
    fig = P.scale_and_loss(list(range(n)), scales, [True] * n, [1.0] * n)
    dtick = fig.layout.yaxis.dtick
    assert (24 + 149) / dtick <= P.MAX_SCALE_TICKS and dtick in (32, 64)
    assert fig.data[0].y[-1] is None                  # 0 has no log2: a gap, not a fake value
    small = P.scale_and_loss([0, 1], [4.0, 8.0], [False, False], [1.0, 1.0])
    assert small.layout.yaxis.dtick == 1


def test_scale_series_appends_and_applies():
    s = P.ScaleSeries()
    fig = P.scale_and_loss([], [], [], [])
    s.extend([0, 1], [8.0, 4.0], [True, False], [2.0, 1.5])
    s.extend([2], [4.0], [False], [1.0])
    s.apply(fig)
    whole = P.scale_and_loss([0, 1, 2], [8.0, 4.0, 4.0], [True, False, False], [2.0, 1.5, 1.0])
    for got, want in zip(fig.data, whole.data):
        assert list(got.x) == list(want.x) and list(got.y) == list(want.y)
    assert len(s) == 3 and (s.low, s.high) == (2.0, 3.0)
    s.extend([3], [0.0], [True], [1.0])               # a scale of 0 is kept, not plotted
    assert s.log2[-1] is None and s.skip_x == [0]
    with pytest.raises(ValueError, match="same length"):
        s.extend([4], [1.0, 2.0], [False], [1.0])
    s.clear()
    assert len(s) == 0 and s.low is None


def test_lost_shares_never_read_zero_for_a_lost_value():
    many = {"fc": np.r_[np.full(2_000_000, 1e-3), 1e-12]}   # one flushed in two million
    s = P.lost_shares(many, 1.0, "fp16")
    assert s["flushed"] == "< 0.001% (1 of 2,000,001)" and s["overflow"] == "0%"
    title = P.gradient_histogram(many, 1.0).layout.title.text
    assert "< 0.001% (1 of 2,000,001) flushed to zero" in title


def test_plots_has_one_import_block_and_no_claim_ids():
    import inspect
    import re
    src = inspect.getsource(P)
    body = src[src.index("TEMPLATE ="):]
    assert not re.search(r"^(import|from) ", body, re.M), "imports only at the top"
    assert "_l01_" not in src and "_L0" not in src
    assert not re.search(r"\b(claim_|[RB]\d+[a-d]?\b)", src)


def test_label_positions_keep_labels_apart_in_a_cluster():
    """Seven long labels on points crowded into a corner (lesson 05's checkpointed runs):
    no two estimated label boxes overlap; lone points keep their label beside them."""
    from amp_lessons.ui import plots as P

    x = [52.9, 55.7, 55.8, 60.3, 68.5, 75.3, 51.5, 120.0]
    y = [5.43, 5.18, 4.94, 6.50, 4.75, 4.75, 7.19, 20.0]
    labels = ["AMP + checkpointing stem+layer1-2 + CUDA graph",
              "AMP + checkpointing stem+layer1-2", "AMP + checkpointing + CUDA graph",
              "AMP + checkpointing per stage", "AMP + checkpointing", "bf16 + checkpointing",
              "AMP + checkpointing stem+layer1", "TF32"]
    places = P.label_positions(x, y, labels, (0, 150), (0, 23), height=520)
    assert len(places) == len(x) and places[-1] == "top center"
    assert all(isinstance(p, str) or (isinstance(p, tuple) and len(p) == 2) for p in places)
    boxes = []
    for i, place in enumerate(places):  # the same estimate the function makes
        cx, cy = x[i] / 150 * 800, y[i] / 23 * 390
        w, h = 6.0 * len(labels[i]), 12.0
        if isinstance(place, tuple):
            boxes.append((cx + place[0] - w / 2, cy + place[1] - h / 2,
                          cx + place[0] + w / 2, cy + place[1] + h / 2))
            continue
        vertical, horizontal = place.split()
        x0 = {"center": cx - w / 2, "right": cx + 6, "left": cx - 6 - w}[horizontal]
        y0 = {"top": cy + 6, "bottom": cy - 6 - h, "middle": cy - h / 2}[vertical]
        boxes.append((x0, y0, x0 + w, y0 + h))
    for i in range(len(boxes)):
        for j in range(i):
            a, b = boxes[i], boxes[j]
            assert min(a[2], b[2]) <= max(a[0], b[0]) or min(a[3], b[3]) <= max(a[1], b[1]), \
                (labels[i], labels[j])
    with pytest.raises(ValueError, match="same length"):
        P.label_positions([1], [1, 2], ["a"], (0, 1), (0, 1))
    with pytest.raises(ValueError, match="high > low"):
        P.label_positions([1], [1], ["a"], (1, 1), (0, 1))
