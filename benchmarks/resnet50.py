#!/usr/bin/env python
"""Lesson 04's ResNet-50 measurements on one GPU, and the search for the fastest training step.

    python benchmarks/resnet50.py --suite lesson --out benchmarks/results
    python benchmarks/resnet50.py --suite explore --budget 240 --out benchmarks/results
    python benchmarks/resnet50.py --suite all --smoke        # a CPU check of the script itself

``lesson`` runs what notebooks/04_resnet50_memory_and_speed.ipynb runs in its full profile, in the
same order (the table, the trainer against a hand-written loop, the digits accuracy runs), with
the course's standard settings (``measure.STANDARD``: cuDNN autotuning on, foreach SGD), and times
the whole, so the notebook's GPU run time is known. ``explore`` tries what might be faster:
CUDA graphs of the whole step, bf16, fused SGD, larger batches, torch.compile modes and inductor
options, and profiles the step (top kernels and their share of device time).

Each suite writes ``<out>/resnet50_<suite>.json`` (GPU name, torch version, date, rows) after every
row, so a run cut short still leaves its results; the last thing printed is a short table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from amp_lessons import measure  # noqa: E402
from amp_lessons.data import synthetic_images  # noqa: E402
from amp_lessons.lessons import l04_resnet50 as lesson  # noqa: E402
from amp_lessons.measure import BenchConfig  # noqa: E402
from amp_lessons.numerics.precision import native_bf16, precision_settings  # noqa: E402


def _inductor_patch(overrides):
    if not overrides:
        return nullcontext()
    import torch._inductor.config as inductor_config
    return inductor_config.patch(**overrides)


class Recorder:
    """Collects rows, rewrites the JSON file after each one, prints a line per row."""

    def __init__(self, path: Path, device, **extra):
        self.path, self.device, self.extra = path, device, extra
        self.rows, self.t0 = [], time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, row: dict) -> None:
        row = dict(row)
        row["t_end_s"] = round(self.elapsed(), 1)
        self.rows.append(row)
        ips = row.get("img_per_s")
        peak = row.get("peak_allocated_gib")
        print(f"[{self.elapsed():6.1f}s] {row.get('label', row.get('kind'))}: "
              f"{row.get('status', '')} "
              f"{'' if ips is None else f'{ips:,.0f} img/s'} "
              f"{'' if peak is None else f'{peak:.2f} GiB'} "
              f"({row.get('seconds') or 0:.1f}s) {row.get('reason') or ''}", flush=True)
        self.save()

    def save(self) -> None:
        doc = measure.results_document(self.rows, self.device, total_seconds=self.elapsed(),
                                     **self.extra)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(doc, indent=1))


# --- lesson: what the notebook's full profile runs ------------------------------------------

def lesson_suite(rec: Recorder, device, sizes: dict) -> None:
    amp = "fp16" if device.type == "cuda" else "bf16"
    compile_precision = None if sizes["smoke"] else ("bf16" if native_bf16(device) else "fp16")
    configs = lesson.lesson_configs(sizes["model"], sizes["batch"], sizes["image"], amp=amp,
                                   compile_precision=compile_precision)
    rows = measure.run_configs(configs, device, warmup=sizes["warmup"], steps=sizes["steps"],
                             progress=False, on_row=lambda r: rec.add(dict(r, kind="table")))
    standard = {k: v for k, v in measure.STANDARD.items() if k not in ("warmup", "steps")}
    loops_cfg = BenchConfig(model=sizes["model"], precision=amp, batch_size=sizes["batch"],
                            image_size=sizes["image"], **standard)
    rec.add(dict(measure.compare_loops(loops_cfg, device, warmup=sizes["warmup"],
                                     steps=sizes["steps"], rounds=3), kind="loops"))
    digits = dict(model=sizes["digits_model"], device=device, epochs=sizes["digits_epochs"],
                  batch_size=sizes["digits_batch"], small_input=not sizes["smoke"],
                  max_train=sizes["digits_max_train"])
    for precision in ("fp32", "fp16", "bf16"):
        rec.add(dict(lesson.digits_accuracy(precision=precision, **digits), kind="digits"))
    rec.add(dict(lesson.digits_accuracy(**dict(digits, model=sizes["digits_model"] + "-selective"),
                                       precision=amp), kind="digits"))
    for eps, amsgrad in ((1e-8, False), (1e-7, False), (1e-8, True)):
        rec.add(dict(lesson.digits_accuracy(precision=amp, optimizer="adam", eps=eps,
                                           amsgrad=amsgrad, **digits), kind="digits"))
    for dtype in (torch.float16, torch.bfloat16):
        for r in lesson.autocast_error_by_op(device, dtype):
            rec.add(dict(r, kind="op_error", dtype=str(dtype), label=r["op"]))
    for opt in ("sgd", "adam"):
        rec.add(dict(lesson.skipped_step_check(opt, "fused", device), kind="skip_check",
                     label=f"skipped step, fused {opt}"))
    _ = rows


# --- notebook: the lesson's own cells, timed ----------------------------------------------------

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "04_resnet50_memory_and_speed.ipynb"


def notebook_suite(rec: Recorder) -> None:
    """Run the notebook's code cells in order in this process (no Jupyter needed) and time each.

    Cells that draw (``perf_plots``) are skipped where plotly is not installed; a failing cell is
    recorded and the rest still run. The lesson's measurements are then recorded as rows.
    """
    os.environ.setdefault("AMP_LESSONS_PROFILE", "full")
    cells = [c["source"] if isinstance(c["source"], str) else "".join(c["source"])
             for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    try:
        import plotly  # noqa: F401
        have_plotly = True
    except ImportError:
        have_plotly = False
    ns: dict = {}
    for i, src in enumerate(cells):
        if "perf_plots" in src and not have_plotly:
            rec.add({"label": f"cell {i}", "kind": "cell", "status": "skipped",
                     "reason": "plotly is not installed here", "seconds": 0.0})
            continue
        src = src.replace("subprocess.run(", "(lambda *a, **k: None)(")  # never pip install
        t0 = time.perf_counter()
        status, reason = "ok", ""
        try:
            exec(compile(src, f"<cell {i}>", "exec"), ns)
        except Exception as exc:  # noqa: BLE001
            status, reason = "error", f"{type(exc).__name__}: {exc}"[:400]
        rec.add({"label": f"cell {i}: {src.strip().splitlines()[0][:60]}", "kind": "cell",
                 "status": status, "reason": reason, "seconds": time.perf_counter() - t0})
    for name in ("rows", "runs", "selective_run", "r5_runs", "loops", "op_rows", "r6", "verdicts"):
        value = ns.get(name)
        if isinstance(value, dict):
            value = [value]
        if name == "verdicts":
            value = [dict(v.row(), numbers=dict(v.numbers)) for v in value or []]
        for row in value or []:
            rec.add(dict(row, kind={"rows": "table"}.get(name, name)))


# --- explore: toward the fastest step ---------------------------------------------------------

def explore_entries(sizes: dict):
    """(config, inductor overrides, estimated seconds) in the order to try them.

    Fused SGD is safe with GradScaler here: ``measure.build_optimizer`` primes its momentum buffers
    (see ``trainer.prime_momentum_buffers``), so the fp16 fused rows train correctly.
    """
    base = dict(model=sizes["model"], batch_size=sizes["batch"], image_size=sizes["image"],
                channels_last=True, impl="fused", cudnn_benchmark=True)
    big = sizes["batch"] * 2
    entries = [
        (BenchConfig(precision="fp16", compile="default", **base), None, 60),
        (BenchConfig(precision="fp16", compile="reduce-overhead", **base), None, 70),
        (BenchConfig(precision="fp16", compile="default", **dict(base, batch_size=big)), None, 80),
        (BenchConfig(precision="fp16", cuda_graph=True, **base), None, 15),
        (BenchConfig(precision="bf16", compile="reduce-overhead", **base), None, 70),
        (BenchConfig(precision="fp16", compile="reduce-overhead", **dict(base, batch_size=big)),
         None, 90),
        (BenchConfig(label="fp16 + GradScaler, channels_last, compile, fused SGD, conv_1x1_as_mm",
                     precision="fp16", compile="default", **base),
         {"conv_1x1_as_mm": True}, 80),
        (BenchConfig(label="bf16, channels_last, compile reduce-overhead, fused SGD, "
                           "coordinate-descent tuning",
                     precision="bf16", compile="reduce-overhead", **base),
         {"coordinate_descent_tuning": True}, 150),
        (BenchConfig(precision="bf16", compile="reduce-overhead", **dict(base, batch_size=big)),
         None, 90),
    ]
    return [(replace(c, label=f"{c.label}, batch {c.batch_size}"), o, t)
            for c, o, t in entries]


def top_kernels(config: BenchConfig, device, steps: int = 3, top: int = 15) -> dict:
    """Profile ``steps`` training steps after warm-up: the top kernels and their share."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = measure.build_model(config, device)
    optimizer = measure.build_optimizer(config, model.parameters())
    x, y = synthetic_images(config.batch_size, config.image_size, config.num_classes,
                                  device, channels_last=config.channels_last)
    run = model if not config.compile else torch.compile(model, mode=config.compile)
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        with precision_settings(config.precision, device):
            step = measure.hand_step(run, optimizer, config.precision, device)
            for _ in range(4):
                step(x, y)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    step(x, y)
                torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.benchmark = old
    events = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", None)
        if t is None:
            t = getattr(evt, "self_cuda_time_total", 0)
        if t and evt.key and not evt.key.startswith("ProfilerStep"):
            events.append((evt.key, t / 1e3 / steps, evt.count // steps))
    events.sort(key=lambda e: -e[1])
    total = sum(e[1] for e in events)
    groups = {}
    for name, ms, _ in events:
        groups[_kernel_group(name)] = groups.get(_kernel_group(name), 0.0) + ms
    del model, optimizer, x, y, run, step, prof
    measure.free_memory(device, reset_compiler=bool(config.compile))
    return {"label": f"profile: {config.label}", "kind": "profile", "status": "ok",
            "device_ms_per_step": total,
            "top": [{"kernel": n[:140], "ms_per_step": ms, "share_pct": 100 * ms / total,
                     "calls_per_step": c} for n, ms, c in events[:top]],
            "groups": {g: {"ms_per_step": ms, "share_pct": 100 * ms / total}
                       for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])}}


