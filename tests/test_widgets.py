"""amp_lessons.ui.widgets without a browser: set controls, read what the panels show.

The panels know no lesson: the scaler and preset panels are driven here with a small fake run
(no training), so these tests are fast and test the panel itself; lesson 03's real runs through
these panels are tested in test_lesson03.py.
"""
import json
import math
import re
import time

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from amp_lessons.numerics import formats as F
from amp_lessons.train.trainer import ScalerSettings
from amp_lessons.ui import plots
from amp_lessons.ui import controls as C
from amp_lessons.ui import widgets as W

PLOTLY_MIME = "application/vnd.plotly.v1+json"
GRADS = {"fc1": np.array([2.0**-26, 2.0**-20, 2.0**-10, 1.0], dtype=np.float32),
         "fc2": np.array([3e-3, 2e-3, 0.0], dtype=np.float32)}


@pytest.fixture(autouse=True)
def notebook_renderer(monkeypatch):
    """Render figures as JupyterLab does (``al.setup()`` picks this renderer locally)."""
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype+notebook_connected")


def classes(widget):
    return set(widget._dom_classes)


def as_lists(fig):
    """A figure's data as plain JSON (plotly 5 keeps numpy arrays in to_plotly_json())."""
    return json.loads(pio.to_json(fig, validate=False))["data"]


# ---- a run the panels can drive without training --------------------------------------------------

class FakeResult:
    def __init__(self, settings):
        self.settings, self.changes = settings, []
        self.steps, self.scales, self.skipped, self.losses = [], [], [], []
        self.final_scale = None

    def summary_line(self):
        return f"skipped {sum(self.skipped)} of {len(self.steps)} steps"

    def columns(self):
        return {"steps": self.steps, "scales": self.scales, "skipped": self.skipped,
                "losses": self.losses}

    def row(self):
        s = self.settings
        return {"preset": "p", "init_scale": s.init_scale, "growth_factor": s.growth_factor,
                "backoff_factor": s.backoff_factor, "growth_interval": s.growth_interval,
                "steps": len(self.steps), "skipped steps": sum(self.skipped),
                "injected overflows": 0, "settled after (steps)": None,
                "final scale": self.final_scale, "final loss": 1.0, "test accuracy": None}


class FakeTrainer:
    def __init__(self, scale):
        self.scale = scale

    def set_scaler(self, settings):
        self.scale = settings.init_scale


def fake_run(settings, steps, rate, on_step, step_seconds=0.0):
    """Overflow above 2^20 or when the injected rate is 1: the scale halves; else it holds."""
    result, trainer = FakeResult(settings), FakeTrainer(settings.init_scale)
    for i in range(steps):
        skip = rate() >= 1.0 or trainer.scale > 2.0 ** 20
        result.steps.append(i)
        result.scales.append(trainer.scale)
        result.skipped.append(skip)
        result.losses.append(1.0 / (i + 1))
        if skip:
            trainer.scale = float(np.float32(trainer.scale * settings.backoff_factor))  # as GradScaler
        if step_seconds:
            time.sleep(step_seconds)
        if on_step(trainer, result) is False:
            break
    result.final_scale = trainer.scale
    return result


def panel(mode="widget", **kw):
    kw.setdefault("background", False)
    return W.ScalerPanel(kw.pop("run", fake_run), ScalerSettings(), steps=kw.pop("steps", 8),
                         figure_mode=mode, **kw)


# ---- the bit explorer -----------------------------------------------------------------------

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
    assert C.parse_number(ex.text.value) == 2.0**-10
    assert "0x1400" in ex.table.value                                 # 2^-10 in fp16
    ex.negative.value = True
    assert ex.text.value.startswith("-") and ex.value < 0


@pytest.mark.parametrize("k", [20, -30, 0, 7])
def test_bit_explorer_slider_ends_are_exact_powers_of_two(k):
    ex = W.bit_explorer(3.0)
    ex.slider.value = 2.0 ** k
    assert ex.value == 2.0 ** k                    # 2^20 read 1048580.0 with "%.6g"
    assert C.parse_number(ex.text.value) == 2.0 ** k
    assert F.decode(ex.value, "fp32").mantissa_bits == "0" * 23   # no stray mantissa bit
    assert W.slider_text(2.0 ** 20, False, 0.05) == "1048576.0"


