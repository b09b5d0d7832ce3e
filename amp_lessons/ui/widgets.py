"""Live panels: ipywidgets built on the figure builders of ``plots.py`` and the parts in
``controls.py``.

A panel is an ipywidgets container (display it as the last line of a cell) whose controls redraw
a figure through ``controls.LiveFigure``, the one live-figure mechanism: a plotly ``FigureWidget``
where anywidget is present (plotly >= 6 needs it), an ``Output`` widget whose contents are replaced
elsewhere (Colab ships older ipywidgets and plotly). Panels know no lesson: what they run comes
in as a callable from the lesson module (``lessons/l03_scaler.py`` builds lesson 03's panels).

Inputs take what a learner types (``2.5``, ``1e3``, ``2**10``) and say next to the field why a
value is refused; nothing is clamped silently. Controls carry CSS classes (``amp-...``) that the
browser tests find them by; the unit tests drive the panels headless by setting values.
"""
from __future__ import annotations

import ast
import math
import re
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import ipywidgets as w
import numpy as np
import plotly.graph_objects as go

from amp_lessons.numerics import formats
from amp_lessons.validate import is_int, is_real
from amp_lessons.tables import percent, plural
from amp_lessons.ui import plots
from amp_lessons.ui.controls import (WRAP, BackgroundRun, LiveFigure, NumberField,
                       SliderField, error_html, escape_html, parse_number, resolve_figure_mode,
                       scroll_box, set_class)

# ---- the bit explorer ------------------------------------------------------------------------------

EXPLORER_FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")


def bit_explorer_html(value: float, formats_shown: Sequence[str] = EXPLORER_FORMATS) -> str:
    """The bit explorer's table for one value: ``plots.bit_layout_html`` of its decodings."""
    return scroll_box(plots.bit_layout_html([formats.decode(value, f) for f in formats_shown],
                                            caption=f"x = {value!r}"))


def slider_text(magnitude: float, negative: bool, step: float) -> str:
    """What the bit explorer writes for a slider position: the magnitude snapped to the slider's
    log2 grid, exact where that lands on a power of two (``2**20`` reads ``1048576.0``, with no
    stray mantissa bit), else to 6 significant digits."""
    k = round(math.log2(magnitude) / step) * step
    if abs(k - round(k)) < 1e-9:
        value = 2.0 ** int(round(k))
        text = repr(value)
    else:
        text = f"{2.0 ** k:.6g}"
    return f"-{text}" if negative else text


def _exponent_range(setting: str, pair) -> tuple:
    """``(low, high)`` powers of two for a slider: whole numbers, low < high, each in
    ``formats.SCALE_EXPONENT_RANGE``; ValueError naming ``setting`` otherwise."""
    lo_k, hi_k = formats.SCALE_EXPONENT_RANGE
    try:
        lo, hi = pair
    except (TypeError, ValueError):
        lo = hi = None
    if not (is_int(lo) and is_int(hi) and lo_k <= lo < hi <= hi_k):
        raise ValueError(f"{setting} must be two integers (low, high) with low < high, both in "
                         f"[{lo_k}, {hi_k}]; got {pair!r}")
    return int(lo), int(hi)


def _log2_of_power(value) -> float:
    """log2 of a loss scale, for the panel's log2 slider: an ``init_scale`` that is not a power of
    two gives a fractional exponent, which the slider's field refuses with the setting's name."""
    if not (is_real(value) and value > 0):
        raise ValueError(f"init_scale must be a power of two > 0 (the panel's slider is log2); "
                         f"got {value!r}")
    return math.log2(value)


