"""Starting N processes, one per device, joined in a process group: the launcher under
``amp_lessons.measure.distributed`` (which re-exports everything public here).

``launch(fn, world_size)`` spawns the processes with ``torch.multiprocessing`` (so it works from a
notebook), joins them with NCCL (one GPU each) or gloo (CPU processes) and returns rank 0's result;
the checks before it refuse a world size or backend this machine cannot run, naming the allowed
range; ``check_same_settings`` compares settings across ranks.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from amp_lessons.validate import check_choice, check_int
from amp_lessons.env import apply_simulation

BACKENDS = ("nccl", "gloo")
WORLD_SIZES = (1, 2, 4, 8)


# --- checks -------------------------------------------------------------------------------------

def cpu_count() -> int:
    """CPU cores this process may use (its affinity on Linux), at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_backend() -> str:
    """``"nccl"`` where CUDA GPUs and NCCL are present, else ``"gloo"`` (CPU processes)."""
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_slots(backend: str) -> int:
    """How many processes ``backend`` can run here: one per GPU (nccl), one per CPU core (gloo)."""
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return cpu_count()


def check_backend(backend: Optional[str] = None) -> str:
    """Resolve ``backend`` (``None``: the default here); ``ValueError`` where it cannot run."""
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this PyTorch build")
    if backend is None:
        return default_backend()
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs and this machine has none; "
                             "use backend='gloo' (CPU processes)")
        if not dist.is_nccl_available():
            raise ValueError("backend 'nccl' is not built into this PyTorch; use 'gloo'")
    elif not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not built into this PyTorch")
    return backend


def check_world_size(world_size: int, backend: str) -> None:
    """``ValueError`` when ``world_size`` asks for more processes than ``backend`` has devices."""
    check_int("world_size", world_size, 1)
    slots = device_slots(backend)
    if world_size > slots:
        what = "CUDA devices" if backend == "nccl" else "CPU cores"
        raise ValueError(f"world_size={world_size} is more processes than this machine has "
                         f"{what} ({slots}); allowed: 1..{slots} with backend {backend!r}")


def available_world_sizes(backend: Optional[str] = None,
                          candidates: Sequence[int] = WORLD_SIZES) -> List[int]:
    """The ``candidates`` this machine can run with ``backend`` (e.g. ``[1]`` on one GPU)."""
    backend = check_backend(backend)
    slots = device_slots(backend)
    return [n for n in candidates if n <= slots]


def describe_world(backend: Optional[str] = None,
                   candidates: Sequence[int] = WORLD_SIZES) -> str:
    """One paragraph: the devices ``backend`` uses here, which world sizes run, which do not."""
    backend = check_backend(backend)
    slots = device_slots(backend)
    run = [n for n in candidates if n <= slots]
    skipped = [n for n in candidates if n > slots]
    if backend == "nccl":
        names = sorted({torch.cuda.get_device_name(i) for i in range(slots)})
        where = f"NCCL, one process per GPU: {slots} x {', '.join(names)}"
        why = f"needs that many GPUs; this machine has {slots}"
    else:
        where = f"gloo, CPU processes: {slots} CPU cores"
        why = f"needs that many CPU cores; this machine has {slots}"
    text = (f"backend  : {where}\nrun here : world sizes {', '.join(map(str, run)) or 'none'}"
            f" (of {', '.join(map(str, candidates))})")
    if skipped:
        text += f"\nnot run  : world sizes {', '.join(map(str, skipped))} ({why})"
    return text


# --- launching ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankContext:
    """What a process of a launch knows about itself: its rank, the world and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def device_type(self) -> str:
        """``"cuda"`` (nccl) or ``"cpu"`` (gloo): the ``device_type`` of ``torch.autocast``."""
        return self.device.type


def free_port() -> int:
    """A TCP port that is free on this machine now (for the rendezvous of a new launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world_size: int, local_rank: int, backend: str, init_method: str,
               timeout_s: float) -> RankContext:
    """Join this process to the default process group (``init_method``: ``tcp://`` or
    ``env://``): NCCL with its own GPU ``local_rank``, or gloo with a fair share of the CPU
    threads. Used by ``launch`` and by the torchrun entry point."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        apply_simulation(device)  # AMP_LESSONS_SIMULATE caps each rank's allocator too
    else:
        device = torch.device("cpu")
        # Processes share the cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, cpu_count() // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=_dt.timedelta(seconds=timeout_s))
    return RankContext(rank, world_size, local_rank, backend, device)


def barrier(ctx: RankContext, group=None) -> None:
    """``dist.barrier`` over ``group``, naming this rank's GPU under NCCL (no device guessing)."""
    if ctx.backend == "nccl":
        dist.barrier(group, device_ids=[ctx.device.index])
    else:
        dist.barrier(group)


# Set for the spawned processes only: torch's C++ warnings (c10 logging) would otherwise go
# straight to stderr from every rank; Python warnings are collected and returned (run_plan).
_CHILD_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "NCCL_NVLS_ENABLE": "0"}