def test_bit_explorer_bad_text_keeps_the_table():
    ex = W.bit_explorer(1.0)
    before = ex.table.value
    ex.text.value = "one"
    assert "value must be a number" in ex.message.value and ex.table.value == before
    ex.text.value = "1+" * 5000 + "1"
    assert "value must be a number" in ex.message.value and ex.table.value == before
    ex.text.value = "nan"
    assert ex.message.value == "" and math.isnan(ex.value) and ">nan<" in ex.table.value


def test_bit_explorer_settings():
    assert W.BitExplorer("2**-24", formats_shown=["fp16"]).value == 2.0**-24
    assert W.bit_explorer_html(1.0, ["fp16"]).count("<tr>") == 2          # header + one row
    assert "overflow-x:auto" in W.bit_explorer_html(1.0, ["fp16"])       # scrolls when narrow
    with pytest.raises(ValueError, match="formats_shown must be one of"):
        W.BitExplorer(1.0, formats_shown=["fp12"])
    with pytest.raises(ValueError, match="formats_shown must name at least one"):
        W.BitExplorer(1.0, formats_shown=[])
    with pytest.raises(ValueError, match="log2_range must be"):
        W.BitExplorer(1.0, log2_range=(5, -5))


def test_bit_explorer_ignores_the_browser_snapping_the_slider():
    ex = W.bit_explorer(0.1)
    snapped = 2.0 ** (round(math.log2(0.1) / ex.slider.step) * ex.slider.step)
    assert snapped != 0.1
    ex.slider.value = snapped                 # what the front end sends back when it renders
    assert ex.text.value == "0.1" and ex.value == 0.1
    ex.slider.value = 0.1 * 2 ** (2 * ex.slider.step)  # a real move of two steps
    assert ex.text.value != "0.1"


# ---- the loss-scale explorer ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["widget", "output"])
def test_loss_scale_explorer_follows_the_figure_rule(mode):
    if mode == "widget" and not C.figure_widget_available():
        pytest.skip("FigureWidget needs plotly >= 6 and anywidget")
    ex = W.loss_scale_explorer(GRADS, k=0, figure_mode=mode)
    assert ex.live.mode == mode
    assert isinstance(ex.figure, go.FigureWidget) == (mode == "widget")
    title0, summary0 = ex.figure.layout.title.text, ex.summary.value
    assert "× 2^0" in title0 and "scale 2<sup>0</sup>" in summary0
    ex.set_k(12)
    assert ex.slider.value == 12 and "× 2^12" in ex.figure.layout.title.text
    assert "<b>100%</b> normal" in ex.summary.value
    filled = [x for x, y in zip(ex.figure.data[0].x, ex.figure.data[0].y) if y]
    assert filled == [-13.5, -7.5, 2.5, 12.5]                          # fc1 x 2^12, log2 bins
    if mode == "output":
        assert len(ex.live.widget.outputs) == 1 and "× 2^12" in json.dumps(ex.live.widget.outputs, ensure_ascii=False)


def test_loss_scale_explorer_k_is_typed_with_a_check_not_clamped():
    ex = W.loss_scale_explorer(GRADS, k=0, figure_mode="output")
    ex.k.field.text.value = "12"
    assert ex.slider.value == 12 and "× 2^12" in ex.figure.layout.title.text
    ex.k.field.text.value = "40"
    assert ex.slider.value == 12 and "k must be a whole number in [0, 32]" in ex.k.field.message.value
    assert W.bit_explorer(1.0).slider.readout is False   # typed values go through the text box


def test_loss_scale_explorer_auto_without_anywidget_uses_output(monkeypatch):
    monkeypatch.setattr(C, "figure_widget_available", lambda: False)
    ex = W.loss_scale_explorer(GRADS, k=4)
    assert ex.live.mode == "output" and isinstance(ex.figure, go.Figure)
    ex.slider.value = 20
    assert "× 2^20" in ex.figure.layout.title.text and "2<sup>20</sup>" in ex.summary.value


def test_loss_scale_explorer_text_and_title_agree_and_never_round_to_zero():
    """At 2^19 the explorer's text said 0.000% overflow while its title said 0.000431%."""
    rng = np.random.default_rng(0)
    mags = {"fc": np.r_[np.abs(rng.normal(0, 1e-3, 250_000)), 0.2].astype(np.float32)}
    ex = W.loss_scale_explorer(mags, k=19, figure_mode="output")
    c = F.scaled_counts(list(mags.values()), 2.0**19)
    assert 0 < c["overflow"] and c["overflow"] / c["nonzero"] < 1e-4
    overflow = plots.lost_shares(mags, 2.0**19)["overflow"]
    assert overflow != "0%" and not re.search(r"\b0\.0+%", ex.summary.value)
    assert f"<b>{overflow}</b> overflow" in ex.summary.value
    assert f"{overflow} overflow" in ex.figure.layout.title.text


