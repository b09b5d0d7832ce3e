"""The doctor on a second set of held-out models and inputs (none in its bench or in
test_doctor_heldout.py): recurrent and bag-of-embeddings models, weight tying, a LayerNorm by hand,
frozen parts (a frozen float16 backbone), a float16 buffer, BatchNorm1d, a focal loss, modules
without parameters, named-tuple and tuple outputs, models that return their own loss (a dict
'loss' or one number from forward(x, y)), a torch.compile'd model, and hostile batches (on the
meta device, one sample into a BatchNorm, a detached output, a forward that fails only in
training). Each class of misjudgement found is pinned here."""
import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons as al
from doctor_helpers import QUICK, healthy_report, seeded
from amp_lessons.doctor import inputs as doctor_inputs
from amp_lessons.doctor import speed

def classes(n=8, d=8, k=3, s=0):
    g = seeded(s)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


# --- healthy models: no alarm, fp16 checked and safe -------------------------------------------

class GRUClassifier(nn.Module):
    """Returns (logits, last hidden state), as nn.GRU does: the loss is taken of output 0."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(6, 12, batch_first=True), nn.Linear(12, 3)

    def forward(self, x):
        out, h = self.rnn(x)
        return self.head(out[:, -1]), h


class TiedLM(nn.Module):
    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb, self.mix = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(100, 16, mode="mean"), nn.Linear(16, 2)

    def forward(self, ids):
        return self.head(self.bag(ids))


class HalfBuffer(nn.Module):
    """A float16 buffer (a fixed per-channel scale), used in float32."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("scale", torch.full((8,), 0.5, dtype=torch.float16))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.scale.float())


class FrozenHalfBackbone(nn.Module):
    """A frozen float16 backbone (as loaded for inference) under a trainable float32 head."""

    def __init__(self):
        super().__init__()
        self.back = nn.Linear(8, 16).half().requires_grad_(False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.back(x.half())).float())


class NoParamParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool, self.id, self.act = nn.AdaptiveAvgPool1d(1), nn.Identity(), nn.GELU()
        self.drop, self.empty, self.fc = nn.Dropout(0.1), nn.Sequential(), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.drop(self.act(self.id(self.pool(x).squeeze(-1)))))


class NamedOut(nn.Module):
    Out = collections.namedtuple("Out", "logits hidden")

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 3)

    def forward(self, x):
        return self.Out(self.a(x), x)


def focal(out, y, gamma=2.0):
    logp = F.log_softmax(out.float(), -1).gather(1, y[:, None]).squeeze(1)
    return (-(1 - logp.exp()) ** gamma * logp).mean()


class DictLoss(nn.Module):
    """HF-style: forward(input_ids, labels) returns {'hidden', 'loss'}; no target is given."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(30, 16), nn.Linear(16, 30)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        return {"hidden": h, "loss": F.cross_entropy(self.out(h).flatten(0, 1).float(),
                                                     labels.flatten())}


class ScalarLoss(nn.Module):
    """forward(x, y) returns the loss itself: one number."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.b(torch.relu(self.a(x))), y)


def ids(vocab, shape, s=0):
    return torch.randint(0, vocab, shape, generator=seeded(s))


HEALTHY = {
    "GRU returning (logits, h)": lambda: (GRUClassifier(), dict(
        batch=(torch.randn(4, 5, 6, generator=seeded()), torch.randint(0, 3, (4,))), output=0)),
    "weight-tied LM": lambda: (TiedLM(), dict(batch=(ids(50, (4, 8)), ids(50, (4, 8), 1)))),
    "EmbeddingBag": lambda: (Bag(), dict(batch=(ids(100, (8, 6)), ids(2, (8,), 1)))),
    "float16 buffer": lambda: (HalfBuffer(), dict(batch=classes())),
    "frozen float16 backbone": lambda: (FrozenHalfBackbone(), dict(batch=classes())),
    "frozen float32 backbone": lambda: (nn.Sequential(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU()).requires_grad_(False), nn.Linear(16, 3)),
        dict(batch=classes())),
    "BatchNorm1d MLP": lambda: (nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                              nn.Linear(32, 3)), dict(batch=classes(16))),
    "focal loss": lambda: (nn.Sequential(nn.Linear(8, 20), nn.GELU(), nn.Linear(20, 3)),
                           dict(batch=classes(), loss_fn=focal)),
    "modules without parameters": lambda: (NoParamParts(), dict(
        batch=(torch.randn(4, 8, 5, generator=seeded()), torch.randint(0, 3, (4,))))),
    "named-tuple output": lambda: (NamedOut(), dict(batch=classes())),
    "dict with its own loss": lambda: (DictLoss(), dict(
        inputs={"input_ids": ids(30, (4, 7)), "labels": ids(30, (4, 7), 1)})),
    "forward(x, y) returning the loss": lambda: (ScalarLoss(), dict(inputs=classes())),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_heldout2_healthy_model_gets_a_healthy_verdict(name):
    """No alarm, and fp16 checked and found safe: a trial that cannot run (a frozen 16-bit part
    the trainer refused, a model whose own loss needs no target) is no evidence against fp16."""
    seeded()
    model, kwargs = HEALTHY[name]()
    r = healthy_report(model, **kwargs)
    assert r.scaler_trial and all(t["status"] == "ok" for t in r.scaler_trial), r.scaler_trial


