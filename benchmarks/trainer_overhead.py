"""Where does Trainer.train_step's cost over a hand-written AMP step come from?

Times the hand-written step and the Trainer with each optional feature on alone, all on one
ResNet-50 (fp16 + GradScaler, channels_last, foreach SGD), interleaved in rounds so that clock
drift hits every variant alike. Prints img/s per variant, its cost against the hand loop, and the
host (CPU) time per step (GradScaler's ``step`` waits for the host with non-fused optimizers, so
host work after that wait shows up as idle GPU time and the two medians stay close).

    python benchmarks/trainer_overhead.py [--batch-size 256] [--rounds 6] [--steps 15]
        [--cudnn-benchmark] [--json OUT] [--in-kernel]

``--in-kernel`` runs the same measurement inside a Jupyter kernel (through nbclient), the way a
lesson notebook runs it, and prints what it printed.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amp_lessons import bench, trainer as T  # noqa: E402

VARIANTS = {
    "trainer, defaults": {},
    "trainer, lean": dict(track_grad_norm=False, track_memory=False, skip_safe_batchnorm=False),
    "+ grad norm only": dict(track_grad_norm=True, track_memory=False, skip_safe_batchnorm=False),
    "+ memory only": dict(track_grad_norm=False, track_memory=True, skip_safe_batchnorm=False),
    "+ BN guard only": dict(track_grad_norm=False, track_memory=False, skip_safe_batchnorm=True),
}


def host_timed(step):
    """Wrap ``step`` so each call's host (wall) time is appended to ``wrapper.host_ms``."""
    def wrapper(x, y):
        t0 = time.perf_counter()
        out = step(x, y)
        wrapper.host_ms.append((time.perf_counter() - t0) * 1e3)
        return out
    wrapper.host_ms = []
    return wrapper


def run_in_kernel(argv) -> int:
    """Run this script with ``argv`` in a fresh Jupyter kernel; print its output."""
    import shlex

    import nbclient
    import nbformat

    cell = f"%run {shlex.quote(str(Path(__file__).resolve()))} {shlex.join(argv)}"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nbclient.NotebookClient(nb, timeout=1200, kernel_name="python3").execute()
    for out in nb.cells[0].outputs:
        print(out.get("text", ""), end="")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="autotune convolutions (lesson 04 runs with it off)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--in-kernel", action="store_true", help="run inside a Jupyter kernel")
    args = p.parse_args(argv)
    if args.in_kernel:
        return run_in_kernel([a for a in (argv if argv is not None else sys.argv[1:])
                              if a != "--in-kernel"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    size, batch = (224, args.batch_size) if device.type == "cuda" else (32, 4)
    config = bench.BenchConfig(model="resnet50", precision="fp16", channels_last=True,
                               impl="foreach", batch_size=batch, image_size=size)
    torch.manual_seed(0)
    model = bench.build_model(config, device)
    opt = bench.build_optimizer(config, model.parameters())
    x, y = bench.synthetic_images(batch, size, 1000, device, channels_last=True)
    steps = {"hand-written": bench.hand_step(model, opt, "fp16", device)}
    for name, flags in VARIANTS.items():
        tcfg = T.TrainConfig(precision="fp16", channels_last=True, progress=False, seed=None, **flags)
        tr = T.Trainer(model, opt, tcfg, device=device)
        steps[name] = bench.Step(model, opt, tr.scaler, None, None, None, trainer=tr)
    timed = {n: host_timed(s) for n, s in steps.items()}
    times = {n: [] for n in steps}
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            before = len(timed[name].host_ms)
            t = bench.time_steps(timed[name], x, y, warmup=5 if r == 0 else 1, steps=args.steps,
                                 device=device)
            del timed[name].host_ms[before:len(timed[name].host_ms) - args.steps]  # keep timed
            times[name] += t["times_ms"]
    hand = statistics.median(times["hand-written"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        host = statistics.median(timed[name].host_ms)
        rows.append({"variant": name, "step_ms": med, "img_per_s": batch / med * 1e3,
                     "cost_pct": 100 * (med / hand - 1), "host_ms": host, "steps": len(ts)})
        print(f"{name:22s} {med:8.2f} ms  {batch / med * 1e3:8.0f} img/s  "
              f"{100 * (med / hand - 1):+6.2f}%  host {host:6.2f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cudnn_benchmark": args.cudnn_benchmark,
            "batch_size": batch, "rounds": args.rounds, "steps_per_round": args.steps,
            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
