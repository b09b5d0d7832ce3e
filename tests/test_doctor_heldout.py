"""The doctor on held-out models: architectures the doctor and its bench were not built from (a
gated-GELU T5 encoder in bf16, a custom Function in a convolutional net's head, a decoder's
cross-attention, a siamese distance, a conv LayerScale, dict outputs with other key names), each problem
caught at its site, and no alarm on held-out healthy models (a conv autoencoder, a ViT-like
encoder, a decorated custom Function, an HF-like model that returns its own loss)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons as al
from doctor_helpers import QUICK, seeded

# --- problems ---------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class GatedFFN(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.wi_0, self.wi_1 = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.wo = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return self.wo(F.gelu(self.wi_0(x)) * self.wi_1(x))


class T5Encoder(nn.Module):
    def __init__(self, vocab=50, d=24, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict({"norm": RMSNorm(d), "ff": GatedFFN(d, 48)})
                                    for _ in range(layers))
        self.final = RMSNorm(d)
        self.lm = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["ff"](layer["norm"](h))
        return self.lm(self.final(h))


def t5_bf16_trained():
    """Weights 'trained in bf16': one FFN's output projection grew past fp16's range."""
    g = seeded()
    net = T5Encoder()
    with torch.no_grad():
        net.layers[2]["ff"].wo.weight.mul_(2e5)
    ids = torch.randint(0, 50, (4, 12), generator=g)
    return net, dict(batch=(ids, ids), loss_fn=lambda out, y: F.cross_entropy(
        out.flatten(0, 1).float(), y.flatten()))


class OuterFn(torch.autograd.Function):
    """A custom bilinear pooling in a CNN head, undecorated: its backward multiplies a 16-bit
    gradient with a float32 saved tensor."""

    @staticmethod
    def forward(ctx, a, m):
        ctx.save_for_backward(a, m)
        return a @ m

    @staticmethod
    def backward(ctx, g):
        a, m = ctx.saved_tensors
        return g @ m.t(), a.t() @ g


class ConvWithCustomHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.mix = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.out = nn.Linear(8, 5)

    def forward(self, x):
        return self.out(OuterFn.apply(self.conv(x).flatten(1), self.mix))


def conv_custom_function():
    g = seeded()
    return ConvWithCustomHead(), dict(batch=(torch.randn(4, 3, 12, 12, generator=g),
                                             torch.randint(0, 5, (4,), generator=g)))


class EncoderClassifier(nn.Module):
    def __init__(self, d=32, big=1.0):
        super().__init__()
        self.proj = nn.Linear(6, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True), 1,
            enable_nested_tensor=False)
        self.cls = nn.Linear(d, 3)
        with torch.no_grad():
            self.encoder.layers[0].self_attn.in_proj_weight[:2 * d].mul_(big)

    def forward(self, x):
        return self.cls(self.encoder(self.proj(x)).mean(1))


class CrossAttention(nn.Module):
    """Queries from a decoder, keys from an encoder memory, scores by einsum without the
    1/sqrt(d) factor (PyTorch's fused attention accumulates in float32 and does not overflow;
    a hand-written one does)."""

    def __init__(self, d=24, big=150.0):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        with torch.no_grad():
            self.to_q.weight.mul_(big)
            self.to_k.weight.mul_(big)

    def forward(self, x, memory):
        s = torch.einsum("bqd,bkd->bqk", self.to_q(x), self.to_k(memory))
        return torch.einsum("bqk,bkd->bqd", s.softmax(-1), self.to_v(memory))


class Decoder(nn.Module):
    def __init__(self, d=24):
        super().__init__()
        self.inp, self.mem = nn.Linear(5, d), nn.Linear(7, d)
        self.xattn = CrossAttention(d)
        self.out = nn.Linear(d, 4)

    def forward(self, x, memory):
        return self.out(self.xattn(self.inp(x), self.mem(memory)).mean(1))


def cross_attention_overflow():
    g = seeded()
    return Decoder(), dict(inputs=(torch.randn(2, 6, 5, generator=g) * 2,
                                   torch.randn(2, 9, 7, generator=g) * 2),
                           target=torch.randint(0, 4, (2,), generator=g))


class Siamese(nn.Module):
    """Distance between two nearly equal embeddings: (a - b)^2 underflows to 0 in fp16 and the
    backward of sqrt(0) is inf at any loss scale."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, a, b):
        d = ((self.enc(a) - self.enc(b)) ** 2).mean(-1).sqrt()
        return torch.stack([d, -d], -1)


def siamese_collapse():
    g = seeded()
    a = torch.randn(8, 10, generator=g)
    b = a + 1e-4 * torch.randn(8, 10, generator=g)
    return Siamese(), dict(inputs=(a, b), target=torch.randint(0, 2, (8,), generator=g))


class ConvLayerScale(nn.Module):
    def __init__(self, gamma=1e-9):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gamma = nn.Parameter(torch.full((8, 1, 1), gamma))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = F.gelu(self.stem(x))
        h = h + self.gamma * self.dw(h)
        return self.fc(h.mean((2, 3)))


def conv_layerscale_underflow():
    g = seeded()
    return ConvLayerScale(), dict(batch=(torch.randn(16, 3, 8, 8, generator=g),
                                         torch.randint(0, 4, (16,), generator=g)))


