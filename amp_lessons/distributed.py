"""Mixed precision on several GPUs (lesson 06): DDP, FSDP2 and sharded optimizer state.

One process per device, PyTorch's own engine:

- ``launch(fn, world_size)`` starts ``world_size`` processes with ``torch.multiprocessing`` (the
  ``spawn`` start method, so it works from a notebook), joins each to a process group (NCCL on
  GPUs, one GPU per process; gloo on CPUs) and returns rank 0's result. ``fn`` must live in an
  importable module, because a spawned process imports it by name.
- ``RunConfig`` names one training run (model, strategy, precision, per-rank batch);
  ``run_experiments(grid(configs, world_sizes))`` trains each on 1, 2, 4... ranks inside one
  launch (a sub-group per world size) and returns a ``SweepResult``: per-rank step time, peak
  memory and the bytes of parameters, gradients and optimizer state each rank holds, gathered to
  rank 0, with throughput and scaling efficiency against one process.
- Strategies, all trained by the shared ``Trainer`` (autocast, and a ``GradScaler`` of its own
  on every rank for fp16): ``"ddp"`` (``DistributedDataParallel``), ``"ddp_zero"`` (the same,
  with ``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its share of the
  parameters, ZeRO stage 1) and ``"fsdp2"`` (``fully_shard`` with
  ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)``: parameters, gradients and
  optimizer state all sharded).
- Clear errors: more processes than devices, a backend that cannot run here, settings that
  differ between ranks (``check_same_settings`` all-gathers them and compares).

Outside a notebook, the same runs start with torchrun (one process per GPU)::

    torchrun --standalone --nproc_per_node=4 -m amp_lessons.distributed \\
        --model tiny_transformer --strategy fsdp2 --precision bf16

or, without torchrun, ``python -m amp_lessons.distributed --nproc 4 ...`` (spawns them itself).
``NCCL_NVLS_ENABLE`` is set to ``0`` (NVLink multicast off) unless it is already set.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._validate import check_choice, check_int
from .precision import HALF_DTYPES, PRECISIONS
from .tables import text_table

BACKENDS = ("nccl", "gloo")
STRATEGIES = ("ddp", "ddp_zero", "fsdp2")
OPTIMIZERS = ("sgd", "adamw")
MODELS = ("mlp", "small_cnn", "resnet18", "resnet50", "tiny_transformer")
WORLD_SIZES = (1, 2, 4, 8)
MIB, GIB = 2**20, 2**30

CLAIM_R10 = ("article R, claim R10: on several 8 GB cards, AMP + ZeRO stage 1 saves 60-70% of "
             "GPU memory")
CLAIM_R10_RANGE = (0.60, 0.70)


# --- checks -------------------------------------------------------------------------------------

def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_backend() -> str:
    """``"nccl"`` where CUDA GPUs and NCCL are present, else ``"gloo"`` (CPU processes)."""
    if torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_slots(backend: str) -> int:
    """How many processes ``backend`` can run here: one per GPU (nccl), one per CPU core (gloo)."""
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return _cpu_count()


def check_backend(backend: Optional[str] = None) -> str:
    """Resolve ``backend`` (``None``: the default here); ``ValueError`` where it cannot run."""
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this PyTorch build")
    if backend is None:
        return default_backend()
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs and this machine has none; "
                             "use backend='gloo' (CPU processes)")
        if not dist.is_nccl_available():
            raise ValueError("backend 'nccl' is not built into this PyTorch; use 'gloo'")
    elif not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not built into this PyTorch")
    return backend


def check_world_size(world_size: int, backend: str) -> None:
    """``ValueError`` when ``world_size`` asks for more processes than ``backend`` has devices."""
    check_int("world_size", world_size, 1)
    slots = device_slots(backend)
    if world_size > slots:
        what = "CUDA devices" if backend == "nccl" else "CPU cores"
        raise ValueError(f"world_size={world_size} is more processes than this machine has "
                         f"{what} ({slots}); allowed: 1..{slots} with backend {backend!r}")


def available_world_sizes(backend: Optional[str] = None,
                          candidates: Sequence[int] = WORLD_SIZES) -> List[int]:
    """The ``candidates`` this machine can run with ``backend`` (e.g. ``[1]`` on one GPU)."""
    backend = check_backend(backend)
    slots = device_slots(backend)
    return [n for n in candidates if n <= slots]


def describe_world(backend: Optional[str] = None,
                   candidates: Sequence[int] = WORLD_SIZES) -> str:
    """One paragraph: the devices ``backend`` uses here, which world sizes run, which do not."""
    backend = check_backend(backend)
    slots = device_slots(backend)
    run = [n for n in candidates if n <= slots]
    skipped = [n for n in candidates if n > slots]
    if backend == "nccl":
        names = sorted({torch.cuda.get_device_name(i) for i in range(slots)})
        where = f"NCCL, one process per GPU: {slots} x {', '.join(names)}"
        why = f"needs that many GPUs; this machine has {slots}"
    else:
        where = f"gloo, CPU processes: {slots} CPU cores"
        why = f"needs that many CPU cores; this machine has {slots}"
    text = (f"backend  : {where}\nrun here : world sizes {', '.join(map(str, run)) or 'none'}"
            f" (of {', '.join(map(str, candidates))})")
    if skipped:
        text += f"\nnot run  : world sizes {', '.join(map(str, skipped))} ({why})"
    return text


# --- launching ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankContext:
    """What a process of a launch knows about itself: its rank, the world and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def device_type(self) -> str:
        """``"cuda"`` (nccl) or ``"cpu"`` (gloo): the ``device_type`` of ``torch.autocast``."""
        return self.device.type


