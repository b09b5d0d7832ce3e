"""Every article claim the course tests, as data, and the one ``Verdict`` type every lesson returns.

A claim has an id, the article that makes it, what it says, the lesson whose measurement decides it
and the rule that decides it. **One claim, one deciding measurement**: ``decide`` refuses a ruling
from any lesson but the claim's own (other lessons may show related numbers, never a verdict), and
a measurement that cannot decide (a CPU timing, too few steps, an idle GPU, accuracy at chance)
comes back as "not decided here" with the reason, never as held or not held.

The verdict scale (``OUTCOMES``): held, held, understated (``one_sided`` rules: the benefit larger
or the cost smaller than claimed, saying by how much), held, deprecated (the code runs and only
warns), partly held (a compound claim decided ``Part`` by part), did not hold, not decided here;
a claim decided on a stand-in for its setting says so. A lesson declares the function that decides
a claim with ``@decides(...)`` (named ``verdict_<id>``, ``verdict_name``); ``deciders()`` and each
lesson's ``DECIDES`` (``decided_in``) are derived from those declarations; ``rows_timing_gate`` is
the one helper that applies ``timing_gate`` to measured rows.

The claims' text is published in ``docs/claims.md`` (``python -m amp_lessons claims``), so a clone
of the repository is whole.
"""
from __future__ import annotations

import math
import numbers as numbers_
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from amp_lessons.validate import check_int, is_real, plain_number
from amp_lessons.tables import markdown_text, plural

ARTICLES = {
    "R": ("PyTorch 2.0 混合精度训练实战：ResNet-50 显存节省 40% 的 3 个关键配置 (\"Mixed precision "
          "training with PyTorch 2.0: 3 key settings that save 40% of ResNet-50's GPU memory\")"),
    "B": ("混合精度训练实战：PyTorch中从零实现高效GPU计算优化 (\"Mixed precision in practice: "
          "efficient GPU training in PyTorch from scratch\")"),
}
LESSONS = ("01", "02", "03", "04", "05", "06", "07", "08", "09")

HELD, NOT_HELD, UNDECIDED = "held", "did not hold", "not decided here"
UNDERSTATED, DEPRECATED, PARTLY = "held, understated", "held, deprecated", "partly held"
#: Every outcome a verdict can have (``Verdict.outcome``; a stand-in adds ", on a stand-in").
OUTCOMES = (HELD, UNDERSTATED, DEPRECATED, PARTLY, NOT_HELD, UNDECIDED)


@dataclass(frozen=True)
class Claim:
    """One claim: ``id``, ``article`` (a key of ``ARTICLES``), what it ``says``, the ``lesson``
    whose measurement decides it (None: the course does not measure it) and the ``rule``."""

    id: str
    article: str
    says: str
    lesson: Optional[str]
    rule: str


