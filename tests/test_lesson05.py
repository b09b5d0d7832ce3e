"""Lesson 05 on the CPU: checkpointing computes the same step (BatchNorm statistics included),
the largest-batch search under a fake memory limit, accumulation equivalence, exact resume with
and without the scaler's state, claims R8-R10 and the lesson's charts."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons.measure.cards  # noqa: F401 (bench.cards below)
from amp_lessons import measure as bench
from amp_lessons.publish import claims
from amp_lessons import measure
from amp_lessons import models as M
from amp_lessons.train import trainer as T
from amp_lessons.lessons import l05_checkpointing as L
from amp_lessons.ui import perf_plots as P
from amp_lessons.measure.accumulation import accumulation_equivalence
from amp_lessons.measure import activation_checkpointing as K

TINY = dict(model="resnet18", image_size=16, num_classes=10)  # layer3 and layer4 at 1x1


# --- checkpointing: same step, BatchNorm updated once ------------------------------------------

@pytest.mark.parametrize("mode", ["block", "stage", "stage1-2", "stem+stage1", "stem+stage1-2"])
def test_checkpointed_resnet_matches_plain(mode):
    out = L.checkpoint_equivalence("resnet18", mode, image_size=16, batch_size=4)
    assert out["loss_diff"] <= 1e-6
    assert out["grad_rel_diff"] <= 1e-5
    assert out["weight_rel_diff"] <= 1e-6
    assert out["bn_rel_diff"] <= 1e-6  # running mean and variance as after a plain step
    assert out["batches_tracked"] == {"plain": 1, "checkpointed": 1,
                                      "checkpointed without the fix": 2}
    assert out["bn_rel_diff_without_fix"] > 1e-3  # the double update is visible, not rounding


def test_without_fix_updates_batchnorm_twice_by_the_momentum_formula():
    """Recomputation runs BatchNorm again on the same input: the running mean moves twice
    toward the same batch mean, (1-m)^2 r0 + (1 - (1-m)^2) mu, instead of once."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=0.1)
    bn.running_mean.fill_(1.0)
    block = nn.Sequential(nn.Conv2d(3, 3, 1), bn)
    wrapped = M.CheckpointedWithoutBatchNormFix(block)
    x = torch.randn(4, 3, 5, 5)
    with torch.no_grad():
        mu = block[0](x).mean(dim=(0, 2, 3))
    wrapped(x).sum().backward()
    m = 0.1
    expected = (1 - m) ** 2 * 1.0 + (1 - (1 - m) ** 2) * mu
    assert int(bn.num_batches_tracked) == 2
    torch.testing.assert_close(bn.running_mean, expected, rtol=1e-5, atol=1e-6)
    # the course's Checkpointed restores the buffers after recomputation: one update
    bn2 = nn.BatchNorm2d(3, momentum=0.1)
    bn2.running_mean.fill_(1.0)
    block2 = nn.Sequential(nn.Conv2d(3, 3, 1), bn2)
    block2[0].load_state_dict(block[0].state_dict())
    M.Checkpointed(block2)(x).sum().backward()
    assert int(bn2.num_batches_tracked) == 1
    torch.testing.assert_close(bn2.running_mean, (1 - m) * 1.0 + m * mu, rtol=1e-5, atol=1e-6)


def test_without_batchnorm_fix_swaps_every_unit_and_nothing_else():
    net = M.resnet18(num_classes=10, checkpoint="block")
    n = sum(isinstance(m, M.Checkpointed) for m in net.modules())
    M.without_batchnorm_fix(net)
    assert sum(type(m) is M.CheckpointedWithoutBatchNormFix for m in net.modules()) == n == 8


@pytest.mark.slow
def test_checkpoint_sequential_pitfall_is_the_stem_relu_at_a_boundary():
    out = L.checkpoint_sequential_pitfall(segments=4)
    assert "modified by an inplace operation" in out["error"]
    assert out["inplace_first"] == [["relu", "maxpool"]]
    assert out["segments"][0] == ["conv1", "bn1"]
    assert out["batchnorm_updates_per_step"] == 2  # runs once out of place, BN moves twice


def test_pitfall_rejects_bad_segments():
    with pytest.raises(ValueError, match="segments"):
        L.checkpoint_sequential_pitfall(segments=1)
    with pytest.raises(ValueError, match="segments"):
        L.checkpoint_sequential_pitfall(segments=40)


# --- largest_batch under a fake memory limit -----------------------------------------------------

def _fake(fixed, per_image):
    return lambda b: fixed + per_image * b


@pytest.fixture
def no_gc(monkeypatch):
    """The search frees memory after every trial (gc.collect: slow, and nothing to free here)."""
    monkeypatch.setattr(bench.cards, "free_memory", lambda *a, **k: None)
    monkeypatch.setattr(bench.search, "free_memory", lambda *a, **k: None)


@pytest.mark.parametrize("cap,start,limit", [(1000, 1, 4096), (1000, 3, 64), (5000, 1, 100),
                                             (150, 1, 4096), (99, 1, 16)])
