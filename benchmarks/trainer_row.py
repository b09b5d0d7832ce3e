"""Lesson 04's trainer row, measured exactly as the lesson measures it (issue 22).

The row is ``l04_resnet50.trainer_fastest_config``: ResNet-50 through ``Trainer.train_step``,
fp16 + GradScaler (bf16 where fp16 has no tensor cores), channels_last, fused SGD,
``torch.compile(mode="reduce-overhead")``, the trainer's grad-norm and memory tracking off, at
the batch the notebook derives from the card's memory (twice its table's batch where it fits).
Each row goes through ``bench.run_configs`` with the course's standard warm-up and timed steps,
as the notebook's table does, so ``seconds`` is what the row adds to the lesson (compilation
included). ``--rows hand`` adds the same configuration as a hand-written loop, for comparison.

    python benchmarks/trainer_row.py --json OUT.json [--rows trainer hand]
        [--compile max-autotune]

``--compile max-autotune`` measures the same rows with inductor's kernel tuning (issue 22: the
issue's hand loop reached 8,062 img/s that way after about 280 s of compiling); the lesson keeps
``reduce-overhead``, which compiles in about a minute.

On a CPU the rows read "skipped" (torch.compile is measured on a GPU only) and the same rows run
eagerly at tiny sizes: a check of the script, no conclusions.
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import amp_lessons as al  # noqa: E402
from amp_lessons.lessons import l04_resnet50 as lesson  # noqa: E402


def configs(env, which, compile="reduce-overhead"):
    """The lesson's trainer row (and its hand-loop twin), sized as notebook 04 sizes them;
    ``compile``: the ``torch.compile`` mode of both."""
    model = "resnet18" if env.quick else "resnet50"
    image = 32 if env.quick else 224
    batch = 4 if env.quick else al.measure.batch_size_for(env.total_memory_gib, image)
    fast_batch = al.measure.batch_size_for(env.total_memory_gib, image, largest=2 * batch)
    amp = "fp16" if env.fp16_tensor_cores else "bf16"
    row = lesson.trainer_fastest_config(model, fast_batch, image, precision=amp, compile=compile)
    hand = dataclasses.replace(row, loop="hand", trainer_tracking=True, label="")
    out = {"trainer": row, "hand": dataclasses.replace(
        hand, label=f"hand-written loop: {hand.label}, batch {fast_batch}")}
    rows = [out[w] for w in which]
    if env.quick:  # the CPU skips compiled rows: smoke the same rows eagerly too
        rows += [dataclasses.replace(c, compile=None, label=c.label + " [eager, CPU smoke]")
                 for c in rows]
    return rows


def _num(value, fmt):
    return "n/a" if value is None else fmt.format(value)


def markdown(doc) -> str:
    """The rows as a Markdown table for benchmarks/NOTES.md (numbers read from the JSON only)."""
    lines = [f"{doc['device']}, torch {doc['torch']}; {doc['settings']['warmup']} warm-up + "
             f"{doc['settings']['steps']} timed steps (CUDA events, median), cuDNN autotuning "
             f"{'on' if doc['settings']['cudnn_benchmark'] else 'off'}; {doc['seconds']} s in all.",
             "", "| row | img/s | step ms [q1, q3] | peak reserved GiB | GPU idle | seconds for "
             "the row (compiling included) |", "|---|---:|---|---:|---:|---:|"]
    for r in doc["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | {r['status']}: {r.get('reason')} | | | | |")
            continue
        lines.append(f"| {r['label']} | {r['img_per_s']:,.0f} | {r['step_ms']:.2f} "
                     f"[{r['step_ms_q1']:.2f}, {r['step_ms_q3']:.2f}] | "
                     f"{_num(r['peak_reserved_gib'], '{:.2f}')} | "
                     f"{_num(r['gpu_idle_fraction'], '{:.1%}')} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", choices=("trainer", "hand"), default=["trainer"])
    p.add_argument("--compile", default="reduce-overhead",
                   choices=[m for m in al.measure.COMPILE_MODES if m],
                   help="torch.compile mode of the rows (default: the lesson's)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None,
                   help="print a JSON result of this script as a Markdown table; run nothing")
    args = p.parse_args(argv)
    if args.report is not None:
        print(markdown(json.loads(args.report.read_text())))
        return None
    env = al.setup(quiet=True)
    settings = al.measure.standard_settings(quick=env.quick)
    doc = {"device": env.device_name, "torch": torch.__version__, "rows": [],
           "settings": settings, "seconds": None}
    t0 = time.perf_counter()

    def write(row):
        doc["rows"].append(row)
        doc["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{row['label']}: {row['status']} {row.get('reason') or ''} "
              f"img/s {row.get('img_per_s')} step_ms {row.get('step_ms')} "
              f"[{row.get('step_ms_q1')}, {row.get('step_ms_q3')}] peak reserved "
              f"{row.get('peak_reserved_gib')} GiB, idle {row.get('gpu_idle_fraction')}, "
              f"{row.get('seconds') or 0:.1f} s for the row", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1, default=str))

    al.measure.run_configs(configs(env, args.rows, args.compile), env.device, warmup=settings["warmup"],
                           steps=settings["steps"], progress=False, on_row=write)
    print(f"done in {doc['seconds']} s" + (f"; wrote {args.json}" if args.json else ""))
    return doc


if __name__ == "__main__":
    main()
