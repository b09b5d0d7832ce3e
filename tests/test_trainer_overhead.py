"""benchmarks/trainer_overhead.py on the CPU (tiny sizes): it runs within its budget, reports
its noise floor and each variant's interval, and every eager variant ends bitwise equal to its
hand loop. The numbers themselves mean nothing here; the H200 run decides (issue 22)."""
import importlib.util
import json
import random
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "trainer_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trainer_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_noise_floor_and_intervals(bench):
    rng = random.Random(0)
    assert bench.noise_floor([1.0] * 10, rng) == 0.0
    noisy = [1.0 + (-1) ** i * 0.05 for i in range(20)]
    assert 0 < bench.noise_floor(noisy, rng) <= 10.0
    s = bench.summarise([1.10] * 5, rng)
    assert s["cost_pct"] == pytest.approx(10.0) and s["cost_ci95_pct"] == pytest.approx([10, 10])


def test_smoke_run_writes_json_and_stays_bitwise(bench, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    bench.main(["--networks", "mlp_bf16", "--budget", "6", "--min-rounds", "2",
                "--max-rounds", "3", "--json", str(out)])
    doc = json.loads(out.read_text())
    net = doc["networks"]["mlp_bf16"]
    assert net["rounds"] >= 2 and net["noise_floor_pct"] >= 0
    variants = {r["variant"]: r for r in net["rows"]}
    assert {"hand-written", "hand-written (again)", "trainer, defaults", "trainer, lean",
            "lean, nonfinite='raise'",
            "trainer lean, foreach SGD, skip by host decision"} <= set(variants)
    for row in net["rows"]:
        low, high = row["cost_ci95_pct"]
        assert low <= row["cost_pct"] <= high
        assert row["bitwise_equal_to_reference"], row["variant"]
    assert {g["variant"] for g in doc["goals"]} == {"trainer, defaults", "trainer, lean"}
    capsys.readouterr()
    bench.main(["--report", str(out)])
    report = capsys.readouterr().out
    assert "**mlp_bf16** (bf16): noise floor" in report and "| trainer, lean |" in report
