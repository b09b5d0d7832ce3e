"""The trainer's policies: the non-finite rule (GradScaler under fp16; skip, raise, ignore
otherwise) and what each reads back from the device, the compatibility module that is the only
user of GradScaler's private API, the before_step hook and cancelled steps."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import _compat as C
from amp_lessons.train import policies as _policies
from amp_lessons.train import records as R
from amp_lessons.train import trainer as T
from trainer_helpers import (Inject, ScalarReads, assert_same_tensors, batches, fresh,
                             optimizer_tensors)


# --- the compatibility module against the installed torch ----------------------------------------

def _scaled_step(scaler, p, opt, bad=False):
    scaler.scale(p.sum()).backward()
    if bad:
        p.grad[0] = float("inf")
    scaler.unscale_(opt)


def test_compat_reads_gradscaler_on_this_torch():
    """Every private attribute the package reads exists and means what _compat says."""
    assert C.FOUND_INF_READABLE
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert C.scale_tensor(scaler) is None and C.init_scale(scaler) == 8.0
    assert C.found_inf(scaler, opt) is None  # nothing unscaled yet this step
    _scaled_step(scaler, p, opt, bad=True)
    scale = C.scale_tensor(scaler)
    assert scale.dim() == 0 and scale.item() == 8.0 and scale is C.scale_reader(scaler)()
    flag = C.found_inf(scaler, opt)
    assert flag.dtype == torch.float32 and flag.dim() == 0 and flag.item() == 1.0
    # a step that will not complete: forgotten, the next unscale_ is accepted
    assert C.forget_step(scaler, opt)
    p.grad = None
    _scaled_step(scaler, p, opt)
    assert C.found_inf(scaler, opt).item() == 0.0
    scaler.step(opt)
    scaler.update()
    for _ in range(3):  # three good steps counted
        opt.zero_grad()
        _scaled_step(scaler, p, opt)
        scaler.step(opt)
        scaler.update()
    C.cap_growth_tracker(scaler, 2)
    assert scaler._get_growth_tracker() == 1
    C.reset_scale(scaler, 32.0)
    assert scaler.get_scale() == 32.0 and C.init_scale(scaler) == 32.0


def test_compat_torch_version_reads_release_strings(monkeypatch):
    assert C.torch_version() == tuple(int(v) for v in torch.__version__.split(".")[:2])
    for text, want in (("2.4.1+cu121", (2, 4)), ("2.14.1", (2, 14)), ("2.6.0a0+git1234", (2, 6)),
                       ("2.10.0.dev20251201+cpu", (2, 10)), ("3.0rc1", (3, 0))):
        monkeypatch.setattr(torch, "__version__", text)
        assert C.torch_version() == want, text


def test_compat_found_inf_degrades_to_none_where_torch_hides_it():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler._found_inf_per_device = None  # as if a release renamed it
    _scaled_step(scaler, p, opt)
    assert C.found_inf(scaler, opt) is None
    assert C.forget_step(object(), opt) is False


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)], ids=["sgd", "adam", "adamw"])
def test_fused_optimizers_skip_inside_their_kernel(make):
    """step_skipping with flag 1 leaves parameters and state bitwise as they were; with flag 0
    it is the plain step, bit for bit."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(5))
    b = nn.Parameter(a.detach().clone())
    opt_a, opt_b = make([a]), make([b])
    T.prime_momentum_buffers(opt_a) if isinstance(opt_a, torch.optim.SGD) else None
    T.prime_momentum_buffers(opt_b) if isinstance(opt_b, torch.optim.SGD) else None
    assert C.supports_found_inf(opt_a)
    for i in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        C.step_skipping(opt_a, torch.zeros(()))
        opt_b.step()
        assert torch.equal(a, b)
    before = copy.deepcopy((a.detach().clone(), optimizer_tensors(opt_a)))
    a.grad = torch.randn(5)
    C.step_skipping(opt_a, torch.ones(()))
    assert torch.equal(a, before[0])
    assert_same_tensors(optimizer_tensors(opt_a), before[1])
    assert not hasattr(opt_a, "found_inf") and not hasattr(opt_a, "grad_scale")
    assert not C.supports_found_inf(torch.optim.AdamW([a], lr=0.1, foreach=True))


