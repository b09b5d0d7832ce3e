"""amp_lessons.ui.controls: the one live-figure mechanism (FigureWidget only where anywidget is
present, else an Output replaced in one assignment, with no script outputs piling up), the
number parser's bounds, and fields that take what a learner types or say why not."""
import json
import math

import ipywidgets

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from amp_lessons.ui import controls as C
from amp_lessons.ui import plots

PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture(autouse=True)
def notebook_renderer(monkeypatch):
    """Render figures as JupyterLab does (``al.setup()`` picks this renderer locally)."""
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype+notebook_connected")


def classes(widget):
    return set(widget._dom_classes)


# ---- figure modes and the one live-figure mechanism ----------------------------------------------

def test_figure_mode_auto_follows_anywidget(monkeypatch):
    assert C.resolve_figure_mode("widget") == "widget"
    assert C.resolve_figure_mode("output") == "output"
    monkeypatch.setattr(C, "figure_widget_available", lambda: False)
    assert C.resolve_figure_mode("auto") == "output"
    monkeypatch.setattr(C, "figure_widget_available", lambda: True)
    assert C.resolve_figure_mode("auto") == "widget"
    with pytest.raises(ValueError, match="figure mode"):
        C.resolve_figure_mode("svg")


def test_figure_widget_available_here_matches_imports():
    import importlib.util

    import plotly
    expected = (int(plotly.__version__.split(".")[0]) >= 6
                and importlib.util.find_spec("anywidget") is not None)
    assert C.figure_widget_available() == expected


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_live_figure_updates(mode):
    if mode == "widget" and not C.figure_widget_available():
        pytest.skip("FigureWidget needs plotly >= 6 and anywidget")
    live = C.LiveFigure(plots.scale_and_loss([0], [4.0], [False], [1.0]), mode, css_class="amp-x")
    assert "amp-x" in classes(live.widget)
    before = live.redraws
    live.update(lambda fig: plots.update_scale_and_loss(fig, [0, 1], [4.0, 2.0], [True, False],
                                                       [1.0, 0.5]))
    assert list(live.figure.data[0].y) == [2.0, 1.0]  # log2 of the scales
    assert list(live.figure.data[1].x) == [0]         # the skipped step
    if mode == "widget":
        assert isinstance(live.widget, go.FigureWidget) and live.live
    else:
        assert live.redraws == before + 1 and not live.live
        (out,) = live.widget.outputs
        assert list(out["data"][PLOTLY_MIME]["data"][0]["y"]) == [2.0, 1.0]


def test_output_redraws_leave_one_output_with_no_script(monkeypatch):
    """Under the notebook_connected renderer, each redraw used to leave a <script> output."""
    live = C.LiveFigure(plots.scale_and_loss([0], [4.0], [False], [1.0]), "output")
    for k in range(5):
        live.update(lambda fig: plots.update_scale_and_loss(fig, [0], [2.0 ** k], [False], [1.0]))
    assert len(live.widget.outputs) == 1
    data = live.widget.outputs[0]["data"]
    assert set(data) == {PLOTLY_MIME, "text/plain"} and "<script" not in json.dumps(data)
    json.dumps(live.widget.outputs)  # plain JSON: no numpy arrays left in it
    # on Colab the renderer's own bundle (its HTML) is what shows
    monkeypatch.setattr(pio.renderers, "default", "colab")
    assert "text/html" in C.figure_bundle(live.figure)


# ---- parse_number and the bit explorer ------------------------------------------------------------

@pytest.mark.parametrize("text,value", [("0.1", 0.1), ("-1e-8", -1e-8), ("65504", 65504.0),
                                        ("2**-24", 2.0**-24), ("2^-24", 2.0**-24), ("1/4", 0.25),
                                        (" -(2**-14 - 2**-24) ", -(2.0**-14 - 2.0**-24)),
                                        ("inf", math.inf), ("-inf", -math.inf)])
def test_parse_number(text, value):
    assert C.parse_number(text) == value


@pytest.mark.parametrize("text", ["", "2**", "abc", "__import__('os')", "1/0", "2**10000",
                                  "[1]", "True", "9**9**9"])
def test_parse_number_rejects(text):
    with pytest.raises(ValueError, match="value must be a number such as"):
        C.parse_number(text)


@pytest.mark.parametrize("text", ["1+" * 5000 + "1", "-" * 3000 + "1", "(" * 150 + "1" + ")" * 150,
                                  "2**" * 60 + "1", "1" * 100_000])
def test_parse_number_long_or_deep_is_a_value_error(text):
    """These raised RecursionError (or hung in the parser) before the length and depth bounds."""
    with pytest.raises(ValueError, match="value must be a number such as"):
        C.parse_number(text)


def test_parse_number_nan():
    assert math.isnan(C.parse_number("nan"))


# ---- fields that take what a learner types --------------------------------------------------------

@pytest.mark.parametrize("typed,value", [("2000", 2000), ("1e3", 1000), ("2**10", 1024),
                                         (" 7 ", 7)])
def test_integer_field_accepts_what_a_learner_types(typed, value):
    f = C.NumberField("growth_interval", 2000, 1, 1_000_000, integer=True)
    f.text.value = typed
    assert f.value == value and f.valid and f.message.value == ""


@pytest.mark.parametrize("typed", ["2.5", "12.7", "0", "2000000", "-3", "abc", "1e9"])
def test_integer_field_refuses_with_a_message_never_clamps_or_drops(typed):
    f = C.NumberField("growth_interval", 2000, 1, 1_000_000, integer=True)
    f.text.value = typed
    assert not f.valid and f.text.value == typed          # kept as typed: no "25" from "2.5"
    assert "growth_interval must be a whole number in [1, 1e+06]" in f.message.value
    with pytest.raises(ValueError, match="growth_interval must be a whole number"):
        f.value


def test_float_field_and_slider_field():
    s = C.SliderField(ipywidgets.FloatSlider(value=2.0, min=1.05, max=8.0,
                                                          step=0.05),
                      "growth_factor", css_class="amp-g")
    assert s.slider.readout is False and "amp-g" in classes(s.slider)
    s.field.text.value = "2.5"
    assert s.value == 2.5 and s.field.message.value == ""
    s.field.text.value = "10"                     # above max: said, and the slider stays
    assert s.value == 2.5 and "growth_factor must be a number in [1.05, 8]" in s.field.message.value
    s.value = 4.0
    assert s.field.text.value == "4" and s.field.valid
