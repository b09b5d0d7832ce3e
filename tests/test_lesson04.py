"""Lesson 04 (amp_lessons.lessons.l04_resnet50) on the CPU: its table of configurations, the skip
check, accuracy runs, op errors, the claims it decides (B1, B2, R4, R5, R6, R7, R12) as
claims.Verdict through the timing and accuracy gates, the fastest step, and its figure. The
quick profile (a CPU, 2 timed steps, accuracy at chance) must decide no claim."""
import importlib.util
import math

import pytest
import torch

from amp_lessons import measure
from amp_lessons import models as al_models
from amp_lessons.publish import claims
from amp_lessons.lessons import l04_resnet50 as L
from amp_lessons.ui import perf_plots

GPU = dict(timer="CUDA events", steps=15, warmup=5)


def _row(label, ips, peak, precision="fp16", status="ok", idle=0.05, **extra):
    """A measured table row as run_configs makes it, timed on a busy GPU unless told."""
    row = dict(label=label, img_per_s=ips, step_ms=None if ips is None else 256e3 / ips,
               peak_allocated_gib=peak, status=status, reason="", gpu_idle_fraction=idle,
               config={"precision": precision, "batch_size": 256}, loss=1.0, **GPU)
    row.update(extra)
    return row


def _run(precision, accuracy, fp32_eval=None, label=None, **extra):
    return dict(label=label or precision, precision=precision, accuracy=accuracy,
                accuracy_fp32_eval=accuracy if fp32_eval is None else fp32_eval, classes=10,
                status="ok", **extra)


CPU = dict(timer="perf_counter", steps=2, warmup=1, idle=None)


def test_lesson_decides_exactly_its_registered_claims():
    assert L.LESSON == "04"
    assert sorted(L.DECIDES) == sorted(c.id for c in claims.CLAIMS.values() if c.lesson == "04")
    assert sorted(L.DECIDES) == ["B1", "B2", "R12", "R4", "R5", "R6", "R7"]


# --- the table ------------------------------------------------------------------------------------

def test_lesson_configs_cover_the_lesson_with_the_standard_settings():
    cfgs = L.lesson_configs("resnet18", 8, 32, amp="fp16", compile_precision="bf16")
    labels = [c.label for c in cfgs]
    assert len(set(labels)) == len(labels)
    for p in L.PRECISIONS:
        assert any(c.precision == p and not c.channels_last for c in cfgs)
        assert any(c.precision == p and c.channels_last for c in cfgs)
    assert all(c.cudnn_benchmark for c in cfgs)  # measure.STANDARD: cuDNN autotuning on
    plain = [c for c in cfgs if c.optimizer == "sgd" and not c.compile and c.impl != "fused"]
    assert {c.impl for c in plain} == {measure.STANDARD["impl"]}
    assert {c.impl for c in cfgs} == {"foreach", "fused"}
    assert any(c.model == "resnet18-selective" for c in cfgs)
    adam = [c for c in cfgs if c.optimizer == "adam"]
    assert {c.eps for c in adam} == {1e-8, 1e-7} and any(c.amsgrad for c in adam)
    compiled = [c for c in cfgs if c.compile]
    assert [c.compile for c in compiled] == ["default", "reduce-overhead"]
    assert all(c.impl == "fused" and c.channels_last and c.precision == "bf16" for c in compiled)
    one = L.lesson_configs("resnet18", compile_modes=("default",))
    assert [c.compile for c in one if c.compile] == ["default"]
    assert not any(c.compile for c in L.lesson_configs("resnet18", compile_precision=None))
    assert not any(c.cudnn_benchmark for c in L.lesson_configs("resnet18", cudnn_benchmark=False))
    with pytest.raises(ValueError, match="amp"):
        L.lesson_configs(amp="fp32")
    with pytest.raises(ValueError, match="compile_precision"):
        L.lesson_configs(compile_precision="fp8")
    with pytest.raises(ValueError, match="cudnn_benchmark"):
        L.lesson_configs(cudnn_benchmark="yes")
    for bad in ("default", (), ("fast",), (None,)):
        with pytest.raises(ValueError, match="compile_modes"):
            L.lesson_configs(compile_modes=bad)


