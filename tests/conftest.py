import pytest
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def chromium():
    """Path of a Chromium executable for the browser tests; skips them where there is none."""
    from browser_helpers import chromium_executable

    path = chromium_executable()
    if path is None:
        pytest.skip("no Chromium executable (install Debian's: apt-get install -y chromium)")
    return path


# --- the order tests run in, and what a `-m` run collects ------------------------------------------
# `make test` runs the `serial` and `browser` tests in one process, serial ones first (they time
# what they see; the browser tests leave JupyterLab's shutdown behind them). Test files that hold
# a `slow` test run first, so that pytest-xdist's workers do not end on one long test while the
# other waits. A run whose `-m` expression selects no unmarked test (`-m "serial or browser"`)
# imports only the test files that name one of the expression's marks: a test file can only
# carry a mark it names (a test file that took one from elsewhere is refused at collection).
MARKS = ("serial", "browser", "slow")
SLOW_BUDGET_S = 10.0  # a test past this (setup or call, wall time) without `slow` is listed
_sources = {}
_needed = {}


def _source(path) -> str:
    path = Path(path)
    if path not in _sources:
        try:
            _sources[path] = path.read_text(errors="replace")
        except OSError:
            _sources[path] = ""
    return _sources[path]


def _needed_marks(config):
    """The mark names one of which a test needs to be selected by ``-m``, or None where a test
    with no mark is selected (or there is no ``-m``)."""
    expr = (config.getoption("markexpr", "") or "").strip()
    if expr not in _needed:
        _needed[expr] = None
        try:
            from _pytest.mark.expression import Expression

            if expr and not Expression.compile(expr).evaluate(lambda name, **kwargs: False):
                names = set(re.findall(r"[A-Za-z_][\w.-]*", expr)) - {"and", "or", "not"}
                _needed[expr] = names or None
        except Exception:  # a malformed expression: pytest reports it itself
            pass
    return _needed[expr]


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    names = _needed_marks(config)
    if names and not any(name in _source(collection_path) for name in names):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    indirect = [f"{item.nodeid}: {name}" for item in items if str(item.path).endswith(".py")
                for name in {m.name for m in item.iter_markers()} & set(MARKS)
                if name not in _source(item.path)]
    if indirect:
        raise pytest.UsageError("these tests carry a mark their test file does not name (name it "
                                "there, e.g. @pytest.mark.serial):\n  " + "\n  ".join(indirect))
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item):
        if item.get_closest_marker("browser"):
            return 2
        return 0 if item.path in slow_files else 1

    items.sort(key=rank)  # stable: each file's tests keep their order


_over_budget = []


def pytest_runtest_logreport(report):
    if (report.when in ("setup", "call") and report.duration > SLOW_BUDGET_S
            and "slow" not in report.keywords and "browser" not in report.keywords):
        _over_budget.append((report.duration, report.when, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over_budget:
        terminalreporter.write_sep("-", f"over {SLOW_BUDGET_S:.0f} s and not marked slow")
        for seconds, when, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f}s {when:5} {nodeid}")
