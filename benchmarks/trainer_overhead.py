"""What does Trainer.train_step cost over a hand-written step, and can this benchmark tell?

Networks (short steps, where the trainer's host work shows; issue 22):

- ``recipe``: PyTorch's AMP recipe network, 3 x Linear(4096) + ReLU, batch 512, fp16 +
  GradScaler, SGD momentum 0.9 (foreach);
- ``digits``: the digits CNN of lessons 02/03 (SmallCNN width 32, BatchNorm), batch 64, 32x32,
  fp16 + GradScaler, SGD momentum 0.9;
- ``mlp_bf16``: 4 x Linear(2048) + ReLU, batch 1024, bf16 autocast, fused AdamW (plus the same
  network with foreach SGD, to measure the two exact skip mechanisms of a non-fused optimizer:
  a device copy of parameters and state put back, or one host sync a step);
- ``mlp_fp32``: the same MLP in fp32 (TF32 off), fused AdamW;
- ``resnet50`` (not by default): lesson 04's ResNet-50, batch 256, channels_last, fp16.
- ``resnet50_bf16`` (not by default): the same in bf16 with foreach SGD, a GPU-bound step, for
  ``TrainConfig(nonfused_skip=...)``: lean ("copy", the default) against lean with "sync" and
  with ``nonfinite="ignore"``.

Variants: the hand loop, twice (the second is the noise floor); the trainer with its defaults;
lean (``track_grad_norm=False, track_memory=False, track_time=False``: no record that costs a
kernel or a CUDA call); lean plus each record alone; per network, the non-finite policies and
the CUDA graph of the whole step (``Trainer.capture``) against a hand-captured step.

Method. Every variant trains its own copy of the same initial weights. Rounds are interleaved,
each round runs ``--steps`` steps per variant, synchronised at both ends, and a variant's cost
is the median over rounds of its PAIRED ratio to its reference in the same round (clock drift
hits both alike). The order is balanced (``bench_rounds.py``): each round begins with
``--warm-steps`` untimed steps of a throwaway hand loop, and over each block of rounds (as many
as variants) every variant runs in every position once, in a seeded random order per block.
(The old alternating order, ``--schedule alternate``, let the reference run first after the
rounds' bookkeeping in every other round, where it paid 3-5% on the H200: every cost read 1.5-2
points low and the floor stalled at 2.6-2.8%.) The noise floor is the hand loop against itself:
a second, identical hand loop timed as a variant; ``floor_pct`` is the half-width of the 95%
bootstrap interval of its median paired ratio plus the distance of that median from 0. It is
computed at block ends (with the garbage collector, which is off during the rounds); rounds are
added until it is under ``--target-floor`` (after ``--min-rounds``) or the network's share of
``--budget`` seconds is spent. Each row gives the median cost, its 95% bootstrap interval and
interquartile range, and ``beyond_floor`` (|cost| larger than the floor).

Host CPU time, a second reading of the same rounds: the trainer's cost on a short step is host
work (Python, dispatch, launches), so each round also records this thread's CPU time across its
step calls (``time.thread_time``, stopped before the round's closing sync: waiting on the GPU is
not host work). Each row gives it per step and its paired cost (``host_cpu_cost_pct``, interval,
IQR), and the network its own floor from the twin (``host_cpu_noise_floor_pct``). Time the host
spends descheduled counts in the wall clock but not here, which is why it may resolve a smaller
host cost than the wall clock can; a variant that synchronises in its step (``.item()``) counts
the CUDA runtime's wait for the GPU as CPU time where that wait spins.

On ``mlp_bf16``, "hand-written, skip via found_inf" is the hand loop that also skips a step
with a non-finite gradient as GradScaler does it for a fused optimizer (one check kernel, the
flag handed to fused AdamW): the trainer's lean (``nonfinite="skip"``) is also read against it,
the row "trainer, lean (vs hand-written, skip via found_inf)", from the same rounds.

"hand-written, one function" (recipe, mlp_bf16) is the same hand loop as a learner writes it,
every call inline in one function (the reference "hand-written" is ``measure.hand_step``, whose
closures cost a few Python calls more): the trainer's lean is also read against it on the
recipe network, "trainer, lean (vs hand-written, one function)".

"hand-written, logging norm and time" (recipe) and "hand-written, skip via found_inf, logging
norm and time" (mlp_bf16) are the hand loop that records what the trainer's defaults record,
as an engineer logs it (the loss, ``get_total_norm`` after ``unscale_``, two CUDA events a
step): the defaults are also read against them, from the same rounds ("trainer, defaults (vs
...)"): what the trainer's records cost beyond logging the same figures by hand.

Checks. After the timing, fresh copies of the eager variants run ``--check-steps`` steps and
their weights, buffers and optimizer state are compared bitwise with their hand loop's. On a
GPU, also: a skipped step leaves everything bitwise as it was (fp16, bf16, fp32; fused and
foreach SGD/AdamW; the CUDA graph); ``nonfinite="raise"`` names the step without a per-step
sync; and no policy synchronises with the host after the first step
(``torch.cuda.set_sync_debug_mode("error")``).

    python benchmarks/trainer_overhead.py --budget 180 --json OUT.json
        [--networks recipe digits mlp_bf16 mlp_fp32] [--target-floor 2] [--profile]
        [--warm-steps 5] [--schedule balanced]

On a CPU it runs in tiny sizes (width 64): every step is then host work, so the differences
read there are the trainer's own Python per step, in microseconds (`results/trainer_overhead_cpu_tiny.json`);
they say nothing about CUDA calls or GPU time, which only a GPU run measures.
"""
import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if str(Path(__file__).resolve().parent) not in sys.path:  # bench_rounds, when imported by path
    sys.path.append(str(Path(__file__).resolve().parent))
