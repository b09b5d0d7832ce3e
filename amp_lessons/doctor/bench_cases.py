"""Reproductions of the mixed-precision failures users report (PyTorch, transformers, accelerate,
Lightning, torchao and Transformer Engine issue trackers), each a tiny model that runs on a CPU
in well under a second, and healthy models (a CNN with BatchNorm, a small GPT, an MLP, a model
with a dict output). Every case is seeded: the same model and batch on every run."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import models
from amp_lessons.doctor.bench import Case


def _seed(s: int = 0) -> torch.Generator:
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)


def _classes(n: int = 16, d: int = 16, k: int = 4, s: int = 0):
    g = _seed(s)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


# --- fp16 activation overflow: a T5-like FFN trained in bf16 ------------------------------------

class T5Block(nn.Module):
    def __init__(self, d=16, ff=32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.wi, self.wo = nn.Linear(d, ff, bias=False), nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return x + self.wo(F.relu(self.wi(self.norm(x))))


class T5Like(nn.Module):
    """Two blocks; the second's FFN output was left large by bf16 pre-training (its range is
    fp32's): the final LayerNorm divides the scale out, so fp32 and bf16 train; fp16 is inf."""

    def __init__(self, d=16):
        super().__init__()
        self.blocks = nn.Sequential(T5Block(d), T5Block(d))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 4)
        with torch.no_grad():
            self.blocks[1].wo.weight.mul_(3e5)

    def forward(self, x):
        return self.head(self.norm(self.blocks(x)))


def t5_overflow():
    _seed()
    return T5Like(), dict(batch=_classes())


# --- attention scores that overflow fp16 ------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d=16, scaled=False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.scaled = scaled

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        if self.scaled:
            s = s / math.sqrt(x.shape[-1])
        return self.o(torch.softmax(s, -1) @ self.v(x))


class ScoresModel(nn.Module):
    def __init__(self, d=16, big=60.0):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.attn = Attention(d)
        self.head = nn.Linear(d, 4)
        with torch.no_grad():
            self.attn.q.weight.mul_(big)
            self.attn.k.weight.mul_(big)

    def forward(self, x):
        return self.head(self.attn(self.embed(x)).mean(1))


def attention_overflow():
    g = _seed()
    return ScoresModel(), dict(batch=(torch.randn(4, 6, 8, generator=g) * 3,
                                      torch.randint(0, 4, (4,), generator=g)))


# --- gradient underflow in one layer (a LayerScale branch initialised tiny) --------------------

class LayerScaleNet(nn.Module):
    def __init__(self, d=16, gamma=1e-9):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.branch = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.full((d,), gamma))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + self.gamma * self.branch(h)
        return self.head(h)


def layer_underflow():
    g = _seed()
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return LayerScaleNet(), dict(batch=(x, y))


# --- a loss scale that collapses: a norm whose fp16 backward divides by 0 ----------------------

class FeatureNorm(nn.Module):
    """||x|| per row, by hand: x * x underflows to 0 in fp16 for small x, and the backward of
    sqrt at 0 is inf, so every gradient is inf/NaN whatever the loss scale."""

    def forward(self, x):
        return torch.sqrt((x * x).mean(-1, keepdim=True))


class CollapseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = FeatureNorm()
        self.head = nn.Linear(9, 4)
        with torch.no_grad():
            self.proj.weight.mul_(1e-4)
            self.proj.bias.zero_()

    def forward(self, x):
        h = self.proj(x)
        return self.head(torch.cat([h * 1e4, self.norm(h) * 1e4], -1))


def scale_collapse():
    return CollapseNet(), dict(batch=_classes(16, 8))


# --- custom autograd Functions under autocast ---------------------------------------------------

class LinearFn(torch.autograd.Function):
    """A hand-written linear without custom_fwd/custom_bwd: its backward runs outside autocast
    and multiplies a 16-bit gradient by a float32 weight."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.mm(w.t())

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g.mm(w), g.t().mm(x)


class CustomFnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(LinearFn.apply(self.a(x), self.w)))


def custom_function():
    _seed()
    return CustomFnNet(), dict(batch=_classes())


class RecomputeFn(torch.autograd.Function):
    """A hand-written activation checkpoint: keeps the input, recomputes the block in backward
    (outside autocast, so in float32 where the forward ran in fp16)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().float().requires_grad_(True)  # the block's weights are float32
            out = ctx.block(x)
        out.backward(g.to(out.dtype))  # the recompute ran in float32: its gradient must too
        return x.grad, None


class CheckpointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(RecomputeFn.apply(self.inp(x), self.block))


def checkpoint_recompute():
    _seed()
    return CheckpointNet(), dict(batch=_classes())


# --- weights and optimizer state in 16 bits -----------------------------------------------------

def _mlp(d_in=16, width=32, k=4):
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, k))


def bf16_weights():
    _seed()
    return _mlp().to(torch.bfloat16), dict(batch=_classes())


def fp16_adam():
    _seed()
    net = _mlp().half()
    return net, dict(batch=_classes(), optimizer=torch.optim.Adam(net.parameters(), eps=1e-8))


# --- the loss and reductions in 16 bits ---------------------------------------------------------

def l1_by_hand(out, y):
    """A hand-written L1 loss: under autocast it stays in the output's 16 bits."""
    return (out - y.to(out.dtype)).abs().mean()


def loss_in_fp16():
    g = _seed()
    return _mlp(k=8), dict(batch=(torch.randn(16, 16, generator=g),
                                  torch.randn(16, 8, generator=g)), loss_fn=l1_by_hand)


