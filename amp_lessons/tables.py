"""Numbers as text, defined once: the one text-table formatter (and its HTML twin), value,
percentage and plural formatting, the one way generated Markdown and HTML protect identifiers
(code spans), and the one helper that turns results into plain JSON data. Every module and
lesson uses these."""
from __future__ import annotations

import decimal
import html
import math
import re
import unicodedata
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from amp_lessons.validate import check_int, is_int, is_real, plain_number
from amp_lessons.lineage import traced  # explain names what made each row

Column = Union[str, Tuple[str, str], Tuple[str, str, Union[str, Callable[[Any], str]]]]


BRIEF_FROM = 1e7  # from here on a table shows a number in brief (3 significant digits)


def format_value(value, digits: int = 2, missing: str = "n/a") -> str:
    """One value as a table cell: the course's one cell formatter (notebook tables, the README's
    tables, lesson and doctor tables all call it).

    ``None`` -> ``missing`` (``"n/a"``), a flag -> ``"yes"``/``"no"``; a float: thousands
    separated from 100 on, ``digits`` decimals from about 1, ``digits + 1`` significant digits
    below (never rounded to 0 when nonzero), brief (``digits + 1`` significant digits) from
    ``BRIEF_FROM`` on, NaN and infinities as ``nan``/``inf``; whole numbers thousands
    separated, as floats are; text as it is. NumPy scalars and 0-d tensors read as the numbers they hold.
    Example: ``format_value(1234.5) == "1,234"``, ``format_value(0.000123) == "0.000123"``."""
    check_int("digits", digits, 0)
    value = plain_number(value)
    if value is None:
        return missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= BRIEF_FROM:  # beyond any img/s or MiB figure: a blown-up value, briefly
            return f"{value:.{digits + 1}g}"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if value == 0 or abs(value) >= 0.995:
            return f"{value:.{digits}f}"
        return f"{value:.{digits + 1}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


NOISY_SPREAD = 0.10  # repeats of one row that disagree by more than this decide nothing


def noisy(row: Mapping[str, Any]) -> Optional[str]:
    """Why ``row``'s timing decides nothing because its repeats disagree (``spread`` over
    ``NOISY_SPREAD``), as a table's status says it, or None."""
    spread = plain_number(row.get("spread"))
    if is_real(spread) and spread > NOISY_SPREAD:
        return (f"noisy: repeats differ by {100 * spread:.0f}% (over "
                f"{100 * NOISY_SPREAD:.0f}%), decides nothing")
    return None


def percent(part: float, whole: float, digits: int = 3, floor: float = 0.001) -> str:
    """``part`` of ``whole`` as a percentage that never shows a nonzero share as zero.

    ``digits`` significant digits; below ``floor`` percent it reads ``"< 0.001% (3 of 2,000,000)"``
    with the count, above ``100 - floor`` it reads ``"> 99.999% (9,999,999 of 10,000,000)"``,
    and exactly zero and all of them read ``"0%"`` and ``"100%"``.
    """
    check_int("digits", digits, 1)
    if not is_real(floor) or not 0 < floor < 50:
        raise ValueError(f"floor must be a number in (0, 50) percent; got {floor!r}")
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
    text = _significant(share, digits)
    while float(text) >= 100.0 and digits < 17:  # 99.9996 must not read as all of them
        digits += 1
        text = _significant(share, digits)
    if float(text) >= 100.0:
        return f"> {100.0 - floor:g}% ({count} of {total})"
    return f"{text}%"


