"""The package's layout rules (issue 11), as tests: engine and ui never mention a claim, lessons
define no torch abstraction, one import block per module, no private names across modules, each
notebook calls its own lesson module, and the README's module table matches the code."""
import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "amp_lessons"
ENGINE = (sorted(p for p in PKG.glob("*.py")) + sorted((PKG / "ui").glob("*.py"))
          + sorted((PKG / "doctor").glob("*.py")) + sorted((PKG / "bench").glob("*.py"))
          + sorted((PKG / "exercises").glob("*.py")))  # the graders are engine-side
LESSONS = sorted((PKG / "lessons").glob("l[0-9][0-9]_*.py"))
ALL = ENGINE + LESSONS + [PKG / "lessons" / "__init__.py"]
CLAIM_ID = re.compile(r"\b(claim_[a-z0-9]+|[RB]\d{1,2}[a-d]?)\b")
MAX_ENGINE_LINES = 900
MAX_LESSON_LINES = 700


def rel(p: Path) -> str:
    return str(p.relative_to(PKG))


@pytest.mark.parametrize("path", [p for p in ENGINE if p.name != "claims.py"], ids=rel)
def test_engine_and_ui_modules_never_mention_a_claim_id(path):
    found = sorted({m.group(0) for m in CLAIM_ID.finditer(path.read_text())})
    assert not found, f"{rel(path)} mentions {found}: claims live in claims.py and the lessons"


@pytest.mark.parametrize("path", ENGINE, ids=rel)
def test_engine_modules_stay_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_ENGINE_LINES, f"{rel(path)} has {n} lines (at most about {MAX_ENGINE_LINES})"


UI_LIBRARIES = ("ipywidgets", "plotly")


