"""Lesson 03 (``notebooks/03_grad_scaler_tuning.ipynb``): GradScaler's loss-scale dynamics.

The lesson's experiments, built on the engine (``trainer``, ``data``, ``models``, ``formats``) and
shown with ``ui.plots``/``ui.widgets``:

- ``RunSetup`` / ``train_with_scaler``: one fp16 run of a digits model with given
  ``ScalerSettings``, the same seed, weights and batches every time, recorded as a
  ``measure.scaler_runs.ScalerRun``; its ``OverflowInjector`` writes an inf into a gradient at a
  chosen rate (overflow on demand).
- ``scaler_presets`` / ``compare_presets`` / ``comparison_rows``: PyTorch's defaults (measured),
  article R's tuned set and NVIDIA's ResNet-50 settings on the same run.
- ``GradientCapture`` / ``capture_gradients``: real per-layer gradients (against fp16's range:
  ``formats.fraction_rows``, ``formats.scale_window``).
- ``verdict_r2``, ``verdict_r3``, ``verdict_b4``, ``verdict_r13``, ``verdict_r14``: the claims
  this lesson decides, as ``claims.Verdict``, each with its sensitivity rows.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from amp_lessons.publish import claims
from amp_lessons.validate import check_int, is_int
from amp_lessons.numerics.formats import fraction_rows, lost_shares, scale_window  # noqa: F401 (the lesson's API)
from amp_lessons.tables import plural, pow2_text
from amp_lessons.train.trainer import ScalerSettings
from amp_lessons.measure.scaler_runs import (FINAL_LOSS_WINDOW, SETTLE_WINDOW,  # noqa: F401 (the lesson's API)
                                             SETTLED_MEANS, GradientCapture, OverflowInjector,
                                             RunSetup, ScalerRun, endless, final_loss, last_skip,
                                             longest_skip_streak, scaler_getter_trace,
                                             settled_text, steps_to_settle, train_with_scaler,
                                             measured_defaults, preset_note)
from amp_lessons.lineage import traced  # explain names what made each row


LESSON = "03"

#: Claim R3 (article R): "for ResNet-50 these work best".
ARTICLE_R_TUNED = dict(init_scale=32768.0, growth_factor=1.5, backoff_factor=0.4,
                       growth_interval=1000)
#: NVIDIA DeepLearningExamples, PyTorch ResNet-50: static-loss-scale 128 as the initial scale,
#: dynamic scaling that grows every 100 steps (growth and backoff factors left at PyTorch's).
NVIDIA_RESNET50 = dict(init_scale=128.0, growth_interval=100)
#: Claim R2 (article R): PyTorch's GradScaler defaults, as the article states them.
ARTICLE_R_DEFAULTS = dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=2000)


def scaler_presets(device_type: str = "cpu") -> Dict[str, ScalerSettings]:
    """The presets lesson 03 compares: PyTorch's defaults (measured), article R's tuned set (R3)
    and NVIDIA's ResNet-50 example (init_scale 128, growth_interval 100, other knobs default)."""
    defaults = measured_defaults(device_type)
    return {"PyTorch defaults": defaults,
            "article R tuned (R3)": ScalerSettings(**ARTICLE_R_TUNED),
            "NVIDIA ResNet-50": dataclasses.replace(defaults, **NVIDIA_RESNET50)}


# ---- one run: same seed, same data, a given ScalerSettings ------------------------------------

PRESET_COLUMNS = ("preset", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
                  "skipped steps", "settled after (steps)", "last skip (step)", "final scale",
                  "final loss", "test accuracy")


PRESET_NOTE = preset_note()  # runs of FINAL_LOSS_WINDOW steps or more (the lesson's)


def capture_gradients(steps: int = 20, setup: RunSetup = RunSetup(model="cnn", image_size=32),
                      settings: Optional[ScalerSettings] = None, last: int = 3):
    """Train ``setup``'s model for ``steps`` fp16 steps and return ``(magnitudes, step)``: the
    per-layer true gradient magnitudes (``GradientCapture``) of the latest finite step among the
    last ``last`` steps. ``settings`` default to PyTorch's (measured)."""
    if not is_int(steps) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    settings = settings or measured_defaults(setup.torch_device.type)
    capture = GradientCapture(start_at=max(0, steps - last))
    trainer, train, _ = setup.build(settings, hooks=[capture])
    batches = endless(train)
    for _ in range(steps):
        trainer.train_step([next(batches)])
    if not capture.magnitudes:
        raise RuntimeError(f"every one of the last {plural(last, 'step')} had non-finite gradients")
    return capture.magnitudes, capture.step


