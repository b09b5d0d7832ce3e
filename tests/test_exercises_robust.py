"""The graders never trust the learner's code: they compute their references first and hand the
learner copies, so an answer that changes its inputs in place grades as what it returns; they read
what comes back through one door, so an answer on the meta device (or another device, or in
another dtype) gets a message naming the problem, never a traceback; every process a grader
starts ends, on a time-out too; and a wrong answer never shows the expected value before the
third attempt."""
import inspect
import re
import sys
import time

import pytest
import torch
from torch import nn

from amp_lessons.exercises import MODULES
from amp_lessons.exercises import check as common
from amp_lessons.exercises import ex01, ex02, ex03, ex04, ex05, ex06, ex07, ex08, ex09
from amp_lessons.train.trainer import ScalerSettings
from exercise_helpers import fresh_attempts  # noqa: F401

META = torch.device("meta")


def _meta(value):
    """``value`` (a tensor, or a tuple of them) moved to the meta device."""
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    return value.to(META) if isinstance(value, torch.Tensor) else value


def test_every_check_function_counts_its_wrong_attempts():
    for key, module in MODULES.items():
        checks = [name for name, fn in vars(module).items()
                  if name.startswith("check_") and inspect.isfunction(fn)
                  and fn.__module__ == module.__name__]
        assert checks, key
        for name in checks:
            assert getattr(vars(module)[name], "graded", False), f"{key}.{name} is not @graded"


# --- answers that change their inputs in place -----------------------------------------------
def _mutating_tensor_scale(x):
    x.mul_(2)  # doubles x in place, then returns half the right scale of the original
    return ex07.reference_per_tensor(x)


def _mutating_row_scale(x):
    x.mul_(2)
    return ex07.reference_per_row(x)


def _mutating_stochastic(x):
    x.mul_(2)  # rounds a doubled x: right for what it changed x into, wrong for the input
    return ex08.reference_stochastic_round(x)


def _mutating_kahan(weight, compensation, update):
    update.mul_(2)  # a doubled update, added exactly
    return ex08.reference_kahan_add(weight, compensation, update)


def _mutating_channels_last(model, x):
    x.mul_(2)
    return ex04.reference_channels_last(model, x)


def _mutating_checkpoint(blocks, x):
    x.mul_(2)
    return ex05.reference_checkpointed_forward(blocks, x)


def _mutating_accumulate(model, x, y, micro_batches):
    x.mul_(2)
    ex05.reference_accumulate(model, x, y, micro_batches)


def _mutating_first_overflow(model, x):
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return "0"


MUTATING = {
    "ex07 per tensor": lambda: ex07.check_per_tensor_scale(_mutating_tensor_scale),
    "ex07 per row": lambda: ex07.check_per_row_scale(_mutating_row_scale),
    "ex08 stochastic": lambda: ex08.check_stochastic_rounding(_mutating_stochastic),
    "ex08 kahan": lambda: ex08.check_kahan_update(_mutating_kahan),
    "ex04 channels_last": lambda: ex04.check_channels_last(_mutating_channels_last),
    "ex05 checkpoint": lambda: ex05.check_checkpointing(_mutating_checkpoint),
    "ex05 accumulate": lambda: ex05.check_accumulation(_mutating_accumulate),
    "ex09 first overflow": lambda: ex09.check_first_overflow(_mutating_first_overflow),
}


@pytest.mark.parametrize("name", sorted(MUTATING))
def test_an_answer_that_changes_its_input_in_place_does_not_pass(name):
    check = MUTATING[name]()
    assert check.status == "wrong", check


def test_the_fp8_graders_say_the_input_was_changed():
    for check in (ex07.check_per_tensor_scale(_mutating_tensor_scale),
                  ex07.check_per_row_scale(_mutating_row_scale)):
        assert "changed x in place" in check.message, check


