"""Speed and memory figures (lessons 04-07): throughput against memory, the memory/time frontier of
checkpointing techniques, the largest batch per card, accumulation, resume, multi-GPU scaling and
memory per rank. Pure functions: rows in, a plotly figure out (titles and axes with units)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import plotly.graph_objects as go

from amp_lessons.validate import is_real
from amp_lessons.tables import plural, shown_technique
from amp_lessons.ui.plots import label_positions, preset_comparison, styled, with_caveat


# ---------------------------------------------------------------------------------------------
# Lesson 04: ResNet-50 speed against memory, one point per configuration
# ---------------------------------------------------------------------------------------------

_L04_COLORS = {"fp32": "#4C78A8", "tf32": "#72B7B2", "fp16": "#F58518", "bf16": "#E45756"}
_L04_COUNTED = ("params_gib", "grads_gib", "optimizer_state_gib", "activations_gib")


def _l04_memory(row: Mapping, key: str) -> Optional[float]:
    if key == "counted_gib":
        parts = [row.get(k) for k in _L04_COUNTED]
        return sum(parts) if all(is_real(p) for p in parts) else None
    value = row.get(key)
    return value if is_real(value) else None  # NaN/inf memory is not measured, never a point


def _l04_hover(row: Mapping) -> str:
    idle = row.get("gpu_idle_fraction")
    return str(row.get("label", "?")) + ("" if not is_real(idle) else
                                         f"<br>GPU idle {100 * idle:.2g}% of the step")


def throughput_memory(rows: Sequence[Mapping], title: str = "ResNet training step: "
                      "speed against memory", memory_key: str = "peak_allocated_gib",
                      caveat: str = "") -> go.Figure:
    """Lesson 04: img/s against peak memory (GiB), one point per measured configuration, with
    ``caveat`` (``plots.with_caveat``: why these speeds decide nothing, where they cannot) below.

    ``rows`` are ``measure.run_configs`` rows; those without both numbers (skipped, out of memory)
    are named in the subtitle. One trace per precision. Where no row has a peak (a CPU), memory
    falls back to the counted total: parameters + gradients + optimizer state + saved activations.
    """
    if not any(_l04_memory(r, memory_key) is not None for r in rows):
        memory_key = "counted_gib"
    x_title = ("peak allocated memory (GiB)" if memory_key == "peak_allocated_gib" else
               "counted memory: params + grads + optimizer state + activations (GiB)"
               if memory_key == "counted_gib" else f"{memory_key} (GiB)")
    shown = [r for r in rows if is_real(r.get("img_per_s")) and r.get("status") == "ok"
             and _l04_memory(r, memory_key) is not None]
    if not shown:
        raise ValueError("rows must hold at least one measured configuration (status ok)")
    fig = go.Figure()
    for precision, color in _L04_COLORS.items():
        group = [r for r in shown if r.get("config", {}).get("precision") == precision]
        if not group:
            continue
        fig.add_trace(go.Scatter(
            x=[_l04_memory(r, memory_key) for r in group], y=[r["img_per_s"] for r in group],
            mode="markers", name=precision, marker=dict(size=11, color=color,
                                                        line=dict(width=1, color="white")),
            text=[_l04_hover(r) for r in group],
            hovertemplate="%{text}<br>%{y:,.0f} img/s, %{x:.2f} GiB<extra></extra>"))
    others = [r for r in shown if r.get("config", {}).get("precision") not in _L04_COLORS]
    if others:
        fig.add_trace(go.Scatter(x=[_l04_memory(r, memory_key) for r in others],
                                 y=[r["img_per_s"] for r in others], mode="markers",
                                 name="other", text=[_l04_hover(r) for r in others]))
    left_out = [f"{r.get('label', '?')} ({r.get('status', '?')})" for r in rows if r not in shown]
    if left_out:
        title = (f"{title}<br><sup>not shown: "
                 f"{'; '.join(left_out[:4])}{' ...' if len(left_out) > 4 else ''}</sup>")
    fig.update_layout(showlegend=True)
    styled(fig, title, x_title, "throughput (img/s)", height=480)
    fig.update_xaxes(rangemode="tozero")
    fig.update_yaxes(rangemode="tozero")
    return with_caveat(fig, caveat)


# ---------------------------------------------------------------------------------------------
# Lesson 05: checkpointing and accumulation (memory against time per technique, the largest
# batch per simulated card, memory per micro-batch count, resume with and without scaler state)
# ---------------------------------------------------------------------------------------------

_L05_COLORS = {"fp32": "#4C78A8", "fp32 + checkpointing": "#9ECAE9", "AMP": "#F58518",
               "AMP + checkpointing": "#FFBF79", "bf16": "#E45756",
               "bf16 + checkpointing": "#FF9D98",
               "AMP + checkpointing per stage": "#B279A2",
               "AMP + checkpointing layer1-2": "#9D755D",
               "AMP + checkpointing stem+layer1": "#54A24B",
               "AMP + checkpointing stem+layer1-2": "#2E7D32",
               "AMP + selective checkpointing": "#BAB0AC", "AMP + CUDA graph": "#D62728",
               "AMP + checkpointing + CUDA graph": "#FF7F7F",
               "AMP + checkpointing stem+layer1-2 + CUDA graph": "#8C1D18"}
_L05_OTHER = ("#54A24B", "#B279A2", "#9D755D", "#BAB0AC")
def _l05_color(name: str, i: int) -> str:
    return _L05_COLORS.get(name, _L05_OTHER[i % len(_L05_OTHER)])


def _l05_check_lines(name: str, lines: Optional[Mapping[str, float]]) -> Dict[str, float]:
    lines = dict(lines or {})
    for label, value in lines.items():
        if not is_real(value) or not value > 0:
            raise ValueError(f"{name} must map labels to numbers > 0; got {label!r}: {value!r}")
    return lines


def technique_memory_time(rows: Sequence[Mapping[str, Any]],
                          title: str = "Memory against step time per technique",
                          frontier: Sequence[str] = (),
                          memory_lines: Optional[Mapping[str, float]] = None,
                          time_lines: Optional[Mapping[str, float]] = None) -> go.Figure:
    """Lesson 05: one labelled point per technique: step time (ms, x) against memory (GiB, y).

    ``rows`` are ``technique_table`` rows (``technique``, ``step_ms``, ``memory_gib``,
    ``memory_source``); rows that did not run are named under the title with their status.
    ``frontier``: the techniques on the Pareto frontier (no other is both faster and smaller),
    joined by a dashed line. ``memory_lines`` / ``time_lines``: labelled horizontal (GiB) and
    vertical (ms) guides, e.g. a card's memory or a time budget.
    """
    if isinstance(frontier, str):  # a string was read letter by letter
        raise ValueError(f"frontier must be a list of technique names; got the string {frontier!r}")
    memory_lines = _l05_check_lines("memory_lines", memory_lines)
    time_lines = _l05_check_lines("time_lines", time_lines)
    # NaN/inf numbers are not measured: named under the title, never a point (NaN broke the axes)
    shown = [r for r in rows if r.get("status") == "ok" and is_real(r.get("step_ms"))
             and is_real(r.get("memory_gib"))]
    if not shown:
        raise ValueError("rows must hold at least one measured technique (status ok)")
    names = [r.get("technique", r.get("label", "?")) for r in shown]
    unknown = [f for f in frontier if f not in names]
    if unknown:
        raise ValueError(f"frontier must name measured techniques; not measured: {unknown}")
    fig = go.Figure()
    on_front = [r for n in frontier for r, m in zip(shown, names) if m == n]
    if len(on_front) > 1:
        on_front.sort(key=lambda r: r["step_ms"])
        fig.add_trace(go.Scatter(
            x=[r["step_ms"] for r in on_front], y=[r["memory_gib"] for r in on_front],
            mode="lines", name="frontier", line=dict(color="#888", dash="dash", width=1.5),
            hoverinfo="skip"))
    # room for the labels beside the outermost points
    top_x = max([r["step_ms"] for r in shown] + list(time_lines.values()))
    top_y = max([r["memory_gib"] for r in shown] + list(memory_lines.values()))
    x_range, y_range = (0, 1.25 * top_x), (0, 1.15 * top_y)
    labels = [shown_technique(r) for r in shown]  # TF32 where fp32 ran with TF32 math
    positions = label_positions([r["step_ms"] for r in shown], [r["memory_gib"] for r in shown],
                                labels, x_range, y_range, height=520)
    for i, (r, name, label) in enumerate(zip(shown, names, labels)):
        star = name in frontier
        beside = isinstance(positions[i], str)
        if not beside:  # a label farther out, joined to its point by a line
            dx, dy = positions[i]
            fig.add_annotation(x=r["step_ms"], y=r["memory_gib"], text=label, ax=dx, ay=-dy,
                               showarrow=True, arrowhead=0, arrowwidth=1, arrowcolor="#999",
                               standoff=6, font=dict(size=10))
        fig.add_trace(go.Scatter(
            x=[r["step_ms"]], y=[r["memory_gib"]], mode="markers+text", name=label,
            text=[label if beside else ""], textposition=positions[i] if beside else "top center",
            textfont=dict(size=10),
            marker=dict(size=14 if star else 10, color=_l05_color(name, i),
                        symbol="star" if star else "circle", line=dict(width=1, color="#333")),
            hovertemplate=f"{label}<br>%{{x:,.1f}} ms per step<br>%{{y:.3f}} GiB<extra></extra>"))
    for label, gib in memory_lines.items():
        fig.add_hline(y=gib, line=dict(color="#C44", dash="dot", width=1),
                      annotation_text=label, annotation_position="top left",
                      annotation_font_size=10)
    for label, ms in time_lines.items():
        fig.add_vline(x=ms, line=dict(color="#44C", dash="dot", width=1),
                      annotation_text=label, annotation_position="top right",
                      annotation_font_size=10)
    left_out = [f"{shown_technique(r)} ({r.get('status')})" for r in rows if r not in shown]
    if left_out:
        title = f"{title}<br><sup>not measured here: {'; '.join(left_out)}</sup>"
    source = shown[0].get("memory_source") or "peak allocated"
    batch = shown[0].get("config", {}).get("batch_size")
    if batch:
        title = f"{title} (batch {batch})"
    fig = styled(fig, title, "training step time (ms, median)", f"memory (GiB, {source})",
                 height=520)
    fig.update_layout(showlegend=len(shown) <= 6)
    fig.update_xaxes(range=list(x_range))
    fig.update_yaxes(range=list(y_range))
    return fig


def largest_batch_chart(rows: Sequence[Mapping[str, Any]],
                        title: str = "The largest batch per simulated card") -> go.Figure:
    """Lesson 05: grouped bars, the largest batch (images) per card size and technique.

    ``rows`` are lesson 05's ``largest_batch_table`` rows; skipped cells have no bar and are counted
    under the title (the table says why).
    """
    if not rows:
        raise ValueError("rows must hold at least one largest_batch_table row")
    cards = sorted({r["card_gb"] for r in rows})
    labels = [f"{c:g} GB" for c in cards]
    techniques = list(dict.fromkeys(r["technique"] for r in rows))
    fig = go.Figure()
    for i, t in enumerate(techniques):
        by_card = {r["card_gb"]: r for r in rows if r["technique"] == t}
        ys = [by_card[c]["largest_batch"] if c in by_card and by_card[c].get("status") == "ok"
              and is_real(by_card[c].get("largest_batch")) else None for c in cards]
        if all(y is None for y in ys):
            continue
        name = shown_technique(next(iter(by_card.values())))  # TF32 where the math is TF32
        fig.add_trace(go.Bar(x=labels, y=ys, name=name, marker_color=_l05_color(t, i),
                             text=[f"{y:,}" if y is not None else "" for y in ys],
                             textposition="outside", textangle=-90 if len(techniques) > 2 else 0,
                             textfont=dict(size=10), cliponaxis=False,
                             hovertemplate=f"{name}<br>%{{x}} card: %{{y:,}} images<extra></extra>"))
    skipped = sum(1 for r in rows if r.get("status") != "ok")
    if skipped:
        title = f"{title}<br><sup>{skipped} card/technique pairs skipped (see the table)</sup>"
    fig.update_layout(barmode="group", showlegend=True)
    fig = styled(fig, title, "simulated card (GB of memory)",
                 "largest batch that trains (images)", height=480)
    top = max([r["largest_batch"] for r in rows if r.get("status") == "ok"
               and is_real(r.get("largest_batch"))] or [1])  # NaN made the y range NaN
    return fig.update_yaxes(range=[0, 1.15 * max(top, 1)])  # room for the labels


def accumulation_memory_chart(rows: Sequence[Mapping[str, Any]],
                              title: str = "Memory per effective batch: accumulation against "
                                           "one batch") -> go.Figure:
    """Lesson 05: memory against the effective batch, reached by accumulating
    micro-batches and by one big batch. Peak allocated memory where measured (a GPU), else the
    counted bytes saved for backward. ``rows`` are lesson 05's ``accumulation_memory`` rows."""
    if not rows:
        raise ValueError("rows must hold at least one accumulation_memory row")
    gpu = all(r.get("accumulated_peak_gib") is not None for r in rows)
    key = "peak_gib" if gpu else "saved_gib"
    y_title = ("peak allocated memory (GiB)" if gpu else
               "saved for backward, largest forward (GiB, counted)")
    fig = go.Figure()
    micro = rows[0]["micro_batch"]
    fig.add_trace(go.Scatter(
        x=[r["effective_batch"] for r in rows],
        y=[r.get(f"accumulated_{key}") if is_real(r.get(f"accumulated_{key}")) else None
           for r in rows],  # not measured: a gap, never NaN
        mode="lines+markers", name=f"accumulating micro-batches of {micro}",
        text=[f"{r['micro_batches']} x {micro}" for r in rows],
        hovertemplate="%{text}<br>%{y:.3f} GiB<extra></extra>"))
    one = [r for r in rows if is_real(r.get(f"one_batch_{key}"))]
    if one:
        fig.add_trace(go.Scatter(x=[r["effective_batch"] for r in one],
                                 y=[r[f"one_batch_{key}"] for r in one],
                                 mode="lines+markers", name="one batch",
                                 hovertemplate="batch %{x}<br>%{y:.3f} GiB<extra></extra>"))
    fig.update_layout(showlegend=True)
    fig = styled(fig, title, "effective batch (images per optimizer step)", y_title)
    fig.update_yaxes(rangemode="tozero")
    return fig


