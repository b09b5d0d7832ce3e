"""The doctor on a fourth set of held-out models (none in its bench nor in the earlier held-out
files): a U-Net with skip connections, a ViT with a class token and einsum attention, a
cumsum/cumprod scan, a top-k mixture of experts returning a namedtuple (loss, logits, aux), a
CLIP-like model with a learned logit_scale.exp(), a diffusion noise predictor with sin/cos
timestep embeddings, a graph network aggregating with index_add_/scatter_add_, Embedding
(padding_idx) beside EmbeddingBag, weight_norm/spectral_norm parametrizations, layers in a plain
Python list beside an fp16 buffer, a fake-quant Function, and new step and checkpoint functions.
The classes of misjudgement found are pinned here: an unscale_ after update() (GradScaler does
not refuse it), a resumed GradScaler that is disabled, and an inf/NaN that comes from a 16-bit
zero (an underflow) rather than a value too large."""
import collections
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import amp_lessons as al
from doctor_helpers import QUICK, classes, healthy_report, seeded

def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


# --- models -------------------------------------------------------------------------------------

class DoubleConv(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o)
        self.c2, self.n2 = nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o)

    def forward(self, x):
        return F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))))


class UNet(nn.Module):
    def __init__(self, big=1.0):
        super().__init__()
        self.down1, self.down2, self.bottleneck = DoubleConv(3, 8), DoubleConv(8, 16), \
            DoubleConv(16, 32)
        self.up2, self.dec2 = nn.ConvTranspose2d(32, 16, 2, stride=2), DoubleConv(32, 16)
        self.up1, self.dec1 = nn.ConvTranspose2d(16, 8, 2, stride=2), DoubleConv(16, 8)
        self.head = nn.Conv2d(8, 2, 1)
        with torch.no_grad():
            self.up1.weight.mul_(big)

    def forward(self, x):
        s1 = self.down1(x)
        s2 = self.down2(F.max_pool2d(s1, 2))
        b = self.bottleneck(F.max_pool2d(s2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), s2], 1))
        return self.head(self.dec1(torch.cat([self.up1(d2), s1], 1)))


def unet(big=1.0):
    g = seeded()
    return UNet(big), dict(batch=(torch.randn(2, 3, 16, 16, generator=g),
                                  torch.randint(0, 2, (2, 16, 16), generator=g)))


class EinsumAttn(nn.Module):
    def __init__(self, d, h, scaled):
        super().__init__()
        self.qkv, self.o, self.h, self.scaled = nn.Linear(d, 3 * d), nn.Linear(d, d), h, scaled

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.h, C // self.h).unbind(2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k)
        if self.scaled:
            s = s / math.sqrt(C // self.h)
        return self.o(torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, C))


class ViTBlock(nn.Module):
    def __init__(self, d, h, scaled):
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(d), EinsumAttn(d, h, scaled), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    def __init__(self, d=32, scaled=True):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 17, d) * .02)
        self.blocks = nn.Sequential(*[ViTBlock(d, 4, scaled) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 5)

    def forward(self, x):
        p = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(p), -1, -1), p], 1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit(scaled=True, big=1.0):
    g = seeded()
    m = ViT(scaled=scaled)
    with torch.no_grad():
        m.blocks[1].attn.qkv.weight[:64].mul_(big)  # q and k of the second block
    return m, dict(batch=(torch.randn(4, 3, 16, 16, generator=g),
                          torch.randint(0, 5, (4,), generator=g)))


class Scan(nn.Module):
    """A selective-scan-like recurrence written with cumsum, exp and cumprod."""

    def __init__(self, d=16):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(8, d), nn.Linear(8, d), nn.Linear(d, 3)

    def forward(self, x):
        u, a = self.inp(x), torch.sigmoid(self.gate(x)) * 0.5 + 0.5
        la = torch.cumsum(torch.log(a), 1)
        h = torch.exp(la) * torch.cumsum(u * torch.exp(-la).clamp(max=1e4), 1)
        return self.out((h + torch.cumprod(a, 1)).mean(1))


