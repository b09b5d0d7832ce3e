"""The runner: one configuration measured (``measure``), many in one process (``run_configs``),
and the trainer's step against the hand-written one (``compare_loops``). An out-of-memory error
becomes a row, never a dead kernel. Memory breakdown and the profiler pass run outside the timed
steps: the breakdown before the warm-up, the profiler after the peak memory was read."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Sequence

import torch

from amp_lessons.validate import check_bool, check_int
from amp_lessons.data import synthetic_images
from amp_lessons.env import allocatable_bytes
from amp_lessons.numerics.precision import precision_settings
from amp_lessons.tables import plural
from amp_lessons.progress import progress_bar
from amp_lessons.measure.config import BenchConfig, skip_reason
from amp_lessons.lineage import call, traced
from amp_lessons.measure.memory import GIB, memory_breakdown, optimizer_state_tensors, tensor_bytes
from amp_lessons.measure.oom import free_memory, is_out_of_memory
from amp_lessons.measure.rows import noisy
from amp_lessons.measure.steps import build_model, build_optimizer, cuda_graph_step, hand_step, trainer_step
from amp_lessons.measure.timer import device_busy_ms, idle_fraction, summarize_times, time_steps


ROW_KEYS = ("label", "status", "reason", "img_per_s", "step_ms", "step_ms_q1", "step_ms_q3", "spread",
            "peak_allocated_gib", "peak_reserved_gib", "params_gib", "grads_gib",
            "optimizer_state_gib", "activations_gib", "activations_allocated_gib", "loss",
            "gpu_busy_ms", "gpu_idle_fraction", "timer", "steps", "warmup", "seconds")


def _empty_row(config: BenchConfig, status: str, reason: str = "") -> Dict[str, object]:
    row = {k: None for k in ROW_KEYS}
    row.update(label=config.label, status=status, reason=reason, config=asdict(config))
    return row


def _measure(config: BenchConfig, device: torch.device, warmup: int, steps: int,
             breakdown: bool, idle: bool) -> Dict[str, object]:
    torch.manual_seed(0)
    model = build_model(config, device)
    optimizer = build_optimizer(config, model.parameters())
    x, y = synthetic_images(config.batch_size, config.image_size, config.num_classes, device,
                            channels_last=config.channels_last)
    compiled = model if not config.compile else torch.compile(model, mode=config.compile)
    cudagraph_mode = bool(config.compile) and config.compile in ("reduce-overhead", "max-autotune")
    # the calls are recorded (lineage.call): ``explain`` names the step each row timed
    if config.loop == "trainer":
        step = call(trainer_step, compiled, optimizer, config, device)
    else:
        step = call(hand_step, compiled, optimizer, config.precision, device,
                    cache_enabled=not config.cuda_graph, mark_step=cudagraph_mode)
    row = _empty_row(config, "ok")
    if breakdown:  # on the eager model: saved-tensor hooks do not see inside compiled graphs
        row.update(call(memory_breakdown, hand_step(model, optimizer, config.precision, device),
                        x, y, device))
    graphed = config.cuda_graph or cudagraph_mode
    if graphed and device.type == "cuda":
        # a CUDA graph's memory pool is set aside during warm-up and capture and held for the
        # whole run: count it, so the row's peak is what the configuration really needs
        free_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
    run = step
    if config.cuda_graph:
        run = call(cuda_graph_step, step, x, y, warmup=max(warmup, 2))
    timing = call(time_steps, run, x, y, warmup=warmup, steps=steps, device=device,
                  reset_peak=not graphed)
    row.update(summarize_times(timing["times_ms"], config.batch_size))
    row.update(loss=timing["loss"], timer=timing["timer"], steps=steps, warmup=warmup)
    row["optimizer_state_gib"] = tensor_bytes(optimizer_state_tensors(optimizer)) / GIB
    if device.type == "cuda":
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        if idle:  # a few more steps under the profiler, after the peak was read
            try:
                row["gpu_busy_ms"] = device_busy_ms(run, x, y, device)
            except RuntimeError as exc:  # a profiler that cannot start leaves the share unknown
                row["reason"] = f"GPU idle share not measured ({exc})"[:200]
            if not row["gpu_busy_ms"]:  # no device events recorded (no CUPTI): unknown, not idle
                row["gpu_busy_ms"] = None
            row["gpu_idle_fraction"] = idle_fraction(row["gpu_busy_ms"], row["step_ms"])
        if graphed:
            row["reason"] = ("peak over warm-up, capture and timed steps: a CUDA graph holds "
                             "its memory pool for the whole run")
    if not optimizer_state_tensors(optimizer):
        # GradScaler skipped every step (inf/NaN gradients in fp16): the optimizer never made
        # its state, so 0 bytes would be wrong. Count it after everything above was read
        row["optimizer_state_gib"] = _unskipped_state_bytes(config, model) / GIB
        note = ("GradScaler skipped every step: the step time leaves out the optimizer update, "
                "and the optimizer state is counted from one unscaled step after the timing")
        row["reason"] = f"{row['reason']}; {note}" if row["reason"] else note
    if not math.isfinite(row["loss"]):
        row["status"] = "error"
        row["reason"] = f"loss is {row['loss']} after {plural(warmup + steps, 'step')} (timing kept)"
    return row


def _unskipped_state_bytes(config: BenchConfig, model: torch.nn.Module) -> int:
    """Bytes of the state ``config``'s optimizer holds over ``model``'s parameters once one step
    was taken: a fresh optimizer of the same kind and kernels steps once on zero gradients (the
    parameters may move; the measurement they served is over)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fresh = build_optimizer(config, params)
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
    fresh.step()
    return tensor_bytes(optimizer_state_tensors(fresh))


