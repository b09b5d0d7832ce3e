"""Mixed precision on several GPUs: DDP, ZeRO and FSDP2 runs on N processes (the engine).

One process per device, PyTorch's own engine:

- ``launch(fn, world_size)`` starts ``world_size`` processes with ``torch.multiprocessing`` (the
  ``spawn`` start method, so it works from a notebook), joins each to a process group (NCCL on
  GPUs, one GPU per process; gloo on CPUs) and returns rank 0's result. ``fn`` must live in an
  importable module, because a spawned process imports it by name.
- ``RunConfig`` names one training run (model, strategy, precision, per-rank batch);
  ``run_experiments(grid(configs, world_sizes))`` trains each on 1, 2, 4... ranks inside one
  launch (a sub-group per world size) and returns a ``SweepResult``: per-rank step time with its
  repeat spread, peak memory and the bytes of parameters, gradients and optimizer state each rank
  holds, gathered to rank 0, with throughput and scaling efficiency against one process. The
  timed steps run in three repeats (``timed_repeats``); a row whose repeats disagree by over 10%,
  in time or in peak memory, says so (``row_noise``) and decides nothing.
- Strategies, all trained by the shared ``Trainer`` (autocast, and a ``GradScaler`` of its own
  on every rank for fp16): ``"ddp"`` (``DistributedDataParallel``), ``"ddp_zero"`` (the same,
  with ``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its share of the
  parameters, ZeRO stage 1) and ``"fsdp2"`` (``fully_shard``: parameters, gradients and
  optimizer state all sharded). How FSDP2 wraps the model is ``RunConfig.fsdp_wrap`` (one unit
  per residual or transformer block plus the root, see ``FSDP_WRAPS``) and
  ``RunConfig.reshard_after_forward``.
- Clear errors: more processes than devices, a backend that cannot run here, settings that
  differ between ranks (``check_same_settings`` all-gathers them and compares). The launcher and
  these checks live in ``_launch.py`` and are re-exported here, so ``al.distributed`` is the one
  name a lesson needs.

Outside a notebook, the same runs start with torchrun (one process per GPU)::

    torchrun --standalone --nproc_per_node=4 -m amp_lessons.measure.distributed \\
        --model tiny_transformer --strategy fsdp2 --precision bf16

or, without torchrun, ``python -m amp_lessons.measure.distributed --nproc 4 ...`` (spawns them itself).
``NCCL_NVLS_ENABLE`` is set to ``0`` (NVLink multicast off) unless it is already set.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from amp_lessons import models
from amp_lessons._compat import torch_version
from amp_lessons.measure.launch import (BACKENDS, WORLD_SIZES, RankContext, available_world_sizes, barrier,
                      check_backend, check_same_settings, check_world_size, cpu_count,
                      default_backend, describe_world, device_slots, free_port, init_rank, launch,
                      leave_now)
from amp_lessons.validate import check_bool, check_choice, check_int, check_seed, is_real
from amp_lessons.measure.memory import GIB
from amp_lessons.measure.rows import noisy
from amp_lessons.measure.timer import NOISY_SPREAD, REPEATS, repeat_spread, time_steps
from amp_lessons.data import synthetic_images
from amp_lessons.numerics.precision import HALF_DTYPES, PRECISIONS, autocast_for, check_precision, normalize_precision
from amp_lessons.tables import plural, text_table
from amp_lessons.train.trainer import ScalerSettings, TrainConfig, Trainer
from amp_lessons.lineage import traced  # explain names what made each row

__all__ = [  # the launcher's names (from _launch) and this module's own
    "BACKENDS", "WORLD_SIZES", "RankContext", "available_world_sizes", "barrier", "check_backend",
    "check_same_settings", "check_world_size", "cpu_count", "default_backend", "describe_world",
    "device_slots", "free_port", "init_rank", "launch", "leave_now",
    "STRATEGIES", "OPTIMIZERS", "MODELS", "FSDP_WRAPS", "BN_MIXUP", "RunConfig", "grid",
    "build_model", "parameter_count", "make_batch", "make_optimizer", "shard_units",
    "has_batchnorm", "fsdp2_shard", "fsdp_units", "fsdp2_available", "fsdp2_problem",
    "local_state_bytes", "make_trainer", "repeat_blocks", "peak_spread", "timed_repeats",
    "row_noise", "run_one", "run_plan", "SweepResult", "run_experiments", "PER_RANK_COLUMNS",
    "SUMMARY_COLUMNS", "main"]

STRATEGIES = ("ddp", "ddp_zero", "fsdp2")
OPTIMIZERS = ("sgd", "adamw")
MODELS = ("mlp", "small_cnn", "resnet18", "resnet50", "tiny_transformer")
MIB = 2**20

# How fsdp2 wraps a model (``shard_units``: residual or transformer blocks), see ``fsdp2_shard``.
FSDP_WRAPS = {
    "blocks": "one unit per block + the root; fp32 parameters, autocast casts per op",
    "blocks-half-params": "one unit per block + the root; parameters gathered in the half type "
                          "(MixedPrecisionPolicy param_dtype); not with BatchNorm",
    "bn-units": "every BatchNorm its own fp32 unit, then blocks + root with half parameters "
                "(FSDP1's default; many small units)",
}
BN_MIXUP = ("with parameters gathered in the half type, BatchNorm's weights are half while its "
            "running statistics stay fp32, and BatchNorm refuses the mix (cuDNN: \"Expected "
            "running_mean to have type BFloat16 but got Float\"); use fsdp_wrap='blocks' (fp32 "
            "parameters, autocast casts) instead")


# --- one run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunConfig:
    """One training run, the same on every rank. ``batch_size`` is per rank (per GPU).

    ``model``: one of ``MODELS`` (``model_kwargs`` go to its constructor); ``strategy``: one of
    ``STRATEGIES``; ``precision``: ``fp32``, ``tf32``, ``fp16`` (autocast + GradScaler; ``amp``
    is accepted for it) or ``bf16``. The run takes ``warmup`` untimed steps, then ``steps`` timed
    ones, on one fixed synthetic batch (the global batch of ``world_size * batch_size`` examples
    is made from ``seed``, and each rank takes its slice: one process with the whole batch sees
    exactly what several see together); the timed steps are split into three repeats
    (``timed_repeats``), so give at least 6 for a repeat spread. ``keep_params`` returns the
    trained parameters.
    ``fsdp_wrap`` (one of ``FSDP_WRAPS``) and ``reshard_after_forward`` say how ``fsdp2`` wraps
    the model (``fsdp2_shard``); other strategies ignore them.
    """

    model: str = "small_cnn"
    strategy: str = "ddp"
    precision: str = "bf16"
    batch_size: int = 8
    image_size: int = 32
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    optimizer: str = "adamw"
    lr: float = 1e-3
    steps: int = 5
    warmup: int = 1
    init_scale: float = 2.0**16
    seed: int = 0
    label: str = ""
    keep_params: bool = False
    fsdp_wrap: str = "blocks"
    reshard_after_forward: bool = True

    def __post_init__(self):
        # the package's one reading of a precision name ("AMP", " bf16 ")
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        if not isinstance(self.label, str):  # rows and tables show it as text
            raise ValueError(f"label must be a string; got {self.label!r}")
        check_choice("model", self.model, MODELS)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_int("batch_size", self.batch_size, 1)
        check_int("image_size", self.image_size, 8)
        check_int("steps", self.steps, 1)
        check_int("warmup", self.warmup, 0)
        check_seed("seed", self.seed)
        check_choice("fsdp_wrap", self.fsdp_wrap, tuple(FSDP_WRAPS))
        check_bool("reshard_after_forward", self.reshard_after_forward)
        check_bool("keep_params", self.keep_params)
        if not isinstance(self.model_kwargs, dict):
            raise ValueError(f"model_kwargs must be a dict; got {self.model_kwargs!r}")
        try:  # the workers would fail on kwargs the model does not take: build it here, on meta
            with torch.device("meta"):
                build_model(self)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model_kwargs {self.model_kwargs!r} do not build a {self.model}: "
                             f"{exc}") from None
        if not (is_real(self.lr) and 0 < self.lr < 10):
            raise ValueError(f"lr must be a number in (0, 10); got {self.lr!r}")
        ScalerSettings(init_scale=self.init_scale)  # the trainer's check of the loss scale

    @property
    def name(self) -> str:
        """The row label: ``label`` or ``"<model> <strategy> <precision>"`` (+ the FSDP2 wrap)."""
        if self.label:
            return self.label
        return f"{self.model} {self.strategy} {self.precision}{self.wrap_name}"

    @property
    def wrap_name(self) -> str:
        """How fsdp2 wraps this run (``" blocks"``, ``" bn-units, no reshard"``); ``""`` else."""
        if self.strategy != "fsdp2":
            return ""
        return f" {self.fsdp_wrap}" + ("" if self.reshard_after_forward else ", no reshard")

    @property
    def unit(self) -> str:
        """What one example is: ``"img"`` for image models, ``"seq"`` for the transformer."""
        return {"mlp": "sample", "tiny_transformer": "seq"}.get(self.model, "img")


def grid(configs: Sequence[RunConfig], world_sizes: Sequence[int]) -> List[Tuple[RunConfig, int]]:
    """Every config at every world size, as ``(config, world_size)`` pairs, world size first."""
    if not configs or not world_sizes:
        raise ValueError("grid needs at least one config and one world size")
    for n in world_sizes:
        check_int("world size", n, 1)
    return [(c, n) for n in world_sizes for c in configs]


def build_model(config: RunConfig) -> nn.Module:
    """The model ``config`` names, on the current device, in fp32 (seeded by the caller)."""
    kwargs = dict(config.model_kwargs)
    if config.model == "mlp":
        return models.MLP(**{"in_features": 64, "hidden": (64, 64), **kwargs})
    if config.model == "small_cnn":
        return models.SmallCNN(**{"in_channels": 3, "width": 16, **kwargs})
    if config.model in ("resnet18", "resnet50"):
        kwargs.setdefault("num_classes", 10)
        kwargs.setdefault("small_input", config.image_size < 64)
        return getattr(models, config.model)(**kwargs)
    return models.TinyTransformer(**kwargs)


def parameter_count(config: RunConfig) -> int:
    """Parameters of the model ``config`` names, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config).parameters())