def test_largest_batch_bisects_to_the_exact_answer(cap, start, limit, no_gc):
    fixed, per = 100, 7
    expected = min(limit, max(0, (cap - fixed) // per))
    ran = []
    found = measure.largest_batch(lambda b: (lambda: ran.append(b)), cap, start=start, limit=limit,
                            peak_bytes=_fake(fixed, per))
    assert found.batch_size == expected
    fits = [t["batch_size"] for t in found.trials if t["fits"]]
    fails = [t["batch_size"] for t in found.trials if not t["fits"]]
    assert all(b <= expected for b in fits) and all(b > expected for b in fails)
    if expected < limit:
        assert expected + 1 in fails or expected < start  # the boundary itself was tried
    assert len(found.trials) <= 2 * math.ceil(math.log2(limit + 1)) + 2
    assert all(b in ran for b in fits)  # a trial runs the step (twice)


@pytest.mark.parametrize("predicted", [0, 1, 20, 37, 38, 60, 999, 5000])
def test_verified_batch_walks_from_the_prediction_to_the_exact_answer(predicted, no_gc):
    fixed, per, cap, limit = 100, 7, 1000, 1000
    expected = (cap - fixed) // per  # 128
    found = bench.search.verified_batch(lambda b: (lambda: None), cap, predicted, limit=limit,
                                        peak_bytes=_fake(fixed, per))
    assert found.batch_size == min(expected, limit)
    assert len(found.trials) <= 2 * math.ceil(math.log2(limit + 1)) + 2
    exact = bench.search.verified_batch(lambda b: (lambda: None), cap, expected, limit=limit,
                                        peak_bytes=_fake(fixed, per))
    assert len(exact.trials) == 2  # a right prediction is verified in two trials


def test_largest_batch_survives_a_real_out_of_memory_error(no_gc):
    """make_step raising the allocator's error (as a GPU would) counts as "does not fit"; the
    search goes on and the process is fine; any other error is not swallowed."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

    def make(b):
        def run():
            if b > 37:
                raise oom(f"CUDA out of memory. Tried to allocate {b} MiB")
            return torch.ones(b).sum()
        return run

    found = measure.largest_batch(make, 10 ** 9, start=1, limit=1000, peak_bytes=lambda b: 1)
    assert found.batch_size == 37
    assert any(t["reason"] == "out of memory" for t in found.trials)
    assert torch.ones(3).sum().item() == 3.0  # still alive

    def broken(b):
        def run():
            raise RuntimeError("shape mismatch")
        return run

    with pytest.raises(RuntimeError, match="shape mismatch"):
        measure.largest_batch(broken, 10 ** 9, peak_bytes=lambda b: 1)


def test_largest_batch_table_on_the_cpu_follows_the_counted_line(monkeypatch, no_gc):
    """On a CPU the search runs on the counted memory line: the answer is the largest multiple
    of the resolution whose counted peak stays under the card."""
    lines = {"fp32": (0.05 * measure.GIB, 2 ** 20), "bf16 + checkpointing": (0.06 * measure.GIB, 2 ** 18)}
    monkeypatch.setattr(bench.cards, "counted_memory_model", lambda config, device: dict(
        zip(("fixed_bytes", "bytes_per_image"), lines[config.label])))
    rows = L.largest_batch_table((0.2, 0.4), tuple(lines), device="cpu", resolution_parts=4,
                                 **TINY)
    assert [(r["card_gb"], r["technique"]) for r in rows] == [
        (0.2, "fp32"), (0.4, "fp32"), (0.2, "bf16 + checkpointing"),
        (0.4, "bf16 + checkpointing")]
    for r in rows:
        fixed, per = lines[r["technique"]]
        res, cap = r["resolution"], r["card_gb"] * measure.GIB
        assert r["status"] == "ok" and r["how"].startswith("counted") and r["reason"] == ""
        assert res >= 1 and res & (res - 1) == 0 and r["largest_batch"] % res == 0
        assert fixed + per * r["largest_batch"] <= cap < fixed + per * (r["largest_batch"] + res)
        assert 2 <= r["trials"] <= 4  # the fit predicts; the trials verify
        assert r["predicted"] >= r["largest_batch"]
    assert rows[1]["largest_batch"] > rows[0]["largest_batch"] > 100
    assert rows[2]["largest_batch"] > rows[0]["largest_batch"]


def test_largest_batch_search_is_not_bounded_by_its_prediction(monkeypatch, no_gc):
    """A prediction far too low (a poor fit) still reaches the exact boundary: the search's only
    limit is max_batch, so no cell ends as "at least" because the fit was off (the committed
    run's 24 and 40 GB cells for AMP + checkpointing did)."""
    limits = []
    real = bench.cards.verified_batch

    def spy(make, cap, predicted, device=None, limit=4096, peak_bytes=None):
        limits.append(limit)
        return real(make, cap, max(1, predicted // 4), device=device, limit=limit,
                    peak_bytes=peak_bytes)  # the prediction made 4x too low
    monkeypatch.setattr(bench.cards, "verified_batch", spy)
    fixed, per = 0.05 * measure.GIB, 2 ** 20
    monkeypatch.setattr(bench.cards, "counted_memory_model", lambda config, device: {
        "fixed_bytes": fixed, "bytes_per_image": per})
    rows = L.largest_batch_table((0.2, 0.4), ("fp32",), device="cpu", resolution_parts=4,
                                 max_batch=4096, **TINY)
    for r, limit in zip(rows, limits):
        res = r["resolution"]
        assert limit * res == 4096 and r["reason"] == ""
        assert fixed + per * r["largest_batch"] <= r["card_gb"] * measure.GIB \
            < fixed + per * (r["largest_batch"] + res)


def test_refit_uses_every_measured_point_and_falls_back_to_a_low_guess():
    line = {8: 1.0e9 + 8 * 2e7, 16: 1.0e9 + 16 * 2e7, 32: 1.0e9 + 32 * 2e7}
    fit = bench.cards.refit({**line, 400: 1.0e9 + 400 * 2e7})
    assert fit["per_sample"] == pytest.approx(2e7) and fit["fixed"] == pytest.approx(1e9)
    flat = bench.cards.refit({8: 5e8, 16: 5e8, 32: 5e8})  # blocks hid the growth
    assert flat == {"fixed": 0.0, "per_sample": pytest.approx(5e8 / 32)}


def test_largest_batch_table_skips_with_the_reason(monkeypatch, no_gc):
    monkeypatch.setattr(bench.cards, "skip_reason", lambda config, device: "no such hardware here")
    rows = L.largest_batch_table((8, 16), ("AMP",), device="cpu", **TINY)
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all(r["reason"] == "no such hardware here" and r["largest_batch"] is None
               for r in rows)


def test_largest_batch_table_rejects_bad_settings():
    with pytest.raises(ValueError, match="card_sizes_gb"):
        L.largest_batch_table((), device="cpu")
    with pytest.raises(ValueError, match="card_sizes_gb"):
        L.largest_batch_table((8, -1), device="cpu")
    with pytest.raises(ValueError, match="technique"):
        L.largest_batch_table((8,), ("fp8",), device="cpu")
    with pytest.raises(ValueError, match="resolution_parts"):
        L.largest_batch_table((8,), device="cpu", resolution_parts=0)
    with pytest.raises(ValueError, match="cudnn_benchmark"):
        L.technique_configs(["fp32"], cudnn_benchmark="yes")


# --- counted memory and the technique table -----------------------------------------------------

def test_counted_memory_sees_what_checkpointing_keeps_and_recomputes():
    plain, ckpt = (L.counted_step_memory(c, "cpu") for c in L.technique_configs(
        ["fp32", "fp32 + checkpointing"], batch_size=4, **TINY))
    assert plain["state_bytes"] == ckpt["state_bytes"] > 0
    assert plain["recompute_bytes"] == 0 < ckpt["recompute_bytes"]
    assert ckpt["kept_bytes"] < plain["kept_bytes"]
    params = sum(p.numel() for p in M.resnet18(num_classes=10).parameters()) * 4
    assert plain["state_bytes"] == 3 * params  # weights, gradients, SGD momentum


def test_technique_table_and_claim_r8_on_the_cpu():
    """The quick profile's path: standard settings, counted memory, and R8 not decided (a CPU
    timing says nothing about a GPU)."""
    rows = L.technique_table(["fp32", "fp32 + checkpointing"], device="cpu", batch_size=2,
                             **TINY)
    assert [r["technique"] for r in rows] == ["fp32", "fp32 + checkpointing"]
    assert all(r["status"] == "ok" and r["memory_gib"] > r["state_gib"] > 0 for r in rows)
    assert rows[1]["activations_gib"] < rows[0]["activations_gib"]
    assert rows[0]["memory_source"].startswith("counted")
    assert rows[0]["settings"] == measure.standard_settings(quick=True)
    assert rows[0]["config"]["channels_last"] and rows[0]["config"]["impl"] == "foreach"
    caption = L.technique_caption(rows)
    assert "channels_last" in caption and "cuDNN autotuning on" in caption and "counted" in caption
    costs = L.checkpointing_costs(rows)
    assert [c["pair"] for c in costs] == ["fp32 -> fp32 + checkpointing"]
    verdict = L.verdict_r8(rows)
    assert isinstance(verdict, claims.Verdict) and verdict.claim == "R8" and verdict.lesson == "05"
    assert verdict.held is None and verdict.outcome == "not decided here"
    assert "timed on cpu" in verdict.why and costs[0]["pair"] in verdict.measured


def test_technique_table_skips_what_a_cpu_cannot_count():
    rows = L.technique_table(["AMP + selective checkpointing"], device="cpu", batch_size=2,
                             settings={"channels_last": False}, **TINY)
    from amp_lessons.models import selective_checkpointing_problem
    why = selective_checkpointing_problem() or "saved-tensor hooks"  # torch 2.4 has no SAC
    assert rows[0]["status"] == "skipped" and why in rows[0]["reason"]


def _row(technique, memory, step_ms, img_per_s=None, device_type="cuda", state=0.3, idle=0.05):
    """A technique_table row as a GPU measures it (its idle share included) unless told."""
    return {"technique": technique, "status": "ok", "memory_gib": memory, "step_ms": step_ms,
            "img_per_s": img_per_s if img_per_s is not None else 1000.0 / step_ms,
            "config": {"batch_size": 64}, "memory_source": "peak allocated (CUDA)",
            "device_type": device_type, "steps": 15, "warmup": 5, "state_gib": state,
            "gpu_idle_fraction": idle if device_type == "cuda" else None}


FP32 = _row("fp32", 20.0, 60.0)


def test_claim_r8_verdicts_are_computed():
    # one-sided, in points of fp32's memory (20 GiB here): 11 -> 5 GiB saves 30 points
    held = L.verdict_r8([FP32, _row("AMP", 11.0, 100.0), _row("AMP + checkpointing", 5.0, 130.0)])
    assert held.outcome == "held" and "30 points of the fp32 row's)" in held.measured
    assert "+30%" in held.measured and held.numbers["points_of_fp32"] == pytest.approx(30.0)
    # 20 points is the threshold: 21 holds, 19 does not
    assert L.verdict_r8([FP32, _row("AMP", 11.0, 100.0),
                         _row("AMP + checkpointing", 6.8, 130.0)]).held is True
    low = L.verdict_r8([FP32, _row("AMP", 11.0, 100.0), _row("AMP + checkpointing", 7.2, 130.0)])
    assert low.held is False and "19 points" in low.why
    # saving more than claimed is not a refutation: held, understated, saying by how much
    more = L.verdict_r8([FP32, _row("AMP", 11.0, 100.0), _row("AMP + checkpointing", 4.0, 133.0)])
    assert more.outcome == "held, understated" and "35 points is 5 points more" in more.why
    # time: at most 40% added holds; 41% does not; under 20% is understated too
    assert L.verdict_r8([FP32, _row("AMP", 11.0, 100.0),
                         _row("AMP + checkpointing", 5.0, 141.0)]).held is False
    cheap = L.verdict_r8([FP32, _row("AMP", 11.0, 100.0), _row("AMP + checkpointing", 5.0, 115.0)])
    assert cheap.outcome == "held, understated" and "15% is 5% less" in cheap.why
    none = L.verdict_r8([_row("AMP", 10.0, 100.0)])
    assert none.held is None and none.outcome == "not decided here"
    few = L.verdict_r8([dict(r, steps=2) for r in (FP32, _row("AMP", 10.0, 100.0),
                                                  _row("AMP + checkpointing", 7.5, 130.0))])
    assert few.held is None and "only 2 timed steps" in few.why
    cpu = L.verdict_r8([dict(FP32, device_type="cpu"), _row("AMP", 10.0, 100.0, device_type="cpu"),
                      _row("AMP + checkpointing", 7.5, 130.0, device_type="cpu")])
    assert cpu.held is None and "counted" in cpu.why
    no_fp32 = L.verdict_r8([_row("AMP", 10.0, 100.0), _row("AMP + checkpointing", 5.0, 130.0)])
    assert no_fp32.held is None and "not finite" in no_fp32.why


def test_claim_r8_never_rules_on_a_missing_or_nan_time():
    for bad in (float("nan"), 0.0, None):
        v = L.verdict_r8([FP32, _row("AMP", 10.0, 100.0),
                          dict(_row("AMP + checkpointing", 7.5, 130.0), step_ms=bad)])
        assert v.held is None and "not finite" in v.why, bad
    v = L.verdict_r8([FP32, _row("AMP", float("nan"), 100.0), _row("AMP + checkpointing", 7.5, 130.0)])
    assert v.held is None


def test_claim_r10_verdicts():
    techniques = [_row("fp32", 20.0, 100.0, 1000.0), _row("AMP", 11.0, 40.0, 3000.0),
                  _row("AMP + checkpointing", 4.5, 55.0, 2300.0)]
    cards = [{"card_gb": c, "technique": t, "largest_batch": b, "status": "ok"}
             for c, t, b in [(8, "fp32", 90), (8, "AMP", 180), (8, "AMP + checkpointing", 430),
                             (16, "fp32", 190), (16, "AMP", 370),
                             (16, "AMP + checkpointing", 870)]]
    cards.append({"card_gb": 24, "technique": "fp32", "largest_batch": None,
                  "status": "skipped"})
    rows = L.verdict_r10(cards, techniques)
    assert [r.claim for r in rows] == ["R10a", "R10b", "R10c", "R10d"]
    assert all(isinstance(r, claims.Verdict) and r.lesson == "05" for r in rows)
    assert rows[0].held is True and rows[0].outcome == "held, understated"
    assert "1 of 1" in rows[0].why and "memory saved 78%: more than" in rows[0].why
    assert "78% is 18% more than the claimed 50-60%" in rows[0].why
    # a cheaper checkpointing that fits the same batch is a tie, not a loss (seen on an H200)
    tie = cards + [{"card_gb": 8, "technique": "AMP + checkpointing stem+layer1-2",
                    "largest_batch": 430, "status": "ok"}]
    assert L.verdict_r10(tie, techniques)[0].held is True
    bigger = cards + [{"card_gb": 8, "technique": "AMP + checkpointing stem+layer1-2",
                       "largest_batch": 450, "status": "ok"}]
    lost = L.verdict_r10(bigger, techniques)[0]
    assert lost.held is False and "0 of 1" in lost.why and "stem+layer1-2 larger" in lost.why
    assert "8 GB: fp32 90" in rows[0].measured
    assert rows[1].held is True and rows[1].outcome == "held"
    assert "memory saved 45%: within the claimed 40-50%" in rows[1].why
    # R10b's speed comparison passes the busy-GPU gate: a GPU idle half the step cannot decide
    busy = [dict(r, gpu_idle_fraction=0.05) for r in techniques]
    assert L.verdict_r10(cards, busy)[1].held is True
    idle = [busy[0], dict(busy[1], gpu_idle_fraction=0.5), busy[2]]
    v = L.verdict_r10(cards, idle)[1]
    assert v.held is None and "idle 50%" in v.why
    # where eager checkpointing is host-bound, the pair in a CUDA graph decides the speed part
    graphed = idle + [_row("AMP + CUDA graph", 11.0, 35.0, 3200.0),
                      _row("AMP + checkpointing + CUDA graph", 4.5, 45.0, 2600.0)]
    v = L.verdict_r10(cards, graphed)[1]
    assert v.held is True and "AMP + CUDA graph trains at 3,200 img/s" in v.why
    edge = [busy[0], dict(busy[1], gpu_idle_fraction=0.26), busy[2]]
    assert L.verdict_r10(cards, edge)[1].held is None
    assert L.verdict_r10(cards, [busy[0], dict(busy[1], gpu_idle_fraction=0.24),
                                 busy[2]])[1].held is True
    # R10b one-sided: 40% is the threshold; above 50% the claim understated it
    saved_39 = [techniques[0], _row("AMP", 12.2, 40.0, 3000.0), techniques[2]]
    assert L.verdict_r10(cards, saved_39)[1].held is False
    saved_60 = [techniques[0], _row("AMP", 8.0, 40.0, 3000.0), techniques[2]]
    assert L.verdict_r10(cards, saved_60)[1].outcome == "held, understated"
    assert "the faster way" in rows[1].why and "24 GB" not in rows[1].measured
    assert all(r.held is None for r in rows[2:]) and "lesson 06" in rows[2].why
    # only small cards measured: R10b cannot be decided
    only_small = L.verdict_r10([c for c in cards if c["card_gb"] == 8], techniques)
    assert only_small[1].held is None
    # bf16 stands in where AMP did not run
    bf = [dict(r, technique=r["technique"].replace("AMP", "bf16")) for r in techniques]
    bf_cards = [dict(c, technique=c["technique"].replace("AMP", "bf16")) for c in cards]
    assert "standing in for AMP" in L.verdict_r10(bf_cards, bf)[0].measured
    # checkpointing faster than plain AMP: accumulation is not the faster way, R10b fails
    slow_amp = [techniques[0], _row("AMP", 11.0, 80.0, 1000.0), techniques[2]]
    assert L.verdict_r10(cards, slow_amp)[1].held is False
    # a CPU run (counted memory) decides neither
    cpu = [dict(r, device_type="cpu") for r in techniques]
    assert [v.held for v in L.verdict_r10(cards, cpu)] == [None, None, None, None]
    with pytest.raises(ValueError, match="small_card_gb"):
        L.verdict_r10(cards, techniques, small_card_gb=0)


def test_lesson_decides_exactly_its_claims():
    assert L.LESSON == "05"
    assert set(L.DECIDES) == {c.id for c in claims.CLAIMS.values() if c.lesson == "05"}


# --- the frontier: memory against time, and what to pick on a card ------------------------------

def test_pareto_front_and_frontier_rows():
    rows = [_row("fp32", 21.0, 80.0), _row("AMP", 11.0, 44.0),
            _row("AMP + checkpointing", 4.7, 64.0),
            _row("AMP + checkpointing stem+layer1", 7.1, 57.0),
            _row("AMP + selective checkpointing", 9.4, 100.0),
            {"technique": "bf16", "status": "skipped", "reason": "no bf16"}]
    assert L.pareto_front(rows) == ["AMP", "AMP + checkpointing stem+layer1",
                                    "AMP + checkpointing"]
    table = L.frontier_rows(rows)
    assert [r["technique"] for r in table][:2] == ["AMP", "AMP + checkpointing stem+layer1"]
    by = {r["technique"]: r for r in table}
    assert by["AMP + selective checkpointing"]["on the frontier"] == "no"
    assert by["fp32"]["on the frontier"] == "no"  # slower and larger than AMP
    assert by["AMP"]["time x AMP"] == 1.0 and by["fp32"]["memory x fp32"] == 1.0
    assert by["AMP + checkpointing"]["memory x fp32"] == pytest.approx(4.7 / 21.0)
    assert by["AMP + checkpointing stem+layer1"]["checkpoint"] == "stem+stage1"
    assert by["AMP"]["repeat spread %"] is None  # every timed row carries its spread
    spread = L.frontier_rows([dict(r, spread=0.02) for r in rows[:2]])
    assert [r["repeat spread %"] for r in spread] == [pytest.approx(2.0)] * 2
    assert L.pareto_front([]) == []


def test_card_advice_picks_the_fastest_that_fits():
    rows = [_row("AMP", 11.0, 44.0, state=0.4), _row("AMP + checkpointing", 4.7, 64.0, state=0.4),
            _row("AMP + checkpointing stem+layer1", 7.1, 57.0, state=0.4)]
    # measured at batch 64: AMP needs 0.4 + 10.6 * b / 64 GiB
    advice = L.card_advice(rows, 15.0, batches=(64, 80, 128, 192, 4096))
    picks = [a["pick"] for a in advice]
    assert picks == ["AMP", "AMP", "AMP + checkpointing stem+layer1", "AMP + checkpointing", None]
    assert advice[0]["predicted GiB"] == pytest.approx(11.0)
    assert advice[0]["predicted img/s"] == pytest.approx(64 / 0.044)
    assert advice[2]["predicted GiB"] == pytest.approx(0.4 + 6.7 * 2) and advice[4]["slower choices that fit"] == "-"
    with pytest.raises(ValueError, match="card_gib"):
        L.card_advice(rows, 0)
    for bad in ((), (0,), (2.5,)):
        with pytest.raises(ValueError, match="batches"):
            L.card_advice(rows, 15.0, batches=bad)
    with pytest.raises(ValueError, match="rows"):
        L.card_advice([], 15.0)


# --- gradient accumulation -----------------------------------------------------------------------

def test_accumulation_equals_one_big_batch_in_fp32():
    out = L.accumulation_equivalence("mlp", "fp32", micro_batch=8, micro_batches=4)
    assert out["loss_diff"] <= 1e-6
    assert out["grad_rel_diff"] <= 1e-5 and out["weight_rel_diff"] <= 1e-6


def test_accumulation_equals_one_big_batch_with_the_scaler():
    out = L.accumulation_equivalence("mlp", "fp16", micro_batch=8, micro_batches=4)
    assert out["scale"] == (65536.0, 65536.0) and out["skipped"] == (False, False)
    assert out["loss_diff"] <= 1e-3
    assert out["grad_rel_diff"] <= 5e-3  # fp16 rounding of four partial sums
    assert out["weight_rel_diff"] <= 1e-3


def test_accumulation_differs_with_batchnorm():
    """BatchNorm normalises each micro-batch by its own statistics: not the big batch's step."""
    out = L.accumulation_equivalence("cnn", "fp32", micro_batch=4, micro_batches=2)
    assert out["grad_rel_diff"] > 1e-3


def test_trainer_accumulation_against_a_hand_written_big_batch():
    """The trainer's accumulate=4 against F.cross_entropy on all 32 examples at once."""
    torch.manual_seed(0)
    net = M.MLP(hidden=(32,))
    ref = M.MLP(hidden=(32,))
    ref.load_state_dict(net.state_dict())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    trainer = T.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.5),
                        T.TrainConfig(accumulate=4, progress=False, seed=None))
    trainer.train_step([(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_accumulation_memory_and_claim_r9():
    rows = L.accumulation_memory(micro_batch=2, counts=(1, 3), precision="fp32",
                                 device="cpu", **TINY)
    assert [r["effective_batch"] for r in rows] == [2, 6]
    acc = [r["accumulated_saved_gib"] for r in rows]
    one = [r["one_batch_saved_gib"] for r in rows]
    assert max(acc) == pytest.approx(min(acc), rel=1e-6)  # one micro-batch saved at a time
    assert one[1] > 2 * one[0]  # one big batch saves ~3x
    assert all(r["accumulated_peak_gib"] is None for r in rows)  # no peak counter on a CPU
    # counted memory and the step comparison are arithmetic: a CPU run decides R9
    eq = L.accumulation_equivalence("mlp", "fp32", micro_batch=4, micro_batches=4, device="cpu")
    verdict = L.verdict_r9(rows, eq)
    assert isinstance(verdict, claims.Verdict) and verdict.held is True
    assert "saved for backward" in verdict.measured and "gradients differ" in verdict.measured
    grown = [dict(r, accumulated_saved_gib=r["one_batch_saved_gib"]) for r in rows]
    assert L.verdict_r9(grown, eq).held is False
    assert L.verdict_r9(rows, dict(eq, grad_rel_diff=0.1)).held is False  # not the same step
    assert "not compared" in L.verdict_r9(rows).why
    with pytest.raises(ValueError, match="counts"):
        L.accumulation_memory(counts=(0,))
    with pytest.raises(ValueError, match="rows"):
        L.verdict_r9([])
    # one micro-batch count, a memory that was not measured, a NaN step comparison: not decided
    assert L.verdict_r9(rows[:1], eq).held is None and "two or more" in L.verdict_r9(rows[:1]).why
    assert L.verdict_r9([rows[0], dict(rows[0])]).held is None       # the same count twice
    zero = [dict(r, accumulated_saved_gib=0.0) for r in rows]
    assert L.verdict_r9(zero).held is None and "not measured" in L.verdict_r9(zero).why
    assert L.verdict_r9(rows, dict(eq, grad_rel_diff=float("nan"))).held is None
    with pytest.raises(ValueError, match="tolerance"):
        L.verdict_r9(rows, tolerance=1.5)


# --- training checkpoints ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resumed():
    return L.resume_experiment("fp16", "mlp", total_steps=24, resume_at=12, init_scale=2.0 ** 24)


def test_resume_with_scaler_state_is_exact(resumed):
    with_state = resumed["summary"][0]
    assert with_state["run"] == "resumed with scaler state" and with_state["steps"] == 24
    assert with_state["same_history_before_resume"]
    assert with_state["max_loss_diff_after_resume"] == 0.0
    assert with_state["same_scales_after_resume"]
    assert with_state["first_scale_after_resume"] == resumed["saved_scale"]
    assert with_state["skipped_after_resume"] == with_state["uninterrupted_skipped_after_resume"]


def test_resume_without_scaler_state_restarts_the_scale(resumed):
    """A fresh GradScaler starts at init_scale: the first resumed step has the uninterrupted
    run's loss (same weights, same batch) but overflows; the scale halves once per skipped step
    until it is back at the scale the run had reached: log2(init / saved) steps in a row."""
    without = resumed["summary"][1]
    cols, ref = resumed["runs"]["resumed without scaler state"], resumed["runs"]["uninterrupted"]
    k = resumed["resume_step"]
    assert resumed["saved_scale"] < resumed["init_scale"]
    assert without["first_scale_after_resume"] == resumed["init_scale"]
    assert cols["loss"][k] == ref["loss"][k]
    assert without["skipped_in_a_row_at_resume"] == resumed["expected_burst"] >= 1
    burst = without["skipped_in_a_row_at_resume"]
    assert cols["scale"][k:k + burst + 1] == [resumed["init_scale"] / 2 ** i
                                              for i in range(burst + 1)]
    assert cols["scale"][k + burst] == resumed["saved_scale"]
    assert without["max_loss_diff_after_resume"] > 0  # skipped steps left the weights behind


def test_resume_rejects_bad_settings():
    with pytest.raises(ValueError, match="resume_at"):
        L.resume_experiment(total_steps=10, resume_at=10)


# --- charts -------------------------------------------------------------------------------------

def _titles(fig):
    return fig.layout.title.text, fig.layout.xaxis.title.text, fig.layout.yaxis.title.text


def test_charts_have_titles_units_and_legends(resumed):
    techniques = [_row("fp32", 20.0, 100.0), _row("AMP", 11.0, 40.0),
                  dict(_row("bf16", 0, 1), status="skipped", reason="no bf16")]
    fig = P.technique_memory_time(techniques)
    title, x, y = _titles(fig)
    assert "ms" in x and "GiB" in y and "bf16 (skipped)" in title and len(fig.data) == 2
    cards = [{"card_gb": 8, "technique": "fp32", "largest_batch": 90, "status": "ok"},
             {"card_gb": 8, "technique": "AMP", "largest_batch": 180, "status": "ok"},
             {"card_gb": 80, "technique": "AMP", "largest_batch": None, "status": "skipped"}]
    fig = P.largest_batch_chart(cards)
    title, x, y = _titles(fig)
    assert "GB" in x and "images" in y and "1 card/technique" in title and len(fig.data) == 2
    acc = [{"micro_batches": n, "micro_batch": 2, "effective_batch": 2 * n,
            "accumulated_peak_gib": 1.0, "accumulated_saved_gib": 0.5,
            "one_batch_peak_gib": float(n), "one_batch_saved_gib": 0.5 * n} for n in (1, 2)]
    fig = P.accumulation_memory_chart(acc)
    assert "peak allocated" in _titles(fig)[2] and len(fig.data) == 2
    fig = P.resume_chart(resumed)
    assert fig.layout.title.text and len(fig.data) == 9
    for fn in (P.technique_memory_time, P.largest_batch_chart, P.accumulation_memory_chart):
        with pytest.raises(ValueError):
            fn([])
    with pytest.raises(ValueError):
        P.resume_chart({})


# --- tables for the notebook and the README ------------------------------------------------------

def test_report_rows():
    rows = [dict(_row("fp32", 20.0, 100.0), status="ok"), _row("AMP", 10.0, 50.0),
            {"technique": "bf16", "status": "skipped", "reason": "no bf16", "config": {}}]
    table = L.technique_report_rows(rows)
    assert [r["technique"] for r in table] == ["fp32", "AMP", "bf16"]
    assert table[1]["memory x fp32"] == 0.5 and table[1]["time x fp32"] == 0.5
    assert table[2]["status"] == "skipped: no bf16" and table[2]["memory GiB"] is None
    cards = [{"card_gb": 8, "technique": "fp32", "largest_batch": 88, "status": "ok",
              "reason": "", "how": "CUDA allocator capped at 8 GiB", "resolution": 8},
             {"card_gb": 80, "technique": "fp32", "largest_batch": None, "status": "skipped",
              "reason": "this device has 14.6 GiB", "how": "", "resolution": None},
             {"card_gb": 8, "technique": "AMP", "largest_batch": 176, "status": "ok",
              "reason": "", "how": "CUDA allocator capped at 8 GiB", "resolution": 16}]
    pivot = L.largest_batch_report_rows(cards)
    assert pivot["columns"] == ["card (GB)", "fp32", "AMP"]
    assert pivot["rows"] == [{"card (GB)": "8", "fp32": 88, "AMP": 176},
                             {"card (GB)": "80", "fp32": None, "AMP": None}]
    assert "steps of 8, 16 images" in pivot["note"] and "14.6 GiB" in pivot["note"]
    with pytest.raises(ValueError, match="rows"):
        L.largest_batch_report_rows([])


def test_accumulation_equivalence_rejects_bad_settings():
    with pytest.raises(ValueError, match="micro_batches"):
        L.accumulation_equivalence(micro_batches=0)
    with pytest.raises(ValueError, match="precision"):
        L.accumulation_equivalence(precision="fp8")


def test_pitfall_with_resnet18_has_the_same_stem():
    out = L.checkpoint_sequential_pitfall(segments=4, model="resnet18")
    assert "modified by an inplace operation" in out["error"]
    assert out["inplace_first"] == [["relu", "maxpool"]]
    fine = L.checkpoint_sequential_pitfall(segments=2, model="resnet18")  # ReLU inside segment 0
    assert fine["error"] == "" and fine["inplace_first"] == []
    with pytest.raises(ValueError, match="model"):
        L.checkpoint_sequential_pitfall(model="vgg16")


def test_accumulation_plan():
    cards = [{"card_gb": 8, "technique": "fp32", "largest_batch": 88, "status": "ok"},
             {"card_gb": 8, "technique": "AMP", "largest_batch": 1100, "status": "ok"},
             {"card_gb": 16, "technique": "fp32", "largest_batch": None, "status": "skipped"},
             {"card_gb": 16, "technique": "AMP", "largest_batch": 256, "status": "ok"}]
    plan = L.accumulation_plan(cards, 1024)
    assert plan["columns"] == ["card (GB)", "fp32", "AMP"]
    assert plan["rows"] == [{"card (GB)": "8", "fp32": "12 x 86", "AMP": "1 x 1024"},
                            {"card (GB)": "16", "fp32": None, "AMP": "4 x 256"}]
    with pytest.raises(ValueError, match="target_batch"):
        L.accumulation_plan(cards, 0)


def test_every_lesson05_output_names_tf32_math_tf32():
    """Where the "fp32" technique ran with TF32 math (precision tf32 on a GPU) every table, chart
    and verdict of the lesson says TF32; fp32 stays fp32 only where the math is fp32 (a CPU)."""
    tf32 = {"precision": "tf32", "device_type": "cuda"}
    techniques = [dict(_row("fp32", 20.0, 100.0, 1000.0), **tf32),
                  dict(_row("fp32 + checkpointing", 8.0, 130.0, 800.0), **tf32),
                  _row("AMP", 11.0, 40.0, 3000.0), _row("AMP + checkpointing", 4.5, 55.0, 2300.0)]
    cards = [dict({"card_gb": c, "technique": t, "largest_batch": b, "status": "ok",
                   "reason": "", "how": "capped", "resolution": 8}, **(tf32 if t == "fp32" else {}))
             for c, t, b in [(8, "fp32", 88), (8, "AMP", 176), (8, "AMP + checkpointing", 432),
                             (16, "fp32", 184), (16, "AMP", 352), (16, "AMP + checkpointing", 800)]]
    assert [r["technique"] for r in L.technique_report_rows(techniques)][:2] == \
        ["TF32", "TF32 + checkpointing"]
    assert L.largest_batch_report_rows(cards)["columns"][1] == "TF32"
    assert L.accumulation_plan(cards, 1024)["columns"][1] == "TF32"
    assert "TF32" in [t.name for t in P.largest_batch_chart(cards).data]
    assert {"TF32", "TF32 + checkpointing"} <= {t.name for t in
                                                 P.technique_memory_time(techniques).data}
    r10a, r10b = L.verdict_r10(cards, techniques)[:2]
    for v in (r10a, r10b):
        assert "8 GB: TF32 88" in r10a.measured and "against TF32 (fp32 storage with TF32" \
            in v.measured and "fp32 88" not in v.measured
    only_fp32 = [dict(techniques[0], technique="fp32"), techniques[1]]
    r8 = L.verdict_r8(only_fp32)
    assert r8.measured.startswith("TF32 -> TF32 + checkpointing:") and "of the TF32 (" in r8.measured
    cpu = [dict(r, device_type="cpu") for r in techniques]
    assert [r["technique"] for r in L.technique_report_rows(cpu)][0] == "fp32"
    assert L.technique_with_math(None) == "fp32"


# --- the cheaper checkpointing modes and the frontier chart --------------------------------------

def test_technique_configs_follow_the_standard_settings():
    configs = L.technique_configs(["AMP", "AMP + checkpointing stem+layer1-2",
                                   "AMP + checkpointing stem+layer1-2 + CUDA graph"])
    std = measure.standard_settings()
    assert all(c.channels_last == std["channels_last"] and c.cudnn_benchmark for c in configs)
    assert [c.impl for c in configs] == ["foreach", "foreach", "fused"]  # GradScaler in a graph
    assert [c.cuda_graph for c in configs] == [False, False, True]
    assert configs[1].checkpoint == "stem+stage1-2"
    off = L.technique_configs(["AMP"], cudnn_benchmark=False, settings={"channels_last": False})
    assert not off[0].cudnn_benchmark and not off[0].channels_last
    assert all(L.TECHNIQUES[t]["checkpoint"] in M.CHECKPOINT_MODES for t in L.TECHNIQUES)
    assert set(L.CARD_TECHNIQUES) <= set(L.TECHNIQUES)
    with pytest.raises(ValueError, match="technique"):
        L.technique_configs(["AMP", "AMP"])


def test_cuda_graph_rows_say_why_on_a_cpu():
    rows = L.technique_table(["AMP + CUDA graph"], device="cpu", batch_size=2, **TINY)
    assert rows[0]["status"] == "skipped" and "CUDA" in rows[0]["reason"]


def test_frontier_chart_marks_the_frontier_and_guides():
    rows = [_row("fp32", 21.0, 80.0), _row("AMP", 11.0, 44.0),
            _row("AMP + checkpointing", 4.7, 64.0),
            _row("AMP + checkpointing stem+layer1", 7.1, 57.0)]
    front = L.pareto_front(rows)
    fig = P.technique_memory_time(rows, frontier=front, memory_lines={"25% of fp32": 5.25},
                                  time_lines={"AMP + 15%": 50.6})
    title, x, y = _titles(fig)
    assert "ms" in x and "GiB" in y and title
    line = [t for t in fig.data if t.name == "frontier"]
    assert len(line) == 1 and list(line[0].x) == [44.0, 57.0, 64.0]
    stars = [t.name for t in fig.data if t.mode == "markers+text" and t.marker.symbol == "star"]
    assert stars == [n for n in (r["technique"] for r in rows) if n in front]
    assert [s.y0 for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1] == [5.25]
    assert any(a.text == "25% of fp32" for a in fig.layout.annotations)
    with pytest.raises(ValueError, match="frontier"):
        P.technique_memory_time(rows, frontier=["bf16"])
    with pytest.raises(ValueError, match="memory_lines"):
        P.technique_memory_time(rows, memory_lines={"card": 0})


def test_checkpointed_keeps_rng_only_for_dropout():
    assert not M.Checkpointed(nn.Sequential(nn.Linear(2, 2), nn.ReLU())).preserve_rng_state
    unit = M.Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    assert unit.preserve_rng_state
    # with dropout the replay draws the same mask: gradients as without checkpointing
    torch.manual_seed(0)
    x = torch.randn(8, 4, requires_grad=True)
    torch.manual_seed(1)
    unit(x).sum().backward()
    g_ckpt = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    unit.module(x).sum().backward()
    torch.testing.assert_close(g_ckpt, x.grad)


def test_keep_batchnorm_stats_restores_every_setting():
    bn = nn.BatchNorm2d(3, momentum=None)  # cumulative average: momentum None
    count = bn.num_batches_tracked
    with M.KeepBatchNormStats(nn.Sequential(bn)):
        assert bn.momentum == 0.0 and bn.num_batches_tracked is None
        bn(torch.randn(4, 3, 2, 2))
    assert bn.momentum is None and bn.num_batches_tracked is count and int(count) == 0
    assert torch.equal(bn.running_mean, torch.zeros(3)) and torch.equal(bn.running_var, torch.ones(3))


def test_claim_r8_is_decided_on_a_pair_that_kept_the_gpu_busy():
    def idle(row, share):
        return dict(row, gpu_idle_fraction=share)
    eager = [idle(_row("AMP", 10.0, 100.0), 0.05), idle(_row("AMP + checkpointing", 4.0, 190.0), 0.35)]
    graph = [idle(_row("AMP + CUDA graph", 10.0, 95.0), 0.01),
             idle(_row("AMP + checkpointing + CUDA graph", 5.0, 125.0), 0.02)]
    verdict = L.verdict_r8([FP32] + eager + graph)
    assert verdict.held is True  # the graphed pair: 25 points of fp32's 20 GiB, +32% time
    assert "AMP + CUDA graph -> AMP + checkpointing + CUDA graph" in verdict.measured
    assert "GPU idle at most 2%" in verdict.measured
    host_bound = L.verdict_r8(eager)
    assert host_bound.held is None and "idle 35%" in host_bound.why
    costs = L.checkpointing_costs(eager + graph)
    assert [c["gpu_idle_fraction"] for c in costs] == [0.35, 0.02]
    shown = L.technique_report_rows(eager)
    assert [r["GPU idle %"] for r in shown] == [5.0, 35.0]


def test_fp32_techniques_fall_back_to_plain_fp32_without_tf32(monkeypatch):
    monkeypatch.setattr(L, "native_tf32", lambda device: False)
    monkeypatch.setattr(L, "as_device", lambda device: __import__("torch").device("cuda"))
    (fp32,) = L.technique_configs(["fp32"], device="cuda")
    assert fp32.precision == "fp32"
    monkeypatch.setattr(L, "native_tf32", lambda device: True)
    (tf32,) = L.technique_configs(["fp32"], device="cuda")
    assert tf32.precision == "tf32"
    (cpu,) = L.technique_configs(["fp32"])  # no device named: the table's own choice, tf32
    assert cpu.precision == "tf32"


# --- sensitivity rows ------------------------------------------------------------------------------

def test_claim_r8_decides_the_other_pairs_as_sensitivity_rows():
    rows = [FP32, _row("AMP", 11.0, 100.0), _row("AMP + checkpointing", 5.0, 130.0),
            _row("bf16", 11.0, 100.0), _row("bf16 + checkpointing", 5.0, 190.0),
            _row("fp32 + checkpointing", 8.0, 75.0)]
    v = L.verdict_r8(rows)
    assert v.held is False and v.outcome == "partly held"   # bf16 adds 90%: a flip
    assert "bf16 -> bf16 + checkpointing" in v.row()["sensitivity"]
    assert "held with the AMP -> AMP + checkpointing pair" in v.why
    assert "did not hold with the bf16 -> bf16 + checkpointing pair" in v.why
    # an idle pair decides nothing and flips nothing
    rows[4] = dict(rows[4], gpu_idle_fraction=0.6)
    v = L.verdict_r8(rows)
    assert v.held is True and any(a.held is None for a in v.sensitivity)


def _equivalence(model, precision, diff):
    return {"model": model, "precision": precision, "grad_rel_diff": diff, "micro_batch": 16,
            "micro_batches": 4}


def test_claim_r9_is_partly_held_where_batchnorm_breaks_the_step():
    rows = [{"effective_batch": 32 * n, "micro_batches": n, "accumulated_peak_gib": 2.0,
             "one_batch_peak_gib": 2.0 * n, "accumulated_saved_gib": None,
             "one_batch_saved_gib": None, "one_batch_status": "ok"} for n in (1, 2, 4, 8)]
    eq = [_equivalence("mlp", "fp32", 3.6e-7), _equivalence("mlp", "fp16", 6.1e-4),
          _equivalence("cnn", "fp32", 0.42)]
    v = L.verdict_r9(rows, eq)
    assert v.outcome == "partly held" and [a.held for a in v.sensitivity] == [True, False]
    assert "did not hold with the digits SmallCNN (BatchNorm) in fp32" in v.why
    assert "held with the digits MLP (no BatchNorm) in fp32" in v.why
    # the fp16 MLP is judged within fp16's rounding, not fp32's 1e-4
    assert "at most 1e-02" in v.sensitivity[0].why
    # decided on the BatchNorm model alone: did not hold
    assert L.verdict_r9(rows, eq[2]).held is False
    # one dict still decides as before
    assert L.verdict_r9(rows, eq[0]).held is True


def test_claim_r10_text_comes_from_the_device_count():
    techniques = [_row("fp32", 20.0, 100.0, 1000.0), _row("AMP", 11.0, 40.0, 3000.0),
                  _row("AMP + checkpointing", 4.5, 55.0, 2300.0), _row("bf16", 11.5, 40.0, 2800.0)]
    cards = [{"card_gb": c, "technique": t, "largest_batch": b, "status": "ok"}
             for c, t, b in [(8, "fp32", 90), (8, "AMP", 180), (8, "AMP + checkpointing", 430),
                             (16, "fp32", 190), (16, "AMP", 370), (16, "AMP + checkpointing", 870)]]
    for n, text in ((1, "1 GPU in this run"), (8, "8 GPUs in this run"), (0, "no GPU in this run")):
        out = L.verdict_r10(cards, techniques, devices=n)
        assert out[2].measured == text and out[3].measured == text
    out = L.verdict_r10(cards, techniques, devices=2)
    assert out[1].sensitivity and "bf16" in out[1].sensitivity[0].setting
    assert out[1].sensitivity[0].held is True      # bf16 saves 42.5% >= 40%
    with pytest.raises(ValueError, match="devices"):
        L.verdict_r10(cards, techniques, devices=-1)


def test_accumulation_equivalence_refuses_more_examples_than_the_split_holds():
    with pytest.raises(ValueError, match=r"micro_batch \* micro_batches must be at most \d+ .*"
                                         r"micro_batch=400 \* micro_batches=4 = 1600"):
        accumulation_equivalence("mlp", "fp32", micro_batch=400, micro_batches=4, device="cpu")
    with pytest.raises(ValueError, match="micro_batch"):
        accumulation_equivalence("mlp", "fp32", micro_batch=1, micro_batches=2000, device="cpu")


@pytest.mark.skipif(M.selective_checkpointing_problem() is not None, reason="needs torch >= 2.5")
def test_sac_without_the_batchnorm_fix_really_has_no_fix():
    r = K.checkpoint_equivalence("resnet18", "sac", image_size=32, batch_size=2, device="cpu")
    assert r["batches_tracked"] == {"plain": 1, "checkpointed": 1,
                                    "checkpointed without the fix": 2}
    assert r["bn_rel_diff"] == 0.0 and r["bn_rel_diff_without_fix"] > 0
    net = M.without_batchnorm_fix(M.resnet18(10, checkpoint="sac", small_input=True))
    assert not any(type(u) is M.SelectiveCheckpointed for u in net.modules())


@pytest.mark.parametrize("call", [
    lambda: K.checkpoint_equivalence("resnet18", "block", 32, 2, device="cpu", seed=0),
    lambda: K.checkpoint_sequential_pitfall(4, 32, 2, device="cpu", model="resnet18", seed=0)],
    ids=["checkpoint_equivalence", "checkpoint_sequential_pitfall"])
def test_checkpointing_measurements_leave_the_callers_random_stream_alone(call):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    call()
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_equivalence_names_a_batch_of_one():
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 2; got 1"):
        K.checkpoint_equivalence("resnet18", "block", image_size=32, batch_size=1, device="cpu")
