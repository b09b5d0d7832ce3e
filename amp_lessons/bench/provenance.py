"""What produced a published table, and how to ask (``python -m amp_lessons explain KEY``).

``PRODUCERS`` maps every key a notebook publishes (``report.publish``) to the chain of functions
from the lesson function that built the table down to the code that measured it (the timer for a
timed table). ``report.publish`` stores ``record(key)`` inside the published bundle: that chain
with each function's module, file and line, the device, the torch version and the
configurations of the rows; the notebook's run record says which run. ``explain`` prints it.
"""
from __future__ import annotations

import importlib
import inspect
import platform
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

import torch

_TIMED = ("amp_lessons.bench.runner.measure", "amp_lessons.bench.steps.hand_step",
          "amp_lessons.bench.timer.time_steps")
_VERDICT = ("amp_lessons.report.publish_verdicts", "amp_lessons.claims.Verdict")

# key (or a key prefix ending in ".") -> functions, outermost first
PRODUCERS: Dict[str, Sequence[str]] = {
    "lesson01.fp16-gradients": ("amp_lessons.lessons.l01_ranges.gradient_table",),
    "lesson02.fp32_vs_amp": ("amp_lessons.lessons.l02_amp_loop.compare_fp32_amp",
                             "amp_lessons.bench.steps.hand_step",
                             "amp_lessons.bench.timer.time_steps"),
    "lesson03.presets": ("amp_lessons.lessons.l03_scaler.compare_presets",
                         "amp_lessons.lessons.l03_scaler.train_with_scaler",
                         "amp_lessons.trainer.Trainer.train_step"),
    "lesson04.resnet": ("amp_lessons.lessons.l04_resnet50.lesson_configs",
                        "amp_lessons.bench.runner.run_configs") + _TIMED
                       + ("amp_lessons.bench.rows.published_rows",),
    "lesson04.claim-r6": ("amp_lessons.lessons.l04_resnet50.compare_r6",
                          "amp_lessons.bench.runner.run_configs") + _TIMED,
    "lesson05.techniques": ("amp_lessons.lessons.l05_checkpointing.technique_table",
                            "amp_lessons.lessons.l05_checkpointing.technique_report_rows",
                            "amp_lessons.bench.runner.run_configs") + _TIMED,
    "lesson05.frontier": ("amp_lessons.lessons.l05_checkpointing.frontier_rows",
                          "amp_lessons.lessons.l05_checkpointing.technique_table") + _TIMED,
    "lesson05.card_advice": ("amp_lessons.lessons.l05_checkpointing.card_advice",
                             "amp_lessons.lessons.l05_checkpointing.technique_table") + _TIMED,
    "lesson05.largest_batch": ("amp_lessons.lessons.l05_checkpointing.largest_batch_report_rows",
                               "amp_lessons.lessons.l05_checkpointing.largest_batch_table",
                               "amp_lessons.bench.search.fit_batch_memory",
                               "amp_lessons.bench.search.largest_batch",
                               "amp_lessons.bench.oom.memory_cap"),
    "lesson05.accumulation_plan": ("amp_lessons.lessons.l05_checkpointing.accumulation_plan",
                                   "amp_lessons.lessons.l05_checkpointing.largest_batch_table",
                                   "amp_lessons.bench.search.largest_batch"),
    "lesson06.cnn-wrapping": ("amp_lessons.lessons.l06_multi_gpu.cnn_wrapping_table",),
    "lesson06.transformer-scaling": ("amp_lessons.lessons.l06_multi_gpu.transformer_table",),
    "lesson06.claim_r10c": ("amp_lessons.lessons.l06_multi_gpu.claim_r10c_rows",),
    "lesson07.speed": ("amp_lessons.lessons.l07_fp8.speed_report_rows",
                       "amp_lessons.lessons.l07_fp8.speed_sweep",
                       "amp_lessons.lessons.l07_fp8.time_recipe",
                       "amp_lessons.bench.timer.time_steps"),
    "lesson07.accuracy": ("amp_lessons.lessons.l07_fp8.accuracy_report_rows",
                          "amp_lessons.lessons.l07_fp8.accuracy_runs",
                          "amp_lessons.lessons.l07_fp8.train_gpt"),
    "lesson08.recipes": ("amp_lessons.lessons.l08_weights.recipe_rows",),
    "lesson08.choice": ("amp_lessons.lessons.l08_weights.choice_rows",),
    "lesson09.summary": ("amp_lessons.doctor.report.summary_rows",),
    "lesson09.resnet_vs_lesson04": ("amp_lessons.doctor.speed.resnet_rows",
                                    "amp_lessons.bench.runner.run_configs") + _TIMED,
    "claims.": _VERDICT,
}


