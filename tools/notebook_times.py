"""How long each notebook takes, stated where a learner looks: the **Time** line of each lesson's
title cell and the README's lesson table give the CPU time of the quick profile (as CI runs it
under nbval) and the H200 time of the committed full run.

The figures come from runs, never from a hand: the CPU seconds from the records every nbval run
writes (``conftest.py`` -> ``build/notebook-times/<notebook>.json``), kept in
``docs/notebook_times.json`` by ``record``; the H200 seconds from the notebook's own metadata
(``amp_lessons.run.seconds``, written by the GPU run). ``tests/test_notebook_times.py`` holds the
stated figures within 50% of both.

Usage, after an nbval run of the notebooks (``make notebooks`` or pytest --nbval-lax ...)::

    python tools/notebook_times.py record     # build/notebook-times -> docs/notebook_times.json
    python tools/notebook_times.py record --include-failed   # runs with failing cells too
    python tools/notebook_times.py apply      # the Time lines and the README's table from it
"""
import json
import math
import re
import sys
from pathlib import Path
from typing import Dict, Optional

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "notebook_times.json"
BUILD = ROOT / "build" / "notebook-times"
HOW = ("nbval, profile quick, OMP_NUM_THREADS=1, one notebook at a time, on a 2-core machine "
       "with nothing else running (inside make test, beside its other jobs, the same notebooks "
       "take two to four times as long)")
TIME_LINE = re.compile(r"\*\*Time\*\*: about (?P<cpu>[\d.]+ (?:s|min)) on a CPU .*?"
                       r"(?:about (?P<gpu>[\d.]+ (?:s|min)) on an NVIDIA H200|"
                       r"(?P<nogpu>no H200 run yet))", re.S)
TABLE_HEAD = "| # | notebook | what you learn | hardware | open |"
TABLE_HEAD_TIMED = ("| # | notebook | what you learn | hardware | CPU, quick profile (CI) | "
                    "H200, full profile | open |")


def duration(seconds: float) -> str:
    """``seconds`` as a notebook states it: "40 s" (to 5 s) under 100 s, else "3.5 min"."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a number above 0; got {seconds!r}")
    if seconds < 100:
        return f"{max(5, 5 * round(seconds / 5))} s"
    return f"{seconds / 60:.1f} min"


def parse_duration(text: str) -> float:
    """The seconds a ``duration`` text states ("40 s" -> 40.0, "3.5 min" -> 210.0)."""
    m = re.fullmatch(r"\s*([\d.]+) (s|min)\s*", text)
    if not m:
        raise ValueError(f"text must read 'N s' or 'N min'; got {text!r}")
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def time_line(cpu_s: float, h200_s: Optional[float]) -> str:
    """The **Time** line of a lesson's title cell."""
    gpu = (f"about {duration(h200_s)} on an NVIDIA H200 (full profile: the committed run, "
           f"`amp_lessons.run.seconds` in the notebook's metadata)" if h200_s else
           "no H200 run yet (the full profile's time appears here once it ran)")
    return (f"**Time**: about {duration(cpu_s)} on a CPU (quick profile, as CI runs it: one "
            f"thread, measured alone on a 2-core machine; longer on a busy one), {gpu}.")


def stated(text: str) -> Optional[Dict[str, Optional[float]]]:
    """The seconds a title cell's **Time** line states: {"cpu": s, "h200": s or None}, or None
    where the cell has no such line."""
    m = TIME_LINE.search(text)
    if not m:
        return None
    return {"cpu": parse_duration(m.group("cpu")),
            "h200": parse_duration(m.group("gpu")) if m.group("gpu") else None}


def h200_seconds(notebook: dict) -> Optional[float]:
    """The committed full run's seconds from a notebook's metadata, where that run was on an
    H200; else None."""
    run = notebook.get("metadata", {}).get("amp_lessons", {}).get("run", {})
    if "H200" not in str(run.get("device_name", "")) or run.get("profile") != "full":
        return None
    return run.get("seconds")


def build_records(build: Path = BUILD) -> Dict[str, dict]:
    """{notebook: its latest nbval record} from ``build`` (see ``conftest.py``)."""
    out = {}
    for path in sorted(Path(build).glob("*.json")):
        record = json.loads(path.read_text())
        out[record["notebook"]] = record
    return out


