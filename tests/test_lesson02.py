"""Lesson 02 (amp_lessons.lessons.l02_amp_loop): FP32 vs AMP, the trainer's cost and the GPU's
idle share, autocast dtypes, the mistakes, and the claims it decides (B3, B5, B6, B7) - never B1/B2."""
import warnings

import pytest
import torch

from amp_lessons.publish import claims
from amp_lessons.data import digits_loaders
from amp_lessons.lessons import l02_amp_loop as L
from amp_lessons.models import build_digits_model

QUICK = dict(model="cnn", width=4, image_size=16, batch_size=128, progress=False)


def test_lesson_decides_exactly_its_registered_claims():
    assert L.LESSON == "02"
    assert sorted(L.DECIDES) == sorted(c.id for c in claims.CLAIMS.values() if c.lesson == "02")
    assert all(claims.CLAIMS[c].lesson == "04" for c in L.OTHERS_SHOWN)


# --- FP32 vs AMP ---------------------------------------------------------------------------------

def test_compare_precisions_rows_and_reasons(monkeypatch):
    real = L.check_precision

    def no_bf16(precision, device=None):
        if L.normalize_precision(precision) == "bf16":
            raise ValueError("precision 'bf16' needs a GPU with native bfloat16")
        return real(precision, device)

    monkeypatch.setattr(L, "check_precision", no_bf16)
    rows = L.compare_precisions(["fp32", "amp", "bf16"], epochs=1, **QUICK)
    assert [r["precision"] for r in rows] == ["fp32", "fp16", "bf16"]
    assert [r["ran"] for r in rows] == [True, True, False]
    assert "native bfloat16" in rows[2]["reason"] and rows[2]["run"] is None
    assert all(0 <= r["accuracy_pct"] <= 100 and r["epoch_time_s"] > 0 for r in rows[:2])
    assert all(r["run"].trainer is None for r in rows[:2])  # memory freed between runs
    # the same start: identical first losses up to fp16 rounding
    first = [r["run"].history[0].loss for r in rows[:2]]
    assert first[0] == pytest.approx(first[1], rel=1e-2)
    with pytest.raises(ValueError, match="precision must be one of"):
        L.compare_precisions(["fp8"], epochs=1, **QUICK)


# --- the trainer's cost and the GPU's idle share -------------------------------------------------

TINY = dict(model="mlp", batch_size=32, warmup=1, steps=2, rounds=2, profile_steps=1)


def test_step_overhead_on_a_cpu_times_both_loops_and_says_idle_is_not_measured():
    rows = L.step_overhead(["fp32", "fp16"], device="cpu", **TINY)
    assert [(r["precision"], r["loop"]) for r in rows] == [
        (p, L.LOOPS[k]) for p in ("fp32", "fp16") for k in ("hand", "trainer")]
    assert all(r["step_ms"] > 0 and r["step_ms_q1"] <= r["step_ms"] <= r["step_ms_q3"]
               for r in rows)
    assert all(r["steps"] == 4 and r["timer"] == "perf_counter" for r in rows)  # 2 rounds x 2
    assert all(r["gpu_busy_ms"] is None and r["gpu_idle"] is None for r in rows)
    assert all(r["idle_note"].startswith("not measured on a CPU") for r in rows)
    hand, trained = rows[0], rows[1]
    assert hand["overhead_pct"] is None
    assert trained["overhead_pct"] == pytest.approx(
        100 * (trained["step_ms"] / hand["step_ms"] - 1))
    table = L.overhead_table(rows)
    assert "GPU idle" in table and "n/a" in table and "Trainer.train_step" in table
    summary = L.overhead_summary(rows)
    assert "These timings decide nothing: timed on cpu" in summary
    assert "idle up to" not in summary


