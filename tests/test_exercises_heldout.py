"""The graders against learner answers they were not built from (issue 42): a constant or a
lookup copied from what the notebook shows must fail on a case the learner never saw, a rule
that is right only where the lesson's run goes must fail where it does not, an answer in the
wrong dtype must be refused, and a correct answer written differently (extra keys in a dict)
must pass. Each test fails without the grader change it names."""
import math
from types import SimpleNamespace

import pytest

import torch
import torch.nn.functional as F

from amp_lessons.exercises import capstone, ex02, ex03, ex05, ex09
from amp_lessons.train.trainer import ScalerSettings

from exercise_helpers import assert_wrong, fresh_attempts  # noqa: F401 - an autouse fixture


# --- capstone part 2: a step that ignores `precision` -------------------------------------------

def _step_in(dtype_for):
    """A train_step that is right but for the autocast dtype, which ``dtype_for(precision)``
    picks (None: no autocast)."""
    def train_step(model, optimizer, scaler, scheduler, x, y, precision):
        dtype = dtype_for(precision)
        with torch.autocast(x.device.type, dtype=dtype or torch.float32,
                            enabled=dtype is not None):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= scale:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # a Python float: a correct way to return the loss
    return train_step


def test_capstone_training_sees_the_learners_dtype_not_the_graders_reference():
    """The true-norm reference runs on a deep copy of the learner's model, which carried the
    grader's dtype hook along: the reference's bf16 forward was recorded as the learner's, so a
    step that ran the bf16 part in fp16, or in fp32, passed."""
    right = capstone.check_training(capstone.reference_make_state,
                                    _step_in({"fp16": torch.float16,
                                              "bf16": torch.bfloat16}.get))
    assert right, right
    for name, dtype_for in {"always fp16": lambda p: torch.float16,
                            "bf16 left in fp32": lambda p: torch.float16 if p == "fp16" else None
                            }.items():
        check = capstone.check_training(capstone.reference_make_state, _step_in(dtype_for))
        assert_wrong(check, "bf16: the first convolution computed in", "autocast")


# --- lesson 05: the number of micro-batches copied from the notebook's call ---------------------

def _hard_coded_four(model, x, y, micro_batches):
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        (F.cross_entropy(model(xs), ys) / 4).backward()


def _divides_by_four(model, x, y, micro_batches):
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        (F.cross_entropy(model(xs), ys) / 4).backward()


def _summed_losses_split(model, x, y, micro_batches):
    """Right, written differently: slices of len(x) // micro_batches, summed losses over the
    whole batch's size."""
    size = len(x) // micro_batches
    for xs, ys in zip(x.split(size), y.split(size)):
        (F.cross_entropy(model(xs), ys, reduction="sum") / len(x)).backward()


def test_ex05_accumulation_runs_a_second_count_of_micro_batches():
    assert ex05.check_accumulation(_summed_losses_split)
    for fn in (_hard_coded_four, _divides_by_four):
        check = ex05.check_accumulation(fn)  # the notebook's call: micro_batches=4
        assert_wrong(check, "second run", "micro_batches=8", "argument micro_batches")


# --- lesson 09: k looked up by the report's name -------------------------------------------------

def _report(model, grad_exp):
    top = 65504.0
    layers = [{"layer": "fc", "grad_absmax": top / 2 ** grad_exp, "act_absmax": 3.0,
               "grad_min": top / 2 ** (grad_exp + 9)},
              {"layer": "head", "grad_absmax": None, "act_absmax": 1.0, "grad_min": None}]
    return SimpleNamespace(model=model, layers=layers, scale_exponent=math.floor(grad_exp))


def test_ex09_scale_exponent_is_graded_on_a_report_no_lesson_prints():
    reports = [_report("resnet", 11.5), _report("gpt", 20.5)]
    assert ex09.check_scale_exponent(ex09.reference_scale_exponent, reports)
    lookup = ex09.check_scale_exponent(lambda r: {"resnet": 11, "gpt": 20}[r.model], reports)
    assert_wrong(lookup, "a report the check made", "KeyError", "report.model",
                 hints=ex09.HINTS["scale"])
    held = ex09.held_out_report(reports[0])
    assert held.scale_exponent == 11 + ex09.HELD_OUT_SHIFT
    assert reports[0].layers[0]["grad_absmax"] == 65504.0 / 2 ** 11.5  # a copy was scaled
    constant = ex09.check_scale_exponent(lambda r: 11, reports[:1])
    assert_wrong(constant, "a report the check made", "gives k = 11",
                 hints=ex09.HINTS["scale"])
    assert str(held.scale_exponent) not in constant.message  # not before the third attempt


# --- lesson 03: a floor under the scale ----------------------------------------------------------

