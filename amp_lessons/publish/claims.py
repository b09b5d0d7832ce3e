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

from amp_lessons.lineage import traced
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
    whose measurement decides it (None: the course does not measure it) and the ``rule``;
    ``parts`` (the parts of a compound claim, each decided on its own; "untested:" marks a part
    the course does not measure), ``alternatives`` (the sensitivity rows: the alternatives a
    reviewer would try first, measured in the same run and decided beside the verdict) and
    ``depends`` (what the verdict turns on), as ``docs/claims.md`` publishes them."""

    id: str
    article: str
    says: str
    lesson: Optional[str]
    rule: str
    parts: Tuple[str, ...] = ()
    alternatives: Tuple[str, ...] = ()
    depends: str = ""


_CLAIMS = (
    Claim("R1", "R", "FP16 spans 5.96e-8 to 65504; FP32 spans 1.4e-45 to 3.4e38", "01",
          "each end matches the format's limit measured by arithmetic on this device, at the "
          "claim's written precision",
          parts=("FP16 spans 5.96e-8 to 65504", "FP32 spans 1.4e-45 to 3.4e38"),
          alternatives=("the limits measured by arithmetic on the CPU as well as on this run's "
                        "device", "the limits as torch.finfo states them"),
          depends="the low ends are the subnormal minima: they hold where subnormals are kept "
                  "(PyTorch's default on GPUs and CPUs; a flush-to-zero mode reads them as 0), "
                  "and full precision stops at the smallest normal"),
    Claim("B5", "B", "in AMP \"the loss is computed in FP16\" and \"backward runs in FP16\", then "
          "gradients are \"restored to FP32\"", "02",
          "three parts, each from the dtypes fp16 autocast gives a real model: the loss in FP16; "
          "the gradients flowing back through the layers in FP16; the parameter gradients in FP32 "
          "(the backward of autocast's weight cast returns them in fp32)",
          parts=("the loss is computed in FP16", "backward runs in FP16",
                 "gradients are restored to FP32"),
          alternatives=("a hand-written loss of ops autocast does not list (mean absolute "
                        "error) instead of cross_entropy",),
          depends="the loss function: cross_entropy is on autocast's float32 list, a loss built "
                  "from unlisted ops stays 16-bit"),
    Claim("B6", "B", "the AMP API is `from torch.cuda.amp import autocast, GradScaler`", "02",
          "the import and the calls on this torch: held if they run; held, deprecated if they "
          "only warn (the `torch.amp` replacement named); did not hold if the import fails",
          alternatives=("the torch.amp replacement the warning names, run in the same cell",),
          depends="the torch release: deprecated (a FutureWarning) since torch 2.4; code run "
                  "with warnings as errors stops there"),
    Claim("B7", "B", "AMP needs no change to any layer's code", "02",
          "in fp16: a model of torch.nn layers trains under autocast unchanged, and a layer "
          "written as a custom autograd Function runs under autocast unchanged, or needs "
          "`torch.amp.custom_fwd`",
          alternatives=("a model built only from torch.nn layers (lesson 02's SimpleNet)",),
          depends="how a layer is written: torch.nn layers need no change; a custom autograd "
                  "Function needs torch.amp.custom_fwd/custom_bwd"),
    Claim("B1", "B", "FP16 saves about 50% of memory and trains 1.5 to 2x faster on Tensor Core "
          "GPUs", "04",
          "ResNet-50 on a Tensor Core GPU, fp16 + GradScaler against fp32 as PyTorch runs it by "
          "default (TF32 convolutions), same memory format and run; two parts: memory saved >= 40% "
          "and speed-up >= 1.5x (above 2x: held, understated); decided only on a busy GPU",
          parts=("saves about 50% of memory", "trains 1.5 to 2x faster"),
          alternatives=("channels_last on both sides", "against fp32 with TF32 off"),
          depends="the memory format (fp16 convolutions need channels_last for their fast "
                  "kernels) and the fp32 baseline (TF32 convolutions, PyTorch's default, or TF32 "
                  "off)"),
    Claim("B2", "B", "RTX 3090, `train.py --precision fp32` vs `--precision amp`: about 10.2 GB and "
          "18.7 s per epoch vs about 5.8 GB and 11.2 s (over 40% less memory, about 39% less time)",
          "04",
          "on a named stand-in (ResNet-50 on this GPU for train.py on an RTX 3090): fp16 against "
          "the default fp32 (TF32 convolutions) in the same run and memory format; two parts: "
          "memory saved >= 40% and step time at least 30% shorter; decided only on a busy GPU",
          parts=("over 40% less memory", "about 39% less time"),
          alternatives=("channels_last on both sides", "against fp32 with TF32 off"),
          depends="the memory format and the fp32 baseline, as B1; the card (an RTX 3090 did not "
                  "run: ResNet-50 on this GPU stands in)"),
    Claim("B3", "B", "against exploding gradients or NaN, call `clip_grad_norm_(params, "
          "max_norm=1.0)` (shown without `unscale_`)", "02",
          "three parts on the same fp16 run: the call as shown (before `unscale_`) clips at the "
          "stated norm; the same call after `unscale_` does; clipping guards against exploding "
          "gradients or NaN (conditional: decided only where they occurred on their own)",
          parts=("clip_grad_norm_(max_norm=1.0) as shown (before unscale_) clips at 1.0",
                 "the same call after unscale_ clips at 1.0",
                 "clipping guards against exploding gradients or NaN"),
          alternatives=("bf16 autocast without a GradScaler (no scale to undo)",),
          depends="whether a GradScaler scales the gradients (fp16) and whether unscale_ runs "
                  "before the clip"),
    Claim("B4", "B", "if convergence wobbles, \"increase scale_factor=2.0\" or change the initial "
          "scale", "03",
          "conditional (the wobble is produced on purpose here, by a start at 2^24, and the "
          "verdict says so); two parts, same seed and data: \"increase scale_factor=2.0\" (the "
          "argument exists, or read as growth_factor a larger one steadies the run) and \"change "
          "the initial scale\" (a lower start skips fewer early steps and converges no worse: "
          "final loss)",
          parts=("increase scale_factor=2.0", "or change the initial scale"),
          alternatives=("another seed (the high and the lower start, a shorter run)",),
          depends="what counts as convergence: early skipped steps (a count of backoffs, "
                  "arithmetic on init_scale) or the loss"),
    Claim("R2", "R", "GradScaler defaults: init_scale 65536, growth_factor 2.0, backoff_factor 0.5, "
          "growth_interval 2000", "03", "a fresh GradScaler's getters on this torch",
          alternatives=("the defaults in GradScaler's signature",
                        "a GradScaler for the other device type"),
          depends="the torch release (these defaults have held since torch 1.6)"),
    Claim("R3", "R", "for ResNet-50, init_scale 32768, growth_factor 1.5, backoff_factor 0.4, "
          "growth_interval 1000 work best: the scale settles faster with less early wobble", "03",
          "on a named stand-in (ResNet-50 at 32x32 on the digits set, fp16, GPU only) against "
          "PyTorch's defaults, same seed and data: the article's settings settle strictly sooner "
          "with no more early skipped steps, and over a run long enough for growth to act "
          "(both growth intervals scaled down 20x, labelled) skip no more steps and end at no "
          "higher loss; not decided where neither wobbled or ResNet-50 did not run",
          parts=("the scale settles faster with less early wobble",
                 "the growth settings work over a run where growth acts",
                 "untested: best against settings other than PyTorch's defaults"),
          alternatives=("another seed",),
          depends="the start and backoff: the early skips are a count of backoffs from "
                  "init_scale to the first scale that does not overflow; the model and data (a "
                  "stand-in for ImageNet at 224x224)"),
    Claim("R4", "R", "keep layer1-2 in autocast but force layer3, layer4 and fc to FP32 \"to avoid "
          "vanishing gradients\" and \"guarantee classification accuracy\"", "04",
          "accuracy of the selective-autocast ResNet against plain AMP on real data, decided "
          "only where a difference can show (at least 3 seeds per arm, a baseline below the "
          "task's ceiling, the gain against the seed spread); its cost in speed and memory shown",
          parts=("guarantee classification accuracy",
                 "untested: to avoid vanishing gradients"),
          alternatives=("against plain bf16 autocast instead of fp16",),
          depends="the task's ceiling and the number of seeds: on a saturated task no gain can "
                  "show"),
    Claim("R5", "R", "with Adam, raise eps from 1e-8 to 1e-7 \"to prevent FP16 division by zero\", "
          "enable amsgrad \"for stability\", and use `torch.optim._multi_tensor.Adam` as the "
          "\"mixed-precision wrapper\"", "04",
          "three parts: eps meets FP16 (where Adam's state lives under AMP, and whether eps 1e-8 "
          "vanishes there); amsgrad trains better (an accuracy part, decided only where a "
          "difference can show); `_multi_tensor.Adam` is more than foreach Adam",
          parts=("raise eps to 1e-7 to prevent FP16 division by zero",
                 "enable amsgrad for stability", "_multi_tensor.Adam as the mixed-precision "
                 "wrapper"),
          alternatives=("pure fp16 weights (model.half()), where Adam's state is fp16 too",),
          depends="where Adam's state lives: fp32 under autocast (eps never meets fp16), fp16 "
                  "with fp16 weights (1e-8 rounds to 0 there)"),
    Claim("R6", "R", "ResNet-50 on ImageNet: FP32 15.2 GB, 320 img/s, 76.3% top-1; native AMP "
          "10.1 GB (-33%), 580 img/s (+81%), 76.1%; \"optimized\" (R3+R4+R5) 9.1 GB (-40%), "
          "620 img/s (+94%), 76.2%", "04",
          "the three configurations in one run, \"optimized\" built as the article does (R4's "
          "model, R5's Adam), each part on its own: memory saved and speed-up against the default "
          "fp32 (TF32 convolutions) at least the claimed, and \"optimized\" beats plain AMP; "
          "top-1 on ImageNet untested; decided only on a busy GPU",
          parts=("native AMP saves 33%", "native AMP +81% img/s", "optimized saves 40%",
                 "optimized +94% img/s", "optimized beats native AMP",
                 "untested: top-1 on ImageNet (76.3%, 76.1%, 76.2%)"),
          alternatives=("against fp32 with TF32 off",),
          depends="the fp32 baseline (TF32 convolutions, PyTorch's default, or TF32 off)"),
    Claim("R7", "R", "if validation accuracy drops, validate with autocast disabled", "04",
          "conditional: decided only where a half-precision run's accuracy fell more than 1 point "
          "below fp32's on its own; there, held if evaluating with autocast off wins it back; "
          "trained above chance",
          alternatives=("fp16 alone", "bf16 alone"),
          depends="whether the condition occurs: a drop on the task the course trains"),
    Claim("R8", "R", "gradient checkpointing saves another 20-30% of memory for about 30% more "
          "compute time", "05",
          "per-block checkpointing against AMP on ResNet-50, same settings, busy GPU; one-sided: "
          "memory saved >= 20 points of fp32's memory and step time added <= 40% (more saved "
          "than 30 points, or less than 20% added: held, understated)",
          parts=("another 20-30% of memory", "about 30% more compute time"),
          alternatives=("the eager AMP pair (no CUDA graph)", "the bf16 pair", "the fp32 pair"),
          depends="whether the step is host-bound: checkpointing adds Python work per block, "
                  "which a CUDA graph removes"),
    Claim("R9", "R", "gradient accumulation gives a larger virtual batch at the same memory", "05",
          "two parts: peak memory at 1, 2, 4, 8 micro-batches stays within 15%, and the "
          "accumulated step equals the large-batch step (relative difference at most 1e-4 in "
          "fp32, 10 units of fp16's epsilon in 16 bits) on every model measured",
          parts=("at the same memory", "a larger virtual batch (the same step)"),
          alternatives=("an fp16 MLP", "a model with BatchNorm (the article's ResNet-50 has "
                        "it)"),
          depends="BatchNorm: it normalizes each micro-batch on its own, so the accumulated "
                  "step is not the large batch's"),
    Claim("R10a", "R", "one card under 12 GB: AMP + checkpointing saves 50-60% of memory", "05",
          "the largest batch per simulated card size with each technique, on a GPU; AMP + "
          "checkpointing fits the largest batch and saves >= 50% against fp32 at the same batch",
          alternatives=("bf16 autocast in place of fp16 AMP",
                        "the cheaper checkpointing (stem and layer1-2 only)"),
          depends="which layers are checkpointed, and the simulated card sizes"),
    Claim("R10b", "R", "one card of 12 GB or more: AMP + gradient accumulation saves 40-50% of "
          "memory", "05", "the largest batch per simulated card size with each technique, on a "
          "GPU; AMP saves >= 40% and trains faster than AMP + checkpointing (busy GPU)",
          alternatives=("bf16 autocast in place of fp16 AMP",),
          depends="the speed comparison: eager steps of ResNet-50 are partly host-bound, CUDA "
                  "graphs are not"),
    Claim("R10c", "R", "several 8 GB cards: AMP + ZeRO stage 1 saves 60-70% of memory", "06",
          "peak memory per rank, AMP + ZeRO-1 against fp32 DDP, from a memory model (peak = the "
          "rest + optimizer state / N) validated at the rank counts that ran; the saving at the "
          "claim's 8 ranks is the model's prediction unless 8 ranks ran, and the verdict says so",
          alternatives=("at the rank count that ran, measured (where 8 ranks did not run and "
                        "the model predicted them)",),
          depends="the rank count (ZeRO-1 shards only the optimizer state, so the saving grows "
                  "with N) and the optimizer (Adam's state is two copies of the weights)"),
    Claim("R10d", "R", "AMP + model parallelism saves 40-50% of memory", None,
          "not measured by the course: it trains no model-parallel setup",
          depends="a model-parallel setup, which the course does not train"),
    Claim("R11", "R", "a DeepSpeed config enables mixed precision with `\"amp\": {\"enabled\": "
          "true, \"opt_level\": \"O2\"}`", "06",
          "from the installed DeepSpeed, run on the CPU in a separate process: its config "
          "accepts the key and its engine hands it to Apex's amp.initialize; not decided where "
          "DeepSpeed is not installed, saying why the course does not install it",
          alternatives=("the key beside ZeRO stage 1, as article R uses it",),
          depends="the DeepSpeed release: releases with Apex AMP handed the key to Apex and "
                  "refused it with ZeRO; later releases refuse the key"),
    Claim("R12", "R", "attention is more precision-sensitive than convolutions and may need a "
          "changed autocast op list", "04",
          "two parts: attention's fp16 relative error over 1.5x the convolution's (about half a "
          "bit of fp16's precision, sqrt(2) = 1.41, rounded up) at standard 1/sqrt(d) scaling "
          "(GPU), and whether an autocast op list can be changed (torch.autocast's signature; "
          "torch.library.register_autocast covers custom ops only)",
          parts=("attention is more precision-sensitive than convolutions",
                 "may need a changed autocast op list"),
          alternatives=("sharper softmax logits (8x and 32x the standard scaling)",),
          depends="how sharp the softmax logits are: at standard scaling attention's error is "
                  "close to the convolution's"),
    Claim("R13", "R", "if the loss scale keeps falling, lower init_scale or raise backoff_factor",
          "03",
          "conditional: decided where the scale fell on its own (a start too high: 8 or more "
          "backoffs before it settled); there, from the same seed, a lower init_scale and a "
          "larger backoff_factor (0.8) each skip fewer steps than the falling run",
          parts=("lower init_scale", "raise backoff_factor"),
          alternatives=("a scale that never stops falling (non-finite gradients at every scale, "
                        "produced on purpose)",),
          depends="why the scale falls: a start too high (it stops) or gradients that are not "
                  "finite at any scale (it never stops: no scaler setting cures it)"),
    Claim("R14", "R", "call `scaler.get_growth_factor()` to see the scale's growth", "03",
          "the getter's values over a run in which the scale grew and backed off, beside "
          "get_scale(): held if the getter follows the scale",
          alternatives=("a run whose scale only backed off",),
          depends="what the getter returns: the growth_factor setting, not a trend"),
    Claim("B8", "B", "its diagram of the AMP step puts GradScaler after backward (forward, loss, "
          "backward, then GradScaler, then the update)", "02",
          "the diagram's order run as code (loss.backward(), then scaler.scale and "
          "scaler.step) against PyTorch's (scaler.scale(loss).backward(), then scaler.step), "
          "same start and batch: the update's size against the right one",
          alternatives=("a low init_scale (2^8)", "bf16 autocast with the GradScaler disabled "
                        "(shown: without loss scaling the order cannot matter)"),
          depends="whether the loss is scaled: with fp16 and GradScaler the order decides the "
                  "update's size"),
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
class Alternative:
    """One sensitivity row of a verdict: the claim decided again under an alternative a reviewer
    would try first (another memory format, TF32 off, another seed, the article's own input),
    measured in the same run. ``setting`` reads after "held" ("with channels_last on both
    sides"), ``held`` is True, False or None (this alternative could not decide) and ``why``
    gives the numbers. ``alternative`` builds one from ``Part``s."""

    setting: str
    held: Optional[bool]
    why: str

    def __post_init__(self):
        if not isinstance(self.setting, str) or not self.setting.strip():
            raise ValueError("an alternative must name its setting; got an empty value")
        if self.held not in (True, False, None):
            raise ValueError(f"an alternative's held must be True, False or None; got "
                             f"{self.held!r}")
        if not isinstance(self.why, str) or not self.why.strip():
            raise ValueError(f"alternative {self.setting!r} must say why; got {self.why!r}")

    @property
    def outcome(self) -> str:
        """``"held"``, ``"did not hold"`` or ``"not decided here"`` under this alternative."""
        return {True: HELD, False: NOT_HELD, None: UNDECIDED}[self.held]

    def text(self) -> str:
        """``"<setting>: <outcome> (<why>)"``, as a verdict's sensitivity column shows it."""
        return f"{self.setting}: {self.outcome} ({self.why})"


def alternative(setting: str, parts: Sequence[Part] = (), held: Optional[bool] = None,
                why: str = "", cannot_decide: Optional[str] = None) -> Alternative:
    """An ``Alternative`` from the same rule the verdict used: either ``parts`` (held when every
    decided part held, not held when any did not, undecided when none was decided: untested
    parts do not count; ``why`` lists the parts) or ``held`` and ``why``; ``cannot_decide`` makes it undecided with that
    reason (the alternative's own gate: a CPU timing, an idle GPU)."""
    parts = tuple(parts)
    if parts:
        if held is not None:
            raise ValueError("held must be None when parts are given: the parts decide it")
        decided = [p.held for p in parts if p.held is not None]
        held = None if not decided else all(decided)  # untested parts leave it to the tested
        clauses = "; ".join(f"{p.says}: {p.outcome} ({p.why})" for p in parts)
        why = f"{why}. {clauses}" if why.strip() else clauses
    if cannot_decide:
        held, why = None, cannot_decide
    return Alternative(setting, held, why)


def _with_alternatives(held: Optional[bool], qualifier: str, why: str,
                       alternatives: Sequence[Alternative], condition: str,
                       parts: Sequence[Part] = ()):
    """The verdict's ``(held, qualifier, why)`` after its sensitivity rows: where a decided
    alternative rules otherwise than the main measurement, the verdict is at most partly held
    and ``why`` names the conditions ("held with X; did not hold on Y"). A compound verdict
    counts as held here when every part it could decide held (its untested parts aside)."""
    decided = [a for a in alternatives if a.held is not None]
    if held is None or not decided:
        return held, qualifier, why
    tested = [p.held for p in parts if p.held is not None]
    main = held is True or (bool(tested) and all(tested))  # partly only for untested parts
    if all(a.held == main for a in decided):
        return held, qualifier, why
    yes = ([condition] if main else []) + [a.setting for a in decided if a.held]
    no = ([] if main else [condition]) + [a.setting for a in decided if not a.held]
    return False, "partly", (f"{why}. It depends on the setting: held {'; and '.join(yes)}; "
                             f"did not hold {'; and '.join(no)}")


@dataclass(frozen=True)
class Verdict:
    """A claim beside its measurement, as every lesson returns it.

    ``held`` is True (the whole claim held), False (it did not, or only part of it did), or None
    (this measurement could not decide the claim: ``why`` says why). ``qualifier`` refines a
    decided verdict: ``"understated"`` (held, and the benefit is larger or the cost smaller than
    claimed), ``"deprecated"`` (held: the code runs and only warns), ``"partly"`` (a compound
    claim of which some ``parts`` held and some did not). ``stand_in`` names what stood in for
    the claim's own setting (another model or card); ``measured`` states what ran, with numbers;
    ``numbers`` keeps them as data; ``sensitivity`` holds its ``Alternative`` rows. Built by
    ``decide``, from the measurement, never typed in.
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
    sensitivity: Tuple[Alternative, ...] = ()

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
                "measured": self.measured, "verdict": self.outcome, "why": self.why,
                "sensitivity": self.sensitivity_text()}

    def sensitivity_text(self) -> str:
        """The sensitivity rows in one line (``Alternative.text`` each), or what says none ran."""
        return ("; ".join(a.text() for a in self.sensitivity)
                or "no alternative measured in this run")

    def __str__(self) -> str:
        return (f"claim {self.claim} ({CLAIMS[self.claim].says})\n"
                f"  measured: {self.measured}\n"
                f"  verdict : {self.outcome.upper()}: {self.why}"
                + (f"\n  sensitivity: {self.sensitivity_text()}" if self.sensitivity else ""))


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
           stand_in: Optional[str] = None, sensitivity: Sequence[Alternative] = (),
           condition: str = "in the run shown") -> Verdict:
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

    ``sensitivity``: the claim decided again under the alternatives a reviewer would try first
    (``Alternative``s, measured in the same run). Where a decided alternative rules otherwise
    than the main measurement, the verdict is "partly held" and ``why`` names both conditions:
    ``condition`` is the main measurement's ("on NCHW", read after "held"/"did not hold").
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
    sensitivity = tuple(sensitivity)
    if not all(isinstance(a, Alternative) for a in sensitivity):
        raise ValueError(f"sensitivity must hold claims.Alternative rows; got {sensitivity!r}"
                         [:300])
    if not isinstance(condition, str) or not condition.strip():
        raise ValueError(f"condition must name the main measurement's setting; got "
                         f"{condition!r}")
    if held is True and understated:
        qualifier, why = "understated", f"{why}; understated: {understated}"
    if held is True and deprecated:
        qualifier, why = "deprecated", f"{why}; deprecated: {deprecated}"
    if not cannot_decide:
        held, qualifier, why = _with_alternatives(held, qualifier, why, sensitivity, condition,
                                                  parts)
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
                   stand_in or "", sensitivity)


def not_decided(claim_id: str, lesson: str, measured: str, because: str,
                numbers: Optional[Mapping[str, Any]] = None,
                sensitivity: Sequence[Alternative] = ()) -> Verdict:
    """A "not decided here" verdict: what ran, and why it cannot rule on the claim (with the
    ``sensitivity`` rows that ran beside it)."""
    return decide(claim_id, lesson, measured, None, because, numbers, sensitivity=sensitivity)


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
    no other function decides the same claim. Each call is recorded (``lineage.traced``), so
    ``explain claims.lNN`` names the decider and its arguments for every verdict row. ``deciders()`` and ``decided_in()`` are derived
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
        function = traced(function)  # each verdict leads back to the call that decided it
        function.decides = tuple(claim_ids)
        return function
    return register


def deciders() -> Dict[str, str]:
    """Claim id -> the ``module.function`` declared (``decides``) to decide it, in registry
    order, among the modules imported so far (``lessons.all_deciders()`` imports every lesson
    first: this layer does not import the lessons above it)."""
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


MIN_SEEDS = 3


def accuracy_effect(says: str, base: Sequence[float], variant: Sequence[float],
                    min_gain: float, test_examples: int, classes: int,
                    min_seeds: int = MIN_SEEDS) -> Part:
    """The part of a claim that a change (``variant``) gains more than ``min_gain`` accuracy
    over ``base`` (test accuracies as fractions, one per seed), decided only where a difference
    can show: every run above chance (``accuracy_gate``), at least ``min_seeds`` seeds per arm,
    and a baseline below the task's ceiling (its error leaves room for the claimed gain). Held
    when the mean gain exceeds ``min_gain`` and twice the seed spread (the larger arm's sample
    standard deviation); did not hold when it does not; otherwise the part is "not decided"
    and its why names what is missing (the seeds, or the ceiling: the baseline's accuracy, and
    what one test image is worth)."""
    check_int("test_examples", test_examples, 1)
    check_int("min_seeds", min_seeds, 2)
    if not (is_real(min_gain) and 0 < min_gain < 1):
        raise ValueError(f"min_gain must be a fraction in (0, 1); got {min_gain!r}")
    base, variant = [plain_number(a) for a in base], [plain_number(a) for a in variant]
    if not base or not variant:
        raise ValueError("base and variant must each hold at least one accuracy")
    for a in base + variant:
        why = accuracy_gate(a, classes)
        if why is not None:
            return Part(says, None, f"not decided: {why}")
    image = 100 / test_examples
    mean_b, mean_v = sum(base) / len(base), sum(variant) / len(variant)
    seeds = min(len(base), len(variant))
    ceiling = (f"the baseline reaches {100 * mean_b:.1f}% on {plural(test_examples, 'test image')} "
               f"(one image is {image:.2f} points)")
    if 1 - mean_b <= min_gain:
        return Part(says, None, f"not decided here: the task's ceiling: {ceiling}, which leaves "
                                f"{100 * (1 - mean_b):.2f} points, not more than the "
                                f"{100 * min_gain:g} a gain must exceed")
    if seeds < min_seeds:
        return Part(says, None, f"not decided here: {plural(seeds, 'seed')} per arm (at least "
                                f"{min_seeds} are needed to set the gain against the seed "
                                f"spread); {ceiling}")

    def sd(xs):
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    spread = max(sd(base), sd(variant))
    gain = mean_v - mean_b
    held = gain > min_gain and gain > 2 * spread
    return Part(says, bool(held),
                f"gain {100 * gain:+.2f} points over {plural(seeds, 'seed')} (seed spread "
                f"{100 * spread:.2f} points; needs more than {100 * min_gain:g} and twice the "
                f"spread); {ceiling}")


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
    lines += ["", "Every verdict carries **sensitivity rows**: the claim decided again, in the same",
              "run, under the alternatives a reviewer would try first. Where one rules otherwise",
              "than the main measurement, the verdict is at most \"partly held\" and names both",
              "conditions. Parts marked \"untested\" are parts the course does not measure.", "",
              "| id | article | claim | decided in | rule |", "|---|---|---|---|---|"]
    for c in _CLAIMS:
        where = f"lesson {c.lesson}" if c.lesson else "not measured"
        cells = [c.id, c.article, c.says, where, c.rule]
        lines.append("| " + " | ".join(markdown_text(x, in_table=True) for x in cells) + " |")
    lines += ["", "## Each claim's parts, sensitivity rows and what it depends on"]
    for c in _CLAIMS:
        lines += ["", f"### {c.id}: {markdown_text(c.says)}", ""]
        lines.append("- **parts**: " + ("; ".join(markdown_text(p) for p in c.parts)
                                         if c.parts else "one (the claim as a whole)"))
        lines.append("- **sensitivity rows**: " + ("; ".join(markdown_text(a)
                                                             for a in c.alternatives)
                                                   if c.alternatives else "none (not measured)"))
        lines.append(f"- **depends on**: {markdown_text(c.depends) if c.depends else '-'}")
    return "\n".join(lines) + "\n"


def verdict_rows(verdicts: Sequence[Verdict]) -> list:
    """``Verdict.row()`` of each verdict, for a table or ``report.publish``."""
    return [v.row() for v in verdicts]
