"""Command line: ``python -m amp_lessons {run-notebooks,rehearse,readme,claims,figure-images,bench,train,doctor} ...``.

Bad flags (an empty path among them: what ``--out "$OUT"`` gives with ``OUT`` unset) end in
argparse's usage message and exit status 2. Every other user error (a bad setting, a missing or
damaged file, a path that cannot be written, a run that does not fit in memory) prints one line,
``python -m amp_lessons <command>: error: ...``, and exits with a non-zero status, never a
traceback. Paths are checked before any training or measuring starts, with the rule the one
writer applies (``files.check_writable``: a read-only file is refused, never replaced). Ctrl-C
prints one line saying what was interrupted and what was or was not written, and exits with
status 130 (``INTERRUPTED``); files are written whole or not at all, so none is half-written.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import List, Optional

from amp_lessons import __version__
from amp_lessons.tables import plural
from amp_lessons.files import check_writable, write_atomic, write_failure, write_json  # noqa: F401 - check_writable: this module's API too
from amp_lessons.validate import check_seed

PROG = "python -m amp_lessons"


def fail(command: str, message: str, status: int = 2) -> int:
    """Print one error line for ``command`` to stderr and return ``status``."""
    text = " ".join(str(message).split())  # one line, whatever the message held
    print(f"{PROG} {command}: error: {text}", file=sys.stderr)
    return status


INTERRUPTED = 128 + 2  # the shell's status for a process stopped by SIGINT (Ctrl-C)


def interrupted(command: str, message: str) -> int:
    """Print the one line of a command stopped by Ctrl-C and return ``INTERRUPTED`` (130)."""
    return fail(command, f"interrupted (Ctrl-C) {message}", INTERRUPTED)


def _path(text: str) -> Path:
    """An argparse type: a file or folder path, never the empty string (what ``"$OUT"`` gives
    when ``OUT`` is unset, which ``Path`` would read as the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty string (an unset "
                                         "shell variable?)")
    return Path(text)


def _file_path(text: str) -> Path:
    """An argparse type: a path that names a file (``_path``'s rule, and no trailing ``/``:
    ``Path`` drops it, so ``--json out/`` wrote a file named ``out`` where the user named a
    folder)."""
    path = _path(text)
    if text.endswith(("/", os.sep)) and text.strip("/" + os.sep):
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}: its trailing "
                                         f"'/' names a folder (name the file in it)")
    return path


def as_flag(message: str, dests, renamed: Optional[dict] = None) -> str:
    """``message`` with the setting it starts with ("lr must be ...", "resume: ...") written as
    the command's flag ("--lr must be ..."): errors from the functions behind a command name
    their Python parameters. ``dests``: the command's argument names; ``renamed``: parameter ->
    flag where they differ (``clip_norm`` -> ``--clip``)."""
    match = re.match(r"([a-z][a-z0-9_]*)(?= must\b|:)", message)
    if not match:
        return message
    name = match.group(1)
    flag = (renamed or {}).get(name) or ("--" + name.replace("_", "-") if name in dests else None)
    return flag + message[match.end():] if flag else message


