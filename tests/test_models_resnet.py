"""The ResNets of lessons 04-05: sizes, checkpointing that changes nothing but memory, and the
article's selective-autocast ("optimized") variant."""
import pytest
import torch

from amp_lessons import models
from amp_lessons.measure import SavedActivations
import copy
import torch.nn.functional as F
from torch import nn
from amp_lessons.measure.activation_checkpointing import relative_diff


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_torchvision_sizes():
    assert _count(models.resnet50()) == 25_557_032
    assert _count(models.resnet18()) == 11_689_512
    assert _count(models.optimized_resnet50()) == 25_557_032  # the same weights, wrapped


@pytest.mark.parametrize("kwargs, name", [
    (dict(checkpoint="layer"), "checkpoint"), (dict(checkpoint=True), "checkpoint"),
    (dict(num_classes=0), "num_classes"), (dict(in_channels=0), "in_channels"),
])
def test_bad_settings_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        models.resnet18(**kwargs)


def test_small_input_stem_for_digits():
    model = models.resnet18(num_classes=10, in_channels=1, small_input=True)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    plain = models.resnet18(num_classes=10, in_channels=1)
    assert plain.conv1.kernel_size == (7, 7) and plain.conv1.in_channels == 1


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _buffers(model):
    # Checkpointed models wrap blocks ("layer1.0.module.bn1"); compare by order, not by name.
    return [b.clone() for b in model.buffers()]


NO_SAC = models.selective_checkpointing_problem()  # torch 2.4: no selective checkpointing


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.skipif(m == "sac" and NO_SAC is not None, reason=str(NO_SAC)))
    for m in models.CHECKPOINT_MODES if m])
def test_checkpointing_changes_nothing_but_memory(mode):
    torch.manual_seed(0)
    plain = models.resnet18(num_classes=10)
    ckpt = models.resnet18(num_classes=10, checkpoint=mode)
    ckpt.load_state_dict(_renamed(plain.state_dict(), ckpt))
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    loss_a, grads_a = _step(plain, x, y)
    loss_b, grads_b = _step(ckpt, x, y)
    assert torch.allclose(loss_a, loss_b)
    for (_, ga), (_, gb) in zip(sorted(grads_a.items(), key=lambda kv: _plain_name(kv[0])),
                                sorted(grads_b.items(), key=lambda kv: _plain_name(kv[0]))):
        assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6)
    # BatchNorm statistics moved once, not twice (the recomputation restores them)
    for a, b in zip(_buffers(plain), _buffers(ckpt)):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)
    # and the activations kept for backward shrink
    with SavedActivations(exclude=list(plain.parameters())) as s_plain:
        plain(x)
    with SavedActivations(exclude=list(ckpt.parameters())) as s_ckpt:
        ckpt(x)
    # (selective checkpointing saves outside saved-tensor hooks: its count is not comparable)
    assert s_ckpt.bytes < (0.8 if mode in ("block", "stage", "stem+stage1-2") else 1.0) * s_plain.bytes


def _plain_name(name):
    # the stem unit wraps conv1, bn1, relu and maxpool as conv1.module.0 .. 3
    name = name.replace("conv1.module.0.", "conv1.").replace("conv1.module.1.", "bn1.")
    return name.replace(".module", "")


def test_checkpoint_modes_wrap_what_they_say():
    def units(mode):
        net = models.resnet50(checkpoint=mode)
        return sorted(n for n, m in net.named_modules() if isinstance(m, models.Checkpointed))

    assert len(units("block")) == 16 and len(units("stage")) == 4
    assert units("stage1-2") == [f"layer1.{i}" for i in range(3)] + [f"layer2.{i}" for i in range(4)]
    assert units("stem+stage1") == ["conv1"] + [f"layer1.{i}" for i in range(3)]
    assert len(units("stem+stage1-2")) == 8 and units("stem+stage1-2")[0] == "conv1"
    if NO_SAC is None:
        net = models.resnet50(checkpoint="sac")
        assert sum(isinstance(m, models.SelectiveCheckpointed) for m in net.modules()) == 16
    else:
        with pytest.raises(ValueError, match="needs torch >= 2.5"):
            models.resnet50(checkpoint="sac")
    assert set(models.CHECKPOINT_HELP) == set(models.CHECKPOINT_MODES)
    stem = models.resnet18(checkpoint="stem+stage1")
    assert isinstance(stem.bn1, torch.nn.Identity) and isinstance(stem.maxpool, torch.nn.Identity)
    assert _count(stem) == _count(models.resnet18())


def test_selective_checkpointing_on_a_torch_without_it_is_refused_by_name(monkeypatch):
    """A torch without create_selective_checkpoint_contexts (2.4): building a 'sac' model says
    which torch it needs, and a benchmark row is skipped with the same sentence (no ImportError
    in the middle of a lesson)."""
    import torch.utils.checkpoint as ckpt
    from amp_lessons.measure.config import BenchConfig, skip_reason
    monkeypatch.delattr(ckpt, "create_selective_checkpoint_contexts", raising=False)
    problem = models.selective_checkpointing_problem()
    assert problem.startswith("checkpoint 'sac' needs torch >= 2.5") and torch.__version__ in problem
    with pytest.raises(ValueError, match=r"checkpoint 'sac' needs torch >= 2\.5"):
        models.resnet18(checkpoint="sac")
    assert skip_reason(BenchConfig(model="resnet18", checkpoint="sac"), "cpu") == problem
    assert skip_reason(BenchConfig(model="resnet18", checkpoint="block"), "cpu") is None


