"""Live panels for the lessons: ipywidgets built on the figure builders of ``plots.py``.

Each lesson's panels live in their own section below. A panel is an ipywidgets container (display
it as the last line of a cell) whose controls redraw a figure: a live plotly ``FigureWidget`` where
anywidget is present (plotly >= 6 needs it), an ``Output`` widget that redraws a static figure
elsewhere (Colab ships older ipywidgets and plotly). The logic behind each panel is a plain
function in ``formats``/``plots``, tested on its own; the panels' own tests drive them headless by
setting widget values.
"""
from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# Lesson 01: bit explorer (type or slide a value, see its bits in every format) and the
# loss-scale slider over real gradient magnitudes
# ---------------------------------------------------------------------------------------------
import ast as _l01_ast
import math as _l01_math
import operator as _l01_operator
from typing import Mapping as _L01Mapping, Sequence as _L01Sequence

import ipywidgets as _l01_widgets

EXPLORER_FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2")
_L01_BINARY = {_l01_ast.Add: _l01_operator.add, _l01_ast.Sub: _l01_operator.sub,
               _l01_ast.Mult: _l01_operator.mul, _l01_ast.Div: _l01_operator.truediv,
               _l01_ast.Pow: _l01_operator.pow}
_L01_NAMES = {"inf": _l01_math.inf, "nan": _l01_math.nan, "infinity": _l01_math.inf}


def parse_number(text: str) -> float:
    """Read a number as a learner types it: ``0.1``, ``-1e-8``, ``65504``, ``2**-24``, ``2^-24``,
    ``1/3``, ``inf``, ``nan``. Only numbers, + - * / ** (or ^) and parentheses are allowed;
    anything else raises ``ValueError``."""
    source = str(text).strip().lower().replace("^", "**")

    def ev(node):
        if isinstance(node, _l01_ast.Expression):
            return ev(node.body)
        if isinstance(node, _l01_ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, _l01_ast.Name) and node.id in _L01_NAMES:
            return _L01_NAMES[node.id]
        if isinstance(node, _l01_ast.UnaryOp) and isinstance(node.op, (_l01_ast.USub, _l01_ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, _l01_ast.USub) else v
        if isinstance(node, _l01_ast.BinOp) and type(node.op) in _L01_BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, _l01_ast.Pow) and abs(right) > 4096:
                raise ValueError("exponent too large")
            return float(_L01_BINARY[type(node.op)](left, right))
        raise ValueError("unsupported expression")

    try:
        return ev(_l01_ast.parse(source, mode="eval"))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(f"value must be a number such as 0.1, -1e-8, 65504 or 2**-24; "
                         f"got {text!r} ({exc})") from None


def bit_explorer_html(value: float, formats: _L01Sequence[str] = EXPLORER_FORMATS) -> str:
    """The bit explorer's table for one value: ``plots.bit_layout_html`` of its decodings."""
    from .. import formats as _formats
    from . import plots as _plots

    return _plots.bit_layout_html([_formats.decode(value, f) for f in formats],
                                  caption=f"x = {value!r}")


class BitExplorer(_l01_widgets.VBox):
    """Lesson 01: type a value (``0.1``, ``2**-24``, ``70000``, ``nan``) or slide its magnitude,
    and see its sign, exponent and mantissa bits and the value each format stores.

    ``text`` (the typed value), ``slider`` (|x| on a log2 scale), ``negative`` (sign) and ``table``
    (the HTML output) are the parts; ``value`` is the current number. CSS classes:
    ``amp-bit-explorer`` (the box), ``amp-bit-text``, ``amp-bit-slider``, ``amp-bit-table``.
    """

    def __init__(self, value: float = 0.1, formats: _L01Sequence[str] = EXPLORER_FORMATS,
                 log2_range: tuple = (-30, 20)):
        from .. import formats as _formats

        self.formats = tuple(_formats.get_format(f).name for f in formats)
        if not self.formats:
            raise ValueError("formats must name at least one format")
        lo, hi = log2_range
        if not (isinstance(lo, int) and isinstance(hi, int) and lo < hi):
            raise ValueError(f"log2_range must be two integers (low, high) with low < high; "
                             f"got {log2_range!r}")
        self._syncing = False
        self.value = parse_number(value) if isinstance(value, str) else float(value)
        self.text = _l01_widgets.Text(value=repr(self.value), description="x =",
                                      continuous_update=False,
                                      placeholder="0.1, 1e-8, 2**-24, 70000, nan")
        self.slider = _l01_widgets.FloatLogSlider(value=self._slider_value(self.value, lo, hi),
                                                  base=2, min=lo, max=hi, step=0.05,
                                                  description="|x|", readout_format=".4g",
                                                  continuous_update=True,
                                                  layout=_l01_widgets.Layout(width="60%"))
        self.negative = _l01_widgets.Checkbox(value=self.value < 0, description="negative",
                                              indent=False)
        self.message = _l01_widgets.HTML()
        self.table = _l01_widgets.HTML(bit_explorer_html(self.value, self.formats))
        self.text.observe(self._on_text, names="value")
        self.slider.observe(self._on_slider, names="value")
        self.negative.observe(self._on_slider, names="value")
        super().__init__([_l01_widgets.HBox([self.text, self.negative]), self.slider,
                          self.message, self.table])
        # CSS classes, for the browser test and for learners' own styling
        for widget, css in ((self, "amp-bit-explorer"), (self.text, "amp-bit-text"),
                            (self.slider, "amp-bit-slider"), (self.table, "amp-bit-table")):
            widget.add_class(css)

    @staticmethod
    def _slider_value(value: float, lo: int, hi: int) -> float:
        a = abs(value)
        if not _l01_math.isfinite(a) or a == 0:
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
            self.message.value = f"<span style='color:#d62728'>{exc}</span>"
            return
        self.message.value = ""
        self.show(value)
        if self._syncing:
            return
        self._syncing = True
        try:
            if _l01_math.isfinite(value) and value != 0:
                self.slider.value = self._slider_value(value, int(self.slider.min),
                                                       int(self.slider.max))
            if not _l01_math.isnan(value):
                self.negative.value = _l01_math.copysign(1.0, value) < 0
        finally:
            self._syncing = False

    def _is_echo(self, change) -> bool:
        """True when the browser merely snapped the slider to its step grid: a move of less than
        half a step from the magnitude the text set (the text must then stay as typed)."""
        if change.get("owner") is not self.slider:
            return False
        a, new = abs(self.value), change["new"]
        if not (_l01_math.isfinite(a) and a > 0 and new > 0):
            return False
        target = self._slider_value(a, int(self.slider.min), int(self.slider.max))
        return abs(_l01_math.log2(new) - _l01_math.log2(target)) <= self.slider.step / 2 * 1.001

    def _on_slider(self, change) -> None:
        if self._syncing or self._is_echo(change):
            return
        self._syncing = True
        try:
            value = -self.slider.value if self.negative.value else self.slider.value
            self.text.value = f"{value:.6g}"
        finally:
            self._syncing = False


def bit_explorer(value: float = 0.1, formats: _L01Sequence[str] = EXPLORER_FORMATS) -> BitExplorer:
    """Lesson 01: the bit explorer panel, starting at ``value``."""
    return BitExplorer(value, formats)


def _l01_live_figure(fig):
    """A ``FigureWidget`` of ``fig`` where plotly can make one (anywidget present), else None."""
    try:
        import plotly.graph_objects as go

        return go.FigureWidget(fig)
    except Exception:  # noqa: BLE001 - ImportError without anywidget; older stacks raise others
        return None


