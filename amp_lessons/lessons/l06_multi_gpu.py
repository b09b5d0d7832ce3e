"""Lesson 06, mixed precision on several GPUs (notebooks/06_multi_gpu.ipynb).

Built on ``amp_lessons.measure.distributed`` (the engine: launching, DDP / ZeRO / FSDP2 runs, sweeps):

1. **wrapping FSDP2 on a CNN**: ResNet-50 under DDP and under three FSDP2 wrappings (every
   BatchNorm its own unit, one unit per residual block, the same without resharding after
   forward) at two per-rank batches, on every world size the machine has (``wrap_configs``,
   ``wrap_rows``, ``fsdp_against_ddp``), and the BatchNorm dtype mix-up that made the course wrap
   BatchNorm separately (``batchnorm_mixup``);
2. **a transformer, where sharding matters**: DDP, ZeRO stage 1 and FSDP2 on a GPT-style model
   (``transformer_configs``);
3. **claim R10c** (AMP + ZeRO stage 1 saves 60-70% per card): ``zero_savings``,
   ``zero_memory_model`` (the saving at 8 ranks from a model checked at the ranks that ran),
   ``verdict_r10c``;
4. **claim R11** (a DeepSpeed ``"amp"`` config): ``deepspeed_equivalents``, ``native_support``,
   ``deepspeed_amp_facts`` (DeepSpeed's code, read as data), ``verdict_r11``.

Every verdict is a ``claims.Verdict`` for a claim this lesson decides (``DECIDES``).
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from amp_lessons.publish import claims
from amp_lessons.measure import distributed as multi
from amp_lessons.validate import is_real
from amp_lessons.numerics.precision import HALF_DTYPES, as_device, autocast_for
from amp_lessons.measure.deepspeed_config import deepspeed_config_check  # noqa: F401 (the lesson's API)
from amp_lessons.tables import plural
from amp_lessons.lineage import traced  # explain names what made each row

LESSON = "06"

# --- 1. how FSDP2 wraps a CNN ------------------------------------------------------------------

# (row name, strategy, fsdp_wrap, reshard_after_forward), in the order the table shows them.
WRAPPINGS = (
    ("DDP", "ddp", "blocks", True),
    ("FSDP2, every BatchNorm its own unit (old)", "fsdp2", "bn-units", True),
    ("FSDP2, blocks + root, fp32 params", "fsdp2", "blocks", True),
    ("FSDP2, blocks + root, fp32 params, no reshard", "fsdp2", "blocks", False),
)


def wrap_label(name: str, batch_size: int) -> str:
    """The run label of one wrapping at one per-rank batch (labels key the sweep's rows)."""
    return f"{name} | {batch_size}/rank"


def wrap_configs(model: str, precision: str, batch_sizes: Sequence[int], image_size: int,
                 steps: int, warmup: int) -> List[multi.RunConfig]:
    """DDP and the FSDP2 wrappings of ``WRAPPINGS`` at each per-rank batch: SGD, lr 0.01."""
    if not batch_sizes:
        raise ValueError("batch_sizes must hold at least one per-rank batch size")
    return [multi.RunConfig(model=model, strategy=strategy, precision=precision, batch_size=b,
                            image_size=image_size, optimizer="sgd", lr=0.01, steps=steps,
                            warmup=warmup, fsdp_wrap=wrap, reshard_after_forward=reshard,
                            label=wrap_label(name, b))
            for b in batch_sizes for name, strategy, wrap, reshard in WRAPPINGS]


def _split(label: str) -> Tuple[str, int]:
    name, batch = label.rsplit(" | ", 1)
    return name, int(batch.split("/")[0])


@traced
def wrap_rows(result: multi.SweepResult) -> List[Dict[str, Any]]:
    """The wrapping table: per (processes, batch, wrapping), throughput, its ratio to DDP at the
    same batch and processes, FSDP units and peak memory per rank; sorted for reading."""
    summary = result.summary()
    ddp = {(s["world_size"], s["batch_size"]): s["per_s"] for s in summary
           if _split(s["label"])[0] == WRAPPINGS[0][0]}
    order = {w[0]: i for i, w in enumerate(WRAPPINGS)}
    rows = []
    for s in sorted(summary, key=lambda s: (s["world_size"], s["batch_size"],
                                            order.get(_split(s["label"])[0], 99))):
        name, batch = _split(s["label"])
        base = ddp.get((s["world_size"], batch))
        eff = s["efficiency"]
        rows.append({
            "processes": s["world_size"], "batch per rank": batch, "wrapping": name,
            "FSDP units": s["fsdp_units"], f"throughput ({s['unit']}/s)": s["per_s"],
            "vs DDP": s["per_s"] / base if base else None,
            "repeat spread (%)": 100 * s["spread"] if s["spread"] is not None else None,
            "scaling efficiency (%)": 100 * eff if eff is not None else None,
            "peak memory per rank (GiB)": s["peak_gib"], "note": s["noisy"],
        })
    return rows


def fsdp_against_ddp(result: multi.SweepResult, world_size: int = 1) -> List[Dict[str, Any]]:
    """Per batch: the fastest FSDP2 wrapping at ``world_size``, its throughput over DDP's, and
    the peak memory per rank of both (None off GPUs)."""
    out = []
    rows = [r for r in wrap_rows(result) if r["processes"] == world_size]
    peak = "peak memory per rank (GiB)"
    for row in rows:
        if row["wrapping"] == WRAPPINGS[0][0]:
            continue
        best = next((o for o in out if o["batch per rank"] == row["batch per rank"]), None)
        if best is None or (row["vs DDP"] or 0) > (best["vs DDP"] or 0):
            ddp = next((r for r in rows if r["wrapping"] == WRAPPINGS[0][0]
                        and r["batch per rank"] == row["batch per rank"]), {})
            entry = {"batch per rank": row["batch per rank"], "best FSDP2": row["wrapping"],
                     "vs DDP": row["vs DDP"], "FSDP2 peak GiB": row[peak],
                     "DDP peak GiB": ddp.get(peak)}
            if best is None:
                out.append(entry)
            else:
                best.update(entry)
    return out


def batchnorm_mixup(precision: str = "bf16", device=None) -> List[Dict[str, str]]:
    """What one BatchNorm layer does, forward and backward as in a training step, with a
    half-precision input in the three ways FSDP2 can hand it its parameters: half weights with
    fp32 running statistics (``param_dtype=half`` on a block: refused, on the CPU in forward, on
    CUDA in backward), fp32 weights under autocast (``fsdp_wrap="blocks"``), and all of BatchNorm
    in fp32 (its own unit). Each row: the setup, and the output dtype or where and why it
    failed."""
    if precision not in HALF_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(HALF_DTYPES)}; got {precision!r}")
    dev = as_device(device)
    half = HALF_DTYPES[precision]
    torch.manual_seed(0)
    x = torch.randn(4, 8, 6, 6, device=dev).to(half).requires_grad_()  # a convolution's output
    cases = []
    mixed = nn.BatchNorm2d(8).to(dev)
    mixed.weight.data, mixed.bias.data = mixed.weight.data.to(half), mixed.bias.data.to(half)
    cases.append((f"{precision} weights, fp32 running stats (param_dtype={precision} on a block)",
                  lambda: mixed(x)))
    plain = nn.BatchNorm2d(8).to(dev)

    def under_autocast():
        with autocast_for(precision, dev.type):
            return plain(x)
    cases.append(("fp32 weights and stats, autocast on (fsdp_wrap='blocks')", under_autocast))
    cases.append(("fp32 weights and stats, input cast to fp32 (BatchNorm its own fp32 unit)",
                  lambda: plain(x.float())))
    rows = []
    for setup, run in cases:
        where = "forward"
        try:
            out = run()
            where = "backward"
            out.float().square().sum().backward()
            outcome = f"runs, output {str(out.dtype).replace('torch.', '')}"
        except RuntimeError as exc:
            outcome = f"refused in {where}: {str(exc).splitlines()[0]}"
        x.grad = None
        rows.append({"BatchNorm gets": setup, "outcome": outcome})
    return rows


