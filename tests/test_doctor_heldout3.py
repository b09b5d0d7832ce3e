"""The doctor on a third set of held-out models (none in its bench, test_doctor_heldout.py or
test_doctor_heldout2.py): an HF-style model returning a dataclass with ``loss`` and ``logits``,
an FFN deep in a ModuleDict of ModuleLists of Sequentials, nn.MultiheadAttention's explicit
scores, saturated F.scaled_dot_product_attention, an auxiliary conv head weighted 1e-10, losses
the user computes in 16 bits (``.half()`` before a sum, ``torch.sum`` on an fp16 log-prob),
fp16 Adam on a ``.half()`` conv net, a bf16 embedding beside an fp32 head, a custom Function
that takes its weight through ``ctx``, a ``torch.library`` custom op without an autocast rule, a
reentrant ``torch.utils.checkpoint`` whose region branches on ``torch.is_grad_enabled()``,
GeM pooling whose fp16 backward is inf at every scale, four more ways to misuse GradScaler in a
step, and healthy models of new shapes (a depthwise-separable CNN with GroupNorm, a tiny
nn.Transformer encoder-decoder, an MLP-mixer, a non-reentrant checkpoint, a custom op with an
autocast rule). Each class of misjudgement found is pinned here."""
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import amp_lessons as al
from doctor_helpers import QUICK, classes, healthy_report, seeded

# --- models -------------------------------------------------------------------------------------

@dataclasses.dataclass
class SeqClsOutput:
    """A transformers-style ModelOutput: the loss (when labels are given), logits, hidden states."""
    loss: torch.Tensor = None
    logits: torch.Tensor = None
    hidden_states: tuple = None


class HFLike(nn.Module):
    def __init__(self, big=1.0, vocab=40, d=16):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(nn.ModuleDict({
            "intermediate": nn.Linear(d, 32), "output": nn.Linear(32, d),
            "norm": nn.LayerNorm(d)}) for _ in range(2))})
        self.classifier = nn.Linear(d, 3)
        with torch.no_grad():
            self.encoder["layer"][1]["output"].weight.mul_(big)

    def forward(self, input_ids, labels=None):
        h = self.embeddings(input_ids)
        for blk in self.encoder["layer"]:
            h = blk["norm"](h + blk["output"](F.gelu(blk["intermediate"](h))))
        logits = self.classifier(h[:, 0])
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return SeqClsOutput(loss=loss, logits=logits, hidden_states=(h,))


def hf_inputs():
    g = seeded()
    return {"input_ids": torch.randint(0, 40, (4, 9), generator=g),
            "labels": torch.randint(0, 3, (4,), generator=g)}


class Stages(nn.Module):
    """An FFN three containers deep: stages['high'][1][1][2] is its output projection."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleDict({
            "low": nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU())]),
            "high": nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()), nn.Sequential(
                nn.LayerNorm(16), nn.Sequential(nn.Linear(16, 64), nn.ReLU(),
                                                nn.Linear(64, 16)))])})
        self.out_norm, self.head = nn.LayerNorm(16), nn.Linear(16, 4)
        with torch.no_grad():
            self.stages["high"][1][1][2].weight.mul_(3e5)

    def forward(self, x):
        for part in ("low", "high"):
            for m in self.stages[part]:
                x = x + m(x)
        return self.head(self.out_norm(x))


class MHANet(nn.Module):
    """nn.MultiheadAttention called with its default need_weights=True: the scores are an
    explicit bmm (not a fused kernel)."""

    def __init__(self, big=800.0):
        super().__init__()
        self.inp, self.mha = nn.Linear(6, 32), nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 3)
        with torch.no_grad():
            self.mha.in_proj_weight[:64].mul_(big)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.mha(h, h, h)
        return self.head((h + a).mean(1))


class SDPABlock(nn.Module):
    def __init__(self, d=32, heads=2, big=1.0):
        super().__init__()
        self.qkv, self.proj, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        with torch.no_grad():
            self.qkv.weight[:2 * d].mul_(big)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
                         .reshape(B, T, C))


class SDPANet(nn.Module):
    def __init__(self, big=600.0):
        super().__init__()
        self.inp, self.head = nn.Linear(6, 32), nn.Linear(32, 3)
        self.blocks = nn.Sequential(SDPABlock(), SDPABlock(big=big))

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)).mean(1))


class AuxConv(nn.Module):
    """Deep supervision: an auxiliary head added with weight 1e-10, whose gradient fp16 loses."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.aux = nn.Conv2d(8, 4, 1)
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, x):
        h = self.stem(x)
        return self.body(h) + 1e-10 * self.aux(h).mean((2, 3))


