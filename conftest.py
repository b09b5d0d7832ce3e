"""Repository-wide pytest hooks: nbval's kernel start is retried, cells tagged ``requires-gpu``
are skipped without CUDA, and each notebook's time under nbval is recorded."""
import pytest

GPU_TAG = "requires-gpu"


def pytest_configure(config):
    """nbval's kernels start again when a start fails (up to three tries).

    Several xdist workers start kernels at once, each kernel choosing free TCP ports by binding
    and releasing them: two can pick the same port, and the loser never answers (CI saw a whole
    notebook error with "Kernel didn't respond in 60 seconds" while the machine ran three test
    sessions side by side). A failed start is shut down and a fresh kernel started on new ports.
    """
    try:
        import nbval.plugin as plugin
    except ImportError:
        return
    if getattr(plugin.RunningKernel, "_amp_lessons_retries", False):
        return
    plugin.RunningKernel = _retrying_kernel(plugin.RunningKernel)


def _retrying_kernel(base, attempts=3):
    import sys

    class RetryingKernel(base):
        _amp_lessons_retries = True

        def __init__(self, *args, **kwargs):
            for attempt in range(1, attempts + 1):
                try:
                    super().__init__(*args, **kwargs)
                    return
                except RuntimeError as error:  # start_new_kernel shut its own kernel down
                    km = getattr(self, "km", None)
                    if km is not None:  # started, but IOPub never came up: end it
                        try:
                            self.kc.stop_channels()
                            km.shutdown_kernel(now=True)
                        except Exception:
                            pass
                        self.km = None
                    if attempt == attempts:
                        raise RuntimeError(f"the notebook's kernel did not start in {attempts} "
                                           f"tries; the last: {error}") from error
                    print(f"\nnbval: kernel start {attempt} of {attempts} failed ({error}); "
                          f"starting a fresh kernel", file=sys.stderr)

    return RetryingKernel


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="cell is tagged requires-gpu and no CUDA device is present")
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's IPyNbCell
        if cell is not None and GPU_TAG in cell.get("metadata", {}).get("tags", []):
            item.add_marker(skip)


# --- how long each notebook takes under nbval -------------------------------------------------
# Every nbval run records, per notebook, the seconds its cells took (setup + call + teardown) in
# build/notebook-times/<notebook>.json (an ignored path): tests/test_notebook_times.py holds the
# times the notebooks and the README state against these records.
_NOTEBOOK_TIMES = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    if not path.endswith(".ipynb"):
        return
    entry = _NOTEBOOK_TIMES.setdefault(path, {"seconds": 0.0, "cells": set(), "failed": False})
    entry["seconds"] += report.duration
    entry["cells"].add(report.nodeid)
    entry["failed"] = entry["failed"] or report.failed


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or not _NOTEBOOK_TIMES:
        return  # an xdist worker: the controller receives the same reports and writes them
    import datetime, json, os
    from pathlib import Path
    out = Path(session.config.rootpath) / "build" / "notebook-times"
    out.mkdir(parents=True, exist_ok=True)
    for path, entry in _NOTEBOOK_TIMES.items():
        record = {"notebook": Path(path).name, "seconds": round(entry["seconds"], 1),
                  "cells": len(entry["cells"]), "failed": entry["failed"],
                  "profile": os.environ.get("AMP_LESSONS_PROFILE", ""),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
                  "cpu_count": os.cpu_count(),
                  # `make notebooks` runs alone; `make test` runs them beside two other test
                  # sessions (AMP_LESSONS_TIMED_ALONE=0), where they take two to three times longer
                  "alone": os.environ.get("AMP_LESSONS_TIMED_ALONE", "1") != "0",
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        (out / f"{Path(path).stem}.json").write_text(json.dumps(record, indent=1) + "\n")