def test_step_overhead_idle_share_from_the_busy_time(monkeypatch):
    calls = []

    def fake_busy(step, x, y, device, steps):
        calls.append(steps)
        return 1e-6, "fake profiler"

    monkeypatch.setattr(L, "gpu_busy", fake_busy)
    rows = L.step_overhead(["fp32"], device="cpu", **TINY)
    assert calls == [1, 1]  # each loop profiled once, with profile_steps steps
    for r in rows:
        assert r["gpu_idle"] == pytest.approx(1 - 1e-6 / r["step_ms"])
        assert r["idle_note"] == "fake profiler"
    assert "%" in L.overhead_table(rows).splitlines()[2]


def _overhead_rows(device_type="cuda", idle=(0.6, 0.7), steps=60, warmup=10):
    rows = []
    for p, share in zip(("fp32", "fp16"), idle):
        for loop, ms, cost in (("hand", 2.0, None), ("trainer", 2.2, 10.0)):
            rows.append({"precision": p, "loop": L.LOOPS[loop], "step_ms": ms,
                         "gpu_busy_ms": ms * (1 - share), "gpu_idle": share,
                         "idle_note": "", "overhead_pct": cost, "steps": steps,
                         "warmup": warmup, "timer": "CUDA events", "device_type": device_type})
    return rows


def test_overhead_summary_on_a_gpu_names_the_idle_share():
    launch_bound = L.overhead_summary(_overhead_rows(idle=(0.6, 0.0004)))
    assert "fp32: Trainer.train_step 2.200 ms against the hand loop's 2.000 ms (+10.0%" in launch_bound
    assert "GPU idle 0.04% of each trainer step" in launch_bound  # never rounded to 0%
    assert "idle up to 60% of a step" in launch_bound and "host and launch overhead" in launch_bound
    busy = L.overhead_summary(_overhead_rows(idle=(0.05, 0.1)))
    assert "mostly GPU work" in busy
    few = L.overhead_summary(_overhead_rows(steps=3))
    assert "decide nothing: only 3 timed steps" in few
    with pytest.raises(ValueError, match="at least one step_overhead row"):
        L.overhead_summary([])
    with pytest.raises(ValueError, match="at least one step_overhead row"):
        L.overhead_table([])


def test_show_overhead_shows_the_text_tables_rows_as_html(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    rows = _overhead_rows(idle=(0.6, 0.0004))
    L.show_overhead(rows)
    (bundle,) = shown
    assert bundle["text/plain"] == L.overhead_table(rows)
    assert bundle["text/html"].count("<tr>") == len(rows) + 1
    assert "<th" in bundle["text/html"] and ">0.04%</td>" in bundle["text/html"]
    assert ">+10.0%</td>" in bundle["text/html"]
    with pytest.raises(ValueError, match="at least one step_overhead row"):
        L.show_overhead([])


def test_gpu_busy_is_not_measured_on_a_cpu():
    busy, note = L.gpu_busy(lambda x, y: None, torch.zeros(1), torch.zeros(1), "cpu")
    assert busy is None and note.startswith("not measured on a CPU")
    with pytest.raises(ValueError, match="steps must be a whole number >= 1"):
        L.gpu_busy(lambda x, y: None, torch.zeros(1), torch.zeros(1), "cpu", steps=0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(steps=0), "steps must be a whole number >= 1"),
    (dict(rounds=0), "rounds must be a whole number >= 1"),
    (dict(warmup=0), "warmup must be a whole number >= 1"),
    (dict(lr=0.0), "lr must be a finite number > 0"),
    (dict(precisions=["fp9"]), "precision must be one of"),
])
def test_step_overhead_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        L.step_overhead(**{**dict(TINY, device="cpu"), **kwargs})


# --- B1 and B2: shown beside the digits numbers, never ruled on here -----------------------------

def _row(p, t, m):
    return {"precision": p, "ran": True, "epoch_time_s": t, "peak_memory_mib": m}