def half_mse(out, y):
    """The user's own loss, cast to fp16 before the sum (overflows even in a float32 run)."""
    return ((out.half() - y.half()) ** 2).sum() / out.shape[0]


def summed_nll(out, y):
    """A token NLL summed with torch.sum on what autocast returns (fp16 under autocast)."""
    logp = out - out.logsumexp(-1, keepdim=True)
    return -torch.sum(logp.gather(-1, y[..., None])) / y.numel()


class PartBF16(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(60, 16).to(torch.bfloat16), nn.Linear(16, 60)

    def forward(self, ids):
        return self.head(self.emb(ids).float())


class ProjFn(torch.autograd.Function):
    """A frozen projection whose weight comes through ctx (not an input): the inputs are one
    dtype, but the backward multiplies a 16-bit gradient by the float32 weight."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return x @ layer.weight.t()

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.layer.weight, None


class FnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(ProjFn.apply(self.a(x), self.frozen)))


def _library_op(name, autocast_rule):
    @torch.library.custom_op(f"amp_heldout3::{name}", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w) * 0.5

    @op.register_fake
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[1])

    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.mm(g, w.t()) * 0.5, torch.mm(x.t(), g) * 0.5

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output:
                         ctx.save_for_backward(*inputs))
    if autocast_rule:
        torch.library.register_autocast(f"amp_heldout3::{name}", "cpu", torch.float32)
    return op


OPS = {"half_mm": _library_op("half_mm", autocast_rule=False),
       "ruled_mm": _library_op("ruled_mm", autocast_rule=True)}


class OpNet(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.a, self.head, self.op = nn.Linear(16, 16), nn.Linear(16, 4), op
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)

    def forward(self, x):
        return self.head(torch.relu(OPS[self.op](self.a(x), self.w)))


class GradOnlyBlock(nn.Module):
    """An 'inference path' taken without gradients: a reentrant checkpoint runs its first pass
    under no_grad (float32 here) and its recompute with gradients (fp16 under autocast)."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        if torch.is_grad_enabled():
            return self.f(x)
        with torch.autocast(x.device.type, enabled=False):
            return self.f(x.float())


class CkptNet(nn.Module):
    def __init__(self, block, reentrant):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(16, 16), block, nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant))


class InnerBF16Region(nn.Module):
    """A non-reentrant checkpoint of a region that enters bf16 autocast itself: its recompute
    runs as its forward did (and non-reentrant recompute stops early, once it has what the
    backward needs)."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.f = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def region(self, h):
        with torch.autocast(h.device.type, dtype=torch.bfloat16):
            return self.f(h).float()

    def forward(self, x):
        return self.head(checkpoint(self.region, self.inp(x), use_reentrant=False))


class SequentialCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                    for _ in range(4)])

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint_sequential(
            self.body, 2, self.inp(x), use_reentrant=True))


class GeM(nn.Module):
    """Generalized-mean pooling (image retrieval) with a learned exponent: x.clamp(eps)^p
    underflows to 0 in fp16, and d/dp of the mean's 1/p-th power takes log(0)."""

    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p, self.eps = nn.Parameter(torch.tensor(p)), eps

    def forward(self, x):
        return x.clamp(min=self.eps).pow(self.p).mean((2, 3)).pow(1.0 / self.p)


