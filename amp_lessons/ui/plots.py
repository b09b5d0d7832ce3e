"""Plotly figure builders: pure functions from data to a ``go.Figure``.

Every figure has a title, axis titles with units, and a legend where there is more than one
trace; ``widgets.py`` wraps these in live panels. Each function names the lesson that uses it.
Shares shown in titles come from ``tables.percent``: a nonzero count never reads as 0%.
"""
from __future__ import annotations

import html
import math
import textwrap
from typing import Mapping, Optional, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from amp_lessons.numerics import formats
from amp_lessons.validate import check_int, is_int
from amp_lessons.numerics.formats import lost_shares  # noqa: F401 (re-exported: figures and panels use it)
from amp_lessons.tables import percent, plural, pow2_text  # noqa: F401 (re-exported)

TEMPLATE = "plotly_white"


def styled(fig: go.Figure, title: str, x_title: str, y_title: str, height: int = 420) -> go.Figure:
    """Apply the course's layout: title, axis titles (with units), template and size."""
    if not title or not x_title or not y_title:
        raise ValueError("every chart needs a title and both axis titles")
    fig.update_layout(title=dict(text=title, x=0.01), template=TEMPLATE, height=height,
                      margin=dict(l=70, r=30, t=70, b=60),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1))
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return fig


# where plotly draws a text label beside its point
_TEXT_POSITIONS = ("top center", "bottom center", "top right", "bottom right", "top left",
                   "bottom left", "middle right", "middle left")
# farther places, joined to the point by a line: (dx, dy) pixels from it to the label's centre
_LEADER_OFFSETS = tuple((round(r * math.cos(a)), round(r * math.sin(a)))
                        for r in (34, 56, 80) for a in np.linspace(0, 2 * math.pi, 12,
                                                                   endpoint=False))


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Each value's trailing mean over ``window`` steps (fewer at the start), of the finite values
    only; a non-finite or missing value is a gap (NaN) at its own step and nowhere else (a
    convolution or running sum carried one NaN into every later point of the curve)."""
    check_int("window", window, 1)
    v = np.asarray([x if x is not None else math.nan for x in values], dtype=np.float64)
    ok = np.isfinite(v)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, v, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    i = np.arange(len(v))
    lo = np.maximum(0, i - window + 1)
    n = counts[i + 1] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (sums[i + 1] - sums[lo]) / n
    return np.where(ok & (n > 0), mean, np.nan)


def label_positions(x: Sequence[float], y: Sequence[float], labels: Sequence[str],
                    x_range: Sequence[float], y_range: Sequence[float], width: int = 900,
                    height: int = 420, font_px: float = 10.0,
                    margin: Sequence[int] = (70, 30, 70, 60)) -> list:
    """Where to write each point's label so that labels overlap neither each other nor the
    points, as far as that can be done: a plotly ``textposition`` beside the point (a string),
    or, where every place beside it is taken, an offset ``(dx, dy)`` in pixels (up is +dy) to a
    label joined to the point by a line. Points are placed from the top of the chart down, each
    in the first free place (beside it first, then farther out), else the one that overlaps
    least. Boxes are estimated: ``font_px`` high, 0.6 ``font_px`` a character wide, in a
    ``width`` x ``height`` figure with ``margin`` = (left, right, top, bottom) pixels around the
    axes' ``x_range`` and ``y_range``. Fixed places chosen for one run's numbers collide in the
    next (lesson 05's cluster of checkpointed runs did)."""
    n = len(x)
    if not (len(y) == len(labels) == n):
        raise ValueError(f"x, y and labels must have the same length; got {n}, {len(y)}, "
                         f"{len(labels)}")
    if not (x_range[1] > x_range[0] and y_range[1] > y_range[0]):
        raise ValueError(f"x_range and y_range must be (low, high) with high > low; got "
                         f"{tuple(x_range)}, {tuple(y_range)}")
    left, right, top, bottom = margin
    plot_w, plot_h = max(width - left - right, 1), max(height - top - bottom, 1)
    points = [((x[i] - x_range[0]) / (x_range[1] - x_range[0]) * plot_w,
               (y[i] - y_range[0]) / (y_range[1] - y_range[0]) * plot_h) for i in range(n)]

    def box(i, place):
        (cx, cy), h, gap = points[i], 1.2 * font_px, 6.0
        w = 0.6 * font_px * len(str(labels[i]))
        if not isinstance(place, str):  # a label's centre at an offset
            return cx + place[0] - w / 2, cy + place[1] - h / 2, cx + place[0] + w / 2, \
                cy + place[1] + h / 2
        vertical, horizontal = place.split()
        x0 = {"center": cx - w / 2, "right": cx + gap, "left": cx - gap - w}[horizontal]
        y0 = {"top": cy + gap, "bottom": cy - gap - h, "middle": cy - h / 2}[vertical]
        return x0, y0, x0 + w, y0 + h

    def overlap(a, b):
        return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3])
                                                                   - max(a[1], b[1]))

    def outside(b):  # the part of a box beyond the plot area
        kept = (max(0.0, min(b[2], plot_w) - max(b[0], 0))
                * max(0.0, min(b[3], plot_h) - max(b[1], 0)))
        return (b[2] - b[0]) * (b[3] - b[1]) - kept

    markers = [(cx - 7, cy - 7, cx + 7, cy + 7) for cx, cy in points]
    placed, out = [], [None] * n
    for i in sorted(range(n), key=lambda k: (-y[k], x[k])):
        best = None
        for place in _TEXT_POSITIONS + _LEADER_OFFSETS:
            b = box(i, place)
            cost = (sum(overlap(b, p) for p in placed) + outside(b)
                    + sum(overlap(b, m) for j, m in enumerate(markers) if j != i))
            if best is None or cost < best[0]:
                best = (cost, place, b)
            if cost == 0:
                break
        out[i] = best[1]
        placed.append(best[2])
    return out


