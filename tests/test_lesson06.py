"""Lesson 06 (amp_lessons.lessons.l06_multi_gpu): the FSDP2 wrapping table, the BatchNorm dtype
mix-up, and claims R10c and R11 as claims.Verdicts (never decided on one process or a CPU)."""
import pytest

from amp_lessons.publish import claims
from amp_lessons.measure.distributed import SweepResult
from amp_lessons.lessons import l06_multi_gpu as lesson


def _rows(label, n, step_ms, opt_mib, peak=None, batch=4, units=None):
    return [{"label": label, "model": "m", "strategy": "s", "precision": "bf16", "world_size": n,
             "rank": r, "unit": "img", "batch_size": batch, "step_ms": step_ms + r,
             "per_rank_per_s": 1.0, "peak_gib": peak, "param_mib": 1.0, "grad_mib": 1.0,
             "optimizer_state_mib": opt_mib, "losses": [2.0, 1.0], "fsdp_units": units}
            for r in range(n)]


def test_lesson_declares_the_claims_it_decides():
    assert lesson.LESSON == "06"
    assert lesson.DECIDES == ("R10c", "R11")
    assert all(claims.CLAIMS[c].lesson == "06" for c in lesson.DECIDES)


def test_wrap_configs_cover_every_wrapping_at_every_batch():
    configs = lesson.wrap_configs("resnet50", "bf16", (64, 256), 224, 15, 3)
    assert len(configs) == 2 * len(lesson.WRAPPINGS)
    assert len({c.name for c in configs}) == len(configs)  # labels key the rows: all different
    assert {(c.strategy, c.fsdp_wrap, c.reshard_after_forward) for c in configs} == {
        ("ddp", "blocks", True), ("fsdp2", "bn-units", True), ("fsdp2", "blocks", True),
        ("fsdp2", "blocks", False)}
    assert {c.batch_size for c in configs} == {64, 256}
    with pytest.raises(ValueError, match="batch_sizes"):
        lesson.wrap_configs("resnet50", "bf16", (), 224, 15, 3)
    with pytest.raises(ValueError, match="batch_size"):
        lesson.wrap_configs("resnet50", "bf16", (0,), 224, 15, 3)


def test_wrap_rows_compare_each_wrapping_with_ddp_at_the_same_batch():
    ddp, old, blocks, lazy = (w[0] for w in lesson.WRAPPINGS)
    rows = []
    for n in (1, 2):
        rows += _rows(lesson.wrap_label(ddp, 4), n, 10.0, 2.0)
        rows += _rows(lesson.wrap_label(old, 4), n, 40.0, 2.0, units=70)
        rows += _rows(lesson.wrap_label(blocks, 4), n, 18.0, 2.0, units=17)
        rows += _rows(lesson.wrap_label(lazy, 4), n, 16.0, 2.0, units=17)
    rows += _rows(lesson.wrap_label(ddp, 8), 1, 20.0, 2.0, batch=8)
    rows += _rows(lesson.wrap_label(blocks, 8), 1, 30.0, 2.0, batch=8, units=17)
    table = lesson.wrap_rows(SweepResult(rows=rows, backend="nccl", launched=2))
    assert [(r["processes"], r["batch per rank"]) for r in table][:6] == \
        [(1, 4)] * 4 + [(1, 8)] * 2  # by processes, then batch, then the order of WRAPPINGS
    first = table[:4]
    assert [r["wrapping"] for r in first] == [ddp, old, blocks, lazy]
    assert first[0]["vs DDP"] == pytest.approx(1.0) and first[0]["FSDP units"] is None
    assert first[1]["vs DDP"] == pytest.approx(10 / 40) and first[1]["FSDP units"] == 70
    assert first[3]["vs DDP"] == pytest.approx(10 / 16)
    best = lesson.fsdp_against_ddp(SweepResult(rows=rows, backend="nccl", launched=2), 1)
    assert [(b["batch per rank"], b["best FSDP2"]) for b in best] == [(4, lazy), (8, blocks)]
    assert [b["vs DDP"] for b in best] == [pytest.approx(10 / 16), pytest.approx(20 / 30)]
    assert best[0]["FSDP2 peak GiB"] is None and best[0]["DDP peak GiB"] is None  # CPU rows
    gpu = (_rows(lesson.wrap_label(ddp, 4), 1, 10.0, 2.0, peak=3.0)
           + _rows(lesson.wrap_label(blocks, 4), 1, 12.0, 2.0, peak=2.5, units=17))
    best = lesson.fsdp_against_ddp(SweepResult(rows=gpu, backend="nccl", launched=1), 1)
    assert best == [{"batch per rank": 4, "best FSDP2": blocks, "vs DDP": pytest.approx(10 / 12),
                     "FSDP2 peak GiB": 2.5, "DDP peak GiB": 3.0}]
    two = [r for r in table if r["processes"] == 2 and r["wrapping"] == ddp][0]
    assert two["scaling efficiency (%)"] == pytest.approx(100 * (8 / 0.011) / (2 * 400))


