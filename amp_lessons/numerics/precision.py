"""Precisions, defined once: names, autocast contexts, TF32 switches, and what a device supports.

``fp32`` (TF32 off), ``tf32`` (TF32 matmuls and cuDNN convolutions on CUDA), ``fp16`` (autocast +
GradScaler; ``amp`` is an alias) and ``bf16`` (autocast, no scaler). Every module that needs one of
these (trainer, measure, distributed, the lessons) imports it from here.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from amp_lessons.validate import is_real
from amp_lessons.env import default_device, device_capability, simulated_card

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
        if device < 0:
            raise ValueError(f"device must be a CUDA index >= 0; got {device}")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device, a device string or a CUDA index; "
                         f"got {device!r}") from exc


def available_device(device: Device = None, name: str = "device",
                     given: str = "") -> torch.device:
    """``as_device(device)``, checked to exist on this machine: ValueError naming the setting
    (``name``; ``given``: how to quote the value, default its repr) for a CUDA device where CUDA
    is not available or past the last GPU (torch's own errors name the driver, not the setting)."""
    dev = as_device(device)
    if dev.type == "cuda":
        given = given or (repr(device) if isinstance(device, (str, int)) else repr(str(dev)))
        if not torch.cuda.is_available():
            raise ValueError(f"{name} must be an available device; got {given} but CUDA is not "
                             f"available (use 'cpu')")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise ValueError(f"{name} must be a CUDA device in [0, {count - 1}]; got {given}")
    return dev


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
    dev = available_device(device)
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


# --- autocast, op by op: the error of half-precision ops, what autocast lets a user change ------


def autocast_error_by_op(device=None, dtype="fp16",
                         logit_scales: Sequence[float] = (1.0, 8.0, 32.0),
                         seed: int = 0) -> List[Dict[str, object]]:
    """Relative error of ops under autocast against a float64 reference, on random inputs.

    A 3x3 convolution and a linear layer (the bulk of a ResNet) against scaled dot-product
    attention whose logits are made larger by ``logit_scale`` (sharper softmax, as trained
    attention gets): the error is ``||out - ref|| / ||ref||``, inf where the output overflows.
    ``dtype``: "fp16", "bf16" or the torch dtype. Each row names the ``device`` it ran on."""
    half = HALF_DTYPES.get(dtype) if isinstance(dtype, str) else dtype  # a list is no key
    if half not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be 'fp16', 'bf16', torch.float16 or torch.bfloat16; "
                         f"got {dtype!r}")
    dtype = half
    if isinstance(logit_scales, (str, bytes)) or not hasattr(logit_scales, "__iter__") or \
            not all(is_real(s) and s > 0 for s in logit_scales):
        raise ValueError(f"logit_scales must be finite numbers > 0; got {logit_scales!r}")
    device = as_device(device)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
        out = out.double().cpu()
        if not torch.isfinite(out).all():
            return float("inf")
        return float((out - ref).norm() / ref.norm())

    def row(op, scale, out, ref):
        return {"op": op, "logit_scale": scale, "out_dtype": str(out.dtype),
                "rel_error": rel(out, ref), "device": device.type}

    rows = []
    x, w = rand(8, 64, 32, 32), rand(64, 64, 3, 3, scale=(1 / 576) ** 0.5)
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = F.conv2d(x.float().to(device), w.float().to(device), padding=1)
    rows.append(row("conv2d 3x3, 64 channels", None, out, F.conv2d(x, w, padding=1)))
    a, b = rand(1024, 1024), rand(1024, 1024, scale=1 / 32)
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = F.linear(a.float().to(device), b.t().contiguous().float().to(device))
    rows.append(row("linear 1024x1024", None, out, a @ b))
    for scale in logit_scales:
        q, k, v = rand(4, 8, 256, 64) * scale, rand(4, 8, 256, 64), rand(4, 8, 256, 64)
        ref = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v
        with torch.autocast(device_type=device.type, dtype=dtype):
            out = F.scaled_dot_product_attention(q.float().to(device), k.float().to(device),
                                                 v.float().to(device))
        rows.append(row("attention (SDPA), 256 tokens", scale, out, ref))
    return rows


def autocast_op_list_api() -> Dict[str, object]:
    """What ``torch.autocast`` lets a user change, read from its signature on this torch: its
    parameters, and whether any of them is an op list (a "changed op list")."""
    params = [p for p in inspect.signature(torch.autocast.__init__).parameters if p != "self"]
    listy = [p for p in params if any(w in p.lower() for w in ("op", "list", "cast_policy"))]
    return {"parameters": params, "op_list_parameters": listy}

