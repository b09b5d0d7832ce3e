"""Lesson 03's panels without a browser: set controls, run, read figures and summaries.

Runs train the digits MLP in fp16 on the CPU for a few steps (torch's CPU autocast and
GradScaler("cpu")), so each takes well under a second or two.
"""
import inspect
import math

import numpy as np
import pytest
import torch

from amp_lessons import formats, plots
from amp_lessons import widgets as W
from amp_lessons.trainer import ScalerSettings

SETUP = W.RunSetup(model="mlp", device="cpu")
PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.fixture(autouse=True)
def notebook_renderer(monkeypatch):
    """Render figures as JupyterLab does (``al.setup()`` picks this renderer locally)."""
    import plotly.io as pio
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")


def classes(widget):
    return set(widget._dom_classes)


# ---- figure modes -------------------------------------------------------------------------------

def test_figure_mode_auto_follows_anywidget(monkeypatch):
    assert W.resolve_figure_mode("widget") == "widget"
    assert W.resolve_figure_mode("output") == "output"
    monkeypatch.setattr(W, "figure_widget_available", lambda: False)
    assert W.resolve_figure_mode("auto") == "output"
    monkeypatch.setattr(W, "figure_widget_available", lambda: True)
    assert W.resolve_figure_mode("auto") == "widget"
    with pytest.raises(ValueError, match="figure mode"):
        W.resolve_figure_mode("svg")


def test_figure_widget_available_here_matches_imports():
    import importlib.util

    import plotly
    expected = (int(plotly.__version__.split(".")[0]) >= 6
                and importlib.util.find_spec("anywidget") is not None)
    assert W.figure_widget_available() == expected


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_live_figure_updates(mode):
    live = W.LiveFigure(plots.scale_and_loss([0], [4.0], [False], [1.0]), mode, css_class="amp-x")
    assert "amp-x" in classes(live.widget)
    before = live.redraws
    live.update(lambda fig: plots.update_scale_and_loss(fig, [0, 1], [4.0, 2.0], [True, False],
                                                       [1.0, 0.5]))
    assert list(live.figure.data[0].y) == [2.0, 1.0]  # log2 of the scales
    assert list(live.figure.data[1].x) == [0]         # the skipped step
    if mode == "widget":
        import plotly.graph_objects as go
        assert isinstance(live.widget, go.FigureWidget)
    else:
        assert live.redraws == before + 1
        (out,) = live.widget.outputs
        assert list(out["data"][PLOTLY_MIME]["data"][0]["y"]) == [2.0, 1.0]


# ---- settle, final loss, summaries --------------------------------------------------------------

def test_steps_to_settle_definition():
    assert W.steps_to_settle([False] * 10, window=10) == 0
    assert W.steps_to_settle([True, True, True] + [False] * 10, window=10) == 3
    # a skip inside the first streak pushes the settle point past it
    assert W.steps_to_settle([True, False, False, True, False, False, False], window=3) == 4
    assert W.steps_to_settle([True] + [False] * 9, window=10) is None  # streak too short
    assert W.steps_to_settle([], window=1) is None
    with pytest.raises(ValueError, match="window"):
        W.steps_to_settle([False], window=0)


def test_final_loss_is_mean_of_last_steps():
    assert W.final_loss([5.0] * 5 + [1.0, 2.0, 3.0], last=3) == pytest.approx(2.0)
    assert W.final_loss([4.0, 2.0], last=10) == pytest.approx(3.0)
    assert math.isnan(W.final_loss([], last=3))
    with pytest.raises(ValueError, match="last"):
        W.final_loss([1.0], last=0)


def _fake_run(name, skipped, losses=None, scale=1024.0):
    run = W.ScalerRun(name=name, settings=ScalerSettings())
    run.steps = list(range(len(skipped)))
    run.skipped = list(skipped)
    run.scales = [scale] * len(skipped)
    run.losses = list(losses or [1.0] * len(skipped))
    run.injected = [False] * len(skipped)
    run.final_scale = scale
    return run