def test_batchnorm_mixup_shows_the_refusal_and_both_fixes():
    rows = lesson.batchnorm_mixup("bf16", "cpu")
    assert len(rows) == 3
    assert rows[0]["outcome"].startswith("refused in forward:")  # the CPU refuses at once
    assert "BFloat16" in rows[0]["outcome"] and "Float" in rows[0]["outcome"]
    assert rows[1]["outcome"] == "runs, output bfloat16"  # fp32 weights under autocast
    assert rows[2]["outcome"] == "runs, output float32"
    with pytest.raises(ValueError, match="precision must be one of"):
        lesson.batchnorm_mixup("fp32", "cpu")


def test_transformer_configs():
    runs, base = lesson.transformer_configs({"d_model": 32}, "bf16", 4, 1e-3, 3, 1)
    assert [r.name for r in runs] == ["ddp bf16", "ddp_zero bf16", "fsdp2 bf16"]
    assert runs[2].fsdp_wrap == "blocks-half-params"  # no BatchNorm: half parameters are fine
    assert base.precision == "fp32" and base.strategy == "ddp" and base.name == "ddp fp32"


def _savings(peak_base, peak_zero, n=2):
    result = SweepResult(rows=_rows("base", n, 10.0, 8.0, peak_base)
                         + _rows("zero", n, 10.0, 4.0, peak_zero), backend="nccl", launched=n)
    return lesson.zero_savings(result, "base", "zero", n)


def test_r10c_verdict_follows_the_measurement():
    held = _savings(10.0, 3.5, n=8)   # at the claim's own 8 ranks: decided on the measurement
    assert held["judged_on"] == "peak memory" and held["saved"] == pytest.approx(0.65)
    assert held["optimizer_state_saved"] == pytest.approx(0.5)
    v = lesson.verdict_r10c(held)
    assert isinstance(v, claims.Verdict) and v.claim == "R10c" and v.outcome == "held"
    less = lesson.verdict_r10c(_savings(10.0, 8.0, n=8))
    assert less.outcome == "did not hold" and "below" in less.why
    # one-sided: 60% is the threshold; above 70% the claim understated it
    assert lesson.verdict_r10c(_savings(10.0, 4.1, n=8)).held is False       # 59%
    assert lesson.verdict_r10c(_savings(10.0, 3.9, n=8)).outcome == "held"   # 61%
    assert lesson.verdict_r10c(_savings(10.0, 2.0, n=8)).outcome == "held, understated"
    rows = lesson.r10c_rows(v, held, [_savings(10.0, 8.0)])
    assert [r["verdict"] for r in rows] == ["held", None]  # comparisons get no verdict
    assert rows[0]["saved per rank (%)"] == pytest.approx(65.0)
    assert rows[1]["optimizer state saved per rank (%)"] == pytest.approx(50.0)


def _sweep(points, base_peak=10.0):
    """ZeRO's peak and optimizer state per rank at each world size, against a DDP baseline."""
    rows = []
    for n, (peak, state_mib) in points.items():
        rows += _rows("base", n, 10.0, 8.0, base_peak) + _rows("zero", n, 10.0, state_mib, peak)
    return SweepResult(rows=rows, backend="nccl", launched=max(points))


