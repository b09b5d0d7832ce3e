"""The trainer's precision policies (GradScaler, skip, raise, ignore), the compatibility module
that is the only user of GradScaler's private API, the before_step hook and cancelled steps,
and the no-host-sync promise (issue 22). CPU only; the GPU paths run in
benchmarks/trainer_overhead.py."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import _compat as C
from amp_lessons.train import policies as _policies
from amp_lessons.train import trainer as T
from amp_lessons.train.policies import resolve_nonfused_skip
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


@pytest.mark.parametrize("precision,nonfinite,kind,nonfused_skip", [
    *[("fp16", "skip", k, "copy") for k in KINDS], *[("bf16", "skip", k, "copy") for k in KINDS],
    ("fp32", "skip", "adamw-fused", "copy"), ("bf16", "raise", "sgd-foreach", "copy"),
    ("bf16", "raise", "adamw-fused", "copy"), ("bf16", "skip", "sgd-foreach", "sync"),
    ("bf16", "skip", "adamw", "sync"), ("fp32", "skip", "adamw", "sync"),
    ("bf16", "raise", "sgd-foreach", "sync")])
def test_a_skipped_step_leaves_model_optimizer_and_batchnorm_bitwise(precision, nonfinite, kind,
                                                                     nonfused_skip):
    """GradScaler (fp16) and the skip/raise policies: the bad step changes no bit of weights,
    BatchNorm statistics or optimizer state, whether the optimizer skips in its kernel (fused),
    the trainer puts a copy back (``nonfused_skip="copy"``) or the host decides ("sync")."""
    data = batches(4)
    model, _ = fresh()
    hook = Inject({2}, float("nan"))
    trainer = T.Trainer(model, _optimizer(kind, model),
                        T.TrainConfig(precision=precision, nonfinite=nonfinite, progress=False,
                                      nonfused_skip=nonfused_skip),
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
        assert record.skipped and record.skip_reason == trainer._policy.cause
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
    assert record.skipped and record.skip_reason == T.SKIPPED_BY_SCALER
    assert_same_tensors(_everything(trainer)[0], before[0])
    assert not trainer.train_step([data[2]]).skipped


# --- raise: no per-step sync, the error arrives when the device is there -------------------------

class _LateFlag:
    """Stands for a CUDA event not yet reached: ``ready`` decides what ``query`` answers."""

    ready = False

    def query(self):
        return _LateFlag.ready

    def synchronize(self):
        _LateFlag.ready = True


@pytest.fixture
def late_flags(monkeypatch):
    """Flags of finished steps reach the host only when ``_LateFlag.ready`` (or on wait)."""
    original = _policies.RaisePolicy.watch

    def watch(self, flag, step, epoch, batches_done):
        original(self, flag, step, epoch, batches_done)
        s, e, d, host, _ = self.pending[-1]
        self.pending[-1] = (s, e, d, host.clone(), _LateFlag())

    monkeypatch.setattr(_policies.RaisePolicy, "watch", watch)
    _LateFlag.ready = False
    yield


@pytest.mark.parametrize("kind", ["sgd-foreach", "adamw-fused"])
def test_raise_arrives_late_and_leaves_the_model_as_before_the_bad_step(kind, late_flags):
    """On a GPU the host learns of a non-finite step only once the device got there. Simulated
    here: the flag stays unread for two more steps. Those steps are skipped on the device too,
    so the model, optimizer and BatchNorm are as they were before the bad step; the error names
    it and the counters and history go back to it."""
    data = batches(5)
    model, _ = fresh()
    hook = Inject({1}, float("inf"))
    trainer = T.Trainer(model, _optimizer(kind, model),
                        T.TrainConfig(precision="bf16", nonfinite="raise", progress=False),
                        hooks=[hook])
    trainer.train_step([data[0]])
    before = _everything(trainer)
    for b in data[1:4]:  # step 1 is bad; the host does not know yet
        assert trainer.train_step([b]).skipped  # steps 1-3: skipped on the device
    assert trainer.step == 4
    with pytest.raises(T.NonFiniteError, match=r"^step 1 \(epoch 0\)"):
        trainer.wait()
    assert trainer.step == 1 and len(trainer.history) == 1
    after = _everything(trainer)
    assert_same_tensors(after[0], before[0])
    assert_same_tensors(after[1], before[1])
    _LateFlag.ready, hook.steps = True, set()
    assert not trainer.train_step([data[4]]).skipped  # the device flag was cleared


class _CountedEvent:
    """A CUDA event's stand-in for HostFlags on a CPU: done ``lag`` queries after its record."""

    made = 0
    lag = 0

    def __init__(self):
        _CountedEvent.made += 1
        self.left = 0

    def record(self):
        self.left = _CountedEvent.lag

    def query(self):
        self.left -= 1
        return self.left < 0

    def synchronize(self):
        self.left = -1