def test_summary_line_says_what_was_measured():
    run = _fake_run("x", [True, True] + [False] * 12, losses=[3.0] * 4 + [0.5] * 10)
    s = run.summary()
    assert s["skipped steps"] == 2 and s["settled after (steps)"] == 2
    assert s["final loss"] == pytest.approx(0.5)
    line = run.summary_line()
    assert "skipped 2 of 14 steps" in line and "settled after 2 steps" in line
    assert "2^10 = 1,024" in line and "0.5000" in line


# ---- presets and claims -------------------------------------------------------------------------

def test_measured_defaults_match_gradscalers_signature():
    measured = W.measured_defaults("cpu")
    sig = inspect.signature(torch.amp.GradScaler).parameters
    for knob in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        assert getattr(measured, knob) == sig[knob].default


def test_presets_hold_the_documented_settings():
    presets = W.scaler_presets("cpu")
    assert presets["PyTorch defaults"] == W.measured_defaults("cpu")
    r3 = presets["article R tuned (R3)"]
    assert (r3.init_scale, r3.growth_factor, r3.backoff_factor, r3.growth_interval) == \
        (32768.0, 1.5, 0.4, 1000)
    nv = presets["NVIDIA ResNet-50"]
    assert (nv.init_scale, nv.growth_interval) == (128.0, 100)


def test_claim_r2_compares_against_measurement(monkeypatch):
    assert W.claim_r2("cpu").held is True
    monkeypatch.setitem(W.ARTICLE_R_DEFAULTS, "growth_interval", 1000)
    v = W.claim_r2("cpu")
    assert v.held is False and "growth_interval (claimed 1000, measured 2000)" in v.verdict


def test_claim_r3_verdicts():
    calm = _fake_run("d", [False] * 20)
    assert W.claim_r3(calm, _fake_run("t", [False] * 20)).held is None
    wobbly = _fake_run("d", [True] * 4 + [False] * 20)
    better = _fake_run("t", [True] * 2 + [False] * 20)
    assert W.claim_r3(wobbly, better).held is True
    assert W.claim_r3(better, wobbly).held is False
    assert "2 early skips" in W.claim_r3(wobbly, better).measured


def test_scale_factor_is_not_a_gradscaler_argument():
    assert W.scale_factor_error("cpu").startswith("TypeError")
    assert "scale_factor" in W.scale_factor_error("cpu")


def test_claim_b4_on_identical_and_different_runs():
    a, b = _fake_run("a", [False] * 12), _fake_run("b", [False] * 12)
    v = W.claim_b4(a, b, "cpu")
    assert v.held is False and "changes nothing" in v.verdict
    c = _fake_run("c", [True] + [False] * 11)
    assert "different scales" in W.claim_b4(a, c, "cpu").measured


def test_early_skips_counts_skips_before_settling():
    assert W.early_skips(_fake_run("a", [True, False, True] + [False] * 10)) == 2
    assert W.early_skips(_fake_run("b", [True, False] * 6)) == 6  # never settled: all of them


def test_claim_b4_larger_growth():
    base = _fake_run("2", [True] * 2 + [False] * 10, losses=[1.0] * 12)
    larger = _fake_run("4", [True] * 5 + [False] * 7, losses=[1.2] * 12)
    larger.settings = ScalerSettings(growth_factor=4.0)
    v = W.claim_b4_larger_growth(base, larger)
    assert v.held is False and "more steps (2 -> 5)" in v.verdict
    calm = _fake_run("4", [False] * 12, losses=[1.0] * 12)
    calm.settings = ScalerSettings(growth_factor=4.0)
    assert W.claim_b4_larger_growth(base, calm).held is True
    with pytest.raises(ValueError, match="larger growth_factor"):
        W.claim_b4_larger_growth(larger, base)


def test_step_table_text_explains_each_update():
    run = _fake_run("t", [True, False, False])
    run.scales, run.final_scale = [8.0, 4.0, 4.0], 8.0
    run.injected = [True, False, False]
    text = W.step_table_text(run, first=3)
    lines = text.splitlines()
    assert "yes*" in lines[1] and "backed off x0.5 -> 2^2 = 4" in lines[1]
    assert "kept the scale" in lines[2] and "grew x2 -> 2^3 = 8" in lines[3]
    assert "injected" in lines[-1]
    with pytest.raises(ValueError, match="first"):
        W.step_table_text(run, first=0)


