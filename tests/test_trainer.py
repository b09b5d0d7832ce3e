"""amp_lessons.trainer: the loop against PyTorch's AMP examples, skipped steps, checkpoints, errors.

The reference loops below are written the way https://pytorch.org/docs/stable/notes/amp_examples.html
writes them ("Typical Mixed Precision Training", "Gradient clipping", "Gradient accumulation"),
with the CPU as the device (fp16 autocast + GradScaler("cpu") and bf16 autocast run there).
"""
import copy
import json
import math
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import trainer as T
from amp_lessons.data import TensorBatches


# --- fixtures ------------------------------------------------------------------------------------

class TinyNet(nn.Module):
    """Conv + BatchNorm + Dropout + Linear: enough to exercise BN buffers and the RNG."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.drop(F.relu(self.bn(self.conv(x)))).flatten(1))


def make_data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def batches(n_batches=6, batch=16, seed=0):
    x, y = make_data(n_batches * batch, seed)
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(n_batches)]


def fresh(seed=0, dropout=0.0, lr=0.1, momentum=0.9):
    torch.manual_seed(seed)
    model = TinyNet(dropout)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return model, opt


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def optimizer_tensors(opt):
    return {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


# --- precision helpers ---------------------------------------------------------------------------

@pytest.mark.parametrize("given,expected", [("fp32", "fp32"), ("TF32", "tf32"), ("amp", "fp16"),
                                            (" AMP ", "fp16"), ("bf16", "bf16")])
def test_normalize_precision(given, expected):
    assert T.normalize_precision(given) == expected


@pytest.mark.parametrize("bad", ["fp8", "", "half", None, 16])
def test_unknown_precision_names_the_setting_and_choices(bad):
    with pytest.raises(ValueError, match=r"precision must be one of fp32, tf32, fp16.*bf16"):
        T.check_precision(bad, "cpu")


def test_check_precision_on_cpu():
    assert [T.check_precision(p, "cpu") for p in ("fp32", "tf32", "amp", "bf16")] == \
        ["fp32", "tf32", "fp16", "bf16"]


def test_fp16_where_it_cannot_run_is_a_value_error(monkeypatch):
    monkeypatch.setattr(T, "_fp16_problem", lambda device_type: "no float16 autocast here")
    with pytest.raises(ValueError, match="precision 'fp16' cannot run on cpu: no float16"):
        T.check_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="precision 'fp16'"):
        T.TrainConfig(precision="fp16") and T.Trainer(*fresh(), T.TrainConfig(precision="fp16"))


def test_cuda_device_without_cuda_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device must be an available device"):
        T.check_precision("fp32", "cuda")


def test_bf16_on_a_gpu_without_native_bf16_says_why(monkeypatch):
    """A T4 (capability 7.5): torch only emulates bf16, so the trainer refuses it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"'bf16' needs a GPU with native bfloat16.*Tesla T4 "
                                         r"has 7\.5.*Use fp16"):
        T.check_precision("bf16", "cuda")