def make_batch(config: RunConfig, model: nn.Module, rank: int, world_size: int,
               device) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch (``world_size * batch_size`` examples from seed);
    images with the channels the model takes (``models.input_channels``)."""
    total = world_size * config.batch_size
    g = torch.Generator(device=device).manual_seed(config.seed)
    if config.model == "tiny_transformer":
        tokens = torch.randint(0, model.vocab_size, (total, model.seq_len + 1), device=device,
                               generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
    elif config.model == "mlp":
        x = torch.randn(total, model.net[0].in_features, device=device, generator=g)
        y = torch.randint(0, model.net[-1].out_features, (total,), device=device, generator=g)
    else:
        num_classes = config.model_kwargs.get("num_classes", 10)
        x, y = synthetic_images(total, config.image_size, num_classes, device=device,
                                seed=config.seed, channels=models.input_channels(model))
    part = slice(rank * config.batch_size, (rank + 1) * config.batch_size)
    return x[part].clone(), y[part].clone()


def make_optimizer(config: RunConfig, params, zero: bool = False, group=None):
    """SGD (momentum 0.9) or AdamW; wrapped in ``ZeroRedundancyOptimizer`` when ``zero``."""
    cls, kwargs = ((torch.optim.SGD, {"momentum": 0.9}) if config.optimizer == "sgd"
                   else (torch.optim.AdamW, {}))
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group,
                                       lr=config.lr, **kwargs)
    return cls(params, lr=config.lr, **kwargs)


def _fsdp_api():
    try:  # torch >= 2.6
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 and 2.5
        from torch.distributed._composable.fsdp import (FSDPModule, MixedPrecisionPolicy,
                                                        fully_shard)
    return fully_shard, MixedPrecisionPolicy, FSDPModule


def shard_units(model: nn.Module) -> List[nn.Module]:
    """The sub-modules FSDP2 shards one by one: transformer blocks, ResNet residual blocks."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    stages = [getattr(model, n) for n in ("layer1", "layer2", "layer3", "layer4")
              if hasattr(model, n)]
    return [block for stage in stages for block in stage.children()]


