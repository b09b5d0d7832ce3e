"""The graders of the training-loop lessons: 02 (dtypes under autocast, the three-bug loop, an
autograd Function under autocast), 04 (state bytes with AdamW, autocast's weight copies,
channels_last) and 05 (checkpointing, accumulation, resume): the reference passes, the stub is
"not answered yet", each typical mistake gets its own hint."""
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


def test_ex02_dtypes():
    real = ex02.autocast_dtypes("cpu")
    assert ex02.check_autocast_dtypes(dict(real), "cpu")
    assert ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "16-bit", "fc2": "bf16",
                                       "loss": "fp32"}, "cpu")
    hints = ex02.HINTS["dtypes"]
    assert_unanswered(ex02.check_autocast_dtypes(dict.fromkeys(ex02.LAYERS), "cpu"), hints)
    assert_wrong(ex02.check_autocast_dtypes({"fc1": "fp32", "norm": "16-bit", "fc2": "16-bit",
                                             "loss": "fp32"}, "cpu"), "matrix multiply", hints=hints)
    assert_wrong(ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "16-bit", "fc2": "16-bit",
                                             "loss": "16-bit"}, "cpu"), "range more than speed",
                 hints=hints)
    assert_wrong(ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "fp32", "fc2": "16-bit",
                                             "loss": "fp32"}, "cpu"), "layer_norm", hints=hints)


def test_ex02_dtypes_one_answer_for_the_whole_model_is_named_as_such(monkeypatch):
    hints = ex02.HINTS["dtypes"]
    # On a CPU (the quick profile) "everything fp32" misses fc1, norm and fc2.
    assert_wrong(ex02.check_autocast_dtypes(ex02.WRONG_DTYPES["everything fp32"], "cpu"),
                 "does change", "fc1, norm, fc2", hints=hints)
    # On CUDA (the lead's GPU run) "everything 16-bit" misses norm and loss: the first of them
    # alone gave norm's hint, which is the hint for answering CUDA with a CPU's dtypes.
    cuda = {"fc1": torch.float16, "norm": torch.float32, "fc2": torch.float16,
            "loss": torch.float32}
    monkeypatch.setattr(ex02, "autocast_dtypes", lambda device=None: cuda)
    check = ex02.check_autocast_dtypes(ex02.WRONG_DTYPES["everything 16-bit"], "cpu")
    assert_wrong(check, "norm, loss", "per operation", hints=hints)
    assert "CPU autocast keeps" not in check.hint
    cpu_answer = {"fc1": "16-bit", "norm": "16-bit", "fc2": "16-bit", "loss": "fp32"}
    assert_wrong(ex02.check_autocast_dtypes(cpu_answer, "cpu"), "layer_norm", hints=hints)


