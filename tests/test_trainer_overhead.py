"""benchmarks/trainer_overhead.py on the CPU at tiny sizes: every variant trains the same weights
as the hand loop, the paired costs and their spread are computed from the rounds, the JSON is
written after each network and renders as the findings file's table; the skip checks pass. Its
numbers decide nothing on a CPU: the H200 run does (benchmarks/NOTES.md)."""
import json

import pytest
import torch

from script_helpers import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("trainer_overhead")


def test_a_tiny_run_writes_paired_costs_for_every_variant(script, tmp_path):
    out = tmp_path / "overhead.json"
    doc = script.main(["--quick", "--networks", "recipe", "--rounds", "2", "--steps", "1",
                       "--warmup", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == doc
    (row,) = doc["rows"]
    assert row["network"] == "recipe" and row["precision"] == "fp16" and row["rounds"] == 2
    assert list(row["variants"]) == list(script.VARIANTS)
    hand = row["variants"]["hand"]
    assert hand["cost_pct"] is None and hand["step_ms"]["median"] > 0
    for name in script.VARIANTS[1:]:
        cost = row["variants"][name]["cost_pct"]
        assert cost["min"] <= cost["median"] <= cost["max"]
        assert cost["q1"] <= cost["median"] <= cost["q3"]
        assert row["variants"][name]["bitwise_equal"]  # the trainer's arithmetic is the recipe's
    assert all(c["skipped"] and c["unchanged"] and c["trains_on"] for c in doc["skip_checks"])
    table = script.markdown(doc)
    assert f"{hand['step_ms']['median']:.3f}" in table and table.count("| recipe |") == 4
    script.main(["--report", str(out)])


def test_spread_reads_quartiles_and_extremes(script):
    assert script.spread([4.0, 1.0, 2.0, 3.0, 5.0]) == {"median": 3.0, "q1": 1.5, "q3": 4.5,
                                                        "min": 1.0, "max": 5.0}
    assert script.spread([4.0])["q1"] == 4.0


def test_the_transformer_stack_gives_one_row_per_token(script):
    model, make_opt, x, y, channels_last = script.build("transformer", torch.device("cpu"), True)
    assert model(x).shape == (y.shape[0], 1000) and not channels_last
    assert isinstance(make_opt(model.parameters()), torch.optim.AdamW)
