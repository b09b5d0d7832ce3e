"""What produced a published table, recorded when it is published, and how to ask
(``python -m amp_lessons explain KEY``).

``report.publish`` calls ``record`` with the rows and the frame that called it. Nothing is
declared by hand: the record is read from the code that ran.

- ``published by``: the call path at publish time (the lesson function or notebook cell that
  published, with the code of the ``publish`` call);
- ``made by``: the traced calls (``amp_lessons.lineage``) that returned the table and the inputs
  they were given, down to the measurement; functions called inside the ``publish`` call itself
  are named too (``publish(key, scale_report(grads, ...))``);
- each row: the chain of calls that made it, the calls made inside the innermost one (the step a
  timed row ran: ``hand_step`` or the Trainer's ``trainer_step``) and its configuration;
- each column: the code in the producing functions that computes it, and where that code reads
  a field of a traced input (a doctor report's ``advice``), the function that computed the
  field (``doctor.scale.advice``);
- the device, torch and CUDA versions; the notebook's run record adds the code version.

``explain`` prints a record from the executed notebooks without importing torch or running a
lesson; ``close_keys`` suggests keys for a mistyped one.

With ``AMP_LESSONS_REQUIRE_PROVENANCE=1`` (set by ``make test`` for every notebook it runs), a
table with a row that no traced call made is refused (``UntracedRowsError``) when it is published:
every published number leads back to the function and configuration that produced it.
"""
from __future__ import annotations

import ast
import difflib
import inspect
import linecache
import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from amp_lessons import lineage  # light: no torch, so explain stays fast

MAX_ROWS = 200  # rows of one table described row by row
REQUIRE_ENV = "AMP_LESSONS_REQUIRE_PROVENANCE"
_PACKAGE = Path(__file__).resolve().parents[1]


class UntracedRowsError(ValueError):
    """A table published under ``AMP_LESSONS_REQUIRE_PROVENANCE=1`` with rows no traced call
    made; the message names the key and the rows."""


def check_traced(key: str, described: Sequence[Mapping[str, object]]) -> None:
    """``UntracedRowsError`` naming ``key`` and its rows without a recorded maker (``record``'s
    row descriptions), where ``AMP_LESSONS_REQUIRE_PROVENANCE`` is set to 1; else nothing."""
    if os.environ.get(REQUIRE_ENV, "") != "1":
        return
    missing = [f"{r['row']} ({r.get('first cell')})" for r in described if not r.get("made by")]
    if missing:
        raise UntracedRowsError(
            f"{key}: row{'s' if len(missing) > 1 else ''} {', '.join(missing[:6])}"
            f"{' ...' if len(missing) > 6 else ''} of {len(described)} came from no traced call: "
            f"make the rows with a function decorated @traced (amp_lessons.lineage), so explain "
            f"can name what produced each ({REQUIRE_ENV}=1)")


# --- at publish time ----------------------------------------------------------------------------

def _in_package(frame) -> bool:
    try:
        return Path(frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
    except (OSError, ValueError):
        return False


def _relative(file: str) -> str:
    try:
        return str(Path(file).resolve().relative_to(_PACKAGE.parent))
    except (OSError, ValueError):
        return file


def _frame_text(frame) -> Dict[str, object]:
    """A frame as the call path shows it: a package function (name, file, line) or the code
    outside the package that called it (a notebook cell: the code of its ``publish`` call)."""
    code = frame.f_code
    if _in_package(frame):
        name = getattr(code, "co_qualname", code.co_name)
        return {"function": f"{frame.f_globals.get('__name__', '?')}.{name}",
                "file": _relative(code.co_filename), "line": frame.f_lineno}
    return {"function": "(code outside the package: a notebook cell or a script)",
            "file": code.co_filename, "line": frame.f_lineno, "code": _statement(frame)}


def _source(frame) -> Optional[str]:
    lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)
    return "".join(lines) or None


def _publish_call(frame) -> Optional[ast.Call]:
    """The call expression running in ``frame`` (``publish(...)``), from its source."""
    text = _source(frame)
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and n.lineno <= frame.f_lineno <= (n.end_lineno or n.lineno)]
    named = [c for c in calls if _last_name(c.func) in ("publish", "publish_verdicts")]
    chosen = named or calls
    return min(chosen, key=lambda c: (c.end_lineno or c.lineno) - c.lineno) if chosen else None


def _statement(frame) -> str:
    call = _publish_call(frame)
    text = _source(frame)
    if call is None or text is None:
        return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return " ".join((ast.get_source_segment(text, call) or "").split())[:400]