def resume_chart(result: Mapping[str, Any],
                 title: str = "Resuming from a checkpoint, with and without the scaler's state"
                 ) -> go.Figure:
    """Lesson 05: loss scale (top, skipped steps crossed) and loss per step of the three runs of
    lesson 05's ``resume_experiment``, with the resume step marked."""
    runs = result.get("runs") or {}
    if not runs:
        raise ValueError("result must hold the runs of resume_experiment (lesson 05)")
    step = result["resume_step"]

    def columns(name, c):  # resumed runs: only their own steps (before, they are the same run)
        first = 0 if name == "uninterrupted" else step
        return {"steps": c["step"][first:], "scales": c["scale"][first:],
                "skipped": c["skipped"][first:], "losses": c["loss"][first:]}

    fig = preset_comparison({name: columns(name, c) for name, c in runs.items()}, title=title)
    for trace in fig.data:  # the exact resume lies on the uninterrupted run: draw it dashed
        if trace.legendgroup == "resumed with scaler state" and trace.mode == "lines":
            trace.line.dash = "dash"
    fig.update_layout(legend_title_text="run (× = skipped step)")
    fig.add_vline(x=step - 0.5, line=dict(color="#555", dash="dash"))
    fig.add_annotation(x=step - 0.5, y=1.0, xref="x", yref="paper", text="resume",
                       showarrow=False, xanchor="left", yanchor="bottom")
    return fig


