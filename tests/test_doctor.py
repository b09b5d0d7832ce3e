"""The doctor (amp_lessons.doctor): its counts against formats.py, the loss-scale advice, that it
changes nothing in the model, clear errors on bad input, the report's HTML/JSON, and the CLI on
torchvision:resnet18 at a small batch. Fast, CPU."""
import json
import math

import pytest
import torch
from torch import nn

import amp_lessons as al
from amp_lessons.numerics import formats
from amp_lessons.measure.float8 import conversion_plan, fp8_support
from amp_lessons.cli import main
from amp_lessons.doctor import compiled
from amp_lessons.measure import dtype_trace
from amp_lessons.doctor import fp8
from amp_lessons.doctor import inputs
from amp_lessons.doctor import ranges
from amp_lessons.doctor import scale
from amp_lessons.doctor import speed
from amp_lessons.doctor.report import DoctorReport
from amp_lessons.ui import doctor_plots

FAST = dict(precisions=("fp32",), warmup=1, steps=1, trial_steps=1, time_cpu=True)


def mlp(scale_last: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Dropout(0.1),
                        nn.Linear(16, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        net[0].weight.mul_(scale_last)
    return net


@pytest.fixture(scope="module")
def report():
    net = mlp()
    return al.doctor(net, torch.randn(6, 8), **FAST)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"])
@pytest.mark.parametrize("k", [-4, 0, 9, 30])
def test_format_counts_match_formats_scaled_counts(fmt, k):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g) * 10.0 ** torch.randint(-14, 9, (4000,), generator=g)
    edges = torch.tensor([0.0, 65504.0, 65519.0, 65520.0, 448.0, 464.0, 465.0, 2.0 ** -25,
                          1.5 * 2.0 ** -24, 2.0 ** -14 - 2.0 ** -25, 2.0 ** -133])
    a = torch.cat([x, edges]).abs()
    want = formats.scaled_counts(a, 2.0 ** k, fmt)
    for per_threshold in (False, True):  # the CPU's histogram and the GPU's comparisons
        got = ranges.format_counts(a, [("f", fmt, 2.0 ** k)], per_threshold)["f"]
        assert {key: got[key] for key in ("nonzero", "overflow", "underflow", "flushed")} == \
            {key: want[key] for key in ("nonzero", "overflow", "underflow", "flushed")}


def test_reached_scale_is_the_largest_power_of_two_that_fits():
    assert scale.reached_scale(1.0) == 15           # 2**15 <= 65504 < 2**16
    assert scale.reached_scale(65504.0) == 0
    assert scale.reached_scale(2.0 ** -20) == 35
    assert scale.reached_scale(None) is None and scale.reached_scale(0.0) is None
    assert scale.reached_scale(1e-300) == scale.EXPONENT_RANGE[1]


def test_advice_names_overflow_low_scale_and_bf16():
    site = [{"layer": "blocks.0.mlp.2", "value": 2.6e5}]
    a = scale.advice(10, site, 0.0, 0.0, bf16_native=True)
    assert a["precision"] == "bf16" and a["fp16_safe"] is False and "blocks.0.mlp.2" in a["lines"][0]
    assert scale.advice(10, site, 0.0, 0.0, False)["precision"] == "fp16 with fp32 layers"
    low = scale.advice(10, [], 0.0, 0.0, True)
    assert low["fp16_safe"] and low["settings"]["init_scale"] == 2.0 ** 9
    assert "skipped" in " ".join(low["lines"])
    keep = scale.advice(24, [], 0.0, 0.0005, True)
    assert keep["settings"]["init_scale"] == 2.0 ** 16 and "keep it" in keep["lines"][1]
    high = scale.advice(24, [], 0.0, 0.01, True)
    assert high["settings"]["init_scale"] == 2.0 ** 23 and "14,000 steps" in " ".join(high["lines"])
    lost = scale.advice(12, [], 0.2, 0.3, True, flushed_at_k=0.05)
    assert lost["precision"] == "bf16" and lost["fp16_safe"] is False


def test_doctor_changes_nothing_in_the_model():
    net = mlp().eval()
    net[0].weight.requires_grad_(False)
    net[4].weight.grad = torch.full_like(net[4].weight, 0.5)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    grad = net[4].weight.grad.clone()
    batch = (torch.randn(6, 8), torch.randint(0, 4, (6,)))
    rng = torch.get_rng_state()
    al.doctor(net, batch, **FAST)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert not any(m.training for m in net.modules())
    assert [p.requires_grad for p in net.parameters()] == [False] + [True] * 7
    assert torch.equal(net[4].weight.grad, grad) and net[0].bias.grad is None
    assert torch.equal(torch.get_rng_state(), rng)


def test_report_parts(report):
    assert report.model == "Sequential" and report.parameters == sum(
        p.numel() for p in mlp().parameters())
    assert [r["layer"] for r in report.layers] == ["0", "1", "2", "3", "4", "5"]
    row = report.layers[0]
    assert row["act_absmax"] > row["act_min"] > 0 and 0 <= row["grad_fp16_underflow"] <= 1
    assert report.scale_exponent == scale.reached_scale(
        max(r["grad_absmax"] for r in report.layers if r["grad_absmax"]))
    assert not report.overflow and report.advice["fp16_safe"] in (True, False)
    assert report.trace["low"] == "fp16" and any(r["dtype"] == "16-bit" for r in report.trace["ops"])
    assert report.compiled["rows"] == [] and "GPU" in report.compiled["reason"]
    assert report.speed[0]["status"] == "ok" and not report.speed[0]["decided"]
    assert "CPU" in report.speed[0]["gate"] and report.speed[0]["samples_per_s"] > 0
    assert report.fp8["status"] == "no FP8 on this GPU"
    assert report.scaler_trial and report.scaler_trial[0]["settings"] == "default"
    assert all(f["lesson"].startswith("lesson 0") for f in report.findings)
    assert {f["topic"] for f in report.findings} >= {"ranges", "scale", "trace", "speed", "fp8"}


def test_overflow_site_named_with_its_value():
    net = mlp(scale_last=1e6)
    r = al.doctor(net, torch.randn(6, 8), precisions=(), trial_steps=1)
    assert r.overflow[0]["layer"] == "0" and r.overflow[0]["value"] > 65504
    assert r.advice["fp16_safe"] is False and "0" in r.findings[0]["finding"]
    assert r.fp16_nonfinite[:1] == ["0"]
    assert r.scaler_trial[0]["skipped"] == r.scaler_trial[0]["steps"] == 1
    assert r.speed == []


def test_report_html_json_and_figure(report, tmp_path):
    html = report._repr_html_()
    assert "<table" in html and "explained in" in html and "<script" not in html
    doc = json.loads(report.to_json())
    assert doc["findings"] and doc["layers"][0]["layer"] == "0"
    fig = doctor_plots.ranges_figure(report)
    assert fig.layout.title.text and len(fig.data) == 4 and fig.layout.yaxis.type == "log"
    # each limit's label sits on its own line: on a log axis an annotation's y is log10(value)
    import math
    labels = {a.text.split("<br>")[0]: a.y for a in fig.layout.annotations}
    assert all(a.x > 1 for a in fig.layout.annotations)  # in the right margin, off the markers
    assert labels["fp16 max"] == pytest.approx(math.log10(65504.0))
    assert len({round(y, 3) for y in labels.values()}) == len(labels) == len(doctor_plots.LIMITS)
    bars = doctor_plots.speed_figure(report)
    assert bars.data[0].y[0] > 0 and bars.data[0].text[0] == "not decided"
    page = tmp_path / "r.html"
    report.write(page, doctor_plots.ranges_svg(report))
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<svg" in text and 'src="http' not in text
    assert text.index("verdict for cpu") < text.index("Findings")
    assert json.loads(text.split('id="doctor-data">')[1].split("</script>")[0].replace(
        "<\\/", "</"))["verdict"]["precision"] == "fp32"
    assert list(doc)[0] == "verdict"
    with pytest.raises(ValueError, match="must end in .json, .html"):
        report.write(tmp_path / "r.txt")
    assert isinstance(report, DoctorReport) and "Sequential" in repr(report)


def test_callable_module_and_parts():
    assert callable(al.doctor) and al.doctor.ranges is ranges
    with pytest.raises(AttributeError):
        al.doctor.nothing_here  # noqa: B018


def test_batch_forms_and_default_loss():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 5), nn.Linear(2, 5)

        def forward(self, x, z):
            return {"logits": self.a(x) + self.b(z)}

    net = TwoInputs()
    b = inputs.check_batch(net, ((torch.randn(4, 3), torch.randn(4, 2)), torch.randint(0, 5, (4,))),
                           None, torch.device("cpu"))
    assert b.loss_text == "cross-entropy against the target given" and b.size == 4
    b = inputs.check_batch(net, {"x": torch.randn(4, 3), "z": torch.randn(4, 2)}, None,
                           torch.device("cpu"))
    assert "random class ids in [0, 5)" in b.loss_text and b.target.shape == (4,)
    b = inputs.check_batch(nn.Linear(3, 1), torch.randn(4, 3), None, torch.device("cpu"))
    assert b.loss_text.startswith("mean squared error against zeros")