# --- 2. a transformer ----------------------------------------------------------------------------

def transformer_configs(model_kwargs: Mapping[str, Any], precision: str, batch_size: int,
                        lr: float, steps: int,
                        warmup: int) -> Tuple[List[multi.RunConfig], multi.RunConfig]:
    """DDP, ZeRO stage 1 and FSDP2 (half-precision gathered parameters: no BatchNorm here) on the
    transformer in ``precision``, and the fp32 DDP baseline of claim R10c. AdamW."""
    def run(strategy, prec, label):
        return multi.RunConfig(model="tiny_transformer", model_kwargs=dict(model_kwargs),
                               strategy=strategy, precision=prec, batch_size=batch_size,
                               optimizer="adamw", lr=lr, steps=steps, warmup=warmup,
                               fsdp_wrap="blocks-half-params", label=label)
    runs = [run(s, precision, f"{s} {precision}") for s in ("ddp", "ddp_zero", "fsdp2")]
    return runs, run("ddp", "fp32", "ddp fp32")


# --- 3. claim R10c: AMP + ZeRO stage 1 saves 60-70% per card -------------------------------------

R10C_RANGE = (0.60, 0.70)


def zero_savings(result: multi.SweepResult, baseline: str, zero: str,
                 world_size: int) -> Dict[str, Any]:
    """What run ``zero`` saves per rank against ``baseline`` at ``world_size``: fractions of the
    optimizer state, of all model state (parameters + gradients + optimizer state) and, on GPUs,
    of peak memory. ``saved`` is peak memory where it was measured, else model state. ``noisy``
    says which run's peak memory did not repeat between its repeats ("" when both did)."""
    base, z = result.find(baseline, world_size), result.find(zero, world_size)

    def saved(key):
        a, b = base.get(key), z.get(key)
        return 1 - b / a if a and b is not None else None
    out = {"world_size": world_size, "baseline": baseline, "zero": zero,
           "noisy": "; ".join(f"'{r['label']}' {why}" for r in (base, z)  # its memory, not time
                              if (why := multi.row_noise({"peak_spread": r.get("peak_spread")}))),
           "optimizer_state_mib": (base["optimizer_state_mib"], z["optimizer_state_mib"]),
           "model_state_mib": (base["model_state_mib"], z["model_state_mib"]),
           "peak_gib": (base["peak_gib"], z["peak_gib"]),
           "optimizer_state_saved": saved("optimizer_state_mib"),
           "model_state_saved": saved("model_state_mib"), "peak_saved": saved("peak_gib")}
    out["judged_on"] = "peak memory" if out["peak_saved"] is not None else "model state"
    out["saved"] = out["peak_saved"] if out["peak_saved"] is not None else out["model_state_saved"]
    return out