# ---------------------------------------------------------------------------------------------
# Lesson 06: several processes (throughput and scaling efficiency; what each rank holds)
# ---------------------------------------------------------------------------------------------

_L06_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")
_L06_PARTS = (("param_mib", "parameters", "#1f77b4"), ("grad_mib", "gradients", "#ff7f0e"),
              ("optimizer_state_mib", "optimizer state", "#2ca02c"))


def scaling_figure(summary: Sequence[Dict[str, Any]],
                   title: str = "Throughput against the number of processes") -> go.Figure:
    """Lesson 06: examples/s of each run against its world size, with perfect scaling dashed.

    ``summary``: ``SweepResult.summary()`` rows (label, world_size, per_s, efficiency, unit).
    Each point of two or more processes is labelled with its scaling efficiency (throughput
    over world size x the one-process throughput) where the sweep ran the one-process case
    (one process, 100% by definition, is not labelled; its hover says it).
    """
    if not summary:
        raise ValueError("summary must hold at least one row")
    fig = go.Figure()
    labels = list(dict.fromkeys(r["label"] for r in summary))
    for i, label in enumerate(labels):
        rows = sorted((r for r in summary if r["label"] == label), key=lambda r: r["world_size"])
        color = _L06_COLORS[i % len(_L06_COLORS)]
        n = [r["world_size"] for r in rows]
        efficiency = [f"{r['efficiency']:.0%}" if is_real(r.get("efficiency")) else "n/a"
                      for r in rows]
        # one process is 100% by definition: its label would only stack on the others'
        text = ["" if k == 1 else e.replace("n/a", "") for k, e in zip(n, efficiency)]
        fig.add_trace(go.Scatter(x=n, y=[r["per_s"] if is_real(r.get("per_s")) else None
                                         for r in rows], name=label,
                                 mode="lines+markers+text", text=text, customdata=efficiency,
                                 textposition="top left", line=dict(color=color),
                                 hovertemplate="%{x} processes: %{y:,.0f}/s<br>"
                                               "scaling efficiency %{customdata}<extra>" + label
                                               + "</extra>"))
        one = next((r["per_s"] for r in rows if r["world_size"] == 1
                    and is_real(r.get("per_s"))), None)
        if one is not None and len(n) > 1:
            fig.add_trace(go.Scatter(x=n, y=[one * k for k in n], name=f"{label}: perfect",
                                     mode="lines", line=dict(color=color, dash="dot"),
                                     hoverinfo="skip"))
    units = {r.get("unit", "examples") for r in summary}
    unit = units.pop() if len(units) == 1 else "examples"
    sizes = sorted({r["world_size"] for r in summary})
    fig = styled(fig, title, "processes (GPUs, or CPU processes in the quick profile)",
                 f"throughput ({unit}/s, whole world)")
    fig.update_xaxes(tickmode="array", tickvals=sizes)
    return fig