from amp_lessons import data
from amp_lessons import measure
from amp_lessons import models  # noqa: E402
from amp_lessons.train import trainer as T  # noqa: E402
from bench_rounds import SCHEDULES, Schedule, run_rounds  # noqa: E402

HAND, AGAIN = "hand-written", "hand-written (again)"
FOUND_INF = "hand-written, skip via found_inf"
LOGGING = "hand-written, logging norm and time"
LOGGING_CHECK = "hand-written, skip via found_inf, logging norm and time"
INLINE = "hand-written, one function"
# rows read from the same rounds against a second reference: network -> ((variant, reference),)
ALSO_AGAINST = {"recipe": (("trainer, defaults", LOGGING), ("trainer, lean", INLINE)),
                "mlp_bf16": (("trainer, lean", FOUND_INF), ("trainer, defaults", LOGGING_CHECK))}
# lean: every record the trainer can leave out (grad norm, peak memory, step time) left out
LEAN = dict(track_grad_norm=False, track_memory=False, track_time=False)
NETWORKS = ("recipe", "digits", "mlp_bf16", "mlp_fp32", "resnet50", "resnet50_bf16")
DEFAULT_NETWORKS = ("recipe", "mlp_bf16", "digits", "mlp_fp32")
PRECISION = {"recipe": "fp16", "digits": "fp16", "resnet50": "fp16", "mlp_bf16": "bf16",
             "mlp_fp32": "fp32", "resnet50_bf16": "bf16"}


def mlp(width: int, layers: int = 4) -> nn.Module:
    """``layers`` x Linear(width) with ReLU between them."""
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def build(network: str, device, quick: bool):
    """(model, x, y) for a network; the same weights every call."""
    torch.manual_seed(0)
    g = torch.Generator(device="cpu").manual_seed(1)
    if network in ("resnet50", "resnet50_bf16"):
        batch, size = (4, 32) if quick else (256, 224)
        config = measure.BenchConfig(model="resnet50", precision=PRECISION[network],
                                     channels_last=True, batch_size=batch, image_size=size)
        model = measure.build_model(config, device)
        x, y = data.synthetic_images(batch, size, 1000, device, channels_last=True)
        return model, x, y
    if network == "digits":
        batch = 8 if quick else 64
        model, size = models.build_digits_model("cnn", width=32)
        x = torch.randn(batch, 1, size, size, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        return model.to(device), x.to(device), y.to(device)
    if network == "recipe":
        width, batch, layers = (64, 16, 3) if quick else (4096, 512, 3)
    else:  # the MLPs
        width, batch, layers = (64, 32, 4) if quick else (2048, 1024, 4)
    model = mlp(width, layers)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, width, (batch,), generator=g)
    return model.to(device), x.to(device), y.to(device)


def optimizer(network, model, kind="default"):
    """SGD momentum 0.9 for the fp16 networks, AdamW for the MLPs; ``kind``: "default",
    "fused" or "foreach"."""
    if kind == "sgd-foreach":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    if network.startswith("mlp"):
        fused = kind in ("default", "fused")
        return torch.optim.AdamW(model.parameters(), lr=1e-3,
                                 **(dict(fused=True) if fused else dict(foreach=True)))
    extra = dict(fused=True) if kind == "fused" else {}
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **extra)


