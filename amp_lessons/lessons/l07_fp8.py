"""Lesson 07, FP8 training with torchao on Hopper and Ada GPUs (notebooks/07_fp8_training.ipynb).

Four parts, each a few calls from the notebook:

1. **numerics**: the e4m3 and e5m2 formats, amax-based dynamic scaling per tensor and per row, and
   the quantization error of real activations, weights and gradients (lesson 02's MLP on the
   digits set), on any machine (casts to ``torch.float8_*`` work on the CPU);
2. **speed**: an MLP stack compiled in bf16 against torchao's float8 training recipes
   (``tensorwise``, ``rowwise``) across widths, timed with device events, with peak memory;
3. **accuracy**: a small GPT trained on the Python standard library's own source files (bytes as
   tokens), bf16 over several seeds against FP8 with the same seed as the first;
4. **what not to convert**: the module filter that keeps some ``nn.Linear`` layers in bf16, as a
   table, next to torchao's own heuristic.

The speed table and the accuracy result are published to the README's results section
(``speed_report_rows``, ``accuracy_report_rows``: numbers only where measured on FP8 tensor cores,
``not measured: <reason>`` everywhere else); no article makes FP8 claims, so there are no verdicts.

torchao is optional (the ``torchao`` extra: ``make torchao`` or ``pip install -e ".[torchao]"``
in the course's clone, ``pip install "torchao>=0.18"`` anywhere else): it is imported inside the functions that
need it, and where FP8 cannot run, the functions say why instead of failing. The plotly figure
builders at the end are pure functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import data as _data
from .. import models as _models
from .._validate import check_choice, check_int, check_positive, is_real
from ..env import CARD_FACTS, device_capability, simulated_card
from ..report import show_table
from ..tables import not_compared, plural, text_table

LESSON = "07"
DECIDES = ()  # no article claims FP8 numbers: the lesson states its findings as measurements

FORMATS: Dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMAT_BITS = {"e4m3": (4, 3), "e5m2": (5, 2), "bf16": (8, 7)}
FORMAT_USE = {
    "e4m3": "weights and activations (forward): one more mantissa bit",
    "e5m2": "gradients (backward): more range, less precision",
    "bf16": "the baseline's half type, for scale",
}
SCALINGS = ("none", "tensorwise", "rowwise")
RECIPES = ("bf16", "tensorwise", "rowwise")
FP8_RECIPES = ("tensorwise", "rowwise")
TENSOR_KINDS = ("activation", "weight", "gradient")
MIN_CAPABILITY = (8, 9)
GIB = 2 ** 30
NOT_MEASURED = "not measured"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TORCHAO_REQUIREMENT = "torchao>=0.18"  # the same as pyproject.toml's torchao extra (a test checks)
INSTALL_HINT = f'make torchao in the course\'s clone, or pip install "{TORCHAO_REQUIREMENT}"'


# --- argument checks (each names the setting and its allowed range) ----------------------------

def _check_ints(name: str, values, low: int) -> Tuple[int, ...]:
    values = tuple(values) if isinstance(values, (list, tuple)) else values
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty sequence of integers >= {low}; got {values!r}")
    for v in values:
        check_int(f"each of {name}", v, low)
    return values


# --- 0. can FP8 run here? ------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence import-time log lines and warnings (torchao logs about its C++ extensions on some
    torch versions; torch logs about enum registrations) so notebook outputs stay clean."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def torchao_version() -> Optional[str]:
    """torchao's version where it is installed and imports, else None (torchao is optional)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        with _quiet():
            module = importlib.import_module("torchao")
    except Exception:  # noqa: BLE001 - a broken install counts as not installed
        return None
    return str(getattr(module, "__version__", "unknown"))


def _float8_api():
    """torchao.float8, imported on first use; RuntimeError with the install hint where missing."""
    if torchao_version() is None:
        raise RuntimeError(f"torchao not installed ({INSTALL_HINT})")
    with _quiet():
        return importlib.import_module("torchao.float8")


def support_reason(device_type: str, capability: Optional[Tuple[int, int]],
                   torchao: Optional[str]) -> str:
    """Why FP8 matmuls cannot run with this device and torchao version ("" when they can)."""
    check_choice("device_type", device_type, ("cuda", "cpu", "mps", "xpu"))
    reasons = []
    if device_type != "cuda":
        reasons.append(f"no CUDA GPU (running on the {device_type.upper()})")
    elif capability is None or tuple(capability) < MIN_CAPABILITY:
        cap = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        reasons.append(f"compute capability {cap} is below 8.9")
    if torchao is None:
        reasons.append(f"torchao not installed ({INSTALL_HINT})")
    return "; ".join(reasons)


@dataclass(frozen=True)
class FP8Support:
    """What this machine can do with FP8: tensor cores (capability >= 8.9) and torchao.

    ``available``: torchao's float8 training runs on FP8 tensor cores here (what the speed part
    needs). ``can_emulate``: torchao is present, so FP8 numerics can be trained even without FP8
    tensor cores (``emulate=True``: same casts, matmuls in high precision, no speed-up).
    """

    device_type: str
    device_name: str
    capability: Optional[Tuple[int, int]]
    torchao: Optional[str]
    reason: str

    @property
    def tensor_cores(self) -> bool:
        """True on a CUDA GPU of compute capability 8.9 or above."""
        return (self.device_type == "cuda" and self.capability is not None
                and tuple(self.capability) >= MIN_CAPABILITY)

    @property
    def available(self) -> bool:
        """True when FP8 matmuls run on FP8 tensor cores through torchao."""
        return self.tensor_cores and self.torchao is not None

    @property
    def can_emulate(self) -> bool:
        """True when torchao is installed (FP8 numerics run emulated without FP8 tensor cores)."""
        return self.torchao is not None

    def line(self) -> str:
        """One line for the lesson: FP8 runs here, or why it does not."""
        if self.available:
            cap = f"{self.capability[0]}.{self.capability[1]}"
            return (f"FP8 runs here: {self.device_name} (compute capability {cap}) has FP8 tensor "
                    f"cores, torchao {self.torchao}.")
        return (f"FP8 matmuls do not run here: {self.reason}. FP8 tensor cores start with compute "
                f"capability 8.9 (Ada: L4, RTX 4090; Hopper: H100, H200).")


