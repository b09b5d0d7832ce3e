"""Measured table rows in words and pairs: ``rows_caption`` (the settings of exactly these rows,
for the line above a verdict or a table) and ``layout_effects`` (per precision, NCHW against
channels_last). Lesson 04 shows both.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from amp_lessons.measure.config import STANDARD
from amp_lessons.measure.rows import find_row, ratio
from amp_lessons.numerics.precision import PRECISIONS
from amp_lessons.tables import plural


def layout_effects(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per precision: img/s with NCHW and with channels_last (standard optimizer), and the gain."""
    out = []
    for precision in PRECISIONS:
        pair = [r for r in (find_row(rows, precision=precision, channels_last=cl,
                                     optimizer=STANDARD["optimizer"], impl=STANDARD["impl"],
                                     compile=None, cuda_graph=False) for cl in (False, True))]
        if None in pair or pair[0]["config"]["model"].endswith("-selective"):
            continue
        a, b = pair[0].get("img_per_s"), pair[1].get("img_per_s")
        out.append({"label": pair[0]["label"], "nchw_img_per_s": a, "channels_last_img_per_s": b,
                    "channels_last_gain": ratio(b, a)})
    return out


LAYOUT_COLUMNS = (("label", "precision"), ("nchw_img_per_s", "NCHW img/s"),
                  ("channels_last_img_per_s", "channels_last img/s"),
                  ("channels_last_gain", "gain x"))


def rows_caption(*rows: Dict[str, object]) -> str:
    """The settings of exactly these table rows in words, generated from their configurations
    (memory format, precision, optimizer, cuDNN autotuning, steps): the line above a verdict or
    a published table, so a caption never names a setting its rows did not use."""
    if not rows or any(not isinstance(r, dict) for r in rows):
        raise ValueError("rows must hold at least one measured table row")
    cfgs = [r.get("config") or {} for r in rows]

    def values(key, show):
        return "/".join(dict.fromkeys(show(c.get(key)) for c in cfgs))
    opt = values("optimizer", lambda v: {"sgd": "SGD (momentum 0.9)", "adam": "Adam",
                                         "adamw": "AdamW"}.get(v, str(v)))
    impl = values("impl", str)
    steps = min(int(r.get("steps") or 0) for r in rows)
    warmup = min(int(r.get("warmup") or 0) for r in rows)
    return (f"{values('channels_last', lambda v: 'channels_last' if v else 'NCHW')}, "
            f"{values('label', str).replace('/', ' / ')}; cuDNN autotuning "
            f"{values('cudnn_benchmark', lambda v: 'on' if v else 'off')}, {impl} {opt}, median "
            f"of {plural(steps, 'timed step')} after {warmup} warm-up")