_CLAIMS = (
    Claim("R1", "R", "FP16 spans 5.96e-8 to 65504; FP32 spans 1.4e-45 to 3.4e38", "01",
          "each end matches the format's limit measured by arithmetic on this device, at the "
          "claim's written precision"),
    Claim("B5", "B", "in AMP \"the loss is computed in FP16\" and \"backward runs in FP16\", then "
          "gradients are \"restored to FP32\"", "02",
          "three parts, each from the dtypes fp16 autocast gives a real model: the loss in FP16; "
          "the gradients flowing back through the layers in FP16; the parameter gradients in FP32 "
          "(the backward of autocast's weight cast returns them in fp32)"),
    Claim("B6", "B", "the AMP API is `from torch.cuda.amp import autocast, GradScaler`", "02",
          "the import and the calls on this torch: held if they run; held, deprecated if they "
          "only warn (the `torch.amp` replacement named); did not hold if the import fails"),
    Claim("B7", "B", "AMP needs no change to any layer's code", "02",
          "in fp16: a model with a custom autograd function runs under autocast unchanged, or "
          "needs `torch.amp.custom_fwd`"),
    Claim("B1", "B", "FP16 saves about 50% of memory and trains 1.5 to 2x faster on Tensor Core "
          "GPUs", "04",
          "ResNet-50 on a Tensor Core GPU, fp16 + GradScaler against fp32 as PyTorch runs it by "
          "default (TF32 convolutions), same memory format and run; two parts: memory saved >= 40% "
          "and speed-up >= 1.5x (above 2x: held, understated); fp32 with TF32 off and "
          "channels_last shown beside; decided only on a busy GPU"),
    Claim("B2", "B", "RTX 3090, `train.py --precision fp32` vs `--precision amp`: about 10.2 GB and "
          "18.7 s per epoch vs about 5.8 GB and 11.2 s (over 40% less memory, about 39% less time)",
          "04",
          "on a named stand-in (ResNet-50 on this GPU for train.py on an RTX 3090): fp16 against "
          "the default fp32 (TF32 convolutions) in the same run; two parts: memory saved >= 40% "
          "and step time at least 30% shorter; decided only on a busy GPU"),
    Claim("B3", "B", "against exploding gradients or NaN, call `clip_grad_norm_(params, "
          "max_norm=1.0)` (shown without `unscale_`)", "02",
          "clipping scaled gradients against clipping after `unscale_` on the same run: does the "
          "article's order clip at the stated norm?"),
    Claim("B4", "B", "if convergence wobbles, \"increase scale_factor=2.0\" or change the initial "
          "scale", "03",
          "two parts, same seed and data: \"increase scale_factor=2.0\" (the argument exists, or "
          "read as growth_factor a larger one steadies a wobbling run) and \"change the initial "
          "scale\" (a run started too high skips fewer early steps from a lower start)"),
    Claim("R2", "R", "GradScaler defaults: init_scale 65536, growth_factor 2.0, backoff_factor 0.5, "
          "growth_interval 2000", "03", "a fresh GradScaler's getters on this torch"),
    Claim("R3", "R", "for ResNet-50, init_scale 32768, growth_factor 1.5, backoff_factor 0.4, "
          "growth_interval 1000 work best: the scale settles faster with less early wobble", "03",
          "on ResNet-50 (a few hundred fp16 steps, GPU only): the article's settings settle "
          "strictly sooner with no more early skipped steps than the defaults, same seed and "
          "data; not decided where neither wobbled or ResNet-50 did not run"),
    Claim("R4", "R", "keep layer1-2 in autocast but force layer3, layer4 and fc to FP32 \"to avoid "
          "vanishing gradients\" and \"guarantee classification accuracy\"", "04",
          "accuracy of the selective-autocast ResNet against plain AMP on real data (above "
          "chance), and what it costs in speed and memory"),
    Claim("R5", "R", "with Adam, raise eps from 1e-8 to 1e-7 \"to prevent FP16 division by zero\", "
          "enable amsgrad \"for stability\", and use `torch.optim._multi_tensor.Adam` as the "
          "\"mixed-precision wrapper\"", "04",
          "where Adam's state lives under AMP (fp32 or fp16), and what `_multi_tensor` is on this "
          "torch"),
    Claim("R6", "R", "ResNet-50 on ImageNet: FP32 15.2 GB, 320 img/s, 76.3% top-1; native AMP "
          "10.1 GB (-33%), 580 img/s (+81%), 76.1%; \"optimized\" (R3+R4+R5) 9.1 GB (-40%), "
          "620 img/s (+94%), 76.2%", "04",
          "the three configurations in one run, \"optimized\" built as the article does (R4's "
          "model, R5's Adam): memory saved and speed-up against the default fp32 (TF32 "
          "convolutions) at least the claimed, and \"optimized\" beats plain AMP; decided only on "
          "a busy GPU"),
    Claim("R7", "R", "if validation accuracy drops, validate with autocast disabled", "04",
          "conditional: decided only where a half-precision run's accuracy fell more than 1 point "
          "below fp32's; there, held if evaluating with autocast off wins it back; trained above "
          "chance"),
    Claim("R8", "R", "gradient checkpointing saves another 20-30% of memory for about 30% more "
          "compute time", "05",
          "per-block checkpointing against AMP on ResNet-50, same settings, busy GPU; one-sided: "
          "memory saved >= 20 points of fp32's memory and step time added <= 40% (more saved "
          "than 30 points, or less than 20% added: held, understated)"),
    Claim("R9", "R", "gradient accumulation gives a larger virtual batch at the same memory", "05",
          "peak memory at 1, 2, 4, 8 micro-batches stays within 15%, and the accumulated step "
          "equals the large-batch step"),
    Claim("R10a", "R", "one card under 12 GB: AMP + checkpointing saves 50-60% of memory", "05",
          "the largest batch per simulated card size with each technique, on a GPU"),
    Claim("R10b", "R", "one card of 12 GB or more: AMP + gradient accumulation saves 40-50% of "
          "memory", "05", "the largest batch per simulated card size with each technique, on a "
          "GPU; AMP saves >= 40% and trains faster than AMP + checkpointing (busy GPU)"),
    Claim("R10c", "R", "several 8 GB cards: AMP + ZeRO stage 1 saves 60-70% of memory", "06",
          "peak memory per rank, AMP + ZeRO-1 against fp32 DDP, from a memory model (peak = the "
          "rest + optimizer state / N) validated at the rank counts that ran; the saving at the "
          "claim's 8 ranks is the model's prediction unless 8 ranks ran, and the verdict says so"),
    Claim("R10d", "R", "AMP + model parallelism saves 40-50% of memory", None,
          "not measured by the course: it trains no model-parallel setup"),
    Claim("R11", "R", "a DeepSpeed config enables mixed precision with `\"amp\": {\"enabled\": "
          "true, \"opt_level\": \"O2\"}`", "06",
          "read from DeepSpeed's installed code: the key enables mixed precision (it calls Apex's "
          "amp.initialize) and DeepSpeed refuses it with ZeRO; not decided where DeepSpeed is not "
          "installed"),
    Claim("R12", "R", "attention is more precision-sensitive than convolutions and may need a "
          "changed autocast op list", "04",
          "two parts: attention's fp16 relative error over 1.5x the convolution's (GPU), and "
          "whether torch.autocast takes an op list to change (read from its signature)"),
)
CLAIMS: Dict[str, Claim] = {c.id: c for c in _CLAIMS}


