"""Where does Trainer.train_step's cost over a hand-written AMP step come from?

Times the hand-written step and the Trainer with each optional feature on alone, all on one
ResNet-50 (fp16 + GradScaler, channels_last, foreach SGD), interleaved in rounds so that clock
drift hits every variant alike. Prints img/s per variant and its cost against the hand loop.

    python benchmarks/trainer_overhead.py [--batch-size 256] [--rounds 4] [--steps 15]
"""
import argparse
import json
import statistics
import sys
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    times = {n: [] for n in steps}
    for r in range(args.rounds):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            t = bench.time_steps(steps[name], x, y, warmup=5 if r == 0 else 1, steps=args.steps,
                                 device=device)
            times[name] += t["times_ms"]
    hand = statistics.median(times["hand-written"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"variant": name, "step_ms": med, "img_per_s": batch / med * 1e3,
                     "cost_pct": 100 * (med / hand - 1), "steps": len(ts)})
        print(f"{name:22s} {med:8.2f} ms  {batch / med * 1e3:8.0f} img/s  {100 * (med / hand - 1):+6.2f}%")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda"
                                         else "cpu", "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
