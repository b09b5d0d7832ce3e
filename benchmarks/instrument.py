"""Is the instrument invisible? The engine's timed step against a plain hand-written loop.

For each configuration, four variants train their own copy of the same initial weights:

- ``plain loop``: written here without the package's step (``torch.autocast``, ``GradScaler``,
  ``scaler.step``/``update``, ``zero_grad``), the model from ``models.resnet50(checkpoint=...)``;
- ``plain loop (again)``: a second, identical plain loop: the noise floor;
- ``engine step``: ``bench.build_model``/``build_optimizer``/``hand_step``, the step every lesson
  row times, timed here exactly as the plain loop is;
- ``engine timer``: the same engine step timed by ``bench.time_steps`` (a CUDA event pair per
  step, the median): the number a lesson row reports.

Each variant first runs ``--warmup`` untimed steps. Rounds are interleaved; each runs ``--steps``
steps per variant, synchronised at both ends. The order is balanced (``bench_rounds.py``): each
round begins with ``--warm-steps`` untimed steps of a throwaway plain loop, and over each block
of 4 rounds every variant runs in every position once, in a seeded random order per block (so
that ``--rounds`` is best a multiple of 4). The old order alternated (``--schedule alternate``):
the plain loop ran first in every other round, right after the pause between rounds, where on
the H200 the first slot of a round paid 3-5% (issue 22). The garbage collector is off during
the rounds. A variant's cost is the median over rounds of its PAIRED ratio to the plain loop of
the same round, in % slower (clock drift hits both alike); ``floor_pct`` is the plain loop
against itself (the largest distance of the 95% bootstrap interval of its median paired ratio
from that median, plus that median's distance from 0). ``within_3pct``: the engine's cost and
its interval stay within 3% (the issue's bar). ``round_ms`` keeps every round's ms per step.

Then, once: ``bench.measure`` of the configuration, as a lesson runs it (memory breakdown before
the warm-up, the GPU idle share under the profiler after the timing), whose img/s is compared with
the plain loop's; and the plain loop timed again after that profiler pass, to show whether a
profiler pass leaves a cost behind for the steps timed after it in the same process.

Configurations (ResNet-50, batch 256, 224x224, synthetic data, SGD momentum 0.9, cuDNN autotuning):
``checkpoint``: fp16 + GradScaler, channels_last, per-block checkpointing, foreach SGD (the
issue's host-bound case); ``fastest``: fp16 + GradScaler, channels_last, fused SGD (lessons 04's
fastest eager row; the compiled rows are left out: one compilation per variant would not fit the
budget).

    python benchmarks/instrument.py --json $OUT/instrument.json [--configs checkpoint fastest]
        [--rounds 8] [--steps 15] [--warm-steps 3] [--budget 180]

On a CPU it runs in tiny sizes (``--smoke``: a check of the script; no conclusions).
"""
import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:  # bench_rounds, when imported by path
    sys.path.append(str(Path(__file__).resolve().parent))
from amp_lessons import measure as bench  # noqa: E402
from amp_lessons.data import synthetic_images  # noqa: E402
from bench_rounds import SCHEDULES, Schedule, run_rounds  # noqa: E402

CONFIGS = {
    "checkpoint": dict(checkpoint="block", impl="foreach"),
    "fastest": dict(checkpoint=None, impl="fused"),
}
PLAIN, AGAIN, ENGINE, TIMER = "plain loop", "plain loop (again)", "engine step", "engine timer"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(config, device, state):
    """The hand-written loop: nothing of the package but the model (``models.resnet50``)."""
    model = bench.MODELS[config.model](num_classes=config.num_classes, checkpoint=config.checkpoint)
    model.load_state_dict(state)
    model = model.to(device).to(memory_format=torch.channels_last).train()
    kind = {"fused": dict(fused=True), "foreach": dict(foreach=True)}[config.impl]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kind)
    if config.impl == "fused":  # the course's fused-SGD workaround, as the engine applies it
        for p in model.parameters():
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    scaler = torch.amp.GradScaler(device.type)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    def step(x, y):
        with torch.autocast(device_type=device.type, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def engine_step(config, device, state):
    """The step a lesson row times: the engine's model, optimizer and ``hand_step``."""
    model = bench.build_model(config, device)
    model.load_state_dict(state)
    opt = bench.build_optimizer(config, model.parameters())
    return bench.hand_step(model, opt, config.precision, device)


def wall_ms(step, x, y, steps, device):
    """Milliseconds per step of ``steps`` steps, synchronised at both ends."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / steps


def bootstrap(values, reps=2000, seed=0):
    """The median and its 95% bootstrap interval."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return statistics.median(values), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def noise_floor(costs):
    """(median, low, high, floor) of the plain loop's twin's paired costs in %: the floor is
    the largest distance of the 95% interval from the median plus the median's from 0."""
    med, lo, hi = bootstrap(costs)
    return med, lo, hi, max(abs(lo - med), abs(hi - med)) + abs(med)


def setup(name, device, sizes):
    """The configuration ``name`` at ``sizes`` (model, batch, image, classes), its initial
    weights (seed 0: every loop starts from them) and one synthetic batch on ``device``; turns
    cuDNN autotuning on."""
    extra = CONFIGS[name]
    precision = "fp16" if device.type == "cuda" else "bf16"
    config = bench.BenchConfig(label=name, model=sizes["model"], precision=precision,
                               channels_last=True, batch_size=sizes["batch"],
                               image_size=sizes["image"], num_classes=sizes["classes"],
                               optimizer="sgd", impl=extra["impl"], checkpoint=extra["checkpoint"],
                               cudnn_benchmark=True)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in bench.MODELS[config.model](
        num_classes=config.num_classes, checkpoint=config.checkpoint).state_dict().items()}
    x, y = synthetic_images(config.batch_size, config.image_size, config.num_classes, device,
                            channels_last=True)
    return config, state, x, y


