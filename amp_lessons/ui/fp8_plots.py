"""Lesson 07's figures: FP8 round-trip error per tensor kind and scaling, the speed of the float8
recipes against bf16 per width, and the loss curves of the GPT runs. Pure builders: rows in, a
plotly figure out."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from amp_lessons.measure.float8 import FP8_RECIPES, NOT_MEASURED
from amp_lessons.validate import check_int, is_real
from amp_lessons.numerics.fp8 import FP8_FORMATS as FORMATS
from amp_lessons.numerics.fp8 import SCALINGS, TENSOR_KINDS, error_summary
from amp_lessons.tables import plural


def error_figure(rows: Sequence[Mapping], title: str = "FP8 round-trip error of real tensors"):
    """Relative error (%) of activations, weights and gradients per scaling, e4m3 and e5m2 side by
    side (``error_table`` or ``error_summary`` rows; layers averaged)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from amp_lessons.ui.plots import TEMPLATE

    summary = error_summary(rows) if rows and "layer" in rows[0] else list(rows)
    if not summary:
        raise ValueError("rows must hold at least one row (see error_table)")
    formats = [f for f in FORMATS if any(r["format"] == f for r in summary)]
    fig = make_subplots(rows=1, cols=len(formats), shared_yaxes=True,
                        subplot_titles=[f"{f} ({FORMATS[f]})".replace("torch.", "")
                                        for f in formats])
    colors = {"none": "#b0b0b0", "tensorwise": "#1f77b4", "rowwise": "#ff7f0e"}
    for col, fmt in enumerate(formats, start=1):
        for scaling in SCALINGS:
            sel = {r["tensor"]: r for r in summary if r["format"] == fmt and r["scaling"] == scaling}
            if not sel:
                continue
            kinds = [k for k in TENSOR_KINDS if k in sel]
            # a kind not measured (None, NaN) has no bar and says so, never a 1e-3 % bar
            errors = [sel[k].get("rel_error") for k in kinds]
            flushed = [sel[k].get("underflow") for k in kinds]
            fig.add_trace(go.Bar(
                x=kinds, y=[max(100 * e, 1e-3) if is_real(e) else None for e in errors],
                name=f"scale: {scaling}", legendgroup=scaling, showlegend=col == 1,
                marker_color=colors[scaling],
                text=["" if is_real(e) else "not measured" for e in errors],
                customdata=[100 * u if is_real(u) else None for u in flushed],
                hovertemplate="%{x}: %{y:.3g}% error, %{customdata:.1f}% flushed to 0"),
                row=1, col=col)
    fig.update_yaxes(type="log", title_text="relative error (%, log scale)", row=1, col=1)
    fig.update_xaxes(title_text="tensor (lesson 02's MLP on digits)")
    fig.update_layout(title=dict(text=title, x=0.01), template=TEMPLATE, barmode="group",
                      height=380, legend_title_text="scaling")
    return fig


def speed_figure(rows: Sequence[Mapping],
                 title: str = "FP8 training step: speed-up over compiled bf16 by width"):
    """Speed-up over compiled bf16 (x) against MLP width, one line per float8 recipe; where
    nothing was measured, the figure says why."""
    import plotly.graph_objects as go

    from amp_lessons.ui.plots import styled

    if not rows:
        raise ValueError("rows must hold at least one row (see speed_sweep)")
    fig = go.Figure()
    widths = sorted({r["width"] for r in rows})
    for recipe, color in zip(FP8_RECIPES, ("#1f77b4", "#ff7f0e")):
        pts = sorted((r["width"], r["speedup"], r.get("step_ms"), r.get("peak_gib")) for r in rows
                     if r["recipe"] == recipe and is_real(r.get("speedup")))
        if pts:
            fig.add_trace(go.Scatter(
                x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                name=f"float8 {recipe}", line_color=color,
                customdata=[[p[2], p[3]] for p in pts],
                hovertemplate="width %{x}: %{y:.2f}x (step %{customdata[0]:.1f} ms, "
                              "peak %{customdata[1]:.1f} GiB)"))
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray",
                  annotation_text="compiled bf16 = 1x", annotation_position="bottom right")
    if not fig.data:
        why = str(next((r.get("status") for r in rows if r.get("status")), None) or NOT_MEASURED)
        fig.add_annotation(text=why[:110] + ("..." if len(why) > 110 else ""), showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.6)
    styled(fig, title, "MLP width d (Linear d -> 4d -> d, log scale)",
           "speed-up over compiled bf16 (x, step time ratio)", height=380)
    fig.update_xaxes(type="log", tickvals=widths, ticktext=[f"{w:,}" for w in widths])
    fig.update_yaxes(rangemode="tozero")
    return fig