class Retrieval(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.pool, self.fc = GeM(), nn.Linear(16, 5)
        with torch.no_grad():
            self.backbone[0].bias.fill_(-0.5)

    def forward(self, x):
        return self.fc(self.pool(self.backbone(x)))


class VAE(nn.Module):
    """Returns {'loss', 'recon'}; the KL term's logvar.exp() is computed in the model's own
    forward, between its layers."""

    def __init__(self, logvar_bias=0.0):
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(20, 32), nn.Linear(32, 8), nn.Linear(32, 8)
        self.dec = nn.Linear(8, 20)
        with torch.no_grad():
            self.logvar.bias.fill_(logvar_bias)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        mu, lv = self.mu(h), self.logvar(h)
        rec = self.dec(mu + torch.randn_like(mu) * torch.exp(0.5 * lv))
        kl = -0.5 * torch.mean(1 + lv - mu.pow(2) - lv.exp())
        return {"loss": F.mse_loss(rec.float(), x) + kl.float(), "recon": rec}


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _fp16_loss(model, x, y):
    with torch.autocast(x.device.type, dtype=torch.float16):
        return F.cross_entropy(model(x).float(), y)


def direct_optimizer_step(model, optimizer, scaler, batch):
    optimizer.zero_grad()
    scaler.scale(_fp16_loss(model, *batch)).backward()
    scaler.unscale_(optimizer)
    optimizer.step()  # bypasses GradScaler's inf check
    scaler.update()


def unscaled_backward(model, optimizer, scaler, batch):
    optimizer.zero_grad()
    _fp16_loss(model, *batch).backward()  # scaler.step then divides by the scale
    scaler.step(optimizer)
    scaler.update()


def accumulate_then_clip_by_value(model, optimizer, scaler, batch, scheduler=None):
    x, y = batch
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        scaler.scale(_fp16_loss(model, xs, ys) / 2).backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)  # scaled gradients
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def scheduler_first(model, optimizer, scaler, batch, scheduler=None):
    optimizer.zero_grad()
    scaler.scale(_fp16_loss(model, *batch)).backward()
    if scheduler is not None:
        scheduler.step()
    scaler.step(optimizer)
    scaler.update()


def unscale_twice(model, optimizer, scaler, batch):
    optimizer.zero_grad()
    scaler.scale(_fp16_loss(model, *batch)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.unscale_(optimizer)  # a helper that unscales again
    scaler.step(optimizer)
    scaler.update()


def update_then_step(model, optimizer, scaler, batch):
    optimizer.zero_grad()
    scaler.scale(_fp16_loss(model, *batch)).backward()
    scaler.update()
    scaler.step(optimizer)


def step_every_micro_batch(model, optimizer, scaler, batch):
    x, y = batch
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        scaler.scale(_fp16_loss(model, xs, ys) / 2).backward()
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def bf16_step(model, optimizer, scaler, batch):
    x, y = batch
    optimizer.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def fp16_step_without_scaler(model, optimizer, scaler, batch):
    optimizer.zero_grad()
    _fp16_loss(model, *batch).backward()
    optimizer.step()


def careful_step(model, optimizer, scaler, batch, scheduler=None):
    optimizer.zero_grad()
    scaler.scale(_fp16_loss(model, *batch)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if scheduler is not None and scaler.get_scale() >= before:
        scheduler.step()


# --- each problem at its site -------------------------------------------------------------------

def _half_conv_adam():
    seeded()
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 4)).half()
    g = torch.Generator().manual_seed(1)
    return net, dict(batch=(torch.randn(4, 3, 8, 8, generator=g).half(),
                            torch.randint(0, 4, (4,), generator=g)),
                     optimizer=torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-8))


def _part_bf16():
    seeded()
    net = PartBF16()
    g = torch.Generator().manual_seed(1)
    return net, dict(batch=(torch.randint(0, 60, (4, 8), generator=g),
                            torch.randint(0, 60, (4, 8), generator=g)),
                     optimizer=torch.optim.AdamW(net.parameters(), lr=1e-4))


