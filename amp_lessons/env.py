"""Where the course is running: platform, device, what the device supports, and the profile.

Introduced in every notebook's setup cell (``env = al.setup()``). The profile decides the sizes a
lesson uses: ``quick`` (tiny models, few steps, seconds on a CPU, what CI runs) or ``full`` (real
sizes on a GPU). It comes from ``AMP_LESSONS_PROFILE`` and defaults to ``full`` when CUDA is present.
"""
from __future__ import annotations

import os
import platform as _platform
import random
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from amp_lessons.validate import check_seed

PROFILES = ("quick", "full")
PROFILE_VARIABLE = "AMP_LESSONS_PROFILE"


def detect_platform() -> str:
    """Return ``"colab"``, ``"kaggle"`` or ``"local"`` for the runtime this process is in."""
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return "colab"
    if os.environ.get("KAGGLE_KERNEL_RUN_TYPE") or os.environ.get("KAGGLE_URL_BASE"):
        return "kaggle"
    return "local"


def get_profile(value: Optional[str] = None) -> str:
    """Resolve the profile: ``value``, else ``$AMP_LESSONS_PROFILE``, else by hardware.

    Raises ``ValueError`` naming the setting and its allowed values for anything else.
    """
    if value is None:
        value = os.environ.get(PROFILE_VARIABLE) or None
    if value is None:
        return "full" if torch.cuda.is_available() else "quick"
    if not isinstance(value, str):
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}; got {value!r}")
    value = value.strip().lower()
    if value not in PROFILES:
        raise ValueError(
            f"{PROFILE_VARIABLE} must be one of {', '.join(PROFILES)}; got {value!r}")
    return value


SIMULATE_VARIABLE = "AMP_LESSONS_SIMULATE"
SIMULATED_CARDS = ("t4",)
# What a simulated card looks like to the lessons: Colab's and Kaggle's free T4 (compute capability
# 7.5: fp16 tensor cores; no native bf16, no TF32, no FP8). torch reports 14.75 GiB on it, of which
# the CUDA context holds a few hundred MiB: the allocator gets about 14.4 GiB.
# ``memory_gib`` is what the allocator may hold; ``total_gib`` the card's whole memory (what
# nvidia-smi's per-process figures, contexts included, must fit in).
CARD_FACTS = {"t4": {"name": "Tesla T4", "capability": (7, 5), "memory_gib": 14.4,
                     "total_gib": 14.75}}


def simulated_card() -> Optional[str]:
    """The card ``AMP_LESSONS_SIMULATE`` asks the lessons to behave as (``"t4"``), or None.

    Under ``t4`` a bigger GPU takes Colab's and Kaggle's path: bf16 and TF32 count as unsupported
    and ``probe`` reports the T4's memory, so every lesson's skips and batch sizes are the T4's.
    """
    value = os.environ.get(SIMULATE_VARIABLE, "").strip().lower()
    if not value:
        return None
    if value not in SIMULATED_CARDS:
        raise ValueError(f"{SIMULATE_VARIABLE} must be one of {', '.join(SIMULATED_CARDS)} "
                         f"(or unset); got {value!r}")
    return value


def device_capability(device=None) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a CUDA device as the lessons should see it (a simulated card's under
    ``AMP_LESSONS_SIMULATE``), or None for a CPU."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return None
    card = simulated_card()
    if card:
        return CARD_FACTS[card]["capability"]
    return tuple(torch.cuda.get_device_capability(device))


def allocatable_bytes(device=None) -> Optional[int]:
    """How many bytes this process's CUDA allocator may hold on ``device``: the GPU's memory, or
    the simulated card's (``AMP_LESSONS_SIMULATE``) where that is smaller. None for a CPU."""
    device = torch.device(device) if device is not None else default_device()
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    card = simulated_card()
    if card:
        return min(total, int(CARD_FACTS[card]["memory_gib"] * 2**30))
    return total