def test_the_optimizers_on_copies_step_only_trainable_parameters():
    model = FrozenHalfBackbone()
    given = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for make in (speed.like(None), speed.like(given)):
        params = [p for g in make(model).param_groups for p in g["params"]]
        assert params == [model.head.weight, model.head.bias]


def test_a_lone_number_from_forward_is_the_models_own_loss():
    """Not squared against a made-up zero target (which changes every gradient by 2 * loss)."""
    x, y = classes()
    r = al.doctor(ScalarLoss(), inputs=(x, y), **QUICK)
    assert "own loss" in r.loss and "zeros" not in r.loss
    r = al.doctor(ScalarLoss(), inputs=(x, y), loss_fn=lambda o, t: o * 2, target=torch.zeros(()),
                  **QUICK)
    assert "loss_fn given" in r.loss


# --- a real fp16 hazard at its site --------------------------------------------------------------

class HandLayerNorm(nn.Module):
    """(h - mean)^2 by hand on activations near 300: the square passes 65,504 in fp16 (on a GPU
    too: autocast leaves a mul in the input's dtype)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(32))

    def forward(self, h):
        mu = h.mean(-1, keepdim=True)
        var = ((h - mu) * (h - mu)).mean(-1, keepdim=True)
        return self.w * (h - mu) / torch.sqrt(var + 1e-5)


class HandNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.head = nn.Linear(8, 32), HandLayerNorm(), nn.Linear(32, 4)
        with torch.no_grad():
            self.inp.weight.mul_(300.0)

    def forward(self, x):
        return self.head(self.norm(self.inp(x)))


def test_a_layernorm_by_hand_overflows_at_its_module():
    seeded()
    r = al.doctor(HandNormNet(), classes(k=4), **QUICK)
    hits = [a for a in r.alarms() if a["class"] == "activation-overflow"]
    assert hits and "norm" in hits[0]["site"] and "aten.mul" in hits[0]["site"], r.alarms()
    assert r.advice["fp16_safe"] is False


# --- hostile inputs: one ValueError naming what is wrong -----------------------------------------

class OneSampleBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn = nn.Linear(8, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.a(x))


class Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 3)

    def forward(self, x):
        return self.a(x).detach()


class FailsInTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 3)

    def forward(self, x):
        if self.training:
            raise RuntimeError("this path is not written yet")
        return self.a(x)


@pytest.mark.parametrize("build, batch, where, cause", [
    (OneSampleBN, lambda: classes(1), "in layer 'bn' (BatchNorm1d)", "more than 1 value"),
    (Detached, classes, "outside any layer", "does not require grad"),
    (FailsInTraining, classes, "outside any layer", "not written yet"),
], ids=["one sample into BatchNorm1d", "detached output", "fails only in training"])
def test_a_model_that_cannot_train_in_fp32_is_one_error_not_an_fp16_alarm(build, batch, where,
                                                                           cause):
    """The batch check runs in eval mode; a model that fails in the float32 training pass is
    refused with the layer named, not measured as if fp16 had failed."""
    with pytest.raises(ValueError, match="float32 training step") as info:
        al.doctor(build(), batch(), **QUICK)
    text = str(info.value)
    assert where in text and cause in text and "\n" not in text


def test_cli_a_model_that_cannot_train_is_one_line(tmp_path, monkeypatch, capsys):
    from amp_lessons.cli import main

    (tmp_path / "onebn.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status = main(["doctor", "--model", "onebn:build", "--batch-shape", "1,8",
                   "--trial-steps", "0", "--compile", "off"])
    err = [line for line in capsys.readouterr().err.splitlines()
           if not line.startswith("doctor: ")]  # the progress lines
    assert status == 2 and len(err) == 1, err
    assert "doctor: error: the model's float32 training step" in err[0]
    assert "in layer '1' (BatchNorm1d)" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("kwargs", [
    lambda x, y: dict(batch=(x.to("meta"), y.to("meta"))),
    lambda x, y: dict(inputs=x.to("meta"), target=y),
    lambda x, y: dict(inputs=x, target=y.to("meta")),
], ids=["batch", "inputs", "target"])
def test_a_batch_on_the_meta_device_is_refused_by_name(kwargs):
    x, y = classes()
    args = kwargs(x, y)
    name = next(iter(args)) if "batch" in args else ("target" if args["target"].is_meta
                                                     else "inputs")
    with pytest.raises(ValueError, match=rf"^{name} must hold data: .*meta device"):
        al.doctor(nn.Linear(8, 3), **QUICK, **args)


def test_a_compiled_model_reads_a_pair_as_inputs_and_target():
    """torch.compile's wrapper takes forward(*args): the module it compiles decides."""
    model = torch.compile(nn.Linear(8, 3))
    x, y = classes()
    got, target, how = doctor_inputs.split_batch((x, y), model)
    assert got is x and target is y and "takes one input" in how


