"""Measured rows: ratios between rows, the published form of a table, finding a row by its
configuration, and a results document (rows plus what produced them). ``noisy``, the status
of a row whose repeats disagree, is ``tables.noisy``, the one place tables write it."""
from __future__ import annotations

import datetime
import platform
from typing import Dict, List, Optional, Sequence, TypedDict

import torch

from amp_lessons.numerics.precision import as_device
from amp_lessons.lineage import traced
from amp_lessons.tables import json_safe, noisy, percent, spread_text


class MeasuredRow(TypedDict, total=False):
    """The one result type of a measured row (``runner.measure`` returns one; every key is present,
    None where not measured). ``status``: "ok", "skipped", "out of memory" or "error"."""

    label: str
    status: str
    reason: str
    img_per_s: Optional[float]
    step_ms: Optional[float]
    step_ms_q1: Optional[float]
    step_ms_q3: Optional[float]
    spread: Optional[float]          # how much the repeats disagree (timer.repeat_spread)
    peak_allocated_gib: Optional[float]
    peak_reserved_gib: Optional[float]
    params_gib: Optional[float]
    grads_gib: Optional[float]
    optimizer_state_gib: Optional[float]
    activations_gib: Optional[float]
    activations_allocated_gib: Optional[float]
    loss: Optional[float]
    gpu_busy_ms: Optional[float]
    gpu_idle_fraction: Optional[float]
    timer: Optional[str]
    steps: Optional[int]
    warmup: Optional[int]
    seconds: Optional[float]
    config: Dict[str, object]        # the BenchConfig as a dict


@traced
def with_ratios(rows: Sequence[Dict[str, object]], baseline: str) -> List[Dict[str, object]]:
    """Copies of ``rows`` with ``speedup`` (img/s over the baseline's) and ``memory_ratio``.

    ``baseline`` is the label of a row of the same run. A ratio is None where a number is missing.
    """
    base = next((r for r in rows if r["label"] == baseline), None)
    if base is None:
        raise ValueError(f"baseline must be the label of one of the rows; got {baseline!r}")
    return [dict(r, speedup=ratio(r.get("img_per_s"), base.get("img_per_s")),
                 memory_ratio=ratio(r.get("peak_allocated_gib"), base.get("peak_allocated_gib")))
            for r in rows]


def ratio(a, b) -> Optional[float]:
    """``a / b``, or None where either is missing (or ``b`` is 0): a ratio of two rows' numbers."""
    return a / b if a is not None and b else None


DEFAULT_COLUMNS = (("label", "configuration"), ("img_per_s", "img/s"),
                   ("speedup", "x fp32"), ("peak_allocated_gib", "peak GiB"),
                   ("memory_ratio", "mem x fp32"), ("activations_gib", "act. GiB"),
                   ("optimizer_state_gib", "opt. GiB"),
                   ("gpu_idle_fraction", "GPU idle", lambda v: percent(v, 1.0)),
                   ("spread", "repeat spread", spread_text),
                   ("status", "status"))


@traced
def published_rows(rows: Sequence[Dict[str, object]], columns=DEFAULT_COLUMNS) -> List[Dict[str, object]]:
    """Rows keyed by column heading, for ``report.publish`` (the README's results section): the
    columns and status text of ``tables.text_table``; numbers stay numbers, except in a column
    with a format function (a share: ``"0.61%"``, never rounded to zero), which gives its text.
    A row whose repeats disagree by over 10% says so in its status (``noisy``)."""
    columns = [c for c in columns if any(c[0] in r for r in rows)]
    if not columns:
        raise ValueError("columns must name at least one key present in the rows")

    def cell(r, c):
        v = r.get(c[0])
        if c[0] == "status" and v != "ok" and r.get("reason"):
            return f"{v}: {r['reason']}"
        if c[0] == "status" and v == "ok" and noisy(r):
            return f"ok ({noisy(r)})"
        return c[2](v) if len(c) > 2 and callable(c[2]) and v is not None else v
    return [{c[1]: cell(r, c) for c in columns} for r in rows]


def find_row(rows: Sequence[Dict[str, object]], **match) -> Optional[Dict[str, object]]:
    """The first row whose configuration has every ``key=value`` in ``match`` (None if none)."""
    for r in rows:
        cfg = r.get("config", {})
        if all(cfg.get(k) == v for k, v in match.items()):
            return r
    return None


def results_document(rows: Sequence[Dict[str, object]], device=None,
                     **extra) -> Dict[str, object]:
    """Rows plus what produced them (GPU name, torch version, date) as JSON-ready data."""
    device = as_device(device)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine() or "CPU")
    doc = {"device": str(device), "device_name": name, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}
    doc.update(extra)
    doc["rows"] = [json_safe(r) for r in rows]
    return doc


MEMORY_COLUMNS = (("label", "configuration"), ("params_gib", "params GiB"),
                  ("grads_gib", "grads GiB"), ("optimizer_state_gib", "optimizer GiB"),
                  ("activations_gib", "saved activations GiB"),
                  ("peak_allocated_gib", "peak allocated GiB"),
                  ("peak_reserved_gib", "peak reserved GiB"))


