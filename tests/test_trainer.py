"""amp_lessons.train.trainer: the loop against PyTorch's AMP examples, skipped steps, the non-finite
policy, settings, hooks and fit. (Checkpoints: test_checkpoint.py; records: test_records.py.)

The reference loops below are written the way https://pytorch.org/docs/stable/notes/amp_examples.html
writes them ("Typical Mixed Precision Training", "Gradient clipping", "Gradient accumulation"),
with the CPU as the device (fp16 autocast + GradScaler("cpu") and bf16 autocast run there).
"""
import copy
import dataclasses
import json
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.numerics import precision as P
from amp_lessons.train import records as R
from amp_lessons.train import trainer as T
from amp_lessons.data import TensorBatches
from trainer_helpers import (Inject, TinyNet, assert_same_tensors, batches, fresh, make_data,
                             optimizer_tensors)


# --- precision helpers ---------------------------------------------------------------------------

@pytest.mark.parametrize("given,expected", [("fp32", "fp32"), ("TF32", "tf32"), ("amp", "fp16"),
                                            (" AMP ", "fp16"), ("bf16", "bf16")])
def test_normalize_precision(given, expected):
    assert P.normalize_precision(given) == expected


@pytest.mark.parametrize("bad", ["fp8", "", "half", None, 16])
def test_unknown_precision_names_the_setting_and_choices(bad):
    with pytest.raises(ValueError, match=r"precision must be one of fp32, tf32, fp16.*bf16"):
        P.check_precision(bad, "cpu")


def test_check_precision_on_cpu():
    assert [P.check_precision(p, "cpu") for p in ("fp32", "tf32", "amp", "bf16")] == \
        ["fp32", "tf32", "fp16", "bf16"]


def test_fp16_where_it_cannot_run_is_a_value_error(monkeypatch):
    monkeypatch.setattr(P, "_fp16_problem", lambda device_type: "no float16 autocast here")
    with pytest.raises(ValueError, match="precision 'fp16' cannot run on cpu: no float16"):
        P.check_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="precision 'fp16'"):
        T.Trainer(*fresh(), T.TrainConfig(precision="fp16"))


def test_cuda_device_without_cuda_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device must be an available device"):
        P.check_precision("fp32", "cuda")


