"""Why is "trainer defaults, CUDA graph" not bitwise equal to the hand-captured step, when
"trainer lean, CUDA graph" is? (issue 22; `trainer_overhead.py`'s bitwise check, two runs.)

    OUT=dir python benchmarks/capture_bits.py      (writes $OUT/capture_bits.json)

The recipe network of `trainer_overhead.py` (3 x Linear(4096), batch 512; `--quick`: width 64),
fp16 + GradScaler, fused SGD (momentum 0.9, primed buffers), the same data every step. Each
variant runs 3 warm-up steps and then ``--steps`` steps (replays, for a graph) from the same
initial weights; after every step it logs a bit-level hash of the weights (the sum of their
float32 bit patterns as int64), the loss scale and whether the step was skipped; at the end its
weights, buffers and optimizer state are compared bitwise with the hand loop's of the same kind
(eager or graph). Variants:

- the hand loop, eager and captured (the references), and the same with an explicit
  ``scaler.unscale_`` before ``scaler.step`` (what the trainer's defaults do to read the
  gradient norm: fused SGD then gets ``grad_scale=None`` instead of dividing by the scale);
- the trainer eager: defaults, lean;
- the trainer captured: defaults, lean, and lean plus each record alone (norm, memory, time).

Then ``kernel_bits``: the same question for one parameter and one optimizer step at a time
(fused and foreach SGD), ``scaler.step`` alone against ``scaler.unscale_`` before it.

On a CPU only the eager variants run (a check of the script)."""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from amp_lessons.train import trainer as T  # noqa: E402
import trainer_overhead as TO  # noqa: E402


def weight_hash(model) -> int:
    """The sum of the weights' float32 bit patterns (int64): equal weights, equal hash."""
    return int(sum(p.detach().float().view(torch.int32).sum(dtype=torch.int64).item()
                   for p in model.parameters()))


def hand(device, quick, graph, unscale):
    """(step() -> (scale, skipped), model, optimizer): the hand loop on fixed data."""
    m, x, y = TO.build("recipe", device, quick)
    opt = TO.optimizer("recipe", m, "fused")
    T.prime_momentum_buffers(opt)
    scaler = torch.amp.GradScaler(device.type)

    def inner():
        with torch.autocast(device.type, dtype=torch.float16, cache_enabled=not graph):
            loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    def logged(run):
        def step():
            before = scaler.get_scale()
            run()
            return before, scaler.get_scale() < before
        # a graph reads x and y at their capture-time addresses: they must outlive it (when
        # only the graph was kept, they were freed with ``inner`` and a replay read reused memory)
        step.keep = (inner, x, y)
        return step

    if not graph:
        for _ in range(3):
            inner()
        return logged(inner), m, opt
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            inner()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        inner()
    return logged(g.replay), m, opt


def trainer(device, quick, graph, **flags):
    m, x, y = TO.build("recipe", device, quick)
    opt = TO.optimizer("recipe", m, "fused")
    tr = T.Trainer(m, opt, T.TrainConfig(precision="fp16", progress=False, seed=None, **flags))
    run = tr.capture(x, y, warmup=3) if graph else (lambda a, b: tr.train_step([(a, b)]))

    def step():
        record = run(x, y)
        return record.scale, record.skipped
    if not graph:
        for _ in range(3):
            tr.train_step([(x, y)])
    return step, m, opt