def test_nonfinite_check_flags_inf_and_nan_and_changes_no_bit():
    check = C.NonFiniteCheck()
    values = torch.tensor([0.0, -0.0, 1e-45, -3.4e38, 1.5])
    half = torch.tensor([1.0, -0.0], dtype=torch.bfloat16)
    kept = values.clone(), half.clone()
    flag = check([values, half], torch.device("cpu"))
    assert flag.dim() == 0 and flag.dtype == torch.float32 and flag.item() == 0.0
    assert torch.equal(values.view(torch.int32), kept[0].view(torch.int32))
    assert torch.equal(half.view(torch.int16), kept[1].view(torch.int16))
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.ones(4)
        t[2] = bad
        assert check([values, t], torch.device("cpu")).item() == 1.0
    a, b = check([values], torch.device("cpu")), check([values], torch.device("cpu"))
    assert a is not b  # a fresh flag per call: records keep them


# --- each policy: what a skipped step leaves -----------------------------------------------------

def _optimizer(kind, model):
    return {"sgd-foreach": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                   foreach=True),
            "sgd-fused": lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                 fused=True),
            "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True),
            "adamw-fused": lambda: torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
            }[kind]()


def _everything(trainer):
    return (copy.deepcopy(trainer.model.state_dict()),
            copy.deepcopy(optimizer_tensors(trainer.optimizer)))


KINDS = ("sgd-foreach", "sgd-fused", "adamw", "adamw-fused")


@pytest.mark.parametrize("precision,nonfinite,kind", [
    *[("fp16", "skip", k) for k in KINDS], *[("bf16", "skip", k) for k in KINDS],
    ("fp32", "skip", "adamw-fused"), ("fp32", "skip", "adamw"), ("bf16", "raise", "sgd-foreach"),
    ("bf16", "raise", "adamw-fused")])
def test_a_skipped_step_leaves_model_optimizer_and_batchnorm_bitwise(precision, nonfinite, kind):
    """GradScaler (fp16) and the skip/raise policies: the bad step changes no bit of weights,
    BatchNorm statistics or optimizer state, whether the optimizer skips in its kernel (fused)
    or is not called (the host read the flag)."""
    data = batches(4)
    model, _ = fresh()
    hook = Inject({2}, float("nan"))
    trainer = T.Trainer(model, _optimizer(kind, model),
                        T.TrainConfig(precision=precision, nonfinite=nonfinite, progress=False),
                        hooks=[hook])
    trainer.train_step([data[0]])
    trainer.train_step([data[1]])
    before = _everything(trainer)
    if nonfinite == "raise":
        with pytest.raises(T.NonFiniteError, match=r"^step 2 \(epoch 0\)"):
            trainer.train_step([data[2]])
        assert trainer.step == 2 and len(trainer.history) == 2
    else:
        record = trainer.train_step([data[2]])
        cause = R.SKIPPED_BY_SCALER if precision == "fp16" else R.SKIPPED_NONFINITE
        assert record.skipped and record.skip_reason == cause
    after = _everything(trainer)
    assert_same_tensors(after[0], before[0])  # weights and BatchNorm statistics
    assert_same_tensors(after[1], before[1])
    hook.steps.clear()  # (after a raise the step number is 2 again)
    assert not trainer.train_step([data[3]]).skipped  # and training goes on


