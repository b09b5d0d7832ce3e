"""amp_lessons.measure.distributed: launching, DDP/ZeRO/FSDP2 with mixed precision, FSDP2 wrapping, errors.

The slow tests start two CPU processes with gloo (the quick profile's setup). One sweep, shared
by several tests, trains every configuration they check in a single launch.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp_lessons.measure import distributed as D
from amp_lessons.measure.distributed import RunConfig, SweepResult
from amp_lessons.models import TinyTransformer, lm_loss
from amp_lessons import data

ROOT = Path(__file__).resolve().parent.parent
TWO_CPUS = D.device_slots("gloo") >= 2
needs_two = pytest.mark.skipif(not TWO_CPUS, reason="needs two CPU cores for two processes")
FSDP2_CPU = D.fsdp2_problem("cpu")
needs_fsdp2_cpu = pytest.mark.skipif(FSDP2_CPU is not None, reason=str(FSDP2_CPU))

# Tolerances, stated: fp32 DDP vs one process differ only in summation order (~1e-7 here);
# under autocast the two half-batch weight gradients are rounded separately before DDP averages
# them, so parameters agree to the rounding of fp16 (11 significant bits, ~5e-5 measured) and of
# bf16 (8 significant bits, ~2e-3 measured after 4 SGD steps at lr 0.2).
ATOL = {"fp32": 1e-5, "fp16": 5e-4, "bf16": 5e-3}
# FSDP2 with half-precision gathered parameters (bf16 parameters in every op) vs DDP (autocast:
# fp32 parameters cast per op) round differently; over a few steps their losses stay within 2%.
# FSDP2 wrapped by blocks (fp32 parameters, autocast) does DDP's arithmetic: ATOL of its precision.
FSDP_LOSS_RTOL = 0.02

RESNET = dict(model="resnet18", precision="bf16", optimizer="sgd", lr=0.01, batch_size=2,
              image_size=32, steps=2, warmup=0)
RESNET_WRAPS = (("ddp", "blocks", True), ("fsdp2", "blocks", True), ("fsdp2", "blocks", False),
                ("fsdp2", "bn-units", True))
MLP = dict(model="mlp", optimizer="sgd", lr=0.2, steps=3, warmup=1, keep_params=True)
TINY_TF = dict(model="tiny_transformer", optimizer="adamw", lr=1e-3, steps=2, warmup=1,
               batch_size=2, model_kwargs={"d_model": 32, "n_layers": 4, "n_heads": 2,
                                           "seq_len": 16, "vocab_size": 64})


# --- fast: configuration, checks, tables --------------------------------------------------------

def test_run_config_validates_each_setting():
    assert RunConfig(precision="amp").precision == "fp16"
    for bad in (dict(model="vgg"), dict(strategy="zero3"), dict(precision="fp8"),
                dict(batch_size=0), dict(steps=0), dict(warmup=-1), dict(optimizer="lamb"),
                dict(lr=0), dict(init_scale=0), dict(image_size=4), dict(model_kwargs=[1])):
        key = next(iter(bad))
        with pytest.raises(ValueError, match=key):
            RunConfig(**bad)
    assert RunConfig(model="tiny_transformer").unit == "seq"
    assert RunConfig(label="x").name == "x"
    assert RunConfig().name == "small_cnn ddp bf16"
    assert RunConfig(strategy="fsdp2").name == "small_cnn fsdp2 bf16 blocks"
    assert RunConfig(strategy="fsdp2", fsdp_wrap="bn-units", reshard_after_forward=False).name \
        == "small_cnn fsdp2 bf16 bn-units, no reshard"
    with pytest.raises(ValueError, match="fsdp_wrap must be one of 'blocks'"):
        RunConfig(fsdp_wrap="layers")
    with pytest.raises(ValueError, match="reshard_after_forward must be True or False"):
        RunConfig(reshard_after_forward=1)


def _one_process_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{D.free_port()}",
                                         rank=0, world_size=1)
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")


@pytest.mark.parametrize("wrap, units, kinds", [
    ("blocks", 17, {("Bottleneck", "float32"): 16, ("ResNet", "float32"): 1}),
    ("blocks-half-params", 17, {("Bottleneck", "bfloat16"): 16, ("ResNet", "bfloat16"): 1}),
    ("bn-units", 70, {("BatchNorm2d", "float32"): 53, ("Bottleneck", "bfloat16"): 16,
                      ("ResNet", "bfloat16"): 1}),
])
def test_fsdp2_wrap_of_resnet50_counts_its_units(wrap, units, kinds):
    """The default wrap is one unit per residual block + the root (17 on ResNet-50), with fp32
    parameters; every BatchNorm its own unit made 70, each a collective and hooks per pass."""
    from collections import Counter
    from amp_lessons.models import resnet50
    mesh = _one_process_group()
    try:
        with torch.device("meta"):  # nothing allocated: the wrap alone is under test
            model = resnet50(num_classes=10)
        n_params = len(list(model.parameters()))
        D.fsdp2_shard(model, "bf16", mesh, wrap)
        found = D.fsdp_units(model)
    finally:
        torch.distributed.destroy_process_group()
    assert len(found) == units
    assert Counter((u["kind"], u["param_dtype"]) for u in found) == kinds
    assert sum(u["parameters"] for u in found) == n_params  # every parameter in exactly one unit
    assert found[0]["unit"] == "(root)"
    assert RunConfig(strategy="fsdp2").fsdp_wrap == "blocks"  # the default is the cheap wrap


def test_fsdp2_shard_refuses_bad_settings():
    with pytest.raises(ValueError, match="wrap must be one of"):
        D.fsdp2_shard(torch.nn.Linear(2, 2), "bf16", None, "every-layer")
    with pytest.raises(ValueError, match="reshard_after_forward"):
        D.fsdp2_shard(torch.nn.Linear(2, 2), "bf16", None, "blocks", "yes")


def test_half_parameters_with_batchnorm_are_refused_before_training(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(D, "fsdp2_problem", lambda device: None)  # as on torch >= 2.9 (or GPUs)
    bn = RunConfig(model="resnet18", strategy="fsdp2", fsdp_wrap="blocks-half-params")
    assert "BatchNorm" in D._precision_problem(bn, cpu)
    assert D.has_batchnorm(D.build_model(bn)) and not D.has_batchnorm(D.build_model(RunConfig(
        model="mlp")))
    for ok in (RunConfig(model="resnet18", strategy="fsdp2"),  # fp32 parameters: fine
               RunConfig(model="tiny_transformer", strategy="fsdp2",
                         fsdp_wrap="blocks-half-params"),  # no BatchNorm: fine
               RunConfig(model="resnet18", strategy="fsdp2", fsdp_wrap="blocks-half-params",
                         precision="fp32")):  # nothing is cast
        assert D._precision_problem(ok, cpu) is None


def test_backend_and_world_size_errors():
    with pytest.raises(ValueError, match="backend"):
        D.check_backend("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl.*CUDA"):
            D.check_backend("nccl")
        assert D.default_backend() == "gloo"
    with pytest.raises(ValueError, match="world_size"):
        D.check_world_size(0, "gloo")
    too_many = D.device_slots("gloo") + 1
    with pytest.raises(ValueError, match=f"world_size={too_many}.*allowed: 1..{too_many - 1}"):
        D.check_world_size(too_many, "gloo")
    assert D.available_world_sizes("gloo", (1, 2, 4, 8)) == \
        [n for n in (1, 2, 4, 8) if n <= D.device_slots("gloo")]


def test_launch_refuses_bad_requests_before_starting_processes():
    with pytest.raises(ValueError, match="importable module"):
        D.launch(lambda ctx: 0, 1, backend="gloo")
    with pytest.raises(ValueError, match="world_size"):
        D.launch(D.run_plan, D.device_slots("gloo") + 1, backend="gloo")
    with pytest.raises(ValueError, match="timeout_s"):
        D.launch(D.run_plan, 1, backend="gloo", timeout_s=0)
    with pytest.raises(ValueError, match="plan"):
        D.run_experiments([])
    with pytest.raises(ValueError, match="RunConfig"):
        D.run_experiments([("ddp", 2)])


def test_init_rank_joins_a_one_process_group():
    assert D.cpu_count() == D.device_slots("gloo") >= 1
    threads = torch.get_num_threads()
    ctx = D.init_rank(0, 1, 0, "gloo", f"tcp://127.0.0.1:{D.free_port()}", 30.0)
    try:
        assert ctx == D.RankContext(0, 1, 0, "gloo", torch.device("cpu"))
        assert ctx.device_type == "cpu" and torch.distributed.get_world_size() == 1
        D.barrier(ctx)
    finally:
        torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)


def test_grid_orders_by_world_size():
    a, b = RunConfig(label="a"), RunConfig(label="b")
    assert D.grid([a, b], [1, 2]) == [(a, 1), (b, 1), (a, 2), (b, 2)]
    with pytest.raises(ValueError):
        D.grid([a], [0])


def test_tiny_transformer_and_shard_units():
    m = TinyTransformer(vocab_size=50, d_model=16, n_layers=3, n_heads=2, seq_len=8)
    tokens = torch.randint(0, 50, (2, 8))
    logits = m(tokens)
    assert logits.shape == (2, 8, 50)
    assert math.isclose(lm_loss(logits, tokens).item(), math.log(50), rel_tol=0.3)
    assert m.parameter_count() == sum(p.numel() for p in m.parameters())
    assert D.shard_units(m) == list(m.blocks)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TinyTransformer(d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="seq_len"):
        m(torch.randint(0, 50, (1, 9)))
    from amp_lessons.models import resnet18
    assert len(D.shard_units(resnet18(num_classes=10))) == 8  # 2 basic blocks x 4 stages


def test_causal_attention_does_not_look_ahead():
    torch.manual_seed(0)
    m = TinyTransformer(vocab_size=20, d_model=16, n_layers=2, n_heads=2, seq_len=6).eval()
    a = torch.randint(0, 20, (1, 6))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 20
    assert torch.allclose(m(a)[0, :-1], m(b)[0, :-1])
    assert not torch.allclose(m(a)[0, -1], m(b)[0, -1])


def test_local_state_bytes_counts_adamw_state():
    model = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    held = D.local_state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert held["params"] == held["grads"] == 4 * n
    assert 8 * n <= held["optimizer_state"] <= 8 * n + 64  # exp_avg, exp_avg_sq (+ step counts)


def _rows(label, n, step_ms, opt_mib, peak=None):
    return [{"label": label, "model": "m", "strategy": "s", "precision": "bf16", "world_size": n,
             "rank": r, "unit": "img", "batch_size": 4, "step_ms": step_ms + r,
             "per_rank_per_s": 1.0, "peak_gib": peak, "param_mib": 1.0, "grad_mib": 1.0,
             "optimizer_state_mib": opt_mib, "losses": [2.0, 1.0]} for r in range(n)]


def test_summary_efficiency_and_tables():
    result = SweepResult(rows=_rows("a", 1, 10.0, 2.0) + _rows("a", 2, 10.0, 1.0), backend="gloo",
                         launched=2)
    one, two = result.find("a", 1), result.find("a", 2)
    assert one["per_s"] == pytest.approx(400.0)  # 4 examples / 10 ms
    assert two["per_s"] == pytest.approx(8 / 0.011)  # the slower rank (11 ms) sets the pace
    assert two["efficiency"] == pytest.approx(two["per_s"] / (2 * one["per_s"]))
    assert two["model_state_mib"] == pytest.approx(3.0)
    with pytest.raises(KeyError):
        result.find("a", 4)
    table = result.scaling_table()
    assert "scaling eff." in table and "n/a" in table  # no peak memory on the CPU
    assert len(result.per_rank_table().splitlines()) == 2 + 3
    with pytest.raises(ValueError):
        D.text_table([], D.SUMMARY_COLUMNS)
    published = result.published_rows()
    assert published[1]["scaling efficiency (%)"] == pytest.approx(100 * two["efficiency"])
    assert published[1]["throughput (img/s)"] == pytest.approx(two["per_s"])
    assert published[0]["peak memory per rank (GiB)"] is None


def test_repeat_blocks_and_peak_spread():
    assert D.repeat_blocks(30) == [10, 10, 10] and D.repeat_blocks(10) == [3, 3, 4]
    assert D.repeat_blocks(2) == [2] and D.repeat_blocks(7, repeats=1) == [7]
    with pytest.raises(ValueError, match="steps"):
        D.repeat_blocks(0)
    assert D.peak_spread([6.0, 6.0, 6.0]) == 0.0
    assert D.peak_spread([6.83, 6.02, 6.02]) == pytest.approx(0.81 / 6.83)
    assert D.peak_spread([1.0]) is None and D.peak_spread([0, 0]) is None


def test_timed_repeats_time_every_step_once_after_settling():
    """Warm-up steps, the settle before the last of them, then the timed steps in three repeats:
    every step runs once, in order, and the spread is the engine's repeat_spread."""
    calls = []

    def step():
        calls.append("step")
        return torch.tensor(float(calls.count("step")))
    out = D.timed_repeats(step, 9, 3, torch.device("cpu"), lambda: calls.append("settle"))
    assert calls == ["step", "step", "settle"] + ["step"] * 10
    assert len(out["times"]) == 9 and len(out["losses"]) == 9 and len(out["warm_losses"]) == 3
    assert [float(v) for v in out["losses"]] == [float(i) for i in range(4, 13)]
    assert out["peaks"] == [] and out["peak_spread"] is None  # no peak counter on a CPU
    assert out["spread"] == pytest.approx(D.repeat_spread(out["times"]))
    few = D.timed_repeats(step, 3, 0, torch.device("cpu"), lambda: None)
    assert len(few["times"]) == 3 and few["spread"] is None  # too few steps to tell