def with_caveat(fig: go.Figure, caveat: str, width: int = 110) -> go.Figure:
    """``fig`` with ``caveat`` (what its numbers cannot show, in words) in a box below the plot,
    wrapped at ``width`` characters, so a saved image carries it too; ``""`` adds nothing."""
    if not caveat:
        return fig
    lines = textwrap.wrap(str(caveat), width) or [""]
    fig.add_annotation(text="<br>".join(html.escape(line) for line in lines), xref="paper",
                       yref="paper", x=0, y=0, yshift=-60, xanchor="left", yanchor="top",
                       align="left", showarrow=False, bordercolor="#b22222", borderwidth=1,
                       borderpad=4, bgcolor="#fff5f5", font=dict(size=12, color="#7a1212"))
    bottom = fig.layout.margin.b if fig.layout.margin.b is not None else 60
    fig.update_layout(margin=dict(b=bottom + 24 + 16 * len(lines)),
                      height=(fig.layout.height or 420) + 24 + 16 * len(lines))
    return fig


# ---------------------------------------------------------------------------------------------
# Lesson 03: loss-scale dynamics (scale per step with skipped steps marked, loss, presets)
# ---------------------------------------------------------------------------------------------
SKIPPED_COLOR = "#d62728"
SCALE_AXIS_TITLE = "loss scale (log2 axis: 2<sup>k</sup>)"
STEP_AXIS_TITLE = "optimizer step (count)"
LOSS_AXIS_TITLE = "training loss (cross-entropy, nats)"


def _log2(values: Sequence[float]) -> list:
    return [math.log2(v) if v and v > 0 and math.isfinite(v) else None for v in values]


def change_points(xs: Sequence, ys: Sequence) -> tuple:
    """``(xs, ys)`` kept only where ``ys`` changes, plus the first and last point: the same line
    when drawn with ``shape="hv"`` (a step function), in far fewer points."""
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys must have the same length; got {len(xs)} and {len(ys)}")
    keep = [i for i in range(len(ys)) if i in (0, len(ys) - 1) or ys[i] != ys[i - 1]]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def _skipped_points(steps, scales, skipped):
    pts = [(s, math.log2(v), v) for s, v, k in zip(steps, scales, skipped)
           if k and v and v > 0 and math.isfinite(v)]
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


MAX_SCALE_TICKS = 8


def set_scale_ticks(fig: go.Figure, scales: Sequence[float], row: int = 1) -> go.Figure:
    """Lesson 03: integer-power-of-two ticks (``2^k``) on a scale axis that plots log2 values.

    The tick step (a power of two) grows with the range so that at most ``MAX_SCALE_TICKS``
    labels show, however far the scale fell (an overflow on every step takes it from 2^24 to
    2^-149 and then to 0); widgets call this after each live update as the range changes.
    """
    logs = [v for v in _log2(scales) if v is not None]
    set_log2_ticks(fig, (min(logs), max(logs)) if logs else (0.0, 0.0), row)
    return fig


