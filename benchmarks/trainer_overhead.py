"""What the course's trainer costs over a hand-written loop, on three networks.

- ``resnet50``: torchvision's ResNet-50, fp16 + GradScaler, channels_last, batch 256 at 224x224,
  SGD momentum 0.9 (foreach);
- ``transformer``: 8 pre-norm transformer encoder blocks (d_model 1024, 16 heads, feed-forward
  4096), batch 16 x 512 tokens, bf16 autocast, fused AdamW: a step of 10 ms or more on an H200;
- ``recipe``: PyTorch's AMP recipe network, 3 x Linear(4096) with ReLU, batch 512, fp16 +
  GradScaler, SGD momentum 0.9: a step of about 2 ms, bound by the host.

Variants, each training its own copy of the same initial weights on the same batch:
``hand`` (PyTorch's AMP recipe written out: autocast, ``scaler.scale(loss).backward()``,
``scaler.step``, ``update``, ``zero_grad``), ``hand (again)`` (an identical second copy: the
noise floor), ``trainer`` (``Trainer.train_step`` with ``TrainConfig``'s defaults) and
``trainer, grad norm`` (``track_grad_norm=True``).

Timing: ``measure.timer.time_steps`` (CUDA events around each step, after an untimed warm-up
step). Rounds are paired: in each round every variant runs ``--steps`` timed steps, in an order
rotated from round to round, and a variant's cost is the median over rounds of its step-time
median divided by the hand loop's of the same round, minus 1, with the rounds' quartiles and
extremes as its spread. ``bitwise_equal``: whether the variant's weights equal the hand loop's
after the run (every variant trains the same number of steps; BatchNorm statistics are not
compared: the trainer puts them back on a skipped step, the hand loop does not).

    python benchmarks/trainer_overhead.py --json benchmarks/results/trainer_overhead_h200.json

``skip_checks``, first: on the same device, a step with an inf gradient leaves weights,
BatchNorm statistics and optimizer state bitwise unchanged, per precision and optimizer.

On a CPU, ``--quick`` runs tiny sizes (a check of the script; its numbers decide nothing).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amp_lessons import models  # noqa: E402
from amp_lessons.data import synthetic_images  # noqa: E402
from amp_lessons.measure.timer import time_steps  # noqa: E402
from amp_lessons.train.trainer import Hooks, TrainConfig, Trainer  # noqa: E402

NETWORKS = ("recipe", "transformer", "resnet50")
PRECISION = {"recipe": "fp16", "transformer": "bf16", "resnet50": "fp16"}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("hand", "hand (again)", "trainer", "trainer, grad norm")


class Blocks(nn.Module):
    """Pre-norm transformer encoder blocks over given embeddings, with a 1,000-class head per
    token: ``(batch, seq, d) -> (batch * seq, 1000)``."""

    def __init__(self, d: int, heads: int, layers: int, classes: int = 1000):
        super().__init__()
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(x)).flatten(0, 1)


def build(network: str, device: torch.device, quick: bool):
    """(model, optimizer factory, x, y, channels_last) for one network; the same weights at
    every call."""
    torch.manual_seed(0)
    if network == "resnet50":
        batch, size = (2, 32) if quick else (256, 224)
        model = models.resnet50(num_classes=1000).to(device).to(memory_format=torch.channels_last)
        x, y = synthetic_images(batch, size, 1000, device, channels_last=True)
        return model, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, foreach=True), x, y, True
    if network == "transformer":
        d, heads, layers, batch, seq = (32, 2, 2, 2, 16) if quick else (1024, 16, 8, 16, 512)
        model = Blocks(d, heads, layers).to(device)
        x = torch.randn(batch, seq, d, device=device)
        y = torch.randint(0, 1000, (batch * seq,), device=device)
        fused = dict(fused=True) if device.type == "cuda" else {}
        return model, lambda p: torch.optim.AdamW(p, lr=1e-4, **fused), x, y, False
    width, batch = (64, 16) if quick else (4096, 512)
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
              nn.Linear(width, width)]
    model = nn.Sequential(*layers).to(device)
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, width, (batch,), device=device)
    return model, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), x, y, False


def hand_loop(model, opt, precision: str, device: torch.device):
    """PyTorch's AMP recipe, written out: ``step(x, y) -> loss``."""
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(x, y):
        with torch.autocast(device.type, dtype=DTYPE[precision]):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def trainer_loop(model, opt, precision, device, channels_last, **settings):
    """``Trainer.train_step`` on one batch: ``step(x, y) -> None`` (its record is not read)."""
    trainer = Trainer(model, opt, TrainConfig(precision=precision, channels_last=channels_last,
                                              progress=False, seed=None, **settings),
                      device=device)
    return lambda x, y: trainer.train_step([(x, y)]) and None


