"""The parts every panel is built from: the one live-figure mechanism (``LiveFigure``: a plotly
``FigureWidget`` only where anywidget is present, an ``Output`` replaced in one assignment
elsewhere), fields that take what a learner types and say why a value is refused
(``parse_number``, ``NumberField``, ``SliderField``), and the Run button's background run
(``BackgroundRun``). ``widgets.py`` builds the course's panels from these.
"""
from __future__ import annotations

import ast
import math
import operator
import threading
from typing import Any, Callable, Dict, Optional

import ipywidgets as w
import plotly.graph_objects as go
import plotly.io as pio

from amp_lessons.validate import is_real

FIGURE_MODES = ("auto", "widget", "output")
ERROR_COLOR = "#d62728"


# ---- one live-figure mechanism --------------------------------------------------------------------

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


def figure_bundle(fig: go.Figure) -> Dict[str, Any]:
    """The display bundle of ``fig`` for an ``Output`` panel: where the front end renders plotly's
    mimetype (JupyterLab, Notebook 7, VS Code: the renderer ``al.setup()`` chose names it), that
    mimetype alone, so no ``notebook_connected`` script output piles up on each redraw; elsewhere
    (Colab, Kaggle) the renderer's own bundle. Always with a short ``text/plain``."""
    renderer = str(pio.renderers.default or "")
    if "plotly_mimetype" in renderer or not renderer:
        data = dict(pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict()))
    else:
        data = dict(fig._repr_mimebundle_() or {})
    data["text/plain"] = f"<plotly figure: {fig.layout.title.text}>"
    return data


class LiveFigure:
    """A plotly figure that a panel updates while it runs.

    ``mode="widget"``: a ``go.FigureWidget``, changed inside ``batch_update`` (one redraw per
    update). ``mode="output"``: a plain ``go.Figure`` shown in an ``ipywidgets.Output`` whose
    contents are replaced in one assignment after each update (``figure_bundle``: works with
    ipywidgets 7 and plotly 5, from a background thread, and leaves exactly one output).
    ``widget`` is what a panel puts in its layout; ``figure`` the data; ``redraws`` counts updates.
    """

    def __init__(self, figure: go.Figure, mode: str = "auto", css_class: str = ""):
        self.mode = resolve_figure_mode(mode)
        self.redraws = 0
        if self.mode == "widget":
            self.figure = go.FigureWidget(figure)
            self.widget = self.figure
        else:
            self.figure = go.Figure(figure)
            self.widget = w.Output(layout=w.Layout(width="100%"))
            self._draw()
        if css_class:
            self.widget.add_class(css_class)

    @property
    def live(self) -> bool:
        """True for a FigureWidget updated in place."""
        return self.mode == "widget"

    def update(self, change: Callable[[go.Figure], None]) -> None:
        """Apply ``change(figure)`` and show the result."""
        if self.mode == "widget":
            with self.figure.batch_update():
                change(self.figure)
        else:
            change(self.figure)
            self._draw()

    def _draw(self) -> None:
        self.widget.outputs = ({"output_type": "display_data", "data": figure_bundle(self.figure),
                                "metadata": {}},)
        self.redraws += 1


def set_class(widget, css_class: str):
    widget.add_class(css_class)
    return widget


def error_html(text: str) -> str:
    return f"<span style='color:{ERROR_COLOR}'>{escape_html(text)}</span>"


def escape_html(text: str) -> str:
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def scroll_box(html_text: str) -> str:
    """``html_text`` in a box that scrolls sideways in a narrow window instead of clipping."""
    return (f"<div class='amp-scroll' style='overflow-x:auto;max-width:100%;white-space:nowrap'>"
            f"{html_text}</div>")


WRAP = dict(flex_flow="row wrap", align_items="center", width="100%")
DESCRIPTION_STYLE = {"description_width": "initial"}


# ---- reading numbers as learners type them -------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_EXPRESSION_DEPTH = 32
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow}
_NAMES = {"inf": math.inf, "nan": math.nan, "infinity": math.inf}


