"""benchmarks/capture_bits.py, the diagnosis of "trainer defaults, CUDA graph" against the
hand-captured step, runs on a CPU (its eager variants only) and finds them bitwise equal there;
a variant that trains differently is caught at the step it diverges."""
import json

import torch

from script_helpers import load_benchmark


def load():
    return load_benchmark("capture_bits")


def test_the_eager_variants_agree_on_the_cpu(tmp_path, monkeypatch, capsys):
    bits = load()
    monkeypatch.setenv("OUT", str(tmp_path))
    bits.main(["--quick", "--steps", "3"])
    out = json.loads((tmp_path / "capture_bits.json").read_text())
    assert set(out["compare"]) == {"eager: hand", "eager: hand + unscale_",
                                   "eager: trainer defaults", "eager: trainer lean"}
    for row in out["compare"].values():
        assert row["bitwise_equal_to_hand"] and row["first_step_whose_weights_differ"] is None
    assert all(len(log) == 3 for log in out["runs"].values())
    for impl in ("fused", "foreach"):  # scaler.step alone against unscale_ first: the same bits
        assert out["kernel"][impl]["bitwise_equal"], out["kernel"]
        assert out["kernel"][impl]["max_abs_difference_per_step"] == [0.0] * 3
    capsys.readouterr()


def test_kernel_bits_tells_a_different_step_apart(monkeypatch):
    bits = load()
    real = torch.amp.GradScaler.unscale_

    def off_by_a_bit(self, opt):  # unscale_, then nudge the gradient: another update (fused:
        # scaler.step alone never calls unscale_, it hands the kernel grad_scale)
        real(self, opt)
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.mul_(1 + 2 ** -10)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", off_by_a_bit)
    out = bits.kernel_bits(torch.device("cpu"), n=64, steps=2, impls=("fused",))
    assert not out["fused"]["bitwise_equal"]
    assert all(d > 0 for d in out["fused"]["max_abs_difference_per_step"])


def test_a_different_run_is_caught_at_its_first_step(monkeypatch, tmp_path, capsys):
    bits = load()
    real = bits.hand

    def slower(device, quick, graph, unscale):  # a learning rate of its own: another run
        step, m, opt = real(device, quick, graph, unscale)
        if unscale:
            for g in opt.param_groups:
                g["lr"] = 0.02
        return step, m, opt

    monkeypatch.setattr(bits, "hand", slower)
    monkeypatch.setenv("OUT", str(tmp_path))
    bits.main(["--quick", "--steps", "3"])
    row = json.loads((tmp_path / "capture_bits.json").read_text())["compare"][
        "eager: hand + unscale_"]
    assert not row["bitwise_equal_to_hand"] and row["first_step_whose_weights_differ"] == 0
    assert row["largest_difference"] > 0 and "model.0.weight" in row["differing"]
    assert bits.weight_hash(torch.nn.Linear(2, 2)) != 0
    capsys.readouterr()


def test_load_benchmark_names_a_missing_script():
    import pytest

    with pytest.raises(ValueError, match="name must be a script in benchmarks/"):
        load_benchmark("no_such_script")


def test_the_committed_h200_run_falls_in_the_two_groups_notes_describe():
    """results/capture_bits_h200.json: per-step weight hashes equal within each group of
    benchmarks/NOTES.md ("Measured on the H200"), different between the groups."""
    from script_helpers import BENCHMARKS

    doc = json.loads((BENCHMARKS / "results" / "capture_bits_h200.json").read_text())
    hashes = {name: [r["hash"] for r in log] for name, log in doc["runs"].items()}
    plain = ["eager: hand", "graph: hand", "eager: trainer lean", "graph: trainer lean",
             "graph: trainer lean + memory", "graph: trainer lean + time"]
    unscaled = ["eager: hand + unscale_", "graph: hand + unscale_", "eager: trainer defaults",
                "graph: trainer defaults", "graph: trainer lean + norm"]
    assert set(hashes) == set(plain + unscaled) and doc["steps"] == 12
    assert all(hashes[n] == hashes[plain[0]] for n in plain)
    assert all(hashes[n] == hashes[unscaled[0]] for n in unscaled)
    assert hashes[plain[0]][0] != hashes[unscaled[0]][0]  # from the first step on
    assert all(doc["compare"][n]["equal_to_its_eager_twin"] for n in
               ("graph: hand", "graph: trainer lean", "graph: trainer defaults"))
