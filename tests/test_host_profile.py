"""benchmarks/host_profile.py, where the trainer's host time goes on a short step (issue 22):
it runs on a CPU, times host work per call without the profiler, and names the functions whose
own time or call count differs from the reference's."""
import json

import pytest
from script_helpers import load_benchmark


def test_it_runs_on_a_cpu_and_names_the_trainers_functions(tmp_path, capsys):
    bench = load_benchmark("host_profile")
    out = tmp_path / "h.json"
    doc = bench.main(["--quick", "--steps", "3", "--repeats", "2", "--warm-steps", "1",
                      "--top", "400", "--variants", "hand-written", "trainer, lean",
                      "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert list(doc["rows"]) == ["hand-written", "trainer, lean"] and doc["reference"] == "hand-written"
    for row in doc["rows"].values():
        assert row["host_ms_per_call"] > 0 and row["profile"]["calls_per_step"] > 10
    diff = {name: (us, calls) for name, us, calls in doc["differences"]["trainer, lean"]}
    # the trainer's own step runs once a call, and the hand loop's step function not at all
    assert diff["amp_lessons/train/trainer.py:" + _line("def train_step") + "(train_step)"][1] == 1.0
    assert "us a call unprofiled" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--variants", "no such variant"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--steps", "0"])


def test_differences_sort_by_size_then_name():
    bench = load_benchmark("host_profile")
    rows = {"ref": {"profile": {"functions": {"a": (1.0, 1), "b": (2.0, 1)}}},
            "v": {"profile": {"functions": {"a": (3.0, 2), "b": (2.0, 1), "c": (2.0, 1),
                                            "d": (-1.0, 0)}}}}
    assert bench.differences(rows, "ref", top=10) == {
        "v": [("a", 2.0, 1), ("c", 2.0, 1), ("d", -1.0, 0)]}
    assert bench.differences(rows, "ref", top=1)["v"] == [("a", 2.0, 1)]


def _line(prefix: str) -> str:
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "amp_lessons" / "trainer.py").read_text()
    return str(next(i for i, l in enumerate(text.splitlines(), 1) if l.strip().startswith(prefix)))


def test_the_figures_notes_quotes_are_the_committed_results():
    """NOTES.md's ninth-session figures on the recipe network are the committed H200 results'."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    results = root / "benchmarks" / "results"
    prof = json.loads((results / "host_profile_h200_recipe.json").read_text())
    calls = {k: r["profile"]["calls_per_step"] for k, r in prof["rows"].items()}
    assert (calls["hand-written"], calls["trainer, lean"]) == (378.0, 389.3)
    eager = json.loads((results / "skip_profile_h200_recipe_eager.json").read_text())
    assert eager["differences"]["trainer, lean"]["ops"] == []
    assert {r["profile"]["kernels_per_step"] for k, r in eager["rows"].items()
            if k != "trainer, defaults"} == {61.0}
    doc = json.loads((results / "trainer_overhead_h200_recipe_ninth.json").read_text())
    net = doc["networks"]["recipe"]
    rows = {(r["variant"], r["reference"]): r for r in net["rows"]}
    lean = rows[("trainer, lean", "hand-written")]
    assert (round(lean["cost_pct"], 2), [round(x, 2) for x in lean["cost_ci95_pct"]]) == (2.46, [1.34, 3.36])
    assert (round(lean["host_ms_per_call"], 3), round(rows[("hand-written", "hand-written")]["host_ms_per_call"], 3)) == (1.929, 1.883)
    graph = rows[("trainer lean, CUDA graph", "hand-written, CUDA graph")]
    assert round(graph["cost_pct"], 2) == 0.73 and round(net["noise_floor_pct"], 2) == 1.32
    same = rows[("trainer, defaults", "hand-written, logging norm and time")]
    assert round(same["cost_pct"], 2) == 0.31 and net["rounds"] == 400
    notes = (root / "benchmarks" / "NOTES.md").read_text()
    for quoted in ("**+2.46%** [+1.34, +3.36]", "floor **1.32%**", "**+0.73%** [+0.67, +0.82]",
                   "**+0.31%** [-0.81, +1.39]", "**389.3 Python calls a step against the hand "
                   "loop's 378.0**", "1.929 against 1.883 ms", "same 239 aten ops and the same 61"):
        assert quoted in notes, quoted


@pytest.mark.parametrize("path, shown", [
    ("/w/amp_lessons/amp_lessons/trainer.py", "amp_lessons/train/trainer.py"),
    ("/w/amp_lessons/benchmarks/trainer_overhead.py", "benchmarks/trainer_overhead.py"),
    ("/v/lib/python3.12/site-packages/torch/optim/sgd.py", "torch/optim/sgd.py"),
    ("/v/lib/python3.12/site-packages/amp_lessons/_compat.py", "amp_lessons/_compat.py"),
    ("~", "~")])
def test_function_keys_name_the_package_path_whatever_the_checkouts_name(path, shown):
    """A checkout folder named amp_lessons read as amp_lessons/amp_lessons/... (the first
    occurrence was cut), and the notes' keys did not match."""
    assert load_benchmark("host_profile")._where((path, 7, "f")) == f"{shown}:7(f)"
