"""Lesson 03's panels: the scaler panel, the preset comparison and the gradient histogram
(``widgets``), each wired to the lesson's training runs (``l03_scaler.panel_runner``,
``train_with_scaler``), and a run's first steps as text (``step_table_text``). The lesson module
returns results; these show them."""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from ..lessons.l03_scaler import (PRESET_NOTE, RunSetup, ScalerRun, measured_defaults,
                                  panel_runner, scaler_presets, train_with_scaler)
from .._validate import is_int
from ..trainer import ScalerSettings
from . import widgets
from .plots import pow2_text


def scaler_panel(setup: RunSetup = RunSetup(), steps: int = 60,
                 settings: Optional[ScalerSettings] = None, injection_rate: float = 0.0,
                 figure_mode: str = "auto", background: bool = True) -> widgets.ScalerPanel:
    """Lesson 03's scaler panel (``widgets.ScalerPanel``) over ``setup``'s runs, its knobs at
    ``settings`` (PyTorch's defaults, measured, when None)."""
    defaults = measured_defaults(setup.torch_device.type)
    return widgets.ScalerPanel(panel_runner(setup), defaults, steps=steps, settings=settings,
                               injection_rate=injection_rate, figure_mode=figure_mode,
                               background=background)


def preset_panel(presets: Optional[Mapping[str, ScalerSettings]] = None, steps: int = 100,
                 setup: RunSetup = RunSetup(), injection_rate: float = 0.0,
                 figure_mode: str = "auto", background: bool = True) -> widgets.PresetComparison:
    """The preset comparison panel (``widgets.PresetComparison``): each ticked preset trained
    by ``train_with_scaler`` on ``setup``'s seed and data (``scaler_presets`` when None)."""
    presets = dict(presets or scaler_presets(setup.torch_device.type))

    def run(name: str, settings: ScalerSettings, n_steps: int, rate: float) -> ScalerRun:
        return train_with_scaler(settings, n_steps, setup, rate, name=name)

    return widgets.PresetComparison(presets, run, steps=steps, injection_rate=injection_rate,
                                    figure_mode=figure_mode, background=background,
                                    table_note=PRESET_NOTE)


def histogram_panel(magnitudes_by_layer: Mapping[str, np.ndarray], scale_log2: int = 0,
                    fmt: str = "fp16", figure_mode: str = "auto") -> widgets.HistogramPanel:
    """The gradient histogram panel (``widgets.HistogramPanel``) over captured gradients
    (``capture_gradients``)."""
    return widgets.HistogramPanel(magnitudes_by_layer, scale_log2, fmt, figure_mode=figure_mode)



def step_table_text(run: ScalerRun, first: int = 20) -> str:
    """The first ``first`` steps of a run as text: the scale each step used, whether it was
    skipped (and whether an overflow was injected), and what ``update()`` then did to the scale
    (backed off, grew, or kept it)."""
    if not is_int(first) or first < 1:
        raise ValueError(f"first must be an integer >= 1; got {first!r}")
    nxt = run.scales[1:] + [run.final_scale]
    lines = [f"{'step':>4}  {'scale used':>16}  {'skipped':>7}  {'loss':>8}  update() then"]
    for i in range(min(first, len(run.steps))):
        s, after = run.scales[i], nxt[i]
        if after is None or after == s:
            what = "kept the scale"
        elif after < s:
            what = f"backed off x{after / s:g} -> {pow2_text(after)}"
        else:
            what = f"grew x{after / s:g} -> {pow2_text(after)}"
        skip = ("yes*" if run.injected[i] else "yes") if run.skipped[i] else "no"
        lines.append(f"{run.steps[i]:>4}  {pow2_text(s):>16}  {skip:>7}  {run.losses[i]:>8.4f}  {what}")
    if any(run.injected[:first]):
        lines.append("* an inf was injected into this step's gradients")
    return "\n".join(lines)

