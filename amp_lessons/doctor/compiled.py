"""Eager against ``torch.compile``: does compiling change the forward pass's numbers?

The model is compared in eval mode (dropout off, BatchNorm on its running statistics), so both
runs compute the same function; the compiler may reorder and fuse float operations, so small
differences are expected, and the table says how large they are per output.
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Dict, List, Optional

import torch
from torch import nn

from amp_lessons.numerics.modes import kept_modes
from amp_lessons.numerics.precision import autocast_for, precision_settings
from amp_lessons.doctor.scale import failure_text


def _outputs(out) -> Dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"output": out}
    if isinstance(out, dict):
        return {str(k): v for k, v in out.items() if isinstance(v, torch.Tensor)}
    if isinstance(out, (tuple, list)):
        return {f"output[{i}]": v for i, v in enumerate(out) if isinstance(v, torch.Tensor)}
    return {}


def compile_skip_reason(device) -> Optional[str]:
    """Why the comparison is not run on ``device`` (a sentence), or None when it is."""
    if not hasattr(torch, "compile") or not hasattr(torch, "_dynamo"):
        return f"this torch ({torch.__version__}) has no torch.compile"
    if torch.device(device).type != "cuda":
        return ("torch.compile is compared on a GPU only (compiling on a CPU takes minutes); "
                "pass compile=True to run it here anyway")
    return None


def compare_compiled(model: nn.Module, inputs, precisions=("fp32",),
                     device=None) -> List[Dict[str, object]]:
    """Per precision and output: the largest absolute difference between the eager and the
    compiled forward pass, relative to the output's largest magnitude, and the compile time.
    ``model`` is called as ``model(inputs)`` (the doctor's ``Call`` wrapper). A failure to
    compile becomes a row with ``status`` "error" and the reason."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    rows = []
    try:
        with kept_modes(model, False):  # each module's own mode comes back afterwards
            compiled = torch.compile(model)
            for precision in precisions:
                try:
                    with precision_settings(precision, device), torch.no_grad(), \
                            autocast_for(precision, device.type):
                        eager = _outputs(model(inputs))
                        t0 = time.perf_counter()
                        with warnings.catch_warnings():  # inductor's TF32 hint is about speed
                            warnings.filterwarnings("ignore", message=".*TensorFloat32")
                            got = _outputs(compiled(inputs))
                        seconds = time.perf_counter() - t0
                    for name, e in eager.items():
                        c = got.get(name)
                        diff = (c.float() - e.float()).abs() if c is not None else None
                        big = float(e.float().abs().max()) if e.numel() else 0.0
                        largest = (float(diff.max()) if diff is not None and diff.numel()
                                   else math.nan)
                        rows.append({"precision": precision, "output": name,
                                     "shape": "x".join(map(str, e.shape)),
                                     "max_abs_diff": largest,
                                     "max_rel_diff": largest / big if big else None,
                                     "compile_s": seconds, "status": "ok", "reason": ""})
                except Exception as exc:  # noqa: BLE001 - a finding
                    rows.append(error_row(precision, exc))
    finally:
        torch._dynamo.reset()
    return rows


def error_row(precision: str, exc: BaseException) -> Dict[str, object]:
    """The row of a precision whose compiled forward failed, with the reason."""
    return {"precision": precision, "output": "-", "shape": "-", "max_abs_diff": None,
            "max_rel_diff": None, "compile_s": None, "status": "error",
            "reason": failure_text(exc)}