def record(build: Path = BUILD, path: Path = RECORD, include_failed: bool = False) -> dict:
    """Keep the CPU seconds of the quick-profile runs in ``build`` in ``path`` (notebooks not in
    ``build`` keep their earlier figure): runs made alone (``make notebooks``, not ``make test``,
    which shares the machine), passing runs only, unless ``include_failed`` (a run
    whose failing cells are late checks still times the lesson; the record says it failed)."""
    kept = json.loads(path.read_text()) if path.exists() else {"how": HOW, "notebooks": {}}
    for name, r in build_records(build).items():
        if r.get("profile") == "quick" and r.get("alone", False) and (
                include_failed or not r.get("failed")):
            kept["notebooks"][name] = {"cpu_seconds": r["seconds"], "date": r["date"],
                                       "omp_num_threads": r.get("omp_num_threads"),
                                       "cpu_count": r.get("cpu_count"),
                                       "cells_failed": bool(r.get("failed"))}
    kept["how"] = HOW
    path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    return kept


def with_time_line(title: str, line: str) -> str:
    """A title cell's text with its **Time** line set to ``line`` (after the Hardware
    paragraph, where there was none)."""
    if TIME_LINE.search(title):
        return re.sub(r"\*\*Time\*\*:[^\n]*", lambda m: line, title, count=1)
    return title.rstrip("\n") + "\n\n" + line + "\n"


def readme_table(text: str, times: Dict[str, Dict[str, Optional[float]]]) -> str:
    """The README's lesson table with its two time columns filled from ``times`` ({notebook
    file: {"cpu": s, "h200": s or None}}); rows of notebooks not in ``times`` read "-"."""
    if TABLE_HEAD in text:
        text = text.replace(TABLE_HEAD, TABLE_HEAD_TIMED).replace(
            "|---|---|---|---|---|", "|---|---|---|---|---|---|---|", 1)
    if TABLE_HEAD_TIMED not in text:
        raise ValueError("the README has no lesson table to put the times in")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"\| (\d\d) \| \[[^\]]*\]\(notebooks/([\w.]+\.ipynb)\)", line)
        if not m:
            continue
        cells = line.split(" | ")
        t = times.get(m.group(2), {})
        cpu = f"about {duration(t['cpu'])}" if t.get("cpu") else "-"
        gpu = f"about {duration(t['h200'])}" if t.get("h200") else "-"
        if len(cells) == 5:  # no time columns yet: # | notebook | learn | hardware | open |
            cells = cells[:4] + [cpu, gpu] + cells[4:]
        else:
            cells[4], cells[5] = cpu, gpu
        lines[i] = " | ".join(cells)
    return "\n".join(lines)


def times_for(notebooks: Dict[str, dict], kept: dict) -> Dict[str, Dict[str, Optional[float]]]:
    """{notebook file: {"cpu": recorded seconds, "h200": metadata seconds}} for the notebooks
    the record holds."""
    return {name: {"cpu": kept["notebooks"][name]["cpu_seconds"],
                   "h200": h200_seconds(nb)}
            for name, nb in notebooks.items() if name in kept["notebooks"]}


def main(argv=None) -> int:
    """``record`` or ``apply``, as the module docstring says."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args not in (["record"], ["record", "--include-failed"], ["apply"]):
        print(__doc__)
        return 2
    if args[0] == "record":
        kept = record(include_failed=args[1:] == ["--include-failed"])
        print(f"{RECORD}: {len(kept['notebooks'])} notebooks")
        return 0
    kept = json.loads(RECORD.read_text())
    for name in kept["notebooks"]:
        path = ROOT / "notebooks" / name
        nb = json.loads(path.read_text())
        title = "".join(nb["cells"][0]["source"])
        line = time_line(kept["notebooks"][name]["cpu_seconds"], h200_seconds(nb))
        new = with_time_line(title, line)
        nb["cells"][0]["source"] = [s + "\n" for s in new.split("\n")[:-1]] + [new.split("\n")[-1]]
        path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False))
    notebooks = {name: json.loads((ROOT / "notebooks" / name).read_text())
                 for name in kept["notebooks"]}
    readme = ROOT / "README.md"
    readme.write_text(readme_table(readme.read_text(), times_for(notebooks, kept)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
