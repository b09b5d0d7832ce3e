"""Where does the trainer's host time go on a short step? ``cProfile`` over trainer_overhead's
variants (issue 22).

``trainer_overhead.py --networks recipe`` reads lean (``track_grad_norm=False,
track_memory=False, track_time=False``) about 2.5% over the hand loop on the H200 (+46 us of
host time a call), and ``skip_profile.py`` finds the same aten ops and the same kernels in both:
the difference is Python. This script takes the same variants (``trainer_overhead.variants``:
same models, optimizers and batches), runs ``--steps`` steps of each under ``cProfile`` after
``--warm-steps`` untimed ones, and lists per variant its host time per step (without the
profiler: the median of ``--repeats`` runs, ``time.perf_counter`` around the calls, then one
sync) and the functions whose own time per step differs most from the reference's (the first
variant). cProfile's own cost inflates every function call alike, so read its column as where
the time goes, and the unprofiled column as how much there is.

    python benchmarks/host_profile.py --network recipe --json OUT.json

On a CPU it runs in tiny sizes (``--quick``) for the tests.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_overhead as TO  # noqa: E402

DEFAULT_VARIANTS = ("hand-written", "trainer, lean", "trainer, defaults")


def host_ms(step, x, y, steps: int, repeats: int, device) -> dict:
    """Median host milliseconds per call over ``repeats`` runs of ``steps`` calls (the clock
    stops before the closing sync: waiting for the device is not host work)."""
    times = []
    for _ in range(repeats):
        TO.sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(x, y)
        times.append((time.perf_counter() - t0) * 1e3 / steps)
        TO.sync(device)
    med = statistics.median(times)
    return {"host_ms_per_call": round(med, 4),
            "spread_pct": round(100 * (max(times) - min(times)) / med, 2) if med else None}


def _where(func: tuple) -> str:
    """A cProfile function key as ``file:line(name)``, the file shortened to its package path:
    from the last ``amp_lessons/`` or ``benchmarks/`` in it, or after the last
    ``site-packages/``, whichever comes last (a checkout may itself be named amp_lessons)."""
    file, line, name = func
    at, marker = max((file.rfind(m), m) for m in ("site-packages/", "amp_lessons/", "benchmarks/"))
    if at >= 0:
        file = file[at + len(marker):] if marker == "site-packages/" else file[at:]
    return f"{file}:{line}({name})"


def profiled(step, x, y, steps: int, device) -> dict:
    """Own time (us per step) and calls per step of every function over ``steps`` profiled
    calls."""
    TO.sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(x, y)
    prof.disable()
    TO.sync(device)
    stats = pstats.Stats(prof).stats
    own = {_where(f): (round(tt / steps * 1e6, 3), round(nc / steps, 2))
           for f, (cc, nc, tt, ct, callers) in stats.items()}
    return {"profiled_us_per_step": round(sum(v[0] for v in own.values()), 2),
            "calls_per_step": round(sum(v[1] for v in own.values()), 1), "functions": own}


def differences(rows: dict, ref: str, top: int) -> dict:
    """Per variant, the ``top`` functions whose own time per step differs most from ``ref``'s:
    ``(function, us per step more, calls per step more)``; ties by name."""
    base = rows[ref]["profile"]["functions"]
    out = {}
    for name, row in rows.items():
        if name == ref:
            continue
        mine = row["profile"]["functions"]
        diff = [(k, round(mine.get(k, (0.0, 0))[0] - base.get(k, (0.0, 0))[0], 3),
                 round(mine.get(k, (0.0, 0))[1] - base.get(k, (0.0, 0))[1], 2))
                for k in set(mine) | set(base)]
        out[name] = sorted((d for d in diff if d[1] or d[2]), key=lambda t: (-abs(t[1]), t[0]))[:top]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    TO.profiling_arguments(p, "recipe", DEFAULT_VARIANTS, steps=200, repeats=7, warm_steps=20,
                           top=25, steps_help="steps per timed repeat and profile")
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.top) < 1 or args.warm_steps < 0:
        p.error("--steps, --repeats and --top must be >= 1, --warm-steps >= 0")

    def measure(name, step, x, y, device):
        row = host_ms(step, x, y, args.steps, args.repeats, device)
        row["profile"] = profiled(step, x, y, args.steps, device)
        print(f"{name:36s} host {row['host_ms_per_call']:8.4f} ms/call (spread "
              f"{row['spread_pct']}%)  profiled {row['profile']['profiled_us_per_step']:9.1f} us in "
              f"{row['profile']['calls_per_step']:7.1f} calls a step", flush=True)
        return row

    device, rows = TO.profile_variants(p, args, measure)
    ref = args.variants[0]
    diffs = differences(rows, ref, args.top)
    for name, items in diffs.items():
        extra = rows[name]["host_ms_per_call"] - rows[ref]["host_ms_per_call"]
        print(f"\n{name}: {extra * 1e3:+.1f} us a call unprofiled; functions against {ref} "
              f"(own us per step, calls per step)")
        for k, d, c in items:
            print(f"  {d:+9.3f} us  {c:+7.2f}  {k[:120]}")
    doc = {"script": "benchmarks/host_profile.py", "network": args.network,
           "device": TO.device_name(device), "torch": torch.__version__,
           "python": sys.version.split()[0],
           "args": {k: str(v) for k, v in vars(args).items()}, "reference": ref,
           "rows": {k: {**v, "profile": {kk: vv for kk, vv in v["profile"].items()
                                         if kk != "functions"}} for k, v in rows.items()},
           "differences": diffs}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