def test_trainer_fastest_config_writes_its_settings_out():
    cfg = L.trainer_fastest_config("resnet18", 8, 32, precision="fp16")
    assert (cfg.loop, cfg.compile, cfg.impl, cfg.channels_last, cfg.trainer_tracking) == (
        "trainer", "reduce-overhead", "fused", True, False)
    assert cfg.batch_size == 8 and cfg.cudnn_benchmark == measure.STANDARD["cudnn_benchmark"]
    for words in ("fp16 + GradScaler", "channels_last", "SGD(fused=True)",
                  "torch.compile(mode='reduce-overhead')", "batch 8",
                  "TrainConfig(track_grad_norm=False, track_memory=False)"):
        assert words in cfg.label
    assert "bf16" in L.trainer_fastest_config(precision="bf16").label
    table = L.lesson_configs("resnet18", 4, 32) + [cfg]
    assert len({c.label for c in table}) == len(table)
    row = measure.measure(cfg, "cpu", warmup=0, steps=1)  # not measured here, and says why
    assert row["status"] == "skipped" and "GPU" in row["reason"]
    with pytest.raises(ValueError, match="precision"):
        L.trainer_fastest_config(precision="fp32")
    with pytest.raises(ValueError, match="batch_size"):
        L.trainer_fastest_config(batch_size=0)
    tuned = L.trainer_fastest_config(compile="max-autotune")
    assert tuned.compile == "max-autotune" and "mode='max-autotune'" in tuned.label
    for bad in (None, "fast", ""):
        with pytest.raises(ValueError, match="compile must be one of"):
            L.trainer_fastest_config(compile=bad)


def _table_rows():
    cfgs = L.lesson_configs("resnet18", 8, 32, compile_precision=None)
    speed = {"fp32": 100.0, "tf32": 200.0, "fp16": 300.0, "bf16": 250.0}
    rows = []
    for c in cfgs:
        ips = speed[c.precision] * (2 if c.channels_last else 1)
        rows.append(dict(_row(c.label, ips, 1.0, c.precision), config=dict(
            precision=c.precision, channels_last=c.channels_last, model=c.model,
            optimizer=c.optimizer, impl=c.impl, compile=c.compile, cuda_graph=c.cuda_graph)))
    return rows


def test_plain_row_and_layout_effects():
    rows = _table_rows()
    fp32 = L.plain_row(rows, "fp32", "resnet18")
    assert fp32["label"] == "fp32, TF32 off, foreach SGD"
    assert L.plain_row(rows, "fp16", "resnet18", channels_last=True)["img_per_s"] == 600.0
    assert L.plain_row(rows, "fp16", "vgg") is None
    out = L.layout_effects(rows)
    assert [r["label"].split(",")[0] for r in out] == ["fp32", "fp32", "fp16 + GradScaler", "bf16"]
    assert all(r["channels_last_gain"] == 2.0 for r in out)


# --- the skipped-step check -------------------------------------------------------------------------

def test_skipped_step_check_reference_is_clean():
    out = L.skipped_step_check("sgd", "foreach", "cpu")
    assert out["max_abs_diff"] == 0.0 and out["finite"]
    assert out["state_after_skip"] is False and out["reference_state_after_skip"] is False
    fused = L.skipped_step_check("adam", "fused", "cpu", size=64)
    assert set(fused) >= {"max_abs_diff", "finite", "state_after_skip"}
    with pytest.raises(ValueError, match="size"):
        L.skipped_step_check("sgd", "foreach", "cpu", size=1)
    with pytest.raises(ValueError, match="optimizer"):
        L.skipped_step_check("lamb", "foreach", "cpu")


def test_fused_sgd_skipped_first_step_bug_and_priming_fix():
    # the PyTorch bug the lesson shows: fused SGD's momentum is garbage after a skipped first step
    raw = L.skipped_step_check("sgd", "fused", "cpu", size=256)
    assert raw["primed"] is False
    assert not (raw["finite"] and raw["max_abs_diff"] < 1e-6), raw
    assert raw["state_after_skip"] is True  # the skipped step created the (unwritten) buffer
    fixed = L.skipped_step_check("sgd", "fused", "cpu", size=256, prime_momentum=True)
    assert fixed["primed"] is True and fixed["finite"] and fixed["max_abs_diff"] < 1e-6
    assert fixed["state_after_skip"] is False  # the primed buffer was there before the step
    assert L.skipped_step_check("sgd", "foreach", "cpu", prime_momentum=True)["primed"] is False
    with pytest.raises(ValueError, match="prime_momentum"):
        L.skipped_step_check("sgd", "fused", "cpu", prime_momentum="yes")


# --- accuracy runs, op errors, R5 facts -----------------------------------------------------------

def test_digits_accuracy_runs_with_the_trainer():
    row = L.digits_accuracy("resnet18", "bf16", "cpu", epochs=1, batch_size=16,
                            image_size=16, small_input=False, max_train=32, max_test=64)
    assert row["status"] == "ok" and row["classes"] == 10
    assert 0 <= row["accuracy"] <= 1 and 0 <= row["accuracy_fp32_eval"] <= 1
    assert row["steps"] == 2 and row["test_examples"] == 64 and math.isfinite(row["final_loss"])
    with pytest.raises(ValueError, match="model"):
        L.digits_accuracy("vgg")
    with pytest.raises(ValueError, match="max_train"):
        L.digits_accuracy(max_train=0)
    assert L.RESNET_DIGITS_MODELS is not al_models.DIGITS_MODELS  # no name clash any more


