"""What produced a result: the calls that ran, recorded as they run.

A function decorated with ``@traced`` records each of its calls as a ``Call``: the function
(module, name, file, line), its arguments in short (``BenchConfig``\\ s written out), the traced
calls made inside it, and, for each argument that is itself a traced result, that result's
call. Its return value, and each row of a returned list, tuple or ``{"rows": [...]}`` table,
is remembered with the call that made it; ``origin(obj)`` gives it back. ``call(fn, ...)``
records a call of an undecorated function at the place it is called (the runner records which
training step a row timed: ``hand_step`` or the Trainer's ``trainer_step``).

Row by row: when a traced function returns as many rows as one of its arguments holds traced
rows, row ``i`` is recorded as made from that argument's row ``i`` (``published_rows`` of the
rows ``run_configs`` measured), so a table shown rows later still leads back to the call that
measured each row. This module records; ``publish.provenance`` reads the records when a table
is published. It knows nothing of lessons or keys.

Example::

    @traced
    def technique_table(...): ...
    rows = technique_table(...)
    origin(rows[0]).name   # 'amp_lessons.lessons.l05_checkpointing.technique_table'
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

KEEP = 20_000  # results remembered (the oldest are forgotten first): a long notebook's worth
_ROOT = Path(__file__).resolve().parents[1]
_ids = itertools.count(1)


@dataclasses.dataclass
class Call:
    """One recorded call of a traced function: ``name`` (``module.qualname``), ``file`` and
    ``line`` of its definition, ``arguments`` in short, ``calls`` (the traced calls made inside
    it, in order), ``inputs`` (argument name -> the ``Call`` that made that argument) and, for a
    result row made from an input row, ``row_of`` (the input ``Call``'s row it came from)."""

    name: str
    file: str
    line: int
    arguments: Dict[str, object]
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    calls: List["Call"] = dataclasses.field(default_factory=list)
    inputs: Dict[str, "Call"] = dataclasses.field(default_factory=dict)

    def to_dict(self, depth: int = 6) -> Dict[str, object]:
        """The call as plain JSON data, its inner calls and inputs ``depth`` levels deep."""
        out: Dict[str, object] = {"function": self.name, "file": self.file, "line": self.line,
                                  "arguments": self.arguments}
        if depth > 0:
            if self.calls:
                out["calls"] = [c.to_dict(depth - 1) for c in self.calls]
            if self.inputs:
                out["inputs"] = {k: c.to_dict(depth - 1) for k, c in self.inputs.items()}
        return out


_STACK: contextvars.ContextVar[Tuple[Call, ...]] = contextvars.ContextVar("lineage", default=())
_MADE: "OrderedDict[int, Tuple[Any, Call, Optional[Any]]]" = OrderedDict()  # id -> (obj, call, source row)


def where(fn: Callable) -> Dict[str, object]:
    """``{"name", "file", "line"}`` of a function (file relative to the checkout)."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    file = Path(code.co_filename) if code else None
    if file is not None:
        try:
            file = file.resolve().relative_to(_ROOT)
        except ValueError:
            pass
    module = getattr(fn, "__module__", None) or "?"
    return {"name": f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}",
            "file": str(file) if file else "?", "line": code.co_firstlineno if code else 0}


def short(value, depth: int = 2):
    """``value`` as a short, JSON-ready description: numbers, strings and flags as they are
    (long strings cut), a dataclass (a ``BenchConfig``) or a mapping of such values written
    out, sequences of up to 8 simple values listed, anything else as its type (and shape)."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, str):
        return value if len(value) <= 120 else value[:117] + "..."
    if depth > 0 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: short(getattr(value, f.name), depth - 1)
                for f in dataclasses.fields(value)}
    if depth > 0 and isinstance(value, Mapping) and len(value) <= 24 \
            and all(isinstance(k, str) for k in value):
        return {k: short(v, depth - 1) for k, v in value.items()}
    if depth > 0 and isinstance(value, (list, tuple)) and len(value) <= 8 and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return [short(v, depth - 1) for v in value]
    shape = getattr(value, "shape", None)
    kind = type(value).__name__
    if isinstance(value, (list, tuple, dict)):
        return f"<{kind} of {len(value)}>"
    return f"<{kind}{' ' + str(tuple(shape)) if shape is not None else ''}>"


def _remember(obj, made: Call, source=None) -> None:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return  # no identity of their own
    known = _MADE.get(id(obj))
    if known is not None and known[0] is obj and known[1].id > made.id:
        return  # made by a call inside this one (``measure`` inside ``run_configs``): keep that
    _MADE[id(obj)] = (obj, made, source)
    _MADE.move_to_end(id(obj))
    while len(_MADE) > KEEP:
        _MADE.popitem(last=False)


def origin(obj) -> Optional[Call]:
    """The recorded call that returned ``obj`` (or a row of what it returned), or None."""
    got = _MADE.get(id(obj))
    return got[1] if got is not None and got[0] is obj else None


def source_row(obj):
    """The input row that the result row ``obj`` was made from (see the module's docstring), or
    None."""
    got = _MADE.get(id(obj))
    return got[2] if got is not None and got[0] is obj else None


def rows_of(result) -> List[Any]:
    """The rows of a result: the items of a list or tuple, the ``"rows"`` of a table dict."""
    if isinstance(result, (list, tuple)):
        return list(result)
    if isinstance(result, Mapping) and isinstance(result.get("rows"), (list, tuple)):
        return list(result["rows"])
    return []


def _record_result(result, made: Call, arguments: Mapping[str, object]) -> None:
    rows = rows_of(result)
    pairs = next((rows_of(v) for v in arguments.values()
                  if len(rows_of(v)) == len(rows) and rows
                  and all(origin(r) is not None for r in rows_of(v))), None)
    _remember(result, made)
    for i, row in enumerate(rows):
        _remember(row, made, pairs[i] if pairs else None)


def _enter(fn: Callable, arguments: Mapping[str, object]) -> Tuple[Call, contextvars.Token]:
    at = where(fn)
    made = Call(at["name"], at["file"], at["line"],
                {k: short(v) for k, v in arguments.items() if k not in ("self", "cls")})
    for k, v in arguments.items():
        items = list(v.values()) if isinstance(v, Mapping) else rows_of(v)
        came = origin(v) or next((origin(r) for r in items if origin(r)), None)
        if came is not None:
            made.inputs[k] = came
    stack = _STACK.get()
    if stack:
        stack[-1].calls.append(made)
    return made, _STACK.set(stack + (made,))


def _bind(fn: Callable, args, kwargs) -> Dict[str, object]:
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {f"arg{i}": a for i, a in enumerate(args)} | dict(kwargs)
    return dict(bound.arguments)


def traced(fn: Callable) -> Callable:
    """Decorate ``fn`` so that each call is recorded (see the module's docstring). The function
    runs unchanged: its arguments, result and exceptions are its own."""
    if not callable(fn):
        raise ValueError(f"traced decorates a function; got {fn!r}")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        arguments = _bind(fn, args, kwargs)
        made, token = _enter(fn, arguments)
        try:
            result = fn(*args, **kwargs)
        finally:
            _STACK.reset(token)
        _record_result(result, made, arguments)
        return result

    run.traced = True
    return run


def call(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, recorded as a traced call where it is called (for a function the
    caller does not own, such as the step a row times)."""
    return traced(fn)(*args, **kwargs)


def current() -> Optional[Call]:
    """The innermost traced call running now, or None."""
    stack = _STACK.get()
    return stack[-1] if stack else None