@pytest.mark.parametrize("kind", ["sgd-foreach", "adamw-fused"])
def test_skip_is_bitwise_a_run_without_the_bad_step(kind):
    """bf16: the trainer with a NaN at step 1 ends bitwise where the hand loop ends when it
    never sees that batch (weights, BatchNorm statistics, optimizer state)."""
    data = batches(4)
    model, _ = fresh()
    trainer = T.Trainer(model, _optimizer(kind, model),
                        T.TrainConfig(precision="bf16", progress=False, seed=None),
                        hooks=[Inject({1}, float("nan"))])
    for b in data:
        trainer.train_step([b])
    ref, _ = fresh()
    opt = _optimizer(kind, ref)
    if kind == "sgd-fused":
        T.prime_momentum_buffers(opt)
    for i, (x, y) in enumerate(data):
        if i == 1:
            continue
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_same_tensors(model.state_dict(), ref.state_dict())
    assert_same_tensors(optimizer_tensors(trainer.optimizer), optimizer_tensors(opt))
    assert trainer.history.skipped_step_numbers == [1]


def test_gradscaler_fallback_when_its_flag_is_unreadable(monkeypatch):
    """If a torch release hid GradScaler's flag, the policy checks the gradients itself, before
    clipping by value (which would turn an inf into a finite bound)."""
    monkeypatch.setattr(_policies, "FOUND_INF_READABLE", False)
    monkeypatch.setattr(_policies, "scaler_found_inf", lambda scaler, opt: None)
    data = batches(3)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", clip_value=1e-3,
                                                  track_grad_norm=False, progress=False),
                        hooks=[Inject({1})])
    trainer.train_step([data[0]])
    before = _everything(trainer)
    record = trainer.train_step([data[1]])
    assert record.skipped and record.skip_reason == R.SKIPPED_BY_SCALER
    assert_same_tensors(_everything(trainer)[0], before[0])
    assert not trainer.train_step([data[2]]).skipped


# --- raise: the error comes before the optimizer steps --------------------------------------------

def test_raise_in_fit_puts_the_epoch_position_back():
    data = batches(4)
    trainer = T.Trainer(*fresh(), T.TrainConfig(nonfinite="raise", progress=False),
                        hooks=[Inject({2}, float("nan"))])
    with pytest.raises(T.NonFiniteError, match=r"^step 2 \(epoch 0\)"):
        trainer.fit(data)
    assert trainer.step == 2 and trainer.epoch == 0
    trainer.hooks[0].steps.clear()
    trainer.fit(data)  # the epoch goes on from the bad step: 2 more steps, not 4
    assert trainer.step == 4 and trainer.history.epochs[0]["steps"] == 2


# --- no host sync: no scalar read of a device value, per policy ---------------------------------


def _hand_reads(precision, kind):
    """Scalar reads of the hand-written loop's third step (the optimizer's own, e.g. Adam's
    step counters, which live on the host even for a CUDA model)."""
    data = batches(3)
    model, _ = fresh()
    opt = _optimizer(kind, model)
    if kind == "sgd-fused":
        T.prime_momentum_buffers(opt)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)

    def step(x, y):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    step(*data[0])
    step(*data[1])
    with ScalarReads() as reads:
        step(*data[2])
    return reads.count


@pytest.mark.parametrize("precision,nonfinite,kind,extra", [
    ("bf16", "skip", "adamw-fused", 0), ("bf16", "skip", "sgd-fused", 0),
    ("bf16", "ignore", "adamw", 0), ("fp16", "skip", "sgd-fused", 0),
    ("fp16", "skip", "adamw-fused", 0),
    ("fp16", "skip", "sgd-foreach", 0),  # GradScaler's own read for non-fused: the hand loop's
    ("fp32", "skip", "sgd-foreach", 1), ("bf16", "skip", "adamw", 1),  # the flag, read once
    ("bf16", "raise", "adamw-fused", 1), ("bf16", "raise", "sgd-foreach", 1)])
