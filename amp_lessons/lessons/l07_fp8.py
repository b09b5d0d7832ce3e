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
need it, and where FP8 cannot run, the functions say why instead of failing.

The FP8 numerics live in ``formats`` (``FP8_FORMATS``, ``to_fp8``, ``quantization_error``...), the
speed measurement in the engine (``bench.float8``: ``Float8Config``, ``speed_sweep``, FP8
support), the figures in ``ui.fp8_plots``; this module holds the lesson's experiments and tables.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons import data as _data
from amp_lessons.data import (EXCLUDED_DIRS, Corpus, batch_offsets, stdlib_corpus,  # noqa: F401 (lesson API)
                    stdlib_files, text_batch)
from amp_lessons import models as _models
from amp_lessons.validate import check_choice, check_int, check_positive, is_real
from amp_lessons.measure.float8 import (FP8_RECIPES, INSTALL_HINT, MIN_CAPABILITY,  # noqa: F401 (lesson API)
                            NOT_MEASURED, RECIPES, TORCHAO_REQUIREMENT, Float8Config, FP8Support,
                            check_ints, compile_blocks, conversion_plan, convert_to_float8,
                            evaluate, float8_api, lr_factor, module_filter, train_gpt,
                            float8_config, float8_layers, fp8_support, measure_float8, mlp_stack,
                            quiet, speed_sweep, support_reason, time_recipe, torchao_version)
from amp_lessons.measure.oom import free_memory, is_out_of_memory  # noqa: F401
from amp_lessons.measure.rows import noisy
from amp_lessons.numerics.fp8 import FP8_FORMATS as FORMATS, FP8_USE as FORMAT_USE  # noqa: F401 (lesson API)
from amp_lessons.numerics.fp8 import (SCALINGS, TENSOR_KINDS, amax_scale, error_summary,  # noqa: F401
                   fake_quantize, from_fp8, fp8_max, quantization_error, to_fp8)
from amp_lessons.numerics.fp8 import fp8_format_facts as format_facts  # noqa: F401 (the lesson's API)
from amp_lessons.publish.report import show_table
from amp_lessons.tables import format_value, not_compared, plural, text_table
from amp_lessons.lineage import traced  # explain names what made each row

LESSON = "07"
DECIDES = ()  # no article claims FP8 numbers: the lesson states its findings as measurements
# --- argument checks (each names the setting and its allowed range) ----------------------------

# --- 0. can FP8 run here? ------------------------------------------------------------------------

# --- 1. numerics: formats, dynamic scaling, quantization error -----------------------------------

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
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x must hold finite values (an inf or NaN makes every scale inf or NaN); "
                         f"got {int((~torch.isfinite(x)).sum())} inf/NaN of {x.numel()}")
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


# --- 2. speed: compiled bf16 against torchao's float8 recipes ------------------------------------

def speedup(rows: Sequence[Mapping], width: int, recipe: str = "tensorwise") -> Optional[float]:
    """The measured speed-up of ``recipe`` over bf16 at ``width``, or None where not measured."""
    check_choice("recipe", recipe, RECIPES)
    for r in rows:
        if r["width"] == width and r["recipe"] == recipe:
            return r.get("speedup")
    return None


def speed_noise(row: Mapping, rows: Sequence[Mapping]) -> Optional[str]:
    """Why ``row``'s speed-up decides nothing: its own timed steps or those of the bf16 row of its
    width (``rows``) disagree between repeats by over 10% (``bench.noisy``); None otherwise."""
    base = next((r for r in rows if r["width"] == row["width"] and r["recipe"] == "bf16"), {})
    return noisy(row) or (noisy(base) and f"bf16 at this width: {noisy(base)}") or None


def smallest_paying_width(rows: Sequence[Mapping], recipe: str = "tensorwise",
                          at_least: float = 1.05) -> Optional[int]:
    """The smallest width from which ``recipe`` stays at least ``at_least`` x bf16's speed, or
    None when it never does (or nothing was measured). Noisy rows (``speed_noise``) are left
    out."""
    check_choice("recipe", recipe, FP8_RECIPES)
    check_positive("at_least", at_least)
    measured = sorted((r["width"], r["speedup"]) for r in rows  # a noisy speed-up decides nothing
                      if r["recipe"] == recipe and r.get("speedup") is not None
                      and not speed_noise(r, rows))
    for i, (width, _) in enumerate(measured):
        if all(s >= at_least for _, s in measured[i:]):
            return width
    return None


# --- 3. accuracy: a small GPT on the standard library's source -----------------------------------

def accuracy_runs(corpus: Corpus, seeds: Sequence[int] = (0, 1, 2),
                  fp8_recipes: Sequence[str] = ("tensorwise",),
                  support: Optional[FP8Support] = None, **train_kwargs) -> List[dict]:
    """bf16 once per seed, then each FP8 recipe with the first seed (same weights, same batches).

    FP8 runs on FP8 tensor cores where ``support.available``, emulated where only torchao is
    present, and otherwise appears as a row ``not run: <reason>``. ``train_kwargs`` go to
    ``train_gpt``.
    """
    seeds = check_ints("seeds", seeds, 0)
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
                       f"(this comparison needs at least {min_steps:,})")
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

def torchao_auto_filter(recipe: str = "tensorwise") -> Optional[Callable[[nn.Module, str], bool]]:
    """torchao's own size heuristic (``_auto_filter_for_recipe``, measured on H100s), or None where
    torchao or that (experimental) function is missing."""
    check_choice("recipe", recipe, FP8_RECIPES)
    try:
        api = float8_api()
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

SPEED_REPORT_COLUMNS = ("width", "recipe", "step ms", "speed-up over bf16", "peak GiB",
                        "repeat spread %", "status")
ACCURACY_REPORT_COLUMNS = ("run", "steps", "final loss", "held-out loss",
                           "FP8 minus bf16 (same seed)", "bf16 seed spread", "within the spread",
                           "status")


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(float(value), digits)


@traced
def speed_report_rows(rows: Sequence[Mapping]) -> List[dict]:
    """``speed_sweep`` rows as the table the lesson publishes: width, recipe, median step (ms),
    speed-up over compiled bf16 of the same width, peak GiB, the repeat spread of the timed steps
    and a status (``measured``, or ``measured (noisy: ...)`` where ``speed_noise`` says the row
    decides nothing).

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
                    "repeat spread %": _round(100 * r["spread"], 1)
                    if measured and r.get("spread") is not None else None,
                    "status": status if not measured else
                    f"measured ({speed_noise(r, rows)})" if speed_noise(r, rows) else "measured"})
    return out


@traced
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
    return format_value(value, 3, missing="-")  # the course's one cell formatter


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