def test_autocast_error_by_op():
    rows = L.autocast_error_by_op("cpu", torch.bfloat16, logit_scales=(1.0, 16.0))
    assert [r["op"].split()[0] for r in rows] == ["conv2d", "linear", "attention", "attention"]
    assert all(0 < r["rel_error"] < 0.05 for r in rows)
    assert rows[0]["out_dtype"] == "torch.bfloat16" and {r["device"] for r in rows} == {"cpu"}
    with pytest.raises(ValueError, match="dtype"):
        L.autocast_error_by_op("cpu", torch.float32)


def test_multi_tensor_status_matches_an_import_check():
    expected = importlib.util.find_spec("torch.optim._multi_tensor") is not None
    status = L.multi_tensor_status()
    assert status["exists"] is expected
    if expected:  # what it is in this torch: Adam with foreach=True fixed
        assert status["subclass_of_adam"] and status["foreach"] is True


def test_adam_precision_facts_keep_adam_in_fp32():
    facts = L.adam_precision_facts("cpu")
    assert facts["exp_avg_sq_dtype"] == "torch.float32" and facts["param_dtype"] == "torch.float32"
    assert facts["activation_dtype"] == facts["autocast_dtype"] == "torch.bfloat16"
    assert facts["eps_1e-8_in_fp16"] == 0.0 and facts["eps_1e-7_in_fp16"] > 0


# --- the gates --------------------------------------------------------------------------------------

def test_rows_timing_gate_on_table_rows():
    a, b = _row("a", 1000.0, 20.0), _row("b", 2000.0, 10.0)
    assert claims.rows_timing_gate(a, b) is None
    assert "cpu" in claims.rows_timing_gate(a, dict(b, timer="perf_counter"))
    assert "warm-up" in claims.rows_timing_gate(dict(a, warmup=0), b)
    assert "2 timed steps" in claims.rows_timing_gate(dict(a, steps=2), b)
    assert "idle 60%" in claims.rows_timing_gate(a, dict(b, gpu_idle_fraction=0.6))
    assert "not measured" in claims.rows_timing_gate(a, dict(b, gpu_idle_fraction=None))
    assert "did not run" in claims.rows_timing_gate(a, _row("c", None, None, status="out of memory"))
    with pytest.raises(ValueError, match="rows"):
        claims.rows_timing_gate()


def test_accuracy_reason_follows_claims_accuracy_gate():
    assert L.accuracy_reason(_run("fp16", 0.98), _run("fp32", 0.97)) is None
    assert "near chance" in L.accuracy_reason(_run("fp16", 0.98), _run("fp32", 0.12))
    assert "did not train" in L.accuracy_reason(dict(_run("bf16", None), status="skipped"))
    with pytest.raises(ValueError, match="runs"):
        L.accuracy_reason()


# --- B1 and B2 ------------------------------------------------------------------------------------

