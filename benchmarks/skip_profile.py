"""Where does ``nonfinite="skip"`` cost time on a GPU-bound step? A profile of trainer_overhead's
variants (issue 22).

``trainer_overhead.py --networks resnet50_bf16`` read every skip variant of the trainer
(lean's default device copy, ``nonfused_skip="sync"``, ``nonfinite="raise"``, without the
BatchNorm guard) about 5% over the hand loop, and ``nonfinite="ignore"`` at 0.0%, with a noise
floor of 0.03%. This script takes the same variants (``trainer_overhead.variants``, same
models, optimizers and batches), times each alone (CUDA events, after warm-up, median of
``--repeats`` runs of ``--steps`` steps) and profiles a few steps of each with
``torch.profiler``: per step, the GPU's kernel time, kernel count, the time the GPU sat idle
within the profiled window, and the kernels whose time differs most from the hand loop's.

    python benchmarks/skip_profile.py --network resnet50_bf16 --json OUT.json

On a CPU (no kernels) it runs a quick smoke version of the same (``--quick``) for the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_overhead as TO  # noqa: E402

DEFAULT_VARIANTS = ("hand-written", "lean, nonfinite='ignore'", "trainer, lean",
                    "lean, nonfused_skip='sync'", "lean, no BN guard")


def timed(step, x, y, steps: int, repeats: int, device) -> dict:
    """Median ms per step over ``repeats`` runs of ``steps`` steps (CUDA events on a GPU)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(steps):
                step(x, y)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            times.append((time.perf_counter() - t0) * 1e3 / steps)
    med = statistics.median(times)
    return {"ms_per_step": round(med, 4),
            "spread_pct": round(100 * (max(times) - min(times)) / med, 2) if med else None}


def kernel_summary(trace_path: str, steps: int) -> dict:
    """Kernel time, count and idle time per step from a Chrome trace of ``steps`` steps."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and "dur" in e]
    by_name = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in kernels:
        name = e.get("name", "?")
        by_name[name][0] += float(e["dur"])
        by_name[name][1] += 1
        spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    ops = defaultdict(int)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e.get("name", "?")] += 1
    spans.sort()
    busy, last_end = 0.0, None
    for a, b in spans:
        if last_end is None or a > last_end:
            busy += b - a
            last_end = b
        elif b > last_end:
            busy += b - last_end
            last_end = b
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {"kernel_ms_per_step": round(sum(v[0] for v in by_name.values()) / steps / 1e3, 4),
            "kernels_per_step": round(sum(v[1] for v in by_name.values()) / steps, 1),
            "gpu_idle_ms_per_step": round((window - busy) / steps / 1e3, 4),
            "window_ms_per_step": round(window / steps / 1e3, 4),
            "ops_per_step": round(sum(ops.values()) / steps, 1),
            "op_counts": {k: v / steps for k, v in ops.items()},
            "by_name": {k: (round(v[0] / steps / 1e3, 5), v[1] / steps)
                        for k, v in by_name.items()}}


def profiled(step, x, y, steps: int, device) -> dict:
    """Profile ``steps`` steps (after the caller's warm-up); the kernel summary."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return kernel_summary(path, steps)
    finally:
        os.unlink(path)


def differences(rows: dict, ref: str, top: int) -> dict:
    """Per variant, the ``top`` kernels whose ms per step differ most from ``ref``'s."""
    base = rows[ref]["profile"]["by_name"]
    out = {}
    for name, row in rows.items():
        if name == ref:
            continue
        mine = row["profile"]["by_name"]
        diff = {k: round(mine.get(k, (0.0, 0))[0] - base.get(k, (0.0, 0))[0], 5)
                for k in set(mine) | set(base)}
        kernels = sorted(((k, d, mine.get(k, (0, 0))[1] - base.get(k, (0, 0))[1])
                          for k, d in diff.items() if d), key=lambda t: (-abs(t[1]), t[0]))[:top]
        a, b = row["profile"]["op_counts"], rows[ref]["profile"]["op_counts"]
        ops = sorted(((k, a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b)
                      if a.get(k, 0) != b.get(k, 0)), key=lambda t: (-abs(t[1]), t[0]))[:top]
        out[name] = {"kernels": kernels, "ops": ops}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    TO.profiling_arguments(p, "resnet50_bf16", DEFAULT_VARIANTS, steps=10, repeats=5,
                           warm_steps=5, top=8, steps_help="steps per timed repeat")
    p.add_argument("--profile-steps", type=int, default=4)
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.profile_steps, args.top) < 1 or args.warm_steps < 0:
        p.error("--steps, --repeats, --profile-steps and --top must be >= 1, --warm-steps >= 0")

    def measure(name, step, x, y, device):
        row = timed(step, x, y, args.steps, args.repeats, device)
        row["profile"] = prof = profiled(step, x, y, args.profile_steps, device)
        print(f"{name:36s} {row['ms_per_step']:9.3f} ms/step (spread {row['spread_pct']}%)  "
              f"kernels {prof['kernel_ms_per_step']:8.3f} ms in {prof['kernels_per_step']:7.1f}"
              f"  GPU idle {prof['gpu_idle_ms_per_step']:7.3f} ms", flush=True)
        return row

    device, rows = TO.profile_variants(p, args, measure)
    ref = args.variants[0]
    diffs = differences(rows, ref, args.top)
    for name, items in diffs.items():
        print(f"\n{name}: kernels against {ref} (ms per step, count per step)")
        for k, d, c in items["kernels"]:
            print(f"  {d:+9.4f} ms  {c:+7.1f}  {k[:110]}")
        print("  ops called per step, against the reference: " + ", ".join(
            f"{k} {c:+g}" for k, c in items["ops"]))
    doc = {"script": "benchmarks/skip_profile.py", "network": args.network,
           "device": TO.device_name(device), "torch": torch.__version__,
           "args": {k: str(v) for k, v in vars(args).items()},
           "reference": ref,
           "rows": {k: {**v, "profile": {kk: vv for kk, vv in v["profile"].items()
                                         if kk not in ("by_name", "op_counts")}} for k, v in rows.items()},
           "differences": diffs}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