def _one_bug(bug):
    """The reference loop with one of the three bugs put back."""
    import torch.nn.functional as F

    def loop(model, optimizer, scheduler, batches, device_type, init_scale):
        if bug == "half":
            model.half()
        scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
        for x, y in batches:
            with torch.autocast(device_type, dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if bug == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(optimizer)
            if bug not in ("clip", "no clipping"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if bug == "scheduler" or (bug != "no scheduler" and scaler.get_scale() >= scale):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return loop


def test_ex02_fixed_loop_matches_the_trainer_bitwise():
    hints = ex02.HINTS["loop"]
    assert ex02.check_fixed_loop(ex02.reference_loop, "cpu")
    assert_unanswered(ex02.check_fixed_loop(ex02.buggy_loop, "cpu"), hints)
    half = ex02.check_fixed_loop(_one_bug("half"), "cpu")
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # torch notices it too
        scheduler = ex02.check_fixed_loop(_one_bug("scheduler"), "cpu")
    clip = ex02.check_fixed_loop(_one_bug("clip"), "cpu")
    assert_wrong(half, ".half() bug", "delete the model.half()", hints=hints)
    assert_wrong(scheduler, "scheduler bug", "get_scale()", hints=hints)
    assert_wrong(clip, "clipping bug is the one left", "clip after scaler.unscale_", hints=hints)
    unclipped = ex02.check_fixed_loop(_one_bug("no clipping"), "cpu")  # not the clipping order
    assert_wrong(unclipped, "something else in the loop changed", "clip to 1.0", hints=hints)
    never = ex02.check_fixed_loop(_one_bug("no scheduler"), "cpu")  # fixed too far: never steps
    assert_wrong(never, "stepped less often", "after every other one", hints=hints)
    # each says which bug remains and hints at that one only, not the list of three
    others = {"half": ("clip", "scheduler"), "scheduler": ("half()", "clip"),
              "clip": ("half()", "scheduler")}
    for check, bug in ((half, "half"), (scheduler, "scheduler"), (clip, "clip")):
        assert not [w for w in others[bug] if w in check.hint], (bug, check.hint)


def test_ex02_the_clipping_bug_is_named_when_it_moves_a_skip(monkeypatch):
    # Clipping the scaled gradients moves the weights less, and the scaler's overflows move with
    # them: on the CPU the trainer's run skips step 7, the clip-first loop does not (it skips a
    # later one). Cut at 8 steps, the clip-first loop steps the scheduler once more and its rate
    # ends lower: the rate alone named the scheduler bug, which that loop does not have.
    monkeypatch.setattr(ex02, "LOOP_STEPS", 8)
    ex02.trainer_result.cache_clear()
    try:
        clip_lr = _final_lr(ex02._clip_before_unscale)
        assert clip_lr < ex02.trainer_result("cpu")[1]  # the case: a rate that differs
        hints = ex02.HINTS["loop"]
        clip = ex02.check_fixed_loop(_one_bug("clip"), "cpu")
        assert_wrong(clip, "clipping bug is the one left", "clip after scaler.unscale_",
                     hints=hints)
        assert "scheduler bug" not in repr(clip)
        with pytest.warns(UserWarning, match="lr_scheduler.step"):
            scheduler = ex02.check_fixed_loop(_one_bug("scheduler"), "cpu")
        assert_wrong(scheduler, "scheduler bug", "get_scale()", hints=hints)
        assert ex02.check_fixed_loop(ex02.reference_loop, "cpu")
    finally:
        ex02.trainer_result.cache_clear()


def _final_lr(loop):
    model, optimizer, scheduler, batches = ex02._loop_setup(torch.device("cpu"))
    loop(model, optimizer, scheduler, batches, "cpu", ex02.LOOP_INIT_SCALE)
    return scheduler.get_last_lr()[0]


def test_ex02_autograd_function():
    assert ex02.check_autograd_function(ex02.reference_function("cpu"), "cpu")
    hints = ex02.HINTS["function"]
    assert_unanswered(ex02.check_autograd_function(None, "cpu"), hints)
    assert_wrong(ex02.check_autograd_function(ex02.undecorated_function(), "cpu"),
                 "ran outside autocast", "decorator pair", hints=hints)


def test_ex04_channels_last():
    assert ex04.check_channels_last(ex04.reference_channels_last)
    hints = ex04.HINTS["layout"]
    assert_unanswered(ex04.check_channels_last(lambda model, x: None), hints)
    assert_wrong(ex04.check_channels_last(lambda m, x: (m, x)), "NCHW", hints=hints)
    assert_wrong(ex04.check_channels_last(
        lambda m, x: (m.to(memory_format=torch.channels_last), x)), "input", hints=hints)


def test_ex05_accumulation():
    assert ex05.check_accumulation(ex05.reference_accumulate)
    hints = ex05.HINTS["accumulate"]
    assert_unanswered(ex05.check_accumulation(lambda model, x, y, n: None), hints)
    assert_wrong(ex05.check_accumulation(ex05.WRONG_ACCUMULATE["loss not divided"]), "4.00x",
                 hints=hints)
    assert_wrong(ex05.check_accumulation(ex05.WRONG_ACCUMULATE["gradients zeroed per micro-batch"]),
                 "zeroed", hints=hints)


def test_ex05_accumulation_names_a_mistake_from_all_the_gradients():
    # Splitting with x.split(n) (slices of n samples) instead of x.chunk(n) (n slices), each
    # loss divided by n: twice the right gradients. The first parameter's ratio alone is not
    # n, so the last branch blamed zeroing the gradients, which this loop never does.
    import torch.nn.functional as F
    hints = ex05.HINTS["accumulate"]

    def split_not_chunk(model, x, y, micro_batches):
        for xs, ys in zip(x.split(micro_batches), y.split(micro_batches)):
            (F.cross_entropy(model(xs), ys) / micro_batches).backward()
    check = ex05.check_accumulation(split_not_chunk)
    assert_wrong(check, "2.00x", "x.split(n)", hints=hints)
    assert "zeroed" not in repr(check)

    def last_half_only(model, x, y, micro_batches):  # neither a size nor a known mistake
        half = len(x) // 2
        F.cross_entropy(model(x[half:]), y[half:]).backward()
    other = ex05.check_accumulation(last_half_only)
    assert other.status == "wrong" and "in direction" in other.message, other
    assert "zeroed" not in repr(other) and other.hints == hints.levels


def test_ex05_checkpointing():
    assert ex05.check_checkpointing(ex05.reference_checkpointed_forward)
    hints = ex05.HINTS["checkpoint"]
    assert_unanswered(ex05.check_checkpointing(lambda blocks, x: None), hints)

    def plain(blocks, x):
        for b in blocks:
            x = b(x)
        return x
    assert_wrong(ex05.check_checkpointing(plain), "nothing was checkpointed", hints=hints)

    def reentrant(blocks, x):
        for b in blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True)
        return x
    with pytest.warns(UserWarning):
        assert_wrong(ex05.check_checkpointing(reentrant), "use_reentrant=False", hints=hints)


def test_ex05_resume_keeps_the_scaler():
    assert ex05.check_resume(ex05.reference_save, ex05.reference_load)
    hints = ex05.HINTS["resume"]
    assert_unanswered(ex05.check_resume(lambda m, o, s: None, lambda *a: None), hints)
    for save, load in ex05.WRONG_RESUME.values():
        assert_wrong(ex05.check_resume(save, load), "scaler.state_dict()", hints=hints)

    def load_no_optimizer(state, model, optimizer, scaler):
        model.load_state_dict(state["model"])
        scaler.load_state_dict(state["scaler"])
    assert_wrong(ex05.check_resume(ex05.reference_save, load_no_optimizer),
                 "optimizer.state_dict()", hints=hints)


def test_ex05_resume_names_every_piece_that_did_not_come_back():
    # Saving the model only loses the optimizer's momentum and the scaler's state; the loss
    # scale differs first, so the check named the scaler alone (the other mistake's hint).
    hints = ex05.HINTS["resume"]
    model_only = ex05.check_resume(*ex05.WRONG_RESUME["model only"])
    assert_wrong(model_only, "scaler.state_dict()", "optimizer.state_dict()", hints=hints)
    no_scaler = ex05.check_resume(*ex05.WRONG_RESUME["no scaler state"])
    assert_wrong(no_scaler, "scaler.state_dict()", hints=hints)
    assert "optimizer.state_dict()" not in repr(no_scaler)

    def load_no_model(state, model, optimizer, scaler):  # the weights stay the fresh ones
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    no_model = ex05.check_resume(ex05.reference_save, load_no_model)
    assert_wrong(no_model, "model.state_dict()", hints=hints)
    assert "optimizer.state_dict()" not in no_model.hint


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


def test_channels_last_odd_returns_get_messages():
    cl = torch.channels_last
    cases = {"swapped": (lambda m, x: (x.contiguous(memory_format=cl), m.to(memory_format=cl)),
                         "swapped"),
             "x None": (lambda m, x: (m.to(memory_format=cl), None), "a module and a tensor"),
             "half": (lambda m, x: (m.to(memory_format=cl).half(), x.to(memory_format=cl).half()),
                      "expected torch.float32"),
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


# --- lesson 04: predictions graded against the grader's own measurements -------------------------
MEASURED = {"params": 46_758_048, "grads": 46_758_048, "optimizer state": 93_516_096}
COPIES = 23_434_624  # ResNet-18's, as measured on a CPU


@pytest.fixture
def measured_04(monkeypatch):
    """Lesson 04's graders with their measurements replaced by ResNet-18's figures: the grading
    logic alone, in milliseconds."""
    monkeypatch.setattr(ex04, "measure_state_bytes", lambda model, device=None: dict(MEASURED))
    monkeypatch.setattr(ex04, "measure_weight_copies", lambda model, device=None: COPIES)


def test_ex04_the_measurements_agree_with_the_reference_on_this_device():
    # the lesson's quick model, measured as the check measures it: 4 + 4 + 8 bytes per parameter
    # after an AMP step with AdamW, and 2 bytes per weight value of autocast's copies
    model = al.models.resnet18()
    assert ex04.measure_state_bytes("resnet18", "cpu") == ex04.reference_state_bytes(model)
    copies, want = ex04.measure_weight_copies("resnet18", "cpu"), ex04.reference_weight_copies(model)
    assert abs(copies / want - 1) < 0.01  # BatchNorm's per-channel statistics: the rest
    with pytest.raises(ValueError, match="model must be one of"):
        ex04.measure_state_bytes("vgg16")


def test_ex04_state_bytes(measured_04):
    state = ex04.HINTS["state"]
    assert ex04.check_state_bytes(dict(MEASURED))
    assert_unanswered(ex04.check_state_bytes(dict.fromkeys(ex04.KEYS)), state)
    assert_wrong(ex04.check_state_bytes({k: v / 2 for k, v in MEASURED.items()}),
                 "autocast does not store the weights in 16 bits", hints=state)
    assert_wrong(ex04.check_state_bytes({k: v / 2 ** 30 for k, v in MEASURED.items()}), "GiB",
                 hints=state)
    grads16 = ex04.check_state_bytes({**MEASURED, "grads": MEASURED["grads"] / 2})
    assert_wrong(grads16, "grads:", "gradient takes its parameter's dtype", hints=state)
    sgd = ex04.check_state_bytes({**MEASURED, "optimizer state": MEASURED["params"]})
    assert_wrong(sgd, "optimizer state", "SGD's momentum", hints=state)
    neg = ex04.check_state_bytes({**MEASURED, "params": -MEASURED["params"]})
    assert neg.status == "wrong" and "more than 0" in neg.message
    per = ex04.check_state_bytes({"params": 4, "grads": 4, "optimizer state": 8})
    assert per.status == "wrong" and "size of one value" in per.hint
    counted = ex04.check_state_bytes({k: v / 4 for k, v in MEASURED.items()})
    assert "count of values" in counted.hint


def test_ex04_weight_copies(measured_04):
    copies = ex04.HINTS["copies"]
    n = 11_678_912  # ResNet-18's convolution and Linear weights: 2 bytes each
    assert ex04.check_weight_copies(2 * n) and ex04.check_weight_copies(2 * 11_689_512)
    assert_unanswered(ex04.check_weight_copies(None), copies)
    assert_wrong(ex04.check_weight_copies(4 * n), "twice the copies", hints=copies)
    assert_wrong(ex04.check_weight_copies(0), "autocast does keep copies", hints=copies)
    assert_wrong(ex04.check_weight_copies(n), "count of values", hints=copies)
    gib = ex04.check_weight_copies(COPIES / 2 ** 30)
    assert_wrong(gib, "GiB", hints=copies)
    assert "0.02183 bytes" in gib.message
    ok = ex04.check_weight_copies(COPIES)
    assert "whatever the batch" in ok.message and "quick profile" in ok.message


def test_ex05_says_how_much_a_partly_checkpointed_answer_saved():
    def every_other(blocks, x):
        for i, b in enumerate(blocks):
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if i % 2 == 0 \
                else b(x)
        return x
    text = repr(ex05.check_checkpointing(every_other, device="cpu"))
    assert "wrong" in text and "nothing was checkpointed" not in text
    assert "only part of the forward was checkpointed" in text and "% of what the plain" in text