def free_port() -> int:
    """A TCP port that is free on this machine now (for the rendezvous of a new launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank: int, world_size: int, local_rank: int, backend: str, init_method: str,
               timeout_s: float) -> RankContext:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # Processes share the cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, _cpu_count() // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=_dt.timedelta(seconds=timeout_s))
    return RankContext(rank, world_size, local_rank, backend, device)


def barrier(ctx: RankContext, group=None) -> None:
    """``dist.barrier`` over ``group``, naming this rank's GPU under NCCL (no device guessing)."""
    if ctx.backend == "nccl":
        dist.barrier(group, device_ids=[ctx.device.index])
    else:
        dist.barrier(group)


# Set for the spawned processes only: torch's C++ warnings (c10 logging) would otherwise go
# straight to stderr from every rank; Python warnings are collected and returned (run_plan).
_CHILD_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "NCCL_NVLS_ENABLE": "0"}


@contextmanager
def _child_environment():
    """Variables the spawned processes inherit (those the user set already are kept)."""
    added = {k: v for k, v in _CHILD_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _spawn_entry(index: int, fn: Callable, world_size: int, backend: str, port: int,
                 args: tuple, outdir: str, timeout_s: float) -> None:
    """What each spawned process runs: join the group, call ``fn``, hand rank 0's result back."""
    try:
        ctx = _init_rank(index, world_size, index, backend, f"tcp://127.0.0.1:{port}", timeout_s)
        result = fn(ctx, *args)
        if index == 0:
            torch.save(result, Path(outdir) / "result.pt")
        barrier(ctx)  # no rank leaves (closing its connections) before every rank is done
    except Exception as exc:
        (Path(outdir) / f"error-{index}.json").write_text(json.dumps(
            {"rank": index, "type": type(exc).__name__, "message": str(exc),
             "traceback": traceback.format_exc(), "time": time.time()}))
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    _leave_now()  # every rank is past the barrier and rank 0's result is on disk


def _check_importable(fn: Callable) -> None:
    target = getattr(fn, "func", fn)  # functools.partial
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", "")
    if not callable(fn) or module in (None, "__main__") or "<" in qualname:
        raise ValueError("fn must be a function defined at the top level of an importable module "
                         "(a spawned process imports it by name; a function typed into a notebook "
                         f"or a lambda cannot be); got {fn!r}")


def _worker_error(outdir: Path, exc: BaseException) -> Exception:
    # The first error is the cause; the others are usually peers losing their connection to it.
    errors = sorted((json.loads(p.read_text()) for p in outdir.glob("error-*.json")),
                    key=lambda e: e["time"])
    if not errors:
        return RuntimeError(f"a process of the launch died without a Python error: {exc} (run "
                            "from a script, the launch must sit under `if __name__ == "
                            "'__main__':`; the process's own output says more)")
    for e in errors:  # a ValueError is a bad setting: raise it as one, without the traceback
        if e["type"] == "ValueError":
            return ValueError(e["message"])
    first = errors[0]
    return RuntimeError(f"rank {first['rank']} failed with {first['type']}: {first['message']}\n"
                        f"{first['traceback']}")


def _stop(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Callable, world_size: int, args: tuple = (), backend: Optional[str] = None,
           timeout_s: float = 600.0) -> Any:
    """Run ``fn(ctx, *args)`` in ``world_size`` new processes and return rank 0's return value.

    Each process gets a ``RankContext`` and is already in the default process group (NCCL with
    one GPU per process, ``torch.cuda.set_device(rank)`` done; or gloo on the CPU). Rank 0's
    return value comes back through ``torch.save``/``torch.load(weights_only=True)``: plain data
    and tensors. A ``ValueError`` in any rank is raised here as a ``ValueError`` (bad settings);
    any other failure as a ``RuntimeError`` with the rank's traceback; a launch that runs past
    ``timeout_s`` seconds is stopped. The torchrun equivalent is ``main()`` (see the module doc).
    """
    import torch.multiprocessing as mp

    _check_importable(fn)
    backend = check_backend(backend)
    check_world_size(world_size, backend)
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds; got {timeout_s!r}")
    with tempfile.TemporaryDirectory(prefix="amp-lessons-launch-") as tmp:
        outdir = Path(tmp)
        with _child_environment():
            context = mp.start_processes(
                _spawn_entry,
                args=(fn, world_size, backend, free_port(), tuple(args), tmp, timeout_s),
                nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1.0, grace_period=10.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the launch ran past timeout_s={timeout_s} s and was "
                                       "stopped")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _worker_error(outdir, exc) from None  # torch stopped the other ranks already
        except BaseException:  # timeout, or the notebook's kernel interrupted: stop every rank
            _stop(context.processes)
            raise
        finally:
            for path in context.error_files:  # torch's own traceback files, read above or unused
                if path and os.path.exists(path):
                    os.remove(path)
        result_file = outdir / "result.pt"
        return torch.load(result_file, weights_only=True) if result_file.exists() else None


# --- agreement between ranks --------------------------------------------------------------------

def check_same_settings(settings: Dict[str, Any], group=None) -> None:
    """All-gather ``settings`` from every rank of ``group`` and compare them with each other.

    Raises the same ``ValueError`` on every rank (so none is left waiting in a collective),
    naming each setting that differs and its value on each rank. Under torchrun each process
    parses its own flags and environment; a rank with other settings would train a different
    model, or hang the others at the first collective that no longer matches.
    """
    if not isinstance(settings, dict):
        raise ValueError(f"settings must be a dict; got {type(settings).__name__}")
    gathered: List[Optional[dict]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, settings, group=group)
    missing = object()
    diffs = []
    for key in sorted({k for g in gathered for k in g}, key=str):
        values = [g.get(key, missing) for g in gathered]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"rank {r}: {'(missing)' if v is missing else repr(v)}"
                              for r, v in enumerate(values))
            diffs.append(f"{key} ({shown})")
    if diffs:
        raise ValueError("every rank must use the same settings; these differ: "
                         + "; ".join(diffs))