@pytest.mark.parametrize("kwargs,match", [({"k": 40}, "k must be an integer in"),
                                          ({"k": 1.5}, "k must be an integer in"),
                                          ({"k_range": (3, 1)}, "k_range must be"),
                                          ({"magnitudes_by_layer": {}}, "at least one layer"),
                                          ({"fmt": "fp12"}, "fmt must be one of"),
                                          ({"figure_mode": "live"}, "figure mode must be one of")])
def test_loss_scale_explorer_bad_settings(kwargs, match):
    args = dict(magnitudes_by_layer=GRADS) | kwargs
    with pytest.raises(ValueError, match=match):
        W.loss_scale_explorer(**args)


# ---- the scaler panel -----------------------------------------------------------------------------

def test_scaler_panel_controls_have_css_classes():
    p = panel()
    for widget, cls in [(p.init_scale.slider, "amp-init-scale"),
                        (p.growth_factor.slider, "amp-growth-factor"),
                        (p.backoff_factor.slider, "amp-backoff-factor"),
                        (p.growth_interval.text, "amp-growth-interval"),
                        (p.overflow_rate.slider, "amp-overflow-rate"), (p.steps.text, "amp-steps"),
                        (p.run_button, "amp-run"), (p.reset_button, "amp-reset"),
                        (p.summary, "amp-summary"), (p.live.widget, "amp-scaler-chart"),
                        (p.widget, "amp-scaler-panel")]:
        assert cls in classes(widget)
    assert p.settings() == ScalerSettings()


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_run_button_runs_and_updates_chart_and_summary(mode):
    if mode == "widget" and not C.figure_widget_available():
        pytest.skip("FigureWidget needs plotly >= 6 and anywidget")
    p = panel(mode)
    title = p.live.figure.layout.title.text
    p.init_scale.value = 24
    assert "16,777,216" in p.init_scale_value.value
    p.run_button.click()
    run = p.run_result
    assert run is not None and len(run.steps) == 8 and run.scales[0] == 2.0 ** 24
    fig = p.live.figure
    assert list(fig.data[0].y)[0] == 24.0 and len(fig.data[0].x) == 8
    assert len(fig.data[1].x) == sum(run.skipped) > 0
    assert fig.layout.title.text != title and "Run 1: skipped 4 of 8 steps" in p.summary.value
    assert "of which the chart" in p.summary.value
    assert p.timing["run_s"] >= p.timing["drawing_s"] >= 0
    assert p.timing["training_s"] == pytest.approx(p.timing["run_s"] - p.timing["drawing_s"])
    if mode == "output":
        data = p.live.widget.outputs[0]["data"][PLOTLY_MIME]["data"]
        assert len(data[0]["x"]) == 8


def test_chart_appends_throttled_by_time_not_by_steps():
    p = panel("output", steps=400, redraw_every_s=60)     # one redraw at the start, one at the end
    p.run()
    assert p.live.redraws == 1 + 1 + 1                      # built, "running", final
    q = panel("output", steps=400, redraw_every_s=0)
    q.run()
    assert q.live.redraws > 3 and len(q.live.figure.data[0].x) == 400
    appended = []
    extend = q.series.extend
    q.series.extend = lambda *a: (appended.append(len(a[0])), extend(*a))
    q.run()
    assert sum(appended) == 400          # each step appended once: no redraw of the history


def test_knob_moved_mid_run_changes_the_running_scaler():
    p = panel(steps=12)
    moved = []

    def run(settings, steps, rate, on_step):
        def step(trainer, result):
            if len(result.steps) == 4 and not moved:
                moved.append(4)
                p.init_scale.value = 8           # the learner moves the slider
            return on_step(trainer, result)
        return fake_run(settings, steps, rate, step)

    p._run_fn = run
    result = p.run()
    assert result.scales[:4] == [65536.0] * 4 and result.scales[4] == 256.0
    assert result.changes[0][0] == 3 and result.changes[0][1].init_scale == 256.0


@pytest.mark.parametrize("background", [False, True])
def test_rejected_input_shows_why_and_leaves_no_stale_summary(background):
    p = panel("output", background=background)
    p.run()
    p.steps.text.value = "-3"
    assert "steps must be a whole number in [1, 100000]" in p.steps.message.value
    p.start()
    p.wait(timeout=30)
    assert "Running" not in p.summary.value and "Run 1:" not in p.summary.value
    assert "Run failed: steps must be a whole number" in p.summary.value
    assert not p.running and not p.run_button.disabled
    with pytest.raises(ValueError, match="steps must be"):
        p.run(steps=-3)
    p.steps.text.value = "5"
    p.start()
    p.wait(timeout=30)
    assert "Run 2: skipped" in p.summary.value