def set_log2_ticks(fig: go.Figure, log2_range: tuple, row: int = 1) -> go.Figure:
    """Ticks ``2^k`` on the scale axis of ``row`` for log2 values spanning ``log2_range``."""
    span = max(log2_range[1] - log2_range[0], 0.0)
    dtick = 1
    while span / dtick > MAX_SCALE_TICKS:
        dtick *= 2
    fig.update_yaxes(tickmode="linear", tick0=0, dtick=dtick, tickprefix="2<sup>",
                     ticksuffix="</sup>", row=row, col=1)
    return fig


def scale_and_loss(steps: Sequence[int], scales: Sequence[float], skipped: Sequence[bool],
                   losses: Sequence[float],
                   title: str = "Loss scale and loss per step") -> go.Figure:
    """Lesson 03: the loss scale per step (top, log2 axis) with skipped steps marked, and the loss.

    Traces, in this order (widgets update them in place): ``loss scale`` (the scale the step used),
    ``skipped step`` (red crosses at the scale of each skipped step) and ``loss``.
    Raises ``ValueError`` when the four sequences differ in length.
    """
    n = len(steps)
    if not (len(scales) == len(skipped) == len(losses) == n):
        raise ValueError("steps, scales, skipped and losses must have the same length; got "
                         f"{n}, {len(scales)}, {len(skipped)}, {len(losses)}")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        row_heights=[0.6, 0.4])
    fig.add_trace(go.Scatter(x=list(steps), y=_log2(scales), customdata=list(scales),
                             mode="lines", name="loss scale", line=dict(shape="hv"),
                             hovertemplate="step %{x}<br>scale %{customdata:.6g}<extra></extra>"),
                  row=1, col=1)
    sx, sy, sv = _skipped_points(steps, scales, skipped)
    fig.add_trace(go.Scatter(x=sx, y=sy, customdata=sv, mode="markers", name="skipped step",
                             marker=dict(symbol="x", size=9, color=SKIPPED_COLOR),
                             hovertemplate="step %{x} skipped<br>scale %{customdata:.6g}"
                                           "<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=list(steps), y=list(losses), mode="lines", name="loss",
                             line=dict(color="#2ca02c"),
                             hovertemplate="step %{x}<br>loss %{y:.4f}<extra></extra>"),
                  row=2, col=1)
    styled(fig, title, STEP_AXIS_TITLE, SCALE_AXIS_TITLE, height=480)
    fig.update_xaxes(title_text=None, row=1, col=1)
    fig.update_yaxes(title_text=LOSS_AXIS_TITLE, row=2, col=1)
    return set_scale_ticks(fig, scales)


def update_scale_and_loss(fig, steps, scales, skipped, losses) -> None:
    """Lesson 03: put new data into a figure made by ``scale_and_loss`` (a FigureWidget or not),
    replacing what it showed. Call it inside ``FigureWidget.batch_update()`` so the browser
    redraws once."""
    sx, sy, sv = _skipped_points(steps, scales, skipped)
    fig.data[0].update(x=list(steps), y=_log2(scales), customdata=list(scales))
    fig.data[1].update(x=sx, y=sy, customdata=sv)
    fig.data[2].update(x=list(steps), y=list(losses))
    set_scale_ticks(fig, scales)


class ScaleSeries:
    """The points a live ``scale_and_loss`` figure shows, kept on the Python side so a panel
    appends each new step once (linear cost) and hands the figure whole columns only when it
    redraws, however long the run. ``extend`` adds steps; ``apply(fig)`` puts them in ``fig``."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Forget every point."""
        self.steps, self.log2, self.scales, self.losses = [], [], [], []
        self.skip_x, self.skip_y, self.skip_v = [], [], []
        self.low = self.high = None

    def __len__(self) -> int:
        return len(self.steps)

    def extend(self, steps, scales, skipped, losses) -> None:
        """Append steps (equal-length sequences); raises ValueError when they differ in length."""
        if not (len(steps) == len(scales) == len(skipped) == len(losses)):
            raise ValueError("steps, scales, skipped and losses must have the same length")
        logs = _log2(scales)
        self.steps += list(steps)
        self.scales += list(scales)
        self.log2 += logs
        self.losses += list(losses)
        sx, sy, sv = _skipped_points(steps, scales, skipped)
        self.skip_x += sx
        self.skip_y += sy
        self.skip_v += sv
        finite = [v for v in logs if v is not None]
        if finite:
            lo, hi = min(finite), max(finite)
            self.low = lo if self.low is None else min(self.low, lo)
            self.high = hi if self.high is None else max(self.high, hi)

    def apply(self, fig) -> None:
        """Show every point so far in ``fig`` (a ``scale_and_loss`` figure or FigureWidget);
        call it inside ``FigureWidget.batch_update()``."""
        fig.data[0].update(x=self.steps, y=self.log2, customdata=self.scales)
        fig.data[1].update(x=self.skip_x, y=self.skip_y, customdata=self.skip_v)
        fig.data[2].update(x=self.steps, y=self.losses)
        span = (self.low, self.high) if self.low is not None else (0.0, 0.0)
        set_log2_ticks(fig, span)


