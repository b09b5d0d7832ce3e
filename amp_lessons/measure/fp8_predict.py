"""Predict FP8's end-to-end speed-up from a model's ``nn.Linear`` shapes, before FP8 runs.

A converted ``nn.Linear`` (torchao's ``Float8Linear``) changes two things in a training step:

- its three GEMMs (forward, grad-input, grad-weight) run on FP8 tensor cores: faster, by a gain
  that depends on the GEMM's shape (small GEMMs gain little, 8k-wide ones nearly 2x);
- it adds casts: an amax (largest magnitude) and a scaled cast to FP8 of its input, weight and
  output gradient, transposed FP8 copies for the backward GEMMs, and (rowwise) a rescale of two
  GEMM outputs. These are memory-bound kernels, whose cost grows with the tensors' sizes.

Everything else in the step (attention, norms, activations, the loss, the optimizer) is the same
in bf16 and FP8. So, with ``T`` the measured bf16 step::

    FP8 step = T - sum over converted layers of (bf16 GEMMs - FP8 GEMMs) + sum of their casts

Both sums come from measurements on this GPU (``measure_calibration``): every distinct GEMM shape
is timed in bf16 (``torch.mm``) and FP8 (``torch._scaled_mm``, with the recipe's scales and
accumulation), and three cast kernels (a per-tensor cast, a per-row cast, a transposed FP8 copy)
are timed compiled at two sizes, which gives a fixed cost and a cost per element. Which casts a
recipe makes per layer (``CAST_PLAN``) is read off torchao's ``Float8Linear`` and counted, not
fitted to any GPT.

Entry point: ``predict_fp8_speedup(model, ...)`` (lesson 10 shows it beside the measured
speed-ups; the doctor calls it on a learner's model). ``fp8_all_gather_saving`` is the paper
model of FSDP2's FP8 all-gather at several GPUs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from amp_lessons.validate import check_choice, check_int, check_positive

PREDICT_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
GEMM_ROLES = ("forward", "grad_input", "grad_weight")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# What each torchao recipe does per converted Linear and step (torchao 0.18, float8_linear.py,
# compiled: identical casts in one graph are merged). Per tensor: how many scaled casts to FP8
# ("casts", with the scaling of each), how many transposed FP8 copies the backward GEMMs need
# ("copies": torch._scaled_mm wants its first operand row-major and its second column-major), and
# how many bf16 rescales of a GEMM output follow ("rescales": rowwise backward GEMMs run the
# per-tensor cuBLAS kernel with unit scales, then multiply by the row scales).
#   input  = the layer's input (M x K, bf16), weight = its fp32 master (N x K),
#   grad   = the gradient of its output (M x N, bf16).
CAST_PLAN: Dict[str, Dict[str, Dict[str, object]]] = {
    # forward casts input and weight once; backward casts grad once (its two uses share the
    # scale and merge); input and weight come back from the forward casts, transposed.
    "tensorwise": {"input": {"casts": ("tensorwise",), "copies": 1},
                   "weight": {"casts": ("tensorwise",), "copies": 1},
                   "grad": {"casts": ("tensorwise",), "copies": 1},
                   "rescales": {}},
    # a scale per row along K for the forward GEMM, along the other axis for the backward GEMMs:
    # every tensor is cast twice, and both backward GEMM outputs are rescaled.
    "rowwise": {"input": {"casts": ("rowwise", "rowwise"), "copies": 1},
                "weight": {"casts": ("rowwise", "rowwise"), "copies": 1},
                "grad": {"casts": ("rowwise", "rowwise"), "copies": 1},
                "rescales": {"grad_input": 1, "grad_weight": 1}},
    # rowwise forward, grad-input with a rowwise grad and a per-tensor weight, grad-weight in bf16
    # (no cast of input or grad for it).
    "rowwise_with_gw_hp": {"input": {"casts": ("rowwise",), "copies": 0},
                           "weight": {"casts": ("rowwise", "tensorwise"), "copies": 1},
                           "grad": {"casts": ("rowwise",), "copies": 0},
                           "rescales": {}},
}
# Bytes per element each timed cast kernel moves, to carry its cost to other source dtypes:
# a cast of a bf16 tensor reads it for the amax, reads it again and writes one byte (5 bytes);
# of an fp32 master weight, 4 + 4 + 1 = 9. A transposed FP8 copy reads and writes one byte (2);
# a bf16 rescale reads and writes two (4); bf16 autocast's own weight copy, which FP8 no longer
# makes, reads four bytes and writes two (6).
CAST_BYTES = {"bf16": 5.0, "fp32": 9.0}
COPY_BYTES, RESCALE_BYTES, AUTOCAST_WEIGHT_BYTES = 2.0, 4.0, 6.0


@dataclass(frozen=True)
class LinearShape:
    """One ``nn.Linear`` as a training step sees it: ``m`` rows (tokens) per step, ``k`` input
    and ``n`` output features, and whether it trains in FP8 (``converted``)."""

    name: str
    m: int
    k: int
    n: int
    converted: bool = True

    def gemm(self, role: str) -> Tuple[int, int, int]:
        """``(rows, inner, cols)`` of the role's GEMM: forward ``(M,K)@(K,N)``, grad-input
        ``(M,N)@(N,K)``, grad-weight ``(N,M)@(M,K)``."""
        check_choice("role", role, GEMM_ROLES)
        return {"forward": (self.m, self.k, self.n), "grad_input": (self.m, self.n, self.k),
                "grad_weight": (self.n, self.m, self.k)}[role]

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of its three GEMMs per step: ``6 M K N``."""
        return 6 * self.m * self.k * self.n


