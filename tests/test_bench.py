"""amp_lessons.bench on the CPU: configurations, timing, memory counting, failure rows, the largest
batch search, claim verdicts, the CLI and lesson 04's plot."""
import importlib.util
import json
import math

import pytest
import torch
from torch import nn

from amp_lessons import bench, cli, plots
from amp_lessons.bench import BenchConfig

TINY = dict(model="resnet18", batch_size=2, image_size=16, num_classes=10)


@pytest.fixture
def no_gc(monkeypatch):
    """largest_batch frees memory after every trial (gc + empty_cache); skip that in tests."""
    monkeypatch.setattr(bench, "free_memory", lambda *a, **k: None)


# --- configurations ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(precision="fp8"), "precision"), (dict(model="vgg"), "model"),
    (dict(batch_size=0), "batch_size"), (dict(image_size=4), "image_size"),
    (dict(optimizer="lamb"), "optimizer"), (dict(impl="apex"), "impl"),
    (dict(compile="fast"), "compile"), (dict(checkpoint="layer"), "checkpoint"),
    (dict(eps=0.0), "eps"), (dict(lr=-1.0), "lr"), (dict(loop="mine"), "loop"),
])
def test_config_validation_names_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BenchConfig(**kwargs)


def test_labels_describe_the_configuration():
    assert BenchConfig(precision="fp32").label == "fp32, TF32 off"
    cfg = BenchConfig(precision="fp16", channels_last=True, compile="default", impl="fused")
    assert cfg.label == "fp16 + GradScaler, channels_last, compile, fused SGD"
    adam = BenchConfig(precision="bf16", optimizer="adam", eps=1e-7, amsgrad=True)
    assert adam.label == "bf16, Adam eps=1e-07 amsgrad"
    assert "R4" in BenchConfig(model="resnet50-r4").label
    assert BenchConfig(label="mine").label == "mine"


def test_optimizer_kernels_and_settings():
    params = [nn.Parameter(torch.zeros(3))]
    assert bench.build_optimizer(BenchConfig(impl="foreach"), params).defaults["foreach"] is True
    assert bench.build_optimizer(BenchConfig(impl="fused"), params).defaults["fused"] is True
    assert bench.build_optimizer(BenchConfig(impl="for-loop"), params).defaults["foreach"] is False
    adam = bench.build_optimizer(BenchConfig(optimizer="adam", eps=1e-7, amsgrad=True), params)
    assert isinstance(adam, torch.optim.Adam)
    assert adam.defaults["eps"] == 1e-7 and adam.defaults["amsgrad"] is True
    assert isinstance(bench.build_optimizer(BenchConfig(optimizer="adamw"), params),
                      torch.optim.AdamW)


def test_skip_reasons_on_a_cpu():
    assert "GPU" in bench.skip_reason(BenchConfig(compile="default"), "cpu")
    assert "CUDA" in bench.skip_reason(BenchConfig(cuda_graph=True), "cpu")
    assert bench.skip_reason(BenchConfig(precision="bf16"), "cpu") is None


def test_lesson_configs_cover_the_issue():
    cfgs = bench.lesson_configs("resnet18", 8, 32, amp="fp16", compile_precision="bf16")
    labels = [c.label for c in cfgs]
    assert len(set(labels)) == len(labels)
    for p in bench.PRECISIONS:
        assert any(c.precision == p and not c.channels_last for c in cfgs)
        assert any(c.precision == p and c.channels_last for c in cfgs)
    assert {c.impl for c in cfgs} >= {"foreach", "fused"}
    assert any(c.model == "resnet18-r4" for c in cfgs)
    adam = [c for c in cfgs if c.optimizer == "adam"]
    assert {c.eps for c in adam} == {1e-8, 1e-7} and any(c.amsgrad for c in adam)
    compiled = [c for c in cfgs if c.compile]
    assert [c.compile for c in compiled] == ["default", "reduce-overhead"]
    assert all(c.impl == "fused" and c.channels_last and c.precision == "bf16" for c in compiled)
    one = bench.lesson_configs("resnet18", compile_modes=("default",))
    assert [c.compile for c in one if c.compile] == ["default"]
    assert not any(c.compile for c in bench.lesson_configs("resnet18", compile_precision=None))
    with pytest.raises(ValueError, match="amp"):
        bench.lesson_configs(amp="fp32")
    for bad in ("default", (), ("fast",), (None,)):
        with pytest.raises(ValueError, match="compile_modes"):
            bench.lesson_configs(compile_modes=bad)


