"""Each module's own train/eval mode survives an evaluation (a BatchNorm frozen on purpose)."""
import pytest
import torch
from torch import nn

from amp_lessons.numerics.modes import kept_modes, restore_modes, saved_modes
from amp_lessons.train.trainer import TrainConfig, Trainer


def _frozen_bn_net():
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    net.train()
    net[1].eval()  # a fine-tune: the BatchNorm keeps its statistics
    return net


def test_saved_modes_round_trip_per_module():
    net = _frozen_bn_net()
    saved = saved_modes(net)
    net.train()
    assert net[1].training
    restore_modes(saved)
    assert net.training and not net[1].training and net[0].training


def test_kept_modes_restores_after_an_error():
    net = _frozen_bn_net()
    with pytest.raises(RuntimeError):
        with kept_modes(net, False):
            assert not any(m.training for m in net.modules())
            raise RuntimeError("boom")
    assert net.training and not net[1].training


def test_saved_modes_refuses_a_non_module():
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        saved_modes("net")


def test_trainer_evaluate_keeps_a_frozen_batchnorm_frozen():
    torch.manual_seed(0)
    net = _frozen_bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    trainer = Trainer(net, opt, TrainConfig(precision="fp32", progress=False))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    trainer.evaluate([(x, y)])
    assert net.training and not net[1].training
    before = net[1].running_mean.clone()
    trainer.train_step([(x, y)])
    assert torch.equal(net[1].running_mean, before)  # still frozen: statistics did not move