def _last_name(node) -> str:
    return node.attr if isinstance(node, ast.Attribute) else \
        node.id if isinstance(node, ast.Name) else ""


def _resolve(node, frame):
    """The object an ``a.b.c`` expression names in ``frame`` (names and attributes only; no
    code is run), or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    scope = {**frame.f_globals, **frame.f_locals}
    if node.id not in scope:
        return None
    obj = scope[node.id]
    for attr in reversed(parts):
        obj = inspect.getattr_static(obj, attr, None) if not inspect.ismodule(obj) \
            else getattr(obj, attr, None)
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if obj is None:
            return None
    return obj


def _rows_expression(call: ast.Call) -> Optional[ast.AST]:
    if len(call.args) >= 2:
        return call.args[1]
    keyword = next((k.value for k in call.keywords if k.arg in ("rows", "verdicts")), None)
    return keyword


def _chain(made: lineage.Call, depth: int = 8) -> Dict[str, object]:
    """A traced call and the traced calls that made its inputs (not the calls inside it: the
    rows show those), as JSON."""
    out: Dict[str, object] = {"function": made.name, "file": made.file, "line": made.line,
                              "arguments": made.arguments}
    if depth and made.inputs:
        out["inputs"] = {k: _chain(c, depth - 1) for k, c in made.inputs.items()}
    return out


def _called_in(expr, frame) -> List[Dict[str, object]]:
    """Package functions called inside the ``publish`` call's rows expression, and traced
    results it names, outermost first."""
    found: List[Dict[str, object]] = []
    for node in ast.walk(expr):
        target = node.func if isinstance(node, ast.Call) else node if isinstance(
            node, ast.Name) and isinstance(node.ctx, ast.Load) else None
        if target is None:
            continue
        obj = _resolve(target, frame)
        if callable(obj) and hasattr(inspect.unwrap(obj), "__code__"):  # Python code, no builtin
            at = lineage.where(obj)
            entry = {"function": at["name"], "file": at["file"], "line": at["line"]}
        elif obj is not None and not callable(obj) and lineage.origin(obj) is not None:
            entry = {"name": target.id, **_chain(lineage.origin(obj))}
        else:
            continue
        if entry not in found:
            found.append(entry)
    return found


def _inline_inputs(expr, frame) -> List[tuple]:
    """``(function, items)`` for each package function called in the publish call's rows
    expression and each argument it is given: the argument's rows (a list's items, a mapping's
    values) or the argument itself, as objects."""
    out = []
    for node in ast.walk(expr):
        if not isinstance(node, ast.Call):
            continue
        fn = _resolve(node.func, frame)
        if not callable(fn):
            continue
        name = lineage.where(fn)["name"]
        for arg in list(node.args) + [k.value for k in node.keywords]:
            value = _resolve(arg, frame)
            if value is None or callable(value):
                continue
            items = list(value.values()) if isinstance(value, Mapping) else lineage.rows_of(value)
            out.append((name, items or [value]))
    return out


def _named_rows(expr, frame) -> List[object]:
    """The rows of every object a name in the publish call's rows expression stands for."""
    out: List[object] = []
    for node in ast.walk(expr):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            value = _resolve(node, frame)
            if value is not None and not callable(value):
                out += lineage.rows_of(value)
    return out


def _row_trail(row) -> List[lineage.Call]:
    """The calls that made ``row``, outermost first: the row's own, then those of the rows it
    was made from."""
    trail, seen = [], set()
    while row is not None and id(row) not in seen:
        seen.add(id(row))
        made = lineage.origin(row)
        if made is None:
            break
        trail.append(made)
        row = lineage.source_row(row)
    return trail


def _made_from_content(row: Mapping, candidates: Sequence[Mapping]):
    """A traced row whose items include all of ``row``'s (a row projected onto some columns,
    ``{k: r[k] for k in columns}``), or None."""
    items = [(k, v) for k, v in row.items()]
    for c in candidates:
        try:
            if all(k in c and c[k] == v for k, v in items):
                return c
        except Exception:  # noqa: BLE001 - values that do not compare (tensors): no match
            continue
    return None


def _row_record(i: int, row, trail: List[lineage.Call]) -> Dict[str, object]:
    label = next(iter(row.values()), None) if isinstance(row, Mapping) and row else None
    out: Dict[str, object] = {"row": i + 1, "first cell": lineage.short(label)}
    if not trail:
        out["made by"] = None
        return out
    inner = trail[-1]
    out["made by"] = [c.name for c in trail]
    out["ran"] = [c.name for c in inner.calls]
    config = next((v for v in inner.arguments.values() if isinstance(v, dict)), None)
    out["configuration"] = config if config is not None else inner.arguments
    out["at"] = f"{inner.file}:{inner.line}"
    return out