class BitExplorer(w.VBox):
    """Lesson 01: type a value (``0.1``, ``2**-24``, ``70000``, ``nan``) or slide its magnitude,
    and see its sign, exponent and mantissa bits and the value each format stores.

    ``text`` (the typed value), ``slider`` (|x| on a log2 scale), ``negative`` (sign) and ``table``
    (the HTML output) are the parts; ``value`` is the current number. CSS classes:
    ``amp-bit-explorer`` (the box), ``amp-bit-text``, ``amp-bit-slider``, ``amp-bit-table``.
    """

    def __init__(self, value: float = 0.1, formats_shown: Sequence[str] = EXPLORER_FORMATS,
                 log2_range: tuple = (-30, 20)):
        self.formats = tuple(f.name for f in formats.format_infos(formats_shown, "formats_shown"))
        lo, hi = _exponent_range("log2_range", log2_range)
        self._syncing = False
        try:
            self.value = parse_number(value) if isinstance(value, str) else float(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"value must be a number within float64's range, or text such as "
                             f"'2**-24'; got {value!r}"[:200]) from None
        self.text = w.Text(value=repr(self.value), description="x =", continuous_update=False,
                           placeholder="0.1, 1e-8, 2**-24, 70000, nan",
                           layout=w.Layout(width="auto", flex="1 1 240px", min_width="160px"))
        # no readout to type into (it would clamp silently): values are typed into ``text``
        self.slider = w.FloatLogSlider(value=self._slider_value(self.value, lo, hi), base=2,
                                       min=lo, max=hi, step=0.05, description="|x|",
                                       readout=False, continuous_update=True,
                                       layout=w.Layout(width="100%", max_width="640px",
                                                       min_width="200px"))
        # the sign bit, as typing the value does: -0.0 (and -nan) are negative too
        self.negative = w.Checkbox(value=math.copysign(1.0, self.value) < 0,
                                   description="negative", indent=False,
                                   layout=w.Layout(width="auto"))
        self.message = w.HTML()
        self.table = w.HTML(bit_explorer_html(self.value, self.formats))
        self.text.observe(self._on_text, names="value")
        self.slider.observe(self._on_slider, names="value")
        self.negative.observe(self._on_sign, names="value")
        super().__init__([w.HBox([self.text, self.negative], layout=w.Layout(**WRAP)),
                          self.slider, self.message, self.table],
                         layout=w.Layout(width="100%"))
        for widget, css in ((self, "amp-bit-explorer"), (self.text, "amp-bit-text"),
                            (self.slider, "amp-bit-slider"), (self.table, "amp-bit-table")):
            widget.add_class(css)

    @staticmethod
    def _slider_value(value: float, lo: int, hi: int) -> float:
        a = abs(value)
        if not math.isfinite(a) or a == 0:
            return 1.0
        return min(max(a, 2.0 ** lo), 2.0 ** hi)

    def show(self, value: float) -> None:
        """Display ``value``'s bits (what typing it does, without touching the controls)."""
        self.value = float(value)
        self.table.value = bit_explorer_html(self.value, self.formats)

    def _on_text(self, change) -> None:
        try:
            value = parse_number(change["new"])
        except ValueError as exc:
            self.message.value = error_html(str(exc))
            return
        self.message.value = ""
        self.show(value)
        if self._syncing:
            return
        self._syncing = True
        try:
            if math.isfinite(value) and value != 0:
                self.slider.value = self._slider_value(value, int(self.slider.min),
                                                       int(self.slider.max))
            if not math.isnan(value):
                self.negative.value = math.copysign(1.0, value) < 0
        finally:
            self._syncing = False

    def _is_echo(self, change) -> bool:
        """True when the browser merely snapped the slider to its step grid: a move of less than
        half a step from the magnitude the text set (the text must then stay as typed)."""
        if change.get("owner") is not self.slider:
            return False
        a, new = abs(self.value), change["new"]
        if not (math.isfinite(a) and a > 0 and new > 0):
            return False
        target = self._slider_value(a, int(self.slider.min), int(self.slider.max))
        return abs(math.log2(new) - math.log2(target)) <= self.slider.step / 2 * 1.001

    def _on_sign(self, change) -> None:
        """The checkbox flips the sign of the value as typed (0 -> -0, inf -> -inf, NaN's sign
        bit), never replacing it with the slider's magnitude."""
        if self._syncing:
            return
        if (math.copysign(1.0, self.value) < 0) == bool(change["new"]):
            return
        self.text.value = negated_text(self.text.value)

    def _on_slider(self, change) -> None:
        if self._syncing or self._is_echo(change):
            return
        self._syncing = True
        try:
            self.text.value = slider_text(self.slider.value, self.negative.value,
                                          self.slider.step)
        finally:
            self._syncing = False


_PLAIN_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?|inf|nan)$", re.I)


def negated_text(text: str) -> str:
    """``text`` (a number as typed into the bit explorer) with its sign flipped, kept readable:
    ``0.1`` -> ``-0.1``, ``-inf`` -> ``inf``, ``2**-40`` -> ``-(2**-40)`` and back."""
    t = str(text).strip()
    if _PLAIN_NUMBER.match(t):
        return t[1:] if t[0] == "-" else "-" + t.lstrip("+")
    if t.startswith("-(") and t.endswith(")"):
        inner = t[2:-1]
        try:  # only when the parentheses wrap the whole rest, as this function writes them
            ast.parse(inner, mode="eval")
            return inner
        except SyntaxError:
            pass
    return f"-({t})"


