"""What does Trainer.train_step cost over a hand-written AMP step, and where does it go?

Two short-step networks (issue 14.1), each under fp16 + GradScaler with SGD momentum 0.9:

- ``recipe``: PyTorch's AMP recipe network, 3 x Linear(4096) with ReLU, batch 512;
- ``digits``: the digits CNN of lessons 02/03 (SmallCNN width 32, BatchNorm), batch 64, 32x32;
- ``resnet50`` (not run by default): lesson 04's ResNet-50, batch 256, channels_last, cuDNN
  autotuning off, the network of the earlier results (``results/trainer_overhead_h200.json``).

Variants (each on its own copy of the same initial weights, timed in interleaved rounds so clock
drift hits all alike): the hand loop; the trainer with defaults, lean
(``track_grad_norm=False, track_memory=False``) and one feature at a time; and the opt-in CUDA
graph of the whole step (``Trainer.capture``) against the hand loop captured the same way (both
with fused SGD, which GradScaler steps without a host sync). Per variant: the median over rounds
of the wall-clock time per step (synchronised at both ends of a round), the median CUDA-event
step time, the host time per ``step()`` call, and, from ``torch.profiler``, aten ops and device
kernels per step. Bitwise check: after the timing, fresh copies run ``--check-steps`` steps and
their weights are compared with the hand loop's.

    python benchmarks/trainer_overhead.py [--networks recipe digits] [--rounds 12] [--steps 40]
        [--json OUT]

On a CPU it runs in tiny sizes (a smoke test of the script; no conclusions).
"""
import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amp_lessons import data, measure, models  # noqa: E402
from amp_lessons import trainer as T  # noqa: E402

EAGER_VARIANTS = {
    "trainer, defaults": {},
    "trainer, lean": dict(track_grad_norm=False, track_memory=False),
    "+ grad norm only": dict(track_grad_norm=True, track_memory=False),
    "+ memory only": dict(track_grad_norm=False, track_memory=True),
    "lean, no BN guard": dict(track_grad_norm=False, track_memory=False,
                              skip_safe_batchnorm=False),
}
GRAPH_VARIANTS = {
    "trainer lean, CUDA graph": dict(track_grad_norm=False, track_memory=False),
    "trainer defaults, CUDA graph": {},
}