# --- columns ------------------------------------------------------------------------------------

def _function(name: str):
    """The function object ``module.qualname`` names among loaded modules, or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj = module
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return inspect.unwrap(obj) if obj is not None else None
    return None


def _tree(fn):
    try:
        text = textwrap.dedent(inspect.getsource(fn))
        first = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        return None, None, 0
    try:
        return ast.parse(text), text, first
    except SyntaxError:
        return None, None, 0


def _column_code(fn, column: str):
    """Where ``fn``'s code computes the value of ``column``: an ``ast`` value in a dict literal
    keyed by the column's name, or a keyword argument so named; with the source text."""
    tree, text, first = _tree(fn)
    if tree is None:
        return None
    module = sys.modules.get(getattr(fn, "__module__", ""))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == column:
                    return v, text, first
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == column:
                    return kw.value, text, first
    return _column_spec(module, column)


def _column_spec(module, column: str):
    """A ``(key, heading, ...)`` column tuple in ``module`` whose heading is ``column`` (the
    published form of a row: ``measure.rows.DEFAULT_COLUMNS``), as the code that names it."""
    try:
        text = inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        return None
    if text is None:
        return None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Tuple) and len(node.elts) >= 2 and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts[:2]) \
                and node.elts[1].value == column:
            return node, text, 1
    return None


def _fields_read(expr) -> List[str]:
    """The fields an expression reads: ``r.advice["precision"]`` reads ``advice``."""
    names = []
    for node in ast.walk(expr):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names.append(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.value, ast.Name) and isinstance(node.slice.value, str):
            names.append(node.slice.value)
    return list(dict.fromkeys(names))