def test_verdict_b1_against_the_default_in_two_parts():
    default = _row("fp32, TF32 on", 1000.0, 20.0, "tf32")
    held = L.verdict_b1(default, _row("fp16", 1800.0, 10.0))
    assert isinstance(held, claims.Verdict) and held.claim == "B1" and held.lesson == "04"
    assert held.outcome == "held" and held.numbers["memory_saving_pct"] == pytest.approx(50.0)
    assert "vs fp32, TF32 on (PyTorch's default here)" in held.measured
    # the speed part's threshold, 1.5x, on both sides; above 2x the claim understated it
    assert L.verdict_b1(default, _row("fp16", 1510.0, 10.0)).outcome == "held"
    slow = L.verdict_b1(default, _row("fp16", 1340.0, 10.0))
    assert slow.outcome == "partly held" and [p.held for p in slow.parts] == [True, False]
    fast = L.verdict_b1(default, _row("fp16", 3260.0, 10.0))
    assert fast.outcome == "held, understated" and "faster than the claimed 1.5-2x" in fast.why
    assert L.verdict_b1(default, _row("fp16", 1990.0, 10.0)).outcome == "held"
    # the memory part's threshold, 40%, on both sides
    assert L.verdict_b1(default, _row("fp16", 1800.0, 11.9)).parts[0].held is True   # 40.5%
    assert L.verdict_b1(default, _row("fp16", 1800.0, 12.1)).parts[0].held is False  # 39.5%
    assert L.verdict_b1(default, _row("fp16", 1200.0, 15.0)).outcome == "did not hold"
    # the sensitivity rows: channels_last on both sides and TF32 off, decided by the same rule;
    # a verdict that flips under one is partly held and names both conditions
    beside = L.verdict_b1(default, _row("fp16", 1340.0, 10.0), _row("fp32, TF32 off", 500.0, 20.0),
                          _row("fp16, channels_last", 1810.0, 10.0),
                          _row("fp32, TF32 on, channels_last", 1000.0, 20.0, "tf32"))
    assert [a.held for a in beside.sensitivity] == [True, True]
    assert beside.outcome == "partly held" and "It depends on the setting" in beside.why
    assert "held with channels_last on both sides" in beside.why
    assert "did not hold on NCHW against fp32, TF32 on" in beside.why
    assert "1.81x >= 1.5x" in beside.row()["sensitivity"]
    # a channels_last pair that also fails leaves the verdict as NCHW left it
    both = L.verdict_b1(default, _row("fp16", 1340.0, 10.0), None,
                        _row("fp16, channels_last", 1200.0, 10.0),
                        _row("fp32, TF32 on, channels_last", 1000.0, 20.0, "tf32"))
    assert both.sensitivity[0].held is False and "It depends" not in both.why
    # NCHW held but channels_last did not: partly held the other way round
    flip = L.verdict_b1(default, _row("fp16", 1800.0, 10.0), None,
                        _row("fp16, channels_last", 1100.0, 10.0),
                        _row("fp32, TF32 on, channels_last", 1000.0, 20.0, "tf32"))
    assert flip.outcome == "partly held" and "held on NCHW against fp32, TF32 on" in flip.why
    # an alternative pair on an idle GPU is not decided and changes nothing
    idle_alt = L.verdict_b1(default, _row("fp16", 1800.0, 10.0), None,
                            _row("fp16, channels_last", 1100.0, 10.0, idle=0.6),
                            _row("fp32, TF32 on, channels_last", 1000.0, 20.0, "tf32"))
    assert idle_alt.outcome == "held" and idle_alt.sensitivity[0].held is None
    idle = L.verdict_b1(default, _row("fp16", 1800.0, 10.0, idle=0.5))
    assert idle.outcome == claims.UNDECIDED and "idle 50%" in idle.why
    assert "GPU idle 5%" in held.measured  # every timing comparison states the idle share
    cpu = L.verdict_b1(_row("fp32", 10.0, None, **CPU), _row("fp16", 50.0, None, **CPU))
    assert cpu.outcome == claims.UNDECIDED and "cpu" in cpu.why
    with pytest.raises(ValueError, match="fp16"):
        L.verdict_b1(default, None)


def test_verdict_b2_on_a_named_stand_in_in_two_parts():
    default = _row("fp32, TF32 on", 1000.0, 20.0, "tf32")
    v = L.verdict_b2(default, _row("fp16", 2000.0, 10.0))  # 50% shorter, 50% saved
    assert v.claim == "B2" and v.held is True and v.outcome == "held, on a stand-in"
    assert v.why.startswith("on a stand-in (ResNet-50 at batch 256 on this GPU for article B's "
                            "train.py on an RTX 3090)")
    assert v.numbers["step_time_shorter_pct"] == pytest.approx(50.0)
    # 30% shorter is the threshold: 31% holds, 25% does not
    assert L.verdict_b2(default, _row("fp16", 1450.0, 10.0)).parts[1].held is True
    short = L.verdict_b2(default, _row("fp16", 1333.0, 10.0))
    assert short.outcome == "partly held, on a stand-in" and short.parts[1].held is False
    assert L.verdict_b2(default, _row("fp16", 2000.0, 13.0)).parts[0].held is False  # 35% saved
    assert L.verdict_b2(default, _row("fp16", 1250.0, 13.0)).outcome == "did not hold, on a stand-in"
    cpu = L.verdict_b2(_row("fp32", 10.0, None, **CPU), _row("fp16", 5.0, None, **CPU))
    assert not cpu.decided and "longer" in cpu.measured and "stand-in" not in cpu.outcome


def test_default_row_is_tf32_where_it_ran_else_plain_fp32():
    def row(precision, status="ok"):
        return dict(_row(precision, 1.0, 1.0, precision, status=status),
                    config={"precision": precision, "channels_last": False, "model": "m",
                            "optimizer": measure.STANDARD["optimizer"],
                            "impl": measure.STANDARD["impl"], "compile": None,
                            "cuda_graph": False})
    rows = [row("fp32"), row("tf32")]
    assert L.default_row(rows, "m")["label"] == "tf32"
    t4 = [row("fp32"), row("tf32", status="skipped")]   # no TF32 here: the default is plain fp32
    assert L.default_row(t4, "m")["label"] == "fp32"
    assert L.default_row([row("fp32")], "m")["label"] == "fp32"


