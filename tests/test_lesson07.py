"""Lesson 07 on the CPU: FP8 numerics and scaling, the FP8-support line, the speed sweep's rows
where FP8 cannot run, the standard-library corpus, GPT training and its comparison, the module
filter and the figures. torchao-specific tests run only where torchao is installed."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from amp_lessons.lessons import l07_fp8 as L
from amp_lessons.ui import fp8_plots as U

HAS_TORCHAO = L.torchao_version() is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed")
CPU = L.FP8Support("cpu", "CPU", None, None, L.support_reason("cpu", None, None))
TINY_GPT = dict(d_model=32, n_layers=2, n_heads=2, seq_len=16)


# --- support -----------------------------------------------------------------------------------

def test_support_reason_names_every_missing_piece():
    assert L.support_reason("cuda", (9, 0), "0.18.0") == ""
    assert L.support_reason("cuda", (8, 9), "0.18.0") == ""
    assert "8.0 is below 8.9" in L.support_reason("cuda", (8, 0), "0.18.0")
    assert "7.5 is below 8.9" in L.support_reason("cuda", (7, 5), "0.18.0")
    both = L.support_reason("cpu", None, None)
    assert "no CUDA GPU" in both and "torchao not installed" in both
    assert L.support_reason("cuda", (9, 0), None) == f"torchao not installed ({L.INSTALL_HINT})"
    with pytest.raises(ValueError, match="device_type"):
        L.support_reason("tpu", None, None)


def test_fp8_support_properties_and_line():
    h200 = L.FP8Support("cuda", "NVIDIA H200", (9, 0), "0.18.0", "")
    assert h200.tensor_cores and h200.available and h200.can_emulate
    assert h200.line().startswith("FP8 runs here: NVIDIA H200 (compute capability 9.0)")
    a100 = L.FP8Support("cuda", "A100", (8, 0), "0.18.0", L.support_reason("cuda", (8, 0), "0.18.0"))
    assert not a100.available and a100.can_emulate and not a100.tensor_cores
    assert not CPU.available and not CPU.can_emulate
    line = CPU.line()
    assert line.startswith("FP8 matmuls do not run here: no CUDA GPU") and "\n" not in line


def test_fp8_support_probes_this_machine():
    support = L.fp8_support("cpu")
    assert support.device_type == "cpu" and not support.available
    assert ("torchao not installed" in support.reason) == (not HAS_TORCHAO)
    assert support.torchao == L.torchao_version()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            L.fp8_support("cuda")


# --- numerics ----------------------------------------------------------------------------------

def test_format_facts_match_the_formats():
    facts = {r["format"]: r for r in L.format_facts()}
    assert facts["e4m3"]["largest"] == 448 and facts["e5m2"]["largest"] == 57344
    assert facts["e4m3"]["smallest normal"] == 2.0 ** -6
    assert facts["e4m3"]["smallest subnormal"] == 2.0 ** -9
    assert facts["e5m2"]["smallest subnormal"] == 2.0 ** -16
    assert facts["e4m3"]["step at 1.0"] == 0.125 and facts["e5m2"]["step at 1.0"] == 0.25
    assert facts["bf16"]["mantissa bits"] == 7
    assert L.fp8_max("e4m3") == 448 and L.fp8_max("e5m2") == 57344
    with pytest.raises(ValueError, match="fmt"):
        L.fp8_max("e3m4")


def test_amax_scale_per_tensor_per_row_and_power_of_two():
    x = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    assert float(L.amax_scale(x, "e4m3", "tensorwise")) == pytest.approx(448 / 2)
    rows = L.amax_scale(x, "e4m3", "rowwise")
    assert rows.shape == (2, 1)
    assert rows.flatten().tolist() == pytest.approx([224.0, 896.0])
    assert float(L.amax_scale(x, "e4m3", "none")) == 1.0
    p2 = L.amax_scale(torch.tensor([3.0]), "e4m3", "tensorwise", power_of_2=True)
    assert float(p2) == 128.0  # 448 / 3 = 149.3, rounded down to a power of two
    assert torch.isfinite(L.amax_scale(torch.zeros(3), "e5m2")).all()
    with pytest.raises(ValueError, match="granularity"):
        L.amax_scale(x, "e4m3", "blockwise")


def test_to_fp8_saturates_instead_of_nan_and_round_trips():
    x = torch.tensor([1000.0, -1.0, 0.5])
    y, scale = L.to_fp8(x, "e4m3", "none")
    assert y.dtype == torch.float8_e4m3fn
    back = L.from_fp8(y, scale)
    assert back.tolist() == [448.0, -1.0, 0.5]  # saturated, not NaN
    y, scale = L.to_fp8(x, "e4m3", "tensorwise")
    assert L.from_fp8(y, scale)[0] == pytest.approx(1000.0)
    assert L.fake_quantize(x, "e5m2", "tensorwise").dtype == torch.float32
    with pytest.raises(ValueError, match="x_fp8"):
        L.from_fp8(x, scale)


def test_quantization_error_sees_underflow_and_scaling_removes_it():
    tiny = torch.full((4, 8), 1e-4)
    tiny[0, 0] = 2e-4
    unscaled = L.quantization_error(tiny, "e4m3", "none")
    assert unscaled["underflow"] == 1.0 and unscaled["rel_error"] == pytest.approx(1.0)
    scaled = L.quantization_error(tiny, "e4m3", "tensorwise")
    assert scaled["underflow"] == 0.0 and scaled["rel_error"] < 0.07
    assert L.quantization_error(torch.tensor([1000.0]), "e4m3", "none")["saturated"] == 1.0
    with pytest.raises(ValueError, match="finite"):
        L.quantization_error(torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="non-empty"):
        L.quantization_error(torch.tensor([]))


def test_scaling_walkthrough_shows_per_row_keeping_the_small_row():
    walk = L.scaling_walkthrough()
    assert walk["amax"] == 1700 and walk["tensor_scale"] == pytest.approx(448 / 1700)
    assert walk["row_scales"][1] == pytest.approx(448 / 1700)
    small = walk["rows"][2]  # 0.0007
    assert small["value"] == pytest.approx(7e-4)
    assert small["no scale"] == 0 and small["one scale"] == 0
    assert small["scale per row"] == pytest.approx(7e-4, rel=0.07)
    outlier = walk["rows"][7]
    assert outlier["no scale"] == 448 and outlier["one scale"] == pytest.approx(1700)
    with pytest.raises(ValueError, match="2-d"):
        L.scaling_walkthrough(torch.ones(3))


@pytest.fixture(scope="module")
def digits_tensors():
    return L.digits_tensors(seed=0, epochs=1)


def test_digits_tensors_capture_activation_weight_and_gradient(digits_tensors):
    assert list(digits_tensors) == ["net.0", "net.2", "net.4"]
    first = digits_tensors["net.0"]
    assert first["activation"].shape == (64, 64) and first["weight"].shape == (256, 64)
    assert first["gradient"].shape == (64, 256)
    assert float(first["gradient"].abs().max()) < 0.1  # gradients of a mean loss are small
    with pytest.raises(ValueError, match="epochs"):
        L.digits_tensors(epochs=-1)


def test_error_table_and_summary(digits_tensors):
    rows = L.error_table(digits_tensors)
    assert len(rows) == 3 * 3 * 2 * 3
    summary = {(r["tensor"], r["format"], r["scaling"]): r for r in L.error_summary(rows)}
    assert len(summary) == 3 * 2 * 3
    assert summary[("gradient", "e4m3", "none")]["underflow"] > 0.5
    assert summary[("gradient", "e4m3", "tensorwise")]["underflow"] < 0.05
    assert summary[("weight", "e4m3", "rowwise")]["rel_error"] < summary[("weight", "e5m2", "rowwise")]["rel_error"]
    with pytest.raises(ValueError, match="formats"):
        L.error_table(digits_tensors, formats=("fp4",))
    with pytest.raises(ValueError, match="tensors"):
        L.error_table({})
    with pytest.raises(ValueError, match="rows"):
        L.error_summary([])


# --- speed -------------------------------------------------------------------------------------

def test_mlp_stack_shape_and_checks():
    model = L.mlp_stack(32, blocks=2)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 4 and all(m.bias is None for m in linears)
    assert linears[0].weight.shape == (128, 32)
    assert model(torch.randn(3, 32)).shape == (3, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        L.mlp_stack(40)
    with pytest.raises(ValueError, match="blocks"):
        L.mlp_stack(32, blocks=0)


def test_time_recipe_on_the_cpu():
    row = L.time_recipe("bf16", 32, tokens=64, blocks=1, steps=2, warmup=1, compile=False)
    assert row["status"] == "measured" and row["step_ms"] > 0 and row["peak_gib"] is None
    assert row["params"] == 2 * 4 * 32 * 32 and math.isfinite(row["loss"])
    assert row["spread_pct"] >= 0 and row["first_step_s"] > 0
    with pytest.raises(ValueError, match="recipe"):
        L.time_recipe("fp16", 32)
    with pytest.raises(ValueError, match="steps"):
        L.time_recipe("bf16", 32, steps=0)


def test_speed_sweep_marks_rows_not_measured_with_the_reason():
    rows = L.speed_sweep((32, 64), support=CPU)
    assert len(rows) == 6
    assert all(r["status"] == f"not measured: {CPU.reason}" and r["step_ms"] is None for r in rows)
    assert L.speedup(rows, 32) is None and L.smallest_paying_width(rows) is None
    with pytest.raises(ValueError, match="widths"):
        L.speed_sweep((), support=CPU)
    with pytest.raises(ValueError, match="recipes"):
        L.speed_sweep((32,), recipes=("fp8",), support=CPU)


def test_speed_sweep_measures_and_reports_failures_as_rows():
    fake = L.FP8Support("cuda", "fake", (9, 0), "0.18.0", "")  # pretend, to reach the timing code
    rows = L.speed_sweep((32,), recipes=("bf16", "tensorwise"), tokens=32, blocks=1, steps=1,
                         warmup=1, support=fake, device="cpu", compile=False)
    bf16, fp8 = rows
    assert bf16["status"] == "measured" and bf16["speedup"] == pytest.approx(1.0)
    if HAS_TORCHAO:  # torchao's FP8 GEMM does not run on the CPU: the failure is a row
        assert fp8["status"] == "measured" or fp8["status"].startswith("not measured: ")
    else:
        assert fp8["status"] == f"not measured: RuntimeError: torchao not installed ({L.INSTALL_HINT})"


def test_speedup_and_smallest_paying_width():
    rows = [{"width": w, "recipe": r, "speedup": s} for w, r, s in [
        (1024, "bf16", 1.0), (1024, "tensorwise", 0.9), (2048, "tensorwise", 1.2),
        (4096, "tensorwise", 1.04), (8192, "tensorwise", 1.5), (1024, "rowwise", 1.1),
        (2048, "rowwise", 1.1)]]
    assert L.speedup(rows, 2048) == 1.2 and L.speedup(rows, 512) is None
    assert L.smallest_paying_width(rows) == 8192  # 4096 dips under 1.05 again
    assert L.smallest_paying_width(rows, at_least=1.0) == 2048
    assert L.smallest_paying_width(rows, "rowwise") == 1024
    with pytest.raises(ValueError, match="at_least"):
        L.smallest_paying_width(rows, at_least=0)


# --- accuracy ----------------------------------------------------------------------------------

@pytest.fixture
def source_tree(tmp_path: Path) -> Path:
    for rel, text in [("b.py", "b = 2\n" * 300), ("a.py", "a = 1\n" * 300),
                      ("pkg/c.py", "c = 3\n" * 300), ("pkg/notes.txt", "skip"),
                      ("site-packages/x.py", "skip"), ("__pycache__/y.py", "skip"),
                      ("z.py", "z = 0\n" * 300)]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_stdlib_files_sorted_without_site_packages(source_tree):
    names = [p.relative_to(source_tree).as_posix() for p in L.stdlib_files(source_tree)]
    assert names == ["a.py", "b.py", "pkg/c.py", "z.py"]
    real = L.stdlib_files()
    assert real and all(p.suffix == ".py" for p in real)
    assert not any("site-packages" in p.parts for p in real)
    with pytest.raises(ValueError, match="root"):
        L.stdlib_files(source_tree / "missing")


def test_stdlib_corpus_splits_by_file(source_tree):
    corpus = L.stdlib_corpus(val_every=2, root=source_tree)
    assert corpus.files == 4 and corpus.train.dtype == torch.uint8
    assert bytes(corpus.val.tolist()).startswith(b"a = 1")    # files 0 and 2 held out
    assert b"pkg" not in bytes(corpus.train.tolist()) and b"b = 2" in bytes(corpus.train.tolist())
    assert "4 .py files" in corpus.describe()
    capped = L.stdlib_corpus(max_bytes=4096)
    assert len(capped.train) == 4096
    with pytest.raises(ValueError, match="max_bytes"):
        L.stdlib_corpus(max_bytes=10)
    with pytest.raises(ValueError, match="val_every"):
        L.stdlib_corpus(val_every=1, root=source_tree)


def test_batches_are_fixed_by_the_seed():
    a = L.batch_offsets(1000, 16, 4, 3, seed=1)
    assert a.shape == (3, 4) and torch.equal(a, L.batch_offsets(1000, 16, 4, 3, seed=1))
    assert not torch.equal(a, L.batch_offsets(1000, 16, 4, 3, seed=2))
    text = torch.arange(100, dtype=torch.uint8)
    x, y = L.text_batch(text, torch.tensor([0, 10]), 5)
    assert x.tolist()[1] == [10, 11, 12, 13, 14] and y.tolist()[1] == [11, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="n must exceed"):
        L.batch_offsets(10, 16, 1, 1, 0)


@pytest.fixture(scope="module")
def corpus():
    return L.stdlib_corpus(max_bytes=60_000)


def test_train_gpt_learns_and_repeats(corpus):
    kw = dict(steps=12, batch_size=4, model_kwargs=TINY_GPT, warmup_steps=2, eval_batches=1)
    run = L.train_gpt(corpus, "bf16", seed=3, **kw)
    assert run["status"] == "trained" and run["finite"] and len(run["losses"]) == 12
    assert run["final_loss"] < run["losses"][0] and math.isfinite(run["val_loss"])
    assert run["label"] == "bf16, seed 3" and run["float8_layers"] == 0
    again = L.train_gpt(corpus, "bf16", seed=3, **kw)
    assert again["losses"] == run["losses"]
    fp32 = L.train_gpt(corpus, "bf16", seed=3, amp_dtype=None, **kw)
    assert fp32["label"] == "fp32, seed 3"
    with pytest.raises(ValueError, match="recipe"):
        L.train_gpt(corpus, "fp16", **kw)


def test_train_gpt_compiles_each_block_for_training_only(corpus, monkeypatch):
    """compile=True compiles every block on its own (static shapes), trains exactly as eager would
    (the stand-in compiler changes nothing), puts the plain blocks back before the held-out loss
    (the stand-in refuses to run without gradients) and resets dynamo's caches afterwards."""
    calls, resets = [], []

    class TrainOnly(nn.Module):  # stands in for torch.compile's wrapper
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            assert torch.is_grad_enabled(), "a compiled block ran for the held-out loss"
            return self.block(x)

    def fake_compile(module, **kwargs):
        calls.append(kwargs)
        return TrainOnly(module)

    kw = dict(steps=6, batch_size=4, model_kwargs=TINY_GPT, warmup_steps=1, eval_batches=1)
    eager = L.train_gpt(corpus, "bf16", seed=5, **kw)
    monkeypatch.setattr(L.torch, "compile", fake_compile)
    monkeypatch.setattr(L.torch._dynamo, "reset", lambda: resets.append(1))
    compiled = L.train_gpt(corpus, "bf16", seed=5, compile=True, **kw)
    assert calls == [{"dynamic": False}] * TINY_GPT["n_layers"] and resets == [1]
    assert compiled["losses"] == eager["losses"] and compiled["val_loss"] == eager["val_loss"]
    assert compiled["compiled"] and not eager["compiled"]
    assert compiled["first_step_s"] > 0 and compiled["ms_per_step"] > 0


