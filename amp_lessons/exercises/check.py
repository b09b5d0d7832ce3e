"""The result of grading one exercise, its graded hints, and the small helpers every grader shares.

A ``Check`` renders as plain text in a notebook (its ``repr``), so the cell after an exercise
shows "passed", "wrong: what is wrong + the hint for that mistake", "not answered yet + the first
hint", or "skipped: why", and never a bare ``False``. ``bool(check)`` is True only for a pass.

Hints come in levels (``Hints``): the first is a nudge (where to look, which concept), each next
one says more, and the last may be the answer. A check shows one level; the plain text says how
to ask for the next (``ex02.hint("loop", 2)``), and in JupyterLab (``_repr_html_``) the later
levels wait behind a click, one ``<details>`` each.

A wrong answer never shows the expected value in its message: the value (``reveal``) or, where
there is none, the last hint (the reference solution) appears only from the ``REVEAL_AFTER``-th
wrong attempt at the same exercise on, and every wrong grade before that says so. Each lesson's
``check_*`` functions are wrapped in ``graded``, which counts the attempts.

The learner's code is never trusted: graders compute their references first, hand the learner
copies of the inputs, read what comes back through ``read_number`` and ``tensor_problem`` (a
tensor on the meta device or another device, or of another dtype, is named, never a crash), and
end every process they start (``run_bounded``). A grade runs for at most ``grade_limit_s()``
seconds (300, or ``AMP_LESSONS_GRADE_LIMIT_S``): a learner's endless loop or long sleep ends as a
"wrong" grade that says so, not a cell that never returns.
"""
import ast
import contextlib
import dataclasses
import functools
import html
import inspect
import math
import operator
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from amp_lessons.validate import check_choice, check_int

STATUSES = ("passed", "wrong", "not answered yet", "skipped")
REVEAL_AFTER = 3  # the wrong attempt at an exercise from which its answer is shown
_ATTEMPTS: Dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class Hints:
    """One exercise's graded hints: ``levels`` run from a nudge (level 1, which never gives the
    answer away) to a near-answer (the last); ``module`` and ``name`` say how a learner asks
    for a level in plain text: ``{module}.hint("{name}", level)``."""

    module: str
    name: str
    levels: Tuple[str, ...]

    def __post_init__(self):
        levels = tuple(self.levels)
        if len(levels) < 2 or not all(isinstance(t, str) and t.strip() for t in levels):
            raise ValueError(f"levels of hint {self.name!r} must be 2 or more non-empty texts; "
                             f"got {len(levels)}")
        object.__setattr__(self, "levels", levels)

    def level(self, level: int) -> str:
        """The text of hint ``level`` (1 ... ``len(levels)``)."""
        return self.levels[check_int("level", level, 1, len(self.levels)) - 1]

    def call(self, level: int) -> str:
        """The code a learner runs to read hint ``level``: ``ex02.hint("loop", 2)``."""
        return f'{self.module}.hint("{self.name}", {level})'

    def after(self, mistake: str) -> "Hints":
        """These hints with level 1 replaced by ``mistake``'s own hint: what a wrong answer shows
        first; the later levels stay the exercise's."""
        return dataclasses.replace(self, levels=(mistake,) + self.levels[1:])


def hint_book(module: str, ladders: Mapping[str, Sequence[str]]) -> dict:
    """``{name: Hints}`` for one lesson's exercises (``module`` is the grader's name, ``ex02``)."""
    return {name: Hints(module, name, tuple(levels)) for name, levels in ladders.items()}