def test_rows_caption_is_generated_from_the_rows():
    nchw = dict(_row("fp16", 1.0, 1.0), config={"channels_last": False, "optimizer": "sgd",
                                                "impl": "foreach", "cudnn_benchmark": True,
                                                "label": "fp16 + GradScaler"}, steps=15, warmup=5)
    cl = dict(nchw, config=dict(nchw["config"], channels_last=True))
    assert L.rows_caption(nchw, nchw).startswith("NCHW, ")
    assert "channels_last" not in L.rows_caption(nchw)
    assert L.rows_caption(nchw, cl).startswith("NCHW/channels_last")
    assert "foreach SGD (momentum 0.9), median of 15 timed steps after 5 warm-up" in \
        L.rows_caption(nchw)
    with pytest.raises(ValueError, match="at least one"):
        L.rows_caption()


def test_the_optimized_row_is_built_as_article_r_describes_it():
    cfgs = L.lesson_configs("resnet18", 4, 32, num_classes=10, compile_precision=None)
    opt = [c for c in cfgs if c.label == L.OPTIMIZED_LABEL]
    assert len(opt) == 1
    c = opt[0]
    assert c.model == "resnet18-selective" and c.optimizer == "adam" and c.impl == "foreach"
    assert c.eps == 1e-7 and c.amsgrad is True and c.precision == "fp16"
    rows = [{"label": "x"}, {"label": L.OPTIMIZED_LABEL}]
    assert L.optimized_row(rows) is rows[1] and L.optimized_row(rows[:1]) is None


# --- R6 ---------------------------------------------------------------------------------------------

def test_compare_r6_and_its_verdict():
    fp32, amp = _row("fp32", 1000.0, 20.0, "fp32"), _row("amp", 3000.0, 10.0)
    slow = _row("selective", 2000.0, 13.0)
    out = L.compare_r6(fp32, amp, slow)
    assert [r["configuration"] for r in out] == [c["configuration"] for c in L.R6_CLAIM]
    assert out[1]["measured_saving_pct"] == pytest.approx(50.0)
    assert out[1]["gpu_idle_fraction"] == 0.05 and out[1]["spread"] is None
    assert L.compare_r6(fp32, dict(amp, spread=0.03), slow)[1]["spread"] == 0.03  # carried
    assert "repeat spread" in [c[1] for c in L.R6_COLUMNS]
    v = L.verdict_r6(out)
    # each part on its own; top-1 on ImageNet untested, so never more than partly held
    assert v.claim == "R6" and v.outcome == "partly held"
    assert [p.held for p in v.parts] == [True, True, False, True, False, None]
    assert "untested: top-1" in v.why and "optimized beats native AMP: did not hold" in v.why
    fast = L.verdict_r6(L.compare_r6(fp32, amp, _row("selective", 3500.0, 9.0)))
    assert fast.outcome == "partly held" and all(p.held for p in fast.parts[:5])
    weak = L.verdict_r6(L.compare_r6(fp32, _row("amp", 1100.0, 19.0), _row("o", 3500.0, 9.0)))
    assert weak.parts[1].held is False and "1.10x < 1.81x" in weak.why and "5% < 33.6%" in weak.why
    # against fp32 with TF32 off the speed parts hold: the row is shown and flips nothing here
    off = L.compare_r6(_row("fp32, TF32 off", 400.0, 20.0, "fp32"), amp, slow)
    v = L.verdict_r6(out, off)
    assert v.sensitivity[0].held is False and "against fp32, TF32 off" in v.sensitivity[0].setting
    assert "optimized (R3+R4+R5) +94% img/s: held" in v.sensitivity[0].why
    cpu = L.verdict_r6(L.compare_r6(*(dict(r, **CPU) for r in (fp32, amp, slow))))
    assert not cpu.decided
    with pytest.raises(ValueError, match="measurements"):
        L.compare_r6(fp32, _row("amp", None, None), slow)
    with pytest.raises(ValueError, match="3 rows"):
        L.verdict_r6(out[:2])


# --- R4, R5, R7 (accuracy) and R12 ------------------------------------------------------------------