# --- one run ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunConfig:
    """One training run, the same on every rank. ``batch_size`` is per rank (per GPU).

    ``model``: one of ``MODELS`` (``model_kwargs`` go to its constructor); ``strategy``: one of
    ``STRATEGIES``; ``precision``: ``fp32``, ``tf32``, ``fp16`` (autocast + GradScaler; ``amp``
    is accepted for it) or ``bf16``. The run takes ``warmup`` untimed steps, then ``steps`` timed
    ones, on one fixed synthetic batch (the global batch of ``world_size * batch_size`` examples
    is made from ``seed``, and each rank takes its slice: one process with the whole batch sees
    exactly what several see together). ``keep_params`` returns the trained parameters.
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

    def __post_init__(self):
        if self.precision == "amp":
            object.__setattr__(self, "precision", "fp16")
        check_choice("model", self.model, MODELS)
        check_choice("strategy", self.strategy, STRATEGIES)
        check_choice("precision", self.precision, PRECISIONS + ("amp",))
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_int("batch_size", self.batch_size, 1)
        check_int("image_size", self.image_size, 8)
        check_int("steps", self.steps, 1)
        check_int("warmup", self.warmup, 0)
        check_int("seed", self.seed, 0)
        if not isinstance(self.model_kwargs, dict):
            raise ValueError(f"model_kwargs must be a dict; got {self.model_kwargs!r}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < 10):
            raise ValueError(f"lr must be a number in (0, 10); got {self.lr!r}")
        if not (isinstance(self.init_scale, (int, float)) and self.init_scale > 0):
            raise ValueError(f"init_scale must be a number > 0; got {self.init_scale!r}")

    @property
    def name(self) -> str:
        """The row label: ``label`` or ``"<model> <strategy> <precision>"``."""
        return self.label or f"{self.model} {self.strategy} {self.precision}"

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
    """The model ``config`` names, on the CPU, in fp32 (seeded by the caller)."""
    from . import models
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
    """This rank's slice of the global batch (``world_size * batch_size`` examples from seed)."""
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
        from .data import synthetic_images
        num_classes = config.model_kwargs.get("num_classes", 10)
        x, y = synthetic_images(total, config.image_size, num_classes, device=device,
                                seed=config.seed)
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
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 and 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def shard_units(model: nn.Module) -> List[nn.Module]:
    """The sub-modules FSDP2 shards one by one: transformer blocks, ResNet residual blocks."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    stages = [getattr(model, n) for n in ("layer1", "layer2", "layer3", "layer4")
              if hasattr(model, n)]
    return [block for stage in stages for block in stage.children()]


def fsdp2_shard(model: nn.Module, precision: str, mesh) -> nn.Module:
    """Apply ``fully_shard`` to each of ``shard_units(model)``, then to the whole model.

    fp16/bf16: ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)``: the gathered
    parameters (and so the all-gather traffic) are half precision, gradients are reduced in fp32
    and the sharded master parameters and optimizer state stay fp32. BatchNorm layers get their
    own unit with fp32 parameters (as FSDP1 did by default): their running statistics are fp32.
    """
    fully_shard, MixedPrecisionPolicy = _fsdp_api()
    half = HALF_DTYPES.get(precision)
    policy = (MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half
              else MixedPrecisionPolicy())
    if half:
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                fully_shard(m, mesh=mesh, mp_policy=fp32)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


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


def _trainer():
    return importlib.import_module(".trainer", __package__)


def _autocast(precision: str, device_type: str):
    return _trainer().autocast_for(precision, device_type)


def _loss_fn(config: RunConfig):
    if config.model == "tiny_transformer":
        from .models import lm_loss
        return lm_loss
    return F.cross_entropy


def make_trainer(config: RunConfig, model: nn.Module, optimizer, device):
    """The shared ``Trainer`` for a wrapped model: the same loop for DDP, ZeRO and FSDP2.

    Autocast and a ``GradScaler`` of its own on every rank (fp16). Under DDP the gradients are
    already averaged when the scaler checks them, so every rank finds the same inf/NaN and skips
    the same steps. Under FSDP2 each rank holds only its shard of the gradients (DTensors), and
    their inf/NaN check in ``unscale_`` all-reduces the result over the mesh (torch >= 2.5): the
    ordinary ``torch.amp.GradScaler`` does what FSDP1 needed ``ShardedGradScaler`` for.
    Gradient norm and per-step memory tracking are off: ``run_one`` measures around the steps.
    """
    trainer = _trainer()
    tc = trainer.TrainConfig(precision=config.precision,
                             scaler=trainer.ScalerSettings(init_scale=float(config.init_scale)),
                             progress=False, seed=None, track_grad_norm=False,
                             track_memory=False)
    return trainer.Trainer(model, optimizer, tc, device=device, loss_fn=_loss_fn(config))


def _time_steps(step: Callable, n: int, device) -> Tuple[List[float], List[torch.Tensor]]:
    losses, times = [], []
    if device.type == "cuda":
        events = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) / 1000 for s, e in events]
    else:
        for _ in range(n):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
    return times, losses


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
    with _autocast(config.precision, device.type):
        loss = _loss_fn(config)(model(x), y)
    loss.backward()
    params = list(model.parameters())
    held = _bytes(p.grad for p in params)
    for p in params:
        p.grad = None
    return held


def run_one(ctx: RankContext, config: RunConfig, world_size: int, group=None) -> Dict[str, Any]:
    """Train ``config`` on this rank as one of ``world_size`` ranks of ``group``; one result row.

    Called on every rank of ``group`` (``run_experiments`` does this). Peak memory is read after
    ``reset_peak_memory_stats`` once the warm-up has created the optimizer state.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = ctx.device
    rank = dist.get_rank(group)
    torch.manual_seed(config.seed)
    with device:  # built where it trains: no slow CPU initialisation of large models
        model = build_model(config)
    x, y = make_batch(config, model, rank, world_size, device)
    if config.strategy == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        fsdp2_shard(model, config.precision, DeviceMesh.from_group(group, device.type))
        optimizer = make_optimizer(config, model.parameters())
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    process_group=group)
        optimizer = make_optimizer(config, model.parameters(),
                                   zero=config.strategy == "ddp_zero", group=group)
    trainer = make_trainer(config, model, optimizer, device)

    def step():
        return trainer.train_step([(x, y)]).loss

    _, warm_losses = _time_steps(step, config.warmup, device)
    barrier(ctx, group)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = _time_steps(step, config.steps, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    state = local_state_bytes(model, optimizer)
    state["grads"] = _gradient_bytes(config, model, x, y, device)
    median = statistics.median(times)
    row = {
        "label": config.name, "model": config.model, "strategy": config.strategy,
        "precision": config.precision, "world_size": world_size, "rank": rank,
        "device": _device_name(device), "batch_size": config.batch_size, "unit": config.unit,
        "step_ms": median * 1000, "per_rank_per_s": config.batch_size / median,
        "peak_gib": peak / GIB if peak is not None else None,
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
    import platform
    return platform.processor() or platform.machine() or "CPU"


def _torch_version() -> Tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _precision_problem(config: RunConfig, device) -> Optional[str]:
    """Why ``config`` cannot run on ``device`` (None when it can), found before any training."""
    if config.strategy == "fsdp2" and config.precision == "fp16" and _torch_version() < (2, 5):
        return ("precision 'fp16' with strategy 'fsdp2' needs torch >= 2.5 (its GradScaler "
                "handles sharded DTensor gradients from then on); use 'bf16'")
    try:
        _trainer().check_precision(config.precision, device)
    except ValueError as exc:
        return str(exc)
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
        throughput (1.0 = perfect scaling), where the sweep ran it on one process.
        """
        groups: Dict[Tuple[str, int], List[dict]] = {}
        for r in self.rows:
            groups.setdefault((r["label"], r["world_size"]), []).append(r)
        out = []
        for (label, n), rs in groups.items():
            held = max(r["param_mib"] + r["grad_mib"] + r["optimizer_state_mib"] for r in rs)
            slowest = max(r["step_ms"] for r in rs)
            peaks = [r["peak_gib"] for r in rs if r["peak_gib"] is not None]
            first = rs[0]
            out.append({
                "label": label, "model": first["model"], "strategy": first["strategy"],
                "precision": first["precision"], "world_size": n, "unit": first["unit"],
                "batch_size": first["batch_size"], "step_ms": slowest,
                "per_s": n * first["batch_size"] / (slowest / 1000),
                "peak_gib": max(peaks) if peaks else None,
                "param_mib": max(r["param_mib"] for r in rs),
                "grad_mib": max(r["grad_mib"] for r in rs),
                "optimizer_state_mib": max(r["optimizer_state_mib"] for r in rs),
                "model_state_mib": held,
                "final_loss": statistics.mean(r["losses"][-1] for r in rs),
            })
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
        return ([f"not run: {k['label']} on {k['world_size']} processes: {k['reason']}"
                 for k in self.skipped]
                + [f"warning raised on the ranks: {w}" for w in self.warnings])

    def published_rows(self) -> List[Dict[str, Any]]:
        """The summary with readable column names and units, for ``report.publish``."""
        out = []
        for s in self.summary():
            eff = s["efficiency"]
            out.append({
                "run": s["label"], "processes": s["world_size"],
                f"throughput ({s['unit']}/s)": s["per_s"],
                "scaling efficiency (%)": 100 * eff if eff is not None else None,
                "peak memory per rank (GiB)": s["peak_gib"],
                "weights + grads + optimizer state per rank (MiB)": s["model_state_mib"],
                "optimizer state per rank (MiB)": s["optimizer_state_mib"],
            })
        return out

    def per_rank_table(self) -> str:
        """Every rank's step time, examples/s, peak memory and state it holds, as text."""
        return text_table(self.rows, PER_RANK_COLUMNS)

    def scaling_table(self) -> str:
        """The summary as text: throughput, efficiency and per-rank memory per world size."""
        return text_table(self.summary(), SUMMARY_COLUMNS)


def run_experiments(plan: Sequence[Tuple[RunConfig, int]], backend: Optional[str] = None,
                    timeout_s: float = 600.0) -> SweepResult:
    """Run every ``(config, world_size)`` of ``plan`` (see ``grid``) in one launch.

    Launches ``max(world_size)`` processes once; each world size trains on a sub-group of ranks
    ``0..n-1`` while the rest wait, so starting processes and CUDA is paid once, not per run.
    """
    plan = list(plan)
    if not plan:
        raise ValueError("plan must hold at least one (config, world_size) pair")
    for item in plan:
        if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], RunConfig)):
            raise ValueError(f"plan items must be (RunConfig, world_size) pairs; got {item!r}")
        check_int("world size", item[1], 1)
    backend = check_backend(backend)
    launched = max(n for _, n in plan)
    check_world_size(launched, backend)
    out = launch(run_plan, launched, args=(plan,), backend=backend, timeout_s=timeout_s)
    return SweepResult(rows=out["rows"], backend=backend, launched=launched,
                       skipped=out["skipped"], warnings=out["warnings"])