def test_autocast_for():
    assert isinstance(T.autocast_for("fp32", "cpu"), type(T.autocast_for("tf32", "cpu")))
    for name, dtype in (("fp16", torch.float16), ("amp", torch.float16), ("bf16", torch.bfloat16)):
        with T.autocast_for(name, "cpu"):
            out = torch.ones(2, 2) @ torch.ones(2, 2)
        assert out.dtype == dtype
    with T.autocast_for("fp32", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_precision_settings_switch_tf32_and_restore_without_warnings():
    before = T._get_tf32()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with T.precision_settings("fp32"):
            assert T._get_tf32() == T._tf32_target(False)
            with T.precision_settings("tf32"):
                assert T._get_tf32() == T._tf32_target(True)
            assert T._get_tf32() == T._tf32_target(False)
        assert T._get_tf32() == before
        with T.precision_settings("fp16"):
            assert T._get_tf32() == before
        with pytest.raises(RuntimeError):
            with T.precision_settings("tf32"):
                raise RuntimeError("boom")
        assert T._get_tf32() == before


def test_tf32_uses_the_new_switches_where_torch_has_them():
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert T._tf32_target(True) == ("new", "tf32", "tf32")
        assert T._tf32_target(False) == ("new", "ieee", "ieee")


# --- settings validation -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(init_scale=0), r"init_scale must be a finite number > 0"),
    (dict(init_scale=-1.0), r"init_scale must be a finite number > 0"),
    (dict(init_scale=float("inf")), r"init_scale must be a finite number > 0"),
    (dict(growth_factor=1.0), r"growth_factor must be a finite number > 1"),
    (dict(growth_factor=0.5), r"growth_factor must be a finite number > 1"),
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
    with pytest.raises(ValueError, match="hooks must be Hooks instances"):
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


def test_lean_mode_matches_the_reference_and_still_detects_skips():
    """track_grad_norm/track_memory/skip-safe BN off: scaler.step unscales, as in the example."""
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
    cfg = T.TrainConfig(precision="fp16", progress=False, seed=None, track_grad_norm=False,
                        track_memory=False, skip_safe_batchnorm=False)
    trainer = T.Trainer(model, opt, cfg, hooks=[Inject({2})])
    assert not trainer._unscale_first
    for b in data:
        trainer.train_step([b])
    assert_same_tensors(model.state_dict(), ref_model.state_dict())
    cols = trainer.history.columns()
    assert cols["skipped"] == [False, False, True, False] and cols["grad_norm"] == [None] * 4
    assert cols["scale"] == [65536.0, 65536.0, 65536.0, 32768.0]


def test_clip_by_value_after_unscale():
    data = batches(3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", clip_value=1e-3,
                                                  progress=False))

    class Spy(T.Hooks):
        def after_step(self, trainer, record):
            pass

    grads = []

    class Capture(T.Hooks):
        def after_unscale(self, trainer):
            grads.append(trainer.model.fc.weight.grad.clone())

    trainer.hooks.append(Capture())
    trainer._after_unscale = T._overrides(trainer.hooks, "after_unscale")
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

class Inject(T.Hooks):
    """Writes ``value`` into a gradient on the steps listed (the gradients are still scaled)."""

    def __init__(self, steps, value=float("inf")):
        self.steps, self.value = set(steps), value

    def after_backward(self, trainer, micro_step):
        if trainer.step in self.steps:
            trainer.model.conv.weight.grad[0, 0, 0, 0] = self.value


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_skipped_step_leaves_the_model_exactly_as_it_was(value):
    data = batches(3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
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


def test_step_records_are_lazy_device_values():
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    record = trainer.train_step([batches(1)[0]])
    raw = record.__dict__
    assert all(isinstance(raw[f"_{k}"], torch.Tensor) for k in ("loss", "scale", "skipped",
                                                                  "grad_norm"))
    cols = trainer.history.columns()  # materialises
    assert isinstance(record.__dict__["_loss"], float) and isinstance(record.skipped, bool)
    assert cols["loss"][0] == record.loss and cols["scale"][0] == 65536.0
    assert cols["lr"] == [0.1] and cols["time_s"][0] > 0 and cols["peak_memory_bytes"] == [None]
    assert set(cols) == set(T.STEP_FIELDS)


def test_history_json_is_strict_and_round_trips(tmp_path):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        hooks=[Inject({0})])
    trainer.fit(batches(2), epochs=1)
    text = trainer.history.to_json(tmp_path / "h.json")
    data = json.loads(text)  # strict JSON: the NaN/inf norm became null
    assert data["steps"]["grad_norm"][0] is None and data["steps"]["skipped"] == [True, False]
    assert data["epochs"][0]["steps"] == 2
    again = T.History.from_columns(trainer.history.columns(), trainer.history.epochs)
    assert again.columns()["loss"] == trainer.history.columns()["loss"]


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


# --- checkpoints ---------------------------------------------------------------------------------

def run_with_resume(tmp_path, precision, split_at):
    """Train 2 epochs of 5 steps, saving after ``split_at`` steps and resuming in a new trainer."""
    x, y = make_data(80)

    def build():
        model, opt = fresh(dropout=0.3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        cfg = T.TrainConfig(precision=precision, progress=False, clip_norm=5.0)
        return T.Trainer(model, opt, cfg, scheduler=sched), TensorBatches(x, y, 16, seed=3)

    first, loader = build()
    first.fit(loader, epochs=2, max_steps=split_at)
    path = tmp_path / f"{precision}.pt"
    first.save_checkpoint(path)
    torch.manual_seed(1234)  # disturb every generator: the checkpoint must restore them
    torch.rand(100)
    second, loader = build()
    second.load_checkpoint(path)
    assert second.step == split_at
    second.fit(loader, epochs=2 - second.epoch)  # a half-done epoch counts as one
    return second


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("split_at", [3, 5])
def test_resume_equals_uninterrupted(tmp_path, precision, split_at):
    x, y = make_data(80)
    model, opt = fresh(dropout=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    whole = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False,
                                                clip_norm=5.0), scheduler=sched)
    whole.fit(TensorBatches(x, y, 16, seed=3), epochs=2)
    resumed = run_with_resume(tmp_path, precision, split_at)
    assert resumed.step == whole.step == 10 and resumed.epoch == whole.epoch == 2
    assert_same_tensors(resumed.model.state_dict(), whole.model.state_dict())
    assert_same_tensors(optimizer_tensors(resumed.optimizer), optimizer_tensors(whole.optimizer))
    a, b = resumed.history.columns(), whole.history.columns()
    for name in ("loss", "scale", "skipped", "grad_norm", "lr", "step", "epoch"):
        assert a[name] == b[name], name
    assert resumed.scheduler.state_dict() == whole.scheduler.state_dict()
    assert resumed.scaler.state_dict() == whole.scaler.state_dict()


