"""The exercise cells in the lesson notebooks: three graded exercises per lesson, each followed
by its check; Questions, then Further research, then Checks; every section ends with its
takeaway; and an answer written like the reference finds its modules imported."""
import ast
import re
import importlib.util
import inspect
import textwrap
from pathlib import Path

import nbformat
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons as al
from amp_lessons.exercises import MODULES
from amp_lessons.exercises import check as common
from amp_lessons.exercises import ex01, ex02, ex03, ex04, ex05, ex06, ex07, ex08, ex09
from amp_lessons.train.trainer import ScalerSettings
from exercise_helpers import INF, NAN, assert_unanswered, assert_wrong, fresh_attempts, status  # noqa: F401


ROOT = Path(__file__).resolve().parent.parent


LESSONS_WITH_EXERCISES = sorted(ROOT.glob("notebooks/0[1-9]_*.ipynb"))


@pytest.mark.parametrize("path", LESSONS_WITH_EXERCISES, ids=lambda p: Path(p).name[:2])
def test_each_lesson_has_three_graded_exercises_then_questions_further_research_and_checks(path):
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    exercises = [i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])]
    assert len(exercises) >= 3, f"{path.name}: {len(exercises)} exercise cells"
    module = f"ex{path.name[:2]}."
    for i in exercises:
        check = cells[i + 1]
        assert check.cell_type == "code" and module in check.source and "check_" in check.source, \
            f"{path.name}: the cell after exercise cell {i} does not grade it"
    heads = [c.source.splitlines()[0] for c in cells if c.cell_type == "markdown" and c.source]
    sections = [h for h in heads if h.startswith("## ")]
    assert sections[-3:] == ["## Questions", "## Further research", "## Checks"], sections[-3:]
    further = next(c.source for c in cells if c.cell_type == "markdown"
                   and c.source.startswith("## Further research"))
    prompts = [line for line in further.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
    doing = re.compile(r"\b(measure|time|count|run|find|compare|plan|train|sweep|print)", re.I)
    assert 2 <= len(prompts) <= 3 and all(doing.search(p) for p in prompts), prompts
    questions = next(c.source for c in cells if c.cell_type == "markdown"
                     and c.source.startswith("## Questions"))
    assert 5 <= questions.count("<details>") <= 10
    assert questions.count("<details>") == questions.count("</details>")


def _sections_without_takeaway(path):
    """The ``## `` sections of a notebook whose last markdown line, before the section's
    exercises (``### Exercise ...`` subsections, which come after what they practise; the takeaway
    may stand before or after them), is not a ``**Takeaway:**`` line. Questions and Checks are no teaching sections, and the Summary is a
    list of takeaways."""
    nb = nbformat.read(path, as_version=4)
    lines = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()]
    sections, current, last, in_exercise = [], None, "", False
    for line in lines + ["## end"]:
        if line.startswith("## "):
            if current and current not in ("## Questions", "## Further research", "## Checks",
                                           "## Summary"):
                sections.append((current, last.startswith("**Takeaway:**")))
            current, last, in_exercise = line, "", False
        elif line.startswith("### "):
            in_exercise = line.startswith("### Exercise")
            if not in_exercise:
                last = line
        elif line.startswith("**Takeaway:**") or (line.strip() and not in_exercise):
            last = line
    return [s for s, ok in sections if not ok]


@pytest.mark.parametrize("path", LESSONS_WITH_EXERCISES, ids=lambda p: Path(p).name[:2])
def test_every_section_of_every_lesson_ends_with_a_takeaway(path):
    assert _sections_without_takeaway(path) == []


def test_a_section_without_its_takeaway_is_found(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## 1. A\n\ntext\n\n**Takeaway:** one line."),
        nbformat.v4.new_markdown_cell("## 2. B\n\n**Claim:** a verdict alone."),
        nbformat.v4.new_markdown_cell("## 3. C\n\n**Takeaway:** first.\n\n### Exercise 1\n\nDo it."),
        nbformat.v4.new_markdown_cell("## 4. D\n\n**Takeaway:** x.\n\n### More\n\nNew text."),
        nbformat.v4.new_markdown_cell("## Questions\n\nQ"), nbformat.v4.new_markdown_cell("## Checks")])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert _sections_without_takeaway(path) == ["## 2. B", "## 4. D"]


def _bound_names(sources) -> set:
    """Names that code cells bind (imports, assignments, definitions, loop and with targets);
    IPython's %magic and !shell lines are left out."""
    names = set()
    for source in sources:
        code = "\n".join(line for line in source.splitlines()
                         if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
    return names


def _modules_a_solution_uses(module) -> set:
    """The modules (``torch``, ``math``...) that the bodies of an exercise module's reference
    solutions use by a global name: what a learner's answer, written like the reference, needs."""
    used = set()
    for name, fn in vars(module).items():
        if not (name.startswith("reference_") and callable(fn)):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        body = ast.Module(body=tree.body[0].body, type_ignores=[])  # not the annotations
        for node in ast.walk(body):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                    and inspect.ismodule(getattr(module, node.id, None)):
                used.add(node.id)
    return used


@pytest.mark.parametrize("path", LESSONS_WITH_EXERCISES, ids=lambda p: Path(p).name[:2])
def test_an_answer_written_like_the_reference_finds_its_modules_in_the_notebook(path):
    # A learner writes `torch.` in an exercise cell: the lesson must have imported it by then
    # (lessons 05, 07 and 08 had not: a right answer failed with NameError: name 'torch').
    from amp_lessons import exercises
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if "exercise" in c.metadata.get("tags", []))
    bound = _bound_names(c.source for c in nb.cells[:first] if c.cell_type == "code")
    needed = _modules_a_solution_uses(exercises.MODULES[f"ex{path.name[:2]}"])
    assert needed - bound == set(), f"{path.name}: import {sorted(needed - bound)} before cell {first}"


def test_the_module_finder_sees_torch_in_a_reference_and_the_binder_sees_imports(tmp_path):
    (tmp_path / "exfake.py").write_text(
        "import math\nimport torch\nfrom torch import nn\n\n"
        "def reference_x(t: nn.Module):\n    return torch.zeros(1) + math.pi\n\n"
        "def helper(t):\n    return nn.Identity()(t)\n")
    spec = importlib.util.spec_from_file_location("exfake", tmp_path / "exfake.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert _modules_a_solution_uses(module) == {"torch", "math"}
    assert _bound_names(["%matplotlib inline\nimport torch.nn as nn\nfrom math import pi\nx = 1"]) \
        == {"nn", "pi", "x"}
