"""Models the lessons train.

Small models for the digits set (lessons 01-03): ``SimpleNet`` (the articles' one Linear layer,
adapted to 64 inputs and 10 classes), ``MLP`` and ``SmallCNN`` (BatchNorm included, so the
trainer's skip-safe BatchNorm has something to protect).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}")


class SimpleNet(nn.Module):
    """The articles' ``SimpleNet``: a single Linear layer, here 64 digit pixels -> 10 classes."""

    def __init__(self, in_features: int = 64, num_classes: int = 10):
        super().__init__()
        _check_positive("in_features", in_features)
        _check_positive("num_classes", num_classes)
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """A small multilayer perceptron: Linear -> ReLU blocks, then a Linear classifier."""

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (256, 128),
                 num_classes: int = 10):
        super().__init__()
        _check_positive("in_features", in_features)
        _check_positive("num_classes", num_classes)
        layers, width = [], in_features
        for h in hidden:
            _check_positive("hidden width", h)
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """A small CNN for 1-channel images (digits at 32x32): conv-BN-ReLU x3, pooling, Linear."""

    def __init__(self, in_channels: int = 1, width: int = 32, num_classes: int = 10):
        super().__init__()
        _check_positive("in_channels", in_channels)
        _check_positive("width", width)
        _check_positive("num_classes", num_classes)

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2))

        self.features = nn.Sequential(block(in_channels, width), block(width, 2 * width),
                                      block(2 * width, 4 * width))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