@pytest.mark.parametrize("background", [False, True])
def test_a_failing_run_in_any_mode_is_shown_and_the_panel_stays_usable(background):
    def boom(settings, steps, rate, on_step):
        raise RuntimeError("out of cheese")
    p = panel("output", background=background, run=boom)
    p.start()
    p.wait(timeout=30)
    assert "Run failed" in p.summary.value and "out of cheese" in p.summary.value
    assert not p.running and not p.run_button.disabled and "Running" not in p.summary.value
    p._run_fn = fake_run
    p.start()
    p.wait(timeout=30)
    assert "Run 1:" in p.summary.value


@pytest.mark.serial
def test_background_run_and_quick_reset():
    p = panel("output", steps=100_000, background=True,
              run=lambda *a: fake_run(*a, step_seconds=0.001))
    p.overflow_rate.value = 1.0
    p.run_button.click()
    time.sleep(0.3)
    assert p.running and p.run_button.disabled
    started = time.monotonic()
    p.reset()
    assert time.monotonic() - started < 2
    assert not p.running and not p.run_button.disabled
    assert p.overflow_rate.value == 0.0 and p.settings() == ScalerSettings()
    assert len(p.live.figure.data[0].x) == 0 and "Press" in p.summary.value


def test_scale_that_underflows_to_zero_says_so():
    p = panel("output", steps=200)
    p.overflow_rate.value = 1.0
    result = p.run()
    assert result.final_scale == 0.0
    ticks = p.live.figure.layout.yaxis.dtick
    span = math.log2(65536) - min(v for v in p.series.log2 if v is not None)
    assert span / ticks <= plots.MAX_SCALE_TICKS
    assert "0 (underflowed)" in W.comparison_table_html([result.row()])


def test_scaler_panel_rejects_bad_arguments():
    with pytest.raises(ValueError, match="redraw_every_s"):
        panel(redraw_every_s=-1)
    with pytest.raises(ValueError, match="run must be a callable"):
        W.ScalerPanel(None, ScalerSettings())


def test_panels_wrap_in_narrow_windows():
    p = panel()
    rows = p.widget.children[0].children
    assert all(r.layout.flex_flow == "row wrap" for r in rows)
    assert p.run_button.layout.min_width and p.init_scale.slider.layout.min_width
    assert p.widget.layout.width == "100%"


# ---- histogram panel ------------------------------------------------------------------------------

def _mags():
    rng = np.random.default_rng(0)
    return {"conv (Conv2d)": np.abs(rng.normal(0, 1e-8, 2000)).astype(np.float32),
            "fc (Linear)": np.abs(rng.normal(0, 1e-2, 500)).astype(np.float32)}


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_histogram_slider_moves_fractions_and_figure(mode):
    if mode == "widget" and not C.figure_widget_available():
        pytest.skip("FigureWidget needs plotly >= 6 and anywidget")
    p = W.HistogramPanel(_mags(), scale_log2=0, figure_mode=mode)
    assert "amp-hist-scale" in classes(p.scale.slider) and "amp-hist-table" in classes(p.table)
    low = p.rows()
    assert low[0]["flushed"] > 0.1          # 1e-8 gradients: many flush at scale 1
    before = as_lists(p.live.figure)        # plain lists: comparable under plotly 5 and 6
    table = p.table.value
    p.scale.value = 36                      # 2^36: the 1e-2 layer overflows
    high = p.rows()
    assert high[0]["flushed"] < low[0]["flushed"] and high[1]["overflow"] > 0.5
    assert p.table.value != table and "2^36" in p.table.value
    assert "conv (Conv2d)" in p.table.value and "%" in p.table.value
    assert as_lists(p.live.figure) != before


def test_fraction_table_never_shows_a_lost_value_as_zero():
    rows = [{"layer": "fc", "values": 2_000_001, "nonzero": 2_000_001,
             "flushed": 1 / 2_000_001, "subnormal": 0.0, "overflow": 0.0}]
    html = W.fraction_table_html(rows, 1.0)
    assert "&lt; 0.001% (1 of 2,000,001)" in html or "< 0.001% (1 of 2,000,001)" in html
    assert "0.0e+00%" not in html and "<td>0%</td>" in html


