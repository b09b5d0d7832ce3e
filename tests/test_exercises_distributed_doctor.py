"""The graders of lesson 06 (the DDP + fully_shard script run with torchrun, state per rank,
scaling efficiency) and lesson 09 (where inf is born, the loss scale from a report's ranges, the
learner's own report): the reference passes, the stub is "not answered yet", each typical
mistake gets its own hint."""
from amp_lessons.measure import distributed
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons as al
from amp_lessons.exercises import MODULES
from amp_lessons.exercises import check as common
from amp_lessons.exercises import ex01, ex02, ex03, ex04, ex05, ex06, ex07, ex08, ex09
from amp_lessons.train.trainer import ScalerSettings
from exercise_helpers import INF, NAN, assert_unanswered, assert_wrong, fresh_attempts, status  # noqa: F401


def test_ex06_stub_is_unanswered_without_running():
    assert_unanswered(ex06.check_script(ex06.STUB), ex06.HINTS["script"])
    assert_unanswered(ex06.check_script(ex06.STUB_BODY), ex06.HINTS["script"])
    assert ex06.full_script(ex06.REFERENCE_BODY) == ex06.REFERENCE
    assert "init_process_group" not in ex06.STUB and "fully_shard(layer" in ex06.REFERENCE


def test_ex06_script_is_skipped_where_torch_cannot_shard_on_a_cpu(monkeypatch):
    """torch < 2.9 cannot run FSDP2 correctly on CPU processes: the grader says so instead of
    failing the learner's script with torch's own error (or grading wrong sums)."""
    monkeypatch.setattr(distributed, "torch_version", lambda: (2, 6))
    check = ex06.check_script(ex06.REFERENCE_BODY)
    assert check.status == "skipped" and "FSDP2 on CPU processes needs torch >= 2.9" in str(check)


NO_FSDP2_CPU = pytest.mark.skipif(distributed.fsdp2_problem("cpu") is not None,
                                  reason=str(distributed.fsdp2_problem("cpu")))


@pytest.fixture(scope="module")
def reference_reports():
    result = ex06.run_script(ex06.REFERENCE)
    assert result["returncode"] == 0, result["error"]
    return result["reports"]


@pytest.mark.slow
@NO_FSDP2_CPU
def test_ex06_script_runs_with_torchrun_on_two_cpu_processes(reference_reports):
    assert ex06.grade_reports(reference_reports), ex06.grade_reports(reference_reports)
    assert [r["rank"] for r in reference_reports] == [0, 1]


@pytest.mark.slow
@NO_FSDP2_CPU
def test_ex06_script_without_ddp_fails_with_its_hint():
    body = ex06.REFERENCE_BODY.replace("ddp = DDP(make_model())", "ddp = make_model()")
    assert_wrong(ex06.check_script(body), "wrap the model in DDP",  # a body, as in the notebook
                 hints=ex06.HINTS["script"])


@NO_FSDP2_CPU
def test_ex06_reports_of_typical_mistakes(reference_reports):
    one_unit = [dict(r, fsdp_units=1) for r in reference_reports]
    hints = ex06.HINTS["script"]
    assert_wrong(ex06.grade_reports(one_unit), "on each nn.Linear", hints=hints)
    fp32 = [dict(r, fsdp_output="torch.float32") for r in reference_reports]
    assert_wrong(ex06.grade_reports(fp32), "param_dtype=torch.bfloat16", hints=hints)
    unsharded = [dict(r, fsdp_local=r["full"]) for r in reference_reports]
    assert_wrong(ex06.grade_reports(unsharded), "nothing is sharded", hints=hints)
    assert "root only" in ex06.WRONG_SCRIPTS