@pytest.mark.parametrize("memory, expected", [(None, 256), (15.0, 64), (22.0, 128),
                                              (80.0, 256), (139.8, 256)])
def test_batch_size_scales_to_device_memory(memory, expected):
    assert bench.batch_size_for(memory, 224) == expected


def test_batch_size_for_validates():
    with pytest.raises(ValueError, match="fraction"):
        bench.batch_size_for(16.0, fraction=0)
    assert bench.batch_size_for(15.0, image_size=112) == 256


# --- memory counting ---------------------------------------------------------------------------

def test_tensor_bytes_counts_each_storage_once():
    t = torch.zeros(10, 10)
    assert bench.tensor_bytes([t, t[0], t.view(100), "not a tensor"]) == 400
    assert bench.tensor_bytes([t, torch.zeros(5)]) == 420


def test_saved_activations_are_counted_without_parameters():
    lin = nn.Linear(4, 8, bias=False)
    x = torch.randn(16, 4)
    with bench.SavedActivations(exclude=list(lin.parameters())) as saved:
        out = lin(x)
    assert saved.bytes == x.numel() * 4  # linear keeps its input for the weight gradient
    with bench.SavedActivations(exclude=list(lin.parameters())) as saved:
        torch.relu(lin(x))
    assert saved.bytes == x.numel() * 4 + out.numel() * 4  # relu keeps its output too


def test_memory_breakdown_of_one_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = bench.hand_step(model, opt, "fp32", "cpu")
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    parts = bench.memory_breakdown(step, x, y, "cpu")
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert parts["params_gib"] * bench.GIB == param_bytes
    assert parts["grads_gib"] * bench.GIB == param_bytes
    assert parts["activations_gib"] > 0 and parts["activations_allocated_gib"] is None
    assert bench.tensor_bytes(bench.optimizer_state_tensors(opt)) == param_bytes  # momentum


# --- timing and rows ---------------------------------------------------------------------------

def test_time_steps_and_summary():
    calls = []
    out = bench.time_steps(lambda x, y: calls.append(1) or torch.tensor(1.5),
                           torch.zeros(1), torch.zeros(1), warmup=2, steps=3, device="cpu")
    assert len(calls) == 5 and len(out["times_ms"]) == 3
    assert out["loss"] == 1.5 and out["timer"] == "perf_counter"
    s = bench.summarize_times([10.0, 20.0, 30.0], batch_size=4)
    assert s["step_ms"] == 20.0 and s["img_per_s"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="steps"):
        bench.time_steps(lambda x, y: None, torch.zeros(1), torch.zeros(1), steps=0)
    with pytest.raises(ValueError, match="times_ms"):
        bench.summarize_times([], 1)
    with pytest.raises(ValueError, match="reset_peak"):
        bench.time_steps(lambda x, y: None, torch.zeros(1), torch.zeros(1), reset_peak=None)


def test_time_steps_resets_the_peak_counter_only_when_asked(monkeypatch):
    resets = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: resets.append(1))

    class Event:  # stands in for torch.cuda.Event on a machine without CUDA
        def __init__(self, **kwargs):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    step = lambda x, y: torch.tensor(1.0)  # noqa: E731
    for reset, expected in ((True, [1]), (False, [])):
        resets.clear()
        out = bench.time_steps(step, torch.zeros(1), torch.zeros(1), warmup=1, steps=2,
                               device=torch.device("cuda", 0), reset_peak=reset)
        assert resets == expected and out["times_ms"] == [2.0, 2.0]


def test_measure_a_tiny_resnet_on_the_cpu():
    row = bench.measure(BenchConfig(precision="bf16", channels_last=True, **TINY), "cpu",
                        warmup=1, steps=2)
    assert row["status"] == "ok", row["reason"]
    assert row["img_per_s"] > 0 and row["timer"] == "perf_counter"
    assert row["peak_allocated_gib"] is None  # no allocator statistics on a CPU
    n = sum(p.numel() for p in bench.build_model(BenchConfig(**TINY), "cpu").parameters())
    assert row["params_gib"] * bench.GIB == n * 4
    assert row["optimizer_state_gib"] * bench.GIB == n * 4  # SGD momentum, fp32
    assert math.isfinite(row["loss"]) and row["config"]["precision"] == "bf16"