_PRESET_COLORS = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def preset_comparison(runs: Mapping[str, Mapping[str, Sequence]],
                      title: str = "GradScaler presets on the same run") -> go.Figure:
    """Lesson 03: several scaler settings trained on the same seed and data, plotted together.

    ``runs`` maps a preset's name to columns ``steps``, ``scales``, ``skipped``, ``losses``
    (``ScalerRun.columns()`` gives these). Top: the scale per step (log2 axis), skipped steps
    marked with crosses in the preset's colour; bottom: the loss per step. One legend entry per
    preset. Raises ``ValueError`` for no runs or columns of different lengths.
    """
    if not runs:
        raise ValueError("runs must name at least one preset")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        row_heights=[0.6, 0.4])
    all_scales = []
    for i, (name, cols) in enumerate(runs.items()):
        steps, scales, skipped, losses = (list(cols[k])
                                          for k in ("steps", "scales", "skipped", "losses"))
        if not (len(steps) == len(scales) == len(skipped) == len(losses)):
            raise ValueError(f"columns of preset {name!r} differ in length")
        color = _PRESET_COLORS[i % len(_PRESET_COLORS)]
        all_scales += scales
        # the scale is a step function: its change points, drawn "hv", are the same line in a
        # fraction of the stored data (a 1500-step preset keeps a few dozen points)
        cx, cs = change_points(steps, scales)
        fig.add_trace(go.Scatter(x=cx, y=_log2(cs), customdata=cs, mode="lines",
                                 name=name, legendgroup=name, line=dict(color=color, shape="hv"),
                                 hovertemplate=f"{name}<br>from step %{{x}}<br>scale "
                                               "%{customdata:.6g}<extra></extra>"), row=1, col=1)
        sx, sy, sv = _skipped_points(steps, scales, skipped)
        fig.add_trace(go.Scatter(x=sx, y=sy, customdata=sv, mode="markers",
                                 name=f"{name}: skipped", legendgroup=name, showlegend=False,
                                 marker=dict(symbol="x", size=8, color=color),
                                 hovertemplate=f"{name}<br>step %{{x}} skipped<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=losses, mode="lines", name=f"{name}: loss",
                                 legendgroup=name, showlegend=False,
                                 line=dict(color=color, width=1.5),
                                 hovertemplate=f"{name}<br>step %{{x}}<br>loss %{{y:.4f}}"
                                               "<extra></extra>"), row=2, col=1)
    styled(fig, title, STEP_AXIS_TITLE, SCALE_AXIS_TITLE, height=520)
    # one entry per preset: on the right, where long names and many presets fit
    fig.update_layout(legend=dict(orientation="v", x=1.02, xanchor="left", y=1, yanchor="top",
                                  title_text="preset (× = skipped step)"),
                      margin=dict(r=20))
    fig.update_xaxes(title_text=None, row=1, col=1)
    fig.update_yaxes(title_text=LOSS_AXIS_TITLE, row=2, col=1)
    return set_scale_ticks(fig, all_scales)


# ---------------------------------------------------------------------------------------------
# Lesson 01: number formats (ranges on a number line, gradient magnitudes against fp16's bands,
# swamping, loss-scale sweep, bit layouts)
# ---------------------------------------------------------------------------------------------
BAND_COLORS = {"flushed": "#d62728", "subnormal": "#ff7f0e", "normal": "#2ca02c",
               "overflow": "#7f0000"}
BIT_COLORS = {"sign": "#d62728", "exponent": "#1f77b4", "mantissa": "#2ca02c"}
MAGNITUDE_AXIS_TITLE = "magnitude |x| (log scale, dimensionless)"
GRADIENT_AXIS_TITLE = "|gradient| × loss scale (log2 axis: bin k holds 2<sup>k</sup> to 2<sup>k+1</sup>)"
GRADIENT_COUNT_TITLE = "gradient values per bin (count)"