def test_bf16_on_a_gpu_without_native_bf16_says_why(monkeypatch):
    """A T4 (capability 7.5): torch only emulates bf16, so the trainer refuses it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"'bf16' needs a GPU with native bfloat16.*Tesla T4 "
                                         r"has 7\.5.*Use fp16"):
        P.check_precision("bf16", "cuda")


def test_autocast_for():
    assert isinstance(P.autocast_for("fp32", "cpu"), type(P.autocast_for("tf32", "cpu")))
    for name, dtype in (("fp16", torch.float16), ("amp", torch.float16), ("bf16", torch.bfloat16)):
        with P.autocast_for(name, "cpu"):
            out = torch.ones(2, 2) @ torch.ones(2, 2)
        assert out.dtype == dtype
    with P.autocast_for("fp32", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_precision_settings_switch_tf32_and_restore_without_warnings():
    before = P._get_tf32()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with P.precision_settings("fp32"):
            assert P._get_tf32() == P._tf32_target(False)
            with P.precision_settings("tf32"):
                assert P._get_tf32() == P._tf32_target(True)
            assert P._get_tf32() == P._tf32_target(False)
        assert P._get_tf32() == before
        with P.precision_settings("fp16"):
            assert P._get_tf32() == before
        with pytest.raises(RuntimeError):
            with P.precision_settings("tf32"):
                raise RuntimeError("boom")
        assert P._get_tf32() == before


def test_tf32_uses_the_new_switches_where_torch_has_them():
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert P._tf32_target(True) == ("new", "tf32", "tf32")
        assert P._tf32_target(False) == ("new", "ieee", "ieee")


# --- settings validation -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(init_scale=0), r"init_scale must be a finite number > 0"),
    (dict(init_scale=-1.0), r"init_scale must be a finite number > 0"),
    (dict(init_scale=float("inf")), r"init_scale must be a finite number > 0"),
    (dict(growth_factor=1.0), r"growth_factor must be a finite number in \(1, 1.70141e\+38\]"),
    (dict(growth_factor=0.5), r"growth_factor must be a finite number in \(1, "),
    (dict(growth_factor=1e308), r"growth_factor must be a finite number in \(1, .*; got 1e\+308"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in the open interval \(0, 1\)"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in the open interval \(0, 1\)"),
    (dict(backoff_factor=1.5), r"backoff_factor must be in the open interval \(0, 1\)"),
    (dict(growth_interval=0), r"growth_interval must be a whole number >= 1"),
    (dict(growth_interval=2.5), r"growth_interval must be a whole number >= 1"),
    (dict(growth_interval=True), r"growth_interval must be a whole number >= 1"),
    (dict(enabled="yes"), r"enabled must be True or False"),
])
def test_bad_scaler_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        T.ScalerSettings(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(precision="fp64"), r"precision must be one of"),
    (dict(scaler={"init_scale": 1}), r"scaler must be a ScalerSettings"),
    (dict(clip_norm=0), r"clip_norm must be None or a finite number > 0"),
    (dict(clip_norm=float("nan")), r"clip_norm must be None or a finite number > 0"),
    (dict(clip_value=-1), r"clip_value must be None or a finite number > 0"),
    (dict(clip_norm=1.0, clip_value=1.0), r"clip_norm and clip_value: set at most one"),
    (dict(accumulate=0), r"accumulate must be a whole number >= 1"),
    (dict(accumulate=1.5), r"accumulate must be a whole number >= 1"),
    (dict(eval_precision="fp64"), r"eval_precision must be one of same, fp32, tf32, fp16, bf16"),
    (dict(skip_safe_batchnorm=1), r"skip_safe_batchnorm must be True or False"),
    (dict(channels_last="no"), r"channels_last must be True or False"),
    (dict(progress=None), r"progress must be True or False"),
    (dict(seed=-1), r"seed must be None or a whole number >= 0"),
])
def test_bad_train_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        T.TrainConfig(**kwargs)


def test_train_config_normalises_names():
    cfg = T.TrainConfig(precision="AMP", eval_precision="FP32")
    assert (cfg.precision, cfg.eval_precision) == ("fp16", "fp32")
    assert json.dumps(cfg.as_dict())  # plain data


def test_scaler_settings_make_and_apply():
    s = T.ScalerSettings(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25,
                         growth_interval=7)
    scaler = s.make("cpu")
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (1024.0, 3.0, 0.25, 7)
    scaler.scale(torch.ones(()))  # creates the scale tensor
    T.ScalerSettings(init_scale=64.0, growth_factor=1.5, backoff_factor=0.4,
                     growth_interval=3).apply_to(scaler)
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (64.0, 1.5, 0.4, 3)
    with pytest.raises(ValueError, match="enabled cannot change on a live GradScaler"):
        T.ScalerSettings(enabled=False).apply_to(scaler)


def test_lowering_growth_interval_mid_run_does_not_stall_growth():
    """torch grows when good steps == interval; a lowered interval must not be skipped past."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = T.ScalerSettings(init_scale=8.0, growth_interval=100).make("cpu")

    def good_step():
        scaler.scale(p.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    for _ in range(3):
        good_step()
    T.ScalerSettings(init_scale=8.0, growth_interval=2).apply_to(scaler)
    good_step()
    assert scaler.get_scale() == 16.0  # grew at the next good step
    good_step()
    good_step()
    assert scaler.get_scale() == 32.0  # and then every 2 good steps


def test_trainer_rejects_bad_arguments():
    model, opt = fresh()
    with pytest.raises(ValueError, match="config must be a TrainConfig"):
        T.Trainer(model, opt, config={"precision": "fp32"})
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        T.Trainer(model, "sgd")
    with pytest.raises(ValueError, match="hooks must be a list of Hooks instances"):
        T.Trainer(model, opt, hooks=[object()])
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False))
    with pytest.raises(ValueError, match="micro_batches must hold at least one"):
        trainer.train_step([])
    with pytest.raises(ValueError, match="epochs must be a whole number >= 1"):
        trainer.fit(batches(), epochs=0)
    with pytest.raises(ValueError, match="max_steps must be None or a whole number >= 1"):
        trainer.fit(batches(), max_steps=0)
    with pytest.raises(ValueError, match="precision must be None or one of"):
        trainer.evaluate(batches(), precision=3)


def test_half_model_is_refused_under_fp16_amp():
    model, _ = fresh()
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"parameters must stay float32.*\.half\(\)"):
        T.Trainer(model, opt, T.TrainConfig(precision="fp16"))


# --- against the reference loops -----------------------------------------------------------------

def reference_clipping(precision, steps, max_norm):
    """PyTorch's "Gradient clipping" example, verbatim apart from device and dtype."""
    model, optimizer = fresh()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    for input, target in steps:
        optimizer.zero_grad()
        with torch.autocast(device_type="cpu", dtype=dtype, enabled=precision != "fp32"):
            output = model(input)
            loss = F.cross_entropy(output, target)
        scaler.scale(loss).backward()
        # Unscales the gradients of optimizer's assigned params in-place
        scaler.unscale_(optimizer)
        # Since the gradients of optimizer's assigned params are unscaled, clips as usual:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
    return model, optimizer, scaler