def _kernel_group(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("conv", "xmma", "implicit", "cudnn", "dgrad", "wgrad", "fprop",
                            "sm90_", "cutlass", "gemm", "nhwc")):
        if "bn_" in n or "batch_norm" in n or "batchnorm" in n:
            return "batch norm (cuDNN)"
        return "convolution / GEMM"
    if "triton" in n:
        return "Triton (fused BN/ReLU/add)"
    if "batch_norm" in n or "bn_" in n or "welford" in n:
        return "batch norm"
    if "multi_tensor" in n or "fused_sgd" in n or "foreach" in n or "adam" in n:
        return "optimizer"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n or "threshold" in n:
        return "elementwise (ReLU, add, casts)"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copies"
    if "reduce" in n or "max_pool" in n or "avg_pool" in n or "softmax" in n or "nll" in n:
        return "pooling / reductions / loss"
    return "other"


def explore_suite(rec: Recorder, device, sizes: dict, budget: float, only=(),
                  profile: bool = True) -> None:
    """Profile the compiled step (``profile``), then measure ``explore_entries`` in order, skipping
    any that would overrun ``budget`` seconds; ``only``: label substrings to keep (empty: all)."""
    compiled = BenchConfig(precision="fp16", model=sizes["model"], batch_size=sizes["batch"],
                           image_size=sizes["image"], channels_last=True, impl="fused",
                           compile="default")
    if profile and device.type == "cuda" and rec.elapsed() + 40 <= budget:
        try:
            rec.add(top_kernels(compiled, device))
        except Exception as exc:  # noqa: BLE001
            rec.add({"label": f"profile: {compiled.label}", "kind": "profile", "status": "error",
                     "reason": f"{type(exc).__name__}: {exc}"[:300]})
    for config, overrides, cost in explore_entries(sizes):
        if config.compile and device.type != "cuda":
            continue
        if only and not any(o in config.label for o in only):
            continue
        if rec.elapsed() + cost > budget:
            rec.add({"label": config.label, "kind": "explore", "status": "skipped",
                     "reason": f"time budget ({budget:.0f}s) would be exceeded"})
            continue
        with _inductor_patch(overrides):
            row = measure.measure(config, device, warmup=sizes["warmup"], steps=sizes["steps"],
                                breakdown=False)
        rec.add(dict(row, kind="explore", inductor=overrides or {}))