def test_bad_input_clear_errors():
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        inputs.load_factory("resnet50")
    with pytest.raises(ValueError, match="cannot be imported"):
        inputs.load_factory("no_such_module_26:build")
    with pytest.raises(ValueError, match="has no 'nothing'"):
        inputs.load_factory("torchvision:nothing")
    with pytest.raises(ValueError, match="batch shape must be whole numbers"):
        inputs.parse_shape("2,three")
    with pytest.raises(ValueError, match="must have parameters to train; ReLU has none"):
        al.doctor(nn.ReLU(), torch.randn(2, 3))
    with pytest.raises(ValueError, match="must be a torch.nn.Module"):
        al.doctor("model", torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"failed in layer '1' \(Linear\) on a batch of shape 2x7"):
        al.doctor(nn.Sequential(nn.Linear(7, 5), nn.Linear(6, 2)), torch.randn(2, 7))
    with pytest.raises(ValueError, match="batch must be a tensor"):
        al.doctor(mlp(), [1, 2, 3])
    with pytest.raises(ValueError, match="loss_fn must be callable"):
        al.doctor(mlp(), torch.randn(4, 8), loss_fn=3)
    with pytest.raises(ValueError, match="precisions must be names from"):
        al.doctor(mlp(), torch.randn(4, 8), precisions=("fp64",))
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        al.doctor(mlp(), torch.randn(4, 8), optimizer="adam")


