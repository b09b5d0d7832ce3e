"""The result of grading one exercise, and the small helpers every grader shares.

A ``Check`` renders as plain text in a notebook (its ``repr``), so the cell after an exercise
shows "passed", "wrong: what is wrong + a hint", "not answered yet + the hint", or "skipped: why"
and never a bare ``False``. ``bool(check)`` is True only for a pass.
"""
import ast
import dataclasses
import inspect
import textwrap
from typing import Any, Callable, Optional

STATUSES = ("passed", "wrong", "not answered yet", "skipped")


@dataclasses.dataclass(frozen=True)
class Check:
    """One exercise's grade: ``exercise`` (its title), ``status`` (one of ``STATUSES``),
    ``message`` (what was found) and ``hint`` (what to look at next)."""

    exercise: str
    status: str
    message: str = ""
    hint: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {self.status!r}")

    @property
    def passed(self) -> bool:
        """True for a correct answer only."""
        return self.status == "passed"

    def __bool__(self) -> bool:
        return self.passed

    def text(self) -> str:
        """The grade as the lines a notebook shows."""
        mark = {"passed": "[x]", "wrong": "[ ]", "not answered yet": "[?]", "skipped": "[-]"}
        lines = [f"{mark[self.status]} {self.exercise}: {self.status}"
                 + (f": {self.message}" if self.message else "")]
        if self.hint and self.status != "passed":
            lines.append(f"    hint: {self.hint}")
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return self.text()


def passed(exercise: str, message: str = "") -> Check:
    """A correct answer."""
    return Check(exercise, "passed", message)


def wrong(exercise: str, message: str, hint: str) -> Check:
    """A wrong answer: what is wrong, and a hint."""
    return Check(exercise, "wrong", message, hint)


def unanswered(exercise: str, hint: str) -> Check:
    """The stub is still there: say so, and show the hint."""
    return Check(exercise, "not answered yet", "", hint)


def skipped(exercise: str, why: str) -> Check:
    """The check cannot run here (no GPU, no torchao...): one line saying why."""
    return Check(exercise, "skipped", why)


def is_blank(answer: Any) -> bool:
    """True for the stubs a learner has not filled in: None, ``...``, or a container of them."""
    if answer is None or answer is Ellipsis:
        return True
    if isinstance(answer, dict):
        return not answer or all(is_blank(v) for v in answer.values())
    if isinstance(answer, (list, tuple)):
        return not answer or all(is_blank(v) for v in answer)
    return False


def _function_ast(fn: Callable) -> Optional[str]:
    """``fn``'s definition as an AST dump without its name, docstring, comments or line numbers
    (None where its source cannot be read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    node.name, node.decorator_list = "_", []
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        node.body = node.body[1:]
    return ast.dump(node)


def same_code(fn: Callable, reference: Callable) -> bool:
    """True when ``fn`` is ``reference`` as written (an unedited fix-the-bug stub): the same
    syntax tree, whatever the name, docstring, comments or layout. Falls back to comparing
    bytecode where a source cannot be read."""
    a, b = _function_ast(fn), _function_ast(reference)
    if a is not None and b is not None:
        return a == b
    ca, cb = getattr(fn, "__code__", None), getattr(reference, "__code__", None)
    if ca is None or cb is None:
        return False
    return (ca.co_code, ca.co_names, ca.co_varnames) == (cb.co_code, cb.co_names, cb.co_varnames) \
        and repr(ca.co_consts) == repr(cb.co_consts)


def number(value: Any) -> Optional[float]:
    """``value`` as a float, or None when it is not a number (a grader then says so)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def within(value: float, target: float, rel: float) -> bool:
    """True when ``value`` is within ``rel`` (a fraction) of ``target``."""
    return abs(value - target) <= rel * abs(target)