def test_ex06_state_per_rank():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    held = al.distributed.local_state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    ddp = sum(held.values()) / ex06.MIB  # one process's full copy, measured
    assert abs(ddp / ex06.reference_state_per_rank(n, 1)["ddp"] - 1) < 0.01  # + AdamW's steps
    measured = {"ddp": ddp, "zero": ddp * 12 / 16, "fsdp2": ddp / 2}
    assert ex06.check_state_per_rank(ex06.reference_state_per_rank(n, 2), measured, 2)
    hints = ex06.HINTS["state"]
    assert_unanswered(ex06.check_state_per_rank(dict.fromkeys(measured), measured, 2), hints)
    assert_wrong(ex06.check_state_per_rank({**measured, "zero": ddp / 2}, measured, 2),
                 "only the optimizer state", hints=hints)
    assert_wrong(ex06.check_state_per_rank({**measured, "fsdp2": ddp}, measured, 2), "16/N",
                 hints=hints)


def test_ex06_efficiency():
    summary = [{"label": "ddp bf16", "world_size": 1, "per_s": 100.0, "efficiency": 1.0},
               {"label": "ddp bf16", "world_size": 2, "per_s": 190.0, "efficiency": 0.95}]
    assert ex06.check_efficiency(ex06.reference_efficiency, summary)
    hints = ex06.HINTS["efficiency"]
    assert_unanswered(ex06.check_efficiency(lambda a, b, n: None, summary), hints)
    assert_wrong(ex06.check_efficiency(lambda a, b, n: b / a, summary), "speed-up", hints=hints)
    one_gpu = ex06.check_efficiency(ex06.reference_efficiency, summary[:1])  # one process ran
    assert one_gpu and "0 measured rows and 3 made-up ones" in one_gpu.message, one_gpu
    assert_wrong(ex06.check_efficiency(lambda a, b, n: b / a, summary[:1]), "speed-up",
                 hints=hints)
    assert ex06.check_efficiency(ex06.reference_efficiency, [])  # nothing ran: made-up rows


def test_ex06_state_in_the_wrong_unit_is_not_blamed_on_ddp():
    # Answers in bytes (or GiB) with every split right: the first key alone gave DDP's hint,
    # "DDP replicates everything", the hint for a DDP answer that splits something.
    n, world = 1_000_000, 2
    measured = ex06.reference_state_per_rank(n, world)
    hints = ex06.HINTS["state"]
    in_bytes = {k: v * ex06.MIB for k, v in measured.items()}
    check = ex06.check_state_per_rank(in_bytes, measured, world)
    assert_wrong(check, "those are bytes", "2**20", hints=hints)
    assert "replicates" not in check.hint
    in_gib = {k: v / 1024 for k, v in measured.items()}
    assert_wrong(ex06.check_state_per_rank(in_gib, measured, world), "those are GiB", hints=hints)
    twelve = {k: v * 12 / 16 for k, v in measured.items()}  # 12 bytes per parameter everywhere
    assert_wrong(ex06.check_state_per_rank(twelve, measured, world), "bytes per parameter",
                 hints=hints)
    fsdp_for_zero = {**measured, "zero": measured["fsdp2"]}  # one key off: its own fact
    assert_wrong(ex06.check_state_per_rank(fsdp_for_zero, measured, world),
                 "only the optimizer state", hints=hints)


def test_ex06_efficiency_names_a_mistake_from_every_row():
    # At 2 processes, speed-up / (n - 1) equals the speed-up: the first row alone told a learner
    # who divides to divide. A sweep with 2 and 4 processes (the full profile) tells them apart.
    summary = [{"label": "ddp bf16", "world_size": 1, "per_s": 100.0, "efficiency": 1.0},
               {"label": "ddp bf16", "world_size": 2, "per_s": 190.0, "efficiency": 0.95},
               {"label": "ddp bf16", "world_size": 4, "per_s": 360.0, "efficiency": 0.9}]
    hints = ex06.HINTS["efficiency"]
    off_by_one = ex06.check_efficiency(lambda a, b, n: b / a / (n - 1), summary)
    assert off_by_one.status == "wrong" and off_by_one.hints == hints.levels, off_by_one
    assert_wrong(ex06.check_efficiency(ex06.WRONG_EFFICIENCY["the speed-up"], summary),
                 "speed-up", hints=hints)
    assert_wrong(ex06.check_efficiency(ex06.WRONG_EFFICIENCY["the inverse"], summary),
                 "inverse", hints=hints)
    assert ex06.check_efficiency(ex06.reference_efficiency, summary)


