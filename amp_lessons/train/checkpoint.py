"""Training-checkpoint files, for ``Trainer.save_checkpoint``/``load_checkpoint``: written
atomically, every byte verified when read, random-generator states captured and restored.

A file is a normal ``torch.save`` archive followed by one trailer line,
``\n#amp-lessons sha256=<64 hex digits>\n``, the SHA-256 of every byte before it: ``torch.load``
ignores the trailer, and ``read_verified`` finds any byte changed since the save before anything is
unpickled. Saves go through the package's one atomic writer (``files.atomic_file``: a temporary
file next to the target, fsynced, renamed over it); temporary files of killed saves are removed
by the next save or load of that path.
"""
from __future__ import annotations

import copy
import hashlib
import os
import random
import re
import zipfile
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from amp_lessons.validate import is_real
from amp_lessons.numerics.precision import as_device
from amp_lessons.files import (DiskFullError, FileTooLargeError, host_tag,  # noqa: F401
                               atomic_file, remove_stale_temp_files, write_error)

TRAILER_PREFIX = b"\n#amp-lessons sha256="
TRAILER_SIZE = len(TRAILER_PREFIX) + 64 + 1
CHECKSUM_KEY = "checksum_trailer"  # a saved dict with this key set must come with its trailer
FORMAT_NAME = "amp-lessons-trainer"


class CheckpointError(ValueError):
    """A file that is not a complete, intact training checkpoint (the message names the file
    and what is wrong with it), or a checkpoint that does not fit the live trainer."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint file at the path (also a FileNotFoundError)."""


class CheckpointIsAFolderError(CheckpointError, IsADirectoryError):
    """The checkpoint path is a folder (also an IsADirectoryError)."""


class CheckpointFromNewerRelease(CheckpointError):
    """A checkpoint in a newer format than this release reads; the message names both."""


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


def atomic_save(obj: Any, path: Union[str, Path]) -> Path:
    """``torch.save(obj)`` plus its checksum trailer, written atomically over ``path``: a failure
    at any point (an exception, a full disk, ``kill -9``) leaves the previous file untouched. A
    full disk raises ``DiskFullError``, a file-size limit ``FileTooLargeError``, each naming the
    file. A dict saved with ``obj[CHECKSUM_KEY] = True`` is refused when its trailer is damaged.
    """
    path = checkpoint_path(path)
    if path.is_dir():
        raise CheckpointIsAFolderError(f"{path}: is a folder; a checkpoint path must name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"{path}: a part of its folder is a file; a checkpoint path must "
                              f"lie in a folder") from None
    with atomic_file(path, "checkpoint") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
            writer.write(TRAILER_PREFIX + writer.sha.hexdigest().encode() + b"\n")
        except Exception as exc:  # torch reports a failed write as "unexpected pos ..."
            better = write_error(exc, path, "checkpoint", writer)
            if better is not None:
                raise better from exc
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


def checkpoint_path(path) -> Path:
    """``path`` as a ``Path``; ValueError naming the setting for anything else (``None``, a
    number), where pathlib's TypeError named nothing."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (a str or a pathlib.Path); got {path!r}")
    return Path(path)


def read_verified(path: Union[str, Path], map_location="cpu") -> Any:
    """Load what ``atomic_save`` wrote, after checking every byte; ``weights_only=True``.

    Raises ``CheckpointError`` (a ValueError) naming ``path`` and what is wrong: missing, a
    folder, empty, not an archive, truncated, corrupted (checksum or CRC mismatch), or holding
    objects other than tensors and plain containers. Also removes stale temporary files of
    interrupted saves of ``path``.
    """
    path = checkpoint_path(path)
    if map_location is not None and not callable(map_location) and \
            not isinstance(map_location, dict):
        try:  # a bad one was blamed on the file ("cannot be read as a checkpoint")
            as_device(map_location)
        except ValueError:
            raise ValueError(f"map_location must be a device ('cpu', 'cuda:0', a torch.device "
                             f"or a CUDA index), a dict or a function; got {map_location!r}"
                             ) from None
    remove_stale_temp_files(path)
    if path.is_dir():
        raise CheckpointIsAFolderError(f"{path}: is a folder, not a checkpoint file")
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file")
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


def _shadow_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` that a ``load_state_dict`` may change without touching it: its
    own dicts and lists (settings, param groups, state, an optimizer's own records such as
    BF16AdamW's generators), the tensors shared (a load replaces them, never writes into them).
    ``copy.copy`` is not that: it shares the settings dict, to which torch's load adds keys."""
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, list)) else v
                            for k, v in optimizer.__dict__.items()})
    shadow.param_groups = [dict(g) for g in optimizer.param_groups]
    return shadow