def has_batchnorm(model: nn.Module) -> bool:
    """True when ``model`` holds a BatchNorm layer (fp32 running statistics)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def fsdp2_shard(model: nn.Module, precision: str, mesh, wrap: str = "blocks",
                reshard_after_forward: bool = True) -> nn.Module:
    """Apply ``fully_shard`` to each of ``shard_units(model)``, then to the whole model.

    ``wrap`` (one of ``FSDP_WRAPS``):

    - ``"blocks"``: ``MixedPrecisionPolicy()``: parameters stay fp32 (sharded and gathered), the
      training step's autocast casts them per op, gradients are reduced in fp32. Works with
      BatchNorm, whose weights and running statistics are then both fp32.
    - ``"blocks-half-params"`` (fp16/bf16): ``MixedPrecisionPolicy(param_dtype=half,
      reduce_dtype=float32)``: the gathered parameters, and so the all-gather traffic, are half
      precision; the sharded master parameters and optimizer state stay fp32. Not for models with
      BatchNorm (``BN_MIXUP``).
    - ``"bn-units"``: every BatchNorm first becomes its own unit with fp32 parameters, then blocks
      and root with half parameters: valid, but ResNet-50 gets 70 units, each a collective and a
      few hooks per pass.

    ``reshard_after_forward=False`` keeps each block's gathered parameters from forward to
    backward (no second all-gather; more memory, like ZeRO stage 2).
    """
    check_choice("wrap", wrap, tuple(FSDP_WRAPS))
    check_bool("reshard_after_forward", reshard_after_forward)
    fully_shard, MixedPrecisionPolicy, _ = _fsdp_api()
    half = HALF_DTYPES.get(precision)
    if half is None or wrap == "blocks":
        policy = MixedPrecisionPolicy()
    else:
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    if half is not None and wrap == "bn-units":
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                fully_shard(m, mesh=mesh, mp_policy=fp32,
                            reshard_after_forward=reshard_after_forward)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def fsdp_units(model: nn.Module) -> List[Dict[str, Any]]:
    """Every FSDP2 unit of ``model`` (after ``fsdp2_shard``): its name (``"(root)"`` for the
    model), its class, how many parameter tensors it gathers (those not in a nested unit) and
    the dtype it gathers them in (``None`` where this torch does not say)."""
    _, _, FSDPModule = _fsdp_api()
    names = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    units = []
    for name in names:
        m = model.get_submodule(name)
        nested = [n for n in names if n != name and (not name or n.startswith(name + "."))]
        owned = [p for p, _ in m.named_parameters()
                 if not any(f"{name}.{p}".lstrip(".").startswith(n + ".") for n in nested)]
        kind = next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule)).__name__
        try:  # torch's own accessor for a unit's settings (not public API)
            policy = m._get_fsdp_state()._fsdp_param_group.mp_policy  # noqa: SLF001
            dtype = str(policy.param_dtype or torch.float32).replace("torch.", "")
        except AttributeError:
            dtype = None
        units.append({"unit": name or "(root)", "kind": kind, "parameters": len(owned),
                      "param_dtype": dtype})
    return units


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def local_state_bytes(model: nn.Module, optimizer) -> Dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (shards only).

    Counted from the tensors themselves (DTensors by their local shard; a
    ``ZeroRedundancyOptimizer`` by the state of its local optimizer), each storage once.
    """
    params = list(model.parameters())
    opt = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard here
    state = [v for s in opt.state.values() for v in s.values()]
    return {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "optimizer_state": _bytes(state)}


