"""benchmarks/cpu_skip_cost.py, the measurement behind ``nonfused_skip="auto"``: it runs, pairs
every variant with the hand loop of its round, and the figures ``TrainConfig``'s docstring and
NOTES.md quote are the committed result's."""
import json
import re
from pathlib import Path

from script_helpers import load_benchmark

from amp_lessons.train import config as _config

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "cpu_skip_cost.json"


def test_it_runs_and_reports_every_variant(tmp_path, capsys):
    bench = load_benchmark("cpu_skip_cost")
    out = tmp_path / "r.json"
    bench.main(["--batch", "2", "--image-size", "16", "--rounds", "2", "--steps", "1",
                "--warmup", "0", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == list(bench.VARIANTS)
    assert result["rows"][0]["cost_pct"] == 0.0 and result["noise_floor_pct"] >= 0
    assert "| trainer lean, nonfused_skip='copy' |" in bench.report(result)
    capsys.readouterr()


def test_the_quoted_figures_are_the_committed_result():
    result = json.loads(RESULT.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    doc = " ".join(_config.TrainConfig.__doc__.split())
    hand = rows["hand-written"]["step_ms"]
    copy = rows["trainer lean, nonfused_skip='copy'"]["cost_pct"]
    sync = rows["trainer lean, nonfused_skip='sync'"]["cost_pct"]
    quoted = (f"the hand loop {hand:.1f} ms a step, lean with ``\"copy\"`` +{copy:.0f}%, with "
              f"``\"sync\"`` +{sync:.0f}% inside a {result['noise_floor_pct']:.1f}% noise floor")
    assert quoted in doc
    notes = (ROOT / "benchmarks" / "NOTES.md").read_text()
    assert f"| trainer lean, `nonfused_skip=\"copy\"` | " in notes
    assert re.search(rf"\*\*\+{copy:.1f}%\*\*", notes)
    assert f"the noise floor, {result['noise_floor_pct']:.1f}%" in notes
