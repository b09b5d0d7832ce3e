"""Precisions, defined once: names, autocast contexts, TF32 switches, and what a device supports.

``fp32`` (TF32 off), ``tf32`` (TF32 matmuls and cuDNN convolutions on CUDA), ``fp16`` (autocast +
GradScaler; ``amp`` is an alias) and ``bf16`` (autocast, no scaler). Every module that needs one of
these (trainer, measure, distributed, the lessons) imports it from here.
"""
from __future__ import annotations

import contextlib
import warnings
from functools import lru_cache
from typing import Any, Optional, Tuple, Union

import torch

from .env import default_device, device_capability, simulated_card

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
PRECISION_ALIASES = {"amp": "fp16"}
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

Device = Union[str, int, torch.device, None]


def as_device(device: Device = None) -> torch.device:
    """``None`` -> ``env.default_device()`` (the current GPU, else the CPU); an int -> that CUDA
    device; a string or ``torch.device`` as given. The one meaning of ``device=None`` everywhere."""
    if device is None:
        return default_device()
    if isinstance(device, bool):
        raise ValueError(f"device must be a torch.device, a device string or a CUDA index; got {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device, a device string or a CUDA index; "
                         f"got {device!r}") from exc


def normalize_precision(precision: str) -> str:
    """``"AMP"`` -> ``"fp16"``, ``" bf16 "`` -> ``"bf16"``; ValueError for anything not in PRECISIONS."""
    if not isinstance(precision, str):
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (or 'amp' for fp16); "
                         f"got {precision!r}")
    name = precision.strip().lower()
    name = PRECISION_ALIASES.get(name, name)
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (or 'amp' for fp16); "
                         f"got {precision!r}")
    return name


@lru_cache(maxsize=None)
def _fp16_problem(device_type: str) -> Optional[str]:
    """Why fp16 autocast + GradScaler cannot run on this device type, or None when it can."""
    if not hasattr(torch.amp, "GradScaler"):
        return "this torch has no torch.amp.GradScaler (needs torch >= 2.3)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unsupported dtype only warns and disables autocast
            a = torch.ones(2, 2, device=device_type)
            with torch.autocast(device_type=device_type, dtype=torch.float16):
                out = a @ a
            if out.dtype != torch.float16:
                return f"torch {torch.__version__} has no float16 autocast on {device_type}"
            grads = [torch.ones(2, device=device_type)]
            found = torch.zeros((), device=device_type)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, torch.ones((), device=device_type))
            torch.amp.GradScaler(device_type)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot run here"
        return f"torch {torch.__version__} cannot run fp16 AMP on {device_type}: {exc}"
    return None


def native_bf16(device: Device = None) -> bool:
    """True where bf16 runs natively: any CPU, or a GPU of compute capability 8.0 or newer
    (a T4, 7.5, would only emulate it). Under ``AMP_LESSONS_SIMULATE=t4`` every GPU answers False."""
    dev = as_device(device)
    if dev.type != "cuda":
        return True
    return (device_capability(dev) or (0, 0)) >= (8, 0)


def native_tf32(device: Device = None) -> bool:
    """True where the ``tf32`` precision really uses TF32 tensor cores: a GPU of compute capability
    8.0 or newer (not a simulated T4). Elsewhere ``tf32`` runs as plain fp32."""
    dev = as_device(device)
    return dev.type == "cuda" and (device_capability(dev) or (0, 0)) >= (8, 0)


def check_precision(precision: str, device: Device = None) -> str:
    """Normalise ``precision`` (``"amp"`` -> ``"fp16"``) and make sure it can run on ``device``.

    Raises ValueError naming the setting and why: an unknown name, a CUDA device without CUDA,
    fp16 where this torch cannot autocast/scale fp16, bf16 on a GPU without native bf16 (a T4:
    torch would emulate it, slowly). ``tf32`` runs everywhere; off CUDA it is plain fp32.
    """
    name = normalize_precision(precision)
    dev = as_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device must be an available device; got {dev} but CUDA is not available")
    if name == "fp16":
        problem = _fp16_problem(dev.type)
        if problem:
            raise ValueError(f"precision 'fp16' cannot run on {dev.type}: {problem}; "
                             f"use fp32 or bf16")
    if name == "bf16" and dev.type == "cuda" and not native_bf16(dev):
        gpu = torch.cuda.get_device_name(dev) + (" (as a simulated T4)" if simulated_card() else "")
        major, minor = device_capability(dev)
        raise ValueError(f"precision 'bf16' needs a GPU with native bfloat16 (compute capability "
                         f">= 8.0); {gpu} has {major}.{minor}, where torch would only emulate it. "
                         f"Use fp16 (autocast + GradScaler) instead")
    return name


def autocast_for(precision: str, device_type: str, cache_enabled: bool = True):
    """The autocast context of a precision: ``torch.autocast`` for fp16/bf16, a no-op otherwise.

    ``cache_enabled=False`` is what CUDA graph capture needs (the cast-weight cache would hold
    tensors from outside the graph's pool)."""
    name = normalize_precision(precision)
    if name not in HALF_DTYPES:
        return contextlib.nullcontext()
    if cache_enabled:
        return torch.autocast(device_type=device_type, dtype=HALF_DTYPES[name])
    return torch.autocast(device_type=device_type, dtype=HALF_DTYPES[name], cache_enabled=False)


def _tf32_api() -> str:
    """``"new"`` where torch has the fp32_precision switches (torch >= 2.9), else ``"legacy"``."""
    try:
        torch.backends.cuda.matmul.fp32_precision  # noqa: B018 - probing
        torch.backends.cudnn.conv.fp32_precision  # noqa: B018
        return "new"
    except (AttributeError, RuntimeError):
        return "legacy"


def _get_tf32() -> Tuple[str, Any, Any]:
    if _tf32_api() == "new":
        return ("new", torch.backends.cuda.matmul.fp32_precision,
                torch.backends.cudnn.conv.fp32_precision)
    return ("legacy", torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _set_tf32(state: Tuple[str, Any, Any]) -> None:
    api, matmul, conv = state
    if api == "new":
        torch.backends.cuda.matmul.fp32_precision = matmul
        torch.backends.cudnn.conv.fp32_precision = conv
    else:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = conv


def _tf32_target(on: bool) -> Tuple[str, Any, Any]:
    if _tf32_api() == "new":
        value = "tf32" if on else "ieee"
        return ("new", value, value)
    return ("legacy", on, on)


@contextlib.contextmanager
def precision_settings(precision: str, device: Device = None):
    """Within the block, TF32 is off for ``fp32`` and on for ``tf32`` (matmuls and cuDNN
    convolutions); fp16/bf16 leave the switches as they are. The previous settings come back on
    exit. Uses ``fp32_precision`` where torch has it (>= 2.9), else the ``allow_tf32`` flags, so no
    deprecation warning is triggered.
    """
    name = normalize_precision(precision)
    if name not in ("fp32", "tf32"):
        yield
        return
    before = _get_tf32()
    target = _tf32_target(name == "tf32")
    if before == target:
        yield
        return
    _set_tf32(target)
    try:
        yield
    finally:
        _set_tf32(before)