MoEOut = collections.namedtuple("MoEOut", "loss logits aux")


class MoE(nn.Module):
    """Top-2 routing, a load-balancing aux loss, its own loss when labels are given."""

    def __init__(self, d=16, e=4, tiny=1.0):
        super().__init__()
        self.router = nn.Linear(d, e)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
                                     for _ in range(e))
        self.head, self.e, self.tiny = nn.Linear(d, 4), e, tiny

    def forward(self, x, labels=None):
        probs = self.router(x).float().softmax(-1)
        w, idx = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for j in range(self.e):
            for slot in range(2):
                sel = idx[:, slot] == j
                if sel.any():
                    out = self.experts[j](x[sel]) * (self.tiny if j == self.e - 1 else 1.0)
                    y = y.index_add(0, sel.nonzero()[:, 0], (w[sel, slot, None] * out).to(y.dtype))
        aux = self.e * (F.one_hot(idx[:, 0], self.e).float().mean(0) * probs.mean(0)).sum()
        logits = self.head(x + y)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels) + 0.01 * aux
        return MoEOut(loss, logits, aux)


def moe(tiny=1.0):
    g = seeded()
    m = MoE(tiny=tiny)
    return m, dict(inputs=(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)))


class CLIP(nn.Module):
    def __init__(self, normalize=True, scale=1 / 0.07):
        super().__init__()
        self.img = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(8, 32))
        self.txt_emb, self.txt = nn.Embedding(50, 32), nn.Linear(32, 32)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(scale)))
        self.normalize = normalize

    def forward(self, image, text):
        a, b = self.img(image), self.txt(self.txt_emb(text).mean(1))
        if self.normalize:
            a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
        return self.logit_scale.exp() * a @ b.t()


def clip(normalize=True, scale=1 / 0.07, big=1.0):
    g = seeded()
    m = CLIP(normalize, scale)
    with torch.no_grad():
        m.img[-1].weight.mul_(big)
        m.txt.weight.mul_(big)
    return m, dict(inputs=(torch.randn(8, 3, 16, 16, generator=g),
                           torch.randint(0, 50, (8, 6), generator=g)), target=torch.arange(8))


def timestep_embedding(t, dim, max_period=10000.0):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class NoisePred(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, 2 * d))
        self.inp, self.mid = nn.Conv2d(3, d, 3, padding=1), nn.Conv2d(d, d, 3, padding=1)
        self.out, self.norm, self.d = nn.Conv2d(d, 3, 3, padding=1), nn.GroupNorm(4, d), d

    def forward(self, x, t):
        s, b = self.t_mlp(timestep_embedding(t, self.d)).chunk(2, -1)
        h = self.norm(F.silu(self.inp(x))) * (1 + s[:, :, None, None]) + b[:, :, None, None]
        return self.out(F.silu(self.mid(h)))


def diffusion():
    g = seeded()
    x0, noise = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)
    return NoisePred(), dict(inputs=(x0 + noise, torch.randint(0, 1000, (4,), generator=g)),
                             target=noise)