def bit_explorer(value: float = 0.1,
                 formats_shown: Sequence[str] = EXPLORER_FORMATS) -> BitExplorer:
    """Lesson 01: the bit explorer panel, starting at ``value``."""
    return BitExplorer(value, formats_shown)


# ---- the loss-scale explorer -------------------------------------------------------------------

def shares_html(magnitudes_by_layer: Mapping[str, object], k: int, fmt: str) -> str:
    """The loss-scale explorer's summary: the shares ``plots.lost_shares`` gives (the same text
    as the histogram's title; a nonzero count never reads as 0%)."""
    s = plots.lost_shares(magnitudes_by_layer, 2.0 ** k, fmt)
    return (f"scale 2<sup>{k}</sup> = {2.0 ** k:.6g}: of the "
            f"{plural(s['nonzero'], 'nonzero gradient value')}, <b>{s['flushed']}</b> flushed to "
            f"zero, <b>{s['subnormal']}</b> subnormal, "
            f"<b>{s['normal']}</b> normal, <b>{s['overflow']}</b> overflow in "
            f"{formats.get_format(fmt).name}")


class LossScaleExplorer(w.VBox):
    """Lesson 01: slide the loss-scale exponent k and watch gradient magnitudes x 2^k move through
    a format's flushed / subnormal / normal / overflow bands (``plots.gradient_histogram``).

    ``slider`` is an IntSlider over k, with a field beside it to type k (``k``, a
    ``SliderField``: out-of-range values are refused with a message, not clamped); ``live`` the ``LiveFigure`` (a FigureWidget only where
    anywidget is present, an Output redrawn elsewhere), ``figure`` its figure; ``summary``
    shows the shares (``shares_html``). ``figure_mode``: ``"auto"``, ``"widget"`` or
    ``"output"``. CSS classes: ``amp-l01-scale`` (the box), ``amp-l01-k``, ``amp-l01-summary``,
    ``amp-l01-chart``.
    """

    def __init__(self, magnitudes_by_layer: Mapping[str, object], k: int = 0,
                 fmt: str = "fp16", k_range: tuple = (0, 32), log_y: bool = True,
                 figure_mode: str = "auto"):
        mode = resolve_figure_mode(figure_mode)
        lo, hi = _exponent_range("k_range", k_range)
        if not is_int(k) or not lo <= k <= hi:
            raise ValueError(f"k must be an integer in [{lo}, {hi}]; got {k!r}")
        k = int(k)
        if not magnitudes_by_layer:
            raise ValueError("magnitudes_by_layer must name at least one layer")
        self.fmt = formats.get_format(fmt).name
        self.magnitudes = dict(magnitudes_by_layer)
        x_range = plots.gradient_histogram_range(self.magnitudes, (2.0 ** lo, 2.0 ** hi),
                                                 self.fmt)
        figure = plots.gradient_histogram(self.magnitudes, 2.0 ** k, self.fmt, x_range=x_range,
                                          log_y=log_y)
        self.live = LiveFigure(figure, mode, css_class="amp-l01-chart")
        self.k = SliderField(w.IntSlider(value=k, min=lo, max=hi, step=1,
                                         description="scale 2^k, k =", continuous_update=False),
                             "k", integer=True, css_class="amp-l01-k")
        self.slider = self.k.slider
        self.summary = w.HTML(shares_html(self.magnitudes, k, self.fmt))
        self.slider.observe(self._on_k, names="value")
        super().__init__([self.k.widget, self.summary, self.live.widget],
                         layout=w.Layout(width="100%"))
        for widget, css in ((self, "amp-l01-scale"), (self.summary, "amp-l01-summary")):
            widget.add_class(css)

    @property
    def figure(self):
        """The histogram (a FigureWidget in widget mode, a Figure in output mode)."""
        return self.live.figure

    def set_k(self, k: int) -> None:
        """Move to scale 2**k (what the slider does)."""
        self.slider.value = k

    def _on_k(self, change) -> None:
        k = int(change["new"])
        self.live.update(lambda fig: plots.update_gradient_histogram(
            fig, self.magnitudes, 2.0 ** k, self.fmt))
        self.summary.value = shares_html(self.magnitudes, k, self.fmt)


def loss_scale_explorer(magnitudes_by_layer: Mapping[str, object], k: int = 0,
                        fmt: str = "fp16", k_range: tuple = (0, 32),
                        figure_mode: str = "auto") -> LossScaleExplorer:
    """Lesson 01: the loss-scale slider over gradient magnitudes, starting at scale 2**k."""
    return LossScaleExplorer(magnitudes_by_layer, k, fmt, k_range, figure_mode=figure_mode)


# ---- the scaler panel ------------------------------------------------------------------------------