# --- tables and claims --------------------------------------------------------------------------

PER_RANK_COLUMNS = (("label", "run"), ("world_size", "ranks"), ("rank", "rank"),
                    ("step_ms", "step ms"), ("per_rank_per_s", "examples/s"),
                    ("peak_gib", "peak GiB"), ("param_mib", "params MiB"),
                    ("grad_mib", "grads MiB"), ("optimizer_state_mib", "opt. state MiB"))
SUMMARY_COLUMNS = (("label", "run"), ("world_size", "ranks"), ("per_s", "examples/s"),
                   ("efficiency", "scaling eff.", "{:.0%}"), ("peak_gib", "peak GiB/rank"),
                   ("model_state_mib", "state MiB/rank"),
                   ("optimizer_state_mib", "opt. state MiB/rank"), ("final_loss", "last loss"))






def zero_savings(result: SweepResult, baseline: str, zero: str, world_size: int) -> Dict[str, Any]:
    """What ZeRO (or any run ``zero``) saves per rank against ``baseline`` at ``world_size``.

    Fractions saved of the optimizer state, of all model state (parameters + gradients +
    optimizer state) and, on GPUs, of peak memory. Claim R10 is judged on peak memory where it
    was measured (GPUs), else on model state (the CPU has no peak counter).
    """
    base, z = result.find(baseline, world_size), result.find(zero, world_size)

    def saved(key):
        a, b = base.get(key), z.get(key)
        return 1 - b / a if a and b is not None else None
    out = {"world_size": world_size, "baseline": baseline, "zero": zero,
           "optimizer_state_mib": (base["optimizer_state_mib"], z["optimizer_state_mib"]),
           "model_state_mib": (base["model_state_mib"], z["model_state_mib"]),
           "peak_gib": (base["peak_gib"], z["peak_gib"]),
           "optimizer_state_saved": saved("optimizer_state_mib"),
           "model_state_saved": saved("model_state_mib"), "peak_saved": saved("peak_gib")}
    out["judged_on"] = "peak memory" if out["peak_saved"] is not None else "model state"
    out["saved"] = out["peak_saved"] if out["peak_saved"] is not None else out["model_state_saved"]
    return out