def step_unless_nonfinite(opt, grads, one):
    """A fused optimizer's step, skipped inside its kernel where ``grads`` hold inf/NaN, as
    ``GradScaler.step`` hands it the flag: one ``_amp_foreach_non_finite_check_and_unscale_``
    into a zeroed float32 flag with the inverse scale ``one`` (1.0: values left as they are),
    then ``grad_scale = None`` and ``found_inf`` set on the optimizer around ``step()``."""
    found_inf = torch.zeros((), dtype=torch.float32, device=one.device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
    opt.grad_scale, opt.found_inf = None, found_inf
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf


def variants(network, device):
    """name -> (reference name, builder) for one network; builders return (step, model, opt)."""
    precision = PRECISION[network]
    out = {}

    def hand(kind="default", graph=False):
        def make(quick):
            m, x, y = build(network, device, quick)
            opt = optimizer(network, m, kind)
            if isinstance(opt, torch.optim.SGD) and kind == "fused":
                T.prime_momentum_buffers(opt)  # as the trainer does (fused SGD's skip bug)
            step = measure.hand_step(m, opt, precision, device, cache_enabled=not graph)
            if precision == "fp32":
                inner = step

                def step(a, b, inner=inner):  # noqa: E306 - TF32 off, as the trainer's fp32
                    with T.precision_settings("fp32", device):
                        return inner(a, b)
            if graph:
                step = measure.cuda_graph_step(step, x, y, warmup=3)
            return step, m, opt
        return make

    def trainer(kind="default", graph=False, **flags):
        def make(quick):
            m, x, y = build(network, device, quick)
            opt = optimizer(network, m, kind)
            cfg = T.TrainConfig(precision=precision, progress=False, seed=None, **flags)
            tr = T.Trainer(m, opt, cfg)
            if graph:
                return tr.capture(x, y, warmup=3), m, opt
            return (lambda a, b: tr.train_step([(a, b)])), m, opt
        return make

    def hand_found_inf():
        """The bf16 fused-AdamW hand loop plus the cheapest exact skip a careful engineer
        writes, the way GradScaler.step hands it to a fused optimizer
        (``torch/amp/grad_scaler.py``, ``_step_supports_amp_scaling``; ``_compat.step_skipping``):
        one ``_amp_foreach_non_finite_check_and_unscale_`` over the gradients into a zeroed
        float32 flag with an inverse scale of exactly 1.0 (values left as they are), then
        ``optimizer.grad_scale = None`` and ``optimizer.found_inf = flag`` around ``step()``:
        the fused kernel does nothing where the flag is 1. No host sync."""
        def make(quick):
            m, x, y = build(network, device, quick)
            opt = optimizer(network, m)  # fused AdamW
            params = [p for group in opt.param_groups for p in group["params"]]
            one = torch.ones((), dtype=torch.float32, device=device)

            def step(a, b):
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = F.cross_entropy(m(a), b)
                loss.backward()
                step_unless_nonfinite(opt, [p.grad for p in params if p.grad is not None], one)
                opt.zero_grad(set_to_none=True)
                return loss.detach()
            return step, m, opt
        return make

    def hand_inline():
        """The hand loop as a learner writes it, in one function: the autocast forward, the
        backward (scaled under fp16), step, update and ``zero_grad`` inline. ``measure.hand_step``
        makes the same calls from forward/backward/update closures behind a dataclass, which
        costs Python calls of its own: this row says how many percent that is."""
        def make(quick):
            m, x, y = build(network, device, quick)
            opt = optimizer(network, m)
            kind, dtype = device.type, (torch.float16 if precision == "fp16" else torch.bfloat16)
            scaler = torch.amp.GradScaler(kind)

            def scaled(a, b):
                with torch.autocast(kind, dtype=dtype):
                    loss = F.cross_entropy(m(a), b)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            def plain(a, b):
                with torch.autocast(kind, dtype=dtype):
                    loss = F.cross_entropy(m(a), b)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()
            return (scaled if precision == "fp16" else plain), m, opt
        return make

    def hand_logging(check=False):
        """The hand loop that records what the trainer's defaults record, the way a careful
        engineer logs them: the loss (``loss.detach()``), the total gradient norm (after
        ``scaler.unscale_`` under fp16; ``torch.nn.utils.get_total_norm``, or before torch 2.6
        ``clip_grad_norm_`` with ``max_norm=inf``) and the step time (two CUDA events a step, a
        start and an end, elapsed time read later), kept in lists nobody reads here (like the
        trainer's records in this benchmark), emptied every 1,000 steps. ``check``: also the
        skip of "hand-written, skip via found_inf" (the bf16 MLP's defaults skip too)."""
        def make(quick):
            m, x, y = build(network, device, quick)
            opt = optimizer(network, m)
            params = [p for group in opt.param_groups for p in group["params"]]
            scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
            norm_of = getattr(torch.nn.utils, "get_total_norm", None) or (
                lambda grads: torch.nn.utils.clip_grad_norm_(params, float("inf")))
            cuda = device.type == "cuda"
            one = torch.ones((), dtype=torch.float32, device=device)
            log = []

            def step(a, b):
                start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
                if cuda:
                    start.record()
                with T.autocast_for(precision, device.type):
                    loss = F.cross_entropy(m(a), b)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                grads = [p.grad for p in params if p.grad is not None]
                norm = norm_of(grads)
                if check:
                    step_unless_nonfinite(opt, grads, one)
                else:
                    scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                if cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                else:
                    end = time.perf_counter()
                log.append((loss.detach(), norm, start, end))
                if len(log) >= 1000:
                    log.clear()
                return loss.detach()
            step.log = log  # (loss, norm, start, end) per step, for the tests
            return step, m, opt
        return make

    out[HAND] = (HAND, hand())
    out[AGAIN] = (HAND, hand())
    out["trainer, defaults"] = (HAND, trainer())
    out["trainer, lean"] = (HAND, trainer(**LEAN))
    out["+ grad norm only"] = (HAND, trainer(**dict(LEAN, track_grad_norm=True)))
    out["+ memory only"] = (HAND, trainer(**dict(LEAN, track_memory=True)))
    out["+ step time only"] = (HAND, trainer(**dict(LEAN, track_time=True)))
    if network in ("digits", "resnet50", "resnet50_bf16"):
        out["lean, no BN guard"] = (HAND, trainer(skip_safe_batchnorm=False, **LEAN))
    if network == "resnet50_bf16":  # SGD's momentum lives on the device: the copy is made
        out["lean, nonfused_skip='sync'"] = (HAND, trainer(nonfused_skip="sync", **LEAN))
    if network in ("recipe", "mlp_bf16"):  # fp16 and bf16: the half precisions
        out[INLINE] = (HAND, hand_inline())
    if network == "recipe":
        out[LOGGING] = (HAND, hand_logging())
    if network == "mlp_bf16":
        out[LOGGING_CHECK] = (HAND, hand_logging(check=True))
    if precision != "fp16":
        out["lean, nonfinite='ignore'"] = (HAND, trainer(nonfinite="ignore", **LEAN))
        out["lean, nonfinite='raise'"] = (HAND, trainer(nonfinite="raise", **LEAN))
    if network == "mlp_bf16":
        out[FOUND_INF] = (HAND, hand_found_inf())
        # a non-fused optimizer whose state lives on the device (SGD's momentum; Adam keeps
        # its step counters on the host, so the trainer decides on the host for it anyway)
        ref = "hand-written, foreach SGD"
        out[ref] = (ref, hand("sgd-foreach"))
        out["trainer lean, foreach SGD, skip by device copy"] = (
            ref, trainer("sgd-foreach", nonfused_skip="copy", **LEAN))
        out["trainer lean, foreach SGD, skip by host decision"] = (
            ref, trainer("sgd-foreach", nonfused_skip="sync", **LEAN))
        out["trainer lean, foreach SGD, ignore"] = (
            ref, trainer("sgd-foreach", nonfinite="ignore", **LEAN))
    if device.type == "cuda" and network in ("recipe", "digits"):
        ref = "hand-written, CUDA graph"
        out["hand-written, fused SGD"] = ("hand-written, fused SGD", hand("fused"))
        out[ref] = (ref, hand("fused", graph=True))
        out["trainer lean, CUDA graph"] = (ref, trainer("fused", graph=True, **LEAN))
        out["trainer defaults, CUDA graph"] = (ref, trainer("fused", graph=True))
    return out


def each_variant(network, names, device, quick: bool, warm_steps: int):
    """``(name, step, x, y)`` for each of ``names`` among ``variants(network)`` in turn, built
    and warmed up (``warm_steps`` untimed steps), released before the next one is built: the
    profiling scripts' loop (skip_profile.py, host_profile.py). ValueError naming unknown ones,
    before anything is built."""
    table = variants(network, device)
    unknown = [v for v in names if v not in table]
    if unknown:
        raise ValueError(f"--variants: {unknown} not among {sorted(table)}")

    def each():
        _, x, y = build(network, device, quick)
        for name in names:
            step, model, opt = table[name][1](quick)
            for _ in range(warm_steps):
                step(x, y)
            yield name, step, x, y
            del step, model, opt
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return each()


def profiling_arguments(p, network: str, variants, steps: int, steps_help: str, repeats: int,
                        warm_steps: int, top: int) -> None:
    """The profiling scripts' shared flags (skip_profile.py, host_profile.py), with their own
    defaults: --network, --variants, --steps, --repeats, --warm-steps, --top, --quick, --json."""
    p.add_argument("--network", choices=NETWORKS, default=network)
    p.add_argument("--variants", nargs="+", default=list(variants))
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--warm-steps", type=int, default=warm_steps)
    p.add_argument("--top", type=int, default=top)
    p.add_argument("--quick", action="store_true", help="small models (CPU smoke run)")
    p.add_argument("--json", type=Path, default=None)


def profile_variants(p, args, measure):
    """``(device, {name: row})``: each of ``args.variants`` built and warmed up in turn
    (``each_variant``) and measured by ``measure(step, x, y, device)``, which returns its row;
    an unknown variant is ``p.error``. The profiling scripts' loop."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        built = each_variant(args.network, args.variants, device, args.quick, args.warm_steps)
    except ValueError as exc:
        p.error(str(exc))
    rows = {}
    for name, step, x, y in built:
        rows[name] = measure(name, step, x, y, device)
        del step  # freed before the next variant is built
    return device, rows


def device_name(device) -> str:
    """The GPU's name, or "cpu": what a result file records as its device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round(step, x, y, steps, device):
    """(wall ms per step over the round, event ms per step list, host ms per call list, host
    CPU ms per step over the round: ``time.thread_time`` of this thread across the calls)."""
    sync(device)
    host = []
    cpu_start = time.thread_time()
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
        cpu = time.thread_time() - cpu_start  # before the sync: waiting is not host work
        sync(device)
        events = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(steps):
            h0 = time.perf_counter()
            step(x, y)
            host.append((time.perf_counter() - h0) * 1e3)
        cpu = time.thread_time() - cpu_start
        events = host
    wall = (time.perf_counter() - t_start) * 1e3 / steps
    return wall, events, host, cpu * 1e3 / steps


def median_ci(values, rng, resamples=2000):
    """(median, low, high): the median and its 95% bootstrap interval."""
    med = statistics.median(values)
    if len(values) < 3:
        return med, min(values), max(values)
    meds = sorted(statistics.median(rng.choices(values, k=len(values)))
                  for _ in range(resamples))
    return med, meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def paired(series, name, ref):
    """Per round, ``name``'s reading over ``ref``'s (``series``: variant -> one value a round)."""
    return [a / b for a, b in zip(series[name], series[ref])]


def summarise(ratios, rng):
    """Cost in % (median paired ratio - 1), its 95% interval and interquartile range."""
    pct = [100 * (r - 1) for r in ratios]
    med, low, high = median_ci(pct, rng)
    q = statistics.quantiles(pct, n=4) if len(pct) >= 2 else [pct[0]] * 3
    return {"cost_pct": med, "cost_ci95_pct": [low, high], "cost_iqr_pct": [q[0], q[2]]}


def noise_floor(ratios, rng):
    """The largest cost the hand loop shows against itself: |median| + CI half-width."""
    s = summarise(ratios, rng)
    low, high = s["cost_ci95_pct"]
    return abs(s["cost_pct"]) + (high - low) / 2


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
    return {"aten_ops_per_step": aten / steps, "kernels_per_step": kernels / steps}


def state_of(model, opt):
    """Weights, buffers and optimizer-state tensors, for a bitwise comparison."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state_dict()["state"].values()):
        out.update({f"opt.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def bitwise(table, network, device, quick, steps, pairs=()):
    """Whether each variant's weights, buffers and optimizer state equal its reference's after
    ``steps`` steps on fresh copies: ``{variant: bool}`` for the table, plus
    ``{(variant, reference): bool}`` for the extra ``pairs``."""
    _, x, y = build(network, device, quick)
    states = {}
    for name, (_, make) in table.items():
        step, m, opt = make(quick)
        for _ in range(steps):
            step(x, y)
        sync(device)
        states[name] = state_of(m, opt)
        del step

    def equal(name, ref):
        a, b = states[name], states[ref]
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].device)) for k in a)

    out = {name: equal(name, ref) for name, (ref, _) in table.items()}
    out.update({(name, ref): equal(name, ref) for name, ref in pairs})
    return out


def run_network(network, args, device, quick, deadline, rng):
    """Time every variant of ``network`` in interleaved rounds (``bench_rounds``: a warm slot,
    then a balanced order) until the floor is under the target or ``deadline`` (perf_counter
    seconds) is near; then the bitwise check."""
    table = variants(network, device)
    _, x, y = build(network, device, quick)
    built = {}
    t_build = time.perf_counter()
    for name, (_, make) in table.items():
        try:
            built[name] = make(quick)[0]
        except Exception as exc:  # noqa: BLE001 - report and go on with the rest
            print(f"{network} {name}: could not build: {type(exc).__name__}: {exc}", flush=True)
    table = {k: v for k, v in table.items() if k in built and v[0] in built}
    pairs = [(n, r) for n, r in ALSO_AGAINST.get(network, ()) if n in table and r in table]
    # the warm slot: a throwaway hand loop, run untimed at the start of every round
    warm_step = table[HAND][1](quick)[0] if args.warm_steps > 0 else None
    for step in list(built.values()) + ([warm_step] if warm_step else []):
        for _ in range(5):  # warm-up: allocator, cuBLAS handles, autotuning
            step(x, y)
    sync(device)
    build_s = time.perf_counter() - t_build  # the bitwise check builds them all again
    walls = {n: [] for n in table}
    events = {n: [] for n in table}
    hosts = {n: [] for n in table}
    cpus = {n: [] for n in table}
    schedule = Schedule(list(table), args.schedule, seed=args.seed)

    def time_slot(name, r):
        wall, ev, host, cpu = time_round(built[name], x, y, args.steps, device)
        walls[name].append(wall)
        events[name] += ev
        hosts[name] += host
        cpus[name].append(cpu)

    def warm_slot(r):
        for _ in range(args.warm_steps):
            warm_step(x, y)

    def floor_now():
        return noise_floor(paired(walls, AGAIN, HAND), rng)

    def reserve(round_s):  # the bitwise check after the rounds: a rebuild and check_steps
        return build_s + round_s * args.check_steps / args.steps * 1.5 + 1

    rounds = run_rounds(schedule, time_slot, warm_slot if warm_step else None,
                        max_rounds=args.max_rounds, min_rounds=args.min_rounds,
                        at_block_end=lambda n: floor_now() < args.target_floor,
                        deadline=deadline, reserve=reserve)
    floor = floor_now()
    cpu_floor = noise_floor(paired(cpus, AGAIN, HAND), rng)
    rows = []
    for name, ref in [(n, r) for n, (r, _) in table.items()] + pairs:
        ratios = paired(walls, name, ref)
        row = {"network": network, "precision": PRECISION[network], "variant": name,
               "reference": ref, "step_ms": statistics.median(walls[name]),
               "event_step_ms": statistics.median(events[name]),
               "host_ms_per_call": statistics.median(hosts[name]),
               "rounds": rounds, "steps_per_round": args.steps, "round_ms": walls[name]}
        row.update(summarise(ratios, rng))
        row["beyond_floor"] = name not in (HAND, ref) and abs(row["cost_pct"]) > floor
        # the same paired reading of the host's CPU time (the trainer's cost on a short step is
        # host work; a descheduled or waiting host counts in the wall clock, not here)
        row["host_cpu_ms_per_step"] = statistics.median(cpus[name])
        row.update({f"host_cpu_{k}": v for k, v in summarise(
            paired(cpus, name, ref), rng).items()})
        if args.profile:
            row.update(profile_counts(built[name], x, y, device))
        rows.append(row)
        vs = "" if ref == HAND else f" (vs {ref})"
        print(f"{network:9s} {name + vs:50s} {row['step_ms']:7.3f} ms {row['cost_pct']:+6.2f}% "
              f"[{row['cost_ci95_pct'][0]:+6.2f}, {row['cost_ci95_pct'][1]:+6.2f}] "
              f"host {row['host_ms_per_call']:6.3f} ms", flush=True)
    del built, warm_step
    equal = bitwise(table, network, device, quick, args.check_steps, pairs)
    for row in rows:
        key = row["variant"] if row["variant"] in table and \
            table[row["variant"]][0] == row["reference"] else (row["variant"], row["reference"])
        row["bitwise_equal_to_reference"] = equal[key]
    print(f"{network}: noise floor {floor:.2f}% after {rounds} rounds of {args.steps} steps "
          f"({args.schedule} order, {args.warm_steps} warm steps a round); bitwise equal to the "
          f"reference after {args.check_steps} steps: {equal}", flush=True)
    return {"noise_floor_pct": floor, "floor_under_target": floor < args.target_floor,
            "host_cpu_noise_floor_pct": cpu_floor,
            "rounds": rounds, "steps_per_round": args.steps,
            "schedule": schedule.describe(rounds, args.warm_steps), "rows": rows}


# --- GPU-only checks -----------------------------------------------------------------------------

class InjectInf(T.Hooks):
    """Writes inf into the first parameter's gradient at the listed steps."""

    def __init__(self, steps, value=float("inf")):
        self.steps, self.value = set(steps), value

    def after_backward(self, trainer, micro_step):
        if trainer.step in self.steps:
            next(trainer.model.parameters()).grad.view(-1)[0] = self.value


def _same(before, after):
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                 for k in before)