SCALER_TITLE = "Loss scale and loss per step"


class ScalerPanel(BackgroundRun):
    """GradScaler's four knobs, an overflow-injection rate, a step count, Run and Reset; a live
    chart of the scale per step (skipped steps marked) and the loss; a summary.

    ``run(settings, steps, injection_rate, on_step)`` is what Run trains (the lesson supplies
    it): ``injection_rate`` is a callable giving the rate control's current value,
    ``on_step(trainer, result)`` must be called after every step and returns False to stop; it
    returns a result with ``steps``, ``scales``, ``skipped``, ``losses`` (lists), ``settings``,
    ``changes`` and ``summary_line()``. ``defaults`` are the knobs' starting values when
    ``settings`` is None.

    Moving a knob during a run changes the running scaler at the next step
    (``trainer.set_scaler``). The chart grows by appending the new steps at most every
    ``redraw_every_s`` seconds, and never more often than keeps drawing under a tenth of the
    run's time (throttled by time, not by steps), so a long run costs time linear in its steps
    and the panel stays responsive. ``background=True`` (the Run button's
    default) trains in a thread; ``run()`` blocks. ``timing`` holds the last run's seconds:
    ``run_s`` in all, ``drawing_s`` spent on the chart, ``training_s`` the rest. CSS classes: ``amp-init-scale``,
    ``amp-growth-factor``, ``amp-backoff-factor``, ``amp-growth-interval``, ``amp-overflow-rate``,
    ``amp-steps``, ``amp-run``, ``amp-reset``, ``amp-summary``, ``amp-scaler-chart``,
    ``amp-init-scale-value`` (the scale the kernel has); the box ``amp-scaler-panel``.
    """

    def __init__(self, run: Callable, defaults, steps: int = 60, settings=None,
                 injection_rate: float = 0.0, figure_mode: str = "auto",
                 background: bool = True, redraw_every_s: float = 0.3):
        if not callable(run):
            raise ValueError("run must be a callable run(settings, steps, injection_rate, "
                             "on_step)")
        if not (is_real(redraw_every_s) and 0 <= redraw_every_s <= 60):
            raise ValueError(f"redraw_every_s must be a number of seconds in [0, 60]; "
                             f"got {redraw_every_s!r}")
        self._run_fn = run
        self.settings_type = type(defaults)
        self.defaults = defaults
        self.redraw_every_s = float(redraw_every_s)
        self.background = background
        start = settings or defaults
        self._initial = (start, injection_rate, steps)
        # every starting value is checked against its control's range (never clamped)
        self.init_scale = SliderField(w.IntSlider(
            value=0, min=-10, max=32, step=1,
            description="init_scale (log2)", continuous_update=False), "init_scale (log2)",
            integer=True, css_class="amp-init-scale", start=_log2_of_power(start.init_scale))
        # written by the kernel's observer, so it shows the value the kernel has
        self.init_scale_value = set_class(w.HTML(layout=w.Layout(min_width="120px")),
                                           "amp-init-scale-value")
        self.growth_factor = SliderField(w.FloatSlider(
            value=2.0, min=1.05, max=8.0, step=0.05, description="growth_factor",
            continuous_update=False), "growth_factor", css_class="amp-growth-factor",
            start=start.growth_factor)
        self.backoff_factor = SliderField(w.FloatSlider(
            value=0.5, min=0.05, max=0.95, step=0.05,
            description="backoff_factor", continuous_update=False), "backoff_factor",
            css_class="amp-backoff-factor", start=start.backoff_factor)
        self.growth_interval = NumberField("growth_interval", start.growth_interval, 1,
                                           1_000_000, integer=True, css_class="amp-growth-interval")
        self.overflow_rate = SliderField(w.FloatSlider(
            value=0.0, min=0.0, max=1.0, step=0.01,
            description="injected overflow rate", continuous_update=False),
            "injected overflow rate", css_class="amp-overflow-rate", start=injection_rate)
        self.steps = NumberField("steps", steps, 1, 100_000, integer=True, css_class="amp-steps")
        button = w.Layout(width="auto", min_width="90px")
        self.run_button = set_class(w.Button(description="Run", button_style="primary",
                                              icon="play", layout=button), "amp-run")
        self.reset_button = set_class(w.Button(description="Reset", icon="undo",
                                                layout=button), "amp-reset")
        self.summary = set_class(w.HTML("Press <b>Run</b> to train."), "amp-summary")
        self.series = plots.ScaleSeries()
        self.live = LiveFigure(plots.scale_and_loss(
            [], [], [], [], title=f"{SCALER_TITLE} (press Run)"), figure_mode,
            css_class="amp-scaler-chart")
        self.run_result = None
        self.runs = 0
        self._lock = threading.Lock()
        self._pending = None
        self._rate = float(self.overflow_rate.value)
        self._running = False
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._last_draw = 0.0
        self._draw_cost = 0.0
        self._drawing_s = 0.0
        self.timing: Dict[str, float] = {}
        for knob in (self.init_scale.slider, self.growth_factor.slider,
                     self.backoff_factor.slider, self.growth_interval.text):
            knob.observe(self._on_knob, names="value")
        self.init_scale.slider.observe(self._show_init_scale, names="value")
        self.overflow_rate.slider.observe(self._on_rate, names="value")
        self.run_button.on_click(lambda _: self.start())
        self.reset_button.on_click(lambda _: self.reset())
        self._show_init_scale()
        row = w.Layout(**WRAP)
        controls = w.VBox([
            w.HBox([self.init_scale.widget, self.init_scale_value], layout=row),
            w.HBox([self.growth_factor.widget, self.growth_interval.widget], layout=row),
            w.HBox([self.backoff_factor.widget, self.steps.widget], layout=row),
            w.HBox([self.overflow_rate.widget, self.run_button, self.reset_button], layout=row),
        ], layout=w.Layout(width="100%"))
        self.widget = set_class(w.VBox([controls, self.live.widget, self.summary],
                                        layout=w.Layout(width="100%")), "amp-scaler-panel")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    # -- state ---------------------------------------------------------------------------------
    def settings(self):
        """The knobs' values as validated settings (ValueError naming a refused field)."""
        return self.settings_type(init_scale=2.0 ** self.init_scale.value,
                                  growth_factor=float(self.growth_factor.value),
                                  backoff_factor=float(self.backoff_factor.value),
                                  growth_interval=self.growth_interval.value)

    @property
    def running(self) -> bool:
        """True while a run is training."""
        return self._running

    def _show_init_scale(self, change=None):
        v = 2.0 ** self.init_scale.value
        self.init_scale_value.value = f"= {v:,.0f}" if v >= 1 else f"= {v:.6g}"

    def _on_knob(self, change):
        if not self._running:
            return
        try:
            pending = self.settings()
        except ValueError:
            return  # the field shows why; the run keeps its settings
        with self._lock:
            self._pending = pending

    def _on_rate(self, change):
        self._rate = float(change["new"])

    # -- actions -------------------------------------------------------------------------------
    def _status_html(self):
        return self.summary

    def wait(self, timeout: Optional[float] = None):
        """Wait for a background run to finish; return its result."""
        self._join(timeout)
        return self.run_result

    def run(self, steps: Optional[int] = None):
        """Train with the knobs' settings for ``steps`` (default: the steps field), growing the
        chart as it goes and writing the summary at the end; return the result. A refused
        setting or a failed run shows its message, leaves the panel usable and raises."""
        self._running, self._stop = True, False
        self.run_button.disabled = True
        try:
            if steps is None:
                steps = self.steps.value
            elif not is_int(steps) or steps < 1:
                raise ValueError(f"steps must be a whole number >= 1; got {steps!r}")
            steps = int(steps)
            settings = self.settings()
            with self._lock:
                self._pending = None
            self.series.clear()
            self._last_draw, self._draw_cost = time.monotonic(), 0.0
            self._drawing_s = 0.0
            self.summary.value = f"Running {plural(steps, 'step')} with {settings} ..."
            self._redraw(settings, running=True)
            started = time.perf_counter()
            result = self._run_fn(settings, steps, lambda: self._rate, self._on_step)
            run_s = time.perf_counter() - started
        except Exception as exc:
            self._failed(exc)
            raise
        self._append(result)
        self._redraw(result.settings, running=False)
        self.run_result = result
        self.runs += 1
        self.timing = {"run_s": run_s, "drawing_s": self._drawing_s,
                       "training_s": run_s - self._drawing_s}
        self.summary.value = (f"Run {self.runs}: {result.summary_line()} · ran {run_s:.1f} s, "
                              f"of which the chart {self._drawing_s:.1f} s")
        self._running = False
        self.run_button.disabled = False
        return result

    def _on_step(self, trainer, result) -> bool:
        now = time.monotonic()
        if now - self._last_draw >= max(self.redraw_every_s, 9 * self._draw_cost):
            self._append(result)
            self._redraw(result.settings, running=True)
            self._last_draw = time.monotonic()
            # a redraw grows with the points shown: space them so drawing stays under a tenth
            # of the run's time however long it gets
            self._draw_cost = self._last_draw - now
            self._drawing_s += self._draw_cost
        time.sleep(0)  # hand the interpreter to the kernel's main thread: typing registers
        with self._lock:  # knobs moved while this step ran apply from the next step on
            pending, self._pending = self._pending, None
        if pending is not None:
            trainer.set_scaler(pending)
            result.changes.append((result.steps[-1], pending))
        return not self._stop

    def _append(self, result) -> None:
        n = len(self.series)
        self.series.extend(result.steps[n:], result.scales[n:], result.skipped[n:],
                           result.losses[n:])

    def _redraw(self, settings, running: bool) -> None:
        title = (f"{SCALER_TITLE} (init_scale {plots.pow2_text(settings.init_scale, html=True)}, "
                 f"{plural(len(self.series), 'step')}{', running' if running else ''})")

        def change(fig):
            self.series.apply(fig)
            fig.layout.title.text = title

        self.live.update(change)

    def reset(self) -> None:
        """Stop a run, put every knob back to its starting value, clear the chart and summary."""
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        start, rate, steps = self._initial
        self.init_scale.value = round(math.log2(start.init_scale))
        self.growth_factor.value = start.growth_factor
        self.backoff_factor.value = start.backoff_factor
        self.growth_interval.value = start.growth_interval
        self.overflow_rate.value = rate
        self.steps.value = steps
        self.run_result = None
        self.series.clear()

        def clear(fig):
            self.series.apply(fig)
            fig.layout.title.text = f"{SCALER_TITLE} (press Run)"

        self.live.update(clear)
        self.summary.value = "Press <b>Run</b> to train."
        self._running = False
        self.run_button.disabled = False