#: The rank count claim R10c is about ("several 8 GB cards": ZeRO's usual eight-GPU node).
R10C_RANKS = 8
#: How closely the memory model must predict a measured peak (relative) to count as validated.
R10C_MODEL_TOLERANCE = 0.05


def zero_memory_model(result: multi.SweepResult, baseline: str, zero: str,
                      world_sizes: Sequence[int], ranks: int = R10C_RANKS) -> Dict[str, Any]:
    """Claim R10c's memory model, fitted and checked on the rank counts that ran.

    ZeRO stage 1 shards only the optimizer state, so run ``zero``'s peak per rank at N ranks is
    ``rest + state / N`` (``rest``: weights, gradients, activations and buffers, which ZeRO-1
    does not shard; ``state``: the whole optimizer state, N times the state per rank measured
    at the fewest ranks). The model is fitted at the fewest ranks that ran and validated against
    the measured peak at every other count (``largest_error``, relative; ``validated`` when at
    most ``R10C_MODEL_TOLERANCE``); it then predicts the peak at ``ranks`` against
    ``baseline``'s (plain DDP replicates everything: its peak per rank does not depend on N).
    ``measured_at_ranks`` is True when ``ranks`` itself ran. ``why`` says what is missing.
    """
    ran = [n for n in sorted(set(world_sizes))
           if result.ran(baseline, n) and result.ran(zero, n)]
    points = []
    for n in ran:
        b, z = result.find(baseline, n), result.find(zero, n)
        points.append({"world_size": n, "baseline_peak_gib": b.get("peak_gib"),
                       "zero_peak_gib": z.get("peak_gib"),
                       "state_per_rank_gib": (z["optimizer_state_mib"] / 1024
                                              if z.get("optimizer_state_mib") is not None
                                              else None)})
    usable = [p for p in points if p["zero_peak_gib"] and p["baseline_peak_gib"]
              and p["state_per_rank_gib"] is not None]
    out: Dict[str, Any] = {"ranks": ranks, "points": points, "validated": None,
                           "largest_error": None, "predicted_saved": None,
                           "measured_at_ranks": any(p["world_size"] == ranks for p in usable),
                           "why": ""}
    if len(usable) < 2:
        out["why"] = (f"the model needs peak memory at two rank counts to be checked; measured "
                      f"at {', '.join(str(p['world_size']) for p in usable) or 'none'}")
        return out
    first = usable[0]
    state = first["state_per_rank_gib"] * first["world_size"]
    rest = first["zero_peak_gib"] - state / first["world_size"]
    errors = []
    for p in usable[1:]:
        p["predicted_zero_peak_gib"] = rest + state / p["world_size"]
        errors.append(abs(p["predicted_zero_peak_gib"] - p["zero_peak_gib"]) / p["zero_peak_gib"])
    base = usable[-1]["baseline_peak_gib"]
    predicted = rest + state / ranks
    out.update(validated=max(errors) <= R10C_MODEL_TOLERANCE, largest_error=max(errors),
               rest_gib=rest, state_gib=state, baseline_peak_gib=base,
               predicted_zero_peak_gib=predicted, predicted_saved=1 - predicted / base)
    return out


