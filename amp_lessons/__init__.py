"""amp-lessons: the companion package of an interactive course on mixed-precision training.

Each notebook starts with ``import amp_lessons as al; env = al.setup()``; the modules below hold the
loops, measurements, plots and widgets the lessons call (``al.formats``, ``al.trainer``, ...; each lesson's own experiments in ``al.lessons``). They
are imported on first use, so ``import amp_lessons`` stays fast.
"""
from __future__ import annotations

import importlib

from .env import Env, get_profile, probe, seed_everything, setup

__version__ = "0.1.0"
__all__ = ["Env", "get_profile", "probe", "seed_everything", "setup", "__version__"]

_SUBMODULES = {"checkpoint", "claims", "cli", "data", "distributed", "doctor", "env", "formats",
               "lessons",
               "bench", "measure", "models", "precision", "recipes", "records", "report", "runner", "tables",
               "trainer", "ui"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'amp_lessons' has no attribute {name!r}")