PROBLEMS = {
    "HF dataclass, FFN output overflows": (
        lambda: (HFLike(big=2e5), dict(inputs=hf_inputs())),
        "activation-overflow", "encoder.layer.1.output"),
    "FFN deep in ModuleDict/ModuleList/Sequential": (
        lambda: (Stages(), dict(batch=classes(s=1))), "activation-overflow", "stages.high.1.1.2"),
    "nn.MultiheadAttention scores (need_weights)": (
        lambda: (MHANet(), dict(batch=(torch.randn(3, 8, 6, generator=seeded()) * 2,
                                       torch.randint(0, 3, (3,))))),
        "attention-overflow", "mha (MultiheadAttention), op aten.bmm"),
    "aux conv head weighted 1e-10": (
        lambda: (AuxConv(), dict(batch=(torch.randn(8, 3, 8, 8, generator=seeded()),
                                        torch.randint(0, 4, (8,))))),
        "grad-underflow", "aux.weight"),
    ".half() loss overflows in fp32 too": (
        lambda: (mlp(), dict(batch=(torch.randn(64, 16, generator=seeded()),
                                    torch.randn(64, 4) * 30), loss_fn=half_mse)),
        "loss-16bit", "half_mse (the loss), op aten.sum"),
    "torch.sum over an fp16 log-prob": (
        lambda: (nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)), dict(
            batch=(torch.randint(0, 50, (4, 64), generator=seeded()),
                   torch.randint(0, 50, (4, 64))), loss_fn=summed_nll)),
        "loss-16bit", "summed_nll"),
    "fp16 conv net with Adam(eps=1e-8)": (_half_conv_adam, "16bit-optimizer-state",
                                         "param group 0"),
    "bf16 embedding beside an fp32 head, AdamW": (_part_bf16, "16bit-weights", "emb.weight"),
    "custom Function, weight through ctx": (
        lambda: (FnNet(), dict(batch=classes())), "custom-function", "ProjFn"),
    "torch.library op without an autocast rule": (
        lambda: (OpNet("half_mm"), dict(batch=classes())), "custom-function",
        "custom op amp_heldout3::half_mm"),
    "reentrant checkpoint recomputing in fp16": (
        lambda: (CkptNet(GradOnlyBlock(), True), dict(batch=classes())),
        "checkpoint-recompute", "block"),
    "GeM pooling: inf gradient at every scale": (
        lambda: (Retrieval(), dict(batch=(torch.randn(4, 3, 8, 8, generator=seeded()) * 0.1,
                                          torch.randint(0, 5, (4,))))),
        "scale-collapse", "pool.p"),
    "optimizer.step() outside scaler.step": (
        lambda: (mlp(), dict(batch=classes(), step_fn=direct_optimizer_step)),
        "scaler-misuse", "direct optimizer step"),
    "backward without scaler.scale": (
        lambda: (mlp(), dict(batch=classes(), step_fn=unscaled_backward)),
        "scaler-misuse", "loss not scaled"),
    "accumulation, clip_grad_value_ on scaled gradients": (
        lambda: (mlp(), dict(batch=classes(), step_fn=accumulate_then_clip_by_value)),
        "scaler-misuse", "clip before unscale_"),
    "scheduler stepped before scaler.step": (
        lambda: (mlp(), dict(batch=classes(), step_fn=scheduler_first)),
        "scaler-misuse", "scheduler on skipped step"),
    "scaler.unscale_ twice in a step": (
        lambda: (mlp(), dict(batch=classes(), step_fn=unscale_twice)),
        "scaler-misuse", "second unscale_"),
    "scaler.update before scaler.step": (
        lambda: (mlp(), dict(batch=classes(), step_fn=update_then_step)),
        "scaler-misuse", "update before step"),
}


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_heldout3_problem_is_caught_at_its_site(name):
    build, cls, site = PROBLEMS[name]
    seeded()  # the model's weights: built before its batch
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    hits = [a for a in r.alarms() if a["class"] == cls and site in a["site"]]
    assert hits, [(a["class"], a["site"]) for a in r.alarms()]
    assert hits[0]["fix"] and hits[0]["lesson"].startswith("lesson ")
    text = " ".join(r.advice["lines"])
    if cls not in ("16bit-weights", "16bit-optimizer-state", "scaler-misuse"):
        assert "safe here" not in text and "keep it" not in text or cls in (
            "loss-16bit", "checkpoint-recompute"), text
    if cls in ("custom-function", "checkpoint-recompute", "loss-16bit", "scaler-misuse",
               "16bit-optimizer-state"):  # the verdict says to fix it first
        assert cls in r.verdict["text"] or r.verdict["text"].startswith("fix your code"), \
            r.verdict["text"]


# --- healthy models: no alarm -------------------------------------------------------------------

class DWSep(nn.Module):
    def __init__(self):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, i, 3, padding=1, groups=i), nn.Conv2d(i, o, 1),
                                 nn.GroupNorm(4, o), nn.SiLU())
        self.f = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), block(8, 16),
                               block(16, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(32, 5)

    def forward(self, x):
        return self.fc(self.f(x))


class EncDec(nn.Module):
    def __init__(self, v=30, d=32):
        super().__init__()
        self.src, self.tgt = nn.Embedding(v, d), nn.Embedding(v, d)
        self.t = nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, v)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.t(self.src(src), self.tgt(tgt), tgt_mask=mask))


