"""The trainer's step time (issue 22, third round): one clock mark a step, chained (a step's
``time_s`` is its period, from the previous step's end to its own), a start mark where the chain
is broken, and on CUDA events reused from a pool. The CUDA path's bookkeeping runs on the CPU
with stand-in events (``FakeEvent``) on a fake device clock."""
import itertools

import pytest
import torch

from amp_lessons.train import trainer as T
from amp_lessons.train.graphed import GraphedStep
from amp_lessons.train.lazy import EventSpan, StepClock
from trainer_helpers import assert_same_tensors, batches, fresh


class FakeEvent:
    """A CUDA event on the CPU: ``record`` stamps the next tick of a shared fake device clock
    (1 ms apart); counts records, syncs and reads."""

    ticks = itertools.count(1)
    made = records = syncs = 0

    def __init__(self):
        FakeEvent.made += 1
        self.t = None

    def record(self, stream=None):
        FakeEvent.records += 1
        self.t = next(FakeEvent.ticks)

    def synchronize(self):
        FakeEvent.syncs += 1

    def elapsed_time(self, end):
        assert self.t is not None and end.t is not None and end.t > self.t
        return float(end.t - self.t)  # milliseconds


def cuda_clock(trainer):
    """Give ``trainer`` a CUDA-style clock with stand-in events; returns it."""
    trainer._clock = StepClock(True, FakeEvent)
    return trainer._clock


def make_trainer(**flags):
    model, opt = fresh()
    flags.setdefault("progress", False)
    return T.Trainer(model, opt, T.TrainConfig(**flags))


def marks(step):
    """Event records made by ``step()``."""
    before = FakeEvent.records
    step()
    return FakeEvent.records - before


def test_step_times_are_chained_periods_on_the_cuda_path():
    """One event a step; each record spans the previous step's end to its own, so the periods
    add up to the span from the first start to the last end; a start mark only for the first
    step and for the first after evaluate, a checkpoint save or load, a new epoch, a config or
    scaler change, a cancelled step."""
    trainer = make_trainer()
    clock = cuda_clock(trainer)
    data = batches(4)
    counts = [marks(lambda: trainer.train_step([data[0]])) for _ in range(5)]
    assert counts == [2, 1, 1, 1, 1]
    spans = [r.__dict__["_time_s"] for r in trainer.history]
    assert all(isinstance(s, EventSpan) for s in spans)
    first, last = spans[0].start[0].t, spans[-1].end[0].t
    assert [s.start is p.end for s, p in zip(spans[1:], spans)] == [True] * 4
    times = trainer.history.columns()["time_s"]
    assert sum(times) == pytest.approx((last - first) / 1e3) and all(t == 1e-3 for t in times)

    def after(event):
        event()
        return marks(lambda: trainer.train_step([data[1]]))

    assert after(lambda: None) == 1
    assert after(lambda: trainer.evaluate(data)) == 2
    assert after(lambda: trainer.state_dict()) == 2
    assert after(lambda: trainer.set_scaler(trainer.config.scaler)) == 2
    assert after(lambda: setattr(trainer, "config", trainer.config)) == 2
    before = FakeEvent.records
    trainer.fit(data, epochs=2, eval_loader=None)  # each epoch's first step marks its start
    assert FakeEvent.records - before == 2 * (4 + 1)
    assert clock.last is not None


def test_a_cancelled_or_failed_step_breaks_the_chain_and_a_load_does_too(tmp_path):
    class Cancel(T.Hooks):
        fail = False

        def before_step(self, trainer):
            if trainer.step == 1:
                trainer.cancel_step("test")

        def after_backward(self, trainer, micro_step):
            if self.fail:
                raise RuntimeError("a bad micro-batch")

    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False), hooks=[Cancel()])
    cuda_clock(trainer)
    data = batches(3)
    path = trainer.save_checkpoint(tmp_path / "c.pt")
    assert [marks(lambda: trainer.train_step([b])) for b in data] == [2, 1, 2]
    assert trainer.history[1].skipped
    Cancel.fail = True
    with pytest.raises(RuntimeError, match="a bad micro-batch"):
        trainer.train_step([data[0]])
    Cancel.fail = False
    assert marks(lambda: trainer.train_step([data[0]])) == 2
    trainer.load_checkpoint(path)
    assert marks(lambda: trainer.train_step([data[0]])) == 2
    assert all(t > 0 for t in trainer.history.columns()["time_s"])