# ---- gradient histograms against a format's range ------------------------------------------------

def fraction_table_html(rows: Sequence[Mapping], scale: float, fmt: str = "fp16") -> str:
    """Per-layer rows of ``formats.gradient_summary`` (``nonzero`` and the fractions) as an HTML
    table of the shares lost at ``scale``; shares from ``tables.percent`` (a nonzero count never
    reads as 0%). It scrolls sideways in a narrow window."""
    def share(r, key):
        n = r["nonzero"]
        return percent(round(r[key] * n), n) if n else "n/a"

    head = ("layer", "values", "flushed to zero", "subnormal (precision lost)", "overflow (inf)")
    cells = "".join(
        f"<tr><td style='text-align:left'>{escape_html(r['layer'])}</td><td>{r['values']:,}</td>"
        f"<td>{share(r, 'flushed')}</td><td>{share(r, 'subnormal')}</td>"
        f"<td>{share(r, 'overflow')}</td></tr>" for r in rows)
    header = "".join(f"<th>{h}</th>" for h in head)
    return scroll_box(f"<b>Share of each layer's nonzero gradients lost in {fmt} at loss scale "
                      f"{plots.pow2_text(scale)}</b><table style='border-collapse:collapse' "
                      f"cellpadding='4'><tr>{header}</tr>{cells}</table>")