def test_noisy_rows_say_so_in_every_table():
    rows = _rows("a", 2, 10.0, 1.0, peak=2.0)
    rows[0].update(spread=0.04, peak_spread=0.0)
    rows[1].update(spread=0.03, peak_spread=0.2)
    result = SweepResult(rows=rows, backend="nccl", launched=2)
    s = result.find("a", 2)
    assert s["spread"] == pytest.approx(0.04) and s["peak_spread"] == pytest.approx(0.2)
    assert s["noisy"] == D.row_noise(s) and "peak memory of the repeats differs by 20%" in s["noisy"]
    published = result.published_rows()[0]
    assert published["repeat spread (%)"] == pytest.approx(4.0)
    assert published["note"] == s["noisy"]
    assert "repeat spread" in result.scaling_table() and "4%" in result.per_rank_table()
    assert D.row_noise({"spread": 0.11}).startswith("noisy: repeats differ by 11%")
    assert D.row_noise({"spread": 0.05, "peak_spread": 0.1}) is None
    steady = SweepResult(rows=_rows("a", 1, 10.0, 1.0), backend="nccl", launched=1)
    assert steady.find("a", 1)["noisy"] == "" and steady.published_rows()[0]["note"] == ""


def test_scaling_and_memory_figures():
    from amp_lessons.ui import perf_plots as plots
    result = SweepResult(rows=_rows("a", 1, 10.0, 2.0) + _rows("a", 2, 10.0, 1.0, peak=0.5),
                         backend="nccl", launched=2)
    fig = plots.scaling_figure(result.summary())
    assert [t.name for t in fig.data] == ["a", "a: perfect"]
    assert list(fig.data[1].y) == [pytest.approx(400.0), pytest.approx(800.0)]
    assert fig.data[0].text[1] == f"{result.find('a', 2)['efficiency']:.0%}"
    assert fig.data[0].text[0] == "" and list(fig.data[0].customdata) == ["100%", fig.data[0].text[1]]
    assert fig.layout.title.text and fig.layout.xaxis.title.text
    assert "/s" in fig.layout.yaxis.title.text
    mem = plots.memory_per_rank_figure(result.rows)
    assert [t.name for t in mem.data] == ["parameters", "gradients", "optimizer state",
                                          "peak allocated"]
    assert list(mem.data[3].y) == [512.0, 512.0]  # 0.5 GiB in MiB, both ranks of world size 2
    assert "MiB" in mem.layout.yaxis.title.text and "2 processes" in mem.layout.title.text
    with pytest.raises(ValueError):
        plots.memory_per_rank_figure(result.rows, world_size=4)
    with pytest.raises(ValueError):
        plots.scaling_figure([])


