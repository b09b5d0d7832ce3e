"""Lesson 08, the precision of weights and optimizer state (notebooks/08_weights_and_optimizer_state.ipynb).

Autocast lowers the precision of the math; weights and AdamW state stay in fp32, 16 bytes per
parameter with the gradients. This lesson stores them in less, and measures what it costs:

1. **why pure bf16 weights stall**: an update below half a unit in the last place (ulp) of the
   weight is rounded away (``one_weight``, ``accumulation_rows``); on a real run, the share of
   weights whose update was rounded away, step by step (``optim.RoundedAway``);
2. **the remedies**: fp32 master weights, stochastic rounding, Kahan-compensated updates
   (``optim.BF16AdamW``), and torchao's 8-bit, 4-bit and FP8 AdamW states, trained on two
   workloads with the same data for every recipe: a teacher-student MLP (a clean signal) and
   lesson 07's byte-level GPT on the standard library's source (a real one), the fp32-master
   reference over several seeds for the noise scale (``run_recipes``, ``comparison``);
3. **where the memory goes**: bytes of weights, gradients, optimizer state and activations per
   recipe, and claim R10c's question on one GPU: sharding the state (ZeRO-1) or shrinking it
   (``per_rank_rows``; lesson 06 decides the claim, this lesson only shows related numbers);
4. **which recipe for which card and model size**, derived from those measurements
   (``choice_table``).

Measuring lives in the engine (``amp_lessons.measure.optim.train_recipe``: ``timing.time_steps``, the
peak-memory reading, the out-of-memory rule); this module defines the workloads and reads the
rows. torchao is optional: without it the low-bit states are rows saying so.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from amp_lessons.publish import claims
from amp_lessons.numerics import formats
from amp_lessons import models as _models
from amp_lessons.measure import optim
from amp_lessons.validate import check_int, check_real, is_real
from amp_lessons.measure.memory import GIB
from amp_lessons.publish.report import show_table
from amp_lessons.tables import format_value, plural, text_table
from amp_lessons.lessons import l07_fp8
from amp_lessons.lineage import traced  # explain names what made each row

LESSON = "08"
DECIDES = ()  # R10c is decided by lesson 06's multi-GPU run; this lesson shows related numbers
REFERENCE = "fp32 master"
TORCH_RECIPES = ("fp32 master", "bf16", "bf16 + stochastic rounding", "bf16 + Kahan")
LOWBIT_RECIPES = ("8-bit state", "4-bit state", "FP8 state")
ALL_RECIPES = TORCH_RECIPES + LOWBIT_RECIPES
# Cards a learner meets, with the memory a process can use and whether bf16 is native.
CARDS = (("T4 (Colab, Kaggle)", 15, False), ("RTX 4090", 24, True), ("A100 40GB", 40, True),
         ("H100 / A100 80GB", 80, True), ("H200", 141, True))
MODEL_SIZES = (0.35e9, 1.3e9, 7e9, 13e9)
STATE_SHARE = 0.5  # model state may take this share of a card; the rest is for activations


# --- 1. one weight ---------------------------------------------------------------------------------

def one_weight(weight: float = 1.0, updates: Sequence[float] = (1e-2, 4e-3, 3.9e-3, 1e-3)) -> List[dict]:
    """A bf16 weight plus each update, rounded to nearest: the ulp at the weight, half of it, the
    sum kept in fp32 and in bf16, and whether bf16 kept the update."""
    check_real("weight", weight)
    rows = []
    gap = formats.ulp(weight, "bf16")
    for u in updates:
        check_real("each of updates", u)
        w = float(formats.round_to(weight, "bf16"))
        in_bf16 = float(formats.round_to(w + u, "bf16"))
        rows.append({"weight": w, "update": u, "bf16 ulp": gap, "half ulp": gap / 2,
                     "fp32 sum": float(formats.round_to(w + u, "fp32")), "bf16 sum": in_bf16,
                     "update kept": in_bf16 != w})
    return rows


def accumulation_rows(update: float = 1e-3, steps: int = 1000, start: float = 1.0,
                      seeds: Sequence[int] = (0, 1, 2)) -> List[dict]:
    """``update`` added ``steps`` times to a bf16 weight with each rounding (stochastic rounding
    over ``seeds``), beside the exact result."""
    exact = start + steps * update
    rows = []
    for rounding in optim.ROUNDINGS:
        runs = seeds if rounding == "stochastic" else seeds[:1]
        finals = [optim.accumulate_bf16(update, steps, start, rounding, s)[-1] for s in runs]
        rows.append({"rounding": rounding, "runs": len(finals), "final (mean)": statistics.fmean(finals),
                     "exact": exact,
                     "update applied %": 100 * (statistics.fmean(finals) - start) / (exact - start)})
    return rows


# --- 2. workloads ----------------------------------------------------------------------------------

@dataclass
class Workload:
    """A model builder, the batch of each step (the same for every recipe), a loss and a
    learning-rate schedule: what ``optim.train_recipe`` trains."""

    name: str
    make_model: Callable[[], nn.Module]
    batch: Callable[[int], Tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable
    steps: int
    lr_at: Callable[[int], float]
    clip: Optional[float]
    describe: str


def cosine_lr(lr: float, steps: int, warmup: int = 0, floor: float = 0.1) -> Callable[[int], float]:
    """Learning rate at each step: linear warm-up over ``warmup`` steps, then cosine decay from
    ``lr`` to ``floor * lr`` at the last step."""
    check_real("lr", lr, 0.0, low_open=True)
    check_int("steps", steps, 1)
    check_int("warmup", warmup, 0)
    if warmup >= steps:
        raise ValueError(f"warmup must be below steps ({steps}: the decay needs at least one "
                         f"step); got {warmup}")
    check_real("floor", floor, 0.0, 1.0)

    def at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = min((step - warmup) / max(steps - warmup - 1, 1), 1.0)
        return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    return at


def mlp(width: int, depth: int = 4) -> nn.Sequential:
    """``depth`` Linear(width, width) layers with GELU between them."""
    check_int("width", width, 1)
    check_int("depth", depth, 1)
    layers: List[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def teacher_student(width: int, batch_size: int, steps: int, device, lr: float = 1e-3,
                    depth: int = 4, teacher_seed: int = 1234) -> Workload:
    """A student MLP learns a fixed random teacher of the same shape: fresh Gaussian inputs every
    step (fixed by the step number, so every recipe sees the same data), MSE loss, AdamW with a
    cosine schedule to 10%."""
    check_int("batch_size", batch_size, 1)
    check_int("steps", steps, 1)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(teacher_seed)  # the teacher runs in bf16: cheap, and the same for all
        teacher = mlp(width, depth).to(device, torch.bfloat16).requires_grad_(False)

    @torch.no_grad()
    def batch(step: int):
        g = torch.Generator(device=device).manual_seed(10_000 + step)
        x = torch.randn(batch_size, width, device=device, generator=g)
        return x, teacher(x.to(torch.bfloat16)).float()

    def loss_fn(out, y):
        return nn.functional.mse_loss(out.float(), y)
    return Workload("teacher-student MLP", lambda: mlp(width, depth), batch, loss_fn, steps,
                    cosine_lr(lr, steps), None,
                    f"a {depth} x Linear({width}) MLP learns a fixed teacher, batch {batch_size}, "
                    f"{plural(steps, 'step')}")


def text_corpus(max_bytes: Optional[int] = None) -> "l07_fp8.Corpus":
    """Lesson 07's text: the Python standard library's own source, bytes as tokens (every 20th
    file held out); ``max_bytes`` caps the training text."""
    return l07_fp8.stdlib_corpus(max_bytes)


def byte_gpt(corpus: "l07_fp8.Corpus", model_kwargs: Mapping, batch_size: int, steps: int, device,
             lr: float = 1e-3, warmup: int = 50, data_seed: int = 0) -> Workload:
    """Lesson 07's byte-level GPT (``TinyTransformer``) on ``corpus``: the same batches for every
    recipe (``data_seed``), next-byte cross-entropy, gradients clipped at 1."""
    kwargs = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=64)
    kwargs.update(model_kwargs or {})
    device = torch.device(device)
    text = corpus.train.to(device)
    seq_len = kwargs["seq_len"]
    offsets = l07_fp8.batch_offsets(len(text), seq_len, batch_size, steps + 1,
                                    data_seed).to(device)  # one copy, not a blocking one per step

    def batch(step: int):
        return l07_fp8.text_batch(text, offsets[step], seq_len)
    model = _models.TinyTransformer(**kwargs)
    return Workload("byte-level GPT", lambda: _models.TinyTransformer(**kwargs), batch,
                    _models.lm_loss, steps, cosine_lr(lr, steps, min(warmup, steps - 1)), 1.0,
                    f"a {model.parameter_count() / 1e6:.2f} M-parameter GPT on {corpus.describe()}, "
                    f"{batch_size} x {plural(seq_len, 'byte')} per step, {plural(steps, 'step')}")


def run_recipes(workload: Workload, recipes: Sequence[str], device, seeds: Sequence[int] = (0, 1),
                amp_dtype: torch.dtype = torch.bfloat16, bf16: bool = True,
                time_steps: int = 0, count_every: int = 1) -> List[dict]:
    """The reference once per seed in ``seeds``, then every other recipe with the first seed
    (same initial weights, same batches): a row per run (``optim.train_recipe``), tagged with
    the workload."""
    seeds = tuple(seeds)
    if not seeds:
        raise ValueError("seeds must hold at least one seed")
    for r in recipes:
        optim.get_recipe(r)
    torchao = optim.torchao_version()
    plan = [(REFERENCE, s) for s in seeds] + [(r, seeds[0]) for r in recipes if r != REFERENCE]
    rows = []
    for name, seed in plan:
        row = optim.train_recipe(optim.get_recipe(name), workload.make_model, workload.batch,
                                 workload.loss_fn, workload.steps, workload.lr_at, device,
                                 seed=seed, amp_dtype=amp_dtype, clip=workload.clip,
                                 count_every=count_every,
                                 time_steps_n=time_steps if seed == seeds[0] else 0,
                                 bf16=bf16, torchao=torchao)
        row["workload"] = workload.name
        rows.append(row)
    return rows


def skipped_line(rows: Sequence[Mapping]) -> str:
    """One line naming the recipes that did not run and why ("" when all ran)."""
    why: Dict[str, List[str]] = {}
    for r in rows:
        if str(r["status"]).startswith("not run: "):
            names = why.setdefault(r["status"][len("not run: "):], [])
            if r["recipe"] not in names:
                names.append(r["recipe"])
    return "; ".join(f"skipped {', '.join(n)}: {w}" for w, n in why.items())


def comparison(rows: Sequence[Mapping]) -> List[dict]:
    """Each recipe's final loss beside the reference (same seed) and the reference's seed spread
    (largest minus smallest final loss): the difference, whether it is within the spread, and
    the share of updates rounded away over the last 10% of steps."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        ref = [r for r in mine if r["recipe"] == REFERENCE and r["status"] == "trained"
               and is_real(r["final_loss"])]
        finals = [r["final_loss"] for r in ref]
        spread = max(finals) - min(finals) if len(finals) >= 2 else None
        for r in mine:
            if r["recipe"] == REFERENCE and ref and r is not ref[0]:
                continue
            same = next((b for b in ref if b["seed"] == r["seed"]), None)
            final = r["final_loss"] if is_real(r.get("final_loss")) else None
            diff = final - same["final_loss"] if final is not None and same else None
            counted = r["rounded_away"]  # (step, share) every few steps; the last 10% of them
            tail = [v for s, v in counted if s >= 0.9 * len(r["losses"])] or \
                [v for _, v in counted[-max(1, len(counted) // 10):]]
            out.append({"workload": workload, "recipe": r["recipe"], "final loss": final,
                        "reference": same["final_loss"] if same else None,
                        "difference %": 100 * diff / same["final_loss"] if diff is not None else None,
                        "reference spread %": 100 * spread / same["final_loss"]
                        if spread is not None and same else None,
                        "within spread": abs(diff) <= spread if diff is not None and spread is not None
                        else None,
                        "rounded away % (last 10%)": 100 * statistics.fmean(tail) if tail else None,
                        "status": r["status"]})
    return out


def stall_line(table: Sequence[Mapping]) -> str:
    """Where pure bf16 weights stalled, from ``comparison`` rows, or why it did not show."""
    lines = []
    for row in table:
        if row["recipe"] != "bf16" or row["final loss"] is None:
            continue
        fix = {r["recipe"]: r for r in table if r["workload"] == row["workload"]}
        kept = [n for n in ("bf16 + stochastic rounding", "bf16 + Kahan")
                if fix.get(n, {}).get("difference %") is not None]
        worse = row["difference %"] or 0.0
        stalled = row["within spread"] is False and worse > 0
        lines.append(
            f"{row['workload']}: pure bf16 weights ended {worse:+.1f}% against fp32 masters "
            f"(seed spread {row['reference spread %'] or 0:.1f}%), {row['rounded away % (last 10%)'] or 0:.0f}% "
            f"of updates rounded away over the last 10% of steps: "
            + ("the stall shows" if stalled else "no stall beyond the seed spread here")
            + "".join(f"; {n}: {fix[n]['difference %']:+.1f}%" for n in kept))
    return "\n".join(lines) or "pure bf16 did not run here, so the stall could not be shown"


# --- 3. memory ----------------------------------------------------------------------------------

def memory_table(rows: Sequence[Mapping]) -> List[dict]:
    """Bytes by category per recipe (first seed of each), as measured (``optim.memory_rows``)."""
    firsts, seen = [], set()
    for r in rows:
        key = (r["workload"], r["recipe"])
        if key not in seen and r.get("weights_mib") is not None:
            seen.add(key)
            firsts.append(r)
    return [dict(workload=r["workload"], **m) for r, m in zip(firsts, optim.memory_rows(firsts))]


def per_rank_rows(memory: Sequence[Mapping], ranks: Sequence[int] = (2, 4, 8)) -> List[dict]:
    """Claim R10c's question on one workload's measured bytes: model state and total per rank
    for the reference with ZeRO-1 (optimizer state sharded over ``ranks``: ``state / N``), beside
    shrinking the state on one GPU (each low-precision recipe that ran), and both together."""
    by = {m["recipe"]: m for m in memory}
    ref = by.get(REFERENCE)
    if ref is None:
        return []

    def row(how, ranks_, m, state):
        total = m["weights MiB"] + m["gradients MiB"] + state + m["activations MiB"]
        return {"setup": how, "GPUs": ranks_, "optimizer state MiB per rank": state,
                "total MiB per rank": total,
                "saved per rank %": 100 * (1 - total / ref["total MiB"])}
    out = [row("fp32 master, one GPU", 1, ref, ref["optimizer state MiB"])]
    out += [row("fp32 master + ZeRO-1", n, ref, ref["optimizer state MiB"] / n) for n in ranks]
    for name in ("8-bit state", "bf16 + Kahan", "bf16 + stochastic rounding"):
        if name in by:
            out.append(row(f"{name}, one GPU", 1, by[name], by[name]["optimizer state MiB"]))
    if "8-bit state" in by:
        n = max(ranks)
        out.append(row("8-bit state + ZeRO-1", n, by["8-bit state"],
                       by["8-bit state"]["optimizer state MiB"] / n))
    return out


def r10c_line(per_rank: Sequence[Mapping]) -> str:
    """One line tying ``per_rank_rows`` to claim R10c (decided in lesson 06, not here)."""
    claim = claims.get_claim("R10c")
    if not per_rank:
        return f"claim R10c ({claim.says}): no reference memory was measured here"
    one = {r["setup"]: r for r in per_rank if r["GPUs"] == 1}
    zero = [r for r in per_rank if r["setup"] == "fp32 master + ZeRO-1"]
    best = max(zero, key=lambda r: r["GPUs"]) if zero else None
    shrink = one.get("8-bit state, one GPU") or one.get("bf16 + Kahan, one GPU")
    text = (f"claim R10c ({claim.says}) is decided by lesson {claim.lesson}'s multi-GPU run. "
            f"Here, per rank: ZeRO-1 over {plural(best['GPUs'], 'GPU')} saves {best['saved per rank %']:.0f}%")
    if shrink:
        text += (f"; {shrink['setup']} saves {shrink['saved per rank %']:.0f}% with no second GPU")
    return text + "."


# --- 4. which recipe ------------------------------------------------------------------------------

@traced
def choice_table(table: Sequence[Mapping], memory: Sequence[Mapping],
                 cards=CARDS, sizes: Sequence[float] = MODEL_SIZES,
                 state_share: float = STATE_SHARE) -> List[dict]:
    """For each model size and card: the recipe to pick, from this run's measurements.

    A recipe fits when its model state (measured bytes per parameter x parameters) takes at most
    ``state_share`` of the card; bf16-weight recipes are left out on cards without native bf16.
    The pick, judged on the last workload measured (the GPT where it ran): the fp32-master
    reference where it fits; else, among the recipes whose final loss came within the
    reference's seed spread, the one with the fewest bytes per parameter; else the one closest to
    the reference. Where nothing fits, the state must be sharded across GPUs.
    """
    check_real("state_share", state_share, 0.0, 1.0, low_open=True)
    workloads = [t["workload"] for t in table if t["final loss"] is not None]
    if not workloads:
        return []
    workload = workloads[-1]
    mine = {t["recipe"]: t for t in table if t["workload"] == workload
            and t["difference %"] is not None}
    bpp = {m["recipe"]: m["bytes per parameter"] for m in memory if m["workload"] == workload}

    def rank(r):
        if r == REFERENCE:
            return (0, 0.0)
        if mine[r]["within spread"]:
            return (1, bpp[r])
        return (2, abs(mine[r]["difference %"]))
    rows = []
    for size in sizes:
        row = {"model": f"{size / 1e9:g} B parameters"}
        for card, gib, bf16 in cards:
            fits = [r for r in mine if r in bpp and bpp[r] * size <= state_share * gib * GIB
                    and (bf16 or not optim.get_recipe(r).needs_bf16)]
            if not fits:
                row[card] = "shard it (lesson 06)"
                continue
            pick = min(fits, key=rank)
            row[card] = f"{pick} ({bpp[pick]:.1f} B/param)"
        rows.append(row)
    return rows


# --- 5. tables for the notebook and the README ----------------------------------------------------

RECIPE_REPORT_COLUMNS = ("workload", "recipe", "final loss", "reference", "difference %",
                         "reference spread %", "within spread", "rounded away % (last 10%)",
                         "optimizer state MiB", "bytes per parameter", "optimizer step ms",
                         "compiled step ms", "repeat spread %", "status")


@traced
def report_rows(table: Sequence[Mapping], memory: Sequence[Mapping], rows: Sequence[Mapping],
                on_gpu: bool) -> List[dict]:
    """``comparison`` rows with each recipe's memory and optimizer step time (times only where
    measured on a GPU: a CPU timing says nothing about the choice) and the larger repeat spread
    of its two optimizer step times (``repeat spread %``; over 10%: the times decide nothing)."""
    mem = {(m["workload"], m["recipe"]): m for m in memory}
    timed = {(r["workload"], r["recipe"]): r for r in rows if r.get("optimizer_ms") is not None}
    out = []
    for t in table:
        m = mem.get((t["workload"], t["recipe"]), {})
        r = timed.get((t["workload"], t["recipe"]), {})
        out.append({**{k: t[k] for k in t}, "optimizer state MiB": m.get("optimizer state MiB"),
                    "bytes per parameter": m.get("bytes per parameter"),
                    "optimizer step ms": r.get("optimizer_ms") if on_gpu else None,
                    "compiled step ms": r.get("optimizer_compiled_ms") if on_gpu else None,
                    "repeat spread %": _spread_pct(r) if on_gpu else None})
    return out


def _spread_pct(row: Mapping) -> Optional[float]:
    spreads = [row[k] for k in ("optimizer_spread", "optimizer_compiled_spread")
               if row.get(k) is not None]
    return 100 * max(spreads) if spreads else None


def _cell(v) -> str:
    return format_value(v, 3, missing="-")  # the course's one cell formatter


def format_rows(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None) -> str:
    """Rows as the course's text table (numbers to 4 significant digits, None as '-')."""
    if not rows:
        return "(no rows)"
    return text_table(rows, list(columns or rows[0].keys()), cell=_cell)


def show_rows(rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None) -> None:
    """Show rows in the notebook as a table (``report.show_table``: HTML, ``format_rows``'s text
    as the fallback) in this lesson's number style; ``(no rows)`` where there are none."""
    if not rows:
        print("(no rows)")
        return
    show_table(rows, list(columns or rows[0].keys()), cell=_cell)
