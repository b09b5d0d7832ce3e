"""Configurations: what one measured training step is (``BenchConfig``), the course's standard
measurement settings (``STANDARD``) and why a configuration cannot run on a device."""
from __future__ import annotations

from typing import Dict, Optional

import torch
from dataclasses import asdict, dataclass  # noqa: F401 (asdict used by runner via config)

from amp_lessons import models as _models
from amp_lessons.validate import check_bool, check_choice, check_int, check_real
from amp_lessons.env import device_capability
from amp_lessons.numerics.precision import PRECISIONS, native_bf16
from amp_lessons.tables import plural

MODELS = {
    "resnet50": _models.resnet50,
    "resnet18": _models.resnet18,
    "resnet50-selective": _models.optimized_resnet50,
    "resnet18-selective": _models.optimized_resnet18,
}
OPTIMIZERS = ("sgd", "adam", "adamw")
OPTIMIZER_IMPLS = ("default", "for-loop", "foreach", "fused")
#: how a row's label names each precision
PRECISION_NAMES = {"fp32": "fp32, TF32 off", "tf32": "fp32, TF32 on", "fp16": "fp16 + GradScaler",
                   "bf16": "bf16"}
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
LOOPS = ("hand", "trainer")


# --- the standard measurement settings ----------------------------------------------------------
# The settings every speed and memory measurement uses (lessons 04 and 05) unless the lesson is
# about the difference: NHWC, cuDNN autotuning on, SGD (momentum 0.9) with foreach kernels
# (PyTorch's GPU default, named so a CPU runs the same code), 5 warm-up steps, median of 15.
STANDARD = dict(channels_last=True, cudnn_benchmark=True, optimizer="sgd", impl="foreach",
                warmup=5, steps=15)


def standard_settings(quick: bool = False) -> Dict[str, object]:
    """``STANDARD`` as a new dict; ``quick=True`` (the CPU profile) keeps every setting but times
    1 warm-up step and 2 steps, enough to show the method and too few to decide anything."""
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be True or False; got {quick!r}")
    out = dict(STANDARD)
    if quick:
        out.update(warmup=1, steps=2)
    return out


def settings_caption(settings: Optional[Dict[str, object]] = None) -> str:
    """The settings in words, for the line above a table and a published table's title, e.g.
    "channels_last, cuDNN autotuning on, foreach SGD, median of 15 steps after 5 warm-up"."""
    s = dict(STANDARD if settings is None else settings)
    missing = [k for k in STANDARD if k not in s]
    if missing:
        raise ValueError(f"settings must hold {', '.join(STANDARD)}; missing {', '.join(missing)}")
    opt = {"sgd": "SGD (momentum 0.9)", "adam": "Adam", "adamw": "AdamW"}.get(s["optimizer"],
                                                                              s["optimizer"])
    impl = "" if s["impl"] == "default" else f"{s['impl']} "
    return (f"{'channels_last' if s['channels_last'] else 'NCHW'}, cuDNN autotuning "
            f"{'on' if s['cudnn_benchmark'] else 'off'}, {impl}{opt}, median of "
            f"{plural(s['steps'], 'timed step')} after {s['warmup']} warm-up")


