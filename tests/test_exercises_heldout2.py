"""Held-out answers from an outside check of the graders (round 2): answers written to pass on
the grader's own inputs only, or a mistake that the grader's settings hid, each refused and named;
correct answers written another way still pass."""
import numpy as np
import torch

from amp_lessons.exercises import ex03, ex06, ex07
from amp_lessons.train.config import ScalerSettings

from exercise_helpers import assert_wrong, fresh_attempts  # noqa: F401 - autouse fixture

E4M3_MAX = 448.0


def _demo_run():
    st = ScalerSettings(init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=5)
    skipped = [True, True] + [False] * 6 + [True] + [False] * 12
    return ex03.replay(ex03.reference_update, [st.init_scale] * len(skipped), skipped, st), \
        skipped, st


def test_ex03_backing_off_by_dividing_by_growth_factor_fails_under_other_settings():
    """With the defaults (2 and 0.5) scale / growth_factor equals scale * backoff_factor; the
    grader's second run must not have backoff_factor = 1 / growth_factor, or it passes."""
    def divides(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf:
            return scale / growth, 0
        tracker += 1
        return (scale * growth, 0) if tracker == interval else (scale, tracker)
    st = ex03.OTHER_SETTINGS
    assert st.backoff_factor * st.growth_factor != 1
    check = ex03.check_update_rule(divides, *_demo_run())
    assert_wrong(check, "growth_factor=4", "use the arguments", hints=ex03.HINTS["rule"])


def test_ex03_floor_at_one_still_shown_and_other_spellings_still_pass():
    def floored(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf:
            return max(scale * backoff, 1.0), 0
        tracker += 1
        return (scale * growth, 0) if tracker == interval else (scale, tracker)

    def other_spelling(scale, tracker, found_inf, growth, backoff, interval):
        if found_inf:
            return [np.float64(scale / (1 / backoff)), 0]
        tracker += 1
        return (torch.as_tensor(scale * growth), 0) if tracker >= interval \
            else (torch.as_tensor(scale), tracker)
    assert_wrong(ex03.check_update_rule(floored, *_demo_run()), "below 1")
    assert ex03.check_update_rule(other_spelling, *_demo_run()).passed


def test_ex07_a_scale_worked_out_once_is_refused_on_another_tensor():
    per_tensor = float(E4M3_MAX / ex07.test_tensor().abs().max())
    per_row = E4M3_MAX / ex07.test_tensor().abs().amax(dim=1, keepdim=True)
    for check, hints in ((ex07.check_per_tensor_scale(lambda x: per_tensor), ex07.HINTS["tensor"]),
                         (ex07.check_per_row_scale(lambda x: per_row.clone()), ex07.HINTS["row"])):
        assert_wrong(check, "another tensor", "the x your function receives", hints=hints)
        assert f"{per_tensor:.4g}" not in repr(check)


def test_ex07_correct_scales_written_differently_pass():
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    assert ex07.check_per_tensor_scale(lambda x: float(fp8_max / x.abs().max())).passed
    assert ex07.check_per_tensor_scale(
        lambda x: E4M3_MAX / torch.clamp(x.abs().amax(), min=1e-12)).passed
    assert ex07.check_per_row_scale(lambda x: (E4M3_MAX / x.abs().amax(-1)).unsqueeze(-1)).passed
    assert ex07.check_per_row_scale(
        lambda x: (E4M3_MAX / x.abs().amax(dim=1, keepdim=True)).tolist()).passed


def test_ex06_efficiency_in_percent_is_named():
    check = ex06.check_efficiency(lambda one, many, n: 100 * many / (n * one), [])
    assert_wrong(check, "percent", hints=ex06.HINTS["efficiency"])
    assert "0.93" not in repr(check)
    assert ex06.check_efficiency(lambda one, many, n: np.float32(many) / np.float32(n * one),
                                 []).passed


# --- ex02's loop: a scheduler test that is right only while the scale never grows ----------------

def _loop_with_scheduler_test(keep_stepping, scaler_class=None):
    """The fixed loop of lesson 02 with the scheduler stepped where ``keep_stepping(new, old)``;
    its GradScaler is ``scaler_class``, or ``torch.amp.GradScaler`` looked up as the loop runs."""
    def loop(model, optimizer, scheduler, batches, device_type, init_scale):
        make = scaler_class or torch.amp.GradScaler
        scaler = make(device_type, init_scale=init_scale)
        for x, y in batches:
            with torch.autocast(device_type, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if keep_stepping(scaler.get_scale(), scale):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return loop


def test_ex02_refuses_a_scheduler_that_steps_only_while_the_scale_is_unchanged():
    """`==` in place of the hint's `>=` matches the trainer over 20 steps at growth_interval 2000
    (the scale never grows there); run again with scalers that grow, it misses every growth."""
    from amp_lessons.exercises import ex02

    result = ex02.check_fixed_loop(_loop_with_scheduler_test(lambda new, old: new == old),
                                   device="cpu")
    assert result.status == "wrong", result
    assert "skipped the steps where the scale grew" in result.message


def test_ex02_still_passes_a_right_loop_whose_scaler_cannot_be_made_to_grow():
    """A loop that bound GradScaler before the grade (an import at the top) cannot be probed
    with growing scalers: it is graded on the 20 steps alone, not refused."""
    from torch.amp import GradScaler as BoundEarly

    from amp_lessons.exercises import ex02

    loop = _loop_with_scheduler_test(lambda new, old: not new < old, scaler_class=BoundEarly)
    assert ex02.check_fixed_loop(loop, device="cpu").status == "passed"
    assert ex02.check_fixed_loop(_loop_with_scheduler_test(lambda new, old: new >= old),
                                 device="cpu").status == "passed"
    assert torch.amp.GradScaler.__name__ == "GradScaler"  # the probe put the class back