def test_scale_window_from_the_format_limits():
    mags = {"tiny": np.array([2.0 ** -30], dtype=np.float32),
            "big": np.array([1.0], dtype=np.float32)}
    w = W.scale_window(mags, exponents=range(-4, 30))
    assert w["no_flush_from"] == 6        # 2^-30 x 2^5 = 2^-25 still rounds to 0 (tie to even)
    assert w["no_overflow_up_to"] == 15   # 2^16 > 65504
    assert w["at_scale_1"]["flushed"] == 0.5


# ---- training through the trainer ---------------------------------------------------------------

def test_run_setup_rejects_bad_values():
    with pytest.raises(ValueError, match="model"):
        W.RunSetup(model="resnet")
    with pytest.raises(ValueError, match="batch_size"):
        W.RunSetup(batch_size=0)
    with pytest.raises(ValueError, match="steps"):
        W.train_with_scaler(ScalerSettings(), 0, SETUP)


def test_overflow_injector_rate_is_validated():
    with pytest.raises(ValueError, match="rate"):
        W.OverflowInjector(1.5)
    inj = W.OverflowInjector(0.0)
    with pytest.raises(ValueError, match="rate"):
        inj.rate = -0.1


def test_persistent_overflow_backs_off_every_step_and_goes_below_one():
    run = W.train_with_scaler(ScalerSettings(init_scale=8.0), 6, SETUP, injection_rate=1.0,
                              evaluate=False)
    assert run.injected == [True] * 6 and run.skipped == [True] * 6
    assert run.scales == [8.0 * 0.5 ** i for i in range(6)]
    assert run.final_scale == pytest.approx(8.0 * 0.5 ** 6) and run.final_scale < 1


def test_runs_repeat_and_injection_is_seeded():
    a = W.train_with_scaler(ScalerSettings(), 8, SETUP, injection_rate=0.3, evaluate=False)
    b = W.train_with_scaler(ScalerSettings(), 8, SETUP, injection_rate=0.3, evaluate=False)
    assert a.losses == b.losses and a.injected == b.injected and a.scales == b.scales
    assert any(a.injected) and not all(a.injected)
    assert a.skipped == a.injected  # the MLP itself never overflows at 2^16


def test_on_step_can_change_the_scaler_mid_run():
    def change(trainer, run):
        if len(run.steps) == 3:
            trainer.set_scaler(ScalerSettings(init_scale=2.0 ** 10))
        return len(run.steps) < 7   # stop after 7 steps

    run = W.train_with_scaler(ScalerSettings(), 20, SETUP, on_step=change, evaluate=False)
    assert len(run.steps) == 7
    assert run.scales[:3] == [65536.0] * 3 and run.scales[3:] == [1024.0] * 4


def test_growth_interval_grows_the_scale():
    run = W.train_with_scaler(ScalerSettings(init_scale=2.0, growth_interval=2), 6, SETUP,
                              evaluate=False)
    assert run.scales == [2.0, 2.0, 4.0, 4.0, 8.0, 8.0] and run.final_scale == 16.0


def test_gradient_capture_keeps_true_per_layer_grads():
    setup = W.RunSetup(model="cnn", width=8, image_size=16, device="cpu")
    mags, step = W.capture_gradients(steps=2, setup=setup)
    assert step == 1
    assert len(mags) == 4 and all(np.isfinite(m).all() for m in mags.values())
    assert any("Conv2d" in k for k in mags) and any("Linear" in k for k in mags)
    # unscaled: far below the 2^16 scale's overflow, and not all zero
    assert all(0 < m.max() < 1e3 for m in mags.values())


# ---- the scaler panel ---------------------------------------------------------------------------

def _panel(mode="widget", **kw):
    return W.ScalerPanel(SETUP, steps=8, update_every=4, figure_mode=mode, background=False, **kw)


