"""The trainer's lazy record values (issue 22, second round: ``_compat.ScaleLog``, ``_lazy``,
``_graphed``) against the values an eager loop would have recorded, in the corners a review
found: records kept while the trainer changes under them."""
import dataclasses

import torch

from amp_lessons.train import trainer as T
from amp_lessons.train.graphed import GraphedStep
from trainer_helpers import batches, fresh


class _FakeGraph:
    """Stands in for a CUDA graph on the CPU: a replay halves GradScaler's scale in place
    without bumping its version counter, as a real replay's kernels do (no autograd there)."""

    def __init__(self, scaler):
        self.scaler = scaler

    def replay(self):
        self.scaler._scale.data.mul_(0.5)  # ``.data``: no version bump, like a graph's kernels


def test_a_replay_after_a_config_change_still_restarts_the_scale_log():
    """``GraphedStep`` must tell the trainer's CURRENT scale log that a replay moved the scale:
    a config change after ``capture`` builds a new policy (and log); an eager step after a
    replay must still record the scale GradScaler really held."""
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(precision="fp16", progress=False,
                                                  track_grad_norm=False))
    data = batches(2)
    trainer.train_step([data[0]])
    x, y = data[1]
    loss = torch.zeros(())
    graphed = GraphedStep(trainer, _FakeGraph(trainer.scaler), x, y,
                          (loss, None, None, 1.0, None), torch.zeros(1))
    trainer.config = dataclasses.replace(trainer.config, track_time=False)  # a new policy
    expected = []
    for i in range(4):
        if i % 2:
            graphed(x, y)
        else:
            expected.append(trainer.scaler.get_scale())
            record = trainer.train_step([data[0]])
            assert record.scale == expected[-1], (i, record.scale, expected[-1])


class _PeakCounter:
    """The CUDA allocator's peak counter on the CPU: a hook allocates ``sizes[step]`` bytes in
    each step; a reset forgets the peak; a read gives the peak since the last reset."""

    def __init__(self, monkeypatch):
        self.peak = 0
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", self.stats)

    def reset(self, device=None):
        self.peak = 0

    def stats(self, device=None):
        return {"allocated_bytes": {"all": {"peak": self.peak}}}


class _Allocates(T.Hooks):
    def __init__(self, counter, sizes):
        self.counter, self.sizes = counter, sizes

    def after_backward(self, trainer, micro_step):
        self.counter.peak = max(self.counter.peak, self.sizes(trainer.step))


def test_records_kept_across_a_checkpoint_load_keep_their_own_peak_memory(monkeypatch, tmp_path):
    """A record of a memory window still open when a checkpoint is loaded reads the peak of
    its own steps, not the peak of the steps trained after the load."""
    counter = _PeakCounter(monkeypatch)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False),
                        hooks=[_Allocates(counter, lambda step: 100 if step < 2 else 5000)])
    trainer._track_memory = True  # as on a GPU (the allocator is patched)
    data = batches(4)
    path = trainer.save_checkpoint(tmp_path / "start.pt")
    kept = [trainer.train_step([b]) for b in data[:3]]  # one open window, unread
    trainer.load_checkpoint(path)
    trainer._track_memory = True
    trainer.hooks[0].sizes = lambda step: 100
    for b in data[:2]:
        trainer.train_step([b])
    assert [r.peak_memory_bytes for r in kept] == [5000] * 3
    assert trainer.history[-1].peak_memory_bytes == 100


def test_an_evaluation_between_steps_is_not_counted_in_the_steps_peak_memory(monkeypatch):
    """``evaluate`` after a ``fit`` stopped by ``max_steps`` (its window open, unread): the
    training records read afterwards show their own steps' peak, not the evaluation's."""
    counter = _PeakCounter(monkeypatch)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False),
                        hooks=[_Allocates(counter, lambda step: 100)])
    trainer._track_memory = True  # as on a GPU (the allocator is patched)

    def evaluation_allocates(module, args, output):
        if not module.training:
            counter.peak = max(counter.peak, 9000)

    model.register_forward_hook(evaluation_allocates)
    data = batches(4)
    trainer.fit(data, max_steps=2)
    trainer.evaluate(data)
    assert [r.peak_memory_bytes for r in trainer.history] == [100, 100]
    trainer.fit(data, max_steps=1)
    assert trainer.history[-1].peak_memory_bytes == 100


def test_steps_trained_with_track_memory_off_do_not_count_in_an_earlier_window(monkeypatch):
    """``track_memory`` turned off, then on again (``trainer.config = ...``): the records kept
    from before show their own steps' peak, not that of the untracked steps in between."""
    counter = _PeakCounter(monkeypatch)
    model, opt = fresh()
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False),
                        hooks=[_Allocates(counter, lambda step: 5000 if step in (2, 3) else 100)])
    trainer._track_memory = True  # as on a GPU (the allocator is patched)
    data = batches(4)
    kept = [trainer.train_step([b]) for b in data[:2]]
    trainer.config = dataclasses.replace(trainer.config, track_memory=False)
    untracked = [trainer.train_step([b]) for b in data[2:]]
    trainer.config = dataclasses.replace(trainer.config, track_memory=True)
    trainer._track_memory = True
    later = trainer.train_step([data[0]])
    assert [r.peak_memory_bytes for r in untracked] == [None, None]
    assert [r.peak_memory_bytes for r in kept] == [100, 100]
    assert later.peak_memory_bytes == 100
