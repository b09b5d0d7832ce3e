"""benchmarks/trainer_gpu_paths.py, the GPU-only paths' check of the trainer's lazy records, runs
on a CPU too (without its capture part) and finds what it should there."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_paths_check_runs_and_agrees_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer_gpu_paths.py")], env=env,
                   check=True, capture_output=True, timeout=300)
    out = json.loads((tmp_path / "gpu_paths.json").read_text())
    assert out["scale_equal"] and out["norm_equal_on_finite_steps"] and out["weights_equal"]
    assert out["skipped"][:4] == [20, 21, 47, 90]  # the inf inputs; the scale backs off there
    assert len(out["scale_values"]) > 3  # it grew and backed off
    assert out["eager_all_positive"] and abs(out["eager_sum_over_wall"] - 1) < 0.05
    assert all(t > 0 for t in out["after_evaluate"])