def reference_accumulation(precision, data, iters_to_accumulate):
    """PyTorch's "Gradient accumulation" example, verbatim apart from device and dtype."""
    model, optimizer = fresh()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    for i, (input, target) in enumerate(data):
        with torch.autocast(device_type="cpu", dtype=dtype, enabled=precision != "fp32"):
            output = model(input)
            loss = F.cross_entropy(output, target)
            loss = loss / iters_to_accumulate
        scaler.scale(loss).backward()
        if (i + 1) % iters_to_accumulate == 0:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return model, optimizer, scaler


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_matches_reference_with_clipping(precision):
    data = batches(6)
    ref_model, ref_opt, ref_scaler = reference_clipping(precision, data, max_norm=0.5)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision=precision, clip_norm=0.5,
                                                  progress=False, seed=None))
    for b in data:
        trainer.train_step([b])
    assert_same_tensors(model.state_dict(), ref_model.state_dict())
    assert_same_tensors(optimizer_tensors(opt), optimizer_tensors(ref_opt))
    assert trainer.scaler.get_scale() == ref_scaler.get_scale()
    # the clipped run really clipped: recorded norms are the pre-clip ones, some above 0.5
    assert max(trainer.history.columns()["grad_norm"]) > 0.5


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_matches_reference_with_accumulation(precision):
    data = batches(6)
    ref_model, ref_opt, ref_scaler = reference_accumulation(precision, data, 3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision=precision, accumulate=3,
                                                  progress=False, seed=None))
    trainer.fit(data, epochs=1)
    assert trainer.step == 2 and len(trainer.history) == 2
    assert_same_tensors(model.state_dict(), ref_model.state_dict())
    assert_same_tensors(optimizer_tensors(opt), optimizer_tensors(ref_opt))
    assert trainer.scaler.get_scale() == ref_scaler.get_scale()


def test_fp16_reference_loop_without_clipping():
    """The "Typical Mixed Precision Training" example: no explicit unscale_ there, same result."""
    data = batches(5)
    ref_model, ref_opt = fresh()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=2)
    for input, target in data:
        ref_opt.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            output = ref_model(input)
            loss = F.cross_entropy(output, target)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
    runs = {}
    for guard in (False, True):
        model, opt = fresh()
        cfg = T.TrainConfig(precision="fp16", progress=False, seed=None, skip_safe_batchnorm=guard,
                            scaler=T.ScalerSettings(init_scale=2.0 ** 20, growth_interval=2))
        trainer = T.Trainer(model, opt, cfg)
        for b in data:
            trainer.train_step([b])
        assert trainer.scaler.get_scale() == scaler.get_scale()
        runs[guard] = (model, trainer)
    # torch's own behaviour, bitwise, once the skip-safe BatchNorm is switched off
    assert_same_tensors(runs[False][0].state_dict(), ref_model.state_dict())
    # with it (the default) the weights are the same; only BN statistics of skipped steps differ
    guarded, trainer = runs[True]
    assert_same_tensors(dict(guarded.named_parameters()), dict(ref_model.named_parameters()))
    assert trainer.history.skipped_steps >= 1
    assert guarded.bn.num_batches_tracked == 5 - trainer.history.skipped_steps
    assert ref_model.bn.num_batches_tracked == 5
    scales = trainer.history.columns()["scale"]
    assert scales[0] == 2.0 ** 20 and len(set(scales)) > 1  # the scale moved during the run


def test_the_defaults_match_the_typical_example_and_still_detect_skips():
    """No clipping, no norm, no hook reading gradients: scaler.step unscales, as in the
    example; a step with an inf gradient is skipped as GradScaler skips it."""
    data = batches(4)
    ref_model, ref_opt = fresh()
    scaler = torch.amp.GradScaler("cpu")
    for i, (input, target) in enumerate(data):
        ref_opt.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = F.cross_entropy(ref_model(input), target)
        scaler.scale(loss).backward()
        if i == 2:
            ref_model.conv.weight.grad[0, 0, 0, 0] = float("inf")
        scaler.step(ref_opt)
        scaler.update()
    model, opt = fresh()
    cfg = T.TrainConfig(precision="fp16", progress=False, seed=None, skip_safe_batchnorm=False)
    trainer = T.Trainer(model, opt, cfg, hooks=[Inject({2})])
    for b in data:
        trainer.train_step([b])
    assert_same_tensors(model.state_dict(), ref_model.state_dict())
    cols = trainer.history.columns()
    assert cols["skipped"] == [False, False, True, False] and cols["grad_norm"] == [None] * 4
    assert cols["scale"] == [65536.0, 65536.0, 65536.0, 32768.0]


class _Block(nn.Module):
    """A pre-norm transformer block over 8 tokens of 16 features, then a 10-class head."""

    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.block(x.reshape(-1, 4, 16)).mean(1))


NETWORKS = {"conv + BatchNorm": TinyNet,
            "MLP": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.GELU(),
                                         nn.Linear(32, 10)),
            "transformer block": _Block}