class LossScaleExplorer(_l01_widgets.VBox):
    """Lesson 01: slide the loss-scale exponent k and watch gradient magnitudes x 2^k move through
    a format's flushed / subnormal / normal / overflow bands (``plots.gradient_histogram``).

    ``slider`` is an IntSlider over k; ``figure`` is the histogram (a FigureWidget updated in
    place, or a plain figure redrawn into ``output`` where FigureWidget is unavailable);
    ``summary`` shows the exact fractions (``formats.scaled_fractions``). ``figure_mode``:
    ``"auto"`` (FigureWidget where available), ``"widget"`` or ``"output"`` (an Output redrawn;
    a saved notebook then carries no copy of plotly.js in its widget state). CSS classes:
    ``amp-l01-scale`` (the box), ``amp-l01-k``, ``amp-l01-summary``, ``amp-l01-chart``.
    """

    def __init__(self, magnitudes_by_layer: _L01Mapping[str, object], k: int = 0,
                 fmt: str = "fp16", k_range: tuple = (0, 32), log_y: bool = True,
                 figure_mode: str = "auto"):
        from .. import formats as _formats
        from . import plots as _plots

        if figure_mode not in ("auto", "widget", "output"):
            raise ValueError(f"figure_mode must be one of auto, widget, output; "
                             f"got {figure_mode!r}")
        lo, hi = k_range
        if not (isinstance(lo, int) and isinstance(hi, int) and lo < hi):
            raise ValueError(f"k_range must be two integers (low, high) with low < high; "
                             f"got {k_range!r}")
        if not isinstance(k, int) or not lo <= k <= hi:
            raise ValueError(f"k must be an integer in [{lo}, {hi}]; got {k!r}")
        if not magnitudes_by_layer:
            raise ValueError("magnitudes_by_layer must name at least one layer")
        self.fmt = _formats.get_format(fmt).name
        self.magnitudes = dict(magnitudes_by_layer)
        x_range = _plots.gradient_histogram_range(self.magnitudes, (2.0 ** lo, 2.0 ** hi),
                                                  self.fmt)
        static = _plots.gradient_histogram(self.magnitudes, 2.0 ** k, self.fmt, x_range=x_range,
                                           log_y=log_y)
        live = None if figure_mode == "output" else _l01_live_figure(static)
        if live is None and figure_mode == "widget":
            raise ValueError("figure_mode='widget' needs plotly's FigureWidget (install "
                             "anywidget); use 'auto' or 'output'")
        self.live = live is not None
        self.figure = live if live is not None else static
        self.output = None if self.live else _l01_widgets.Output()
        self.slider = _l01_widgets.IntSlider(value=k, min=lo, max=hi, step=1,
                                             description="scale 2^k, k =",
                                             continuous_update=False,
                                             style={"description_width": "initial"},
                                             layout=_l01_widgets.Layout(width="60%"))
        self.summary = _l01_widgets.HTML(self._summary(k))
        self.slider.observe(self._on_k, names="value")
        view = _l01_widgets.Box([self.figure if self.live else self.output],
                                layout=_l01_widgets.Layout(width="100%", display="block"))
        super().__init__([self.slider, self.summary, view])
        for widget, css in ((self, "amp-l01-scale"), (self.slider, "amp-l01-k"),
                            (self.summary, "amp-l01-summary"), (view, "amp-l01-chart")):
            widget.add_class(css)
        if not self.live:
            self._redraw()

    def _summary(self, k: int) -> str:
        from .. import formats as _formats

        f = _formats.scaled_fractions(list(self.magnitudes.values()), 2.0 ** k, self.fmt)
        return (f"scale 2<sup>{k}</sup> = {2.0 ** k:.6g}: of the nonzero gradient values, "
                f"<b>{100 * f['flushed']:.3f}%</b> flushed to zero, "
                f"<b>{100 * f['subnormal']:.3f}%</b> subnormal, "
                f"<b>{100 * f['normal']:.3f}%</b> normal, "
                f"<b>{100 * f['overflow']:.3f}%</b> overflow in {self.fmt}")

    def _redraw(self) -> None:
        from IPython.display import display

        with self.output:
            self.output.clear_output(wait=True)
            display(self.figure)

    def set_k(self, k: int) -> None:
        """Move to scale 2**k (what the slider does)."""
        self.slider.value = k

    def _on_k(self, change) -> None:
        from . import plots as _plots

        k = int(change["new"])
        if self.live:
            with self.figure.batch_update():
                _plots.update_gradient_histogram(self.figure, self.magnitudes, 2.0 ** k, self.fmt)
        else:
            _plots.update_gradient_histogram(self.figure, self.magnitudes, 2.0 ** k, self.fmt)
            self._redraw()
        self.summary.value = self._summary(k)


def loss_scale_explorer(magnitudes_by_layer: _L01Mapping[str, object], k: int = 0,
                        fmt: str = "fp16", k_range: tuple = (0, 32),
                        figure_mode: str = "auto") -> LossScaleExplorer:
    """Lesson 01: the loss-scale slider over gradient magnitudes, starting at scale 2**k."""
    return LossScaleExplorer(magnitudes_by_layer, k, fmt, k_range, figure_mode=figure_mode)


# =============================================================================================
# Lesson 03: GradScaler panels (live figures, scaler panel, histogram panel, preset comparison)
# =============================================================================================
# Widget logic lives in plain classes and functions that the tests drive without a browser:
# set a control's ``value``, call ``run()``, read the figure's data and the summary's text.
# Each control carries a CSS class (``amp-...``) that the browser test finds it by.
import dataclasses as _dc
import math as _math
import threading as _threading
from typing import Callable as _Callable, Dict as _Dict, List as _List, Mapping as _Mapping
from typing import Optional as _Optional, Sequence as _Sequence

import ipywidgets as _w
import numpy as _np
import plotly.graph_objects as _go
import torch as _torch

from . import plots as _plots
from ..data import digits_loaders as _digits_loaders
from ..models import DIGITS_MODELS as _DIGITS_MODELS, build_digits_model as _build_digits_model
from ..trainer import Hooks as _Hooks, ScalerSettings
from ..trainer import TrainConfig as _TrainConfig, Trainer as _Trainer

FIGURE_MODES = ("auto", "widget", "output")


def figure_widget_available() -> bool:
    """True where plotly's ``FigureWidget`` can render live: plotly >= 6 with anywidget importable.

    Colab ships plotly 5 with ipywidgets 7, where the panels use the ``Output`` fallback instead.
    """
    import plotly

    if int(plotly.__version__.split(".")[0]) < 6:
        return False
    try:
        import anywidget  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_figure_mode(mode: str = "auto") -> str:
    """``"widget"`` (FigureWidget, updated in place) or ``"output"`` (an Output redrawn).

    ``"auto"`` picks ``"widget"`` where ``figure_widget_available()``; tests force either.
    """
    if mode not in FIGURE_MODES:
        raise ValueError(f"figure mode must be one of {', '.join(FIGURE_MODES)}; got {mode!r}")
    if mode == "auto":
        return "widget" if figure_widget_available() else "output"
    return mode


class LiveFigure:
    """A plotly figure that a panel updates while it runs.

    ``mode="widget"``: a ``go.FigureWidget``, changed inside ``batch_update`` (one redraw per
    update). ``mode="output"``: a plain ``go.Figure`` shown in an ``ipywidgets.Output`` whose
    contents are replaced after each update (works with ipywidgets 7 and plotly 5, and from a
    background thread). ``widget`` is what a panel puts in its layout; ``figure`` the data.
    """

    def __init__(self, figure: _go.Figure, mode: str = "auto", css_class: str = ""):
        self.mode = resolve_figure_mode(mode)
        self.redraws = 0
        if self.mode == "widget":
            self.figure = _go.FigureWidget(figure)
            self.widget = self.figure
        else:
            self.figure = _go.Figure(figure)
            self.widget = _w.Output()
            self._draw()
        if css_class:
            self.widget.add_class(css_class)

    def update(self, change: _Callable[[_go.Figure], None]) -> None:
        """Apply ``change(figure)`` and show the result."""
        if self.mode == "widget":
            with self.figure.batch_update():
                change(self.figure)
        else:
            change(self.figure)
            self._draw()

    def _draw(self) -> None:
        # The figure's own bundle (the renderer al.setup() chose for this front end), set as the
        # Output's contents in one assignment: works from a thread and without a kernel.
        data = dict(self.figure._repr_mimebundle_() or {})
        data.setdefault("text/plain", f"<plotly figure: {self.figure.layout.title.text}>")
        self.widget.outputs = ({"output_type": "display_data", "data": data, "metadata": {}},)
        self.redraws += 1


