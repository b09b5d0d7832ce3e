"""Numbers as text, defined once: the one text-table formatter, value and percentage formatting,
and the one helper that turns results into plain JSON data. Every module and lesson uses these."""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

from ._validate import is_int, is_real

Column = Union[str, Tuple[str, str], Tuple[str, str, Union[str, Callable[[Any], str]]]]


def format_value(value, digits: int = 2) -> str:
    """One number as a table cell: ``None`` -> ``"n/a"``, thousands separated, small values to
    ``digits + 1`` significant digits (never rounded to 0 when nonzero), blown-up values brief."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e7:  # beyond any img/s or MiB figure: a blown-up value, say so briefly
            return f"{value:.{digits + 1}g}"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if value == 0 or abs(value) >= 0.995:
            return f"{value:.{digits}f}"
        return f"{value:.{digits + 1}g}"
    return str(value)


def percent(part: float, whole: float, digits: int = 3, floor: float = 0.001) -> str:
    """``part`` of ``whole`` as a percentage that never shows a nonzero share as zero.

    ``digits`` significant digits; below ``floor`` percent it reads ``"< 0.001% (3 of 2,000,000)"``
    with the count, above ``100 - floor`` it reads ``"> 99.999% (9,999,999 of 10,000,000)"``,
    and exactly zero and all of them read ``"0%"`` and ``"100%"``.
    """
    if not is_real(whole) or whole <= 0:
        raise ValueError(f"whole must be a number > 0; got {whole!r}")
    if not is_real(part) or not 0 <= part <= whole:
        raise ValueError(f"part must be a number in [0, whole={whole}]; got {part!r}")
    if part == 0:
        return "0%"
    if part == whole:
        return "100%"
    count = f"{int(part):,}" if is_int(part) else f"{float(part):g}"
    total = f"{int(whole):,}" if is_int(whole) else f"{float(whole):g}"
    share = 100.0 * part / whole
    if share < floor:
        return f"< {floor:g}% ({count} of {total})"
    if share > 100.0 - floor:  # all but a few: must not read as all of them
        return f"> {100.0 - floor:g}% ({count} of {total})"
    text = f"{share:.{digits}g}"
    if float(text) >= 100.0:  # 99.9996 must not read as all of them
        text = f"{share:.{digits + 3}g}"
    return f"{text}%"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _columns(rows: Sequence[Mapping], columns: Optional[Sequence[Column]]):
    out = []
    for c in columns:
        if isinstance(c, str):
            c = (c, c)
        if not isinstance(c, tuple) or len(c) not in (2, 3):
            raise ValueError(f"columns must hold keys or (key, heading[, format]) tuples; got {c!r}")
        out.append(c)
    return [c for c in out if any(c[0] in r for r in rows)]


def _cell(row: Mapping, col, cell: Optional[Callable[[Any], str]] = None) -> str:
    key = col[0]
    if cell is not None:
        return cell(row.get(key))
    value = row.get(key)
    if key == "status" and value != "ok" and row.get("reason"):
        return f"{value}: {row['reason']}"
    if len(col) > 2 and value is not None and _is_number(value):
        fmt = col[2]
        if callable(fmt):
            return fmt(value)
        return fmt.format(value) if "{" in fmt else format(value, fmt)
    return format_value(value)


def text_table(rows: Sequence[Mapping], columns: Optional[Sequence[Column]] = None,
               formats: Optional[Mapping[str, str]] = None,
               cell: Optional[Callable[[Any], str]] = None) -> str:
    """Rows of dicts as an aligned text table (the course's one table formatter).

    Without ``columns``: every key of the first row, headed by its name; ``formats`` maps a column
    to a format spec (``".4g"``) and other floats print in full (``repr``), so tables of exact
    facts (format limits, rounded values) show every digit. With ``columns``: ``key``,
    ``(key, heading)`` or ``(key, heading, format)`` (a spec, a ``"{:.0%}"`` pattern or a
    function); keys absent from every row are left out, ``None`` reads ``"n/a"``, a ``status``
    other than ``"ok"`` carries its ``reason``, and numeric columns are right-aligned. ``cell``,
    when given, formats every value instead (a lesson's own number style).
    """
    if not rows:
        raise ValueError("rows must hold at least one row")
    if columns is None:
        formats = formats or {}
        head = list(rows[0].keys())

        def plain(col, v):
            if col in formats and _is_number(v):
                return format(v, formats[col])
            return repr(v) if isinstance(v, float) else str(v)

        body = [[plain(c, r.get(c)) for c in head] for r in rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()
                 for line in [head] + body]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)
    cols = _columns(rows, columns)
    if not cols:
        raise ValueError("columns must name at least one key present in the rows")
    cells = [[_cell(r, c, cell) for c in cols] for r in rows]
    widths = [max(len(c[1]), *(len(line[i]) for line in cells)) for i, c in enumerate(cols)]
    numeric = [all(_is_number(r.get(c[0])) or r.get(c[0]) is None for r in rows) for c in cols]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    lines = [line([c[1] for c in cols]), line(["-" * w for w in widths])]
    return "\n".join(lines + [line(c) for c in cells])


def json_safe(obj):
    """``obj`` as plain JSON data: non-finite floats -> None, tuples -> lists, keys -> strings,
    numpy and 0-d torch numbers -> Python numbers, anything else (paths, dtypes) -> its text."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if callable(getattr(obj, "item", None)) and tuple(getattr(obj, "shape", (1,))) == ():
        return json_safe(obj.item())
    return str(obj)
