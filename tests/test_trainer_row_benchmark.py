"""benchmarks/trainer_row.py on the CPU: lesson 04's trainer row (and its hand-loop twin) through
``bench.run_configs`` as the notebook measures it; the compiled rows read "skipped" with the
reason and run eagerly at tiny sizes; ``--report`` renders the JSON. The H200 run decides
(issue 22)."""
import json

import pytest

from script_helpers import BENCHMARKS, load_benchmark


def _load():
    return load_benchmark("trainer_row")


def test_the_trainer_row_runs_and_reports_on_the_cpu(tmp_path, capsys):
    script = _load()
    out = tmp_path / "row.json"
    doc = script.main(["--rows", "trainer", "--json", str(out)])
    rows = doc["rows"]
    assert [r["status"] for r in rows] == ["skipped", "ok"]
    assert "GPU" in rows[0]["reason"] and rows[0]["config"]["loop"] == "trainer"
    assert rows[1]["config"]["trainer_tracking"] is False and rows[1]["img_per_s"] > 0
    assert rows[1]["config"]["compile"] is None  # the CPU smoke runs it eagerly
    assert json.loads(out.read_text())["rows"][1]["label"] == rows[1]["label"]
    capsys.readouterr()
    text = script.markdown(json.loads(out.read_text()))
    assert "skipped: torch.compile" in text and f"{rows[1]['img_per_s']:,.0f}" in text
    hand = script.configs(script.al.setup(quiet=True), ["hand"])
    assert hand[0].loop == "hand" and hand[0].label.startswith("hand-written loop: ")
    tuned = script.configs(script.al.setup(quiet=True), ["trainer", "hand"], "max-autotune")
    assert [c.compile for c in tuned[:2]] == ["max-autotune"] * 2
    assert "mode='max-autotune'" in tuned[0].label and "compile max-autotune" in tuned[1].label


@pytest.mark.parametrize("name, mode", [("trainer_row_h200", "reduce-overhead"),
                                        ("trainer_row_h200_max_autotune", "max-autotune")])
def test_the_committed_h200_runs_read_back_and_notes_quote_them(name, mode):
    doc = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())
    text = _load().markdown(doc)
    row = doc["rows"][0]
    assert row["config"]["loop"] == "trainer" and row["status"] == "ok"
    assert row["config"]["compile"] == mode and f"mode='{mode}'" in row["label"]
    assert f"{row['img_per_s']:,.0f}" in text and "batch 512" in text
    notes = (BENCHMARKS / "NOTES.md").read_text()
    assert text.splitlines()[-1] in notes  # the row as the report prints it


def test_lesson_04_quotes_the_committed_trainer_rows():
    """Lesson 04's section 10 quotes the two committed trainer-row runs (numbers measured
    outside the lesson): each img/s as the JSON holds it, and the file it comes from."""
    nb = json.loads((BENCHMARKS.parent / "notebooks" / "04_resnet50_memory_and_speed.ipynb").read_text())
    prose = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    prose = " ".join(prose.split())  # the numbers may wrap
    for name in ("trainer_row_h200", "trainer_row_h200_max_autotune"):
        doc = json.loads((BENCHMARKS / "results" / f"{name}.json").read_text())
        assert f"benchmarks/results/{name}.json" in prose
        assert f"{doc['rows'][0]['img_per_s']:,.0f} " in prose, name
    tuned = json.loads((BENCHMARKS / "results" / "trainer_row_h200_max_autotune.json")
                       .read_text())
    assert f"after {tuned['rows'][0]['seconds']:.0f} s of compiling" in prose
