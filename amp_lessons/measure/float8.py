"""FP8 training measured: whether FP8 runs here (``fp8_support``), torchao's float8 conversion
(``conversion_plan``: which layers), the timed step of an MLP stack per width and float8 recipe
(``Float8Config``, ``time_recipe``, ``speed_sweep``: lesson 07's speed part, through the engine's
timer, out-of-memory classifier and memory release), and a small GPT trained in bf16 or a float8
recipe (``train_gpt``: lesson 07's accuracy runs)."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import models as _models
from amp_lessons.numerics.modes import kept_modes
from amp_lessons.validate import check_choice, check_int, check_positive
from amp_lessons.data import Corpus, batch_offsets, text_batch
from amp_lessons.env import CARD_FACTS, device_capability, simulated_card
from amp_lessons.measure.memory import GIB
from amp_lessons.measure.oom import free_memory, is_out_of_memory
from amp_lessons.measure.timer import repeat_spread, summarize_times, time_steps

RECIPES = ("bf16", "tensorwise", "rowwise")
FP8_RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
NOT_MEASURED = "not measured"
TORCHAO_REQUIREMENT = "torchao>=0.18"  # the same as pyproject.toml's torchao extra (a test checks)
INSTALL_HINT = f'`make torchao` in the course\'s clone, or `pip install "{TORCHAO_REQUIREMENT}"`'


def check_ints(name: str, values, low: int) -> Tuple[int, ...]:
    """``values`` as a tuple of integers >= ``low``; a ``ValueError`` names ``name`` otherwise."""
    values = tuple(values) if isinstance(values, (list, tuple)) else values
    if not isinstance(values, tuple) or not values:
        raise ValueError(f"{name} must be a non-empty sequence of integers >= {low}; got {values!r}")
    for v in values:
        check_int(f"each of {name}", v, low)
    return values


@contextlib.contextmanager
def quiet() -> Iterator[None]:
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
        with quiet():
            module = importlib.import_module("torchao")
    except Exception:  # noqa: BLE001 - a broken install counts as not installed
        return None
    return str(getattr(module, "__version__", "unknown"))


def float8_api():
    """torchao.float8, imported on first use; RuntimeError with the install hint where missing."""
    if torchao_version() is None:
        raise RuntimeError(f"torchao not installed ({INSTALL_HINT})")
    with quiet():
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
    api = float8_api()
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
    api = float8_api()
    config = float8_config(recipe, emulate)
    with quiet():
        return api.convert_to_float8_training(model, config=config,
                                              module_filter_fn=module_filter_fn)


def float8_layers(model: nn.Module) -> List[str]:
    """Names of the layers torchao converted (its ``Float8Linear``), in module order."""
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def compile_blocks(blocks: Union[nn.Sequential, nn.ModuleList]) -> List[nn.Module]:
    """Compile each block on its own ("regional" compilation), in place.

    The blocks are identical, so inductor's caches serve blocks 2-4 from block 1's compilation,
    and compiling takes about a quarter of the time of compiling the whole stack. Returns the
    uncompiled blocks (same parameters), so a caller can put them back (see lesson 07's
    ``train_gpt``).
    """
    originals = list(blocks)
    for i in range(len(blocks)):
        blocks[i] = torch.compile(originals[i], dynamic=False)
    return originals


@dataclass(frozen=True)
class Float8Config:
    """One FP8 speed configuration: ``model`` kind (``"mlp-stack"``: ``blocks`` x the transformer
    MLP at ``width``), the float8 ``recipe`` (``"bf16"`` for the baseline), ``tokens`` rows per
    step, fused AdamW at ``lr``, each block compiled unless ``compile`` is False, ``emulate``:
    FP8 casts with high-precision matmuls (no FP8 tensor cores needed)."""

    width: int
    recipe: str = "tensorwise"
    model: str = "mlp-stack"
    tokens: int = 16384
    blocks: int = 4
    compile: bool = True
    emulate: bool = False
    lr: float = 1e-4

    def __post_init__(self):
        check_choice("recipe", self.recipe, RECIPES)
        check_choice("model", self.model, ("mlp-stack",))
        check_int("width", self.width, 16)
        check_int("tokens", self.tokens, 1)
        check_int("blocks", self.blocks, 1, 64)
        check_positive("lr", self.lr)


def time_recipe(recipe: str, width: int, tokens: int = 16384, blocks: int = 4, steps: int = 10,
                warmup: int = 3, device: Union[str, torch.device, None] = None,
                compile: bool = True, emulate: bool = False, lr: float = 1e-4) -> dict:
    """``measure_float8`` of ``Float8Config(width, recipe, tokens=..., blocks=...)``."""
    check_choice("recipe", recipe, RECIPES)
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 1)
    config = Float8Config(width=width, recipe=recipe, tokens=tokens, blocks=blocks,
                          compile=compile, emulate=emulate, lr=lr)
    return measure_float8(config, steps=steps, warmup=warmup, device=device)


def measure_float8(config: Float8Config, steps: int = 10, warmup: int = 3,
                   device: Union[str, torch.device, None] = None) -> dict:
    """Train ``mlp_stack(width, blocks)`` on ``tokens`` rows for ``warmup`` + ``steps`` steps.

    bf16 autocast, fused AdamW (on CUDA), MSE against a fixed random target; ``recipe`` is
    ``bf16`` or a torchao float8 recipe. The model is built directly on ``device`` (initialising
    two billion weights on the CPU and copying them over took longer than timing them). Peak
    memory is reset before the model is built, so it counts weights, gradients, optimizer state
    and activations. The first (compiling) step is timed on its own; the rest go through the
    engine's timer (``timer.time_steps``: CUDA events on a GPU). Returns the median step, the
    spread of the timed steps (largest minus smallest, in % of the median; ``spread``: how much
    the repeats disagree), peak GiB, TFLOP/s, the time of the first step and the loss.
    """
    if not isinstance(config, Float8Config):
        raise ValueError(f"config must be a Float8Config; got {type(config).__name__}")
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 1)
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    free_memory(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:  # weights are created and initialised on the device itself
        model = mlp_stack(config.width, config.blocks)
    n_params = sum(p.numel() for p in model.parameters())
    if config.recipe != "bf16":
        convert_to_float8(model, config.recipe, emulate=config.emulate)
    if config.compile:
        compile_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, fused=cuda)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(config.tokens, config.width, device=device, generator=g)
    target = torch.randn(config.tokens, config.width, device=device, generator=g)

    def step(inputs, wanted):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(inputs)
        loss = F.mse_loss(out.float(), wanted)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    with quiet():
        t0 = time.perf_counter()
        step(x, target)  # the first step compiles
        if cuda:
            torch.cuda.synchronize(device)
        first_s = time.perf_counter() - t0
        timing = time_steps(step, x, target, warmup=warmup - 1, steps=steps, device=device,
                            reset_peak=False)
    step_times = timing["times_ms"]
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    step_ms = summarize_times(step_times, config.tokens)["step_ms"]
    flops = 6.0 * n_params * config.tokens
    result = {"width": config.width, "recipe": config.recipe, "step_ms": step_ms,
              "speedup": None, "peak_gib": peak, "tflops": flops / (step_ms * 1e-3) / 1e12,
              "params": n_params,
              "spread_pct": 100 * (max(step_times) - min(step_times)) / step_ms,
              "spread": repeat_spread(step_times), "steps": steps, "warmup": warmup,
              "timer": timing["timer"], "first_step_s": first_s, "loss": timing["loss"],
              "status": "measured", "config": dataclasses.asdict(config)}
    del model, opt, x, target
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
    widths = check_ints("widths", widths, 16)
    for r in recipes:
        check_choice("recipes", r, RECIPES)
    support = support if support is not None else fp8_support(device)
    rows: List[dict] = []
    for width in widths:
        for recipe in recipes:
            base = {"width": width, "recipe": recipe, "step_ms": None, "speedup": None, "spread": None,
                    "peak_gib": None, "tflops": None, "spread_pct": None}
            if not support.available:
                rows.append({**base, "status": f"{NOT_MEASURED}: {support.reason}"})
                continue
            try:
                rows.append(measure_float8(Float8Config(width=width, recipe=recipe,
                                                        tokens=tokens, blocks=blocks,
                                                        compile=compile),
                                           steps=steps, warmup=warmup, device=device))
            except Exception as exc:  # noqa: BLE001 - one configuration's failure is a row
                what = "out of memory" if is_out_of_memory(exc) else \
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
                rows.append({**base, "status": f"{NOT_MEASURED}: {what}"})
            finally:
                if compile:
                    torch._dynamo.reset()  # fresh caches: no recompile limit, no dynamic shapes
                free_memory(device)
    for r in rows:
        b = next((o for o in rows if o["width"] == r["width"] and o["recipe"] == "bf16"), None)
        if r["step_ms"] and b and b["step_ms"]:
            r["speedup"] = b["step_ms"] / r["step_ms"]
    return rows



# --- a small GPT trained in bf16 or a float8 recipe (lesson 07's accuracy runs) ----------------


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor at ``step``: linear warm-up over ``warmup`` steps, then cosine
    decay to 10% at ``steps``."""
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
    losses = []
    with kept_modes(model, False):  # each module's own mode comes back afterwards
        for row in offsets:
            x, y = text_batch(text, row, seq_len)
            with torch.autocast(text.device.type, dtype=amp_dtype or torch.float32,
                                enabled=amp_dtype is not None):
                losses.append(_models.lm_loss(model(x), y))
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
    free_memory()
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup_steps))
    losses = torch.zeros(steps, device=device)
    originals = compile_blocks(model.blocks) if compile else None
    first_s = 0.0
    started = time.perf_counter()
    try:
        with quiet():
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
    with quiet():
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

