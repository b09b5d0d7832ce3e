"""Figures (``plots``: pure plotly builders) and panels (``widgets``: ipywidgets), built on the engine."""