class HistogramPanel:
    """Per-layer gradient magnitudes in log2 bins against fmt's bands (normal, subnormal,
    flushed to zero), with a loss-scale slider; under the chart, per layer, the share that
    underflows or overflows at that scale.

    Built on ``plots.gradient_histogram``. CSS classes: ``amp-hist-scale`` (the slider),
    ``amp-hist-chart``, ``amp-hist-table``; the box ``amp-hist-panel``.
    """

    def __init__(self, magnitudes_by_layer: Mapping[str, np.ndarray], scale_log2: int = 0,
                 fmt: str = "fp16", figure_mode: str = "auto", log2_range: tuple = (-8, 40)):
        try:
            lo, hi = log2_range
        except (TypeError, ValueError):
            lo = hi = None
        if not (is_int(lo) and is_int(hi) and lo < hi):
            raise ValueError(f"log2_range must be two integers (low, high), low < high; "
                             f"got {log2_range!r}")
        lo, hi = int(lo), int(hi)
        if not is_int(scale_log2) or not lo <= scale_log2 <= hi:
            raise ValueError(f"scale_log2 must be an integer in [{lo}, {hi}]; got {scale_log2!r}")
        scale_log2 = int(scale_log2)
        if not magnitudes_by_layer:
            raise ValueError("magnitudes_by_layer must name at least one layer")
        self.magnitudes = dict(magnitudes_by_layer)
        self.fmt = formats.get_format(fmt).name
        # one x range for every slider position, so the bars move and the bands stay put
        x_lo, x_hi = plots.gradient_histogram_range(self.magnitudes, (2.0 ** lo, 2.0 ** hi),
                                                    self.fmt)
        flush_edge = math.floor(math.log2(formats.band_limits(self.fmt)["flushed_max"]))
        self.x_range = (float(min(x_lo, flush_edge - 12)), x_hi)  # room for the band's label
        self.scale = SliderField(w.IntSlider(
            value=scale_log2, min=lo, max=hi, step=1, description="loss scale (log2)",
            continuous_update=False), "loss scale (log2)", integer=True,
            css_class="amp-hist-scale")
        self.scale_value = w.HTML(layout=w.Layout(min_width="120px"))
        self.live = LiveFigure(plots.gradient_histogram(self.magnitudes, self.loss_scale,
                                                        self.fmt, x_range=self.x_range,
                                                        log_y=True),
                               figure_mode, css_class="amp-hist-chart")
        self.table = set_class(w.HTML(), "amp-hist-table")
        self.scale.slider.observe(self._on_scale, names="value")
        self._show()
        self.widget = set_class(w.VBox([w.HBox([self.scale.widget, self.scale_value],
                                                layout=w.Layout(**WRAP)),
                                         self.live.widget, self.table],
                                        layout=w.Layout(width="100%")), "amp-hist-panel")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    @property
    def loss_scale(self) -> float:
        """The slider's scale, ``2 ** value``."""
        return 2.0 ** self.scale.value

    def rows(self):
        """Per-layer ``formats.gradient_summary`` rows at the slider's scale."""
        return formats.gradient_summary(self.magnitudes, self.loss_scale, self.fmt)[:-1]

    def _on_scale(self, change=None):
        self.live.update(lambda fig: plots.update_gradient_histogram(
            fig, self.magnitudes, self.loss_scale, self.fmt))
        self._show()

    def _show(self):
        v = self.loss_scale
        self.scale_value.value = f"= {v:,.0f}" if v >= 1 else f"= {v:.6g}"
        self.table.value = fraction_table_html(self.rows(), v, self.fmt)