def test_a_checkpointed_backward_under_autocast_prints_no_warning_from_torch():
    """torch 2.4's checkpoint recomputes under the autocast APIs it deprecated (a FutureWarning
    at every backward, from torch's own code): ``models`` silences exactly that one, so a lesson's
    output stays clean; checked in a fresh interpreter where FutureWarnings are errors."""
    import subprocess
    import sys
    code = ("import torch, torch.nn.functional as F\n"
            "from amp_lessons import models\n"
            "net = models.resnet18(num_classes=10, checkpoint='block')\n"
            "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
            "    loss = F.cross_entropy(net(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2]))\n"
            "loss.backward()\n"
            "import warnings; warnings.warn('still an error', FutureWarning)\n")
    out = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().endswith("FutureWarning: still an error"), \
        out.stderr[-1500:]


def _renamed(state, target):
    names = list(target.state_dict())
    plain_to_target = {_plain_name(n): n for n in names}
    return {plain_to_target[k]: v for k, v in state.items()}


def test_checkpointing_is_off_in_eval_and_no_grad():
    model = models.resnet18(num_classes=10, checkpoint="block").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def _stage_dtypes(model, x, dtype):
    seen = {}
    hooks = [getattr(model.resnet, name).register_forward_hook(
        lambda m, i, o, name=name: seen.__setitem__(name, (i[0].dtype, o.dtype)))
        for name in ("layer1", "layer2", "layer3", "layer4", "fc")]
    with torch.autocast(device_type="cpu", dtype=dtype):
        out = model(x)
    for h in hooks:
        h.remove()
    return seen, out


def test_selective_autocast_runs_layer3_on_in_fp32():
    torch.manual_seed(0)
    model = models.optimized_resnet18(num_classes=10)
    seen, out = _stage_dtypes(model, torch.randn(2, 3, 32, 32), torch.bfloat16)
    assert seen["layer1"][1] == torch.bfloat16 and seen["layer2"][1] == torch.bfloat16
    assert seen["layer3"] == (torch.float32, torch.float32)
    assert seen["layer4"][1] == torch.float32 and seen["fc"][1] == torch.float32
    assert out.dtype == torch.float32


def test_selective_autocast_boundary_is_configurable():
    model = models.SelectiveAutocastResNet(models.resnet18(num_classes=10), fp32_from="fc")
    seen, out = _stage_dtypes(model, torch.randn(2, 3, 32, 32), torch.bfloat16)
    assert seen["layer4"][1] == torch.bfloat16
    assert seen["fc"] == (torch.float32, torch.float32)
    with pytest.raises(ValueError, match="fp32_from"):
        models.SelectiveAutocastResNet(models.resnet18(), fp32_from="layer5")


def test_optimized_resnet_trains_one_step_with_checkpointing():
    model = models.optimized_resnet18(num_classes=10, checkpoint="stage")
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


class _FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), 0.5, self.training))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.a(x, x, x, need_weights=False)[0]


def _grad_diff(make) -> float:
    torch.manual_seed(0)
    plain = make().train()
    wrapped = models.Checkpointed(copy.deepcopy(plain)).train()
    x = torch.randn(2, 4, 16)
    grads = []
    for net in (plain, wrapped):
        torch.manual_seed(123)  # the same random stream for both forwards
        net(x.clone().requires_grad_()).pow(2).sum().backward()
        grads.append([p.grad for p in net.parameters()])
    return relative_diff(grads[1], grads[0])


@pytest.mark.parametrize("make", [_FunctionalDropout, _Attention],
                         ids=["F.dropout", "attention dropout"])
def test_checkpointed_replays_randomness_outside_dropout_modules(make):
    assert models.Checkpointed(make()).preserve_rng_state
    assert _grad_diff(make) == 0.0


def test_checkpointed_refuses_rrelu_whose_replay_torch_gets_wrong():
    assert models.random_modules(nn.Sequential(nn.Linear(4, 4), nn.RReLU())) == ["1"]
    with pytest.raises(ValueError, match=r"nn.RReLU \(found at 1\).*193671"):
        models.Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.RReLU()))


def test_checkpointed_skips_the_rng_state_only_for_known_deterministic_modules():
    resnet = models.resnet18(num_classes=10, checkpoint="block")
    units = [m for m in resnet.modules() if isinstance(m, models.Checkpointed)]
    assert units and not any(u.preserve_rng_state for u in units)  # the lessons' timings
    assert models.random_modules(nn.MultiheadAttention(16, 2)) == []  # dropout 0
    assert models.random_modules(_FunctionalDropout()) == [""]  # a forward of its own
    assert not models.Checkpointed(_FunctionalDropout(), deterministic=True).preserve_rng_state
    assert models.Checkpointed(nn.Linear(2, 2), deterministic=False).preserve_rng_state
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        models.Checkpointed(nn.Linear(2, 2), deterministic="yes")