@claims.decides("R10c")
def verdict_r10c(savings: Mapping[str, Any],
                 model: Optional[Mapping[str, Any]] = None) -> claims.Verdict:
    """Claim R10c (several 8 GB cards: AMP + ZeRO stage 1 saves 60-70% of memory) at the rank
    count it is about, ``R10C_RANKS``. ``savings`` (``zero_savings``) is what the most ranks that
    ran measured, shown always; ``model`` (``zero_memory_model``) carries it to ``R10C_RANKS``.
    Decided on the measured saving where ``R10C_RANKS`` ran, else on the model's prediction when
    the model was validated at the counts that ran (the verdict says plainly that
    ``R10C_RANKS`` ranks did not run); one-sided: at least 60% holds. Not decided on one
    process, on CPU processes (no GPU memory), where a run's peak memory did not repeat
    (``savings["noisy"]``), or without a validated model.
    """
    low, high = R10C_RANGE
    s = savings["saved"]
    n = savings["world_size"]
    numbers = {k: savings[k] for k in ("world_size", "saved", "judged_on",
                                       "optimizer_state_saved", "model_state_saved")}
    if s is None:
        return claims.not_decided("R10c", LESSON, "no memory of either run was measured",
                                  "nothing to compare", numbers)
    measured = (f"on {n} rank{'s' if n > 1 else ''}, '{savings['zero']}' holds {s:.0%} less "
                f"{savings['judged_on']} per rank than '{savings['baseline']}'; optimizer state "
                f"per rank {savings['optimizer_state_saved']:.0%} less")
    cannot = None
    if n < 2:
        cannot = (f"with 1 process ZeRO has nothing to shard across, so the {s:.0%} is mixed "
                  f"precision's saving alone; the claim needs 2 or more GPUs")
    elif savings["judged_on"] != "peak memory":
        cannot = ("measured on CPU processes: no GPU memory was measured, and AMP's part of the "
                  "saving (activations) is not counted; the claim is about GPU memory")
    elif savings.get("noisy"):
        cannot = f"the runs did not repeat: {savings['noisy']}"
    decided_on = s
    if cannot is None and n != R10C_RANKS:
        if model is None or not model.get("validated"):
            why = (model or {}).get("why") or (
                f"the memory model missed a measured peak by {model['largest_error']:.0%}"
                if model and model.get("largest_error") is not None else "no memory model given")
            cannot = (f"the claim is about {R10C_RANKS} ranks and only {n} ran here; {why}, so "
                      f"the saving at {R10C_RANKS} ranks cannot be predicted")
        else:
            decided_on = model["predicted_saved"]
            numbers["predicted_saved"] = decided_on
            measured += (f"; the memory model (peak = {model['rest_gib']:.2f} GiB + "
                         f"{model['state_gib']:.2f} GiB of optimizer state / N), fitted at "
                         f"{model['points'][0]['world_size']} rank(s) and within "
                         f"{model['largest_error']:.1%} of the measured peak at the others, "
                         f"predicts {decided_on:.0%} saved at {R10C_RANKS} ranks "
                         f"({R10C_RANKS} ranks did not run here)")
    held, more = (claims.one_sided(100 * decided_on, 100 * low, 100 * high, "%")
                  if cannot is None and is_real(decided_on) and math.isfinite(decided_on)
                  else (False, None))
    where = ("within" if low <= decided_on <= high else "below" if decided_on < low
             else "above") if is_real(decided_on) else "not comparable with"
    what = "measured" if decided_on is s else f"predicted for {R10C_RANKS} ranks (not run)"
    alts = []
    if decided_on is not s:  # predicted for R10C_RANKS: the ranks that ran are the row
        m_held = claims.one_sided(100 * s, 100 * low, 100 * high, "%")[0]
        alts.append(claims.alternative(
            f"at the {plural(n, 'rank')} that ran (measured, not predicted)", held=m_held,
            why=f"{s:.0%} measured is {'at least' if m_held else 'below'} {low:.0%}"))
    return claims.decide("R10c", LESSON, measured, held,
                         f"{decided_on:.0%} {what} is {where} the claimed {low:.0%}-{high:.0%}",
                         numbers, cannot_decide=cannot, understated=more, sensitivity=alts,
                         condition=(f"at {R10C_RANKS} ranks (predicted)" if decided_on is not s
                                    else f"at the {plural(n, 'rank')} that ran"))


