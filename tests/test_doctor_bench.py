"""The doctor bench (amp_lessons/doctor/bench_cases.py): every reproduction diagnosed at its site, no false alarm
on the healthy models, every class either diagnosed or reported "not checked" with its reason;
and the two baseline tools measured on the same cases. CPU, tiny models."""
import pytest
import torch

import amp_lessons as al
from amp_lessons.doctor import bench
from amp_lessons.doctor.findings import CLASSES
from amp_lessons.doctor.bench_cases import CASES, HEALTHY, PROBLEMS


@pytest.fixture(scope="module")
def rows():
    return bench.run(CASES, al.doctor, baselines=True)


def test_the_bench_has_at_least_12_cases_and_three_healthy_models():
    assert len(CASES) >= 12 and len(HEALTHY) >= 3
    assert len({c.name for c in CASES}) == len(CASES)


def test_every_reproduction_is_diagnosed_at_its_site(rows):
    by_name = {r["case"]: r for r in rows}
    missed = [(c.name, by_name[c.name]["alarms"]) for c in PROBLEMS
              if by_name[c.name]["doctor"] != "diagnosed"]
    assert not missed


def test_no_false_alarm_on_the_healthy_models(rows):
    healthy = {c.name for c in HEALTHY}
    assert all(r["doctor"] == "clean" for r in rows if r["case"] in healthy), \
        [(r["case"], r["alarms"]) for r in rows if r["case"] in healthy]


def test_every_class_is_diagnosed_by_a_case_or_not_checked():
    """Each failure class has a reproduction, except fp32-nonfinite and fp16-failed (covered in
    test_doctor_diagnosis) ; and without step_fn / checkpoint_fn the report says 'not checked'."""
    covered = {cls for c in PROBLEMS for cls in c.classes}
    assert covered >= set(CLASSES) - {"fp32-nonfinite", "fp16-failed"}
    model, kwargs = HEALTHY[2].build()
    r = al.doctor(model, **{**bench.QUICK_DOCTOR, **kwargs})
    unchecked = [f for f in r.findings if f["severity"] == "not checked"]
    assert {f["topic"] for f in unchecked} == {"step", "resume"}
    assert any("needs your training step" in f["finding"] for f in unchecked)


def test_baselines_were_measured_and_miss_what_they_cannot_see(rows):
    """The hooks see forward inf/NaN only, detect_anomaly a NaN in backward: neither sees 16-bit
    weights, gradient underflow or scaler misuse (measured per case, not assumed)."""
    by_name = {r["case"]: r for r in rows}
    for name in ("layer_gradient_underflow", "bf16_weights_no_masters", "clip_before_unscale"):
        assert by_name[name]["hooks"] == "nothing found"
        assert by_name[name]["anomaly"] == "nothing found"
    assert by_name["t5_ffn_overflow"]["hooks_found"] == "found"
    assert all(r["hooks_found"] == "clean" for r in rows if r["case"].startswith("healthy"))
    assert bench.tally(rows)["diagnosed"] > bench.tally(rows, "hooks_found").get("found", 0)


def test_score_reads_a_wrong_site_as_missed():
    class FakeReport:
        verdict = {"text": "t"}

        def alarms(self):
            return [{"class": "activation-overflow", "site": "other.layer"}]

    case = bench.Case("x", lambda: None, ("activation-overflow",), "blocks.1.wo")
    assert bench.score(case, FakeReport())["doctor"] == "missed"
    assert bench.score(bench.Case("h", lambda: None), FakeReport())["doctor"] == "false alarm"


def test_the_model_is_unchanged_by_the_bench():
    model, kwargs = PROBLEMS[0].build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    al.doctor(model, **{**bench.QUICK_DOCTOR, **kwargs})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
