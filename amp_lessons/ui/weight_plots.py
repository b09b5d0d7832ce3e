"""Figures of lesson 08 (weights and optimizer state): loss curves per recipe, the share of
updates rounded away per step, and memory by category. Pure functions: rows in (from
``amp_lessons.measure.optim.train_recipe`` and ``optim.memory_rows``), a plotly figure out, with a title
and axis titles with units."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from amp_lessons.validate import check_int, is_real
from amp_lessons.ui.plots import TEMPLATE, styled, trailing_mean

RECIPE_COLORS = {"fp32 master": "#000000", "bf16": "#E45756",
                 "bf16 + stochastic rounding": "#F58518", "bf16 + Kahan": "#54A24B",
                 "8-bit state": "#4C78A8", "4-bit state": "#B279A2", "FP8 state": "#72B7B2"}
MEMORY_PARTS = (("weights MiB", "weights", "#4C78A8"), ("gradients MiB", "gradients", "#F58518"),
                ("optimizer state MiB", "optimizer state", "#E45756"),
                ("activations MiB", "activations", "#72B7B2"))


def _workloads(rows: Sequence[Mapping]) -> list:
    return list(dict.fromkeys(r["workload"] for r in rows))


def _thin(ys, max_points: int):
    """Every n-th point (the last one kept), so a saved figure stays small."""
    ys = np.asarray(ys, dtype=np.float64)
    idx = np.arange(len(ys))
    if len(ys) > max_points:
        idx = np.unique(np.append(idx[:: -(-len(ys) // max_points)], len(ys) - 1))
    return idx, ys[idx]


def _panels(workloads: Sequence[str], title: str, x_title: str, y_title: str,
            height: int = 500) -> go.Figure:
    fig = make_subplots(rows=1, cols=len(workloads), subplot_titles=list(workloads))
    styled(fig, title, x_title, y_title, height=height)
    # the legend sits between the title and the panels' own titles, never over either
    fig.update_layout(margin=dict(t=150), title=dict(y=0.97, yanchor="top"),
                      legend=dict(orientation="h", yanchor="bottom", y=1.08, xanchor="left", x=0))
    return fig


def recipe_losses(rows: Sequence[Mapping], title: str = "Training loss per weight and optimizer "
                  "recipe (same data, same first seed)", max_points: int = 300) -> go.Figure:
    """Loss against step, one panel per workload, one line per recipe (the first seed; other
    seeds of the fp32-master reference drawn thin and grey: the noise scale). Log y axis; the
    curve is a moving average over 2% of the steps."""
    check_int("max_points", max_points, 2)  # 0 divided by zero, a negative one thinned nothing
    trained = [r for r in rows if r.get("losses")]
    if not trained:
        raise ValueError("rows must hold at least one trained run (with losses)")
    workloads = _workloads(trained)
    fig = _panels(workloads, title, "optimizer step (count)",
                  "training loss (log axis; MSE or nats per byte)")
    shown = set()
    for col, w in enumerate(workloads, start=1):
        first_seen = set()
        for r in (r for r in trained if r["workload"] == w):
            steps = len(r["losses"])
            losses = [v if is_real(v) else np.nan for v in r["losses"]]  # not measured: a gap
            y_full = trailing_mean(losses, max(1, steps // 50))
            x, y = _thin(y_full, max_points)
            extra_seed = r["recipe"] in first_seen
            first_seen.add(r["recipe"])
            name = r["recipe"] + (f" (seed {r['seed']})" if extra_seed else "")
            fig.add_trace(go.Scatter(
                x=x, y=y, mode="lines", name=name, legendgroup=name,
                showlegend=name not in shown,
                line=dict(color="#BBBBBB" if extra_seed else RECIPE_COLORS.get(r["recipe"]),
                          width=1 if extra_seed else 2)), row=1, col=col)
            shown.add(name)
        fig.update_yaxes(type="log", row=1, col=col)
    return fig


def rounded_away(rows: Sequence[Mapping], title: str = "Share of weights whose update was "
                 "rounded away, per step") -> go.Figure:
    """Per workload, the share (%) of weights that received a non-zero gradient yet kept their
    stored value, per recipe (first seed). For pure bf16 those updates are lost; stochastic
    rounding makes them up on average and Kahan carries them to later steps."""
    counted = [r for r in rows if r.get("rounded_away")]
    if not counted:
        raise ValueError("rows must hold at least one run with counted steps")
    workloads = _workloads(counted)
    fig = _panels(workloads, title, "optimizer step (count)", "weights unchanged by their update (%)")
    shown, seen = set(), set()
    for col, w in enumerate(workloads, start=1):
        for r in (r for r in counted if r["workload"] == w):
            if (w, r["recipe"]) in seen:
                continue
            seen.add((w, r["recipe"]))
            steps, shares = zip(*r["rounded_away"])
            idx, y = _thin([100 * s if is_real(s) else np.nan for s in shares], 300)
            fig.add_trace(go.Scatter(x=[steps[i] for i in idx], y=y, mode="lines",
                                     name=r["recipe"], legendgroup=r["recipe"],
                                     showlegend=r["recipe"] not in shown,
                                     line=dict(color=RECIPE_COLORS.get(r["recipe"]))),
                          row=1, col=col)
            shown.add(r["recipe"])
        fig.update_yaxes(range=[0, 100], row=1, col=col)
    return fig


def memory_by_category(memory: Sequence[Mapping], title: str = "Where the training memory goes, "
                       "per recipe (measured)") -> go.Figure:
    """Stacked bars: MiB of weights, gradients, optimizer state and activations per recipe, one
    panel per workload (``optim.memory_rows`` rows with a ``workload`` key)."""
    if not memory:
        raise ValueError("memory must hold at least one row")
    workloads = _workloads(memory)
    missing = [f"{m['recipe']} {label}" for m in memory for key, label, _ in MEMORY_PARTS
               if not is_real(m.get(key))]
    if missing:
        title = (f"{title}<br><sup>not measured: {'; '.join(missing[:4])}"
                 f"{' ...' if len(missing) > 4 else ''}</sup>")
    fig = _panels(workloads, title, "recipe", "memory (MiB)", height=540)
    for col, w in enumerate(workloads, start=1):
        mine = [m for m in memory if m["workload"] == w]
        for key, label, color in MEMORY_PARTS:
            # a part not measured (None, NaN, absent) has no bar segment (named in the title)
            values = [m.get(key) for m in mine]
            fig.add_trace(go.Bar(x=[m["recipe"] for m in mine],
                                 y=[v if is_real(v) else None for v in values],
                                 name=label, legendgroup=label, showlegend=col == 1,
                                 marker_color=color,
                                 hovertemplate="%{x}: %{y:.1f} MiB " + label + "<extra></extra>"),
                          row=1, col=col)
    fig.update_layout(barmode="stack", template=TEMPLATE)
    fig.update_xaxes(tickangle=-30)
    return fig