def skip_checks(device, quick):
    """A skipped step leaves weights, BatchNorm statistics and optimizer state bitwise as they
    were: fp16 (GradScaler), bf16 and fp32 (nonfinite='skip'), foreach and fused SGD/AdamW, and
    a captured step."""
    results = {}
    cases = [("fp16", "sgd"), ("fp16", "sgd-fused"), ("fp16", "adamw-fused"),
             ("bf16", "sgd"), ("bf16", "sgd-fused"), ("bf16", "adamw"), ("bf16", "adamw-fused"),
             ("fp32", "adamw-fused"), ("fp32", "sgd"), ("fp16", "graph"), ("bf16", "graph")]
    for precision, impl in cases:
        key = f"{precision} {impl}"
        try:
            model, x, y = build("digits", device, quick)
            fused = impl.endswith("fused") or impl == "graph"
            if impl.startswith("adamw"):
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3,
                                        **(dict(fused=True) if fused else {}))
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                      **(dict(fused=True) if fused else {}))
            tr = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False,
                                                     seed=None),
                           hooks=[] if impl == "graph" else [InjectInf({3})])
            if impl == "graph":
                step = tr.capture(x, y, warmup=3)
                before = copy.deepcopy(state_of(model, opt))
                bad = x.clone()
                bad.view(-1)[0] = float("inf")
                record = step(bad, y)
            else:
                for _ in range(3):
                    tr.train_step([(x, y)])
                before = copy.deepcopy(state_of(model, opt))
                record = tr.train_step([(x, y)])
            results[key] = {"skipped": bool(record.skipped),
                            "unchanged": _same(before, state_of(model, opt)),
                            "reason": record.skip_reason}
            results[key]["ok"] = results[key]["skipped"] and results[key]["unchanged"]
        except Exception as exc:  # noqa: BLE001
            results[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"skip check {key}: {results[key]}", flush=True)
    results.update(lean_skip_checks(device, quick))
    return results


