"""benchmarks/aftereffect.py (does anything a lesson row does leave a cost behind?) runs end to
end on a CPU in its tiny sizes and writes every phase against the first timing."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_aftereffect_runs_every_phase_on_the_cpu(tmp_path):
    out = tmp_path / "after.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aftereffect.py"), "--json", str(out),
                    "--steps", "1", "--repeats", "2"], check=True, capture_output=True, timeout=300,
                   cwd=tmp_path)
    doc = json.loads(out.read_text())
    phases = [p["phase"] for p in doc["phases"]]
    assert phases[0] == "baseline" and doc["phases"][0]["vs_baseline_pct"] == 0
    assert any("profiler" in p for p in phases) and phases[-1].startswith("after bench.measure")
    assert all(p["ms"] > 0 and len(p["repeats_ms"]) == 2 for p in doc["phases"])
    assert doc["measure_status"] == "ok" and doc["timer_median_ms"] > 0
