"""Command line: ``python -m amp_lessons {run-notebooks,train,bench} ...``.

Bad flags end in argparse's usage message and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from . import __version__


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


# --- run-notebooks -------------------------------------------------------------------------------

def _add_run_notebooks(sub) -> None:
    p = sub.add_parser("run-notebooks", help="execute lesson notebooks headless, in order",
                       description="Execute notebooks in order, write the executed copies and "
                                   "record the run (device, torch, profile, date) in their "
                                   "metadata.")
    p.add_argument("notebooks", nargs="*", type=Path,
                   help="notebooks to run (default: every lesson in notebooks/)")
    p.add_argument("--profile", choices=["quick", "full"], default=None,
                   help="sizes to use (default: full with CUDA, quick without)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the executed copies (default: rewrite in place)")
    p.add_argument("--timeout", type=_positive_int, default=1800,
                   help="seconds one cell may run (default 1800)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=_cmd_run_notebooks)


def _cmd_run_notebooks(args) -> int:
    from .runner import NotebookRunError, course_notebooks, run_notebooks

    paths = args.notebooks or course_notebooks()
    missing = [str(p) for p in paths if not Path(p).is_file()]
    if missing:
        print(f"error: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        written = run_notebooks(paths, profile=args.profile, out=args.out, timeout=args.timeout,
                                progress=not args.no_progress)
    except NotebookRunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


# --- readme ------------------------------------------------------------------------------------

def _add_readme(sub) -> None:
    p = sub.add_parser("readme", help="rebuild the README's results section from the notebooks",
                       description="Rebuild README.md's results section from the tables the "
                                   "committed notebooks published in their latest run.")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if the section is out of date")
    p.add_argument("--readme", type=Path, default=None, help="README to update (default: the repo's)")
    p.set_defaults(func=_cmd_readme)


def _cmd_readme(args) -> int:
    from .report import results_section, update_readme
    from .runner import NOTEBOOK_DIR, course_notebooks

    readme = args.readme or NOTEBOOK_DIR.parent / "README.md"
    notebooks = course_notebooks()
    if args.check:
        current = readme.read_text()
        if results_section(notebooks) not in current:
            print(f"{readme}: results section is out of date; run `python -m amp_lessons readme`",
                  file=sys.stderr)
            return 1
        print(f"{readme}: results section is current")
        return 0
    try:
        changed = update_readme(readme, notebooks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{readme}: {'updated' if changed else 'already current'}")
    return 0


# --- entry point ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``python -m amp_lessons`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="python -m amp_lessons",
                                     description="Companion tools of the amp-lessons course.")
    parser.add_argument("--version", action="version", version=f"amp-lessons {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


# One ``_add_<command>(subparsers)`` function per subcommand, defined above in its own section.
_COMMANDS = [_add_run_notebooks, _add_readme]


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)