def recipe_network(width: int) -> nn.Module:
    """PyTorch's AMP recipe: Linear + ReLU, three times (the last without ReLU)."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width))


def build(network: str, device, quick: bool):
    """(model, x, y) for a network; the same weights every call."""
    torch.manual_seed(0)
    g = torch.Generator(device="cpu").manual_seed(1)
    if network == "resnet50":
        batch, size = (4, 32) if quick else (256, 224)
        config = measure.BenchConfig(model="resnet50", precision="fp16", channels_last=True,
                                     batch_size=batch, image_size=size)
        model = measure.build_model(config, device)
        x, y = data.synthetic_images(batch, size, 1000, device, channels_last=True)
        return model, x, y
    if network == "recipe":
        width, batch = (64, 16) if quick else (4096, 512)
        model = recipe_network(width)
        x = torch.randn(batch, width, generator=g)
        y = torch.randint(0, width, (batch,), generator=g)
    else:
        batch = 8 if quick else 64
        model, size = models.build_digits_model("cnn", width=32)
        x = torch.randn(batch, 1, size, size, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
    return model.to(device), x.to(device), y.to(device)


def sgd(model, fused=False):
    kind = dict(fused=True) if fused else {}
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **kind)


def make_steps(network, device, quick, graphs):
    """name -> (step(x, y), model), each variant on its own copy of the same weights."""
    steps = {}
    model, x, y = build(network, device, quick)
    hand = measure.hand_step(model, sgd(model), "fp16", device)
    steps["hand-written"] = (hand, model)
    for name, flags in EAGER_VARIANTS.items():
        if network == "recipe" and "BN" in name:
            continue  # no BatchNorm: the guard is never there
        m, _, _ = build(network, device, quick)
        tr = T.Trainer(m, sgd(m), T.TrainConfig(precision="fp16", progress=False, seed=None,
                                                **flags))
        steps[name] = (lambda a, b, tr=tr: tr.train_step([(a, b)]), m)
    if graphs:
        m, _, _ = build(network, device, quick)
        opt = sgd(m, fused=True)
        T.prime_momentum_buffers(opt)  # as the trainer does (fused SGD's skipped-step bug)
        h = measure.hand_step(m, opt, "fp16", device, cache_enabled=False)
        steps["hand-written, fused SGD"] = (h, m)
        m, _, _ = build(network, device, quick)
        opt = sgd(m, fused=True)
        T.prime_momentum_buffers(opt)
        h = measure.hand_step(m, opt, "fp16", device, cache_enabled=False)
        steps["hand-written, CUDA graph"] = (measure.cuda_graph_step(h, x, y, warmup=3), m)
        for name, flags in GRAPH_VARIANTS.items():
            m, _, _ = build(network, device, quick)
            tr = T.Trainer(m, sgd(m, fused=True),
                           T.TrainConfig(precision="fp16", progress=False, seed=None, **flags))
            try:
                steps[name] = (tr.capture(x, y, warmup=3), m)
            except Exception as exc:  # noqa: BLE001 - report and go on with the rest
                print(f"{network} {name}: capture failed: {type(exc).__name__}: {exc}",
                      flush=True)
    return steps, x, y


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round(step, x, y, steps, device):
    """(wall ms per step over the round, event ms per step, host ms per call)."""
    sync(device)
    host = []
    t_start = time.perf_counter()
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for i in range(steps):
            starts[i].record()
            h0 = time.perf_counter()
            step(x, y)
            host.append((time.perf_counter() - h0) * 1e3)
            ends[i].record()
        sync(device)
        events = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(steps):
            h0 = time.perf_counter()
            step(x, y)
            host.append((time.perf_counter() - h0) * 1e3)
        events = host
    wall = (time.perf_counter() - t_start) * 1e3 / steps
    return wall, events, host


def profile_counts(step, x, y, device, steps=5):
    """aten ops and device kernels per step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    step(x, y)
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(x, y)
        sync(device)
    events = prof.events()
    aten = sum(1 for e in events if e.name.startswith("aten::")
               and e.device_type == torch.autograd.DeviceType.CPU)
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    top = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            top[e.name[:60]] = top.get(e.name[:60], 0) + 1
    return {"aten_ops_per_step": aten / steps, "kernels_per_step": kernels / steps,
            "top_kernels": sorted(((k, v / steps) for k, v in top.items()),
                                  key=lambda kv: -kv[1])[:12]}


def bitwise(network, device, quick, steps, graphs):
    """Whether each variant's weights equal the hand loop's after ``steps`` steps."""
    built, x, y = make_steps(network, device, quick, graphs)
    for _, (step, _) in built.items():
        for _ in range(steps):
            step(x, y)
    sync(device)
    out = {}
    ref = dict(built["hand-written"][1].named_parameters())
    ref_fused = dict(built["hand-written, fused SGD"][1].named_parameters()) if graphs else None
    for name, (_, m) in built.items():
        target = ref_fused if (graphs and ("graph" in name or "fused" in name)) else ref
        out[name] = all(torch.equal(p, target[k]) for k, p in m.named_parameters())
    return out


def run_network(network, args, device, quick):
    graphs = device.type == "cuda"
    built, x, y = make_steps(network, device, quick, graphs)
    for step, _ in built.values():  # warm-up: allocator, cuBLAS handles, autotuning
        for _ in range(5):
            step(x, y)
    rounds = {n: {"wall": [], "events": [], "host": []} for n in built}
    for r in range(args.rounds):
        order = list(built) if r % 2 == 0 else list(reversed(built))
        for name in order:
            wall, events, host = time_round(built[name][0], x, y, args.steps, device)
            rounds[name]["wall"].append(wall)
            rounds[name]["events"] += events
            rounds[name]["host"] += host
    hand = statistics.median(rounds["hand-written"]["wall"])
    rows = []
    for name, t in rounds.items():
        wall = statistics.median(t["wall"])
        row = {"network": network, "variant": name, "step_ms": wall,
               "cost_pct": 100 * (wall / hand - 1),
               "event_step_ms": statistics.median(t["events"]),
               "host_ms_per_call": statistics.median(t["host"]),
               "round_ms": t["wall"], "rounds": args.rounds, "steps_per_round": args.steps}
        row.update(profile_counts(built[name][0], x, y, device))
        rows.append(row)
        print(f"{network:7s} {name:30s} {wall:7.3f} ms/step {row['cost_pct']:+7.2f}%  "
              f"events {row['event_step_ms']:7.3f}  host {row['host_ms_per_call']:6.3f} ms  "
              f"aten {row['aten_ops_per_step']:5.0f}  kernels {row['kernels_per_step']:5.0f}",
              flush=True)
    del built
    equal = bitwise(network, device, quick, args.check_steps, graphs)
    for row in rows:
        row["bitwise_equal_to_hand"] = equal[row["variant"]]
    print(f"{network}: bitwise equal to the hand loop after {args.check_steps} steps: {equal}",
          flush=True)
    return rows