def r10_rows(claim: Dict[str, Any], comparisons: Sequence[Dict[str, Any]] = ()) -> List[dict]:
    """Claim R10 beside ``zero_savings`` measurements, for publishing: ``claim`` is judged (AMP +
    ZeRO stage 1), ``comparisons`` (e.g. FSDP2) are shown beside it without a verdict."""
    low, high = CLAIM_R10_RANGE

    def pct(v):
        return 100 * v if v is not None else None
    rows = []
    for s, judged in [(claim, True)] + [(c, False) for c in comparisons]:
        saved = s["saved"]
        rows.append({
            "run": s["zero"], "against": s["baseline"], "processes": s["world_size"],
            "judged on": s["judged_on"], "saved per rank (%)": pct(saved),
            "optimizer state saved per rank (%)": pct(s["optimizer_state_saved"]),
            "claim R10 (%)": f"{100 * low:.0f}-{100 * high:.0f}" if judged else None,
            "claim held": (("not decided (1 process)" if s["world_size"] < 2 else
                            saved is not None and low <= saved <= high) if judged else None),
        })
    return rows


def verdict_r10(savings: Dict[str, Any]) -> str:
    """Claim R10 beside the measurement, and which way it went (computed, not typed in)."""
    low, high = CLAIM_R10_RANGE
    s = savings["saved"]
    if s is None:
        return f"{CLAIM_R10}. Not measured here."
    if savings["world_size"] < 2:
        return (f"{CLAIM_R10}.\nNot decided here: with 1 process ZeRO has nothing to shard "
                f"across, so '{savings['zero']}' saving {s:.0%} of {savings['judged_on']} "
                f"against '{savings['baseline']}' is mixed precision's saving alone. "
                f"The claim needs 2 or more GPUs.")
    where = ("within" if low <= s <= high else "below" if s < low else "above")
    held = "held" if where == "within" else "did not hold"
    return (f"{CLAIM_R10}.\nMeasured on {savings['world_size']} ranks: "
            f"'{savings['zero']}' uses {s:.0%} less {savings['judged_on']} per rank than "
            f"'{savings['baseline']}' ({where} the claimed {low:.0%}-{high:.0%}: the claim {held} "
            f"here). Optimizer state per rank: {savings['optimizer_state_saved']:.0%} less.")