def get_claim(claim_id: str) -> Claim:
    """The registered claim ``claim_id``; ValueError naming the known ids otherwise."""
    try:
        return CLAIMS[claim_id]
    except (KeyError, TypeError):
        raise ValueError(f"claim must be one of {', '.join(CLAIMS)}; got {claim_id!r}") from None


@dataclass(frozen=True)
class Part:
    """One measurable part of a compound claim: what it ``says``, whether it ``held`` (True,
    False, or None: this run could not decide that part) and ``why``."""

    says: str
    held: Optional[bool]
    why: str

    def __post_init__(self):
        if not isinstance(self.says, str) or not self.says.strip():
            raise ValueError("a part must say which part of the claim it is; got an empty value")
        if self.held not in (True, False, None):
            raise ValueError(f"a part's held must be True, False or None; got {self.held!r}")
        if not isinstance(self.why, str) or not self.why.strip():
            raise ValueError(f"part {self.says!r} must say why it held or not; got {self.why!r}")

    @property
    def outcome(self) -> str:
        """``"held"``, ``"did not hold"`` or ``"not decided here"``."""
        return {True: HELD, False: NOT_HELD, None: UNDECIDED}[self.held]


@dataclass(frozen=True)
class Verdict:
    """A claim beside its measurement, as every lesson returns it.

    ``held`` is True (the whole claim held), False (it did not, or only part of it did), or None
    (this measurement could not decide the claim: ``why`` says why). ``qualifier`` refines a
    decided verdict: ``"understated"`` (held, and the benefit is larger or the cost smaller than
    claimed), ``"deprecated"`` (held: the code runs and only warns), ``"partly"`` (a compound
    claim of which some ``parts`` held and some did not). ``stand_in`` names what stood in for
    the claim's own setting (another model or card); ``measured`` states what ran, with numbers;
    ``numbers`` keeps them as data. Built by ``decide``, from the measurement, never typed in.
    """

    claim: str
    lesson: str
    measured: str
    held: Optional[bool]
    why: str
    numbers: Mapping[str, Any] = field(default_factory=dict)
    qualifier: str = ""
    parts: Tuple[Part, ...] = ()
    stand_in: str = ""

    @property
    def outcome(self) -> str:
        """One of ``OUTCOMES`` (``"held"``, ``"held, understated"``, ``"held, deprecated"``,
        ``"partly held"``, ``"did not hold"``, ``"not decided here"``), with ", on a stand-in"
        when a stand-in decided it."""
        if self.held is None:
            return UNDECIDED
        base = (PARTLY if self.qualifier == "partly" else NOT_HELD if self.held is False
                else {"understated": UNDERSTATED, "deprecated": DEPRECATED}.get(self.qualifier,
                                                                                 HELD))
        return base + (", on a stand-in" if self.stand_in else "")

    @property
    def decided(self) -> bool:
        """True when the measurement ruled (any outcome but "not decided here")."""
        return self.held is not None

    def row(self) -> Dict[str, Any]:
        """One table row: claim, what it says, the rule, the measurement, the outcome and why."""
        c = CLAIMS[self.claim]
        return {"claim": self.claim, "says": c.says, "holds if": c.rule,
                "measured": self.measured, "verdict": self.outcome, "why": self.why}

    def __str__(self) -> str:
        return (f"claim {self.claim} ({CLAIMS[self.claim].says})\n"
                f"  measured: {self.measured}\n"
                f"  verdict : {self.outcome.upper()}: {self.why}")