def test_raise_reuses_its_pinned_slots_and_events(monkeypatch):
    """The CUDA path of nonfinite='raise', run on a CPU with stand-ins (a block of host floats,
    counted events): over 300 steps one block of slots and a handful of events are made, not a
    pinned tensor and an event per step; a late flag still names its step."""
    blocks = []

    def block(n):
        blocks.append(torch.zeros(n))
        return blocks[-1]

    data = batches(4)
    hook = Inject(set(), float("inf"))
    trainer = T.Trainer(*fresh(), T.TrainConfig(precision="bf16", nonfinite="raise",
                                                progress=False), hooks=[hook])
    flags = trainer._policy.host_flags = _policies.HostFlags(torch.device("cuda"), block,
                                                             _CountedEvent)
    _CountedEvent.made, _CountedEvent.lag = 0, 2  # the host sees a step two queries late
    for i in range(300):
        trainer.train_step([data[i % 4]])
    assert len(blocks) == 1 and _CountedEvent.made <= 4, (len(blocks), _CountedEvent.made)
    assert len(trainer._policy.pending) <= 3
    hook.steps = {300}
    trainer.train_step([data[0]])  # step 300 is bad; its flag reaches the host a step later
    with pytest.raises(T.NonFiniteError, match=r"^step 300 "):
        for _ in range(5):
            trainer.train_step([data[1]])
    assert trainer.step == 300 and not trainer._policy.pending
    assert len(blocks) == 1 and _CountedEvent.made <= 4
    assert flags.send(torch.ones(()))[0].item() == 1.0  # a reused slot holds the new flag


def test_a_pending_bad_step_is_reported_before_a_checkpoint_or_a_policy_change(late_flags,
                                                                               tmp_path):
    data = batches(3)
    hook = Inject({1}, float("nan"))
    trainer = T.Trainer(*fresh(), T.TrainConfig(nonfinite="raise", progress=False),
                        hooks=[hook])
    for b in data[:2]:
        trainer.train_step([b])
    with pytest.raises(T.NonFiniteError, match=r"^step 1 "):
        trainer.save_checkpoint(tmp_path / "c.pt")  # never saves the skipped steps after it
    assert not (tmp_path / "c.pt").exists() and trainer.step == 1
    hook.steps = set()
    trainer.train_step([data[1]])
    path = trainer.save_checkpoint(tmp_path / "c.pt")
    hook.steps = {2}
    _LateFlag.ready = False
    trainer.train_step([data[2]])  # bad, not yet seen
    trainer.load_checkpoint(path)  # its flag is forgotten with the steps it belonged to
    assert trainer.step == 2 and not trainer._policy.pending
    hook.steps = {2}
    trainer.train_step([data[2]])
    with pytest.raises(T.NonFiniteError, match=r"^step 2 "):
        trainer.config = dataclasses.replace(trainer.config, nonfinite="skip")
    assert trainer.config.nonfinite == "raise"


def test_raise_in_fit_puts_the_epoch_position_back():
    data = batches(4)
    trainer = T.Trainer(*fresh(), T.TrainConfig(nonfinite="raise", progress=False),
                        hooks=[Inject({2}, float("nan"))])
    with pytest.raises(T.NonFiniteError, match=r"^step 2 \(epoch 0\)"):
        trainer.fit(data)
    assert trainer.step == 2 and trainer._batches_done == 2 and trainer.epoch == 0


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


@pytest.mark.parametrize("precision,nonfinite,kind", [
    ("bf16", "skip", "adamw-fused"), ("bf16", "skip", "sgd-fused"),
    ("fp32", "skip", "sgd-foreach"), ("bf16", "raise", "adamw-fused"),
    ("bf16", "raise", "sgd-foreach"), ("bf16", "ignore", "adamw"),
    ("fp16", "skip", "sgd-fused"), ("fp16", "skip", "adamw-fused"),
    ("fp16", "skip", "sgd-foreach")])  # GradScaler's own sync for non-fused: the hand loop's
