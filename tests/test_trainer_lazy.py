"""The trainer's lazy record values (issue 22, second round: ``_compat.ScaleLog``, ``_lazy``,
``_graphed``) against the values an eager loop would have recorded, in the corners a review
found: records kept while the trainer changes under them."""
import dataclasses

import torch

from amp_lessons import trainer as T
from amp_lessons._graphed import GraphedStep
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
