"""Lesson 10 (FP8 end to end on GPTs): the shape-based predictor, the GPT sweep and parity engine,
and the lesson's tables, on the CPU (no FP8 GPU needed: FP8 rows say why they did not run)."""
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from amp_lessons.lessons import l10_fp8_gpt as lesson
from amp_lessons.measure import fp8_predict as fp
from amp_lessons.measure import gpt_fp8 as g
from amp_lessons.measure.float8 import FP8Support

TINY = g.GPTShape(32, 2, 2, vocab_size=256, seq_len=16)
NO_FP8 = FP8Support("cpu", "CPU", None, None, "no CUDA GPU (running on the CPU)")


def fake_calibration(recipe="tensorwise", gain=2.0, bf16_ms=1.0, casts=None, model=None,
                     tokens=8):
    """A calibration where every GEMM of ``model``'s Linears (``tokens`` rows) takes ``bf16_ms``
    in bf16 and ``bf16_ms / gain`` in FP8."""
    cal = fp.Calibration(recipe, "test")
    cal.casts = casts or {"tensorwise": (0.0, 0.0), "rowwise": (0.0, 0.0), "copy": (0.0, 0.0)}
    for s in fp.linear_shapes(model, tokens=tokens) if model is not None else ():
        for role in fp.GEMM_ROLES:
            cal.gemms[(*s.gemm(role), role)] = (bf16_ms, bf16_ms / gain)
    return cal


# --- the predictor --------------------------------------------------------------------------------

def test_linear_shapes_from_tokens_and_from_a_batch():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    by_tokens = fp.linear_shapes(model, tokens=10)
    assert [(s.name, s.m, s.k, s.n, s.converted) for s in by_tokens] == [
        ("0", 10, 32, 64, True), ("2", 10, 64, 8, False)]  # 8 is not a multiple of 16
    by_batch = fp.linear_shapes(model, example_inputs=torch.randn(3, 5, 32))
    assert [s.m for s in by_batch] == [15, 15]
    assert by_batch[0].gemm("grad_weight") == (64, 15, 32) and by_batch[0].flops == 6 * 15 * 32 * 64
    with pytest.raises(ValueError, match="exactly one"):
        fp.linear_shapes(model)
    with pytest.raises(ValueError, match="exactly one"):
        fp.linear_shapes(model, tokens=4, example_inputs=torch.randn(1, 32))


def test_gpt_body_filter_keeps_the_head_in_bf16():
    with torch.device("meta"):
        model = TINY.build()
    shapes = fp.linear_shapes(model, tokens=64, module_filter_fn=fp.gpt_body_filter)
    converted = {s.name for s in shapes if s.converted}
    assert "head" not in converted and len(converted) == 4 * TINY.n_layers
    assert all(name.startswith("blocks.") for name in converted)


def test_prediction_arithmetic_on_a_known_calibration():
    # 8 converted layers x 3 GEMMs at 1 ms in bf16 and 0.5 ms in FP8, casts free: 12 ms saved
    with torch.device("meta"):
        model = TINY.build()
    cal = fake_calibration(gain=2.0, bf16_ms=1.0, model=model, tokens=64)
    pred = fp.predict_fp8_speedup(model, cal, tokens=64, bf16_step_ms=40.0,
                                  module_filter_fn=fp.gpt_body_filter)
    assert pred.status == "predicted"
    assert pred.gemm_bf16_ms == pytest.approx(24.0) and pred.gemm_fp8_ms == pytest.approx(12.0)
    assert pred.fp8_step_ms == pytest.approx(28.0) and pred.speedup == pytest.approx(40 / 28)
    assert pred.gemm_share == pytest.approx(0.6) and pred.linear_speedup == pytest.approx(2.0)
    assert sum(r["converted"] for r in pred.layers) == 8 and len(pred.layers) == 9