def fp8_support(device: Union[str, torch.device, None] = None) -> FP8Support:
    """Probe ``device`` (default: the current CUDA device, else the CPU) and torchao for FP8. Under
    ``AMP_LESSONS_SIMULATE`` a GPU reports the simulated card's capability (a T4: no FP8)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    device = torch.device(device)
    capability, name = None, "CPU"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device must be a device this machine has; got {device} without CUDA")
        capability = device_capability(device)  # a simulated card's (AMP_LESSONS_SIMULATE)
        name = torch.cuda.get_device_properties(device).name
        card = simulated_card()
        if card:
            name = f"{CARD_FACTS[card]['name']} (simulated on {name})"
    elif device.type != "cpu":
        name = device.type.upper()
    version = torchao_version()
    reason = support_reason(device.type if device.type in ("cuda", "cpu", "mps", "xpu") else "cpu",
                            capability, version)
    return FP8Support(device.type, name, capability, version, reason)


# --- 1. numerics: formats, dynamic scaling, quantization error -----------------------------------

def format_facts() -> List[dict]:
    """e4m3, e5m2 (and bf16 for scale): bits, range, smallest values, spacing at 1, use in training."""
    rows = []
    for name in ("e4m3", "e5m2", "bf16"):
        dtype = FORMATS.get(name, torch.bfloat16)
        info = torch.finfo(dtype)
        exp_bits, man_bits = FORMAT_BITS[name]
        rows.append({"format": name, "dtype": str(dtype).replace("torch.", ""),
                     "exponent bits": exp_bits, "mantissa bits": man_bits,
                     "largest": float(info.max), "smallest normal": float(info.tiny),
                     "smallest subnormal": float(info.tiny) * 2.0 ** -man_bits,
                     "step at 1.0": float(info.eps), "used for": FORMAT_USE[name]})
    return rows


def fp8_max(fmt: str) -> float:
    """The largest finite value of an FP8 format (448 for e4m3, 57,344 for e5m2)."""
    check_choice("fmt", fmt, tuple(FORMATS))
    return float(torch.finfo(FORMATS[fmt]).max)


def amax_scale(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensorwise",
               power_of_2: bool = False) -> torch.Tensor:
    """Dynamic scale for casting ``x`` to FP8: the format's largest value over ``amax(|x|)``.

    ``tensorwise``: one scale (a 0-d tensor); ``rowwise``: one per row, over the last dimension
    (shape ``... x 1``); ``none``: 1. ``power_of_2`` rounds scales down to a power of two (torchao's
    rowwise recipe does, so scaling itself adds no rounding error). Multiplying by the scale puts
    the largest magnitude exactly at the top of the format's range.
    """
    check_choice("fmt", fmt, tuple(FORMATS))
    check_choice("granularity", granularity, SCALINGS)
    x = x.detach().float()
    if granularity == "none":
        return torch.ones((), device=x.device)
    amax = x.abs().amax() if granularity == "tensorwise" or x.dim() == 0 \
        else x.abs().amax(dim=-1, keepdim=True)
    scale = fp8_max(fmt) / amax.clamp(min=1e-12)
    if power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def to_fp8(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensorwise",
           power_of_2: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x`` to FP8 with a dynamic scale: ``(x * scale)`` saturated to the range, then cast.

    Returns ``(x_fp8, scale)``; ``from_fp8(x_fp8, scale)`` undoes the scale. Saturating first
    matters: e4m3fn has no infinity, and values past 448 would cast to NaN.
    """
    scale = amax_scale(x, fmt, granularity, power_of_2)
    top = fp8_max(fmt)
    return (x.detach().float() * scale).clamp(-top, top).to(FORMATS[fmt]), scale