def _significant(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, never in scientific notation (45.3 to one
    digit is ``50``, not ``5e+01``)."""
    text = f"{value:.{digits}g}"
    if "e" in text:
        text = format(decimal.Decimal(text), "f")
    return text


MEASURED_NOT_COMPARED = "measured, not compared"


def spread_text(spread: float) -> str:
    """A relative spread (interquartile range or max-min over the median, so not a share: it
    can pass 1) as a percentage: ``percent(spread, 1)`` below 99%, one decimal from there on
    (``"100.4%"``, ``"837.0%"``: a share's formatter raised on 8.37, and clamping showed 100%)."""
    if not is_real(spread) or spread < 0:
        raise ValueError(f"spread must be a number >= 0; got {spread!r}")
    if spread < 0.99:
        return percent(spread, 1.0)
    # near and past 100%: a spread is no count of items ("> 99.999% (1 of 1)"), and 100.4%
    # must not read as 100%
    return f"{100.0 * spread:,.1f}%"


def not_compared(why: str) -> str:
    """The status of a row that was measured (its numbers are shown) but cannot be compared or
    decide anything here: ``"measured, not compared: <why>"``. A row that did not run says
    ``"not measured: <why>"`` instead, and has no numbers."""
    if not isinstance(why, str) or not why.strip():
        raise ValueError(f"why must say why the row cannot be compared; got {why!r}")
    return f"{MEASURED_NOT_COMPARED}: {why.strip()}"


def plural(count, word: str, many: Optional[str] = None) -> str:
    """``count`` and ``word`` as a reader writes them: ``"1 epoch"``, ``"3 epochs"``,
    ``"1,500 steps"``; ``many`` is the plural where adding an s is wrong (``"batches"``)."""
    if not is_real(count):
        raise ValueError(f"count must be a number; got {count!r}")
    if not isinstance(word, str) or not word:
        raise ValueError(f"word must be a non-empty string; got {word!r}")
    number = f"{int(count):,}" if is_int(count) or float(count).is_integer() else f"{count:g}"
    return f"{number} {word if count == 1 else (many or word + 's')}"


# --- identifiers in generated Markdown and HTML ------------------------------------------------
# Text a reader sees rendered (a README table, a notebook's table) may hold code: `__init__`,
# `channels_last`, `torch.amp.GradScaler(...)`. Rendered as plain Markdown, underscores turn into
# bold or italics and the name is lost, so code-like words go into code spans, defined once here.

_SPAN = re.compile(r"`[^`\n]+`")
_WORD = re.compile(r"(?<![\w`.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
                   r"(?:\([^()\n]*\)|=[\w.+\-*]+)?")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]~|]|<(?=[A-Za-z/!?]))")


def _is_code(word: str) -> bool:
    name = word.split("(", 1)[0].split("=", 1)[0]
    if word.endswith(("(s)", "(es)")):  # "warning(s)": a plural, not a call
        return "_" in name
    if "(" in word or "_" in name:
        return True
    parts = name.split(".")
    return len(parts) > 1 and any(len(p) > 1 for p in parts)  # torch.amp, not e.g


def code_pieces(text: str) -> List[Tuple[str, bool]]:
    """``text`` cut into ``(piece, is_code)``: spans already in backticks (without them) and
    code-like words (names with an underscore, dotted names, calls such as
    ``GradScaler.__init__()``) are code; everything else is prose."""
    pieces: List[Tuple[str, bool]] = []
    at = 0
    for span in _SPAN.finditer(text):
        pieces += _words(text[at:span.start()])
        pieces.append((span.group()[1:-1], True))
        at = span.end()
    return pieces + _words(text[at:])


def _words(text: str) -> List[Tuple[str, bool]]:
    pieces, at = [], 0
    for m in _WORD.finditer(text):
        if _is_code(m.group()):
            pieces += [(text[at:m.start()], False), (m.group(), True)]
            at = m.end()
    pieces.append((text[at:], False))
    return [p for p in pieces if p[0]]


def markdown_text(value, in_table: bool = False) -> str:
    """``value`` as Markdown that renders as the text it is: code in code spans, Markdown's
    special characters escaped elsewhere, one line; ``in_table`` also escapes ``|`` inside code
    spans (a table cell's pipe ends the cell even there)."""
    text = str(value).replace("\n", " ")
    out = []
    for piece, code in code_pieces(text):
        if code:
            fence = "``" if "`" in piece else "`"
            out.append(fence + (piece.replace("|", "\\|") if in_table else piece) + fence)
        else:
            out.append(_MD_SPECIAL.sub(r"\\\1", piece))
    return "".join(out)


def html_text(value) -> str:
    """``value`` as HTML: escaped, with the same code-like words as ``markdown_text`` in
    ``<code>``."""
    return "".join(f"<code>{html.escape(p)}</code>" if code else html.escape(p)
                   for p, code in code_pieces(str(value)))


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
    value = plain_number(row.get(key))  # NumPy scalars and 0-d tensors as Python numbers
    if cell is not None:
        return cell(value)
    if key == "status" and value != "ok" and row.get("reason"):
        return f"{value}: {row['reason']}"
    if len(col) > 2 and value is not None and _is_number(value):
        fmt = col[2]
        if callable(fmt):
            return fmt(value)
        return fmt.format(value) if "{" in fmt else format(value, fmt)
    return format_value(value)