class Mixer(nn.Module):
    def __init__(self, patches=16, c=24):
        super().__init__()
        self.patch = nn.Conv2d(3, c, 4, 4)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "n1": nn.LayerNorm(c), "n2": nn.LayerNorm(c),
            "tok": nn.Sequential(nn.Linear(patches, 32), nn.GELU(), nn.Linear(32, patches)),
            "ch": nn.Sequential(nn.Linear(c, 48), nn.GELU(), nn.Linear(48, c))})
            for _ in range(2))
        self.head = nn.Linear(c, 6)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2)
        for layer in self.layers:
            h = h + layer["tok"](layer["n1"](h).transpose(1, 2)).transpose(1, 2)
            h = h + layer["ch"](layer["n2"](h))
        return self.head(h.mean(1))


class SegNet(nn.Module):
    """Dense prediction: N x C x H x W logits against an N x H x W map of class ids."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"),
                                nn.Conv2d(8, 4, 3, padding=1))

    def forward(self, x):
        return self.up(self.down(x))


def _encdec():
    g = seeded()
    return EncDec(), dict(
        inputs=(torch.randint(0, 30, (2, 7), generator=g), torch.randint(0, 30, (2, 6),
                                                                         generator=g)),
        target=torch.randint(0, 30, (2, 6), generator=g),
        loss_fn=lambda o, y: F.cross_entropy(o.flatten(0, 1).float(), y.flatten()))


HEALTHY = {
    "depthwise-separable CNN with GroupNorm": lambda: (DWSep(), dict(batch=(
        torch.randn(4, 3, 16, 16, generator=seeded()), torch.randint(0, 5, (4,))))),
    "tiny nn.Transformer encoder-decoder": _encdec,
    "MLP-mixer": lambda: (Mixer(), dict(batch=(torch.randn(4, 3, 16, 16, generator=seeded()),
                                              torch.randint(0, 6, (4,))))),
    "HF dataclass with its own loss": lambda: (HFLike(), dict(inputs=hf_inputs())),
    "non-reentrant checkpoint": lambda: (CkptNet(nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), False), dict(batch=classes())),
    "checkpointed region entering bf16 itself": lambda: (InnerBF16Region(),
                                                         dict(batch=classes())),
    "checkpoint_sequential (reentrant)": lambda: (SequentialCheckpoint(), dict(batch=classes())),
    "custom op with an autocast rule": lambda: (OpNet("ruled_mm"), dict(batch=classes())),
    "segmentation, class-id maps as target": lambda: (SegNet(), dict(batch=(
        torch.randn(2, 3, 16, 16, generator=seeded()), torch.randint(0, 4, (2, 16, 16))))),
    "a careful AMP step with a scheduler": lambda: (mlp(), dict(batch=classes(),
                                                                step_fn=careful_step)),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_heldout3_healthy_model_raises_no_alarm(name):
    seeded()
    model, kwargs = HEALTHY[name]()
    healthy_report(model, **kwargs)


# --- the classes of misjudgement, one by one ----------------------------------------------------

def test_a_model_returning_its_loss_and_logits_is_measured_on_its_own_loss():
    """Labels went in and no target was given: the logits against made-up random targets would
    be another loss than the one it trains on."""
    seeded()
    r = al.doctor(HFLike(), inputs=hf_inputs(), **QUICK)
    assert "'loss'" in r.output.split("(")[0] and "own loss" in r.loss
    assert not r.no_gradient
    r = al.doctor(HFLike(), inputs=hf_inputs(), output="logits", **QUICK)
    assert "'logits' (as given)" in r.output and "random class ids" in r.loss
    r = al.doctor(HFLike(), inputs=hf_inputs(), target=torch.randint(0, 3, (4,)), **QUICK)
    assert "'logits'" in r.output.split("(")[0] and "the target given" in r.loss


def test_an_output_that_is_no_tensor_is_refused_saying_what_it_is():
    seeded()
    ids = {"input_ids": hf_inputs()["input_ids"]}
    with pytest.raises(ValueError, match=r"^output 'hidden_states' is a tuple, not a tensor: "
                                         r".*'logits' \(4x3 float32\)$"):
        al.doctor(HFLike(), inputs=ids, output="hidden_states", **QUICK)
    with pytest.raises(ValueError, match=r"^output 'loss' is None for this batch .*labels"):
        al.doctor(HFLike(), inputs=ids, output="loss", **QUICK)


def test_a_loss_the_user_casts_to_fp16_is_not_called_an_fp32_bug():
    """An inf from fp16 inputs in the float32 run is the user's own .half(): the verdict says to
    compute that part in float32, not that no precision helps."""
    build, _, _ = PROBLEMS[".half() loss overflows in fp32 too"]
    seeded()
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    assert not [a for a in r.alarms() if a["class"] == "fp32-nonfinite"]
    assert r.verdict["text"].startswith("fix your code first") and "float32" in r.verdict["text"]
    assert "no precision helps" not in " ".join(r.advice["lines"])
    assert ".half()" in r.alarms()[0]["fix"]


class TiedGPT(nn.Module):
    """A small GPT with tied embeddings (N(0, 1) init: large logits, a saturated softmax) and
    causal F.scaled_dot_product_attention."""

    def __init__(self, v=64, d=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(v, d), nn.Parameter(torch.zeros(1, 16, d))
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d),
            "ln2": nn.LayerNorm(d), "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(),
                                                         nn.Linear(4 * d, d))})
            for _ in range(2))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, v, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        B, T = ids.shape
        h = self.tok(ids) + self.pos[:, :T]
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](h)).view(B, T, 3, 2, -1).permute(2, 0, 3, 1, 4)
            h = h + b["o"](F.scaled_dot_product_attention(q, k, v, is_causal=True)
                           .transpose(1, 2).reshape(B, T, -1))
            h = h + b["mlp"](b["ln2"](h))
        return self.head(self.ln(h))


def lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


@pytest.mark.parametrize("build, batch, loss_fn", [
    (TiedGPT, lambda g: (lambda t: (t[:, :-1], t[:, 1:]))(
        torch.randint(0, 64, (4, 17), generator=g)), lm_loss),
    (SDPANet, lambda g: (torch.randn(3, 8, 6, generator=g) * 2,
                         torch.randint(0, 3, (3,), generator=g)), None),
], ids=["tied GPT, saturated softmax", "SDPA with large q and k"])
def test_flushed_values_that_change_no_gradient_do_not_make_fp16_unsafe(build, batch, loss_fn):
    """3% of all gradient values flushed to zero made fp16 "unsafe" (no site named) on a healthy
    tied GPT: they are the logits' gradients of tokens the softmax gives ~0, the smallest of
    their gradient. Each layer's output gradient and each parameter's is now measured after the
    fp16 round trip: none changes by 1%, so fp16 is safe, and the advice says why."""
    seeded()
    model = build()
    r = al.doctor(model, batch(seeded()), loss_fn=loss_fn, **QUICK)
    assert not r.alarms(), [(a["class"], a["site"]) for a in r.alarms()]
    assert r.advice["fp16_safe"] is True
    assert "but they are the smallest of their gradients" in " ".join(r.advice["lines"])


def test_flushed_values_that_do_change_a_gradient_name_its_layer():
    """Where the flushed values do carry a gradient (the gradient into a layer's output changes
    by more than 1%), fp16 is unsafe and that layer is the alarm's site."""
    from amp_lessons.doctor import diagnose, scale

    out = {"layer": "blocks.3.attn", "values": 100, "share_k": 0.4, "share_default": 0.5,
           "error_k": 0.2, "error_default": 0.3}
    param = {"parameter": "head.weight", "values": 10, "share_k": 0.0, "share_default": 0.0,
             "error_k": 0.0001, "error_default": 0.0001}
    a = scale.advice(17, [], 0.05, 0.06, True, flushed_at_k=0.04, worst_layer=param,
                     worst_output=out)
    assert a["fp16_safe"] is False and a["reason"] == "flushed"
    assert "blocks.3.attn's output changes by 20.0%" in " ".join(a["lines"])
    quiet = scale.advice(17, [], 0.05, 0.06, True, flushed_at_k=0.04, worst_layer=param,
                         worst_output={**out, "error_k": 0.0002})
    assert quiet["fp16_safe"] is True
    rows = [{"layer": "blocks.3.attn", "grad_fp16_counts": {"nonzero": 100, "flushed": 40}},
            {"layer": "head", "grad_fp16_counts": {"nonzero": 1000, "flushed": 90}}]
    hit = diagnose.underflow_alarm([param], 17, 16, "bf16", 0.04, rows, [out])
    assert hit and hit[0]["site"] == "blocks.3.attn" and hit[0]["class"] == "grad-underflow"
    assert "changes by 20.0%" in hit[0]["finding"]


