"""``fit``'s place in the epoch and resuming, found by an outside review: a step is counted
in the epoch when it is applied (a checkpoint saved from ``after_step`` resumes exactly), a
one-shot iterator goes on where an error left it, a DataLoader's ``iter()`` does not move the
resumed run's random numbers, and a tensor learning rate is recorded as it was."""
import pytest
import torch
from torch import nn

from amp_lessons.train import trainer as T


def mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 4))


def data(n=8, rows=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g))
            for _ in range(n)]


def new(model=None, hooks=(), **kw):
    model = model if model is not None else mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return T.Trainer(model, opt, T.TrainConfig(progress=False, **kw), hooks=hooks)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(),
                                                  b.model.state_dict().values()))


def test_a_checkpoint_saved_from_after_step_resumes_exactly(tmp_path):
    path = tmp_path / "at4.pt"

    class SaveAt(T.Hooks):
        def after_step(self, trainer, record):
            if record.step == 3:
                trainer.save_checkpoint(path)

    batches = data(8)
    whole = new(hooks=[SaveAt()])
    whole.fit(batches)
    assert torch.load(path, weights_only=True)["batches_done"] == 4
    resumed = new()
    resumed.load_checkpoint(path)
    resumed.fit(batches)
    assert resumed.step == whole.step == 8 and same(whole, resumed)


def test_an_after_step_hook_that_raises_leaves_its_step_counted_in_the_epoch():
    class Fails(T.Hooks):
        armed = True

        def after_step(self, trainer, record):
            if self.armed and record.step == 2:
                raise RuntimeError("logging failed")

    batches = data(6)
    trainer = new(hooks=[Fails()])
    with pytest.raises(RuntimeError, match="logging failed"):
        trainer.fit(batches)
    assert trainer.step == 3
    trainer.hooks[0].armed = False
    trainer.fit(batches)  # finishes the epoch: 3 more steps, not 4
    assert trainer.step == 6 and trainer.history.epochs[-1]["steps"] == 3


def test_a_generator_goes_on_where_an_error_left_it():
    """After an exception, the same generator is not skipped into: the batches it gave are
    gone from it (they were trained, or belong to the failed step)."""
    class Stop(T.Hooks):
        armed = True

        def before_step(self, trainer):
            if self.armed and trainer.step == 4:
                raise KeyboardInterrupt

    batches = data(10)
    trainer = new(hooks=[Stop()])
    gen = (b for b in batches)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(gen)
    assert trainer.step == 4
    trainer.hooks[0].armed = False
    trainer.fit(gen)
    assert trainer.step == 9  # every batch but the interrupted step's


def test_resuming_with_a_dataloader_and_dropout_is_exact(tmp_path):
    """``iter(DataLoader)`` draws its base seed from the global generator: redrawing the used
    batches must not shift the resumed run's dropout masks."""
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 4, (48,), generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    whole = new(mlp(dropout=0.5))
    whole.fit(loader, epochs=2)
    stopped = new(mlp(dropout=0.5))
    stopped.fit(loader, max_steps=5)
    stopped.save_checkpoint(tmp_path / "mid.pt")
    resumed = new(mlp(dropout=0.5))
    resumed.load_checkpoint(tmp_path / "mid.pt")
    resumed.fit(loader, epochs=2)
    assert resumed.step == whole.step and same(whole, resumed)


def test_a_tensor_learning_rate_is_recorded_as_it_was_during_the_step():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False), scheduler=sched)
    now = []
    for batch in data(4):
        now.append(float(trainer.train_step([batch]).lr))
    late = [float(v) for v in trainer.history.columns()["lr"]]
    expected = [0.01 * 0.5 ** i for i in range(4)]
    assert now == pytest.approx(expected) and late == pytest.approx(expected)


def test_cancel_step_outside_a_step_is_refused():
    class Late(T.Hooks):
        def after_step(self, trainer, record):
            trainer.cancel_step("too late")

    trainer = new(hooks=[Late()])
    with pytest.raises(ValueError, match="cancel_step works only during a step"):
        trainer.train_step([data(1)[0]])
    with pytest.raises(ValueError, match="cancel_step works only during a step"):
        new().cancel_step("between steps")


def test_a_cancelled_nan_step_under_raise_raises_nothing_and_is_not_sticky():
    """A hook that cancels the step it found bad: under nonfinite='raise' that step never
    happened, so its flag neither raises later nor keeps later steps skipped."""
    class CancelBad(T.Hooks):
        def before_step(self, trainer):
            if trainer.step == 1:
                trainer.cancel_step("bad batch, cancelled by hook")

    batches = data(4)
    x, y = batches[1]
    bad = x.clone()
    bad[0, 0] = float("nan")
    trainer = new(hooks=[CancelBad()], nonfinite="raise")
    trainer.train_step([batches[0]])
    assert trainer.train_step([(bad, y)]).skip_reason == "bad batch, cancelled by hook"
    for batch in batches[2:]:
        assert not trainer.train_step([batch]).skipped
    trainer.wait()
    assert trainer.step == 4


def test_arguments_that_are_not_what_the_trainer_takes_are_named():
    with pytest.raises(ValueError, match=r"hooks must be a list of Hooks instances; got one Hooks "
                                         r"instance: pass hooks=\[it\]"):
        new(hooks=T.Hooks())
    assert new(hooks=None).hooks == []
    trainer = new()
    batches = data(3)
    with pytest.raises(ValueError, match=r"micro_batches must be a list of \(x, y\) pairs; got "
                                         r"generator"):
        trainer.train_step(b for b in batches)
    x, y = batches[0]
    with pytest.raises(ValueError, match=r"micro-batch 0 is a tuple of length 3"):
        trainer.train_step([(x, y, y)])
    with pytest.raises(ValueError, match=r"loader must yield \(x, y\) pairs; got a tuple of "
                                         r"length 1"):
        trainer.evaluate([(x,)])
    with pytest.raises(ValueError, match="loader must be iterable"):
        trainer.fit(None)
    assert trainer.step == 0


def test_a_compiled_models_checkpoint_loads_into_the_plain_model(tmp_path):
    """``torch.compile`` prefixes its state dict's keys with ``_orig_mod.``: the trainer saves
    and loads the module it wraps, so either side can resume the other."""
    compiled = new(torch.compile(mlp(seed=1)))
    compiled.save_checkpoint(tmp_path / "c.pt")
    plain = new(mlp(seed=2))
    plain.load_checkpoint(tmp_path / "c.pt")
    assert all(torch.equal(a, b) for a, b in zip(compiled.model._orig_mod.state_dict().values(),
                                                  plain.model.state_dict().values()))
    plain.save_checkpoint(tmp_path / "p.pt")
    new(torch.compile(mlp(seed=3))).load_checkpoint(tmp_path / "p.pt")