def fsdp2_available() -> bool:
    """True when this torch has FSDP2 (``fully_shard`` and ``MixedPrecisionPolicy``)."""
    try:
        _fsdp_api()
    except ImportError:
        return False
    return True


def _loss_fn(config: RunConfig):
    return models.lm_loss if config.model == "tiny_transformer" else F.cross_entropy


def make_trainer(config: RunConfig, model: nn.Module, optimizer, device):
    """The shared ``Trainer`` for a wrapped model: the same loop for DDP, ZeRO and FSDP2.

    Autocast and a ``GradScaler`` of its own on every rank (fp16). Under DDP the gradients are
    already averaged when the scaler checks them, so every rank finds the same inf/NaN and skips
    the same steps. Under FSDP2 each rank holds only its shard of the gradients (DTensors), and
    their inf/NaN check in ``unscale_`` all-reduces the result over the mesh (torch >= 2.5): the
    ordinary ``torch.amp.GradScaler`` does what FSDP1 needed ``ShardedGradScaler`` for.
    Gradient norm and per-step memory tracking are off: ``run_one`` measures around the steps.
    Without a GradScaler (fp32, bf16) non-finite steps are not checked (``nonfinite="ignore"``,
    what plain DDP and FSDP2 loops do): the check's copy of parameters and optimizer state would
    add to the per-rank memory and time these runs measure.
    """
    extra = {"nonfinite": "ignore"} if "nonfinite" in TrainConfig.__dataclass_fields__ else {}
    tc = TrainConfig(precision=config.precision,
                     scaler=ScalerSettings(init_scale=float(config.init_scale)),
                     progress=False, seed=None, track_grad_norm=False, track_memory=False,
                     **extra)
    return Trainer(model, optimizer, tc, device=device, loss_fn=_loss_fn(config))


def _step_loss(trainer: Trainer, batches) -> torch.Tensor:
    return trainer.train_step(batches).loss


def _time_steps(step: Callable, n: int, device) -> Tuple[List[float], List[torch.Tensor]]:
    """``n`` steps timed by the engine's one timer (``bench.time_steps``: CUDA events on a GPU),
    in seconds, with what each step returned."""
    if n == 0:
        return [], []
    timed = time_steps(lambda _x, _y: step(), None, None, warmup=0, steps=n, device=device,
                       reset_peak=False, keep_losses=True)
    return [ms / 1e3 for ms in timed["times_ms"]], timed["losses"]


def repeat_blocks(steps: int, repeats: int = REPEATS) -> List[int]:
    """How many timed steps each repeat gets: ``steps`` split into ``repeats`` consecutive blocks
    of ``steps // repeats`` as ``bench.repeat_spread`` splits them, the last one also taking the
    remainder (which the spread leaves out); one block where there are fewer steps than
    repeats."""
    check_int("steps", steps, 1)
    check_int("repeats", repeats, 1)
    per = steps // repeats
    return [steps] if per == 0 else [per] * (repeats - 1) + [steps - per * (repeats - 1)]


