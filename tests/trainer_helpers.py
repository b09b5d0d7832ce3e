"""Shared fixtures of the trainer, checkpoint and records tests: a tiny BatchNorm model, data,
and a hook that injects inf/NaN into a gradient."""
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.train import trainer as T

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


class Inject(T.Hooks):
    """Writes ``value`` into a gradient on the steps listed (the gradients are still scaled)."""

    def __init__(self, steps, value=float("inf")):
        self.steps, self.value = set(steps), value

    def after_backward(self, trainer, micro_step):
        if trainer.step in self.steps:
            trainer.model.conv.weight.grad[0, 0, 0, 0] = self.value


class ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ``.item()``/``bool()`` reads (aten._local_scalar_dense): on a GPU each is a sync."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