def test_what_each_policy_reads_from_the_device_per_step(precision, nonfinite, kind, extra):
    """After the first step, the trainer reads back (a host sync on a GPU) what the
    hand-written loop reads, plus one read of the step's flag where the policy says so: a
    non-fused optimizer under "skip", and "raise"; a fused optimizer skips with no read."""
    data = batches(3)
    model, _ = fresh()
    trainer = T.Trainer(model, _optimizer(kind, model),
                        T.TrainConfig(precision=precision, nonfinite=nonfinite, progress=False))
    trainer.train_step([data[0]])
    trainer.train_step([data[1]])
    with ScalarReads() as reads:
        trainer.train_step([data[2]])
    assert reads.count == _hand_reads(precision, kind) + extra


# --- before_step and cancelling a step -----------------------------------------------------------

class _Cancel(T.Hooks):
    def __init__(self, steps, where="before_step"):
        self.steps, self.where, self.seen = set(steps), where, []

    def after_backward(self, trainer, micro_step):
        if self.where == "after_backward" and trainer.step in self.steps:
            trainer.cancel_step("loss spike")

    def before_step(self, trainer):
        self.seen.append(trainer.model.fc.weight.grad.clone())
        if self.where == "before_step" and trainer.step in self.steps:
            trainer.cancel_step("loss spike")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("where", ["after_backward", "before_step"])
def test_a_hook_cancels_a_step_and_nothing_moves(precision, where):
    """A cancelled step: weights, BatchNorm statistics, optimizer state and the loss scale as
    they were; recorded as skipped with the hook's reason; the run then continues exactly as a
    run that never saw that batch."""
    data = batches(4)
    cfg = T.TrainConfig(precision=precision, progress=False, seed=None)
    hook = _Cancel({1}, where)
    trainer = T.Trainer(*fresh(), cfg, hooks=[hook])
    reference = T.Trainer(*fresh(), cfg)
    trainer.train_step([data[0]])
    before = _everything(trainer)
    scale = trainer.scaler.get_scale()
    record = trainer.train_step([data[1]])
    assert record.skipped and record.skip_reason == "loss spike"
    assert_same_tensors(_everything(trainer)[0], before[0])
    assert_same_tensors(_everything(trainer)[1], before[1])
    assert trainer.scaler.get_scale() == scale
    assert all(p.grad is None for p in trainer.model.parameters())
    for b in (data[2], data[3]):
        trainer.train_step([b])
    for b in (data[0], data[2], data[3]):
        reference.train_step([b])
    assert_same_tensors(trainer.model.state_dict(), reference.model.state_dict())
    assert trainer.history.skipped_step_numbers == [1]


def test_before_step_sees_true_clipped_gradients_under_fp16():
    """before_step runs after unscale_ and clipping: the gradients it sees are the ones the
    optimizer uses."""
    data = batches(2)
    hook = _Cancel(set())
    cfg = T.TrainConfig(precision="fp16", progress=False, clip_value=1e-3)
    trainer = T.Trainer(*fresh(), cfg, hooks=[hook])
    trainer.train_step([data[0]])
    assert hook.seen and hook.seen[0].abs().max() <= torch.tensor(1e-3).item()
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        trainer.cancel_step("")


def test_fused_sgd_needs_priming_only_where_steps_can_be_skipped():
    import torch
    from amp_lessons.train.skipsafe import fused_sgd_needs_priming

    def sgd(**kw):
        return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, **kw)

    assert fused_sgd_needs_priming(sgd(momentum=0.9, fused=True), can_skip=True)
    assert not fused_sgd_needs_priming(sgd(momentum=0.9, fused=True), can_skip=False)
    assert not fused_sgd_needs_priming(sgd(momentum=0.9), can_skip=True)  # foreach: no bug
    assert not fused_sgd_needs_priming(sgd(fused=True), can_skip=True)  # no momentum buffers
    damped = sgd(momentum=0.9, dampening=0.1, fused=True)
    assert not fused_sgd_needs_priming(damped, can_skip=False)
    with pytest.raises(ValueError, match="dampening must be 0 for fused SGD .* got 0.1"):
        fused_sgd_needs_priming(damped, can_skip=True)