def test_scaler_panel_controls_have_css_classes():
    p = _panel()
    for widget, cls in [(p.init_scale, "amp-init-scale"), (p.growth_factor, "amp-growth-factor"),
                        (p.backoff_factor, "amp-backoff-factor"),
                        (p.growth_interval, "amp-growth-interval"),
                        (p.overflow_rate, "amp-overflow-rate"), (p.steps, "amp-steps"),
                        (p.run_button, "amp-run"), (p.reset_button, "amp-reset"),
                        (p.summary, "amp-summary"), (p.live.widget, "amp-scaler-chart"),
                        (p.widget, "amp-scaler-panel")]:
        assert cls in classes(widget)
    assert p.settings() == W.measured_defaults("cpu")


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_run_button_trains_and_updates_chart_and_summary(mode):
    p = _panel(mode)
    title = p.live.figure.layout.title.text
    p.init_scale.value = 24              # 2^24: the MLP's gradients overflow at first
    assert "16,777,216" in p.init_scale_value.value
    p.run_button.click()
    run = p.run_result
    assert run is not None and len(run.steps) == 8
    assert run.scales[0] == 2.0 ** 24 and run.skipped[0]
    fig = p.live.figure
    assert list(fig.data[0].y)[0] == 24.0 and len(fig.data[0].x) == 8
    assert len(fig.data[1].x) == sum(run.skipped) > 0
    assert fig.layout.title.text != title
    assert "skipped" in p.summary.value and f"of 8 steps" in p.summary.value
    if mode == "output":
        data = p.live.widget.outputs[0]["data"][PLOTLY_MIME]["data"]
        assert len(data[0]["x"]) == 8


def test_moving_a_knob_mid_run_changes_the_running_scaler(monkeypatch):
    p = W.ScalerPanel(SETUP, steps=12, update_every=4, figure_mode="widget", background=False)
    draw = p._draw
    moved = []

    def draw_and_move(run, running):
        draw(run, running)
        if running and not moved:   # first redraw, after step 4: the learner moves the slider
            moved.append(len(run.steps))
            p.init_scale.value = 8

    monkeypatch.setattr(p, "_draw", draw_and_move)
    run = p.run()
    assert moved == [4]
    assert run.scales[:4] == [65536.0] * 4 and run.scales[4] == 256.0
    assert run.changes and run.changes[0][0] == 3 and run.changes[0][1].init_scale == 256.0


def test_background_run_and_reset():
    p = W.ScalerPanel(SETUP, steps=6, figure_mode="output", background=True)
    p.overflow_rate.value = 1.0
    p.run_button.click()
    run = p.wait(timeout=60)
    assert not p.running and run.skipped == [True] * 6
    p.reset()
    assert p.overflow_rate.value == 0.0 and p.settings() == W.measured_defaults("cpu")
    assert len(p.live.figure.data[0].x) == 0 and "Press" in p.summary.value


def test_panel_rejects_bad_update_every():
    with pytest.raises(ValueError, match="update_every"):
        W.ScalerPanel(SETUP, update_every=0)


# ---- histogram panel ----------------------------------------------------------------------------

def _mags():
    rng = np.random.default_rng(0)
    return {"conv (Conv2d)": np.abs(rng.normal(0, 1e-8, 2000)).astype(np.float32),
            "fc (Linear)": np.abs(rng.normal(0, 1e-2, 500)).astype(np.float32)}


def test_fraction_rows_use_formats():
    rows = W.fraction_rows(_mags(), 2.0 ** 4, "fp16")
    for row, (name, m) in zip(rows, _mags().items()):
        f = formats.scaled_fractions(m, 2.0 ** 4, "fp16")
        assert row["layer"] == name and row["flushed"] == f["flushed"]
        assert row["overflow"] == f["overflow"] and row["subnormal"] == f["subnormal"]
    with pytest.raises(ValueError):
        W.fraction_rows({}, 1.0)


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_histogram_slider_moves_fractions_and_figure(mode):
    p = W.HistogramPanel(_mags(), scale_log2=0, figure_mode=mode)
    assert {"amp-hist-scale"} <= classes(p.scale) and "amp-hist-table" in classes(p.table)
    low = p.rows()
    assert low[0]["flushed"] > 0.1          # 1e-8 gradients: many flush at scale 1
    before = p.live.figure.to_plotly_json()
    table = p.table.value
    p.scale.value = 36                       # 2^36: the 1e-2 layer overflows
    high = p.rows()
    assert high[0]["flushed"] < low[0]["flushed"] and high[1]["overflow"] > 0.5
    assert p.table.value != table and "2^36" in p.table.value
    assert "conv (Conv2d)" in p.table.value and "%" in p.table.value
    assert p.live.figure.to_plotly_json() != before