def format_ranges(names: Optional[Sequence[str]] = None,
                  title: str = "What each format can hold: subnormal and normal ranges") -> go.Figure:
    """Lesson 01: a number line of each format's bands on a log axis.

    One row per format: its subnormal range (smallest subnormal to smallest normal) and its normal
    range (smallest normal to max). Traces: ``subnormal range``, ``normal range``, ``limits``
    (markers with the exact values on hover). Unknown names raise ``ValueError``.
    """
    infos = [formats.get_format(n) for n in (names or formats.FORMAT_NAMES)]
    sub_x, sub_y, norm_x, norm_y = [], [], [], []
    lim_x, lim_y, lim_text = [], [], []
    for f in infos:
        sub_x += [f.smallest_subnormal, f.smallest_normal, None]
        sub_y += [f.name, f.name, None]
        norm_x += [f.smallest_normal, f.max, None]
        norm_y += [f.name, f.name, None]
        for label, v in (("smallest subnormal", f.smallest_subnormal),
                         ("smallest normal", f.smallest_normal), ("max", f.max)):
            lim_x.append(v)
            lim_y.append(f.name)
            lim_text.append(f"{f.name} {label}: {v:.6g}")
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=sub_x, y=sub_y, mode="lines", name="subnormal range",
                             line=dict(color=BAND_COLORS["subnormal"], width=14),
                             hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=norm_x, y=norm_y, mode="lines", name="normal range",
                             line=dict(color=BAND_COLORS["normal"], width=14), hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=lim_x, y=lim_y, mode="markers", name="limits",
                             marker=dict(symbol="line-ns-open", size=22, color="black"),
                             text=lim_text, hovertemplate="%{text}<extra></extra>"))
    for f in infos:
        fig.add_annotation(x=math.log10(f.max), y=f.name, text=f" max {f.max:.0f}" if f.max < 1e6 else f" max {f.max:.4g}",
                           xanchor="left", showarrow=False, font=dict(size=11))
    styled(fig, title, MAGNITUDE_AXIS_TITLE, "format", height=120 + 55 * len(infos))
    fig.update_xaxes(type="log", exponentformat="power", dtick=10)
    fig.update_yaxes(autorange="reversed")
    return fig


def _scale_label(scale: float) -> str:
    m, e = math.frexp(scale)
    return f"2^{e - 1}" if m == 0.5 else f"{scale:g}"


def _log2_bins(values, scale: float):
    """Nonzero finite magnitudes of ``values`` times ``scale`` as integer log2 bins, and the zeros."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().float().cpu().numpy()
    a = np.abs(np.asarray(values, dtype=np.float64).reshape(-1)) * scale
    finite = np.isfinite(a)
    zeros = int(np.sum(finite & (a == 0)))
    a = a[finite & (a > 0)]
    return np.floor(np.log2(a)).astype(np.int64), zeros


def gradient_histogram_range(magnitudes_by_layer, scales: Sequence[float] = (1.0,),
                             fmt: str = "fp16") -> tuple:
    """Lesson 01/03: an x range (log2 units) that shows the data at every scale in ``scales`` and
    the format's bands; widgets fix it so the bars move, not the axis."""
    limits = formats.band_limits(fmt)
    lo = math.log2(limits["flushed_max"]) - 3
    hi = math.log2(limits["overflow_from"]) + 3
    for s in scales:
        for values in magnitudes_by_layer.values():
            bins, _ = _log2_bins(values, float(s))
            if bins.size:
                lo, hi = min(lo, int(bins.min())), max(hi, int(bins.max()) + 1)
    return (float(math.floor(lo)), float(math.ceil(hi)))


def _histogram_data(magnitudes_by_layer, scale, x_range):
    lo, hi = int(math.floor(x_range[0])), int(math.ceil(x_range[1]))
    edges = np.arange(lo, hi + 1)
    out = {}
    for name, values in magnitudes_by_layer.items():
        bins, zeros = _log2_bins(values, scale)
        bins = np.clip(bins, lo, hi - 1)  # out-of-range values land in the end bins
        counts = np.bincount(bins - lo, minlength=hi - lo)[: hi - lo]
        out[name] = (edges[:-1] + 0.5, counts, zeros)
    return out


def _histogram_title(magnitudes_by_layer, scale, fmt) -> str:
    pct = lost_shares(magnitudes_by_layer, scale, fmt)
    return (f"|gradient| × {_scale_label(scale)} in {formats.get_format(fmt).name}: "
            f"{pct['flushed']} flushed to zero, {pct['subnormal']} subnormal, "
            f"{pct['overflow']} overflow")