@pytest.mark.parametrize("device_type,idle,speed,why", [
    ("cuda", (0.6, 0.7), 0.8, "the digits CNN is launch-bound: the GPU is idle 70% of each step"),
    ("cuda", (0.02, 0.05), 3.0, "not the workload the claim is about"),  # even a busy 3x run
    ("cpu", None, 2.0, "timed on cpu"),
])
def test_lesson02_never_rules_on_b1_or_b2(device_type, idle, speed, why):
    rows = [_row("fp32", speed, 100.0), _row("fp16", 1.0, 40.0)]
    overhead = _overhead_rows(device_type, idle or (0.5, 0.5))
    if idle is None:
        for r in overhead:
            r["gpu_idle"] = r["gpu_busy_ms"] = None
    verdicts = L.b1_b2_context(rows, overhead, device_type)
    assert [v.claim for v in verdicts] == ["B1", "B2"]
    assert all(v.held is None and v.outcome == "not decided here" for v in verdicts)
    assert all(why in v.why and "lesson 04 decides" in v.why for v in verdicts)
    assert f"{speed:.2f}x" in verdicts[0].measured and "60% saved" in verdicts[0].measured
    # and the registry refuses a ruling from this lesson outright
    with pytest.raises(ValueError, match="decided by lesson 04"):
        claims.decide("B1", L.LESSON, "x", True, "y")


def test_b1_b2_context_needs_fp32_and_fp16():
    with pytest.raises(ValueError, match="an fp32 and an fp16 row that ran"):
        L.b1_b2_context([_row("fp32", 1.0, None)], [], "cpu")
    cpu = L.b1_b2_context([_row("fp32", 1.0, None), _row("fp16", 2.0, None)], [], "cpu")
    assert "no CUDA memory counter on a CPU" in cpu[0].measured


# --- B5: what autocast runs in 16 bits -----------------------------------------------------------

def test_autocast_report_table_is_device_agnostic_and_b5_partly_held():
    torch.manual_seed(0)
    net, _ = build_digits_model("cnn", 4)
    x, y = next(iter(digits_loaders(8, 16)[0]))
    before = net.features[0][1].running_mean.clone()
    texts = []
    for dtype in (torch.bfloat16, torch.float16):
        report = L.autocast_report(net, x, y, "cpu", dtype)
        kinds = {k: d for _, k, d, _ in report.layers}
        assert kinds["Conv2d"] == kinds["Linear"] == kinds["BatchNorm2d"] == dtype
        assert report.loss == torch.float32
        assert report.parameters == report.gradients == {torch.float32}
        assert all(g == dtype for _, _, _, g in report.layers)
        texts.append(report.format())
        parts = L.b5_parts(report)
        assert [p["measured"] for p in parts] == [
            "loss float32", "gradients into layer outputs: 16-bit",
            "parameters float32, their gradients float32"]
        verdict = L.verdict_b5(report)
        assert verdict.claim == "B5" and verdict.lesson == "02"
        assert verdict.numbers["parts"] == parts
        if dtype == torch.bfloat16:   # the claim is about FP16: bf16 decides nothing
            assert verdict.held is None and "about FP16" in verdict.why
            continue
        # three parts: the loss is not fp16; backward is, through the 16-bit ops; the weight
        # gradients come back fp32 through the backward of autocast's cast
        assert verdict.outcome == "partly held" and verdict.held is False
        assert [p.held for p in verdict.parts] == [False, True, True]
        assert "cross_entropy is on autocast's float32 list" in verdict.why
        assert "backward of that cast returns the weight gradients in float32" in verdict.why
        assert "nothing is restored" not in verdict.why
    assert texts[0] == texts[1]  # fp16 and bf16 print the same table
    lines = texts[0].splitlines()
    assert lines[0].split() == ["tensor", "layer", "dtype", "gradient", "dtype"]
    assert lines[-1].split() == ["every", "parameter", "weights", "float32", "float32"]
    assert all(p.grad is None for p in net.parameters())
    assert not torch.equal(before, net.features[0][1].running_mean)  # a real training forward
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        L.autocast_report(net, x, y, "cpu", torch.float32)