def test_verdict_r4_rules_on_accuracy_above_chance():
    amp, sel = _row("amp", 3000.0, 11.0), _row("sel", 2500.0, 14.0)
    n = dict(test_examples=450)
    same = L.verdict_r4(amp, sel, _run("fp16", 0.991, **n), _run("fp16", 1.0, **n))
    # a 100% selective model against 99.1%: the task's ceiling leaves no 1-point gain to show
    assert same.claim == "R4" and same.held is None and "x0.83" in same.measured
    assert "ceiling" in same.why and "99.1%" in same.why and "0.22 points" in same.why
    # one seed per arm is not enough, however large the gain
    one = L.verdict_r4(amp, sel, _run("fp16", 0.90, **n), _run("fp16", 0.95, **n))
    assert one.held is None and "1 seed per arm" in one.why
    # three seeds on an unsaturated task: a gain beyond the seed spread holds, one inside it not
    base = [_run("fp16", a, **n) for a in (0.80, 0.81, 0.79)]
    bought = L.verdict_r4(amp, sel, base, [_run("fp16", a, **n) for a in (0.90, 0.91, 0.89)])
    assert bought.parts[0].held is True and bought.outcome == "partly held"  # gradients untested
    noisy = [_run("fp16", a, **n) for a in (0.70, 0.95, 0.80)]
    assert L.verdict_r4(amp, sel, base, noisy).parts[0].held is False
    # the bf16 baseline row is decided by the same rule
    v = L.verdict_r4(amp, sel, base, [_run("fp16", a, **n) for a in (0.90, 0.91, 0.89)],
                     bf16_run=[_run("bf16", a, **n) for a in (0.90, 0.90, 0.91)])
    assert v.sensitivity[0].held is False and "It depends" in v.why
    chance = L.verdict_r4(amp, sel, _run("fp16", 0.11), _run("fp16", 0.2))
    assert not chance.decided and "chance" in chance.why
    with pytest.raises(ValueError, match="amp_run"):
        L.verdict_r4(amp, sel, dict(_run("fp16", None), status="skipped"), _run("fp16", 0.9))


def test_verdict_r5():
    facts = L.adam_precision_facts("cpu")
    plain = {"exists": True, "subclass_of_adam": True, "foreach": True}
    n = dict(test_examples=450, eps=1e-8)
    runs = [_run("fp16", 0.98, **n), _run("fp16", 0.979, **dict(n, eps=1e-7)),
            _run("fp16", 0.981, amsgrad=True, **n)]
    v = L.verdict_r5(facts, plain, runs)
    # three parts, not an OR of them: eps never meets fp16 under autocast, amsgrad cannot show
    # on one seed, _multi_tensor is plain foreach Adam
    assert v.claim == "R5" and v.held is False and "torch.float32" in v.why
    assert [p.held for p in v.parts] == [False, None, False]
    # pure fp16 weights: eps 1e-8 rounds to 0 and the step writes NaN; 1e-7 keeps it finite
    steps = [L.half_adam_step(1e-8, "cpu"), L.half_adam_step(1e-7, "cpu")]
    assert not steps[0]["finite"] and steps[0]["eps_in_fp16"] == 0 and steps[1]["finite"]
    v = L.verdict_r5(facts, plain, runs, half_steps=steps)
    assert v.outcome == "partly held" and v.sensitivity[0].held is True
    assert "held with pure fp16 weights" in v.why and "did not hold under autocast" in v.why
    assert "non-finite" in v.row()["sensitivity"]
    # with fp16 state under autocast the eps part holds on its own measurement
    assert L.verdict_r5(dict(facts, exp_avg_sq_dtype="torch.float16"), plain, runs).parts[0].held
    # amsgrad over three seeds each on an unsaturated task is decided
    three = ([_run("fp16", a, **n) for a in (0.80, 0.81, 0.79)]
             + [_run("fp16", a, amsgrad=True, **n) for a in (0.90, 0.91, 0.89)])
    assert L.verdict_r5(facts, plain, three).parts[1].held is True
    assert L.verdict_r5(facts, plain, [_run("fp16", 0.1, **n), _run("fp16", 0.1, amsgrad=True,
                                                                    **n)]).parts[1].held is None
    with pytest.raises(ValueError, match="runs"):
        L.verdict_r5(facts, plain, runs[:1])


def test_verdict_r7_is_decided_only_where_accuracy_dropped():
    runs = [_run("fp32", 0.98), _run("fp16", 0.98, 0.985), _run("bf16", 0.975, 0.976)]
    v = L.verdict_r7(runs)   # the largest drop is 0.5 points, under the 1-point condition
    assert v.claim == "R7" and v.held is None and "condition did not occur" in v.why
    assert "would trigger" in v.why and v.numbers["largest_drop"] == pytest.approx(0.005)
    # a drop just over 1 point triggers the claim: autocast-off evaluation decides it
    dropped = L.verdict_r7([_run("fp32", 0.98), _run("fp16", 0.965, 0.98)])
    assert dropped.held is True and "won back" in dropped.why
    in_training = L.verdict_r7([_run("fp32", 0.98), _run("fp16", 0.965, 0.966)])
    assert in_training.held is False and "in training" in in_training.why
    assert L.verdict_r7([_run("fp32", 0.98), _run("fp16", 0.971, 0.99)]).held is None  # 0.9 points
    assert not L.verdict_r7([_run("fp32", 0.12), _run("fp16", 0.10, 0.12)]).decided  # at chance
    assert not L.verdict_r7([_run("fp16", 0.90, 0.95)]).decided   # no fp32 run to compare
    with pytest.raises(ValueError, match="fp16 or bf16"):
        L.verdict_r7([_run("fp32", 0.9)])