def hint_reader(book: Mapping[str, "Hints"], module: str) -> Callable[..., "HintText"]:
    """A lesson's ``hint(exercise, level=1)`` (``exNN.hint``): hint ``level`` of one of
    ``book``'s exercises, read with ``read_hint``; ``module`` is the grader module's
    ``__name__``, which the function reports as its own."""
    def hint(exercise: str, level: int = 1) -> HintText:
        return read_hint(book, exercise, level)

    names = ", ".join(f'"{name}"' for name in book)
    hint.__doc__ = (f"Hint ``level`` of one of this lesson's exercises: ``exercise`` is one of "
                    f"``HINTS`` ({names}); level 1 is a nudge, the last is near the answer. "
                    "Raises ValueError for another name or a level outside 1 ... the number of "
                    "levels.")
    hint.__module__ = module
    return hint


class HintText(str):
    """A hint as a string that a notebook shows as its text (with which level it is), not as a
    quoted Python string."""

    label = ""

    def __repr__(self) -> str:
        return f"{self.label}: {str(self)}" if self.label else str(self)


def read_hint(book: Mapping[str, Hints], exercise: str, level: int = 1) -> HintText:
    """Hint ``level`` of ``exercise`` in ``book`` (see ``hint_book``), checked: ``exercise``
    must be one of the book's names, ``level`` a whole number from 1 to its number of levels."""
    check_choice("exercise", exercise, tuple(book))
    hints = book[exercise]
    text = HintText(hints.level(level))
    text.label = f"{exercise}, hint {level} of {len(hints.levels)}"
    return text


@dataclasses.dataclass(frozen=True)
class Check:
    """One exercise's grade: ``exercise`` (its title), ``status`` (one of ``STATUSES``),
    ``message`` (what was found, never the expected value), ``hints`` (the hint levels for this
    grade: level 1 is shown, the later ones are asked for or unfolded; a single string is one
    level), ``more`` (the code that reads a level in plain text, with ``{level}`` in it, or
    empty), ``reveal`` (the expected answer, shown only from attempt ``REVEAL_AFTER`` on) and
    ``attempt`` (which wrong attempt at this exercise this grade is; 0 where not counted)."""

    exercise: str
    status: str
    message: str = ""
    hints: Union[str, Tuple[str, ...]] = ()
    more: str = ""
    reveal: str = ""
    attempt: int = 0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {self.status!r}")
        hints = (self.hints,) if isinstance(self.hints, str) else tuple(self.hints)
        object.__setattr__(self, "hints", tuple(h for h in hints if h))
        if self.more and "{level}" not in self.more:
            raise ValueError(f"more must contain '{{level}}'; got {self.more!r}")

    @property
    def passed(self) -> bool:
        """True for a correct answer only."""
        return self.status == "passed"

    @property
    def hint(self) -> str:
        """The hint this grade shows (level 1), or "" when it has none."""
        return self.hints[0] if self.hints else ""

    def hint_at(self, level: int) -> str:
        """Hint ``level`` of this grade (1 ... ``len(hints)``)."""
        if not self.hints:
            raise ValueError(f"this check ({self.status}) has no hints to read")
        return self.hints[check_int("level", level, 1, len(self.hints)) - 1]

    def __bool__(self) -> bool:
        return self.passed

    def _shows_hints(self) -> bool:
        return bool(self.hints) and self.status in ("wrong", "not answered yet")

    def _label(self, level: int) -> str:
        n = len(self.hints)
        return "hint" if n == 1 else f"hint {level} of {n}"

    def _heading(self) -> str:
        mark = {"passed": "[x]", "wrong": "[ ]", "not answered yet": "[?]", "skipped": "[-]"}
        return f"{mark[self.status]} {self.exercise}: {self.status}"

    @property
    def revealed(self) -> bool:
        """True when this grade shows the answer: a wrong attempt numbered ``REVEAL_AFTER`` or
        later."""
        return self.status == "wrong" and self.attempt >= REVEAL_AFTER

    def answer_line(self) -> str:
        """What a wrong grade says about the answer: the answer itself from attempt
        ``REVEAL_AFTER`` on (``reveal``, else the last hint, the reference solution), before
        that when and where it will show; "" for other grades."""
        if self.status != "wrong":
            return ""
        if self.revealed:
            answer = self.reveal or (self.hints[-1] if self.hints else "")
            return f"the answer (wrong attempt {self.attempt}): {answer}" if answer else ""
        last = (self.more.format(level=len(self.hints)) if self.more and len(self.hints) > 1
                else f"check.hint_at({len(self.hints)})" if len(self.hints) > 1 else "")
        this = f" (this was attempt {self.attempt})" if self.attempt else ""
        where = f", or read the last hint: {last}" if last else ""
        return f"the answer shows after {REVEAL_AFTER} wrong attempts{this}{where}"

    def text(self) -> str:
        """The grade as the lines a notebook shows: the first hint only, how to read the next
        one, and when the answer shows."""
        lines = [self._heading() + (f": {self.message}" if self.message else "")]
        if self._shows_hints():
            lines.append(f"    {self._label(1)}: {self.hints[0]}")
            if len(self.hints) > 1:
                how = self.more.format(level=2) if self.more else "check.hint_at(2)"
                lines.append(f"    stuck? the next hint: {how}")
        if self.answer_line():
            lines.append(f"    {self.answer_line()}")
        return "\n".join(lines)

    __str__ = text

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        """The grade for JupyterLab: the first hint shown, each later level in its own
        ``<details>`` that unfolds on a click (every text escaped)."""
        esc = html.escape
        head = f"<b>{esc(self._heading())}</b>" + (f": {esc(self.message)}" if self.message
                                                   else "")
        parts = [f'<div class="amp-check" data-status="{esc(self.status)}">', f"<div>{head}</div>"]
        if self._shows_hints():
            parts.append(f"<div><b>{esc(self._label(1))}:</b> {esc(self.hints[0])}</div>")
            for level, text in enumerate(self.hints[1:], start=2):
                last = " (closest to the answer)" if level == len(self.hints) else ""
                parts.append(f"<details><summary>{esc(self._label(level))}{last}</summary>"
                             f"<div>{esc(text)}</div></details>")
        if self.answer_line():
            parts.append(f"<div><i>{esc(self.answer_line())}</i></div>")
        parts.append("</div>")
        return "\n".join(parts)