def test_optimizer_like_the_one_given():
    net = mlp()
    make = speed.like(torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.05))
    opt = make(mlp())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 3e-4
    assert speed.like(None)(net).defaults["foreach"] is True


def test_dtype_trace_and_op_counts():
    net = mlp()
    x = torch.randn(4, 8)
    rep = dtype_trace.autocast_report(net, x, torch.randint(0, 4, (4,)), "cpu", torch.bfloat16)
    assert rep.layers[0][:3] == ("0", "Linear", torch.bfloat16) and rep.nonfinite == []
    ops = dtype_trace.op_dtypes(lambda: net(x), "cpu", torch.bfloat16)
    assert {"op": "addmm", "dtype": "16-bit", "calls": 2} in ops
    assert dtype_trace.first_tensor((1, [torch.ones(1)])) is not None


def test_compare_compiled_rows(monkeypatch):
    net = inputs.Call(mlp())
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)  # the logic, not inductor
    rows = compiled.compare_compiled(net, torch.randn(4, 8), precisions=("fp32", "bf16"))
    assert [r["precision"] for r in rows] == ["fp32", "bf16"] and net.training
    assert all(r["status"] == "ok" and r["max_abs_diff"] == 0 and r["shape"] == "4x4"
               for r in rows)

    def broken(model, **kw):
        def call(x):
            raise RuntimeError("inductor says no\nmore")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    row = compiled.compare_compiled(net, torch.randn(4, 8))[0]
    assert row["status"] == "error" and row["reason"] == "RuntimeError: inductor says no"