def test_evaluate_uses_fixed_batches(corpus):
    torch.manual_seed(0)
    model = L._models.TinyTransformer(**TINY_GPT)
    assert L.evaluate(model, corpus.val, 16, 2, 2) == L.evaluate(model, corpus.val, 16, 2, 2)
    with pytest.raises(ValueError, match="batches"):
        L.evaluate(model, corpus.val, 16, 2, 0)


def test_accuracy_runs_without_fp8_show_why(corpus):
    runs = L.accuracy_runs(corpus, (0, 1), ("tensorwise",), support=CPU, steps=4, batch_size=2,
                           model_kwargs=TINY_GPT, warmup_steps=1, eval_batches=1)
    assert [r["label"] for r in runs] == ["bf16, seed 0", "bf16, seed 1", "float8 tensorwise, seed 0"]
    assert runs[2]["status"] == f"not run: {CPU.reason}"
    table = L.accuracy_table(runs)
    assert table[2]["final loss"] is None and table[0]["steps"] == 4
    cmp = L.loss_comparison(runs, min_steps=2)
    assert not cmp["decided"] and "FP8 not run" in cmp["reason"]
    with pytest.raises(ValueError, match="seeds"):
        L.accuracy_runs(corpus, (), support=CPU)


@needs_torchao
def test_accuracy_runs_emulate_fp8_where_torchao_is_installed(corpus):
    support = L.fp8_support("cpu")
    runs = L.accuracy_runs(corpus, (0,), ("tensorwise",), support=support, steps=4, batch_size=2,
                           model_kwargs=TINY_GPT, warmup_steps=1, eval_batches=1)
    fp8 = runs[1]
    assert fp8["status"] == "trained" and fp8["emulated"] and fp8["float8_layers"] == 7
    assert fp8["label"] == "float8 tensorwise (emulated), seed 0"
    assert abs(fp8["final_loss"] - runs[0]["final_loss"]) < 0.1


