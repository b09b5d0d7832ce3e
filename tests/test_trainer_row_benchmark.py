"""benchmarks/trainer_row.py on the CPU: lesson 04's trainer row (and its hand-loop twin) through
``bench.run_configs`` as the notebook measures it; the compiled rows read "skipped" with the
reason and run eagerly at tiny sizes; ``markdown`` renders the JSON."""
import json

from script_helpers import load_benchmark


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