def compare(name, device, sizes, rounds, steps, warmup, deadline, warm_steps=3,
            schedule="balanced", seed=0):
    """One configuration: the interleaved rounds (``bench_rounds``: ``warm_steps`` untimed
    steps of a throwaway plain loop, then the variants in a balanced order), then
    ``bench.measure`` and the plain loop after its profiler pass. ``deadline``: perf_counter
    seconds by which all of it should be done."""
    config, state, x, y = setup(name, device, sizes)
    steps_of = {PLAIN: plain_loop(config, device, state), AGAIN: plain_loop(config, device, state),
                ENGINE: engine_step(config, device, state)}
    steps_of[TIMER] = engine_step(config, device, state)
    warm = plain_loop(config, device, state) if warm_steps > 0 else None  # never timed
    for step in list(steps_of.values()) + ([warm] if warm else []):
        for _ in range(warmup):  # warm-up: cuDNN autotuning, optimizer state, allocator
            step(x, y)
    sync(device)
    ms = {k: [] for k in steps_of}
    order = Schedule(list(steps_of), schedule, seed=seed)

    def time_slot(name_, r):
        if name_ == TIMER:
            t = bench.time_steps(steps_of[TIMER], x, y, warmup=0, steps=steps, device=device)
            ms[TIMER].append(statistics.median(t["times_ms"]))
        else:
            ms[name_].append(wall_ms(steps_of[name_], x, y, steps, device))

    def warm_slot(r):
        for _ in range(warm_steps):
            warm(x, y)

    # kept for measure() and the plain loop after it (about 11 s for the checkpointed step
    # on the H200, 2 rounds' worth): 10 s and 3 rounds
    done = run_rounds(order, time_slot, warm_slot if warm else None, max_rounds=rounds,
                      deadline=deadline, reserve=lambda round_s: 10 + 3 * round_s)
    del warm
    rows = []
    floor = None
    for name_ in (AGAIN, ENGINE, TIMER):
        cost = [100 * (ms[name_][i] / ms[PLAIN][i] - 1) for i in range(done)]
        med, lo, hi, spread = noise_floor(cost)
        if name_ == AGAIN:
            floor = spread
        rows.append({"variant": name_, "cost_pct": med, "ci95_pct": [lo, hi],
                     "img_per_s": config.batch_size / (statistics.median(ms[name_]) / 1e3)})
    plain_img_s = config.batch_size / (statistics.median(ms[PLAIN]) / 1e3)
    del steps_of
    bench.free_memory(device)
    row = bench.measure(config, device, warmup=5, steps=15)  # as a lesson measures it
    after = plain_loop(config, device, state)  # timed after measure()'s profiler pass
    for _ in range(warmup):
        after(x, y)
    after_ms = [wall_ms(after, x, y, steps, device) for _ in range(2)]
    del after
    bench.free_memory(device)
    engine = next(r for r in rows if r["variant"] == ENGINE)
    timer = next(r for r in rows if r["variant"] == TIMER)
    return {
        "config": config.label, "describe": config.describe(), "rounds": done,
        "steps_per_round": steps, "schedule": order.describe(done, warm_steps),
        "plain_img_per_s": plain_img_s, "floor_pct": floor, "variants": rows,
        "round_ms": ms,
        "within_3pct": all(abs(v["cost_pct"]) <= 3 and max(map(abs, v["ci95_pct"])) <= 3 + floor
                           for v in (engine, timer)),
        "measure_row": {k: row.get(k) for k in ("status", "reason", "img_per_s", "spread",
                                                "gpu_idle_fraction", "peak_allocated_gib",
                                                "timer", "steps", "warmup")},
        "measure_vs_plain_pct": (100 * (plain_img_s / row["img_per_s"] - 1)
                                 if row.get("img_per_s") else None),
        "plain_after_profiler_img_per_s": config.batch_size / (statistics.median(after_ms) / 1e3),
        "plain_after_profiler_cost_pct": 100 * (statistics.median(after_ms)
                                                / statistics.median(ms[PLAIN]) - 1),
    }