def _raise(exc):
    def build(*args, **kwargs):
        raise exc
    return build


def test_failures_become_rows(monkeypatch):
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    monkeypatch.setattr(bench, "build_model", _raise(oom("CUDA out of memory. Tried to allocate")))
    row = bench.measure(BenchConfig(**TINY), "cpu")
    assert row["status"] == "out of memory" and "batch 2" in row["reason"]
    monkeypatch.setattr(bench, "build_model", _raise(RuntimeError("boom\nmore")))
    row = bench.measure(BenchConfig(**TINY), "cpu")
    assert row["status"] == "error" and row["reason"] == "RuntimeError: boom"
    skipped = bench.measure(BenchConfig(compile="default", **TINY), "cpu")
    assert skipped["status"] == "skipped" and skipped["img_per_s"] is None


def test_is_out_of_memory():
    assert bench.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert bench.is_out_of_memory(MemoryError())
    assert not bench.is_out_of_memory(RuntimeError("shape mismatch"))


def test_run_configs_in_one_process(monkeypatch):
    seen = []
    rows = bench.run_configs([BenchConfig(precision="fp32", **TINY),
                              BenchConfig(compile="default", **TINY)], "cpu", warmup=0, steps=1,
                             breakdown=False, progress=False, on_row=seen.append)
    assert [r["status"] for r in rows] == ["ok", "skipped"] and seen == rows
    with pytest.raises(ValueError, match="unique"):
        bench.run_configs([BenchConfig(**TINY)] * 2, "cpu")


def _row(label, ips, peak, precision="fp16", status="ok", **extra):
    row = dict(label=label, img_per_s=ips, peak_allocated_gib=peak, status=status, reason="",
               config={"precision": precision})
    row.update(extra)
    return row


def test_ratios_and_table():
    rows = [_row("fp32", 1000.0, 20.0, "fp32"), _row("fp16", 3000.0, 10.0),
            _row("bf16", None, None, "bf16", status="skipped", reason="needs bf16")]
    out = bench.with_ratios(rows, "fp32")
    assert out[1]["speedup"] == 3.0 and out[1]["memory_ratio"] == 0.5
    assert out[2]["speedup"] is None
    text = bench.format_table(out)
    assert "x fp32" in text and "3.00" in text and "n/a" in text and "needs bf16" in text
    with pytest.raises(ValueError, match="baseline"):
        bench.with_ratios(rows, "tf32")
    with pytest.raises(ValueError, match="columns"):
        bench.format_table(rows, columns=[("nope", "nope")])


def test_find_row():
    rows = [_row("a", 1.0, 1.0, "fp32"), _row("b", 2.0, 1.0, "fp16")]
    assert bench.find_row(rows, precision="fp16")["label"] == "b"
    assert bench.find_row(rows, precision="bf16") is None


def test_results_document_is_json():
    doc = bench.results_document([_row("a", float("nan"), 1.0)], "cpu", suite="x")
    text = json.dumps(doc)
    assert doc["rows"][0]["img_per_s"] is None and doc["suite"] == "x"
    assert {"device_name", "torch", "date"} <= set(json.loads(text))


# --- the trainer against a hand-written loop ---------------------------------------------------

def test_compare_loops_on_the_cpu():
    out = bench.compare_loops(BenchConfig(precision="fp32", **TINY), "cpu", warmup=0, steps=1,
                              rounds=2)
    assert out["status"] == "ok", out
    assert out["hand_img_per_s"] > 0 and out["trainer_img_per_s"] > 0
    assert out["steps_each"] == 2 and math.isfinite(out["overhead_pct"])
    assert bench.compare_loops(BenchConfig(compile="default", **TINY), "cpu")["status"] == "skipped"


# --- the largest batch under a memory cap ------------------------------------------------------