def _run(recipe, seed, final, steps=2000, status="trained"):
    return {"label": f"{recipe}, seed {seed}", "recipe": recipe, "seed": seed, "steps": steps,
            "final_loss": final, "status": status, "losses": [final + 1, final]}


def test_loss_comparison_within_outside_and_not_decided():
    runs = [_run("bf16", 0, 1.50), _run("bf16", 1, 1.52), _run("bf16", 2, 1.49),
            _run("tensorwise", 0, 1.51), _run("rowwise", 0, 1.56)]
    cmp = L.loss_comparison(runs)
    assert cmp["decided"] and cmp["spread"] == pytest.approx(0.03)
    tw, rw = cmp["rows"]
    assert tw["difference"] == pytest.approx(0.01) and tw["within"]
    assert rw["difference"] == pytest.approx(0.06) and rw["within"] is False
    short = L.loss_comparison([_run("bf16", 0, 1.5, 50), _run("bf16", 1, 1.6, 50),
                               _run("tensorwise", 0, 1.5, 50)])
    assert not short["decided"] and "50 steps are too few" in short["reason"]
    single = L.loss_comparison([_run("bf16", 0, 1.5), _run("tensorwise", 0, 1.5)])
    assert not single["decided"] and "fewer than two bf16 seeds" in single["reason"]
    with pytest.raises(ValueError, match="min_steps"):
        L.loss_comparison(runs, min_steps=0)