def kernel_bits(device, n: int = 1 << 20, steps: int = 3, impls=("fused", "foreach")) -> dict:
    """The smallest case of the two groups: one parameter of ``n`` floats, loss ``(p * c).sum()``
    (its gradient is ``c``), SGD momentum 0.9 (zero-primed buffers), GradScaler at its default
    scale, ``steps`` steps with a new ``c`` each. Per optimizer ``impl``, the largest
    ``|p_plain - p_unscaled|`` after each step, between ``scaler.step`` alone (a fused kernel is
    handed ``grad_scale``) and ``scaler.unscale_`` before it (the kernel gets ``grad_scale=None``):
    0.0 where the two give the same bits."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, generator=g) * 0.02
    cs = [torch.randn(n, generator=g) * 1e-3 for _ in range(steps)]

    def run(impl, unscale):
        p = torch.nn.Parameter(w0.clone().to(device))  # a copy on the CPU too
        opt = torch.optim.SGD([p], lr=0.01, momentum=0.9, **{impl: True})
        T.prime_momentum_buffers(opt)
        scaler = torch.amp.GradScaler(device.type)
        out = []
        for c in cs:
            opt.zero_grad(set_to_none=True)
            scaler.scale((p * c.to(device)).sum()).backward()
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            out.append(p.detach().clone())
        return out, scaler.get_scale()

    result = {}
    for impl in impls:
        if impl == "fused" and device.type not in ("cuda", "cpu"):
            continue
        plain, scale = run(impl, False)
        unscaled, _ = run(impl, True)
        result[impl] = {"scale": scale, "max_abs_difference_per_step": [
            float((a.double() - b.double()).abs().max()) for a, b in zip(plain, unscaled)],
            "bitwise_equal": all(torch.equal(a, b) for a, b in zip(plain, unscaled))}
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="width 64 instead of 4096")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    lean = dict(TO.LEAN)
    variants = {
        ("eager", "hand"): lambda: hand(device, args.quick, False, False),
        ("eager", "hand + unscale_"): lambda: hand(device, args.quick, False, True),
        ("eager", "trainer defaults"): lambda: trainer(device, args.quick, False),
        ("eager", "trainer lean"): lambda: trainer(device, args.quick, False, **lean),
    }
    if cuda:
        variants.update({
            ("graph", "hand"): lambda: hand(device, args.quick, True, False),
            ("graph", "hand + unscale_"): lambda: hand(device, args.quick, True, True),
            ("graph", "trainer defaults"): lambda: trainer(device, args.quick, True),
            ("graph", "trainer lean"): lambda: trainer(device, args.quick, True, **lean),
            ("graph", "trainer lean + norm"): lambda: trainer(
                device, args.quick, True, **dict(lean, track_grad_norm=True)),
            ("graph", "trainer lean + memory"): lambda: trainer(
                device, args.quick, True, **dict(lean, track_memory=True)),
            ("graph", "trainer lean + time"): lambda: trainer(
                device, args.quick, True, **dict(lean, track_time=True)),
        })
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "steps": args.steps, "quick": args.quick, "runs": {}}
    finals = {}
    for (kind, name), make in variants.items():
        print(f"{kind}: {name}", flush=True)  # a failure below names its variant
        step, m, opt = make()
        log = []
        for _ in range(args.steps):
            scale, skipped = step()
            log.append({"scale": float(scale), "skipped": bool(skipped),
                        "hash": weight_hash(m)})
        finals[(kind, name)] = {k: v.detach().clone() for k, v in TO.state_of(m, opt).items()}
        out["runs"][f"{kind}: {name}"] = log
        del step, m, opt
        if cuda:
            torch.cuda.empty_cache()
    compare = {}
    for (kind, name), state in finals.items():
        ref = finals[(kind, "hand")]
        eager = finals.get(("eager", name))
        diff = [k for k in ref if not torch.equal(ref[k], state[k])]
        first = next((i for i, (a, b) in enumerate(zip(out["runs"][f"{kind}: hand"],
                                                        out["runs"][f"{kind}: {name}"]))
                      if a["hash"] != b["hash"]), None)
        compare[f"{kind}: {name}"] = {
            "bitwise_equal_to_hand": not diff, "differing": diff[:6],
            "largest_difference": max((float((ref[k].double() - state[k].double()).abs().max())
                                       for k in diff), default=0.0),
            "first_step_whose_weights_differ": first,
            "equal_to_its_eager_twin": None if eager is None or kind == "eager" else all(
                torch.equal(eager[k], state[k]) for k in eager)}
    out["compare"] = compare
    out["kernel"] = kernel_bits(device)
    print("kernel:", json.dumps(out["kernel"]))
    print(json.dumps(compare, indent=1))
    for name, log in out["runs"].items():
        print(name, [(int(r["scale"]), r["skipped"]) for r in log][:6])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "capture_bits.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