OPTIMIZERS = {"SGD momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
              "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
              "fused AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)}


@pytest.mark.parametrize("network", list(NETWORKS))
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("optimizer,clip", [("SGD momentum", None), ("AdamW", 0.5),
                                            ("fused AdamW", None)])
def test_each_step_equals_the_amp_examples_on_several_networks(network, precision, optimizer,
                                                               clip):
    """Step by step, bitwise: weights, buffers, optimizer state and loss scale after every step
    equal PyTorch's "Typical Mixed Precision Training" example (with "Gradient clipping" where
    ``clip`` is set), for three kinds of network, three precisions and three optimizers. The
    first step overflows fp16's initial scale on some of them: skipped steps must match too."""
    torch.manual_seed(0)
    ref = NETWORKS[network]()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS[optimizer](ref.parameters()), OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision=precision, clip_norm=clip,
                                                  skip_safe_batchnorm=False, nonfinite="ignore",
                                                  progress=False, seed=None))
    for input, target in batches(4):
        ref_opt.zero_grad()
        with torch.autocast(device_type="cpu", dtype=dtype, enabled=precision != "fp32"):
            loss = F.cross_entropy(ref(input), target)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        scaler.step(ref_opt)
        scaler.update()
        record = trainer.train_step([(input, target)])
        assert record.loss == loss.item()
        assert_same_tensors(model.state_dict(), ref.state_dict())
        assert_same_tensors(optimizer_tensors(opt), optimizer_tensors(ref_opt))
        assert trainer.scaler.get_scale() == scaler.get_scale()


def test_clip_by_value_after_unscale():
    data = batches(3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", clip_value=1e-3,
                                                  progress=False))

    grads = []

    class Capture(T.Hooks):
        def after_unscale(self, trainer):
            grads.append(trainer.model.fc.weight.grad.clone())

    trainer = T.Trainer(model, opt, trainer.config, hooks=[Capture()])
    # capture after the trainer's clipping too: wrap the optimizer step
    stepped = []
    original = opt.step

    def step(*args, **kwargs):
        stepped.append(model.fc.weight.grad.abs().max().item())
        return original(*args, **kwargs)

    opt.step = step
    for b in data:
        trainer.train_step([b])
    assert all(g.abs().max() > 1e-3 for g in grads)  # true gradients exceed the bound
    bound = torch.tensor(1e-3).item()  # 1e-3 as float32
    assert stepped and all(v <= bound for v in stepped)  # clipped ones do not


# --- skipped steps -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_skipped_step_leaves_the_model_exactly_as_it_was(value):
    data = batches(3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False,
                                                  track_grad_norm=True),
                        hooks=[Inject({2}, value)])
    trainer.train_step([data[0]])
    trainer.train_step([data[1]])
    params = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer_tensors(opt))
    scale = trainer.scaler.get_scale()
    record = trainer.train_step([data[2]])
    assert record.skipped is True and record.scale == scale
    assert math.isnan(record.grad_norm) or math.isinf(record.grad_norm)
    assert trainer.scaler.get_scale() == scale * 0.5  # backed off
    assert_same_tensors(model.state_dict(), params)  # weights AND BatchNorm buffers
    assert_same_tensors(optimizer_tensors(opt), state)
    assert trainer.history.skipped_steps == 1 and trainer.history.skipped_step_numbers == [2]
    assert [r.skipped for r in trainer.history] == [False, False, True]


def test_without_skip_safe_batchnorm_a_skipped_step_moves_the_running_stats():
    """The control: the guard above is what keeps BN still (this is what torch does alone)."""
    data = batches(2)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False,
                                                  skip_safe_batchnorm=False),
                        hooks=[Inject({1})])
    trainer.train_step([data[0]])
    before = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    weights = model.conv.weight.detach().clone()
    assert trainer.train_step([data[1]]).skipped
    assert torch.equal(model.conv.weight, weights)  # the optimizer did skip
    assert not torch.equal(model.bn.running_mean, before[0])
    assert model.bn.num_batches_tracked == before[1] + 1


def test_skip_with_accumulation_restores_every_micro_batch_update():
    data = batches(4)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", accumulate=2, progress=False),
                        hooks=[Inject({1})])
    trainer.train_step(data[:2])
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    assert trainer.train_step(data[2:]).skipped
    assert_same_tensors(dict(model.named_buffers()), buffers)


# --- scheduler -----------------------------------------------------------------------------------

def test_scheduler_steps_only_when_the_optimizer_stepped():
    data = batches(3)
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        scheduler=sched, hooks=[Inject({0})])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        first = trainer.train_step([data[0]])
        assert first.skipped and sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1
        second = trainer.train_step([data[1]])
        assert not second.skipped and sched.last_epoch == 1
        assert second.lr == 0.1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
        third = trainer.train_step([data[2]])
        assert third.lr == pytest.approx(0.05)


def test_naive_loop_does_warn():
    """The control for the test above: stepping the scheduler after a skipped step warns."""
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    model.conv.weight.grad[0, 0, 0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()


# --- hooks, fit, evaluate ------------------------------------------------------------------------

def test_hooks_are_called_in_order_with_scaled_then_true_gradients():
    calls = []

    class Log(T.Hooks):
        def after_backward(self, trainer, micro_step):
            calls.append(("backward", micro_step, trainer.model.fc.bias.grad.abs().sum().item()))

        def after_unscale(self, trainer):
            calls.append(("unscale", None, trainer.model.fc.bias.grad.abs().sum().item()))

        def after_step(self, trainer, record):
            calls.append(("step", record.step, record.scale))

    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", accumulate=2, progress=False),
                        hooks=[Log()])
    trainer.train_step(batches(2))
    assert [c[0] for c in calls] == ["backward", "backward", "unscale", "step"]
    assert calls[1][2] / calls[2][2] == pytest.approx(65536.0, rel=1e-4)  # scaled, then true
    assert calls[3] == ("step", 0, 65536.0)