def _parts_outcome(parts: Sequence[Part]) -> Tuple[Optional[bool], str]:
    """``(held, qualifier)`` of a compound claim from its parts: held when every part held, not
    held when every decided part did not, partly held when some held and some did not (or were
    not decided), not decided when no part was."""
    decided = [p.held for p in parts if p.held is not None]
    if not decided:
        return None, ""
    if all(decided) and len(decided) == len(parts):
        return True, ""
    if not any(decided):
        return False, ""
    return False, "partly"


def decide(claim_id: str, lesson: str, measured: str, held: Optional[bool], why: str,
           numbers: Optional[Mapping[str, Any]] = None,
           cannot_decide: Optional[str] = None, *, parts: Sequence[Part] = (),
           understated: Optional[str] = None, deprecated: Optional[str] = None,
           stand_in: Optional[str] = None) -> Verdict:
    """A ``Verdict`` for ``claim_id`` from ``lesson``'s measurement.

    ``cannot_decide``: the reason this run cannot rule (see ``timing_gate``/``accuracy_gate``);
    when given, the verdict is "not decided here" whatever ``held`` was; so it is when a number
    in ``numbers`` (top level) is NaN or infinite. A ruling (``held`` True
    or False) from a lesson other than the claim's own deciding lesson raises ValueError: one
    claim, one deciding measurement.

    The finer outcomes: ``parts`` (``Part``s of a compound claim; ``held`` must then be None, it
    is derived: all held, none held, or "partly held", and ``why`` gains one clause per part);
    ``understated`` (held, and this says by how much the claim undersold the benefit or
    overstated the cost); ``deprecated`` (held: the code runs and only warns; this names the
    current API); ``stand_in`` (what stood in for the claim's setting: the outcome says so).
    """
    claim = get_claim(claim_id)
    if lesson not in LESSONS:
        raise ValueError(f"lesson must be one of {', '.join(LESSONS)}; got {lesson!r}")
    if held not in (True, False, None):
        raise ValueError(f"held must be True, False or None; got {held!r}")
    if not isinstance(measured, str) or not measured.strip():
        raise ValueError("measured must say what ran, with numbers; got an empty value")
    parts = tuple(parts)
    if not all(isinstance(p, Part) for p in parts):
        raise ValueError(f"parts must be claims.Part objects; got {parts!r}")
    if parts and held is not None:
        raise ValueError("held must be None when parts are given: the parts decide it")
    for name, text in (("understated", understated), ("deprecated", deprecated),
                       ("stand_in", stand_in)):
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise ValueError(f"{name} must say what it qualifies (a non-empty string); "
                             f"got {text!r}")
    if understated and deprecated:
        raise ValueError("a verdict is either understated or deprecated, not both")
    qualifier = ""
    if parts:
        held, qualifier = _parts_outcome(parts)
        clauses = "; ".join(f"{p.says}: {p.outcome} ({p.why})" for p in parts)
        why = f"{why.strip()}. {clauses}" if isinstance(why, str) and why.strip() else clauses
    if held is True and understated:
        qualifier, why = "understated", f"{why}; understated: {understated}"
    if held is True and deprecated:
        qualifier, why = "deprecated", f"{why}; deprecated: {deprecated}"
    if cannot_decide:
        held, why, qualifier = None, cannot_decide, ""
    plain = {k: plain_number(v) for k, v in (numbers or {}).items()}  # 0-d tensors too
    broken = [f"{k}={v!r}" for k, v in plain.items()
              if isinstance(v, numbers_.Real) and not isinstance(v, bool)
              and not math.isfinite(float(v))]
    if held is not None and broken:  # a ruling on NaN or inf is a ruling on noise
        held, qualifier, why = None, "", (f"a measured number is not finite "
                                          f"({', '.join(broken)}): the run diverged or was not "
                                          f"measured, so it cannot rule")
    if held is not None and claim.lesson != lesson:
        raise ValueError(f"claim {claim_id} is decided by lesson {claim.lesson}'s measurement; "
                         f"lesson {lesson} may show related numbers but not rule on it")
    if not isinstance(why, str) or not why.strip():
        raise ValueError("why must say how the rule decided, or why it could not")
    if stand_in and held is not None:
        why = f"on a stand-in ({stand_in}): {why}"
    return Verdict(claim_id, lesson, measured, held, why, dict(numbers or {}), qualifier, parts,
                   stand_in or "")