def _set_class(widget, css_class: str):
    widget.add_class(css_class)
    return widget


# ---- scaler settings: PyTorch's defaults (measured), the article's tuned set, NVIDIA's ----------

#: Claim R3 (article R): "for ResNet-50 these work best".
ARTICLE_R_TUNED = dict(init_scale=32768.0, growth_factor=1.5, backoff_factor=0.4,
                       growth_interval=1000)
#: NVIDIA DeepLearningExamples, PyTorch ResNet-50: static-loss-scale 128 as the initial scale,
#: dynamic scaling that grows every 100 steps (growth and backoff factors left at PyTorch's).
NVIDIA_RESNET50 = dict(init_scale=128.0, growth_interval=100)
#: Claim R2 (article R): PyTorch's GradScaler defaults, as the article states them.
ARTICLE_R_DEFAULTS = dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=2000)


def measured_defaults(device_type: str = "cpu") -> ScalerSettings:
    """PyTorch's GradScaler defaults, read from a fresh ``torch.amp.GradScaler(device_type)``.

    Measured, not typed: ``get_scale()``, ``get_growth_factor()``, ``get_backoff_factor()`` and
    ``get_growth_interval()`` of a scaler built with no arguments (claim R2 compares these).
    """
    scaler = _torch.amp.GradScaler(device_type)
    if not scaler.is_enabled():
        raise ValueError(f"GradScaler cannot run on device_type {device_type!r} here")
    return ScalerSettings(init_scale=float(scaler.get_scale()),
                          growth_factor=float(scaler.get_growth_factor()),
                          backoff_factor=float(scaler.get_backoff_factor()),
                          growth_interval=int(scaler.get_growth_interval()))


def scaler_presets(device_type: str = "cpu") -> _Dict[str, ScalerSettings]:
    """The presets lesson 03 compares: PyTorch's defaults (measured), article R's tuned set (R3)
    and NVIDIA's ResNet-50 example (init_scale 128, growth_interval 100, other knobs default)."""
    defaults = measured_defaults(device_type)
    return {"PyTorch defaults": defaults,
            "article R tuned (R3)": ScalerSettings(**ARTICLE_R_TUNED),
            "NVIDIA ResNet-50": _dc.replace(defaults, **NVIDIA_RESNET50)}


# ---- one run: same seed, same data, a given ScalerSettings ------------------------------------

SETTLE_WINDOW = 10
FINAL_LOSS_WINDOW = 10


def steps_to_settle(skipped: _Sequence[bool], window: int = SETTLE_WINDOW) -> _Optional[int]:
    """How many optimizer steps a run took before its loss scale settled, or ``None``.

    Definition: the scale has *settled* at step ``k`` (0-based) when steps ``k .. k+window-1``
    are all taken, i.e. ``window`` steps in a row without a skip, so the scaler has stopped
    cutting the scale back. The result is the smallest such ``k`` (equivalently, the number of
    steps that came before that streak); ``None`` when the run holds no such streak (it skipped
    too often, or has fewer than ``window`` steps after its last skip).

    This measures early wobble (skipping), not whether the scale is as large as it could be: a
    scale that starts low and climbs without ever overflowing has settled at step 0.
    Raises ``ValueError`` for ``window < 1``.
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1; got {window!r}")
    streak = 0
    for i, skip in enumerate(skipped):
        streak = 0 if skip else streak + 1
        if streak == window:
            return i - window + 1
    return None


def final_loss(losses: _Sequence[float], last: int = FINAL_LOSS_WINDOW) -> float:
    """The run's final loss: the mean training loss over its last ``last`` steps (fewer if the
    run is shorter), which is steadier than one step's loss. ``nan`` for an empty run."""
    if not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be an integer >= 1; got {last!r}")
    tail = [float(v) for v in list(losses)[-last:]]
    return float(_np.mean(tail)) if tail else float("nan")


def _pow2(value: float, html: bool = False) -> str:
    """``65536`` as ``2^16 = 65,536`` (``2<sup>16</sup> = 65,536`` with ``html``); other values
    as ``2^15.29 = 40,000``."""
    if not value or not _math.isfinite(value) or value <= 0:
        return str(value)
    k = _math.log2(value)
    exp = f"{k:.0f}" if abs(k - round(k)) < 1e-9 else f"{k:.2f}"
    shown = f"{value:,.0f}" if value >= 1 and value == int(value) else f"{value:.6g}"
    return f"2<sup>{exp}</sup> = {shown}" if html else f"2^{exp} = {shown}"


@_dc.dataclass
class ScalerRun:
    """What one run recorded, step by step, and its summary.

    ``scales[i]`` is the scale step ``i`` used (as the trainer's ``StepRecord.scale``),
    ``skipped[i]`` whether the scaler skipped it, ``injected[i]`` whether the overflow injector
    wrote an inf into its gradients, ``changes`` the settings changed mid-run as
    ``(step, ScalerSettings)``; ``evaluation`` the test loss and accuracy after the run.
    """

    name: str
    settings: ScalerSettings
    steps: _List[int] = _dc.field(default_factory=list)
    scales: _List[float] = _dc.field(default_factory=list)
    skipped: _List[bool] = _dc.field(default_factory=list)
    losses: _List[float] = _dc.field(default_factory=list)
    injected: _List[bool] = _dc.field(default_factory=list)
    changes: _List[tuple] = _dc.field(default_factory=list)
    evaluation: _Optional[dict] = None
    final_scale: _Optional[float] = None
    trainer: object = _dc.field(default=None, repr=False, compare=False)

    def _take(self, records, injector: "OverflowInjector") -> None:
        """Append the numbers of the records not yet taken (reading them from the device)."""
        for record in records[len(self.steps):]:
            self.steps.append(len(self.steps))
            self.scales.append(float(record.scale))
            self.skipped.append(bool(record.skipped))
            self.losses.append(float(record.loss))
            self.injected.append(injector.injected[len(self.injected)])
        if self.trainer is not None:
            self.final_scale = float(self.trainer.scaler.get_scale())

    def columns(self) -> _Dict[str, list]:
        """The per-step columns the plots take: steps, scales, skipped, losses."""
        return {"steps": list(self.steps), "scales": list(self.scales),
                "skipped": list(self.skipped), "losses": list(self.losses)}

    def summary(self, window: int = SETTLE_WINDOW) -> dict:
        """Skipped steps, steps until settled (see ``steps_to_settle``), final scale (after the
        last update), final loss (see ``final_loss``), and test accuracy when evaluated."""
        ev = self.evaluation or {}
        return {"preset": self.name, "steps": len(self.steps),
                "skipped steps": int(sum(self.skipped)),
                "injected overflows": int(sum(self.injected)),
                "settled after (steps)": steps_to_settle(self.skipped, window),
                "final scale": self.final_scale,
                "min scale": min(self.scales) if self.scales else None,
                "final loss": final_loss(self.losses) if self.losses else None,
                "test accuracy": ev.get("accuracy")}

    def summary_line(self, window: int = SETTLE_WINDOW) -> str:
        """One line for people: the panel's summary."""
        s = self.summary(window)
        k = s["settled after (steps)"]
        settled = "not within the run" if k is None else f"after {k} step{'' if k == 1 else 's'}"
        parts = [f"skipped {s['skipped steps']} of {s['steps']} steps",
                 f"settled {settled} (first {window} steps in a row without a skip)",
                 f"final scale {_pow2(s['final scale'])}" if s["final scale"] else "",
                 f"final loss {s['final loss']:.4f} (mean of last {FINAL_LOSS_WINDOW} steps)"
                 if s["final loss"] is not None else "",
                 f"test accuracy {s['test accuracy']:.1%}"
                 if s["test accuracy"] is not None else ""]
        return " · ".join(p for p in parts if p)