def test_no_policy_reads_a_device_value_per_step(precision, nonfinite, kind):
    """After the first step (no optimizer state yet), the trainer reads no more values back
    than the hand-written loop does (each read of a device value is a host sync on a GPU), with
    its defaults on (grad norm, memory, BatchNorm guard) and under every policy."""
    data = batches(3)
    model, _ = fresh()
    trainer = T.Trainer(model, _optimizer(kind, model),
                        T.TrainConfig(precision=precision, nonfinite=nonfinite, progress=False,
                                      nonfused_skip="copy"))  # the GPU's default, no read
    trainer.train_step([data[0]])
    trainer.train_step([data[1]])
    with ScalarReads() as reads:
        trainer.train_step([data[2]])
    assert reads.count == _hand_reads(precision, kind)
    if kind.endswith("fused"):
        assert reads.count == 0


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
    optimizer uses, even in lean mode where nothing else would unscale first."""
    data = batches(2)
    hook = _Cancel(set())
    cfg = T.TrainConfig(precision="fp16", progress=False, clip_value=1e-3,
                        track_grad_norm=False, track_memory=False)
    trainer = T.Trainer(*fresh(), cfg, hooks=[hook])
    trainer.train_step([data[0]])
    assert trainer._unscale_first
    assert hook.seen and hook.seen[0].abs().max() <= torch.tensor(1e-3).item()
    with pytest.raises(ValueError, match="reason must be a non-empty string"):
        trainer.cancel_step("")


def test_policies_have_one_interface():
    """Every policy answers the same calls; the trainer's step uses nothing else."""
    names = ("backward", "unscale_", "check", "step", "update", "forget", "scale_used",
             "checks_before_step", "unscale_first", "first_bad")
    for cls in (_policies.ScalerPolicy, _policies.SkipPolicy, _policies.RaisePolicy,
                _policies.IgnorePolicy):
        assert all(callable(getattr(cls, n)) for n in names), cls
        assert cls.name in ("scaler", "skip", "raise", "ignore")


# --- nonfused_skip: a device copy or the host's decision -----------------------------------------

def _guard_floats(trainer):
    """Floats the non-fused skip keeps aside (its flat buffers)."""
    return sum(t.numel() for group in trainer._policy._update_guard._groups
               for t in group[1:3])


@pytest.mark.parametrize("kind", ["sgd-foreach", "adamw"])
def test_nonfused_skip_copy_keeps_two_copies_and_sync_one_read_and_none(kind):
    """``"copy"``: no device value read, two flat buffers of parameters + optimizer state (what
    TrainConfig's docstring states); ``"sync"``: one read a step (a host sync on a GPU), no
    buffer at all; both end bitwise where a run without the bad batch ends."""
    data = batches(4)
    ends = {}
    for how in ("copy", "sync"):
        model, _ = fresh()
        trainer = T.Trainer(model, _optimizer(kind, model),
                            T.TrainConfig(precision="bf16", progress=False, seed=None,
                                          nonfused_skip=how), hooks=[Inject({3})])
        trainer.train_step([data[0]])
        trainer.train_step([data[1]])
        with ScalarReads() as reads:  # a finite step, as the hand loop's
            trainer.train_step([data[2]])
        extra = reads.count - _hand_reads("bf16", kind)
        state = sum(t.numel() for t in optimizer_tensors(trainer.optimizer).values())
        params = sum(p.numel() for p in model.parameters())
        if how == "copy":
            assert extra == 0 and _guard_floats(trainer) == 2 * (params + state)
        else:
            assert extra == 1 and _guard_floats(trainer) == 0
        assert trainer.train_step([data[3]]).skipped
        ends[how] = _everything(trainer)
    assert_same_tensors(ends["copy"][0], ends["sync"][0])
    assert_same_tensors(ends["copy"][1], ends["sync"][1])


def test_nonfused_skip_names_its_choices_and_capture_refuses_sync():
    with pytest.raises(ValueError, match=r"nonfused_skip must be one of 'auto', 'copy', 'sync'; "
                                         r"got 'host'"):
        T.TrainConfig(nonfused_skip="host")
    model, _ = fresh()
    trainer = T.Trainer(model, _optimizer("sgd-foreach", model),
                        T.TrainConfig(precision="bf16", progress=False, nonfused_skip="sync"))
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="nonfused_skip 'copy' for a non-fused optimizer"):
        trainer.capture(x, y)
    fused = T.Trainer(*[(m, _optimizer("adamw-fused", m)) for m in [fresh()[0]]][0],
                      T.TrainConfig(precision="bf16", progress=False, nonfused_skip="sync"))
    with pytest.raises(ValueError) as err:  # a fused optimizer skips in its kernel: no complaint
        fused.capture(x, y)
    assert "nonfused_skip" not in str(err.value)
    assert T.TrainConfig(nonfused_skip="sync").as_dict()["nonfused_skip"] == "sync"


