"""The doctor: the course's measurements run on any model, and what they say to do.

``al.doctor(model, batch)`` (this package is callable: it is ``doctor.run.doctor``) measures, on
the learner's device and on copies of the model (the model itself is never changed):

- ``ranges``: per layer, the range of activations and gradients and the share that would overflow
  or underflow in fp16, bf16, e4m3 and e5m2, gradients at the loss scale GradScaler would reach
  (lesson 01); the layers where fp16 overflows, with the value found;
- ``scale``: that loss scale and the advice (init_scale, growth_interval, or why bf16), checked
  with a few fp16 steps of the shared trainer (lesson 03);
- the dtype trace (``measure.dtype_trace``, lesson 02): the ops and layers autocast runs in 16 bits and in fp32;
- ``compiled``: eager against ``torch.compile`` forward (on a GPU, or with ``compile=True``);
- ``speed``: speed and peak memory per precision through the engine, gated (lesson 04);
- ``fp8``: the Linear layers where FP8 pays, from lesson 07's crossover width, or why not here;
- ``probes``, ``diagnose``: one forward and backward watched op by op, and the failure classes
  found (``findings.CLASSES``), each with its site, evidence and fix; ``weights``: 16-bit weights
  and optimizer state (lesson 08); ``training``: the learner's own step and checkpoint, when
  given; ``verdict``: the one line per device that says what to train in, first in the report;
- ``bench``: the doctor bench (its cases: ``bench_cases``).

The fp16 evidence (the fp16 forward and the trial) overrides what the ranges predict: an inf/NaN
there means fp16 is not safe, also when no layer's fp32 output passes 65,504; a model already
inf/NaN in fp32 is told so. A measurement that fails (a layer fp16 autocast cannot run on this
device) becomes a row or finding with its reason, never a lost report. It returns a
``report.DoctorReport``: a table in a notebook, JSON and a self-contained HTML page
(``ui.doctor_plots`` draws its figure). Command line: ``python -m amp_lessons doctor --model
MODULE:FACTORY``.
"""
from __future__ import annotations

import importlib
import sys
import types

__all__ = ["doctor", "DoctorReport"]
_PARTS = {"bench", "bench_cases", "compiled", "command", "diagnose", "findings", "fp8", "inputs",
          "probes", "ranges", "report", "run", "scale", "speed", "training", "verdict", "weights"}


def doctor(model, batch=None, loss_fn=None, optimizer=None, **kwargs):
    """See ``doctor.run.doctor``: measure ``model`` on ``batch`` (or ``inputs=`` and
    ``target=``); returns a ``DoctorReport`` whose ``verdict`` says what to train in."""
    from amp_lessons.doctor.run import doctor as _doctor

    return _doctor(model, batch, loss_fn=loss_fn, optimizer=optimizer, **kwargs)


def __getattr__(name: str):
    if name == "DoctorReport":
        from amp_lessons.doctor.report import DoctorReport

        return DoctorReport
    if name in _PARTS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``amp_lessons.doctor(model, batch)`` calls ``doctor``; the package's parts stay reachable
    as attributes (``amp_lessons.doctor.ranges``)."""

    def __call__(self, model, batch=None, loss_fn=None, optimizer=None, **kwargs):
        return doctor(model, batch, loss_fn=loss_fn, optimizer=optimizer, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