@pytest.fixture(scope="module")
def doctor_reports():
    """The doctor on two tiny models: one whose middle Linear overflows fp16, one with a large
    batch, so small gradients (a loss scale far from the default 2^16)."""
    reports = []
    for name, factor, n in (("overflowing", 1e6, 8), ("small gradients", 1.0, 1024)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16),
                              nn.Linear(16, 4))
        with torch.no_grad():
            model[2].weight.mul_(factor)
        batch = (torch.randn(n, 8), torch.randint(0, 4, (n,)))
        reports.append(al.doctor(model, batch, name=name, precisions=(), trial_steps=0,
                                 compile=False))
    return reports


def test_ex09_first_overflow_on_models_the_lesson_never_shows():
    hints = ex09.HINTS["overflow"]
    cases = ex09.overflow_cases("cpu")
    assert [ex09.first_overflow(m, x) for _, m, x in cases] == ["blocks.1.proj", "5"]
    assert ex09.check_first_overflow(ex09.reference_first_overflow)
    assert_unanswered(ex09.check_first_overflow(lambda model, x: None), hints)
    assert_unanswered(ex09.check_first_overflow(None), hints)
    assert_wrong(ex09.check_first_overflow(ex09.WRONG_OVERFLOW["the largest output"]),
                 "an earlier layer already did", "not where inf is born", hints=hints)
    assert_wrong(ex09.check_first_overflow(ex09.WRONG_OVERFLOW["the last layer inf reaches"]),
                 "an earlier layer already did", hints=hints)
    lesson_answer = ex09.check_first_overflow(lambda model, x: "blocks.0.mlp.2")  # the report's
    assert_wrong(lesson_answer, "stays within fp16's range", "models of its own", hints=hints)
    near = ex09.check_first_overflow(lambda model, x: "2" if isinstance(model, nn.Sequential)
                                     else ex09.first_overflow(model, x))
    assert_wrong(near, "stays within fp16's range", "still finite", hints=hints)
    assert_wrong(ex09.check_first_overflow(lambda model, x: "nope"), "not one of its leaf",
                 hints=hints)
    assert_wrong(ex09.check_first_overflow(lambda model, x: model), "expected a layer name",
                 hints=hints)


def test_ex09_scale_exponent_from_the_ranges(doctor_reports):
    assert doctor_reports[1].scale_exponent > 16  # the default's exponent would be wrong here
    assert ex09.check_scale_exponent(ex09.reference_scale_exponent, doctor_reports)
    hints = ex09.HINTS["scale"]
    assert_unanswered(ex09.check_scale_exponent(lambda r: None, doctor_reports), hints)
    fragments = {"from the activations": "not the activations", "rounded up": "round the exponent down",
                 "from the smallest gradient": "not the smallest",
                 "the default init_scale": "default init_scale"}
    for name, bad in ex09.WRONG_SCALE.items():
        assert_wrong(ex09.check_scale_exponent(bad, doctor_reports[::-1]), fragments[name],
                     hints=hints)
    assert_wrong(ex09.check_scale_exponent(lambda r: 2.0 ** ex09.reference_scale_exponent(r),
                                           doctor_reports[1:]),
                 "not the scale", hints=hints)


def _fake_report(model, grad_exp, act_exp):
    """A doctor report's ranges only: the largest gradient fp16's max / 2**grad_exp, the largest
    activation fp16's max / 2**act_exp."""
    from types import SimpleNamespace
    top = 65504.0
    layers = [{"name": "fc", "grad_absmax": top / 2 ** grad_exp, "act_absmax": top / 2 ** act_exp,
               "grad_min": top / 2 ** (grad_exp + 9)}]
    return SimpleNamespace(model=model, layers=layers, scale_exponent=math.floor(grad_exp))


