"""amp_lessons.measure (the measurement engine) on the CPU: configurations, the standard settings, timing, the GPU's idle
share, memory counting, failure rows, the trainer against a hand loop, the largest batch search,
published rows and the bench command."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from amp_lessons import cli
from amp_lessons import measure as M
from amp_lessons.measure import BenchConfig
from amp_lessons.tables import text_table

TINY = dict(model="resnet18", batch_size=2, image_size=16, num_classes=10)


@pytest.fixture
def no_gc(monkeypatch):
    """largest_batch frees memory after every trial (gc + empty_cache); skip that in tests."""
    monkeypatch.setattr(M.search, "free_memory", lambda *a, **k: None)


# --- configurations ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(precision="fp8"), "precision"), (dict(model="vgg"), "model"),
    (dict(batch_size=0), "batch_size"), (dict(image_size=4), "image_size"),
    (dict(optimizer="lamb"), "optimizer"), (dict(impl="apex"), "impl"),
    (dict(compile="fast"), "compile"), (dict(checkpoint="layer"), "checkpoint"),
    (dict(eps=0.0), "eps"), (dict(lr=-1.0), "lr"), (dict(loop="mine"), "loop"),
    (dict(trainer_tracking="no"), "trainer_tracking"),
    (dict(trainer_tracking=False), "trainer_tracking"),  # needs loop="trainer"
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
    assert "layer3/4+fc in fp32" in BenchConfig(model="resnet50-selective").label
    assert BenchConfig(label="mine").label == "mine"


def test_trainer_rows_turn_the_trainers_tracking_on_or_off():
    lean = BenchConfig(precision="fp32", loop="trainer", trainer_tracking=False, **TINY)
    assert lean.label.endswith("Trainer (track_grad_norm=False, track_memory=False)")
    assert BenchConfig(loop="trainer").label.endswith(", Trainer")
    for cfg, on in ((lean, False), (BenchConfig(precision="fp32", loop="trainer", **TINY), True)):
        model = M.build_model(cfg, "cpu")
        step = M.trainer_step(model, M.build_optimizer(cfg, model.parameters()), cfg, "cpu")
        tcfg = step.trainer.config
        assert tcfg.track_grad_norm is on and tcfg.track_memory is on
        x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
        assert math.isfinite(float(step(x, y)))
        assert (step.trainer.history[-1].grad_norm is None) is not on


def test_optimizer_kernels_and_settings():
    params = [nn.Parameter(torch.zeros(3))]
    assert M.build_optimizer(BenchConfig(impl="foreach"), params).defaults["foreach"] is True
    assert M.build_optimizer(BenchConfig(impl="fused"), params).defaults["fused"] is True
    assert M.build_optimizer(BenchConfig(impl="for-loop"), params).defaults["foreach"] is False
    adam = M.build_optimizer(BenchConfig(optimizer="adam", eps=1e-7, amsgrad=True), params)
    assert isinstance(adam, torch.optim.Adam)
    assert adam.defaults["eps"] == 1e-7 and adam.defaults["amsgrad"] is True
    assert isinstance(M.build_optimizer(BenchConfig(optimizer="adamw"), params),
                      torch.optim.AdamW)


def test_skip_reasons_on_a_cpu():
    assert "GPU" in M.skip_reason(BenchConfig(compile="default"), "cpu")
    assert "CUDA" in M.skip_reason(BenchConfig(cuda_graph=True), "cpu")
    assert M.skip_reason(BenchConfig(precision="bf16"), "cpu") is None
    assert M.skip_reason(BenchConfig(precision="tf32"), "cpu") is None  # plain fp32 off CUDA


@pytest.mark.parametrize("memory, expected", [(None, 256), (15.0, 64), (22.0, 128),
                                              (80.0, 256), (139.8, 256)])
def test_batch_size_scales_to_device_memory(memory, expected):
    assert M.batch_size_for(memory, 224) == expected


def test_batch_size_for_validates():
    with pytest.raises(ValueError, match="fraction"):
        M.batch_size_for(16.0, fraction=0)
    assert M.batch_size_for(15.0, image_size=112) == 256


# --- memory counting ---------------------------------------------------------------------------

def test_tensor_bytes_counts_each_storage_once():
    t = torch.zeros(10, 10)
    assert M.tensor_bytes([t, t[0], t.view(100), "not a tensor"]) == 400
    assert M.tensor_bytes([t, torch.zeros(5)]) == 420


def test_saved_activations_are_counted_without_parameters():
    lin = nn.Linear(4, 8, bias=False)
    x = torch.randn(16, 4)
    with M.SavedActivations(exclude=list(lin.parameters())) as saved:
        out = lin(x)
    assert saved.bytes == x.numel() * 4  # linear keeps its input for the weight gradient
    with M.SavedActivations(exclude=list(lin.parameters())) as saved:
        torch.relu(lin(x))
    assert saved.bytes == x.numel() * 4 + out.numel() * 4  # relu keeps its output too


def test_memory_breakdown_of_one_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = M.hand_step(model, opt, "fp32", "cpu")
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    parts = M.memory_breakdown(step, x, y, "cpu")
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert parts["params_gib"] * M.GIB == param_bytes
    assert parts["grads_gib"] * M.GIB == param_bytes
    assert parts["activations_gib"] > 0 and parts["activations_allocated_gib"] is None
    assert M.tensor_bytes(M.optimizer_state_tensors(opt)) == param_bytes  # momentum


# --- timing and rows ---------------------------------------------------------------------------

def test_time_steps_and_summary():
    calls = []
    out = M.time_steps(lambda x, y: calls.append(1) or torch.tensor(1.5),
                           torch.zeros(1), torch.zeros(1), warmup=2, steps=3, device="cpu")
    assert len(calls) == 5 and len(out["times_ms"]) == 3
    assert out["loss"] == 1.5 and out["timer"] == "perf_counter"
    s = M.summarize_times([10.0, 20.0, 30.0], batch_size=4)
    assert s["step_ms"] == 20.0 and s["img_per_s"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="steps"):
        M.time_steps(lambda x, y: None, torch.zeros(1), torch.zeros(1), steps=0)
    with pytest.raises(ValueError, match="times_ms"):
        M.summarize_times([], 1)
    with pytest.raises(ValueError, match="reset_peak"):
        M.time_steps(lambda x, y: None, torch.zeros(1), torch.zeros(1), reset_peak=None)


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
        out = M.time_steps(step, torch.zeros(1), torch.zeros(1), warmup=1, steps=2,
                               device=torch.device("cuda", 0), reset_peak=reset)
        assert resets == expected and out["times_ms"] == [2.0, 2.0]


def test_measure_a_tiny_resnet_on_the_cpu():
    # fp32: bf16 on two 16-pixel images ran to a NaN loss in some full-suite orders (not alone);
    # a NaN loss becomes an "error" row by design, which test_nan_loss_is_reported covers.
    row = M.measure(BenchConfig(precision="fp32", channels_last=True, lr=0.01, **TINY), "cpu",
                    warmup=1, steps=2)
    assert row["status"] == "ok", row["reason"]
    assert row["img_per_s"] > 0 and row["timer"] == "perf_counter"
    assert row["peak_allocated_gib"] is None  # no allocator statistics on a CPU
    n = sum(p.numel() for p in M.build_model(BenchConfig(**TINY), "cpu").parameters())
    assert row["params_gib"] * M.GIB == n * 4
    assert row["optimizer_state_gib"] * M.GIB == n * 4  # SGD momentum, fp32
    assert math.isfinite(row["loss"]) and row["config"]["precision"] == "fp32"


def test_nan_loss_is_reported(monkeypatch):
    real = M.build_model

    def poisoned(config, device, *args, **kwargs):
        model = real(config, device, *args, **kwargs)
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
        return model

    monkeypatch.setattr(M.runner, "build_model", poisoned)
    row = M.measure(BenchConfig(precision="fp32", **TINY), "cpu", warmup=1, steps=2)
    assert row["status"] == "error" and "loss is nan after 3 steps" in row["reason"]
    assert row["img_per_s"] > 0  # the timing is kept


def _raise(exc):
    def build(*args, **kwargs):
        raise exc
    return build


def test_failures_become_rows(monkeypatch):
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    monkeypatch.setattr(M.runner, "build_model", _raise(oom("CUDA out of memory. Tried to allocate")))
    row = M.measure(BenchConfig(**TINY), "cpu")
    assert row["status"] == "out of memory" and "batch 2" in row["reason"]
    monkeypatch.setattr(M.runner, "build_model", _raise(RuntimeError("boom\nmore")))
    row = M.measure(BenchConfig(**TINY), "cpu")
    assert row["status"] == "error" and row["reason"] == "RuntimeError: boom"
    skipped = M.measure(BenchConfig(compile="default", **TINY), "cpu")
    assert skipped["status"] == "skipped" and skipped["img_per_s"] is None


def test_is_out_of_memory():
    assert M.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert M.is_out_of_memory(MemoryError())
    assert not M.is_out_of_memory(RuntimeError("shape mismatch"))


def test_run_configs_in_one_process(monkeypatch):
    seen = []
    rows = M.run_configs([BenchConfig(precision="fp32", **TINY),
                              BenchConfig(compile="default", **TINY)], "cpu", warmup=0, steps=1,
                             breakdown=False, progress=False, on_row=seen.append)
    assert [r["status"] for r in rows] == ["ok", "skipped"] and seen == rows
    with pytest.raises(ValueError, match="unique"):
        M.run_configs([BenchConfig(**TINY)] * 2, "cpu")


def _row(label, ips, peak, precision="fp16", status="ok", **extra):
    row = dict(label=label, img_per_s=ips, peak_allocated_gib=peak, status=status, reason="",
               config={"precision": precision})
    row.update(extra)
    return row


def test_ratios_and_table():
    rows = [_row("fp32", 1000.0, 20.0, "fp32"), _row("fp16", 3000.0, 10.0),
            _row("bf16", None, None, "bf16", status="skipped", reason="needs bf16")]
    out = M.with_ratios(rows, "fp32")
    assert out[1]["speedup"] == 3.0 and out[1]["memory_ratio"] == 0.5
    assert out[2]["speedup"] is None
    text = text_table(out, M.DEFAULT_COLUMNS)
    assert "x fp32" in text and "3.00" in text and "n/a" in text and "needs bf16" in text
    with pytest.raises(ValueError, match="baseline"):
        M.with_ratios(rows, "tf32")
    with pytest.raises(ValueError, match="columns"):
        text_table(rows, columns=[("nope", "nope")])


def test_find_row():
    rows = [_row("a", 1.0, 1.0, "fp32"), _row("b", 2.0, 1.0, "fp16")]
    assert M.find_row(rows, precision="fp16")["label"] == "b"
    assert M.find_row(rows, precision="bf16") is None


def test_results_document_is_json():
    doc = M.results_document([_row("a", float("nan"), 1.0)], "cpu", suite="x")
    text = json.dumps(doc)
    assert doc["rows"][0]["img_per_s"] is None and doc["suite"] == "x"
    assert {"device_name", "torch", "date"} <= set(json.loads(text))


# --- the trainer against a hand-written loop ---------------------------------------------------

def test_compare_loops_on_the_cpu():
    out = M.compare_loops(BenchConfig(precision="fp32", **TINY), "cpu", warmup=0, steps=1,
                              rounds=2)
    assert out["status"] == "ok", out
    assert out["hand_img_per_s"] > 0 and out["trainer_img_per_s"] > 0
    assert out["steps_each"] == 2 and math.isfinite(out["overhead_pct"])
    assert M.compare_loops(BenchConfig(compile="default", **TINY), "cpu")["status"] == "skipped"


# --- the largest batch under a memory cap ------------------------------------------------------

def test_largest_batch_doubles_then_bisects(no_gc):
    made = []

    def make_step(batch):
        made.append(batch)
        return lambda: None

    found = M.largest_batch(make_step, cap_bytes=37_000, peak_bytes=lambda b: 1000 * b)
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

    found = M.largest_batch(make_step, cap_bytes=10**9, peak_bytes=lambda b: 1)
    assert found.batch_size == 5
    assert any(t["reason"] == "out of memory" for t in found.trials)
    assert M.largest_batch(lambda b: (lambda: None), 10**9, peak_bytes=lambda b: 1,
                               limit=12).batch_size == 12
    none = M.largest_batch(lambda b: (lambda: None), 10, peak_bytes=lambda b: 100)
    assert none.batch_size == 0 and len(none.trials) == 1


def test_largest_batch_validates_and_propagates_other_errors(no_gc):
    with pytest.raises(ValueError, match="cap_bytes"):
        M.largest_batch(lambda b: None, 0, peak_bytes=lambda b: 1)
    with pytest.raises(ValueError, match="limit"):
        M.largest_batch(lambda b: None, 10, peak_bytes=lambda b: 1, start=8, limit=4)
    with pytest.raises(ValueError, match="peak_bytes"):
        M.largest_batch(lambda b: None, 10, device="cpu")
    with pytest.raises(KeyError):
        M.largest_batch(_raise(KeyError("x")), 10, peak_bytes=lambda b: 1)


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
    monkeypatch.setattr(M.oom, "free_memory", lambda *a, **k: None)
    with M.memory_cap(250, torch.device("cuda", 0)):
        assert calls == [0.25]
    assert calls == [0.25, 0.7]
    with pytest.raises(ValueError, match="cap_bytes"):
        with M.memory_cap(2000, torch.device("cuda", 0)):
            pass



# --- CLI and published rows ----------------------------------------------------------------------

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

    monkeypatch.setattr(M, "run_configs", fake_run)
    rc = cli.main(["bench", "--profile", "quick", "--precision", "amp", "fp16", "bf16",
                   "--channels-last", "--optimizer", "adam", "--impl", "fused", "--trainer",
                   "--checkpoint", "block", "--model", "resnet50-selective"])
    assert rc == 0
    cfgs = seen["configs"]
    assert [c.precision for c in cfgs] == ["fp16", "bf16"]  # "amp" is fp16, listed once
    assert all(c.channels_last and c.optimizer == "adam" and c.impl == "fused" for c in cfgs)
    assert all(c.loop == "trainer" and c.checkpoint == "block" for c in cfgs)
    assert cfgs[0].model == "resnet50-selective" and cfgs[0].batch_size == 8  # quick default
    assert seen["warmup"] == 1 and seen["steps"] == 3


def test_cli_bench_takes_warmup_0_as_the_doctor_does(monkeypatch, capsys):
    """``--warmup 0`` was refused by ``bench`` (and would have read as the default) while
    ``doctor --warmup 0`` ran; now both time from the first step when asked."""
    seen = {}

    def fake_run(configs, device, **kwargs):
        seen.update(kwargs)
        return [dict(label=c.label, status="ok", reason="", img_per_s=1.0) for c in configs]

    monkeypatch.setattr(M, "run_configs", fake_run)
    assert cli.main(["bench", "--profile", "quick", "--precision", "fp32", "--warmup", "0"]) == 0
    assert seen["warmup"] == 0
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--warmup", "-1"])
    assert exc.value.code == 2 and "expected a whole number >= 0, got -1" in capsys.readouterr().err


def test_cli_bench_rejects_bad_flags():
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--precision", "fp8"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["bench", "--batch-size", "0"])


def test_published_rows_follow_the_table_columns():
    rows = [{"label": "fp32", "img_per_s": 905.0, "speedup": 1.0, "status": "ok"},
            {"label": "fp16", "img_per_s": None, "status": "skipped", "reason": "no bf16"}]
    out = M.published_rows(rows)
    assert list(out[0]) == ["configuration", "img/s", "x fp32", "status"]
    assert out[0]["img/s"] == 905.0 and out[1]["status"] == "skipped: no bf16"
    with pytest.raises(ValueError, match="columns must name at least one key"):
        M.published_rows(rows, (("nope", "x"),))


def test_build_optimizer_primes_fused_sgd_only():
    p = torch.nn.Parameter(torch.ones(4))
    fused = M.build_optimizer(M.BenchConfig(impl="fused"), [p])
    assert torch.equal(fused.state[p]["momentum_buffer"], torch.zeros(4))
    raw = M.build_optimizer(M.BenchConfig(impl="fused"), [p], prime_momentum=False)
    assert not raw.state
    foreach = M.build_optimizer(M.BenchConfig(impl="foreach"), [p])
    assert not foreach.state
    with pytest.raises(ValueError, match="prime_momentum"):
        M.build_optimizer(M.BenchConfig(), [p], prime_momentum=1)


def test_format_table_writes_blown_up_numbers_briefly():
    text = text_table([{"label": "x", "max_abs_diff": 7.77e39}, {"label": "y", "max_abs_diff": 1234.5}],
                              (("label", "run"), ("max_abs_diff", "diff")))
    assert "7.77e+39" in text and "1,234" in text


# --- the standard settings, the idle share, the layout rule ------------------------------------

def test_standard_settings_are_one_dict_for_every_lesson():
    assert M.STANDARD == dict(channels_last=True, cudnn_benchmark=True, optimizer="sgd",
                              impl="foreach", warmup=5, steps=15)
    quick = M.standard_settings(quick=True)
    assert quick == dict(M.STANDARD, warmup=1, steps=2)  # quick still warms up one step
    full = M.standard_settings()
    full["steps"] = 99
    assert M.STANDARD["steps"] == 15  # a copy: callers cannot change the course's settings
    BenchConfig(**{k: v for k, v in M.STANDARD.items() if k not in ("warmup", "steps")})
    with pytest.raises(ValueError, match="quick"):
        M.standard_settings(quick="yes")


def test_settings_caption_names_every_setting():
    text = M.settings_caption()
    for words in ("channels_last", "cuDNN autotuning on", "foreach SGD", "15 timed steps",
                  "5 warm-up"):
        assert words in text, text
    off = M.settings_caption(dict(M.STANDARD, channels_last=False, cudnn_benchmark=False,
                                  impl="fused", optimizer="adam", steps=2, warmup=1))
    assert off.startswith("NCHW, cuDNN autotuning off, fused Adam, median of 2")
    with pytest.raises(ValueError, match="missing warmup"):
        M.settings_caption({k: v for k, v in M.STANDARD.items() if k != "warmup"})


def test_interval_union_counts_overlaps_once():
    assert M.interval_union([]) == 0.0
    assert M.interval_union([(0, 2), (1, 3), (5, 6)]) == 4.0  # overlapping streams
    assert M.interval_union([(0, 10), (2, 3), (4, 5)]) == 10.0  # nested events
    assert M.interval_union([(3, 4), (0, 1)]) == 2.0  # any order
    with pytest.raises(ValueError, match="end >= start"):
        M.interval_union([(2, 1)])


def test_idle_fraction():
    assert M.idle_fraction(8.0, 10.0) == pytest.approx(0.2)
    assert M.idle_fraction(12.0, 10.0) == 0.0 and M.idle_fraction(0.0, 10.0) == 1.0
    assert M.idle_fraction(None, 10.0) is None and M.idle_fraction(1.0, None) is None


def test_device_busy_ms_on_the_cpu():
    x = torch.randn(128, 128)
    step = lambda x, y: (x @ x).sum()  # noqa: E731
    assert M.device_busy_ms(step, x, None, "cpu") is None  # no GPU to sit idle
    busy = M.device_busy_ms(step, x, None, "cpu", steps=2, activity="cpu")
    assert busy is not None and busy > 0  # the CPU operators' own time, per step
    with pytest.raises(ValueError, match="steps"):
        M.device_busy_ms(step, x, None, "cpu", steps=0)
    with pytest.raises(ValueError, match="activity"):
        M.device_busy_ms(step, x, None, "cpu", activity="tpu")


def test_cpu_rows_carry_no_idle_share():
    row = M.measure(BenchConfig(precision="fp32", **TINY), "cpu", warmup=1, steps=1,
                    breakdown=False)
    assert row["status"] == "ok" and row["gpu_idle_fraction"] is None
    assert row["gpu_busy_ms"] is None and {"gpu_idle_fraction", "gpu_busy_ms"} <= set(M.ROW_KEYS)
    assert "GPU idle" in text_table([row], M.DEFAULT_COLUMNS)


def test_measure_has_no_claim_ids_and_stays_small():
    text = Path(M.__file__).read_text()
    assert not re.findall(r"\b(claim_[a-z0-9]+|[RB]\d{1,2}[a-d]?)\b", text)
    assert len(text.splitlines()) <= 900


def test_device_busy_ms_keeps_the_profilers_notice_out_of_the_output(monkeypatch):
    """torch 2.11's profiler warns "Profiler clears events at the end of each cycle" on a GPU: a
    notice about repeated cycles, which one cycle does not have; it must not reach a notebook."""
    import warnings

    class Event:
        device_type = type("T", (), {"name": "CPU"})()
        time_range = type("R", (), {"start": 0.0, "end": 2000.0})()

    class FakeProfile:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            warnings.warn("Warning: Profiler clears events at the end of each cycle.", UserWarning)
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [Event()]

    from amp_lessons.measure import timer as timing
    monkeypatch.setattr(timing, "profile", FakeProfile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        busy = M.device_busy_ms(lambda x, y: None, torch.zeros(1), None, "cpu", steps=2,
                                activity="cpu")
    assert busy == 1.0 and not caught  # 2 ms of events over 2 steps


def test_published_rows_show_the_idle_share_as_text():
    rows = [{"label": "fp16", "img_per_s": 3000.0, "gpu_idle_fraction": 0.0061, "status": "ok"},
            {"label": "cpu", "img_per_s": 3.0, "gpu_idle_fraction": None, "status": "ok"}]
    out = M.published_rows(rows)
    assert out[0]["GPU idle"] == "0.61%" and out[0]["img/s"] == 3000.0
    assert out[1]["GPU idle"] is None
    tiny = M.published_rows([dict(rows[0], gpu_idle_fraction=2e-6)])[0]["GPU idle"]
    assert tiny.startswith("< 0.001%")  # a nonzero share never reads as 0


def test_repeat_spread_splits_the_timed_steps_into_repeats():
    assert M.repeat_spread([10.0] * 15) == 0.0
    assert M.repeat_spread([10.0] * 5 + [11.0] * 5 + [10.0] * 5) == pytest.approx(0.1)
    assert M.repeat_spread([10.0, 11.0, 12.0]) is None       # one step per repeat: unknown
    with pytest.raises(ValueError, match="repeats"):
        M.repeat_spread([1.0] * 6, repeats=1)
    row = M.summarize_times([10.0] * 5 + [20.0] * 5 + [10.0] * 5, batch_size=4)
    assert row["spread"] == pytest.approx(1.0) and row["step_ms"] == 10.0


def test_fit_batch_memory_predicts_the_largest_batch():
    fit = M.fit_batch_memory({2: 1000 + 2 * 300, 4: 1000 + 4 * 300, 8: 1000 + 8 * 300})
    assert fit["fixed"] == pytest.approx(1000) and fit["per_sample"] == pytest.approx(300)
    assert M.search.predicted_batch(fit, 1000 + 300 * 50 + 10, limit=4096) == 50
    assert M.search.predicted_batch(fit, 500, limit=4096) == 0
    assert M.search.predicted_batch(fit, 10 ** 9, limit=64) == 64
    with pytest.raises(ValueError, match="at least two"):
        M.fit_batch_memory({2: 1.0})
    with pytest.raises(ValueError, match="grow"):
        M.fit_batch_memory({2: 5.0, 4: 5.0})


def test_free_bytes_is_none_off_a_gpu():
    assert M.free_bytes("cpu") is None and M.free_bytes(None) is None


def test_wall_clock_times_the_whole_block_even_when_it_raises():
    import time
    with M.wall_clock() as clock:
        assert math.isnan(clock["seconds"])  # no reading before the block ends
        time.sleep(0.02)
    assert 0.015 < clock["seconds"] < 5
    with pytest.raises(RuntimeError), M.wall_clock() as failed:
        raise RuntimeError("stop")
    assert failed["seconds"] >= 0


def test_cupti_teardown_is_asked_for_during_a_profile_and_undone(monkeypatch):
    import os

    from amp_lessons.measure import timer

    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.setattr(timer.torch.version, "cuda", "13.0")
    with timer.cupti_teardown():
        assert os.environ["TEARDOWN_CUPTI"] == "1"
    assert "TEARDOWN_CUPTI" not in os.environ
    monkeypatch.setattr(timer.torch.version, "cuda", "12.4")  # a teardown can crash graphs there
    with timer.cupti_teardown():
        assert "TEARDOWN_CUPTI" not in os.environ
    monkeypatch.setattr(timer.torch.version, "cuda", "13.0")
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")  # set by torch or the user: left alone
    with timer.cupti_teardown():
        assert os.environ["TEARDOWN_CUPTI"] == "0"
    with timer.cupti_teardown(enabled=False):
        assert os.environ["TEARDOWN_CUPTI"] == "0"


def test_a_noisy_row_says_so_in_its_published_status():
    rows = [{"label": "a", "status": "ok", "img_per_s": 1.0, "spread": 0.25},
            {"label": "b", "status": "ok", "img_per_s": 1.0, "spread": 0.02}]
    out = M.published_rows(rows)
    assert out[0]["status"].startswith("ok (noisy: repeats differ by 25%")
    assert out[1]["status"] == "ok" and out[1]["repeat spread"] == "2%"
    assert M.noisy(rows[0]) and M.noisy(rows[1]) is None and M.noisy({}) is None


def test_time_steps_keeps_every_timed_steps_output_when_asked():
    calls = iter(range(100))
    out = M.time_steps(lambda x, y: torch.tensor(float(next(calls))), torch.zeros(1), None,
                       warmup=2, steps=3, device="cpu", keep_losses=True)
    assert [float(v) for v in out["losses"]] == [2.0, 3.0, 4.0] and out["loss"] == 4.0
    assert "losses" not in M.time_steps(lambda x, y: None, torch.zeros(1), None, warmup=0,
                                        steps=1, device="cpu")
    with pytest.raises(ValueError, match="keep_losses"):
        M.time_steps(lambda x, y: None, torch.zeros(1), None, keep_losses="yes")


def test_run_configs_shows_the_course_progress_bar(capsys):
    """``progress=True`` showed no bar since it was written (an import of a module that did not
    exist, its ImportError swallowed): the bar is ``amp_lessons.progress``'s."""
    skipped = [BenchConfig(compile="default", **TINY), BenchConfig(compile="max-autotune", **TINY)]
    M.run_configs(skipped, "cpu", warmup=0, steps=1, breakdown=False, progress=True)
    err = capsys.readouterr().err
    assert "measuring:" in err and "/2 [" in err and "configuration/s" in err
    M.run_configs(skipped, "cpu", warmup=0, steps=1, breakdown=False, progress=False)
    assert "measuring" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="progress must be True or False"):
        M.run_configs(skipped, "cpu", progress="yes")


