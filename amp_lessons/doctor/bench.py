"""The doctor bench: the doctor run on small reproductions of each failure class and on healthy
models, scored as diagnosed / missed / false alarm, beside the two tools a user would otherwise
reach for.

A ``Case`` builds a model and the doctor's arguments, and says what a right diagnosis is: an
alarm of one of ``classes`` whose site contains ``site`` (a healthy case has no classes: any
alarm there is a false alarm). The cases are in ``bench_cases``; lesson 09
runs them from there.

The two baselines, run on the same model and batch under fp16 autocast:

- ``hooks_baseline``: forward hooks that record each module's output abs-min and abs-max and stop
  at the first module whose output holds inf/NaN, as transformers' ``DebugUnderflowOverflow``
  does (it also reports absmax above fp16's range, which a forward hook sees as inf);
- ``anomaly_baseline``: the forward and backward under ``torch.autograd.detect_anomaly()``, which
  raises at the first backward function that returns NaN and names it.

Each says what it found (a module or backward function) or that it found nothing; a baseline
"found" the case where its finding contains the case's site (or, for a backward function, the
case's ``anomaly`` name).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from amp_lessons.measure.dtype_trace import first_tensor

QUICK_DOCTOR = dict(precisions=(), trial_steps=1, compile=False)


@dataclass
class Case:
    """One bench case: ``build()`` returns ``(model, doctor keyword arguments)`` (the batch among
    them: ``batch=`` or ``inputs=``/``target=``); ``classes``: the alarm classes a right
    diagnosis has (empty for a healthy model); ``site``: text the alarm's site must contain;
    ``what``: the problem in words; ``anomaly``: the backward function detect_anomaly should name
    for this case, where it can."""

    name: str
    build: Callable[[], Tuple[nn.Module, Dict[str, object]]]
    classes: Tuple[str, ...] = ()
    site: str = ""
    what: str = ""
    anomaly: str = ""
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        """True for a model on which the doctor must raise no alarm."""
        return not self.classes


def score(case: Case, report) -> Dict[str, object]:
    """``diagnosed`` / ``missed`` (a problem case) or ``clean`` / ``false alarm`` (a healthy one),
    with the alarms the report raised."""
    alarms = report.alarms()
    shown = [f"{a['class']} at {a['site']}" for a in alarms]
    if case.healthy:
        verdict = "false alarm" if alarms else "clean"
    else:
        hit = [a for a in alarms if a["class"] in case.classes
               and case.site.lower() in str(a["site"]).lower()]
        verdict = "diagnosed" if hit else "missed"
    return {"case": case.name, "problem": case.what or "healthy model",
            "expected": ", ".join(case.classes) or "no alarm", "doctor": verdict,
            "alarms": "; ".join(shown) or "none", "verdict": report.verdict.get("text", "")}


def _batch(kwargs: Dict[str, object]):
    """``(call, target)``: a function running the model on the case's inputs, and the target."""
    if "inputs" in kwargs:
        x, y = kwargs["inputs"], kwargs.get("target")
    else:
        b = kwargs["batch"]
        x, y = (b if isinstance(b, (tuple, list)) and len(b) == 2 and
                not isinstance(b[0], (int, float)) else (b, None))
    def call(model):
        if isinstance(x, dict):
            return model(**x)
        if isinstance(x, (tuple, list)):
            return model(*x)
        return model(x)
    return call, y


def _loss(case_kwargs, out, y):
    loss_fn = case_kwargs.get("loss_fn")
    out = first_tensor(out) if not isinstance(out, torch.Tensor) else out
    if loss_fn is not None and y is not None:
        return loss_fn(out, y)
    return out.float().pow(2).mean()


def hooks_baseline(model: nn.Module, kwargs: Dict[str, object]) -> str:
    """Forward hooks on every module recording abs-min/abs-max of its output under fp16 autocast,
    as ``DebugUnderflowOverflow`` does; the first module whose output holds inf/NaN, or
    "nothing found"."""
    import copy

    model = copy.deepcopy(model).float()
    found: List[str] = []
    handles = []

    def hook(name):
        def fn(module, inputs, output):
            t = first_tensor(output)
            if t is None or not t.is_floating_point() or found:
                return
            if not bool(torch.isfinite(t).all()):
                found.append(f"{name} ({type(module).__name__}): inf/NaN in its output")
        return fn

    for name, m in model.named_modules():
        handles.append(m.register_forward_hook(hook(name or type(model).__name__)))
    call, _ = _batch(kwargs)
    device_type = next(model.parameters()).device.type
    try:
        with torch.no_grad(), torch.autocast(device_type, dtype=torch.float16):
            call(model)
    except Exception as exc:  # noqa: BLE001 - what the tool shows the user
        return f"the forward raised {type(exc).__name__}"
    finally:
        for h in handles:
            h.remove()
    # the hooks fire innermost first: the first entry is the innermost module with inf/NaN
    return found[0] if found else "nothing found"


def anomaly_baseline(model: nn.Module, kwargs: Dict[str, object]) -> str:
    """One fp16 autocast forward and backward under ``torch.autograd.detect_anomaly()``: the
    backward function it names, the error the pass raised, or "nothing found"."""
    import copy

    model = copy.deepcopy(model).float()
    call, y = _batch(kwargs)
    device_type = next(model.parameters()).device.type
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():
                with torch.autocast(device_type, dtype=torch.float16):
                    loss = _loss(kwargs, call(model), y)
                loss.backward()
    except Exception as exc:  # noqa: BLE001
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return text[:160]
    return "nothing found"


def run(cases: Sequence[Case], doctor: Callable, baselines: bool = False
        ) -> List[Dict[str, object]]:
    """Each case through ``doctor`` (``amp_lessons.doctor``) at the bench's quick settings
    (``QUICK_DOCTOR``, the case's own arguments over them), scored; with ``baselines``, the two
    baseline tools' findings beside it and whether each found the case's site."""
    rows = []
    for case in cases:
        model, kwargs = case.build()
        t0 = time.perf_counter()
        report = doctor(model, **{**QUICK_DOCTOR, **kwargs})
        row = score(case, report)
        row["seconds"] = time.perf_counter() - t0
        if baselines:
            hooks, anomaly = hooks_baseline(model, kwargs), anomaly_baseline(model, kwargs)
            row.update(hooks=hooks, anomaly=anomaly,
                       hooks_found=_found(case, hooks), anomaly_found=_found(case, anomaly))
        rows.append(row)
    return rows


def _found(case: Case, text: str) -> str:
    if text == "nothing found":
        return "clean" if case.healthy else "missed"
    if case.healthy:
        return "false alarm"
    names = [n for n in (case.site, case.anomaly) if n]
    return "found" if any(n.lower() in text.lower() for n in names) else "flagged elsewhere"


def tally(rows: Sequence[Dict[str, object]], key: str = "doctor") -> Dict[str, int]:
    """How many rows read each outcome in column ``key``."""
    out: Dict[str, int] = {}
    for r in rows:
        out[str(r[key])] = out.get(str(r[key]), 0) + 1
    return out