@traced
def r10c_rows(verdict: claims.Verdict, savings: Mapping[str, Any],
              comparisons: Sequence[Mapping[str, Any]] = ()) -> List[Dict[str, Any]]:
    """Claim R10c's row (with the verdict) and, without a verdict, ``comparisons`` beside it."""
    low, high = R10C_RANGE

    def pct(v):
        return 100 * v if v is not None else None
    rows = []
    for s, judged in [(savings, True)] + [(c, False) for c in comparisons]:
        rows.append({
            "run": s["zero"], "against": s["baseline"], "processes": s["world_size"],
            "judged on": s["judged_on"], "saved per rank (%)": pct(s["saved"]),
            "optimizer state saved per rank (%)": pct(s["optimizer_state_saved"]),
            "claim R10c (%)": f"{100 * low:.0f}-{100 * high:.0f}" if judged else None,
            "verdict": verdict.outcome if judged else None,
        })
    return rows


# --- 4. claim R11: the DeepSpeed "amp" config ----------------------------------------------------

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
    return "\n\n".join(f"DeepSpeed {key}\n  does   : {does}\n  PyTorch: {native}"
                       for key, does, native in DEEPSPEED_EQUIVALENTS)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def native_support() -> Dict[str, Any]:
    """What this installation has: PyTorch's native pieces this lesson ran and, looked up without
    importing them, DeepSpeed and NVIDIA Apex (which claim R11's ``"amp"`` key needs)."""
    return {"torch": torch.__version__, "torch.amp.GradScaler": hasattr(torch.amp, "GradScaler"),
            "fully_shard + MixedPrecisionPolicy": multi.fsdp2_available(),
            "ZeroRedundancyOptimizer": _importable("torch.distributed.optim"),
            "deepspeed installed": _importable("deepspeed"), "apex installed": _importable("apex")}


