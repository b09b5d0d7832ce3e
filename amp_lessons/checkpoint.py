"""Training-checkpoint files: written atomically, verified when read, RNG states captured and
restored. ``Trainer.save_checkpoint``/``load_checkpoint`` build on these (docs/reliability.md).

File layout: a normal ``torch.save`` archive followed by one trailer line,
``\\n#amp-lessons sha256=<64 hex digits>\\n``, the SHA-256 of every byte before it. ``torch.load``
and ``zipfile`` ignore the trailer, so a checkpoint is still a plain PyTorch file; ``read_verified``
recomputes the digest, so any byte changed since the save (a flipped bit, a truncated copy) is
found before anything is unpickled.

Temporary files of a save are named ``.<name>.tmp-<host>-<pid>-<random>`` next to the target. A
save killed with ``kill -9`` cannot remove its own, so every later save or load of that path
removes the ones left by processes of this host that no longer run (never one of a live process).
"""
from __future__ import annotations

import copy
import errno
import hashlib
import os
import random
import re
import secrets
import socket
import zipfile
from pathlib import Path
from typing import Any, List, Union

import numpy as np
import torch

from ._validate import is_real

TRAILER_PREFIX = b"\n#amp-lessons sha256="
TRAILER_SIZE = len(TRAILER_PREFIX) + 64 + 1
CHECKSUM_KEY = "checksum_trailer"  # a saved dict with this key set must come with its trailer
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(ValueError):
    """A file that is not a complete, intact training checkpoint (the message names the file
    and what is wrong with it), or a checkpoint that does not fit the live trainer."""


class DiskFullError(OSError):
    """A save ran out of disk space (ENOSPC/EDQUOT); the previous file at the path is intact."""


# --- temporary files -----------------------------------------------------------------------------