@_dc.dataclass(frozen=True)
class RunSetup:
    """What every run of a comparison shares: model, data, optimizer and seed.

    ``model``: one of ``trainer.DIGITS_MODELS`` built by ``trainer.build_digits_model(model,
    width)``: ``"mlp"`` (flat 8x8 digits; fast on a CPU) or ``"cnn"`` (``SmallCNN`` on digits
    upsampled to ``image_size``), as in lesson 02. SGD with momentum at ``lr``. Validated when
    built.
    """

    model: str = "mlp"
    width: int = 32
    image_size: int = 32
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    device: _Optional[str] = None

    def __post_init__(self):
        if self.model not in _DIGITS_MODELS:
            raise ValueError(f"model must be one of {', '.join(_DIGITS_MODELS)}; "
                             f"got {self.model!r}")
        for name, low in (("width", 1), ("image_size", 8), ("batch_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr <= 10):
            raise ValueError(f"lr must be in (0, 10]; got {self.lr!r}")
        if not (isinstance(self.momentum, (int, float)) and 0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1); got {self.momentum!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {self.seed!r}")

    @property
    def torch_device(self) -> _torch.device:
        """The device runs train on: ``device`` if given, else the course's default device."""
        from ..env import default_device

        return _torch.device(self.device) if self.device is not None else default_device()

    def build(self, settings: ScalerSettings, hooks: _Sequence = ()):
        """A fresh, seeded ``Trainer`` (fp16 + GradScaler with ``settings``) and the data
        ``(train_batches, test_batches)``: the same weights and batch order for every call."""
        device = self.torch_device
        _torch.manual_seed(self.seed)
        model, size = _build_digits_model(self.model, self.width)
        if size is not None:
            size = self.image_size
        model = model.to(device)
        opt = _torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)
        config = _TrainConfig(precision="fp16", scaler=settings, progress=False, seed=self.seed)
        trainer = _Trainer(model, opt, config, device=device, hooks=tuple(hooks))
        train, test = _digits_loaders(self.batch_size, size, device, self.seed)
        return trainer, train, test


def _forever(batches):
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


class OverflowInjector(_Hooks):
    """A trainer hook that writes ``inf`` into a gradient with probability ``rate`` per step.

    Runs in ``after_backward`` (the gradients are still scaled), so ``unscale_`` finds the inf,
    the step is skipped and the scale backs off: overflow on demand. Draws come from its own
    generator seeded with ``seed`` (one draw per backward, whatever the rate), so a run repeats
    exactly and changing ``rate`` mid-run does not shift later draws. ``injected`` lists, per
    optimizer step, whether an inf was written. Raises ``ValueError`` for a rate outside [0, 1].
    """

    def __init__(self, rate: float = 0.0, seed: int = 0):
        self.rate = rate
        self.generator = _torch.Generator().manual_seed(int(seed))
        self.injected: _List[bool] = []
        self._this_step = False

    @property
    def rate(self) -> float:
        """The probability of an inf per backward pass, in [0, 1]."""
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        if not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"overflow injection rate must be in [0, 1]; got {value!r}")
        self._rate = float(value)

    def after_backward(self, trainer, micro_step):
        draw = float(_torch.rand((), generator=self.generator))
        if draw < self._rate:
            grad = next((p.grad for p in trainer.model.parameters() if p.grad is not None), None)
            if grad is not None:
                grad[(0,) * grad.dim()] = float("inf")
                self._this_step = True

    def after_step(self, trainer, record):
        self.injected.append(self._this_step)
        self._this_step = False


def train_with_scaler(settings: ScalerSettings, steps: int, setup: RunSetup = RunSetup(),
                      injection_rate: float = 0.0, name: str = "run",
                      on_step: _Optional[_Callable] = None, evaluate: bool = True,
                      injector: _Optional["OverflowInjector"] = None) -> ScalerRun:
    """Train ``steps`` optimizer steps in fp16 with a GradScaler set to ``settings``.

    Same seed, weights and batches for every call with the same ``setup``; an
    ``OverflowInjector(injection_rate, setup.seed)`` is installed. ``on_step(trainer, run)`` runs
    after every step; it may call ``trainer.set_scaler`` (a mid-run change) and returns
    ``False`` to stop early. Pass ``injector`` to keep a handle on it (its rate is then used and
    ``injection_rate`` ignored). Returns the ``ScalerRun`` (its ``trainer`` attribute holds the
    trainer). Raises ``ValueError`` for ``steps < 1`` and the trainer's documented errors for
    bad settings.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    injector = injector or OverflowInjector(injection_rate, seed=setup.seed)
    trainer, train, test = setup.build(settings, hooks=[injector])
    run = ScalerRun(name=name, settings=settings, trainer=trainer)
    batches = _forever(train)
    records = []
    for _ in range(steps):
        records.append(trainer.train_step([next(batches)]))
        if on_step is not None:  # live: read this step's numbers now (one small sync)
            run._take(records, injector)
            if on_step(trainer, run) is False:
                break
    trainer.history.materialize()  # the rest with one copy per field, no sync per step
    run._take(records, injector)
    if evaluate:
        run.evaluation = dict(trainer.evaluate(test))
    return run


# ---- the scaler panel --------------------------------------------------------------------------

_DESC = {"description_width": "150px"}
_ROW = _w.Layout(width="360px")


class _BackgroundRun:
    """The Run button of a panel: ``run()`` in a thread when ``background``, else inline.

    A panel sets ``background``, ``_running``, ``_thread`` and ``run_button``, and names the HTML
    widget that shows a failure in ``_status_html()``; a thread's error would be lost otherwise.
    """

    def start(self):
        """What the Run button does: ``run()`` in a thread when ``background``, else inline."""
        if self._running:
            return None
        if not self.background:
            return self.run()
        self._running = True  # before the thread starts, so a second click is ignored
        self._thread = _threading.Thread(target=self._run_reporting_errors, daemon=True)
        self._thread.start()
        return self._thread

    def _join(self, timeout: _Optional[float]) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run_reporting_errors(self):
        try:
            self.run()
        except Exception as exc:  # noqa: BLE001
            self._status_html().value = f"<span style='color:#d62728'>Run failed: {exc!r}</span>"
            self._running = False
            self.run_button.disabled = False


class ScalerPanel(_BackgroundRun):
    """Lesson 03's panel: GradScaler's four knobs, an overflow-injection rate, a step count, Run
    and Reset; a live chart of the scale per step (skipped steps marked) and the loss; a summary.

    Run trains a fresh seeded model through ``amp_lessons.trainer`` (fp16 + GradScaler) with the
    knobs' values. Moving a knob while a run is going changes the running scaler at the next step
    through ``Trainer.set_scaler`` (GradScaler's setters, and ``update(new_scale=...)`` for the
    scale); the injection rate changes at once. ``background=True`` (the Run button's default)
    trains in a thread so the knobs stay live; ``run()`` always blocks and returns the
    ``ScalerRun``. Controls carry CSS classes: ``amp-init-scale``, ``amp-growth-factor``,
    ``amp-backoff-factor``, ``amp-growth-interval``, ``amp-overflow-rate``, ``amp-steps``,
    ``amp-run``, ``amp-reset``, ``amp-summary``, ``amp-scaler-chart``, ``amp-init-scale-value`` (the
    scale the kernel has, as a number); the box ``amp-scaler-panel``.
    """

    def __init__(self, setup: RunSetup = RunSetup(), steps: int = 60,
                 settings: _Optional[ScalerSettings] = None, injection_rate: float = 0.0,
                 update_every: int = 5, figure_mode: str = "auto", background: bool = True):
        if not isinstance(update_every, int) or update_every < 1:
            raise ValueError(f"update_every must be an integer >= 1; got {update_every!r}")
        self.setup = setup
        self.update_every = update_every
        self.background = background
        self.defaults = measured_defaults(setup.torch_device.type)
        start = settings or self.defaults
        self._initial = (start, injection_rate, steps)
        self.init_scale = _set_class(_w.IntSlider(
            value=round(_math.log2(start.init_scale)), min=-10, max=32, step=1,
            description="init_scale (log2)", style=_DESC, layout=_ROW,
            continuous_update=False), "amp-init-scale")
        # written by the kernel's observer, so it shows the value the kernel has (the browser
        # test waits on it)
        self.init_scale_value = _set_class(_w.HTML(layout=_w.Layout(width="190px")),
                                           "amp-init-scale-value")
        self.growth_factor = _set_class(_w.FloatSlider(
            value=start.growth_factor, min=1.05, max=8.0, step=0.05, description="growth_factor",
            style=_DESC, layout=_ROW, continuous_update=False), "amp-growth-factor")
        self.backoff_factor = _set_class(_w.FloatSlider(
            value=start.backoff_factor, min=0.05, max=0.95, step=0.05,
            description="backoff_factor", style=_DESC, layout=_ROW, continuous_update=False),
            "amp-backoff-factor")
        self.growth_interval = _set_class(_w.BoundedIntText(
            value=start.growth_interval, min=1, max=1_000_000, description="growth_interval",
            style=_DESC, layout=_w.Layout(width="260px")), "amp-growth-interval")
        self.overflow_rate = _set_class(_w.FloatSlider(
            value=injection_rate, min=0.0, max=1.0, step=0.01,
            description="injected overflow rate", style=_DESC, layout=_ROW,
            continuous_update=False), "amp-overflow-rate")
        self.steps = _set_class(_w.BoundedIntText(
            value=steps, min=1, max=100_000, description="steps", style=_DESC,
            layout=_w.Layout(width="260px")), "amp-steps")
        self.run_button = _set_class(_w.Button(description="Run", button_style="primary",
                                               icon="play"), "amp-run")
        self.reset_button = _set_class(_w.Button(description="Reset", icon="undo"), "amp-reset")
        self.summary = _set_class(_w.HTML("Press <b>Run</b> to train."), "amp-summary")
        self.live = LiveFigure(_plots.scale_and_loss(
            [], [], [], [], title="Loss scale and loss per step (press Run)"),
            figure_mode, css_class="amp-scaler-chart")
        self.run_result: _Optional[ScalerRun] = None
        self.runs = 0
        self._lock = _threading.Lock()
        self._pending: _Optional[ScalerSettings] = None
        self._injector: _Optional[OverflowInjector] = None
        self._running = False
        self._stop = False
        self._thread: _Optional[_threading.Thread] = None
        for knob in (self.init_scale, self.growth_factor, self.backoff_factor,
                     self.growth_interval):
            knob.observe(self._on_knob, names="value")
        self.init_scale.observe(self._show_init_scale, names="value")
        self.overflow_rate.observe(self._on_rate, names="value")
        self.run_button.on_click(lambda _: self.start())
        self.reset_button.on_click(lambda _: self.reset())
        self._show_init_scale()
        controls = _w.VBox([
            _w.HBox([self.init_scale, self.init_scale_value]),
            _w.HBox([self.growth_factor, self.growth_interval]),
            _w.HBox([self.backoff_factor, self.steps]),
            _w.HBox([self.overflow_rate, self.run_button, self.reset_button]),
        ])
        self.widget = _set_class(_w.VBox([controls, self.live.widget, self.summary]),
                                 "amp-scaler-panel")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    # -- state ---------------------------------------------------------------------------------
    def settings(self) -> ScalerSettings:
        """The knobs' values as a validated ``ScalerSettings``."""
        return ScalerSettings(init_scale=2.0 ** self.init_scale.value,
                              growth_factor=float(self.growth_factor.value),
                              backoff_factor=float(self.backoff_factor.value),
                              growth_interval=int(self.growth_interval.value))

    @property
    def running(self) -> bool:
        """True while a run is training."""
        return self._running

    def _show_init_scale(self, change=None):
        v = 2.0 ** self.init_scale.value
        self.init_scale_value.value = f"= {v:,.0f}" if v >= 1 else f"= {v:.6g}"

    def _on_knob(self, change):
        if self._running:
            with self._lock:
                self._pending = self.settings()

    def _on_rate(self, change):
        if self._injector is not None:
            self._injector.rate = float(change["new"])

    # -- actions -------------------------------------------------------------------------------
    def _status_html(self):
        return self.summary

    def wait(self, timeout: _Optional[float] = None) -> _Optional[ScalerRun]:
        """Wait for a background run to finish; return its ``ScalerRun``."""
        self._join(timeout)
        return self.run_result

    def run(self, steps: _Optional[int] = None) -> ScalerRun:
        """Train with the knobs' settings for ``steps`` (default: the steps box), updating the
        chart every ``update_every`` steps and the summary at the end; return the ``ScalerRun``."""
        steps = int(self.steps.value if steps is None else steps)
        self._running, self._stop = True, False
        self.run_button.disabled = True
        with self._lock:
            self._pending = None
        settings = self.settings()
        self.summary.value = f"Running {steps} steps with {settings} ..."

        def on_step(trainer, run):
            if len(run.steps) % self.update_every == 0:
                self._draw(run, running=True)
            with self._lock:  # knobs moved while this step ran apply from the next step on
                pending, self._pending = self._pending, None
            if pending is not None:
                trainer.set_scaler(pending)
                run.changes.append((run.steps[-1], pending))
            return not self._stop

        self._injector = OverflowInjector(float(self.overflow_rate.value), seed=self.setup.seed)
        try:
            result = train_with_scaler(settings, steps, self.setup, name="panel",
                                       on_step=on_step, evaluate=False, injector=self._injector)
        finally:
            self._injector = None
            self._running = False
            self.run_button.disabled = False
        self.run_result = result
        self.runs += 1
        self._draw(result, running=False)
        self.summary.value = f"Run {self.runs}: {result.summary_line()}"
        return result

    def _draw(self, run: ScalerRun, running: bool) -> None:
        cols = run.columns()
        title = (f"Loss scale and loss per step (init_scale "
                 f"{_pow2(run.settings.init_scale, html=True)}, {len(cols['steps'])} steps"
                 f"{', running' if running else ''})")

        def change(fig):
            _plots.update_scale_and_loss(fig, cols["steps"], cols["scales"], cols["skipped"],
                                         cols["losses"])
            fig.layout.title.text = title

        self.live.update(change)

    def reset(self) -> None:
        """Stop a run, put every knob back to its starting value, clear the chart and summary."""
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        start, rate, steps = self._initial
        self.init_scale.value = round(_math.log2(start.init_scale))
        self.growth_factor.value = start.growth_factor
        self.backoff_factor.value = start.backoff_factor
        self.growth_interval.value = start.growth_interval
        self.overflow_rate.value = rate
        self.steps.value = steps
        self.run_result = None

        def clear(fig):
            _plots.update_scale_and_loss(fig, [], [], [], [])
            fig.layout.title.text = "Loss scale and loss per step (press Run)"

        self.live.update(clear)
        self.summary.value = "Press <b>Run</b> to train."


# ---- gradient histograms against fp16's range ----------------------------------------------------

class GradientCapture(_Hooks):
    """A trainer hook that keeps each layer's true gradient magnitudes ``|g|``.

    Runs in ``after_unscale``: the gradients are unscaled (what the model really computed) and
    not yet clipped. Layers are the modules with a weight of two or more dimensions (convolutions
    and linear layers), weight and bias together, named ``"<module name> (<type>)"``. From step
    ``start_at`` (0-based) on, it keeps the latest step whose gradients are all finite (a skipped
    step's are not); ``magnitudes`` maps layer to a float32 array, ``step`` is the step they came
    from (``None`` before a capture).
    """

    def __init__(self, start_at: int = 0):
        if not isinstance(start_at, int) or start_at < 0:
            raise ValueError(f"start_at must be an integer >= 0; got {start_at!r}")
        self.start_at = start_at
        self.magnitudes: _Dict[str, _np.ndarray] = {}
        self.step: _Optional[int] = None
        self._count = 0

    def after_unscale(self, trainer):
        if self._count < self.start_at:
            return
        found = {}
        for name, module in trainer.model.named_modules():
            weight = getattr(module, "weight", None)
            if (not isinstance(weight, _torch.nn.Parameter) or weight.dim() < 2
                    or weight.grad is None):
                continue
            parts = [weight.grad.detach().reshape(-1)]
            bias = getattr(module, "bias", None)
            if isinstance(bias, _torch.nn.Parameter) and bias.grad is not None:
                parts.append(bias.grad.detach().reshape(-1))
            found[f"{name} ({type(module).__name__})"] = _torch.cat(parts).abs().float()
        if found and all(bool(_torch.isfinite(g).all()) for g in found.values()):
            self.magnitudes = {k: v.cpu().numpy() for k, v in found.items()}
            self.step = self._count

    def after_step(self, trainer, record):
        self._count += 1


def capture_gradients(steps: int = 20, setup: RunSetup = RunSetup(model="cnn", image_size=32),
                      settings: _Optional[ScalerSettings] = None, last: int = 3):
    """Train ``setup``'s model for ``steps`` fp16 steps and return ``(magnitudes, step)``: the
    per-layer true gradient magnitudes (``GradientCapture``) of the latest finite step among the
    last ``last`` steps. ``settings`` default to PyTorch's (measured)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    settings = settings or measured_defaults(setup.torch_device.type)
    capture = GradientCapture(start_at=max(0, steps - last))
    trainer, train, _ = setup.build(settings, hooks=[capture])
    batches = _forever(train)
    for _ in range(steps):
        trainer.train_step([next(batches)])
    if not capture.magnitudes:
        raise RuntimeError(f"every one of the last {last} steps had non-finite gradients")
    return capture.magnitudes, capture.step


def fraction_rows(magnitudes_by_layer: _Mapping[str, _np.ndarray], scale: float,
                  fmt: str = "fp16") -> _List[dict]:
    """Per layer: the fractions of its nonzero gradients that ``fmt`` flushes to zero, makes
    subnormal, or overflows once multiplied by ``scale`` (``formats.scaled_fractions``)."""
    from ..formats import scaled_fractions

    if not magnitudes_by_layer:
        raise ValueError("magnitudes_by_layer must name at least one layer")
    rows = []
    for layer, mags in magnitudes_by_layer.items():
        f = scaled_fractions(mags, scale, fmt)
        rows.append({"layer": layer, "values": int(_np.size(mags)), "flushed": f["flushed"],
                     "subnormal": f["subnormal"], "overflow": f["overflow"]})
    return rows


def _percent(x: float) -> str:
    if x == 0:
        return "0"
    return f"{100 * x:.2f}%" if x >= 1e-4 else f"{100 * x:.1e}%"


def fraction_table_html(rows: _Sequence[_Mapping], scale: float, fmt: str = "fp16") -> str:
    """``fraction_rows`` as an HTML table (what the histogram panel shows under its chart)."""
    head = ("layer", "values", "flushed to zero", "subnormal (precision lost)", "overflow (inf)")
    cells = "".join(
        f"<tr><td style='text-align:left'>{r['layer']}</td><td>{r['values']:,}</td>"
        f"<td>{_percent(r['flushed'])}</td><td>{_percent(r['subnormal'])}</td>"
        f"<td>{_percent(r['overflow'])}</td></tr>" for r in rows)
    header = "".join(f"<th>{h}</th>" for h in head)
    return (f"<b>Share of each layer's nonzero gradients lost in {fmt} at loss scale "
            f"{_pow2(scale)}</b><table style='border-collapse:collapse' cellpadding='4'>"
            f"<tr>{header}</tr>{cells}</table>")


class HistogramPanel:
    """Per-layer gradient magnitudes in log2 bins against fmt's bands (normal, subnormal,
    flushed to zero), with a loss-scale slider; under the chart, per layer, the fraction that
    underflows or overflows at that scale.

    Built on ``plots.gradient_histogram``. CSS classes: ``amp-hist-scale`` (the slider),
    ``amp-hist-chart``, ``amp-hist-table``; the box ``amp-hist-panel``.
    """

    def __init__(self, magnitudes_by_layer: _Mapping[str, _np.ndarray], scale_log2: int = 0,
                 fmt: str = "fp16", figure_mode: str = "auto", log2_range: tuple = (-8, 40)):
        lo, hi = log2_range
        if not (isinstance(lo, int) and isinstance(hi, int) and lo < hi):
            raise ValueError(f"log2_range must be two integers (low, high), low < high; "
                             f"got {log2_range!r}")
        if not isinstance(scale_log2, int) or not lo <= scale_log2 <= hi:
            raise ValueError(f"scale_log2 must be an integer in [{lo}, {hi}]; got {scale_log2!r}")
        if not magnitudes_by_layer:
            raise ValueError("magnitudes_by_layer must name at least one layer")
        self.magnitudes = dict(magnitudes_by_layer)
        self.fmt = fmt
        # one x range for every slider position, so the bars move and the bands stay put
        x_lo, x_hi = _plots.gradient_histogram_range(self.magnitudes, (2.0 ** lo, 2.0 ** hi), fmt)
        from ..formats import band_limits

        flush_edge = _math.floor(_math.log2(band_limits(fmt)["flushed_max"]))
        self.x_range = (float(min(x_lo, flush_edge - 12)), x_hi)  # room for the band's label
        self.scale = _set_class(_w.IntSlider(
            value=scale_log2, min=lo, max=hi, step=1, description="loss scale (log2)",
            style=_DESC, layout=_w.Layout(width="480px"), continuous_update=False),
            "amp-hist-scale")
        self.scale_value = _w.HTML()
        self.live = LiveFigure(_plots.gradient_histogram(self.magnitudes, self.loss_scale, fmt,
                                                         x_range=self.x_range, log_y=True),
                               figure_mode, css_class="amp-hist-chart")
        self.table = _set_class(_w.HTML(), "amp-hist-table")
        self.scale.observe(self._on_scale, names="value")
        self._show()
        self.widget = _set_class(_w.VBox([_w.HBox([self.scale, self.scale_value]),
                                          self.live.widget, self.table]), "amp-hist-panel")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    @property
    def loss_scale(self) -> float:
        """The slider's scale, ``2 ** value``."""
        return 2.0 ** self.scale.value

    def rows(self) -> _List[dict]:
        """``fraction_rows`` at the slider's scale."""
        return fraction_rows(self.magnitudes, self.loss_scale, self.fmt)

    def _on_scale(self, change=None):
        self.live.update(lambda fig: _plots.update_gradient_histogram(
            fig, self.magnitudes, self.loss_scale, self.fmt))
        self._show()

    def _show(self):
        v = self.loss_scale
        self.scale_value.value = f"= {v:,.0f}" if v >= 1 else f"= {v:.6g}"
        self.table.value = fraction_table_html(self.rows(), v, self.fmt)


def _replace_figure(fig, new: _go.Figure) -> None:
    """Make ``fig`` (a Figure or FigureWidget) show ``new``: traces updated in place when they
    line up, replaced otherwise; the layout replaced."""
    if len(fig.data) == len(new.data) and all(a.type == b.type for a, b in zip(fig.data, new.data)):
        for old, fresh in zip(fig.data, new.data):
            old.update(fresh.to_plotly_json(), overwrite=True)
    else:
        fig.data = ()
        fig.add_traces(list(new.data))
    fig.layout = new.layout


# ---- presets on the same run ---------------------------------------------------------------------

def compare_presets(presets: _Mapping[str, ScalerSettings], steps: int,
                    setup: RunSetup = RunSetup(), injection_rate: float = 0.0,
                    on_run: _Optional[_Callable[[str, ScalerRun], None]] = None
                    ) -> _Dict[str, ScalerRun]:
    """Train each preset with ``train_with_scaler`` on the same seed, weights and batches (and
    the same injected overflows); return ``{name: ScalerRun}`` in order. ``on_run(name, run)``
    is called after each. Raises ``ValueError`` for no presets."""
    if not presets:
        raise ValueError("presets must name at least one ScalerSettings")
    runs = {}
    for name, settings in presets.items():
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"preset {name!r} must be a ScalerSettings; "
                             f"got {type(settings).__name__}")
        runs[name] = train_with_scaler(settings, steps, setup, injection_rate, name=name)
        if on_run is not None:
            on_run(name, runs[name])
    return runs