# ---- preset comparison ----------------------------------------------------------------------------

def _preset_run(name, settings, steps, rate):
    r = fake_run(settings, steps, lambda: rate, lambda t, res: True)
    return r


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_preset_panel_draws_every_ticked_preset(mode):
    if mode == "widget" and not C.figure_widget_available():
        pytest.skip("FigureWidget needs plotly >= 6 and anywidget")
    presets = {"a": ScalerSettings(), "b": ScalerSettings(init_scale=2.0 ** 22),
               "c": ScalerSettings(init_scale=2.0)}
    p = W.PresetComparison(presets, _preset_run, steps=4, figure_mode=mode, background=False)
    p.checks["c"].value = False
    p.run_button.click()
    assert list(p.runs) == ["a", "b"]
    fig = p.live.figure
    assert [t.name for t in fig.data if t.showlegend is not False] == ["a", "b"]
    assert len(fig.data[2].x) == 4 and fig.data[0].x[-1] == 3  # loss: every step; scale: changes
    assert "<table" in p.table.value and p.table.value.count("<tr>") == 3
    p.checks["a"].value = p.checks["b"].value = False
    with pytest.raises(ValueError, match="tick"):
        p.run()
    assert "Run failed: tick at least one preset" in p.table.value and not p.run_button.disabled


@pytest.mark.parametrize("background", [False, True])
def test_preset_panel_failure_is_shown(background):
    def boom(*a):
        raise RuntimeError("out of cheese")
    p = W.PresetComparison({"a": ScalerSettings()}, boom, steps=2, figure_mode="output",
                           background=background)
    p.start()
    p.wait(timeout=30)
    assert "Run failed" in p.table.value and "out of cheese" in p.table.value
    assert not p.run_button.disabled


# ---- the rules of the ui layer --------------------------------------------------------------------

@pytest.mark.parametrize("module", [W, C], ids=["widgets", "controls"])
def test_ui_modules_have_one_import_block_and_know_no_lesson(module):
    import inspect
    src = inspect.getsource(module)
    first_code = re.search(r"^(?!from |import |\s|$|#|\)|\"\"\")", src[src.index('"""', 3) + 3:], re.M)
    body = src[src.index('"""', 3) + 3:][first_code.start():]
    assert not re.search(r"^(import|from) ", body, re.M), "imports only at the top"
    assert "lessons" not in re.findall(r"^from \.\.(\w+)", src, re.M)
    assert not re.search(r"\b(claim_|[RB]\d+[a-d]?\b)", src)
    assert "_l01_" not in src


# ---- NumPy numbers and signed zeros (issue 23) ------------------------------------------------------

def test_widgets_take_numpy_integers_as_the_engine_does():
    """A sweep over np.arange hands out np.int64: every explorer and panel takes it, through
    _validate's checks, and still refuses np.float64(1.5) and bools."""
    k = W.LossScaleExplorer(_mags(), k=np.int64(3), k_range=(np.int64(0), np.int64(32)),
                            figure_mode="output")
    assert k.slider.value == 3 and type(k.slider.value) is int
    h = W.HistogramPanel(_mags(), scale_log2=np.int32(4), figure_mode="output",
                         log2_range=(np.int64(-8), np.int64(40)))
    assert h.loss_scale == 16.0
    b = W.BitExplorer(np.float32(0.5), log2_range=(np.int64(-30), np.int64(20)))
    assert b.value == 0.5 and b.slider.min == -30
    p = panel("output")
    result = p.run(steps=np.int64(3))
    assert len(result.steps) == 3 and "Run failed" not in p.summary.value
    for bad in (np.float64(1.5), True):
        with pytest.raises(ValueError, match="k must be an integer in"):
            W.LossScaleExplorer(_mags(), k=bad, figure_mode="output")
        with pytest.raises(ValueError, match="scale_log2 must be an integer"):
            W.HistogramPanel(_mags(), scale_log2=bad, figure_mode="output")
    with pytest.raises(ValueError, match="steps must be a whole number >= 1"):
        panel("output").run(steps=np.float64(3.0))


@pytest.mark.parametrize("value", [-0.0, "-0", "-0.0", float("-nan")])
def test_bit_explorer_ticks_negative_for_a_set_sign_bit(value):
    ex = W.BitExplorer(value, formats_shown=["fp16"])
    assert ex.negative.value is True
    assert math.copysign(1.0, ex.value) < 0
    assert W.BitExplorer(0.0, formats_shown=["fp16"]).negative.value is False
