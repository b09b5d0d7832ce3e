"""Lesson 09's module: the three models, lesson 04's comparison, lesson 07's crossover, the
summary and the cheat sheet. Fast, CPU (the doctor itself: test_doctor.py)."""
import pytest
import torch

from amp_lessons.doctor import bench_cases as BENCH_CASES
from amp_lessons.doctor.report import DoctorReport
from amp_lessons.lessons import l09_your_model as L


def test_overflowing_transformer_is_deterministic_and_passes_fp16():
    a, (x, y), info = L.overflowing_transformer(d_model=16, n_layers=1, seq_len=8, batch_size=2)
    b, (x2, _), info2 = L.overflowing_transformer(d_model=16, n_layers=1, seq_len=8, batch_size=2)
    assert info == info2 and torch.equal(x, x2) and x.shape == y.shape == (2, 8)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    seen = {}
    a.blocks[0].mlp[2].register_forward_hook(lambda m, i, o: seen.setdefault("max", o.abs().max()))
    with torch.no_grad():
        out = a(x)
    assert L.FP16_MAX < float(seen["max"]) <= 8 * L.FP16_MAX and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="d_model must be"):
        L.overflowing_transformer(d_model=4)


def test_gpt_and_resnet_cases():
    net, (x, y) = L.gpt_case(dict(d_model=16, n_layers=1, n_heads=2, seq_len=8), 3,
                             corpus_bytes=8192)
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.int64 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])
    net, (x, y) = L.resnet_case("resnet18", 2, 32)
    assert x.shape == (2, 3, 32, 32) and y.shape == (2,)


def test_lesson07_crossover_reads_the_committed_run(tmp_path):
    width, where = L.lesson07_crossover()
    if width is not None:  # the committed lesson 07 holds a GPU run with its speed sweep
        assert width in (1024, 2048, 4096, 8192) and "lesson 07's committed run" in where
    assert L.lesson07_crossover(tmp_path / "none.ipynb")[0] is None


def _report(speed):
    return DoctorReport(model="m", parameters=1, device="cuda:0", device_name="GPU", torch="x",
                        batch="1", loss="l", layers=[], scale_exponent=3, overflow=[],
                        fp16_nonfinite=[], advice={"precision": "fp16", "fp16_safe": True,
                                                   "lines": []},
                        scaler_trial=[], trace={}, compiled={}, speed=speed,
                        fp8={"status": "no FP8 on this GPU", "reason": "r"}, findings=[])


def test_agreement_and_summary():
    timed = {"status": "ok", "timer": "CUDA events", "steps": 15, "warmup": 5,
             "gpu_idle_fraction": 0.01}
    mine = [dict(timed, precision="fp16", samples_per_s=103.0, decided=True, gate=""),
            dict(timed, precision="fp32", samples_per_s=50.0, decided=True, gate="")]
    rows = [dict(timed, config={"precision": "fp16"}, img_per_s=100.0),
            dict(timed, config={"precision": "fp32"}, img_per_s=60.0),
            dict(timed, config={"precision": "bf16"}, img_per_s=60.0)]
    got = L.agreement(_report(mine), rows)
    assert [r["within 5%"] for r in got] == [True, False]
    assert got[0]["difference %"] == pytest.approx(3.0)
    assert got[0]["repeat spread %"] is None  # neither row carried a spread
    noisy = L.agreement(_report([dict(mine[0], spread=0.02)]), [dict(rows[0], spread=0.15)])
    assert noisy[0]["repeat spread %"] == pytest.approx(15.0) and noisy[0]["within 5%"] is None
    assert "repeats" in noisy[0]["why not decided"]
    short = L.agreement(_report(mine), [dict(rows[0], steps=2)])
    assert short[0]["within 5%"] is None and "timed steps" in short[0]["why not decided"]
    row = L.summary({"m": _report(mine)})[0]
    assert row["fastest (decided)"] == "fp16" and row["loss scale"] == "2^3"
    assert row["alarms"] == "none" and "verdict" in row
    mine[1]["decided"] = False
    assert L.summary({"m": _report(mine)})[0]["fastest (decided)"] == "not decided"


def test_the_repository_cheat_sheet_renders():
    if L.CHEAT_SHEET.is_file():
        text = L.cheat_sheet()
        assert "### Which precision" in text and "<!--" not in text


def test_cheat_sheet_and_fingerprint(monkeypatch, tmp_path):
    monkeypatch.setattr(L, "CHEAT_SHEET", tmp_path / "missing.md")
    monkeypatch.setattr(L, "REPO", tmp_path)
    assert L.CHEAT_SHEET_URL in L.cheat_sheet()
    (tmp_path / "README.md").write_text("# x\n\n## Cheat sheet\n\n| a |\n\n## Next\nno\n")
    assert L.cheat_sheet() == "## Cheat sheet\n\n| a |\n"
    (tmp_path / "sheet.md").write_text("<!-- note\nfor maintainers -->\n### Chart\n")
    monkeypatch.setattr(L, "CHEAT_SHEET", tmp_path / "sheet.md")
    assert L.cheat_sheet() == "### Chart\n"
    # a citation the notebooks here cannot fill (none here): the README's filled copy
    (tmp_path / "sheet.md").write_text("<!-- n -->\n**{{lesson04.resnet | fp32 | img/s}}**\n")
    assert L.cheat_sheet() == "## Cheat sheet\n\n| a |\n"
    net = torch.nn.Linear(2, 2)
    before = L.fingerprint(net)
    assert L.unchanged(net, before)
    net.eval()
    assert not L.unchanged(net, before)


def test_bench_cases_and_summary():
    cases = list(BENCH_CASES.CASES)
    assert len(cases) >= 12 and sum(c.healthy for c in cases) >= 3
    rows = [{"expected": "activation-overflow", "doctor": "diagnosed", "hooks_found": "found",
             "anomaly_found": "flagged elsewhere"},
            {"expected": "grad-underflow", "doctor": "diagnosed", "hooks_found": "missed",
             "anomaly_found": "missed"},
            {"expected": "no alarm", "doctor": "clean", "hooks_found": "false alarm",
             "anomaly_found": "clean"}]
    table = {r["tool"]: r for r in L.bench_summary(rows)}
    assert table["the doctor"]["problems found at their site"] == 2
    assert table["forward hooks, abs-min/abs-max"]["problems found at their site"] == 1
    assert table["forward hooks, abs-min/abs-max"]["false alarms (healthy models)"] == 1
    assert table["torch.autograd.detect_anomaly"]["flagged elsewhere"] == 1
    assert all(r["problems"] == 2 and r["healthy models"] == 1 for r in table.values())


def test_bench_cases_ship_with_the_package():
    """The bench runs wherever the package is installed (Colab, Kaggle), not only in a clone."""
    cases = list(BENCH_CASES.CASES)
    assert len(cases) >= 12
    assert any(c.healthy for c in cases) and any(not c.healthy for c in cases)
    assert all(c.name for c in cases)