def test_a_custom_op_failure_names_the_op_and_its_autocast_rule():
    seeded()
    r = al.doctor(OpNet("half_mm"), classes(), **QUICK)
    hit = next(a for a in r.alarms() if a["class"] == "custom-function")
    assert "torch.library.register_autocast('amp_heldout3::half_mm', 'cpu', torch.float32)" in \
        hit["fix"]
    assert "custom op amp_heldout3::half_mm" in " ".join(r.advice["lines"])


def test_a_collapse_from_an_op_cuda_runs_in_float32_is_not_decided_for_a_gpu():
    build, _, _ = PROBLEMS["GeM pooling: inf gradient at every scale"]
    seeded()
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    hit = next(a for a in r.alarms() if a["class"] == "scale-collapse")
    assert "aten.log" in hit["site"] and "maybe on this CPU only" in hit["finding"]
    assert "fp16 not decided by this CPU run" in r.verdict["on_gpu"]


def test_a_step_fn_that_grad_scaler_refuses_is_named_by_its_misuse():
    """GradScaler's own error is read against the calls of the step that raised: a second
    scaler.step in one step is not also called a missing update; an unscale_ twice is not a
    missing update; update before step is a misuse, not "not checked"."""
    seeded()
    r = al.doctor(mlp(), classes(), step_fn=step_every_micro_batch, **QUICK)
    assert [a["site"] for a in r.alarms()] == ["second step"], r.alarms()
    r = al.doctor(mlp(), classes(), step_fn=unscale_twice, **QUICK)
    assert [a["site"] for a in r.alarms()] == ["second unscale_"], r.alarms()
    r = al.doctor(mlp(), classes(), step_fn=update_then_step, **QUICK)
    assert r.step_check["status"] == "checked" and [a["site"] for a in r.alarms()] == [
        "update before step"]