def test_fit_groups_micro_batches_and_summarises_epochs():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(accumulate=4, progress=False))
    x, y = make_data(160)
    loader = TensorBatches(x, y, batch_size=16)  # 10 batches -> steps of 4, 4, 2
    trainer.fit(loader, epochs=2, eval_loader=TensorBatches(x, y, 32, shuffle=False))
    assert trainer.step == 6 and trainer.epoch == 2
    assert [e["steps"] for e in trainer.history.epochs] == [3, 3]
    assert [e["partial"] for e in trainer.history.epochs] == [False, False]
    assert [r.epoch for r in trainer.history] == [0, 0, 0, 1, 1, 1]
    assert 0 <= trainer.history.epochs[-1]["test_accuracy"] <= 1
    assert loader.epoch == 1  # set_epoch was called


def test_fit_max_steps_then_continue_covers_the_epoch_once():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False))
    data = batches(5)
    trainer.fit(data, epochs=1, max_steps=2)
    assert trainer.step == 2 and trainer.epoch == 0 and trainer._batches_done == 2
    trainer.fit(data, epochs=1)
    assert trainer.step == 5 and trainer.epoch == 1 and trainer.history.epochs[0]["steps"] == 3
    # the summary says it covers only the part of the epoch run by the second call
    assert trainer.history.epochs[0]["partial"] is True
    assert trainer.history.epochs[0]["resumed_at_batch"] == 2


def test_evaluate_precision_choice_and_mode_restore():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="bf16", progress=False))
    data = batches(2)
    model.train()
    same = trainer.evaluate(data)
    full = trainer.evaluate(data, precision="fp32")
    assert model.training
    assert same["precision"] == "bf16" and full["precision"] == "fp32"
    assert same["examples"] == full["examples"] == 32
    assert 0 <= same["accuracy"] <= 1 and same["loss"] != full["loss"]
    with pytest.raises(ValueError, match="loader must yield at least one batch"):
        trainer.evaluate([])


def test_channels_last_model_and_inputs():
    model, opt = fresh()
    seen = []
    model.conv.register_forward_hook(lambda m, i, o: seen.append(
        i[0].is_contiguous(memory_format=torch.channels_last)))
    trainer = T.Trainer(model, opt, T.TrainConfig(channels_last=True, progress=False))
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    trainer.train_step([batches(1)[0]])
    assert seen == [True]


def test_set_scaler_mid_run():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    trainer.train_step([batches(1)[0]])
    trainer.set_scaler(T.ScalerSettings(init_scale=256.0, growth_factor=4.0, growth_interval=1))
    assert trainer.scaler.get_scale() == 256.0 and trainer.scaler.get_growth_factor() == 4.0
    trainer.train_step([batches(1)[0]])
    assert trainer.scaler.get_scale() == 1024.0
    trainer.set_scaler(T.ScalerSettings(enabled=False))
    assert not trainer.scaler.is_enabled()
    with pytest.raises(ValueError, match="settings must be a ScalerSettings"):
        trainer.set_scaler({"init_scale": 2.0})


def test_prime_momentum_buffers_keeps_sgd_updates_identical():
    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(3)]
    results = []
    for prime in (False, True):
        p = nn.Parameter(torch.linspace(-1, 1, 5))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, foreach=False)
        if prime:
            assert T.prime_momentum_buffers(opt) == 1
            assert T.prime_momentum_buffers(opt) == 0  # already there: nothing new
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])


def test_prime_momentum_buffers_rejects_what_it_cannot_prime():
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="torch.optim.SGD"):
        T.prime_momentum_buffers(torch.optim.Adam([p]))
    with pytest.raises(ValueError, match="dampening"):
        T.prime_momentum_buffers(torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1))
    assert T.prime_momentum_buffers(torch.optim.SGD([p], lr=0.1)) == 0  # no momentum: no buffer