def gradient_histogram(magnitudes_by_layer: Mapping[str, object], scale: float = 1.0,
                       fmt: str = "fp16", x_range: Optional[tuple] = None,
                       title: Optional[str] = None, log_y: bool = False) -> go.Figure:
    """Lesson 01 (and lesson 03's widget): gradient magnitudes in log2 bins, one stacked bar
    trace per layer, over the format's shaded bands: flushed to zero, subnormal, normal,
    overflow.

    ``magnitudes_by_layer`` maps a layer name to its gradient values (numpy array or tensor; signs
    are ignored). ``scale`` multiplies every value (a loss scale). ``x_range`` (log2 units) fixes
    the axis, e.g. ``gradient_histogram_range(...)`` for a widget; values outside it are counted
    in the end bins. Exact zeros cannot sit on a log axis and are counted in the legend instead.
    ``log_y`` puts the counts on a log axis so the few values in the tails show (stack tops
    stay the totals). The title gives the exact fractions (``formats.scaled_fractions``).
    Raises ``ValueError`` for an empty mapping, a bad scale or an unknown format.
    """
    if not magnitudes_by_layer:
        raise ValueError("magnitudes_by_layer must name at least one layer")
    scale = formats.check_scale(scale)
    info = formats.get_format(fmt)
    if x_range is None:
        x_range = gradient_histogram_range(magnitudes_by_layer, (scale,), info.name)
    data = _histogram_data(magnitudes_by_layer, scale, x_range)
    fig = go.Figure()
    for name, (centers, counts, zeros) in data.items():
        fig.add_trace(go.Bar(x=centers, y=counts, width=1.0, name=f"{name} ({zeros} exact zeros)",
                             customdata=centers - 0.5,
                             hovertemplate=f"{name}<br>2^%{{customdata}} ≤ |g|×scale < "
                                           f"2^(%{{customdata}}+1)<br>%{{y}} values<extra></extra>"))
    limits = formats.band_limits(info)
    lg = math.log2
    bands = [("flushed", x_range[0], lg(limits["flushed_max"])),
             ("subnormal", lg(limits["flushed_max"]), lg(limits["smallest_normal"])),
             ("normal", lg(limits["smallest_normal"]), lg(limits["overflow_from"])),
             ("overflow", lg(limits["overflow_from"]), x_range[1])]
    labels = {"flushed": "flushed to zero", "subnormal": "subnormal", "normal": "normal",
              "overflow": "overflow (inf)" if info.has_inf else "overflow (NaN)"}
    for band, x0, x1 in bands:
        if x1 <= x0:
            continue
        fig.add_vrect(x0=x0, x1=x1, fillcolor=BAND_COLORS[band], opacity=0.12, layer="below",
                      line_width=0, name=band)
        fig.add_annotation(x=(x0 + x1) / 2, y=1.0, xref="x", yref="paper", yanchor="bottom",
                           text=f"{info.name} {labels[band]}", showarrow=False,
                           font=dict(size=10, color=BAND_COLORS[band]))
    styled(fig, title or _histogram_title(magnitudes_by_layer, scale, info.name),
           GRADIENT_AXIS_TITLE, GRADIENT_COUNT_TITLE, height=460)
    fig.update_layout(barmode="stack", bargap=0, margin=dict(t=110),
                      legend=dict(y=-0.25, yanchor="top", x=0, xanchor="left"))
    fig.update_xaxes(range=list(x_range), tickmode="linear", tick0=0, dtick=4,
                     tickprefix="2<sup>", ticksuffix="</sup>")
    if log_y:
        fig.update_yaxes(type="log", title_text=GRADIENT_COUNT_TITLE.replace("(count)",
                                                                              "(count, log scale)"))
    return fig


def update_gradient_histogram(fig, magnitudes_by_layer: Mapping[str, object],
                              scale: float = 1.0, fmt: str = "fp16") -> None:
    """Lesson 01/03: move a ``gradient_histogram`` figure (FigureWidget or not) to a new scale in
    place: new bar heights and title, the same axis range and bands. Call it inside
    ``FigureWidget.batch_update()`` so the browser redraws once."""
    scale = formats.check_scale(scale)
    x_range = tuple(fig.layout.xaxis.range)
    data = _histogram_data(magnitudes_by_layer, scale, x_range)
    if len(data) != len(fig.data):
        raise ValueError(f"figure has {len(fig.data)} layer traces; got {plural(len(data), 'layer')}")
    for trace, (name, (centers, counts, zeros)) in zip(fig.data, data.items()):
        trace.update(x=centers, y=counts, customdata=centers - 0.5,
                     name=f"{name} ({zeros} exact zeros)")
    fig.layout.title.text = _histogram_title(magnitudes_by_layer, scale, fmt)