def test_checkpoint_loads_with_weights_only(tmp_path):
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False),
                        scheduler=sched)
    trainer.fit(batches(2))
    path = trainer.save_checkpoint(tmp_path / "c.pt")
    state = torch.load(path, weights_only=True)
    assert state["format"] == T.CHECKPOINT_FORMAT and state["step"] == 2
    assert isinstance(state["rng"]["torch"], torch.Tensor)
    assert state["scaler"]["scale"] == 65536.0


def test_atomic_save_survives_a_failure_mid_write(tmp_path, monkeypatch):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False))
    trainer.fit(batches(2))
    path = tmp_path / "ckpt.pt"
    trainer.save_checkpoint(path)
    good = path.read_bytes()
    trainer.fit(batches(2))

    real_save = torch.save

    def broken_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # writes everything...
        f.truncate(f.tell() // 2)  # ...keeps half of it, then dies mid-write
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left behind
    other = T.Trainer(*fresh(), T.TrainConfig(progress=False))
    other.load_checkpoint(path)
    assert other.step == 2


def test_load_checkpoint_errors(tmp_path):
    trainer = T.Trainer(*fresh(), T.TrainConfig(progress=False))
    with pytest.raises(ValueError, match="path must be an existing checkpoint file"):
        trainer.load_checkpoint(tmp_path / "missing.pt")
    torch.save({"x": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="path must be a checkpoint written by Trainer"):
        trainer.load_checkpoint(tmp_path / "other.pt")
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    T.Trainer(model, opt, T.TrainConfig(progress=False), scheduler=sched).save_checkpoint(
        tmp_path / "s.pt")
    with pytest.raises(ValueError, match="scheduler: the checkpoint holds a scheduler state"):
        trainer.load_checkpoint(tmp_path / "s.pt")


def test_load_checkpoint_can_keep_the_scaler(tmp_path):
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    trainer.train_step([batches(1)[0]])
    trainer.save_checkpoint(tmp_path / "c.pt")
    other = T.Trainer(*fresh(), T.TrainConfig(precision="fp16", progress=False,
                                              scaler=T.ScalerSettings(init_scale=8.0)))
    other.load_checkpoint(tmp_path / "c.pt", load_scaler=False)
    assert other.scaler.get_scale() == 8.0
    other.load_checkpoint(tmp_path / "c.pt")
    assert other.scaler.get_scale() == 65536.0


def test_rng_state_round_trip():
    import random

    import numpy as np
    state = T.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    T.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


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


def test_fused_sgd_with_dampening_is_refused_under_fp16_only():
    model, _ = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1, fused=True)
    with pytest.raises(ValueError, match="dampening must be 0 for fused SGD"):
        T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    T.Trainer(model, opt, T.TrainConfig(precision="bf16", progress=False))  # no scaler: no bug
    assert not opt.state


def test_load_checkpoint_primes_fused_sgd_again(tmp_path):
    model, _ = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False))
    other_model, _ = fresh()
    unprimed = torch.optim.SGD(other_model.parameters(), lr=0.1, momentum=0.9, fused=True)
    other = T.Trainer(other_model, unprimed, T.TrainConfig(precision="bf16", progress=False))
    unprimed.state.clear()  # as saved by code that never primed: no buffers at all
    other.save_checkpoint(tmp_path / "before_any_step.pt")
    trainer.load_checkpoint(tmp_path / "before_any_step.pt")
    assert all(torch.count_nonzero(opt.state[p]["momentum_buffer"]) == 0
               for p in model.parameters())
