"""Execute the course notebooks headless, in order, and record which run produced their outputs.

This is how notebooks are run on a GPU before they are committed
(``python -m amp_lessons run-notebooks --profile full``): every notebook in the repository carries
the outputs of its latest full run and, in its metadata under ``amp_lessons.run``, the device name,
torch version, profile and date of that run, and the code version (git commit, clean tree or not).
"""
from __future__ import annotations

import datetime as _dt
import os
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional, Sequence


from amp_lessons.validate import is_int
from amp_lessons.env import PROFILE_VARIABLE, get_profile, probe
from amp_lessons.files import NotANotebookError, check_folder_writable, check_writable, read_notebook  # noqa: F401 - re-exported
from amp_lessons.files import write_notebook

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
GPU_TAG = "requires-gpu"


class NotebookRunError(RuntimeError):
    """A cell failed, timed out or killed its kernel: the message names the notebook, the cell
    and the error; ``summary`` says it in one line (what the CLI prints)."""

    def __init__(self, notebook: Path, cell_index: int, cell_source: str, error: str):
        first = next((line for line in cell_source.splitlines() if line.strip()), "")
        self.notebook, self.cell_index, self.error = notebook, cell_index, error
        lines = [line.strip() for line in _ANSI.sub("", error).splitlines() if line.strip()]
        self.summary = (f"{notebook.name}: cell {cell_index} ({first[:70]!r}) failed: "
                        f"{lines[-1] if lines else 'no message'}")
        super().__init__(f"{notebook.name}: cell {cell_index} ({first[:70]!r}) failed:\n{error}")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def course_notebooks(directory: Path = NOTEBOOK_DIR) -> List[Path]:
    """The lesson notebooks (``NN_name.ipynb``) in course order."""
    return sorted(p for p in Path(directory).glob("[0-9][0-9]_*.ipynb"))


def code_version(folder: Path = NOTEBOOK_DIR) -> dict:
    """The code a run used: ``{"commit", "clean"}`` of the git checkout holding ``folder``
    (``clean``: no file differs from the commit and no untracked file outside .gitignore, the
    notebooks' own ``.ipynb`` files aside: running them rewrites them; otherwise ``changed``
    names up to 5 of the files that differ), or ``{"commit": None, "clean": None, "reason"}``
    where it cannot be told (no git, not a checkout). ``run_notebook`` records it before the
    first cell runs; ``explain`` prints it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True,
                              timeout=30, check=True).stdout.rstrip("\n")

    expected = os.environ.get(EXPECT_COMMIT_VARIABLE, "")
    if expected:  # a copy whose .git is not its source's: trust the source's record if the files match
        return _against_expected(folder, expected)
    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=normal", "--", ":/",
                      ":(top,exclude,glob)**/*.ipynb").splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        why = getattr(exc, "stderr", None) or str(exc)
        return {"commit": None, "clean": None,
                "reason": f"no git commit to name ({' '.join(str(why).split())[:160]})"}
    out = {"commit": commit, "clean": not changed}
    if changed:
        out["changed"] = [line[3:] for line in changed[:5]]
    return out


EXPECT_COMMIT_VARIABLE = "AMP_LESSONS_EXPECT_COMMIT"
_NOT_CODE = (":(exclude,glob)**/*.ipynb",)
_NOT_CODE_FOLDERS = "/.whl/"  # wheels carried to a GPU host, ignored there as here


def files_hash(folder: Path = NOTEBOOK_DIR) -> str:
    """The git tree hash of the files of the checkout holding ``folder`` as they are now
    (tracked and untracked, ignored files, ``.whl`` and the notebooks aside), from a scratch
    index: the same files give the same hash on any machine, whatever its ``.git`` holds."""
    import subprocess
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=folder, text=True,
                             capture_output=True, check=True, timeout=30).stdout.strip()
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard", f"--exclude={_NOT_CODE_FOLDERS}", "--",
                                 ".", *_NOT_CODE], cwd=top, capture_output=True, check=True,
                                timeout=120).stdout
        subprocess.run(["git", "update-index", "--add", "--remove", "-z", "--stdin"], cwd=top,
                       env=env, input=listed, capture_output=True, check=True, timeout=300)
        return subprocess.run(["git", "write-tree"], cwd=top, env=env, capture_output=True,
                              text=True, check=True, timeout=60).stdout.strip()


def copy_code_version(folder: Path = NOTEBOOK_DIR) -> str:
    """What to put in ``AMP_LESSONS_EXPECT_COMMIT`` when the checkout is copied to another
    machine without its history (a GPU host): this checkout's ``code_version`` plus the hash of
    its files, as JSON. There, ``code_version`` records it only if the files hash the same."""
    import json
    return json.dumps(dict(code_version(folder), files=files_hash(folder)))


def _against_expected(folder: Path, expected: str) -> dict:
    import json
    import subprocess
    try:
        claimed = json.loads(expected)
        want = claimed.pop("files")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{EXPECT_COMMIT_VARIABLE} must be the JSON copy_code_version() "
                         f"writes, got {expected[:80]!r}") from None
    try:
        here = files_hash(folder)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"commit": claimed.get("commit"), "clean": None,
                "reason": f"could not hash the files here ({' '.join(str(exc).split())[:160]})"}
    if here == want:
        return claimed
    return {"commit": claimed.get("commit"), "clean": False,
            "reason": f"the files here (tree {here[:12]}) are not those of the copy's source "
                      f"(tree {want[:12]})"}


def run_record(profile: str, code: Optional[dict] = None) -> dict:
    """What to store in a notebook's metadata about the run that produced its outputs: device,
    torch, Python, profile, date and the code version (``code``: ``code_version()`` taken when
    the run started; now, when not given)."""
    env = probe(profile)
    return {
        "device": str(env.device),
        "device_name": env.device_name,
        "device_count": _device_count(),
        "capability": list(env.capability) if env.capability else None,
        "torch": env.torch_version,
        "python": env.python_version,
        "profile": profile,
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "code": code if code is not None else code_version(),
    }


def _device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` inside the block (kernels started there
    inherit it) and restore its previous value, or its absence, afterwards."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def run_notebook(path: Path, profile: Optional[str] = None, out: Optional[Path] = None,
                 timeout: int = 1800, progress: bool = True,
                 kernel_name: str = "python3") -> Path:
    """Execute one notebook top to bottom and write the executed copy.

    ``out`` is a folder for the copy; by default the notebook is rewritten in place, and only
    after every cell succeeded. Cells tagged ``requires-gpu`` are left unexecuted without CUDA.
    Raises ``NotebookRunError`` naming the cell that failed, timed out (``timeout`` seconds) or
    killed the kernel (a partial copy is still written to ``out`` when one was given and it is
    not the notebook itself, so the failure can be read), ``NotANotebookError`` for a file that
    is not a notebook, ValueError for an output path that cannot be written (before any cell
    runs). The original notebook is never left half-written (``files.write_atomic``).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from tqdm.auto import tqdm

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no notebook at {path}")
    if not is_int(timeout) or timeout <= 0:  # None, "10" and nan reached nbclient's traits
        raise ValueError(f"timeout must be a whole number of seconds >= 1; got {timeout!r}")
    profile = get_profile(profile)
    has_gpu = _device_count() > 0
    nb = read_notebook(path)
    target = output_path(path, out)
    keep_partial = out is not None and target.resolve() != path.resolve()
    # Widget state is not saved: anywidget-based FigureWidgets would embed plotly.js (5 MB) each.
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                            store_widget_state=False,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    code = code_version(path.resolve().parent)  # the code as the run starts
    started = time.perf_counter()
    # the kernel's own stderr (its log, and the zmq traceback of a kernel stopped mid-cell after
    # a timeout) goes to a file, not the terminal: a failure is reported in one line below
    with tempfile.TemporaryFile() as kernel_log, \
            environment_variable(PROFILE_VARIABLE, profile), \
            client.setup_kernel(stderr=kernel_log):
        cells = tqdm(list(enumerate(nb.cells)), desc=path.stem, unit="cell", disable=not progress,
                     leave=True)
        for index, cell in cells:
            if cell.cell_type != "code":
                continue
            if GPU_TAG in cell.metadata.get("tags", []) and not has_gpu:
                cell.outputs, cell.execution_count = [], None
                continue
            try:
                client.execute_cell(cell, index)
            except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
                if isinstance(exc, CellTimeoutError):
                    error = f"timed out after {timeout} s (--timeout)"
                elif isinstance(exc, DeadKernelError):
                    error = f"the kernel died ({exc}){_last_words(kernel_log)}"
                else:
                    error = str(exc)
                if keep_partial:
                    _write(nb, target)
                raise NotebookRunError(path, index, cell.source, error) from None
    _tidy_widget_outputs(nb)
    record = run_record(profile, code)
    record["seconds"] = round(time.perf_counter() - started, 1)
    nb.metadata.setdefault("amp_lessons", {})["run"] = record
    _write(nb, target)
    return target