def test_b5_verdict_holds_when_the_loss_and_backward_are_16_bit():
    low = torch.float16
    report = L.AutocastReport(layers=[("fc", "Linear", low, low)], loss=low,
                              parameters={torch.float32}, gradients={torch.float32}, low=low,
                              input=torch.float32)
    verdict = L.verdict_b5(report)
    assert verdict.held is True and verdict.outcome == "held"
    assert verdict.measured.startswith("loss 16-bit")
    assert [r["what"] for r in report.rows()] == ["input batch", "fc", "loss", "every parameter"]
    # the third part fails where the parameter gradients are not float32: then none of the
    # parts but the loss and backward held (partly), and with a float32 loss as well, two of three
    half_grads = L.AutocastReport(layers=[("fc", "Linear", low, low)], loss=torch.float32,
                                  parameters={torch.float32}, gradients={low}, low=low,
                                  input=torch.float32)
    v = L.verdict_b5(half_grads)
    assert [p.held for p in v.parts] == [False, True, False] and v.outcome == "partly held"
    none_16 = L.AutocastReport(layers=[("fc", "Linear", torch.float32, torch.float32)],
                               loss=torch.float32, parameters={torch.float32},
                               gradients={torch.float32}, low=low, input=torch.float32)
    v = L.verdict_b5(none_16)   # nothing ran in 16 bits: the claim did not hold, part 3 undecided
    assert [p.held for p in v.parts] == [False, False, None] and v.outcome == "did not hold"


def test_claim_dtype_is_fp16_where_autocast_runs_it():
    assert L.claim_dtype("cpu") in (torch.float16, torch.bfloat16)
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 6):
        assert L.claim_dtype("cpu") == torch.float16


def test_dtype_label():
    assert L.dtype_label(torch.bfloat16, torch.bfloat16) == "16-bit"
    assert L.dtype_label(torch.float32, torch.float16) == "float32"


# --- B7: a custom autograd Function under autocast -----------------------------------------------