def memory_per_rank_figure(rows: Sequence[Dict[str, Any]],
                           world_size: Optional[int] = None,
                           title: str = "What each rank holds") -> go.Figure:
    """Lesson 06: per-rank parameters, gradients and optimizer state (stacked, MiB) per run.

    ``rows``: ``SweepResult.rows`` (one per rank). Only ``world_size`` (default: the largest in
    ``rows``) is shown. Where peak memory was measured (GPUs), a diamond marks each rank's peak.
    """
    if not rows:
        raise ValueError("rows must hold at least one per-rank row")
    if world_size is None:
        world_size = max(r["world_size"] for r in rows)
    sizes = sorted({r["world_size"] for r in rows})
    if world_size not in sizes or isinstance(world_size, bool):  # 0 chose the largest silently
        raise ValueError(f"world_size must be one of the sizes in rows {sizes} (None: the "
                         f"largest); got {world_size!r}")
    chosen = [r for r in rows if r["world_size"] == world_size]
    x = [f"{r['label']}<br>rank {r['rank']}" for r in chosen]
    fig = go.Figure()
    for key, name, color in _L06_PARTS:
        fig.add_trace(go.Bar(x=x, y=[r[key] for r in chosen], name=name, marker_color=color,
                             hovertemplate="%{y:,.1f} MiB<extra>" + name + "</extra>"))
    peaks = [r.get("peak_gib") for r in chosen]
    if any(is_real(p) for p in peaks):
        fig.add_trace(go.Scatter(x=x, y=[p * 1024 if is_real(p) else None for p in peaks],
                                 name="peak allocated", mode="markers",
                                 marker=dict(symbol="diamond", size=11, color="#111111"),
                                 hovertemplate="%{y:,.0f} MiB<extra>peak allocated</extra>"))
    fig.update_layout(barmode="stack")
    return styled(fig, f"{title} ({plural(world_size, 'process', 'processes')})", "run and rank",
                  "memory per rank (MiB)")