def test_r10c_from_a_memory_model_validated_at_the_ranks_that_ran():
    # rest 2 GiB + 4 GiB of state / N: 6 GiB at 1 rank, 4 at 2, predicted 2.5 at 8 (75% saved)
    result = _sweep({1: (6.0, 4096.0), 2: (4.0, 2048.0)})
    model = lesson.zero_memory_model(result, "base", "zero", [1, 2])
    assert model["validated"] and model["largest_error"] == pytest.approx(0.0)
    assert model["predicted_zero_peak_gib"] == pytest.approx(2.5)
    assert model["predicted_saved"] == pytest.approx(0.75) and not model["measured_at_ranks"]
    savings = lesson.zero_savings(result, "base", "zero", 2)
    v = lesson.verdict_r10c(savings, model)
    # predicted to hold at 8 ranks, measured 60% at the 2 that ran: the row agrees
    assert v.outcome == "held, understated" and "predicted for 8 ranks (not run)" in v.why
    assert "8 ranks did not run here" in v.measured and v.sensitivity[0].held is True
    # the model predicts 59% and 61% at 8 ranks on either side of the threshold; at the 2 ranks
    # that ran both save less than 60%, so the held one is partly held and names both counts
    for rest, outcome in ((4.1 - 0.5, "did not hold"), (3.9 - 0.5, "partly held")):
        r = _sweep({1: (rest + 4.0, 4096.0), 2: (rest + 2.0, 2048.0)})
        m = lesson.zero_memory_model(r, "base", "zero", [1, 2])
        v = lesson.verdict_r10c(lesson.zero_savings(r, "base", "zero", 2), m)
        assert v.outcome == outcome and v.sensitivity[0].held is False
    assert "held at 8 ranks (predicted)" in v.why and "did not hold at the 2 ranks that ran" in v.why
    # the model must meet the measured peak within 5%: 3.6% off is validated, 11% is not
    near = _sweep({1: (6.0, 4096.0), 2: (4.15, 2048.0)})
    m = lesson.zero_memory_model(near, "base", "zero", [1, 2])
    assert m["validated"] is True and m["largest_error"] == pytest.approx(0.15 / 4.15)
    # a model that misses the measured peak at 2 ranks by more than 5% decides nothing
    off = _sweep({1: (6.0, 4096.0), 2: (4.5, 2048.0)})
    m = lesson.zero_memory_model(off, "base", "zero", [1, 2])
    assert m["validated"] is False and m["largest_error"] == pytest.approx(0.5 / 4.5)
    v = lesson.verdict_r10c(lesson.zero_savings(off, "base", "zero", 2), m)
    assert v.outcome == "not decided here" and "8 ranks and only 2 ran" in v.why
    # one rank count only: no model, not decided (the old verdict ruled at 2 ranks)
    only = _sweep({2: (4.0, 2048.0)})
    m = lesson.zero_memory_model(only, "base", "zero", [2])
    assert m["validated"] is None and "two rank counts" in m["why"]
    v = lesson.verdict_r10c(lesson.zero_savings(only, "base", "zero", 2), m)
    assert not v.decided and "two rank counts" in v.why
    assert not lesson.verdict_r10c(lesson.zero_savings(only, "base", "zero", 2)).decided


def test_r10c_is_not_decided_where_a_peak_did_not_repeat():
    """A run whose repeats' peaks differ by over 10% decides nothing (its time spread does not
    matter to a memory claim); the reason names the run."""
    rows = _rows("base", 8, 10.0, 8.0, 10.0) + _rows("zero", 8, 10.0, 4.0, 3.5)
    for r in rows:
        r["spread"] = 0.5  # noisy timing: irrelevant to peak memory
    steady = SweepResult(rows=rows, backend="nccl", launched=8)
    assert lesson.verdict_r10c(lesson.zero_savings(steady, "base", "zero", 8)).outcome == "held"
    rows[-1]["peak_spread"] = 0.12  # one rank of the ZeRO run
    savings = lesson.zero_savings(SweepResult(rows=rows, backend="nccl", launched=8),
                                  "base", "zero", 8)
    assert savings["noisy"].startswith("'zero' noisy: peak memory of the repeats differs by 12%")
    v = lesson.verdict_r10c(savings)
    assert v.outcome == "not decided here" and "did not repeat" in v.why


def test_wrap_rows_carry_the_repeat_spread_and_say_when_it_is_too_wide():
    ddp = lesson.WRAPPINGS[0][0]
    rows = _rows(lesson.wrap_label(ddp, 4), 2, 10.0, 2.0)
    rows[0]["spread"], rows[1]["spread"] = 0.02, 0.15  # the worse rank speaks for the run
    row = lesson.wrap_rows(SweepResult(rows=rows, backend="nccl", launched=2))[0]
    assert row["repeat spread (%)"] == pytest.approx(15.0)
    assert "repeats differ by 15%" in row["note"] and "decides nothing" in row["note"]


def test_r10c_is_not_decided_on_a_nan_saving():
    for bad in (float("nan"), -float("inf")):
        v = lesson.verdict_r10c(dict(_savings(10.0, 3.5, n=8), saved=bad))
        assert v.outcome == "not decided here" and "not finite" in v.why