def test_verdict_r12_rules_only_on_gpu_kernels():
    rows = [dict(op="conv2d 3x3", rel_error=1e-3, device="cuda"),
            dict(op="attention (SDPA)", logit_scale=1.0, rel_error=1.28e-3, device="cuda"),
            dict(op="attention (SDPA)", logit_scale=32.0, rel_error=5e-3, device="cuda")]
    v = L.verdict_r12(rows)
    # decided at the article's own condition (standard scaling, x1: ratio 1.28 <= 1.5); sharper
    # logits (x32: ratio 5) are a sensitivity row that flips the first part: partly held
    assert v.claim == "R12" and v.outcome == "partly held" and "5.00x at logit scale 32" in v.measured
    assert [p.held for p in v.parts] == [False, False] and "no op list" in v.why
    assert "register_autocast" in v.why and "half a bit" in v.why
    assert v.sensitivity[0].held is True and "did not hold at the standard" in v.why
    assert L.verdict_r12([rows[0], rows[1]]).outcome == "did not hold"   # ratio 1.28, no row
    edge = [rows[0], dict(rows[1], rel_error=1.6e-3)]
    assert L.verdict_r12(edge).parts[0].held is True
    assert L.verdict_r12([rows[0], dict(rows[1], rel_error=1.4e-3)]).parts[0].held is False
    listed = {"parameters": ["device_type", "op_list"], "op_list_parameters": ["op_list"]}
    assert L.verdict_r12([rows[0], dict(rows[1], rel_error=2e-3)], listed).outcome == "held"
    assert L.autocast_op_list_api()["op_list_parameters"] == []
    cpu = L.verdict_r12([dict(r, device="cpu") for r in rows])
    assert not cpu.decided and "GPU kernels" in cpu.why
    with pytest.raises(ValueError, match="convolution and attention"):
        L.verdict_r12(rows[:1])


# --- the fastest step -----------------------------------------------------------------------------

def test_fastest_row_and_the_published_figure():
    rows = [_row("a", 1000.0, 10.0, loss=2.0), _row("nan", 9000.0, 10.0, loss=float("nan")),
            _row("b", 3000.0, 10.0, loss=1.5), {"label": "oom", "status": "out of memory"}]
    assert L.fastest_row(rows)["label"] == "b"
    assert L.fastest_row([rows[1], rows[3]]) is None
    out = L.fastest_against_published(rows[2], rows[0])
    assert out["share_of_published"] == pytest.approx(3000.0 / L.PUBLISHED_FASTEST["img_per_s"])
    assert out["comparable"] and not out["beats_published"] and "3.00x fp32" in out["text"]
    cpu = L.fastest_against_published(dict(rows[2], **CPU), dict(rows[0], **CPU))
    assert cpu["share_of_published"] is None and cpu["beats_published"] is None
    assert not cpu["comparable"] and "not compared" in cpu["text"] and "%" not in cpu["text"]
    with pytest.raises(ValueError, match="fp32 must be a measured row"):
        L.fastest_against_published(rows[2], rows[3])
    with pytest.raises(ValueError, match="row must be a measured row"):
        L.fastest_against_published(dict(rows[1], status="error"), rows[0])


# --- the quick profile decides nothing --------------------------------------------------------------