def test_trainer_survives_a_skipped_first_step_with_fused_sgd():
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0])
    x_bad = x.clone()
    x_bad[0, 0] = float("inf")
    finals = {}
    for impl in ("foreach", "fused"):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **{impl: True})
        # no grad-norm tracking: scaler.step then leaves unscaling and skipping to the fused
        # kernel, the path with the bug (an explicit unscale_ first skips the whole step instead)
        cfg = T.TrainConfig(precision="fp16", progress=False, seed=None, track_grad_norm=False,
                            scaler=T.ScalerSettings(init_scale=1024.0))
        tr = T.Trainer(model, opt, cfg, device="cpu")
        # leave NaN in freed memory of the parameters' sizes, where an uninitialised buffer
        # would likely be placed (so the bug, if back, shows as a difference below)
        junk = [torch.full_like(p, float("nan")) for p in model.parameters()]
        del junk
        assert bool(tr.train_step([(x_bad, y)]).skipped)
        assert not bool(tr.train_step([(x, y)]).skipped)
        finals[impl] = [p.detach().clone() for p in model.parameters()]
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    for a, b in zip(finals["foreach"], finals["fused"]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_skip_safe_batchnorm_sees_changes_made_between_steps(fused):
    """The snapshot left by one step is reused by the next only while no one touched the buffers:
    a train-mode forward outside the trainer, or load_state_dict, must be what a skip restores."""
    data = batches(3)
    model, _ = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused,
                          foreach=None if fused else False)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        hooks=[Inject({1, 2})])
    trainer.train_step([data[0]])
    with torch.no_grad():
        model(data[1][0])  # train mode: moves the running statistics outside the trainer
    expected = {k: v.clone() for k, v in model.state_dict().items() if "bn." in k}
    assert trainer.train_step([data[1]]).skipped
    assert_same_tensors({k: v for k, v in model.state_dict().items() if "bn." in k}, expected)
    state = copy.deepcopy(model.state_dict())
    state["bn.running_mean"].fill_(0.25)
    model.load_state_dict(state)
    assert trainer.train_step([data[2]]).skipped
    assert torch.equal(model.bn.running_mean, torch.full_like(model.bn.running_mean, 0.25))
    # writes that no version counter sees: through .data, and BatchNorm's functional form
    model.bn.running_var.data.fill_(2.0)
    F.batch_norm(torch.randn(4, 4, 3, 3), model.bn.running_mean, model.bn.running_var,
                 training=True, momentum=0.5)
    expected = model.bn.running_mean.clone(), model.bn.running_var.clone()
    trainer.hooks[0].steps.add(trainer.step)
    assert trainer.train_step([data[0]]).skipped
    assert torch.equal(model.bn.running_mean, expected[0])
    assert torch.equal(model.bn.running_var, expected[1])


def test_fused_sgd_with_dampening_is_refused_where_steps_can_be_skipped():
    model, _ = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1, fused=True)
    with pytest.raises(ValueError, match="dampening must be 0 for fused SGD"):
        T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    with pytest.raises(ValueError, match="dampening must be 0 for fused SGD"):
        T.Trainer(model, opt, T.TrainConfig(precision="bf16", progress=False))  # skip policy
    # nothing is ever skipped: no bug to work around
    T.Trainer(model, opt, T.TrainConfig(precision="bf16", progress=False, nonfinite="ignore"))
    assert not opt.state


# --- settings cannot change behind the trainer's back --------------------------------------------

def test_train_config_is_immutable_and_replace_revalidates():
    cfg = T.TrainConfig(clip_norm=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_norm = -1
    with pytest.raises(ValueError, match="clip_norm must be None or a finite number > 0"):
        dataclasses.replace(cfg, clip_norm=-1)
    with pytest.raises(ValueError, match="nonfinite must be one of 'skip', 'raise', 'ignore'"):
        T.TrainConfig(nonfinite="warn")


def test_trainer_config_can_be_replaced_between_steps_but_not_its_precision():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    assert trainer.train_step(batches(1)).grad_norm is None
    trainer.config = dataclasses.replace(trainer.config, track_grad_norm=True)
    assert trainer.train_step(batches(1)).grad_norm > 0  # the step follows the new config
    trainer.config = dataclasses.replace(trainer.config,
                                         scaler=T.ScalerSettings(init_scale=8.0))
    assert trainer.scaler.get_scale() == 8.0
    with pytest.raises(ValueError, match="precision cannot change on a live Trainer"):
        trainer.config = dataclasses.replace(trainer.config, precision="bf16")
    with pytest.raises(ValueError, match="config must be a TrainConfig"):
        trainer.config = {"clip_norm": 1.0}
    assert trainer.config.precision == "fp16"


def test_optimizer_must_own_the_models_trainable_parameters():
    model, _ = fresh()
    other, _ = fresh()
    with pytest.raises(ValueError, match=r"optimizer must own every trainable parameter.*"
                                         r"none of them"):
        T.Trainer(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"holds 2 of 6 \(missing: conv.weight, conv.bias"):
        T.Trainer(model, torch.optim.SGD([model.bn.weight, model.bn.bias], lr=0.1))
    # frozen parameters may stay out of the optimizer
    model.conv.requires_grad_(False)
    model.fc.requires_grad_(False)
    T.Trainer(model, torch.optim.SGD([model.bn.weight, model.bn.bias], lr=0.1),
              T.TrainConfig(progress=False))


# --- non-finite values without a GradScaler ------------------------------------------------------

class InjectLoss(T.Hooks):
    """Makes a gradient NaN on the listed steps (after backward, as a NaN loss would)."""

    def __init__(self, steps, value=float("nan")):
        self.steps, self.value = set(steps), value

    def after_backward(self, trainer, micro_step):
        if trainer.step in self.steps:
            trainer.model.fc.weight.grad[0, 0] = self.value


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused", "adam"])
def test_nonfinite_skip_leaves_everything_as_it_was(precision, impl):
    data = batches(4)
    model, _ = fresh()
    if impl == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                              **{"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                                 "fused": dict(fused=True)}[impl])
    trainer = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False),
                        hooks=[InjectLoss({0, 2})])
    first = trainer.train_step([data[0]])  # first step: no optimizer state yet
    assert first.skipped and first.skip_reason == R.SKIPPED_NONFINITE
    trainer.train_step([data[1]])
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer_tensors(opt))
    record = trainer.train_step([data[2]])
    assert record.skipped is True and record.skip_reason == R.SKIPPED_NONFINITE
    assert_same_tensors(model.state_dict(), weights)  # weights and BatchNorm statistics
    assert_same_tensors(optimizer_tensors(opt), state)
    assert not trainer.train_step([data[3]]).skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.history.skipped_step_numbers == [0, 2]


