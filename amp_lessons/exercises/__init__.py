"""Graded exercises, one module per lesson (``ex01`` ... ``ex07``).

Each ``check_*`` function grades what a learner wrote in an ``exercise`` cell with the package's
own functions and returns a ``Check`` that reads "passed", "wrong" (what is wrong, and a hint),
"not answered yet" (with the hint) or "skipped" (why it cannot run here). Each module also holds
its reference solutions (``reference_*``) and typical wrong answers (``WRONG_*``), which
``tests/test_exercises.py`` runs. The engine's layer: no lesson module, no claim.
"""
from . import ex01, ex02, ex03, ex04, ex05, ex06, ex07
from .check import Check

__all__ = ["Check", "ex01", "ex02", "ex03", "ex04", "ex05", "ex06", "ex07"]