def test_describe_world_and_parameter_count():
    assert 0 < D.free_port() < 65536
    text = D.describe_world("gloo", (1, 2, 10_000))
    assert "gloo" in text and "not run  : world sizes 10000" in text
    assert D.parameter_count(RunConfig(model="mlp")) == sum(
        p.numel() for p in D.build_model(RunConfig(model="mlp")).parameters())
    assert D.fsdp2_available()


def test_fsdp2_problem_names_the_torch_that_cannot_shard_on_a_cpu(monkeypatch):
    """FSDP2 on CPU processes needs torch >= 2.9: 2.4 to 2.6 cannot run it, 2.7 and 2.8 average
    wrongly over gloo; a run plan skips such a configuration with that reason instead."""
    assert D.fsdp2_problem("cuda") is None  # GPUs: any torch with FSDP2
    monkeypatch.setattr(D, "torch_version", lambda: (2, 6))
    problem = D.fsdp2_problem("cpu")
    assert problem.startswith("FSDP2 on CPU processes needs torch >= 2.9")
    assert torch.__version__ in problem and "cannot run it" in problem
    assert D._precision_problem(RunConfig(model="mlp", strategy="fsdp2"), "cpu") == problem
    assert D._precision_problem(RunConfig(model="mlp", strategy="ddp"), "cpu") is None
    monkeypatch.setattr(D, "torch_version", lambda: (2, 8))
    assert "pytorch/pytorch#162338" in D.fsdp2_problem("cpu")
    monkeypatch.setattr(D, "torch_version", lambda: (2, 9))
    assert D.fsdp2_problem("cpu") is None
    monkeypatch.setattr(D, "fsdp2_available", lambda: False)
    assert "has no FSDP2" in D.fsdp2_problem("cuda")