def test_events_are_reused_from_a_small_pool():
    """1,000 steps whose records are read every 100 (by ``time_s`` or ``History.materialize``)
    create about 100 events, not 2,000; an end event shared by two records goes back to the
    pool only when both have read it."""
    trainer = make_trainer(track_grad_norm=False)
    clock = cuda_clock(trainer)
    x, y = batches(1)[0]
    for i in range(1, 1001):
        trainer.train_step([(x, y)])
        if i % 200 == 100:
            [r.time_s for r in trainer.history[-100:]]
        elif i % 200 == 0:
            trainer.history.materialize()
    assert clock.created <= 102, clock.created
    assert len(clock.pool) >= 99
    a = trainer.train_step([(x, y)])
    b = trainer.train_step([(x, y)])
    shared, last = b.__dict__["_time_s"].start, b.__dict__["_time_s"].end
    assert shared is a.__dict__["_time_s"].end

    def pooled(cell):
        return any(c is cell for c in clock.pool)

    assert b.time_s > 0 and not pooled(shared)  # ``a`` still needs it
    assert a.time_s > 0 and pooled(shared)
    assert not pooled(last)  # the chain (the next step's start) still needs it
    trainer.evaluate(batches(1))  # breaks the chain: its last user is gone
    assert pooled(last)


def test_materialize_waits_for_the_last_event_only():
    trainer = make_trainer()
    cuda_clock(trainer)
    for x, y in batches(5):
        trainer.train_step([(x, y)])
    syncs = FakeEvent.syncs
    trainer.history.materialize()
    assert FakeEvent.syncs - syncs == 1


def test_cpu_step_times_are_chained_periods(monkeypatch):
    """On a CPU the same meaning with ``time.perf_counter``: one call a step (two where the
    chain is broken), periods adding up to the span."""
    import amp_lessons.train.lazy as lazy
    calls = []

    class FakeTime:
        @staticmethod
        def perf_counter():
            calls.append(len(calls) * 0.5)
            return calls[-1]

    monkeypatch.setattr(lazy, "time", FakeTime)
    trainer = make_trainer()
    for x, y in batches(4):
        trainer.train_step([(x, y)])
    assert len(calls) == 5
    times = [r.time_s for r in trainer.history]
    assert times == [0.5] * 4 and sum(times) == calls[-1] - calls[0]
    trainer.evaluate(batches(1))
    trainer.train_step(batches(1))
    assert len(calls) == 7 and trainer.history[-1].time_s == 0.5


def test_the_step_time_changes_no_bit_trained():
    runs = {}
    for timed in ("cuda", "cpu", None):
        trainer = make_trainer(precision="fp16", track_time=timed is not None)
        if timed == "cuda":
            cuda_clock(trainer)
        trainer.fit(batches(4), epochs=2)
        runs[timed] = trainer.model.state_dict()
    assert_same_tensors(runs["cuda"], runs[None])
    assert_same_tensors(runs["cpu"], runs[None])


class _FakeGraph:
    def replay(self):
        pass


def test_replays_of_a_captured_step_mark_one_event_each():
    """``Trainer.capture``'s replays (``GraphedStep``) keep the same chain: one event a
    replay, a start mark for the first one."""
    trainer = make_trainer(track_grad_norm=False)
    cuda_clock(trainer)
    x, y = batches(1)[0]
    graphed = GraphedStep(trainer, _FakeGraph(), x, y, (torch.zeros(()), None, None, 1.0, None),
                          torch.zeros(1))
    trainer._clock.reset()  # as capture leaves it
    assert [marks(lambda: graphed(x, y)) for _ in range(3)] == [2, 1, 1]
    assert marks(lambda: trainer.train_step([(x, y)])) == 1
    assert [r.time_s for r in trainer.history] == [1e-3] * 4


@pytest.mark.parametrize("cuda", [True, False])
def test_a_reset_inside_a_step_leaves_its_time_unknown(cuda):
    """A hook that evaluates in the middle of a step breaks the chain there: that step's time
    reads None (its start is gone), the next one is timed from its own start."""
    class Evaluates(T.Hooks):
        on = True

        def before_step(self, trainer):
            if self.on:
                trainer.evaluate(batches(1))

    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False), hooks=[Evaluates()])
    if cuda:
        clock = cuda_clock(trainer)
    trainer.train_step(batches(1))
    Evaluates.on = False
    trainer.train_step(batches(1))
    trainer.train_step(batches(1))
    assert [r.time_s is None for r in trainer.history.materialize()] == [True, False, False]
    if cuda:
        assert len(clock.pool) + 1 == clock.created  # nothing lost but the chain's