def _ui_imports(source: str):
    """(line, module) of every import of ipywidgets, plotly or any ``ui`` module (each imports
    plotly or ipywidgets) in ``source``, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if isinstance(node, ast.ImportFrom) and (node.module or "").lstrip(".") == "ui":
            names += [f"ui.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] in UI_LIBRARIES or name.lstrip(".") == "ui" \
                    or name.lstrip(".").startswith("ui."):  # any ui module pulls in plotly
                found.append((node.lineno, name))
    return found


@pytest.mark.parametrize("path", LESSONS, ids=rel)
def test_lesson_modules_stay_under_700_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LESSON_LINES, (f"{rel(path)} has {n} lines (at most {MAX_LESSON_LINES}): move "
                                   f"measurement code to bench/, figures to ui/, table shaping to "
                                   f"tables.py")


@pytest.mark.parametrize("path", LESSONS, ids=rel)
def test_lesson_modules_import_neither_ipywidgets_nor_plotly(path):
    """Lessons return results; ``ui/`` draws them (figures and panels)."""
    found = _ui_imports(path.read_text())
    assert not found, f"{rel(path)} imports {found}: figures and panels live in ui/"


ENGINE_ONLY = re.compile(r"cuda\.Event|memory_(allocated|reserved|stats)|reset_peak_memory_stats|"
                         r"OutOfMemoryError|empty_cache|gc\.collect|mem_get_info|profile\(activities|"
                         r"set_per_process_memory_fraction|cuda\.synchronize|timeit|"
                         r"time\.(perf_counter|perf_counter_ns|monotonic|process_time|time)\(")


@pytest.mark.parametrize("path", LESSONS, ids=rel)
def test_lesson_modules_define_no_timing_memory_or_out_of_memory_logic(path):
    """Timers, peak-memory counters, out-of-memory handling and memory release live in bench/."""
    found = sorted({m.group(0) for m in ENGINE_ONLY.finditer(path.read_text())})
    assert not found, f"{rel(path)} uses {found}: measure through amp_lessons.measure"


def test_the_engine_only_rule_sees_every_timer_and_memory_counter():
    for line in ("torch.cuda.max_memory_allocated(d)", "torch.cuda.memory_allocated(d)",
                 "torch.cuda.memory_reserved()", "torch.cuda.memory_stats(d)",
                 "torch.cuda.synchronize(d)", "t = time.monotonic()", "time.perf_counter_ns()",
                 "time.process_time()", "import timeit", "except torch.OutOfMemoryError:"):
        assert ENGINE_ONLY.search(line), line
    assert not ENGINE_ONLY.search("rows = bench.measure(config, device)  # timed by the engine")


def test_the_ui_import_rule_sees_every_form():
    assert [m for _, m in _ui_imports("import plotly.graph_objects as go")] == ["plotly.graph_objects"]
    assert _ui_imports("def f():\n    import ipywidgets as w\n")
    assert _ui_imports("from ..ui import widgets\n")
    assert _ui_imports("from ..ui.widgets import ScalerPanel\n")
    assert _ui_imports("from ..ui.plots import pow2_text\nimport torch\n")  # plots imports plotly
    assert not _ui_imports("from ..tables import pow2_text\nimport torch\n")


TORCH_BASES = {"Module", "Function", "Optimizer", "_LRScheduler", "LRScheduler", "Dataset",
               "Sampler", "DataLoader", "autograd.Function", "nn.Module"}


@pytest.mark.parametrize("path", LESSONS, ids=rel)
def test_lesson_modules_define_no_torch_abstraction(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
            assert not bases & TORCH_BASES, \
                f"{rel(path)}: class {node.name} subclasses {bases & TORCH_BASES}; put it in the engine"


@pytest.mark.parametrize("path", ALL, ids=rel)
def test_one_import_block_and_no_private_names_across_modules(path):
    tree = ast.parse(path.read_text())
    seen_code = False
    for node in tree.body:
        is_import = isinstance(node, (ast.Import, ast.ImportFrom))
        if is_import and seen_code:
            pytest.fail(f"{rel(path)}:{node.lineno}: a second import block after code")
        if not is_import and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            seen_code = True
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            assert not private, f"{rel(path)}:{node.lineno} imports private names {private}"


def _code(nb_path: Path) -> str:
    nb = json.loads(nb_path.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# the capstone is graded work the learner builds (amp_lessons.exercises.capstone), not a lesson
LESSON_NOTEBOOKS = [p for p in NOTEBOOKS if "capstone" not in p.name]


@pytest.mark.parametrize("nb_path", LESSON_NOTEBOOKS, ids=lambda p: p.name)
def test_each_notebook_calls_its_own_lesson_module_and_the_engine_only(nb_path):
    number = nb_path.name[:2]
    code = _code(nb_path)
    mine = [p.stem for p in LESSONS if p.stem.startswith(f"l{number}_")]
    assert len(mine) == 1, f"lesson {number} has no module amp_lessons/lessons/l{number}_*.py"
    assert re.search(rf"from amp_lessons\.lessons import {mine[0]}\b", code), \
        f"{nb_path.name} does not import its lesson module {mine[0]}"
    others = {m for m in re.findall(r"\bl(\d\d)_[a-z0-9_]+", code) if m != number}
    assert not others, f"{nb_path.name} uses other lessons' modules: {sorted(others)}"
    gone = re.findall(r"\bal\.(bench|plots|widgets)\b", code)
    assert not gone, f"{nb_path.name} calls modules that no longer exist: {sorted(set(gone))}"


def test_readme_module_table_matches_the_code():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The package", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            listed |= set(re.findall(r"`([a-z_0-9/]+(?:\.py)?)`", line.split("|")[1]))
    listed = {x.removesuffix(".py") for x in listed}
    actual = {p.stem for p in PKG.glob("*.py") if not p.stem.startswith("_")}
    by_module = {"ui", "train", "numerics", "measure", "publish"}  # folders listed module by module
    for folder in by_module:
        actual |= {f"{folder}/{p.stem}" for p in (PKG / folder).glob("*.py") if p.stem != "__init__"}
    actual |= {p.parent.name for p in PKG.glob("*/__init__.py")} - by_module
    assert listed == actual, (f"README's module table lists {sorted(listed - actual)} that do not "
                              f"exist and misses {sorted(actual - listed)}")


def test_readme_counts_and_lists_every_lesson():
    """The README's opening counts the lesson notebooks there are, and its lessons table links
    each of them (the opening said "Seven" for two lessons after 08 and 09 landed)."""
    readme = (ROOT / "README.md").read_text()
    notebooks = NOTEBOOKS
    words = {7: "Seven", 8: "Eight", 9: "Nine", 10: "Ten", 11: "Eleven", 12: "Twelve"}
    opening = readme.split("\n## ", 1)[0]
    assert f"{words[len(LESSON_NOTEBOOKS)]} ordered notebooks" in opening
    assert len(NOTEBOOKS) == len(LESSON_NOTEBOOKS) or "capstone" in opening
    table = readme.split("## The lessons", 1)[1].split("\n## ", 1)[0]
    assert all(f"(notebooks/{nb.name})" in table for nb in notebooks)
