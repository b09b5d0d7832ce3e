"""amp-lessons: the companion package of an interactive course on mixed-precision training.

Each notebook starts with ``import amp_lessons as al; env = al.setup()``; the modules below hold the
loops, measurements, plots and widgets the lessons call (``al.formats``, ``al.trainer``, ...; each lesson's own experiments in ``al.lessons``). They
are imported on first use, so ``import amp_lessons`` stays fast.
"""
from __future__ import annotations

import importlib

from amp_lessons.env import Env, get_profile, probe, seed_everything, setup

__version__ = "0.1.0"
__all__ = ["Env", "get_profile", "probe", "seed_everything", "setup", "__version__"]

# ``al.<name>`` in the notebooks: the modules learners call, loaded on first use, by the name the
# lessons use (the folders ``train``, ``numerics``, ``measure``, ``publish`` are reachable too).
_MODULES = {
    "trainer": "train.trainer", "records": "train.records", "checkpoint": "train.checkpoint",
    "recipes": "train.recipes",
    "formats": "numerics.formats", "precision": "numerics.precision", "fp8": "numerics.fp8",
    "optim": "measure.optim",
    "distributed": "measure.distributed",
    "claims": "publish.claims", "report": "publish.report",
}
_FOLDERS = {"train", "numerics", "measure", "publish", "doctor", "exercises", "lessons", "ui",
            "cli", "data", "env", "models", "tables", "files"}


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f".{_MODULES[name]}", __name__)
    if name in _FOLDERS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'amp_lessons' has no attribute {name!r}")
