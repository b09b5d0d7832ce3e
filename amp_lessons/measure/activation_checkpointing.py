"""Activation checkpointing, checked: the ``checkpoint_sequential`` pitfall on torchvision's
ResNet (an in-place ReLU overwrites a kept input; BatchNorm statistics move twice), and one SGD
step of a checkpointed ResNet against the plain one on the same weights
(``checkpoint_equivalence``), with cuDNN deterministic so a GPU repeats a step bit for bit
(``deterministic_kernels``). Lesson 05 shows these; ``models.resnet50(checkpoint=...)`` is the
checkpointing they check."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import models
from amp_lessons.numerics.modes import keeps_rng
from amp_lessons.validate import check_choice, check_int
from amp_lessons.measure.config import MODELS
from amp_lessons.measure.oom import free_memory
from amp_lessons.data import synthetic_images
from amp_lessons.numerics.precision import as_device


@keeps_rng
def checkpoint_sequential_pitfall(segments: int = 4, image_size: int = 32, batch_size: int = 2,
                                  device=None, seed: int = 0,
                                  model: str = "resnet50") -> Dict[str, object]:
    """``checkpoint_sequential`` over torchvision's ResNet-50 children: the error, and why.

    The children (conv1, bn1, relu, maxpool, layer1..4, avgpool, then flatten and fc) are cut
    into ``segments`` equal segments, as ``torch.utils.checkpoint.checkpoint_sequential(...,
    use_reentrant=False)`` does; with 4 or more, one segment starts with the stem's
    ``ReLU(inplace=True)``, which overwrites that segment's input: the tensor the checkpoint keeps
    to replay the segment in backward. Returns ``error`` (the message, "" if backward ran),
    ``segments`` (module names per segment; the last runs without checkpointing),
    ``inplace_first`` (checkpointed segments that start with an in-place module) and
    ``batchnorm_updates_per_step``: how often bn1's statistics moved in one step once the ReLU
    is made out-of-place (2: recomputation runs BatchNorm again). ``model="resnet18"`` uses
    torchvision's ResNet-18, whose stem is the same (a quicker run on a CPU).
    """
    from collections import OrderedDict

    import torchvision.models
    from torch.utils.checkpoint import checkpoint_sequential

    check_choice("model", model, ("resnet18", "resnet50"))

    check_int("segments", segments, 2)
    check_int("image_size", image_size, 32)
    check_int("batch_size", batch_size, 2)
    device = as_device(device)
    torch.manual_seed(seed)
    net = getattr(torchvision.models, model)(weights=None, num_classes=10).to(device).train()
    children = list(net.named_children())
    seq = nn.Sequential(OrderedDict(children[:-1] + [("flatten", nn.Flatten())] + children[-1:]))
    names = list(seq._modules)
    if segments > len(names):
        raise ValueError(f"segments must be in [2, {len(names)}]; got {segments}")
    size = len(names) // segments  # the split checkpoint_sequential makes
    cut = size * (segments - 1)
    parts = [names[i:i + size] for i in range(0, cut, size)] + [names[cut:]]
    inplace_first = [p for p in parts[1:-1] if getattr(seq._modules[p[0]], "inplace", False)]
    x, y = synthetic_images(batch_size, image_size, 10, device, seed=seed)

    def step() -> None:
        out = checkpoint_sequential(seq, segments, x, use_reentrant=False)
        F.cross_entropy(out, y).backward()
        net.zero_grad(set_to_none=True)

    error = ""
    try:
        step()
    except RuntimeError as exc:
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.split(' Hint:')[0]}"
    net.relu.inplace = False  # the stem's ReLU out of place: the segments no longer clash
    before = int(net.bn1.num_batches_tracked)
    step()
    updates = int(net.bn1.num_batches_tracked) - before
    del net, seq, x, y
    free_memory(device)
    return {"error": error, "segments": parts, "inplace_first": inplace_first,
            "batchnorm_updates_per_step": updates}


def batchnorm_buffers(model: nn.Module) -> List[torch.Tensor]:
    """The running statistics of every BatchNorm layer of ``model`` (not its step counters)."""
    return [b for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for name, b in m.named_buffers() if name != "num_batches_tracked"]


def relative_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest relative difference between paired tensors (max |a-b| / max |b|, in fp64)."""
    worst = 0.0
    for s, t in zip(a, b):
        s, t = s.detach().double(), t.detach().double()
        worst = max(worst, float((s - t).abs().max() / t.abs().max().clamp_min(1e-12)))
    return worst


