"""Models the lessons train.

Small models for the digits set (lessons 01-03): ``SimpleNet`` (the articles' one Linear layer,
adapted to 64 inputs and 10 classes), ``MLP`` and ``SmallCNN`` (BatchNorm included, so the
trainer's skip-safe BatchNorm has something to protect).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence

import torch
from torch import nn

from amp_lessons._compat import torch_version
from amp_lessons.validate import check_bool, is_int


def _check_positive(name: str, value: int) -> None:
    if not is_int(value) or value < 1:
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
        if isinstance(hidden, (str, bytes)) or not hasattr(hidden, "__iter__"):
            raise ValueError(f"hidden must be a sequence of layer widths such as (256, 128); "
                             f"got {hidden!r}")
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


# --- ResNets (lessons 04-05) ----------------------------------------------------------------------
# torchvision's ResNet-50 and ResNet-18 (random weights), optionally with activation checkpointing
# per residual block or per stage, and the "optimized" variant of article R: layer3,
# layer4 and fc forced to fp32 inside an autocast region. Lesson 04 measures their speed and memory,
# lesson 05 their checkpointing.

CHECKPOINT_MODES = (None, "block", "stage", "stage1-2", "stem+stage1", "stem+stage1-2", "sac")
CHECKPOINT_HELP = {
    None: "no checkpointing: every activation is kept for backward",
    "block": "each residual block (16 in ResNet-50) keeps only its input and recomputes its inside",
    "stage": "each of layer1..layer4 keeps only its input (fewer, larger recomputed units)",
    "stage1-2": "the blocks of layer1 and layer2 only (56x56 and 28x28: the largest activations "
                "for the least arithmetic); layer3, layer4 and the stem keep everything",
    "stem+stage1": "the stem (conv1, bn1, relu, maxpool at 112x112) and the blocks of layer1",
    "stem+stage1-2": "the stem and the blocks of layer1 and layer2",
    "sac": "each block under selective activation checkpointing (PyTorch's SAC policy): "
           "convolution outputs are saved, BatchNorm and ReLU recomputed",
}
"""What each ``checkpoint=`` mode of ``resnet50``/``resnet18`` recomputes (lesson 05)."""


def input_channels(model: nn.Module) -> int:
    """Channels of the images ``model`` takes: its first convolution's ``in_channels`` (3 for a
    model without a convolution)."""
    first = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    return first.in_channels if first is not None else 3


class KeepBatchNormStats:
    """Recompute context for checkpointing: BatchNorm running statistics stay as they are.

    Recomputing a checkpointed region in training mode runs its BatchNorm layers a second time,
    which would update their running statistics (and ``num_batches_tracked``) twice per step.
    Inside this context each BatchNorm layer has momentum 0 (the update leaves the running mean
    and variance exactly as they were: ``r * 1 + 0 * batch``) and no ``num_batches_tracked``
    to count with; the layer still normalises by the batch's own statistics, as in the first
    forward. Switching attributes costs no GPU work, where copying every buffer out and back
    (318 copies per ResNet-50 step) cost 7 ms of host time per step on an H200.
    """

    def __init__(self, module: nn.Module):
        self.layers = [m for m in module.modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self.saved: list = []

    def __enter__(self):
        self.saved = [(m.momentum, m.num_batches_tracked) for m in self.layers]
        for m in self.layers:
            m.momentum, m.num_batches_tracked = 0.0, None
        return self

    def __exit__(self, *exc):
        for m, (momentum, count) in zip(self.layers, self.saved):
            m.momentum, m.num_batches_tracked = momentum, count
        self.saved = []
        return False


if torch_version() < (2, 5):
    # torch 2.4's non-reentrant checkpoint recomputes under torch.cpu.amp.autocast (and
    # torch.cuda.amp.autocast), the APIs it deprecated itself: a FutureWarning from torch's own
    # code at every backward of a checkpointed model, which no learner can act on
    warnings.filterwarnings(
        "ignore", category=FutureWarning, module=r"torch\.utils\.checkpoint",
        message=r"`torch\.(cpu|cuda)\.amp\.autocast\(args\.\.\.\)` is deprecated")


@functools.lru_cache(maxsize=None)  # built once: every Checkpointed wrapper asks
def _known_deterministic_types() -> "dict[type, object]":
    """Module types whose own ``forward`` draws no random numbers (their children are checked
    one by one): type -> None, or a test of the instance (attention draws a dropout mask only
    when its ``dropout`` is above 0). Exact types only: a subclass may override ``forward``."""
    import torchvision.models.resnet as tv_resnet
    plain = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
             nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear, nn.Bilinear,
             nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
             nn.ConvTranspose2d, nn.ConvTranspose3d, nn.BatchNorm1d, nn.BatchNorm2d,
             nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d,
             nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LocalResponseNorm, nn.Embedding,
             nn.EmbeddingBag, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU,
             nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
             nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Softmax, nn.LogSoftmax, nn.GLU,
             nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
             nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
             nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Upsample,
             nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d,
             nn.PixelShuffle, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
             nn.TransformerEncoder, nn.TransformerDecoder,
             tv_resnet.BasicBlock, tv_resnet.Bottleneck, tv_resnet.ResNet,
             SimpleNet, MLP, SmallCNN, TransformerBlock, TinyTransformer)
    known: dict = {t: None for t in plain}
    known[nn.MultiheadAttention] = lambda m: not m.dropout
    for t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
              nn.FeatureAlphaDropout):
        known[t] = lambda m: not m.p
    return known


def random_modules(module: nn.Module) -> "list[str]":
    """Names of the submodules of ``module`` (itself included, as ``""``) whose forward may draw
    random numbers, or whose type the course does not know (a custom ``forward`` may call
    ``F.dropout``, ``torch.rand``, stochastic depth ...): what makes ``Checkpointed`` save and
    restore the RNG state. Empty when every module is of a known deterministic type (ResNet's
    blocks and stem, the course's models, Linear/Conv/BatchNorm/activations/pooling, dropout
    with ``p=0``, ``MultiheadAttention`` with ``dropout=0``); ``nn.RReLU`` and dropout with
    ``p > 0`` are always listed, even in eval mode (``Checkpointed`` refuses ``nn.RReLU``)."""
    known = _known_deterministic_types()
    found = []
    for name, m in module.named_modules():
        test = known.get(type(m), False)
        if test is False or (test is not None and not test(m)):
            found.append(name)
    return found


class Checkpointed(nn.Module):
    """Run ``module`` under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    Only the input is kept for backward; the activations inside are recomputed. Safe with
    torchvision's in-place ReLUs because the wrapped unit (a residual block, a stage or the stem)
    never modifies its own input in place, and BatchNorm statistics are updated once per step.

    The replay must draw the random numbers the first forward drew (the same dropout mask),
    else gradients are silently wrong. ``deterministic`` says whether it can skip saving and
    restoring the random-number state: ``None`` (default) decides from the modules inside
    (``random_modules``): the state is saved unless every module is of a type known to draw no
    random numbers, so dropout written with ``F.dropout`` in a custom ``forward``, attention
    dropout, ``nn.RReLU`` or stochastic depth keep it; ``True`` says the forward draws none
    (skip it), ``False`` always saves it. The cost of saving: copying the CPU and device RNG
    states at every checkpointed forward and restoring them at the replay, 8 ms of host time per
    ResNet-50 step on an H200 with per-block checkpointing (ResNet blocks are known
    deterministic, so the course's ResNets skip it).

    ``nn.RReLU`` is refused (a ValueError): even with the RNG state kept, torch's non-reentrant
    checkpoint saves its noise uninitialised on the replay and the gradients come out wrong
    (pytorch/pytorch#193671, open; seen on torch 2.14); nothing can see ``F.rrelu`` inside a
    custom ``forward``, which has the same problem: keep it outside checkpointed units.
    """

    def __init__(self, module: nn.Module, deterministic: Optional[bool] = None):
        super().__init__()
        if deterministic is not None:
            check_bool("deterministic", deterministic)
        rrelu = [n or "the module itself" for n, m in module.named_modules()
                 if isinstance(m, nn.RReLU)]
        if rrelu:
            raise ValueError(f"module must not hold nn.RReLU (found at {', '.join(rrelu)}): "
                             f"torch's non-reentrant checkpoint replays its noise wrong and the "
                             f"gradients come out wrong (pytorch/pytorch#193671); checkpoint the "
                             f"modules around it")
        self.module = module
        self.deterministic = deterministic
        self.preserve_rng_state = (bool(random_modules(module)) if deterministic is None
                                   else not deterministic)

    def _contexts(self):
        from contextlib import nullcontext
        return nullcontext(), KeepBatchNormStats(self.module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.module(x)
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.module, x, use_reentrant=False, context_fn=self._contexts,
                          preserve_rng_state=self.preserve_rng_state)


def _conv_outputs_saved(ctx, op, *args, **kwargs):
    """SAC policy: keep what convolutions and matrix products return, recompute everything else
    (BatchNorm, ReLU, additions: cheap arithmetic on large tensors)."""
    from torch.utils.checkpoint import CheckpointPolicy
    name = str(op)
    if "convolution" in name or "addmm" in name or name.startswith("aten.mm"):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_options() -> dict:
    """Route what selective checkpointing saves through saved-tensor hooks where torch can (it
    warns otherwise when a hook, such as the course's memory counter, is active)."""
    import inspect

    from torch.utils.checkpoint import checkpoint
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        return {"respect_saved_tensors_hooks": True}
    return {}


class SelectiveCheckpointed(Checkpointed):
    """``Checkpointed`` with PyTorch's selective activation checkpointing: the ops that
    ``_conv_outputs_saved`` names are saved in forward, the rest recomputed in backward
    (BatchNorm statistics still updated once per step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.module(x)
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.module, x, use_reentrant=False, context_fn=self._contexts,
                          preserve_rng_state=self.preserve_rng_state, **_sac_options())

    def _contexts(self):
        from contextlib import ExitStack, contextmanager
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_conv_outputs_saved)
        keep = KeepBatchNormStats(self.module)

        @contextmanager
        def recompute():
            with ExitStack() as stack:
                stack.enter_context(keep)
                stack.enter_context(recompute_ctx)
                yield

        return forward_ctx, recompute()


class CheckpointedWithoutBatchNormFix(Checkpointed):
    """``Checkpointed`` without its BatchNorm fix, for lesson 05's comparison only: recomputing
    the unit in backward runs its BatchNorm layers in training mode again, so their running
    statistics move twice per step."""

    def _contexts(self):
        from contextlib import nullcontext
        return nullcontext(), nullcontext()


class SelectiveCheckpointedWithoutBatchNormFix(SelectiveCheckpointed):
    """``SelectiveCheckpointed`` without its BatchNorm fix: the ops it recomputes include
    BatchNorm's, so the running statistics move twice per step (for comparisons only)."""

    def _contexts(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        return create_selective_checkpoint_contexts(_conv_outputs_saved)


_WITHOUT_FIX = {Checkpointed: CheckpointedWithoutBatchNormFix,
                SelectiveCheckpointed: SelectiveCheckpointedWithoutBatchNormFix}


def without_batchnorm_fix(model: nn.Module) -> nn.Module:
    """Turn every checkpointed unit of ``model`` (``Checkpointed`` and ``SelectiveCheckpointed``)
    into its twin without the BatchNorm fix (in place; returns ``model``): the pitfall lesson 05
    shows."""
    for m in model.modules():
        twin = _WITHOUT_FIX.get(type(m))
        if twin is not None:
            m.__class__ = twin
    return model


def selective_checkpointing_problem() -> Optional[str]:
    """Why this torch cannot run ``checkpoint="sac"`` (a sentence), or None when it can:
    selective activation checkpointing needs ``torch.utils.checkpoint``'s public
    ``create_selective_checkpoint_contexts`` and ``CheckpointPolicy`` (torch >= 2.5)."""
    import torch.utils.checkpoint as ckpt
    if hasattr(ckpt, "create_selective_checkpoint_contexts") and hasattr(ckpt, "CheckpointPolicy"):
        return None
    return (f"checkpoint 'sac' needs torch >= 2.5 (torch.utils.checkpoint."
            f"create_selective_checkpoint_contexts); this is torch {torch.__version__}")


def _check_checkpoint(checkpoint) -> None:
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}; "
                         f"got {checkpoint!r}")
    if checkpoint == "sac":
        problem = selective_checkpointing_problem()
        if problem:
            raise ValueError(problem)


def _checkpoint_plan(checkpoint) -> "tuple[bool, dict]":
    """(checkpoint the stem?, {stage name: "block" | "stage" | "sac"}) for a mode."""
    stages = ("layer1", "layer2", "layer3", "layer4")
    if checkpoint in ("block", "stage", "sac"):
        return False, {name: checkpoint for name in stages}
    if checkpoint == "stage1-2":
        return False, {"layer1": "block", "layer2": "block"}
    if checkpoint == "stem+stage1":
        return True, {"layer1": "block"}
    if checkpoint == "stem+stage1-2":
        return True, {"layer1": "block", "layer2": "block"}
    return False, {}


def _resnet(builder, num_classes: int, checkpoint, in_channels: int, small_input: bool):
    _check_positive("num_classes", num_classes)
    _check_positive("in_channels", in_channels)
    _check_checkpoint(checkpoint)
    check_bool("small_input", small_input)
    model = builder(weights=None, num_classes=num_classes)
    if in_channels != 3 or small_input:
        # Small images (digits at 32x32): a 3x3 stride-1 stem and no max-pool, as for CIFAR,
        # so layer4 still sees 4x4 maps instead of 1x1.
        k, s, p = (3, 1, 1) if small_input else (7, 2, 3)
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=k, stride=s, padding=p, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        if small_input:
            model.maxpool = nn.Identity()
    stem, stages = _checkpoint_plan(checkpoint)
    for name, unit in stages.items():
        stage = getattr(model, name)
        if unit == "stage":
            setattr(model, name, Checkpointed(stage))
        else:
            wrap = SelectiveCheckpointed if unit == "sac" else Checkpointed
            setattr(model, name, nn.Sequential(*[wrap(block) for block in stage]))
    if stem:
        # conv1 -> bn1 -> relu -> maxpool as one unit that keeps only the image; the names
        # bn1, relu and maxpool stay (as identities) so torchvision's forward runs unchanged
        model.conv1 = Checkpointed(nn.Sequential(model.conv1, model.bn1, model.relu,
                                                 model.maxpool))
        model.bn1, model.relu, model.maxpool = nn.Identity(), nn.Identity(), nn.Identity()
    return model


def resnet50(num_classes: int = 1000, checkpoint=None, in_channels: int = 3,
             small_input: bool = False) -> nn.Module:
    """torchvision's ResNet-50 with random weights (25.6 M parameters at 1000 classes).

    ``checkpoint``: one of ``CHECKPOINT_MODES`` (``CHECKPOINT_HELP`` says what each recomputes):
    ``None``, ``"block"`` (each of the 16 bottleneck blocks recomputes its inside in backward),
    ``"stage"`` (each of layer1..layer4 does), ``"stage1-2"``, ``"stem+stage1"``,
    ``"stem+stage1-2"`` (only the high-resolution part) or ``"sac"``. ``in_channels=1`` and
    ``small_input=True`` adapt the stem to the digits set at 32x32. Lessons 04 and 05.
    """
    from torchvision.models import resnet50 as _resnet50
    return _resnet(_resnet50, num_classes, checkpoint, in_channels, small_input)


def resnet18(num_classes: int = 1000, checkpoint=None, in_channels: int = 3,
             small_input: bool = False) -> nn.Module:
    """torchvision's ResNet-18 (11.7 M parameters): the quick profile's stand-in for ResNet-50."""
    from torchvision.models import resnet18 as _resnet18
    return _resnet(_resnet18, num_classes, checkpoint, in_channels, small_input)


RESNET_STAGES = ("layer1", "layer2", "layer3", "layer4", "fc")


class SelectiveAutocastResNet(nn.Module):
    """Article R's "optimized" ResNet: the stages from ``fp32_from`` on run in fp32.

    The stem and the earlier stages run under whatever autocast region encloses the call; from
    ``fp32_from`` (default ``"layer3"``: layer3, layer4 and fc) a nested
    ``torch.autocast(enabled=False)`` turns autocast off and the activations are cast back to
    fp32 with ``.float()``. Lesson 04 measures what this costs in speed, memory and accuracy.
    """

    def __init__(self, resnet: nn.Module, fp32_from: str = "layer3"):
        super().__init__()
        if fp32_from not in RESNET_STAGES:
            raise ValueError(f"fp32_from must be one of {', '.join(RESNET_STAGES)}; "
                             f"got {fp32_from!r}")
        self.resnet = resnet
        self.fp32_from = fp32_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.resnet
        x = r.maxpool(r.relu(r.bn1(r.conv1(x))))
        fp32 = False
        for name in RESNET_STAGES[:-1]:
            if name == self.fp32_from:
                fp32 = True
            x = self._run(getattr(r, name), x, fp32)
        return self._run(lambda t: r.fc(torch.flatten(r.avgpool(t), 1)), x,
                         fp32 or self.fp32_from == "fc")

    @staticmethod
    def _run(module, x: torch.Tensor, fp32: bool) -> torch.Tensor:
        if not fp32:
            return module(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return module(x.float())


def optimized_resnet50(num_classes: int = 1000, fp32_from: str = "layer3", **kwargs) -> nn.Module:
    """ResNet-50 wrapped in ``SelectiveAutocastResNet`` (layer3/4 + fc in fp32, as article R advises)."""
    return SelectiveAutocastResNet(resnet50(num_classes, **kwargs), fp32_from=fp32_from)


def optimized_resnet18(num_classes: int = 1000, fp32_from: str = "layer3", **kwargs) -> nn.Module:
    """ResNet-18 wrapped in ``SelectiveAutocastResNet`` (the quick profile's selective-autocast model)."""
    return SelectiveAutocastResNet(resnet18(num_classes, **kwargs), fp32_from=fp32_from)


# --- A small transformer (lesson 06) ------------------------------------------------------------
# A decoder-only language model (GPT-style, pre-LayerNorm) whose size is set by a few numbers:
# tiny on a CPU, hundreds of millions of parameters on a GPU, where its parameters, gradients and
# AdamW state (16 bytes per parameter in fp32) are what sharding (ZeRO, FSDP2) cuts per rank.

class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: causal self-attention (``scaled_dot_product_attention``), then an MLP."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("mlp_ratio", mlp_ratio)):
            _check_positive(name, value)
        if d_model % n_heads:
            raise ValueError(f"d_model must be a multiple of n_heads; got {d_model} and {n_heads}")
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A GPT-style language model: token + position embeddings, ``n_layers`` blocks, a head.

    ``forward(tokens)`` takes ``B x T`` token ids (``T <= seq_len``) and returns ``B x T x
    vocab_size`` logits; ``lm_loss`` scores them against the next tokens. ``blocks`` holds the
    units that FSDP2 shards one by one. The defaults are CPU-sized; lesson 06 scales ``d_model``
    and ``n_layers`` up on a GPU (``parameter_count`` says how large it became).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 64, n_layers: int = 2,
                 n_heads: int = 4, seq_len: int = 64, mlp_ratio: int = 4):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("n_layers", n_layers),
                            ("seq_len", seq_len)):
            _check_positive(name, value)
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, mlp_ratio)
                                    for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] > self.seq_len:
            raise ValueError(f"tokens must be B x T with T <= seq_len={self.seq_len}; "
                             f"got shape {tuple(tokens.shape)}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def parameter_count(self) -> int:
        """Number of parameters (every one trained)."""
        return sum(p.numel() for p in self.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``B x T x V`` logits against ``B x T`` target ids (in fp32)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --- the digits models of lessons 02 and 03 -----------------------------------------------------

def build_digits_model(name: str = "cnn", width: int = 32) -> "tuple[nn.Module, int | None]":
    """A fresh digits model and the input it wants: ``("simplenet" | "mlp" | "cnn")`` ->
    ``(model, image_size)`` where image_size None means flat 64-vectors."""
    _check_positive("width", width)
    if name == "simplenet":
        return SimpleNet(), None
    if name == "mlp":
        return MLP(hidden=(4 * width, 2 * width)), None
    if name == "cnn":
        return SmallCNN(width=width), 32
    raise ValueError(f"model must be one of {', '.join(DIGITS_MODELS)}; got {name!r}")


DIGITS_MODELS = ("simplenet", "mlp", "cnn")