def passed(exercise: str, message: str = "") -> Check:
    """A correct answer."""
    return Check(exercise, "passed", message)


HintsLike = Union[str, Sequence[str], Hints]


def _levels(hint: HintsLike) -> Tuple[Tuple[str, ...], str]:
    if isinstance(hint, Hints):
        return hint.levels, hint.call("{level}")
    return ((hint,) if isinstance(hint, str) else tuple(hint)), ""


def wrong(exercise: str, message: str, hint: HintsLike, reveal: str = "") -> Check:
    """A wrong answer: what is wrong (never the expected value), the hints for that mistake (a
    ``Hints``, usually an exercise's own or ``Hints.after(mistake)``; a string is one level),
    and ``reveal``, the expected answer, which the grade shows only from the ``REVEAL_AFTER``-th
    wrong attempt on (``graded`` counts them)."""
    levels, more = _levels(hint)
    return Check(exercise, "wrong", message, levels, more, reveal)


GRADE_LIMIT_S = 300.0  # seconds one grade may run (the learner's code included)
GRADE_LIMIT_ENV = "AMP_LESSONS_GRADE_LIMIT_S"


class GradeTimeout(BaseException):
    """A grade ran past its time limit (raised inside the learner's code: a ``BaseException``, so
    the learner's own ``except Exception`` does not swallow it)."""


def grade_limit_s() -> float:
    """The seconds one grade may run: ``AMP_LESSONS_GRADE_LIMIT_S`` where set (a number > 0),
    else ``GRADE_LIMIT_S``. ValueError naming the setting for anything else."""
    text = os.environ.get(GRADE_LIMIT_ENV, "").strip()
    if not text:
        return GRADE_LIMIT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{GRADE_LIMIT_ENV} must be a number of seconds > 0; got {text!r}")
    return value