def spread(values):
    """Median, quartiles and extremes of ``values`` (percent)."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2],
            "min": min(values), "max": max(values)}


def measure_network(network: str, device, rounds: int, steps: int, warmup: int, quick: bool):
    """One network's row: per-variant step times and paired costs against the hand loop."""
    model, make_opt, x, y, channels_last = build(network, device, quick)
    precision = PRECISION[network]
    loops, copies = {}, {}
    for name in VARIANTS:
        net = copy.deepcopy(model)
        opt = make_opt(net.parameters())
        copies[name] = net
        if name.startswith("hand"):
            loops[name] = hand_loop(net, opt, precision, device)
        else:
            loops[name] = trainer_loop(net, opt, precision, device, channels_last,
                                       track_grad_norm=name.endswith("grad norm"))
    del model
    for name in VARIANTS:  # warm-up: allocator, cuDNN autotuning, lazy state
        time_steps(loops[name], x, y, warmup=warmup, steps=1, reset_peak=False)
    times = {name: [] for name in VARIANTS}  # per round: the median step, ms
    every = {name: [] for name in VARIANTS}
    t0 = time.perf_counter()
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for name in order:
            out = time_steps(loops[name], x, y, warmup=1, steps=steps, reset_peak=False)
            times[name].append(statistics.median(out["times_ms"]))
            every[name] += out["times_ms"]
    seconds = time.perf_counter() - t0
    hand = dict(copies["hand"].named_parameters())
    row = {"network": network, "precision": precision, "batch": int(x.shape[0]),
           "rounds": rounds, "steps_per_round": steps, "seconds": seconds, "variants": {}}
    for name in VARIANTS:
        ratios = [100 * (t / h - 1) for t, h in zip(times[name], times["hand"])]
        state = dict(copies[name].named_parameters())
        row["variants"][name] = {
            "step_ms": spread(every[name]),
            "cost_pct": None if name == "hand" else spread(ratios),
            "bitwise_equal": all(torch.equal(state[k], hand[k]) for k in hand)}
    return row


class Poison(Hooks):
    """Writes inf into the first parameter's gradient at step ``at``."""

    def __init__(self, at: int):
        self.at = at

    def after_backward(self, trainer, micro_step):
        if trainer.step == self.at:
            next(trainer.model.parameters()).grad.view(-1)[0] = float("inf")


def skip_checks(device: torch.device) -> list:
    """On this device: a step with an inf gradient leaves weights, BatchNorm statistics and
    optimizer state bitwise as they were, per precision and optimizer (GradScaler; the
    non-finite policy's in-kernel and host-decided skips)."""
    cases = [("fp16", "sgd-foreach"), ("fp16", "sgd-fused"), ("fp16", "adamw-fused"),
             ("bf16", "sgd-foreach"), ("bf16", "sgd-fused"), ("bf16", "adamw-fused"),
             ("bf16", "adamw-foreach"), ("fp32", "sgd-foreach")]
    out = []
    for precision, kind in cases:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).to(device)
        impl = {"fused": True} if kind.endswith("fused") else {"foreach": True}
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **impl)
               if kind.startswith("sgd") else torch.optim.AdamW(model.parameters(), lr=1e-3, **impl))
        trainer = Trainer(model, opt, TrainConfig(precision=precision, progress=False, seed=None),
                          device=device, hooks=[Poison(2)])
        x, y = torch.randn(16, 3, 8, 8, device=device), torch.randint(0, 10, (16,), device=device)
        for _ in range(2):
            trainer.train_step([(x, y)])
        before = copy.deepcopy((model.state_dict(), opt.state_dict()["state"]))
        record = trainer.train_step([(x, y)])
        after = (model.state_dict(), opt.state_dict()["state"])
        same = all(torch.equal(before[0][k], after[0][k]) for k in after[0]) and all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(after[1][i][k]))
            for i, s in before[1].items() for k, v in s.items())
        trainer.train_step([(x, y)])
        out.append({"precision": precision, "optimizer": kind, "skipped": record.skipped,
                    "unchanged": same, "trains_on": all(
                        torch.isfinite(p).all().item() for p in model.parameters())})
    return out


def markdown(doc: dict) -> str:
    """The results as the findings file shows them."""
    lines = ["| network | precision | variant | ms/step (median) | cost vs hand loop, median "
             "[q1, q3] over rounds | bitwise = hand |", "|---|---|---|---:|---|---|"]
    for row in doc["rows"]:
        for name, v in row["variants"].items():
            c = v["cost_pct"]
            cost = "-" if c is None else (f"{c['median']:+.2f}% [{c['q1']:+.2f}, "
                                          f"{c['q3']:+.2f}]")
            lines.append(f"| {row['network']} | {row['precision']} | {name} | "
                         f"{v['step_ms']['median']:.3f} | {cost} | "
                         f"{'yes' if v['bitwise_equal'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Measure the networks asked for and write the JSON (after each network, so a run cut
    short keeps what it finished)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=None, help="timed steps per round and variant "
                   "(default: 50 for recipe, 20 for transformer, 10 for resnet50)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, help="print a JSON's table and stop")
    args = p.parse_args(argv)
    if args.report is not None:
        doc = json.loads(args.report.read_text())
        print(markdown(doc))
        return doc
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "timer": "CUDA events"
           if device.type == "cuda" else "perf_counter", "rows": []}
    doc["skip_checks"] = skip_checks(device)
    print("skip checks:", "all pass" if all(c["skipped"] and c["unchanged"] and c["trains_on"]
                                            for c in doc["skip_checks"]) else doc["skip_checks"])
    for network in args.networks:
        steps = args.steps or {"recipe": 50, "transformer": 20, "resnet50": 10}[network]
        doc["rows"].append(measure_network(network, device, args.rounds, steps, args.warmup,
                                           args.quick))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1))
        print(markdown({"rows": doc["rows"][-1:]}), flush=True)
    return doc


if __name__ == "__main__":
    main()