def _failure_text(exc: BaseException) -> str:
    """A failed run's line: the package's file errors as they are (they say "could not write"
    and name the file), others with their type (``OSError: ...``, a kernel that would not
    start)."""
    from amp_lessons.files import DiskFullError, FileTooLargeError, ReadOnlyFileError

    if isinstance(exc, (DiskFullError, FileTooLargeError, ReadOnlyFileError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _int_from(low: int):
    """An argparse type: a whole number >= ``low``, else an error that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
        return value
    return parse


_positive_int = _int_from(1)
_nonnegative_int = _int_from(0)  # untimed warm-up steps: 0 is a choice (doctor, bench alike)


# --- run-notebooks -------------------------------------------------------------------------------

def _add_run_notebooks(sub) -> None:
    p = sub.add_parser("run-notebooks", help="execute lesson notebooks headless, in order",
                       description="Execute notebooks in order, write the executed copies and "
                                   "record the run (device, torch, profile, date) in their "
                                   "metadata.")
    p.add_argument("notebooks", nargs="*", type=_path,
                   help="notebooks to run (default: every lesson in notebooks/)")
    p.add_argument("--profile", choices=["quick", "full"], default=None,
                   help="sizes to use (default: full with CUDA, quick without)")
    p.add_argument("--out", type=_path, default=None,
                   help="folder for the executed copies (default: rewrite in place)")
    p.add_argument("--timeout", type=_positive_int, default=1800,
                   help="seconds one cell may run (default 1800)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--allow-busy-gpu", action="store_true",
                   help="run even when another process uses the GPU (its measurements would "
                        "time both; by default each notebook waits up to 60 s, then stops)")
    p.set_defaults(func=_cmd_run_notebooks)


def check_notebooks(paths, out: Optional[Path] = None) -> None:
    """ValueError (``runner.NotANotebookError`` is one) unless every path is a valid notebook
    and its executed copy can be written (in place, or in ``out``, a folder that exists or can
    be made in a writable place): checked before the first notebook runs."""
    from amp_lessons.publish.notebooks import output_path, read_notebook

    check_paths_exist(paths)
    for p in paths:
        read_notebook(Path(p))
    targets: dict = {}
    for p in paths:
        target = output_path(Path(p), out).resolve()
        if target in targets:  # a notebook named twice, or two of one name into one --out
            raise ValueError(f"'{p}' and '{targets[target]}' would both be written to "
                             f"'{target}': name each notebook once, or run them into "
                             f"different --out folders")
        targets[target] = p


def check_paths_exist(paths) -> None:
    """ValueError naming what is wrong with notebook paths that are not files: a folder (name
    the notebooks in it), or nothing at all there."""
    folders = [str(p) for p in paths if Path(p).is_dir()]
    if folders:
        raise ValueError(f"{', '.join(folders)}: a folder, not a notebook (name the notebooks "
                         f"in it, e.g. {Path(folders[0]) / '*.ipynb'})")
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        raise ValueError(f"no such notebook: {', '.join(missing)}")


def _cmd_run_notebooks(args) -> int:
    from amp_lessons.publish.notebooks import NotebookRunError, course_notebooks, run_notebook

    paths = args.notebooks or course_notebooks()
    try:
        check_notebooks(paths, args.out)
    except ValueError as exc:
        return fail("run-notebooks", str(exc))
    from amp_lessons.publish.rehearsal import busy_gpu_text, wait_for_idle_gpu

    written = []
    path = None
    try:
        for path in paths:
            busy = [] if args.allow_busy_gpu else wait_for_idle_gpu()
            if busy:  # a timing taken beside another process measures both
                return fail("run-notebooks", f"{path.name}: not run: {busy_gpu_text(busy)}; wait "
                            f"for it or stop it (--allow-busy-gpu runs anyway)", 1)
            written.append(run_notebook(path, profile=args.profile, out=args.out,
                                        timeout=args.timeout, progress=not args.no_progress))
    except KeyboardInterrupt:
        later = paths[paths.index(path) + 1:] if path in paths else []
        return interrupted("run-notebooks", "".join((
            f"while running {path}: it was not written (left as it was)",
            f"; wrote {', '.join(map(str, written))}" if written else "",
            f"; not run: {', '.join(map(str, later))}" if later else "")))
    except NotebookRunError as exc:
        return fail("run-notebooks", exc.summary, 1)
    except (OSError, RuntimeError, ValueError) as exc:  # kernel would not start, disk, ...
        return fail("run-notebooks", _failure_text(exc), 1)
    for path in written:
        print(f"wrote {path}")
    return 0


# --- rehearse ----------------------------------------------------------------------------------

def _add_rehearse(sub) -> None:
    p = sub.add_parser("rehearse", help="run lessons' full profiles on a simulated card (T4)",
                       description="Run notebooks with AMP_LESSONS_SIMULATE set (allocator capped, "
                                   "bf16 and TF32 off, the card's capability) and write "
                                   "rehearsal_<card>.json: time, GPU-busy time, peak GPU memory "
                                   "and the rows not run per lesson.")
    p.add_argument("notebooks", nargs="*", type=_path,
                   help="notebooks to run (default: every lesson in notebooks/)")
    p.add_argument("--card", default="t4", help="the card to simulate (default and only: t4)")
    p.add_argument("--profile", choices=["quick", "full"], default="full",
                   help="sizes to use (default: full)")
    p.add_argument("--out", type=_path, required=True,
                   help="folder for the executed copies and rehearsal_<card>.json")
    p.add_argument("--timeout", type=_positive_int, default=1800,
                   help="seconds one cell may run (default 1800)")
    p.add_argument("--update", type=_file_path, default=None,
                   help="a rehearsal record (docs/rehearsal_t4.json) to merge this run into: "
                        "lessons run now replace their earlier records")
    p.set_defaults(func=_cmd_rehearse)


def update_problem(profile: str) -> str:
    """Why a rehearsal run here may not go into the committed record (``--update``), or "": the
    record publishes a simulated card's times and memory under that heading, so only a
    full-profile run on a CUDA GPU (the card simulated on it) belongs there; a run on a CPU
    replaced the H200's records with numbers that mean something else."""
    import torch

    if not torch.cuda.is_available():
        return ("only a rehearsal on a CUDA GPU (simulating the card) can go into the record; "
                "this machine has none (run without --update to try the notebooks)")
    if profile != "full":
        return (f"the record holds full-profile runs; this run is --profile {profile} (run "
                f"without --update, or with --profile full)")
    return ""


def _cmd_rehearse(args) -> int:
    from amp_lessons.env import SIMULATED_CARDS
    from amp_lessons.publish.rehearsal import rehearse
    from amp_lessons.publish.notebooks import course_notebooks

    paths = args.notebooks or course_notebooks()
    try:
        if args.card not in SIMULATED_CARDS:
            raise ValueError(f"card must be one of {', '.join(SIMULATED_CARDS)}; got {args.card!r}")
        check_notebooks(paths, args.out)
        check_writable(args.out / f"rehearsal_{args.card}.json", "out")
        earlier = None
        if args.update is not None:
            check_writable(args.update, "update")
            if args.update.exists():
                from amp_lessons.publish.rehearsal import read_record

                earlier = read_record(args.update, "update")
                if earlier["card"] != args.card:
                    raise ValueError(f"update: '{args.update}' is a rehearsal record of card "
                                     f"{earlier['card']}, not {args.card}")
            problem = update_problem(args.profile)
            if problem:
                raise ValueError(f"update: {problem}")
    except (ValueError, OSError) as exc:  # NotANotebookError, JSONDecodeError are ValueErrors
        return fail("rehearse", str(exc))
    try:
        doc = rehearse(paths, card=args.card, out=args.out, profile=args.profile,
                       timeout=args.timeout)
    except (OSError, ValueError) as exc:
        return fail("rehearse", _failure_text(exc), 1)
    if args.update is not None:
        from amp_lessons.publish.rehearsal import merge
        from amp_lessons.tables import json_safe

        try:
            merged = merge([earlier, doc], replace=True) if earlier else doc
            write_json(args.update, json_safe(merged), "rehearsal record")
        except OSError as exc:
            return fail("rehearse", write_failure(args.update, exc), 1)
        except (KeyError, ValueError) as exc:
            return fail("rehearse", f"could not merge into {args.update}: {exc}", 1)
        print(f"updated {args.update}")
    for r in doc["lessons"]:
        state = "completed" if r["completed"] else f"FAILED ({r['error']})"
        peak = "n/a" if r["peak_gpu_mib"] is None else f"{r['peak_gpu_mib']} MiB"
        print(f"{r['notebook']}: {state} in {r['seconds']} s, peak {peak}, "
              f"{plural(len(r['not_run']), 'row')} not run")
    print(f"wrote {args.out / f'rehearsal_{args.card}.json'}")
    return 0 if all(r["completed"] for r in doc["lessons"]) else 1


# --- readme ------------------------------------------------------------------------------------

def _add_readme(sub) -> None:
    p = sub.add_parser("readme", help="rebuild the README's results section from the notebooks",
                       description="Rebuild README.md's results section from the tables the "
                                   "committed notebooks published in their latest run, its T4 "
                                   "rehearsal table from docs/rehearsal_t4.json and its cheat "
                                   "sheet from docs/cheat_sheet.md, its citations "
                                   "{{KEY | ROW | COLUMN}} filled from the same tables, "
                                   "and the lessons' cited prose (markdown cells that keep "
                                   "their citations in metadata amp_lessons.cited) too.")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the section is out of date")
    p.add_argument("--readme", type=_file_path, default=None,
                   help="README to update (default: the repo's, and then the lessons' cited "
                        "prose too; another README is written alone)")
    p.set_defaults(func=_cmd_readme)


def _cmd_readme(args) -> int:
    from amp_lessons.publish import rehearsal
    from amp_lessons.files import read_text
    from amp_lessons.publish.report import cite_notebooks, collect, readme_with_generated
    from amp_lessons.publish.notebooks import NOTEBOOK_DIR, course_notebooks

    repo_readme = NOTEBOOK_DIR.parent / "README.md"
    readme = args.readme or repo_readme
    # another README (a copy): write only it, not the checkout's notebooks
    own = args.readme is None or readme.resolve() == repo_readme.resolve()
    if readme.is_dir():
        return fail("readme", f"--readme must name a file, not a folder; got '{readme}'")
    if not readme.is_file():
        return fail("readme", f"no README at '{readme}'")
    if not args.check:  # the one writer's rule, before the work: a read-only README is refused
        try:
            check_writable(readme, "--readme" if args.readme is not None else "README")
        except ValueError as exc:
            return fail("readme", str(exc))
    rehearsal_file = NOTEBOOK_DIR.parent / "docs" / "rehearsal_t4.json"
    try:  # every generated block is built before anything is written
        current = read_text(readme, "README")
        notebooks = course_notebooks()
        results = collect(notebooks)  # every notebook read once, for every block
        new = readme_with_generated(readme, current, notebooks, results)
        if rehearsal_file.is_file():  # the T4 rehearsal's block, from its committed record
            new = rehearsal.with_rehearsal(new, rehearsal.read_record(rehearsal_file), str(readme))
        stale = cite_notebooks(notebooks, write=False, results=results)  # lessons' cited prose
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return fail("readme", str(exc))
    if args.check:
        stale = stale if own else []
        if new != current or stale:
            names = ", ".join(p.name for p in stale)
            print(f"{readme}: results, rehearsal or cheat-sheet section is out of date"
                  f"{f', and the cited prose of {names}' if stale else ''}; run "
                  f"`python -m amp_lessons readme`", file=sys.stderr)
            return 1
        print(f"{readme}: results, rehearsal and cheat-sheet sections and the lessons' cited "
              f"prose are current")
        return 0
    if new != current:
        try:
            write_atomic(readme, new, "README")
        except OSError as exc:
            return fail("readme", write_failure(readme, exc), 1)
    print(f"{readme}: {'updated' if new != current else 'already current'}")
    if not own:
        if stale:
            print(f"not written (--readme names another README): the cited prose of "
                  f"{', '.join(p.name for p in stale)}")
        return 0
    try:
        for path in cite_notebooks(stale, results=results):
            print(f"{path}: cited prose updated")
    except (OSError, ValueError) as exc:
        return fail("readme", str(exc))
    return 0


# --- explain ----------------------------------------------------------------------------------

def _add_explain(sub) -> None:
    p = sub.add_parser("explain", help="where a published table's numbers came from",
                       description="Print what the committed notebooks recorded when they "
                                   "published a table (e.g. lesson05.techniques): the run and "
                                   "the code version, the call path at publish time, the calls "
                                   "that made each row (with its configuration) and each "
                                   "column. Without KEY, list the published keys.")
    p.add_argument("key", nargs="?", default=None, metavar="KEY",
                   help="a published key (the README names each table's); without one, list them")
    p.set_defaults(func=_cmd_explain)


def _cmd_explain(args) -> int:
    from amp_lessons.publish.notebooks import course_notebooks
    from amp_lessons.publish.provenance import explain, unknown_key
    from amp_lessons.publish.report import collect

    try:  # the committed records only: no torch-heavy module is imported, no lesson runs
        published = collect(course_notebooks(), validate=False)
    except (OSError, ValueError) as exc:
        return fail("explain", str(exc))
    keys = list(dict.fromkeys(r["key"] for r in published))
    if args.key is None:
        for key in keys:
            found = next(r for r in published if r["key"] == key)
            print(f"{key}  (notebooks/{found['notebook']}): {found.get('title', '')}")
        return 0
    found = [r for r in published if r["key"] == args.key]
    if not found:
        return fail("explain", unknown_key(args.key, keys))
    print(explain(args.key, found[-1]))
    return 0


# --- claims and figure images --------------------------------------------------------------------

def _add_claims(sub) -> None:
    p = sub.add_parser("claims", help="print the claims table (docs/claims.md) from the registry",
                       description="Print every article claim, the lesson that decides it and "
                                   "the rule, from amp_lessons/publish/claims.py, as Markdown (what "
                                   "docs/claims.md holds). Writes a file only where --out names "
                                   "one.")
    p.add_argument("--out", type=_file_path, default=None, metavar="PATH",
                   help="write the Markdown to PATH instead of printing it "
                        "(the course's own copy: --out docs/claims.md)")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the file (--out, default: the clone's "
                        "docs/claims.md) is out of date")
    p.set_defaults(func=_cmd_claims)


def _cmd_claims(args) -> int:
    from amp_lessons.publish.claims import claims_markdown
    from amp_lessons.publish.notebooks import NOTEBOOK_DIR

    text = claims_markdown()
    if args.check:
        from amp_lessons.files import read_text

        path = args.out or NOTEBOOK_DIR.parent / "docs" / "claims.md"
        if path.is_dir():
            return fail("claims", f"out must name a file, not a folder; got '{path}'")
        if not path.is_file():
            print(f"{path}: no such file; run `python -m amp_lessons claims --out {path}`",
                  file=sys.stderr)
            return 1
        try:
            current = read_text(path, "claims page")
        except (OSError, ValueError) as exc:
            return fail("claims", str(exc))
        if current != text:
            print(f"{path}: out of date; run `python -m amp_lessons claims --out {path}`",
                  file=sys.stderr)
            return 1
        print(f"{path}: current")
        return 0
    if args.out is None:  # a command a learner runs prints; it writes only where asked
        sys.stdout.write(text)
        return 0
    try:
        check_writable(args.out, "--out")
        write_atomic(args.out, text, "claims page")
    except ValueError as exc:
        return fail("claims", str(exc))
    except OSError as exc:
        return fail("claims", write_failure(args.out, exc), 1)
    print(f"wrote {args.out}")
    return 0


def _add_figure_images(sub) -> None:
    p = sub.add_parser("figure-images", help="add a static PNG beside every figure of notebooks",
                       description="Give every plotly figure in the executed notebooks a static "
                                   "PNG (what GitHub shows), store its data once, and pack long "
                                   "arrays. Needs Chromium (apt-get install chromium).")
    p.add_argument("notebooks", nargs="*", type=_path,
                   help="notebooks to update (default: every lesson in notebooks/)")
    p.add_argument("--force", action="store_true", help="render images that already exist again")
    p.set_defaults(func=_cmd_figure_images)


def _cmd_figure_images(args) -> int:
    from amp_lessons.publish.notebooks import course_notebooks
    from amp_lessons.publish.snapshots import add_images_to

    paths = args.notebooks or course_notebooks()
    try:
        check_paths_exist(paths)
    except ValueError as exc:
        return fail("figure-images", str(exc))
    for path in paths:
        if path.suffix != ".ipynb":
            return fail("figure-images", f"'{path}' is not a notebook file (.ipynb)")
    try:  # the writer's rule before Chromium starts: a read-only notebook is refused, unrendered
        for path in paths:
            check_writable(path, "notebook")
    except ValueError as exc:
        return fail("figure-images", str(exc))
    try:
        added = add_images_to(paths, force=args.force)
    except (RuntimeError, ValueError, OSError) as exc:
        return fail("figure-images", str(exc))
    for path, n in added.items():
        # --force draws every figure's image again, where one existed too
        print(f"{path}: {n} image{'s' if n != 1 else ''} {'written' if args.force else 'added'}")
    return 0


# --- bench ---------------------------------------------------------------------------------------

def _add_bench(sub) -> None:
    from amp_lessons.measure import COMPILE_MODES, MODELS, OPTIMIZER_IMPLS, OPTIMIZERS
    from amp_lessons.numerics.precision import PRECISIONS

    p = sub.add_parser("bench", help="time a training step and measure its memory (lesson 04)",
                       description="Measure img/s (median over steps, CUDA events on a GPU) and "
                                   "peak memory of a training step, one row per precision, all "
                                   "in this process. Sizes default to the profile's.")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="default: resnet50 (full profile), resnet18 (quick)")
    p.add_argument("--precision", nargs="+", choices=list(PRECISIONS) + ["amp"],
                   default=["fp32", "fp16"], help="one row per precision (default: fp32 fp16)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="default: 256 scaled to the GPU's memory (full), 8 (quick)")
    p.add_argument("--image-size", type=_positive_int, default=None,
                   help="default: 224 (full), 32 (quick)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format")
    p.add_argument("--compile", nargs="?", const="default", default=None,
                   choices=[m for m in COMPILE_MODES if m],
                   help="torch.compile the model (optionally with a mode)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole eager step in one CUDA graph")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--impl", choices=OPTIMIZER_IMPLS, default="default",
                   help="optimizer kernels: for-loop, foreach or fused")
    p.add_argument("--checkpoint", choices=["block", "stage"], default=None,
                   help="activation checkpointing per residual block or per stage")
    p.add_argument("--trainer", action="store_true",
                   help="time Trainer.train_step instead of the hand-written loop")
    p.add_argument("--warmup", type=_nonnegative_int, default=None,
                   help="untimed steps per row (default: 5 full, 1 quick)")
    p.add_argument("--steps", type=_positive_int, default=None, help="default: 15 (full), 3 (quick)")
    p.add_argument("--profile", choices=["quick", "full"], default=None,
                   help="default sizes to use (default: full with CUDA, quick without)")
    p.add_argument("--json", type=_file_path, default=None, help="also write the rows as JSON here")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    import json

    from amp_lessons.measure import DEFAULT_COLUMNS, BenchConfig, batch_size_for, results_document, run_configs
    from amp_lessons.publish.claims import rows_timing_gate
    from amp_lessons.tables import text_table
    from amp_lessons.env import probe

    env = probe(args.profile)
    quick = env.profile == "quick"
    model = args.model or ("resnet18" if quick else "resnet50")
    image = args.image_size or (32 if quick else 224)
    batch = args.batch_size or (8 if quick else batch_size_for(env.total_memory_gib, image))
    precisions = list(dict.fromkeys("fp16" if p == "amp" else p for p in args.precision))
    try:
        if args.json is not None:
            check_writable(args.json, "json")
        configs = [BenchConfig(model=model, precision=p, channels_last=args.channels_last,
                               batch_size=batch, image_size=image, optimizer=args.optimizer,
                               impl=args.impl, compile=args.compile, cuda_graph=args.cuda_graph,
                               checkpoint=args.checkpoint,
                               loop="trainer" if args.trainer else "hand")
                   for p in precisions]
    except ValueError as exc:
        return fail("bench", as_flag(str(exc), vars(args)))
    warmup = args.warmup if args.warmup is not None else (1 if quick else 5)
    rows = run_configs(configs, env.device, warmup=warmup,
                       steps=args.steps or (3 if quick else 15), progress=False)
    print(text_table(rows, DEFAULT_COLUMNS))
    ok = [r for r in rows if r.get("status") == "ok"]
    why = rows_timing_gate(*ok) if len(ok) > 1 else None  # the gate of every timing verdict
    for line in [f"note: no speed comparison: {why}" if why else ""] + [
            cpu_half_hint(p, env.device) for p in precisions]:
        if line:
            print(line)
    if args.json is not None:
        doc = results_document(rows, env.device, profile=env.profile)
        try:
            write_atomic(args.json, json.dumps(doc, indent=1), "results")
        except OSError as exc:
            return fail("bench", write_failure(args.json, exc), 1)
        print(f"wrote {args.json}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


# --- train ---------------------------------------------------------------------------------------

def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _add_train(sub) -> None:
    from amp_lessons.models import DIGITS_MODELS
    from amp_lessons.train.trainer import EVAL_PRECISIONS, NONFINITE_POLICIES, PRECISIONS

    p = sub.add_parser("train", help="train a digits model at one precision (lesson 02)",
                       description="Train on scikit-learn's digits with the course's trainer and "
                                   "print time per epoch, peak memory and test accuracy. Run it "
                                   "with --precision fp32 and with --precision amp to compare "
                                   "them, as lesson 02 does.")
    p.add_argument("--precision", choices=list(PRECISIONS) + ["amp"], default="fp32",
                   help="fp32 (TF32 off), tf32, fp16 = amp (autocast + GradScaler), bf16")
    p.add_argument("--model", choices=DIGITS_MODELS, default="cnn", help="default: cnn")
    p.add_argument("--width", type=_positive_int, default=32, help="model width (default 32)")
    p.add_argument("--epochs", type=_positive_int, default=3,
                   help="total epochs, counting those a --resume checkpoint already did (default 3)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="default 64")
    p.add_argument("--lr", type=_number, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--init-scale", type=_number, default=2.0 ** 16,
                   help="GradScaler init_scale, > 0 (default 65536)")
    p.add_argument("--growth-factor", type=_number, default=2.0, help="> 1 (default 2.0)")
    p.add_argument("--backoff-factor", type=_number, default=0.5, help="in (0, 1) (default 0.5)")
    p.add_argument("--growth-interval", type=_whole, default=2000, help=">= 1 (default 2000)")
    p.add_argument("--clip", type=_number, default=None, metavar="MAX_NORM",
                   help="clip the gradient norm (after unscale_) to MAX_NORM")
    p.add_argument("--accumulate", type=_positive_int, default=1,
                   help="micro-batches per optimizer step (default 1)")
    p.add_argument("--nonfinite", choices=NONFINITE_POLICIES, default="skip",
                   help="a step with an inf/NaN loss or gradient without GradScaler (fp32, tf32, "
                        "bf16): skip it (default), raise, or ignore")
    p.add_argument("--eval-precision", choices=EVAL_PRECISIONS, default="same",
                   help="evaluate under training's autocast (same) or another precision")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="default: the GPU if there is one")
    p.add_argument("--seed", type=_whole, default=0, help="default 0")
    p.add_argument("--checkpoint", type=_file_path, default=None, metavar="PATH",
                   help="save a training checkpoint here after every epoch (atomically)")
    p.add_argument("--resume", type=_file_path, default=None, metavar="PATH",
                   help="continue exactly from this checkpoint")
    p.add_argument("--json", type=_file_path, default=None, metavar="OUT",
                   help="also write the per-epoch results, summary and step history here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_cmd_train, parser=p)


def _mib(value) -> str:
    return "n/a on a CPU" if value is None else f"{value / 2 ** 20:.1f} MiB"


def _loss_text(value) -> str:
    return "n/a (every step skipped)" if value is None else f"{value:.4f}"


def cpu_half_hint(precision: str, device=None) -> str:
    """One line on why ``train`` or ``bench`` with ``--precision fp16`` (or ``amp``) is slow when
    it runs on a CPU, or ``""`` elsewhere: the speed-up of fp16 is a GPU's."""
    from amp_lessons.numerics.precision import as_device

    if precision not in ("fp16", "amp") or as_device(device).type != "cpu":
        return ""
    return ("hint: fp16 on a CPU runs slower than fp32: a CPU has no fast fp16 math, so autocast "
            "converts to and from fp16 around every op and GradScaler adds its checks; the "
            "speed-up is a GPU's (here, compare with --precision fp32)")


def _cmd_train(args) -> int:
    finished: List[dict] = []  # the summaries of the epochs this run finished
    before = {path: _file_id(path) for path in (args.checkpoint, args.json) if path is not None}
    try:
        return _train(args, finished)
    except KeyboardInterrupt:
        return interrupted("train", _train_interrupted(args, finished, before))


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through links, ``..`` and hard links), existing or
    not."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def _file_id(path: Path):
    """What tells a file written since from the one there now: the atomic writer's rename gives
    each write a new inode (None where there is no file)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _train_interrupted(args, finished: List[dict], before: dict) -> str:
    """The rest of ``train``'s Ctrl-C line: where it stopped, what the checkpoint holds now,
    whether ``--json`` was written, and any temporary file left (none: the writer removes its
    own on Ctrl-C)."""
    from amp_lessons.files import temp_files_of

    where = (f"in epoch {finished[-1]['epoch'] + 2} of {args.epochs} "
             f"({plural(len(finished), 'epoch')} finished in this run)" if finished
             else "before an epoch of this run finished")
    parts = []
    if args.checkpoint is not None:
        path = args.checkpoint
        if _file_id(path) == before[path]:
            parts.append(f"checkpoint {path} not written" if before[path] is None else
                         f"checkpoint {path} left as it was")
        else:
            parts.append(f"checkpoint {path} {_checkpoint_holds(path)} (continue with --resume "
                         f"{path})")
    if args.json is not None:
        changed = _file_id(args.json) != before[args.json]
        parts.append(f"wrote {args.json}" if changed else f"--json {args.json} not written")
    if not parts:
        parts.append("nothing written (no --checkpoint or --json given)")
    left = [str(t) for path in before for t in temp_files_of(path)]
    parts.append(f"temporary file left: {', '.join(left)}" if left else
                 "no temporary file left behind")
    return f"{where}: {'; '.join(parts)}"


def _checkpoint_holds(path: Path) -> str:
    """"holds N finished epochs", read from the checkpoint itself (a save may have finished
    after the last epoch was printed)."""
    from amp_lessons.train.checkpoint import read_verified

    try:
        epochs = read_verified(path)["epoch"]
    except Exception as exc:  # noqa: BLE001 - the line says what is known
        return f"was written, but could not be read back ({type(exc).__name__})"
    return f"holds {plural(int(epochs), 'finished epoch')}"


def out_of_memory_text(exc: BaseException, device, lower: str) -> str:
    """One line for a run that did not fit: the bytes one allocation asked for (as the
    allocator's message gives them), the bytes the device has, and the settings to ``lower``."""
    import torch

    from amp_lessons.numerics.precision import as_device

    device = as_device(device)
    match = re.search(r"tried to allocate (\d+) bytes", str(exc), re.IGNORECASE)
    unit = re.search(r"tried to allocate ([\d.]+) (KiB|MiB|GiB|TiB)", str(exc), re.IGNORECASE)
    needed = int(match.group(1)) if match else (
        int(float(unit.group(1)) * 2 ** (10 * ("KMGT".index(unit.group(2)[0].upper()) + 1)))
        if unit else None)
    if device.type == "cuda":
        has = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            has = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            has = None
    asked = f"one allocation asked for {plural(needed, 'byte')}" if needed else "an allocation failed"
    where = "the GPU" if device.type == "cuda" else "this machine"
    held = f", and {where} has {plural(has, 'byte')} of memory" if has else ""
    return f"out of memory on {device}: {asked}{held}; {lower}"


def _train(args, finished: List[dict]) -> int:
    from amp_lessons.files import DiskFullError, FileTooLargeError, ReadOnlyFileError
    from amp_lessons.measure.oom import is_out_of_memory
    from amp_lessons.tables import json_safe
    from amp_lessons.train.recipes import check_train_sizes, train_digits
    from amp_lessons.train.trainer import ScalerSettings

    def on_epoch(e: dict) -> None:
        finished.append(e)
        part = (f" (resumed after batch {e['resumed_at_batch']}: covers the last "
                f"{plural(e['steps'], 'step')} only)" if e.get("partial") else "")
        print(f"epoch {e['epoch'] + 1}/{args.epochs}{part}: {e['time_s']:.2f} s, "
              f"peak memory {_mib(e['peak_memory_bytes'])}, "
              f"train loss {_loss_text(e['train_loss'])}, "
              f"test accuracy {100 * e['test_accuracy']:.1f}%, skipped steps {e['skipped']}",
              flush=True)

    env_doc = None
    device = None if args.device == "auto" else args.device
    try:
        check_seed("seed", args.seed)
        check_train_sizes(args.lr, args.batch_size, args.accumulate)  # before the env probe
        if args.json is not None:  # probed before training: a failure costs no training run
            from amp_lessons.env import probe

            env_doc = probe().as_dict()
        if args.resume is not None and not args.resume.is_file():
            raise ValueError(f"resume must name an existing checkpoint file; got '{args.resume}'")
        if args.checkpoint is not None:
            check_writable(args.checkpoint, "checkpoint")
        if args.json is not None:
            check_writable(args.json, "json")
            for flag, other in (("--checkpoint", args.checkpoint), ("--resume", args.resume)):
                if other is not None and same_file(args.json, other):
                    raise ValueError(f"--json and {flag} name the same file ('{args.json}'): "
                                     f"the results would replace the checkpoint; name two files")
        scaler = ScalerSettings(init_scale=args.init_scale, growth_factor=args.growth_factor,
                                backoff_factor=args.backoff_factor,
                                growth_interval=args.growth_interval)
        hint = cpu_half_hint(args.precision, device)
        if hint:
            print(hint, file=sys.stderr, flush=True)
        run = train_digits(args.precision, model=args.model, epochs=args.epochs,
                           batch_size=args.batch_size, lr=args.lr, width=args.width,
                           scaler=scaler, clip_norm=args.clip, accumulate=args.accumulate,
                           eval_precision=args.eval_precision, device=device,
                           seed=args.seed, progress=not args.no_progress,
                           checkpoint=args.checkpoint, resume=args.resume, on_epoch=on_epoch,
                           nonfinite=args.nonfinite)
    except (DiskFullError, FileTooLargeError, ReadOnlyFileError) as exc:  # a checkpoint save
        return fail("train", write_failure(args.checkpoint, exc), 1)
    except (ValueError, OSError, FloatingPointError) as exc:
        # bad settings, a damaged --resume file (CheckpointError), a path that cannot be written
        return fail("train", as_flag(str(exc), vars(args), {"clip_norm": "--clip"}))
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc) and "can't allocate memory" not in str(exc):
            raise
        return fail("train", out_of_memory_text(
            exc, device, f"lower --width (now {args.width}) or --batch-size (now "
                         f"{args.batch_size})"), 1)
    s = run.summary()
    if not run.epochs:
        return fail("train", "resume: the checkpoint holds no finished epoch; nothing to report")
    peak = s["peak_memory_mib"]
    print(f"summary: {s['model']} at {s['precision']} on {s['device']}, "
          f"{plural(s['epochs'], 'epoch')}")
    print(f"  time per epoch : {s['epoch_time_s']:.2f} s "
          f"({'median, first epoch left out' if s['epochs'] > 1 else 'one epoch'})")
    print(f"  peak memory    : {'n/a on a CPU' if peak is None else f'{peak:.1f} MiB'}")
    print(f"  test accuracy  : {100 * s['accuracy']:.1f}%")
    print(f"  skipped steps  : {s['skipped_steps']}")
    if args.json is not None:
        doc = {"command": "train",
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                        if k not in ("func", "parser")},
               "env": env_doc, "summary": s, "epochs": run.epochs,
               "history": run.history.columns()}
        try:
            write_json(args.json, json_safe(doc), "results")
        except OSError as exc:
            return fail("train", write_failure(args.json, exc), 1)
        print(f"wrote {args.json}")
    return 0


# --- entry point ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``python -m amp_lessons`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog=PROG,
                                     description="Companion tools of the amp-lessons course.")
    parser.add_argument("--version", action="version", version=f"amp-lessons {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def _add_doctor(sub) -> None:
    from amp_lessons.doctor.command import add_parser  # the subcommand lives with the doctor

    add_parser(sub)


# One ``_add_<command>(subparsers)`` function per subcommand, defined above in its own section.
_COMMANDS = [_add_run_notebooks, _add_rehearse, _add_readme, _add_explain, _add_claims,
             _add_figure_images, _add_bench, _add_train, _add_doctor]


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the exit status.

    Whatever a command does not catch itself ends in one line, never a traceback: Ctrl-C
    (status 130; files are written whole or not at all), a closed output pipe (``| head``:
    quietly, status 141 as the shell gives), and an unexpected error (its type and first line,
    status 1; ``AMP_LESSONS_TRACEBACK=1`` shows the traceback instead)."""
    args = build_parser().parse_args(argv)
    from amp_lessons.env import get_profile, simulated_card

    try:  # a junk AMP_LESSONS_PROFILE or AMP_LESSONS_SIMULATE: one line, before any work
        get_profile()
        simulated_card()
    except ValueError as exc:
        return fail(args.command, str(exc))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return interrupted(args.command, "before it finished: a file it was writing was not "
                                         "written (files are replaced whole or not at all)")
    except BrokenPipeError:  # the reader of stdout went away (| head): nothing more to say
        try:  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 128 + 13
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        if os.environ.get("AMP_LESSONS_TRACEBACK") == "1":
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return fail(args.command, f"unexpected {type(exc).__name__}: {first} (run again with "
                                  f"AMP_LESSONS_TRACEBACK=1 to see where)", 1)
