#!/usr/bin/env python
"""Checkpointing techniques on ResNet-50: memory against step time, on one GPU (lesson 05, issue 14.2).

    python benchmarks/checkpointing.py --out benchmarks/results        # a GPU: ResNet-50, batch 256
    python benchmarks/checkpointing.py --smoke                        # a CPU check of the script

Every row uses the course's standard measurement settings (``measure.STANDARD``: channels_last,
cuDNN autotuning on, foreach SGD with momentum, 5 warm-up steps, then the median of 15 steps timed
with CUDA events; the peak-memory counter is reset after the warm-up of each row). The goal is a
technique at <= 25% of fp32's peak memory for <= 15% more step time than AMP (fp16 + GradScaler).

Rows, in order: fp32 (TF32) and AMP without checkpointing; AMP with each ``models.CHECKPOINT_MODES``
mode; lesson 05's old settings (cuDNN autotuning off, 3 + 10 steps) for AMP and AMP + per-block
checkpointing, which explain the 3,109 img/s the lesson used to show (issue 12.3); the forward
time of each part of the network (where recomputation spends its time); then, while the time budget
lasts, ``torch.compile`` with an activation memory budget
(``torch._functorch.config.activation_memory_budget``): the compiler picks what to recompute.

Writes ``<out>/checkpointing_<gpu>.json`` after every row (a run cut short keeps its rows) and
prints a table: img/s, peak GiB, share of fp32's peak, step time against AMP.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from amp_lessons import measure
from amp_lessons import models  # noqa: E402
from amp_lessons.data import synthetic_images  # noqa: E402
from amp_lessons.numerics.precision import autocast_for  # noqa: E402
from amp_lessons.tables import json_safe  # noqa: E402

MODES = ("block", "stage", "stage1-2", "stem+stage1", "stem+stage1-2", "sac")


def _budget_patch(budget):
    if budget is None:
        return nullcontext()
    import torch._functorch.config as functorch_config
    return functorch_config.patch(activation_memory_budget=budget)


def stage_forward_ms(device, batch: int, image: int, classes: int, reps: int) -> dict:
    """Median forward time (ms) of each part of ResNet-50 under fp16 autocast, training mode."""
    torch.manual_seed(0)
    net = models.resnet50(num_classes=classes).to(device, memory_format=torch.channels_last).train()
    x, _ = synthetic_images(batch, image, classes, device, channels_last=True)
    parts = [("stem", lambda t: net.maxpool(net.relu(net.bn1(net.conv1(t)))))]
    parts += [(n, getattr(net, n)) for n in ("layer1", "layer2", "layer3", "layer4")]
    parts.append(("head", lambda t: net.fc(torch.flatten(net.avgpool(t), 1))))
    inputs, t = {}, x
    with torch.no_grad(), autocast_for("fp16", device.type):
        for name, fn in parts:
            inputs[name] = t
            t = fn(t)
    out = {}
    cuda = device.type == "cuda"
    with torch.enable_grad(), autocast_for("fp16", device.type):
        for name, fn in parts:
            times = []
            for i in range(reps + 2):
                if cuda:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    y = fn(inputs[name])
                    e.record()
                    torch.cuda.synchronize()
                    ms = s.elapsed_time(e)
                else:
                    t0 = time.perf_counter()
                    y = fn(inputs[name])
                    ms = 1e3 * (time.perf_counter() - t0)
                del y
                if i >= 2:
                    times.append(ms)
            out[name] = statistics.median(times)
    del net, x, inputs
    measure.free_memory(device)
    return out


class _NoRngCheckpointed(models.Checkpointed):
    """Per-block checkpointing without saving and restoring the RNG state (ResNet draws none)."""

    def forward(self, x):
        if not (self.training and torch.is_grad_enabled()):
            return self.module(x)
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.module, x, use_reentrant=False, context_fn=self._contexts,
                          preserve_rng_state=False)


class _BareCheckpointed(models.Checkpointed):
    """Per-block checkpointing as the PyTorch docs write it: no context_fn, no BatchNorm fix."""

    def forward(self, x):
        if not (self.training and torch.is_grad_enabled()):
            return self.module(x)
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.module, x, use_reentrant=False)


VARIANTS = {"course's Checkpointed": models.Checkpointed,
            "preserve_rng_state=False": _NoRngCheckpointed,
            "bare checkpoint() (no BatchNorm fix)": _BareCheckpointed}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "cudaStreamWaitEvent")


def diagnose(device, sizes, warmup: int, steps: int) -> dict:
    """Per-block checkpointing taken apart: step time of variants of the wrapper (same model,
    same settings), and a torch.profiler look at one step of AMP and of AMP + per-block
    checkpointing (host wall time, GPU busy time, synchronising CUDA calls, top host ops)."""
    from torch.profiler import ProfilerActivity, profile

    torch.backends.cudnn.benchmark = True
    out = {"variants": {}, "profiles": {}}

    def build(mode, cls=None):
        torch.manual_seed(0)
        net = models.resnet50(num_classes=sizes["num_classes"], checkpoint=mode)
        if cls is not None:
            for m in net.modules():
                if type(m) is models.Checkpointed:
                    m.__class__ = cls
        net = net.to(device, memory_format=torch.channels_last).train()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=True)
        x, y = synthetic_images(sizes["batch_size"], sizes["image_size"], sizes["num_classes"],
                                device, channels_last=True)
        return net, opt, x, y

    for name, cls in VARIANTS.items():
        net, opt, x, y = build("block", cls)
        step = measure.hand_step(net, opt, "fp16", device)
        t = measure.time_steps(step, x, y, warmup=warmup, steps=steps, device=device)
        out["variants"][name] = measure.summarize_times(t["times_ms"], sizes["batch_size"])
        print("variant", name, round(out["variants"][name]["step_ms"], 2), "ms", flush=True)
        del net, opt, x, y, step
        measure.free_memory(device)
    for mode in (None, "block"):
        net, opt, x, y = build(mode)
        step = measure.hand_step(net, opt, "fp16", device)
        for _ in range(warmup):
            step(x, y)
        torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(3):
                step(x, y)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 3 * 1e3
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA) / 3
        calls = {e.key: e.count / 3 for e in events if e.key in SYNC_CALLS}
        host = sorted(((e.key, e.self_cpu_time_total / 3e3, e.count / 3) for e in events
                       if e.device_type == torch.autograd.DeviceType.CPU),
                      key=lambda r: -r[1])[:15]
        kernels = sorted(((e.key, e.self_device_time_total / 3e3) for e in events
                          if e.self_device_time_total > 0), key=lambda r: -r[1])[:12]
        name = "AMP" if mode is None else "AMP + block"
        out["profiles"][name] = {"wall_ms": wall, "gpu_busy_ms": gpu_us / 1e3,
                                 "sync_calls_per_step": calls, "top_host_ms": host,
                                 "top_kernels_ms": kernels}
        print("profile", name, json.dumps(json_safe(out["profiles"][name]))[:1500], flush=True)
        del net, opt, x, y, step, prof
        measure.free_memory(device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--budget", type=float, default=100.0,
                        help="seconds; rows that would start after it are skipped")
    parser.add_argument("--memory-budgets", type=float, nargs="*", default=[0.3, 0.5],
                        help="activation_memory_budget values to try with torch.compile")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check)")
    parser.add_argument("--diagnose", action="store_true",
                        help="only take per-block checkpointing apart (variants and a profile), "
                             "then the compile rows")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    std = measure.standard_settings(quick=args.smoke)
    warmup, steps = std.pop("warmup"), std.pop("steps")
    sizes = (dict(model="resnet50", batch_size=256, image_size=224, num_classes=1000) if cuda else
             dict(model="resnet18", batch_size=4, image_size=32, num_classes=10))
    # a CPU emulates fp16 convolutions slowly: the smoke run checks the script with bf16
    base = measure.BenchConfig(precision="fp16" if cuda else "bf16", **sizes, **std)
    name = torch.cuda.get_device_name(device).split()[-1].lower() if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"checkpointing_{name}.json"
    doc = {"gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "settings": measure.settings_caption(dict(std, warmup=warmup, steps=steps)),
           "sizes": sizes, "rows": [], "stage_forward_ms": None}
    t0 = time.perf_counter()

    def save():
        path.write_text(json.dumps(json_safe(doc), indent=1))

    def run(config, technique, w=warmup, s=steps, budget=None):
        if time.perf_counter() - t0 > args.budget:
            print(f"skipped (time budget): {technique}")
            return
        with _budget_patch(budget):
            row = measure.measure(config, device, warmup=w, steps=s, breakdown=False)
        row["technique"] = technique
        row["activation_memory_budget"] = budget
        doc["rows"].append(row)
        save()
        print(f"[{time.perf_counter() - t0:6.1f}s] {technique}: {row['status']} "
              f"{row.get('img_per_s') or 0:,.0f} img/s, {row.get('peak_allocated_gib') or 0:.2f} GiB "
              f"{row.get('reason') or ''}", flush=True)

    if args.diagnose:
        path = args.out / f"checkpointing_{name}_diagnose.json"
        try:
            doc["diagnose"] = diagnose(device, sizes, warmup, steps)
        except Exception:  # noqa: BLE001 - keep the compile rows
            import traceback
            traceback.print_exc()
        save()
    else:
        run(replace(base, label="fp32 (TF32)", precision="tf32"), "fp32")
    run(replace(base, label="AMP"), "AMP")
    for mode in () if args.diagnose else MODES:
        run(replace(base, label=f"AMP + checkpoint {mode}", checkpoint=mode), f"AMP + {mode}")
    # lesson 05's settings before this change: cuDNN autotuning off, 3 warm-up and 10 timed steps
    for mode in () if args.diagnose else (None, "block"):
        label = "AMP" + (f" + checkpoint {mode}" if mode else "") + ", lesson 05's old settings"
        run(replace(base, label=label, checkpoint=mode, cudnn_benchmark=False), label, w=3, s=10)
    if time.perf_counter() - t0 < args.budget and not args.diagnose:
        doc["stage_forward_ms"] = stage_forward_ms(device, sizes["batch_size"],
                                                   sizes["image_size"], sizes["num_classes"],
                                                   reps=10 if cuda else 1)
        save()
        print("forward ms per part:", {k: round(v, 2) for k, v in doc["stage_forward_ms"].items()})
    if cuda:
        for b in args.memory_budgets:
            run(replace(base, label=f"AMP + compile, activation budget {b:g}", compile="default"),
                f"AMP + compile (budget {b:g})", budget=b)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    save()

    rows = {r["technique"]: r for r in doc["rows"] if r["status"] == "ok"}
    fp32, amp = rows.get("fp32"), rows.get("AMP")
    print(f"\n{doc['gpu']}, {sizes['model']} batch {sizes['batch_size']}: {doc['settings']}")
    print(f"{'technique':44s} {'img/s':>7s} {'peak GiB':>9s} {'x fp32 mem':>10s} {'time x AMP':>10s}")
    for r in doc["rows"]:
        if r["status"] != "ok":
            print(f"{r['technique']:44s} {r['status']}: {r['reason']}")
            continue
        mem = r["peak_allocated_gib"]
        share = (f"{mem / fp32['peak_allocated_gib']:.0%}" if mem is not None and fp32
                 and fp32.get("peak_allocated_gib") else "-")
        slower = f"{r['step_ms'] / amp['step_ms']:.2f}" if amp else "-"
        print(f"{r['technique']:44s} {r['img_per_s']:7,.0f} {mem if mem is not None else 0:9.2f} "
              f"{share:>10s} {slower:>10s}")
    print(f"wrote {path} ({doc['seconds']} s)")


if __name__ == "__main__":
    main()