def _settle(device) -> int:
    """Bytes still allocated on ``device`` once every earlier step and run has let go of its
    memory: garbage collected, the device synchronised and the allocator's pending frees
    processed (``empty_cache`` frees blocks whose use on another stream, an NCCL collective's,
    had not been seen to end), so a peak counted from here holds this run alone."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def peak_spread(peaks: Sequence[float]) -> Optional[float]:
    """How much the peaks of one run's repeats disagree: (largest - smallest) / largest; None
    with fewer than two peaks or none above zero."""
    peaks = [float(p) for p in peaks]
    if len(peaks) < 2 or not max(peaks) > 0:
        return None
    return (max(peaks) - min(peaks)) / max(peaks)


def timed_repeats(step: Callable, steps: int, warmup: int, device, settle: Callable[[], None]
                  ) -> Dict[str, Any]:
    """``warmup`` untimed steps, then ``steps`` timed ones in ``repeat_blocks(steps)`` repeats,
    each repeat with its own peak memory (GPU), counted from the same state every time.

    ``settle()`` runs before the last warm-up step (a barrier and ``_settle`` in a run): the
    warm-up step after it refills the allocator's cache, so the timed steps pay no
    ``cudaMalloc``. The peak counter is reset before each repeat. Returns ``times`` (seconds, per
    step), ``losses`` (warm-up first), ``peaks`` (bytes per repeat; empty off GPUs), ``spread``
    (``bench.repeat_spread`` of the step times) and ``peak_spread``.
    """
    cuda = device.type == "cuda"
    _, warm = _time_steps(step, max(warmup - 1, 0), device)
    settle()
    if warmup:
        warm += _time_steps(step, 1, device)[1]
    times: List[float] = []
    losses: List[torch.Tensor] = []
    peaks: List[int] = []
    for n in repeat_blocks(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t, lo = _time_steps(step, n, device)  # synchronised at its end
        times += t
        losses += lo
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(device))
    return {"times": times, "warm_losses": warm, "losses": losses, "peaks": peaks,
            "spread": repeat_spread(times),
            "peak_spread": peak_spread(peaks)}


def _as_float(v) -> float:
    return float(v.item() if isinstance(v, torch.Tensor) else v)


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)  # DDP wraps, FSDP2 does not
    out = {}
    for name, p in inner.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()  # collective: every rank of the mesh calls it
        out[name] = t.float().cpu().clone()
    return out


def _gradient_bytes(config: RunConfig, model: nn.Module, x, y, device) -> int:
    """Bytes of the gradients this rank holds right after a backward pass (then freed again).

    The training step frees gradients at its end (``zero_grad(set_to_none=True)``), so one more
    forward and backward shows what they take at their largest: the full set under DDP, this
    rank's shard under FSDP2.
    """
    with autocast_for(config.precision, device.type):
        loss = _loss_fn(config)(model(x), y)
    loss.backward()
    params = list(model.parameters())
    held = _bytes(p.grad for p in params)
    for p in params:
        p.grad = None
    return held


def run_one(ctx: RankContext, config: RunConfig, world_size: int, group=None) -> Dict[str, Any]:
    """Train ``config`` on this rank as one of ``world_size`` ranks of ``group``; one result row.

    Called on every rank of ``group`` (``run_experiments`` does this). Timed as
    ``timed_repeats``: the step times carry their repeat ``spread``; peak memory is read per
    repeat after ``reset_peak_memory_stats`` (once the warm-up has created the optimizer state,
    from a settled allocator), less what was still allocated before this run built its model,
    and is the largest repeat's (``peak_spread``: how much the repeats' peaks disagree).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = ctx.device
    rank = dist.get_rank(group)
    before = _settle(device)  # an earlier run's leftovers are not this run's memory
    torch.manual_seed(config.seed)
    with device:  # built where it trains: no slow CPU initialisation of large models
        model = build_model(config)
    x, y = make_batch(config, model, rank, world_size, device)
    units = None
    if config.strategy == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        fsdp2_shard(model, config.precision, DeviceMesh.from_group(group, device.type),
                    config.fsdp_wrap, config.reshard_after_forward)
        units = len(fsdp_units(model))
        optimizer = make_optimizer(config, model.parameters())
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    process_group=group)
        optimizer = make_optimizer(config, model.parameters(),
                                   zero=config.strategy == "ddp_zero", group=group)
    trainer = make_trainer(config, model, optimizer, device)
    step = partial(_step_loss, trainer, [(x, y)])

    def settle():
        barrier(ctx, group)
        _settle(device)
    timed = timed_repeats(step, config.steps, config.warmup, device, settle)
    times, losses, warm_losses = timed["times"], timed["losses"], timed["warm_losses"]
    peak = max(timed["peaks"]) - before if timed["peaks"] else None
    state = local_state_bytes(model, optimizer)
    state["grads"] = _gradient_bytes(config, model, x, y, device)
    median = statistics.median(times)
    row = {
        "label": config.name, "model": config.model, "strategy": config.strategy,
        "precision": config.precision, "world_size": world_size, "rank": rank,
        "fsdp_wrap": config.wrap_name.strip() or None, "fsdp_units": units,
        "device": _device_name(device), "batch_size": config.batch_size, "unit": config.unit,
        "step_ms": median * 1000, "per_rank_per_s": config.batch_size / median,
        "spread": timed["spread"], "steps": config.steps, "warmup": config.warmup,
        "peak_gib": peak / GIB if peak is not None else None,
        "peak_spread": timed["peak_spread"],
        "param_mib": state["params"] / MIB, "grad_mib": state["grads"] / MIB,
        "optimizer_state_mib": state["optimizer_state"] / MIB,
        "losses": [_as_float(v) for v in warm_losses + losses],
    }
    if config.keep_params:
        row["params"] = _full_params(model)
    del model, optimizer, step, trainer
    if device.type == "cuda":  # free this run's memory before the next one measures its peak
        gc.collect()
        torch.cuda.empty_cache()
    return row


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "CPU"


