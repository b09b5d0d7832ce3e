"""benchmarks/skip_profile.py, the profile behind the skip's layout fix (NOTES.md, eighth
session): it runs on a CPU, reads kernel time, count and GPU idle time from a profiler trace,
names the kernels and ops that differ from the reference, and the figures NOTES.md quotes are
the committed H200 result's."""
import json
from pathlib import Path

import pytest
from script_helpers import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "skip_profile_h200_resnet50_bf16.json"


def test_kernel_summary_counts_time_and_idle_gaps(tmp_path):
    bench = load_benchmark("skip_profile")
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "a", "ts": 5, "dur": 10},    # overlaps the first: busy 0-15
        {"cat": "gpu_memcpy", "name": "copy", "ts": 25, "dur": 5},  # idle 15-25
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 1},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 2, "dur": 1},
        {"cat": "kernel", "name": "no duration", "ts": 40}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    s = bench.kernel_summary(str(path), steps=2)
    assert s["kernels_per_step"] == 1.5  # three timed kernels over two steps
    assert s["kernel_ms_per_step"] == pytest.approx(25 / 2 / 1e3)
    assert s["gpu_idle_ms_per_step"] == pytest.approx(10 / 2 / 1e3)
    assert s["window_ms_per_step"] == pytest.approx(30 / 2 / 1e3)
    assert s["op_counts"] == {"aten::copy_": 1.0} and s["ops_per_step"] == 1.0
    assert s["by_name"]["a"] == (pytest.approx(0.01), 1.0)


def test_it_runs_on_a_cpu_and_names_what_differs(tmp_path, capsys):
    bench = load_benchmark("skip_profile")
    out = tmp_path / "p.json"
    doc = bench.main(["--quick", "--steps", "1", "--repeats", "2", "--profile-steps", "1",
                      "--warm-steps", "1", "--top", "100", "--variants", "hand-written",
                      "trainer, lean",
                      "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert list(doc["rows"]) == ["hand-written", "trainer, lean"] and doc["reference"] == "hand-written"
    # the trainer's skip runs the check kernel the hand loop does not
    ops = dict(doc["differences"]["trainer, lean"]["ops"])
    assert ops.get("aten::_amp_foreach_non_finite_check_and_unscale_") == 1
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--variants", "no such variant"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--repeats", "0"])
    capsys.readouterr()


def test_the_figures_notes_quotes_are_the_committed_result():
    doc = json.loads(RESULT.read_text())
    rows = doc["rows"]
    assert doc["network"] == "resnet50_bf16" and "H200" in doc["device"]
    hand, copy, sync = rows["hand-written"], rows["trainer, lean"], rows["lean, nonfused_skip='sync'"]
    assert (hand["profile"]["kernels_per_step"], copy["profile"]["kernels_per_step"]) == (980, 1963)
    assert dict(doc["differences"]["trainer, lean"]["ops"])["aten::copy_"] == 966
    assert copy["profile"]["kernel_ms_per_step"] - hand["profile"]["kernel_ms_per_step"] == \
        pytest.approx(1.84, abs=0.01)
    assert sync["profile"]["kernel_ms_per_step"] - hand["profile"]["kernel_ms_per_step"] == \
        pytest.approx(0.17, abs=0.01)
    assert sync["profile"]["gpu_idle_ms_per_step"] - hand["profile"]["gpu_idle_ms_per_step"] == \
        pytest.approx(2.43, abs=0.01)
    notes = (ROOT / "benchmarks" / "NOTES.md").read_text()
    for quoted in ("1,963 kernels a step against the\nhand loop's 980", "966 single-tensor copies",
                   "+1.8 ms of kernel time", "(+0.17 ms)", "GPU idle 2.4 ms longer"):
        assert quoted in notes, quoted


def test_the_after_figures_notes_quotes_are_the_committed_results():
    """The ninth session's table and profile figures (NOTES.md) are the committed H200 results'
    after the layout fix: the copy path back to a few multi-tensor kernels, about 1.4%."""
    results = ROOT / "benchmarks" / "results"
    prof = json.loads((results / "skip_profile_h200_resnet50_bf16_after.json").read_text())
    rows = prof["rows"]
    hand, copy = rows["hand-written"]["profile"], rows["trainer, lean"]["profile"]
    assert (hand["kernels_per_step"], copy["kernels_per_step"]) == (980, 1015)
    assert copy["kernel_ms_per_step"] - hand["kernel_ms_per_step"] == pytest.approx(0.75, abs=0.005)
    assert "aten::copy_" not in dict(prof["differences"]["trainer, lean"]["ops"])
    sync = rows["lean, nonfused_skip='sync'"]
    assert (round(sync["ms_per_step"], 2), round(rows["hand-written"]["ms_per_step"], 2)) == (58.29, 54.73)
    doc = json.loads((results / "trainer_overhead_h200_resnet50_bf16_after.json").read_text())
    net = doc["networks"]["resnet50_bf16"]
    cost = {r["variant"]: r["cost_pct"] for r in net["rows"]}
    assert round(cost["trainer, lean"], 2) == 1.42 and round(cost["lean, nonfused_skip='sync'"], 2) == 5.89
    assert round(cost["lean, nonfinite='ignore'"], 2) == -0.03 and round(net["noise_floor_pct"], 2) == 0.01
    assert all(r["bitwise_equal_to_reference"] for r in net["rows"])
    graph = json.loads((results / "skip_profile_h200_recipe_graph.json").read_text())["rows"]
    ratio = graph["trainer lean, CUDA graph"]["ms_per_step"] / graph["hand-written, CUDA graph"]["ms_per_step"]
    assert round(100 * (ratio - 1), 2) == 0.63
    notes = (ROOT / "benchmarks" / "NOTES.md").read_text()
    for quoted in ("**1,015 kernels a step against the hand loop's 980**", "**+1.42%** [+1.41, +1.44]",
                   "+5.89% [+5.57, +6.25]", "58.29 ms against 54.73", "(**+0.63%**, 59 kernels",
                   "floor **0.01%**"):
        assert quoted in notes, quoted
