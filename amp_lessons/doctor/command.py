"""``python -m amp_lessons doctor --model MODULE:FACTORY [--input SHAPE ...] [--out report.html]``.

Builds the model from its factory (``torchvision:resnet50``: random weights, nothing
downloaded), makes a random batch (``--batch-shape`` for one input, or ``--input`` once per
input: ``8,128`` a float tensor, ``8,128:ids=30522`` integer ids, ``name=8,128`` a keyword
input), runs the doctor with a progress line per part on stderr, and prints the verdict first,
then the findings; ``--out`` writes the report (``.html``: a self-contained page with a static
figure; ``.json``: the data; both can be given). Imports torch only when it runs.

Every error ends in one line, ``python -m amp_lessons doctor: error: ...``, never a traceback: a
bad setting, a factory that cannot be imported or ends the program, parameters on the meta
device, a batch too large for memory (with the bytes it needs and the bytes there are), a failed
write, and Ctrl-C (exit status 130, saying what was and was not written).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from amp_lessons.tables import plural

PROG = "python -m amp_lessons"
INTERRUPTED = 130  # the shell's status for a program ended by Ctrl-C (128 + SIGINT)
# the doctor's Python parameters, as the command's flags (errors name what the user typed)
FLAGS = {"trial_steps": "--trial-steps", "fp8_crossover": "--fp8-crossover",
         "precisions": "--precisions", "warmup": "--warmup", "steps": "--steps",
         "device": "--device", "output": "--output", "model": "--model",
         "time_cpu": "--time-cpu"}


def fail(message: str, status: int = 2) -> int:
    """Print one error line for the doctor to stderr and return ``status``."""
    text = " ".join(str(message).split())
    print(f"{PROG} doctor: error: {text}", file=sys.stderr)
    return status


def as_flags(message: str) -> str:
    """``message`` with a leading Python parameter name (``trial_steps must be ...``) written as
    the command's flag (``--trial-steps must be ...``)."""
    match = re.match(r"([a-z][a-z0-9_]*)(?= must\b|:)", message)
    if match and match.group(1) in FLAGS:
        return FLAGS[match.group(1)] + message[match.end():]
    return message


