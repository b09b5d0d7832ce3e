"""Plotly figure builders: pure functions from data to a ``go.Figure``.

Every figure has a title, axis titles with units, and a legend where there is more than one
trace; ``widgets.py`` wraps these in live panels. Each function names the lesson that uses it.
"""
from __future__ import annotations

import plotly.graph_objects as go

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