def _field_sources(fn, field: str) -> List[Dict[str, object]]:
    """The package functions whose result ``fn`` stores as ``field`` (a keyword or dict key of
    the value it returns), following names back to the calls assigned to them."""
    found = _column_code(fn, field)
    if found is None:
        return []
    expr, _, _ = found
    tree, _, _ = _tree(fn)
    assigned: Dict[str, List[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        assigned.setdefault(name.id, []).append(node.value)
    todo, seen, out = [expr], set(), []
    while todo:
        node = todo.pop()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                obj = _resolve_static(sub.func, fn)
                if callable(obj) and str(getattr(obj, "__module__", "")).startswith("amp_lessons"):
                    at = lineage.where(obj)
                    entry = {"function": at["name"], "file": at["file"], "line": at["line"]}
                    if entry not in out:
                        out.append(entry)
            elif isinstance(sub, ast.Name) and sub.id in assigned and sub.id not in seen:
                seen.add(sub.id)
                todo += assigned[sub.id]
    return out


def _resolve_static(node, fn):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    obj = getattr(fn, "__globals__", {}).get(node.id)
    for attr in reversed(parts):
        obj = getattr(obj, attr, None)
    return obj


def _columns(columns: Sequence[str], producers: Sequence[str],
             inputs: Mapping[str, Sequence[str]]) -> Dict[str, Dict[str, object]]:
    """Each column's source: the first producing function (outermost first) whose code computes
    it, the code, and the functions that computed the fields of traced inputs it reads."""
    out: Dict[str, Dict[str, object]] = {}
    for column in columns:
        for name in producers:
            fn = _function(name)
            found = _column_code(fn, column) if fn is not None else None
            if found is None:
                continue
            expr, text, first = found
            entry: Dict[str, object] = {
                "function": name, "file": _relative(inspect.getsourcefile(fn) or "?"),
                "line": first + expr.lineno - 1,
                "code": " ".join((ast.get_source_segment(text, expr) or "").split())[:200]}
            fed = []
            for field in _fields_read(expr):
                for maker in inputs.get(name, ()):
                    maker_fn = _function(maker)
                    if maker_fn is not None:
                        fed += [dict(s, field=field) for s in _field_sources(maker_fn, field)]
            if fed:
                entry["fields from"] = fed
            out[column] = entry
            break
    return out


def _names_in(chain: Mapping[str, object]) -> List[str]:
    names = [chain["function"]] if "function" in chain else []
    for sub in (chain.get("inputs") or {}).values():
        names += _names_in(sub)
    return names


def _input_makers(chain: Mapping[str, object], out: Dict[str, List[str]]) -> None:
    for sub in (chain.get("inputs") or {}).values():
        out.setdefault(chain["function"], []).append(sub["function"])
        _input_makers(sub, out)


def record(key: str, rows: Sequence[Mapping], caller=None,
           columns: Optional[Sequence[str]] = None, device: Optional[str] = None
           ) -> Dict[str, object]:
    """What ``report.publish`` stores beside a table (see the module's docstring). ``caller``:
    the frame that called ``publish`` (its call path and code are recorded); ``columns``: the
    table's columns (default: the first row's keys)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string; got {key!r}")
    made = lineage.origin(rows)  # before the copy below: the object a traced call returned
    rows = list(rows)
    path: List[Dict[str, object]] = []
    frame = caller
    while frame is not None and len(path) < 8:
        path.append(_frame_text(frame))
        if not _in_package(frame):
            break
        frame = frame.f_back
    chains: List[Dict[str, object]] = [_chain(made)] if made is not None else []
    call = _publish_call(caller) if caller is not None else None
    expression = _rows_expression(call) if call is not None else None
    makers: Dict[str, List[str]] = {}
    paired: List = []  # traced rows that the published rows were made from, one for one
    if expression is not None and caller is not None:
        for entry in _called_in(expression, caller):
            if entry["function"] not in [n for c in chains for n in _names_in(c)]:
                chains.append(entry)
        for name, items in _inline_inputs(expression, caller):
            makers.setdefault(name, []).extend(
                lineage.origin(i).name for i in items if lineage.origin(i) is not None)
            if not paired and len(items) == len(rows) and all(lineage.origin(i) for i in items):
                paired = items
    # a row projected in the publish call matches only rows of what that call names or calls
    called = {n for c in chains for n in _names_in(c)}
    named = {id(r) for r in _named_rows(expression, caller)} if expression is not None else set()
    traced_rows = [r for r in _all_traced_rows()
                   if id(r) in named or lineage.origin(r).name in called]
    described = []
    for i, row in enumerate(rows[:MAX_ROWS]):
        trail = _row_trail(row)
        if not trail and paired:
            trail = _row_trail(paired[i])
        if not trail and isinstance(row, Mapping):
            like = _made_from_content(row, traced_rows)
            if like is not None:
                trail = _row_trail(like)
        described.append(_row_record(i, row, trail))
    check_traced(key, described)
    producers = [n for c in chains for n in _names_in(c)]
    for c in chains:
        _input_makers(c, makers)
    for trail in (_row_trail(r) for r in rows[:MAX_ROWS]):
        for a, b in zip(trail, trail[1:]):
            makers.setdefault(a.name, []).append(b.name)
        if trail:
            producers += [c.name for c in trail if c.name not in producers]
    columns = list(columns or (rows[0].keys() if rows and isinstance(rows[0], Mapping) else []))
    if device is None:
        device = _device_name()
    import torch  # loaded already: publish runs in a lesson's kernel

    return {"published by": list(reversed(path)), "made by": chains, "rows": described,
            "rows not described": max(0, len(rows) - MAX_ROWS),
            "columns": _columns(columns, list(dict.fromkeys(producers)),
                                {k: list(dict.fromkeys(v)) for k, v in makers.items()}),
            "device": device, "torch": torch.__version__, "cuda": torch.version.cuda}


def _all_traced_rows() -> List[Mapping]:
    return [obj for obj, _, _ in reversed(lineage._MADE.values()) if isinstance(obj, Mapping)]


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "CPU"


# --- explain: read back from the executed notebooks ---------------------------------------------

def close_keys(key: str, keys: Iterable[str], n: int = 3) -> List[str]:
    """Up to ``n`` of ``keys`` that look like ``key`` (a typo, a missing prefix), best first."""
    keys = list(dict.fromkeys(keys))
    got = difflib.get_close_matches(key, keys, n=n, cutoff=0.75)
    got += [k for k in keys if key and key.lower() in k.lower() and k not in got]
    return got[:n]


def unknown_key(key, keys: Sequence[str]) -> str:
    """The one-line error for a key no executed notebook publishes, with the closest keys."""
    if not isinstance(key, str) or not key.strip():
        return (f"KEY must name a published table (e.g. {keys[0] if keys else 'lesson04.resnet'});"
                f" got an empty key {key!r}. Run without KEY to list the {len(keys)} published keys")
    near = close_keys(key, keys)
    hint = f"; did you mean {', '.join(near)}?" if near else \
        f"; run without KEY to list the {len(keys)} published keys"
    return f"no executed notebook publishes a table keyed {key!r}{hint}"


def _brief(name: str) -> str:
    return name[len("amp_lessons."):] if name.startswith("amp_lessons.") else name


def _where(entry: Mapping[str, object]) -> str:
    return f"{entry.get('function')}  {entry.get('file')}:{entry.get('line')}"


def _args(arguments: Mapping[str, object], limit: int = 160) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in arguments.items()
                     if not (isinstance(v, str) and v.startswith("<")))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _chain_lines(chain: Mapping[str, object], indent: str, via: str = "") -> List[str]:
    lines = [f"{indent}{via}{_where(chain)}"]
    if chain.get("arguments"):
        args = _args(chain["arguments"])
        if args:
            lines.append(f"{indent}    with {args}")
    for name, sub in (chain.get("inputs") or {}).items():
        lines += _chain_lines(sub, indent + "  ", f"{name} from ")
    return lines


def code_version(run: Mapping[str, object]) -> str:
    """The code version a run record holds, as a line: commit and whether the tree was clean."""
    code = run.get("code") if isinstance(run, Mapping) else None
    if not isinstance(code, Mapping):
        return "not recorded (run before run-notebooks recorded it: run the notebook again)"
    if not code.get("commit"):
        return f"unknown ({code.get('reason', 'no git checkout')})"
    state = {True: "clean tree", False: "uncommitted changes in the tree"}.get(code.get("clean"),
                                                                              "tree state unknown")
    changed = code.get("changed") or []
    return f"commit {code['commit']} ({state}" + (f": {', '.join(changed)}" if changed else "") + ")"


def _configuration_lines(rows: Sequence[Mapping]) -> List[str]:
    configs = [r.get("configuration") for r in rows if isinstance(r.get("configuration"), dict)]
    if not configs:
        return []
    keys = list(dict.fromkeys(k for c in configs for k in c))
    shared = {k: configs[0].get(k) for k in keys
              if all(k in c and c[k] == configs[0].get(k) for c in configs)}
    return ["configuration shared by the rows: " + _args(shared, 400)] if shared and \
        len(configs) > 1 else []


def explain(key: str, published: Optional[Mapping] = None) -> str:
    """The record of the table published as ``key``, as text: the notebook and run (device,
    torch, profile, date, code version), the call path at publish time, the calls that made the
    table, each row's calls and configuration, each column's source. ``published``: the table as
    ``report.collect`` returns it."""
    if published is None:
        return f"{key}:\nno executed notebook in this checkout publishes it"
    run = published.get("run") or {}
    prov = published.get("provenance") or {}
    lines = [f"{key}: {published.get('title', '')}",
             f"notebook: notebooks/{published.get('notebook', '?')}",
             "run: " + (", ".join(f"{k}={run[k]}" for k in
                                  ("device_name", "torch", "profile", "date", "seconds") if k in run)
                        or "no run record"),
             f"code version: {code_version(run)}"]
    if "made by" not in prov:
        lines.append("this table was published before provenance was recorded from the code "
                     "that ran: run its notebook again (run-notebooks) to record it")
        return "\n".join(lines)
    lines.append(f"measured on: {prov.get('device')}; torch {prov.get('torch')} "
                 f"(CUDA {prov.get('cuda')})")
    lines.append("published by (outermost first):")
    for step in prov.get("published by", []):
        lines.append(f"  {_where(step)}" + (f"\n    {step['code']}" if step.get("code") else ""))
    lines.append("made by (the table, then the calls that made its inputs):")
    for chain in prov["made by"] or []:
        lines += _chain_lines(chain, "  ")
    if not prov["made by"]:
        lines.append("  no traced function returned these rows (built in the publishing code)")
    rows = prov.get("rows", [])
    lines.append(f"rows ({len(rows)}):")
    lines += ["  " + x for x in _configuration_lines(rows)]
    for r in rows:
        head = f"  {r['row']}. {r.get('first cell')}: "
        if not r.get("made by"):
            lines.append(head + "made in the publishing code from untraced values")
            continue
        ran = f"; ran {', '.join(_brief(n) for n in r['ran'])}" if r.get("ran") else ""
        lines.append(head + " <- ".join(_brief(n) for n in r["made by"]) + ran)
        config = r.get("configuration") or {}
        shared = _configuration_lines(rows)
        own = {k: v for k, v in config.items()} if not shared else {
            k: v for k, v in config.items()
            if any((o.get("configuration") or {}).get(k) != v for o in rows)}
        if own:
            lines.append("       configuration: " + _args(own, 400))
    if prov.get("rows not described"):
        lines.append(f"  ... and {prov['rows not described']} more rows")
    columns = prov.get("columns") or {}
    if columns:
        lines.append("columns:")
        for name, src in columns.items():
            lines.append(f"  {name}: {src['code']}  ({src['function']}, "
                         f"{src.get('file', '?')}:{src['line']})")
            for fed in src.get("fields from", []):
                lines.append(f"    {fed['field']} from {_where(fed)}")
    return "\n".join(lines)