def add_parser(sub) -> None:
    """Add the ``doctor`` subcommand to ``sub`` (argparse subparsers)."""
    p = sub.add_parser("doctor", help="measure a model and say which precision to train it in",
                       description="Run the course's measurements on a model and diagnose its "
                                   "mixed-precision problems: fp16 overflow and underflow sites, "
                                   "non-finite gradients, custom autograd Functions under "
                                   "autocast, 16-bit weights and losses, loss-scale advice, "
                                   "autocast's dtypes, speed and memory per precision (on a "
                                   "GPU), FP8 from the Linear shapes. Prints the verdict first.")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="a callable that builds the model, e.g. mypkg.models:build, "
                        "path/to/models.py:build or torchvision:resnet50 (random weights)")
    p.add_argument("--batch-shape", default=None, metavar="N,...",
                   help="shape of one random input batch for a model of one input (default "
                        "2,3,224,224 when no --input is given)")
    p.add_argument("--input", action="append", default=[], metavar="[NAME=]SHAPE[:ids=V]",
                   help="one input of the model, in order (repeat for several): SHAPE a random "
                        "float tensor, SHAPE:ids=V integer ids in [0, V); NAME= passes it as a "
                        "keyword argument (then name every input)")
    p.add_argument("--vocab", type=int, default=None, metavar="V",
                   help="make the --batch-shape batch integer token ids in [0, V) (language "
                        "models; default: a float batch)")
    p.add_argument("--output", default=None, metavar="KEY",
                   help="which output to take the loss of where the model returns a dict, "
                        "dataclass or tuple (a key or index; default: 'logits', else 'loss')")
    p.add_argument("--device", default=None, help="device (default: CUDA when present, else CPU)")
    p.add_argument("--precisions", default="fp32,tf32,fp16,bf16",
                   help="precisions to time, comma-separated ('' for none; default: all four; on "
                        "a CPU nothing is timed unless --time-cpu)")
    p.add_argument("--time-cpu", action="store_true",
                   help="time the precisions on a CPU too (slow, and decides nothing: the "
                        "course's timing gate needs a GPU)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per precision (default 5)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per precision (default 15)")
    p.add_argument("--trial-steps", type=int, default=None,
                   help="fp16 steps per GradScaler setting checked with the trainer (0: none; "
                        "default 5 on a GPU, 2 on a CPU)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="compare eager and torch.compile forward (auto: on a GPU only)")
    p.add_argument("--fp8-crossover", type=int, default=None, metavar="WIDTH",
                   help="width from which FP8 pays on this GPU (default: lesson 07's committed "
                        "run)")
    p.add_argument("--out", type=Path, action="append", default=[], metavar="FILE",
                   help="write the report: .html (self-contained) or .json; may repeat")
    p.set_defaults(func=run)


def parse_input(text: str) -> Tuple[Optional[str], Tuple[int, ...], Optional[int]]:
    """``[NAME=]SHAPE[:ids=V]`` as ``(name, shape, vocab)``; ValueError naming ``--input``."""
    from amp_lessons.doctor.inputs import parse_shape

    name = None
    body = text
    head = text.split(":", 1)[0]
    if "=" in head:
        name, body = text.split("=", 1)
        if not name.isidentifier():
            raise ValueError(f"--input: {name!r} is not a keyword argument name (in {text!r})")
    shape_text, _, kind = body.partition(":")
    vocab = None
    if kind:
        match = re.fullmatch(r"ids=(\d+)", kind.strip())
        if not match or int(match.group(1)) < 2:
            raise ValueError(f"--input: after the shape write :ids=V with V >= 2 (integer ids in "
                             f"[0, V)); got {text!r}")
        vocab = int(match.group(1))
    try:
        shape = parse_shape(shape_text)
    except ValueError:
        raise ValueError(f"--input must be [NAME=]SHAPE[:ids=V] with SHAPE whole numbers >= 1 "
                         f"separated by commas, e.g. 8,128 or input_ids=8,128:ids=30522; got "
                         f"{text!r}") from None
    return name, shape, vocab


def _specs(args) -> List[Tuple[Optional[str], Tuple[int, ...], Optional[int]]]:
    from amp_lessons.doctor.inputs import parse_shape

    if args.input and (args.batch_shape is not None or args.vocab is not None):
        raise ValueError("give either --batch-shape (with --vocab) for one input, or --input "
                         "once per input, not both")
    if args.vocab is not None and args.vocab < 2:
        raise ValueError(f"--vocab must be a whole number >= 2; got {args.vocab}")
    if not args.input:
        return [(None, parse_shape(args.batch_shape or "2,3,224,224"), args.vocab)]
    specs = [parse_input(t) for t in args.input]
    named = [s[0] is not None for s in specs]
    if any(named) and not all(named):
        raise ValueError("--input: name every input (NAME=SHAPE) or none")
    return specs


def make_inputs(specs, device):
    """The random batch the specs describe: one tensor, a tuple (positional inputs) or a dict
    (named inputs), each checked against the device's free memory first."""
    import torch

    from amp_lessons.doctor.inputs import check_fits

    g = torch.Generator(device=device).manual_seed(0)
    tensors: Dict[object, object] = {}
    for i, (name, shape, vocab) in enumerate(specs):
        check_fits(shape, torch.int64 if vocab else torch.float32, device,
                   "--input" if len(specs) > 1 or name else "--batch-shape")
        t = (torch.randint(0, vocab, shape, device=device, generator=g) if vocab else
             torch.randn(shape, device=device, generator=g))
        tensors[name if name else i] = t
    if len(specs) == 1 and specs[0][0] is None:
        return tensors[0]
    if specs[0][0] is not None:
        return dict(tensors)
    return tuple(tensors.values())


def run(args: argparse.Namespace) -> int:
    """Run the subcommand; returns the exit status (one error line on any failure, 130 on
    Ctrl-C)."""
    written: List[str] = []
    try:
        return _run(args, written)
    except KeyboardInterrupt:
        done = f"wrote {', '.join(written)}" if written else "no report was written"
        left = [str(o) for o in args.out if str(o) not in written]
        return fail(f"interrupted (Ctrl-C) while measuring {args.model}: {done}"
                    + (f"; not written: {', '.join(left)}" if left else ""), INTERRUPTED)


def _run(args: argparse.Namespace, written: List[str]) -> int:
    from amp_lessons.files import check_writable, write_failure

    try:
        for out in args.out:
            if out.suffix.lower() not in (".html", ".htm", ".json"):
                raise ValueError(f"--out must end in .html or .json; got '{out}'")
            check_writable(out, "--out")
        specs = _specs(args)
        import torch

        from amp_lessons.doctor.inputs import build_model, check_model, is_out_of_memory
        from amp_lessons.doctor.run import check_device, doctor
        from amp_lessons.numerics.precision import as_device

        device = check_device(as_device(args.device), name="--device")
        model = check_model(build_model(args.model))
        model = model.to(device)
        batch = make_inputs(specs, device)
        precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip())
        kwargs = dict(inputs=batch) if not isinstance(batch, torch.Tensor) else {}
        report = doctor(model, batch if not kwargs else None, device=device,
                        precisions=precisions, warmup=args.warmup, steps=args.steps,
                        trial_steps=args.trial_steps,
                        compile={"auto": None, "on": True, "off": False}[args.compile],
                        fp8_crossover=args.fp8_crossover, name=args.model,
                        output=args.output, time_cpu=args.time_cpu, progress=True, **kwargs)
    except ValueError as exc:
        return fail(as_flags(str(exc)))
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        return fail(_one_line(exc, args))
    print(report.verdict_line())
    for f in report.findings:
        severity = f.get("severity", "note")
        site = f" at {f['site']}" if f.get("site") and severity == "alarm" else ""
        print(f"[{severity}: {f['topic']}] {f['finding']}{site}  ({f['lesson']})")
        if severity == "alarm" and f.get("fix"):
            print(f"    fix: {f['fix']}")
    for out in args.out:
        figure = ""
        if out.suffix.lower() != ".json":
            from amp_lessons.ui.doctor_plots import ranges_svg

            figure = ranges_svg(report) if report.layers else ""
        try:
            report.write(out, figure)
        except OSError as exc:
            return fail(write_failure(out, exc), 1)
        written.append(str(out))
        print(f"wrote {out}")
    return 0


def _one_line(exc: BaseException, args) -> str:
    """A failure other than a ValueError as one line naming its cause."""
    from amp_lessons.doctor.inputs import available_bytes, is_out_of_memory

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if is_out_of_memory(exc):
        import torch

        device = torch.device(args.device) if args.device else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        free = available_bytes(device)
        shapes = ", ".join(args.input) or args.batch_shape or "2,3,224,224"
        need = re.search(r"allocate (\d[\d,]*) bytes", first) or \
            re.search(r"allocate ([\d.]+ [GMK]iB)", first)
        return (f"out of memory on {device} measuring {args.model} with a batch of {shapes}: "
                f"{'it asked for ' + need.group(1) + (' bytes' if need.group(1)[-1].isdigit() else '') + ' and ' if need else ''}"
                f"{plural(free, 'byte') + ' are free' if free is not None else 'free memory unknown'}: "
                f"use a smaller batch")
    if "meta" in first.lower() and "tensor" in first.lower():
        return (f"{args.model}: the model's parameters are on the meta device and hold no data: "
                f"materialise them first ({type(exc).__name__}: {first})")
    return f"{args.model}: {type(exc).__name__}: {first}"