# ---- presets on the same run ---------------------------------------------------------------------

def comparison_table_html(rows: Sequence[Mapping], note: str = "") -> str:
    """The preset panel's table: one row per run (``preset``, the four settings, ``steps``,
    ``skipped steps``, ``injected overflows``, ``settled after (steps)`` with ``last skip
    (step)`` beside it, ``final scale``, ``final loss``, ``test accuracy``), formatted for
    people; a scale that fell to 0 says so; ``note`` (what the columns mean, from the lesson)
    below it. It scrolls sideways in a narrow window."""
    head = ("preset", "init / growth / backoff / interval", "skipped steps", "settled after",
            "final scale", "final loss", "test accuracy")
    body = []
    for row in rows:
        settled, last = row.get("settled after (steps)"), row.get("last skip (step)")
        acc = row.get("test accuracy")
        cells = (escape_html(row["preset"]),
                 f"{plots.pow2_text(row['init_scale'], html=True).split(' = ')[0]} / "
                 f"{row['growth_factor']:g} / {row['backoff_factor']:g} / "
                 f"{row['growth_interval']}",
                 f"{row['skipped steps']} of {row['steps']}"
                 + (f" ({row['injected overflows']} injected)"
                    if row.get("injected overflows") else ""),
                 ("never" if settled is None else f"after {plural(settled, 'step')}")
                 + ("" if last is None else f" (last skip: step {last:,})"),
                 plots.pow2_text(row.get("final scale"), html=True),
                 f"{row['final loss']:.4f}" if row.get("final loss") is not None else "n/a",
                 f"{acc:.1%}" if acc is not None else "n/a")
        body.append("<tr>" + "".join(f"<td style='padding:2px 10px;white-space:nowrap'>{c}</td>" for c in cells)
                    + "</tr>")
    header = "".join(f"<th style='padding:2px 10px;text-align:left;white-space:nowrap'>{h}</th>" for h in head)
    return scroll_box(f"<table style='border-collapse:collapse'><tr>{header}</tr>"
                      f"{''.join(body)}</table><small>{escape_html(note)}</small>")


def _replace_figure(fig, new: go.Figure) -> None:
    """Make ``fig`` (a Figure or FigureWidget) show ``new``: traces updated in place when they
    line up, replaced otherwise; the layout replaced."""
    if len(fig.data) == len(new.data) and all(a.type == b.type for a, b in zip(fig.data, new.data)):
        for old, fresh in zip(fig.data, new.data):
            old.update(fresh.to_plotly_json(), overwrite=True)
    else:
        fig.data = ()
        fig.add_traces(list(new.data))
    fig.layout = new.layout