def test_largest_batch_doubles_then_bisects(no_gc):
    made = []

    def make_step(batch):
        made.append(batch)
        return lambda: None

    found = bench.largest_batch(make_step, cap_bytes=37_000, peak_bytes=lambda b: 1000 * b)
    assert found.batch_size == 37
    tried = [t["batch_size"] for t in found.trials]
    assert tried[:7] == [1, 2, 4, 8, 16, 32, 64] and set(made) == set(tried)
    assert all(t["fits"] == (t["batch_size"] <= 37) for t in found.trials)


def test_largest_batch_catches_real_out_of_memory_and_limits(no_gc):
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def make_step(batch):
        if batch > 5:
            raise oom("CUDA out of memory")
        return lambda: None

    found = bench.largest_batch(make_step, cap_bytes=10**9, peak_bytes=lambda b: 1)
    assert found.batch_size == 5
    assert any(t["reason"] == "out of memory" for t in found.trials)
    assert bench.largest_batch(lambda b: (lambda: None), 10**9, peak_bytes=lambda b: 1,
                               limit=12).batch_size == 12
    none = bench.largest_batch(lambda b: (lambda: None), 10, peak_bytes=lambda b: 100)
    assert none.batch_size == 0 and len(none.trials) == 1


def test_largest_batch_validates_and_propagates_other_errors(no_gc):
    with pytest.raises(ValueError, match="cap_bytes"):
        bench.largest_batch(lambda b: None, 0, peak_bytes=lambda b: 1)
    with pytest.raises(ValueError, match="limit"):
        bench.largest_batch(lambda b: None, 10, peak_bytes=lambda b: 1, start=8, limit=4)
    with pytest.raises(ValueError, match="peak_bytes"):
        bench.largest_batch(lambda b: None, 10, device="cpu")
    with pytest.raises(KeyError):
        bench.largest_batch(_raise(KeyError("x")), 10, peak_bytes=lambda b: 1)


def test_memory_cap_sets_and_restores_the_fraction(monkeypatch):
    calls = []

    class Props:
        total_memory = 1000

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d=None: calls.append(f))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: 0.7,
                        raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench, "free_memory", lambda *a, **k: None)
    with bench.memory_cap(250, torch.device("cuda", 0)):
        assert calls == [0.25]
    assert calls == [0.25, 0.7]
    with pytest.raises(ValueError, match="cap_bytes"):
        with bench.memory_cap(2000, torch.device("cuda", 0)):
            pass


# --- claims ------------------------------------------------------------------------------------

def test_skipped_step_check_reference_is_clean():
    out = bench.skipped_step_check("sgd", "foreach", "cpu")
    assert out["max_abs_diff"] == 0.0 and out["finite"]
    assert out["state_after_skip"] is False and out["reference_state_after_skip"] is False
    fused = bench.skipped_step_check("adam", "fused", "cpu", size=64)
    assert set(fused) >= {"max_abs_diff", "finite", "state_after_skip"}


def test_compare_r6_verdicts_follow_the_numbers():
    fp32, amp = _row("fp32", 1000.0, 20.0, "fp32"), _row("amp", 3000.0, 10.0)
    slow = _row("r4", 2000.0, 13.0)
    out = bench.compare_r6(fp32, amp, slow)
    assert [r["configuration"] for r in out] == [c["configuration"] for c in bench.R6_CLAIM]
    assert out[1]["measured_saving_pct"] == pytest.approx(50.0)
    assert out[1]["verdict"].count("held") == 2 and "did not" not in out[1]["verdict"]
    assert "NOT better than plain AMP" in out[2]["verdict"]
    fast = bench.compare_r6(fp32, amp, _row("r4", 3500.0, 9.0))
    assert "better than plain AMP as claimed" in fast[2]["verdict"]
    weak = bench.compare_r6(fp32, _row("amp", 1100.0, 19.0), slow)
    assert "did not hold" in weak[1]["verdict"]
    with pytest.raises(ValueError, match="measurements"):
        bench.compare_r6(fp32, _row("amp", None, None), slow)


def test_verdict_b1():
    out = bench.verdict_b1(_row("fp32", 1000.0, 20.0), _row("fp16", 1800.0, 10.0))
    assert out["speed_verdict"] == "within the claimed 1.5-2x" and out["held"]
    assert out["memory_saving_pct"] == pytest.approx(50.0)
    fast = bench.verdict_b1(_row("fp32", 1000.0, 20.0), _row("fp16", 5000.0, 18.0))
    assert fast["speed_verdict"] == "faster than claimed" and not fast["held"]
    cpu = bench.verdict_b1(_row("fp32", 10.0, None), _row("fp16", 5.0, None))
    assert cpu["speed_verdict"] == "slower than claimed" and "not measured" in cpu["memory_verdict"]


