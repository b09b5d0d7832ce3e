"""Graded exercises, one module per lesson (``ex01`` ... ``ex09``), and the capstone's graders
(``capstone``: the learner's whole mixed-precision setup for a model the lessons never used).

Each ``check_*`` function grades what a learner wrote in an ``exercise`` cell with the package's
own functions and returns a ``Check`` that reads "passed", "wrong" (what is wrong, and the hint
for that mistake), "not answered yet" (with the first hint) or "skipped" (why it cannot run
here). Hints come in levels, from a nudge to a near-answer: each module's ``HINTS`` holds them and
``exNN.hint(name, level)`` reads one (``ex02.hint("loop", 2)``); in JupyterLab a check's later
levels unfold on a click. Each module also holds its reference solutions (``reference_*``) and
typical wrong answers (``WRONG_*``), which ``tests/test_exercises_*.py`` run. The engine's layer:
no lesson module, no claim.
"""
from amp_lessons.exercises import capstone
from amp_lessons.exercises import ex01
from amp_lessons.exercises import ex02
from amp_lessons.exercises import ex03
from amp_lessons.exercises import ex04
from amp_lessons.exercises import ex05
from amp_lessons.exercises import ex06
from amp_lessons.exercises import ex07
from amp_lessons.exercises import ex08
from amp_lessons.exercises import ex09
from amp_lessons.exercises.check import Check, Hints

MODULES = {"ex01": ex01, "ex02": ex02, "ex03": ex03, "ex04": ex04, "ex05": ex05, "ex06": ex06,
           "ex07": ex07, "ex08": ex08, "ex09": ex09}

__all__ = ["Check", "Hints", "MODULES", "capstone", "ex01", "ex02", "ex03", "ex04", "ex05", "ex06", "ex07",
           "ex08", "ex09"]
