"""Every lesson states how long it takes, and the figures hold: the **Time** line of each title
cell and the README's lesson table give the CPU time of the quick profile (recorded from an nbval
run in docs/notebook_times.json by tools/notebook_times.py) and the H200 time of the committed
full run (the notebook's metadata); each is within 50% of what was measured, and so is the
latest nbval run's record on this machine (build/notebook-times, written by conftest.py), where
one exists."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("notebook_times", ROOT / "tools" / "notebook_times.py")
nt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nt)
RECORD = json.loads((ROOT / "docs" / "notebook_times.json").read_text())
STATING = sorted(p for p in (ROOT / "notebooks").glob("[01][0-9]_*.ipynb")
                 if p.name[:2] != "10")  # lesson 10 states its own times
README = (ROOT / "README.md").read_text()


def _close(stated, measured):
    return abs(stated - measured) <= 0.5 * measured


@pytest.mark.parametrize("path", STATING, ids=lambda p: p.name[:2])
def test_each_lesson_states_its_cpu_and_h200_times(path):
    nb = json.loads(path.read_text())
    said = nt.stated("".join(nb["cells"][0]["source"]))
    assert said, f"{path.name}: no **Time** line in the title cell"
    assert path.name in RECORD["notebooks"], f"{path.name}: no CPU time recorded"
    assert _close(said["cpu"], RECORD["notebooks"][path.name]["cpu_seconds"])
    h200 = nt.h200_seconds(nb)
    assert (said["h200"] is None) == (h200 is None), path.name
    if h200:
        assert _close(said["h200"], h200)


def test_the_readme_table_gives_the_same_times():
    head = README.split(nt.TABLE_HEAD_TIMED, 1)[1].split("\n\n", 1)[0]
    rows = [r for r in head.split("\n") if r.startswith("| ") and "](notebooks/" in r]
    assert len(rows) >= len(STATING)
    for path in STATING:
        (row,) = [r for r in rows if f"(notebooks/{path.name})" in r]
        cells = row.split(" | ")
        said = nt.stated("".join(json.loads(path.read_text())["cells"][0]["source"]))
        assert cells[4] == f"about {nt.duration(said['cpu'])}", row
        assert cells[5] == (f"about {nt.duration(said['h200'])}" if said["h200"] else "-"), row


def test_the_latest_nbval_run_here_agrees_within_half():
    """Where this machine ran the notebooks under nbval (make notebooks, or make test), each
    complete quick-profile run made alone is within 50% of the stated CPU time; where it did not,
    there is nothing to compare yet (a fresh clone runs the unit tests first; `make test` runs the
    notebooks beside two other test sessions, and its record says so)."""
    runs = {name: r for name, r in nt.build_records(nt.BUILD).items()
            if r.get("profile") == "quick" and not r.get("failed") and r.get("alone", False)
            and name in RECORD["notebooks"]}
    complete = {name: r for name, r in runs.items()
                if r["cells"] == sum(c["cell_type"] == "code" for c in json.loads(
                    (ROOT / "notebooks" / name).read_text())["cells"])}
    if not complete:
        pytest.skip("no complete nbval run of the notebooks recorded in build/notebook-times yet")
    off = {name: (r["seconds"], RECORD["notebooks"][name]["cpu_seconds"])
           for name, r in complete.items()
           if not _close(RECORD["notebooks"][name]["cpu_seconds"], r["seconds"])}
    assert not off, (f"stated CPU times more than 50% off this machine's latest run (measured, "
                     f"stated): {off}; refresh them with python tools/notebook_times.py record, "
                     f"then apply")


def test_durations_read_back_and_refuse_nonsense():
    for seconds, text in ((12.3, "10 s"), (41, "40 s"), (99, "100 s"), (376.2, "6.3 min")):
        assert nt.duration(seconds) == text and _close(nt.parse_duration(text), seconds)
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises(ValueError, match="seconds must be"):
            nt.duration(bad)
    with pytest.raises(ValueError, match="text must read"):
        nt.parse_duration("a minute")


def test_a_time_line_is_set_once_and_read_back():
    title = "# L\n\n**Hardware**: any.\n"
    once = nt.with_time_line(title, nt.time_line(41, 12.3))
    assert nt.stated(once) == {"cpu": 40.0, "h200": 10.0}
    twice = nt.with_time_line(once, nt.time_line(130, None))
    assert twice.count("**Time**") == 1 and twice.endswith("once it ran).\n")
    assert nt.stated(twice) == {"cpu": nt.parse_duration(nt.duration(130)), "h200": None}


def test_record_keeps_complete_quick_runs_made_alone_only(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    for name, seconds, failed, profile, alone in (("a.ipynb", 10.0, False, "quick", True),
                                                  ("b.ipynb", 20.0, True, "quick", True),
                                                  ("c.ipynb", 30.0, False, "full", True),
                                                  ("d.ipynb", 40.0, False, "quick", False)):
        (build / f"{name[:-6]}.json").write_text(json.dumps(
            {"notebook": name, "seconds": seconds, "failed": failed, "profile": profile,
             "cells": 3, "date": "2026-12-03T00:00:00+00:00", "alone": alone}))
    out = tmp_path / "times.json"
    kept = nt.record(build, out)
    assert list(kept["notebooks"]) == ["a.ipynb"] and json.loads(out.read_text()) == kept
    assert sorted(nt.record(build, out, include_failed=True)["notebooks"]) == ["a.ipynb", "b.ipynb"]


def test_the_readme_table_gains_its_time_columns():
    text = (f"{nt.TABLE_HEAD}\n|---|---|---|---|---|\n"
            f"| 01 | [One](notebooks/01_one.ipynb) | x | any | [open] |\n"
            f"| 02 | [Two](notebooks/02_two.ipynb) | y | gpu | [open] |\n")
    new = nt.readme_table(text, {"01_one.ipynb": {"cpu": 41, "h200": 376.2}})
    assert nt.TABLE_HEAD_TIMED in new and "|---|---|---|---|---|---|---|" in new
    assert "| 01 | [One](notebooks/01_one.ipynb) | x | any | about 40 s | about 6.3 min | [open] |" in new
    assert "| 02 | [Two](notebooks/02_two.ipynb) | y | gpu | - | - | [open] |" in new
    assert nt.readme_table(new, {"01_one.ipynb": {"cpu": 41, "h200": 376.2}}) == new
    with pytest.raises(ValueError, match="no lesson table"):
        nt.readme_table("# R\n", {})


def test_make_test_marks_its_notebook_times_as_shared_and_make_notebooks_as_alone():
    """`make test` runs the notebooks beside two other test sessions: its records must not be
    read as the lessons' times (a second `make test` in one clone failed the check above)."""
    import subprocess

    def dry(*args):
        return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout

    # (no STAMP=Makefile shortcut: make runs the recipe that remakes a makefile even under -n)
    assert "AMP_LESSONS_TIMED_ALONE=1" in dry("notebooks")
    assert "AMP_LESSONS_TIMED_ALONE=0" in dry("notebooks", "SHARED=1")
    assert "AMP_LESSONS_TIMED_ALONE=0" in dry("colab-workers")
    (side_by_side,) = [line for line in (ROOT / "Makefile").read_text().splitlines()
                       if "-j3 $(OUTPUT_SYNC) notebooks" in line]
    assert side_by_side.endswith(" SHARED=1")
