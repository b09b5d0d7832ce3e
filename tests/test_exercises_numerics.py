"""The graders of the number-format lessons: 01 (fp16 rounding, the smallest safe loss scale, an
fp32 master weight), 03 (GradScaler's update rule, scale traces, the scale below 1), 07 (amax
scales, the FP8 module filter) and 08 (stochastic rounding, Kahan updates, state memory): the
reference passes, the stub is "not answered yet", each typical mistake gets its own hint."""
from amp_lessons.lessons import l03_scaler, l07_fp8, l08_weights
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


def test_ex01_predictions():
    t = ex01.fp16_truths()
    assert t["one_plus"] == 1.0 and 9.9 < t["hundredths"] < 10.0
    assert ex01.check_fp16_predictions(t["one_plus"], round(t["hundredths"], 2))
    hints = ex01.HINTS["predict"]
    assert_unanswered(ex01.check_fp16_predictions(None, None), hints)
    one_off = ex01.check_fp16_predictions(1.0001, t["hundredths"])
    assert_wrong(one_off, "half the gap 2**-10", hints=hints)
    assert "1.0" not in repr(one_off).replace("1.0001", "")  # fp16's 1 + 1e-4 is not shown
    assert_wrong(ex01.check_fp16_predictions(1.0, 10.0), "exact sum", hints=hints)
    # exact arithmetic for both: one mistake, named as such, not the first answer's fact alone
    exact = ex01.check_fp16_predictions(1 + 1e-4, 10.0)
    assert_wrong(exact, "both answers are the exact", "2**-7", hints=hints)
    assert "half the gap 2**-10 between 1" not in exact.hint


def test_ex01_scale_exponent():
    grads = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-6
    k = ex01.smallest_safe_exponent(grads)
    assert al.formats.scaled_fractions(grads, 2.0 ** k)["flushed"] == 0
    assert al.formats.scaled_fractions(grads, 2.0 ** (k - 1))["flushed"] > 0
    assert ex01.check_scale_exponent(k, grads)
    hints = ex01.HINTS["scale"]
    assert_unanswered(ex01.check_scale_exponent(None, grads), hints)
    assert_wrong(ex01.check_scale_exponent(0, grads), "keep raising k", hints=hints)
    assert_wrong(ex01.check_scale_exponent(k + 4, grads), "lower k", hints=hints)
    assert_wrong(ex01.check_scale_exponent(2.0 ** k, grads), "not an exponent")
    assert_wrong(ex01.check_scale_exponent(65536, grads), "is a scale, 2**16", hints=hints)


def test_ex01_master_weight():
    assert ex01.check_master_weight(ex01.reference_master_weight)
    assert_unanswered(ex01.check_master_weight(lambda start, update, steps: None),
                      ex01.HINTS["master"])
    for bad in ex01.WRONG_MASTER.values():
        assert_wrong(ex01.check_master_weight(bad), "swamped", "torch.float32",
                     hints=ex01.HINTS["master"])


@pytest.fixture(scope="module")
def scaler_runs():
    settings = ScalerSettings(init_scale=2.0 ** 24, growth_interval=2)
    demo = l03_scaler.train_with_scaler(settings, 20, evaluate=False)
    floor = l03_scaler.train_with_scaler(ScalerSettings(), 19, injection_rate=1.0,
                                         evaluate=False)
    healthy = l03_scaler.train_with_scaler(ScalerSettings(init_scale=2.0 ** 8), 10,
                                           evaluate=False)
    return settings, demo, floor, healthy


def test_ex03_update_rule_replays_a_run(scaler_runs):
    settings, demo, _, _ = scaler_runs
    assert any(demo.skipped) and len(set(demo.scales)) > 3
    assert ex03.check_update_rule(ex03.reference_update, demo.scales, demo.skipped, settings)
    hints = ex03.HINTS["rule"]
    assert_unanswered(ex03.check_update_rule(lambda *a: None, demo.scales, demo.skipped,
                                             settings), hints)
    for bad in ex03.WRONG_RULES.values():
        assert_wrong(ex03.check_update_rule(bad, demo.scales, demo.skipped, settings),
                     "growth_interval", hints=hints)


