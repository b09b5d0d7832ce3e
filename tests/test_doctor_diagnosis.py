"""The doctor's diagnosis at its edges (amp_lessons.doctor): overflow in a plain op, tuple/dict
inputs, a layer fp16 autocast cannot run, a frozen BatchNorm, the default scale at the ceiling,
bad arguments, the trace's labels, a model already inf in fp32, an empty batch, dict outputs,
float16 parameters, small-integer targets, op kinds counted once, FP8 off a GPU. Fast, CPU."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons as al
from amp_lessons.measure import dtype_trace
from amp_lessons.doctor import findings
from amp_lessons.doctor import fp8
from amp_lessons.doctor import inputs
from amp_lessons.doctor import scale
from amp_lessons.doctor.report import DoctorReport

QUICK = dict(precisions=(), trial_steps=0)
TIMED = dict(precisions=("fp32",), time_cpu=True)


class Scores(nn.Module):
    """Attention scores without 1/sqrt(d): every layer's fp32 output stays under 65,504, but
    q @ k^T (a plain op, no layer's output) passes it."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(300)
            self.k.weight.mul_(300)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.o(torch.softmax(s, -1) @ self.v(x)).mean(1)


def test_overflow_inside_the_forward_is_not_called_safe():
    torch.manual_seed(0)
    net, x = Scores(), torch.randn(2, 6, 16)
    r = al.doctor(net, x, precisions=(), trial_steps=1)
    assert r.overflow == [] and r.fp16_nonfinite  # no layer output passes 65,504 in fp32
    assert r.advice["fp16_safe"] is False and "no GradScaler" in r.advice["lines"][0]
    said = [f for f in r.findings if f["topic"] == "overflow"]
    assert said and said[0]["severity"] == "alarm" and said[0]["class"] == "attention-overflow"
    assert "aten.bmm" in said[0]["site"] and "Scores" in said[0]["site"]
    scale_finding = next(f for f in r.findings if f["topic"] == "scale")
    assert "final loss nan" in scale_finding["evidence"]


def test_advice_takes_the_fp16_evidence():
    safe = scale.advice(18, [], 0.0, 0.0, True)
    assert safe["fp16_safe"] is True
    loss_only = scale.advice(18, [], 0.0, 0.0, True, fp16_nonfinite=["the loss"])
    assert loss_only["fp16_safe"] is False and "the loss" in loss_only["lines"][0]
    nan_trial = [{"settings": "default", "final_loss": math.nan}]
    trial = scale.advice(18, [], 0.0, 0.0, False, trial=nan_trial)
    assert trial["fp16_safe"] is False and trial["precision"] == "fp16 with fp32 layers"
    unchecked = scale.advice(18, [], 0.0, 0.0, True, fp16_unchecked="RuntimeError: no kernel")
    assert unchecked["fp16_safe"] is None and "not checked" in unchecked["lines"][-1]
    raised = scale.advice(18, [], 0.0, 0.0, True, fp16_failed=["the fp16 pass raised X"])
    assert raised["fp16_safe"] is False and not any("safe here" in line or "keep it" in line
                                                   for line in raised["lines"])
    errored = scale.advice(18, [], 0.0, 0.0, True, trial=[{"settings": "default",
                                                           "status": "error", "reason": "E"}])
    assert errored["fp16_safe"] is False and "raised E" in errored["lines"][0]


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 3)

    def forward(self, a, b):
        return self.l(a + b)


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_samples_per_s_counts_the_batch_rows_of_several_inputs(form):
    a, b, y = torch.randn(32, 8), torch.randn(32, 8), torch.randint(0, 3, (32,))
    batch = ((a, b), y) if form == "tuple" else ({"a": a, "b": b}, y)
    r = al.doctor(TwoInputs(), batch, warmup=0, steps=2, trial_steps=0, **TIMED)
    row = r.speed[0]
    assert row["samples_per_s"] * row["step_ms"] / 1e3 == pytest.approx(32, rel=1e-6)