#: What claim R11 turns on, looked for in DeepSpeed's own engine code (``runtime/engine.py``):
#: the call that hands the "amp" dict to NVIDIA Apex, and the check that refuses it with ZeRO.
DEEPSPEED_AMP_CALL = "amp.initialize("
DEEPSPEED_AMP_ZERO_REFUSAL = "Amp and ZeRO are not currently compatible"


def deepspeed_amp_facts(root: Optional[Path] = None) -> Dict[str, Any]:
    """What DeepSpeed's installed code does with the ``"amp"`` key, read as text (DeepSpeed is
    never imported): ``installed``, ``source`` (the file read), ``calls_apex`` (it hands the
    key's settings to Apex's ``amp.initialize``) and ``refuses_zero`` (it asserts that amp and
    ZeRO are not compatible). ``root``: a DeepSpeed package directory (default: the installed
    one, found without importing it)."""
    if root is None:
        try:
            spec = importlib.util.find_spec("deepspeed")
        except (ImportError, ValueError):
            spec = None
        locations = list(getattr(spec, "submodule_search_locations", None) or [])
        root = Path(locations[0]) if locations else None
    engine = root / "runtime" / "engine.py" if root is not None else None
    if engine is None or not engine.is_file():
        return {"installed": root is not None, "source": None, "calls_apex": None,
                "refuses_zero": None}
    text = engine.read_text(errors="replace")
    return {"installed": True, "source": str(engine),
            "calls_apex": DEEPSPEED_AMP_CALL in text and "amp_params" in text,
            "refuses_zero": DEEPSPEED_AMP_ZERO_REFUSAL in text}


#: Claim R11's config as article R writes it, and beside ZeRO stage 1 as the article uses it.
R11_CONFIGS = {"article": {"train_batch_size": 8, "amp": {"enabled": True, "opt_level": "O2"}},
               "with ZeRO stage 1": {"train_batch_size": 8, "amp": {"enabled": True,
                                                                    "opt_level": "O2"},
                                     "zero_optimization": {"stage": 1}}}
#: Why the course does not install DeepSpeed (said where it is absent).
DEEPSPEED_NOT_INSTALLED = (
    "DeepSpeed is not installed here, and the course does not install it: PyPI publishes its "
    "current releases only as a source archive (its one wheel is the 2020 0.3.1.dev5), so "
    "installing it builds a wheel from source, which the course's wheel-only installs (CI, "
    "offline GPU hosts) do not do, and its import loads its accelerator and op-builder code. "
    "Installed, this verdict builds DeepSpeed's DeepSpeedConfig from the article's dict on "
    "the CPU, in a separate process (measure.deepspeed_config), and decides")


