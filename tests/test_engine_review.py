"""Fixes from an outside review of the engine (scripts re-run with other models and inputs):
checkpointing's RNG state, skipped fp16 steps in the weight recipes, accumulation's example
count, duplicate sweep labels, 1-channel distributed batches, the optimizer state of a row
whose steps were all skipped, large data seeds, ex05's message, bench's timing summaries and
BF16AdamW's parameter groups. Each test fails without its fix."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import measure as B
from amp_lessons import data
from amp_lessons.measure import distributed
from amp_lessons import models
from amp_lessons.measure import optim as O
from amp_lessons.measure.accumulation import accumulation_equivalence
from amp_lessons.measure.activation_checkpointing import relative_diff
from amp_lessons.exercises import ex05

TINY = dict(model="resnet18", batch_size=2, image_size=16, num_classes=10)


# --- 1. Checkpointed keeps the RNG state for any randomness in the forward ----------------------

class _FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), 0.5, self.training))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.a(x, x, x, need_weights=False)[0]


def _grad_diff(make) -> float:
    torch.manual_seed(0)
    plain = make().train()
    wrapped = models.Checkpointed(copy.deepcopy(plain)).train()
    x = torch.randn(2, 4, 16)
    grads = []
    for net in (plain, wrapped):
        torch.manual_seed(123)  # the same random stream for both forwards
        net(x.clone().requires_grad_()).pow(2).sum().backward()
        grads.append([p.grad for p in net.parameters()])
    return relative_diff(grads[1], grads[0])


@pytest.mark.parametrize("make", [_FunctionalDropout, _Attention],
                         ids=["F.dropout", "attention dropout"])
def test_checkpointed_replays_randomness_outside_dropout_modules(make):
    assert models.Checkpointed(make()).preserve_rng_state
    assert _grad_diff(make) == 0.0


def test_checkpointed_refuses_rrelu_whose_replay_torch_gets_wrong():
    assert models.random_modules(nn.Sequential(nn.Linear(4, 4), nn.RReLU())) == ["1"]
    with pytest.raises(ValueError, match=r"nn.RReLU \(found at 1\).*193671"):
        models.Checkpointed(nn.Sequential(nn.Linear(4, 4), nn.RReLU()))


def test_checkpointed_skips_the_rng_state_only_for_known_deterministic_modules():
    resnet = models.resnet18(num_classes=10, checkpoint="block")
    units = [m for m in resnet.modules() if isinstance(m, models.Checkpointed)]
    assert units and not any(u.preserve_rng_state for u in units)  # the lessons' timings
    assert models.random_modules(nn.MultiheadAttention(16, 2)) == []  # dropout 0
    assert models.random_modules(_FunctionalDropout()) == [""]  # a forward of its own
    assert not models.Checkpointed(_FunctionalDropout(), deterministic=True).preserve_rng_state
    assert models.Checkpointed(nn.Linear(2, 2), deterministic=False).preserve_rng_state
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        models.Checkpointed(nn.Linear(2, 2), deterministic="yes")


# --- 2. skipped fp16 steps are not "rounded away" -----------------------------------------------

def _fp16_recipe(steps):
    torch.manual_seed(0)
    x, y = torch.randn(64, 16) * 100, torch.randint(0, 4, (64,))
    return O.train_recipe(O.get_recipe("fp32 master"),
                          lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
                          lambda s: (x, y), F.cross_entropy, steps=steps, lr_at=lambda s: 1e-3,
                          device="cpu", amp_dtype=torch.float16)


def test_train_recipe_reports_skipped_steps_instead_of_rounded_away():
    row = _fp16_recipe(6)  # GradScaler backs off from 2**16 for the first five steps
    assert row["status"] == "trained"
    assert row["skipped_steps"] == [0, 1, 2, 3, 4]
    assert [s for s, _ in row["rounded_away"]] == [5]
    every = _fp16_recipe(3)
    assert every["status"] == "not trained: GradScaler skipped all 3 steps"
    assert every["rounded_away"] == [] and every["skipped_steps"] == [0, 1, 2]


# --- 3. accumulation_equivalence uses the examples asked for, or refuses ------------------------

def test_accumulation_equivalence_refuses_more_examples_than_the_split_holds():
    with pytest.raises(ValueError, match=r"micro_batch \* micro_batches must be at most \d+ .*"
                                         r"micro_batch=400 \* micro_batches=4 = 1600"):
        accumulation_equivalence("mlp", "fp32", micro_batch=400, micro_batches=4, device="cpu")
    with pytest.raises(ValueError, match="micro_batch"):
        accumulation_equivalence("mlp", "fp32", micro_batch=1, micro_batches=2000, device="cpu")


# --- 4. different configs never share a label in a sweep ----------------------------------------

def test_run_experiments_refuses_two_configs_with_one_label():
    a = distributed.RunConfig(model="mlp", precision="fp32", batch_size=4, optimizer="sgd")
    b = distributed.RunConfig(model="mlp", precision="fp32", batch_size=64)
    assert a.name == b.name
    with pytest.raises(ValueError, match="labels must be unique.*'mlp ddp fp32'"):
        distributed.run_experiments(distributed.grid([a, b], [1]), backend="gloo")
    with pytest.raises(ValueError, match="twice"):
        distributed.run_experiments([(a, 1), (a, 1)], backend="gloo")


def test_sweep_summary_never_folds_rows_of_two_runs():
    row = {"label": "x", "model": "mlp", "strategy": "ddp", "precision": "fp32", "world_size": 1,
           "rank": 0, "unit": "sample", "fsdp_wrap": None, "fsdp_units": None, "batch_size": 4,
           "step_ms": 1.0, "peak_gib": None, "param_mib": 1.0, "grad_mib": 1.0,
           "optimizer_state_mib": 1.0, "losses": [1.0], "spread": None, "peak_spread": None,
           "steps": 6, "warmup": 1}
    assert len(distributed.SweepResult([row], "gloo", 1).summary()) == 1
    with pytest.raises(ValueError, match="batch_size"):
        distributed.SweepResult([row, dict(row, batch_size=64)], "gloo", 1).summary()
    with pytest.raises(ValueError, match="a rank repeats"):
        distributed.SweepResult([row, dict(row)], "gloo", 1).summary()


# --- 5. distributed batches follow the model's input channels -----------------------------------

@pytest.mark.parametrize("model", ["small_cnn", "resnet18"])
def test_make_batch_follows_the_models_input_channels(model):
    config = distributed.RunConfig(model=model, precision="fp32", image_size=16,
                                   model_kwargs={"in_channels": 1})
    net = distributed.build_model(config)
    x, y = distributed.make_batch(config, net, 0, 1, "cpu")
    assert x.shape == (8, 1, 16, 16)
    net(x)  # the worker's forward no longer fails on 3-channel images
    three = distributed.RunConfig(model=model, precision="fp32", image_size=16)
    x3, _ = distributed.make_batch(three, distributed.build_model(three), 0, 1, "cpu")
    assert torch.equal(x3, data.synthetic_images(8, 16, 10, "cpu")[0])  # unchanged


# --- 6. a row whose steps GradScaler all skipped still counts the optimizer state ---------------

def test_measure_counts_optimizer_state_when_no_step_ran(monkeypatch):
    def no_step(step, x, y, **kwargs):  # what a run looks like where every step was skipped
        return {"times_ms": [1.0, 1.0], "loss": 1.0, "timer": "perf_counter"}
    monkeypatch.setattr(B.runner, "time_steps", no_step)
    row = B.measure(B.BenchConfig(precision="fp16", **TINY), "cpu", warmup=0, steps=1,
                    breakdown=True, idle=False)
    assert row["status"] == "ok" and row["optimizer_state_gib"] > 0
    assert row["optimizer_state_gib"] == pytest.approx(row["params_gib"])  # SGD momentum
    assert "GradScaler skipped every step" in row["reason"]


def test_measure_reads_optimizer_state_as_before_when_steps_ran():
    row = B.measure(B.BenchConfig(precision="fp32", **TINY), "cpu", warmup=0, steps=1,
                    idle=False)
    assert row["reason"] == ""
    assert row["optimizer_state_gib"] == pytest.approx(row["params_gib"])


# --- 7. any valid seed shuffles; the course's seeds draw the same orders ------------------------

def test_tensor_batches_takes_every_valid_seed():
    for seed in (2**62, 2**63 - 1):
        batches = data.TensorBatches(torch.arange(10.).reshape(10, 1), torch.arange(10), 3,
                                     seed=seed)
        batches.set_epoch(7)
        assert sum(len(x) for x, _ in batches) == 10
        sampler = data.EpochShuffleSampler(10, seed)
        sampler.set_epoch(3)
        assert sorted(sampler) == list(range(10))
    for seed, epoch in ((0, 0), (0, 5), (1, 2), (42, 9)):  # unchanged for the seeds that fitted
        assert data.epoch_seed(seed, epoch) == seed * 100_003 + epoch
    x = torch.arange(10.).reshape(10, 1)
    order = [int(v) for xb, _ in data.TensorBatches(x, torch.arange(10), 10, seed=3) for v in xb]
    g = torch.Generator().manual_seed(3 * 100_003)
    assert order == torch.randperm(10, generator=g).tolist()


# --- also: ex05's message, bench's summaries, BF16AdamW's groups --------------------------------

def test_ex05_says_how_much_a_partly_checkpointed_answer_saved():
    def every_other(blocks, x):
        for i, b in enumerate(blocks):
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if i % 2 == 0 \
                else b(x)
        return x
    text = repr(ex05.check_checkpointing(every_other, device="cpu"))
    assert "wrong" in text and "nothing was checkpointed" not in text
    assert "only part of the forward was checkpointed" in text and "% of what the plain" in text


def test_summarize_times_refuses_zero_times_and_batches():
    with pytest.raises(ValueError, match="times_ms must have a median above 0 ms"):
        B.summarize_times([0.0, 0.0], 8)
    with pytest.raises(ValueError, match="times_ms must hold finite step times"):
        B.summarize_times([float("nan")] * 6, 8)
    with pytest.raises(ValueError, match="batch_size must be"):
        B.summarize_times([1.0, 2.0], 0)


def test_overhead_noise_says_when_the_overhead_decides_nothing():
    rounds = [{"hand": 10.0, "trainer": 10.1}, {"hand": 10.0, "trainer": 10.3}]
    out = B.overhead_noise(2.0, rounds)
    assert out["overhead_spread_pct"] == pytest.approx(2.0)
    assert out["note"].startswith("undecided") and "noise floor" in out["note"]
    assert B.overhead_noise(50.0, rounds)["note"] == ""
    assert B.overhead_noise(50.0, rounds, hand_spread=0.3)["note"].startswith("noisy")
    assert B.overhead_noise(50.0, rounds[:1])["note"].startswith("undecided: one round")


def test_compare_loops_reports_the_spread_of_its_overhead():
    out = B.compare_loops(B.BenchConfig(precision="fp32", **TINY), "cpu", warmup=0, steps=1,
                          rounds=2)
    assert len(out["overhead_rounds_pct"]) == 2 and math.isfinite(out["overhead_spread_pct"])
    assert "spread" in out and isinstance(out["note"], str)


def test_bf16_adamw_add_param_group_refuses_fp32_params():
    opt = O.BF16AdamW([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="params must be bfloat16 tensors.*float32"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="params must be bfloat16"):
        opt.add_param_group({"params": (p for p in [nn.Parameter(torch.zeros(2))])})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))})
    assert len(opt.param_groups) == 2
