"""The trainer with models, optimizers, schedulers and losses the course itself does not use (an
outside review re-ran it that way): a skipped step leaves everything as it was, whatever the
optimizer keeps and however it updates it; what the trainer cannot drive is refused up front."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.train import trainer as T
from amp_lessons.train.skipsafe import stateful_modules


def cfg(**kw):
    kw.setdefault("precision", "fp32")
    return T.TrainConfig(progress=False, seed=None, **kw)


def data(n=4, seed=0, rows=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(n)]


def poisoned(batch):
    x, y = batch
    x = x.clone()
    x[0, 0] = float("nan")
    return x, y


def everything(model, opt):
    """Model tensors, optimizer state (tensors and numbers) and param-group values."""
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for k, v in opt.state.get(p, {}).items():
            out[f"s{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    for i, g in enumerate(opt.param_groups):
        out.update({f"g{i}.{k}": v for k, v in g.items() if k != "params"})
    return out


def assert_same(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


class OutOfPlaceMomentum(torch.optim.Optimizer):
    """A third-party style optimizer: it replaces its state tensors each step."""

    def __init__(self, params, lr=0.1, beta=0.9, python_counter=False, group_counter=False):
        super().__init__(params, dict(lr=lr, beta=beta))
        self.python_counter, self.group_counter = python_counter, group_counter

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            if self.group_counter:
                g["steps"] = g.get("steps", 0) + 1
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0 if self.python_counter else torch.zeros(())
                    st["buf"] = torch.zeros_like(p)
                st["step"] = st["step"] + 1  # a new int or a new tensor
                st["buf"] = g["beta"] * st["buf"] + p.grad
                p.add_(st["buf"], alpha=-g["lr"])


@pytest.mark.parametrize("python_counter,group_counter", [(False, False), (True, False),
                                                          (False, True)])
def test_a_skipped_step_undoes_an_optimizer_that_replaces_its_state(python_counter, group_counter):
    """A skipped step leaves any optimizer as it was: out-of-place state
    (``state["buf"] = beta * buf + g``), Python counters, param-group counters."""
    batches = data(4)
    ends = {}
    for run in ("skipped", "control"):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = OutOfPlaceMomentum(model.parameters(), python_counter=python_counter,
                                 group_counter=group_counter)
        trainer = T.Trainer(model, opt, cfg())
        trainer.train_step([batches[0]])
        trainer.train_step([batches[1]])
        if run == "skipped":
            before = everything(model, opt)
            assert trainer.train_step([poisoned(batches[2])]).skipped
            assert_same(before, everything(model, opt))
        trainer.train_step([batches[3]])
        ends[run] = everything(model, opt)
    assert_same(ends["skipped"], ends["control"])
    assert all(torch.isfinite(v).all() for v in ends["skipped"].values()
               if isinstance(v, torch.Tensor))


def test_state_a_skipped_step_makes_is_dropped():
    """A parameter whose first gradient comes in a skipped step: Adam makes its state in that
    step; the step is undone, so the state must not exist afterwards."""
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)
            self.use_b = False

        def forward(self, x):
            return self.a(x) + (self.b(x) if self.use_b else 0)

    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    trainer = T.Trainer(model, opt, cfg(track_grad_norm=False))
    batches = data(3)
    trainer.train_step([batches[0]])
    trainer.train_step([batches[1]])
    before = everything(model, opt)
    model.use_b = True
    assert trainer.train_step([poisoned(batches[2])]).skipped
    assert not opt.state.get(model.b.weight)
    assert_same(before, everything(model, opt))


def test_switching_to_skip_primes_fused_sgd_and_refuses_a_damped_one():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    trainer = T.Trainer(model, opt, cfg(nonfinite="ignore"))
    assert not opt.state
    trainer.config = cfg(nonfinite="skip")
    assert all(torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p))
               for p in model.parameters())
    batches = data(2)
    assert trainer.train_step([poisoned(batches[0])]).skipped
    trainer.train_step([batches[1]])
    assert all(torch.isfinite(p).all() for p in model.parameters())

    other = nn.Linear(4, 3)
    damped = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9, dampening=0.5, fused=True)
    trainer = T.Trainer(other, damped, cfg(nonfinite="ignore"))
    with pytest.raises(ValueError, match="dampening must be 0 for fused SGD"):
        trainer.config = cfg(nonfinite="skip")
    assert trainer.config.nonfinite == "ignore"  # refused before anything changed


class Norms(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        if kind == "spectral":
            self.lin = nn.utils.parametrizations.spectral_norm(self.lin)
        elif kind == "spectral-hook":
            self.lin = nn.utils.spectral_norm(self.lin)
        self.norm = nn.InstanceNorm1d(6, track_running_stats=True) if kind == "instance" \
            else nn.Identity()
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.norm(self.lin(x).unsqueeze(-1).expand(-1, -1, 2)).mean(-1))


@pytest.mark.parametrize("kind", ["instance", "spectral", "spectral-hook"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_skipped_step_leaves_every_running_statistic(kind, precision):
    """InstanceNorm's running statistics and spectral norm's vectors used to move (to NaN) on
    a skipped step: only BatchNorm was guarded."""
    torch.manual_seed(0)
    model = Norms(kind)
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        cfg(precision=precision))
    batches = data(2)
    trainer.train_step([batches[0]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert trainer.train_step([poisoned(batches[1])]).skipped
    after = model.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_stateful_modules_names_the_layers_that_write_buffers():
    bn, inorm, plain = nn.BatchNorm1d(3), nn.InstanceNorm1d(3, track_running_stats=True), \
        nn.InstanceNorm1d(3)
    spectral = nn.utils.parametrizations.spectral_norm(nn.Linear(3, 3))
    hooked = nn.utils.spectral_norm(nn.Linear(3, 3))
    model = nn.Sequential(bn, inorm, plain, spectral, hooked, nn.Linear(3, 3))
    found = stateful_modules(model)
    assert bn in found and inorm in found and hooked in found and plain not in found
    assert any(type(m).__name__ == "_SpectralNorm" for m in found)
    assert model[5] not in found


def test_a_scheduler_that_needs_a_metric_or_another_optimizer_is_refused():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau.step needs metrics: pass "
                                         r"scheduler=None and call scheduler.step\(metrics\)"):
        T.Trainer(model, opt, cfg(), scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler must schedule the trainer's optimizer"):
        T.Trainer(model, opt, cfg(), scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(ValueError, match="scheduler must be None or have a step"):
        T.Trainer(model, opt, cfg(), scheduler=object())


def test_a_scheduler_that_raises_after_the_step_leaves_the_step_recorded():
    """OneCycleLR raises once stepped past total_steps: the optimizer step is applied, so it
    is counted and recorded, then the error is raised."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=2)
    trainer = T.Trainer(model, opt, cfg(), scheduler=sched)
    batches = data(3)
    trainer.train_step([batches[0]])
    trainer.train_step([batches[1]])
    weight = model.weight.clone()
    with pytest.raises(RuntimeError, match=r"scheduler.step\(\) raised after step 2's optimizer "
                                           r"step; that step is applied and recorded"):
        trainer.train_step([batches[2]])
    assert trainer.step == 3 and len(trainer.history) == 3
    assert not torch.equal(weight, model.weight)