def _r11_rule(result: Mapping[str, Any], facts: Mapping[str, Any], zero: bool):
    """R11 on one config's result: ``(held, why)``. Accepted by the config: held unless the
    engine code read as text refuses it (with ZeRO) or does not hand it to Apex."""
    if not result.get("accepted"):
        return False, f"DeepSpeed's config refuses it: {result.get('error')}"
    if zero and facts.get("refuses_zero"):
        return False, (f"the config takes it, but DeepSpeed's engine asserts "
                       f"\"{DEEPSPEED_AMP_ZERO_REFUSAL}\"")
    if facts.get("calls_apex") is False:
        return False, "the config takes it, but DeepSpeed's engine does not hand it to Apex"
    return True, ("the config takes it, and DeepSpeed's engine hands it to NVIDIA Apex's "
                  "amp.initialize (Apex AMP, deprecated by Apex; Apex must be installed)")


@claims.decides("R11")
def verdict_r11(support: Mapping[str, Any], facts: Optional[Mapping[str, Any]] = None,
                check: Optional[Mapping[str, Any]] = None) -> claims.Verdict:
    """Claim R11 (a DeepSpeed config enables mixed precision with ``"amp": {"enabled": true,
    "opt_level": "O2"}``), decided from the installed DeepSpeed: ``check`` is
    ``deepspeed_config_check(R11_CONFIGS)`` (its config accepts or refuses the article's dict,
    run on the CPU in a separate process) and ``facts`` its engine code read as text
    (``deepspeed_amp_facts``: does it hand the key to Apex, does it refuse it with ZeRO).
    Sensitivity row: the dict beside ZeRO stage 1, as article R uses it. Not decided where
    DeepSpeed is not installed (``DEEPSPEED_NOT_INSTALLED`` says why the course does not).
    ``support`` is ``native_support()``: PyTorch's native equivalents, shown."""
    facts = deepspeed_amp_facts() if facts is None else facts
    native = all(support.get(k) for k in ("torch.amp.GradScaler",
                                          "fully_shard + MixedPrecisionPolicy",
                                          "ZeroRedundancyOptimizer"))
    measured = (f"installed here: deepspeed "
                f"{(check or {}).get('version') or ('yes' if facts.get('installed') else 'no')}, "
                f"apex {'yes' if support.get('apex installed') else 'no'}; PyTorch's native "
                f"equivalents (autocast, GradScaler, FSDP2, ZeroRedundancyOptimizer) "
                f"{'all present and run in this lesson' if native else 'not all present'}")
    numbers = {"native_equivalents_present": native,
               **{k: facts.get(k) for k in ("installed", "calls_apex", "refuses_zero")}}
    results = (check or {}).get("results") or {}
    if "article" not in results:
        why = (check or {}).get("why") or ""
        installed = check.get("installed") if check is not None else facts.get("installed")
        because = (DEEPSPEED_NOT_INSTALLED if not installed else
                   f"DeepSpeed is installed, but its config could not be checked ({why or 'no check was run'})")
        return claims.not_decided("R11", LESSON, measured, because, numbers)
    held, why = _r11_rule(results["article"], facts, zero=False)
    alts = [claims.alternative("with ZeRO stage 1 beside it, as article R uses it",
                               held=_r11_rule(results[k], facts, True)[0],
                               why=_r11_rule(results[k], facts, True)[1])
            for k in results if k != "article"]
    return claims.decide("R11", LESSON, f"DeepSpeed {check.get('version')}'s DeepSpeedConfig "
                         f"on the article's dict; " + measured, held, why, numbers,
                         sensitivity=alts, condition="with the key alone")


def verdicts(savings: Mapping[str, Any], support: Optional[Mapping[str, Any]] = None,
             model: Optional[Mapping[str, Any]] = None,
             check: Optional[Mapping[str, Any]] = None) -> List[claims.Verdict]:
    """This lesson's verdicts, one per claim of ``DECIDES`` (``model``: ``zero_memory_model``;
    ``check``: ``deepspeed_config_check(R11_CONFIGS)``)."""
    return [verdict_r10c(savings, model), verdict_r11(support or native_support(), check=check)]


#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)