def producers(key: str) -> Sequence[str]:
    """The functions (dotted names, outermost first) that produce the table published as
    ``key``; a ``ValueError`` names the known keys for a key no notebook publishes."""
    if not isinstance(key, str):
        raise ValueError(f"key must be a string; got {key!r}")
    if key in PRODUCERS:
        return PRODUCERS[key]
    for prefix, chain in PRODUCERS.items():
        if prefix.endswith(".") and key.startswith(prefix):
            return chain
    raise ValueError(f"key must be a published table's key ({', '.join(sorted(PRODUCERS))}); "
                     f"got {key!r}")


def locate(dotted: str) -> Dict[str, object]:
    """Where a function lives: ``{"function", "module", "file", "line"}`` (file relative to the
    package's parent folder). A name that does not resolve raises ``ValueError``."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        obj = inspect.unwrap(obj)
        try:
            file = Path(inspect.getsourcefile(obj)).resolve()
            _, line = inspect.getsourcelines(obj)
        except (TypeError, OSError) as exc:
            raise ValueError(f"{dotted} has no source to point at ({exc})") from None
        root = Path(__file__).resolve().parents[2]
        try:
            file = file.relative_to(root)
        except ValueError:
            pass
        return {"function": parts[-1] if cut == len(parts) - 1 else ".".join(parts[cut:]),
                "module": ".".join(parts[:cut]), "file": str(file), "line": line}
    raise ValueError(f"{dotted} does not name a function of the course's package")


def record(key: str, rows: Sequence[Mapping] = (), device: Optional[str] = None) -> Dict[str, object]:
    """What ``report.publish`` stores beside a table: the producing functions (module, file,
    line), the configurations of the rows (where rows carry one), device and torch version."""
    chain = [locate(name) for name in producers(key)]
    configs = [dict(r["config"]) for r in rows if isinstance(r, Mapping)
               and isinstance(r.get("config"), Mapping)]
    if device is None:
        device = (torch.cuda.get_device_name() if torch.cuda.is_available()
                  else platform.processor() or platform.machine() or "CPU")
    return {"produced_by": chain, "configurations": configs, "device": device,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def explain(key: str, published: Optional[Mapping] = None) -> str:
    """The path from the published table ``key`` to the code that measured it, as text: the
    functions with file and line (from this checkout), and from the published bundle
    (``published``, as ``report.collect`` returns it) the configurations, device, torch and run."""
    lines = [f"{key}: {published.get('title', '')}" if published else f"{key}:",
             "produced by (outermost first):"]
    for where in (locate(name) for name in producers(key)):
        lines.append(f"  {where['module']}.{where['function']}  {where['file']}:{where['line']}")
    if published is None:
        lines.append("no executed notebook in this checkout publishes it yet")
        return "\n".join(lines)
    prov = published.get("provenance") or {}
    run = published.get("run") or {}
    lines.append(f"notebook: {published.get('notebook', '?')}")
    lines.append(f"run: " + (", ".join(f"{k}={v}" for k, v in run.items() if not isinstance(v, (dict, list)))
                             or "no run record"))
    if prov:
        lines.append(f"device: {prov.get('device')}; torch {prov.get('torch')} (CUDA {prov.get('cuda')})")
        for cfg in prov.get("configurations", []):
            lines.append("  configuration: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    else:
        lines.append("the published bundle predates provenance records: re-run the notebook")
    return "\n".join(lines)