def test_fp8_and_compile_reasons():
    assert fp8.fp8_unavailable("cpu") == fp8_support("cpu").reason  # the engine's words
    assert "no CUDA GPU" in fp8.fp8_unavailable("cpu")
    assert "GPU only" in compiled.compile_skip_reason("cpu")
    r = fp8.candidates(mlp(), "cpu", 2048)
    assert r["status"] == "no FP8 on this GPU" and r["layers"] == []
    assert r["reason"] == fp8_support("cpu").reason


def test_fp8_candidates_are_the_engines_conversion_plan(monkeypatch):
    """Where FP8 runs, the doctor's layers are bench.float8.conversion_plan at the crossover width,
    row for row (one filter, one set of reasons), with ``candidate`` where the plan says float8."""
    monkeypatch.setattr(fp8, "fp8_unavailable", lambda device: None)
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Linear(256, 40),
                        nn.Linear(40, 256), nn.Linear(256, 64), nn.Linear(64, 10))
    r = fp8.candidates(net, "cpu", 128, "test")
    plan = conversion_plan(net, min_features=128)
    assert r["status"] == "measured" and r["linear_layers"] == 6
    assert [{k: v for k, v in row.items() if k != "candidate"} for row in r["layers"]] == plan
    assert [row["layer"] for row in r["layers"] if row["candidate"]] == ["2"]
    assert r["reason"].startswith("1 of 6 Linear layers (")
    assert "crossover width 128" in r["reason"]
    assert fp8.candidates(net, "cpu", None)["status"] == "not decided"


def test_cli_doctor_on_resnet18_writes_html_and_json(tmp_path, capsys):
    html, js = tmp_path / "out" / "report.html", tmp_path / "report.json"
    assert main(["doctor", "--model", "torchvision:resnet18", "--batch-shape", "2,3,32,32",
                 "--precisions", "fp32", "--warmup", "0", "--steps", "1", "--trial-steps", "0",
                 "--time-cpu", "--out", str(html), "--out", str(js)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.startswith("verdict for cpu (CPU): stay in fp32: CPU")
    assert "[note: scale]" in out and "(lesson 03:" in out and f"wrote {html}" in out
    assert "doctor: ranges" in captured.err  # a progress line per part
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "layer1.0.conv1" in page and "<svg" in page and "Plotly" not in page
    assert len(page.encode()) < 1_000_000
    doc = json.loads(js.read_text())
    assert doc["model"] == "torchvision:resnet18" and doc["batch"].startswith("2x3x32x32")
    assert math.isfinite(doc["speed"][0]["samples_per_s"]) and doc["findings"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "no_such_module_26:f"], "cannot be imported"),
    (["--model", "torchvision:resnet18", "--batch-shape", "2,3,32"], "failed in layer 'conv1'"),
    (["--model", "torchvision:resnet18", "--out", "r.txt"], "--out must end in .html or .json"),
    (["--model", "torch.nn:ReLU"], "must have parameters to train"),
    (["--model", "torchvision:resnet18", "--steps", "0"], "steps must be a whole number >= 1"),
] + ([] if torch.cuda.is_available() else
     [(["--model", "torchvision:resnet18", "--device", "cuda"], "CUDA is not available")]))