@contextmanager
def deterministic_kernels() -> Iterator[None]:
    """cuDNN in deterministic mode, benchmark off (restored on exit), so two runs of the same
    step on a GPU give the same bits, as they do on a CPU."""
    old = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old


@keeps_rng
def checkpoint_equivalence(model: str = "resnet18", checkpoint: str = "block",
                           image_size: int = 32, batch_size: int = 4, num_classes: int = 10,
                           device=None, seed: int = 0) -> Dict[str, object]:
    """One SGD step of a plain ResNet and of the same weights checkpointed, compared.

    Three models start from the same weights: plain, checkpointed with ``checkpoint`` (a mode
    of ``models.CHECKPOINT_MODES``; ``models.Checkpointed`` keeps BatchNorm statistics still
    during recomputation) and checkpointed without that fix (``models.without_batchnorm_fix``).
    Returns ``loss_diff`` (absolute), ``grad_rel_diff`` and ``weight_rel_diff`` (largest
    relative difference over parameters after the step), ``bn_rel_diff`` and
    ``bn_rel_diff_without_fix`` (running mean and variance against the plain model), and the
    ``num_batches_tracked`` of bn1 in the first residual block for each: 1, 1 and 2.
    Seeds itself with ``seed`` and leaves the caller's random stream where it was.
    """
    check_choice("model", model, ("resnet18", "resnet50"))
    check_choice("checkpoint", checkpoint, tuple(m for m in models.CHECKPOINT_MODES if m))
    check_int("batch_size", batch_size, 2)  # BatchNorm needs 2 values per channel (layer4: 1x1)
    device = as_device(device)
    x, y = synthetic_images(batch_size, image_size, num_classes, device, seed=seed)
    out: Dict[str, object] = {"model": model, "checkpoint": checkpoint}
    nets = {}
    with deterministic_kernels():
        for name, mode in (("plain", None), ("checkpointed", checkpoint),
                           ("without_fix", checkpoint)):
            torch.manual_seed(seed)  # same construction order, so the same initial weights
            net = MODELS[model](num_classes=num_classes, checkpoint=mode).to(device).train()
            if name == "without_fix":
                models.without_batchnorm_fix(net)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            grads = [p.grad.detach().clone() for p in net.parameters()]
            opt.step()
            nets[name] = (net, float(loss.detach()), grads)
    plain, ckpt, unfixed = nets["plain"], nets["checkpointed"], nets["without_fix"]

    def first_block_bn1(net: nn.Module) -> int:
        bn = [m for n, m in net.named_modules() if n.startswith("layer1")
              and isinstance(m, nn.BatchNorm2d)][0]
        return int(bn.num_batches_tracked)

    out.update(
        loss_diff=abs(ckpt[1] - plain[1]),
        grad_rel_diff=relative_diff(ckpt[2], plain[2]),
        weight_rel_diff=relative_diff(list(ckpt[0].parameters()), list(plain[0].parameters())),
        bn_rel_diff=relative_diff(batchnorm_buffers(ckpt[0]), batchnorm_buffers(plain[0])),
        bn_rel_diff_without_fix=relative_diff(batchnorm_buffers(unfixed[0]),
                                               batchnorm_buffers(plain[0])),
        batches_tracked={"plain": first_block_bn1(plain[0]),
                         "checkpointed": first_block_bn1(ckpt[0]),
                         "checkpointed without the fix": first_block_bn1(unfixed[0])})
    del nets, plain, ckpt, unfixed
    free_memory(device)
    return out