CLAIM_R11 = ('article R, claim R11: a DeepSpeed config enables mixed precision with '
             '"amp": {"enabled": true, "opt_level": "O2"}')

# Claim R11's key, DeepSpeed's own mixed-precision and ZeRO keys (from its config documentation,
# deepspeed.ai/docs/config-json), and what PyTorch itself offers for each.
DEEPSPEED_EQUIVALENTS = (
    ('"amp": {"enabled": true, "opt_level": "O2"}',
     "passes everything but 'enabled' to NVIDIA Apex's amp.initialize (Apex AMP, deprecated by "
     "Apex in favour of PyTorch AMP); needs Apex installed; cannot be combined with \"fp16\" or "
     "with ZeRO",
     "torch.autocast + torch.amp.GradScaler (what Apex O1 became). O2 (fp16 weights, fp32 master "
     "copy) is closest to FSDP2's MixedPrecisionPolicy(param_dtype=torch.float16)"),
    ('"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}',
     "DeepSpeed's own fp16 training; loss_scale 0 = dynamic loss scaling from 2**16",
     "torch.autocast(device_type, dtype=torch.float16) + torch.amp.GradScaler(init_scale=2**16)"),
    ('"bf16": {"enabled": true}',
     "DeepSpeed's own bf16 training, no loss scaling",
     "torch.autocast(device_type, dtype=torch.bfloat16); under FSDP2 "
     "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"),
    ('"zero_optimization": {"stage": 1}',
     "ZeRO stage 1: optimizer state sharded across ranks",
     "torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=...)"),
    ('"zero_optimization": {"stage": 2}',
     "stage 2: optimizer state and gradients sharded",
     "torch.distributed.fsdp.fully_shard(module, reshard_after_forward=False)"),
    ('"zero_optimization": {"stage": 3}',
     "stage 3: optimizer state, gradients and parameters sharded",
     "torch.distributed.fsdp.fully_shard(module) (reshard_after_forward=True)"),
)