class PresetComparison(BackgroundRun):
    """Several scaler presets trained on the same seed and data, drawn together as they finish.

    ``run(name, settings, steps, injection_rate)`` trains one preset (the lesson supplies it) and
    returns a result with ``columns()`` (``plots.preset_comparison``'s columns) and ``row()``
    (``comparison_table_html``'s row). A checkbox per preset (class ``amp-preset``), steps
    (``amp-presets-steps``), an injected overflow rate (``amp-presets-overflow-rate``), Run
    (``amp-presets-run``), the chart (``amp-presets-chart``) and a table of summaries
    (``amp-presets-table``) under ``table_note`` (a text, or a function of the steps run).
    ``run()`` blocks and returns ``{name: result}``; the button runs in a thread when
    ``background``.
    """

    def __init__(self, presets: Mapping[str, Any], run: Callable, steps: int = 100,
                 injection_rate: float = 0.0, figure_mode: str = "auto",
                 background: bool = True, table_note: Union[str, Callable[[int], str]] = ""):
        self.presets = dict(presets)
        self.table_note = table_note
        if not self.presets:
            raise ValueError("presets must name at least one preset's settings")
        if not callable(run):
            raise ValueError("run must be a callable run(name, settings, steps, injection_rate)")
        self._run_fn = run
        self.background = background
        self.checks = {name: set_class(w.Checkbox(value=True, description=name, indent=False,
                                                   layout=w.Layout(width="auto")), "amp-preset")
                       for name in self.presets}
        self.steps = NumberField("steps", steps, 1, 100_000, integer=True,
                                 css_class="amp-presets-steps")
        self.overflow_rate = SliderField(w.FloatSlider(
            value=0.0, min=0.0, max=1.0, step=0.01, description="injected overflow rate",
            continuous_update=False), "injected overflow rate",
            css_class="amp-presets-overflow-rate", start=injection_rate)
        self.run_button = set_class(w.Button(description="Run presets", button_style="primary",
                                              icon="play",
                                              layout=w.Layout(width="auto", min_width="120px")),
                                     "amp-presets-run")
        self.table = set_class(w.HTML("Press <b>Run presets</b>."), "amp-presets-table")
        self.live = LiveFigure(self._empty_figure(), figure_mode, css_class="amp-presets-chart")
        self.runs: Dict[str, Any] = {}
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self.run_button.on_click(lambda _: self.start())
        row = w.Layout(**WRAP)
        self.widget = set_class(w.VBox([
            w.HBox(list(self.checks.values()), layout=row),
            w.HBox([self.steps.widget, self.overflow_rate.widget, self.run_button], layout=row),
            self.live.widget, self.table], layout=w.Layout(width="100%")), "amp-presets-panel")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _empty_figure(self) -> go.Figure:
        empty = {"steps": [], "scales": [], "skipped": [], "losses": []}
        return plots.preset_comparison({n: empty for n in self.presets},
                                       title="GradScaler presets on the same run (press Run)")

    def selected(self) -> Dict[str, Any]:
        """The ticked presets."""
        return {n: s for n, s in self.presets.items() if self.checks[n].value}

    def _status_html(self):
        return self.table

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Wait for a background run; return its runs."""
        self._join(timeout)
        return self.runs

    def run(self) -> Dict[str, Any]:
        """Train every ticked preset for ``steps``; redraw after each; fill the table."""
        self._running = True
        self.run_button.disabled = True
        done: Dict[str, Any] = {}
        try:
            chosen = self.selected()
            if not chosen:
                raise ValueError("tick at least one preset")
            steps = self.steps.value
            rate = float(self.overflow_rate.value)
            self.table.value = f"Running {plural(len(chosen), 'preset')} x {plural(steps, 'step')} ..."
            for name, settings in chosen.items():
                done[name] = self._run_fn(name, settings, steps, rate)
                self._draw(done, final=len(done) == len(chosen))
                note = self.table_note(steps) if callable(self.table_note) else self.table_note
                self.table.value = comparison_table_html([r.row() for r in done.values()], note)
        except Exception as exc:
            self._failed(exc)
            raise
        self._running = False
        self.run_button.disabled = False
        self.runs = done
        return done

    def _draw(self, runs: Mapping[str, Any], final: bool) -> None:
        first = next(iter(runs.values())).columns()
        new = plots.preset_comparison(
            {n: r.columns() for n, r in runs.items()},
            title=f"GradScaler presets on the same run ({plural(len(first['steps']), 'step')}, same seed "
                  f"and data{'' if final else ', running'})")
        self.live.update(lambda fig: _replace_figure(fig, new))