def fsdp2_problem(device) -> Optional[str]:
    """Why FSDP2's ``fully_shard`` cannot train correctly on ``device`` with this torch (a
    sentence), or None when it can: it needs FSDP2 itself (torch >= 2.4) and, on CPU processes
    (gloo), torch >= 2.9. Tried here: 2.4 and 2.5 stop with "FSDP requires CUDA for streams",
    2.6 with "'Stream' object has no attribute 'record_event'"; 2.7.1 and 2.8.0 train, but sum
    the gradients over gloo instead of averaging them (pytorch/pytorch#162338: after 4 fp32
    steps their weights are 0.19 away from DDP's); 2.9.1 and later match DDP."""
    device = torch.device(device)
    if not fsdp2_available():
        return f"this torch ({torch.__version__}) has no FSDP2 (fully_shard)"
    if device.type != "cuda" and torch_version() < (2, 9):
        why = ("cannot run it" if torch_version() < (2, 7) else
               "sums its gradients over gloo instead of averaging them, pytorch/pytorch#162338")
        return (f"FSDP2 on CPU processes needs torch >= 2.9; this torch ({torch.__version__}) "
                f"{why}: run it on GPUs")
    return None


def _precision_problem(config: RunConfig, device) -> Optional[str]:
    """Why ``config`` cannot run on ``device`` (None when it can), found before any training."""
    if config.strategy == "fsdp2":
        problem = fsdp2_problem(device)
        if problem:
            return problem
        if config.precision == "fp16" and torch_version() < (2, 5):
            return ("precision 'fp16' with strategy 'fsdp2' needs torch >= 2.5 (its GradScaler "
                    "handles sharded DTensor gradients from then on); use 'bf16'")
    try:
        check_precision(config.precision, device)
    except ValueError as exc:
        return str(exc)
    if (config.strategy == "fsdp2" and config.fsdp_wrap == "blocks-half-params"
            and config.precision in HALF_DTYPES):
        with torch.device("meta"):
            if has_batchnorm(build_model(config)):
                return f"{config.model} has BatchNorm: {BN_MIXUP}"
    return None