def test_multi_tensor_status_matches_an_import_check():
    expected = importlib.util.find_spec("torch.optim._multi_tensor") is not None
    status = bench.multi_tensor_status()
    assert status["exists"] is expected
    if expected:  # what it is in this torch: Adam with foreach=True fixed
        assert status["subclass_of_adam"] and status["foreach"] is True


def test_autocast_error_by_op():
    rows = bench.autocast_error_by_op("cpu", torch.bfloat16, logit_scales=(1.0, 16.0))
    assert [r["op"].split()[0] for r in rows] == ["conv2d", "linear", "attention", "attention"]
    assert all(0 < r["rel_error"] < 0.05 for r in rows)
    assert rows[0]["out_dtype"] == "torch.bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        bench.autocast_error_by_op("cpu", torch.float32)


def test_digits_accuracy_runs_with_the_trainer():
    row = bench.digits_accuracy("resnet18", "bf16", "cpu", epochs=1, batch_size=16,
                                image_size=16, small_input=False, max_train=32, max_test=64)
    assert row["status"] == "ok"
    assert 0 <= row["accuracy"] <= 1 and 0 <= row["accuracy_fp32_eval"] <= 1
    assert row["steps"] == 2 and row["test_examples"] == 64 and math.isfinite(row["final_loss"])
    with pytest.raises(ValueError, match="model"):
        bench.digits_accuracy("vgg")


# --- CLI and plot ------------------------------------------------------------------------------

def test_cli_bench_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "--profile", "quick", "--precision", "fp32", "--batch-size", "2",
                   "--image-size", "16", "--warmup", "1", "--steps", "1", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["rows"]] == ["fp32, TF32 off"]
    assert doc["rows"][0]["status"] == "ok" and doc["rows"][0]["img_per_s"] > 0
    assert doc["profile"] == "quick" and "img/s" in capsys.readouterr().out


def test_cli_bench_builds_one_config_per_precision(monkeypatch, capsys):
    seen = {}

    def fake_run(configs, device, **kwargs):
        seen.update(configs=configs, **kwargs)
        return [dict(label=c.label, status="ok", reason="", img_per_s=1.0) for c in configs]

    monkeypatch.setattr(bench, "run_configs", fake_run)
    rc = cli.main(["bench", "--profile", "quick", "--precision", "amp", "fp16", "bf16",
                   "--channels-last", "--optimizer", "adam", "--impl", "fused", "--trainer",
                   "--checkpoint", "block", "--model", "resnet50-r4"])
    assert rc == 0
    cfgs = seen["configs"]
    assert [c.precision for c in cfgs] == ["fp16", "bf16"]  # "amp" is fp16, listed once
    assert all(c.channels_last and c.optimizer == "adam" and c.impl == "fused" for c in cfgs)
    assert all(c.loop == "trainer" and c.checkpoint == "block" for c in cfgs)
    assert cfgs[0].model == "resnet50-r4" and cfgs[0].batch_size == 8  # quick default
    assert seen["warmup"] == 1 and seen["steps"] == 3


def test_cli_bench_rejects_bad_flags():
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--precision", "fp8"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "--batch-size", "0"])


def test_throughput_memory_plot():
    rows = [_row("fp32", 1000.0, 20.0, "fp32"), _row("fp16 a", 3000.0, 10.0),
            _row("fp16 b", 3500.0, 10.5), _row("bf16", None, None, "bf16", status="skipped")]
    fig = plots.throughput_memory(rows)
    assert {t.name for t in fig.data} == {"fp32", "fp16"}
    assert sum(len(t.x) for t in fig.data) == 3
    assert "(GiB)" in fig.layout.xaxis.title.text and "(img/s)" in fig.layout.yaxis.title.text
    assert "bf16" in fig.layout.title.text  # the row left out is named