def test_nonfinite_skip_matches_a_run_without_the_bad_batches():
    """Skipping is exact: the same weights as a run that never saw the bad steps."""
    data = batches(5)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False, seed=None),
                        hooks=[InjectLoss({1, 3})])
    for b in data:
        trainer.train_step([b])
    ref_model, ref_opt = fresh()
    for i, (x, y) in enumerate(data):
        if i in (1, 3):
            continue
        F.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # BatchNorm saw batches 1 and 3 in the reference run too only if we let it: compare weights
    assert_same_tensors(dict(model.named_parameters()), dict(ref_model.named_parameters()))
    assert_same_tensors(dict(model.named_buffers()), dict(ref_model.named_buffers()))


def test_nonfinite_loss_is_caught_even_when_gradients_are_finite():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False),
                        loss_fn=lambda out, y: F.cross_entropy(out, y) + torch.tensor(float("inf")))
    before = copy.deepcopy(model.state_dict())
    assert trainer.train_step([batches(1)[0]]).skipped
    assert_same_tensors(model.state_dict(), before)


def test_nonfinite_raise_names_the_step_and_leaves_the_model():
    data = batches(3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False, nonfinite="raise"),
                        hooks=[InjectLoss({1})])
    trainer.train_step([data[0]])
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(T.NonFiniteError, match=r"step 1 \(epoch 0\): non-finite loss or gradient"):
        trainer.train_step([data[1]])
    assert_same_tensors(model.state_dict(), before)
    assert trainer.step == 1 and len(trainer.history) == 1


def test_nonfinite_ignore_trains_on_nan_as_plain_pytorch_does():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False, nonfinite="ignore"),
                        hooks=[InjectLoss({0})])
    record = trainer.train_step([batches(1)[0]])
    assert record.skipped is False and record.skip_reason is None
    assert torch.isnan(model.fc.weight).any()


def test_nonfinite_skip_with_clip_by_value_still_sees_the_inf():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False, clip_value=0.1,
                                                  track_grad_norm=False),
                        hooks=[InjectLoss({0}, float("inf"))])
    before = copy.deepcopy(model.state_dict())
    assert trainer.train_step([batches(1)[0]]).skipped
    assert_same_tensors(model.state_dict(), before)


def test_epoch_summary_counts_skips_and_averages_finite_losses_only():
    """fp16: a skipped step's loss may be NaN; the epoch's train_loss must not become NaN."""
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        loss_fn=NaNOnce())
    trainer.fit(batches(4), epochs=1)
    summary = trainer.history.epochs[0]
    assert summary["skipped"] == 1 and summary["steps"] == 4
    assert math.isfinite(summary["train_loss"])
    losses = [r.loss for r in trainer.history if not r.skipped]
    assert summary["train_loss"] == pytest.approx(sum(losses) / 3)
    assert trainer.history[0].skip_reason == R.SKIPPED_BY_SCALER


class NaNOnce:
    """cross_entropy, NaN on its first call."""

    def __init__(self):
        self.calls = 0

    def __call__(self, out, y):
        self.calls += 1
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if self.calls == 1 else loss


# --- a step that raises leaves the trainer as it was -----------------------------------------------

def _snapshot(trainer):
    return (copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(optimizer_tensors(
        trainer.optimizer)), trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None,
        trainer.step, len(trainer.history))


def _assert_unchanged(trainer, before):
    model, opt, scale, step, records = before
    assert_same_tensors(trainer.model.state_dict(), model)  # weights and BatchNorm statistics
    assert_same_tensors(optimizer_tensors(trainer.optimizer), opt)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert (trainer.scaler.get_scale() if trainer.scaler.is_enabled() else None) == scale
    assert (trainer.step, len(trainer.history)) == (step, records)


@pytest.mark.parametrize("precision,bad_at", [("fp32", 0), ("fp32", 1), ("fp16", 1),
                                               ("bf16", 1)])
