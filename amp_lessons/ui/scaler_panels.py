"""Lesson 03's panels: the scaler panel, the preset comparison and the gradient histogram
(``widgets``), each wired to the lesson's training runs (``train_with_scaler``, through
``panel_runner`` for the scaler panel), and a run's first steps as a table
(``show_step_table``; ``step_table_text``). The lesson module returns results; these show
them."""
from __future__ import annotations

from typing import Callable, List, Mapping, Optional

import numpy as np

from amp_lessons.measure.scaler_runs import (OverflowInjector, RunSetup, ScalerRun, measured_defaults,
                                             preset_note, train_with_scaler)
from amp_lessons.validate import is_int
from amp_lessons.publish.report import show_table
from amp_lessons.train.trainer import ScalerSettings
from amp_lessons.ui import widgets
from amp_lessons.ui.plots import pow2_text


def scaler_panel(setup: RunSetup = RunSetup(), steps: int = 60,
                 settings: Optional[ScalerSettings] = None, injection_rate: float = 0.0,
                 figure_mode: str = "auto", background: bool = True) -> widgets.ScalerPanel:
    """Lesson 03's scaler panel (``widgets.ScalerPanel``) over ``setup``'s runs, its knobs at
    ``settings`` (PyTorch's defaults, measured, when None)."""
    defaults = measured_defaults(setup.torch_device.type)
    return widgets.ScalerPanel(panel_runner(setup), defaults, steps=steps, settings=settings,
                               injection_rate=injection_rate, figure_mode=figure_mode,
                               background=background)


def panel_runner(setup: RunSetup = RunSetup()) -> Callable:
    """What a ``widgets.ScalerPanel`` runs: ``run(settings, steps, injection_rate, on_step)``
    trains ``setup``'s model with ``train_with_scaler`` (no evaluation), reading the injected
    overflow rate from the callable ``injection_rate`` before every step, and returns the
    ``ScalerRun``."""

    def run(settings: ScalerSettings, steps: int, injection_rate: Callable[[], float],
            on_step: Callable) -> ScalerRun:
        injector = OverflowInjector(float(injection_rate()), seed=setup.seed)

        def step(trainer, result):
            injector.rate = float(injection_rate())
            return on_step(trainer, result)

        return train_with_scaler(settings, steps, setup, name="panel", on_step=step,
                                 evaluate=False, injector=injector)

    return run


def preset_panel(presets: Mapping[str, ScalerSettings], steps: int = 100,
                 setup: RunSetup = RunSetup(), injection_rate: float = 0.0,
                 figure_mode: str = "auto", background: bool = True) -> widgets.PresetComparison:
    """The preset comparison panel (``widgets.PresetComparison``): each ticked preset trained
    by ``train_with_scaler`` on ``setup``'s seed and data; ``presets`` maps a name to its
    settings (lesson 03 passes ``l03_scaler.scaler_presets(...)``)."""
    if not isinstance(presets, Mapping) or not presets:
        raise ValueError(f"presets must be a non-empty mapping of name -> ScalerSettings, "
                         f"got {presets!r}")
    presets = dict(presets)

    def run(name: str, settings: ScalerSettings, n_steps: int, rate: float) -> ScalerRun:
        return train_with_scaler(settings, n_steps, setup, rate, name=name)

    return widgets.PresetComparison(presets, run, steps=steps, injection_rate=injection_rate,
                                    figure_mode=figure_mode, background=background,
                                    table_note=preset_note)


def histogram_panel(magnitudes_by_layer: Mapping[str, np.ndarray], scale_log2: int = 0,
                    fmt: str = "fp16", figure_mode: str = "auto") -> widgets.HistogramPanel:
    """The gradient histogram panel (``widgets.HistogramPanel``) over captured gradients
    (``capture_gradients``)."""
    return widgets.HistogramPanel(magnitudes_by_layer, scale_log2, fmt, figure_mode=figure_mode)



STEP_COLUMNS = (("step", "step"), ("scale", "scale used"), ("skipped", "skipped"),
                ("loss", "loss", ".4f"), ("update", "update() then"))
INJECTED_NOTE = "* an inf was injected into this step's gradients"


def step_rows(run: ScalerRun, first: int = 20) -> List[dict]:
    """The first ``first`` steps of a run, a row each (``STEP_COLUMNS``): the scale each step
    used, whether it was skipped (``yes*`` where an overflow was injected), its loss, and what
    ``update()`` then did to the scale (backed off, grew, or kept it)."""
    if not is_int(first) or first < 1:
        raise ValueError(f"first must be an integer >= 1; got {first!r}")
    nxt = run.scales[1:] + [run.final_scale]
    rows = []
    for i in range(min(first, len(run.steps))):
        s, after = run.scales[i], nxt[i]
        if after is None or after == s:
            what = "kept the scale"
        elif after < s:
            what = f"backed off x{after / s:g} -> {pow2_text(after)}"
        else:
            what = f"grew x{after / s:g} -> {pow2_text(after)}"
        skip = ("yes*" if run.injected[i] else "yes") if run.skipped[i] else "no"
        rows.append({"step": run.steps[i], "scale": pow2_text(s), "skipped": skip,
                     "loss": run.losses[i], "update": what})
    return rows


def step_table_text(run: ScalerRun, first: int = 20) -> str:
    """``step_rows`` as text, one line a step (and ``INJECTED_NOTE`` where an inf was injected)."""
    rows = step_rows(run, first)
    lines = [f"{'step':>4}  {'scale used':>16}  {'skipped':>7}  {'loss':>8}  update() then"]
    lines += [f"{r['step']:>4}  {r['scale']:>16}  {r['skipped']:>7}  {r['loss']:>8.4f}  {r['update']}"
              for r in rows]
    if any(r["skipped"] == "yes*" for r in rows):
        lines.append(INJECTED_NOTE)
    return "\n".join(lines)


def show_step_table(run: ScalerRun, first: int = 20) -> None:
    """``step_rows`` as the notebook's table (``report.show_table``: HTML, the text table as the
    fallback), with ``INJECTED_NOTE`` where an inf was injected."""
    rows = step_rows(run, first)
    show_table(rows, STEP_COLUMNS,
               note=INJECTED_NOTE if any(r["skipped"] == "yes*" for r in rows) else "")