def parse_number(text: str) -> float:
    """Read a number as a learner types it: ``0.1``, ``-1e-8``, ``65504``, ``2**-24``, ``2^-24``,
    ``1/3``, ``inf``, ``nan``. A finite input whose value is beyond float64 (``1e400``,
    ``1e308*10``) is refused, not turned into inf. Only numbers, + - * / ** (or ^) and parentheses are allowed, at
    most ``MAX_EXPRESSION_CHARS`` characters nested at most ``MAX_EXPRESSION_DEPTH`` deep;
    anything else raises ``ValueError``."""
    source = str(text).strip().lower().replace("^", "**")
    hint = "value must be a number such as 0.1, -1e-8, 65504 or 2**-24"
    if len(source) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"{hint}, at most {MAX_EXPRESSION_CHARS} characters; got "
                         f"{len(source)} characters")

    def ev(node, depth):
        if depth > MAX_EXPRESSION_DEPTH:
            raise ValueError(f"nested deeper than {MAX_EXPRESSION_DEPTH} levels")
        if isinstance(node, ast.Expression):
            return ev(node.body, depth + 1)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            value = float(node.value)  # OverflowError for a too long integer literal
            if math.isinf(value):
                raise OverflowError(f"{source[:20]} is beyond float64's largest value, about "
                                    f"1.8e308 (type inf for infinity)")
            return value
        if isinstance(node, ast.Name) and node.id in _NAMES:
            return _NAMES[node.id]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left, depth + 1), ev(node.right, depth + 1)
            if isinstance(node.op, ast.Pow) and abs(right) > 4096:
                raise ValueError("exponent too large")
            try:
                value = float(_BINARY[type(node.op)](left, right))
            except OverflowError:
                value = math.inf
            if math.isinf(value) and math.isfinite(left) and math.isfinite(right):
                raise OverflowError("the result is beyond float64's largest value, about 1.8e308 "
                                    "(type inf for infinity)")
            return value
        raise ValueError("unsupported expression")

    try:
        return ev(ast.parse(source, mode="eval"), 0)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError,
            RecursionError, MemoryError) as exc:
        raise ValueError(f"{hint}; got {str(text)[:40]!r}{'...' if len(str(text)) > 40 else ''} "
                         f"({type(exc).__name__}: {exc})") from None


class NumberField:
    """A text field for one setting that accepts what a learner types (``2.5``, ``1e3``,
    ``2**10``) and says next to the field why a value is refused (not a number, not whole, out
    of ``[low, high]``); a refused value is never clamped or dropped.

    ``text`` (the ``ipywidgets.Text``), ``message`` (the HTML beside it) and ``widget`` (both,
    in a wrapping box) are the parts; ``value`` is the accepted number (ValueError naming the
    setting and its range otherwise); ``valid`` says whether the text is accepted now.
    """

    def __init__(self, name: str, value, low: Optional[float] = None,
                 high: Optional[float] = None, integer: bool = False,
                 description: Optional[str] = None, css_class: str = "", width: str = "220px"):
        self.name, self.low, self.high, self.integer = name, low, high, integer
        for bound, v in (("low", low), ("high", high)):
            if v is not None and not is_real(v):
                raise ValueError(f"{name}: {bound} must be None or a finite number; got {v!r}")
        if low is not None and high is not None and low > high:
            raise ValueError(f"{name}: low must be <= high; got low={low!r}, high={high!r}")
        value = self.check(value)  # a panel never starts from a value its field would refuse
        self.text = w.Text(value=self._show(value),
                           description=name if description is None else description,
                           continuous_update=True, style=DESCRIPTION_STYLE,
                           layout=w.Layout(width=width, min_width="120px"))
        self.message = w.HTML(layout=w.Layout(min_width="0"))
        self.widget = w.HBox([self.text, self.message], layout=w.Layout(**WRAP))
        if css_class:
            self.text.add_class(css_class)
            self.message.add_class(f"{css_class}-message")
        self.text.observe(self._check, names="value")
        self._check()

    def _show(self, value) -> str:
        if self.integer and float(value) == int(value):
            return str(int(value))
        return f"{float(value):g}"

    def _range(self) -> str:
        kind = "a whole number" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            return f"{kind} in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{kind} >= {self.low:g}"
        if self.high is not None:
            return f"{kind} <= {self.high:g}"
        return kind

    def check(self, value):
        """``value`` (a number, or text as typed) as this field's number; ValueError naming the
        setting and its range when the field would refuse it."""
        if isinstance(value, str):
            return self.parse(value)
        if not is_real(value) or (self.integer and value != int(value)) \
                or (self.low is not None and value < self.low) \
                or (self.high is not None and value > self.high):
            raise ValueError(f"{self.name} must be {self._range()}; got {value!r}")
        return int(value) if self.integer else float(value)

    def parse(self, text: str):
        """``text`` as this field's number; ValueError naming the setting and its range."""
        try:
            v = parse_number(text)
        except ValueError:
            raise ValueError(f"{self.name} must be {self._range()}; got {str(text)[:40]!r}") \
                from None
        if not math.isfinite(v) or (self.integer and v != int(v)) \
                or (self.low is not None and v < self.low) \
                or (self.high is not None and v > self.high):
            raise ValueError(f"{self.name} must be {self._range()}; got {str(text)[:40]!r}")
        return int(v) if self.integer else v

    @property
    def value(self):
        """The accepted number (ValueError when the text is refused)."""
        return self.parse(self.text.value)

    @value.setter
    def value(self, v) -> None:
        self.text.value = self._show(v)

    @property
    def valid(self) -> bool:
        """True when the text is accepted."""
        try:
            self.value
        except ValueError:
            return False
        return True

    def _check(self, change=None) -> None:
        try:
            self.value
        except ValueError as exc:
            self.message.value = error_html(str(exc))
        else:
            self.message.value = ""