def test_measure_counts_optimizer_state_when_no_step_ran(monkeypatch):
    def no_step(step, x, y, **kwargs):  # what a run looks like where every step was skipped
        return {"times_ms": [1.0, 1.0], "loss": 1.0, "timer": "perf_counter"}
    monkeypatch.setattr(M.runner, "time_steps", no_step)
    row = M.measure(M.BenchConfig(precision="fp16", **TINY), "cpu", warmup=0, steps=1,
                    breakdown=True, idle=False)
    assert row["status"] == "ok" and row["optimizer_state_gib"] > 0
    assert row["optimizer_state_gib"] == pytest.approx(row["params_gib"])  # SGD momentum
    assert "GradScaler skipped every step" in row["reason"]


def test_measure_reads_optimizer_state_as_before_when_steps_ran():
    row = M.measure(M.BenchConfig(precision="fp32", **TINY), "cpu", warmup=0, steps=1,
                    idle=False)
    assert row["reason"] == ""
    assert row["optimizer_state_gib"] == pytest.approx(row["params_gib"])


def test_summarize_times_refuses_zero_times_and_batches():
    with pytest.raises(ValueError, match="times_ms must have a median above 0 ms"):
        M.summarize_times([0.0, 0.0], 8)
    with pytest.raises(ValueError, match="times_ms must hold finite step times"):
        M.summarize_times([float("nan")] * 6, 8)
    with pytest.raises(ValueError, match="batch_size must be"):
        M.summarize_times([1.0, 2.0], 0)


def test_overhead_noise_says_when_the_overhead_decides_nothing():
    rounds = [{"hand": 10.0, "trainer": 10.1}, {"hand": 10.0, "trainer": 10.3}]
    out = M.overhead_noise(2.0, rounds)
    assert out["overhead_spread_pct"] == pytest.approx(2.0)
    assert out["note"].startswith("undecided") and "noise floor" in out["note"]
    assert M.overhead_noise(50.0, rounds)["note"] == ""
    assert M.overhead_noise(50.0, rounds, hand_spread=0.3)["note"].startswith("noisy")
    assert M.overhead_noise(50.0, rounds[:1])["note"].startswith("undecided: one round")


def test_compare_loops_reports_the_spread_of_its_overhead():
    out = M.compare_loops(M.BenchConfig(precision="fp32", **TINY), "cpu", warmup=0, steps=1,
                          rounds=2)
    assert len(out["overhead_rounds_pct"]) == 2 and math.isfinite(out["overhead_spread_pct"])
    assert "spread" in out and isinstance(out["note"], str)
