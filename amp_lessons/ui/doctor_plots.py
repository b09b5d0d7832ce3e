"""Figures of the doctor's report (lesson 09): pure builders from a ``DoctorReport``."""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go

from amp_lessons.numerics import formats
from amp_lessons.validate import is_real
from amp_lessons.ui.plots import styled

LIMITS = (("fp16 max", "fp16", "max", "#d62728"),
          ("fp16 smallest normal", "fp16", "smallest_normal", "#ff7f0e"),
          ("fp16 smallest subnormal", "fp16", "smallest_subnormal", "#8c564b"),
          ("e4m3 max", "fp8_e4m3fn", "max", "#9467bd"))


def ranges_figure(report, title: Optional[str] = None) -> go.Figure:
    """Per layer (call order): the largest and smallest nonzero |activation|, and the largest and
    smallest nonzero |gradient| times the loss scale GradScaler would reach, on a log axis, with
    fp16's and e4m3's limits as lines: a point above "fp16 max" overflows, below "fp16 smallest
    subnormal" it is flushed to zero."""
    def value(r, key):  # a magnitude to plot: finite and > 0 (None/NaN/inf are not points)
        v = r.get(key)
        return v if is_real(v) and v > 0 else None

    rows = [r for r in report.layers if value(r, "act_absmax") or value(r, "grad_absmax")]
    if not rows:
        raise ValueError("report must hold at least one layer with a nonzero value")
    k = report.scale_exponent
    scale = 2.0 ** k if k is not None else 1.0
    at = f"x 2^{k}" if k is not None else "(unscaled: no loss scale found)"
    names = [r["layer"] for r in rows]
    fig = go.Figure()
    for key, label, factor, symbol in (("act_absmax", "max |activation|", 1.0, "circle"),
                                       ("act_min", "min nonzero |activation|", 1.0, "circle-open"),
                                       ("grad_absmax", f"max |gradient| {at}", scale, "diamond"),
                                       ("grad_min", f"min nonzero |gradient| {at}", scale,
                                        "diamond-open")):
        ys = [value(r, key) * factor if value(r, key) else None for r in rows]
        fig.add_trace(go.Scatter(x=names, y=ys, mode="markers", name=label,
                                 marker=dict(symbol=symbol, size=6),
                                 hovertemplate="%{x}<br>%{y:.3g}<extra>" + label + "</extra>"))
    for label, fmt, key, color in LIMITS:
        value = getattr(formats.get_format(fmt), key)
        fig.add_hline(y=value, line=dict(color=color, dash="dot", width=1))
        # plotly places a line's own annotation at the raw value on a log axis (every label then
        # lands near 10^0): an annotation on a log axis takes log10 of the value
        fig.add_annotation(x=0, xref="paper", xanchor="left", y=math.log10(value), yref="y",
                           yanchor="bottom", text=f"{label} {value:.3g}", showarrow=False,
                           font=dict(size=10, color=color))
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(showticklabels=len(names) <= 60, tickangle=-60)
    title = title or (f"{report.model}: per-layer ranges against fp16 and e4m3 (gradients "
                      + (f"at the loss scale 2^{k})" if k is not None else "unscaled)"))
    return styled(fig, title, "layer (call order)", "magnitude (log scale)", height=480)


def speed_figure(report, title: Optional[str] = None) -> go.Figure:
    """Samples per second and peak memory per precision (the report's speed rows that ran)."""
    rows = [r for r in report.speed if r.get("status") == "ok"]
    if not rows:
        raise ValueError("report must hold at least one timed precision")
    speeds = [r.get("samples_per_s") for r in rows]
    fig = go.Figure()
    # a speed not measured (None, NaN) has no bar and says so; an undecided one is marked
    fig.add_trace(go.Bar(x=[r["precision"] for r in rows],
                         y=[v if is_real(v) else None for v in speeds], name="samples/s",
                         text=["not measured" if not is_real(v) else
                               "" if r.get("decided") else "not decided"
                               for r, v in zip(rows, speeds)]))
    title = title or f"{report.model}: training speed per precision"
    missing = [r["precision"] for r, v in zip(rows, speeds) if not is_real(v)]
    if missing:
        title = f"{title}<br><sup>not measured: {', '.join(map(str, missing))}</sup>"
    return styled(fig, title, "precision", "samples per second (median step)")


def figure_html(fig: go.Figure) -> str:
    """``fig`` as an HTML fragment with plotly.js inlined (a page that needs no network)."""
    return fig.to_html(include_plotlyjs=True, full_html=False)
