"""benchmarks/trainer_overhead.py on the CPU (tiny sizes): it runs within its budget, reports
its noise floor and each variant's interval, and every eager variant ends bitwise equal to its
hand loop. The numbers themselves mean nothing here; the H200 run decides (issue 22)."""
import json
import random

import pytest
import torch

from script_helpers import load_benchmark



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("trainer_overhead")


def test_noise_floor_and_intervals(bench):
    rng = random.Random(0)
    assert bench.noise_floor([1.0] * 10, rng) == 0.0
    noisy = [1.0 + (-1) ** i * 0.05 for i in range(20)]
    assert 0 < bench.noise_floor(noisy, rng) <= 10.0
    s = bench.summarise([1.10] * 5, rng)
    assert s["cost_pct"] == pytest.approx(10.0) and s["cost_ci95_pct"] == pytest.approx([10, 10])


def test_smoke_run_writes_json_and_stays_bitwise(bench, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    bench.main(["--networks", "mlp_bf16", "--budget", "6", "--min-rounds", "2",
                "--max-rounds", "3", "--json", str(out)])
    doc = json.loads(out.read_text())
    net = doc["networks"]["mlp_bf16"]
    assert net["rounds"] >= 2 and net["noise_floor_pct"] >= 0
    variants = {r["variant"]: r for r in net["rows"]}
    assert {"hand-written", "hand-written (again)", "trainer, defaults", "trainer, lean",
            "lean, nonfinite='raise'",
            "trainer lean, foreach SGD, skip by host decision"} <= set(variants)
    for row in net["rows"]:
        low, high = row["cost_ci95_pct"]
        assert low <= row["cost_pct"] <= high
        assert row["bitwise_equal_to_reference"], row["variant"]
        # the host's CPU time, read the same paired way
        low, high = row["host_cpu_cost_ci95_pct"]
        assert row["host_cpu_ms_per_step"] > 0 and low <= row["host_cpu_cost_pct"] <= high
    assert net["host_cpu_noise_floor_pct"] >= 0
    assert {g["variant"] for g in doc["goals"]} == {"trainer, defaults", "trainer, lean"}
    capsys.readouterr()
    bench.main(["--report", str(out)])
    report = capsys.readouterr().out
    assert "**mlp_bf16** (bf16): noise floor" in report and "| trainer, lean |" in report
    assert "host CPU time's noise floor" in report and "| host CPU cost [95%] |" in report
    rows = [line for line in report.splitlines() if line.startswith("| trainer, lean |")]
    assert rows and rows[0].count("|") == 11  # ten columns


@pytest.mark.serial  # asserts on CPU time against wall time: alone, not beside other workers
def test_time_round_counts_host_cpu_time_not_waiting(bench):
    """A step that sleeps costs wall time but (almost) no CPU time; one that computes costs
    both: the host-CPU column tells host work from waiting."""
    import time as _time

    def sleepy(x, y):
        _time.sleep(0.005)

    def busy(x, y):
        end = _time.perf_counter() + 0.005
        while _time.perf_counter() < end:
            pass

    cpu_device = torch.device("cpu")
    wall_s, _, _, cpu_s = bench.time_round(sleepy, None, None, 4, cpu_device)
    wall_b, _, _, cpu_b = bench.time_round(busy, None, None, 4, cpu_device)
    assert wall_s >= 5 and wall_b >= 5
    # the busy step's CPU time stays far above the sleeping one's even where other processes
    # take the core half the time (as when the tests share two cores): not a share of its wall
    assert cpu_s < 0.5 * wall_s and cpu_b > max(1.0, 10 * cpu_s), (cpu_s, wall_s, cpu_b, wall_b)


def test_a_report_of_a_run_before_the_host_cpu_column_still_reads(bench):
    from script_helpers import BENCHMARKS

    doc = json.loads((BENCHMARKS / "results" / "trainer_overhead_h200_raise_pool.json")
                     .read_text())
    text = bench.markdown(doc)
    assert "host CPU" not in text and "| trainer, lean | 2.115 |" in text


class FirstSlotPenalty:
    """A synthetic timer: every slot takes 1 ms x (1 + gaussian noise), and the first slot of
    each round, the first after the pause between rounds (the H200's 3-5%), pays ``penalty``
    more. Records the timed slots' milliseconds per variant."""

    def __init__(self, penalty=0.04, noise=0.01, seed=1):
        self.penalty, self.noise = penalty, noise
        self.rng = random.Random(seed)
        self.round, self.ms = None, {}

    def _take(self, r):
        first, self.round = r != self.round, r
        return (1 + self.rng.gauss(0, self.noise)) * (1 + self.penalty if first else 1)

    def warm(self, r):
        self._take(r)

    def slot(self, name, r):
        self.ms.setdefault(name, []).append(self._take(r))


NAMES = ["hand-written", "hand-written (again)", "trainer, defaults", "trainer, lean",
         "+ grad norm only", "+ memory only", "+ step time only"]


def simulate(bench, kind, warm, rounds=7 * 24):
    timer = FirstSlotPenalty()
    done = bench.run_rounds(bench.Schedule(NAMES, kind, seed=0), timer.slot,
                            timer.warm if warm else None, max_rounds=rounds)
    assert done == rounds
    rng = random.Random(0)
    hand = timer.ms[bench.HAND]
    twin = [a / b for a, b in zip(timer.ms[bench.AGAIN], hand)]
    costs = {n: bench.summarise([a / b for a, b in zip(timer.ms[n], hand)], rng)["cost_pct"]
             for n in NAMES}
    return costs, bench.noise_floor(twin, rng)


def test_a_first_slot_penalty_biases_no_variant(bench):
    """The H200's position effect, on a synthetic timer: whatever runs first in a round pays
    4%. The script's order (a warm slot, then a balanced order) leaves the twin hand loop near 0
    and the floor under 2%; so it does with the balanced order alone, without a warm slot. The
    old alternating order gives the reference the first slot in every other round: the twin
    reads about -2% and the floor stays above 2%, as on the H200 (-1.5/-1.9%, 2.6/2.8%)."""
    costs, floor = simulate(bench, "balanced", warm=True)
    assert all(abs(c) < 0.5 for c in costs.values()), costs
    assert floor < 1.0
    costs, floor = simulate(bench, "balanced", warm=False)
    assert all(abs(c) < 0.6 for c in costs.values()), costs
    assert floor < 2.0
    costs, floor = simulate(bench, "alternate", warm=False)
    assert costs[bench.AGAIN] < -1.0 and floor > 2.0, (costs, floor)


def test_the_balanced_order_puts_every_variant_everywhere_equally(bench):
    schedule = bench.Schedule(NAMES, "balanced", seed=3)
    blocks = 6
    orders = [schedule.order(r) for r in range(blocks * len(NAMES))]
    for pos in range(len(NAMES)):
        for name in NAMES:
            assert sum(o[pos] == name for o in orders) == blocks
    first = sum(o.index(bench.HAND) < o.index(bench.AGAIN) for o in orders) / len(orders)
    assert 0.2 < first < 0.8  # the reference is not systematically before its twin
    assert orders == [bench.Schedule(NAMES, "balanced", seed=3).order(r)
                      for r in range(len(orders))]  # seeded: the same run, the same order
    with pytest.raises(ValueError, match="schedule"):
        bench.Schedule(NAMES, "random")


def test_rounds_stop_at_block_ends_and_keep_gc_off(bench):
    import gc

    seen = []
    schedule = bench.Schedule(NAMES[:3], "balanced")
    done = bench.run_rounds(schedule, lambda name, r: seen.append(gc.isenabled()),
                            max_rounds=100, min_rounds=4, at_block_end=lambda n: n >= 4)
    assert done == 6 and not any(seen) and gc.isenabled()  # 4 rounds asked: 2 whole blocks
    now = [0.0]  # a clock that only the slots move: 1 s a slot, 3 s a round

    def slot(name, r):
        now[0] += 1

    # a block starts only where it fits: at 9 s the next block would end at 18 s
    for deadline, rounds in ((10, 3), (20, 6), (19, 6)):
        now[0] = 0.0
        assert bench.run_rounds(schedule, slot, max_rounds=100, deadline=deadline,
                                clock=lambda: now[0]) == rounds


def assert_a_bad_step_changes_nothing(bench, step, model, opt, x, y) -> dict:
    """Run ``step`` on ``x`` with an inf in it: weights, buffers and optimizer state stay
    bitwise as they were. Returns them as they were."""
    import torch

    before = {k: v.clone() for k, v in bench.state_of(model, opt).items()}
    bad = x.clone()
    bad[0, 0] = float("inf")
    step(bad, y)
    after = bench.state_of(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)
    return before


def test_the_found_inf_hand_loop_skips_a_bad_step(bench):
    """The hand loop with the same check as the trainer's lean skip: a step whose gradients
    hold an inf leaves weights and fused AdamW's state bitwise as they were (on the CPU)."""
    import torch

    table = bench.variants("mlp_bf16", torch.device("cpu"))
    step, model, opt = table[bench.FOUND_INF][1](True)
    _, x, y = bench.build("mlp_bf16", torch.device("cpu"), True)
    for _ in range(2):
        step(x, y)
    before = assert_a_bad_step_changes_nothing(bench, step, model, opt, x, y)
    step(x, y)
    assert not torch.equal(before["model.0.weight"], model.state_dict()["0.weight"])


@pytest.mark.parametrize("network", ["recipe", "mlp_bf16"])
def test_the_logging_hand_loop_logs_the_trainers_figures(bench, network):
    """The hand loop that logs what the defaults record logs the same gradient norm as the
    trainer's record, bit for bit, and a step time; on the bf16 MLP it also skips a step whose
    gradients hold an inf, leaving weights and fused AdamW's state as they were."""
    import torch

    from amp_lessons.train import trainer as T

    cpu = torch.device("cpu")
    name = bench.LOGGING if network == "recipe" else bench.LOGGING_CHECK
    table = bench.variants(network, cpu)
    assert table[name][0] == bench.HAND
    assert ("trainer, defaults", name) in bench.ALSO_AGAINST[network]
    step, model, opt = table[name][1](True)
    t_model, x, y = bench.build(network, cpu, True)
    trainer = T.Trainer(t_model, bench.optimizer(network, t_model),
                        T.TrainConfig(precision=bench.PRECISION[network], progress=False,
                                      seed=None))
    records = [trainer.train_step([(x, y)]) for _ in range(3)]
    for _ in range(3):
        step(x, y)
    assert [n.item() for _, n, _, _ in step.log] == [r.grad_norm for r in records]
    assert all(end >= start for _, _, start, end in step.log)
    if network == "mlp_bf16":
        assert_a_bad_step_changes_nothing(bench, step, model, opt, x, y)


def test_the_gpu_bound_network_compares_both_nonfused_skips(bench):
    """``resnet50_bf16`` (bf16, SGD with momentum: its state lives on the device) times lean
    with the default copy against lean with ``nonfused_skip="sync"``; both train the same."""
    cpu = torch.device("cpu")
    table = bench.variants("resnet50_bf16", cpu)
    assert {"trainer, lean", "lean, nonfused_skip='sync'", "lean, nonfinite='ignore'",
            "lean, no BN guard"} <= set(table)
    assert table["lean, nonfused_skip='sync'"][0] == bench.HAND
    assert "resnet50_bf16" in bench.NETWORKS and "resnet50_bf16" not in bench.DEFAULT_NETWORKS
    _, x, y = bench.build("resnet50_bf16", cpu, quick=True)
    weights = []
    for name in ("trainer, lean", "lean, nonfused_skip='sync'"):
        step, model, opt = table[name][1](True)
        assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
        for _ in range(2):
            step(x, y)
        weights.append(model.fc.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_the_lean_step_skip_check_runs_on_a_cpu(bench, capsys):
    """``lean_skip_checks`` (part of the GPU checks): each case takes the lean step, skips the
    bad step and leaves weights and optimizer state bitwise as they were."""
    results = bench.lean_skip_checks(torch.device("cpu"), True)
    assert set(results) == {"lean fp16 sgd", "lean fp16 sgd-fused", "lean bf16 sgd",
                            "lean bf16 adamw-fused"}
    assert all(r["ok"] and r["lean"] for r in results.values()), results
    capsys.readouterr()


def test_the_one_function_hand_loop_is_the_hand_loop_bitwise(bench):
    """The learner's one-function loop makes the reference's calls: same weights after 3 steps."""
    table = bench.variants("recipe", torch.device("cpu"))
    ref, inline = table[bench.HAND][1](True), table[bench.INLINE][1](True)
    assert table[bench.INLINE][0] == bench.HAND
    _, x, y = bench.build("recipe", torch.device("cpu"), True)
    for _ in range(3):
        ref[0](x, y), inline[0](x, y)
    for a, b in zip(ref[1].parameters(), inline[1].parameters()):
        assert torch.equal(a, b)


def test_each_variant_builds_warms_and_names_unknown_ones(bench, monkeypatch):
    with pytest.raises(ValueError, match=r"--variants: \['nope'\] not among"):
        bench.each_variant("recipe", ["hand-written", "nope"], torch.device("cpu"), True, 1)
    log = []

    def fake_variants(network, device):
        def maker(name):
            def make(quick):
                log.append(f"build {name}")
                return (lambda x, y: log.append(f"step {name}")), object(), object()
            return make
        return {n: ("ref", maker(n)) for n in ("a", "b")}

    monkeypatch.setattr(bench, "variants", fake_variants)
    monkeypatch.setattr(bench, "build", lambda *a: (None, "x", "y"))
    for name, step, x, y in bench.each_variant("recipe", ["b", "a"], torch.device("cpu"), True, 2):
        log.append(f"use {name}")
    # each built, warmed up twice and handed out before the next one is built
    assert log == ["build b", "step b", "step b", "use b", "build a", "step a", "step a", "use a"]


def test_checks_only_refuses_where_there_are_no_gpu_checks_to_run(bench, tmp_path, capsys):
    """On a CPU (or with --no-gpu-checks) --checks-only ran nothing and wrote an empty document."""
    out = tmp_path / "c.json"
    for extra in ([], ["--no-gpu-checks"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(["--checks-only", "--json", str(out)] + extra)
        assert exc.value.code == 2 and "--checks-only runs the GPU checks" in capsys.readouterr().err
    assert not out.exists()


def test_the_profiling_scripts_shared_flags_and_loop(bench, monkeypatch, capsys):
    import argparse
    p = argparse.ArgumentParser()
    bench.profiling_arguments(p, "recipe", ("hand-written",), steps=3, steps_help="h", repeats=2,
                              warm_steps=1, top=4)
    args = p.parse_args(["--quick", "--variants", "a", "b"])
    assert (args.network, args.steps, args.repeats, args.warm_steps, args.top, args.json) == \
        ("recipe", 3, 2, 1, 4, None) and args.quick and args.variants == ["a", "b"]
    monkeypatch.setattr(bench, "each_variant", lambda net, names, device, quick, warm: iter(
        [(n, f"step {n}", "x", "y") for n in names]))
    device, rows = bench.profile_variants(p, args, lambda name, step, x, y, d: (step, d.type))
    assert rows == {"a": ("step a", device.type), "b": ("step b", device.type)}
    assert bench.device_name(torch.device("cpu")) == "cpu"

    def unknown(*a):
        raise ValueError("--variants: ['z'] not among [...]")
    monkeypatch.setattr(bench, "each_variant", unknown)
    with pytest.raises(SystemExit):
        bench.profile_variants(p, args, None)
    assert "--variants: ['z'] not among" in capsys.readouterr().err