# --- what not to convert -----------------------------------------------------------------------

def test_conversion_plan_reasons():
    model = nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 1000),
                          nn.Linear(1000, 4096), nn.Linear(4096, 512), nn.Linear(512, 10))
    plan = {r["layer"]: r for r in L.conversion_plan(model, min_features=1024)}
    assert plan["0"]["precision"] == "bf16" and plan["0"]["reason"].startswith("first layer")
    assert plan["5"]["precision"] == "bf16" and plan["5"]["reason"].startswith("last layer")
    assert plan["1"]["precision"] == "float8"
    assert "not divisible by 16" in plan["2"]["reason"] and "not divisible by 16" in plan["3"]["reason"]
    assert plan["4"]["reason"].startswith("small: 512 < 1,024")
    keep_all_edges = L.conversion_plan(model, min_features=1, keep_first=False, keep_last=False)
    assert keep_all_edges[0]["precision"] == "float8"
    chosen = L.module_filter(L.conversion_plan(model, 1024))
    assert chosen(model[1], "1") and not chosen(model[0], "0")
    with pytest.raises(ValueError, match="min_features"):
        L.conversion_plan(model, min_features=0)


def test_example_transformer_is_on_meta_and_planned():
    big = L.example_transformer(d_model=2048, n_layers=2)
    assert next(big.parameters()).device.type == "meta"
    plan = L.plan_table(big, 2048)
    rows = {r["layer"]: r for r in plan}
    assert rows["head"]["precision"] == "bf16" and rows["head"]["out"] == 50257
    assert rows["blocks.1.mlp.0"]["precision"] == "float8"
    if HAS_TORCHAO:
        assert rows["blocks.1.mlp.0"]["converted by torchao"] == "yes"
        assert rows["head"]["converted by torchao"] == "no"
        assert rows["blocks.0.qkv"]["torchao auto filter"] == "float8"
    else:
        assert rows["head"]["converted by torchao"] == "-" and L.torchao_auto_filter() is None
    with pytest.raises(ValueError, match="d_model"):
        L.example_transformer(d_model=8)