def lean_skip_checks(device, quick):
    """The same for the trainer's lean step (one micro-batch, no hooks before the step, no
    BatchNorm guard, no grad norm: ``Trainer._lean_step``) on the recipe MLP, the inf coming in
    with the batch."""
    results = {}
    for precision, impl in (("fp16", "sgd"), ("fp16", "sgd-fused"), ("bf16", "sgd"),
                            ("bf16", "adamw-fused")):
        key = f"lean {precision} {impl}"
        try:
            model, x, y = build("recipe", device, quick)
            fused = dict(fused=True) if impl.endswith("fused") else {}
            opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)
                   if impl.startswith("adamw") else
                   torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, **fused))
            tr = T.Trainer(model, opt, T.TrainConfig(precision=precision, progress=False,
                                                     seed=None, **LEAN))
            for _ in range(3):
                tr.train_step([(x, y)])
            before = copy.deepcopy(state_of(model, opt))
            bad = x.clone()
            bad.view(-1)[0] = float("inf")
            record = tr.train_step([(bad, y)])
            results[key] = {"lean": tr._lean, "skipped": bool(record.skipped),
                            "unchanged": _same(before, state_of(model, opt)),
                            "reason": record.skip_reason}
            results[key]["ok"] = all(results[key][k] for k in ("lean", "skipped", "unchanged"))
        except Exception as exc:  # noqa: BLE001
            results[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"skip check {key}: {results[key]}", flush=True)
    return results