def _floored(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    if found_inf:
        return max(scale * backoff_factor, 1.0), 0
    tracker += 1
    if tracker == growth_interval:
        return scale * growth_factor, 0
    return scale, tracker


def test_ex03_update_rule_with_a_floor_at_one_fails():
    """No demo run's scale falls below 1, so a rule that keeps it at 1 or above reproduced every
    graded trace; GradScaler has no floor (exercise 2 is about a scale below 1)."""
    settings = ScalerSettings(init_scale=2.0 ** 24, growth_interval=10)
    skipped = [True] * 8 + [False] * 25 + [True] + [False] * 12
    scales = ex03.replay(ex03.reference_update, [settings.init_scale] * len(skipped), skipped,
                         settings)
    assert ex03.check_update_rule(ex03.reference_update, scales, skipped, settings)
    check = ex03.check_update_rule(_floored, scales, skipped, settings)
    assert_wrong(check, "below 1", "no floor", hints=ex03.HINTS["rule"])


# --- lesson 02: forward in float64 ----------------------------------------------------------------

class _DoubleMatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.double() @ b.double()

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.float() @ b.t(), a.t() @ grad.float()


def test_ex02_function_in_float64_is_refused_by_dtype():
    check = ex02.check_autograd_function(_DoubleMatMul)
    assert_wrong(check, "torch.float64", "no .double()", hints=ex02.HINTS["function"])
    assert ex02.check_autograd_function(ex02.reference_function("cpu"))


# --- extra keys in a dict answer ------------------------------------------------------------------

def test_a_dict_answer_with_an_extra_key_is_graded_on_its_named_keys():
    real = ex02.autocast_dtypes("cpu")
    answer = {name: real[name] for name in ex02.LAYERS}
    assert ex02.check_autocast_dtypes({**answer, "relu": "16-bit"}, "cpu")
    off = {**answer, "loss": torch.bfloat16, "note": "guessed"}
    assert ex02.check_autocast_dtypes(off, "cpu").status == "wrong"
    traces = {"A": ([2.0 ** 16] * 4, [False] * 4), "B": ([1.0] * 4, [True] * 4)}
    causes = {"A": "healthy", "B": "inf or NaN every step", "total": 2}
    assert ex03.check_trace_causes(causes, traces)
    # a key spelled twice, or one missing, is still refused
    assert ex03.check_trace_causes({"A": "healthy", "a": "healthy", "B": "healthy"},
                                   traces).status == "wrong"
    assert ex03.check_trace_causes({"A": "healthy", "C": "healthy"}, traces).status == "wrong"


# --- a learner's code that never returns ----------------------------------------------------------

def _sleeps(x):
    import time
    time.sleep(60)


def _spins_and_swallows(x):
    while True:
        try:
            sum(range(1000))
        except Exception:  # a learner's catch-all must not swallow the grade's time limit
            pass


@pytest.mark.parametrize("answer", [_sleeps, _spins_and_swallows])
def test_a_grade_ends_after_its_time_limit_and_says_why(monkeypatch, answer):
    import signal
    import time

    from amp_lessons.exercises import check, ex07

    monkeypatch.setenv(check.GRADE_LIMIT_ENV, "1")
    check.reset_attempts()
    start = time.monotonic()
    grade = ex07.check_per_tensor_scale(answer)
    assert time.monotonic() - start < 10
    assert grade.status == "wrong" and "stopped after 1 s" in grade.message
    assert grade.attempt == 0  # not counted: nothing was learned about the answer
    assert signal.getitimer(signal.ITIMER_REAL)[0] < 600  # pytest-timeout's timer set again
    assert ex07.check_per_tensor_scale(ex07.reference_per_tensor).passed  # and grading goes on


def test_the_grade_limit_setting_is_checked(monkeypatch):
    from amp_lessons.exercises import check

    for bad in ("0", "-3", "soon", "inf"):
        monkeypatch.setenv(check.GRADE_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match="AMP_LESSONS_GRADE_LIMIT_S must be a number of "
                                             "seconds > 0"):
            check.grade_limit_s()
    monkeypatch.setenv(check.GRADE_LIMIT_ENV, "2.5")
    assert check.grade_limit_s() == 2.5


def test_a_timer_already_running_keeps_its_deadline():
    import signal
    import time

    from amp_lessons.exercises import check

    rang = []
    previous = signal.signal(signal.SIGALRM, lambda *a: rang.append(time.monotonic()))
    try:
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # due before the grade's limit
        with check.time_bound(5):
            time.sleep(1)
        assert rang and rang[0] - start < 0.9  # the outer timer's own handler ran on time
        signal.setitimer(signal.ITIMER_REAL, 3)  # due after the grade's limit
        with pytest.raises(check.GradeTimeout):
            with check.time_bound(0.2):
                time.sleep(2)
        assert 2 < signal.getitimer(signal.ITIMER_REAL)[0] < 3  # set again for what is left
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- ex02's loop without zero_grad: named as such, not as the scheduler bug -------------------------

def _loop_without_zero_grad(model, optimizer, scheduler, batches, device_type, init_scale):
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
    for x, y in batches:
        with torch.autocast(device_type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() >= scale:
            scheduler.step()


@pytest.mark.slow  # two graded loops of 20 fp16 steps each, with their references
def test_a_loop_that_never_clears_its_gradients_is_told_so():
    grade = ex02.check_fixed_loop(_loop_without_zero_grad)
    assert_wrong(grade, "nothing cleared them", hints=ex02.HINTS["loop"])
    assert "scheduler" not in grade.message
    assert ex02.check_fixed_loop(ex02.reference_loop).passed


def test_same_values_compares_nested_states_bit_for_bit():
    from amp_lessons.exercises.check import same_values

    a = {"w": torch.ones(2), "groups": [{"lr": 0.1, "params": (0, 1)}]}
    assert same_values(a, {"w": torch.ones(2), "groups": [{"lr": 0.1, "params": (0, 1)}]})
    assert not same_values(a, {"w": torch.ones(2) + 1e-7, "groups": a["groups"]})
    assert not same_values(a, {"w": torch.ones(1, 2), "groups": a["groups"]})
    assert not same_values(a, {"w": 1.0, "groups": a["groups"]})
    assert not same_values(a, {"w": torch.ones(2)})