def test_errors_about_the_output_name_it_once():
    x, y = classes()
    with pytest.raises(ValueError) as info:
        al.doctor(nn.Linear(8, 3), (x, torch.randint(5, 9, (8,))), **QUICK)
    assert "the model's the model's" not in str(info.value)
    assert str(info.value).startswith("the loss failed on the model's output (8, 3)")


# --- a layer CPU fp16 autocast cannot run says nothing of a GPU ----------------------------------

class LSTMLM(nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(vocab, d), nn.LSTM(d, d, batch_first=True), \
            nn.Linear(d, vocab)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0])


class NoFp16Kernel(nn.Module):
    """Raises under CPU fp16 autocast, as a layer without a CPU fp16 kernel does."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 3)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            raise RuntimeError("no fp16 kernel for this layer on the CPU")
        return self.l(x)


@pytest.mark.parametrize("build, batch", [
    (LSTMLM, lambda: (ids(40, (4, 8)), ids(40, (4, 8), 1))),
    (NoFp16Kernel, classes),
], ids=["LSTM language model", "a layer without a CPU fp16 kernel"])
def test_an_fp16_pass_that_raises_on_a_cpu_leaves_the_gpu_outlook_unchecked(build, batch):
    """On this CPU the failure stays an alarm (fp16 does not run here), but the line for a GPU
    does not call fp16 unsafe on the strength of a CPU kernel: it says not checked, and why."""
    seeded()
    r = al.doctor(build(), batch(), **QUICK)
    if r.advice["fp16_safe"] is not False:
        pytest.skip("this torch runs the layer under CPU fp16 autocast")
    assert "fp16 is unsafe" not in r.verdict["on_gpu"]
    assert "fp16 not checked for a GPU (the fp16 pass raised on this CPU" in r.verdict["on_gpu"]


# --- an op CUDA autocast runs in float32 and CPU autocast in fp16 ------------------------------

class HandSoftmaxNet(nn.Module):
    """A softmax by hand, exp(s) / sum(exp(s)), on scores near 20: exp(20) ~ 4.9e8 passes fp16's
    65,504 where exp runs in fp16 (CPU autocast) and stays finite where it runs in float32 (CUDA
    autocast's list); the layer's own output is a probability."""

    def __init__(self):
        super().__init__()
        self.score, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        with torch.no_grad():
            self.score.weight.zero_()
            self.score.bias.fill_(20.0)

    def forward(self, x):
        e = torch.exp(self.score(x))
        return self.head(e / e.sum(-1, keepdim=True))


def test_an_overflow_at_an_op_cuda_runs_in_float32_is_said_to_be_this_cpus():
    seeded()
    r = al.doctor(HandSoftmaxNet(), classes(), **QUICK)
    hits = [a for a in r.alarms() if a["class"] == "activation-overflow"]
    assert hits and "aten.exp" in hits[0]["site"], r.alarms()
    assert "on this CPU only: CPU autocast runs aten.exp in fp16, CUDA autocast runs it in " \
           "float32" in hits[0]["finding"]
    assert "fp16 is unsafe" not in r.verdict["on_gpu"]
    assert "fp16 not decided by this CPU run" in r.verdict["on_gpu"]


def test_an_overflow_a_gpu_shares_still_calls_fp16_unsafe_on_a_gpu():
    seeded()
    r = al.doctor(HandNormNet(), classes(k=4), **QUICK)  # a mul: 16 bits under CUDA autocast too
    hits = [a for a in r.alarms() if a["class"] == "activation-overflow"]
    assert hits and "on this CPU only" not in hits[0]["finding"]
    assert "fp16 not decided" not in r.verdict["on_gpu"]


def test_cpu_only_names_the_ops_cuda_autocast_runs_in_float32():
    from amp_lessons.doctor.diagnose import cpu_only

    assert cpu_only("aten.exp", "cpu") and cpu_only("aten.sum.dim_IntList", "cpu")
    assert cpu_only("aten._softmax", "cpu") and cpu_only("aten.native_layer_norm", "cpu")
    assert not cpu_only("aten.exp", "cuda") and not cpu_only("aten.mul", "cpu")
    assert not cpu_only("aten.mm", "cpu") and not cpu_only("aten.mean", "cpu")