def test_float8_api_without_torchao_names_the_fix():
    if HAS_TORCHAO:
        pytest.skip("torchao is installed")
    with pytest.raises(RuntimeError, match="torchao not installed"):
        L.convert_to_float8(L.mlp_stack(32), "tensorwise")
    with pytest.raises(RuntimeError, match="torchao not installed"):
        L.float8_config("rowwise")


@needs_torchao
def test_convert_to_float8_swaps_the_filtered_layers():
    model = L.mlp_stack(32, blocks=2)
    plan = L.conversion_plan(model, min_features=16)
    L.convert_to_float8(model, "rowwise", L.module_filter(plan), emulate=True)
    assert L.float8_layers(model) == ["0.2", "1.0"]
    assert L.float8_config("tensorwise", emulate=True).emulate
    with pytest.raises(ValueError, match="recipe"):
        L.float8_config("bf16")


# --- findings, tables, figures -----------------------------------------------------------------

def _speed_rows():
    rows = []
    for w, ms in [(1024, (2.0, 2.2, 2.5)), (4096, (84.7, 58.3, 66.6))]:
        for recipe, m in zip(L.RECIPES, ms):
            rows.append({"width": w, "recipe": recipe, "step_ms": m, "speedup": ms[0] / m,
                         "peak_gib": 10.0, "tflops": 1.0, "status": "measured", "spread": 0.02})
    return rows


def test_findings_state_measurements_and_what_is_not_decided():
    h200 = L.FP8Support("cuda", "NVIDIA H200", (9, 0), "0.18.0", "")
    runs = [_run("bf16", 0, 1.50), _run("bf16", 1, 1.52), _run("tensorwise", 0, 1.56)]
    lines = L.findings(h200, _speed_rows(), L.loss_comparison(runs), width=4096)
    text = "\n".join(lines)
    assert "1.45x at 4,096" in text and "0.91x at 1,024" in text
    assert "Peak memory at width 4,096: bf16 10.0 GiB" in text
    assert "outside, by 0.0400, that spread" in text and "Not decided" not in text
    cpu_lines = L.findings(CPU, L.speed_sweep((32,), support=CPU),
                           L.loss_comparison([_run("bf16", 0, 1.5, 20), _run("bf16", 1, 1.6, 20)]))
    assert cpu_lines[1] == f"Speed: not measured: {CPU.reason}."
    assert cpu_lines[-1].startswith("Not decided here whether FP8 trains as well as bf16")