def from_fp8(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to fp32: the FP8 values divided by the scale they were cast with."""
    if x_fp8.dtype not in FORMATS.values():
        raise ValueError(f"x_fp8 must have an FP8 dtype ({', '.join(map(str, FORMATS.values()))}); "
                         f"got {x_fp8.dtype}")
    return x_fp8.float() / scale


def fake_quantize(x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensorwise",
                  power_of_2: bool = False) -> torch.Tensor:
    """``x`` after a round trip through FP8 (in fp32): what a matmul on FP8 inputs sees."""
    return from_fp8(*to_fp8(x, fmt, granularity, power_of_2))


def quantization_error(x: torch.Tensor, fmt: str = "e4m3",
                       granularity: str = "tensorwise") -> Dict[str, float]:
    """How much of ``x`` a round trip through FP8 loses.

    ``rel_error``: ``||q(x) - x|| / ||x||``; ``underflow``: the fraction of non-zero values that
    became 0; ``saturated``: the fraction clipped at the format's largest value.
    """
    x = x.detach().float()
    if x.numel() == 0 or not torch.isfinite(x).all():
        raise ValueError("x must be a non-empty tensor of finite values")
    q = fake_quantize(x, fmt, granularity)
    norm = float(x.norm())
    nonzero = x != 0
    scale = amax_scale(x, fmt, granularity)
    saturated = (x.abs() * scale) > fp8_max(fmt)
    return {"rel_error": float((q - x).norm()) / norm if norm > 0 else 0.0,
            "underflow": float(((q == 0) & nonzero).sum()) / max(int(nonzero.sum()), 1),
            "saturated": float(saturated.float().mean())}


WALK_COLUMNS = {"none": "no scale", "tensorwise": "one scale", "rowwise": "scale per row"}
OUTLIER_EXAMPLE = ((0.0013, -0.0042, 0.0007, 0.011),
                   (2.5, -120.0, 31.0, 1700.0))


def scaling_walkthrough(x: Optional[torch.Tensor] = None, fmt: str = "e4m3") -> dict:
    """A small tensor cast to FP8 three ways (no scale, one scale, one per row), element by element.

    The default tensor has a row of small values and a row with an outlier (1,700, past e4m3's
    448): without a scale the small row underflows and the outlier saturates; one scale for the
    tensor fits the outlier and pushes the small row under e4m3's smallest subnormal; a scale per
    row fits both. Returns the amaxes, the scales and one row per element.
    """
    x = torch.tensor(OUTLIER_EXAMPLE) if x is None else x.detach().float().cpu()
    if x.dim() != 2:
        raise ValueError(f"x must be a 2-d tensor (rows x values); got {x.dim()} dimensions")
    out = {granularity: fake_quantize(x, fmt, granularity) for granularity in SCALINGS}
    rows = []
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            rows.append({"row": i, "value": float(x[i, j]),
                         **{WALK_COLUMNS[g]: float(out[g][i, j]) for g in SCALINGS}})
    return {"amax": float(x.abs().amax()),
            "tensor_scale": float(amax_scale(x, fmt, "tensorwise")),
            "row_amax": [float(v) for v in x.abs().amax(dim=-1)],
            "row_scales": [float(v) for v in amax_scale(x, fmt, "rowwise").flatten()],
            "rows": rows}


def digits_tensors(seed: int = 0, epochs: int = 3, batch_size: int = 64,
                   hidden: Sequence[int] = (256, 128)) -> Dict[str, Dict[str, torch.Tensor]]:
    """Real tensors of a training step: lesson 02's MLP trained briefly on the digits set.

    Trains in fp32 on the CPU for ``epochs`` (a second), then runs one more batch and captures,
    per ``nn.Linear``: its input (the activation), its weight, and the gradient of the loss with
    respect to its output (what FP8 training casts to e5m2 in backward). Returns
    ``{layer: {"activation", "weight", "gradient"}}``.
    """
    check_int("seed", seed, 0)
    check_int("epochs", epochs, 0, 100)
    check_int("batch_size", batch_size, 1, 1347)
    torch.manual_seed(seed)
    model = _models.MLP(in_features=64, hidden=tuple(hidden), num_classes=10)
    train, _ = _data.digits_loaders(batch_size=batch_size, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        train.set_epoch(epoch)
        for x, y in train:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    captured: Dict[str, Dict[str, torch.Tensor]] = {}
    hooks = []

    def capture(name):
        def hook(module, inputs, output):
            entry = captured.setdefault(name, {})
            entry["activation"] = inputs[0].detach().clone()
            entry["weight"] = module.weight.detach().clone()
            output.register_hook(lambda g: entry.__setitem__("gradient", g.detach().clone()))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(capture(name)))
    train.set_epoch(epochs)
    x, y = next(iter(train))
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    for h in hooks:
        h.remove()
    return captured


def error_table(tensors: Mapping[str, Mapping[str, torch.Tensor]],
                formats: Sequence[str] = ("e4m3", "e5m2"),
                scalings: Sequence[str] = SCALINGS) -> List[dict]:
    """Quantization error of every captured tensor, per format and scaling (one row each)."""
    if not tensors:
        raise ValueError("tensors must hold at least one layer (see digits_tensors)")
    for f in formats:
        check_choice("formats", f, tuple(FORMATS))
    for s in scalings:
        check_choice("scalings", s, SCALINGS)
    rows = []
    for layer, kinds in tensors.items():
        for kind in TENSOR_KINDS:
            if kind not in kinds:
                continue
            t = kinds[kind]
            for fmt in formats:
                for scaling in scalings:
                    err = quantization_error(t, fmt, scaling)
                    rows.append({"layer": layer, "tensor": kind,
                                 "shape": "x".join(map(str, t.shape)),
                                 "amax": float(t.abs().amax()), "format": fmt, "scaling": scaling,
                                 **err})
    return rows


def error_summary(rows: Sequence[Mapping]) -> List[dict]:
    """``error_table`` rows averaged over layers: one row per tensor kind, format and scaling."""
    if not rows:
        raise ValueError("rows must hold at least one row (see error_table)")
    groups: Dict[Tuple[str, str, str], List[Mapping]] = {}
    for r in rows:
        groups.setdefault((r["tensor"], r["format"], r["scaling"]), []).append(r)
    return [{"tensor": k[0], "format": k[1], "scaling": k[2],
             "rel_error": statistics.fmean(r["rel_error"] for r in g),
             "underflow": statistics.fmean(r["underflow"] for r in g)}
            for k, g in groups.items()]


# --- 2. speed: compiled bf16 against torchao's float8 recipes ------------------------------------

def mlp_stack(width: int, blocks: int = 4, ratio: int = 4) -> nn.Sequential:
    """``blocks`` x (Linear width -> ratio*width, GELU, Linear ratio*width -> width), no bias.

    The transformer MLP's shape without the rest: its two GEMMs per block are where FP8 pays.
    """
    check_int("width", width, 16)
    check_int("blocks", blocks, 1, 64)
    check_int("ratio", ratio, 1, 16)
    if width % 16:
        raise ValueError(f"width must be a multiple of 16 (FP8 GEMMs need it); got {width}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, ratio * width, bias=False), nn.GELU(),
                                         nn.Linear(ratio * width, width, bias=False))
                           for _ in range(blocks)])


def float8_config(recipe: str, emulate: bool = False):
    """torchao's ``Float8LinearConfig.from_recipe_name(recipe)`` (``emulate=True``: no FP8 GEMMs)."""
    check_choice("recipe", recipe, FP8_RECIPES)
    api = _float8_api()
    config = api.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise",
                      module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                      emulate: bool = False) -> nn.Module:
    """Swap ``model``'s ``nn.Linear`` layers for torchao's ``Float8Linear`` (in place).

    ``module_filter_fn(module, fqn)`` returns True for the layers to convert (see
    ``conversion_plan``). Each converted layer casts its input and weight to e4m3 and, in
    backward, its output gradient to e5m2 (tensorwise) or e4m3 (rowwise), with a dynamic scale.
    """
    api = _float8_api()
    config = float8_config(recipe, emulate)
    with _quiet():
        return api.convert_to_float8_training(model, config=config,
                                              module_filter_fn=module_filter_fn)


def float8_layers(model: nn.Module) -> List[str]:
    """Names of the layers torchao converted (its ``Float8Linear``), in module order."""
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _compile_blocks(blocks: Union[nn.Sequential, nn.ModuleList]) -> List[nn.Module]:
    # Each block is compiled on its own ("regional" compilation): the blocks are identical, so
    # inductor's caches serve blocks 2-4 from block 1's compilation, and compiling takes about a
    # quarter of the time of compiling the whole stack. Returns the uncompiled blocks (same
    # parameters), so a caller can put them back (see ``train_gpt``).
    originals = list(blocks)
    for i in range(len(blocks)):
        blocks[i] = torch.compile(originals[i], dynamic=False)
    return originals