def compare_presets(presets: Mapping[str, ScalerSettings], steps: int,
                    setup: RunSetup = RunSetup(), injection_rate: float = 0.0,
                    on_run: Optional[Callable[[str, ScalerRun], None]] = None
                    ) -> Dict[str, ScalerRun]:
    """Train each preset with ``train_with_scaler`` on the same seed, weights and batches (and
    the same injected overflows); return ``{name: ScalerRun}`` in order. ``on_run(name, run)``
    is called after each. Raises ``ValueError`` for no presets."""
    if not presets:
        raise ValueError("presets must name at least one ScalerSettings")
    runs = {}
    for name, settings in presets.items():
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"preset {name!r} must be a ScalerSettings; "
                             f"got {type(settings).__name__}")
        runs[name] = train_with_scaler(settings, steps, setup, injection_rate, name=name)
        if on_run is not None:
            on_run(name, runs[name])
    return runs


@traced
def comparison_rows(runs: Mapping[str, ScalerRun]) -> List[dict]:
    """One summary row per run (``ScalerRun.summary``) with the preset's settings."""
    return [dict(run.row(), preset=name) for name, run in runs.items()]


def early_skips(run: ScalerRun, window: int = SETTLE_WINDOW) -> int:
    """Skipped steps before the scale settled (all of them if it never did): early wobble."""
    settle = steps_to_settle(run.skipped, window)
    return int(sum(run.skipped if settle is None else run.skipped[:settle]))


def scale_factor_error(device_type: str = "cpu") -> str:
    """What ``torch.amp.GradScaler(device_type, scale_factor=2.0)`` (claim B4's knob) raises,
    as ``"TypeError: ..."``; ``""`` if this torch accepted it."""
    try:
        torch.amp.GradScaler(device_type, scale_factor=2.0)
    except TypeError as exc:
        return f"TypeError: {exc}"
    return ""


# ---- the claims lesson 03 decides ------------------------------------------------------------------

def _signature_defaults() -> Dict[str, float]:
    sig = inspect.signature(torch.amp.GradScaler.__init__).parameters
    return {k: sig[k].default for k in ARTICLE_R_DEFAULTS if k in sig}


def _defaults_rule(got: Mapping[str, float]) -> Tuple[bool, str]:
    wrong = [k for k, v in ARTICLE_R_DEFAULTS.items() if got.get(k) != v]
    return not wrong, ("every default matches" if not wrong else "differs in " + ", ".join(
        f"{k} (claimed {ARTICLE_R_DEFAULTS[k]:g}, measured {got.get(k)!r})" for k in wrong))


@claims.decides("R2")
def verdict_r2(device_type: str = "cpu") -> claims.Verdict:
    """Claim R2 (PyTorch's GradScaler defaults) against a fresh scaler's getters on this torch;
    sensitivity rows: the defaults in GradScaler's signature, and a scaler for the other device
    type where one runs here (a CPU's beside a GPU's)."""
    measured = measured_defaults(device_type)
    got = {k: getattr(measured, k) for k in ARTICLE_R_DEFAULTS}
    held, why = _defaults_rule(got)
    alts = [claims.alternative("in GradScaler's signature", held=_defaults_rule(
        _signature_defaults())[0], why=_defaults_rule(_signature_defaults())[1])]
    other = "cpu" if device_type != "cpu" else "cuda" if torch.cuda.is_available() else None
    if other is not None:
        o = measured_defaults(other)
        alts.append(claims.alternative(f"for device type {other}", held=_defaults_rule(
            dataclasses.asdict(o))[0], why=_defaults_rule(dataclasses.asdict(o))[1]))
    text = ", ".join(f"{k} {v:g}" for k, v in got.items())
    return claims.decide("R2", LESSON, f"torch {torch.__version__}: {text}", held, why,
                         numbers=got, sensitivity=alts,
                         condition=f"from a fresh GradScaler({device_type!r})'s getters")