def test_nonfused_skip_auto_is_sync_on_a_cpu_and_copy_elsewhere():
    """A read on a CPU waits for no queued work, and the copies only cost time: "auto" takes the
    host's decision there (one read a step, no copy) and the device copy on a GPU."""
    assert T.TrainConfig().nonfused_skip == "auto"
    assert resolve_nonfused_skip("auto", "cpu") == "sync"
    assert resolve_nonfused_skip("auto", "cuda") == "copy"
    assert resolve_nonfused_skip("copy", "cpu") == "copy"
    assert resolve_nonfused_skip("sync", "cuda:1") == "sync"
    with pytest.raises(ValueError, match="nonfused_skip must be one of 'auto', 'copy', 'sync'"):
        resolve_nonfused_skip("fast", "cpu")
    model, _ = fresh()
    trainer = T.Trainer(model, _optimizer("sgd-foreach", model),
                        T.TrainConfig(precision="bf16", progress=False, seed=None))
    data = batches(3)
    trainer.train_step([data[0]])
    with ScalarReads() as reads:
        trainer.train_step([data[1]])
    assert reads.count == 1 + _hand_reads("bf16", "sgd-foreach") and _guard_floats(trainer) == 0


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)  # where trainer_helpers.Inject writes its inf
        self.body = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.body(self.conv(x))


def _conv_net():
    torch.manual_seed(0)
    return _ConvNet().to(memory_format=torch.channels_last)


def test_skip_copies_keep_the_layout_of_channels_last_weights():
    """The device copy of ``nonfused_skip="copy"`` has each tensor's strides: a contiguous copy
    of a ``channels_last`` weight sends ``torch._foreach_copy_`` off its multi-tensor kernel to
    one kernel per tensor (measured: 966 copies a step, +5% on ResNet-50 on the H200), which is
    the case where source and destination strides differ. A skipped step still puts every
    parameter and momentum buffer back bitwise, and a finite one matches the hand loop."""
    x = torch.randn(6, 3, 8, 8).to(memory_format=torch.channels_last)
    y = torch.randint(0, 4, (6,))
    hand = _conv_net()
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.1, momentum=0.9)
    model = _conv_net()
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        T.TrainConfig(precision="bf16", progress=False, seed=None,
                                      nonfused_skip="copy"), hooks=[Inject({2})])
    for _ in range(2):
        trainer.train_step([(x, y)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(hand(x), y)
        loss.backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)
    assert_same_tensors(dict(model.state_dict()), dict(hand.state_dict()))
    guard = trainer._policy._update_guard
    taken = [t for group in guard._groups for t in group[0]]
    views = [v for group in guard._groups for v in group[3]] + \
        [v for group in guard._groups for v in group[4]]
    assert any(t.dim() == 4 and not t.is_contiguous() for t in taken)  # channels_last weights
    for t, v in zip(taken + taken, views):
        assert v.shape == t.shape and v.stride() == t.stride()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [trainer.optimizer.state[p]["momentum_buffer"].clone()
                for p in model.parameters()]
    assert trainer.train_step([(x, y)]).skipped
    assert_same_tensors(dict(model.state_dict()), before)
    for p, m in zip(model.parameters(), momentum):
        assert torch.equal(trainer.optimizer.state[p]["momentum_buffer"], m)


@pytest.mark.parametrize("shape,fmt,dense", [
    ((2, 3, 4, 5), torch.contiguous_format, True), ((2, 3, 4, 5), torch.channels_last, True),
    ((8, 1, 3, 3), torch.channels_last, True), ((1, 1, 1, 1), torch.contiguous_format, True),
    ((0, 3), torch.contiguous_format, False)])
def test_dense_strides_knows_permuted_layouts(shape, fmt, dense):
    from amp_lessons.train.skipsafe import dense_strides
    t = torch.empty(shape).to(memory_format=fmt) if len(shape) == 4 else torch.empty(shape)
    assert dense_strides(t) is dense
    assert dense_strides(torch.empty(4, 6)[:, ::2]) is False  # a strided slice has gaps
    assert dense_strides(torch.empty(4, 6).t()) is True


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
