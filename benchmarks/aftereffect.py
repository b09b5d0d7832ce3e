"""Does anything a lesson row does leave a cost behind for the steps timed after it?

`instrument.py` timed the plain loop again after `bench.measure` on the host-bound checkpointing
step and found it 4.6-5.5% slower in three H200 runs (on the GPU-bound fastest row: +0.1%). This
script takes measure() apart, in one process: a plain hand-written loop (instrument.plain_loop,
ResNet-50, fp16 + GradScaler, channels_last, per-block checkpointing, foreach SGD, batch 256) is
timed (`--repeats` x `--steps` steps, wall clock, synchronised, median) before anything, after
a pause (drift), after each piece measure() runs (the GPU-idle profiler pass, the memory
breakdown, a fresh engine model trained and timed, `free_memory`) and after a whole `measure()`;
plus, at the start, the same loop timed by `bench.time_steps` (the CUDA-event timer a row uses)
against the wall clock. Each phase's median is given against the first baseline, with the
spread of its repeats.

    python benchmarks/aftereffect.py --json $OUT/aftereffect.json [--steps 10] [--repeats 8]

On a CPU it runs in tiny sizes (a check of the script; no conclusions).
"""
import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from amp_lessons import measure as bench  # noqa: E402
from instrument import plain_loop, setup, sync, wall_ms  # noqa: E402


def timed(step, x, y, device, steps, repeats):
    """Median and relative spread (max-min over median) of ``repeats`` wall-clock timings."""
    gc.collect()
    gc.disable()
    try:
        step(x, y)  # one untimed step after whatever ran before
        ms = [wall_ms(step, x, y, steps, device) for _ in range(repeats)]
    finally:
        gc.enable()
    med = statistics.median(ms)
    return {"ms": med, "spread_pct": 100 * (max(ms) - min(ms)) / med, "repeats_ms": ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=8)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = dict(model="resnet50", batch=256, image=224, classes=1000) if cuda else \
        dict(model="resnet18", batch=4, image=32, classes=10)
    config, state, x, y = setup("checkpoint", device, sizes)
    step = plain_loop(config, device, state)
    for _ in range(5):
        step(x, y)
    sync(device)
    t0 = time.perf_counter()
    phases = []

    def phase(name, action=None):
        if action is not None:
            action()
        sync(device)
        r = timed(step, x, y, device, args.steps, args.repeats)
        r["phase"] = name
        phases.append(r)
        print(f"{name}: {r['ms']:.2f} ms/step (spread {r['spread_pct']:.1f}%)", flush=True)

    phase("baseline")
    ev = bench.time_steps(step, x, y, warmup=1, steps=3 * args.steps, device=device)
    timer_ms = statistics.median(ev["times_ms"])
    phase("after bench.time_steps (the row's timer)")
    phase("after a 3 s pause (drift)", lambda: time.sleep(3))
    phase("after the GPU-idle profiler pass (device_busy_ms)",
          lambda: bench.device_busy_ms(step, x, y, device) if cuda else None)
    phase("after the profiler pass again", lambda: bench.device_busy_ms(step, x, y, device) if cuda else None)
    phase("after a 3 s pause again (drift)", lambda: time.sleep(3))

    def breakdown():
        model = bench.build_model(config, device)
        opt = bench.build_optimizer(config, model.parameters())
        bench.memory_breakdown(bench.hand_step(model, opt, config.precision, device), x, y, device)
    phase("after the memory breakdown (fresh engine model, one step)", breakdown)

    def fresh_timed():
        model = bench.build_model(config, device)
        opt = bench.build_optimizer(config, model.parameters())
        bench.time_steps(bench.hand_step(model, opt, config.precision, device), x, y,
                         warmup=5, steps=15, device=device)
    phase("after a fresh engine model trained and timed (20 steps)", fresh_timed)
    phase("after free_memory (empty the allocator's cache)", lambda: bench.free_memory(device))
    rows = []
    phase("after bench.measure (the whole lesson row)",
          lambda: rows.append(bench.measure(config, device, warmup=5, steps=15)))
    base = phases[0]["ms"]
    for r in phases:
        r["vs_baseline_pct"] = 100 * (r["ms"] / base - 1)
    row = rows[0]
    out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "config": config.describe(), "steps": args.steps, "repeats": args.repeats,
           "seconds": time.perf_counter() - t0,
           "timer_median_ms": timer_ms, "timer_vs_wall_pct": 100 * (timer_ms / base - 1),
           "measure_img_per_s": row.get("img_per_s"), "measure_status": row.get("status"),
           "measure_vs_baseline_pct": (100 * (config.batch_size / row["img_per_s"] * 1e3 / base - 1)
                                       if row.get("img_per_s") else None),
           "phases": phases}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"row's timer {timer_ms:.2f} ms against wall {base:.2f} ms ({out['timer_vs_wall_pct']:+.1f}%); "
          f"measure() row {out['measure_vs_baseline_pct']}")
    for r in phases:
        print(f"{r['vs_baseline_pct']:+6.2f}%  {r['phase']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