def bf16_adamw():
    seeded()
    net = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 3)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    return net, dict(batch=(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,),
                                                                           generator=g)),
                     optimizer=torch.optim.AdamW(net.parameters(), lr=1e-5))


def double_step():
    seeded()
    net = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))

    def step(model, optimizer, scaler, batch):
        x, y = batch
        with torch.autocast(x.device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.step(optimizer)  # a second step before update()
        scaler.update()
        optimizer.zero_grad()

    g = torch.Generator().manual_seed(2)
    return net, dict(batch=(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,),
                                                                           generator=g)),
                     step_fn=step)


PROBLEMS = [
    ("t5 gated FFN trained in bf16", t5_bf16_trained, "activation-overflow", "layers.2.ff.wo"),
    ("custom Function in a CNN head", conv_custom_function, "custom-function", "OuterFn"),
    ("decoder cross-attention scores", cross_attention_overflow, "attention-overflow",
     "xattn"),
    ("siamese distance sqrt(0)", siamese_collapse, "scale-collapse", "enc"),
    ("conv LayerScale underflow", conv_layerscale_underflow, "grad-underflow", "dw"),
    ("bf16 weights with AdamW", bf16_adamw, "16bit-weights", "0.weight"),
    ("scaler.step twice", double_step, "scaler-misuse", "second step"),
]


@pytest.mark.parametrize("name, build, cls, site", PROBLEMS, ids=[p[0] for p in PROBLEMS])
def test_heldout_problem_is_caught_at_its_site(name, build, cls, site):
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    hits = [a for a in r.alarms() if a["class"] == cls and site in a["site"]]
    assert hits, [(a["class"], a["site"]) for a in r.alarms()]
    assert hits[0]["fix"] and hits[0]["lesson"].startswith("lesson ")
    assert "safe here" not in " ".join(r.advice["lines"]) or cls in (
        "16bit-weights", "scaler-misuse")


# --- healthy ------------------------------------------------------------------------------------

class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
                                 nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.dec = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(),
                                 nn.ConvTranspose2d(8, 1, 4, stride=2, padding=1))

    def forward(self, x):
        return self.dec(self.enc(x))


def autoencoder():
    g = seeded()
    x = torch.rand(4, 1, 16, 16, generator=g)
    return AutoEncoder(), dict(batch=(x, x))


def vit_like():
    g = seeded()
    return EncoderClassifier(), dict(batch=(torch.randn(3, 10, 6, generator=g),
                                            torch.randint(0, 3, (3,), generator=g)))


class ScaledGelu(torch.autograd.Function):
    """A custom activation, decorated as lesson 02 teaches."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.gelu(x) * w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
            out = F.gelu(xx) * ww
        return torch.autograd.grad(out, (xx, ww), g)


class DecoratedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(10, 20), nn.Linear(20, 3)
        self.w = nn.Parameter(torch.ones(20))

    def forward(self, x):
        return self.b(ScaledGelu.apply(self.a(x), self.w))


def decorated_function():
    g = seeded()
    return DecoratedNet(), dict(batch=(torch.randn(8, 10, generator=g),
                                       torch.randint(0, 3, (8,), generator=g)))


class OwnLoss(nn.Module):
    """HF-style: takes labels and returns {'hidden': ..., 'loss': ..., 'scores': ...}."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(30, 16), nn.Linear(16, 30)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        scores = self.out(h)
        return {"hidden": h, "loss": F.cross_entropy(scores.flatten(0, 1).float(),
                                                     labels.flatten()), "scores": scores}


def own_loss():
    g = seeded()
    ids = torch.randint(0, 30, (4, 7), generator=g)
    return OwnLoss(), dict(inputs={"input_ids": ids, "labels": ids})


HEALTHY = [("conv autoencoder", autoencoder), ("ViT-like encoder", vit_like),
           ("decorated custom Function", decorated_function),
           ("HF-like model returning its loss", own_loss)]


@pytest.mark.parametrize("name, build", HEALTHY, ids=[h[0] for h in HEALTHY])
def test_heldout_healthy_model_raises_no_alarm(name, build):
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    assert not r.alarms(), [(a["class"], a["site"], a["finding"]) for a in r.alarms()]
    assert r.verdict["text"].startswith("stay in fp32: CPU")


def test_an_output_named_otherwise_is_refused_then_taken_by_key():
    class EmbPred(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            e = torch.relu(self.a(x))
            return {"emb": e, "pred": self.b(e)}

    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match=r"none is named 'logits' or 'loss'.*'emb'.*'pred'"
                                         r".*output=KEY.*--output KEY"):
        al.doctor(EmbPred(), (x, y), **QUICK)
    r = al.doctor(EmbPred(), (x, y), output="pred", **QUICK)
    assert "'pred'" in r.output and not r.no_gradient
    r = al.doctor(EmbPred(), (x, y), output="emb", loss_fn=lambda o, t: o.pow(2).mean(), **QUICK)
    assert r.no_gradient == ["b.weight", "b.bias"]
    warn = [f for f in r.findings if f["severity"] == "warn"]
    assert warn and "b.weight" in warn[0]["finding"] and "'emb'" in warn[0]["evidence"]


def test_the_own_loss_output_is_used_as_the_loss():
    model, kwargs = own_loss()
    r = al.doctor(model, **{**QUICK, **kwargs})
    assert "own loss" in r.loss and "'loss'" in r.output
    assert math.isfinite(r.layers[0]["act_absmax"])
