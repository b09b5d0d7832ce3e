"""Lesson 01's panels without a browser: set widget values, read what they show."""
import math

import numpy as np
import plotly.graph_objects as go
import pytest

from amp_lessons import formats as F
from amp_lessons import widgets as W

GRADS = {"fc1": np.array([2.0**-26, 2.0**-20, 2.0**-10, 1.0], dtype=np.float32),
         "fc2": np.array([3e-3, 2e-3, 0.0], dtype=np.float32)}


@pytest.mark.parametrize("text,value", [("0.1", 0.1), ("-1e-8", -1e-8), ("65504", 65504.0),
                                        ("2**-24", 2.0**-24), ("2^-24", 2.0**-24), ("1/4", 0.25),
                                        (" -(2**-14 - 2**-24) ", -(2.0**-14 - 2.0**-24)),
                                        ("inf", math.inf), ("-inf", -math.inf)])
def test_parse_number(text, value):
    assert W.parse_number(text) == value


@pytest.mark.parametrize("text", ["", "2**", "abc", "__import__('os')", "1/0", "2**10000",
                                  "[1]", "True"])
def test_parse_number_rejects(text):
    with pytest.raises(ValueError, match="value must be a number such as"):
        W.parse_number(text)


def test_parse_number_nan():
    assert math.isnan(W.parse_number("nan"))


def test_bit_explorer_typing_updates_the_table_and_slider():
    ex = W.bit_explorer(0.1)
    assert "x = 0.1" in ex.table.value and "0x2E66" in ex.table.value  # 0.1 in fp16
    before = ex.table.value
    ex.text.value = "65504"
    assert ex.table.value != before and "0x7BFF" in ex.table.value and ex.value == 65504.0
    assert ex.slider.value == pytest.approx(65504.0)
    ex.text.value = "-2**-24"
    assert ex.value == -(2.0**-24) and ex.negative.value is True
    assert "0x8001" in ex.table.value                                 # fp16: sign + subnormal 1
    ex.text.value = "70000"
    assert "inf (overflow)" in ex.table.value and ex.negative.value is False


def test_bit_explorer_slider_and_sign_write_the_text():
    ex = W.bit_explorer(1.0)
    ex.slider.value = 2.0**-10
    assert W.parse_number(ex.text.value) == pytest.approx(2.0**-10, rel=1e-5)
    assert "0x1400" in ex.table.value                                 # 2^-10 in fp16
    ex.negative.value = True
    assert ex.text.value.startswith("-") and ex.value < 0


def test_bit_explorer_bad_text_keeps_the_table():
    ex = W.bit_explorer(1.0)
    before = ex.table.value
    ex.text.value = "one"
    assert "value must be a number" in ex.message.value and ex.table.value == before
    ex.text.value = "nan"
    assert ex.message.value == "" and math.isnan(ex.value) and ">nan<" in ex.table.value


def test_bit_explorer_settings():
    assert W.BitExplorer("2**-24", formats=["fp16"]).value == 2.0**-24
    assert W.bit_explorer_html(1.0, ["fp16"]).count("<tr>") == 2          # header + one row
    with pytest.raises(ValueError, match="fmt must be one of"):
        W.BitExplorer(1.0, formats=["fp12"])
    with pytest.raises(ValueError, match="formats must name at least one"):
        W.BitExplorer(1.0, formats=[])
    with pytest.raises(ValueError, match="log2_range must be"):
        W.BitExplorer(1.0, log2_range=(5, -5))


def test_loss_scale_explorer_live_figure():
    pytest.importorskip("anywidget")
    ex = W.loss_scale_explorer(GRADS, k=0)
    assert ex.live and isinstance(ex.figure, go.FigureWidget) and ex.output is None
    title0, summary0 = ex.figure.layout.title.text, ex.summary.value
    assert "× 2^0" in title0 and "scale 2<sup>0</sup>" in summary0
    ex.set_k(12)
    assert ex.slider.value == 12 and "× 2^12" in ex.figure.layout.title.text
    f = F.scaled_fractions(list(GRADS.values()), 2.0**12)
    assert f"{100 * f['normal']:.3f}%</b> normal" in ex.summary.value and f["normal"] == 1.0
    filled = [x for x, y in zip(ex.figure.data[0].x, ex.figure.data[0].y) if y]
    assert filled == [-13.5, -7.5, 2.5, 12.5]                          # fc1 x 2^12, log2 bins


def test_loss_scale_explorer_without_figure_widget(monkeypatch):
    monkeypatch.setattr(W, "_l01_live_figure", lambda fig: None)
    ex = W.loss_scale_explorer(GRADS, k=4)
    assert not ex.live and isinstance(ex.figure, go.Figure) and ex.output is not None
    ex.slider.value = 20
    assert "× 2^20" in ex.figure.layout.title.text and "2<sup>20</sup>" in ex.summary.value


@pytest.mark.parametrize("kwargs,match", [({"k": 40}, "k must be an integer in"),
                                          ({"k": 1.5}, "k must be an integer in"),
                                          ({"k_range": (3, 1)}, "k_range must be"),
                                          ({"magnitudes_by_layer": {}}, "at least one layer"),
                                          ({"fmt": "fp12"}, "fmt must be one of")])
def test_loss_scale_explorer_bad_settings(kwargs, match):
    args = dict(magnitudes_by_layer=GRADS) | kwargs
    with pytest.raises(ValueError, match=match):
        W.loss_scale_explorer(**args)


def test_bit_explorer_ignores_the_browser_snapping_the_slider():
    ex = W.bit_explorer(0.1)
    snapped = 2.0 ** (round(math.log2(0.1) / ex.slider.step) * ex.slider.step)
    assert snapped != 0.1
    ex.slider.value = snapped                 # what the front end sends back when it renders
    assert ex.text.value == "0.1" and ex.value == 0.1
    ex.slider.value = 0.1 * 2 ** (2 * ex.slider.step)  # a real move of two steps
    assert ex.text.value != "0.1"


def test_loss_scale_explorer_figure_modes(monkeypatch):
    ex = W.loss_scale_explorer(GRADS, figure_mode="output")
    assert not ex.live and ex.output is not None
    with pytest.raises(ValueError, match="figure_mode must be one of auto, widget, output"):
        W.loss_scale_explorer(GRADS, figure_mode="live")
    monkeypatch.setattr(W, "_l01_live_figure", lambda fig: None)
    with pytest.raises(ValueError, match="needs plotly's FigureWidget"):
        W.loss_scale_explorer(GRADS, figure_mode="widget")