def _grid(rows: Sequence[Mapping], columns: Optional[Sequence[Column]],
          formats: Optional[Mapping[str, str]], cell: Optional[Callable[[Any], str]]):
    """(headings, rows of cell texts, which columns are numeric): what both tables show."""
    if not rows:
        raise ValueError("rows must hold at least one row")
    if columns is None:
        formats = formats or {}
        head = list(rows[0].keys())

        def plain(col, v):
            v = plain_number(v)
            if col in formats and _is_number(v):
                return format(v, formats[col])
            return repr(v) if isinstance(v, float) else str(v)

        return head, [[plain(c, r.get(c)) for c in head] for r in rows], [False] * len(head)
    cols = _columns(rows, columns)
    if not cols:
        raise ValueError("columns must name at least one key present in the rows")
    cells = [[_cell(r, c, cell) for c in cols] for r in rows]
    numeric = [all(_is_number(plain_number(r.get(c[0]))) or r.get(c[0]) is None for r in rows)
               for c in cols]
    return [c[1] for c in cols], cells, numeric


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
    head, body, numeric = _grid(rows, columns, formats, cell)
    head, body = _one_line(head), [_one_line(r) for r in body]
    widths = [max(display_width(x) for x in col) for col in zip(head, *body)]

    def pad(text, width, right):
        gap = " " * (width - display_width(text))
        return gap + text if right else text + gap

    def line(values):
        return "  ".join(pad(v, w, num) for v, w, num in zip(values, widths, numeric)).rstrip()

    lines = [line(head), line(["-" * w for w in widths])]
    return "\n".join(lines + [line(c) for c in body])


def _one_line(cells: Sequence[str]) -> List[str]:
    """Cells of a text table on one line each (a line break would break the row)."""
    return [" ".join(c.splitlines()) for c in cells]