def test_command_line_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        D.main(["--precision", "fp8"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        D.main(["--batch-size", "0", "--nproc", "1", "--backend", "gloo"])
    assert "batch_size" in capsys.readouterr().err


# --- slow: two processes with gloo --------------------------------------------------------------

@pytest.fixture(scope="module")
def sweep():
    """One launch of two processes training every configuration the tests below compare."""
    plan = []
    for p in ("fp32", "bf16", "fp16"):
        plan += [(RunConfig(**MLP, precision=p, batch_size=8, label=f"one {p}"), 1),
                 (RunConfig(**MLP, precision=p, batch_size=4, label=f"ddp {p}"), 2),
                 (RunConfig(**MLP, precision=p, batch_size=4, strategy="fsdp2",
                            label=f"fsdp2 {p}"), 2),
                 (RunConfig(**MLP, precision=p, batch_size=4, strategy="fsdp2",
                            fsdp_wrap="blocks-half-params", label=f"fsdp2 half {p}"), 2)]
    plan += [(RunConfig(**RESNET, strategy=s, fsdp_wrap=w, reshard_after_forward=r,
                        label=f"resnet {s} {w} {r}"), 2) for s, w, r in RESNET_WRAPS]
    plan.append((RunConfig(**MLP, precision="fp32", batch_size=4, label="half batch"), 1))
    plan += [(RunConfig(**TINY_TF, precision="bf16", strategy=s, label=f"tf {s}"), 2)
             for s in ("ddp", "ddp_zero", "fsdp2")]
    return D.run_experiments(plan, backend="gloo")


def _params(result, label, world_size):
    return next(r["params"] for r in result.rows
                if r["label"] == label and r["world_size"] == world_size and r["rank"] == 0)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@needs_two
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_ddp_with_amp_matches_one_process_on_the_whole_batch(sweep, precision):
    atol = ATOL[precision]
    one = _params(sweep, f"one {precision}", 1)
    ddp = _params(sweep, f"ddp {precision}", 2)
    assert _max_diff(one, ddp) <= atol
    # The comparison can fail: one process that saw only half the batch ends elsewhere.
    assert _max_diff(_params(sweep, "half batch", 1), ddp) > 20 * atol
    ranks = [r for r in sweep.rows if r["label"] == f"ddp {precision}"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own half


@pytest.mark.slow
@needs_two
@needs_fsdp2_cpu
def test_fsdp2_matches_ddp(sweep):
    # fp32 parameters (the default wrap, autocast casts): DDP's arithmetic, sharded.
    for p in ("fp32", "bf16", "fp16"):
        assert _max_diff(_params(sweep, f"fsdp2 {p}", 2), _params(sweep, f"ddp {p}", 2)) <= ATOL[p]
    # half-precision gathered parameters: the stated loss tolerance.
    for p in ("bf16", "fp16"):
        fsdp = [r for r in sweep.rows if r["label"] == f"fsdp2 half {p}"]
        ddp = [r for r in sweep.rows if r["label"] == f"ddp {p}"]
        for f, d in zip(fsdp, ddp):
            assert f["rank"] == d["rank"]
            for lf, ld in zip(f["losses"], d["losses"]):
                assert math.isfinite(lf) and abs(lf - ld) <= FSDP_LOSS_RTOL * abs(ld)
        summary = sweep.find(f"fsdp2 half {p}", 2)
        assert summary["final_loss"] < fsdp[0]["losses"][0]  # it trains
    tf = sweep.find("tf fsdp2", 2)
    assert all(math.isfinite(v) for r in sweep.rows if r["label"] == "tf fsdp2" for v in r["losses"])
    # FSDP2 shards the parameters too: each rank holds about half of DDP's.
    assert tf["param_mib"] == pytest.approx(sweep.find("tf ddp", 2)["param_mib"] / 2, rel=0.1)


@pytest.mark.slow
@needs_two
@needs_fsdp2_cpu
def test_every_fsdp2_wrap_of_a_resnet_trains_like_ddp(sweep):
    ddp = [r for r in sweep.rows if r["label"] == "resnet ddp blocks True"]
    for s, w, r in RESNET_WRAPS[1:]:
        rows = [x for x in sweep.rows if x["label"] == f"resnet {s} {w} {r}"]
        assert [x["rank"] for x in rows] == [0, 1]
        assert rows[0]["fsdp_units"] == (8 + 1 + (20 if w == "bn-units" else 0))  # resnet18
        for f, d in zip(rows, ddp):
            for lf, ld in zip(f["losses"], d["losses"]):
                assert abs(lf - ld) <= FSDP_LOSS_RTOL * abs(ld), (w, r, f["losses"], d["losses"])
    assert ddp[0]["fsdp_units"] is None


@pytest.mark.slow
@needs_two
def test_zero_shards_the_optimizer_state(sweep):
    ddp = [r for r in sweep.rows if r["label"] == "tf ddp"]
    zero = [r for r in sweep.rows if r["label"] == "tf ddp_zero"]
    full = ddp[0]["optimizer_state_mib"]
    assert all(r["optimizer_state_mib"] == pytest.approx(full) for r in ddp)
    for r in zero:  # ZeRO splits by whole parameters: about half each
        assert 0.3 * full <= r["optimizer_state_mib"] <= 0.7 * full
    assert sum(r["optimizer_state_mib"] for r in zero) == pytest.approx(full, rel=0.02)
    assert all(r["param_mib"] == pytest.approx(ddp[0]["param_mib"]) for r in zero)  # stage 1 only
    assert sweep.find("tf ddp", 2)["efficiency"] is None  # no one-process run of it in the sweep


# Workers below are imported by name in the spawned processes (tests/ is on their sys.path).

def settings_worker(ctx, mismatch):
    D.check_same_settings({"precision": "bf16" if ctx.rank == 0 or not mismatch else "fp16",
                           "batch_size": 4})
    return "agreed"


def failing_worker(ctx):
    if ctx.rank == 1:
        raise RuntimeError("boom on rank 1")
    torch.distributed.barrier()


def inf_on_one_rank_worker(ctx):
    """fp16 FSDP2: an inf in rank 0's gradient shard makes every rank skip the step."""
    from torch.distributed.device_mesh import DeviceMesh
    torch.manual_seed(0)
    config = RunConfig(model="mlp", strategy="fsdp2", precision="fp16", batch_size=4)
    model = D.build_model(config)
    D.fsdp2_shard(model, "fp16", DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu"))
    opt = D.make_optimizer(config, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = D.make_batch(config, model, ctx.rank, ctx.world_size, ctx.device)
    stepped = []
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step == 0 and ctx.rank == 0:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        stepped.append(any(not torch.equal(b, p.to_local())
                           for b, p in zip(before, model.parameters())))
    gathered = [None] * ctx.world_size
    torch.distributed.all_gather_object(gathered, (stepped, scaler.get_scale()))
    return gathered


@pytest.mark.slow
@needs_two
def test_settings_must_agree_across_ranks():
    with pytest.raises(ValueError, match=r"precision \(rank 0: 'bf16', rank 1: 'fp16'\)"):
        D.launch(settings_worker, 2, args=(True,), backend="gloo")


@pytest.mark.slow
@needs_two
def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 failed with RuntimeError: boom on rank 1"):
        D.launch(failing_worker, 2, backend="gloo", timeout_s=120)


@pytest.mark.slow
@needs_two
@needs_fsdp2_cpu
def test_fsdp2_fp16_scaler_skips_on_every_rank_together():
    results = D.launch(inf_on_one_rank_worker, 2, backend="gloo")
    for stepped, scale in results:  # rank 1's own shard was finite, yet it skipped too
        assert stepped == [False, True]
        assert scale == 512.0


@pytest.mark.slow
@needs_two
@needs_fsdp2_cpu
def test_torchrun_runs_the_module():
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "amp_lessons.measure.distributed",
         "--model", "mlp", "--strategy", "fsdp2", "--precision", "bf16", "--backend", "gloo",
         "--steps", "2", "--warmup", "0", "--batch-size", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("mlp fsdp2 bf16") for line in lines) == 3  # 2 ranks + summary


def sleepy_worker(ctx):
    import time
    time.sleep(60)


@pytest.mark.slow
@needs_two
def test_a_launch_past_its_timeout_is_stopped():
    import time
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="timeout_s=3"):
        D.launch(sleepy_worker, 2, backend="gloo", timeout_s=3)
    assert time.monotonic() - started < 40


@pytest.mark.slow
def test_runs_that_cannot_run_here_are_skipped_with_the_reason(monkeypatch):
    # One process, in this one: run_plan's bookkeeping without spawning anything.
    monkeypatch.setattr(D, "_precision_problem",
                        lambda config, device: "no fsdp2 here" if config.strategy == "fsdp2"
                        else None)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{D.free_port()}",
                                         rank=0, world_size=1)
    try:
        ctx = D.RankContext(0, 1, 0, "gloo", torch.device("cpu"))
        out = D.run_plan(ctx, [(RunConfig(model="mlp", strategy="fsdp2", steps=1, warmup=0,
                                          batch_size=4, label="f"), 1),
                               (RunConfig(model="mlp", steps=1, warmup=0, batch_size=4,
                                          label="d"), 1)])
    finally:
        torch.distributed.destroy_process_group()
    result = SweepResult(rows=out["rows"], backend="gloo", launched=1, skipped=out["skipped"],
                         warnings=out["warnings"])
    assert result.ran("d", 1) and not result.ran("f", 1)
    assert result.skipped == [{"label": "f", "world_size": 1, "reason": "no fsdp2 here"}]
    with pytest.raises(KeyError, match="skipped, no fsdp2 here"):
        result.find("f", 1)
    assert "not run: f on 1 process: no fsdp2 here" in result.notes()
    assert result.find("d", 1)["efficiency"] == pytest.approx(1.0)


def test_run_experiments_refuses_two_configs_with_one_label():
    a = D.RunConfig(model="mlp", precision="fp32", batch_size=4, optimizer="sgd")
    b = D.RunConfig(model="mlp", precision="fp32", batch_size=64)
    assert a.name == b.name
    with pytest.raises(ValueError, match="labels must be unique.*'mlp ddp fp32'"):
        D.run_experiments(D.grid([a, b], [1]), backend="gloo")
    with pytest.raises(ValueError, match="twice"):
        D.run_experiments([(a, 1), (a, 1)], backend="gloo")


def test_sweep_summary_never_folds_rows_of_two_runs():
    row = {"label": "x", "model": "mlp", "strategy": "ddp", "precision": "fp32", "world_size": 1,
           "rank": 0, "unit": "sample", "fsdp_wrap": None, "fsdp_units": None, "batch_size": 4,
           "step_ms": 1.0, "peak_gib": None, "param_mib": 1.0, "grad_mib": 1.0,
           "optimizer_state_mib": 1.0, "losses": [1.0], "spread": None, "peak_spread": None,
           "steps": 6, "warmup": 1}
    assert len(D.SweepResult([row], "gloo", 1).summary()) == 1
    with pytest.raises(ValueError, match="batch_size"):
        D.SweepResult([row, dict(row, batch_size=64)], "gloo", 1).summary()
    with pytest.raises(ValueError, match="a rank repeats"):
        D.SweepResult([row, dict(row)], "gloo", 1).summary()


@pytest.mark.parametrize("model", ["small_cnn", "resnet18"])
def test_make_batch_follows_the_models_input_channels(model):
    config = D.RunConfig(model=model, precision="fp32", image_size=16,
                                   model_kwargs={"in_channels": 1})
    net = D.build_model(config)
    x, y = D.make_batch(config, net, 0, 1, "cpu")
    assert x.shape == (8, 1, 16, 16)
    net(x)  # the worker's forward no longer fails on 3-channel images
    three = D.RunConfig(model=model, precision="fp32", image_size=16)
    x3, _ = D.make_batch(three, D.build_model(three), 0, 1, "cpu")
    assert torch.equal(x3, data.synthetic_images(8, 16, 10, "cpu")[0])  # unchanged


def test_runconfig_reads_precision_names_as_the_package_does_and_checks_its_label():
    assert D.RunConfig(precision="AMP").precision == "fp16"
    assert D.RunConfig(precision=" bf16 ").precision == "bf16"
    for label in (5, ["x"]):
        with pytest.raises(ValueError, match="label must be a string"):
            D.RunConfig(label=label)
    with pytest.raises(ValueError, match="precision must be one of"):
        D.RunConfig(precision="fp64")