def test_loss_reductions_the_trainer_can_use():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"loss_fn.reduction must be one of mean, sum .*"
                                         r"got 'none'"):
        T.Trainer(model, opt, cfg(), loss_fn=nn.CrossEntropyLoss(reduction="none"))
    batches = data(3)
    summed = T.Trainer(model, opt, cfg(), loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    expected = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in batches) / 24
    assert summed.evaluate(batches)["loss"] == pytest.approx(expected, rel=1e-6)


def test_evaluate_gives_no_accuracy_where_there_are_no_classes():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg(),
                        loss_fn=nn.MSELoss())
    batches = [(x, torch.randn(len(x), 1)) for x, _ in data(2)]
    trainer.train_step([batches[0]])
    result = trainer.evaluate(batches)
    assert result["accuracy"] is None and result["examples"] == 16


def test_inputs_may_be_dicts_and_one_pair_is_named():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

        def forward(self, inputs):
            return self.a(inputs["x"]) + self.b(inputs["extra"])

    torch.manual_seed(0)
    model = TwoInputs()
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg())
    x, y = data(1)[0]
    record = trainer.train_step([({"x": x, "extra": torch.randn(8, 2)}, y)])
    assert not record.skipped
    with pytest.raises(ValueError, match=r"micro_batches must be a list of \(x, y\) pairs.*"
                                         r"pass \[\(x, y\)\]"):
        trainer.train_step((x, y))
    with pytest.raises(ValueError, match="x must be a tensor, or a tuple, list or dict of "
                                         "tensors; got str"):
        trainer.train_step([("text", y)])


def test_sparse_gradients_are_checked_and_skipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        cfg(track_grad_norm=False))
    x = torch.randint(0, 10, (8, 2))
    y = torch.randint(0, 3, (8,))
    assert not trainer.train_step([(x, y)]).skipped
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model[0].weight.register_hook(lambda g: g * float("inf"))
    assert trainer.train_step([(x, y)]).skipped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_nonfinite_is_spelled_freely():
    assert T.TrainConfig(nonfinite=" SKIP ").nonfinite == "skip"


# torch.ao.quantization's own deprecation notices are not about this test
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:Please use quant_min:UserWarning")
@pytest.mark.parametrize("bad_step", [0, 2])
def test_quantization_aware_training_observers_are_put_back(bad_step):
    """QAT's observers resize their per-channel statistics in the first forward: a skipped
    first step puts back even their shapes (the host reads that step's flag), a later one their
    values on the device."""
    quant = pytest.importorskip("torch.ao.quantization")  # deprecated in torch: may go
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).train()
    model.qconfig = quant.get_default_qat_qconfig("x86")
    model = quant.prepare_qat(model)
    trainer = T.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg())
    batches = data(4)
    for batch in batches[:bad_step]:
        trainer.train_step([batch])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert trainer.train_step([poisoned(batches[bad_step])]).skipped
    after = model.state_dict()
    for k in before:
        assert before[k].shape == after[k].shape and torch.equal(before[k], after[k]), k
    trainer.train_step([batches[3]])  # trains on from there
    assert all(torch.isfinite(p).all() for p in model.parameters())