def comparison_rows(runs: _Mapping[str, ScalerRun]) -> _List[dict]:
    """One summary row per run (``ScalerRun.summary``) with the preset's settings."""
    rows = []
    for name, run in runs.items():
        s = run.settings
        rows.append({"preset": name, "init_scale": s.init_scale, "growth_factor": s.growth_factor,
                     "backoff_factor": s.backoff_factor, "growth_interval": s.growth_interval,
                     **{k: v for k, v in run.summary().items() if k != "preset"}})
    return rows


def comparison_table_html(runs: _Mapping[str, ScalerRun]) -> str:
    """The preset panel's table: one row per run with its settings, skipped steps, steps until
    settled, final scale, final loss and test accuracy, formatted for people."""
    head = ("preset", "init / growth / backoff / interval", "skipped steps", "settled after",
            "final scale", "final loss", "test accuracy")
    body = []
    for name, run in runs.items():
        s, row = run.settings, run.summary()
        settled = row["settled after (steps)"]
        acc = row["test accuracy"]
        cells = (name, f"{_pow2(s.init_scale, html=True).split(' = ')[0]} / {s.growth_factor:g} / "
                       f"{s.backoff_factor:g} / {s.growth_interval}",
                 f"{row['skipped steps']} of {row['steps']}"
                 + (f" ({row['injected overflows']} injected)"
                    if row["injected overflows"] else ""),
                 "never" if settled is None else f"{settled} steps",
                 _pow2(row["final scale"], html=True) if row["final scale"] else "-",
                 f"{row['final loss']:.4f}" if row["final loss"] is not None else "-",
                 f"{acc:.1%}" if acc is not None else "-")
        body.append("<tr>" + "".join(f"<td style='padding:2px 10px'>{c}</td>" for c in cells)
                    + "</tr>")
    header = "".join(f"<th style='padding:2px 10px;text-align:left'>{h}</th>" for h in head)
    return (f"<table style='border-collapse:collapse'><tr>{header}</tr>{''.join(body)}</table>"
            f"<small>settled: first of {SETTLE_WINDOW} steps in a row without a skip; final loss: "
            f"mean of the last {FINAL_LOSS_WINDOW} steps</small>")