def compare_settling(defaults: ScalerRun, tuned: ScalerRun,
                     window: int = SETTLE_WINDOW) -> Tuple[Optional[bool], str, str]:
    """R3's rule on two runs of the same seed and data: ``(held, measured, why)``. Held when the
    tuned run settles strictly sooner (``steps_to_settle``) and skips no more steps early
    (``early_skips``); None when neither run skipped early and both settled at the same step
    (nothing to improve on)."""
    inf = float("inf")
    sd, st = steps_to_settle(defaults.skipped, window), steps_to_settle(tuned.skipped, window)
    ed, et = early_skips(defaults, window), early_skips(tuned, window)

    def settled(v):
        return "never" if v is None else f"after {plural(v, 'step')}"

    measured = (f"{defaults.name}: {plural(ed, 'early skip')}, settled {settled(sd)}, final loss "
                f"{final_loss(defaults.losses):.4f}; {tuned.name}: {plural(et, 'early skip')}, settled "
                f"{settled(st)}, final loss {final_loss(tuned.losses):.4f}")
    if ed == 0 and et == 0 and sd == st:
        return None, measured, ("neither run wobbled (no early skipped steps), so there was "
                                "nothing for the tuned settings to improve on")
    faster = (inf if st is None else st) < (inf if sd is None else sd)
    held = faster and et <= ed
    why = (f"{tuned.name} settled {sd if sd is not None else 'never'} -> "
           f"{st if st is not None else 'never'} steps with {ed} -> {plural(et, 'early skip')}: "
           + ("sooner, with no more wobble" if held else "not sooner with less wobble"))
    return held, measured, why


MIN_DECIDING_STEPS = 200  # shorter runs show the first overflows only, not how a scale settles


def _too_short(runs: Sequence[ScalerRun], what: str) -> Optional[str]:
    steps = min(len(r.steps) for r in runs)
    if steps < MIN_DECIDING_STEPS:
        return (f"only {plural(steps, 'step')} per run ({what} needs at least {MIN_DECIDING_STEPS}: a short "
                f"run shows the first overflows, not how the scale settles; the full profile runs "
                f"longer)")
    return None


#: Claim R3 is about ResNet-50: the full profile on a CUDA GPU trains it this many fp16 steps per
#: setting (digits at 32x32, batch 64), enough for the early skips and the settling to show.
R3_RESNET50_STEPS = 300
R3_RESNET50_SETUP = RunSetup(model="resnet50", image_size=32, batch_size=64, lr=0.05)
R3_STAND_IN = "ResNet-50 at 32x32 on the digits set, batch 64, for ResNet-50 on ImageNet"
#: R3's growth settings act only after growth_interval clean steps (1000 and PyTorch's 2000):
#: the growth pair divides both intervals by this, so growth acts within R3_RESNET50_STEPS.
R3_GROWTH_SCALE = 20
R3_LOSS_TOLERANCE = 0.05  # "no higher final loss": within 5% (one seed)


