"""amp_lessons.models: the small digits models (SimpleNet, MLP, SmallCNN) and the trainer's
``build_digits_model``. (The ResNet section is tested by its own file.)"""
import pytest
import torch

from amp_lessons import models
from amp_lessons.models import DIGITS_MODELS, build_digits_model


def test_simplenet_is_one_linear_layer():
    net = models.SimpleNet()
    assert [type(m).__name__ for m in net.children()] == ["Linear"]
    assert net(torch.zeros(5, 1, 8, 8)).shape == (5, 10)  # flattens images too


def test_mlp_widths():
    net = models.MLP(in_features=64, hidden=(16, 8), num_classes=3)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in linears] == [(64, 16), (16, 8), (8, 3)]
    assert net(torch.zeros(2, 64)).shape == (2, 3)


def test_small_cnn_has_batchnorm_and_any_input_size():
    net = models.SmallCNN(in_channels=3, width=4, num_classes=7)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules()) == 3
    for size in (16, 32):
        assert net(torch.zeros(2, 3, size, size)).shape == (2, 7)


@pytest.mark.parametrize("build,message", [
    (lambda: models.SimpleNet(in_features=0), "in_features must be an integer >= 1"),
    (lambda: models.MLP(hidden=(8, 0)), "hidden width must be an integer >= 1"),
    (lambda: models.SmallCNN(width=1.5), "width must be an integer >= 1"),
    (lambda: models.SmallCNN(num_classes=0), "num_classes must be an integer >= 1"),
])
def test_bad_sizes(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_build_digits_model():
    sizes = {}
    for name in DIGITS_MODELS:
        net, size = build_digits_model(name, width=8)
        x = torch.zeros(2, 64) if size is None else torch.zeros(2, 1, size, size)
        assert net(x).shape == (2, 10)
        sizes[name] = size
    assert sizes == {"simplenet": None, "mlp": None, "cnn": 32}
    with pytest.raises(ValueError, match="model must be one of simplenet, mlp, cnn"):
        build_digits_model("resnet")