class PresetComparison(_BackgroundRun):
    """Several scaler presets trained on the same seed and data, drawn together as they finish.

    A checkbox per preset (class ``amp-preset``), steps (``amp-presets-steps``), an injected
    overflow rate (``amp-presets-overflow-rate``), Run (``amp-presets-run``), the chart
    (``amp-presets-chart``) and a table of summaries (``amp-presets-table``). ``run()`` blocks
    and returns ``{name: ScalerRun}``; the button runs in a thread when ``background``.
    """

    def __init__(self, presets: _Optional[_Mapping[str, ScalerSettings]] = None, steps: int = 100,
                 setup: RunSetup = RunSetup(), injection_rate: float = 0.0,
                 figure_mode: str = "auto", background: bool = True):
        self.presets = dict(presets or scaler_presets(setup.torch_device.type))
        if not self.presets:
            raise ValueError("presets must name at least one ScalerSettings")
        self.setup = setup
        self.background = background
        self.checks = {name: _set_class(_w.Checkbox(value=True, description=name, indent=False,
                                                    layout=_w.Layout(width="auto")), "amp-preset")
                       for name in self.presets}
        self.steps = _set_class(_w.BoundedIntText(value=steps, min=1, max=100_000,
                                                  description="steps", style=_DESC,
                                                  layout=_w.Layout(width="260px")),
                                "amp-presets-steps")
        self.overflow_rate = _set_class(_w.FloatSlider(
            value=injection_rate, min=0.0, max=1.0, step=0.01, description="injected overflow rate",
            style=_DESC, layout=_ROW, continuous_update=False), "amp-presets-overflow-rate")
        self.run_button = _set_class(_w.Button(description="Run presets", button_style="primary",
                                               icon="play"), "amp-presets-run")
        self.table = _set_class(_w.HTML("Press <b>Run presets</b>."), "amp-presets-table")
        self.live = LiveFigure(self._empty_figure(), figure_mode, css_class="amp-presets-chart")
        self.runs: _Dict[str, ScalerRun] = {}
        self._thread: _Optional[_threading.Thread] = None
        self._running = False
        self.run_button.on_click(lambda _: self.start())
        self.widget = _set_class(_w.VBox([
            _w.HBox(list(self.checks.values())),
            _w.HBox([self.steps, self.overflow_rate, self.run_button]),
            self.live.widget, self.table]), "amp-presets-panel")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _empty_figure(self) -> _go.Figure:
        empty = {"steps": [], "scales": [], "skipped": [], "losses": []}
        return _plots.preset_comparison({n: empty for n in self.presets},
                                        title="GradScaler presets on the same run (press Run)")

    def selected(self) -> _Dict[str, ScalerSettings]:
        """The ticked presets."""
        return {n: s for n, s in self.presets.items() if self.checks[n].value}

    def _status_html(self):
        return self.table

    def wait(self, timeout: _Optional[float] = None) -> _Dict[str, ScalerRun]:
        """Wait for a background run; return its runs."""
        self._join(timeout)
        return self.runs

    def run(self) -> _Dict[str, ScalerRun]:
        """Train every ticked preset for ``steps``; redraw after each; fill the table."""
        chosen = self.selected()
        if not chosen:
            raise ValueError("tick at least one preset")
        self._running = True
        self.run_button.disabled = True
        steps = int(self.steps.value)
        done: _Dict[str, ScalerRun] = {}

        def on_run(name, run):
            done[name] = run
            self._draw(done, final=len(done) == len(chosen))
            self.table.value = comparison_table_html(done)

        try:
            self.table.value = f"Running {len(chosen)} presets x {steps} steps ..."
            compare_presets(chosen, steps, self.setup, float(self.overflow_rate.value), on_run)
        finally:
            self._running = False
            self.run_button.disabled = False
        self.runs = done
        return done

    def _draw(self, runs: _Mapping[str, ScalerRun], final: bool) -> None:
        new = _plots.preset_comparison(
            {n: r.columns() for n, r in runs.items()},
            title=f"GradScaler presets on the same run ({len(next(iter(runs.values())).steps)} "
                  f"steps, same seed and data{'' if final else ', running'})")
        self.live.update(lambda fig: _replace_figure(fig, new))


