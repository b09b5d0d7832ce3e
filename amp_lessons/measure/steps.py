"""Step builders: the configuration's model and optimizer, and the training step a row times
(``hand_step``: the canonical AMP step written out; ``trainer_step``: the course's trainer), and
``cuda_graph_step``, the package's one CUDA-graph capture of a whole training step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.train import trainer as _trainer
from amp_lessons.train.skipsafe import prime_momentum_buffers
from amp_lessons.numerics.precision import autocast_for
from amp_lessons.measure.config import MODELS, BenchConfig


def build_model(config: BenchConfig, device, in_channels: int = 3) -> nn.Module:
    """The configuration's model on ``device`` (channels_last if asked), in training mode."""
    model = MODELS[config.model](num_classes=config.num_classes, checkpoint=config.checkpoint,
                                 in_channels=in_channels)
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model.train()


def build_optimizer(config: BenchConfig, params: Iterable[torch.Tensor],
                    prime_momentum: bool = True) -> torch.optim.Optimizer:
    """SGD (momentum 0.9) or Adam/AdamW with the configuration's kernels, eps and amsgrad.

    ``prime_momentum``: give fused SGD zero momentum buffers up front
    (``train.skipsafe.prime_momentum_buffers``), so a first step that GradScaler skips cannot leave
    them uninitialised; the updates are the same as without priming.
    """
    if not isinstance(prime_momentum, bool):
        raise ValueError(f"prime_momentum must be True or False; got {prime_momentum!r}")
    kwargs: Dict[str, object] = {}
    if config.impl == "for-loop":
        kwargs["foreach"] = False
    elif config.impl == "foreach":
        kwargs["foreach"] = True
    elif config.impl == "fused":
        kwargs["fused"] = True
    if config.optimizer == "sgd":
        sgd = torch.optim.SGD(params, lr=config.lr or 0.1, momentum=0.9, **kwargs)
        if prime_momentum and config.impl == "fused":
            prime_momentum_buffers(sgd)
        return sgd
    if config.cuda_graph:
        kwargs["capturable"] = True
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=config.lr or 1e-3, eps=config.eps, amsgrad=config.amsgrad, **kwargs)



@dataclass
class Step:
    """A training step in three parts: ``forward(x, y) -> loss``, ``backward(loss)``,
    ``update()`` (optimizer step, scaler update, zero_grad). ``step(x, y)`` runs all three and
    returns the detached loss; with ``trainer`` set it calls ``trainer.train_step`` instead."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    forward: Callable
    backward: Callable
    update: Callable
    trainer: object = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor):
        if self.trainer is not None:
            return _RecordLoss(self.trainer.train_step([(x, y)]))
        loss = self.forward(x, y)
        self.backward(loss)
        self.update()
        return loss.detach()


class _RecordLoss:
    """A StepRecord's loss, read (with its host sync) only when converted with ``float()``."""

    def __init__(self, record):
        self.record = record

    def __float__(self) -> float:
        return float(self.record.loss)


def hand_step(model: nn.Module, optimizer: torch.optim.Optimizer, precision: str, device,
              loss_fn: Callable = F.cross_entropy, cache_enabled: bool = True,
              mark_step: bool = False) -> Step:
    """The canonical AMP step written out: autocast forward, scaled backward, step, update.

    ``scaler`` is enabled for fp16 only; for fp32/tf32/bf16 it passes everything through.
    ``mark_step`` tells torch.compile's CUDA graphs that a new iteration begins.
    """
    device_type = torch.device(device).type
    scaler = torch.amp.GradScaler(device_type, enabled=precision == "fp16")

    def forward(x, y):
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast_for(precision, device_type, cache_enabled=cache_enabled):
            return loss_fn(model(x), y)

    def backward(loss):
        scaler.scale(loss).backward()

    def update():
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return Step(model, optimizer, scaler, forward, backward, update)


def trainer_step(model: nn.Module, optimizer: torch.optim.Optimizer, config: BenchConfig,
                 device) -> Step:
    """A ``Step`` that calls the shared ``Trainer.train_step`` (lesson 02's trainer), with its
    grad-norm and peak-memory tracking as ``config.trainer_tracking`` says."""
    tcfg = _trainer.TrainConfig(precision=config.precision, channels_last=config.channels_last,
                                progress=False, seed=None,
                                track_grad_norm=config.trainer_tracking,
                                track_memory=config.trainer_tracking)
    trainer = _trainer.Trainer(model, optimizer, tcfg, device=device)
    base = hand_step(model, optimizer, config.precision, device)
    return Step(model, optimizer, trainer.scaler, base.forward, base.backward, base.update,
                trainer=trainer)


def cuda_graph_step(step: Step, x: torch.Tensor, y: torch.Tensor, warmup: int = 3) -> Callable:
    """Capture one whole training step in a CUDA graph; returns ``replay(x, y) -> loss``.

    The graph reads ``x`` and ``y`` from their addresses at capture time, so replays train on
    those same tensors (copy new data into them to change it). Warm-up runs on a side stream,
    as PyTorch's CUDA-graph recipe does, so lazily created state exists before capture.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step(x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    step.optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(x, y)

    def replay(x_in: torch.Tensor, y_in: torch.Tensor) -> torch.Tensor:
        if x_in.data_ptr() != x.data_ptr() or y_in.data_ptr() != y.data_ptr():
            x.copy_(x_in)
            y.copy_(y_in)
        graph.replay()
        return static_loss

    replay.graph = graph  # keep it alive with the callable
    return replay