def scale_sweep_figure(rows: Sequence[Mapping], fmt: str = "fp16",
                       marks: Optional[Mapping[str, int]] = None,
                       title: Optional[str] = None) -> go.Figure:
    """Lesson 01: what a loss scale 2^k does to gradients in a format, from ``formats.scale_sweep``
    rows: the percent of nonzero values that underflow (flushed + subnormal), that are flushed,
    and that overflow, against k. ``marks`` draws labelled vertical lines at chosen k."""
    if not rows:
        raise ValueError("rows must hold at least one scale_sweep row")
    ks = [r["k"] for r in rows]
    fig = go.Figure()
    for key, label, color in (("underflow", "underflow (flushed + subnormal)", BAND_COLORS["subnormal"]),
                              ("flushed", "flushed to zero", BAND_COLORS["flushed"]),
                              ("overflow", "overflow", BAND_COLORS["overflow"])):
        fig.add_trace(go.Scatter(x=ks, y=[100 * r[key] for r in rows], mode="lines+markers",
                                 name=label, line=dict(color=color),
                                 hovertemplate=f"scale 2^%{{x}}<br>{label}: %{{y:.3g}}%<extra></extra>"))
    for i, (label, k) in enumerate((marks or {}).items()):
        fig.add_vline(x=k, line=dict(color="gray", dash="dash"))
        # labels stacked downwards so that marks a step apart stay readable
        fig.add_annotation(x=k, y=0.97 - 0.09 * i, xref="x", yref="paper", text=f" {label}",
                           xanchor="left", showarrow=False, bgcolor="rgba(255,255,255,0.8)",
                           font=dict(size=11))
    styled(fig, title or f"Loss scale 2^k against {fmt}: values lost at each end",
           "loss scale (2<sup>k</sup>, k on the axis)", "nonzero gradient values (%)")
    fig.update_layout(legend=dict(y=-0.22, yanchor="top", x=0, xanchor="left"))
    fig.update_xaxes(tickmode="linear", tick0=0, dtick=2, tickprefix="2<sup>", ticksuffix="</sup>")
    return fig


def _thin(ys, max_points: int):
    """Every n-th point (the last one kept) so a saved figure stays small."""
    ys = np.asarray(ys, dtype=np.float64)
    idx = np.arange(len(ys))
    if len(ys) > max_points:
        idx = np.unique(np.append(idx[:: -(-len(ys) // max_points)], len(ys) - 1))
    return idx, ys[idx]


def accumulation_figure(trajectories: Mapping[str, Sequence[float]],
                        exact: Optional[Sequence[float]] = None,
                        title: str = "Adding the same small update again and again",
                        max_points: int = 1000) -> go.Figure:
    """Lesson 01: running values of repeated additions (``formats.accumulate``), one line per
    storage format, with the exact float64 sum dashed. Swamped lines go flat. Long runs are
    drawn with at most ``max_points`` points per line (every n-th addition, the last kept)."""
    if not trajectories:
        raise ValueError("trajectories must hold at least one line")
    if not is_int(max_points) or max_points < 2:
        raise ValueError(f"max_points must be an integer >= 2; got {max_points!r}")
    fig = go.Figure()
    for name, ys in trajectories.items():
        x, y = _thin(ys, max_points)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name))
    if exact is not None:
        x, y = _thin(exact, max_points)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name="exact",
                                 line=dict(color="black", dash="dash", width=1)))
    return styled(fig, title, "additions (count)", "running value (dimensionless)")