def fp8_shape_ok(k: int, n: int) -> bool:
    """FP8 GEMMs need both dimensions divisible by 16."""
    return k % 16 == 0 and n % 16 == 0


def linear_shapes(model: nn.Module, tokens: Optional[int] = None, example_inputs=None,
                  module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None
                  ) -> List[LinearShape]:
    """The ``nn.Linear`` layers of ``model`` with the rows each one sees per step.

    ``tokens``: every Linear sees that many rows (a transformer: batch x sequence length).
    ``example_inputs`` (a tensor or a tuple of them): one forward pass under ``torch.no_grad``
    records each layer's rows from its real input instead (for models whose layers see different
    row counts). ``module_filter_fn(module, fqn)``: torchao's filter, True for the layers to
    convert; by default every Linear whose dimensions are multiples of 16 is converted.
    """
    if (tokens is None) == (example_inputs is None):
        raise ValueError("give exactly one of tokens (rows per step for every Linear) and "
                         "example_inputs (a batch to run once)")
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    rows: Dict[str, int] = {}
    if tokens is not None:
        check_int("tokens", tokens, 1)
        rows = {name: tokens for name, _ in linears}
    else:
        hooks = [m.register_forward_hook(
            lambda mod, inp, out, name=name: rows.__setitem__(name, inp[0].numel() // mod.in_features))
            for name, m in linears]
        try:
            args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            with torch.no_grad():
                model(*args)
        finally:
            for h in hooks:
                h.remove()
    out = []
    for name, m in linears:
        if name not in rows:  # a layer the forward pass never used costs nothing
            continue
        chosen = module_filter_fn(m, name) if module_filter_fn is not None else True
        out.append(LinearShape(name, rows[name], m.in_features, m.out_features,
                               bool(chosen) and fp8_shape_ok(m.in_features, m.out_features)))
    return out


def gpt_body_filter(module: nn.Module, fqn: str) -> bool:
    """The filter lesson 10 trains with: every Linear inside the transformer blocks
    (``blocks.*``) in FP8, the LM head and anything else in bf16."""
    return isinstance(module, nn.Linear) and fqn.startswith("blocks.")


# --- calibration: this GPU's GEMMs and casts, measured --------------------------------------------

@dataclass
class Calibration:
    """What ``measure_calibration`` measured on one device for one recipe.

    ``gemms[(rows, inner, cols, role)] = (bf16_ms, fp8_ms)``: one GEMM of that shape, as the
    recipe runs it. ``casts[kind] = (fixed_us, ns_per_element)`` for ``tensorwise`` and
    ``rowwise`` casts of a bf16 tensor (amax, scale, saturating cast) and ``copy`` (a transposed
    FP8 copy). Immutable once measured; ``device_name`` says where.
    """

    recipe: str
    device_name: str
    gemms: Dict[Tuple[int, int, int, str], Tuple[float, float]] = field(default_factory=dict)
    casts: Dict[str, Tuple[float, float]] = field(default_factory=dict)

    def gemm_ms(self, rows: int, inner: int, cols: int, role: str) -> Tuple[float, float]:
        """``(bf16_ms, fp8_ms)`` of one GEMM; KeyError naming the shape when it was not measured
        (measure the model's own shapes: ``measure_calibration(linear_shapes(model, ...))``)."""
        key = (rows, inner, cols, role)
        if key not in self.gemms:
            raise KeyError(f"GEMM {rows}x{inner}x{cols} ({role}) was not measured in this "
                           f"calibration; measure_calibration(shapes) with this model's shapes")
        return self.gemms[key]

    def op_ms(self, kind: str, elements: float, bytes_per_element: Optional[float] = None) -> float:
        """Predicted time (ms) of one cast kernel of ``kind`` over ``elements`` elements;
        ``bytes_per_element`` rescales the per-element cost from the timed kernel's bytes (see
        ``CAST_BYTES``)."""
        fixed_us, ns = self.casts[kind]
        timed = COPY_BYTES if kind == "copy" else CAST_BYTES["bf16"]
        scale = 1.0 if bytes_per_element is None else bytes_per_element / timed
        return fixed_us / 1e3 + elements * ns * scale / 1e6


def layer_cast_ms(shape: LinearShape, recipe: str, calibration: Calibration) -> float:
    """Predicted time (ms per step) of the casts one converted Linear adds under ``recipe``
    (``CAST_PLAN``), less the bf16 weight copy that autocast no longer makes."""
    check_choice("recipe", recipe, PREDICT_RECIPES)
    plan = CAST_PLAN[recipe]
    sizes = {"input": shape.m * shape.k, "weight": shape.k * shape.n, "grad": shape.m * shape.n}
    total = 0.0
    for tensor in ("input", "weight", "grad"):
        source = CAST_BYTES["fp32" if tensor == "weight" else "bf16"]
        for kind in plan[tensor]["casts"]:
            total += calibration.op_ms(kind, sizes[tensor], source)
        total += plan[tensor]["copies"] * calibration.op_ms("copy", sizes[tensor])
    outputs = {"grad_input": shape.m * shape.k, "grad_weight": shape.k * shape.n}
    for role, count in plan["rescales"].items():
        total += count * calibration.op_ms("copy", outputs[role], RESCALE_BYTES)
    # autocast casts the fp32 weight to bf16 in the bf16 step; FP8 casts it to FP8 instead
    saved = calibration.casts["copy"][1] * sizes["weight"] * AUTOCAST_WEIGHT_BYTES / COPY_BYTES / 1e6
    return total - saved


SLEEP_CYCLES = 4_000_000  # about 2 ms of a spinning kernel at 2 GHz


def _device_ms(fn: Callable[[], object], device: torch.device, reps: int, repeats: int = 3) -> float:
    """Median device time (ms) of one call of ``fn``.

    On a GPU each repeat queues a spinning kernel (``torch.cuda._sleep``) first, then ``reps``
    calls between two CUDA events: while the GPU spins the host queues every call, so the events
    time the kernels back to back, not the host's launch rate (a 768-wide GEMM runs in less
    time than Python takes to launch it; in a compiled training step the host is ahead of the
    GPU, and the kernel's own time is what the step pays). On a CPU: ``time.perf_counter``.
    """
    fn()  # warm-up: compile, cuBLAS heuristics, allocations
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times) / reps
    torch.cuda.synchronize(device)
    pairs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / reps


def _gemm_fns(rows: int, inner: int, cols: int, role: str, recipe: str, device: torch.device):
    """``(bf16_call, fp8_call)`` for one GEMM as torchao runs it under ``recipe``."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(rows, inner, device=device, generator=g).to(torch.bfloat16)
    b = torch.randn(cols, inner, device=device, generator=g).to(torch.bfloat16).t()  # column-major
    bf16 = lambda: torch.mm(a, b)  # noqa: E731
    if recipe == "rowwise_with_gw_hp" and role == "grad_weight":
        return bf16, bf16  # this recipe keeps the grad-weight GEMM in bf16
    grad_first = recipe == "tensorwise" and role != "forward"  # tensorwise grads are e5m2
    a8 = a.to(E5M2 if grad_first else E4M3)
    b8 = b.t().contiguous().to(E4M3).t()
    one = torch.ones((), device=device)
    if recipe != "tensorwise" and role == "forward":  # rowwise scales, fast accumulation
        sa = torch.ones(rows, 1, device=device)
        sb = torch.ones(1, cols, device=device)
        return bf16, lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16,
                                              use_fast_accum=True)
    fast = role == "forward"  # torchao's defaults: fast accumulation in forward only
    return bf16, lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16,
                                          use_fast_accum=fast)


def _cast_tensorwise(x: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)


def _cast_rowwise(x: torch.Tensor) -> torch.Tensor:
    scale = 448.0 / x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(scale)))  # torchao's rowwise rounds to powers of 2
    return (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)


def _copy_transposed(x8: torch.Tensor) -> torch.Tensor:
    return x8.t().contiguous()


CAST_SIZES = ((1024, 1024), (8192, 4096))  # two sizes: the fixed cost and the cost per element


def measure_casts(device: torch.device, compile: bool = True,
                  sizes: Sequence[Tuple[int, int]] = CAST_SIZES, reps: int = 20
                  ) -> Dict[str, Tuple[float, float]]:
    """Time the three cast kernels (``tensorwise``, ``rowwise``, ``copy``) at two sizes, compiled
    (as in a compiled model, each is one or two fused kernels), and fit ``time = fixed +
    per-element x elements``: ``{kind: (fixed_us, ns_per_element)}``."""
    if len(sizes) != 2:
        raise ValueError(f"sizes must hold two (rows, cols) pairs; got {sizes!r}")
    fns = {"tensorwise": _cast_tensorwise, "rowwise": _cast_rowwise, "copy": _copy_transposed}
    out = {}
    for kind, fn in fns.items():
        run = torch.compile(fn, dynamic=True) if compile else fn
        times = []
        for rows, cols in sizes:
            x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
            if kind == "copy":
                x = x.to(E4M3)
            times.append((rows * cols, _device_ms(lambda: run(x), device, reps)))
        (e1, t1), (e2, t2) = times
        ns = max((t2 - t1) / (e2 - e1) * 1e6, 0.0)  # ms per element -> ns per element
        out[kind] = (max(t1 - e1 * ns / 1e6, 0.0) * 1e3, ns)
    return out


def measure_calibration(shapes: Sequence[LinearShape], recipe: str = "tensorwise",
                        device: Union[str, torch.device, None] = None, reps: int = 10,
                        compile: bool = True, casts: Optional[Mapping] = None) -> Calibration:
    """Measure what ``predict_fp8_speedup`` needs on ``device``: every distinct GEMM of the
    converted ``shapes`` in bf16 and in FP8 as ``recipe`` runs it, and the cast kernels
    (``measure_casts``; pass ``casts`` from an earlier calibration to skip them).

    Seconds on a GPU (no model is built or compiled, only three small cast functions). On a CPU
    it runs too (``torch._scaled_mm`` has a CPU kernel), for tests; its numbers say nothing about
    a GPU.
    """
    check_choice("recipe", recipe, PREDICT_RECIPES)
    check_int("reps", reps, 1)
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()
    cal = Calibration(recipe, name)
    for s in shapes:
        if not s.converted:
            continue
        for role in GEMM_ROLES:
            key = (*s.gemm(role), role)
            if key in cal.gemms:
                continue
            bf16, fp8 = _gemm_fns(*key, recipe, device)
            cal.gemms[key] = (_device_ms(bf16, device, reps), _device_ms(fp8, device, reps))
    cal.casts = dict(casts) if casts is not None else measure_casts(device, compile=compile)
    return cal


# --- the prediction --------------------------------------------------------------------------------

@dataclass
class Prediction:
    """``predict_fp8_speedup``'s answer.

    ``speedup``: predicted bf16 step / FP8 step (None without a bf16 step time: then only
    ``linear_speedup``, the speed-up of the converted layers' GEMMs and casts on their own, is
    known; the whole step's lies between 1 and it). ``gemm_share``: the converted layers' bf16
    GEMMs as a share of the bf16 step. ``layers``: one row per Linear.
    ``status``: ``"predicted"``, ``"layers only"`` (no bf16 step time) or ``"not decided"``
    (``reason`` says why).
    """

    recipe: str
    status: str
    reason: str = ""
    speedup: Optional[float] = None
    linear_speedup: Optional[float] = None
    bf16_step_ms: Optional[float] = None
    fp8_step_ms: Optional[float] = None
    gemm_bf16_ms: float = 0.0
    gemm_fp8_ms: float = 0.0
    cast_ms: float = 0.0
    gemm_share: Optional[float] = None
    layers: List[dict] = field(default_factory=list)

    @property
    def gemm_saved_ms(self) -> float:
        """bf16 GEMM time minus FP8 GEMM time over the converted layers (ms per step)."""
        return self.gemm_bf16_ms - self.gemm_fp8_ms


def predict_fp8_speedup(model: nn.Module, calibration: Optional[Calibration] = None, *,
                        tokens: Optional[int] = None, example_inputs=None,
                        bf16_step_ms: Optional[float] = None, recipe: str = "tensorwise",
                        module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                        device: Union[str, torch.device, None] = None) -> Prediction:
    """Predict how much faster a training step of ``model`` gets with torchao's float8 ``recipe``.

    - ``model``: any module; its ``nn.Linear`` layers are what FP8 changes (on the meta device
      too, when ``tokens`` is given: nothing runs then).
    - ``tokens`` (rows every Linear sees per step, e.g. batch x sequence length) or
      ``example_inputs`` (one real batch, run once under ``no_grad``): see ``linear_shapes``.
    - ``bf16_step_ms``: the measured step time of the compiled bf16 step with the same batch;
      the prediction is ``bf16_step_ms / (bf16_step_ms - GEMM time saved + cast time added)``.
      Without it the answer is the converted layers' own speed-up (``status="layers only"``).
    - ``calibration``: ``measure_calibration`` of this model's shapes on the GPU it will train on.
      None: measured here on ``device`` when FP8 runs there (``measure.float8.fp8_support``),
      otherwise the answer is ``status="not decided"`` with the reason (no FP8 tensor cores, no
      torchao).
    - ``module_filter_fn``: torchao's filter (which Linears train in FP8); default: all whose
      dimensions are multiples of 16.

    Returns a ``Prediction``. Raises ValueError for a bad argument; never runs the model's
    training step.
    """
    check_choice("recipe", recipe, PREDICT_RECIPES)
    if bf16_step_ms is not None:
        check_positive("bf16_step_ms", bf16_step_ms)
    shapes = linear_shapes(model, tokens, example_inputs, module_filter_fn)
    converted = [s for s in shapes if s.converted]
    if not converted:
        return Prediction(recipe, "not decided", "no nn.Linear layer to train in FP8 (none, or "
                          "none with both dimensions multiples of 16 that the filter keeps)",
                          speedup=1.0 if bf16_step_ms else None, bf16_step_ms=bf16_step_ms)
    if calibration is None:
        from amp_lessons.measure.float8 import fp8_support
        support = fp8_support(device)
        if not support.available:
            return Prediction(recipe, "not decided", f"no FP8 calibration: {support.reason}",
                              bf16_step_ms=bf16_step_ms)
        calibration = measure_calibration(converted, recipe, device)
    if calibration.recipe != recipe:
        raise ValueError(f"calibration must be measured for recipe {recipe!r}; "
                         f"got one for {calibration.recipe!r}")
    pred = Prediction(recipe, "predicted", bf16_step_ms=bf16_step_ms)
    for s in shapes:
        row = {"layer": s.name, "m": s.m, "k": s.k, "n": s.n, "converted": s.converted,
               "bf16_gemm_ms": None, "fp8_gemm_ms": None, "gemm_gain": None, "cast_ms": None}
        if s.converted:
            times = [calibration.gemm_ms(*s.gemm(role), role) for role in GEMM_ROLES]
            bf16 = sum(t[0] for t in times)
            fp8 = sum(t[1] for t in times)
            cast = layer_cast_ms(s, recipe, calibration)
            row.update(bf16_gemm_ms=bf16, fp8_gemm_ms=fp8, gemm_gain=bf16 / fp8, cast_ms=cast)
            pred.gemm_bf16_ms += bf16
            pred.gemm_fp8_ms += fp8
            pred.cast_ms += cast
        pred.layers.append(row)
    pred.linear_speedup = pred.gemm_bf16_ms / (pred.gemm_fp8_ms + pred.cast_ms)
    if bf16_step_ms is None:
        pred.status = "layers only"
        pred.reason = ("no bf16 step time: the whole step's speed-up lies between 1 and the "
                       "converted layers' own")
        return pred
    pred.fp8_step_ms = bf16_step_ms - pred.gemm_saved_ms + pred.cast_ms
    pred.gemm_share = pred.gemm_bf16_ms / bf16_step_ms
    if pred.gemm_share > 1.0:
        pred.status = "not decided"
        pred.reason = (f"the converted layers' bf16 GEMMs alone ({pred.gemm_bf16_ms:.2f} ms) take "
                       f"longer than the bf16 step given ({bf16_step_ms:.2f} ms): the step time "
                       f"or the token count is not this model's")
        return pred
    pred.speedup = bf16_step_ms / pred.fp8_step_ms
    return pred


# --- beyond one GPU: a model, not a measurement ----------------------------------------------------

NVLINK_H100_H200_GBPS = 450.0  # NVLink 4 per GPU and direction (NVIDIA's datasheet: 900 GB/s both ways)


def fp8_all_gather_saving(model: nn.Module, world_size: int = 8,
                          bandwidth_gbps: float = NVLINK_H100_H200_GBPS,
                          module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                          gathers_per_step: int = 2) -> dict:
    """FSDP2's all-gather of the converted weights in FP8 instead of bf16, on paper.

    FSDP2 gathers every sharded weight before its forward and again before its backward
    (``gathers_per_step=2``, ``reshard_after_forward=True``). Each GPU receives ``(world_size-1)
    / world_size`` of each gathered weight: 2 bytes per element in bf16, 1 in FP8 (torchao's
    ``enable_fsdp_float8_all_gather``; the per-tensor scales are a few bytes). The time is
    bytes / ``bandwidth_gbps`` (GB/s a GPU receives; NVLink 4's datasheet figure by default,
    which NCCL does not fully reach), so the saving is an upper bound on what the step gains, and
    only where the gathers are not hidden behind compute. A model: nothing here ran on several
    GPUs.
    """
    check_int("world_size", world_size, 2)
    check_positive("bandwidth_gbps", bandwidth_gbps)
    check_int("gathers_per_step", gathers_per_step, 1)
    elements = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and fp8_shape_ok(m.in_features, m.out_features) and (
                module_filter_fn is None or module_filter_fn(m, name)):
            elements += m.in_features * m.out_features
    share = (world_size - 1) / world_size
    bf16_bytes = 2.0 * elements * share * gathers_per_step
    fp8_bytes = 1.0 * elements * share * gathers_per_step
    to_ms = lambda b: b / (bandwidth_gbps * 1e9) * 1e3  # noqa: E731
    return {"world_size": world_size, "converted_weights": elements,
            "bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes,
            "bf16_ms": to_ms(bf16_bytes), "fp8_ms": to_ms(fp8_bytes),
            "saved_ms": to_ms(bf16_bytes - fp8_bytes), "bandwidth_gbps": bandwidth_gbps,
            "kind": "model (bytes / bandwidth), not a measurement"}