def raise_check(device, quick):
    """nonfinite='raise' on the GPU: the error names the bad step (here at the latest at
    ``wait()``), counters go back to it, and the model is as it was before it."""
    model, x, y = build("digits", device, quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    hook = InjectInf({2})
    tr = T.Trainer(model, opt, T.TrainConfig(precision="bf16", nonfinite="raise",
                                             progress=False, seed=None), hooks=[hook])
    out = {"ok": False}
    try:
        for _ in range(2):
            tr.train_step([(x, y)])
        before = copy.deepcopy(state_of(model, opt))
        try:
            for _ in range(4):
                tr.train_step([(x, y)])
            tr.wait()
            out["error"] = "no NonFiniteError"
        except T.NonFiniteError as exc:
            out.update(message=str(exc), step_after=tr.step, history=len(tr.history),
                       unchanged=_same(before, state_of(model, opt)))
            out["ok"] = str(exc).startswith("step 2 ") and tr.step == 2 and out["unchanged"]
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(f"raise check: {out}", flush=True)
    return out


def no_sync_checks(device, quick):
    """No host sync after the first step, under torch.cuda.set_sync_debug_mode('error'), for
    the policies that promise it (the defaults included: grad norm, memory, BatchNorm guard).
    The control, fp16 with a non-fused SGD, must sync (GradScaler.step reads its flag there):
    ``ok`` is true when each case did what it should."""
    results = {}
    cases = [("bf16", "skip", "adamw-fused", "mlp_bf16"), ("bf16", "raise", "adamw-fused",
                                                          "mlp_bf16"),
             ("fp32", "skip", "adamw-fused", "mlp_fp32"), ("bf16", "skip", "sgd", "digits"),
             ("fp16", "skip", "sgd-fused", "recipe"), ("fp16", "skip", "sgd-fused", "digits"),
             ("bf16", "ignore", "adamw-fused", "mlp_bf16"),
             ("fp16", "skip", "sgd", "recipe"),  # the control: GradScaler.step syncs here
             ("bf16", "skip", "adamw-fused", "mlp_bf16", LEAN),  # the lean step
             ("fp16", "skip", "sgd-fused", "recipe", LEAN), ("bf16", "skip", "sgd", "recipe", LEAN)]
    for precision, nonfinite, kind, network, *lean in cases:
        flags = lean[0] if lean else {}
        key = f"{network} {precision} {nonfinite} {kind}" + (" lean" if lean else "")
        control = precision == "fp16" and kind == "sgd"
        try:
            model, x, y = build(network, device, quick)
            if kind.startswith("adamw"):
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                      **(dict(fused=True) if kind.endswith("fused") else {}))
            tr = T.Trainer(model, opt, T.TrainConfig(precision=precision, nonfinite=nonfinite,
                                                     progress=False, seed=None, **flags))
            for _ in range(2):
                tr.train_step([(x, y)])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    tr.train_step([(x, y)])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            results[key] = {"ok": not control, "synced": False}
        except Exception as exc:  # noqa: BLE001
            results[key] = {"ok": control, "synced": True,
                            "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(f"no-sync check {key}: {results[key]}", flush=True)
    return results


# (network, variant, goal %, the row's reference, the goal's label; None: "network variant")
GOALS = (("recipe", "trainer, defaults", 3.0, None, None),
         ("recipe", "trainer, lean", 1.0, None, None),
         ("mlp_bf16", "trainer, defaults", 3.0, None, None),
         ("mlp_bf16", "trainer, lean", 1.0, None, None),
         ("mlp_bf16", "trainer, lean", 1.0, FOUND_INF,
          "mlp_bf16 trainer lean vs hand loop with the same check"),
         ("recipe", "trainer, defaults", 3.0, LOGGING,
          "recipe trainer defaults vs hand loop logging the same"),
         ("mlp_bf16", "trainer, defaults", 3.0, LOGGING_CHECK,
          "mlp_bf16 trainer defaults vs hand loop checking and logging the same"),
         ("recipe", "trainer lean, CUDA graph", 3.0, None, None),
         ("recipe", "trainer, lean", 1.0, INLINE, "recipe trainer lean vs a one-function hand loop"))


def verdicts(networks):
    """The issue's goals, read off the rows: cost at most the goal, and a floor small enough
    to tell (under the goal, or the goal's interval clear of it)."""
    out = []
    for network, variant, goal, reference, label in GOALS:
        row = next((r for r in networks.get(network, {}).get("rows", [])
                    if r["variant"] == variant
                    and (reference is None or r["reference"] == reference)), None)
        if row is None:
            continue
        floor = networks[network]["noise_floor_pct"]
        out.append({"network": network, "variant": variant, "reference": row["reference"],
                    "label": label or f"{network} {variant}", "goal_pct": goal,
                    "cost_pct": row["cost_pct"], "ci95_high_pct": row["cost_ci95_pct"][1],
                    "noise_floor_pct": floor, "met": row["cost_ci95_pct"][1] <= goal,
                    "resolved": floor < goal})
    return out


def goal_label(goal) -> str:
    """A goal's name in the report (results written before labels: "network variant")."""
    return goal.get("label") or f"{goal['network']} {goal['variant']}"


def markdown(doc) -> str:
    """The run as Markdown tables for benchmarks/NOTES.md (numbers read from the JSON only)."""
    lines = [f"{doc['device']}, torch {doc['torch']}, {doc['seconds']} s (budget "
             f"{doc['budget_s']} s); {doc['timer']}.", ""]
    for network, net in doc["networks"].items():
        if "error" in net:
            lines += [f"**{network}**: failed: {net['error']}", ""]
            continue
        order = net.get("schedule")
        order = "" if order is None else (
            f"; {order['kind']} order, {order['warm_steps']} untimed warm "
            f"step{'' if order['warm_steps'] == 1 else 's'} a round")
        cpu = "host_cpu_noise_floor_pct" in net  # results written before it: no such column
        lines += [f"**{network}** ({net['rows'][0]['precision']}): noise floor "
                  f"{net['noise_floor_pct']:.2f}% after {net['rounds']} rounds of "
                  f"{net['steps_per_round']} steps{order}" + (
                      f"; host CPU time's noise floor {net['host_cpu_noise_floor_pct']:.2f}%"
                      if cpu else ""), "",
                  "| variant | ms/step | cost | 95% interval | IQR | beyond floor | host ms/call "
                  + ("| host CPU ms/step | host CPU cost [95%] " if cpu else "")
                  + "| bitwise = reference |",
                  "|---|---:|---:|---|---|---|---:|" + ("---:|---|" if cpu else "") + "---|"]
        for r in net["rows"]:
            lo, hi = r["cost_ci95_pct"]
            q1, q3 = r["cost_iqr_pct"]
            vs = "" if r["reference"] == HAND else f" (vs {r['reference']})"
            host_cpu = ""
            if cpu:
                c_lo, c_hi = r["host_cpu_cost_ci95_pct"]
                host_cpu = (f" {r['host_cpu_ms_per_step']:.3f} | {r['host_cpu_cost_pct']:+.2f}% "
                            f"[{c_lo:+.2f}, {c_hi:+.2f}] |")
            lines.append(f"| {r['variant']}{vs} | {r['step_ms']:.3f} | {r['cost_pct']:+.2f}% | "
                         f"[{lo:+.2f}, {hi:+.2f}] | [{q1:+.2f}, {q3:+.2f}] | "
                         f"{'yes' if r['beyond_floor'] else 'no'} | {r['host_ms_per_call']:.3f} |"
                         f"{host_cpu} {'yes' if r['bitwise_equal_to_reference'] else 'NO'} |")
        lines.append("")
    if doc["goals"]:
        lines += ["| goal | cost | 95% up to | floor | met | resolved |",
                  "|---|---:|---:|---:|---|---|"]
        for g in doc["goals"]:
            lines.append(f"| {goal_label(g)} <= {g['goal_pct']}% | "
                         f"{g['cost_pct']:+.2f}% | {g['ci95_high_pct']:+.2f}% | "
                         f"{g['noise_floor_pct']:.2f}% | {'yes' if g['met'] else 'no'} | "
                         f"{'yes' if g['resolved'] else 'no'} |")
        lines.append("")
    for part, results in doc.get("gpu_checks", {}).items():
        items = [("raise", results)] if part == "raise" else list(results.items())
        bad = [k for k, v in items if not v.get("ok")]
        lines.append(f"- GPU {part} checks: {len(items) - len(bad)} of {len(items)} ok"
                     + (f"; failed: {', '.join(bad)}" if bad else ""))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", nargs="+", choices=NETWORKS, default=list(DEFAULT_NETWORKS))
    p.add_argument("--budget", type=float, default=180.0,
                   help="seconds for the whole run (timing, checks, GPU checks)")
    p.add_argument("--target-floor", type=float, default=2.0,
                   help="stop adding rounds once the noise floor is under this (%%)")
    p.add_argument("--min-rounds", type=int, default=8)
    p.add_argument("--max-rounds", type=int, default=400)
    p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    p.add_argument("--warm-steps", type=int, default=5,
                   help="untimed steps of a throwaway hand loop at the start of every round")
    p.add_argument("--schedule", choices=SCHEDULES, default="balanced",
                   help="the order of the variants in the rounds (alternate: the old order)")
    p.add_argument("--check-steps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="count aten ops and kernels too")
    p.add_argument("--no-gpu-checks", action="store_true")
    p.add_argument("--checks-only", action="store_true",
                   help="run the GPU checks only (no timed networks)")
    p.add_argument("--seed", type=int, default=0,
                   help="for the bootstrap intervals and the balanced order")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None,
                   help="print a JSON result of this script as Markdown tables; run nothing")
    args = p.parse_args(argv)
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text())))
        return None
    if args.budget <= 0 or args.steps < 1 or args.min_rounds < 2 or args.warm_steps < 0 or \
            args.max_rounds < 2:
        p.error("--budget must be > 0, --steps >= 1, --min-rounds and --max-rounds >= 2, "
                "--warm-steps >= 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.checks_only and (device.type != "cuda" or args.no_gpu_checks):
        p.error("--checks-only runs the GPU checks: it needs a CUDA device and no "
                "--no-gpu-checks (it would write an empty document)")
    quick = device.type != "cuda"
    torch.backends.cudnn.benchmark = False  # as lesson 04 runs
    if quick:
        args.steps, args.check_steps = min(args.steps, 3), min(args.check_steps, 3)
        args.warm_steps = min(args.warm_steps, 1)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    gpu_checks = device.type == "cuda" and not args.no_gpu_checks
    reserve = 25.0 if gpu_checks else 0.0  # seconds kept for the GPU checks at the end
    networks, checks = {}, {}

    def document():
        return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "python": sys.version.split()[0],
                "timer": "wall clock per step over a synchronised round; median over "
                         "interleaved rounds of the paired ratio to the reference",
                "schedule": args.schedule, "warm_steps": args.warm_steps,
                "budget_s": args.budget, "target_floor_pct": args.target_floor,
                "seconds": round(time.perf_counter() - t0, 1), "networks": networks,
                "goals": verdicts(networks), "gpu_checks": checks}

    def write():  # after each part, so a run cut short still leaves what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(document(), indent=1))

    for i, network in enumerate([] if args.checks_only else args.networks):
        left = args.budget - reserve - (time.perf_counter() - t0)
        deadline = time.perf_counter() + left / (len(args.networks) - i)
        try:
            networks[network] = run_network(network, args, device, quick, deadline, rng)
        except Exception as exc:  # noqa: BLE001 - keep what the other networks measured
            networks[network] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{network}: failed: {type(exc).__name__}: {exc}", flush=True)
        write()
    if gpu_checks:
        checks["skip"] = skip_checks(device, quick)
        checks["raise"] = raise_check(device, quick)
        checks["no_sync"] = no_sync_checks(device, quick)
    doc = document()
    write()
    for goal in doc["goals"]:
        print(f"goal {goal_label(goal)}: {goal['cost_pct']:+.2f}% "
              f"(95% up to {goal['ci95_high_pct']:+.2f}%, floor {goal['noise_floor_pct']:.2f}%)"
              f" <= {goal['goal_pct']}%: {'met' if goal['met'] else 'NOT met'}"
              f"{'' if goal['resolved'] else ' (floor too high to tell)'}", flush=True)
    print(f"done in {doc['seconds']} s" + (f"; wrote {args.json}" if args.json else ""))
    return doc


if __name__ == "__main__":
    main()