# --- configurations -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """One training-step configuration to measure. ``label`` defaults to a description."""

    label: str = ""
    model: str = "resnet50"
    precision: str = "fp32"            # fp32 (TF32 off), tf32, fp16 (+ GradScaler), bf16
    channels_last: bool = False
    batch_size: int = 256
    image_size: int = 224
    num_classes: int = 1000
    optimizer: str = "sgd"
    impl: str = "default"              # for-loop, foreach or fused optimizer kernels
    lr: Optional[float] = None         # default 0.1 for SGD, 1e-3 for Adam(W)
    eps: float = 1e-8                  # Adam(W) only
    amsgrad: bool = False              # Adam(W) only
    compile: Optional[str] = None      # a torch.compile mode, or None for eager
    cuda_graph: bool = False           # capture the whole eager step in one CUDA graph
    checkpoint: Optional[str] = None   # None, "block" or "stage" (activation checkpointing)
    loop: str = "hand"                 # "hand": hand-written loop; "trainer": Trainer.train_step
    cudnn_benchmark: bool = True       # let cuDNN pick the fastest convolution algorithms
    trainer_tracking: bool = True      # loop="trainer" only: record grad norm and peak memory

    def __post_init__(self):
        for name, choices in (("model", tuple(MODELS)), ("precision", PRECISIONS),
                              ("optimizer", OPTIMIZERS), ("impl", OPTIMIZER_IMPLS),
                              ("compile", COMPILE_MODES), ("loop", LOOPS),
                              ("checkpoint", _models.CHECKPOINT_MODES)):
            check_choice(name, getattr(self, name), choices)
        if not isinstance(self.label, str):
            raise ValueError(f"label must be a string; got {self.label!r}")
        fixed = {"batch_size": check_int("batch_size", self.batch_size, 1),
                 "image_size": check_int("image_size", self.image_size, 8),
                 "num_classes": check_int("num_classes", self.num_classes, 2)}
        for name in ("channels_last", "amsgrad", "cuda_graph", "cudnn_benchmark",
                     "trainer_tracking"):
            fixed[name] = check_bool(name, getattr(self, name))
        if self.lr is not None:
            fixed["lr"] = check_real("lr", self.lr, 0.0, low_open=True)
        fixed["eps"] = check_real("eps", self.eps, 0.0, 1.0, low_open=True, high_open=True)
        for name, value in fixed.items():  # NumPy scalars kept as plain Python values
            object.__setattr__(self, name, value)
        if not self.trainer_tracking and self.loop != "trainer":
            raise ValueError("trainer_tracking=False turns off the trainer's grad-norm and "
                             "memory tracking: it needs loop='trainer'; got loop="
                             f"{self.loop!r}")
        if not self.label:
            object.__setattr__(self, "label", self.describe())

    def describe(self) -> str:
        """A readable name, e.g. "fp16 + GradScaler, channels_last, compile, fused SGD"."""
        parts = [PRECISION_NAMES[self.precision]]
        if self.model.endswith("-selective"):
            parts.append("layer3/4+fc in fp32")
        if self.channels_last:
            parts.append("channels_last")
        if self.checkpoint:
            parts.append(f"checkpoint per {self.checkpoint}")
        if self.compile:
            parts.append("compile" if self.compile == "default" else f"compile {self.compile}")
        if self.cuda_graph:
            parts.append("CUDA graph")
        opt = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}[self.optimizer]
        if self.impl != "default":
            opt = f"{self.impl} {opt}"
        if self.optimizer != "sgd" and self.eps != 1e-8:
            opt += f" eps={self.eps:g}"
        if self.amsgrad:
            opt += " amsgrad"
        if self.impl != "default" or self.optimizer != "sgd":
            parts.append(opt)
        if self.loop == "trainer":
            parts.append("Trainer" if self.trainer_tracking else
                         "Trainer (track_grad_norm=False, track_memory=False)")
        return ", ".join(parts)



def skip_reason(config: BenchConfig, device) -> Optional[str]:
    """Why ``config`` cannot run on ``device`` (a sentence), or None when it can."""
    device = torch.device(device)
    if config.precision in ("bf16", "tf32") and device.type == "cuda" and not native_bf16(device):
        major, minor = device_capability(device)
        return (f"{config.precision} needs compute capability 8.0+ (native bf16, TF32 tensor "
                f"cores); this GPU is sm_{major}{minor}")
    if config.compile and device.type != "cuda":
        return "torch.compile is measured on a GPU only (compiling a ResNet takes minutes on a CPU)"
    if config.cuda_graph:
        if device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if config.compile:
            return "a manual CUDA graph wraps the eager step; use compile='reduce-overhead' instead"
        if config.loop == "trainer":
            return "the trainer's step is not captured in a CUDA graph"
        if config.precision == "fp16" and config.impl != "fused":
            return "GradScaler waits for the host in step() unless the optimizer is fused"
    if config.impl == "fused" and device.type not in ("cuda", "cpu"):
        return f"fused optimizers do not run on {device.type}"
    if config.checkpoint == "sac":
        return _models.selective_checkpointing_problem()
    return None