class SumPool(nn.Module):
    """Sum-pooling over a long sequence: the fp16 sum passes 65,504."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.embed.bias.fill_(60.0)

    def forward(self, x):
        return self.head(self.embed(x).sum(1) / x.shape[1])


def reduction_in_fp16():
    g = _seed()
    return SumPool(), dict(batch=(torch.randn(2, 2048, 8, generator=g),
                                  torch.randint(0, 4, (2,), generator=g)))


# --- GradScaler misuse in the learner's step ----------------------------------------------------

def _ce_step(order):
    def step(model, optimizer, scaler, batch, scheduler=None):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        for what in order:
            if what == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            elif what == "unscale":
                scaler.unscale_(optimizer)
            elif what == "step":
                scaler.step(optimizer)
            elif what == "update":
                scaler.update()
            elif what == "scheduler" and scheduler is not None:
                scheduler.step()
    return step


def _step_case(order):
    def build():
        _seed()
        return _mlp(), dict(batch=_classes(), step_fn=_ce_step(order))
    return build


def _lost_scaler(model, optimizer, scaler):
    """A checkpoint of the model and optimizer only: the scaler starts over on resume."""
    import io

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    return torch.amp.GradScaler(next(model.parameters()).device.type)


def scaler_state_lost():
    _seed()
    return _mlp(), dict(batch=_classes(), checkpoint_fn=_lost_scaler)


# --- healthy models ------------------------------------------------------------------------------

class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                                      nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                                      nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def healthy_cnn():
    g = _seed()
    return SmallCNN(), dict(batch=(torch.randn(8, 3, 16, 16, generator=g),
                                   torch.randint(0, 10, (8,), generator=g)))


def healthy_gpt():
    g = _seed()
    net = models.TinyTransformer(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
    tokens = torch.randint(0, 64, (4, 17), generator=g)
    return net, dict(batch=(tokens[:, :-1], tokens[:, 1:]), loss_fn=models.lm_loss)


def healthy_mlp():
    _seed()
    return _mlp(), dict(batch=_classes())


class AuxDict(nn.Module):
    """Returns its auxiliary score first and its logits second (the key order a bug once took the
    loss of)."""

    def __init__(self):
        super().__init__()
        self.body, self.aux, self.cls = nn.Linear(16, 32), nn.Linear(32, 1), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"aux_score": self.aux(h), "logits": self.cls(h)}


def healthy_dict_output():
    _seed()
    return AuxDict(), dict(batch=_classes())


def healthy_good_step():
    _seed()
    return _mlp(), dict(batch=_classes(),
                        step_fn=_ce_step(("unscale", "clip", "step", "update")))


PROBLEMS = [
    Case("t5_ffn_overflow", t5_overflow, ("activation-overflow",), "blocks.1.wo",
         "FFN output past 65,504 (weights trained in bf16)"),
    Case("attention_scores_overflow", attention_overflow, ("attention-overflow",), "attn",
         "q @ k^T without 1/sqrt(d) overflows fp16"),
    Case("layer_gradient_underflow", layer_underflow, ("grad-underflow",), "branch",
         "a LayerScale branch whose gradients fp16 flushes to zero"),
    Case("loss_scale_collapse", scale_collapse, ("scale-collapse",), "proj",
         "inf/NaN gradients at every loss scale (fp16 sqrt(0) in backward)",
         anomaly="SqrtBackward0"),
    Case("custom_function_mixed_dtypes", custom_function, ("custom-function",), "LinearFn",
         "custom autograd Function without custom_fwd/custom_bwd", anomaly="LinearFn"),
    Case("checkpoint_recompute_fp32", checkpoint_recompute, ("checkpoint-recompute",),
         "RecomputeFn", "hand-written checkpoint recomputing outside autocast"),
    Case("bf16_weights_no_masters", bf16_weights, ("16bit-weights",), "0.weight",
         "model.to(torch.bfloat16): small updates round away"),
    Case("fp16_adam_eps", fp16_adam, ("16bit-optimizer-state",), "param group 0",
         "model.half() with Adam(eps=1e-8): eps is 0 in fp16"),
    Case("loss_in_fp16", loss_in_fp16, ("loss-16bit",), "l1_by_hand",
         "a hand-written loss computed in fp16"),
    Case("sum_reduction_in_fp16", reduction_in_fp16, ("reduction-16bit",), "aten.sum",
         "a sum-pool over 2,048 tokens in fp16"),
    Case("clip_before_unscale", _step_case(("clip", "unscale", "step", "update")),
         ("scaler-misuse",), "clip before unscale_", "clip_grad_norm_ before scaler.unscale_"),
    Case("scheduler_on_skipped_steps",
         _step_case(("unscale", "step", "update", "scheduler")), ("scaler-misuse",),
         "scheduler on skipped step", "scheduler.step() on steps GradScaler skipped"),
    Case("missing_update", _step_case(("unscale", "step")), ("scaler-misuse",),
         "missing update", "scaler.update() never called"),
    Case("scaler_state_lost_on_resume", scaler_state_lost, ("scaler-resume",),
         "scaler state lost", "checkpoint without the scaler's state"),
]
HEALTHY = [
    Case("healthy_cnn_batchnorm", healthy_cnn, what="a CNN with BatchNorm"),
    Case("healthy_small_gpt", healthy_gpt, what="a small GPT (lesson 07's)"),
    Case("healthy_mlp", healthy_mlp, what="an MLP"),
    Case("healthy_dict_output", healthy_dict_output,
         what="a dict output with its logits second"),
    Case("healthy_amp_step", healthy_good_step, what="an MLP with a correct AMP step"),
]
CASES = PROBLEMS + HEALTHY