def test_ex09_a_mistake_is_named_from_every_report_not_the_first_alone():
    # On report a, the exponent from the activations (12) is also the gradients' rounded up
    # (11.5 -> 12): the first report alone would blame rounding. Report b tells them apart.
    a, b = _fake_report("a", 11.5, 12.2), _fake_report("b", 20.5, 5.3)
    check = ex09.check_scale_exponent(ex09.WRONG_SCALE["from the activations"], [a, b])
    assert_wrong(check, "not the activations", hints=ex09.HINTS["scale"])
    assert "round the exponent down" not in str(check)
    rounded = ex09.check_scale_exponent(ex09.WRONG_SCALE["rounded up"], [a, b])
    assert_wrong(rounded, "round the exponent down", hints=ex09.HINTS["scale"])
    # an answer that is none of the typical mistakes still gets the fact about its exponent
    odd = ex09.check_scale_exponent(lambda r: {"a": 12, "b": 3}[r.model], [a, b])
    assert_wrong(odd, "round the exponent down", hints=ex09.HINTS["scale"])
    assert ex09.check_scale_exponent(ex09.reference_scale_exponent, [a, b])
    # the smallest gradient's exponent, on a report whose gradients are all close together, is
    # also the largest one's rounded up (12): report d tells them apart
    c, d = _fake_report("c", 11.5, 5.0), _fake_report("d", 20.5, 5.0)
    c.layers[0]["grad_min"], d.layers[0]["grad_min"] = 65504.0 / 2 ** 12.2, 65504.0 / 2 ** 25
    smallest = ex09.check_scale_exponent(ex09.WRONG_SCALE["from the smallest gradient"], [c, d])
    assert_wrong(smallest, "not the smallest", hints=ex09.HINTS["scale"])
    assert "round the exponent down" not in str(smallest)


def test_ex09_scale_exponent_that_is_not_finite_is_wrong_not_a_crash(doctor_reports):
    for k in (float("inf"), float("nan")):
        assert_wrong(ex09.check_scale_exponent(lambda r: k, doctor_reports), "whole",
                     hints=ex09.HINTS["scale"])


def test_ex09_scale_exponent_cannot_return_the_doctors_own_answer(doctor_reports):
    """The exercise is to compute k from report.layers: handing back report.scale_exponent (or
    the advice) fails, and the learner's function cannot change the report either."""
    check = ex09.check_scale_exponent(lambda r: r.scale_exponent, doctor_reports)
    assert check.status == "wrong" and "report.layers only" in check.message, check
    before = [dict(r) for r in doctor_reports[1].layers]

    def sorts_in_place(report):
        report.layers.sort(key=lambda r: -(r["grad_absmax"] or 0))
        report.layers.clear()
        return 0

    ex09.check_scale_exponent(sorts_in_place, doctor_reports)
    assert doctor_reports[1].layers == before


def test_ex09_answers_from_your_report(doctor_reports):
    hints = ex09.HINTS["yours"]
    for report in doctor_reports:
        assert ex09.check_report_answers(ex09.reference_answers(report), report)
        assert_unanswered(ex09.check_report_answers(dict.fromkeys(ex09.QUESTIONS), report), hints)
        assert_wrong(ex09.check_report_answers(ex09.WRONG_ANSWERS["the last layer"](report),
                                               report), "not always the last", hints=hints)
    small = doctor_reports[1]
    assert_wrong(ex09.check_report_answers(ex09.WRONG_ANSWERS["the default init_scale"](small),
                                           small), "default start", hints=hints)
    assert_wrong(ex09.check_report_answers({**ex09.reference_answers(small), "fp16 safe": False},
                                           small), "fp16 safe", hints=hints)


