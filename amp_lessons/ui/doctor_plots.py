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
        # lands near 10^0): an annotation on a log axis takes log10 of the value. The labels sit
        # right of the plotting area, in the margin, where no marker can be under them
        fig.add_annotation(x=1.01, xref="paper", xanchor="left", y=math.log10(value), yref="y",
                           yanchor="middle", text=f"{label}<br>{value:.3g}", showarrow=False,
                           align="left", font=dict(size=10, color=color))
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(showticklabels=len(names) <= 60, tickangle=-60)
    title = title or (f"{report.model}: per-layer ranges against fp16 and e4m3 (gradients "
                      + (f"at the loss scale 2^{k})" if k is not None else "unscaled)"))
    fig = styled(fig, title, "layer (call order)", "magnitude (log scale)", height=480)
    fig.update_layout(margin=dict(r=170), legend=dict(orientation="h", y=-0.35))
    return fig


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


def ranges_svg(report, width: int = 900, height: int = 380) -> str:
    """The per-layer ranges as a static SVG (what ``ranges_figure`` shows, without JavaScript):
    per layer the largest |activation| (filled circle) and the largest and smallest nonzero
    |gradient| at the reached loss scale (diamonds), on a log axis, with fp16's largest value,
    smallest normal and smallest subnormal as labelled lines in the right margin. A few KB for
    any model: the self-contained report page embeds this one."""
    import html as _html

    def value(r, key):
        v = r.get(key)
        return v if is_real(v) and v > 0 else None

    rows = [r for r in report.layers if value(r, "act_absmax") or value(r, "grad_absmax")]
    k = report.scale_exponent
    scale = 2.0 ** k if k is not None else 1.0
    left, right, top, bottom = 60, 170, 30, 40
    pw, ph = width - left - right, height - top - bottom
    limits = [(label, getattr(formats.get_format(fmt), key), color)
              for label, fmt, key, color in LIMITS if fmt == "fp16"]
    series = [("act_absmax", 1.0, "#1f77b4", "circle"), ("grad_absmax", scale, "#2ca02c", "d"),
              ("grad_min", scale, "#9467bd", "d-open")]
    points = [value(r, key) * f for r in rows for key, f, _, _ in series if value(r, key)]
    lo = math.floor(math.log10(min(points + [x[1] for x in limits]) or 1e-30))
    hi = math.ceil(math.log10(max(points + [x[1] for x in limits]) or 1.0))
    hi = max(hi, lo + 1)

    def y(v):
        return top + ph * (hi - math.log10(v)) / (hi - lo)

    def x(i):
        return left + pw * (i + 0.5) / max(len(rows), 1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="10" role="img">',
           f'<title>{_html.escape(report.model)}: per-layer ranges against fp16</title>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for e in range(lo, hi + 1, max(1, (hi - lo) // 8)):
        out.append(f'<text x="{left - 4}" y="{y(10.0 ** e) + 3:.1f}" text-anchor="end">'
                   f'1e{e}</text>')
    for label, v, color in limits:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                   f'stroke="{color}" stroke-dasharray="3,3"/>')
        out.append(f'<text x="{left + pw + 4}" y="{y(v) + 3:.1f}" fill="{color}">'
                   f'{_html.escape(label)} {v:.3g}</text>')
    for i, r in enumerate(rows):
        for key, f, color, shape in series:
            v = value(r, key)
            if v is None:
                continue
            cx, cy = x(i), y(v * f)
            tip = f"<title>{_html.escape(str(r['layer']))} {key} {v * f:.3g}</title>"
            if shape == "circle":
                out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}">{tip}'
                           f'</circle>')
            else:
                fill = "none" if shape.endswith("open") else color
                out.append(f'<path d="M{cx:.1f},{cy - 4:.1f}l4,4l-4,4l-4,-4z" fill="{fill}" '
                           f'stroke="{color}">{tip}</path>')
    at = f"x 2^{k}" if k is not None else "unscaled"
    out.append(f'<text x="{left}" y="{top - 10}">{_html.escape(report.model)}: max |activation| '
               f'(blue), max and min nonzero |gradient| {at} (green, purple), layers in call '
               f'order</text>')
    out.append("</svg>")
    return "\n".join(out)


def figure_html(fig: go.Figure) -> str:
    """``fig`` as an HTML fragment with plotly.js inlined (a page that needs no network)."""
    return fig.to_html(include_plotlyjs=True, full_html=False)
