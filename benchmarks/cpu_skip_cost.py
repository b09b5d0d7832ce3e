"""What the trainer's skip costs on a CPU, by how a non-fused optimizer skips (``nonfused_skip``).

On a CPU there is no queue of device work, so reading a step's non-finite flag waits for
nothing, while copying parameters and optimizer state aside (``"copy"``) reads and writes them
every step. This times torchvision's ResNet-18 (fp32, SGD with momentum, 32x32 inputs) through
the hand-written loop twice (the noise floor), and through the trainer with ``"copy"``,
``"sync"``, the default and ``nonfinite="ignore"``, in interleaved rounds; each round's time is
paired with the hand loop's of the same round.

    python benchmarks/cpu_skip_cost.py --json benchmarks/results/cpu_skip_cost.json
    python benchmarks/cpu_skip_cost.py --report benchmarks/results/cpu_skip_cost.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

from amp_lessons.train import trainer as T

LEAN = dict(track_grad_norm=False, track_memory=False)
VARIANTS = {
    "hand-written": None,
    "hand-written (again)": None,
    "trainer lean, nonfused_skip='copy'": dict(nonfused_skip="copy", **LEAN),
    "trainer lean, nonfused_skip='sync'": dict(nonfused_skip="sync", **LEAN),
    "trainer lean, default (auto)": dict(LEAN),
    "trainer lean, nonfinite='ignore'": dict(nonfinite="ignore", **LEAN),
}


def build(batch: int, size: int, seed: int = 0):
    """ResNet-18 (10 classes), SGD with momentum, and one fixed batch."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    return model, opt, (torch.randn(batch, 3, size, size, generator=g),
                        torch.randint(0, 10, (batch,), generator=g))


def step_fn(settings, batch: int, size: int):
    """One training step of the variant: the hand loop (``settings`` None) or the trainer."""
    model, opt, (x, y) = build(batch, size)
    if settings is None:
        def hand():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return hand
    trainer = T.Trainer(model, opt, T.TrainConfig(progress=False, seed=None, **settings))
    return lambda: trainer.train_step([(x, y)])


def quartiles(values):
    """(median, [q1, q3])."""
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), [q[0], q[2]]


def run(batch: int, size: int, rounds: int, steps: int, warmup: int) -> dict:
    """Time every variant in interleaved rounds; costs are medians of per-round paired ratios."""
    fns = {name: step_fn(settings, batch, size) for name, settings in VARIANTS.items()}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ms = {name: [] for name in fns}
    t_all = time.perf_counter()
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))  # no fixed first slot
        for name in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    ref = ms["hand-written"]
    rows = []
    for name, times in ms.items():
        med, iqr = quartiles(times)
        paired = [100 * (t / h - 1) for t, h in zip(times, ref)]
        cost, cost_iqr = quartiles(paired)
        rows.append({"variant": name, "settings": VARIANTS[name], "step_ms": med,
                     "step_ms_iqr": iqr, "cost_pct": cost, "cost_iqr_pct": cost_iqr})
    twin = next(r for r in rows if r["variant"] == "hand-written (again)")
    return {"device": "cpu", "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "model": "torchvision resnet18, 10 classes, fp32, SGD(lr=0.01, momentum=0.9)",
            "batch": batch, "image_size": size, "rounds": rounds, "steps_per_round": steps,
            "warmup_steps": warmup, "seconds": time.perf_counter() - t_all,
            "noise_floor_pct": abs(twin["cost_pct"]) + (twin["cost_iqr_pct"][1]
                                                       - twin["cost_iqr_pct"][0]) / 2,
            "rows": rows}


def report(result: dict) -> str:
    """The result as a Markdown table."""
    lines = [f"{result['model']}, batch {result['batch']}, {result['image_size']} px, "
             f"{result['device']} ({result['threads']} threads), torch {result['torch']}; "
             f"{result['rounds']} interleaved rounds of {result['steps_per_round']} steps; "
             f"noise floor (twin hand loop: |median| + half its IQR) "
             f"{result['noise_floor_pct']:.1f}%", "",
             "| variant | ms/step [q1, q3] | cost over the hand loop [q1, q3] |", "|---|---|---|"]
    for r in result["rows"]:
        lo, hi = r["step_ms_iqr"]
        clo, chi = r["cost_iqr_pct"]
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} [{lo:.1f}, {hi:.1f}] | "
                     f"{r['cost_pct']:+.1f}% [{clo:+.1f}, {chi:+.1f}] |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, help="print a JSON result as Markdown; run nothing")
    args = ap.parse_args(argv)
    if args.report:
        print(report(json.loads(args.report.read_text())))
        return
    for name in ("batch", "image_size", "rounds", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.rounds < 2:
        raise SystemExit(f"--rounds must be >= 2 (quartiles); got {args.rounds}")
    result = run(args.batch, args.image_size, args.rounds, args.steps, args.warmup)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