# --- what the lesson publishes ----------------------------------------------------------------

H200 = L.FP8Support("cuda", "NVIDIA H200", (9, 0), "0.18.0", "")


def _numbers(row, keep=("width", "recipe", "run", "steps", "status")):
    return {k: v for k, v in row.items() if k not in keep and v is not None}


def test_speed_report_rows_measured_and_not():
    rows = L.speed_report_rows(_speed_rows())
    assert [list(r) for r in rows] == [list(L.SPEED_REPORT_COLUMNS)] * len(rows)
    tw = next(r for r in rows if r["width"] == 4096 and r["recipe"] == "tensorwise")
    assert tw == {"width": 4096, "recipe": "tensorwise", "step ms": 58.3,
                  "speed-up over bf16": 1.45, "peak GiB": 10.0, "repeat spread %": 2.0,
                  "status": "measured"}
    cpu = L.speed_report_rows(L.speed_sweep((32, 64), support=CPU))
    assert len(cpu) == 6 and all(not _numbers(r) for r in cpu)
    assert all(r["status"] == f"not measured: {CPU.reason}" for r in cpu)
    odd = L.speed_report_rows([{"width": 8192, "recipe": "rowwise", "step_ms": 3.0, "speedup": 1.0,
                                "peak_gib": 1.0, "status": "failed"},
                               {"width": 8192, "recipe": "bf16", "step_ms": None,
                                "status": "not measured: out of memory"}])
    assert [r["status"] for r in odd] == ["not measured: failed", "not measured: out of memory"]
    assert all(not _numbers(r) for r in odd)  # a number is never shown beside "not measured"
    with pytest.raises(ValueError, match="rows"):
        L.speed_report_rows([])


def test_a_noisy_speed_row_says_so_and_decides_no_crossover():
    """Every timed row carries its repeat spread; where its own repeats or those of the bf16 row
    of its width differ by over 10%, its status says so and the crossover leaves it out."""
    rows = _speed_rows()
    assert L.smallest_paying_width(rows) == 4096
    noisy_base = [dict(r, spread=0.3) if (r["width"], r["recipe"]) == (4096, "bf16") else r
                  for r in rows]
    shown = {(r["width"], r["recipe"]): r for r in L.speed_report_rows(noisy_base)}
    assert shown[(4096, "bf16")]["repeat spread %"] == 30.0
    assert shown[(4096, "bf16")]["status"].startswith("measured (noisy: repeats differ by 30%")
    assert shown[(4096, "tensorwise")]["status"].startswith("measured (bf16 at this width: noisy")
    assert shown[(1024, "tensorwise")]["status"] == "measured"
    assert L.smallest_paying_width(noisy_base) is None  # 4096's speed-up decides nothing


def test_accuracy_report_rows_decided_not_decided_and_not_run():
    runs = [dict(_run("bf16", 0, 1.50), val_loss=1.6), dict(_run("bf16", 1, 1.52), val_loss=1.61),
            dict(_run("bf16", 2, 1.49), val_loss=1.59),
            dict(_run("tensorwise", 0, 1.51), val_loss=1.6)]
    rows = L.accuracy_report_rows(runs, L.loss_comparison(runs), H200)
    assert [list(r) for r in rows] == [list(L.ACCURACY_REPORT_COLUMNS)] * 4
    assert rows[0]["final loss"] == "1.5000" and rows[0]["FP8 minus bf16 (same seed)"] is None
    fp8 = rows[3]
    assert fp8["FP8 minus bf16 (same seed)"] == "+0.0100" and fp8["bf16 seed spread"] == "0.0300"
    assert fp8["within the spread"] is True and fp8["status"] == "measured"
    assert fp8["held-out loss"] == "1.6000"
    # on the CPU (no FP8 tensor cores, no torchao): every row says why, with no number
    cpu_runs = runs[:2] + [{"label": "float8 tensorwise, seed 0", "recipe": "tensorwise",
                            "seed": 0, "steps": 2000, "status": f"not run: {CPU.reason}"}]
    cpu = L.accuracy_report_rows(cpu_runs, L.loss_comparison(cpu_runs), CPU)
    # the bf16 seeds trained: measured, shown with their losses, but not compared here
    assert [r["final loss"] for r in cpu[:2]] == ["1.5000", "1.5200"]
    assert cpu[0]["held-out loss"] == "1.6000"
    assert all(r["status"] == f"measured, not compared: {CPU.reason}" for r in cpu[:2])
    assert all(r["FP8 minus bf16 (same seed)"] is None for r in cpu[:2])
    # the FP8 run did not train: not measured, no number
    assert not _numbers(cpu[2]) and cpu[2]["status"] == f"not measured: not run: {CPU.reason}"
    # FP8 tensor cores, but too few steps to compare: losses shown, the comparison's reason
    short = [dict(r, steps=20) for r in runs]
    rows = L.accuracy_report_rows(short, L.loss_comparison(short), H200)
    assert all(r["final loss"] is not None and r["within the spread"] is None for r in rows)
    assert all(r["status"].startswith("measured, not compared: ") for r in rows)
    assert all("20 steps are too few" in r["status"] for r in rows)
    with pytest.raises(ValueError, match="runs"):
        L.accuracy_report_rows([], {}, H200)