@contextmanager
def _child_environment():
    """Variables the spawned processes inherit (those the user set already are kept)."""
    added = {k: v for k, v in _CHILD_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _spawn_entry(index: int, fn: Callable, world_size: int, backend: str, port: int,
                 args: tuple, outdir: str, timeout_s: float) -> None:
    """What each spawned process runs: join the group, call ``fn``, hand rank 0's result back."""
    try:
        ctx = init_rank(index, world_size, index, backend, f"tcp://127.0.0.1:{port}", timeout_s)
        result = fn(ctx, *args)
        if index == 0:
            torch.save(result, Path(outdir) / "result.pt")
        barrier(ctx)  # no rank leaves (closing its connections) before every rank is done
    except Exception as exc:
        (Path(outdir) / f"error-{index}.json").write_text(json.dumps(
            {"rank": index, "type": type(exc).__name__, "message": str(exc),
             "traceback": traceback.format_exc(), "time": time.time()}))
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    leave_now()  # every rank is past the barrier and rank 0's result is on disk


def _check_importable(fn: Callable) -> None:
    target = getattr(fn, "func", fn)  # functools.partial
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not callable(fn) or module in (None, "__main__") or "<" in qualname:
        raise ValueError("fn must be a function defined at the top level of an importable module "
                         "(a spawned process imports it by name; a function typed into a notebook "
                         f"or a lambda cannot be); got {fn!r}")


def _worker_error(outdir: Path, exc: BaseException) -> Exception:
    # The first error is the cause; the others are usually peers losing their connection to it.
    errors = sorted((json.loads(p.read_text()) for p in outdir.glob("error-*.json")),
                    key=lambda e: e["time"])
    if not errors:
        return RuntimeError(f"a process of the launch died without a Python error: {exc} (run "
                            "from a script, the launch must sit under `if __name__ == "
                            "'__main__':`; the process's own output says more)")
    for e in errors:  # a ValueError is a bad setting: raise it as one, without the traceback
        if e["type"] == "ValueError":
            return ValueError(e["message"])
    first = errors[0]
    return RuntimeError(f"rank {first['rank']} failed with {first['type']}: {first['message']}\n"
                        f"{first['traceback']}")


def _join_options(context) -> Dict[str, float]:
    """``grace_period=10`` where ``ProcessContext.join`` takes it (torch >= 2.5: the other ranks
    get 10 s after a failure before they are killed), else nothing (torch 2.4 stops them at
    once)."""
    import inspect
    return {"grace_period": 10.0} if "grace_period" in inspect.signature(
        context.join).parameters else {}


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Callable, world_size: int, args: tuple = (), backend: Optional[str] = None,
           timeout_s: float = 600.0) -> Any:
    """Run ``fn(ctx, *args)`` in ``world_size`` new processes and return rank 0's return value.

    Each process gets a ``RankContext`` and is already in the default process group (NCCL with
    one GPU per process, ``torch.cuda.set_device(rank)`` done; or gloo on the CPU). Rank 0's
    return value comes back through ``torch.save``/``torch.load(weights_only=True)``: plain data
    and tensors. A ``ValueError`` in any rank is raised here as a ``ValueError`` (bad settings);
    any other failure as a ``RuntimeError`` with the rank's traceback; a launch that runs past
    ``timeout_s`` seconds is stopped. The torchrun equivalent is ``main()`` (see the module doc).
    """
    import torch.multiprocessing as mp

    _check_importable(fn)
    backend = check_backend(backend)
    check_world_size(world_size, backend)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds; got {timeout_s!r}")
    with tempfile.TemporaryDirectory(prefix="amp-lessons-launch-") as tmp:
        outdir = Path(tmp)
        with _child_environment():
            context = mp.start_processes(
                _spawn_entry,
                args=(fn, world_size, backend, free_port(), tuple(args), tmp, timeout_s),
                nprocs=world_size, join=False, start_method="spawn")
        deadline, options = time.monotonic() + timeout_s, _join_options(context)
        try:
            while not context.join(timeout=1.0, **options):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the launch ran past timeout_s={timeout_s} s and was "
                                       "stopped")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _worker_error(outdir, exc) from None  # torch stopped the other ranks already
        except BaseException:  # timeout, or the notebook's kernel interrupted: stop every rank
            _stop(context.processes)
            raise
        finally:
            for path in context.error_files:  # torch's own traceback files, read above or unused
                if path and os.path.exists(path):
                    os.remove(path)
        result_file = outdir / "result.pt"
        return torch.load(result_file, weights_only=True) if result_file.exists() else None


# --- agreement between ranks --------------------------------------------------------------------

def check_same_settings(settings: Dict[str, Any], group=None) -> None:
    """All-gather ``settings`` from every rank of ``group`` and compare them with each other.

    Raises the same ``ValueError`` on every rank (so none is left waiting in a collective),
    naming each setting that differs and its value on each rank. Under torchrun each process
    parses its own flags and environment; a rank with other settings would train a different
    model, or hang the others at the first collective that no longer matches.
    """
    if not isinstance(settings, dict):
        raise ValueError(f"settings must be a dict; got {type(settings).__name__}")
    gathered: List[Optional[dict]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, settings, group=group)
    missing = object()
    diffs = []
    for key in sorted({k for g in gathered for k in g}, key=str):
        values = [g.get(key, missing) for g in gathered]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {r}: {'(missing)' if v is missing else repr(v)}"
                              for r, v in enumerate(values))
            diffs.append(f"{key} ({shown})")
    if diffs:
        raise ValueError("every rank must use the same settings; these differ: "
                         + "; ".join(diffs))


def leave_now() -> None:
    """Exit this rank at once, output flushed: every collective is done, and tearing the gloo
    groups down at interpreter exit sometimes aborts a process (SIGABRT, "terminate called
    without an active exception"), which would turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