@traced
def measure(config: BenchConfig, device, warmup: int = 5, steps: int = 15,
            breakdown: bool = True, idle: bool = True) -> Dict[str, object]:
    """Measure one configuration; returns a row (a dict) whatever happens.

    On a GPU, ``idle`` adds ``gpu_busy_ms`` and ``gpu_idle_fraction`` (``device_busy_ms`` over 3
    more steps, after the timing and the peak-memory reading): whether the step kept the GPU
    busy, which a comparison between precisions must state.

    ``status`` is ``"ok"``, ``"skipped"`` (``reason`` says why: no bf16, no GPU for compile...),
    ``"out of memory"`` or ``"error"``. Where GradScaler skipped every step (fp16), the optimizer
    state is counted from a fresh optimizer's one step after the timing, and ``reason`` says so. Memory is freed before returning, also after a failure.
    """
    if not isinstance(config, BenchConfig):
        raise ValueError(f"config must be a BenchConfig; got {type(config).__name__}")
    # bad arguments are the caller's mistake, not the configuration's result: raise, no row
    warmup, steps = check_int("warmup", warmup, 0), check_int("steps", steps, 1)
    check_bool("breakdown", breakdown)
    check_bool("idle", idle)
    device = torch.device(device)
    reason = skip_reason(config, device)
    if reason:
        return _empty_row(config, "skipped", reason)
    t0 = time.perf_counter()
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    try:
        with precision_settings(config.precision, device):
            row = _measure(config, device, warmup, steps, breakdown, idle)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, never a dead kernel
        if is_out_of_memory(exc):
            total = allocatable_bytes(device) / GIB if device.type == "cuda" else None
            where = f" of this device's {total:.1f} GiB" if total else ""
            row = _empty_row(config, "out of memory",
                             f"batch {config.batch_size} needs more than the free memory{where}")
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            row = _empty_row(config, "error", f"{type(exc).__name__}: {first}"[:300])
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
        free_memory(device, reset_compiler=bool(config.compile))
    row["seconds"] = time.perf_counter() - t0
    return row


@traced
def run_configs(configs: Sequence[BenchConfig], device, warmup: int = 5, steps: int = 15,
                breakdown: bool = True, progress: bool = True, idle: bool = True,
                on_row: Optional[Callable[[Dict[str, object]], None]] = None
                ) -> List[Dict[str, object]]:
    """Measure every configuration in turn, in this process, freeing memory between them.

    ``progress`` shows the course's progress bar (``amp_lessons.progress``) over the
    configurations; ``on_row`` is called with each row as it is measured. Each row is recorded
    with the call that measured it (``lineage``): ``explain`` names the step it timed."""
    configs = list(configs)
    if not configs or not all(isinstance(c, BenchConfig) for c in configs):
        raise ValueError("configs must hold at least one BenchConfig, and nothing else")
    check_int("warmup", warmup, 0)
    check_int("steps", steps, 1)
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError("configuration labels must be unique")
    check_bool("progress", progress)
    rows = []
    free_memory(device)
    with progress_bar(configs, desc="measuring", unit="configuration", leave=False,
                      disable=not progress) as bar:
        for config in bar:
            row = measure(config, device, warmup=warmup, steps=steps, breakdown=breakdown,
                          idle=idle)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows



def compare_loops(config: BenchConfig, device, warmup: int = 5, steps: int = 15,
                  rounds: int = 3) -> Dict[str, object]:
    """Time ``Trainer.train_step`` and the hand-written step on one model, interleaved.

    Both train the same model with the same optimizer; ``rounds`` alternating blocks of
    ``steps`` timed steps each cancel slow drifts (clocks, other processes). Returns the median
    img/s of each and ``overhead_pct`` (how much slower the trainer is; negative: faster), with
    its noise: ``overhead_rounds_pct`` (the overhead from each round's medians),
    ``overhead_spread_pct`` (slowest minus fastest round, in percentage points; None with one
    round), ``spread`` (the larger ``repeat_spread`` of the two loops' step times, as in
    ``measure``'s rows) and ``note``: "" when the overhead stands, else why it decides nothing
    (``noisy``: repeats differ by over 10%; or "undecided": one round, or the overhead is no
    larger than the rounds' spread, the noise floor).
    """
    check_int("rounds", rounds, 1)
    device = torch.device(device)
    reason = skip_reason(config, device)
    if reason:
        return {"label": config.label, "status": "skipped", "reason": reason}
    old_benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    try:
        with precision_settings(config.precision, device):
            torch.manual_seed(0)
            model = build_model(config, device)
            optimizer = build_optimizer(config, model.parameters())
            x, y = synthetic_images(config.batch_size, config.image_size, config.num_classes,
                                    device, channels_last=config.channels_last)
            hand = hand_step(model, optimizer, config.precision, device)
            trained = trainer_step(model, optimizer, config, device)
            times: Dict[str, List[float]] = {"hand": [], "trainer": []}
            per_round: List[Dict[str, float]] = []
            for r in range(rounds):
                medians: Dict[str, float] = {}
                for name, step in (("hand", hand), ("trainer", trained)) if r % 2 == 0 else \
                        (("trainer", trained), ("hand", hand)):
                    t = time_steps(step, x, y, warmup=warmup if r == 0 else 1, steps=steps,
                                   device=device)
                    times[name] += t["times_ms"]
                    medians[name] = statistics.median(t["times_ms"])
                per_round.append(medians)
    except Exception as exc:  # noqa: BLE001
        status = "out of memory" if is_out_of_memory(exc) else "error"
        return {"label": config.label, "status": status, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        torch.backends.cudnn.benchmark = old_benchmark
        free_memory(device)
    hand_s = summarize_times(times["hand"], config.batch_size)
    trainer_s = summarize_times(times["trainer"], config.batch_size)
    out = {"label": config.label, "status": "ok", "reason": "",
           "hand_img_per_s": hand_s["img_per_s"], "trainer_img_per_s": trainer_s["img_per_s"],
           "overhead_pct": 100 * (hand_s["img_per_s"] / trainer_s["img_per_s"] - 1),
           "steps_each": len(times["hand"]), "timer": "CUDA events" if device.type == "cuda"
           else "perf_counter"}
    out.update(overhead_noise(out["overhead_pct"], per_round, hand_s["spread"],
                              trainer_s["spread"]))
    return out


def overhead_noise(overhead_pct: float, per_round: Sequence[Dict[str, float]],
                   hand_spread: Optional[float] = None,
                   trainer_spread: Optional[float] = None) -> Dict[str, object]:
    """How far ``compare_loops``' ``overhead_pct`` can be trusted: ``per_round`` holds each
    round's median step time of both loops (``{"hand": ms, "trainer": ms}``, times > 0).
    Returns ``overhead_rounds_pct``, ``overhead_spread_pct`` (max - min of those, percentage
    points; None with one round), ``spread`` (the larger repeat spread of the loops, None when
    neither has one) and ``note`` ("" when the overhead stands: larger than the rounds' spread
    and the repeats within ``NOISY_SPREAD``)."""
    rounds = [100 * (r["trainer"] / r["hand"] - 1) for r in per_round if r["hand"] > 0]
    if not rounds:
        raise ValueError("per_round must hold at least one round's medians")
    spreads = [s for s in (hand_spread, trainer_spread) if s is not None]
    out: Dict[str, object] = {"overhead_rounds_pct": rounds,
                              "overhead_spread_pct": max(rounds) - min(rounds)
                              if len(rounds) > 1 else None,
                              "spread": max(spreads) if spreads else None}
    floor = out["overhead_spread_pct"]
    out["note"] = (noisy(out) or
                   ("undecided: one round gives no spread to compare the overhead against "
                    "(rounds >= 2)" if floor is None else
                    f"undecided: the overhead ({overhead_pct:+.1f}%) is within the rounds' "
                    f"spread ({floor:.1f} points), the noise floor"
                    if abs(overhead_pct) <= floor else ""))
    return out