def test_a_bad_micro_batch_leaves_the_trainer_as_it_was(precision, bad_at):
    """A 9x9 image passes the convolution and BatchNorm, then fails in the Linear layer: the
    micro-batches before it (gradients, BatchNorm statistics) must not leak into the next step."""
    data = batches(3)
    bad = (torch.randn(16, 1, 9, 9), data[1][1])
    cfg = T.TrainConfig(precision=precision, accumulate=2, progress=False)
    trainer = T.Trainer(*fresh(), cfg)
    reference = T.Trainer(*fresh(), cfg)
    for t in (trainer, reference):
        t.train_step([data[0], data[1]])  # momentum exists: the failed step must not touch it
    before = _snapshot(trainer)
    group = [data[1], data[2]]
    group[bad_at] = bad
    with pytest.raises(RuntimeError):
        trainer.train_step(group)
    _assert_unchanged(trainer, before)
    for t in (trainer, reference):
        t.train_step([data[2], data[0]])
    assert_same_tensors(trainer.model.state_dict(), reference.model.state_dict())
    assert trainer.history.columns()["loss"] == reference.history.columns()["loss"]


class _Interrupt(T.Hooks):
    """Presses Stop (KeyboardInterrupt) once, at the given point of the next step."""

    def __init__(self, where):
        self.where, self.armed = where, False

    def _maybe(self, where):
        if self.armed and where == self.where:
            self.armed = False
            raise KeyboardInterrupt

    def after_backward(self, trainer, micro_step):
        self._maybe("backward")

    def after_unscale(self, trainer):
        self._maybe("unscale")


@pytest.mark.parametrize("where", ["backward", "unscale"])
def test_an_interrupted_fp16_step_leaves_the_trainer_able_to_step(where):
    """Stop pressed after unscale_: torch's GradScaler would then refuse every later step
    ("unscale_() has already been called"); the trainer forgets the step instead."""
    data = batches(3)
    cfg = T.TrainConfig(precision="fp16", progress=False, clip_norm=1.0)
    hook, quiet = _Interrupt(where), _Interrupt(where)
    trainer = T.Trainer(*fresh(), cfg, hooks=[hook])
    reference = T.Trainer(*fresh(), cfg, hooks=[quiet])
    for t in (trainer, reference):
        t.train_step([data[0]])
    before = _snapshot(trainer)
    hook.armed = True
    with pytest.raises(KeyboardInterrupt):
        trainer.train_step([data[1]])
    _assert_unchanged(trainer, before)
    for t in (trainer, reference):
        t.train_step([data[1]])
        t.train_step([data[2]])
    assert_same_tensors(trainer.model.state_dict(), reference.model.state_dict())
    assert trainer.scaler.get_scale() == reference.scaler.get_scale()


# --- loops over data neither lose nor invent work --------------------------------------------------

class _Counted:
    """A one-shot generator of ``batches`` that counts what was drawn from it."""

    def __init__(self, data):
        self.drawn = 0
        self.gen = self._gen(data)

    def _gen(self, data):
        for b in data:
            self.drawn += 1
            yield b


def test_fit_refuses_an_epoch_without_batches():
    trainer = T.Trainer(*fresh(), T.TrainConfig(progress=False))
    with pytest.raises(ValueError, match="loader must yield at least one batch per epoch"):
        trainer.fit([])
    assert trainer.epoch == 0 and trainer.history.epochs == [] and trainer.step == 0
    gen = (b for b in batches(2))
    trainer.fit(gen)
    assert trainer.epoch == 1
    with pytest.raises(ValueError, match="epoch 2 got none"):
        trainer.fit(gen)  # used up: no empty epoch is counted
    assert trainer.epoch == 1 and len(trainer.history.epochs) == 1
    with pytest.raises(ValueError, match="epochs must be 1 for a one-shot iterator"):
        trainer.fit((b for b in batches(2)), epochs=2)  # refused before any training
    assert trainer.step == 2


@pytest.mark.parametrize("accumulate,max_steps", [(1, 3), (2, 2), (3, 1)])
def test_fit_trains_every_batch_it_takes_from_an_iterator(accumulate, max_steps):
    """fit(gen, max_steps) then fit(gen): every batch of the generator trained exactly once, in
    order, as one uninterrupted fit over the same batches; none is drawn and dropped."""
    data = batches(10)
    cfg = T.TrainConfig(progress=False, accumulate=accumulate)
    trainer, reference = T.Trainer(*fresh(), cfg), T.Trainer(*fresh(), cfg)
    counted = _Counted(data)
    trainer.fit(counted.gen, max_steps=max_steps)
    assert counted.drawn == accumulate * max_steps  # the budget is checked before drawing
    trainer.fit(counted.gen)
    reference.fit(data)
    assert counted.drawn == 10 and trainer.step == reference.step == -(-10 // accumulate)
    assert_same_tensors(trainer.model.state_dict(), reference.model.state_dict())
    assert trainer.epoch == 1 and trainer.history.epochs[0]["partial"] is True