def test_r10c_is_not_decided_on_one_process_or_a_cpu():
    one = lesson.verdict_r10c(_savings(10.0, 3.5, n=1))
    assert one.outcome == "not decided here" and "1 process" in one.why
    cpu = SweepResult(rows=_rows("base", 2, 1.0, 8.0) + _rows("zero", 2, 1.0, 4.0),
                      backend="gloo", launched=2)
    savings = lesson.zero_savings(cpu, "base", "zero", 2)
    assert savings["judged_on"] == "model state"
    assert savings["saved"] == pytest.approx(1 - 6 / 10)
    v = lesson.verdict_r10c(savings)
    assert v.outcome == "not decided here" and "CPU" in v.why
    assert lesson.r10c_rows(v, savings)[0]["verdict"] == "not decided here"


def _fake_deepspeed(root, refuse):
    """A stand-in ``deepspeed`` package whose DeepSpeedConfig refuses or takes the "amp" key."""
    pkg = root / "deepspeed" / "runtime"
    pkg.mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text('__version__ = "9.9.9"\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(
        "class DeepSpeedConfigError(Exception):\n    pass\n\n\n"
        "class DeepSpeedConfig:\n    def __init__(self, cfg):\n"
        + ('        if "amp" in cfg:\n            raise DeepSpeedConfigError("amp removed")\n'
           if refuse else "        self.cfg = cfg\n"))
    return root


def test_r11_answer_and_verdict(tmp_path):
    answer = lesson.deepspeed_equivalents()
    assert '"amp": {"enabled": true, "opt_level": "O2"}' in answer and "Apex" in answer
    assert '"bf16": {"enabled": true}' in answer and "ZeroRedundancyOptimizer" in answer
    support = lesson.native_support()
    assert support["torch.amp.GradScaler"] and support["ZeroRedundancyOptimizer"]
    assert support["fully_shard + MixedPrecisionPolicy"]
    assert isinstance(support["deepspeed installed"], bool)
    # DeepSpeed not installed: not decided, and the reason says why the course does not install it
    none = {"installed": False, "version": None, "results": {}, "why": "deepspeed is not installed"}
    absent = lesson.verdict_r11(support, lesson.deepspeed_amp_facts(tmp_path / "none"), none)
    assert absent.outcome == "not decided here" and "source archive" in absent.why
    # a DeepSpeed whose config refuses the key, checked in a separate process (a stand-in package)
    fake = _fake_deepspeed(tmp_path / "refuses", refuse=True)
    check = lesson.deepspeed_config_check(lesson.R11_CONFIGS, paths=[str(fake)])
    assert check["installed"] and check["version"] == "9.9.9", check
    assert check["results"]["article"] == {"accepted": False,
                                           "error": "DeepSpeedConfigError: amp removed"}
    v = lesson.verdict_r11(support, {"installed": True, "source": None, "calls_apex": None,
                                     "refuses_zero": None}, check)
    assert v.outcome == "did not hold" and "refuses it: DeepSpeedConfigError" in v.why
    assert v.sensitivity[0].held is False and "9.9.9" in v.measured
    # a DeepSpeed that takes the key and hands it to Apex, but refuses it with ZeRO: partly held
    engine = tmp_path / "ds" / "runtime" / "engine.py"
    engine.parent.mkdir(parents=True)
    engine.write_text("amp_params = self.amp_params()\nmodel, optimizer = amp.initialize(model, "
                      "optimizer, **amp_params)\nassert not (amp_enabled and zero_enabled), "
                      "\"Amp and ZeRO are not currently compatible, please use fp16\"\n")
    facts = lesson.deepspeed_amp_facts(tmp_path / "ds")
    assert facts == {"installed": True, "source": str(engine), "calls_apex": True,
                     "refuses_zero": True}
    takes = lesson.deepspeed_config_check(lesson.R11_CONFIGS,
                                          paths=[str(_fake_deepspeed(tmp_path / "takes", False))])
    v = lesson.verdict_r11(support, facts, takes)
    assert v.claim == "R11" and v.lesson == "06" and v.outcome == "partly held" and "Apex" in v.why
    assert "did not hold with ZeRO stage 1 beside it" in v.why
    assert v.numbers["native_equivalents_present"] is True
    # an install whose check failed says so instead of ruling
    broken = lesson.verdict_r11(support, facts, dict(none, installed=True, why="exit 1: boom"))
    assert broken.held is None and "boom" in broken.why
    both = lesson.verdicts(_savings(10.0, 3.5), support)
    assert [x.claim for x in both] == list(lesson.DECIDES)


def test_verdicts_are_only_for_this_lessons_claims():
    with pytest.raises(ValueError, match="lesson 04"):
        claims.decide("B1", lesson.LESSON, "x", True, "y")