def test_cli_doctor_errors_are_one_line(argv, message, capsys):
    assert main(["doctor"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# --- the command line: every error one line (issue 41), several inputs, --output ---------------

CLI_FAST = ["--trial-steps", "0", "--precisions", ""]


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """Modules a user would point --model at: a meta-device model, a script without a __main__
    guard, a two-input model and a model with a tuple output."""
    (tmp_path / "meta_models_41.py").write_text(
        "import torch\n"
        "def meta_net():\n"
        "    with torch.device('meta'):\n"
        "        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n")
    (tmp_path / "train_script_41.py").write_text(
        "import sys, torch\n"
        "def build():\n    return torch.nn.Linear(4, 2)\n"
        "def main():\n    return 0\n"
        "sys.exit(main())\n")
    (tmp_path / "two_inputs_41.py").write_text(
        "import torch\n"
        "class Two(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.a = torch.nn.Linear(4, 3); "
        "self.e = torch.nn.Embedding(10, 3)\n"
        "    def forward(self, x, ids):\n        return self.a(x) + self.e(ids).mean(1)\n"
        "class Pair(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.a = torch.nn.Linear(4, 6); "
        "self.b = torch.nn.Linear(6, 3)\n"
        "    def forward(self, x):\n        f = self.a(x)\n        return f, self.b(f)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--model", "meta_models_41:meta_net", "--batch-shape", "2,8"],
     "parameters are on the meta device and hold no data"),
    (["--model", "train_script_41:build", "--batch-shape", "2,4"], "ended the program"),
    (["--model", "two_inputs_41:Two", "--batch-shape", "100000,100000,100000"],
     "the batch alone needs 4,000,000,000,000,000 bytes"),
    (["--model", "two_inputs_41:Pair", "--batch-shape", "3,4"], "none is named 'logits'"),
    (["--model", "two_inputs_41:Pair", "--batch-shape", "3,4", "--trial-steps", "-1"],
     "--trial-steps must be"),
    (["--model", "two_inputs_41:Two", "--input", "3,4", "--input", "3,5:ids"], "--input"),
])
def test_cli_doctor_user_errors_are_one_line(user_modules, argv, message, capsys):
    assert main(["doctor"] + argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("python -m amp_lessons")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_cli_doctor_takes_several_inputs_and_an_output_key(user_modules, capsys):
    assert main(["doctor", "--model", "two_inputs_41:Two", "--input", "3,4",
                 "--input", "3,5:ids=10"] + CLI_FAST) == 0
    out = capsys.readouterr().out
    assert out.startswith("verdict for cpu") and "3x4 float32" not in out.splitlines()[0]
    assert main(["doctor", "--model", "two_inputs_41:Pair", "--batch-shape", "3,4",
                 "--output", "1"] + CLI_FAST) == 0
    out = capsys.readouterr().out
    assert "the loss is taken of output 1 (as given)" in out


def test_cli_doctor_ctrl_c_is_one_line_and_exit_130(user_modules, monkeypatch, capsys, tmp_path):
    import amp_lessons.doctor.run as run_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "doctor", interrupted)
    out = tmp_path / "r.json"
    assert main(["doctor", "--model", "two_inputs_41:Pair", "--batch-shape", "3,4",
                 "--output", "1", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("python -m amp_lessons")]
    assert len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0]
    assert "no report was written" in lines[0] and str(out) in lines[0] and not out.exists()