@contextlib.contextmanager
def time_bound(seconds: float):
    """Raise ``GradeTimeout`` in the block once ``seconds`` of wall time have passed (a SIGALRM
    timer). A timer already running (pytest-timeout's, say) keeps its deadline: where it is due
    first its own handler runs then, and it is set again for what is left on leaving the block.
    Where no timer can be set (not the main thread, no SIGALRM) the block runs unbounded."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # seconds left on a timer already set
    outer_first = 0 < outer <= seconds
    start, rang = time.monotonic(), []

    def ring(signum, frame):
        if outer_first and callable(previous):
            rang.append(True)
            previous(signum, frame)
            return
        raise GradeTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, outer if outer_first else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0 and not rang:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def graded(check: Callable[..., Check]) -> Callable[..., Check]:
    """Wrap a lesson's ``check_*`` function: each "wrong" grade it returns is numbered, per
    exercise title, as the learner's next wrong attempt (``Check.attempt``), so that its answer
    shows from attempt ``REVEAL_AFTER`` on and not before; a grade that runs past
    ``grade_limit_s()`` stops there and says so, as does one whose learner's code calls
    ``exit()`` (neither is counted as an attempt). Use as a
    decorator."""
    @functools.wraps(check)
    def counted(*args, **kwargs) -> Check:
        limit = grade_limit_s()
        try:
            with time_bound(limit):
                result = check(*args, **kwargs)
        except GradeTimeout:
            return Check(check.__name__, "wrong",
                         f"the grade stopped after {limit:g} s with your code still running: an "
                         f"endless loop, a sleep, or far more work than the exercise needs",
                         "look for a loop whose condition never changes, or a call that waits")
        except SystemExit as exc:  # exit() or sys.exit() in the learner's code: a grade, not
            return Check(check.__name__, "wrong",  # a cell that ends with no grade at all
                         f"your code called exit() or sys.exit() (SystemExit: {exc.code!r}), "
                         f"which ends a program, not a function",
                         "return the answer from your function (return ...), or raise an "
                         "exception to report a problem; never exit()")
        if isinstance(result, Check) and result.status == "wrong":
            n = _ATTEMPTS[result.exercise] = _ATTEMPTS.get(result.exercise, 0) + 1
            result = dataclasses.replace(result, attempt=n)
        return result
    counted.graded = True
    return counted


def attempts(exercise: str) -> int:
    """How many wrong attempts at ``exercise`` (its title) this session has graded."""
    return _ATTEMPTS.get(exercise, 0)


def reset_attempts(exercise: Optional[str] = None) -> None:
    """Forget the wrong attempts at ``exercise`` (a title), or at every exercise (None): the
    next wrong grade is attempt 1 again."""
    if exercise is None:
        _ATTEMPTS.clear()
    else:
        _ATTEMPTS.pop(exercise, None)


def unanswered(exercise: str, hint: HintsLike) -> Check:
    """The stub is still there: say so, and show the first hint (the later ones on request)."""
    levels, more = _levels(hint)
    return Check(exercise, "not answered yet", "", levels, more)


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


def not_a_function(exercise: str, fn: Any, hint: HintsLike) -> Optional[Check]:
    """The grade for an answer that should be a function and is not: "not answered yet" for a
    stub (None, ``...``), "wrong" for anything else that cannot be called; None for a callable."""
    if callable(fn):
        return None
    if is_blank(fn):
        return unanswered(exercise, hint)
    return wrong(exercise, f"expected a function; got {type(fn).__name__} {fn!r:.80}", hint)


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
    """``value`` as a float, or None when it is not a number (a grader then says so): ints,
    floats, NumPy scalars and one-value tensors count, whatever their dtype; bools, strings
    (even "0.5": a quoted number is not the number), None and containers do not. NaN and inf
    come back as they are: a grader compares with ``within`` or ``close``, which reject them."""
    if value is None or isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        return None
    dtype = getattr(value, "dtype", None)
    if dtype is not None and (str(dtype).endswith("bool") or "complex" in str(dtype)):
        return None
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - anything float() refuses is not a number
        return None


def whole_number(value: Any) -> Optional[int]:
    """``value`` as an int when it is a whole number in any numeric type (``5``, ``5.0``,
    ``np.int64(5)``, ``torch.tensor(5)``), else None (a bool, ``5.5``, NaN, a string...)."""
    v = number(value)
    if v is None or not math.isfinite(v) or v != int(v):
        return None
    return int(v)


def close(value: Optional[float], target: float, rel: float = 0.0, abs_tol: float = 0.0) -> bool:
    """True when ``value`` is a finite number within ``rel`` (a fraction of ``target``) or
    ``abs_tol`` of ``target``; never for None, NaN or inf (``abs(nan - x) > tol`` is never
    true, so a tolerance test must be written this way round)."""
    if value is None or not math.isfinite(value):
        return False
    return abs(value - target) <= max(rel * abs(target), abs_tol)


def text_key(value: Any) -> str:
    """``value`` as a graded string: lower case, ``_`` read as a space, the spaces around and
    inside collapsed (``" Init_Scale  too high "`` -> ``"init scale too high"``)."""
    return " ".join(str(value).replace("_", " ").lower().split())


def canonical(value: Any, names: Iterable[str]) -> Any:
    """The one of ``names`` that ``value`` spells (by ``text_key``), else ``value`` itself."""
    return {text_key(n): n for n in names}.get(text_key(value), value)


def keyed(answer: Any, names: Iterable[str]) -> Optional[dict]:
    """``answer`` (a mapping) re-keyed by ``names``, each of its keys matched to a name by
    ``text_key`` (so ``"FP16 safe"`` and ``" fp16_safe"`` are ``"fp16 safe"``); None when it is
    not a mapping, lacks one of the names, or spells one twice. A key that is none of the names
    (a learner's own note, a total) is left out, not held against the answer."""
    names = list(names)
    if not isinstance(answer, Mapping):
        return None
    out = {}
    for key, value in answer.items():
        name = canonical(key, names)
        if name not in names:
            continue
        if name in out:
            return None
        out[name] = value
    return out if len(out) == len(names) else None


def matching_mistake(mistakes: Mapping[str, Callable], answers: Iterable[Tuple[Any, Any]],
                     same: Callable[[Any, Any], bool] = operator.eq) -> Optional[str]:
    """The name of the first of ``mistakes`` (name -> the typical wrong answer, a function of one
    input) that gives the learner's answer on every input of ``answers`` ((input, the learner's
    answer) pairs, compared with ``same``), or None. A grader names a mistake from all the
    inputs it evaluated, not from the first that fails: on one input two mistakes can give the
    same answer, across them usually only the learner's own does. A mistake that cannot be made
    on some input (it raises) is passed over."""
    answers = list(answers)
    for name, mistake in mistakes.items():
        try:
            if all(same(mistake(given), got) for given, got in answers):
                return name
        except Exception:  # noqa: BLE001 - a mistake that cannot be made here is not this one
            continue
    return None


def within(value: float, target: float, rel: float) -> bool:
    """True when ``value`` is within ``rel`` (a fraction) of ``target``; never for NaN or inf."""
    return close(value, target, rel)


def tensor_problem(value: Any, device: Any = None, dtype: Any = None,
                   what: str = "the result") -> Optional[str]:
    """Why ``value``, a tensor the learner's code returned, cannot be graded as it is, in words
    that name the problem: on the meta device (no values to read), on another device than
    ``device`` (a ``torch.device`` or its name; None: any), or of another dtype than ``dtype``
    (None: any); None when it can be graded. Not a tensor: None (the grader says what it
    expected)."""
    import torch
    if not isinstance(value, torch.Tensor):
        return None
    if value.device.type == "meta":
        return f"{what} is on the meta device, which holds shapes but no values"
    if device is not None:
        want = torch.device(device)
        if value.device.type != want.type:
            return (f"{what} is on {value.device}, the input on {want}: return it on the "
                    f"input's device")
    if dtype is not None and value.dtype != dtype:
        return f"{what} is {value.dtype}, expected {dtype}"
    return None


def same_values(a: Any, b: Any) -> bool:
    """``a`` and ``b`` (state dicts, lists or values, nested) hold the same values, bit for bit,
    wherever their tensors live."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b


def read_bool(value: Any, what: str = "the answer") -> Tuple[Optional[bool], Optional[str]]:
    """(``value`` as True or False, None), or (None, why not in words). True and False count,
    as do NumPy's bools and a one-value bool tensor (what a comparison gives); anything else
    does not, though Python would call it true or false: a string ("no" is true), a number, a
    tensor of several values (whose truth raises), None."""
    import torch
    numpy = sys.modules.get("numpy")
    if isinstance(value, bool) or numpy is not None and isinstance(value, numpy.bool_):
        return bool(value), None
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        if value.device.type == "meta":
            return None, f"{what} is a tensor on the meta device, which holds no value"
        if value.numel() == 1:
            return bool(value), None
        return None, (f"{what} must be True or False; got a bool tensor of shape "
                      f"{tuple(value.shape)}")
    shown = f"a tensor of {value.dtype}" if isinstance(value, torch.Tensor) else \
        f"{type(value).__name__} {value!r:.60}"
    return None, f"{what} must be True or False; got {shown}"


def read_number(value: Any, what: str = "the answer") -> Tuple[Optional[float], Optional[str]]:
    """(``value`` as a finite float, None), or (None, why not in words): a meta-device tensor
    holds no value, a tensor of several values is not one number, NaN and inf are not finite,
    a string or a bool is not a number. Read what a learner's function returned with it before
    comparing anything."""
    import torch
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return None, f"{what} is a tensor on the meta device, which holds no value"
        if value.numel() != 1:
            return None, f"{what} must be one number; got a tensor of shape {tuple(value.shape)}"
    v = number(value)
    if v is None:
        return None, f"{what} must be a number; got {type(value).__name__} {value!r:.60}"
    if not math.isfinite(v):
        return None, f"{what} must be a finite number; got {v!r}"
    return v, None


def _descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children, grandchildren...), read from /proc on Linux or
    with psutil where it is installed; [] where neither is available."""
    try:
        import psutil
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is already gone
        return []
    parents = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    parents.setdefault(int(fields[1]), []).append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
    except OSError:
        return []
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_process_tree(proc: "subprocess.Popen", grace_s: float = 3.0) -> None:
    """End ``proc`` and every process it started (torchrun puts its workers in sessions of
    their own, so a process group is not enough): SIGTERM to all, then SIGKILL to any still
    alive after ``grace_s`` seconds; waits for ``proc``."""
    tree = [proc.pid] + _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tree = list(dict.fromkeys(tree + _descendants(proc.pid)))
        for pid in tree:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_alive(p) for p in tree):
                time.sleep(0.05)
            if not any(_alive(p) for p in tree):
                return
    proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def run_bounded(cmd: Sequence[str], timeout_s: float, **popen) -> Tuple[Optional[int], str, str]:
    """Run ``cmd`` (``subprocess.Popen`` keyword arguments in ``popen``), capturing its output
    as text, for at most ``timeout_s`` seconds: (return code, stdout, stderr), the return code
    None on a time-out. On a time-out, an exception or an interrupt the process and everything
    it started are ended (``end_process_tree``) before this returns or raises."""
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a number of seconds > 0; got {timeout_s!r}")
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        end_process_tree(proc)
        out, err = proc.communicate()
        return None, out or "", err or ""
    except BaseException:
        end_process_tree(proc)
        raise