# settings torch's Optimizer.load_state_dict adds itself (to the optimizer's defaults), which a
# saved group need not hold
_ADDED_BY_TORCH_LOAD = {"differentiable"}


def check_optimizer_state(saved, optimizer: torch.optim.Optimizer) -> None:
    """Load into a copy of ``optimizer`` with its own settings, groups and state
    (``_shadow_optimizer``: the live one is not touched), then compare the param groups'
    settings and the state shapes with the live ones: a state saved by another kind of
    optimizer (RMSprop's into Adam) loads without complaint in torch and fails at the first
    ``step()`` (``KeyError: 'betas'``); here it is refused, naming what is missing. An optimizer
    that checks its own state on load (``BF16AdamW``: rounding, moments, generators) refuses
    through that check."""
    shadow = _shadow_optimizer(optimizer)
    try:
        shadow.load_state_dict(saved)
    except Exception as exc:  # noqa: BLE001 - torch raises ValueError, KeyError, TypeError...
        raise CheckpointError(f"optimizer: does not fit this optimizer ({exc})") from None
    for i, loaded in enumerate(shadow.param_groups):
        # the constructor's settings (a scheduler's own keys, initial_lr, are not the
        # optimizer's); torch fills in settings newer than the file when it loads
        missing = sorted(set(optimizer.defaults) - set(loaded) - _ADDED_BY_TORCH_LOAD)
        if missing:
            raise CheckpointError(
                f"optimizer: param group {i} lacks {', '.join(map(repr, missing))}, which "
                f"{type(optimizer).__name__} needs: saved by another kind of optimizer?")
    for p, entry in shadow.state.items():
        for key in _PARAM_SHAPED_STATE:
            v = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(v, torch.Tensor) and v.shape != p.shape:
                raise CheckpointError(f"optimizer: {key} of shape {tuple(v.shape)} for a "
                                      f"parameter of shape {tuple(p.shape)}")


def _newer_format(found, formats) -> bool:
    """Whether ``found`` names a later version of the format family of ``formats``
    (``amp-lessons-trainer/<n>``) than any of them."""
    def version(name):
        match = re.fullmatch(rf"{re.escape(FORMAT_NAME)}/(\d+)", name) if isinstance(
            name, str) else None
        return int(match.group(1)) if match else None

    known = [v for v in map(version, formats) if v is not None]
    got = version(found)
    return got is not None and bool(known) and got > max(known)


def check_training_state(state, model, optimizer, scaler, scheduler, formats) -> None:
    """CheckpointError unless ``state`` (``Trainer.state_dict()``, one of ``formats``) can be
    loaded whole into these live objects (``scaler`` None: the scaler is not loaded). Nothing
    live is changed: the optimizer state is tried on a copy (``check_optimizer_state``)."""
    found = state.get("format") if isinstance(state, dict) else None
    newer = _newer_format(found, formats)
    if newer:
        from amp_lessons import __version__

        raise CheckpointFromNewerRelease(
            f"written by a newer release of amp-lessons (checkpoint format {found}); this "
            f"release ({__version__}) reads format{'s' if len(formats) > 1 else ''} "
            f"{', '.join(formats)}: upgrade amp-lessons to load it")
    if not isinstance(state, dict) or found not in formats:
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
    if scheduler is not None and state["scheduler"] is None and state.get("step"):
        raise CheckpointError(f"scheduler: this Trainer has a {type(scheduler).__name__} but the "
                              f"checkpoint (step {state['step']}) was saved without one: its "
                              f"schedule would start again at 0 while training resumes at step "
                              f"{state['step']}; pass scheduler=None to resume this checkpoint")
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