def deepspeed_equivalents() -> str:
    """Claim R11's DeepSpeed keys beside what each does and PyTorch's own way to do it (text)."""
    blocks = []
    for key, does, native in DEEPSPEED_EQUIVALENTS:
        blocks.append(f"DeepSpeed {key}\n  does   : {does}\n  PyTorch: {native}")
    return "\n\n".join(blocks)


def native_support() -> Dict[str, Any]:
    """What this installation has: PyTorch's native pieces (used above) and, looked up without
    importing them, DeepSpeed and NVIDIA Apex (which claim R11's ``"amp"`` key needs)."""
    import importlib.util

    def importable(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    try:
        _fsdp_api()
        fsdp2 = True
    except ImportError:
        fsdp2 = False
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401 - present since 1.8
    return {"torch": torch.__version__, "torch.amp.GradScaler": hasattr(torch.amp, "GradScaler"),
            "fully_shard + MixedPrecisionPolicy": fsdp2, "ZeroRedundancyOptimizer": True,
            "deepspeed installed": importable("deepspeed"), "apex installed": importable("apex")}


# --- torchrun / command line --------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m amp_lessons.distributed",
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
    """Entry point of ``python -m amp_lessons.distributed`` (and of torchrun ``-m``)."""
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
            ctx = _init_rank(int(os.environ["RANK"]), world, local, backend, "env://", 600.0)
            try:
                out = run_plan(ctx, [(config, world)])
            except BaseException:
                dist.destroy_process_group()
                raise
            if ctx.rank != 0:
                _leave_now()  # see _leave_now: gloo's teardown at exit can abort a finished rank
            result = SweepResult(rows=out["rows"], backend=backend, launched=world,
                                 skipped=out["skipped"], warnings=out["warnings"])
        else:
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
        _leave_now()
    return 0


def _leave_now() -> None:
    """Exit this rank at once, output flushed: every collective is done, and tearing the gloo
    groups down at interpreter exit sometimes aborts a process (SIGABRT, "terminate called
    without an active exception"), which would turn a finished run into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # Run the package's own copy of this module, not this `__main__` one: spawned processes
    # import the worker functions and RunConfig by their package names.
    from amp_lessons.distributed import main as _main
    sys.exit(_main())
