"""``python -m amp_lessons doctor --model MODULE:FACTORY [--batch-shape ...] [--out report.html]``.

Builds the model from its factory (``torchvision:resnet50``: random weights, nothing
downloaded), makes a random batch of the given shape (integer ids with ``--vocab``), runs the
doctor and prints its findings; ``--out`` writes the report (``.html``: a self-contained page
with the figure; ``.json``: the data; both can be given). Imports torch only when it runs.
"""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    """Add the ``doctor`` subcommand to ``sub`` (argparse subparsers)."""
    p = sub.add_parser("doctor", help="measure a model and say which precision to train it in",
                       description="Run the course's measurements on a model: per-layer ranges "
                                   "against fp16/bf16/fp8, fp16 overflow sites, loss-scale "
                                   "advice, autocast's dtypes, speed and memory per precision, "
                                   "FP8 candidates.")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="a callable that builds the model, e.g. mypkg.models:build or "
                        "torchvision:resnet50 (random weights)")
    p.add_argument("--batch-shape", default="2,3,224,224", metavar="N,...",
                   help="shape of one random input batch (default 2,3,224,224)")
    p.add_argument("--vocab", type=int, default=None, metavar="V",
                   help="make the batch integer token ids in [0, V) (language models; default: a "
                        "float batch)")
    p.add_argument("--device", default=None, help="device (default: CUDA when present, else CPU)")
    p.add_argument("--precisions", default="fp32,tf32,fp16,bf16",
                   help="precisions to time, comma-separated ('' for none; default: all four)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per precision (default 5)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per precision (default 15)")
    p.add_argument("--trial-steps", type=int, default=5,
                   help="fp16 steps per GradScaler setting checked with the trainer (0: none; "
                        "default 5)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="compare eager and torch.compile forward (auto: on a GPU only)")
    p.add_argument("--fp8-crossover", type=int, default=None, metavar="WIDTH",
                   help="width from which FP8 pays on this GPU (lesson 07's speed sweep; default: "
                        "none, and the FP8 finding reads 'not decided')")
    p.add_argument("--out", type=Path, action="append", default=[], metavar="FILE",
                   help="write the report: .html (self-contained) or .json; may repeat")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status (one error line on bad input)."""
    from amp_lessons.cli import check_writable, fail

    try:
        for out in args.out:
            if out.suffix.lower() not in (".html", ".htm", ".json"):
                raise ValueError(f"--out must end in .html or .json; got '{out}'")
            check_writable(out, "--out")
        import torch

        from amp_lessons.numerics.precision import as_device
        from amp_lessons.doctor.inputs import build_model, parse_shape
        from amp_lessons.doctor.run import check_device, doctor

        shape = parse_shape(args.batch_shape)
        device = check_device(as_device(args.device), name="--device")
        model = build_model(args.model).to(device)
        g = torch.Generator(device=device).manual_seed(0)
        if args.vocab is not None:
            if args.vocab < 2:
                raise ValueError(f"--vocab must be a whole number >= 2; got {args.vocab}")
            batch = torch.randint(0, args.vocab, shape, device=device, generator=g)
        else:
            batch = torch.randn(shape, device=device, generator=g)
        precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        report = doctor(model, batch, device=device, precisions=precisions, warmup=args.warmup,
                        steps=args.steps, trial_steps=args.trial_steps,
                        compile={"auto": None, "on": True, "off": False}[args.compile],
                        fp8_crossover=args.fp8_crossover, name=args.model)
    except ValueError as exc:
        return fail("doctor", str(exc))
    for f in report.findings:
        print(f"[{f['topic']}] {f['finding']}  ({f['lesson']})")
    for out in args.out:
        figure = ""
        if out.suffix.lower() != ".json":
            from amp_lessons.ui.doctor_plots import figure_html, ranges_figure

            figure = figure_html(ranges_figure(report))
        try:
            report.write(out, figure)
        except OSError as exc:
            return fail("doctor", f"could not write {out}: {exc}", 1)
        print(f"wrote {out}")
    return 0