def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def temp_name(path: Union[str, Path]) -> Path:
    """A fresh temporary name next to ``path``: ``.<name>.tmp-<host>-<pid>-<random>``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temp_files(path: Union[str, Path]) -> List[Path]:
    """Remove the temporary files that interrupted saves of ``path`` left behind; return them.

    Only names of the form ``.<name>.tmp-<this host>-<pid>-<hex>`` whose process is gone are
    removed: a save in progress in another live process keeps its file (a reused pid errs on the
    side of keeping), and files of other hosts sharing the folder are left to those hosts.
    """
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.tmp-{re.escape(_host())}-(\d+)-[0-9a-f]+$")
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except FileNotFoundError:  # another process cleaned it first
            pass
    return removed


# --- writing -------------------------------------------------------------------------------------

class _HashingWriter:
    """A write-only file object that hashes what passes through and remembers an OSError (torch
    turns the writer's exceptions into a bare "unexpected pos" RuntimeError)."""

    def __init__(self, f):
        self.f, self.sha, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha.update(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _disk_full(exc: BaseException, writer: _HashingWriter) -> bool:
    for e in (writer.error, exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
    return False


def atomic_save(obj: Any, path: Union[str, Path]) -> Path:
    """``torch.save`` + checksum trailer to a temporary file next to ``path``, fsync, then rename
    over ``path``. A dict saved with ``obj[CHECKSUM_KEY] = True`` is refused by ``read_verified``
    when its trailer is damaged.

    A failure at any point (an exception, a full disk, ``kill -9``) leaves the previous file at
    ``path`` untouched. An exception removes the temporary file at once; a killed process cannot,
    so this and every later save or ``read_verified`` of ``path`` remove temporary files left by
    dead processes (``remove_stale_temp_files``). The file gets the mode ``torch.save`` would give
    it (0666 less the umask). A full disk raises ``DiskFullError`` saying so.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a folder; a checkpoint path must name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"{path}: a part of its folder is a file; a checkpoint path must "
                              f"lie in a folder") from None
    remove_stale_temp_files(path)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    writer = None
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            digest = writer.sha.hexdigest().encode()
            writer.write(TRAILER_PREFIX + digest + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, Exception) and writer is not None and _disk_full(exc, writer):
            raise DiskFullError(errno.ENOSPC, f"disk full: could not write checkpoint {path} "
                                f"(the previous file there, if any, is intact)") from exc
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            raise DiskFullError(errno.ENOSPC, f"disk full: could not write checkpoint {path} "
                                f"(the previous file there, if any, is intact)") from exc
        raise
    return path


# --- reading -------------------------------------------------------------------------------------

def _check_bytes(path: Path) -> bool:
    """Raise CheckpointError unless the file is an intact archive (trailer digest, or zip CRCs
    for files without a trailer); return whether a trailer was verified."""
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: the file is empty (an interrupted copy or save?); "
                              f"not a training checkpoint")
    with open(path, "rb") as f:
        head = f.read(4)
        if head != b"PK\x03\x04":
            raise CheckpointError(f"{path}: not a PyTorch archive (it does not start like one: "
                                  f"random bytes, or not a file written by torch.save)")
        trailer = b""
        if size > TRAILER_SIZE:
            f.seek(size - TRAILER_SIZE)
            trailer = f.read(TRAILER_SIZE)
        if trailer.startswith(TRAILER_PREFIX) and trailer.endswith(b"\n"):
            expected = trailer[len(TRAILER_PREFIX):-1].decode("ascii", "replace")
            sha, remaining = hashlib.sha256(), size - TRAILER_SIZE
            f.seek(0)
            while remaining:
                chunk = f.read(min(1 << 24, remaining))
                if not chunk:
                    break
                sha.update(chunk)
                remaining -= len(chunk)
            if sha.hexdigest() != expected:
                raise CheckpointError(f"{path}: corrupted: its SHA-256 checksum does not match "
                                      f"(bytes changed since it was saved)")
            return True
    try:  # no trailer: a truncated checkpoint, or an archive from plain torch.save
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CheckpointError(f"{path}: truncated or damaged archive ({exc})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupted: record {bad!r} fails its CRC check")
    return False


def read_verified(path: Union[str, Path], map_location="cpu") -> Any:
    """Load what ``atomic_save`` wrote, after checking every byte; ``weights_only=True``.

    Raises ``CheckpointError`` (a ValueError) naming ``path`` and what is wrong: missing, a
    folder, empty, not an archive, truncated, corrupted (checksum or CRC mismatch), or holding
    objects other than tensors and plain containers. Also removes stale temporary files of
    interrupted saves of ``path``.
    """
    path = Path(path)
    remove_stale_temp_files(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: is a folder, not a checkpoint file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    verified = _check_bytes(path)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a bad archive
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: cannot be read as a checkpoint ({first[:200]})") from None
    if not verified and isinstance(obj, dict) and obj.get(CHECKSUM_KEY):
        raise CheckpointError(f"{path}: corrupted: its checksum trailer is damaged or missing")
    return obj


# --- does a saved state fit the live objects? ------------------------------------------------

def check_model_state(saved, model: torch.nn.Module) -> None:
    """CheckpointError unless ``saved`` has exactly ``model``'s keys, shapes and dtypes."""
    live = model.state_dict()
    if not isinstance(saved, dict):
        raise CheckpointError("model: not a state dict")
    missing = [k for k in live if k not in saved]
    extra = [k for k in saved if k not in live]
    if missing or extra:
        raise CheckpointError(f"model: another model (missing keys: {missing[:4]}, unexpected "
                              f"keys: {extra[:4]})")
    for k, v in live.items():
        s = saved[k]
        if not isinstance(s, torch.Tensor) or s.shape != v.shape or s.dtype != v.dtype:
            got = (f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor)
                   else type(s).__name__)
            raise CheckpointError(f"model: {k} is {got} in the checkpoint but "
                                  f"{tuple(v.shape)} {v.dtype} in this model")


# state entries that have their parameter's shape, in torch's optimizers
_PARAM_SHAPED_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                       "square_avg", "grad_avg", "acc_delta", "sum", "ax", "prev", "mu_product")


def check_optimizer_state(saved, optimizer: torch.optim.Optimizer) -> None:
    """Load into a shallow copy of ``optimizer`` (the live one is not touched), then compare
    state shapes with the parameters."""
    shadow = copy.copy(optimizer)
    try:
        shadow.load_state_dict(saved)
    except Exception as exc:  # noqa: BLE001 - torch raises ValueError, KeyError, TypeError...
        raise CheckpointError(f"optimizer: does not fit this optimizer ({exc})") from None
    for p, entry in shadow.state.items():
        for key in _PARAM_SHAPED_STATE:
            v = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(v, torch.Tensor) and v.shape != p.shape:
                raise CheckpointError(f"optimizer: {key} of shape {tuple(v.shape)} for a "
                                      f"parameter of shape {tuple(p.shape)}")


def check_training_state(state, model, optimizer, scaler, scheduler, formats) -> None:
    """CheckpointError unless ``state`` (``Trainer.state_dict()``, one of ``formats``) can be
    loaded whole into these live objects (``scaler`` None: the scaler is not loaded). Nothing
    live is changed: the optimizer state is tried on a shallow copy."""
    if not isinstance(state, dict) or state.get("format") not in formats:
        if isinstance(state, dict) and state and all(
                isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError("holds a plain state dict (torch.save(model.state_dict())?), "
                                  "not a training checkpoint written by "
                                  "Trainer.save_checkpoint; load it with "
                                  "model.load_state_dict(torch.load(...))")
        raise CheckpointError(f"not a checkpoint written by Trainer.save_checkpoint "
                              f"({formats[-1]})")
    needed = ("model", "optimizer", "scaler", "scheduler", "step", "epoch", "batches_done",
              "history", "rng")
    missing = [k for k in needed if k not in state]
    if missing:
        raise CheckpointError(f"incomplete checkpoint: no {', '.join(missing)}")
    check_model_state(state["model"], model)
    kind = state.get("optimizer_class")
    if kind is not None and kind != type(optimizer).__name__:
        raise CheckpointError(f"optimizer: the checkpoint holds {kind} state but this "
                              f"Trainer's optimizer is {type(optimizer).__name__}")
    check_optimizer_state(state["optimizer"], optimizer)
    if scaler is not None and state["scaler"] and scaler.is_enabled():
        saved = state["scaler"]
        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval")
        if not isinstance(saved, dict) or not all(is_real(saved.get(k)) for k in keys):
            raise CheckpointError(f"scaler: not a GradScaler state (needs {', '.join(keys)})")
    if state["scheduler"] is not None and scheduler is None:
        raise CheckpointError("scheduler: the checkpoint holds a scheduler state but this "
                              "Trainer has no scheduler; pass the same kind of scheduler")
    if scheduler is not None and state["scheduler"] is not None:
        saved, live = state["scheduler"], scheduler.state_dict()
        if not isinstance(saved, dict) or set(saved) != set(live):
            raise CheckpointError(f"scheduler: the checkpoint holds another kind of scheduler "
                                  f"than this Trainer's {type(scheduler).__name__}")
    for key in ("step", "epoch", "batches_done"):
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{key}: must be a whole number >= 0; got {value!r}")
    try:
        history = state["history"]
        steps, epochs = history["steps"], history["epochs"]
        if not isinstance(steps, dict) or not all(isinstance(v, list) for v in steps.values()):
            raise ValueError("history steps must be a dict of lists (one per column)")
        if len({len(v) for v in steps.values()}) > 1:
            raise ValueError("columns of different lengths")
        if not isinstance(epochs, list) or not all(isinstance(e, dict) for e in epochs):
            raise ValueError("history epochs must be a list of per-epoch dicts")
        check_rng_state(state["rng"])
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise CheckpointError(f"history or rng: damaged ({exc})") from None


# --- random generators ---------------------------------------------------------------------------

def rng_state() -> dict:
    """Python's, NumPy's and torch's (CPU and initialised CUDA) generator states, as tensors and
    plain numbers only, so ``torch.load(weights_only=True)`` reads them."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng_state(state) -> None:
    """Raise ValueError unless ``state`` has the shape ``rng_state()`` returns and restores
    (tried, then this process's own state is put back: checking changes nothing)."""
    try:
        ok = (isinstance(state["torch"], torch.Tensor) and state["torch"].dtype == torch.uint8
              and len(state["python"]["state"]) == 625
              and len(state["numpy"]["keys"]) == 624)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError("rng: not the random-generator state rng_state() writes")
    saved = rng_state()  # the real test: restore it, then put this process's state back
    try:
        set_rng_state(state)
    except Exception as exc:  # noqa: BLE001 - any failure means the state cannot be restored
        raise ValueError(f"rng: the state cannot be restored ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        set_rng_state(saved)


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state()`` returned."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = [s.cpu() for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
