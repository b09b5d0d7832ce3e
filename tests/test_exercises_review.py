"""The graders against an outside review's answers (wrong, partly right, written differently,
odd): a wrong answer never passes, a right one written differently does, feedback is true, and
odd input gets a message, never a traceback. Each test stands for a class of answers, checked in
every grader where the class can occur."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from amp_lessons.exercises import ex01
from amp_lessons.exercises import ex02
from amp_lessons.exercises import ex03
from amp_lessons.exercises import ex04
from amp_lessons.exercises import ex05
from amp_lessons.exercises import ex06
from amp_lessons.exercises import ex07
from amp_lessons.exercises import ex08
from amp_lessons.exercises import ex09
from amp_lessons.exercises import check as common
from amp_lessons.train.trainer import ScalerSettings

NAN, INF = float("nan"), float("inf")


def status(check):
    return check.status


# --- helpers every grader shares ----------------------------------------------------------------
def test_tolerances_reject_nan_and_inf():
    within, close = common.within, common.close
    assert not within(NAN, 1.0, 0.5) and not within(INF, 1.0, 0.5) and within(1.2, 1.0, 0.5)
    assert not close(NAN, 1.0, abs_tol=1.0) and not close(None, 1.0, 1.0) and close(1.5, 1.0, 0, 1)


def test_numbers_in_any_numeric_type_count_and_strings_do_not():
    number, whole_number = common.number, common.whole_number
    for v in (3, 3.0, np.int64(3), np.float32(3), torch.tensor(3), torch.tensor(3.0,
                                                                                dtype=torch.bfloat16)):
        assert number(v) == 3.0 and whole_number(v) == 3, v
    for v in ("3", None, True, np.bool_(True), [3], torch.tensor([1.0, 2.0]), 3.5, NAN, INF):
        assert whole_number(v) is None, v
    assert number("3") is None and number(torch.tensor(True)) is None


def test_keys_match_whatever_their_case_and_spacing():
    keyed = common.keyed
    assert keyed({" FP16_safe": 1, "Scale Exponent": 2}, ("fp16 safe", "scale exponent")) == {
        "fp16 safe": 1, "scale exponent": 2}
    assert keyed({"a": 1, "A": 2}, ("A",)) is None and keyed([1], ("A",)) is None


# --- 1. NaN / inf answers never pass a tolerance ------------------------------------------------
def test_nan_or_inf_predictions_are_wrong_with_a_message():
    for b in (NAN, INF, -INF):
        check = ex01.check_fp16_predictions(1.0, b)
        assert status(check) == "wrong" and "finite" in check.message, check
    row = {"params_gib": 4e6 / 2 ** 30, "grads_gib": 4e6 / 2 ** 30,
           "optimizer_state_gib": 4e6 / 2 ** 30}
    check = ex04.check_state_bytes({"params": NAN, "grads": 4e6, "momentum": 4e6}, row)
    assert status(check) == "wrong" and "finite" in check.message
    assert status(ex04.check_activation_ratio(NAN, {"activations_gib": 1.0},
                                              {"activations_gib": 2.0})) == "wrong"
    measured = {"ddp": 16.0, "zero": 12.0, "fsdp2": 8.0}
    assert status(ex06.check_state_per_rank({**measured, "ddp": NAN}, measured, 2)) == "wrong"


def test_ddp_checksums_that_are_nan_are_not_identical_weights():
    report = {"world_size": 2, "ddp": True, "ddp_losses": [1.0], "fsdp_losses": [1.0],
              "ddp_checksum": NAN, "fsdp_local": 50, "full": 100, "fsdp_units": 4,
              "fsdp_output": "torch.bfloat16"}
    check = ex06.grade_reports([dict(report, rank=0), dict(report, rank=1)])
    assert status(check) == "wrong" and "DDP weights differ" in check.message


# --- 2. a function grader tries several inputs --------------------------------------------------
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


# --- 3. an update rule is replayed under other settings -----------------------------------------
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


# --- 4 and 5. accumulation must accumulate, and any micro_batches works -------------------------
def test_accumulation_without_micro_batches_is_wrong():
    whole = ex05.check_accumulation(lambda m, x, y, k: F.cross_entropy(m(x), y).backward(),
                                    device="cpu")
    assert whole.status == "wrong" and "forward over 32 samples" in whole.message

    def one_backward(m, x, y, k):
        sum(F.cross_entropy(m(a), b) / k for a, b in zip(x.chunk(k), y.chunk(k))).backward()
    summed = ex05.check_accumulation(one_backward, device="cpu")
    assert summed.status == "wrong" and "backward ran 1 time" in summed.message


def test_accumulation_right_answers_pass_for_any_number_of_micro_batches():
    def by_index(m, x, y, k):
        n = len(x) // k
        for i in range(k):
            (F.cross_entropy(m(x[i * n:(i + 1) * n]), y[i * n:(i + 1) * n]) / k).backward()
    for k in (1, 3, 4, 5):
        assert ex05.check_accumulation(ex05.reference_accumulate, micro_batches=k, device="cpu")
        assert ex05.check_accumulation(by_index, micro_batches=k, device="cpu")
    for k in (0, -1, 2.5):
        with pytest.raises(ValueError, match="micro_batches"):
            ex05.check_accumulation(ex05.reference_accumulate, micro_batches=k, device="cpu")


# --- 6. a resume must carry the scaler's growth tracker -----------------------------------------
def test_resume_without_the_growth_tracker_is_wrong():
    def save(model, optimizer, scaler):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scale": scaler.get_scale()}

    def load(state, model, optimizer, scaler):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict({**scaler.state_dict(), "scale": state["scale"]})
    check = ex05.check_resume(save, load, "cpu")
    assert check.status == "wrong" and "scaler.state_dict()" in check.hint
    assert "restarted from init_scale" not in check.hint


# --- 7-11. odd answers get a message, never a traceback -----------------------------------------
def test_channels_last_odd_returns_get_messages():
    cl = torch.channels_last
    cases = {"swapped": (lambda m, x: (x.contiguous(memory_format=cl), m.to(memory_format=cl)),
                         "swapped"),
             "x None": (lambda m, x: (m.to(memory_format=cl), None), "a module and a tensor"),
             "half": (lambda m, x: (m.to(memory_format=cl).half(), x.to(memory_format=cl).half()),
                      "changed dtype"),
             "one thing": (lambda m, x: m, "return two things")}
    for name, (fn, fragment) in cases.items():
        check = ex04.check_channels_last(fn, "cpu")
        assert check.status == "wrong" and fragment in check.message, (name, check)
    assert ex04.check_channels_last(lambda m, x: [m.to(memory_format=cl),
                                                  x.to(memory_format=cl)], "cpu")
    assert ex04.check_channels_last(None, "cpu").status == "not answered yet"


def test_checkpointing_odd_outputs_get_true_messages():
    half = ex05.check_checkpointing(
        lambda b, x: ex05.reference_checkpointed_forward(b, x).half(), "cpu")
    assert half.status == "wrong" and "torch.float16" in half.message

    def no_grad(blocks, x):
        with torch.no_grad():
            for b in blocks:
                x = b(x)
        return x
    check = ex05.check_checkpointing(no_grad, "cpu")
    assert check.status == "wrong" and "use_reentrant" not in check.hint
    assert "no_grad" in check.hint

    def reentrant(blocks, x):
        for b in blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True)
        return x
    with pytest.warns(UserWarning):
        check = ex05.check_checkpointing(reentrant, "cpu")
    assert check.status == "wrong" and "use_reentrant=False" in check.hint
    assert ex05.check_checkpointing(lambda b, x: "out", "cpu").status == "wrong"


def test_fp8_scales_that_are_strings_or_zero():
    check = ex07.check_per_row_scale(lambda x: "scales")
    assert check.status == "wrong" and "one per row" in check.message
    zero = ex07.check_per_tensor_scale(lambda x: 0.0)
    assert zero.status == "wrong" and "amax is found" not in zero.hint and "scale of 0" in zero.hint
    listed = ex07.check_per_row_scale(lambda x: [448 / r.abs().amax().reshape(1) for r in x])
    assert listed.status == "wrong" and "shape (8,)" in listed.message  # a list, not a traceback


def test_huge_scale_exponents_get_a_message():
    grads = [torch.full((10,), 1e-6)]
    for k in (2000, -2000):
        assert ex01.check_scale_exponent(k, grads).status == "wrong"


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
    assert check.status == "wrong" and "none recorded" in check.message


# --- 12. numbers in any numeric type ------------------------------------------------------------
def test_whole_numbers_in_any_type_pass():
    grads = [torch.full((10,), 1e-6)]
    k = ex01.smallest_safe_exponent(grads)
    for v in (np.int64(k), float(k), torch.tensor(k)):
        assert ex01.check_scale_exponent(v, grads), v
    for v in (17, 17.0, np.int64(17), torch.tensor(17)):
        assert ex03.check_steps_below_one(v, ScalerSettings()), v
    assert ex03.check_steps_below_one(17.5, ScalerSettings()).status == "wrong"
    rep = _report([{"layer": "fc1", "act_absmax": 3.0}, {"layer": "fc2", "act_absmax": 9e4}])
    for v in (14.0, np.int64(14), torch.tensor(14)):
        assert ex09.check_report_answers({"fp16 safe": False, "scale exponent": v,
                                          "largest activation": "fc2"}, rep), v


def test_efficiency_computed_in_float32_passes():
    summary = [{"label": "cnn", "world_size": 1, "per_s": 100.0, "efficiency": None},
               {"label": "cnn", "world_size": 2, "per_s": 170.0, "efficiency": 0.85}]
    assert ex06.check_efficiency(lambda a, b, n: torch.tensor(b) / (n * torch.tensor(a)), summary)
    assert ex06.check_efficiency(lambda a, b, n: np.float32(b) / np.float32(n * a), summary)
    off = ex06.check_efficiency(lambda a, b, n: 0.851, summary)
    assert off.status == "wrong"
    assert ex06.check_efficiency(lambda a, b, n: "0.85", summary).status == "wrong"


# --- 13. the unanswered script template, precisely ----------------------------------------------
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


# --- 14. strings: case and spaces do not matter -------------------------------------------------
def test_string_answers_ignore_case_and_spaces():
    rep = _report([{"layer": "fc1", "act_absmax": 3.0}, {"layer": "fc2", "act_absmax": 9e4}])
    for name in (" fc2", "FC2 "):
        assert ex09.check_overflow_layer(name, rep), name
        assert ex09.check_report_answers({"FP16 safe": False, " scale_exponent": 14,
                                          "largest activation": name}, rep), name
    traces = {"A": ([2.0 ** (16 - i) for i in range(5)] + [2.0 ** 11] * 5,
                    [True] * 5 + [False] * 5),
              "B": ([2.0 ** (16 - i) for i in range(10)], [True] * 10),
              "C": ([65536.0] * 10, [False] * 10)}
    assert ex03.check_trace_causes({"a": " Init_Scale too high", "B": "inf or NaN every step",
                                    "C": "Healthy"}, traces)
    assert ex02.check_autocast_dtypes({"FC1": "16 bit", "norm": "16-bit", "fc2": "half",
                                       "loss": "single"}, "cpu")
    assert ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "16-bit", "fc2": "16-bit",
                                       "loss": "32 bit"}, "cpu")
    n = 1_000_000
    row = {k: 4 * n / 2 ** 30 for k in ("params_gib", "grads_gib", "optimizer_state_gib")}
    assert ex04.check_state_bytes({"Params": 4 * n, "grads ": 4 * n, "MOMENTUM": 4 * n}, row)
    measured = {"ddp": 16.0, "zero": 12.0, "fsdp2": 8.0}
    assert ex06.check_state_per_rank({"DDP": 16.0, "ZeRO": 12.0, "FSDP2": 8.0}, measured, 2)


def test_memory_answers_with_keys_in_another_case():
    memory = [{"workload": "w", "recipe": r, "bytes per parameter": b, "weights MiB": 1.0,
               "gradients MiB": 1.0, "optimizer state MiB": 2.0}
              for r, b in (("fp32 master", 16.0), ("bf16", 8.0), ("bf16 + Kahan", 10.0))]
    right = ex08.reference_state_gib(memory)
    assert ex08.check_state_gib({k.upper(): v for k, v in right.items()}, memory)
    check = ex08.check_state_gib({"fp32": 1.0, "bf16": 2.0, "kahan": 3.0}, memory)
    assert check.status == "wrong" and "got None" not in check.message
    assert "no answer for 'fp32 master'" in check.message


# --- the other false or unclear feedback --------------------------------------------------------
def test_state_bytes_negative_or_per_parameter_answers():
    n = 1_000_000
    row = {k: 4 * n / 2 ** 30 for k in ("params_gib", "grads_gib", "optimizer_state_gib")}
    neg = ex04.check_state_bytes({"params": -4 * n, "grads": 4 * n, "momentum": 4 * n}, row)
    assert neg.status == "wrong" and "more than 0 bytes" in neg.message
    per = ex04.check_state_bytes({"params": 4, "grads": 4, "momentum": 4}, row)
    assert per.status == "wrong" and "number of parameters" in per.hint
    assert "GiB or millions" not in per.hint
    gib = ex04.check_state_bytes({k: 4 * n / 2 ** 30 for k in ex04.KEYS}, row)
    assert gib.status == "wrong" and "that is GiB" in gib.hint and "0 bytes" not in gib.message


def test_autograd_function_a_few_percent_off_is_wrong():
    def scaled(factor):
        class Off(torch.autograd.Function):
            @staticmethod
            @torch.amp.custom_fwd(device_type="cpu")
            def forward(ctx, a, b):
                ctx.save_for_backward(a, b)
                return a @ b

            @staticmethod
            @torch.amp.custom_bwd(device_type="cpu")
            def backward(ctx, g):
                a, b = ctx.saved_tensors
                return (g @ b.T) * factor, (a.T @ g) * factor
        return Off
    assert ex02.check_autograd_function(ex02.reference_function("cpu"), "cpu")
    assert ex02.check_autograd_function(scaled(1.0), "cpu")
    assert ex02.check_autograd_function(scaled(1.04), "cpu").status == "wrong"
    assert ex02.check_autograd_function(scaled(1.03), "cpu").status == "wrong"


def _loop(dtype, scaler):
    def loop(model, opt, sched, batches, device_type, init_scale):
        s = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=scaler)
        for x, y in batches:
            with torch.autocast(device_type, dtype=dtype):
                loss = F.cross_entropy(model(x), y)
            s.scale(loss).backward()
            s.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            s.step(opt)
            s.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return loop


def test_a_loop_without_fp16_or_a_scaler_is_not_told_about_skipped_steps():
    bf16 = ex02.check_fixed_loop(_loop(torch.bfloat16, False), "cpu")
    assert bf16.status == "wrong" and "torch.bfloat16" in bf16.message
    assert "skipped" not in bf16.message
    no_scaler = ex02.check_fixed_loop(_loop(torch.float16, False), "cpu")
    assert no_scaler.status == "wrong" and "no GradScaler" in no_scaler.message


def test_non_functions_are_not_answered_or_wrong_never_a_traceback():
    for check in (ex03.check_update_rule(None, [1.0, 1.0], [False, False], ScalerSettings()),
                  ex05.check_accumulation(None, device="cpu"),
                  ex05.check_checkpointing(None, "cpu"),
                  ex07.check_per_tensor_scale(None), ex07.check_per_row_scale(...),
                  ex08.check_stochastic_rounding(None), ex08.check_kahan_update(None)):
        assert check.status == "not answered yet", check
    assert ex07.check_per_row_scale(42).status == "wrong"
    assert ex05.check_resume(None, ex05.reference_load, "cpu").status == "not answered yet"