def test_a_kahan_update_that_changes_the_update_cannot_change_the_graders_reference():
    # the grader's own reference run must not see the learner's doubling: a correct update after
    # a mutating one still passes, and the mutating one fails on its own account
    assert ex08.check_kahan_update(_mutating_kahan).status == "wrong"
    assert ex08.check_kahan_update(ex08.reference_kahan_add)


def test_a_mutating_scale_exponent_cannot_change_the_report():
    report = ex09._LayersOnly  # the check hands the learner this wrapper with copied layers
    assert "copy" in inspect.getsource(report.__init__)


# --- answers on another device --------------------------------------------------------------------
ON_META = {
    "ex01 master weight": lambda: ex01.check_master_weight(
        lambda s, u, n: torch.tensor(ex01.reference_master_weight(s, u, n), device=META)),
    "ex01 predictions": lambda: ex01.check_fp16_predictions(torch.tensor(1.0, device=META), 9.95),
    "ex02 function": lambda: ex02.check_autograd_function(_meta_function(), "cpu"),
    "ex04 channels_last": lambda: ex04.check_channels_last(
        lambda m, x: (m.to(META), x.to(META))),
    "ex05 checkpoint": lambda: ex05.check_checkpointing(
        lambda blocks, x: ex05.reference_checkpointed_forward(blocks, x).to(META)),
    "ex06 efficiency": lambda: ex06.check_efficiency(
        lambda a, b, n: torch.tensor(b / (n * a), device=META), []),
    "ex06 state": lambda: ex06.check_state_per_rank(
        {"ddp": torch.tensor(16.0, device=META), "zero": 12.0, "fsdp2": 8.0},
        {"ddp": 16.0, "zero": 12.0, "fsdp2": 8.0}, 2),
    "ex07 per tensor": lambda: ex07.check_per_tensor_scale(
        lambda x: ex07.reference_per_tensor(x).to(META)),
    "ex07 per row": lambda: ex07.check_per_row_scale(lambda x: ex07.reference_per_row(x).to(META)),
    "ex08 stochastic": lambda: ex08.check_stochastic_rounding(
        lambda x: ex08.reference_stochastic_round(x).to(META)),
    "ex08 kahan": lambda: ex08.check_kahan_update(
        lambda w, c, u: _meta(ex08.reference_kahan_add(w, c, u))),
    "ex09 scale exponent": lambda: ex09.check_scale_exponent(
        lambda r: torch.tensor(3.0, device=META), [_report()]),
}