def resnet50_scaler_pair(device_type: str, full: bool, steps: int = R3_RESNET50_STEPS,
                         setup: RunSetup = R3_RESNET50_SETUP, interval_scale: int = 1
                         ) -> Optional[Tuple[ScalerRun, ScalerRun]]:
    """Claim R3's own comparison: ResNet-50 trained ``steps`` fp16 steps with PyTorch's
    defaults and with article R's settings (``ARTICLE_R_TUNED``), same seed and batches, on a
    CUDA GPU in the full profile; None elsewhere (a CPU or the quick profile: ``verdict_r3``
    says why). ``interval_scale`` divides both growth intervals (the growth pair, labelled)."""
    if device_type != "cuda" or not full:
        return None
    check_int("interval_scale", interval_scale, 1)
    label = "" if interval_scale == 1 else f", growth_interval / {interval_scale}"
    settings = [measured_defaults(device_type), ScalerSettings(**ARTICLE_R_TUNED)]
    settings = [dataclasses.replace(x, growth_interval=max(1, x.growth_interval // interval_scale))
                for x in settings]
    return tuple(train_with_scaler(x, steps, setup, evaluate=False, name=f"ResNet-50, {who}{label}")
                 for x, who in zip(settings, ("PyTorch defaults", "article R's settings")))


def growths(run: ScalerRun) -> int:
    """How many times the run's scale grew (a step's scale above the step before's)."""
    return sum(1 for a, b in zip(run.scales, run.scales[1:]) if b > a)


def first_clean_scale(run: ScalerRun) -> Optional[float]:
    """The scale of the run's first step that was not skipped: where the early backoffs ended."""
    return next((s for s, k in zip(run.scales, run.skipped) if not k), None)


def growth_part(defaults: ScalerRun, tuned: ScalerRun) -> claims.Part:
    """R3's second part on a pair whose growth acts: the article's settings skip no more steps
    over the whole run and end at no higher final loss (within ``R3_LOSS_TOLERANCE``); not
    decided where the run is shorter than twice a growth interval or the scale never grew."""
    says = "the growth settings work over a run where growth acts"
    n = min(len(defaults.steps), len(tuned.steps))
    longest = max(defaults.settings.growth_interval, tuned.settings.growth_interval)
    intervals = f"growth_interval {defaults.settings.growth_interval} vs {tuned.settings.growth_interval}"
    if n < 2 * longest or not (growths(defaults) and growths(tuned)):
        return claims.Part(says, None, f"not decided: {plural(n, 'step')} with {intervals}: the "
                                       f"growth settings need a run of two growth intervals "
                                       f"with growth in both")
    sd, st = sum(defaults.skipped), sum(tuned.skipped)
    ld, lt = final_loss(defaults.losses), final_loss(tuned.losses)
    held = st <= sd and lt <= ld * (1 + R3_LOSS_TOLERANCE)
    return claims.Part(says, bool(held), (
        f"over {plural(n, 'step')} ({intervals}; the settings' own are "
        f"{ARTICLE_R_DEFAULTS['growth_interval']} and {ARTICLE_R_TUNED['growth_interval']}, "
        f"scaled down so growth acts: {growths(defaults)} and {growths(tuned)} growths): "
        f"{sd} -> {plural(st, 'skipped step')}, final loss {ld:.4f} -> {lt:.4f}"))


@claims.decides("R3")
def verdict_r3(resnet50_pair: Optional[Tuple[ScalerRun, ScalerRun]],
               digits_pairs: Sequence[Tuple[ScalerRun, ScalerRun]] = (),
               device_type: str = "cpu", window: int = SETTLE_WINDOW,
               growth_pair: Optional[Tuple[ScalerRun, ScalerRun]] = None,
               seed_pair: Optional[Tuple[ScalerRun, ScalerRun]] = None) -> claims.Verdict:
    """Claim R3 ("for ResNet-50 these settings work best: the scale settles faster with less
    early wobble") on a named stand-in (``R3_STAND_IN``), in parts: the article's settings
    settle sooner with no more early skips (``resnet50_pair``, ``compare_settling``, which also
    names the first scale that did not overflow: the early skips are the backoffs down to it);
    over a run where growth acts they skip no more steps and end no higher (``growth_pair``:
    both intervals scaled down ``R3_GROWTH_SCALE``x, labelled; ``growth_part``); "best" against
    other settings is untested on ResNet-50. Sensitivity row: ``seed_pair`` (another seed).
    ``digits_pairs`` are shown beside it and never rule."""
    shown = [compare_settling(d, t, window) for d, t in digits_pairs]
    beside = ("; beside it, not ruling (digits model): " + " | ".join(r[1] for r in shown)
              if shown else "")
    if resnet50_pair is None:
        return claims.not_decided(
            "R3", LESSON, "ResNet-50 did not train here" + beside,
            f"the claim is about ResNet-50, which this lesson trains only in its full profile on "
            f"a CUDA GPU (here: {device_type}); the digits model is not the claim's workload")
    defaults, tuned = resnet50_pair
    held, measured, why = compare_settling(defaults, tuned, window)
    clean = [first_clean_scale(r) for r in resnet50_pair]
    if None not in clean:
        why += (f" (the early skips are the backoffs from init_scale down to the first scale "
                f"that did not overflow, {clean[0]:,.0f} and {clean[1]:,.0f}: a count set by "
                f"init_scale and backoff_factor)")
    parts = [claims.Part("the scale settles faster with less early wobble", held, why),
             growth_part(*growth_pair) if growth_pair else claims.Part(
                 "the growth settings work over a run where growth acts", None,
                 "not decided: no run with growth acting was given"),
             claims.Part("untested: best against settings other than PyTorch's defaults", None,
                         "on ResNet-50 only PyTorch's defaults ran beside them (the digits "
                         "presets, NVIDIA's among them, are shown, not ruling)")]
    alts = []
    if seed_pair is not None:
        h, m, w = compare_settling(*seed_pair, window)
        alts.append(claims.alternative(
            f"with seed {R3_RESNET50_SETUP.seed + 1} ({plural(len(seed_pair[0].steps), 'step')})",
            parts=[claims.Part("the scale settles faster with less early wobble", h,
                               f"{m}: {w}")]))
    runs = [defaults, tuned] + list(growth_pair or ())
    return claims.decide("R3", LESSON, measured + beside, None, "", parts=parts,
                         numbers={"steps": min(len(defaults.steps), len(tuned.steps))},
                         cannot_decide=_too_short(runs, "settling"), stand_in=R3_STAND_IN,
                         sensitivity=alts, condition=f"with seed {R3_RESNET50_SETUP.seed}")


def resnet50_seed_pair(device_type: str, full: bool, steps: int = MIN_DECIDING_STEPS
                       ) -> Optional[Tuple[ScalerRun, ScalerRun]]:
    """R3's sensitivity row: ``resnet50_scaler_pair`` with the next seed, ``steps`` long."""
    setup = dataclasses.replace(R3_RESNET50_SETUP, seed=R3_RESNET50_SETUP.seed + 1)
    return resnet50_scaler_pair(device_type, full, steps, setup)


def scale_factor_accepted(device_type: str = "cpu") -> bool:
    """True when this torch's GradScaler takes ``scale_factor`` (claim B4's knob)."""
    return not scale_factor_error(device_type)


def steadier(base: ScalerRun, larger: ScalerRun,
             tolerance: float = 0.05) -> Tuple[Optional[bool], str, str]:
    """B4 read generously ("raise growth_factor" steadies a wobbling run) on two runs of the same
    seed and data whose settings differ only in growth_factor: ``(held, measured, why)``. Held
    when the larger factor skipped fewer steps and its final loss is no more than ``tolerance``
    (relative) above the base run's; None when the base run never skipped (no wobble) or a
    final loss is not finite."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1); got {tolerance!r}")
    gb, gl = base.settings.growth_factor, larger.settings.growth_factor
    if not gl > gb:
        raise ValueError(f"larger must have the larger growth_factor; got {gl:g} vs {gb:g}")
    sb, sl = sum(base.skipped), sum(larger.skipped)
    lb, ll = final_loss(base.losses), final_loss(larger.losses)
    measured = (f"growth_factor {gb:g}: {plural(sb, 'skipped step')}, final loss {lb:.4f}; "
                f"growth_factor {gl:g}: {plural(sl, 'skipped step')}, final loss {ll:.4f} "
                f"({plural(len(base.steps), 'step')}, "
                f"growth_interval {base.settings.growth_interval})")
    if sb == 0:
        return None, measured, "the base run never skipped a step: no wobble to steady"
    if not (np.isfinite(lb) and np.isfinite(ll)):
        return None, measured, ("a final loss is not finite (the run diverged or holds no "
                                "steps), so the runs cannot be compared")
    if sl > sb:
        return False, measured, (f"the larger growth factor skipped more steps ({sb} -> {sl}): "
                                 f"each growth overshoots further, so more steps hit an overflow")
    held = sl < sb and ll <= lb * (1 + tolerance)
    return held, measured, (f"the larger growth factor skipped {'fewer' if sl < sb else 'as many'}"
                            f" steps ({sb} -> {sl}); final loss {lb:.4f} -> {ll:.4f}")


def lower_start_steadies(wobbly: ScalerRun, lower: ScalerRun,
                         window: int = SETTLE_WINDOW) -> Tuple[Optional[bool], str, str]:
    """B4's second half ("or change the initial scale") on two runs of the same seed and data
    that differ only in ``init_scale``: ``wobbly`` starts too high, ``lower`` lower.
    ``(held, measured, why)``: held when the lower start skipped fewer steps early
    (``early_skips``); None when the high start did not wobble (nothing to steady)."""
    a, b = wobbly.settings.init_scale, lower.settings.init_scale
    if not b < a:
        raise ValueError(f"lower must start below wobbly; got init_scale {b:g} vs {a:g}")
    ew, el = early_skips(wobbly, window), early_skips(lower, window)
    measured = (f"init_scale {pow2_text(a)}: {plural(ew, 'early skip')}; init_scale "
                f"{pow2_text(b)}: {plural(el, 'early skip')}")
    if ew == 0:
        return None, measured, "the high start did not wobble: nothing to steady"
    return (el < ew), measured, (f"starting lower cut the early skipped steps {ew} -> {el}"
                                 if el < ew else f"starting lower did not cut the early skipped "
                                                 f"steps ({ew} -> {el})")


B4_LOSS_TOLERANCE = 0.05  # "converges no worse": a final loss within 5% (one seed)


def lower_start_converges(wobbly: ScalerRun, lower: ScalerRun) -> claims.Part:
    """B4's "change the initial scale" judged on convergence: the lower start's final loss is no
    more than ``B4_LOSS_TOLERANCE`` (relative) above the high start's (same seed and data)."""
    says = "a lower initial scale converges no worse (final loss)"
    lw, ll = final_loss(wobbly.losses), final_loss(lower.losses)
    if not (np.isfinite(lw) and np.isfinite(ll)):
        return claims.Part(says, None, "not decided: a final loss is not finite")
    return claims.Part(says, bool(ll <= lw * (1 + B4_LOSS_TOLERANCE)), (
        f"final loss {lw:.4f} from {pow2_text(wobbly.settings.init_scale)}, {ll:.4f} from "
        f"{pow2_text(lower.settings.init_scale)} ({plural(len(lower.steps), 'step')}, one seed)"))


def _b4_parts(default_run, b4_run, base, larger, device_type, wobbly, lower_start):
    error = scale_factor_error(device_type)
    default_growth = measured_defaults(device_type).growth_factor
    same = default_run.scales == b4_run.scales and default_run.skipped == b4_run.skipped
    n = min(len(default_run.losses), len(b4_run.losses))
    diff = max((abs(a - b) for a, b in zip(default_run.losses[:n], b4_run.losses[:n])),
               default=0.0)
    generous, g_measured, g_why = steadier(base, larger)
    measured = (f"{error or 'scale_factor accepted'}; the default growth_factor measures "
                f"{default_growth:g}; over {plural(n, 'step')} the run with growth_factor=2.0 had "
                f"{'the same' if same else 'different'} scales and skipped steps as the default "
                f"run (largest loss difference {diff:.3g}); {g_measured}")
    no_knob = ("GradScaler has no scale_factor argument" if error else
               "this torch accepts scale_factor")
    behaved = "did exactly what it does by default" if same else "behaved differently"
    effect = (f"growth_factor=2.0 {'is' if default_growth == 2.0 else 'is not'} the default, and "
              f"the scaler {behaved}{', so the advice changes nothing' if same else ''}")
    parts = [claims.Part("increase scale_factor=2.0", generous if generous is not None else (
        False if error and same else None), f"{no_knob}; read as growth_factor, {effect}. "
                                            f"Raising growth_factor: {g_why}")]
    if wobbly is not None and lower_start is not None:
        held2, m2, why2 = lower_start_steadies(wobbly, lower_start)
        measured += f"; {m2}"
        parts += [claims.Part("or change the initial scale: fewer early skipped steps", held2,
                              why2), lower_start_converges(wobbly, lower_start)]
    else:
        parts += [claims.Part("or change the initial scale", None,
                              "no run from a too-high start was given to steady")]
    return parts, measured, {"scale_factor_accepted": not error, "same_as_default": same,
                             "largest_loss_difference": diff}


@claims.decides("B4")
def verdict_b4(default_run: ScalerRun, b4_run: ScalerRun, base: ScalerRun, larger: ScalerRun,
               device_type: str = "cpu", wobbly: Optional[ScalerRun] = None,
               lower_start: Optional[ScalerRun] = None,
               seed_pair: Optional[Tuple[ScalerRun, ScalerRun]] = None) -> claims.Verdict:
    """Claim B4 ("if convergence wobbles, increase scale_factor=2.0 or change the initial
    scale"), decided in parts (``claims.Part``).

    "increase scale_factor=2.0", as written and generously. As written: GradScaler has no
    ``scale_factor``; read as ``growth_factor=2.0`` it is PyTorch's default, so ``b4_run``
    should repeat ``default_run``'s scaler behaviour step for step (same scales and skips;
    losses may differ in the last bits where kernels are not deterministic, so their largest
    difference is reported). Generously: a larger growth factor (``larger`` against ``base``,
    ``steadier``) steadies a wobbling run. "Change the initial scale": ``wobbly`` (a start too
    high, a wobble produced on purpose) against ``lower_start``, judged on early skipped steps
    (``lower_start_steadies``) and on convergence (``lower_start_converges``). Sensitivity row:
    ``seed_pair`` (the high and the lower start with another seed). Nothing is decided from
    runs shorter than ``MIN_DECIDING_STEPS``.
    """
    parts, measured, numbers = _b4_parts(default_run, b4_run, base, larger, device_type, wobbly,
                                         lower_start)
    alts = []
    if seed_pair is not None:
        alt_parts, _, _ = _b4_parts(default_run, b4_run, base, larger, device_type, *seed_pair)
        alts.append(claims.alternative(
            f"with another seed ({seed_pair[0].name} against {seed_pair[1].name}, "
            f"{plural(len(seed_pair[0].steps), 'step')})", parts=alt_parts))
    runs = [default_run, b4_run, base, larger] + [r for r in (wobbly, lower_start) if r]
    why = ("the wobble is produced on purpose here, by a start at "
           f"{pow2_text(wobbly.settings.init_scale)} (a run from PyTorch's defaults wobbles "
           f"little)" if wobbly is not None else "")
    return claims.decide("B4", LESSON, measured, None, why, parts=parts, numbers=numbers,
                         cannot_decide=_too_short(runs, "steadying a wobbling run"),
                         sensitivity=alts, condition="with the lesson's seed")


R13_BACKOFFS = 8  # backoffs before the scale settled that count as "the scale keeps falling"


def _skips(run: ScalerRun, n: int) -> int:
    return int(sum(run.skipped[:n]))


def _remedies(falling: ScalerRun, lower: ScalerRun, gentler: ScalerRun,
              stops: bool) -> List[claims.Part]:
    """R13's two parts on runs from the same seed: ``lower`` (a lower init_scale) and
    ``gentler`` (a larger backoff_factor) against ``falling``. ``stops``: judge whether the fall
    stopped at all (a step not skipped) instead of counting skips over the same steps."""
    if not lower.settings.init_scale < falling.settings.init_scale:
        raise ValueError("lower must start below the falling run (a lower init_scale)")
    if not gentler.settings.backoff_factor > falling.settings.backoff_factor:
        raise ValueError("gentler must have a larger backoff_factor than the falling run")
    n = min(len(falling.steps), len(lower.steps), len(gentler.steps))
    base = _skips(falling, n)
    out = []
    for says, run, what in (("lower init_scale", lower, pow2_text(lower.settings.init_scale)),
                            ("raise backoff_factor", gentler,
                             f"backoff_factor {gentler.settings.backoff_factor:g}")):
        k = _skips(run, n)
        held = k < n if stops else k < base
        out.append(claims.Part(says, held, f"{what}: {k} of {plural(n, 'step')} skipped, against "
                                           f"{base} from {pow2_text(falling.settings.init_scale)} "
                                           f"with backoff_factor "
                                           f"{falling.settings.backoff_factor:g}"
                               + ("" if held or stops or says != "raise backoff_factor" else
                                  ": a gentler backoff falls slower, so more steps overflow "
                                  "before the scale fits")))
    return out


@claims.decides("R13")
def verdict_r13(falling: ScalerRun, lower: ScalerRun, gentler: ScalerRun,
                forced: Optional[Tuple[ScalerRun, ScalerRun, ScalerRun]] = None,
                backoffs: int = R13_BACKOFFS) -> claims.Verdict:
    """Claim R13 ("if the loss scale keeps falling, lower init_scale or raise backoff_factor")
    is conditional: decided only where ``falling`` (a run without injected overflows) backed off
    at least ``backoffs`` times on its own before its scale settled (``early_skips``). There each remedy, run from the same seed
    (``lower``: a lower init_scale; ``gentler``: a larger backoff_factor), holds when it skips
    fewer steps over the same steps. Sensitivity row: ``forced``, the three runs under an
    overflow injected at every step (a scale that never stops falling, produced on purpose):
    a remedy holds there only if the fall stops."""
    check_int("backoffs", backoffs, 2)
    fell, longest = early_skips(falling), longest_skip_streak(falling.skipped)
    alts = []
    if forced is not None:
        alts.append(claims.alternative(
            "with a scale that never stops falling (an overflow injected at every step, "
            "produced on purpose)", parts=_remedies(*forced, stops=True)))
    measured = (f"{falling.name}: {plural(fell, 'backoff')} before the scale settled "
                f"({longest} in a row at most), {plural(sum(falling.skipped), 'skipped step')} of "
                f"{len(falling.steps)}")
    if any(falling.injected) or fell < backoffs:
        return claims.not_decided(
            "R13", LESSON, measured,
            f"the condition did not occur on its own: no run without injected overflows backed "
            f"off {backoffs} or more times before its scale settled ({fell} here); it would "
            f"trigger on a start far above what the gradients allow", sensitivity=alts)
    return claims.decide("R13", LESSON, measured, None,
                         f"the scale backed off {plural(fell, 'time')} before it settled, on its "
                         f"own (a start too high)",
                         parts=_remedies(falling, lower, gentler, stops=False),
                         sensitivity=alts, condition="when a start too high made the scale fall")


@claims.decides("R14")
def verdict_r14(trace: Mapping[str, Sequence], backoff_trace: Optional[Mapping] = None
                ) -> claims.Verdict:
    """Claim R14 ("call get_growth_factor() to see the scale's growth") from
    ``measure.scaler_runs.scaler_getter_trace`` of a run whose scale grew: held if the getter's
    value follows the scale (changes as it changes); not decided where the scale never changed.
    Sensitivity row: ``backoff_trace``, a run whose scale only backed off."""
    def rule(t):
        scale, factor = list(t["scale"]), list(t["growth_factor"])
        if len(scale) < 2 or len(set(scale)) < 2:
            return None, "the scale never changed, so there was no growth to see"
        ups = sum(1 for a, b in zip(scale, scale[1:]) if b > a)
        downs = sum(1 for a, b in zip(scale, scale[1:]) if b < a)
        follows = len(set(factor)) > 1
        return follows, (f"get_growth_factor() returned {', '.join(f'{v:g}' for v in sorted(set(factor)))}"
                         f" at all {len(factor)} steps while get_scale() went {scale[0]:,.6g} -> "
                         f"{scale[-1]:,.6g} ({plural(ups, 'growth')}, {plural(downs, 'backoff')})"
                         + ("" if follows else ": it returns the growth_factor setting, not a "
                                               "trend; read get_scale() to see growth"))
    held, why = rule(trace)
    alts = []
    if backoff_trace is not None:
        h, w = rule(backoff_trace)
        alts.append(claims.alternative("with a scale that only backed off", held=h, why=w))
    measured = f"GradScaler's getters over {plural(len(trace['scale']), 'step')}: {why}"
    return claims.decide("R14", LESSON, measured, held, why, sensitivity=alts,
                         condition="when the scale grew", numbers={
                             "growth_factors": sorted(set(trace["growth_factor"]))})


def lost_line(magnitudes_by_layer: Mapping[str, np.ndarray], scale: float, fmt: str = "fp16",
              layer: Optional[str] = None) -> str:
    """What ``fmt`` loses of the nonzero gradients (of one ``layer``, or all) at ``scale``, in
    words: ``formats.lost_shares``, so a nonzero count never reads as 0%."""
    chosen = {layer: magnitudes_by_layer[layer]} if layer is not None else magnitudes_by_layer
    s = lost_shares(chosen, scale, fmt)
    return f"{s['flushed']} flushed, {s['subnormal']} subnormal, {s['overflow']} overflow"


#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)