def _last_words(log) -> str:
    """The last line a dead kernel wrote to its stderr that is not the kernel app's own log
    (a C-level abort, a CUDA assert), as "; its last message: ..."; "" when there is none."""
    try:
        log.seek(0)
        lines = [line.strip() for line in log.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line and not line.startswith("[IPKernelApp]")]
    return f"; its last message: {lines[-1][:200]}" if lines else ""


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = "Interactive widget: run the notebook to use it."


def _tidy_widget_outputs(nb) -> None:
    """Give widget outputs a short plain-text stand-in for viewers that cannot run them.

    ipywidgets' own stand-in is the widget's repr, which for a plotly FigureWidget is the whole
    figure as text; static viewers (GitHub, nbviewer) would print that instead of a chart.
    """
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_MIME in data:
                data["text/plain"] = WIDGET_NOTE


def _write(nb, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    write_notebook(nb, target)


def output_path(path: Path, out: Optional[Path] = None) -> Path:
    """Where ``run_notebook`` writes the executed copy of ``path``: ``out/<name>``, or ``path``
    itself. ValueError naming the path unless it can be written there (``out`` is a folder, or
    can be made as one, in a writable place; a notebook rewritten in place is in a writable
    folder): checked before the first cell runs."""
    path = Path(path)
    if out is None:
        check_writable(path, "notebook")
        return path
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out must be a folder; got the file '{out}'")
    target = out / path.name
    check_folder_writable(out, "out", f"'{target}'")
    if target.is_dir() or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"out: '{target}' exists and cannot be written")
    return target


def run_notebooks(paths: Optional[Sequence[Path]] = None, profile: Optional[str] = None,
                  out: Optional[Path] = None, timeout: int = 1800,
                  progress: bool = True) -> List[Path]:
    """Execute notebooks in order (all lessons when ``paths`` is empty); stop at the first failure.
    Every notebook is read and its output path checked before the first one runs."""
    chosen: List[Path] = [Path(p) for p in (paths or course_notebooks())]
    for p in chosen:
        read_notebook(p)
        output_path(p, out)
    return [run_notebook(p, profile=profile, out=out, timeout=timeout, progress=progress)
            for p in chosen]