def run_plan(ctx: RankContext, plan: Sequence[Tuple[RunConfig, int]]) -> Dict[str, Any]:
    """Per-rank worker of ``run_experiments``: every ``(config, world_size)`` of ``plan``.

    Ranks ``0..n-1`` form the sub-group of world size ``n``; the others wait. Settings are
    compared across ranks first (a mismatch raises the same ``ValueError`` on every rank). A run
    that a participating rank's device or torch cannot do (bf16 on a GPU without it, fp16 FSDP2
    on torch < 2.5) is skipped on every rank, with the reason. Returns (on rank 0) a dict:
    ``rows`` (all ranks' rows, in plan order), ``skipped`` (label, world_size, reason) and
    ``warnings`` (the Python warnings any rank raised, collected rather than printed by each).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        # torch's own modules raise DeprecationWarnings about their internals (torch.jit use in
        # the distributed package, seen with NCCL): Python hides those by default, and so do we.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        check_same_settings({"plan": [(asdict(c), n) for c, n in plan],
                             "torch": torch.__version__, "backend": ctx.backend})
        problems: List[Optional[List[Optional[str]]]] = [None] * ctx.world_size
        dist.all_gather_object(problems, [_precision_problem(c, ctx.device) for c, _ in plan])
        sizes = sorted({n for _, n in plan})
        groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank makes each one
        rows: List[Dict[str, Any]] = []
        skipped: List[Dict[str, Any]] = []
        for i, (config, n) in enumerate(plan):
            reason = next((problems[r][i] for r in range(n) if problems[r][i]), None)
            if reason:
                skipped.append({"label": config.name, "world_size": n, "reason": reason})
                continue
            row = run_one(ctx, config, n, groups[n]) if ctx.rank < n else None
            gathered: List[Optional[dict]] = [None] * ctx.world_size
            dist.all_gather_object(gathered, row)
            rows += [r for r in gathered if r is not None]
    mine = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    everyone: List[Optional[List[str]]] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {"rows": rows, "skipped": skipped,
            "warnings": sorted({w for ws in everyone for w in ws})}


# --- a sweep and its results --------------------------------------------------------------------

@dataclass
class SweepResult:
    """Per-rank rows of a sweep (``rows``) and what they add up to (``summary()``).

    ``skipped``: runs that could not run here (label, world_size, reason); ``warnings``: Python
    warnings the ranks raised, collected (one line each, no duplicates).
    """

    rows: List[Dict[str, Any]]
    backend: str
    launched: int
    skipped: List[Dict[str, Any]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)

    def summary(self) -> List[Dict[str, Any]]:
        """One row per (config, world size): throughput, scaling efficiency, per-rank memory.

        Throughput counts the whole world's examples per second at the slowest rank's median
        step time; ``efficiency`` is that over ``world_size`` times the same config's one-process
        throughput (1.0 = perfect scaling), where the sweep ran it on one process. A ValueError
        where rows of one label and world size come from two runs (a rank twice, other settings).
        """
        groups: Dict[Tuple[str, int], List[dict]] = {}
        for r in self.rows:
            groups.setdefault((r["label"], r["world_size"]), []).append(r)
        out = []
        for (label, n), rs in groups.items():
            differ = [k for k in _SAME_IN_A_RUN if len({repr(r.get(k)) for r in rs}) > 1]
            if differ or len({r.get("rank") for r in rs}) != len(rs):
                raise ValueError(f"rows labelled {label!r} at world size {n} come from more than "
                                 f"one run ({', '.join(differ) or 'a rank repeats'}): labels "
                                 f"must be unique")
            held = max(r["param_mib"] + r["grad_mib"] + r["optimizer_state_mib"] for r in rs)
            slowest = max(r["step_ms"] for r in rs)
            peaks = [r["peak_gib"] for r in rs if r["peak_gib"] is not None]
            spreads = [r["spread"] for r in rs if r.get("spread") is not None]
            peak_spreads = [r["peak_spread"] for r in rs if r.get("peak_spread") is not None]
            first = rs[0]
            out.append({
                "label": label, "model": first["model"], "strategy": first["strategy"],
                "precision": first["precision"], "world_size": n, "unit": first["unit"],
                "fsdp_wrap": first.get("fsdp_wrap"), "fsdp_units": first.get("fsdp_units"),
                "batch_size": first["batch_size"], "step_ms": slowest,
                "per_s": n * first["batch_size"] / (slowest / 1000),
                "peak_gib": max(peaks) if peaks else None,
                "param_mib": max(r["param_mib"] for r in rs),
                "grad_mib": max(r["grad_mib"] for r in rs),
                "optimizer_state_mib": max(r["optimizer_state_mib"] for r in rs),
                "model_state_mib": held,
                "final_loss": statistics.mean(r["losses"][-1] for r in rs),
                "spread": max(spreads) if spreads else None,
                "peak_spread": max(peak_spreads) if peak_spreads else None,
            })
            out[-1]["noisy"] = row_noise(out[-1]) or ""
        single = {s["label"]: s["per_s"] for s in out if s["world_size"] == 1}
        for s in out:
            base = single.get(s["label"])
            s["efficiency"] = s["per_s"] / (s["world_size"] * base) if base else None
        return out

    def ran(self, label: str, world_size: int) -> bool:
        """True when run ``label`` ran at ``world_size`` (it was in the plan and not skipped)."""
        return any(r["label"] == label and r["world_size"] == world_size for r in self.rows)

    def find(self, label: str, world_size: int) -> Dict[str, Any]:
        """The summary row of ``label`` at ``world_size`` (``KeyError`` if it did not run)."""
        for s in self.summary():
            if s["label"] == label and s["world_size"] == world_size:
                return s
        why = next((f": skipped, {k['reason']}" for k in self.skipped
                    if k["label"] == label and k["world_size"] == world_size), "")
        raise KeyError(f"no run {label!r} at world size {world_size}{why}")

    def notes(self) -> List[str]:
        """One line per skipped run (and why) and per warning the ranks raised."""
        return ([f"not run: {k['label']} on {plural(k['world_size'], 'process', 'processes')}: {k['reason']}"
                 for k in self.skipped]
                + [f"warning raised on the ranks: {w}" for w in self.warnings])

    @traced
    def published_rows(self) -> List[Dict[str, Any]]:
        """The summary with readable column names and units, for ``report.publish``."""
        out = []
        for s in self.summary():
            eff = s["efficiency"]
            out.append({
                "run": s["label"], "processes": s["world_size"],
                f"throughput ({s['unit']}/s)": s["per_s"],
                "repeat spread (%)": _pct(s["spread"]),
                "scaling efficiency (%)": 100 * eff if eff is not None else None,
                "peak memory per rank (GiB)": s["peak_gib"],
                "weights + grads + optimizer state per rank (MiB)": s["model_state_mib"],
                "optimizer state per rank (MiB)": s["optimizer_state_mib"],
                "note": s["noisy"] or "",
            })
        return out

    def per_rank_table(self) -> str:
        """Every rank's step time, examples/s, peak memory and state it holds, as text."""
        return text_table(self.rows, PER_RANK_COLUMNS)

    def scaling_table(self) -> str:
        """The summary as text: throughput, efficiency and per-rank memory per world size."""
        return text_table(self.summary(), SUMMARY_COLUMNS)


_SAME_IN_A_RUN = ("model", "strategy", "precision", "fsdp_wrap", "batch_size", "steps", "warmup")


def _pct(share: Optional[float]) -> Optional[float]:
    return 100 * share if share is not None else None


def row_noise(row: Mapping[str, Any]) -> Optional[str]:
    """Why a run's row decides nothing because its repeats disagree by over ``NOISY_SPREAD``:
    its step times (``spread``, ``bench.noisy``'s words) or its peak memory (``peak_spread``);
    None when both repeat."""
    why = [noisy(row)]
    share = row.get("peak_spread")
    if isinstance(share, (int, float)) and share > NOISY_SPREAD:
        why.append(f"noisy: peak memory of the repeats differs by {100 * share:.0f}% (over "
                   f"{100 * NOISY_SPREAD:.0f}%), decides nothing")
    return "; ".join(w for w in why if w) or None