def test_casts_cost_what_the_recipe_plan_says():
    shape = fp.LinearShape("x", m=1000, k=100, n=200)
    one_ns = {"tensorwise": (0.0, 1.0), "rowwise": (0.0, 1.0), "copy": (0.0, 1.0)}
    cal = fake_calibration(casts=one_ns)
    elements = {"input": 1000 * 100, "weight": 100 * 200, "grad": 1000 * 200}
    # tensorwise: one cast of each tensor (the weight's from fp32: 9/5 of a bf16 cast's cost),
    # one FP8 copy of each, less autocast's bf16 weight copy (6 bytes at a copy's 2 per ns)
    want = (elements["input"] + elements["grad"] + elements["weight"] * 9 / 5
            + sum(elements.values()) - elements["weight"] * 3) / 1e6
    assert fp.layer_cast_ms(shape, "tensorwise", cal) == pytest.approx(want)
    costs = {r: fp.layer_cast_ms(shape, r, fake_calibration(r, casts=one_ns))
             for r in fp.PREDICT_RECIPES}
    assert costs["rowwise"] > costs["tensorwise"] > costs["rowwise_with_gw_hp"]
    fixed = {"tensorwise": (5.0, 0.0), "rowwise": (5.0, 0.0), "copy": (5.0, 0.0)}
    assert fp.layer_cast_ms(shape, "tensorwise", fake_calibration(casts=fixed)) == \
        pytest.approx(6 * 5.0 / 1e3)  # three casts and three copies, 5 us each


def test_prediction_without_a_step_time_or_an_fp8_gpu():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    pred = fp.predict_fp8_speedup(model, fake_calibration(gain=2.0, model=model), tokens=8)
    assert pred.status == "layers only" and pred.speedup is None and pred.linear_speedup == 2.0
    if not torch.cuda.is_available():
        pred = fp.predict_fp8_speedup(model, tokens=8, bf16_step_ms=5.0)
        assert pred.status == "not decided" and "no FP8 calibration" in pred.reason
    none = fp.predict_fp8_speedup(nn.Sequential(nn.Linear(8, 3)), fake_calibration(),
                                  tokens=8, bf16_step_ms=1.0)
    assert none.status == "not decided" and none.speedup == 1.0


def test_prediction_refuses_bad_arguments():
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="recipe"):
        fp.predict_fp8_speedup(model, fake_calibration(model=model), tokens=8, recipe="fp4")
    with pytest.raises(ValueError, match="bf16_step_ms"):
        fp.predict_fp8_speedup(model, fake_calibration(), tokens=8, bf16_step_ms=0)
    with pytest.raises(ValueError, match="measured for recipe 'rowwise'"):
        fp.predict_fp8_speedup(model, fake_calibration("tensorwise"), tokens=8, recipe="rowwise")
    slow = fp.predict_fp8_speedup(model, fake_calibration(bf16_ms=10.0, model=model), tokens=8,
                                  bf16_step_ms=1.0)  # GEMMs alone longer than the step
    assert slow.status == "not decided" and slow.speedup is None


def test_calibration_measures_on_the_cpu():
    shapes = [fp.LinearShape("a", 32, 32, 64)]
    casts = fp.measure_casts(torch.device("cpu"), compile=False, sizes=((32, 32), (128, 128)),
                             reps=2)
    assert set(casts) == {"tensorwise", "rowwise", "copy"}
    assert all(us >= 0 and ns >= 0 for us, ns in casts.values())
    for recipe in fp.PREDICT_RECIPES:
        cal = fp.measure_calibration(shapes, recipe, "cpu", reps=1, casts=casts)
        assert len(cal.gemms) == 3 and all(b > 0 and f > 0 for b, f in cal.gemms.values())
    with pytest.raises(KeyError, match="not measured"):
        cal.gemm_ms(1, 2, 3, "forward")


def test_all_gather_model_halves_the_bytes():
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 10))  # the second is not FP8-able
    m = fp.fp8_all_gather_saving(model, world_size=8, bandwidth_gbps=100.0)
    assert m["converted_weights"] == 64 * 128
    assert m["bf16_bytes"] == pytest.approx(2 * 64 * 128 * 7 / 8 * 2) == 2 * m["fp8_bytes"]
    assert m["saved_ms"] == pytest.approx(m["fp8_bytes"] / 100e9 * 1e3)
    assert "model" in m["kind"]
    with pytest.raises(ValueError, match="world_size"):
        fp.fp8_all_gather_saving(model, world_size=1)


# --- the GPT engine -------------------------------------------------------------------------------

