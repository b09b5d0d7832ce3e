"""FP8 on whole GPTs: the compiled training step of a GPT in bf16 and in each torchao float8
recipe, timed, profiled into GEMM / attention / FP8 casts / optimizer / other, with its peak
memory and compile time (``GPTShape``, ``measure_gpt_step``, ``gpt_speed_sweep``), and the loss
of the same GPT trained on real text over several seeds per recipe (``parity_runs``).

Lesson 10 runs these; the model is the course's ``models.TinyTransformer`` (a GPT-2-style
decoder, pre-LayerNorm, biases, an untied LM head) at GPT sizes. The LM head stays in bf16
(``fp8_predict.gpt_body_filter``); every block is compiled on its own (``float8.compile_blocks``:
the blocks are identical, so one compilation serves them all).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from amp_lessons import models as _models
from amp_lessons.data import Corpus, batch_offsets, text_batch
from amp_lessons.measure.float8 import (FP8Support, compile_blocks, evaluate, float8_api,
                                        fp8_support, lr_factor, quiet)
from amp_lessons.measure.fp8_predict import gpt_body_filter
from amp_lessons.measure.memory import GIB
from amp_lessons.measure.oom import free_memory, is_out_of_memory
from amp_lessons.measure.timer import cupti_teardown, interval_union, repeat_spread, time_steps
from amp_lessons.validate import check_choice, check_int, check_positive

GPT_RECIPES = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp")
GPT_FP8_RECIPES = GPT_RECIPES[1:]
NOT_MEASURED = "not measured"
KERNEL_KINDS = ("gemm", "attention", "fp8 cast", "optimizer", "other")


@dataclass(frozen=True)
class GPTShape:
    """A GPT's size: ``d_model`` wide, ``n_layers`` blocks of ``n_heads`` heads, a vocabulary
    of ``vocab_size`` (50,304: GPT-2's 50,257 rounded up to a multiple of 64) and sequences of
    ``seq_len`` tokens. ``build()`` makes the ``models.TinyTransformer`` of that size on the
    current default device (``with torch.device(...)``)."""

    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int = 50304
    seq_len: int = 1024
    mlp_ratio: int = 4

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "vocab_size", "seq_len", "mlp_ratio"):
            check_int(name, getattr(self, name), 1)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model must be a multiple of n_heads; got {self.d_model} and "
                             f"{self.n_heads}")

    def params(self) -> int:
        """Parameters of ``build()``, counted without building it."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.n_layers * block + (self.vocab_size + self.seq_len) * d + 2 * d \
            + d * self.vocab_size

    @property
    def label(self) -> str:
        """``"406M d1024 x24"``: parameters, width and depth."""
        p = self.params()
        size = f"{p / 1e9:.2f}B" if p >= 1e9 else f"{p / 1e6:.0f}M" if p >= 1e7 else \
            f"{p / 1e6:.2f}M"
        return f"{size} d{self.d_model} x{self.n_layers}"

    def build(self) -> _models.TinyTransformer:
        return _models.TinyTransformer(vocab_size=self.vocab_size, d_model=self.d_model,
                                       n_layers=self.n_layers, n_heads=self.n_heads,
                                       seq_len=self.seq_len, mlp_ratio=self.mlp_ratio)


def convert_gpt(model: nn.Module, recipe: str, emulate: bool = False,
                module_filter_fn: Callable[[nn.Module, str], bool] = gpt_body_filter) -> nn.Module:
    """torchao's ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)``
    (``tensorwise``, ``rowwise`` or ``rowwise_with_gw_hp``), the blocks' Linears only by default
    (the LM head stays in bf16). ``emulate``: FP8 numerics without FP8 tensor cores."""
    check_choice("recipe", recipe, GPT_FP8_RECIPES)
    api = float8_api()
    config = api.Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    with quiet():
        return api.convert_to_float8_training(model, config=config,
                                              module_filter_fn=module_filter_fn)


# --- where a step's time goes: kernels by kind, from the profiler -----------------------------------

_ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn")
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "matmul", "wgmma", "splitk")
_CAST = ("amax", "abs", "clamp", "reciprocal", "float8", "fp8")
_OPTIMIZER = ("adam", "multi_tensor")


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, from its name.

    Compiled kernels first (inductor's ``triton_*``: they are named after every op fused into
    them, so a pointwise kernel that follows a ``_scaled_mm`` carries its name without being a
    matrix product): ``gemm`` only for inductor's matmul templates (``triton_tem_*``), ``fp8 cast``
    where it computes an amax (``abs``/``amax``) or saturates into FP8's range (``clamp``,
    ``reciprocal``: torchao's casts, with whatever inductor fused into them; the bf16 GPT has no
    such op), else ``other``. Library kernels: ``attention`` (flash / memory-efficient / cuDNN
    attention), ``gemm`` (cuBLAS, cuBLASLt's nvjet, CUTLASS: every matrix product, FP8 or not),
    ``optimizer`` (fused AdamW), else ``other`` (norms, the loss, copies).
    """
    n = name.lower()
    if n.startswith("triton"):
        if n.startswith("triton_tem"):
            return "gemm"
        return "fp8 cast" if any(s in n for s in _CAST) else "other"
    if any(s in n for s in _ATTENTION):
        return "attention"
    if any(s in n for s in _GEMM):
        return "gemm"
    if any(s in n for s in _OPTIMIZER):
        return "optimizer"
    return "other"


def kernel_split(step: Callable, x: torch.Tensor, y: torch.Tensor, steps: int = 2,
                 device=None) -> Optional[dict]:
    """Run ``steps`` steps under ``torch.profiler`` (device activity only) and add up the GPU
    kernels' time per ``kernel_kind``: ms per step for each kind, ``busy_ms`` (the union of all
    device intervals) and the three longest kernels of each kind (``top``). None off CUDA."""
    from torch.profiler import ProfilerActivity, profile
    check_int("steps", steps, 1)
    device = torch.device(device) if device is not None else x.device
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with cupti_teardown(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(x, y)
        torch.cuda.synchronize(device)
    per_kind: Dict[str, float] = defaultdict(float)
    per_name: Dict[str, float] = defaultdict(float)
    spans = []
    for e in prof.events():
        if not getattr(e.device_type, "name", str(e.device_type)).upper().endswith("CUDA"):
            continue
        start, end = e.time_range.start, e.time_range.end
        spans.append((start, end))
        per_kind[kernel_kind(e.name)] += (end - start) / 1e3
        per_name[e.name] += (end - start) / 1e3
    out = {kind: per_kind.get(kind, 0.0) / steps for kind in KERNEL_KINDS}
    out["busy_ms"] = interval_union(spans) / 1e3 / steps
    out["top"] = {kind: sorted(((ms / steps, name[:90]) for name, ms in per_name.items()
                                if kernel_kind(name) == kind), reverse=True)[:3]
                  for kind in KERNEL_KINDS}
    return out


# --- the timed step --------------------------------------------------------------------------------

def measure_gpt_step(shape: GPTShape, recipe: str = "bf16", batch_size: int = 8, steps: int = 10,
                     warmup: int = 3, profile_steps: int = 2,
                     device: Union[str, torch.device, None] = None, compile: bool = True,
                     emulate: bool = False, lr: float = 3e-4) -> dict:
    """Train ``shape``'s GPT for ``warmup`` + ``steps`` steps on random tokens and measure it.

    bf16 autocast, fused AdamW (on CUDA), next-token loss on ``batch_size`` sequences of
    ``shape.seq_len`` tokens; ``recipe`` is ``bf16`` or a torchao float8 recipe (``convert_gpt``).
    Each block compiled on its own where ``compile``. Peak memory is reset before the model is
    built (weights, gradients, AdamW state and activations all count). The first step, which
    compiles, is timed on its own (``compile_s``: it minus the median step); the timed steps go
    through the engine's timer (CUDA events on a GPU); ``profile_steps`` more run under the
    profiler (``kernel_split``). Returns one row.
    """
    check_choice("recipe", recipe, GPT_RECIPES)
    check_int("batch_size", batch_size, 1)
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 1)
    check_int("profile_steps", profile_steps, 0)
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    free_memory(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:
        model = shape.build()
    if recipe != "bf16":
        convert_gpt(model, recipe, emulate=emulate)
    if compile:
        compile_blocks(model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, shape.vocab_size, (batch_size, shape.seq_len), device=device, generator=g)
    y = torch.randint(0, shape.vocab_size, (batch_size, shape.seq_len), device=device, generator=g)

    def step(inputs, targets):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = _models.lm_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    with quiet():
        t0 = time.perf_counter()
        step(x, y)
        if cuda:
            torch.cuda.synchronize(device)
        first_s = time.perf_counter() - t0
        timing = time_steps(step, x, y, warmup=warmup - 1, steps=steps, device=device,
                            reset_peak=False)
        split = kernel_split(step, x, y, profile_steps, device) if cuda and profile_steps else None
    times = timing["times_ms"]
    step_ms = statistics.median(times)
    tokens = batch_size * shape.seq_len
    row = {"model": shape.label, "d_model": shape.d_model, "n_layers": shape.n_layers,
           "params": shape.params(), "recipe": recipe, "tokens_per_step": tokens,
           "step_ms": step_ms, "tokens_per_s": tokens / (step_ms / 1e3),
           "min_ms": min(times), "max_ms": max(times),
           "spread_pct": 100 * (max(times) - min(times)) / step_ms,
           "spread": repeat_spread(times), "speedup": None,
           "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
           "first_step_s": first_s, "compile_s": max(first_s - step_ms / 1e3, 0.0),
           "loss": timing["loss"], "steps": steps, "warmup": warmup, "timer": timing["timer"],
           "split": split, "idle_ms": max(step_ms - split["busy_ms"], 0.0) if split else None,
           "status": "measured", "emulated": bool(emulate and recipe != "bf16"),
           "shape": dataclasses.asdict(shape), "batch_size": batch_size}
    del model, opt, x, y
    return row


def gpt_speed_sweep(shapes: Sequence[GPTShape], recipes: Sequence[str] = GPT_RECIPES,
                    batch_size: int = 8, steps: int = 10, warmup: int = 3,
                    profile_steps: int = 2, support: Optional[FP8Support] = None,
                    device: Union[str, torch.device, None] = None, compile: bool = True,
                    progress: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """``measure_gpt_step`` for every shape and recipe, bf16 first; ``speedup`` = bf16's step
    time over the recipe's, same shape, same run. FP8 rows where FP8 cannot run
    (``support.available`` false), and any configuration that runs out of memory or fails, are
    rows ``not measured: <reason>``, never raised. ``progress(row)`` is called after each row."""
    if not shapes:
        raise ValueError("shapes must hold at least one GPTShape")
    for r in recipes:
        check_choice("recipes", r, GPT_RECIPES)
    support = support if support is not None else fp8_support(device)
    rows: List[dict] = []
    for shape in shapes:
        for recipe in recipes:
            base = {"model": shape.label, "d_model": shape.d_model, "n_layers": shape.n_layers,
                    "params": shape.params(), "recipe": recipe, "step_ms": None,
                    "tokens_per_s": None, "speedup": None, "peak_gib": None, "split": None,
                    "compile_s": None, "spread": None, "spread_pct": None, "idle_ms": None,
                    "shape": dataclasses.asdict(shape), "batch_size": batch_size}
            if recipe != "bf16" and not support.available:
                rows.append({**base, "status": f"{NOT_MEASURED}: {support.reason}"})
            else:
                try:
                    rows.append(measure_gpt_step(shape, recipe, batch_size, steps, warmup,
                                                 profile_steps, device, compile))
                except Exception as exc:  # noqa: BLE001 - one configuration's failure is a row
                    text = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                    what = "out of memory" if is_out_of_memory(exc) else \
                        f"{type(exc).__name__}: {text}"
                    rows.append({**base, "status": f"{NOT_MEASURED}: {what}"})
                finally:
                    if compile:
                        torch._dynamo.reset()
                    free_memory(device)
            if progress is not None:
                progress(rows[-1])
    for r in rows:
        b = next((o for o in rows if o["model"] == r["model"] and o["recipe"] == "bf16"), None)
        if r["step_ms"] and b and b["step_ms"]:
            r["speedup"] = b["step_ms"] / r["step_ms"]
    return rows


# --- loss parity: the same GPT on real text, several seeds per recipe --------------------------------

def parity_runs(corpus: Corpus, shape: GPTShape, recipes: Sequence[str] = GPT_RECIPES,
                seeds: Sequence[int] = (0, 1, 2), steps: int = 400, batch_size: int = 8,
                lr: float = 6e-4, warmup_steps: int = 40, eval_batches: int = 8,
                support: Optional[FP8Support] = None,
                device: Union[str, torch.device, None] = None, compile: bool = True) -> List[dict]:
    """Train ``shape``'s GPT on ``corpus`` (bytes as tokens: ``shape.vocab_size`` must be 256)
    once per recipe and seed; the same seed gives every recipe the same initial weights and the
    same batches, so runs with one seed differ only in their arithmetic.

    AdamW (betas 0.9/0.95, weight decay 0.1, fused on CUDA) at ``lr``, linear warm-up over
    ``warmup_steps`` then cosine decay to 10%, gradients clipped at 1, bf16 autocast. Each recipe
    converts and compiles its model once; each seed then loads fresh initial weights into it
    (no recompilation). Returns one run per recipe and seed: the loss of every step, the final
    loss (mean of the last 10% of steps), the held-out loss on fixed batches (``evaluate``, with
    the uncompiled blocks) and the run's seconds. An FP8 recipe where FP8 cannot run is a run
    ``not run: <reason>`` per seed.
    """
    if shape.vocab_size != 256:
        raise ValueError(f"shape.vocab_size must be 256 (byte tokens); got {shape.vocab_size}")
    for r in recipes:
        check_choice("recipes", r, GPT_RECIPES)
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    for s in seeds:
        check_int("seeds", s, 0)
    check_int("steps", steps, 1)
    check_int("warmup_steps", warmup_steps, 0)
    check_positive("lr", lr)
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    support = support if support is not None else fp8_support(device)
    train, val = corpus.train.to(device), corpus.val.to(device)
    runs = []
    for recipe in recipes:
        if recipe != "bf16" and not support.available:
            runs += [{"label": f"{recipe}, seed {s}", "recipe": recipe, "seed": s, "steps": steps,
                      "status": f"not run: {support.reason}"} for s in seeds]
            continue
        free_memory(device)
        with device:
            model = shape.build()
        if recipe != "bf16":
            convert_gpt(model, recipe)
        params = dict(model.named_parameters())  # names before compiling (no _orig_mod.)
        originals = compile_blocks(model.blocks) if compile else None
        compiled = list(model.blocks)
        try:
            for seed in seeds:
                runs.append(_train_one(model, params, compiled, originals, shape, recipe, seed,
                                       train, val, steps, batch_size, lr, warmup_steps,
                                       eval_batches, device))
        finally:
            if compile:
                torch._dynamo.reset()
        del model, params, compiled, originals
    return runs


def _train_one(model, params, compiled, originals, shape, recipe, seed, train, val, steps,
               batch_size, lr, warmup_steps, eval_batches, device) -> dict:
    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    with device:
        fresh = shape.build()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            params[name].copy_(p)
    del fresh
    for i, block in enumerate(compiled):
        model.blocks[i] = block
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup_steps))
    offsets = batch_offsets(len(train), shape.seq_len, batch_size, steps, seed).to(device)
    losses = torch.zeros(steps, device=device)
    t0 = time.perf_counter()
    with quiet():
        for i in range(steps):
            x, y = text_batch(train, offsets[i], shape.seq_len)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = _models.lm_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses[i] = loss.detach()
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        if originals is not None:  # evaluate eagerly: no second compilation for inference
            for i, block in enumerate(originals):
                model.blocks[i] = block
        val_loss = evaluate(model, val, shape.seq_len, batch_size, eval_batches)
    curve = losses.float().cpu().tolist()
    tail = curve[-max(1, steps // 10):]
    return {"label": f"{recipe}, seed {seed}", "recipe": recipe, "seed": seed, "steps": steps,
            "losses": curve, "final_loss": statistics.fmean(tail), "val_loss": val_loss,
            "seconds": seconds, "finite": all(math.isfinite(v) for v in curve),
            "params": sum(p.numel() for p in params.values()), "status": "trained"}