class InjectInf(T.Hooks):
    """Writes inf into the first parameter's gradient at the listed steps."""

    def __init__(self, steps, value=float("inf")):
        self.steps, self.value = set(steps), value

    def after_backward(self, trainer, micro_step):
        if trainer.step in self.steps:
            next(trainer.model.parameters()).grad.view(-1)[0] = self.value


def skip_checks(device):
    """On the GPU: a skipped step leaves weights, BatchNorm statistics and optimizer state
    bitwise as they were, under fp16 (GradScaler) and under bf16/fp32 (nonfinite='skip'), for
    foreach, fused and Adam optimizers; and a captured step skips too."""
    results = {}
    cases = [("fp16", "foreach"), ("fp16", "fused"), ("bf16", "foreach"), ("bf16", "fused"),
             ("bf16", "adam"), ("bf16", "adam-fused"), ("fp32", "foreach"), ("fp16", "graph"),
             ("bf16", "graph")]
    for precision, impl in cases:
        model, x, y = build("digits", device, device.type != "cuda")
        if impl.startswith("adam"):
            opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=impl == "adam-fused")
        else:
            opt = sgd(model, fused=impl in ("fused", "graph"))
        tr = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False, seed=None),
                       hooks=[] if impl == "graph" else [InjectInf({3})])
        try:
            if impl == "graph":
                step = tr.capture(x, y, warmup=3)
                for _ in range(2):
                    step(x, y)
                before = copy.deepcopy((model.state_dict(), opt.state_dict()))
                bad = x.clone()
                bad.view(-1)[0] = float("inf")
                record = step(bad, y)
            else:
                for _ in range(3):
                    tr.train_step([(x, y)])
                before = copy.deepcopy((model.state_dict(), opt.state_dict()))
                record = tr.train_step([(x, y)])
            after = (model.state_dict(), opt.state_dict())
            same = all(torch.equal(a, b) for a, b in zip(before[0].values(), after[0].values()))
            same_opt = all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                           else a[k] == b[k]
                           for a, b in zip(before[1]["state"].values(), after[1]["state"].values())
                           for k in a)
            results[f"{precision} {impl}"] = {"skipped": bool(record.skipped),
                                               "model_unchanged": same,
                                               "optimizer_unchanged": same_opt,
                                               "reason": record.skip_reason}
        except Exception as exc:  # noqa: BLE001
            results[f"{precision} {impl}"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"skip check {precision} {impl}: {results[f'{precision} {impl}']}", flush=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", nargs="+", choices=["recipe", "digits", "resnet50"],
                   default=["recipe", "digits"])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--check-steps", type=int, default=30)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = device.type != "cuda"
    torch.backends.cudnn.benchmark = False  # as lesson 04 runs
    if quick:
        args.rounds, args.steps, args.check_steps = 2, 3, 3
    t0 = time.perf_counter()
    rows, checks = [], {}

    def document():
        return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "python": sys.version.split()[0],
                "timer": "wall clock per step over a synchronised round; median over rounds",
                "seconds": round(time.perf_counter() - t0, 1), "rows": rows,
                "skip_checks": checks}

    def write():  # after each part, so a run cut short still leaves what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(document(), indent=1))

    for network in args.networks:
        try:
            rows += run_network(network, args, device, quick)
        except Exception as exc:  # noqa: BLE001 - keep what the other network measured
            print(f"{network}: failed: {type(exc).__name__}: {exc}", flush=True)
        write()
    if device.type == "cuda":
        checks.update(skip_checks(device))
    write()
    if args.json:
        print(f"wrote {args.json}")
    doc = document()
    return doc


if __name__ == "__main__":
    main()