def time_recipe(recipe: str, width: int, tokens: int = 16384, blocks: int = 4, steps: int = 10,
                warmup: int = 3, device: Union[str, torch.device, None] = None,
                compile: bool = True, emulate: bool = False, lr: float = 1e-4) -> dict:
    """Train ``mlp_stack(width, blocks)`` on ``tokens`` rows for ``warmup`` + ``steps`` steps.

    bf16 autocast, fused AdamW (on CUDA), MSE against a fixed random target; ``recipe`` is
    ``bf16`` or a torchao float8 recipe. The model is built directly on ``device`` (initialising
    two billion weights on the CPU and copying them over took longer than timing them). Peak
    memory is reset before the model is built, so it counts weights, gradients, optimizer state
    and activations. Returns the median step (CUDA events on a GPU), the spread of the timed
    steps (largest minus smallest, in % of the median), peak GiB, TFLOP/s, the time of the first
    (compiling) step and the loss.
    """
    check_choice("recipe", recipe, RECIPES)
    check_int("tokens", tokens, 1)
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 1)
    check_positive("lr", lr)
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    _free_memory()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:  # weights are created and initialised on the device itself
        model = mlp_stack(width, blocks)
    n_params = sum(p.numel() for p in model.parameters())
    if recipe != "bf16":
        convert_to_float8(model, recipe, emulate=emulate)
    if compile:
        _compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, width, device=device, generator=g)
    target = torch.randn(tokens, width, device=device, generator=g)
    times: List[float] = []
    first_s = 0.0
    loss = torch.zeros(())
    with _quiet():
        for i in range(warmup + steps):
            timed = i >= warmup
            if cuda and timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(x)
            loss = F.mse_loss(out.float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda and timed:
                end.record()
                times.append((start, end))
            elif timed:
                times.append(time.perf_counter() - t0)
            if i == 0:
                if cuda:
                    torch.cuda.synchronize(device)
                first_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize(device)
        step_times = [s.elapsed_time(e) for s, e in times]
        peak = torch.cuda.max_memory_allocated(device) / GIB
    else:
        step_times, peak = [t * 1e3 for t in times], None
    step_ms = statistics.median(step_times)
    flops = 6.0 * n_params * tokens
    result = {"width": width, "recipe": recipe, "step_ms": step_ms, "speedup": None,
              "peak_gib": peak, "tflops": flops / (step_ms * 1e-3) / 1e12, "params": n_params,
              "spread_pct": 100 * (max(step_times) - min(step_times)) / step_ms,
              "first_step_s": first_s, "loss": float(loss.detach()), "status": "measured"}
    del model, opt, x, target, out, loss
    return result


def speed_sweep(widths: Sequence[int] = (1024, 2048, 4096, 8192), recipes: Sequence[str] = RECIPES,
                tokens: int = 16384, blocks: int = 4, steps: int = 10, warmup: int = 3,
                support: Optional[FP8Support] = None,
                device: Union[str, torch.device, None] = None, compile: bool = True) -> List[dict]:
    """``time_recipe`` for every width and recipe, bf16 first; speed-ups against bf16 of the
    same width, measured in this run.

    Where FP8 cannot run (``support.available`` false) every row is ``not measured: <reason>``;
    a configuration that runs out of memory or fails is reported in its row, never raised.
    """
    widths = _check_ints("widths", widths, 16)
    for r in recipes:
        check_choice("recipes", r, RECIPES)
    support = support if support is not None else fp8_support(device)
    rows: List[dict] = []
    for width in widths:
        for recipe in recipes:
            base = {"width": width, "recipe": recipe, "step_ms": None, "speedup": None,
                    "peak_gib": None, "tflops": None, "spread_pct": None}
            if not support.available:
                rows.append({**base, "status": f"{NOT_MEASURED}: {support.reason}"})
                continue
            try:
                rows.append(time_recipe(recipe, width, tokens, blocks, steps, warmup, device,
                                        compile=compile))
            except Exception as exc:  # noqa: BLE001 - one configuration's failure is a row
                what = "out of memory" if _is_oom(exc) else \
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
                rows.append({**base, "status": f"{NOT_MEASURED}: {what}"})
            finally:
                if compile:
                    torch._dynamo.reset()  # fresh caches: no recompile limit, no dynamic shapes
                _free_memory()
    for r in rows:
        b = next((o for o in rows if o["width"] == r["width"] and o["recipe"] == "bf16"), None)
        if r["step_ms"] and b and b["step_ms"]:
            r["speedup"] = b["step_ms"] / r["step_ms"]
    return rows


def speedup(rows: Sequence[Mapping], width: int, recipe: str = "tensorwise") -> Optional[float]:
    """The measured speed-up of ``recipe`` over bf16 at ``width``, or None where not measured."""
    check_choice("recipe", recipe, RECIPES)
    for r in rows:
        if r["width"] == width and r["recipe"] == recipe:
            return r.get("speedup")
    return None


def smallest_paying_width(rows: Sequence[Mapping], recipe: str = "tensorwise",
                          at_least: float = 1.05) -> Optional[int]:
    """The smallest width from which ``recipe`` stays at least ``at_least`` x bf16's speed, or
    None when it never does (or nothing was measured)."""
    check_choice("recipe", recipe, FP8_RECIPES)
    check_positive("at_least", at_least)
    measured = sorted((r["width"], r["speedup"]) for r in rows
                      if r["recipe"] == recipe and r.get("speedup") is not None)
    for i, (width, _) in enumerate(measured):
        if all(s >= at_least for _, s in measured[i:]):
            return width
    return None


# --- 3. accuracy: a small GPT on the standard library's source -----------------------------------

@dataclass
class Corpus:
    """Byte-level text: ``train`` and ``val`` are uint8 tensors (every byte is a token)."""

    train: torch.Tensor
    val: torch.Tensor
    files: int
    root: str

    def describe(self) -> str:
        """One line: where the text came from and how much there is."""
        return (f"{self.files:,} .py files from {self.root}: {len(self.train) / 1e6:.2f} MB to "
                f"train on, {len(self.val) / 1e6:.2f} MB held out (every byte one of 256 tokens)")


def stdlib_files(root: Union[str, Path, None] = None) -> List[Path]:
    """The standard library's ``.py`` files under ``root`` (default: where ``os`` lives), in a
    fixed order (sorted relative paths), without site-packages or caches."""
    root = Path(root if root is not None else os.path.dirname(os.__file__))
    if not root.is_dir():
        raise ValueError(f"root must be an existing folder; got {str(root)!r}")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("."))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: Optional[int] = None, val_every: int = 20,
                  root: Union[str, Path, None] = None) -> Corpus:
    """The Python standard library's own source as training text (real, offline, on every machine).

    Files are read in ``stdlib_files`` order; every ``val_every``-th file is held out for
    validation. ``max_bytes`` caps the training text (the quick profile reads a few hundred KB).
    """
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 4096)
    check_int("val_every", val_every, 2)
    files = stdlib_files(root)
    if not files:
        raise ValueError(f"root must hold .py files; none under {root!r}")
    train, val, n_train, used = [], [], 0, 0
    for i, path in enumerate(files):
        if max_bytes is not None and n_train >= max_bytes:
            break
        try:
            text = path.read_bytes() + b"\n"
        except OSError:
            continue
        used += 1
        if i % val_every == 0:
            val.append(text)
        else:
            train.append(text)
            n_train += len(text)
    blob = b"".join(train)[:max_bytes] if max_bytes else b"".join(train)
    held = b"".join(val)
    if max_bytes:
        held = held[:max(max_bytes // 4, 4096)]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()  # noqa: E731
    return Corpus(as_tensor(blob), as_tensor(held), used,
                  str(root if root is not None else os.path.dirname(os.__file__)))


def batch_offsets(n: int, seq_len: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """``steps x batch_size`` random start positions in a text of ``n`` tokens (fixed by ``seed``)."""
    check_int("seq_len", seq_len, 1)
    check_int("batch_size", batch_size, 1)
    check_int("steps", steps, 1)
    check_int("seed", seed, 0)
    if n < seq_len + 2:
        raise ValueError(f"n must exceed seq_len + 1 = {seq_len + 1}; got {n}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n - seq_len - 1, (steps, batch_size), generator=g)


def text_batch(text: torch.Tensor, offsets: torch.Tensor,
               seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (``B x seq_len`` int64) starting at ``offsets``."""
    idx = offsets.to(text.device)[:, None] + torch.arange(seq_len + 1, device=text.device)
    chunk = text[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def evaluate(model: nn.Module, text: torch.Tensor, seq_len: int, batch_size: int = 16,
             batches: int = 8, amp_dtype: Optional[torch.dtype] = torch.bfloat16) -> float:
    """Mean next-token loss on fixed batches of held-out ``text`` (the same batches every run)."""
    check_int("batches", batches, 1)
    offsets = batch_offsets(len(text), seq_len, batch_size, batches, seed=1234)
    was_training = model.training
    model.eval()
    losses = []
    for row in offsets:
        x, y = text_batch(text, row, seq_len)
        with torch.autocast(text.device.type, dtype=amp_dtype or torch.float32,
                            enabled=amp_dtype is not None):
            losses.append(_models.lm_loss(model(x), y))
    model.train(was_training)
    return float(torch.stack(losses).mean())


def train_gpt(corpus: Corpus, recipe: str = "bf16", seed: int = 0, steps: int = 2000,
              batch_size: int = 32, model_kwargs: Optional[Mapping] = None, lr: float = 1e-3,
              warmup_steps: int = 100, eval_batches: int = 16,
              device: Union[str, torch.device, None] = None,
              amp_dtype: Optional[torch.dtype] = torch.bfloat16, emulate: bool = False,
              keep_high_precision: Sequence[str] = ("first", "last"),
              compile: bool = False) -> dict:
    """Train a ``TinyTransformer`` on ``corpus`` in bf16 or a torchao float8 recipe.

    AdamW (betas 0.9/0.95, weight decay 0.1), linear warm-up then cosine decay to 10%, gradients
    clipped at 1. ``seed`` fixes both the initial weights and the batch order, so two recipes with
    one seed differ only in their arithmetic. FP8 runs convert every block's Linear layers except
    the first and last ones (``keep_high_precision``); ``emulate`` runs FP8 numerics without FP8
    tensor cores. ``amp_dtype=None`` trains in fp32 (a GPU without bf16).

    ``compile=True`` compiles each transformer block on its own (as the speed sweep does; every
    recipe the same way, so runs still differ only in their arithmetic). In eager mode torchao's
    casts are dozens of small kernels per layer, which made FP8 four times slower than bf16 on
    this small model; compiled, they fuse. The held-out loss is computed with the uncompiled
    blocks (no second compilation for inference). Returns the per-step losses, the final loss
    (mean of the last 10% of steps), the held-out loss, the time of the first step (which
    compiles), the time per step after it, and peak memory.
    """
    check_choice("recipe", recipe, RECIPES)
    check_int("seed", seed, 0)
    check_int("steps", steps, 1)
    check_int("warmup_steps", warmup_steps, 0)
    check_positive("lr", lr)
    kwargs = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=64)
    kwargs.update(model_kwargs or {})
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    _free_memory()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)
    model = _models.TinyTransformer(**kwargs).to(device)
    converted: List[str] = []
    if recipe != "bf16":
        plan = conversion_plan(model, min_features=16, keep_first="first" in keep_high_precision,
                               keep_last="last" in keep_high_precision)
        convert_to_float8(model, recipe, module_filter(plan), emulate=emulate)
        converted = float8_layers(model)
    seq_len = kwargs["seq_len"]
    train = corpus.train.to(device)
    val = corpus.val.to(device)
    offsets = batch_offsets(len(train), seq_len, batch_size, steps, seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, warmup_steps))
    losses = torch.zeros(steps, device=device)
    originals = _compile_blocks(model.blocks) if compile else None
    first_s = 0.0
    started = time.perf_counter()
    try:
        with _quiet():
            for step in range(steps):
                x, y = text_batch(train, offsets[step], seq_len)
                with torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                    enabled=amp_dtype is not None):
                    loss = _models.lm_loss(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                losses[step] = loss.detach()
                if step == 0:
                    if cuda:
                        torch.cuda.synchronize(device)
                    first_s = time.perf_counter() - started
            if cuda:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
    finally:
        if originals is not None:
            for i, block in enumerate(originals):
                model.blocks[i] = block
            torch._dynamo.reset()  # fresh caches for the next run: no recompile limit reached
    with _quiet():
        val_loss = evaluate(model, val, seq_len, batch_size, eval_batches, amp_dtype)
    curve = losses.float().cpu().tolist()
    tail = curve[-max(1, steps // 10):]
    label = "bf16" if recipe == "bf16" else f"float8 {recipe}" + (" (emulated)" if emulate else "")
    if recipe == "bf16" and amp_dtype is None:
        label = "fp32"
    return {"label": f"{label}, seed {seed}", "recipe": recipe, "seed": seed, "steps": steps,
            "losses": curve, "final_loss": statistics.fmean(tail), "val_loss": val_loss,
            "seconds": seconds, "first_step_s": first_s,
            "ms_per_step": 1e3 * (seconds - first_s) / (steps - 1) if steps > 1 else 1e3 * seconds,
            "compiled": bool(compile),
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
            "params": model.parameter_count(), "float8_layers": len(converted),
            "emulated": bool(emulate and recipe != "bf16"),
            "finite": all(math.isfinite(v) for v in curve), "status": "trained"}


def accuracy_runs(corpus: Corpus, seeds: Sequence[int] = (0, 1, 2),
                  fp8_recipes: Sequence[str] = ("tensorwise",),
                  support: Optional[FP8Support] = None, **train_kwargs) -> List[dict]:
    """bf16 once per seed, then each FP8 recipe with the first seed (same weights, same batches).

    FP8 runs on FP8 tensor cores where ``support.available``, emulated where only torchao is
    present, and otherwise appears as a row ``not run: <reason>``. ``train_kwargs`` go to
    ``train_gpt``.
    """
    seeds = _check_ints("seeds", seeds, 0)
    for r in fp8_recipes:
        check_choice("fp8_recipes", r, FP8_RECIPES)
    support = support if support is not None else fp8_support(train_kwargs.get("device"))
    runs = [train_gpt(corpus, "bf16", seed, **train_kwargs) for seed in seeds]
    for recipe in fp8_recipes:
        if not support.can_emulate:
            runs.append({"label": f"float8 {recipe}, seed {seeds[0]}", "recipe": recipe,
                         "seed": seeds[0], "steps": train_kwargs.get("steps"),
                         "status": f"not run: {support.reason}"})
            continue
        runs.append(train_gpt(corpus, recipe, seeds[0], emulate=not support.available,
                              **train_kwargs))
    return runs


def loss_comparison(runs: Sequence[Mapping], min_steps: int = 1000) -> dict:
    """FP8's final loss against bf16's with the same seed, next to the spread of bf16 seeds.

    ``within`` says whether ``|FP8 - bf16|`` is at most the spread (max - min over bf16 seeds);
    ``decided`` is False, with the reason, when the run cannot tell: fewer than ``min_steps`` steps
    (bf16 or FP8), fewer than two bf16 seeds, no FP8 run with a bf16 partner of the same seed,
    or a loss that is not finite.
    """
    check_int("min_steps", min_steps, 1)
    trained_bf16 = [r for r in runs if r["recipe"] == "bf16" and r.get("status") == "trained"]
    # a diverged seed (NaN or inf loss) has no place in a spread: it would hide in max()/min()
    base = [r for r in trained_bf16 if is_real(r.get("final_loss"))]
    finals = [r["final_loss"] for r in base]
    spread = (max(finals) - min(finals)) if len(finals) >= 2 else None
    rows = []
    for r in runs:
        if r["recipe"] == "bf16":
            continue
        same = next((b for b in base if b["seed"] == r["seed"]), None)
        trained = r.get("status") == "trained" and same is not None \
            and is_real(r.get("final_loss"))
        diff = r["final_loss"] - same["final_loss"] if trained else None
        rows.append({"run": r["label"], "final_loss": r.get("final_loss"),
                     "bf16_same_seed": same["final_loss"] if same else None, "difference": diff,
                     "spread": spread,
                     "within": (abs(diff) <= spread) if diff is not None and spread is not None
                     else None, "status": r.get("status")})
    compared = [r for r in rows if r["difference"] is not None]
    fp8_runs = [r for r in runs if r["recipe"] != "bf16"]
    steps = min((r["steps"] for r in base + [r for r in fp8_runs if r.get("status") == "trained"]),
                default=0)
    reasons = []
    diverged = [r["label"] for r in trained_bf16 + fp8_runs
                if r.get("status") == "trained" and not is_real(r.get("final_loss"))]
    if diverged:
        reasons.append(f"{', '.join(diverged)} ended with a loss that is not finite (diverged)")
    if not any(r["status"] == "trained" for r in rows):
        why = next((r["status"] for r in rows), "not run: no FP8 recipe was asked for")
        reasons.append(f"FP8 {why}")
    elif not compared:
        reasons.append("no FP8 run has a bf16 run with the same seed to compare with")
    if len(finals) < 2:
        reasons.append("fewer than two bf16 seeds, so no seed-to-seed spread")
    if steps < min_steps:
        reasons.append(f"{plural(steps, 'step')} {'is' if steps == 1 else 'are'} too few to "
                       f"compare final losses "
                       f"(this comparison needs at least {min_steps})")
    return {"bf16_final": finals, "spread": spread, "steps": steps, "rows": rows,
            "decided": not reasons, "reason": "; ".join(reasons)}


def accuracy_table(runs: Sequence[Mapping]) -> List[dict]:
    """One row per training run: final and held-out loss, the first step (which compiles, where
    the run was compiled), time per step after it, peak memory, status."""
    return [{"run": r["label"], "steps": r.get("steps"), "final loss": r.get("final_loss"),
             "held-out loss": r.get("val_loss"), "first step s": r.get("first_step_s"),
             "ms/step": r.get("ms_per_step"), "peak GiB": r.get("peak_gib"),
             "FP8 layers": r.get("float8_layers"),
             "status": r.get("status")} for r in runs]


# --- 4. what not to convert: the module filter ---------------------------------------------------

def conversion_plan(model: nn.Module, min_features: int = 2048, keep_first: bool = True,
                    keep_last: bool = True) -> List[dict]:
    """Which ``nn.Linear`` layers of ``model`` to train in FP8, and why the others stay in bf16.

    Kept in bf16: the first and the last Linear (next to the embedding and the logits, where
    quantization error costs the most accuracy), layers with a dimension not divisible by 16
    (FP8 GEMMs require it), and small layers (a dimension under ``min_features``: the casts and
    scales cost more time than the FP8 GEMM saves). Works on a model on the meta device.
    """
    check_int("min_features", min_features, 1)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    rows = []
    for i, (name, m) in enumerate(linears):
        k, n = m.in_features, m.out_features
        if keep_first and i == 0:
            reason = "first layer: errors here reach every layer after it"
        elif keep_last and i == len(linears) - 1:
            reason = "last layer: produces the logits the loss reads"
        elif k % 16 or n % 16:
            reason = "a dimension not divisible by 16 (FP8 GEMMs need multiples of 16)"
        elif min(k, n) < min_features:
            reason = f"small: {min(k, n):,} < {min_features:,} features, casts cost more than FP8 saves"
        else:
            reason = ""
        rows.append({"layer": name, "in": k, "out": n, "params": k * n,
                     "precision": "bf16" if reason else "float8",
                     "reason": reason or f"large GEMM: both dimensions >= {min_features:,}"})
    return rows


def module_filter(plan: Sequence[Mapping]) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn`` for a ``conversion_plan``: True for the layers to convert."""
    chosen = frozenset(r["layer"] for r in plan if r["precision"] == "float8")
    return lambda module, fqn: fqn in chosen


def torchao_auto_filter(recipe: str = "tensorwise") -> Optional[Callable[[nn.Module, str], bool]]:
    """torchao's own size heuristic (``_auto_filter_for_recipe``, measured on H100s), or None where
    torchao or that (experimental) function is missing."""
    check_choice("recipe", recipe, FP8_RECIPES)
    try:
        api = _float8_api()
        return api._auto_filter_for_recipe(recipe, filter_fqns=[])
    except (RuntimeError, AttributeError, ImportError):
        return None


def example_transformer(d_model: int = 2048, n_layers: int = 2, vocab_size: int = 50257,
                        n_heads: int = 16, seq_len: int = 1024) -> nn.Module:
    """A GPT-style ``TinyTransformer`` on the meta device (no memory): a model to plan for.

    The default vocabulary is GPT-2's 50,257 tokens, not a multiple of 16.
    """
    check_int("d_model", d_model, 16)
    with torch.device("meta"):
        return _models.TinyTransformer(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                                       n_heads=n_heads, seq_len=seq_len)


def plan_table(model: nn.Module, min_features: int = 2048, recipe: str = "tensorwise",
               convert: bool = True) -> List[dict]:
    """``conversion_plan`` rows with torchao's heuristic beside them and, where torchao is
    installed and ``convert``, what ``convert_to_float8_training`` actually swapped (on a copy of
    the model's structure; meta-device models cost no memory)."""
    plan = conversion_plan(model, min_features)
    auto = torchao_auto_filter(recipe)
    mods = dict(model.named_modules())
    converted = None
    if convert and auto is not None:
        import copy
        clone = copy.deepcopy(model)
        convert_to_float8(clone, recipe, module_filter(plan))
        converted = set(float8_layers(clone))
    for r in plan:
        r["torchao auto filter"] = "-" if auto is None else \
            ("float8" if auto(mods[r["layer"]], r["layer"]) else "bf16")
        r["converted by torchao"] = "-" if converted is None else \
            ("yes" if r["layer"] in converted else "no")
    return plan


# --- 5. findings, stated as measurements ---------------------------------------------------------

def findings(support: FP8Support, speed_rows: Sequence[Mapping], comparison: Mapping,
             width: int = 4096) -> List[str]:
    """What this run measured, in sentences (no article makes FP8 claims, so nothing is judged):
    speed-ups by width, peak memory at ``width``, and FP8's final loss against the bf16 spread,
    or ``Not decided here`` with the reason."""
    lines = [support.line()]
    measured = [r for r in speed_rows if r.get("step_ms") is not None]
    if not measured:
        why = next((r["status"] for r in speed_rows), f"{NOT_MEASURED}: no rows")
        lines.append(f"Speed: {why}.")
    for recipe in FP8_RECIPES:
        parts = [f"{r['speedup']:.2f}x at {r['width']:,}" for r in speed_rows
                 if r["recipe"] == recipe and r.get("speedup") is not None]
        if parts:
            lines.append(f"Speed, float8 {recipe} against compiled bf16 (one step, this run): "
                         + ", ".join(parts) + ".")
    at = [r for r in speed_rows if r["width"] == width and r.get("peak_gib") is not None]
    if at:
        lines.append(f"Peak memory at width {width:,}: "
                     + ", ".join(f"{r['recipe']} {r['peak_gib']:.1f} GiB" for r in at) + ".")
    for row in comparison.get("rows", []):
        if row["difference"] is None:
            continue
        spread = comparison["spread"]
        where = ("within" if row["within"] else f"outside, by {abs(row['difference']) - spread:.4f},")
        lines.append(f"Accuracy after {plural(comparison['steps'], 'step')}: {row['run']} "
                     f"ended at "
                     f"{row['final_loss']:.4f}, bf16 with the same seed at "
                     f"{row['bf16_same_seed']:.4f} (difference {row['difference']:+.4f}); the "
                     f"bf16 seeds spread {spread:.4f}, so the difference is {where} that spread.")
    if not comparison.get("decided"):
        lines.append(f"Not decided here whether FP8 trains as well as bf16: {comparison['reason']}.")
    return lines


# --- 6. what the lesson publishes (``report.publish``: the README's results section) -------------

SPEED_REPORT_COLUMNS = ("width", "recipe", "step ms", "speed-up over bf16", "peak GiB", "status")
ACCURACY_REPORT_COLUMNS = ("run", "steps", "final loss", "held-out loss",
                           "FP8 minus bf16 (same seed)", "bf16 seed spread", "within the spread",
                           "status")


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(float(value), digits)


def speed_report_rows(rows: Sequence[Mapping]) -> List[dict]:
    """``speed_sweep`` rows as the table the lesson publishes: width, recipe, median step (ms),
    speed-up over compiled bf16 of the same width, peak GiB and a status.

    Only a row whose status is ``measured`` carries numbers; every other row (no FP8 tensor
    cores, no torchao, out of memory, a failure) has no number at all and its status says
    ``not measured: <reason>``.
    """
    if not rows:
        raise ValueError("rows must hold at least one row (see speed_sweep)")
    out = []
    for r in rows:
        measured = r.get("status") == "measured" and r.get("step_ms") is not None
        status = r.get("status") or NOT_MEASURED
        if not measured and not str(status).startswith(NOT_MEASURED):
            status = f"{NOT_MEASURED}: {status}"
        out.append({"width": r["width"], "recipe": r["recipe"],
                    "step ms": _round(r.get("step_ms"), 2) if measured else None,
                    "speed-up over bf16": _round(r.get("speedup"), 2) if measured else None,
                    "peak GiB": _round(r.get("peak_gib"), 2) if measured else None,
                    "status": "measured" if measured else status})
    return out


def accuracy_report_rows(runs: Sequence[Mapping], comparison: Mapping,
                         support: FP8Support) -> List[dict]:
    """``accuracy_runs`` and their ``loss_comparison`` as the table the lesson publishes: one row
    per run (each bf16 seed, then each FP8 run), with its final and held-out loss and, on FP8
    rows, the difference from bf16 with the same seed, the bf16 seed spread and whether the
    difference is within it.

    Every run that trained shows its final and held-out loss. The comparison columns are filled
    only where the comparison was made with FP8 on FP8 tensor cores (``support.available``) and
    decided (enough steps, two or more bf16 seeds, an FP8 run); a run that trained but cannot be
    compared says ``measured, not compared: <reason>`` (``tables.not_compared``), and a run that
    did not train says ``not measured: <reason>`` with no numbers. Losses are text with four
    decimals: they differ in the third, which a two-decimal table would hide.
    """
    if not runs:
        raise ValueError("runs must hold at least one run (see accuracy_runs)")
    if not support.available:
        why = support.reason or "FP8 matmuls do not run here"
    elif not comparison.get("decided"):
        why = comparison.get("reason") or "the comparison was not decided"
    else:
        why = ""
    by_run = {row["run"]: row for row in comparison.get("rows", [])}
    spread = comparison.get("spread")
    loss = lambda v: None if v is None else f"{v:.4f}"  # noqa: E731
    out = []
    for r in runs:
        row = {c: None for c in ACCURACY_REPORT_COLUMNS}
        row.update(run=r["label"], steps=r.get("steps"))
        if r.get("status") != "trained":
            row["status"] = f"{NOT_MEASURED}: {r.get('status')}"
            out.append(row)
            continue
        row.update({"final loss": loss(r["final_loss"]), "held-out loss": loss(r.get("val_loss")),
                    "status": not_compared(why) if why else "measured"})
        if why:
            out.append(row)
            continue
        cmp = by_run.get(r["label"]) if r["recipe"] != "bf16" else None
        if cmp is not None and cmp.get("difference") is not None:
            row.update({"FP8 minus bf16 (same seed)": f"{cmp['difference']:+.4f}",
                        "bf16 seed spread": loss(spread), "within the spread": cmp["within"]})
        out.append(row)
    return out


# --- tables and figures ---------------------------------------------------------------------------

def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value == 0:
            return "0"
        if abs(value) >= 1e5 or abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_rows(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None) -> str:
    """Rows of dicts as an aligned plain-text table (numbers to 4 significant digits), through the
    course's one table formatter (``tables.text_table``) with this lesson's number style."""
    if not rows:
        raise ValueError("rows must hold at least one row")
    return text_table(rows, list(columns or rows[0].keys()), cell=_cell)


def show_rows(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None,
              title: str = "") -> None:
    """Show rows in the notebook as a table (``report.show_table``: HTML, with ``format_rows``'s
    text as the fallback) in this lesson's number style."""
    if not rows:
        raise ValueError("rows must hold at least one row")
    show_table(rows, list(columns or rows[0].keys()), title=title, cell=_cell)


def error_figure(rows: Sequence[Mapping], title: str = "FP8 round-trip error of real tensors"):
    """Relative error (%) of activations, weights and gradients per scaling, e4m3 and e5m2 side by
    side (``error_table`` or ``error_summary`` rows; layers averaged)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    summary = error_summary(rows) if rows and "layer" in rows[0] else list(rows)
    if not summary:
        raise ValueError("rows must hold at least one row (see error_table)")
    formats = [f for f in FORMATS if any(r["format"] == f for r in summary)]
    fig = make_subplots(rows=1, cols=len(formats), shared_yaxes=True,
                        subplot_titles=[f"{f} ({FORMATS[f]})".replace("torch.", "")
                                        for f in formats])
    colors = {"none": "#b0b0b0", "tensorwise": "#1f77b4", "rowwise": "#ff7f0e"}
    for col, fmt in enumerate(formats, start=1):
        for scaling in SCALINGS:
            sel = {r["tensor"]: r for r in summary if r["format"] == fmt and r["scaling"] == scaling}
            if not sel:
                continue
            kinds = [k for k in TENSOR_KINDS if k in sel]
            fig.add_trace(go.Bar(
                x=kinds, y=[max(100 * sel[k]["rel_error"], 1e-3) for k in kinds],
                name=f"scale: {scaling}", legendgroup=scaling, showlegend=col == 1,
                marker_color=colors[scaling],
                customdata=[100 * sel[k]["underflow"] for k in kinds],
                hovertemplate="%{x}: %{y:.3g}% error, %{customdata:.1f}% flushed to 0"),
                row=1, col=col)
    fig.update_yaxes(type="log", title_text="relative error (%, log scale)", row=1, col=1)
    fig.update_xaxes(title_text="tensor (lesson 02's MLP on digits)")
    fig.update_layout(title=title, barmode="group", height=380, legend_title_text="scaling")
    return fig


def speed_figure(rows: Sequence[Mapping],
                 title: str = "FP8 training step: speed-up over compiled bf16 by width"):
    """Speed-up over compiled bf16 (x) against MLP width, one line per float8 recipe; where
    nothing was measured, the figure says why."""
    import plotly.graph_objects as go

    if not rows:
        raise ValueError("rows must hold at least one row (see speed_sweep)")
    fig = go.Figure()
    widths = sorted({r["width"] for r in rows})
    for recipe, color in zip(FP8_RECIPES, ("#1f77b4", "#ff7f0e")):
        pts = sorted((r["width"], r["speedup"], r.get("step_ms"), r.get("peak_gib")) for r in rows
                     if r["recipe"] == recipe and r.get("speedup") is not None)
        if pts:
            fig.add_trace(go.Scatter(
                x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                name=f"float8 {recipe}", line_color=color,
                customdata=[[p[2], p[3]] for p in pts],
                hovertemplate="width %{x}: %{y:.2f}x (step %{customdata[0]:.1f} ms, "
                              "peak %{customdata[1]:.1f} GiB)"))
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray",
                  annotation_text="compiled bf16 = 1x", annotation_position="bottom right")
    if not fig.data:
        why = next((r["status"] for r in rows), NOT_MEASURED)
        fig.add_annotation(text=why[:110] + ("..." if len(why) > 110 else ""), showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.6)
    fig.update_xaxes(type="log", tickvals=widths, ticktext=[f"{w:,}" for w in widths],
                     title_text="MLP width d (Linear d -> 4d -> d, log scale)")
    fig.update_yaxes(title_text="speed-up over compiled bf16 (x, step time ratio)", rangemode="tozero")
    fig.update_layout(title=title, height=380)
    return fig


def _smooth(values: Sequence[float], window: int) -> List[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_figure(runs: Sequence[Mapping], title: Optional[str] = None, smooth: Optional[int] = None):
    """Training loss curves (left) and each FP8 run's gap to the baseline with the same seed against
    the band that the baseline's seeds span (right); curves smoothed over ``smooth`` steps (default:
    2%). The baseline is named as it ran: bf16, or fp32 on a GPU without bf16 (a T4)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    trained = [r for r in runs if r.get("status") == "trained"]
    if not trained:
        raise ValueError("runs must hold at least one trained run (see accuracy_runs)")
    steps = min(len(r["losses"]) for r in trained)
    window = smooth or max(1, steps // 50)
    check_int("smooth", window, 1)
    curves = {r["label"]: _smooth(r["losses"][:steps], window) for r in trained}
    x = list(range(1, steps + 1))
    base = [r for r in trained if r["recipe"] == "bf16"]
    name = "fp32" if any(r["label"].startswith("fp32") for r in base) else "bf16"
    title = title or f"A small GPT on the standard library: {name} against FP8"
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "training loss", f"FP8 minus {name} (same seed), and the {name} seed band"))
    for r in trained:
        fp8 = r["recipe"] != "bf16"
        fig.add_trace(go.Scatter(x=x, y=curves[r["label"]], name=r["label"], mode="lines",
                                 line=dict(width=2 if fp8 else 1, dash=None if fp8 else "dot")),
                      row=1, col=1)
    if base:
        ref = {r["seed"]: curves[r["label"]] for r in base}
        first = curves[base[0]["label"]]
        if len(base) >= 2:
            lo = [min(curves[b["label"]][i] for b in base) - first[i] for i in range(steps)]
            hi = [max(curves[b["label"]][i] for b in base) - first[i] for i in range(steps)]
            fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself",
                                     fillcolor="rgba(128,128,128,0.25)", line=dict(width=0),
                                     name=f"{name} seeds (min to max) minus {name} seed "
                                          f"{base[0]['seed']}", hoverinfo="skip"), row=1, col=2)
        for r in trained:
            if r["recipe"] != "bf16" and r["seed"] in ref:
                gap = [a - b for a, b in zip(curves[r["label"]], ref[r["seed"]])]
                fig.add_trace(go.Scatter(x=x, y=gap, mode="lines", name=f"{r['label']} minus {name}",
                                         line=dict(width=2)), row=1, col=2)
    fig.add_hline(y=0, line_color="gray", line_dash="dash", row=1, col=2)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="cross-entropy (nats per byte)", row=1, col=1)
    fig.update_yaxes(title_text="loss difference (nats per byte)", row=1, col=2)
    fig.update_layout(title=f"{title} (smoothed over {plural(window, 'step')})", height=420)
    return fig