def display_width(text: str) -> int:
    """Columns ``text`` takes in a terminal or notebook's monospace font: wide East Asian
    characters take two, combining marks and format characters (zero-width space and joiner)
    none (``len`` counts each as one). An emoji sequence joined by zero-width joiners still
    counts each of its pictures: fonts differ in how they draw those."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(ch) or unicodedata.category(ch) == "Cf" else
               2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def html_table(rows: Sequence[Mapping], columns: Optional[Sequence[Column]] = None,
               formats: Optional[Mapping[str, str]] = None,
               cell: Optional[Callable[[Any], str]] = None) -> str:
    """The same table as ``text_table`` (same columns, cells and right-aligned numbers) as an
    HTML ``<table>``, with code in ``<code>``: what a notebook shows, so a wide table scrolls
    instead of wrapping mid-row."""
    head, body, numeric = _grid(rows, columns, formats, cell)

    def tr(values, tag):
        return "<tr>" + "".join(
            f'<{tag} style="text-align: {"right" if num else "left"}">{html_text(v)}</{tag}>'
            for v, num in zip(values, numeric)) + "</tr>"

    return ("<table>\n<thead>" + tr(head, "th") + "</thead>\n<tbody>\n"
            + "\n".join(tr(r, "td") for r in body) + "\n</tbody>\n</table>")


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
    plain = plain_number(obj)
    if plain is not obj:  # a 0-d tensor or NumPy array: its Python number
        return json_safe(plain)
    return str(obj)


# --- lesson 05's tables: techniques against fp32, the largest batch per card ------------------


def shown_technique(row: Mapping[str, Any]) -> str:
    """A technique's name as a table shows it: "fp32" becomes "TF32" where the row ran with TF32
    tensor-core math (precision "tf32" on a GPU; lesson 04's "fp32, TF32 on"); fp32 stays fp32
    only where the math is fp32 (a CPU, a GPU without TF32)."""
    name = str(row.get("technique", row.get("label", "")))
    precision = row.get("precision") or (row.get("config") or {}).get("precision")
    if precision == "tf32" and row.get("device_type") == "cuda" and name.startswith("fp32"):
        return "TF32" + name[len("fp32"):]
    return name


def technique_with_math(row: Optional[Mapping[str, Any]]) -> str:
    """The fp32 technique's row as a sentence names it: "TF32 (fp32 storage with TF32 tensor-core
    math: the same memory as fp32)" where it ran with TF32 math (``shown_technique``), "fp32"
    where the math was fp32 (or no row)."""
    name = shown_technique(row) if row else "fp32"
    return name if name == "fp32" else (f"{name} (fp32 storage with TF32 tensor-core math: the "
                                        f"same memory as fp32)")


@traced
def technique_report_rows(rows: Sequence[Dict[str, object]]) -> List[Dict[str, object]]:
    """``technique_table`` rows as a table to show and publish: step time, throughput, memory,
    memory and time against the fp32 row (named TF32 where it ran with TF32 math:
    ``shown_technique``), and the share of the step the GPU sat idle (host and
    launch overhead; None where a number is missing)."""
    ok = {r.get("technique", r.get("label")): r for r in rows if r.get("status") == "ok"}
    base = ok.get("fp32")
    base_name = shown_technique(base) if base else "fp32"

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = []
    for r in rows:
        good = r.get("status") == "ok"
        out.append({
            "technique": shown_technique(r),
            "batch": r.get("config", {}).get("batch_size"),
            "step ms": r.get("step_ms") if good else None,
            "img/s": r.get("img_per_s") if good else None,
            "memory GiB": r.get("memory_gib") if good else None,
            f"memory x {base_name}": ratio(r.get("memory_gib"), base.get("memory_gib"))
            if good and base else None,
            f"time x {base_name}": ratio(r.get("step_ms"), base.get("step_ms")) if good and base
            else None,
            "GPU idle %": 100 * r["gpu_idle_fraction"]
            if good and r.get("gpu_idle_fraction") is not None else None,
            "repeat spread %": 100 * r["spread"] if good and r.get("spread") is not None
            else None,
            "status": ("ok" if not noisy(r) else f"ok ({noisy(r)})") if good
            else f"{r.get('status')}: {r.get('reason')}"})
    return out


@traced
def largest_batch_report_rows(rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """``largest_batch_table`` rows pivoted to one row per card, one column per technique (the
    largest batch in images; None where skipped). Returns ``rows``, ``columns`` and ``note``
    (the search's resolution and every reason a cell was skipped or capped, once each)."""
    if not rows:
        raise ValueError("rows must hold at least one largest_batch_table row")
    techniques = list(dict.fromkeys(r["technique"] for r in rows))
    shown = {r["technique"]: shown_technique(r) for r in rows}
    cards = sorted({r["card_gb"] for r in rows})
    table = []
    for card in cards:
        line: Dict[str, object] = {"card (GB)": f"{card:g}"}
        for t in techniques:
            cell = next((r for r in rows if r["card_gb"] == card and r["technique"] == t), None)
            line[shown[t]] = cell["largest_batch"] if cell and cell["status"] == "ok" else None
        table.append(line)
    reasons = list(dict.fromkeys(f"{shown[r['technique']]}: {r['reason']}" for r in rows
                                 if r["reason"]))
    how = sorted({r["how"].split(" at ")[0] for r in rows if r["how"]})
    steps = sorted({r["resolution"] for r in rows if r["resolution"]})
    note = (f"Images per training step; searched in steps of {', '.join(map(str, steps))} "
            f"images ({'; '.join(how)}). " if steps else "") + \
        (f"Not measured or capped: {'; '.join(reasons)}." if reasons else "")
    return {"rows": table, "columns": ["card (GB)"] + [shown[t] for t in techniques],
            "note": note.strip()}


def pow2_text(value: float, html: bool = False) -> str:
    """``65536`` as ``2^16 = 65,536`` (``2<sup>16</sup> = 65,536`` with ``html``), other positive
    values as ``2^15.29 = 40,000``; ``0`` as ``0 (underflowed)``: a loss scale halved past the
    smallest float is zero, and must not read as "not measured"."""
    if value is None:
        return "n/a"
    if value == 0:
        return "0 (underflowed)"
    if not math.isfinite(value) or value < 0:
        return str(value)
    k = math.log2(value)
    exp = f"{k:.0f}" if abs(k - round(k)) < 1e-9 else f"{k:.2f}"
    shown = f"{value:,.0f}" if value >= 1 and value == int(value) else f"{value:.6g}"
    return f"2<sup>{exp}</sup> = {shown}" if html else f"2^{exp} = {shown}"