# ---- the claims lesson 03 measures ---------------------------------------------------------------

@_dc.dataclass(frozen=True)
class Verdict:
    """A claim beside its measurement. ``held`` is True, False, or None (the run could not
    decide it); ``verdict`` is computed from the measurement, never typed in."""

    claim: str
    measured: str
    held: _Optional[bool]
    verdict: str

    def __str__(self) -> str:
        word = {True: "HELD", False: "DID NOT HOLD", None: "NOT DECIDED BY THIS RUN"}[self.held]
        return (f"claim   : {self.claim}\nmeasured: {self.measured}\n"
                f"verdict : {word}: {self.verdict}")


def claim_r2(device_type: str = "cpu") -> Verdict:
    """Claim R2 (PyTorch's GradScaler defaults) against a fresh scaler's getters."""
    measured = measured_defaults(device_type)
    got = {k: getattr(measured, k) for k in ARTICLE_R_DEFAULTS}
    wrong = [k for k, v in ARTICLE_R_DEFAULTS.items() if got[k] != v]
    claim = ", ".join(f"{k} {v:g}" for k, v in ARTICLE_R_DEFAULTS.items())
    text = ", ".join(f"{k} {v:g}" for k, v in got.items())
    verdict = ("every default matches" if not wrong else
               "differs in " + ", ".join(f"{k} (claimed {ARTICLE_R_DEFAULTS[k]:g}, "
                                         f"measured {got[k]:g})" for k in wrong))
    return Verdict(f"GradScaler defaults: {claim}", f"torch {_torch.__version__}: {text}",
                   not wrong, verdict)