def test_ex09_answers_accept_numpy_values(doctor_reports):
    np = pytest.importorskip("numpy")
    small = doctor_reports[1]
    ref = ex09.reference_answers(small)
    answers = {**ref, "fp16 safe": np.bool_(ref["fp16 safe"]),
               "scale exponent": np.int64(ref["scale exponent"])}
    assert ex09.check_report_answers(answers, small)
    assert not ex09.check_report_answers({**answers, "fp16 safe": np.bool_(not ref["fp16 safe"])},
                                         small)
    assert not ex09.check_report_answers({**ref, "fp16 safe": 1}, small)
    assert_wrong(ex09.check_report_answers({**ref, "fp16 safe": str(ref["fp16 safe"])}, small),
                 "expected True or False", "no quotes", hints=ex09.HINTS["yours"])


def test_ex06_a_rank_dying_in_teardown_after_a_complete_report_still_counts():
    abort = "terminate called without an active exception\nChildFailedError:"
    complete = [{"rank": 0}, {"rank": 1}]
    assert ex06._aborted_at_exit(abort, complete)
    assert not ex06._aborted_at_exit(abort, [{"rank": 0}, None])  # a rank never reported
    assert not ex06._aborted_at_exit(abort, None)  # no report at all
    assert not ex06._aborted_at_exit("RuntimeError: boom", complete)  # a real failure


def test_ddp_checksums_that_are_nan_are_not_identical_weights():
    report = {"world_size": 2, "ddp": True, "ddp_losses": [1.0], "fsdp_losses": [1.0],
              "ddp_checksum": NAN, "fsdp_local": 50, "full": 100, "fsdp_units": 4,
              "fsdp_output": "torch.bfloat16"}
    check = ex06.grade_reports([dict(report, rank=0), dict(report, rank=1)])
    assert status(check) == "wrong" and "DDP weights differ" in check.message


def _report(layers, **kw):
    base = dict(model="toy", layers=layers, scale_exponent=14,
                overflow=[{"layer": "fc2", "kind": "Linear", "value": 9e4}],
                fp16_nonfinite=["fc2"], advice={"fp16_safe": False})
    return SimpleNamespace(**{**base, **kw})


def test_report_answers_with_no_activation_recorded():
    rep = _report([{"layer": "0", "act_absmax": None, "grad_absmax": 0.1}],
                  advice={"fp16_safe": True}, scale_exponent=19, overflow=[], fp16_nonfinite=[])
    right = ex09.reference_answers(rep)
    assert ex09.check_report_answers(right, rep)
    check = ex09.check_report_answers({**right, "largest activation": "zzz"}, rep)
    assert check.status == "wrong" and "not a layer of the report" in check.message


def test_efficiency_computed_in_float32_passes():
    summary = [{"label": "cnn", "world_size": 1, "per_s": 100.0, "efficiency": None},
               {"label": "cnn", "world_size": 2, "per_s": 170.0, "efficiency": 0.85}]
    assert ex06.check_efficiency(lambda a, b, n: torch.tensor(b) / (n * torch.tensor(a)), summary)
    assert ex06.check_efficiency(lambda a, b, n: np.float32(b) / np.float32(n * a), summary)
    off = ex06.check_efficiency(lambda a, b, n: 0.851, summary)
    assert off.status == "wrong"
    assert ex06.check_efficiency(lambda a, b, n: "0.85", summary).status == "wrong"


def test_only_the_template_s_placeholders_mean_not_answered(monkeypatch):
    assert ex06.still_template(ex06.STUB) and ex06.still_template(ex06.STUB_BODY)
    assert ex06.still_template(ex06.STUB_BODY.replace("ddp = ...", "ddp = DDP(make_model())"))
    kept = ex06.REFERENCE_BODY.replace('dist.init_process_group("gloo")',
                                       '...\ndist.init_process_group("gloo")')
    typed = "limit: int = ...\n" + ex06.REFERENCE_BODY
    for body in (kept, typed, ex06.REFERENCE):
        assert not ex06.still_template(body)
    monkeypatch.setattr(ex06, "run_script", lambda source, timeout_s=180.0: {
        "returncode": 1, "reports": None, "error": "stubbed"})
    assert ex06.check_script(kept).status != "not answered yet"