def test_published_rows_make_a_result_bundle():
    from amp_lessons.publish import report
    for key, rows, columns in [
            ("lesson07.speed", L.speed_report_rows(_speed_rows()), L.SPEED_REPORT_COLUMNS),
            ("lesson07.accuracy", L.accuracy_report_rows(
                [_run("bf16", 0, 1.5), _run("bf16", 1, 1.6)],
                L.loss_comparison([_run("bf16", 0, 1.5), _run("bf16", 1, 1.6)]), CPU),
             L.ACCURACY_REPORT_COLUMNS)]:
        bundle = report.result_bundle(key, rows, "title", columns=columns)
        assert bundle[report.RESULT_MIME]["rows"] == rows
        assert bundle[report.RESULT_MIME]["columns"] == list(columns)


def test_format_rows_aligns_and_formats():
    text = L.format_rows([{"name": "a", "x": 1234.5, "n": 3, "none": None},
                          {"name": "bb", "x": 0.0001234, "n": 10, "none": None}])
    lines = text.splitlines()
    assert lines[0].split() == ["name", "x", "n", "none"]
    assert "1,234" in lines[2] and "0.000123" in lines[3] and lines[3].rstrip().endswith("-")
    assert len({len(l) for l in lines[:2]}) == 1
    with pytest.raises(ValueError, match="rows"):
        L.format_rows([])


def _titles(fig):
    return fig.layout.title.text, [a.title.text for a in (fig.layout.xaxis, fig.layout.yaxis)]


def test_error_figure(digits_tensors):
    fig = U.error_figure(L.error_table(digits_tensors))
    title, (x, y) = _titles(fig)
    assert "FP8" in title and "tensor" in x and "%" in y
    assert len(fig.data) == 6 and fig.layout.yaxis.type == "log"
    with pytest.raises(ValueError, match="rows"):
        U.error_figure([])


def test_speed_figure_measured_and_not():
    fig = U.speed_figure(_speed_rows())
    title, (x, y) = _titles(fig)
    assert "speed-up" in title and "width" in x and "(x" in y
    assert [t.name for t in fig.data] == ["float8 tensorwise", "float8 rowwise"]
    empty = U.speed_figure(L.speed_sweep((32,), support=CPU))
    assert not empty.data and "not measured" in empty.layout.annotations[-1].text
    with pytest.raises(ValueError, match="rows"):
        U.speed_figure([])


def test_loss_comparison_never_decides_on_a_diverged_or_unpaired_run():
    nan = float("nan")
    runs = [_run("bf16", 0, 1.50), _run("bf16", 1, nan), _run("bf16", 2, 1.49),
            _run("tensorwise", 0, 1.55)]
    cmp = L.loss_comparison(runs)
    assert not cmp["decided"] and "not finite" in cmp["reason"] and cmp["bf16_final"] == [1.50, 1.49]
    unpaired = [_run("bf16", 1, 1.50), _run("bf16", 2, 1.52), _run("tensorwise", 0, 1.51)]
    cmp = L.loss_comparison(unpaired)
    assert not cmp["decided"] and "same seed" in cmp["reason"]
    short_fp8 = [_run("bf16", 0, 1.50), _run("bf16", 1, 1.52), _run("tensorwise", 0, 1.51, steps=3)]
    cmp = L.loss_comparison(short_fp8)
    assert not cmp["decided"] and "3 steps" in cmp["reason"]
    fp8_nan = [_run("bf16", 0, 1.50), _run("bf16", 1, 1.52), _run("tensorwise", 0, nan)]
    assert not L.loss_comparison(fp8_nan)["decided"]