def bit_layout_html(decoded: Sequence[object], caption: str = "") -> str:
    """Lesson 01: an HTML table of ``formats.decode`` results, one row per format: coloured bit
    boxes (sign, exponent, mantissa), hex, unbiased exponent, stored value, kind, relative
    error."""
    if not decoded:
        raise ValueError("decoded must hold at least one formats.Decoded")
    esc = html.escape

    def boxes(bits: str, part: str) -> str:
        return "".join(f'<span title="{part}" style="display:inline-block;width:0.95em;'
                       f'text-align:center;margin:0 1px 0 0;color:white;border-radius:2px;'
                       f'font-size:12px;background:{BIT_COLORS[part]}">{b}</span>' for b in bits)

    rows = []
    for d in decoded:
        rel = d.rel_error
        rel_text = "n/a" if math.isnan(rel) else f"{rel:.3g}"
        note = " (overflow)" if d.overflow else ""
        rows.append(
            "<tr>"
            f"<td style='text-align:left'><b>{esc(d.fmt)}</b></td>"
            f"<td style='text-align:left;font-family:monospace;white-space:nowrap'>{boxes(str(d.sign), 'sign')}&nbsp;"
            f"{boxes(d.exponent_bits, 'exponent')}&nbsp;{boxes(d.mantissa_bits, 'mantissa')}</td>"
            f"<td style='font-family:monospace'>{esc(d.hex)}</td>"
            f"<td>{'' if d.exponent is None else d.exponent}</td>"
            f"<td style='font-family:monospace'>{esc(repr(d.rounded))}</td>"
            f"<td style='white-space:nowrap'>{esc(d.kind)}{note}</td><td>{rel_text}</td></tr>")
    legend = " ".join(f'<span style="color:{c}">■ {p}</span>' for p, c in BIT_COLORS.items())
    head = ("<tr><th>format</th><th>bits</th><th>hex</th><th>exponent</th><th>stored&nbsp;value</th>"
            "<th>kind</th><th>relative error</th></tr>")
    cap = f"<caption style='text-align:left'>{esc(caption)} {legend}</caption>"
    return f"<table class='amp-bits'>{cap}{head}{''.join(rows)}</table>"


# ---------------------------------------------------------------------------------------------
# Lesson 02 (the basic AMP loop): FP32 vs AMP side by side, and training curves.
# ---------------------------------------------------------------------------------------------
_PRECISION_PANELS = (("epoch_time_s", "time per epoch (s)", "{:.3g} s"),
               ("peak_memory_mib", "peak memory (MiB)", "{:.1f} MiB"),
               ("accuracy_pct", "test accuracy (%)", "{:.1f}%"))


def precision_comparison(rows: Sequence[Mapping], title: str = "FP32 vs AMP on digits"):
    """Lesson 02: three bar panels per precision (time per epoch in s, peak memory in MiB, test
    accuracy in %) from ``trainer.compare_precisions`` rows. Rows that did not run, and memory a
    CPU cannot count, are left out and named in the subtitle."""
    ran = [r for r in rows if r.get("ran")]
    if not ran:
        raise ValueError("rows must hold at least one precision that ran")
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in _PRECISION_PANELS],
                        horizontal_spacing=0.09)
    notes = [f"{r['precision']} not run here" for r in rows if not r.get("ran")]
    for col, (key, label, fmt) in enumerate(_PRECISION_PANELS, start=1):
        shown = [r for r in ran if r.get(key) is not None]
        if not shown:
            notes.append(f"{label.split(' (')[0]} not measured on this device")
        fig.add_trace(go.Bar(x=[r["precision"] for r in shown], y=[r[key] for r in shown],
                             text=[fmt.format(r[key]) for r in shown], textposition="outside",
                             marker_color=["#4C78A8" if r["precision"] in ("fp32", "tf32")
                                           else "#F58518" for r in shown],
                             name=label, showlegend=False,
                             hovertemplate="%{x}: %{text}<extra>" + label + "</extra>"),
                      row=1, col=col)
        fig.update_yaxes(title_text=label, row=1, col=col)
        fig.update_xaxes(title_text="precision", row=1, col=col)
    if notes:
        title = f"{title}<br><sup>{'; '.join(notes)}</sup>"
    styled(fig, title, "precision", "time per epoch (s)")
    for col, (_, label, _) in enumerate(_PRECISION_PANELS, start=1):  # styled set one title on all
        fig.update_yaxes(title_text=label, rangemode="tozero", row=1, col=col)
    return fig


def loss_curves(curves: Mapping[str, Mapping[str, Sequence]],
                title: str = "Training loss per optimizer step"):
    """Lesson 02: one line per run, ``{label: {"step": [...], "loss": [...]}}`` (e.g. a
    History's ``columns()``); the loss is unitless cross-entropy (nats)."""
    if not curves:
        raise ValueError("curves must hold at least one run")
    fig = go.Figure()
    for label, cols in curves.items():
        if len(cols["step"]) != len(cols["loss"]):
            raise ValueError(f"curve {label!r}: step and loss must have the same length")
        fig.add_trace(go.Scatter(x=list(cols["step"]), y=list(cols["loss"]), mode="lines",
                                 name=label))
    fig.update_layout(showlegend=True)
    return styled(fig, title, "optimizer step (count)", "training loss (nats)")