def test_an_op_between_layers_is_fixed_where_the_forward_calls_it():
    """An exp in the model's own forward (not in a submodule): the fix is that op in float32,
    not "keep the model's own forward in fp32" (which is fp32 training); CUDA autocast runs exp
    in float32, so the GPU is left undecided."""
    g = seeded()
    r = al.doctor(VAE(logvar_bias=12.0), inputs=torch.randn(16, 20, generator=g), **QUICK)
    hit = next(a for a in r.alarms() if a["class"] == "activation-overflow")
    assert hit["site"] == "the model's own forward (VAE), op aten.exp"
    assert hit["fix"].startswith("run that aten.exp in float32 at the line of the model's own forward")
    assert "on this CPU only" in hit["finding"] and "not decided" in r.verdict["on_gpu"]
    g = seeded()
    assert not al.doctor(VAE(), inputs=torch.randn(16, 20, generator=g), **QUICK).alarms()


def test_a_checkpoint_recompute_cites_lesson_05_and_the_doctor_warns_nothing_of_its_own():
    """torch.utils.checkpoint is lesson 05's; the doctor's own no-grad forwards of a reentrant
    checkpoint made torch warn "None of the inputs have requires_grad=True" on every run."""
    seeded()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = al.doctor(CkptNet(GradOnlyBlock(), True), classes(), **QUICK)
    assert not [w for w in seen if "requires_grad" in str(w.message)], [str(w.message)
                                                                        for w in seen]
    hit = next(a for a in r.alarms() if a["class"] == "checkpoint-recompute")
    assert hit["lesson"].startswith("lesson 05: activation checkpointing")
    assert "use_reentrant=False" in hit["fix"]


def test_a_step_that_needs_no_grad_scaler_is_not_told_to_use_one():
    """The course's own advice, bf16 autocast, needs no GradScaler: a bf16 (or float32) step that
    never touches the scaler was two scaler-misuse alarms. An fp16 step without it still is."""
    seeded()
    r = al.doctor(mlp(), classes(), step_fn=bf16_step, **QUICK)
    assert not r.alarms() and r.step_check["status"] == "checked", r.alarms()
    assert "bf16 and float32 need none" in r.step_check["reason"]
    r = al.doctor(mlp(), classes(), step_fn=fp16_step_without_scaler, **QUICK)
    assert {"direct optimizer step", "loss not scaled"} <= {a["site"] for a in r.alarms()}