class SliderField:
    """A slider with a ``NumberField`` beside it in place of its readout: drag, or type a value
    (checked, refused with a message, never clamped). They stay in step; a ``start`` value
    outside the slider's range is refused when the panel is built. ``value`` is the
    slider's value; ``slider``, ``field`` and ``widget`` are the parts; the css class goes on
    the slider (and ``<class>-field`` on the text)."""

    def __init__(self, slider: w.Widget, name: str, integer: bool = False, css_class: str = "",
                 start=None):
        slider.readout = False
        slider.layout = w.Layout(width="auto", flex="1 1 200px", min_width="140px")
        slider.style = DESCRIPTION_STYLE
        self.slider = slider
        # ``start`` is checked against the slider's range before the slider sees it (a slider
        # would clamp it without a word): ValueError naming the setting and the range
        self.field = NumberField(name, slider.value if start is None else start, slider.min,
                                 slider.max, integer, description="",
                                 css_class=f"{css_class}-field" if css_class else "", width="110px")
        if start is not None:
            slider.value = self.field.value
        self._syncing = False
        slider.observe(self._from_slider, names="value")
        self.field.text.observe(self._from_field, names="value")
        if css_class:
            slider.add_class(css_class)
        self.widget = w.HBox([slider, self.field.widget],
                             layout=w.Layout(flex_flow="row wrap", align_items="center",
                                             width="100%", max_width="560px"))

    @property
    def value(self):
        """The slider's value."""
        return self.slider.value

    @value.setter
    def value(self, v) -> None:
        self.slider.value = v

    def _from_slider(self, change) -> None:
        if self._syncing:
            return
        self._syncing = True
        try:
            self.field.value = change["new"]
        finally:
            self._syncing = False

    def _from_field(self, change) -> None:
        if self._syncing or not self.field.valid:
            return
        self._syncing = True
        try:
            self.slider.value = self.field.value
        finally:
            self._syncing = False


# ---- the Run button ------------------------------------------------------------------------------

class BackgroundRun:
    """The Run button of a panel: ``run()`` in a thread when ``background``, else inline.

    A panel sets ``background``, ``_running``, ``_thread`` and ``run_button``, and names the HTML
    widget that shows a failure in ``_status_html()``. Whatever the mode, a failed run shows its
    message there and leaves the panel usable (button enabled, not running).
    """

    def start(self):
        """What the Run button does: ``run()`` in a thread when ``background``, else inline."""
        if self._running:
            return None
        if not self.background:
            return self._run_reporting_errors()
        self._running = True  # before the thread starts, so a second click is ignored
        self.run_button.disabled = True
        self._thread = threading.Thread(target=self._run_reporting_errors, daemon=True)
        self._thread.start()
        return self._thread

    def _join(self, timeout: Optional[float]) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _failed(self, exc: BaseException) -> None:
        self._running = False
        self.run_button.disabled = False
        text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        self._status_html().value = error_html(f"Run failed: {text}")

    def _run_reporting_errors(self):
        try:
            return self.run()
        except Exception:  # noqa: BLE001 - run() has shown the message; a click has no caller
            return None