def _meta_function():
    class OnMeta(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a.mm(b).to(META)

        @staticmethod
        def backward(ctx, grad):
            return None, None
    return OnMeta


def _report():
    from types import SimpleNamespace
    layers = [{"layer": "fc", "grad_absmax": 65504.0 / 2 ** 10.5, "act_absmax": 1.0,
               "grad_min": 1e-3}]
    return SimpleNamespace(model="toy", layers=layers, scale_exponent=10)


@pytest.mark.parametrize("name", sorted(ON_META))
def test_an_answer_on_the_meta_device_gets_a_message_not_a_crash(name):
    check = ON_META[name]()
    assert check.status == "wrong", check
    assert "meta" in check.message or "whole exponent" in check.message, check


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device: a GPU")
def test_an_answer_on_another_real_device_is_named():
    check = ex07.check_per_tensor_scale(lambda x: ex07.reference_per_tensor(x).cuda())
    assert check.status == "wrong" and "cuda" in check.message, check


def test_tensor_problem_names_meta_another_device_and_another_dtype():
    assert "meta device" in common.tensor_problem(torch.ones(2, device=META))
    assert common.tensor_problem(torch.ones(2), "cpu", torch.float32) is None
    assert "torch.float64, expected torch.float32" in common.tensor_problem(
        torch.ones(2, dtype=torch.float64), "cpu", torch.float32)
    assert common.tensor_problem(3.0, "cpu", torch.float32) is None  # not a tensor: not this
    assert "is on cpu, the input on cuda" in common.tensor_problem(torch.ones(1), "cuda")


def test_read_number_says_why_a_value_is_not_a_number():
    assert common.read_number(torch.tensor(2.5)) == (2.5, None)
    for value, why in ((torch.tensor(1.0, device=META), "meta device"),
                       (torch.ones(3), "shape (3,)"), (float("nan"), "finite"),
                       ("2.5", "must be a number"), (None, "must be a number")):
        got, problem = common.read_number(value, "k")
        assert got is None and why in problem and problem.startswith("k "), (value, problem)


# --- processes ----------------------------------------------------------------------------------
def _children_of(pid):
    return common._descendants(pid)


def test_run_bounded_ends_the_process_and_its_children_on_a_time_out():
    script = ("import subprocess, sys, time\n"
              "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
              " start_new_session=True) for _ in range(2)]\n"
              "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
              "time.sleep(60)\n")
    started = time.monotonic()
    code, out, err = common.run_bounded([sys.executable, "-c", script], timeout_s=3)
    assert code is None and time.monotonic() - started < 30
    kids = [int(p) for p in out.split()]
    assert len(kids) == 2
    time.sleep(0.2)
    assert not [p for p in kids if common._alive(p)], "a child of a timed-out run is still alive"


def test_run_bounded_returns_output_and_code_and_refuses_a_bad_time_out():
    code, out, err = common.run_bounded([sys.executable, "-c", "print('hi'); exit(3)"], 60)
    assert (code, out.strip()) == (3, "hi")
    for bad in (0, -1, float("inf"), "5"):
        with pytest.raises(ValueError, match="timeout_s must be"):
            common.run_bounded([sys.executable, "-c", "pass"], bad)


def test_the_script_grader_names_nccl_not_torchruns_wrapper():
    stderr = ("[rank0]: Traceback (most recent call last):\n"
              "[rank0]:   File \"ddp_fsdp.py\", line 30, in <module>\n"
              "[rank0]: ValueError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!\n"
              "E1203 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 1)\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\n"
              "ddp_fsdp.py FAILED\n")
    assert "ProcessGroupNCCL is only supported with GPUs" in ex06._last_error(stderr)
    plain = "Traceback:\n  x\nKeyError: 'rank'\ntorch.distributed.elastic...ChildFailedError:\n"
    assert ex06._last_error(plain) == "KeyError: 'rank'"


def test_the_script_grader_gives_the_nccl_hint(monkeypatch):
    monkeypatch.setattr(ex06, "run_script", lambda source, timeout_s=180.0: {
        "returncode": 1, "reports": None,
        "error": "ValueError: ProcessGroupNCCL is only supported with GPUs, no GPUs found!"})
    monkeypatch.setattr("amp_lessons.measure.distributed.fsdp2_problem", lambda device: None)
    body = ex06.REFERENCE_BODY.replace('init_process_group("gloo")', 'init_process_group("nccl")')
    check = ex06.check_script(body)
    assert check.status == "wrong" and "ProcessGroupNCCL" in check.message
    assert "'gloo'" in check.hint and "no GPU" in check.hint, check


def test_a_report_with_missing_fields_is_wrong_not_a_crash():
    check = ex06.grade_reports([{"rank": 0}, {"rank": 1}])
    assert check.status == "wrong" and "incomplete" in check.message, check


# --- the answer shows only from the third wrong attempt ------------------------------------------
def _grads():
    return torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-6


def _secret_cases(monkeypatch):
    """(a wrong answer's grade, strings that would give the answer away)."""
    t = ex01.fp16_truths()
    grads = _grads()
    best = ex01.smallest_safe_exponent(grads)
    monkeypatch.setattr(ex04, "measure_state_bytes", lambda model, device=None: {
        "params": 46_758_048, "grads": 46_758_048, "optimizer state": 93_516_096})
    monkeypatch.setattr(ex04, "measure_weight_copies", lambda model, device=None: 23_434_624)
    measured = {"ddp": 1234.5, "zero": 987.6, "fsdp2": 617.3}
    traces = {"A": ([2.0 ** (16 - i) for i in range(10)], [True] * 10),
              "B": ([65536.0] * 10, [False] * 10)}
    x = ex07.test_tensor()
    return {
        "ex01 predict": (lambda: ex01.check_fp16_predictions(1.0, 9.0),
                         [f"{t['hundredths']:.6g}"]),
        "ex01 scale": (lambda: ex01.check_scale_exponent(0, grads), [f"k = {best}", f"2**{best} "]),
        "ex01 master": (lambda: ex01.check_master_weight(ex01.WRONG_MASTER["fp16 weight"]),
                        [f"{ex01.master_truth(1.0, 1e-4, 1000):.6g}"]),
        "ex02 dtypes": (lambda: ex02.check_autocast_dtypes(dict.fromkeys(ex02.LAYERS, "fp32"),
                                                           "cpu"), ["torch.bfloat16"]),
        "ex03 floor": (lambda: ex03.check_steps_below_one(5, ScalerSettings()), ["17"]),
        "ex03 causes": (lambda: ex03.check_trace_causes({"A": "healthy", "B": "healthy"}, traces),
                        ["inf or NaN every step"]),
        "ex04 state": (lambda: ex04.check_state_bytes({"params": 1e6, "grads": 1e6,
                                                       "optimizer state": 1e6}),
                       ["46,758,048", "46758048"]),
        "ex04 copies": (lambda: ex04.check_weight_copies(1e6), ["23,434,624", "23434624"]),
        "ex06 state": (lambda: ex06.check_state_per_rank({"ddp": 1.0, "zero": 1.0, "fsdp2": 1.0},
                                                         measured, 2), ["1,234", "1235", "987.6"]),
        "ex06 efficiency": (lambda: ex06.check_efficiency(lambda a, b, n: b / a, []),
                            ["0.93 ", "0.93,", "1.08", "0.61"]),
        "ex07 tensor": (lambda: ex07.check_per_tensor_scale(lambda x: 1.0),
                        [f"{float(ex07.reference_per_tensor(x)):.4g}"]),
        "ex09 scale": (lambda: ex09.check_scale_exponent(lambda r: 0, [_report()]), ["k = 10"]),
        "ex09 overflow": (lambda: ex09.check_first_overflow(lambda m, x: "0"),
                          ["blocks.1.proj"]),
    }


def test_a_wrong_answer_shows_the_expected_value_only_from_the_third_attempt(monkeypatch):
    for name, (grade, secrets) in _secret_cases(monkeypatch).items():
        common.reset_attempts()
        for attempt in (1, 2):
            check = grade()
            assert check.status == "wrong" and check.attempt == attempt, (name, check)
            page = re.sub(r"<details>.*?</details>", "", check._repr_html_(), flags=re.S)
            shown = check.text() + page  # the folded later levels are asked for with a click
            assert not [s for s in secrets if s in shown], (name, attempt, shown)
            assert f"the answer shows after 3 wrong attempts (this was attempt {attempt})" \
                in check.text(), (name, check)
        third = grade()
        assert third.revealed and "the answer (wrong attempt 3)" in third.text(), (name, third)
        assert [s for s in secrets if s in third.text()], (name, third)


def test_without_a_value_to_show_the_third_attempt_shows_the_last_hint():
    bad = lambda m, x: (m, x)  # noqa: E731 - nothing converted
    for attempt in (1, 2, 3):
        check = ex04.check_channels_last(bad)
    assert check.attempt == 3 and ex04.HINTS["layout"].levels[-1] in check.text()


def test_a_pass_or_an_unanswered_stub_is_not_an_attempt():
    assert ex07.check_per_tensor_scale(ex07.reference_per_tensor)
    assert ex07.check_per_tensor_scale(None).status == "not answered yet"
    assert common.attempts(ex07.TENSOR) == 0
    ex07.check_per_tensor_scale(lambda x: 1.0)
    assert common.attempts(ex07.TENSOR) == 1
    common.reset_attempts(ex07.TENSOR)
    assert common.attempts(ex07.TENSOR) == 0
