"""benchmarks/instrument.py on the CPU (tiny sizes): the plain loop, its twin, the engine's step
and the engine's timer run interleaved and are written with their costs and the noise floor; the
plain loop and the engine's step train the same weights to the same result. The numbers mean
nothing here; the H200 run decides (issue 21)."""
import json

import pytest
import torch

from script_helpers import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def instrument():
    return load_benchmark("instrument")


def test_bootstrap_gives_the_median_and_an_interval_around_it(instrument):
    med, lo, hi = instrument.bootstrap([1.0, 2.0, 3.0, 4.0, 5.0])
    assert med == 3.0 and lo <= med <= hi and 1.0 <= lo and hi <= 5.0
    assert instrument.bootstrap([2.0] * 4) == (2.0, 2.0, 2.0)


def test_the_plain_loop_and_the_engine_step_train_alike(instrument):
    from amp_lessons import measure as bench

    config = bench.BenchConfig(model="resnet18", precision="bf16", channels_last=True,
                               batch_size=2, image_size=32, num_classes=10, impl="foreach")
    torch.manual_seed(0)
    state = bench.MODELS["resnet18"](num_classes=10).state_dict()
    x, y = bench.runner.synthetic_images(2, 32, 10, "cpu", channels_last=True)
    plain = instrument.plain_loop(config, torch.device("cpu"), state)
    engine = instrument.engine_step(config, torch.device("cpu"), state)
    a = [float(plain(x, y)) for _ in range(2)]
    b = [float(engine(x, y)) for _ in range(2)]
    assert a == pytest.approx(b, rel=1e-5)


def test_smoke_run_writes_every_variant(instrument, tmp_path):
    out = tmp_path / "instrument.json"
    assert instrument.main(["--smoke", "--configs", "fastest", "--rounds", "2", "--steps", "1",
                            "--warmup", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (result,) = doc["configs"]
    assert [v["variant"] for v in result["variants"]] == [instrument.AGAIN, instrument.ENGINE,
                                                          instrument.TIMER]
    assert result["rounds"] == 2 and result["floor_pct"] >= 0
    assert result["schedule"]["kind"] == "balanced" and result["schedule"]["warm_steps"] == 3
    assert {k: len(v) for k, v in result["round_ms"].items()} == {
        n: 2 for n in (instrument.PLAIN, instrument.AGAIN, instrument.ENGINE, instrument.TIMER)}
    assert result["measure_row"]["status"] == "ok" and result["plain_after_profiler_img_per_s"] > 0
    with pytest.raises(SystemExit):
        instrument.main(["--smoke", "--rounds", "1"])


def test_report_renders_a_committed_run(instrument, capsys):
    """``--report`` prints the JSON as NOTES.md's table, numbers from the JSON only."""
    path = BENCHMARKS / "results" / "instrument_h200_checkpoint_balanced.json"
    doc = json.loads(path.read_text())
    text = instrument.markdown(doc)
    c = doc["configs"][0]
    assert c["describe"] in text and f"{c['floor_pct']:.2f}%" in text
    assert f"{c['plain_img_per_s']:,.0f}" in text
    assert instrument.main(["--report", str(path)]) == 0
    assert capsys.readouterr().out.strip() == text


def test_a_first_slot_penalty_biases_no_variant(instrument):
    """A synthetic timer where whatever runs first in a round pays 4% (the H200's position
    effect): with the script's order (a warm slot, then a balanced order) the twin plain loop
    reads near 0 and the floor falls under 2% in 48 rounds; the old alternating order, which
    put the plain loop first in every other round, reads about -2% with a floor over 2%."""
    import random

    names = [instrument.PLAIN, instrument.AGAIN, instrument.ENGINE, instrument.TIMER]

    def run(kind, warm):
        rng, ms, last = random.Random(1), {n: [] for n in names}, [None]

        def take(r):
            first, last[0] = r != last[0], r
            return (1 + rng.gauss(0, 0.01)) * (1.04 if first else 1)

        done = instrument.run_rounds(instrument.Schedule(names, kind), lambda n, r: ms[n].append(
            take(r)), (lambda r: take(r)) if warm else None, max_rounds=48)
        assert done == 48
        return {n: instrument.noise_floor([100 * (a / b - 1) for a, b in
                                           zip(ms[n], ms[instrument.PLAIN])]) for n in names[1:]}

    new = run("balanced", warm=True)
    assert all(abs(v[0]) < 0.8 for v in new.values()), new
    assert new[instrument.AGAIN][3] < 2.0
    old = run("alternate", warm=False)
    assert old[instrument.AGAIN][0] < -1.0 and old[instrument.AGAIN][3] > 2.0, old