def markdown(doc) -> str:
    """The run as a Markdown table for benchmarks/NOTES.md (numbers read from the JSON only)."""
    lines = [f"{doc['device']}, torch {doc['torch']}, {doc.get('seconds', 0):.0f} s.", "",
             "| configuration | rounds x steps | plain loop img/s | noise floor | plain (again) "
             "| engine step | engine timer (a row's number) | lesson row against plain | plain "
             "loop after a profiler pass |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in doc["configs"]:
        cells = {}
        for v in c["variants"]:
            lo, hi = v["ci95_pct"]
            cells[v["variant"]] = f"{v['cost_pct']:+.2f}% [{lo:+.1f}, {hi:+.1f}]"
        vs = c.get("measure_vs_plain_pct")
        lines.append(f"| {c['describe']} | {c['rounds']} x {c['steps_per_round']} | "
                     f"{c['plain_img_per_s']:,.0f} | {c['floor_pct']:.2f}% | {cells.get(AGAIN)} | "
                     f"{cells.get(ENGINE)} | {cells.get(TIMER)} | "
                     f"{'n/a' if vs is None else f'{vs:+.2f}%'} | "
                     f"{c['plain_after_profiler_cost_pct']:+.2f}% |")
    notes = [c for c in doc["configs"] if c.get("schedule")]  # runs since the balanced order
    if notes:
        lines.append("")
    for c in notes:
        o = c["schedule"]
        blocks = o["whole_blocks"]
        lines.append(f"- {c['config']}: {o['kind']} order ({blocks} whole "
                     f"block{'' if blocks == 1 else 's'} of {o['block_rounds']} rounds), "
                     f"{o['warm_steps']} untimed warm "
                     f"step{'' if o['warm_steps'] == 1 else 's'} a round")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", "."))
                        / "instrument.json")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=8,
                        help="at most this many rounds (best a multiple of 4: whole blocks)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--warm-steps", type=int, default=3,
                        help="untimed steps of a throwaway plain loop at the start of each round")
    parser.add_argument("--schedule", choices=SCHEDULES, default="balanced",
                        help="the order of the variants in the rounds (alternate: the old order)")
    parser.add_argument("--seed", type=int, default=0, help="for the balanced order")
    parser.add_argument("--budget", type=float, default=180.0,
                        help="seconds; rounds past 2 stop where the next round (at a block end: "
                             "the next block) would not leave time for bench.measure and the "
                             "last plain loop within a configuration's share")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check)")
    parser.add_argument("--report", type=Path, default=None,
                        help="print a JSON result of this script as a Markdown table; run nothing")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text())))
        return 0
    if args.rounds < 2 or args.steps < 1 or args.warmup < 1 or args.budget <= 0 or \
            args.warm_steps < 0:
        parser.error("--rounds must be >= 2, --steps and --warmup >= 1, --warm-steps >= 0, "
                     "--budget > 0")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes = (dict(model="resnet18", batch=2, image=32, classes=10) if device.type != "cuda"
             else dict(model="resnet50", batch=256, image=224, classes=1000))
    start = time.perf_counter()
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "sizes": sizes, "configs": []}
    for i, name in enumerate(args.configs):
        share = (args.budget - (time.perf_counter() - start)) / (len(args.configs) - i)
        deadline = time.perf_counter() + share
        result = compare(name, device, sizes, args.rounds, args.steps, args.warmup, deadline,
                         args.warm_steps, args.schedule, args.seed)
        out["configs"].append(result)
        print(json.dumps({k: result[k] for k in ("config", "plain_img_per_s", "floor_pct",
                                                 "within_3pct", "measure_vs_plain_pct",
                                                 "plain_after_profiler_cost_pct")}), flush=True)
        for v in result["variants"]:
            print(f"  {v['variant']:20s} {v['img_per_s']:9.1f} img/s  cost {v['cost_pct']:+.2f}% "
                  f"[{v['ci95_pct'][0]:+.2f}, {v['ci95_pct'][1]:+.2f}]", flush=True)
    out["seconds"] = time.perf_counter() - start
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {args.json} ({out['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