class FailsInFp16(nn.Module):
    """A layer with no fp16 kernel on this device (as nn.LSTM under CPU fp16 autocast)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 4)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            raise RuntimeError("no fp16 kernel for this layer here")
        return self.l(x)


def test_a_failed_fp16_measurement_is_a_finding_not_a_crash():
    """An fp16 pass that raises is an alarm naming the module, and fp16 is never called safe."""
    r = al.doctor(FailsInFp16(), torch.randn(4, 8), precisions=(), trial_steps=1)
    assert r.scaler_trial == []  # no trial of a model whose fp16 pass raises
    assert "no fp16 kernel" in r.trace["reason"] and r.advice["fp16_safe"] is False
    failed = [f for f in r.alarms() if f["class"] == "fp16-failed"]
    assert failed and "no fp16 kernel" in failed[0]["finding"]
    assert "FailsInFp16" in failed[0]["site"] or "own forward" in failed[0]["site"]
    assert not any("safe here" in line or "keep it" in line for line in r.advice["lines"])
    assert "RuntimeError: no fp16 kernel" in r._repr_html_()


def frozen_bn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 3))
    net.train()
    net[1].eval()  # frozen: running statistics, which sit far from this batch's
    with torch.no_grad():
        net[1].running_mean.fill_(-7e4)
    return net


def test_a_frozen_batchnorm_is_measured_frozen():
    net, x = frozen_bn(), torch.randn(4, 3, 6, 6)
    with torch.no_grad():
        want = float(net[1](net[0](x)).abs().max())
    modes = [m.training for m in net.modules()]
    r = al.doctor(net, x, **QUICK)
    assert [m.training for m in net.modules()] == modes
    row = next(r for r in r.layers if r["layer"] == "1")
    assert row["act_absmax"] == pytest.approx(want) and want > 65504
    assert r.overflow[0]["layer"] == "1" and r.advice["fp16_safe"] is False
    copy = inputs.work_copy(net, "cpu")
    assert [m.training for m in copy.modules()] == modes
    assert all(m.training for m in inputs.work_copy(net.eval(), "cpu").modules())
    seen = []
    net.train()
    net[1].eval()
    net[1].register_forward_hook(lambda m, i, o: seen.append(m.training))
    dtype_trace.trace(net, lambda: net(x).sum(), "cpu", torch.bfloat16)
    assert seen == [False] and not net[1].training and net.training


def test_advice_when_the_ceiling_is_the_default_scale():
    at = scale.advice(16, [], 0.0, 0.0, True)
    assert at["settings"]["init_scale"] == scale.DEFAULT.init_scale
    assert "too high" not in " ".join(at["lines"]) and "keep it" in at["lines"][1]
    below = scale.advice(15, [], 0.0, 0.0, True)
    assert "too high" in below["lines"][1] and "first 1 step would" in below["lines"][1]
    assert below["settings"]["init_scale"] == 2.0 ** 14
    assert "one halving below" in scale.advice(17, [], 0.0, 0.0, True)["lines"][1]
    low = scale.advice(scale.EXPONENT_RANGE[0], [], 0.0, 0.0, True)
    assert low["settings"]["init_scale"] == 2.0 ** scale.EXPONENT_RANGE[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(precisions=5), "precisions must be names from"),
    (dict(fp8_crossover=(1, 2, 3)), "fp8_crossover must be None, a whole number >= 1"),
    (dict(fp8_crossover=(1024, 5)), "fp8_crossover must be None"),
    (dict(fp8_crossover=[0, "x"]), "fp8_crossover must be a whole number >= 1"),
    (dict(name=123), "name must be None or a string"),
    (dict(device="meta"), r"device must be 'cpu' or a CUDA device"),
] + ([] if torch.cuda.is_available() else [
    (dict(device="cuda"), "CUDA is not available"),
    (dict(device="cuda:0"), "CUDA is not available")]))
def test_bad_arguments_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        al.doctor(nn.Linear(8, 4), torch.randn(4, 8), **{**QUICK, **kwargs})


@pytest.mark.parametrize("device", ["mps", "meta"])
def test_cli_refuses_a_device_it_cannot_use_in_one_line(device, capsys):
    from amp_lessons.cli import main

    assert main(["doctor", "--model", "torch.nn:Linear", "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device must be 'cpu' or a CUDA device ('cuda', 'cuda:0'); got '{device}'" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_fp8_crossover_as_a_list_pair_is_taken():
    r = al.doctor(nn.Linear(8, 4), torch.randn(4, 8), fp8_crossover=[1024, "my run"], **QUICK)
    assert r.fp8["crossover"] == 1024 and r.fp8["source"] == "my run"


def test_trace_rows_name_the_input_dtype_and_the_loss():
    torch.manual_seed(0)
    lm = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
    r = al.doctor(lm, torch.randint(0, 20, (2, 5)), **QUICK)
    rows = r.trace["layers"]
    assert rows[0] == {"what": "input batch", "kind": "data", "dtype": "int64", "grad": "-"}
    assert rows[-2]["kind"] == "cross_entropy"
    r = al.doctor(nn.Linear(8, 1), (torch.randn(4, 8), torch.randn(4, 1)), **QUICK)
    assert r.trace["layers"][-2]["kind"] == "mse_loss"

    def huber(out, target):
        return F.huber_loss(out.float(), target.float())
    r = al.doctor(nn.Linear(8, 1), (torch.randn(4, 8), torch.randn(4, 1)), loss_fn=huber, **QUICK)
    assert r.trace["layers"][-2]["kind"] == "huber" and r.trace["layers"][0]["dtype"] == "float32"
    rep = dtype_trace.autocast_report(nn.Linear(8, 3), torch.randn(2, 8), torch.tensor([0, 2]),
                                      "cpu", torch.bfloat16)  # lesson 02's default: cross-entropy
    assert rep.rows()[-2]["kind"] == "cross_entropy"


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


def test_a_model_already_inf_in_fp32_is_told_so():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Exp(), nn.Linear(8, 3))
    with torch.no_grad():
        net[0].weight.mul_(200)
    r = al.doctor(net, (torch.randn(6, 8), torch.randint(0, 3, (6,))), precisions=(),
                  trial_steps=1)
    bad = [row for row in r.layers if row["act_nonfinite"]]
    assert bad and r.advice["precision"] == "none (inf/NaN in fp32)"
    assert r.advice["fp16_safe"] is False and "bf16" not in r.advice["precision"]
    assert "not finite in fp32" in r.advice["lines"][0]
    first = r.findings[0]
    assert "not finite in fp32" in first["finding"] and "no precision helps" in first["finding"]
    assert first["class"] == "fp32-nonfinite" and "aten.exp" in first["site"]
    assert r.verdict["precision"] == "none" and "fp32 first" in r.verdict["text"]
    for row in bad:
        assert f"{row['layer']} ({row['act_nonfinite']:,})" in first["finding"]


class Mask(nn.Module):
    def forward(self, x):
        return x.masked_fill(torch.arange(x.shape[-1]) == 3, float("-inf"))


def test_a_minus_inf_mask_is_not_called_a_broken_model():
    net = nn.Sequential(nn.Linear(8, 4), Mask())
    r = al.doctor(net, (torch.randn(4, 8), torch.tensor([0, 1, 2, 0])), **QUICK)
    assert r.layers[1]["act_nonfinite"] == 4 and r.advice["fp16_safe"] is True
    assert not r.alarms()
    note = next(f for f in r.findings if "-inf mask" in f["finding"])
    assert "1 (4)" in note["finding"] and note["severity"] == "note"


def test_an_empty_batch_is_refused_and_a_missing_scale_is_said():
    with pytest.raises(ValueError, match="at least one sample; got a batch of shape 0x8"):
        al.doctor(nn.Linear(8, 3), torch.randn(0, 8), **QUICK)
    with pytest.raises(ValueError, match="at least one sample"):
        al.doctor(TwoInputs(), ((torch.randn(4, 8), torch.randn(0, 8)), torch.zeros(4).long()),
                  **QUICK)
    report = DoctorReport(model="m", parameters=1, device="cpu", device_name="CPU", torch="x",
                          batch="1", loss="l", layers=[], scale_exponent=None, overflow=[],
                          fp16_nonfinite=[], advice={"lines": []}, scaler_trial=[], trace={},
                          compiled={"rows": [], "reason": "r"}, speed=[],
                          fp8={"status": "s", "reason": "r"}, findings=[])
    page = report.to_html()
    assert "2^None" not in page and "loss scale not derived" in page


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        f = torch.relu(self.body(x))
        return {"features": f, "logits": self.head(f)}


def test_a_dict_output_is_taken_at_its_logits():
    r = al.doctor(DictOut(), torch.randn(4, 8), **QUICK)
    assert "[0, 3)" in r.loss
    assert next(row for row in r.layers if row["layer"] == "head")["grad_absmax"]


def test_float16_parameters_are_diagnosed_on_a_float32_copy():
    """16-bit weights are no longer refused: they are an alarm, measured on a float32 copy."""
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).half()
    r = al.doctor(net, torch.randn(4, 8).half(), **QUICK)
    weights = [f for f in r.alarms() if f["class"] == "16bit-weights"]
    assert weights and "float16" in weights[0]["finding"] and weights[0]["site"].startswith("0.weight")
    assert "fp32 master" in weights[0]["fix"] and "Kahan" in weights[0]["fix"]
    assert net[0].weight.dtype == torch.float16 and r.layers


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.uint16])
def test_small_integer_targets_are_class_ids(dtype):
    y = torch.tensor([0, 1, 2, 1]).to(dtype)
    b = inputs.check_batch(nn.Linear(8, 3), (torch.randn(4, 8), y), None, torch.device("cpu"))
    assert b.loss_text.startswith("cross-entropy") and b.loss_name == "cross_entropy"
    assert torch.isfinite(b.loss_fn(torch.randn(4, 3), b.target))


def test_op_kinds_are_counted_once():
    from amp_lessons.doctor.run import _op_kinds

    ops = [{"op": "add", "dtype": "16-bit"}, {"op": "add", "dtype": "float32"},
           {"op": "mm", "dtype": "16-bit"}, {"op": "softmax", "dtype": "float32"}]
    kinds = _op_kinds(ops)
    assert kinds == {"low_ops": 2, "fp32_ops": 1, "fp32_examples": ["softmax"], "both_ops": 1,
                     "both_examples": ["add"]}
    trace = {"low": "fp16", "ops": ops, **kinds}
    out = findings.collect([], [], 18, {}, {}, {"lines": ["a"]}, [], trace, {}, [],
                           {"status": "x", "reason": "y"})
    text = next(f["finding"] for f in out if f["topic"] == "trace")
    assert "2 op kinds ran in 16 bits and 1 only in float32 (softmax)" in text
    assert "1 kind of the 16-bit ones also ran in float32 at some calls (add)" in text


def test_fp8_off_a_gpu_says_so():
    r = fp8.candidates(nn.Linear(8, 3), "cpu", None)
    assert r["summary"] == "not on a GPU" and r["status"] == "no FP8 on this GPU"
    out = findings.collect([], [], 18, {}, {}, {"lines": ["a"]}, [], {}, {}, [], r)
    assert out[-1]["finding"].startswith("not on a GPU: ")