def loss_figure(runs: Sequence[Mapping], title: Optional[str] = None, smooth: Optional[int] = None):
    """Training loss curves (left) and each FP8 run's gap to the baseline with the same seed against
    the band that the baseline's seeds span (right); curves smoothed over ``smooth`` steps (default:
    2%). The baseline is named as it ran: bf16, or fp32 on a GPU without bf16 (a T4)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from amp_lessons.ui.plots import TEMPLATE, trailing_mean

    trained = [r for r in runs if r.get("status") == "trained"]
    if not trained:
        raise ValueError("runs must hold at least one trained run (see accuracy_runs)")
    steps = min(len(r["losses"]) for r in trained)
    window = smooth if smooth is not None else max(1, steps // 50)  # 0 is refused, not 2%
    check_int("smooth", window, 1)
    curves = {r["label"]: trailing_mean(r["losses"][:steps], window).tolist() for r in trained}
    x = list(range(1, steps + 1))
    base = [r for r in trained if r["recipe"] == "bf16"]
    name = "fp32" if any(r["label"].startswith("fp32") for r in base) else "bf16"
    title = title or f"A small GPT on the standard library: {name} against FP8"
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14, subplot_titles=(
        "training loss", f"FP8 minus {name} (same seed), and the {name} seed band"))
    for r in trained:
        fp8 = r["recipe"] != "bf16"
        fig.add_trace(go.Scatter(x=x, y=curves[r["label"]], name=r["label"], mode="lines",
                                 line=dict(width=2 if fp8 else 1, dash=None if fp8 else "dot")),
                      row=1, col=1)
    if base:
        ref = {r["seed"]: curves[r["label"]] for r in base}
        first = curves[base[0]["label"]]
        if len(base) >= 2:
            lo = [min(curves[b["label"]][i] for b in base) - first[i] for i in range(steps)]
            hi = [max(curves[b["label"]][i] for b in base) - first[i] for i in range(steps)]
            fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself",
                                     fillcolor="rgba(128,128,128,0.25)", line=dict(width=0),
                                     name=f"{name} seeds (min to max) minus {name} seed "
                                          f"{base[0]['seed']}", hoverinfo="skip"), row=1, col=2)
        for r in trained:
            if r["recipe"] != "bf16" and r["seed"] in ref:
                gap = [a - b for a, b in zip(curves[r["label"]], ref[r["seed"]])]
                fig.add_trace(go.Scatter(x=x, y=gap, mode="lines", name=f"{r['label']} minus {name}",
                                         line=dict(width=2)), row=1, col=2)
    fig.add_hline(y=0, line_color="gray", line_dash="dash", row=1, col=2)
    fig.update_xaxes(title_text="optimizer step (count)")
    fig.update_yaxes(title_text="cross-entropy (nats per byte)", row=1, col=1)
    fig.update_yaxes(title_text="loss difference (nats per byte)", row=1, col=2)
    # the legend below the two panels: beside them it took a third of the width
    fig.update_layout(title=dict(text=f"{title} (smoothed over {plural(window, 'step')})",
                                 x=0.01),
                      template=TEMPLATE, height=500, margin=dict(l=70, r=30, t=90, b=150),
                      legend=dict(orientation="h", yanchor="top", y=-0.2, xanchor="left", x=0))
    return fig