@pytest.mark.slow  # about 15 s: the whole quick profile of lesson 04 on a CPU
def test_quick_profile_decides_no_claim():
    """Issue 15.2: the quick profile's rows (a CPU, 1 warm-up + 2 timed steps) and digits runs
    at chance give "not decided here" with a reason for every claim the lesson decides."""
    quick = measure.standard_settings(quick=True)
    cfgs = [c for c in L.lesson_configs("resnet18", 2, 16, num_classes=10, compile_precision=None)
            if not c.channels_last and c.optimizer == "sgd" and c.impl == quick["impl"]
            and c.precision in ("fp32", "fp16")]
    rows = measure.run_configs(cfgs, "cpu", warmup=quick["warmup"], steps=quick["steps"],
                               progress=False)
    assert all(r["status"] == "ok" and r["warmup"] == 1 for r in rows), rows
    fp32, half = L.plain_row(rows, "fp32", "resnet18"), L.plain_row(rows, "fp16", "resnet18")
    selective = measure.find_row(rows, model="resnet18-selective")
    digits = dict(model="resnet18", epochs=1, batch_size=16, image_size=16, small_input=False,
                  max_train=16, max_test=32)
    amp_run = L.digits_accuracy(precision="fp16", device="cpu", **digits)
    sel_run = L.digits_accuracy(precision="fp16", device="cpu",
                                **dict(digits, model="resnet18-selective"))
    variant = L.digits_accuracy(precision="fp16", device="cpu", eps=1e-7, **digits)
    verdicts = [L.verdict_b1(fp32, half), L.verdict_b2(fp32, half),
                L.verdict_r6(L.compare_r6(fp32, half, selective)),
                L.verdict_r4(half, selective, amp_run, sel_run),
                L.verdict_r5(L.adam_precision_facts("cpu"), L.multi_tensor_status(),
                             [amp_run, variant]),
                L.verdict_r7([amp_run, sel_run, variant]),
                L.verdict_r12(L.autocast_error_by_op("cpu", "fp16", logit_scales=(1.0, 8.0)))]
    assert sorted(v.claim for v in verdicts) == sorted(L.DECIDES)
    for v in verdicts:
        if v.claim == "R5":  # its eps and _multi_tensor parts are facts of the optimizer, not timings
            assert v.parts[1].held is None and "not decided" in v.parts[1].why
            continue
        assert v.outcome == claims.UNDECIDED and v.why, str(v)
        assert "held" not in v.why and "did not hold" not in v.why
    assert not L.fastest_against_published(L.fastest_row(rows), fp32)["comparable"]


# --- the figure -----------------------------------------------------------------------------------

def test_throughput_memory_plot():
    rows = [_row("fp32", 1000.0, 20.0, "fp32"), _row("fp16 a", 3000.0, 10.0),
            _row("fp16 b", 3500.0, 10.5, idle=0.0004), _row("bf16", None, None, "bf16", status="skipped")]
    fig = perf_plots.throughput_memory(rows)
    assert {t.name for t in fig.data} == {"fp32", "fp16"}
    assert sum(len(t.x) for t in fig.data) == 3
    assert "(GiB)" in fig.layout.xaxis.title.text and "(img/s)" in fig.layout.yaxis.title.text
    assert "bf16" in fig.layout.title.text  # the row left out is named
    hover = [t for t in fig.data if t.name == "fp16"][0].text
    assert "GPU idle 0.04% of the step" in hover[1]  # a small nonzero share is not shown as 0


def test_speeds_that_decide_nothing_carry_the_gates_reason_beside_them():
    """On a CPU (2 timed steps) the chart of speeds and the table of ratios say why they decide
    nothing, from the gate the claims use; a run that could decide shows no caveat."""
    cpu = [_row("fp32", 12.8, None, "fp32", **CPU), _row("fp32 cl", 90.5, None, "fp32", **CPU),
           _row("bf16", None, None, "bf16", status="skipped", **CPU)]
    caveat = L.timing_caveat(cpu)
    reason = claims.rows_timing_gate(*cpu[:2])
    assert reason and caveat == (f"Not a speed comparison: {reason}; each img/s is the median of "
                                 f"2 timed steps.")
    assert L.timing_caveat([_row("fp32", 1000.0, 20.0, "fp32", steps=15, warmup=5),
                            _row("fp16", 3000.0, 10.0, steps=15, warmup=5)]) == ""
    assert L.timing_caveat([_row("bf16", None, None, status="skipped")]) == ""
    parts = dict(params_gib=0.1, grads_gib=0.1, optimizer_state_gib=0.1, activations_gib=0.2)
    fig = perf_plots.throughput_memory([dict(r, **parts) for r in cpu], caveat=caveat)
    note = fig.layout.annotations[-1].text
    assert note.replace("<br>", " ").startswith("Not a speed comparison: timed on cpu")
    assert fig.layout.height > 480 and fig.layout.margin.b > 60
    plain = perf_plots.throughput_memory([dict(r, **parts) for r in cpu])
    assert not plain.layout.annotations and plain.layout.height == 480


def test_throughput_memory_plot_counts_memory_on_a_cpu():
    parts = dict(params_gib=0.1, grads_gib=0.1, optimizer_state_gib=0.1, activations_gib=0.2)
    fig = perf_plots.throughput_memory([_row("a", 10.0, None, "fp32", idle=None, **parts)])
    assert fig.data[0].x[0] == pytest.approx(0.5)
    assert "counted" in fig.layout.xaxis.title.text and "GPU idle" not in fig.data[0].text[0]
    with pytest.raises(ValueError, match="measured"):
        perf_plots.throughput_memory([_row("a", None, None, status="skipped")])
