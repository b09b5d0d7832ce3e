"""The capstone's graders (amp_lessons.exercises.capstone): the reference setup passes every part
on a CPU, the notebook's stubs are "not answered yet", each typical mistake of a mixed-precision
setup is named (clipping before unscale_, a schedule that steps on a skipped step, a resume
without the scaler, a precision the advice does not lead to), answers on the meta device get a
message, and part 4 decides on a GPU only."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from amp_lessons.exercises import capstone
from amp_lessons.exercises.check import graded
from exercise_helpers import assert_unanswered, assert_wrong, fresh_attempts  # noqa: F401


def _step(clip_first=False, schedule_always=False, half_model=False, meta_loss=False):
    """The reference step with one mistake put in."""
    def step(model, optimizer, scaler, scheduler, x, y, precision):
        if half_model:
            model.half()
        dtype = capstone.HALF[precision]
        with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)), y)
        scaler.scale(loss).backward()
        if clip_first:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.unscale_(optimizer)
        if not clip_first:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if schedule_always or scaler.get_scale() >= scale:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().to("meta") if meta_loss else loss.detach()
    return step


def test_the_model_and_its_data():
    model = capstone.unet(8)
    noisy, clean = capstone.denoising_batches(1, 2, 16)[0]
    assert model(noisy).shape == clean.shape == (2, 3, 16, 16)
    again = capstone.denoising_batches(1, 2, 16)[0]
    assert torch.equal(again[0], noisy)  # seeded
    with pytest.raises(ValueError, match="width must be"):
        capstone.TinyUNet(3)
    with pytest.raises(ValueError, match="size must be"):
        capstone.denoising_batches(1, 2, 15)


def test_part1_the_precision_from_the_advice():
    hints = capstone.HINTS["choose"]
    assert capstone.check_precision_choice(capstone.reference_choose_precision)
    assert_unanswered(capstone.check_precision_choice(lambda report: None), hints)
    assert_wrong(capstone.check_precision_choice(lambda report: "bf16"), "not what the advice",
                 hints=hints)
    assert_wrong(capstone.check_precision_choice(
        lambda r: "fp16" if r.advice["fp16_safe"] else "bf16"), "stay in fp32", hints=hints)
    odd = capstone.check_precision_choice(lambda report: "half")
    assert odd.status == "wrong" and "return one of" in odd.message

    def changes_the_report(report):
        report.advice["precision"] = "fp16"
        return "fp16"
    cases = capstone.advice_reports()
    capstone.check_precision_choice(changes_the_report, cases)
    assert cases[1].advice["precision"] == "bf16"  # the learner got a copy


def test_part2_the_reference_step_passes_and_each_mistake_is_named():
    hints = capstone.HINTS["train"]
    make = capstone.reference_make_state
    assert capstone.check_training(make, capstone.reference_train_step)
    assert_unanswered(capstone.check_training(lambda m, p: None, capstone.reference_train_step),
                      hints)
    assert_unanswered(capstone.check_training(make, lambda *a: None), hints)
    assert_wrong(capstone.check_training(make, _step(clip_first=True)), "clipping saw",
                 "unscale_(optimizer) before clip_grad_norm_", hints=hints)
    assert_wrong(capstone.check_training(make, _step(schedule_always=True)),
                 "the schedule advanced", "did not drop", hints=hints)
    meta = capstone.check_training(make, _step(meta_loss=True))
    assert meta.status == "wrong" and "meta device" in meta.message, meta


def test_part2_clipping_must_happen_and_the_precision_must_be_used():
    hints = capstone.HINTS["train"]

    def no_clip(model, optimizer, scaler, scheduler, x, y, precision):
        dtype = capstone.HALF[precision]
        with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss.detach()
    assert_wrong(capstone.check_training(capstone.reference_make_state, no_clip), "no clipping",
                 hints=hints)

    def fp32_always(model, optimizer, scaler, scheduler, x, y, precision):
        return capstone.reference_train_step(model, optimizer, scaler, scheduler, x, y, "fp32")
    check = capstone.check_training(capstone.reference_make_state, fp32_always)
    assert check.status == "wrong", check


def test_part3_resume_bit_for_bit():
    hints = capstone.HINTS["resume"]
    make, step = capstone.reference_make_state, capstone.reference_train_step
    assert capstone.check_resume(make, step, capstone.reference_save, capstone.reference_load)
    assert_unanswered(capstone.check_resume(make, step, lambda *a: None, lambda *a: None), hints)
    skipped = capstone.check_resume(lambda m, p: None, lambda *a: None, capstone.reference_save,
                                    capstone.reference_load)
    assert skipped.status == "skipped" and "part 2" in skipped.message

    def save_no_scaler(model, optimizer, scaler, scheduler):
        state = capstone.reference_save(model, optimizer, scaler, scheduler)
        del state["scaler"]
        return state

    def load_no_scaler(state, model, optimizer, scaler, scheduler):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    assert_wrong(capstone.check_resume(make, step, save_no_scaler, load_no_scaler),
                 "scaler", "scaler.state_dict()", hints=hints)

    def load_no_scheduler(state, model, optimizer, scaler, scheduler):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    assert_wrong(capstone.check_resume(make, step, capstone.reference_save, load_no_scheduler),
                 "scheduler", "scheduler.state_dict()", hints=hints)


def test_part4_is_not_decided_on_a_cpu_but_the_function_is_run():
    calls = []

    def fake(precision, device):
        calls.append(precision)
        return {"step_ms": 10.0 if precision == "fp32" else 5.0, "peak_bytes": None}
    check = capstone.check_speed_memory(fake, "bf16", "cpu")
    assert check.status == "skipped" and "not decided here" in check.message
    assert "2.00x" in check.message and calls == ["fp32", "bf16"]
    assert_unanswered(capstone.check_speed_memory(lambda p, d: None, "bf16", "cpu"),
                      capstone.HINTS["speed"])
    bad = capstone.check_speed_memory(lambda p, d: {"step_ms": -1, "peak_bytes": None}, "bf16",
                                      "cpu")
    assert bad.status == "wrong" and "above 0" in bad.message
    meta = capstone.check_speed_memory(
        lambda p, d: {"step_ms": torch.tensor(1.0, device="meta"), "peak_bytes": None},
        "bf16", "cpu")
    assert meta.status == "wrong" and "meta device" in meta.message
    with pytest.raises(ValueError, match="precision must be one of"):
        capstone.check_speed_memory(fake, "fp8", "cpu")


def test_part4_on_a_gpu_compares_the_ratios_with_the_graders():
    theirs = {"fp32": {"step_ms": 10.0, "peak_bytes": 1000}, "bf16": {"step_ms": 4.0,
                                                                      "peak_bytes": 600}}
    close = {"fp32": {"step_ms": 11.0, "peak_bytes": 1010}, "bf16": {"step_ms": 4.2,
                                                                     "peak_bytes": 620}}
    ok = capstone.grade_measurements(close, theirs, "bf16")
    assert ok and "2.62x fp32's speed" in ok.message
    slow = {**close, "bf16": {"step_ms": 11.0, "peak_bytes": 620}}
    assert_wrong(capstone.grade_measurements(slow, theirs, "bf16"), "speed ratio",
                 hints=capstone.HINTS["speed"])
    heavy = {**close, "bf16": {"step_ms": 4.2, "peak_bytes": 1010}}
    assert_wrong(capstone.grade_measurements(heavy, theirs, "bf16"), "memory ratio",
                 hints=capstone.HINTS["speed"])
    none = {**close, "bf16": {"step_ms": 4.2, "peak_bytes": None}}
    assert capstone.grade_measurements(none, theirs, "bf16").status == "wrong"


def test_the_reference_measurement_runs_on_a_cpu():
    got = capstone.reference_measure("bf16", "cpu", **capstone.QUICK_SIZES)
    assert got["step_ms"] > 0 and got["peak_bytes"] is None


def test_every_capstone_check_counts_attempts_and_the_summary_reads_them():
    for name in ("check_precision_choice", "check_training", "check_resume",
                 "check_speed_memory"):
        assert getattr(getattr(capstone, name), "graded", False), name
    parts = [capstone.check_precision_choice(capstone.reference_choose_precision),
             capstone.check_speed_memory(lambda p, d: None, "bf16", "cpu")]
    text = capstone.summary(parts)
    assert "1 of 2 gradable parts passed here" in text and "not answered yet" in text
    with pytest.raises(ValueError, match="checks must be"):
        capstone.summary([])