def test_gpt_shape_counts_its_parameters():
    for shape in (TINY, g.GPTShape(48, 3, 4, vocab_size=100, seq_len=8)):
        assert shape.params() == sum(p.numel() for p in shape.build().parameters())
    assert lesson.FULL_SIZES[1].label == "406M d1024 x24"
    assert lesson.FULL_SIZES[3].label.startswith("2.03B")
    with pytest.raises(ValueError, match="multiple of n_heads"):
        g.GPTShape(30, 1, 4)


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<f8f8bf16_rowwise>>", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("triton_poi_fused__scaled_mm__to_copy_add_clamp_clone_gelu_gelu_backward_mul", "fp8 cast"),
    ("triton_red_fused__to_copy_abs_add_gelu_gelu_backward_max_view_6", "fp8 cast"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_backward__to_copy_clamp", "fp8 cast"),
    ("triton_per_fused_native_layer_norm_backward_5", "other"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "optimizer"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float>", "other"),
])
def test_kernel_kinds_from_real_names(name, kind):
    assert g.kernel_kind(name) == kind


def test_sweep_on_the_cpu_measures_bf16_and_says_why_not_fp8():
    rows = g.gpt_speed_sweep([TINY], batch_size=2, steps=2, warmup=1, support=NO_FP8,
                             device="cpu", compile=False)
    assert [r["recipe"] for r in rows] == list(g.GPT_RECIPES)
    bf16 = rows[0]
    assert bf16["status"] == "measured" and bf16["step_ms"] > 0 and bf16["speedup"] == 1.0
    assert bf16["tokens_per_step"] == 2 * TINY.seq_len and bf16["split"] is None
    assert all(r["status"] == "not measured: no CUDA GPU (running on the CPU)" and
               r["step_ms"] is None for r in rows[1:])
    with pytest.raises(ValueError, match="recipe"):
        g.measure_gpt_step(TINY, "fp4")


def test_parity_runs_reload_the_initial_weights_for_each_seed():
    corpus = lesson.stdlib_corpus(20_000)
    runs = g.parity_runs(corpus, TINY, ("bf16", "tensorwise"), seeds=(0, 0, 1), steps=3,
                         batch_size=2, warmup_steps=1, eval_batches=1, support=NO_FP8,
                         device="cpu", compile=False)
    bf16 = [r for r in runs if r["recipe"] == "bf16"]
    assert [r["status"] for r in bf16] == ["trained"] * 3
    assert bf16[0]["losses"] == bf16[1]["losses"]  # same seed: same weights, same batches
    assert bf16[0]["losses"] != bf16[2]["losses"]
    assert all(r["status"].startswith("not run: no CUDA GPU") for r in runs if r["recipe"] != "bf16")
    with pytest.raises(ValueError, match="vocab_size must be 256"):
        g.parity_runs(corpus, g.GPTShape(32, 1, 2, vocab_size=512, seq_len=16), ("bf16",))


# --- the lesson -----------------------------------------------------------------------------------

def test_the_plan():
    full = lesson.sweep_plan(True)
    assert [s for s, _ in full] == list(lesson.FULL_SIZES)
    assert full[0][1] == g.GPT_RECIPES and all(rs[0] == "bf16" for _, rs in full)
    assert all(rs == g.GPT_RECIPES for _, rs in lesson.sweep_plan(True, every_recipe=True))
    assert lesson.sweep_plan(False) == [(lesson.QUICK_SIZES[0], g.GPT_RECIPES)]
    rows = lesson.flops_rows(full, 8)
    assert all(abs(r["blocks' Linears %"] + r["LM head %"] + r["attention %"] - 100) < 1e-9
               for r in rows)
    assert rows[0]["LM head %"] > rows[-1]["LM head %"]  # the head weighs most on the small GPT


def _row(model, recipe, step_ms, params=1, gemm=None, busy=None, spread=0.01, **kw):
    split = None if gemm is None else {"gemm": gemm, "attention": 1.0, "fp8 cast": 0.5,
                                       "optimizer": 0.5, "other": 1.0, "busy_ms": busy}
    return {"model": model, "recipe": recipe, "params": params, "step_ms": step_ms,
            "speedup": None, "spread": spread, "split": split, "idle_ms": 0.0,
            "status": "measured", "shape": {"seq_len": 16}, **kw}