def not_decided(claim_id: str, lesson: str, measured: str, because: str,
                numbers: Optional[Mapping[str, Any]] = None) -> Verdict:
    """A "not decided here" verdict: what ran, and why it cannot rule on the claim."""
    return decide(claim_id, lesson, measured, None, because, numbers)


def at_least(says: str, value: float, threshold: float, unit: str = "%", digits: int = 0,
             note: str = "") -> Part:
    """The part of a claim that asks for ``value >= threshold``, its why written as the
    comparison (``"48% >= 40%"``, ``"1.36x < 1.5x against ..."``, ``note`` appended), with as
    many more digits as it takes for a value just short of the threshold not to read as equal
    to it ("39.6% < 40%", not "40% < 40%"). A value that is not a finite number (a run that
    diverged or was not measured) leaves the part undecided."""
    value = plain_number(value)
    if not is_real(value):
        return Part(says, None, f"not decided: the value is {value!r}, not a finite number "
                                f"(against {threshold:g}{unit}){note}")
    held = bool(value >= threshold)
    shown = f"{value:.{digits}f}"
    while not held and float(shown) >= threshold and digits < 12:  # 39.6 must not read 40
        digits += 1
        shown = f"{value:.{digits}f}"
    return Part(says, held, f"{shown}{unit} {'>=' if held else '<'} {threshold:g}{unit}{note}")


def one_sided(measured: float, claimed_low: float, claimed_high: float, unit: str,
              larger_is_better: bool = True) -> Tuple[bool, Optional[str]]:
    """A one-sided rule on a claimed range ("saves 20-30%", "costs about 30%"): ``(held,
    understated)``. Where more is better (a saving), it holds at ``claimed_low`` or more, and
    above ``claimed_high`` the claim undersold it; where less is better (a cost), it holds at
    ``claimed_high`` or less, and below ``claimed_low`` the claim overstated it. ``understated``
    says by how much (None when the number lies in the claimed range or the rule failed)."""
    for name, v in (("measured", measured), ("claimed_low", claimed_low),
                    ("claimed_high", claimed_high)):
        if not is_real(v) or not math.isfinite(float(v)):
            raise ValueError(f"{name} must be a finite number; got {v!r}")
    if claimed_low > claimed_high:
        raise ValueError(f"claimed_low must be <= claimed_high; got {claimed_low} > {claimed_high}")
    if larger_is_better:
        held = measured >= claimed_low
        beyond = measured - claimed_high if measured > claimed_high else None
        word = "more than the claimed"
    else:
        held = measured <= claimed_high
        beyond = claimed_low - measured if measured < claimed_low else None
        word = "less than the claimed"
    if not held or beyond is None:
        return held, None
    digits = 0  # as many as it takes for a small excess not to read as "0% more"
    while f"{beyond:.{digits}f}".strip("0.") == "" and digits < 12:
        digits += 1
    return True, (f"{measured:.{digits}f}{unit} is {beyond:.{digits}f}{unit} {word} "
                  f"{claimed_low:g}-{claimed_high:g}{unit}")


# --- which function decides which claim ---------------------------------------------------------

_DECIDERS: Dict[str, str] = {}


def verdict_name(claim_ids: Sequence[str]) -> str:
    """The one name a function deciding ``claim_ids`` may have: ``verdict_`` + the ids' common
    stem, lower case (``verdict_b1`` for B1, ``verdict_r10`` for R10a and R10b)."""
    ids = [c.lower() for c in claim_ids]
    stem = ids[0] if len(ids) == 1 else re.match(r"[a-z]\d+", ids[0]).group(0)
    if any(not c.startswith(stem) for c in ids):
        raise ValueError(f"claims {', '.join(claim_ids)} share no stem: decide them in separate "
                         f"functions")
    return f"verdict_{stem}"