def _scale_only(model, optimizer, scaler):
    """A resume that keeps the scale alone: a new GradScaler(init_scale=the saved scale)."""
    return torch.amp.GradScaler(next(model.parameters()).device.type,
                                init_scale=scaler.get_scale())


def test_a_resume_that_keeps_only_the_scale_says_what_was_lost():
    seeded()
    r = al.doctor(mlp(), classes(), checkpoint_fn=_scale_only, **QUICK)
    hit = next(a for a in r.alarms() if a["class"] == "scaler-resume")
    assert "growth tracker does not" in hit["finding"] and "starts again from init_scale" \
        not in hit["finding"]
    assert hit["evidence"].startswith("growth_tracker")


def test_16bit_weights_that_still_move_say_when_they_stop():
    """At lr 1e-3 every fp16 weight still moves in one step: the alarm says from which update
    size half of them would not."""
    model, kwargs = _half_conv_adam()
    r = al.doctor(model, **{**QUICK, **kwargs})
    hit = next(a for a in r.alarms() if a["class"] == "16bit-weights")
    assert "stop moving once an update falls below" in hit["finding"]


def test_fp8_names_the_widest_layer_as_a_layer():
    r = al.doctor(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)),
                  (torch.randn(8, 64), torch.randint(0, 10, (8,))), **QUICK)
    text = next(f["finding"] for f in r.findings if f["topic"] == "fp8")
    assert "FP8 would be slower than bf16" in text and "widest: layer 0, 64x128" in text


# --- the command line, on a model file of the user's ---------------------------------------------

MODEL_FILE = '''
import torch
from torch import nn
import torch.nn.functional as F


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 32)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 3)
        with torch.no_grad():
            self.mha.in_proj_weight[:64].mul_(800.0)

    def forward(self, x):
        h = self.inp(x)
        return self.head((h + self.mha(h, h, h)[0]).mean(1))


def attention():
    torch.manual_seed(0)
    return Attn()


def two_inputs():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 8), nn.Linear(7, 8)

        def forward(self, x, y):
            return self.a(x) + self.b(y)
    return Pair()


def broken():
    raise RuntimeError("weights file not found")
'''


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    (tmp_path / "heldout3_models.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "heldout3_models"


def _cli(capsys, *args):
    from amp_lessons.cli import main

    status = main(["doctor", *args, "--trial-steps", "1", "--compile", "off"])
    out, err = capsys.readouterr()
    return status, out, [line for line in err.splitlines() if not line.startswith("doctor: ")]


def test_cli_names_the_attention_site_first_after_the_verdict(model_file, capsys):
    status, out, err = _cli(capsys, "--model", f"{model_file}:attention", "--batch-shape",
                            "3,8,6")
    assert status == 0 and not err, err
    lines = out.splitlines()
    assert lines[0].startswith("verdict for cpu")
    assert lines[1].startswith("[alarm: overflow]") and "inside mha (MultiheadAttention)" in \
        lines[1] and "at mha (MultiheadAttention), op aten.bmm" in lines[1]
    assert "1/sqrt(head_dim)" in lines[2]


def test_cli_several_inputs_and_a_factory_that_raises(model_file, capsys):
    status, out, err = _cli(capsys, "--model", f"{model_file}:two_inputs", "--input", "4,5",
                            "--input", "4,7")
    assert status == 0 and out.startswith("verdict for cpu"), err
    status, out, err = _cli(capsys, "--model", f"{model_file}:broken", "--batch-shape", "2,3")
    assert status == 2 and len(err) == 1 and "weights file not found" in err[0], err
    assert "Traceback" not in err[0]


def test_cli_takes_a_model_file_by_its_path(tmp_path, capsys):
    """A new user passes the file they wrote: path/to/file.py:FACTORY (it was "No module named
    '/tmp/.../models'; is it installed, or on PYTHONPATH?")."""
    (tmp_path / "my_models.py").write_text(MODEL_FILE)
    status, out, err = _cli(capsys, "--model", f"{tmp_path / 'my_models.py'}:two_inputs",
                            "--input", "4,5", "--input", "4,7")
    assert status == 0 and out.startswith("verdict for cpu"), err
    status, out, err = _cli(capsys, "--model", f"{tmp_path / 'missing.py'}:build",
                            "--batch-shape", "2,3")
    assert status == 2 and len(err) == 1 and "missing.py" in err[0] and "does not exist" in err[0]