class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class MatmulAMP(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class MatmulCasting(Matmul):  # a backward that casts its gradient itself also works unchanged
    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.to(x.dtype)
        return grad @ w, grad.t() @ x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_custom_function_needs_custom_fwd_and_b7_did_not_hold(dtype):
    plain = L.custom_function_under_autocast(Matmul, "cpu", dtype)
    fixed = L.custom_function_under_autocast(MatmulAMP, "cpu", dtype)
    assert plain["ran"] is False and plain["error"].startswith("RuntimeError: ")
    assert "dtype" in plain["error"] and plain["grad_error"] is None
    assert fixed["ran"] is True and fixed["output"] == "16-bit"
    assert fixed["grad"] == "float32, float32" and fixed["grad_error"] < L.B7_GRAD_TOLERANCE
    verdict = L.verdict_b7(plain, fixed)
    assert verdict.claim == "B7" and "failed in backward" in verdict.measured
    if dtype == torch.float16:
        assert verdict.held is False and "custom_fwd" in verdict.why
    else:   # the claim is about FP16: a bf16 run shows the same failure but decides nothing
        assert verdict.held is None and "about FP16" in verdict.why


def test_b7_holds_when_the_unchanged_function_runs_correctly():
    unchanged = L.custom_function_under_autocast(MatmulCasting, "cpu", L.claim_dtype("cpu"))
    assert unchanged["ran"] and unchanged["grad_error"] < L.B7_GRAD_TOLERANCE
    verdict = L.verdict_b7(unchanged, unchanged)
    assert verdict.held is True
    wrong = dict(unchanged, grad_error=0.5)  # ran, but with wrong gradients
    assert L.verdict_b7(wrong, unchanged).held is False   # the control (custom_fwd) was right
    # the control failed too, or a gradient error is NaN: the experiment cannot rule
    assert L.verdict_b7(wrong, wrong).held is None
    nan = dict(unchanged, grad_error=float("nan"))
    assert L.verdict_b7(nan, nan).held is None and L.verdict_b7(nan, unchanged).held is False


def test_b3_with_a_non_finite_number_decides_nothing():
    row = {"scale": 65536.0, "threshold_applied": 1 / 65536, "true_grad_norm": 2.0,
           "grad_norm_used": 1.0, "accuracy_pct": 10.0}
    right = dict(row, threshold_applied=1.0, accuracy_pct=90.0)
    assert L.verdict_b3([row, right]).held is False
    for key in ("threshold_applied", "scale", "accuracy_pct"):
        v = L.verdict_b3([dict(row, **{key: float("nan")}), right])
        assert v.held is None and "not finite" in v.why, key
    assert L.verdict_b3([row, dict(right, scale=None)]).held is None


def test_custom_function_bad_arguments():
    with pytest.raises(ValueError, match="function must be a torch.autograd.Function subclass"):
        L.custom_function_under_autocast(torch.nn.Linear, "cpu")
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        L.custom_function_under_autocast(Matmul, "cpu", torch.float32)
    with pytest.raises(ValueError, match="unchanged must be a custom_function_under_autocast row"):
        L.verdict_b7({}, {"ran": True})


# --- B3: clipping before unscale_ ----------------------------------------------------------------

def test_clip_before_unscale_applies_max_norm_over_scale_and_b3_did_not_hold():
    rows = L.clip_order_experiment(max_norm=1.0, epochs=1, model="mlp", progress=False)
    wrong, right = rows
    assert wrong["threshold_applied"] == pytest.approx(1.0 / wrong["scale"])
    assert wrong["grad_norm_used"] == pytest.approx(wrong["threshold_applied"], rel=1e-3)
    assert wrong["true_grad_norm"] > 100 * wrong["grad_norm_used"]
    assert right["threshold_applied"] == 1.0
    assert right["grad_norm_used"] <= 1.0 + 1e-6
    assert right["accuracy_pct"] > wrong["accuracy_pct"]
    verdict = L.verdict_b3(rows, 1.0)
    assert verdict.claim == "B3" and verdict.held is False
    assert "max_norm / scale = 1.53e-05" in verdict.why
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        L.ClipBeforeUnscale(-1.0)


def test_b3_verdict_follows_the_threshold():
    row = {"scale": 1.0, "true_grad_norm": 3.0, "threshold_applied": 1.0, "grad_norm_used": 1.0,
           "accuracy_pct": 90.0}
    v = L.verdict_b3([row, row], 1.0)   # a scale of 1 clips at the stated norm, before or after
    assert [p.held for p in v.parts] == [True, True, None] and v.outcome == "partly held"
    assert "did not occur on its own" in v.parts[2].why and "not measured" in v.parts[2].why
    with pytest.raises(ValueError, match="two rows of clip_order_experiment"):
        L.verdict_b3([row], 1.0)
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        L.verdict_b3([row, row], 0)


# --- B6: the deprecated import -------------------------------------------------------------------

def _caught(*categories):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for c in categories:
            warnings.warn(f"`torch.cuda.amp.X` is deprecated ({c.__name__})", c)
    return caught


def test_b6_verdict_from_the_caught_warnings():
    deprecated = L.verdict_b6(_caught(FutureWarning, UserWarning))
    # deprecated is not wrong: the code runs and only warns
    assert deprecated.claim == "B6" and deprecated.held is True
    assert deprecated.outcome == "held, deprecated" and "torch.amp.GradScaler" in deprecated.why
    assert deprecated.numbers["warnings"] == ["`torch.cuda.amp.X` is deprecated (FutureWarning)"]
    assert "1 deprecation warning(s)" in deprecated.measured
    clean = L.verdict_b6(_caught(UserWarning))  # "CUDA not available" is no deprecation
    assert clean.held is True and clean.outcome == "held"
    gone = L.verdict_b6([], ImportError("cannot import name 'GradScaler'"))
    assert gone.held is False and "import failed" in gone.measured
    with pytest.raises(ValueError, match="caught must be the list"):
        L.verdict_b6("FutureWarning")


# --- the published claims --------------------------------------------------------------------------

def test_own_verdicts_refuses_other_claims_and_repeats():
    mine = [claims.decide(c, "02", "m", False, "w") for c in L.DECIDES]
    assert L.own_verdicts(mine) == mine
    b1 = L.b1_b2_context([_row("fp32", 1.0, None), _row("fp16", 2.0, None)], [], "cpu")[0]
    with pytest.raises(ValueError, match="lesson 02's own, for claims B3, B5, B6, B7, B8; got B1"):
        L.own_verdicts(mine + [b1])
    with pytest.raises(ValueError, match=f"each claim once; {mine[0].claim} appears twice"):
        L.own_verdicts(mine + mine[:1])
    with pytest.raises(ValueError, match="claims.Verdict objects"):
        L.own_verdicts([{"claim": "B3", "held": True}])


# --- the scheduler and .half() mistakes ----------------------------------------------------------

def test_scheduler_on_skipped_steps():
    naive, fixed = L.scheduler_on_skipped_steps(steps=12, warmup=40)
    assert naive["skipped_steps"] == fixed["skipped_steps"] >= 1
    assert naive["scheduler_steps"] == 12 and fixed["scheduler_steps"] == fixed["optimizer_steps"]
    assert "before `optimizer.step()`" in naive["warning"] and fixed["warning"] == ""
    assert naive["lr"] > naive["lr_expected"]  # the warm-up ran ahead
    assert fixed["lr"] == pytest.approx(fixed["lr_expected"])
    with pytest.raises(ValueError, match="warmup must be a whole number >= 1"):
        L.scheduler_on_skipped_steps(warmup=0)
    with pytest.raises(ValueError, match="steps must be a whole number >= 1"):
        L.scheduler_on_skipped_steps(steps=0)


def test_half_model_errors():
    out = L.half_model_errors()
    assert out["torch"] == "ValueError: Attempting to unscale FP16 gradients."
    assert out["trainer"].startswith("ValueError: model parameters must stay float32")


def test_loops_agree_bitwise_on_the_cpu():
    for precision in ("fp32", "fp16"):
        out = L.loops_agree(precision, steps=3, width=4, image_size=16, device="cpu")
        assert out == {"precision": precision, "steps": 3, "equal": True, "max_abs_diff": 0.0}
    with pytest.raises(ValueError, match="steps must be a whole number >= 1"):
        L.loops_agree(steps=0, device="cpu")


def test_loops_agree_notices_a_different_update(monkeypatch):
    real = L.bench.hand_step

    def doubled_lr(model, optimizer, precision, device):  # a hand loop that is not the recipe
        for group in optimizer.param_groups:
            group["lr"] *= 2
        return real(model, optimizer, precision, device)

    monkeypatch.setattr(L.bench, "hand_step", doubled_lr)
    out = L.loops_agree("fp32", steps=2, width=4, image_size=16, device="cpu")
    assert out["equal"] is False and out["max_abs_diff"] > 0


# --- sensitivity rows, and claim B8 ----------------------------------------------------------------

def _clip_rows(scale, precision="fp16", top=3.0):
    wrong = {"scale": scale, "true_grad_norm": 2.0, "max_true_grad_norm": top,
             "threshold_applied": 1.0 / scale, "grad_norm_used": 1.0 / scale,
             "accuracy_pct": 10.0, "precision": precision}
    right = dict(wrong, threshold_applied=1.0, grad_norm_used=1.0, accuracy_pct=90.0)
    return [wrong, right]


def test_b3_parts_and_the_unscaled_row_name_the_condition():
    nan = L.clip_nan_check(1.0, "cpu")
    assert nan["clipped_finite"] is False and nan["total_norm"] != nan["total_norm"]  # NaN
    v = L.verdict_b3(_clip_rows(65536.0), 1.0, nan, unscaled_rows=_clip_rows(1.0, "bf16"))
    assert [p.held for p in v.parts] == [False, True, None] and v.outcome == "partly held"
    assert "stays NaN" in v.why and "produced on purpose" in v.why
    assert v.sensitivity[0].held is True and "bf16" in v.sensitivity[0].setting
    assert "held with bf16 autocast and no GradScaler" in v.why
    assert "did not hold with fp16 and a GradScaler (scale 65536)" in v.why
    # gradients that explode on their own are named; still no unclipped run to compare
    v = L.verdict_b3(_clip_rows(65536.0, top=50.0), 1.0)
    assert "exploded on their own" in v.parts[2].why and v.parts[2].held is None


def test_b3_unscaled_rows_come_from_a_bf16_run_without_a_scaler():
    rows = L.clip_order_experiment(1.0, "cpu", "bf16", model="mlp", epochs=1, progress=False)
    assert all(r["scale"] == 1.0 and r["threshold_applied"] == 1.0 for r in rows)


def test_b5_hand_written_loss_row_flips_the_loss_part():
    torch.manual_seed(0)
    net, size = L.build_digits_model("mlp")
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    dtype = L.claim_dtype("cpu")
    ce = L.autocast_report(net, x, y, "cpu", dtype)
    mae = L.autocast_report(net, x, y, "cpu", dtype, loss_fn=L.absolute_error_loss)
    assert mae.loss == dtype and ce.loss == torch.float32
    v = L.verdict_b5(ce, [("with a hand-written loss (mean absolute error)", mae)])
    if dtype == torch.float16:
        assert v.sensitivity[0].held is True and v.outcome == "partly held"
        assert "held with a hand-written loss" in v.why and "cross_entropy as the loss" in v.why
    else:  # bf16 decides nothing on an FP16 claim, and says so
        assert v.held is None and v.sensitivity[0].held is None


def test_b6_replacement_row_and_b7_plain_layers_row():
    v = L.verdict_b6(_caught(FutureWarning), replacement=[])
    assert v.outcome == "held, deprecated" and v.sensitivity[0].held is True
    assert "without a deprecation warning" in v.sensitivity[0].why
    failed = {"function": "F", "ran": False, "error": "RuntimeError: x", "output": "-",
              "grad": "-", "grad_error": None, "dtype": "float16"}
    fixed = dict(failed, ran=True, error="", grad="float32, float32", grad_error=1e-3)
    v = L.verdict_b7(failed, fixed, {"model": "SimpleNet", "accuracy": 0.9, "classes": 10})
    assert v.outcome == "partly held" and v.sensitivity[0].held is True
    assert "held with a model built only from torch.nn layers (SimpleNet)" in v.why
    assert "did not hold with a layer written as a custom autograd Function" in v.why
    # a model near chance decides nothing, so the verdict stays as the custom Function left it
    v = L.verdict_b7(failed, fixed, {"model": "SimpleNet", "accuracy": 0.12, "classes": 10})
    assert v.outcome == "did not hold" and v.sensitivity[0].held is None


def test_b8_gradscaler_after_backward_shrinks_the_update_by_the_scale():
    fp16 = L.scale_order_experiment("cpu", torch.float16, 2.0 ** 16)
    bf16 = L.scale_order_experiment("cpu", torch.bfloat16)
    assert fp16[0]["ratio"] == 1.0 and fp16[1]["ratio"] < 1e-4
    assert abs(bf16[1]["ratio"] - 1.0) < 1e-3     # no scaling: the order does not matter
    v = L.verdict_b8(fp16, bf16)   # without loss scaling the order cannot matter: shown, not ruling
    assert v.claim == "B8" and v.outcome == "did not hold" and "1/scale" in v.why
    assert v.sensitivity[0].held is None and "cannot matter" in v.sensitivity[0].why
    low = L.scale_order_experiment("cpu", torch.float16, 2.0 ** 8)
    v = L.verdict_b8(fp16, bf16, low)
    assert v.sensitivity[0].held is False and "init_scale 256" in v.sensitivity[0].setting
    assert v.outcome == "did not hold"
    assert L.verdict_b8(fp16).held is False
    assert L.verdict_b8(bf16).held is None      # the claim's GradScaler is float16's
    with pytest.raises(ValueError, match="two rows of scale_order_experiment"):
        L.verdict_b8(fp16[:1])
    with pytest.raises(ValueError, match="dtype must be"):
        L.scale_order_experiment("cpu", torch.float32)