def short_table(rows) -> str:
    keep = [r for r in rows if r.get("kind") in ("table", "explore") and r.get("img_per_s")]
    keep.sort(key=lambda r: -r["img_per_s"])
    lines = [f"{'img/s':>7} {'GiB':>6}  configuration"]
    for r in keep[:14]:
        peak = r.get("peak_allocated_gib")
        lines.append(f"{r['img_per_s']:7.0f} {'' if peak is None else f'{peak:6.2f}'}  "
                     f"{r['label']}{'' if r.get('status') == 'ok' else ' [' + r['status'] + ']'}")
    for r in rows:
        if r.get("kind") == "loops" and r.get("status") == "ok":
            lines.append(f"trainer vs hand loop: {r['trainer_img_per_s']:.0f} vs "
                         f"{r['hand_img_per_s']:.0f} img/s, overhead {r['overhead_pct']:+.2f}%")
        if r.get("kind") == "profile" and r.get("status") == "ok":
            groups = ", ".join(f"{g} {v['share_pct']:.0f}%" for g, v in r["groups"].items())
            lines.append(f"{r['label']}: {r['device_ms_per_step']:.1f} ms/step: {groups}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["lesson", "notebook", "explore", "all"],
                        default="all", help="all = lesson + explore")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--budget", type=float, default=600.0,
                        help="seconds; explore skips what would not finish in time")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="explore only configurations whose label contains TEXT (repeatable)")
    parser.add_argument("--no-profile", action="store_true", help="explore without the profile")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    if args.smoke:
        sizes = dict(model="resnet18", batch=4, image=32, warmup=1, steps=2,
                     digits_model="resnet18", digits_epochs=1, digits_batch=32,
                     digits_max_train=64, smoke=True)
    else:
        total = (torch.cuda.get_device_properties(device).total_memory / 2**30
                 if device.type == "cuda" else None)
        sizes = dict(model="resnet50", batch=measure.batch_size_for(total, 224), image=224,
                     warmup=5, steps=15, digits_model="resnet50", digits_epochs=6,
                     digits_batch=64, digits_max_train=None, smoke=False)
    print(f"device {device} ({measure.results_document([], device)['device_name']}), "
          f"torch {torch.__version__}, sizes {sizes}", flush=True)
    recorders = []
    if args.suite in ("lesson", "all"):
        rec = Recorder(args.out / "resnet50_lesson.json", device, suite="lesson", sizes=sizes)
        lesson_suite(rec, device, sizes)
        print(f"lesson suite: {rec.elapsed():.0f} s in all", flush=True)
        recorders.append(rec)
    if args.suite == "notebook":
        rec = Recorder(args.out / "resnet50_notebook.json", device, suite="notebook",
                       notebook=NOTEBOOK.name)
        notebook_suite(rec)
        print(f"notebook: {rec.elapsed():.0f} s in all", flush=True)
        recorders.append(rec)
    if args.suite in ("explore", "all", "notebook"):
        spent = sum(r.elapsed() for r in recorders)
        rec = Recorder(args.out / "resnet50_explore.json", device, suite="explore", sizes=sizes)
        explore_suite(rec, device, sizes, max(0.0, args.budget - spent), only=args.only,
                      profile=not args.no_profile)
        recorders.append(rec)
    print()
    print(short_table([r for rec in recorders for r in rec.rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