def test_smallest_paying_and_obstacles():
    rows = [_row("s", "bf16", 10, 1, 4, 9), _row("s", "tensorwise", 12, 1, 3, 11),
            _row("l", "bf16", 10, 2, 6, 9), _row("l", "tensorwise", 8, 2, 3, 7.5)]
    for r in rows:
        r["speedup"] = 10 / r["step_ms"]
    assert lesson.smallest_paying(rows) == "l" and lesson.best_row(rows)["model"] == "l"
    rows[1]["step_ms"], rows[1]["speedup"] = 9, 10 / 9
    assert lesson.smallest_paying(rows) == "s"
    rows[3]["spread"] = 0.5  # a noisy row decides nothing
    assert lesson.smallest_paying(rows) == "s"
    obstacles = {o["model"]: o for o in lesson.obstacle_rows(rows)}
    assert obstacles["l"]["if GEMMs were 2x"] == pytest.approx(10 / (10 - 3))
    # l: FP8 added (7.5 - 3) - (9 - 6) = 1.5 ms outside GEMMs; without it the step is 6.5 ms
    assert obstacles["l"]["without added time"] == pytest.approx(10 / 6.5)


def test_predictions_are_not_decided_without_an_fp8_gpu():
    plan = [(TINY, g.GPT_RECIPES)]
    rows = g.gpt_speed_sweep([TINY], batch_size=2, steps=2, warmup=1, support=NO_FP8,
                             device="cpu", compile=False)
    preds = lesson.prediction_rows(rows, {}, plan, 2)
    assert len(preds) == 3 and all(p["predicted"] is None and p["status"].startswith(
        "not decided here") for p in preds)
    with torch.device("meta"):
        tiny = TINY.build()
    cal = {r: fake_calibration(r, model=tiny, tokens=2 * TINY.seq_len) for r in fp.PREDICT_RECIPES}
    preds = lesson.prediction_rows(rows, cal, plan, 2)
    assert all(p["status"] == "predicted; " + r["status"] for p, r in zip(preds, rows[1:]))
    gather = lesson.all_gather_rows(plan, rows)
    assert gather[0]["% of the FP8 step"] is None and gather[0]["kind"] == "model"


def _run(recipe, seed, val, steps=100, status="trained"):
    return {"label": f"{recipe}, seed {seed}", "recipe": recipe, "seed": seed, "steps": steps,
            "final_loss": val + 0.1, "val_loss": val, "finite": True, "status": status}


def test_parity_summary_decides_only_when_it_can():
    runs = [_run("bf16", s, v) for s, v in enumerate((2.000, 2.010, 2.005))]
    runs += [_run("tensorwise", s, v) for s, v in enumerate((2.004, 2.012, 2.009))]
    out = lesson.parity_summary(runs)
    assert out["decided"] and out["reason"] == "" and out["spread"] == pytest.approx(0.01)
    tw = out["rows"][1]
    assert tw["mean diff"] == pytest.approx(0.01 / 3) and tw["within"] is True
    wide = lesson.parity_summary(runs, resolution=0.005)
    assert not wide["decided"] and "wider than" in wide["reason"]
    assert wide["rows"][1]["status"].startswith("measured, not compared: ")
    short = lesson.parity_summary([dict(r, steps=10) for r in runs])
    assert not short["decided"] and "fewer than 50" in short["reason"]
    missing = runs[:3] + [{"label": "rowwise, seed 0", "recipe": "rowwise", "seed": 0,
                           "steps": 100, "status": "not run: no FP8"}]
    out = lesson.parity_summary(missing)
    assert not out["decided"] and "rowwise not run: no FP8" in out["reason"]
    two = lesson.parity_summary(runs[:2] + runs[3:5])
    assert not two["decided"] and "a seed spread needs 3" in two["reason"]
    assert lesson.parity_summary(runs, metric="final_loss")["spread"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="metric"):
        lesson.parity_summary(runs, metric="accuracy")


def test_findings_say_not_decided_without_fp8():
    rows = [_row("s", "bf16", 10), _row("s", "tensorwise", None, status="not measured: no GPU")]
    rows[1]["step_ms"] = None
    parity = {"decided": False, "reason": "no FP8", "rows": []}
    lines = lesson.findings(NO_FP8, rows, [], parity)
    assert lines[0] == NO_FP8.line() and "not decided here (not measured: no GPU)" in lines[1]
    assert lines[-1] == "Loss parity: not decided here: no FP8."


def test_lesson_module_stays_thin():
    source = Path(lesson.__file__).read_text(encoding="utf-8")
    assert len(source.splitlines()) < 700
    assert "ipywidgets" not in source and "plotly" not in source
    assert "time_steps" not in source and "Event(" not in source  # no timing of its own