def early_skips(run: ScalerRun, window: int = SETTLE_WINDOW) -> int:
    """Skipped steps before the scale settled (all of them if it never did): early wobble."""
    settle = steps_to_settle(run.skipped, window)
    return int(sum(run.skipped if settle is None else run.skipped[:settle]))


R3_CLAIM = ("init_scale 32768, growth 1.5, backoff 0.4, interval 1000: the scale settles faster "
            "with less early wobble")


def claim_r3(defaults: ScalerRun, tuned: ScalerRun, window: int = SETTLE_WINDOW,
             claim: str = R3_CLAIM) -> Verdict:
    """Claim R3 (the tuned set settles faster with less early wobble) on two runs of the same
    seed and data. Held when the tuned run settles strictly sooner (``steps_to_settle``) and
    skips no more steps early (``early_skips``); undecided when neither run skipped early and
    both settled at the same step (nothing to improve on). ``claim`` words the comparison."""
    inf = float("inf")
    sd, st = steps_to_settle(defaults.skipped, window), steps_to_settle(tuned.skipped, window)
    ed, et = early_skips(defaults, window), early_skips(tuned, window)

    def settled(v):
        return "never" if v is None else f"after {v} steps"

    measured = (f"{defaults.name}: {ed} early skips, settled {settled(sd)}, final loss "
                f"{final_loss(defaults.losses):.4f}; {tuned.name}: {et} early skips, settled "
                f"{settled(st)}, final loss {final_loss(tuned.losses):.4f}")
    if ed == 0 and et == 0 and sd == st:
        held, verdict = None, ("neither run wobbled (no early skipped steps), so there was "
                               "nothing for the tuned settings to improve on this model")
    else:
        faster = (inf if st is None else st) < (inf if sd is None else sd)
        held = faster and et <= ed
        verdict = (f"{tuned.name} settled {sd if sd is not None else 'never'} -> "
                   f"{st if st is not None else 'never'} steps with {ed} -> {et} early skips: "
                   + ("sooner, with no more wobble" if held else "not sooner with less wobble"))
    return Verdict(claim, measured, held, verdict)


def scale_factor_error(device_type: str = "cpu") -> str:
    """What ``torch.amp.GradScaler(device_type, scale_factor=2.0)`` (claim B4's knob) raises,
    as ``"TypeError: ..."``; ``""`` if this torch accepted it."""
    try:
        _torch.amp.GradScaler(device_type, scale_factor=2.0)
    except TypeError as exc:
        return f"TypeError: {exc}"
    return ""


def claim_b4(default_run: ScalerRun, b4_run: ScalerRun, device_type: str = "cpu") -> Verdict:
    """Claim B4 ("increase scale_factor=2.0"): GradScaler has no such argument; read as
    ``growth_factor=2.0`` it is PyTorch's default, so ``b4_run`` (growth_factor 2.0) should
    repeat ``default_run``'s scaler behaviour step for step (same scales and skips; the losses
    may differ in the last bits where the device's kernels are not deterministic, so their
    largest difference is reported, not required to be 0). Held only when ``scale_factor`` is
    accepted or the scaler behaved differently."""
    error = scale_factor_error(device_type)
    default_growth = measured_defaults(device_type).growth_factor
    same = default_run.scales == b4_run.scales and default_run.skipped == b4_run.skipped
    n = min(len(default_run.losses), len(b4_run.losses))
    diff = max((abs(a - b) for a, b in zip(default_run.losses[:n], b4_run.losses[:n])),
               default=0.0)
    measured = (f"{error or 'scale_factor accepted'}; the default growth_factor measures "
                f"{default_growth:g}; over {n} steps the run with growth_factor=2.0 had "
                f"{'the same' if same else 'different'} scales and skipped steps as the default "
                f"run (largest loss difference {diff:.3g})")
    held = bool(not error or not same)
    no_knob = ("GradScaler has no scale_factor argument" if error else
               "this torch accepts scale_factor")
    behaved = "did exactly what it does by default" if same else "behaved differently"
    effect = (f"growth_factor=2.0 {'is' if default_growth == 2.0 else 'is not'} the default, and "
              f"the scaler {behaved}{', so the advice changes nothing' if same else ''}")
    return Verdict("if convergence wobbles, increase scale_factor=2.0", measured, held,
                   f"{no_knob}; read as growth_factor, {effect}")


def claim_b4_larger_growth(base: ScalerRun, larger: ScalerRun, tolerance: float = 0.05) -> Verdict:
    """B4 read generously ("raise growth_factor" steadies a wobbling run) on two runs of the same
    seed and data whose settings differ only in growth_factor. Held when the larger factor
    skipped fewer steps and its final loss (``final_loss``) is no more than ``tolerance``
    (relative) above the base run's."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1); got {tolerance!r}")
    gb, gl = base.settings.growth_factor, larger.settings.growth_factor
    if not gl > gb:
        raise ValueError(f"larger must have the larger growth_factor; got {gl:g} vs {gb:g}")
    sb, sl = sum(base.skipped), sum(larger.skipped)
    lb, ll = final_loss(base.losses), final_loss(larger.losses)
    held = sl < sb and ll <= lb * (1 + tolerance)
    measured = (f"growth_factor {gb:g}: {sb} skipped steps, final loss {lb:.4f}; growth_factor "
                f"{gl:g}: {sl} skipped steps, final loss {ll:.4f} ({len(base.steps)} steps, "
                f"growth_interval {base.settings.growth_interval})")
    if sl > sb:
        verdict = (f"the larger growth factor skipped more steps ({sb} -> {sl}): each growth "
                   f"overshoots further, so more steps hit an overflow")
    else:
        verdict = (f"the larger growth factor skipped {'fewer' if sl < sb else 'as many'} steps "
                   f"({sb} -> {sl}); final loss {lb:.4f} -> {ll:.4f}")
    return Verdict("raising growth_factor steadies a wobbling run", measured, held, verdict)


def step_table_text(run: ScalerRun, first: int = 20) -> str:
    """The first ``first`` steps of a run as text: the scale each step used, whether it was
    skipped (and whether an overflow was injected), and what ``update()`` then did to the scale
    (backed off, grew, or kept it)."""
    if not isinstance(first, int) or first < 1:
        raise ValueError(f"first must be an integer >= 1; got {first!r}")
    nxt = run.scales[1:] + [run.final_scale]
    lines = [f"{'step':>4}  {'scale used':>16}  {'skipped':>7}  {'loss':>8}  update() then"]
    for i in range(min(first, len(run.steps))):
        s, after = run.scales[i], nxt[i]
        if after is None or after == s:
            what = "kept the scale"
        elif after < s:
            what = f"backed off x{after / s:g} -> {_pow2(after)}"
        else:
            what = f"grew x{after / s:g} -> {_pow2(after)}"
        skip = ("yes*" if run.injected[i] else "yes") if run.skipped[i] else "no"
        lines.append(f"{run.steps[i]:>4}  {_pow2(s):>16}  {skip:>7}  {run.losses[i]:>8.4f}  {what}")
    if any(run.injected[:first]):
        lines.append("* an inf was injected into this step's gradients")
    return "\n".join(lines)


def scale_window(magnitudes_by_layer: _Mapping[str, _np.ndarray], fmt: str = "fp16",
                 exponents: _Sequence[int] = range(-8, 41)) -> dict:
    """Where a loss scale 2^k keeps these gradients in ``fmt``: ``no_flush_from`` (the smallest k
    at which no nonzero value is flushed to zero), ``no_overflow_up_to`` (the largest k with no
    overflow), and the fractions at k = 0 (no scaling). None where no k in ``exponents`` does."""
    from ..formats import scale_sweep

    rows = scale_sweep(list(magnitudes_by_layer.values()), exponents, fmt)
    no_flush = [r["k"] for r in rows if r["flushed"] == 0]
    no_over = [r["k"] for r in rows if r["overflow"] == 0]
    at_one = next((r for r in rows if r["k"] == 0), None)
    return {"no_flush_from": min(no_flush) if no_flush else None,
            "no_overflow_up_to": max(no_over) if no_over else None,
            "at_scale_1": at_one}