def apply_simulation(device=None) -> Optional[str]:
    """Cap this process's CUDA allocator at the simulated card's memory (``set_per_process_memory_
    fraction``), so a batch that would not fit a T4 fails here too. Returns a line saying what is
    simulated, or None when nothing is (no simulation asked for, or no GPU)."""
    card = simulated_card()
    device = torch.device(device) if device is not None else default_device()
    if card is None or device.type != "cuda":
        return None
    facts = CARD_FACTS[card]
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    fraction = min(1.0, facts["memory_gib"] / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return (f"simulating a {facts['name']} on this GPU: allocator capped at {facts['memory_gib']:.1f} "
            f"GiB ({fraction:.1%} of {total:.0f} GiB), capability {facts['capability'][0]}."
            f"{facts['capability'][1]}, no bf16, no TF32")


def default_device() -> torch.device:
    """The device lessons train on: the current CUDA device if there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators (every device) so a lesson repeats."""
    seed = check_seed("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class Env:
    """What ``setup()`` found. ``device`` is where lessons put tensors; never write ``"cuda"``."""

    platform: str
    device: torch.device
    device_name: str
    capability: Optional[Tuple[int, int]]
    bf16: bool
    fp16_tensor_cores: bool
    total_memory_gib: Optional[float]
    torch_version: str
    python_version: str
    profile: str
    seed: int

    @property
    def device_type(self) -> str:
        """``"cuda"`` or ``"cpu"``: the ``device_type`` argument of ``torch.autocast``."""
        return self.device.type

    @property
    def is_cuda(self) -> bool:
        """True when lessons run on a CUDA GPU."""
        return self.device.type == "cuda"

    @property
    def quick(self) -> bool:
        """True in the ``quick`` profile (tiny sizes, what CI runs)."""
        return self.profile == "quick"

    @property
    def amp_dtype(self) -> torch.dtype:
        """The half type that suits this device: bf16 where it is native, else fp16."""
        return torch.bfloat16 if self.bf16 else torch.float16

    def describe(self) -> str:
        """One line a learner can paste into a bug report."""
        cap = f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else "n/a"
        mem = f"{self.total_memory_gib:.1f} GiB" if self.total_memory_gib else "n/a"
        return (f"platform={self.platform} device={self.device} ({self.device_name}, {mem}) "
                f"capability={cap} bf16={'yes' if self.bf16 else 'no'} "
                f"fp16-tensor-cores={'yes' if self.fp16_tensor_cores else 'no'} "
                f"torch={self.torch_version} profile={self.profile}")

    def as_dict(self) -> dict:
        """Plain data (for notebook metadata and JSON results)."""
        out = asdict(self)
        out["device"] = str(self.device)
        out["capability"] = list(self.capability) if self.capability else None
        return out


def probe(profile: Optional[str] = None, seed: int = 0) -> Env:
    """Inspect the hardware and profile without printing or seeding anything."""
    device = default_device()
    card = simulated_card()
    if device.type == "cuda" and card:
        facts = CARD_FACTS[card]
        capability, total = facts["capability"], facts["memory_gib"]
        name = f"{facts['name']} (simulated on {torch.cuda.get_device_properties(device).name})"
        bf16, fp16_tc = False, True
    elif device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        capability = (props.major, props.minor)
        name = props.name
        total = props.total_memory / 2**30
        try:
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.3 has no including_emulation
            bf16 = capability >= (8, 0)
        fp16_tc = capability >= (7, 0)
    else:
        capability, total, fp16_tc = None, None, False
        name = _platform.processor() or _platform.machine() or "CPU"
        bf16 = True  # CPU autocast supports bf16 everywhere torch runs (emulated where needed)
    return Env(platform=detect_platform(), device=device, device_name=name,
               capability=capability, bf16=bf16, fp16_tensor_cores=fp16_tc,
               total_memory_gib=total, torch_version=torch.__version__,
               python_version=_platform.python_version(), profile=get_profile(profile),
               seed=seed)


def _configure_notebook_frontend(platform: str) -> None:
    """Choose how plotly and widgets render for the front end in use."""
    try:
        import plotly.io as pio
    except ImportError:  # plotly is a dependency; keep setup() working without it anyway
        return
    if platform == "colab":
        pio.renderers.default = "colab"
        try:
            from google.colab import output  # type: ignore
            output.enable_custom_widget_manager()
        except Exception:  # noqa: BLE001 - older Colab images lack it; plain figures still work
            pass
    elif platform == "kaggle":
        pio.renderers.default = "notebook_connected"
    else:
        # The mimetype renders live in JupyterLab, VS Code and nteract, and stores each figure's
        # data once. Static viewers (GitHub) show the PNG that `python -m amp_lessons
        # figure-images` adds beside it in the committed notebooks (see snapshots.py).
        pio.renderers.default = "plotly_mimetype"


def setup(profile: Optional[str] = None, seed: int = 0, quiet: bool = False) -> Env:
    """Start a lesson: detect platform and device, resolve the profile, seed every RNG.

    Prints one line per fact (platform, device, capability, torch version, profile). Never fails
    on a machine without a GPU: the lesson then runs on the CPU in the ``quick`` profile.
    """
    env = probe(profile, seed)
    seed_everything(seed)
    simulated = apply_simulation(env.device)
    _configure_notebook_frontend(env.platform)
    if not quiet:
        cap = f"{env.capability[0]}.{env.capability[1]}" if env.capability else "n/a (CPU)"
        mem = f", {env.total_memory_gib:.0f} GiB" if env.total_memory_gib else ""
        print(f"platform   : {env.platform}")
        print(f"device     : {env.device} ({env.device_name}{mem})")
        print(f"capability : {cap}; native bf16: {'yes' if env.bf16 else 'no'}; "
              f"fp16 tensor cores: {'yes' if env.fp16_tensor_cores else 'no'}")
        print(f"torch      : {env.torch_version} (Python {env.python_version})")
        print(f"profile    : {env.profile}")
        if simulated:
            print(f"simulation : {simulated}")
    return env