def test_cli_doctor_out_of_memory_names_the_batch_and_the_bytes(user_modules, monkeypatch,
                                                                  capsys):
    import amp_lessons.doctor.run as run_module

    def oom(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "123456789 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(run_module, "doctor", oom)
    assert main(["doctor", "--model", "two_inputs_41:Pair", "--batch-shape", "3,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "out of memory on cpu" in err and "batch of 3,4" in err
    assert "123456789 bytes" in err and "bytes are free" in err


def test_doctor_command_does_not_import_the_cli():
    import ast
    import inspect

    from amp_lessons.doctor import command

    tree = ast.parse(inspect.getsource(command))
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "amp_lessons.cli" not in names


def test_an_ambiguous_pair_is_refused_with_both_forms():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, a, b):
            return self.l(a + b)

    a, b = torch.randn(5, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"could be two inputs or \(inputs, target\).*"
                                         r"inputs=\(a, b\).*inputs=x, target=y.*--input"):
        al.doctor(Two(), (a, b), precisions=(), trial_steps=0)
    r = al.doctor(Two(), inputs=(a, b), precisions=(), trial_steps=0)
    assert r.read_as == "inputs= (as given)" and "random class ids" in r.loss
    r = al.doctor(nn.Linear(4, 3), inputs=a, target=torch.randint(0, 3, (5,)), precisions=(),
                  trial_steps=0)
    assert r.read_as == "inputs= and target= (as given)"
    with pytest.raises(ValueError, match="either as batch or as inputs="):
        al.doctor(Two(), (a, b), inputs=(a, b))


@pytest.mark.parametrize("device_type, bf16, advice, words", [
    ("cuda", True, {"fp16_safe": True, "settings": {"init_scale": 2.0 ** 15}},
     "train in bf16 autocast (this GPU has native bf16)"),
    ("cuda", False, {"fp16_safe": True, "settings": {"init_scale": 2.0 ** 15}},
     "fp16 + GradScaler, init_scale 2^15"),
    ("cuda", False, {"fp16_safe": False, "lines": ["fp16 is not safe: the forward pass "
                                                   "overflows fp16 in 1 layer."]},
     "fp16 is unsafe here because the forward pass overflows fp16 in 1 layer"),
    ("cpu", False, {"fp16_safe": True}, "stay in fp32: CPU"),
    ("cuda", True, {"precision": "none (inf/NaN in fp32)"}, "fix the model in fp32 first"),
])
def test_the_verdict_speaks_the_cheat_sheet(device_type, bf16, advice, words):
    from amp_lessons.doctor import verdict

    v = verdict.verdict(device_type, "GPU", bf16, advice)
    assert v["text"].startswith(words)
    assert "safe" not in v["text"].replace("unsafe", "") or not advice.get("fp16_safe") is False
    fixed = verdict.verdict(device_type, "GPU", bf16, advice, ["custom-function at F"])
    assert fixed["text"].endswith("fix first: custom-function at F")


def test_dropout_mask_memory_is_never_an_overflow_site():
    """Dropout's mask starts as torch.empty_like, whose memory may hold inf/NaN garbage (it did
    in mobilenet_v3_small's classifier): the watch skips ops that return uninitialised memory,
    and still records any other op that makes inf/NaN from finite inputs."""
    from amp_lessons.doctor import probes

    garbage, finite = torch.full((3,), float("nan")), torch.zeros(3)
    w = probes._Watcher(nn.Linear(2, 2), None)
    w.on_op(torch.ops.aten.empty_like.default, (finite,), {}, garbage)
    assert w.result.forward_nonfinite is None
    w.on_op(torch.ops.aten.add.Tensor, (finite, finite), {}, garbage)
    assert w.result.forward_nonfinite["op"] == "aten.add"


def test_fp8_prediction_is_called_where_fp8_runs(monkeypatch):
    """Where FP8 runs, the doctor asks measure.fp8_predict for the end-to-end speed-up and says
    slower or faster; elsewhere it says why it was not run (here: no GPU)."""
    from amp_lessons.measure import fp8_predict

    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    assert fp8.predicted(net, torch.randn(2, 16), "cpu")["status"] == "not run"
    seen = {}

    def fake(model, calibration=None, **kw):
        seen.update(kw)
        return fp8_predict.Prediction("tensorwise", "predicted", speedup=0.8, bf16_step_ms=2.0)

    monkeypatch.setattr(fp8_predict, "predict_fp8_speedup", fake)
    monkeypatch.setattr(fp8, "fp8_unavailable", lambda device: None)
    got = fp8.predicted(net, torch.randn(2, 16), "cpu", bf16_step_ms=2.0)
    assert got["speedup"] == 0.8 and seen["bf16_step_ms"] == 2.0
    assert "slower than bf16, 0.80x" in fp8.prediction_text(got)
    assert "faster" in fp8.prediction_text({"linear_speedup": 1.3})


def test_a_cpu_run_times_nothing_by_default_and_says_why():
    r = al.doctor(mlp(), torch.randn(6, 8))
    assert r.speed == [] and "not timed: on a CPU" in r.extra["speed_reason"]
    assert r.scaler_trial and all(t["steps"] == 2 for t in r.scaler_trial)  # CPU default
    assert any("--time-cpu" in f["finding"] for f in r.findings if f["topic"] == "speed")