def test_ex03_update_rule_names_the_mistake_from_the_whole_trace():
    # Lesson 03's own demo (quick profile: 2^24, growth_interval 10, 30 steps): both typical
    # mistakes first go wrong after a clean step, where one generic hint covered both; the whole
    # replayed trace tells which rule the learner wrote.
    settings = ScalerSettings(init_scale=2.0 ** 24, growth_interval=10)
    demo = l03_scaler.train_with_scaler(settings, 30, evaluate=False)
    assert any(demo.skipped[6:]) and max(demo.scales[5:]) > min(demo.scales[5:])
    assert ex03.check_update_rule(ex03.reference_update, demo.scales, demo.skipped, settings)
    hints = ex03.HINTS["rule"]
    for name, bad in ex03.WRONG_RULES.items():
        check = ex03.check_update_rule(bad, demo.scales, demo.skipped, settings)
        assert_wrong(check, ex03.RULE_MISTAKES[name], hints=hints)
        others = [m for n, m in ex03.RULE_MISTAKES.items() if n != name]
        assert not [m for m in others if m in repr(check)], check

    def no_backoff(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
        return ex03.reference_update(scale, tracker, False, growth_factor, backoff_factor,
                                     growth_interval) if not found_inf else (scale, 0)
    assert_wrong(ex03.check_update_rule(no_backoff, demo.scales, demo.skipped, settings),
                 "after a skipped step", "backoff_factor", hints=hints)


def test_ex03_trace_causes(scaler_runs):
    _, demo, floor, healthy = scaler_runs
    traces = {"A": (floor.scales, floor.skipped), "B": (demo.scales, demo.skipped),
              "C": (healthy.scales, healthy.skipped)}
    right = {"A": "inf or NaN every step", "B": "init_scale too high", "C": "healthy"}
    assert ex03.check_trace_causes(right, traces)
    text = ex03.traces_text(traces)
    assert text.count("\n") == 2 and "A: log2(scale) per step: 16x 15x" in text
    hints = ex03.HINTS["causes"]
    assert_unanswered(ex03.check_trace_causes(dict.fromkeys(traces), traces), hints)
    assert_wrong(ex03.check_trace_causes({**right, "A": "init_scale too high",
                                          "B": "inf or NaN every step"}, traces),
                 "trace A is not", "rises again", hints=hints)
    assert_wrong(ex03.check_trace_causes({**right, "B": "healthy"}, traces), "trace B",
                 "in a row", hints=hints)
    assert_wrong(ex03.check_trace_causes({**right, "C": "init_scale too high"}, traces),
                 "trace C", "its job", hints=hints)
    assert_wrong(ex03.check_trace_causes({**right, "C": "too big"}, traces), "the causes are")


def test_ex03_steps_below_one(scaler_runs):
    floor = scaler_runs[2]
    assert ex03.first_below_one(floor.scales) == 17
    assert ex03.overflow_trace(ScalerSettings(), 19) == floor.scales  # the trainer's own trace
    assert ex03.check_steps_below_one(17, ScalerSettings())
    hints = ex03.HINTS["floor"]
    assert_unanswered(ex03.check_steps_below_one(None, ScalerSettings()), hints)
    assert_wrong(ex03.check_steps_below_one(16, ScalerSettings()), "not below 1", hints=hints)
    assert_wrong(ex03.check_steps_below_one(8, ScalerSettings()), "backoff_factor", hints=hints)
    assert ex03.check_steps_below_one(4, ScalerSettings(init_scale=8.0))


def test_ex07_scales_match_the_lessons_amax_scale():
    x = ex07.test_tensor()
    assert torch.allclose(ex07.reference_per_tensor(x), l07_fp8.amax_scale(x, "e4m3"))
    assert torch.allclose(ex07.reference_per_row(x), l07_fp8.amax_scale(x, "e4m3", "rowwise"))
    assert ex07.check_per_tensor_scale(ex07.reference_per_tensor)
    assert ex07.check_per_row_scale(ex07.reference_per_row)
    tensor, row = ex07.HINTS["tensor"], ex07.HINTS["row"]
    assert_unanswered(ex07.check_per_tensor_scale(lambda x: None), tensor)
    assert_unanswered(ex07.check_per_row_scale(lambda x: None), row)
    fragments = {"inverted": "inverse", "no abs": "x.abs()", "e5m2's max": "e5m2"}
    for name, bad in ex07.WRONG_TENSOR.items():
        assert_wrong(ex07.check_per_tensor_scale(bad), fragments[name], hints=tensor)
    assert_wrong(ex07.check_per_row_scale(ex07.WRONG_ROW["per column"]), "per column",
                 "the last dimension", hints=row)
    assert_wrong(ex07.check_per_row_scale(ex07.WRONG_ROW["per tensor"]), "whole tensor",
                 "each row's own values", hints=row)


def test_ex07_a_wrong_scale_is_named_only_by_its_own_mistake():
    # Before, any scale that was neither the inverse nor e5m2's was told to use x.abs().
    tensor, row = ex07.HINTS["tensor"], ex07.HINTS["row"]
    fnuz = ex07.check_per_tensor_scale(lambda x: 240.0 / x.abs().max())  # e4m3fnuz's max
    assert_wrong(fnuz, "0.5357x", "not e4m3's 448", hints=tensor)
    assert "x.abs()" not in fnuz.hint
    mean = ex07.check_per_tensor_scale(lambda x: 448.0 / x.abs().mean())  # a second input tells
    assert mean.status == "wrong" and mean.hints == tensor.levels, mean  # it from a wrong max
    rows_mean = ex07.check_per_row_scale(lambda x: 448.0 / x.abs().mean(dim=-1, keepdim=True))
    assert rows_mean.status == "wrong" and rows_mean.hints == row.levels, rows_mean
    assert_wrong(ex07.check_per_row_scale(lambda x: 448.0 / x.amax(dim=-1, keepdim=True)),
                 "x.abs()", hints=row)


def test_ex07_module_filter_names_every_layer_it_gets_wrong():
    # Lesson 07's own model (shapes only): converting every Linear gets the first and the last
    # layer wrong, for two reasons; the first layer's alone was the hint of a filter that only
    # forgot the first layer.
    with torch.device("meta"):
        big = l07_fp8.example_transformer(d_model=2048, n_layers=2)
    plan = l07_fp8.conversion_plan(big, 2048)  # MIN_FEATURES where no speed-up was measured
    hints = ex07.HINTS["filter"]
    every = ex07.check_module_filter(ex07.wrong_filter_all_linear, big, plan)
    assert_wrong(every, "2 of 9", "head", "first layer", "last layer", hints=hints)
    names = [r["layer"] for r in plan]
    first_only = ex07.check_module_filter(lambda m, fqn: fqn != names[-1], big, plan)
    assert_wrong(first_only, names[0], "first layer", hints=hints)
    assert "last layer" not in first_only.hint


def test_ex07_module_filter_on_a_model_of_another_family():
    model = l07_fp8.mlp_stack(256, blocks=2)
    plan = l07_fp8.conversion_plan(model, min_features=256)
    assert ex07.check_module_filter(l07_fp8.module_filter(plan), model, plan)
    hints = ex07.HINTS["filter"]
    assert_unanswered(ex07.check_module_filter(lambda m, fqn: None, model, plan), hints)
    assert_wrong(ex07.check_module_filter(ex07.wrong_filter_all_linear, model, plan),
                 "first layer", hints=hints)


def test_ex08_stochastic_rounding_is_unbiased():
    assert ex08.check_stochastic_rounding(ex08.reference_stochastic_round)
    hints = ex08.HINTS["stochastic"]
    assert_unanswered(ex08.check_stochastic_rounding(lambda x: None), hints)
    fragments = {"round to nearest": "round-to-nearest", "truncate": "toward zero",
                 "noise, then round to nearest": "cut the low 16 bits off"}
    for name, bad in ex08.WRONG_STOCHASTIC.items():
        assert_wrong(ex08.check_stochastic_rounding(bad), fragments[name], hints=hints)
    def int64_noise(x):  # torch.randint's default dtype makes the sum int64
        noise = torch.randint(0, 1 << 16, x.shape)
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    assert_wrong(ex08.check_stochastic_rounding(int64_noise), "torch.int32", hints=hints)
    assert_wrong(ex08.check_stochastic_rounding(lambda x: x.clone()), "torch.bfloat16",
                 hints=hints)


def test_ex08_rounding_every_value_up_is_not_called_a_double_rounding():
    # All the way up (the largest 16-bit value added below the cut, not a random one): every
    # positive value is biased by more than 0.3 ulp, the test the double rounding's hint used.
    def always_up(x):
        return ((x.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32).to(torch.bfloat16)
    check = ex08.check_stochastic_rounding(always_up)
    assert_wrong(check, "upper neighbour", "must be random", hints=ex08.HINTS["stochastic"])
    assert "rounds to nearest a second time" not in check.hint


def test_ex08_stochastic_rounding_must_draw_fresh_noise_each_call():
    """A rounding that is unbiased over a tensor but fixed from call to call (a generator seeded
    inside the function, or a pattern) repeats the same error at every step: not stochastic."""
    def seeded_inside(x):
        g = torch.Generator().manual_seed(1234)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=g)
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    def pattern(x):
        noise = (torch.arange(x.numel(), dtype=torch.int32) * 40503) % 65536
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    for fixed in (seeded_inside, pattern):
        assert_wrong(ex08.check_stochastic_rounding(fixed), "second call", "fresh random",
                     hints=ex08.HINTS["stochastic"])

    def uniform_draw(x):  # another correct way: compare a uniform draw with the share of the gap
        low = (x.view(torch.int32) & -65536).view(torch.float32)
        high = (low.view(torch.int32) + 65536).view(torch.float32)
        return torch.where(torch.rand_like(x) < (x - low) / (high - low), high, low).to(
            torch.bfloat16)

    assert ex08.check_stochastic_rounding(uniform_draw)


def test_ex08_kahan_update_keeps_small_updates():
    assert ex08.check_kahan_update(ex08.reference_kahan_add)
    hints = ex08.HINTS["kahan"]
    assert_unanswered(ex08.check_kahan_update(lambda w, c, u: None), hints)
    fragments = {"no compensation": "never changes", "sign flipped": "negative",
                 "compensation kept but never added": "never receives it"}
    for name, bad in ex08.WRONG_KAHAN.items():
        assert_wrong(ex08.check_kahan_update(bad), fragments[name], hints=hints)
    assert_wrong(ex08.check_kahan_update(lambda w, c, u: (w, c)), "unchanged", hints=hints)


def test_ex08_kahan_update_that_keeps_its_own_fp32_copy_fails():
    """A learner's update that keeps an fp32 master copy between calls (in a closure) and only
    casts it to bf16 ends exact, but is not a Kahan update: the same inputs must give the same
    outputs, whatever was called before."""
    master = {}

    def fp32_master(weight, compensation, update):
        total = master.setdefault("w", weight.float().clone())
        total += update
        return total.to(torch.bfloat16), compensation

    assert_wrong(ex08.check_kahan_update(fp32_master), "same inputs", hints=ex08.HINTS["kahan"])

    def textbook(weight, compensation, update):  # Kahan with the buffer's sign the other way
        w = weight.float()
        y = update - compensation.float()
        new = (w + y).to(torch.bfloat16)
        return new, ((new.float() - w) - y).to(torch.bfloat16)

    assert ex08.check_kahan_update(textbook)


@pytest.fixture(scope="module")
def lesson08_memory():
    workload = l08_weights.teacher_student(16, 16, 2, "cpu")
    rows = l08_weights.run_recipes(workload, ex08.MEMORY_RECIPES, "cpu", seeds=(0,), bf16=True)
    return l08_weights.memory_table(rows)


def test_ex08_state_gib_against_the_measured_table(lesson08_memory):
    memory = lesson08_memory
    ref = ex08.reference_state_gib(memory)
    assert sorted(ref) == sorted(ex08.MEMORY_RECIPES)
    assert abs(ref["fp32 master"] / (16 * 7e9 / 2 ** 30) - 1) < 0.01  # measured, near 16 B
    assert ex08.check_state_gib(ref, memory)
    assert ex08.check_state_gib({"fp32 master": 104.3, "bf16": 52.2, "bf16 + Kahan": 65.2}, memory)
    hints = ex08.HINTS["memory"]
    assert_unanswered(ex08.check_state_gib(dict.fromkeys(ex08.MEMORY_RECIPES), memory), hints)
    assert_wrong(ex08.check_state_gib({k: v * 2 ** 30 / 1e9 for k, v in ref.items()}, memory),
                 "GB", hints=hints)
    assert_wrong(ex08.check_state_gib({**ref, "fp32 master": 12 * 7e9 / 2 ** 30}, memory),
                 "gradients too", hints=hints)
    assert_wrong(ex08.check_state_gib({**ref, "bf16": 16 * 7e9 / 2 ** 30}, memory),
                 "2 bytes each", hints=hints)
    assert_wrong(ex08.check_state_gib({**ref, "bf16 + Kahan": ref["bf16"]}, memory),
                 "compensation", hints=hints)
    only_ref = [m for m in memory if m["recipe"] == "fp32 master"]
    assert ex08.check_state_gib(ref, only_ref)  # recipes not measured are not graded
    assert ex08.check_state_gib(ref, []).status == "skipped"


def _master(start, update, steps, offset=0, fixed_start=None):
    w = torch.tensor(start if fixed_start is None else fixed_start, dtype=torch.float32)
    u = torch.tensor(update, dtype=torch.float16)
    for _ in range(steps + offset):
        w = w + u.float()
    return float(w.half())


def test_master_weight_catches_an_off_by_one_loop_and_an_ignored_start():
    assert ex01.check_master_weight(ex01.reference_master_weight)
    assert ex01.check_master_weight(lambda s, u, n: torch.tensor(_master(s, u, n)).half())
    for bad in (lambda s, u, n: _master(s, u, n, offset=-1),
                lambda s, u, n: _master(s, u, n, fixed_start=1.0)):
        assert ex01.check_master_weight(bad, 1.0, 1e-4, 1000).status == "wrong"
        check = ex01.check_master_weight(bad)
        assert "train(0.5, 0.0003, 200)" in check.message and "`steps` times" in check.hint


def test_master_weight_hint_is_true_for_a_bf16_master():
    def bf16_master(start, update, steps):
        w = torch.tensor(start, dtype=torch.bfloat16)
        for _ in range(steps):
            w = w + torch.tensor(update, dtype=torch.float16).bfloat16()
        return float(w.half())
    check = ex01.check_master_weight(bf16_master)
    assert check.status == "wrong" and "bf16" in check.hint and "2**-7" in check.hint


def _demo():
    st = ScalerSettings(init_scale=2.0 ** 24, growth_interval=10)
    skipped = [True] * 8 + [False] * 25 + [True] + [False] * 30
    return ex03.replay(ex03.reference_update, [st.init_scale] * len(skipped), skipped, st), \
        skipped, st


def test_update_rule_with_the_demo_numbers_hard_coded_is_wrong():
    scales, skipped, st = _demo()

    def hard_coded(scale, tracker, found_inf, g, b, gi):
        if found_inf:
            return scale / 2, 0
        tracker += 1
        return (scale * 2, 0) if tracker == 10 else (scale, tracker)
    assert ex03.check_update_rule(ex03.reference_update, scales, skipped, st)
    check = ex03.check_update_rule(hard_coded, scales, skipped, st)
    assert check.status == "wrong" and "growth_factor=4" in check.message
    assert "use the arguments" in check.hint


def test_update_rule_returning_one_value_is_told_so_not_a_typeerror():
    check = ex03.check_update_rule(lambda s, t, f, g, b, i: s * b if f else s, [1.0, 0.5],
                                   [True, False], ScalerSettings(init_scale=1.0))
    assert check.status == "wrong" and "must return (scale, tracker)" in check.message
    assert "TypeError" not in check.message


def test_update_rule_that_fails_only_under_other_settings_says_so():
    """The second replay (other settings) reports a raise or a wrong return the way the first
    does, prefixed with where it happened (one helper, ``ex03._replayed``)."""
    scales, skipped, st = _demo()

    def demo_only(scale, tracker, found_inf, g, b, gi):
        if g != st.growth_factor:
            raise KeyError("a table of the demo's settings")
        return ex03.reference_update(scale, tracker, found_inf, g, b, gi)

    def pair_only_for_the_demo(scale, tracker, found_inf, g, b, gi):
        new = ex03.reference_update(scale, tracker, found_inf, g, b, gi)
        return new if g == st.growth_factor else new[0]
    raised = ex03.check_update_rule(demo_only, scales, skipped, st)
    assert raised.status == "wrong"
    assert raised.message.endswith("with other settings, update raised KeyError: "
                                   "\"a table of the demo's settings\"")
    single = ex03.check_update_rule(pair_only_for_the_demo, scales, skipped, st)
    assert single.status == "wrong" and "with other settings, update must return (scale, " \
        "tracker)" in single.message and "return scale, tracker" in single.hint


def test_fp8_scales_that_are_strings_or_zero():
    check = ex07.check_per_row_scale(lambda x: "scales")
    assert check.status == "wrong" and "one per row" in check.message
    zero = ex07.check_per_tensor_scale(lambda x: 0.0)
    assert zero.status == "wrong" and "amax is found" not in zero.hint and "scale of 0" in zero.hint
    listed = ex07.check_per_row_scale(lambda x: [448 / r.abs().amax().reshape(1) for r in x])
    assert listed.status == "wrong" and "shape (8,)" in listed.message  # a list, not a traceback


def test_ex03_lettered_traces_hide_which_run_is_which(scaler_runs):
    _, demo, floor, healthy = scaler_runs
    traces = ex03.lettered_traces([healthy, floor, demo])
    assert sorted(traces) == ["A", "B", "C"]
    given = [(list(r.scales), list(r.skipped)) for r in (healthy, floor, demo)]
    assert sorted(map(repr, traces.values())) == sorted(map(repr, given))
    assert [traces[k] for k in "ABC"] != given  # not the order the cell lists them in
    assert ex03.lettered_traces([demo]) == {"A": (list(demo.scales), list(demo.skipped))}
    with pytest.raises(ValueError, match="runs must hold 1 to 3 runs"):
        ex03.lettered_traces([demo] * 4)


def test_ex03_floor_result_shows_the_step_only_beside_a_prediction(scaler_runs):
    floor = scaler_runs[2]
    hidden = ex03.floor_result(None, floor)
    assert "17" not in hidden and "once exercise 2" in hidden
    shown = ex03.floor_result(16, floor)
    assert "at step 17" in shown and "you predicted 16" in shown


def test_ex07_module_filter_applies_the_rules_to_gpts_it_never_showed():
    with torch.device("meta"):
        big = l07_fp8.example_transformer(d_model=2048, n_layers=2)
    plan = l07_fp8.conversion_plan(big, 2048)
    assert ex07.plan_threshold(plan) == 2048
    copied = ex07.check_module_filter(l07_fp8.module_filter(plan), big, plan)  # the table's names
    assert_wrong(copied, "another GPT", "not from a list of big_gpt's names",
                 hints=ex07.HINTS["filter"])
    names = [r["layer"] for r in plan]

    def by_the_rules(module, fqn):
        if fqn in (names[0], names[-1]):
            return False
        return all(d % 16 == 0 and d >= 2048 for d in (module.in_features, module.out_features))
    check = ex07.check_module_filter(by_the_rules, big, plan)
    assert check and "2 other GPTs" in check.message, check
    for model in ex07.held_out_models(2048):
        assert all(p.device.type == "meta" for p in model.parameters())