def run_experiments(plan: Sequence[Tuple[RunConfig, int]], backend: Optional[str] = None,
                    timeout_s: float = 600.0) -> SweepResult:
    """Run every ``(config, world_size)`` of ``plan`` (see ``grid``) in one launch.

    Launches ``max(world_size)`` processes once; each world size trains on a sub-group of ranks
    ``0..n-1`` while the rest wait, so starting processes and CUDA is paid once, not per run.
    A ValueError before anything runs where two different configs share a ``name`` (label) or
    a (config, world size) pair repeats: the summary groups rows by label and world size.
    """
    plan = list(plan)
    if not plan:
        raise ValueError("plan must hold at least one (config, world_size) pair")
    for item in plan:
        if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], RunConfig)):
            raise ValueError(f"plan items must be (RunConfig, world_size) pairs; got {item!r}")
        check_int("world size", item[1], 1)
    named: Dict[str, RunConfig] = {}
    for i, (config, n) in enumerate(plan):
        if named.setdefault(config.name, config) != config:
            raise ValueError(f"configuration labels must be unique: two different configs are "
                             f"labelled {config.name!r}; set label= on each")
        if (config, n) in plan[:i]:
            raise ValueError(f"plan holds ({config.name!r}, world size {n}) twice")
    backend = check_backend(backend)
    launched = max(n for _, n in plan)
    check_world_size(launched, backend)
    out = launch(run_plan, launched, args=(plan,), backend=backend, timeout_s=timeout_s)
    return SweepResult(rows=out["rows"], backend=backend, launched=launched,
                       skipped=out["skipped"], warnings=out["warnings"])


# --- tables --------------------------------------------------------------------------------------

PER_RANK_COLUMNS = (("label", "run"), ("world_size", "ranks"), ("rank", "rank"),
                    ("step_ms", "step ms"), ("per_rank_per_s", "examples/s"),
                    ("spread", "repeat spread", "{:.0%}"),
                    ("peak_gib", "peak GiB"), ("param_mib", "params MiB"),
                    ("grad_mib", "grads MiB"), ("optimizer_state_mib", "opt. state MiB"))
SUMMARY_COLUMNS = (("label", "run"), ("world_size", "ranks"), ("per_s", "examples/s"),
                   ("spread", "repeat spread", "{:.0%}"),
                   ("efficiency", "scaling eff.", "{:.0%}"), ("peak_gib", "peak GiB/rank"),
                   ("model_state_mib", "state MiB/rank"),
                   ("optimizer_state_mib", "opt. state MiB/rank"), ("final_loss", "last loss"),
                   ("noisy", "note"))


# --- torchrun / command line --------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m amp_lessons.measure.distributed",
        description="Train one RunConfig on several processes and print each rank's step time "
                    "and memory. Under torchrun each process runs one rank; without it, --nproc "
                    "processes are spawned.")
    p.add_argument("--model", choices=MODELS, default="small_cnn")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--precision", choices=PRECISIONS + ("amp",), default="bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--batch-size", type=int, default=8, help="examples per rank")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", choices=BACKENDS, default=None)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to spawn when not under torchrun (default: every device)")
    return p


def _config_from_args(args) -> RunConfig:
    return RunConfig(model=args.model, strategy=args.strategy, precision=args.precision,
                     optimizer=args.optimizer, batch_size=args.batch_size,
                     image_size=args.image_size, steps=args.steps, warmup=args.warmup)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m amp_lessons.measure.distributed`` (and of torchrun ``-m``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = _config_from_args(args)
        backend = check_backend(args.backend)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
            world = int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
            if backend == "nccl" and local >= device_slots("nccl"):
                raise ValueError(f"local rank {local} has no GPU of its own "
                                 f"({device_slots('nccl')} here); lower --nproc_per_node")
            ctx = init_rank(int(os.environ["RANK"]), world, local, backend, "env://", 600.0)
            try:
                out = run_plan(ctx, [(config, world)])
            except BaseException:
                dist.destroy_process_group()
                raise
            if ctx.rank != 0:
                leave_now()  # see leave_now: gloo's teardown at exit can abort a finished rank
            result = SweepResult(rows=out["rows"], backend=backend, launched=world,
                                 skipped=out["skipped"], warnings=out["warnings"])
        else:
            if args.nproc is not None and args.nproc < 1:
                raise ValueError(f"--nproc must be a whole number >= 1 (or left out for every "
                                 f"device); got {args.nproc}")
            n = args.nproc or device_slots(backend)
            result = run_experiments([(config, n)], backend=backend)
    except ValueError as exc:
        parser.error(str(exc))
    if result.rows:
        print(result.per_rank_table())
        print()
        print(result.scaling_table())
    for line in result.notes():
        print(line)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        leave_now()
    return 0


if __name__ == "__main__":
    # Run the package's own copy of this module, not this `__main__` one: spawned processes
    # import the worker functions and RunConfig by their package names.
    from amp_lessons.measure.distributed import main as _main
    sys.exit(_main())