def test_loss_figure():
    runs = [dict(_run("bf16", s, 1.5 + s / 100), losses=[3.0, 2.0, 1.5 + s / 100]) for s in range(2)]
    runs.append(dict(_run("tensorwise", 0, 1.51), losses=[3.0, 2.1, 1.51]))
    runs.append({"label": "float8 rowwise, seed 0", "recipe": "rowwise", "seed": 0,
                 "status": "not run: no torchao"})
    fig = U.loss_figure(runs, smooth=1)
    assert "bf16 against FP8" in fig.layout.title.text
    assert fig.layout.xaxis.title.text == "optimizer step (count)" and "nats" in fig.layout.yaxis.title.text
    assert "nats" in fig.layout.yaxis2.title.text
    names = [t.name for t in fig.data]
    assert "tensorwise, seed 0 minus bf16" in names and len(names) == 5
    with pytest.raises(ValueError, match="trained"):
        U.loss_figure(runs[3:])


def test_loss_figure_names_an_fp32_baseline():
    """On a GPU without bf16 (a T4) the baseline trains in fp32, and the figure says so."""
    runs = [dict(_run("bf16", s, 1.5 + s / 100), label=f"fp32, seed {s}",
                 losses=[3.0, 2.0, 1.5 + s / 100]) for s in range(2)]
    runs.append(dict(_run("tensorwise", 0, 1.51), losses=[3.0, 2.1, 1.51]))
    fig = U.loss_figure(runs, smooth=1)
    assert "fp32 against FP8" in fig.layout.title.text and "bf16" not in fig.layout.title.text
    names = [t.name for t in fig.data]
    assert any(n.endswith("minus fp32") for n in names)
    assert not any("bf16" in (n or "") for n in names)


def test_fp8_support_follows_the_simulated_card(monkeypatch):
    """An H200 simulated as a T4 reports capability 7.5: no FP8 tensor cores (runs on a CPU:
    the GPU calls are stood in for)."""
    import types
    from amp_lessons import env as E
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(name="NVIDIA H200"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv(E.SIMULATE_VARIABLE, raising=False)
    real = L.fp8_support("cuda")
    assert real.capability == (9, 0) and real.tensor_cores and real.device_name == "NVIDIA H200"
    monkeypatch.setenv(E.SIMULATE_VARIABLE, "t4")
    support = L.fp8_support("cuda")
    assert support.capability == (7, 5) and not support.tensor_cores and not support.available
    assert support.device_name == "Tesla T4 (simulated on NVIDIA H200)"
    assert "7.5 is below 8.9" in support.reason


def test_install_hint_names_the_extra_that_exists():
    """The hint a learner sees without torchao names what pyproject.toml's extra installs, and a
    Makefile target that exists; nothing points at a package index the course is not on."""
    import tomllib

    root = Path(L.__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["torchao"] == [L.TORCHAO_REQUIREMENT] and extras["fp8"] == extras["torchao"]
    assert "\ntorchao:" in (root / "Makefile").read_text() and "make torchao" in L.INSTALL_HINT
    assert "amp-lessons[" not in L.INSTALL_HINT


def test_show_rows_shows_an_html_table_in_the_lessons_number_style(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    L.show_rows([{"run": "bf16, seed 0", "final_loss": 1.23456, "steps": 2000}], title="runs")
    (bundle,) = shown
    assert "<td style=\"text-align: right\">1.235</td>" in bundle["text/html"]
    assert bundle["text/plain"].splitlines()[0] == "runs" and "2,000" in bundle["text/plain"]
    with pytest.raises(ValueError, match="rows"):
        L.show_rows([])


def test_lesson07_figures_wear_the_course_template():
    """Lesson 07's figures use the template and title placement of every other lesson's, and
    the loss figure's legend sits below its two panels (beside them it took a third of the
    width)."""
    from amp_lessons.ui import fp8_plots
    from amp_lessons.ui import plots

    speed = fp8_plots.speed_figure([{"width": 1024, "recipe": "tensorwise", "speedup": 1.2,
                                     "step_ms": 5.0, "peak_gib": 1.0}])
    runs = [{"status": "trained", "label": f"bf16, seed {s}", "recipe": "bf16", "seed": s,
             "losses": [3.0 - 0.01 * i for i in range(100)]} for s in (0, 1)]
    runs.append({"status": "trained", "label": "float8 tensorwise, seed 0",
                 "recipe": "tensorwise", "seed": 0, "losses": [3.0 - 0.011 * i for i in range(100)]})
    loss = fp8_plots.loss_figure(runs)
    for fig in (speed, loss):
        assert fig.layout.template.layout.to_plotly_json() == \
            plots.go.Figure(layout=dict(template=plots.TEMPLATE)).layout.template.layout.to_plotly_json()
        assert fig.layout.title.x == 0.01
    assert loss.layout.legend.orientation == "h" and loss.layout.legend.y < 0


def test_scaling_walkthrough_refuses_inf_and_nan():
    with pytest.raises(ValueError, match="x must hold finite values .* got 16 inf/NaN of 16"):
        L.scaling_walkthrough(torch.full((4, 4), float("nan")))