def decides(*claim_ids: str):
    """Declare that the decorated function decides ``claim_ids``: the one way a lesson says so.

    Checked when the lesson module is imported: each id is a registered claim whose deciding
    lesson is the module's ``LESSON``, the function is named ``verdict_name(claim_ids)``, and
    no other function decides the same claim. ``deciders()`` and ``decided_in()`` are derived
    from these declarations (a lesson's ``DECIDES`` is ``decided_in(__name__)``).
    """
    if not claim_ids:
        raise ValueError("decides needs at least one claim id")
    claimed = [get_claim(c) for c in claim_ids]

    def register(function):
        name = verdict_name(claim_ids)
        if function.__name__ != name:
            raise ValueError(f"a function deciding {', '.join(claim_ids)} must be named {name}; "
                             f"got {function.__name__}")
        lesson = function.__globals__.get("LESSON")
        for c in claimed:
            if c.lesson != lesson:
                raise ValueError(f"claim {c.id} is decided by lesson {c.lesson}; "
                                 f"{function.__module__} is lesson {lesson}")
            where = f"{function.__module__}.{function.__name__}"
            if _DECIDERS.get(c.id, where) != where:
                raise ValueError(f"claim {c.id} is already decided by {_DECIDERS[c.id]}")
            _DECIDERS[c.id] = where
        function.decides = tuple(claim_ids)
        return function
    return register


def deciders() -> Dict[str, str]:
    """Claim id -> the ``module.function`` declared (``decides``) to decide it, in registry
    order, after importing every lesson module."""
    import importlib
    import pkgutil

    from amp_lessons import lessons
    for m in pkgutil.iter_modules(lessons.__path__):
        if re.match(r"l\d\d_", m.name):
            importlib.import_module(f"{lessons.__name__}.{m.name}")
    return {cid: _DECIDERS[cid] for cid in CLAIMS if cid in _DECIDERS}


def decided_in(module: str) -> Tuple[str, ...]:
    """The claims the functions of ``module`` (a module's ``__name__``) declare they decide, in
    registry order: a lesson's ``DECIDES``, derived from its ``decides`` declarations."""
    return tuple(cid for cid in CLAIMS if _DECIDERS.get(cid, "").rsplit(".", 1)[0] == module)


# --- when can a measurement decide? -------------------------------------------------------------

MIN_TIMED_STEPS = 10
MAX_IDLE_FRACTION = 0.25


def timing_gate(device_type: str, steps: int, warmup: int = 1,
                gpu_idle_fraction: Optional[float] = None, min_steps: int = MIN_TIMED_STEPS,
                max_idle: float = MAX_IDLE_FRACTION) -> Optional[str]:
    """Why a speed comparison between precisions cannot decide a claim, or None when it can.

    It can only on a GPU, after a warm-up, over at least ``min_steps`` timed steps, and with the
    GPU busy: the share of step time the GPU sat idle (host and launch overhead) at most
    ``max_idle`` when it was measured.
    """
    check_int("steps", steps, 0)
    check_int("warmup", warmup, 0)
    if device_type != "cuda":
        return (f"timed on {device_type}, not on the GPU the claim is about: CPU speed says "
                f"nothing about tensor cores")
    if gpu_idle_fraction is not None and not (is_real(gpu_idle_fraction)
                                              and 0.0 <= gpu_idle_fraction <= 1.0):
        return (f"the GPU's idle share of each step was not measured as a fraction in [0, 1] "
                f"(got {gpu_idle_fraction!r}), so whether the GPU was busy is unknown")
    if warmup < 1:
        return "timed without a warm-up step: the first steps include one-time setup"
    if steps < min_steps:
        return f"only {plural(steps, 'timed step')} (at least {min_steps} needed for a stable median)"
    if gpu_idle_fraction is not None and gpu_idle_fraction > max_idle:
        return (f"the GPU was idle {gpu_idle_fraction:.0%} of each step (host and launch "
                f"overhead), so the step time does not measure the arithmetic the claim is about")
    return None