# ---- preset comparison --------------------------------------------------------------------------

def test_compare_presets_same_seed_and_data():
    presets = {"a": ScalerSettings(), "b": ScalerSettings(init_scale=2.0 ** 24)}
    runs = W.compare_presets(presets, 5, SETUP)
    assert list(runs) == ["a", "b"]
    assert runs["a"].losses[0] == runs["b"].losses[0]  # same weights, same first batch
    assert runs["b"].skipped[0] and not runs["a"].skipped[0]
    rows = W.comparison_rows(runs)
    assert [r["preset"] for r in rows] == ["a", "b"] and rows[1]["init_scale"] == 2.0 ** 24
    assert 0 <= rows[0]["test accuracy"] <= 1
    with pytest.raises(ValueError):
        W.compare_presets({}, 5, SETUP)
    with pytest.raises(ValueError, match="ScalerSettings"):
        W.compare_presets({"x": {"init_scale": 1.0}}, 5, SETUP)


@pytest.mark.parametrize("mode", ["widget", "output"])
def test_preset_panel_draws_every_ticked_preset(mode):
    presets = {"a": ScalerSettings(), "b": ScalerSettings(init_scale=2.0 ** 20),
               "c": ScalerSettings(init_scale=2.0)}
    p = W.PresetComparison(presets, steps=4, setup=SETUP, figure_mode=mode, background=False)
    p.checks["c"].value = False
    p.run_button.click()
    assert list(p.runs) == ["a", "b"]
    fig = p.live.figure
    assert [t.name for t in fig.data if t.showlegend is not False] == ["a", "b"]
    assert len(fig.data[0].x) == 4
    assert "<table" in p.table.value and p.table.value.count("<tr>") == 3
    p.checks["a"].value = p.checks["b"].value = False
    with pytest.raises(ValueError, match="tick"):
        p.run()


# ---- plots --------------------------------------------------------------------------------------

def test_scale_and_loss_figure_is_labelled():
    fig = plots.scale_and_loss([0, 1, 2], [8.0, 4.0, 4.0], [True, False, False], [2.0, 1.5, 1.0])
    assert [t.name for t in fig.data] == ["loss scale", "skipped step", "loss"]
    assert fig.layout.title.text and "loss scale" in fig.layout.yaxis.title.text
    assert "nats" in fig.layout.yaxis2.title.text and "step" in fig.layout.xaxis2.title.text
    assert list(fig.data[1].x) == [0] and list(fig.data[1].y) == [3.0]
    with pytest.raises(ValueError, match="same length"):
        plots.scale_and_loss([0], [1.0, 2.0], [False], [1.0])


def test_preset_comparison_figure_one_legend_entry_per_preset():
    cols = {"steps": [0, 1], "scales": [2.0, 4.0], "skipped": [False, False], "losses": [1, 1]}
    fig = plots.preset_comparison({"x": cols, "y": cols})
    assert [t.name for t in fig.data if t.showlegend is not False] == ["x", "y"]
    assert fig.layout.title.text and fig.layout.yaxis2.title.text
    with pytest.raises(ValueError):
        plots.preset_comparison({})


@pytest.mark.parametrize("make,status", [
    (lambda: W.ScalerPanel(SETUP, steps=2, figure_mode="output", background=True), "summary"),
    (lambda: W.PresetComparison(W.scaler_presets(), steps=2, setup=SETUP, figure_mode="output",
                                background=True), "table"),
])
def test_a_failing_background_run_is_shown_not_lost(monkeypatch, make, status):
    panel = make()

    def boom(*args, **kwargs):
        raise RuntimeError("out of cheese")
    monkeypatch.setattr(panel, "run", boom)
    panel.start()
    panel.wait(timeout=30)
    assert "Run failed" in getattr(panel, status).value and "out of cheese" in getattr(panel, status).value
    assert not panel.run_button.disabled