class GraphConv(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.msg, self.upd = nn.Linear(d, d), nn.Linear(2 * d, d)

    def forward(self, x, src, dst):
        m = self.msg(x)[src]
        agg = torch.zeros(x.shape[0], m.shape[1], dtype=m.dtype).index_add_(0, dst, m)
        return F.relu(self.upd(torch.cat([x.to(agg.dtype), agg], -1)))


class GNN(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.enc, self.g1, self.g2, self.head = nn.Linear(4, d), GraphConv(d), GraphConv(d), \
            nn.Linear(d, 3)

    def forward(self, x, edge_index, batch_idx):
        h = self.g2(self.g1(self.enc(x), *edge_index), *edge_index)
        pooled = torch.zeros(int(batch_idx.max()) + 1, h.shape[1], dtype=h.dtype).scatter_add_(
            0, batch_idx[:, None].expand_as(h), h)
        return self.head(pooled)


def gnn(hub=0, big=1.0):
    g = seeded()
    n = 40
    src, dst = torch.randint(0, n, (120,), generator=g), torch.randint(0, n, (120,), generator=g)
    if hub:  # a hub node many edges point at
        src = torch.cat([src, torch.randint(0, n, (hub,), generator=g)])
        dst = torch.cat([dst, torch.zeros(hub, dtype=torch.long)])
    m = GNN()
    with torch.no_grad():
        m.g2.msg.weight.mul_(big)
        m.g2.msg.bias.fill_(big)
    return m, dict(inputs=(torch.randn(n, 4, generator=g), torch.stack([src, dst]),
                           torch.arange(n) // 10), target=torch.randint(0, 3, (4,), generator=g))


class BagText(nn.Module):
    def __init__(self, v=100, d=16):
        super().__init__()
        self.tok = nn.Embedding(v, d, padding_idx=0)
        self.bag = nn.EmbeddingBag(v, d, mode="mean", padding_idx=0)
        self.fc = nn.Linear(2 * d, 4)

    def forward(self, ids):
        return self.fc(torch.cat([self.tok(ids).mean(1), self.bag(ids)], -1))


def bagtext():
    g = seeded()
    ids = torch.randint(1, 100, (8, 10), generator=g)
    ids[:, 7:] = 0
    return BagText(), dict(batch=(ids, torch.randint(0, 4, (8,), generator=g)))


class ParamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = weight_norm(nn.Linear(12, 32)), spectral_norm(nn.Linear(32, 32))
        self.c = nn.Linear(32, 3)

    def forward(self, x):
        return self.c(F.leaky_relu(self.b(F.leaky_relu(self.a(x)))))


class ListNet(nn.Module):
    """Layers in a plain Python list (not registered) and a buffer in fp16."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(16, 16) for _ in range(2)]
        self.fc = nn.Linear(16, 4)
        self.register_buffer("mean", torch.zeros(16, dtype=torch.float16))

    def forward(self, x):
        x = x - self.mean
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.fc(x)


class FakeQuantLinearFn(torch.autograd.Function):
    """Straight-through fake quantization of the weight; the backward's matmuls take the saved
    fp32 weight with an fp16 gradient under autocast."""

    @staticmethod
    def forward(ctx, x, w, scale):
        wq = torch.clamp(torch.round(w / scale), -127, 127) * scale
        ctx.save_for_backward(x, wq)
        return x @ wq.t()

    @staticmethod
    def backward(ctx, g):
        x, wq = ctx.saved_tensors
        return g @ wq, g.flatten(0, -2).t() @ x.flatten(0, -2), None


class QATLinear(nn.Linear):
    def forward(self, x):
        return FakeQuantLinearFn.apply(x, self.weight, self.weight.detach().abs().max() / 127) \
            + self.bias


class QATNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), QATLinear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


class TinyRMS(nn.Module):
    """An RMS norm by hand on features of about 1e-4: their squares flush to 0 in fp16."""

    def __init__(self):
        super().__init__()
        self.proj, self.fc = nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.proj.weight.mul_(1e-4)
            self.proj.bias.zero_()

    def forward(self, x):
        h = self.proj(x)
        return self.fc(h / torch.sqrt((h * h).mean(-1, keepdim=True)))


# --- step and checkpoint functions --------------------------------------------------------------

def _loss(model, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x).float(), y)


def careful_step(model, optimizer, scaler, batch, scheduler=None):
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(_loss(model, batch)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    if scheduler is not None and scaler.get_scale() >= scale:
        scheduler.step()


def clip_after_update(model, optimizer, scaler, batch):
    """Clipping moved below the step: GradScaler does not refuse an unscale_ after update()."""
    optimizer.zero_grad()
    scaler.scale(_loss(model, batch)).backward()
    scaler.step(optimizer)
    scaler.update()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def manual_unscale(model, optimizer, scaler, batch):
    optimizer.zero_grad()
    scaler.scale(_loss(model, batch)).backward()
    for p in model.parameters():
        p.grad.mul_(1.0 / scaler.get_scale())
    scaler.step(optimizer)
    scaler.update()


def _round_trip(model, optimizer, scaler, **scaler_kwargs):
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": optimizer.state_dict(), "s": scaler.state_dict()},
               buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    model.load_state_dict(state["m"])
    optimizer.load_state_dict(state["o"])
    new = torch.amp.GradScaler("cpu", **scaler_kwargs)
    new.load_state_dict(state["s"])
    return new


def full_checkpoint(model, optimizer, scaler):
    return _round_trip(model, optimizer, scaler)


def disabled_on_resume(model, optimizer, scaler):
    """The resumed scaler's enabled flag read from the wrong config."""
    return _round_trip(model, optimizer, scaler, enabled=False)


# --- healthy models: no alarm -------------------------------------------------------------------

HEALTHY = {
    "cumsum/cumprod scan": lambda: (Scan(), dict(batch=(torch.randn(4, 12, 8, generator=seeded()),
                                                        torch.randint(0, 3, (4,))))),
    "top-2 MoE, namedtuple with its own loss": moe,
    "CLIP, logit_scale.exp()": clip,
    "diffusion, timestep embeddings": diffusion,
    "graph net, index_add_/scatter_add_": gnn,
    "Embedding(padding_idx) + EmbeddingBag": bagtext,
    "weight_norm + spectral_norm": lambda: (ParamNet(), dict(batch=classes(16, 12, 3))),
    "layers in a Python list, fp16 buffer": lambda: (ListNet(), dict(batch=classes())),
    "careful step and full checkpoint": lambda: (mlp(), dict(
        batch=classes(), step_fn=careful_step, checkpoint_fn=full_checkpoint)),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_heldout4_healthy_model_raises_no_alarm(name):
    seeded()
    model, kwargs = HEALTHY[name]()
    healthy_report(model, **kwargs)


@pytest.mark.parametrize("build", [unet, vit], ids=["U-Net", "ViT"])
def test_heldout4_healthy_conv_and_vit_raise_no_alarm(build):
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    assert not r.alarms(), [(a["class"], a["site"]) for a in r.alarms()]


# --- planted problems: class and site -----------------------------------------------------------

PROBLEMS = {
    "ViT, einsum scores without 1/sqrt(d)": (lambda: vit(scaled=False, big=150.0),
                                             "attention-overflow", "blocks.1.attn"),
    "MoE, one expert weighted 1e-9": (lambda: moe(tiny=1e-9), "grad-underflow", "experts.3"),
    "CLIP, unnormalized features": (lambda: clip(False, 100.0, 60.0), "activation-overflow",
                                    "the model's own forward (CLIP), op aten.mm"),
    "graph net, hub node": (lambda: gnn(hub=3000, big=30.0), "activation-overflow", "g2"),
    "fake-quant Function": (lambda: (QATNet(), dict(batch=classes())), "custom-function",
                            "FakeQuantLinearFn"),
    "bf16 graph layer, SGD momentum": (None, "16bit-weights", "g1."),
    "manual unscale, then scaler.step": (lambda: (mlp(), dict(
        batch=classes(), step_fn=manual_unscale)), "scaler-misuse", "clip before unscale_"),
    "unscale_ and clip after update": (lambda: (mlp(), dict(
        batch=classes(), step_fn=clip_after_update)), "scaler-misuse", "unscale_ after step"),
    "resumed GradScaler disabled": (lambda: (mlp(), dict(
        batch=classes(), checkpoint_fn=disabled_on_resume)), "scaler-resume", "scaler state"),
}


def _bf16_graph():
    m, kwargs = gnn()
    m.g1.to(torch.bfloat16)
    return m, {**kwargs, "optimizer": torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)}


PROBLEMS["bf16 graph layer, SGD momentum"] = (_bf16_graph,) + PROBLEMS[
    "bf16 graph layer, SGD momentum"][1:]


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_heldout4_problem_is_caught_at_its_site(name):
    build, cls, site = PROBLEMS[name]
    seeded()
    model, kwargs = build()
    r = al.doctor(model, **{**QUICK, **kwargs})
    hits = [a for a in r.alarms() if a["class"] == cls and site in a["site"]]
    assert hits, [(a["class"], a["site"]) for a in r.alarms()]
    assert hits[0]["fix"] and hits[0]["lesson"].startswith("lesson ")
    if cls in ("attention-overflow", "activation-overflow", "grad-underflow", "custom-function"):
        assert r.advice["fp16_safe"] is False and "keep it" not in " ".join(r.advice["lines"])


# --- the classes of misjudgement, one by one ----------------------------------------------------

def test_an_unscale_after_update_is_misuse_and_the_next_step_is_left_scaled():
    """GradScaler refuses an unscale_ between step() and update(), not one after update(): the
    optimizer stays marked unscaled, and the next scaler.step() applies gradients still
    multiplied by the loss scale. The careful order stays clean."""
    r = al.doctor(mlp(), batch=classes(), step_fn=clip_after_update, **QUICK)
    hit = next(a for a in r.alarms() if a["site"] == "unscale_ after step")
    assert "step 2's scaler.step() unscaled nothing" in hit["evidence"], hit["evidence"]
    assert "scaler-misuse" in r.verdict["text"]
    r = al.doctor(mlp(), batch=classes(), step_fn=careful_step, **QUICK)
    assert not r.alarms()


def test_a_resumed_scaler_that_is_disabled_is_named_as_such():
    r = al.doctor(mlp(), batch=classes(), checkpoint_fn=disabled_on_resume, **QUICK)
    hit = next(a for a in r.alarms() if a["class"] == "scaler-resume")
    assert "disabled" in hit["finding"] and "enabled" in hit["fix"], hit


def test_an_inf_from_a_flushed_zero_is_not_called_an_overflow():
    """h / sqrt(mean(h*h)) with h about 1e-4: the squares flush to 0 in fp16 and the division
    makes inf. The site is the division; the finding says underflow, not a value too large."""
    seeded()
    r = al.doctor(TinyRMS(), batch=classes(), **QUICK)
    hit = next(a for a in r.alarms() if "aten.div" in a["site"])
    assert "the model's own forward (TinyRMS)" in hit["site"]
    assert "flushed to 0" in hit["finding"] and "overflows inside" not in hit["finding"]
    assert r.advice["fp16_safe"] is False


def test_an_overflow_by_magnitude_still_reads_overflow():
    seeded()
    r = al.doctor(*clip(False, 100.0, 60.0)[:1], **clip(False, 100.0, 60.0)[1], **QUICK)
    hit = next(a for a in r.alarms() if "aten.mm" in a["site"])
    assert "overflows inside" in hit["finding"] and "flushed" not in hit["finding"]


# --- the command line, on a model file of the user's --------------------------------------------

MODEL_FILE = '''
import math
import torch
from torch import nn
import torch.nn.functional as F


class Attn(nn.Module):
    def __init__(self, big):
        super().__init__()
        self.qkv, self.o, self.head = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 3)
        with torch.no_grad():
            self.qkv.weight[:32].mul_(big)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        s = torch.einsum("bqd,bkd->bqk", q, k) / (1.0 if self.training else math.sqrt(16))
        return self.head(self.o(torch.einsum("bqk,bkd->bqd", s.softmax(-1), v)).mean(1))


def build():
    torch.manual_seed(0)
    return Attn(150.0)


def healthy():
    torch.manual_seed(0)
    return Attn(1.0)
'''


@pytest.mark.parametrize("factory, alarm", [("build", True), ("healthy", False)])
def test_cli_on_a_model_file(tmp_path, capsys, factory, alarm):
    from amp_lessons.cli import main

    path = tmp_path / "einsum_model.py"
    path.write_text(MODEL_FILE)
    rc = main(["doctor", "--model", f"{path}:{factory}", "--batch-shape", "4,8,16",
               "--trial-steps", "1", "--compile", "off"])
    out = capsys.readouterr().out
    assert rc in (0, None), out
    assert out.splitlines()[0].startswith("verdict for cpu"), out[:300]
    assert ("[alarm" in out) is alarm, out
    if alarm:  # the scores' matmul, in the model's own forward
        assert "aten.bmm" in out and "scale the scores by 1/sqrt(head_dim)" in out, out