def rows_timing_gate(*rows: Mapping[str, Any], busy: bool = True) -> Optional[str]:
    """``timing_gate`` applied to measured rows (``measure.run_configs`` rows or a lesson's table
    rows): why a speed comparison of them cannot decide a claim, or None when it can. The one
    helper every timing verdict uses.

    Every row must have run (``status`` "ok"); the device is a GPU only when every row ran on one
    (``device_type`` "cuda", or timed with "CUDA events"); the fewest timed steps and the least
    warm-up among them count; with ``busy`` (the default) the idlest GPU's share counts too, and
    a GPU row whose idle share was not measured cannot show that the GPU was busy. A row whose
    repeats disagree by more than 10% (``spread``, ``bench.timer.repeat_spread``) decides nothing.
    """
    if not rows:
        raise ValueError("rows must hold at least one measured row")
    for r in rows:
        if not isinstance(r, Mapping):
            raise ValueError(f"rows must be measured rows (dicts); got {r!r}"[:200])
        if r.get("status") != "ok":
            return (f"{r.get('label', r.get('technique', '?'))} did not run "
                    f"({r.get('status')}: {r.get('reason')})")
    on_gpu = all((r.get("device_type") or ("cuda" if r.get("timer") == "CUDA events"
                                           else "cpu")) == "cuda" for r in rows)
    device = "cuda" if on_gpu else next(
        (r.get("device_type") for r in rows if r.get("device_type") not in (None, "cuda")),
        "cpu")
    idle = [r.get("gpu_idle_fraction") for r in rows]
    if on_gpu and busy and any(v is None for v in idle):
        return "the GPU's idle share was not measured, so a busy GPU cannot be shown"
    gate = timing_gate(device, min(int(r.get("steps") or 0) for r in rows),
                       min(int(r.get("warmup") or 0) for r in rows),
                       max(idle) if on_gpu and busy else None)
    if gate is not None:
        return gate
    from amp_lessons.measure.timer import NOISY_SPREAD  # the repeats of a row must agree
    for r in rows:
        spread = r.get("spread")
        if spread is not None and is_real(spread) and spread > NOISY_SPREAD:
            return (f"{r.get('label', r.get('technique', '?'))}'s repeats disagree by "
                    f"{100 * spread:.0f}% (over {100 * NOISY_SPREAD:.0f}%): the timing is noise")
    return None


def accuracy_gate(accuracy: Optional[float], classes: int, margin: float = 0.2) -> Optional[str]:
    """Why an accuracy comparison cannot decide a claim, or None: the runs must train well above
    chance (accuracy at least chance + ``margin``, as fractions)."""
    check_int("classes", classes, 2)
    accuracy = plain_number(accuracy)  # acc.mean() of a tensor is a correct accuracy too
    if accuracy is None:
        return "no accuracy was measured"
    if not (is_real(accuracy) and 0.0 <= accuracy <= 1.0):
        return (f"the accuracy is not a fraction in [0, 1] (got {accuracy!r}): the run diverged "
                f"or was not measured")
    chance = 1.0 / classes
    if accuracy < chance + margin:
        return (f"trained to {accuracy:.1%} accuracy, near chance ({chance:.0%}) for {classes} "
                f"classes: too short a run to compare precisions on accuracy")
    return None


# --- the published list ----------------------------------------------------------------------------

def claims_markdown() -> str:
    """``docs/claims.md``: the articles and every claim with its deciding lesson and rule."""
    lines = ["# The claims the course tests", "",
             "Generated from `amp_lessons/publish/claims.py` by `python -m amp_lessons claims --out docs/claims.md`",
             "(`make claims`); do not edit.",
             "Each claim is decided by exactly one measurement, in the lesson named here; other",
             "lessons may show related numbers but never rule on it. A run that cannot decide (a",
             "CPU timing, too few steps, an idle GPU, accuracy near chance) says \"not decided",
             "here\" and why. Outcomes: held; held, understated (the benefit larger or the cost",
             "smaller than claimed); held, deprecated (the code runs and only warns); partly held (a",
             "compound claim: the verdict names which part held); did not hold; not decided here.",
             "A claim decided on a stand-in for its setting says \", on a stand-in\".", ""]
    for key, title in ARTICLES.items():
        lines.append(f"- **Article {key}**: {title}")
    lines += ["", "| id | article | claim | decided in | rule |", "|---|---|---|---|---|"]
    for c in _CLAIMS:
        where = f"lesson {c.lesson}" if c.lesson else "not measured"
        cells = [c.id, c.article, c.says, where, c.rule]
        lines.append("| " + " | ".join(markdown_text(x, in_table=True) for x in cells) + " |")
    return "\n".join(lines) + "\n"


def verdict_rows(verdicts: Sequence[Verdict]) -> list:
    """``Verdict.row()`` of each verdict, for a table or ``report.publish``."""
    return [v.row() for v in verdicts]