def test_throughput_memory_plot_counts_memory_on_a_cpu():
    parts = dict(params_gib=0.1, grads_gib=0.1, optimizer_state_gib=0.1, activations_gib=0.2)
    fig = plots.throughput_memory([_row("a", 10.0, None, "fp32", **parts)])
    assert fig.data[0].x[0] == pytest.approx(0.5)
    assert "counted" in fig.layout.xaxis.title.text
    with pytest.raises(ValueError, match="measured"):
        plots.throughput_memory([_row("a", None, None, status="skipped")])


def test_published_rows_follow_the_table_columns():
    rows = [{"label": "fp32", "img_per_s": 905.0, "speedup": 1.0, "status": "ok"},
            {"label": "fp16", "img_per_s": None, "status": "skipped", "reason": "no bf16"}]
    out = bench.published_rows(rows)
    assert list(out[0]) == ["configuration", "img/s", "x fp32", "status"]
    assert out[0]["img/s"] == 905.0 and out[1]["status"] == "skipped: no bf16"
    with pytest.raises(ValueError, match="columns must name at least one key"):
        bench.published_rows(rows, (("nope", "x"),))


def test_fused_sgd_skipped_first_step_bug_and_priming_fix():
    # the PyTorch bug the lesson shows: fused SGD's momentum is garbage after a skipped first step
    raw = bench.skipped_step_check("sgd", "fused", "cpu", size=256)
    assert raw["primed"] is False
    assert not (raw["finite"] and raw["max_abs_diff"] < 1e-6), raw
    assert raw["state_after_skip"] is True  # the skipped step created the (unwritten) buffer
    fixed = bench.skipped_step_check("sgd", "fused", "cpu", size=256, prime_momentum=True)
    assert fixed["primed"] is True and fixed["finite"] and fixed["max_abs_diff"] < 1e-6
    assert fixed["state_after_skip"] is False  # the primed buffer was there before the step
    assert bench.skipped_step_check("sgd", "foreach", "cpu", prime_momentum=True)["primed"] is False
    with pytest.raises(ValueError, match="prime_momentum"):
        bench.skipped_step_check("sgd", "fused", "cpu", prime_momentum="yes")


def test_build_optimizer_primes_fused_sgd_only():
    p = torch.nn.Parameter(torch.ones(4))
    fused = bench.build_optimizer(bench.BenchConfig(impl="fused"), [p])
    assert torch.equal(fused.state[p]["momentum_buffer"], torch.zeros(4))
    raw = bench.build_optimizer(bench.BenchConfig(impl="fused"), [p], prime_momentum=False)
    assert not raw.state
    foreach = bench.build_optimizer(bench.BenchConfig(impl="foreach"), [p])
    assert not foreach.state
    with pytest.raises(ValueError, match="prime_momentum"):
        bench.build_optimizer(bench.BenchConfig(), [p], prime_momentum=1)


def test_fastest_row_ignores_rows_that_did_not_train():
    rows = [dict(_row("a", 1000.0, 10.0), loss=2.0), dict(_row("nan", 9000.0, 10.0), loss=float("nan")),
            dict(_row("b", 3000.0, 10.0), loss=1.5), {"label": "oom", "status": "out of memory"}]
    assert bench.fastest_row(rows)["label"] == "b"
    assert bench.fastest_row([rows[1], rows[3]]) is None
    out = bench.verdict_fastest(rows[2], rows[0])
    assert out["share_of_published"] == pytest.approx(3000.0 / bench.PUBLISHED_FASTEST["img_per_s"])
    assert not out["beats_published"] and "3.00x fp32" in out["text"]
    assert "not comparable" not in out["text"]
    assert "not comparable" in bench.verdict_fastest(dict(rows[2], timer="perf_counter"), rows[0])["text"]
    with pytest.raises(ValueError, match="fp32 must be a measured row"):
        bench.verdict_fastest(rows[2], rows[3])
    with pytest.raises(ValueError, match="row must be a measured row"):
        bench.verdict_fastest(dict(rows[1], status="error"), rows[0])  # NaN loss, timing kept


def test_format_table_writes_blown_up_numbers_briefly():
    text = bench.format_table([{"label": "x", "max_abs_diff": 7.77e39}, {"label": "y", "max_abs_diff": 1234.5}],
                              (("label", "run"), ("max_abs_diff", "diff")))
    assert "7.77e+39" in text and "1,234" in text
