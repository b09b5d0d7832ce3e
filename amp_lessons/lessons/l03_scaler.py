"""Lesson 03 (``notebooks/03_grad_scaler_tuning.ipynb``): GradScaler's loss-scale dynamics.

The lesson's experiments, built on the engine (``trainer``, ``data``, ``models``, ``formats``) and
shown with ``ui.plots``/``ui.widgets``:

- ``RunSetup`` / ``train_with_scaler`` / ``ScalerRun``: one fp16 run of a digits model with given
  ``ScalerSettings``, the same seed, weights and batches every time; ``OverflowInjector`` writes
  an inf into a gradient at a chosen rate (overflow on demand).
- ``scaler_presets`` / ``compare_presets`` / ``comparison_rows``: PyTorch's defaults (measured),
  article R's tuned set and NVIDIA's ResNet-50 settings on the same run.
- ``GradientCapture`` / ``capture_gradients``: real per-layer gradients (against fp16's range:
  ``formats.fraction_rows``, ``formats.scale_window``).
- ``verdict_r2``, ``verdict_r3``, ``verdict_b4``: the claims this lesson decides, as
  ``claims.Verdict``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from amp_lessons.publish import claims
from amp_lessons.validate import check_int, is_int, is_real
from amp_lessons.data import digits_loaders
from amp_lessons.numerics.formats import fraction_rows, lost_shares, scale_window  # noqa: F401 (the lesson's API)
from amp_lessons.models import DIGITS_MODELS, build_digits_model, resnet50
from amp_lessons.numerics.precision import as_device
from amp_lessons.tables import plural, pow2_text
from amp_lessons.train.trainer import Hooks, ScalerSettings, TrainConfig, Trainer


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


def measured_defaults(device_type: str = "cpu") -> ScalerSettings:
    """PyTorch's GradScaler defaults, read from a fresh ``torch.amp.GradScaler(device_type)``.

    Measured, not typed: ``get_scale()``, ``get_growth_factor()``, ``get_backoff_factor()`` and
    ``get_growth_interval()`` of a scaler built with no arguments (claim R2 compares these).
    """
    try:
        known = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:
        known = False
    if not known:
        raise ValueError(f"device_type must be a device type torch knows, such as 'cpu' or "
                         f"'cuda'; got {device_type!r}")
    scaler = torch.amp.GradScaler(device_type)
    if not scaler.is_enabled():
        raise ValueError(f"GradScaler cannot run on device_type {device_type!r} here")
    return ScalerSettings(init_scale=float(scaler.get_scale()),
                          growth_factor=float(scaler.get_growth_factor()),
                          backoff_factor=float(scaler.get_backoff_factor()),
                          growth_interval=int(scaler.get_growth_interval()))


def scaler_presets(device_type: str = "cpu") -> Dict[str, ScalerSettings]:
    """The presets lesson 03 compares: PyTorch's defaults (measured), article R's tuned set (R3)
    and NVIDIA's ResNet-50 example (init_scale 128, growth_interval 100, other knobs default)."""
    defaults = measured_defaults(device_type)
    return {"PyTorch defaults": defaults,
            "article R tuned (R3)": ScalerSettings(**ARTICLE_R_TUNED),
            "NVIDIA ResNet-50": dataclasses.replace(defaults, **NVIDIA_RESNET50)}


# ---- one run: same seed, same data, a given ScalerSettings ------------------------------------

SETTLE_WINDOW = 10
FINAL_LOSS_WINDOW = 10


def last_skip(skipped: Sequence[bool]) -> Optional[int]:
    """The (0-based) step of the run's last skipped step, or ``None`` when no step was skipped."""
    return max((i for i, skip in enumerate(skipped) if skip), default=None)


def steps_to_settle(skipped: Sequence[bool], window: int = SETTLE_WINDOW) -> Optional[int]:
    """How many optimizer steps a run took before its loss scale settled, or ``None``.

    Definition (``SETTLED_MEANS``): the scale has *settled* at the step after the run's last
    skipped step (0 when none was skipped): no step after it was skipped. ``None`` when its last
    skip is among its last ``window`` steps, too close to the end to tell a settled scale from a
    pause between overflows: a scaler that keeps probing (grows, overflows, backs off) never
    settles. Raises ``ValueError`` for ``window < 1``."""
    if not is_int(window) or window < 1:
        raise ValueError(f"window must be an integer >= 1; got {window!r}")
    last = last_skip(skipped)
    settled = 0 if last is None else last + 1
    return settled if len(skipped) - settled >= window else None


SETTLED_MEANS = (f"settled: the step after the last skipped step (no skip in the rest of the "
                 f"run); never when the last skip is within the last {SETTLE_WINDOW} steps")


PRESET_COLUMNS = ("preset", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
                  "skipped steps", "settled after (steps)", "last skip (step)", "final scale",
                  "final loss", "test accuracy")


def preset_note(steps: int = FINAL_LOSS_WINDOW) -> str:
    """The presets table's note for runs of ``steps`` steps: what "final loss" (the mean of the
    last ``FINAL_LOSS_WINDOW`` steps, or of all of a shorter run's), "settled" and "last skip"
    mean. The preset panel says it for the steps it ran (a 4-step run averages 4, not 10)."""
    check_int("steps", steps, 1)
    which = (f"the last {FINAL_LOSS_WINDOW} steps" if steps >= FINAL_LOSS_WINDOW else
             "its one step" if steps == 1 else f"all {steps} steps")
    return (f"final loss: mean training loss of {which}; {SETTLED_MEANS}; last skip: the step "
            f"number of the run's last skipped step.")


PRESET_NOTE = preset_note()  # runs of FINAL_LOSS_WINDOW steps or more (the lesson's)


def settled_text(skipped: Sequence[bool], window: int = SETTLE_WINDOW) -> str:
    """When the scale settled, with the last skip beside it: ``"after 981 steps (last skip at
    step 980)"``, or ``"not within the run (last skip at step 2,995 of 3,000)"``."""
    k, last = steps_to_settle(skipped, window), last_skip(skipped)
    if last is None:
        return "at step 0 (no step skipped)" if k == 0 else "not within the run (too short)"
    if k is None:
        return f"not within the run (last skip at step {last:,} of {len(skipped):,})"
    return f"after {plural(k, 'step')} (last skip at step {last:,})"


def final_loss(losses: Sequence[float], last: int = FINAL_LOSS_WINDOW) -> float:
    """The run's final loss: the mean training loss over its last ``last`` steps (fewer if the
    run is shorter), which is steadier than one step's loss. ``nan`` for an empty run."""
    if not is_int(last) or last < 1:
        raise ValueError(f"last must be an integer >= 1; got {last!r}")
    tail = [float(v) for v in list(losses)[-last:]]
    return float(np.mean(tail)) if tail else float("nan")


@dataclasses.dataclass
class ScalerRun:
    """What one run recorded, step by step, and its summary.

    ``scales[i]`` is the scale step ``i`` used (as the trainer's ``StepRecord.scale``),
    ``skipped[i]`` whether the scaler skipped it, ``injected[i]`` whether the overflow injector
    wrote an inf into its gradients, ``changes`` the settings changed mid-run as
    ``(step, ScalerSettings)``; ``evaluation`` the test loss and accuracy after the run.
    """

    name: str
    settings: ScalerSettings
    steps: List[int] = dataclasses.field(default_factory=list)
    scales: List[float] = dataclasses.field(default_factory=list)
    skipped: List[bool] = dataclasses.field(default_factory=list)
    losses: List[float] = dataclasses.field(default_factory=list)
    injected: List[bool] = dataclasses.field(default_factory=list)
    changes: List[tuple] = dataclasses.field(default_factory=list)
    evaluation: Optional[dict] = None
    final_scale: Optional[float] = None
    trainer: object = dataclasses.field(default=None, repr=False, compare=False)

    def _take(self, records, injector: "OverflowInjector") -> None:
        """Append the numbers of the records not yet taken (reading them from the device)."""
        for record in records[len(self.steps):]:
            self.steps.append(len(self.steps))
            self.scales.append(float(record.scale))
            self.skipped.append(bool(record.skipped))
            self.losses.append(float(record.loss))
            self.injected.append(injector.injected[len(self.injected)])
        if self.trainer is not None:
            self.final_scale = float(self.trainer.scaler.get_scale())

    def columns(self) -> Dict[str, list]:
        """The per-step columns the plots take: steps, scales, skipped, losses."""
        return {"steps": list(self.steps), "scales": list(self.scales),
                "skipped": list(self.skipped), "losses": list(self.losses)}

    def summary(self, window: int = SETTLE_WINDOW) -> dict:
        """Skipped steps, steps until settled (see ``steps_to_settle``), final scale (after the
        last update), final loss (see ``final_loss``), and test accuracy when evaluated."""
        ev = self.evaluation or {}
        return {"preset": self.name, "steps": len(self.steps),
                "skipped steps": int(sum(self.skipped)),
                "injected overflows": int(sum(self.injected)),
                "settled after (steps)": steps_to_settle(self.skipped, window),
                "last skip (step)": last_skip(self.skipped),
                "final scale": self.final_scale,
                "min scale": min(self.scales) if self.scales else None,
                "final loss": final_loss(self.losses) if self.losses else None,
                "test accuracy": ev.get("accuracy")}

    def row(self) -> dict:
        """The run's settings and ``summary`` in one row (``comparison_rows``, the preset panel's
        table)."""
        s = self.settings
        return {"preset": self.name, "init_scale": s.init_scale, "growth_factor": s.growth_factor,
                "backoff_factor": s.backoff_factor, "growth_interval": s.growth_interval,
                **{k: v for k, v in self.summary().items() if k != "preset"}}

    def summary_line(self, window: int = SETTLE_WINDOW) -> str:
        """One line for people: the panel's summary."""
        s = self.summary(window)
        parts = [f"skipped {s['skipped steps']:,} of {plural(s['steps'], 'step')}",
                 f"settled {settled_text(self.skipped, window)}",
                 (f"final scale {pow2_text(s['final scale'])}" if s["final scale"] is not None
                  else ""),
                 f"final loss {s['final loss']:.4f} (mean of last "
                 f"{plural(min(FINAL_LOSS_WINDOW, s['steps']), 'step')})"
                 if s["final loss"] is not None else "",
                 f"test accuracy {s['test accuracy']:.1%}"
                 if s["test accuracy"] is not None else ""]
        return " · ".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What every run of a comparison shares: model, data, optimizer and seed.

    ``model``: one of ``trainer.DIGITS_MODELS`` built by ``trainer.build_digits_model(model,
    width)``: ``"mlp"`` (flat 8x8 digits; fast on a CPU) or ``"cnn"`` (``SmallCNN`` on digits
    upsampled to ``image_size``), as in lesson 02, or ``"resnet50"`` (torchvision's ResNet-50,
    its stem adapted to 1-channel digits at ``image_size``: claim R3's model). SGD with momentum
    at ``lr``. Validated when built.
    """

    model: str = "mlp"
    width: int = 32
    image_size: int = 32
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    device: Optional[str] = None

    def __post_init__(self):
        if self.model not in DIGITS_MODELS + ("resnet50",):
            raise ValueError(f"model must be one of {', '.join(DIGITS_MODELS + ('resnet50',))}; "
                             f"got {self.model!r}")
        for name, low in (("width", 1), ("image_size", 8), ("batch_size", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
            object.__setattr__(self, name, int(value))
        if not (is_real(self.lr) and 0 < self.lr <= 10):
            raise ValueError(f"lr must be in (0, 10]; got {self.lr!r}")
        if not (is_real(self.momentum) and 0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1); got {self.momentum!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {self.seed!r}")
        for name, kind in (("lr", float), ("momentum", float), ("seed", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def torch_device(self) -> torch.device:
        """The device runs train on: ``device`` if given, else the course's default device."""
        return as_device(self.device)

    def build(self, settings: ScalerSettings, hooks: Sequence = ()):
        """A fresh, seeded ``Trainer`` (fp16 + GradScaler with ``settings``) and the data
        ``(train_batches, test_batches)``: the same weights and batch order for every call."""
        device = self.torch_device
        torch.manual_seed(self.seed)
        if self.model == "resnet50":  # claim R3's model, its stem adapted to the digits
            model, size = resnet50(num_classes=10, in_channels=1, small_input=True), 0
        else:
            model, size = build_digits_model(self.model, self.width)
        if size is not None:
            size = self.image_size
        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum)
        config = TrainConfig(precision="fp16", scaler=settings, progress=False, seed=self.seed)
        trainer = Trainer(model, opt, config, device=device, hooks=tuple(hooks))
        train, test = digits_loaders(self.batch_size, size, device, self.seed)
        return trainer, train, test


def _forever(batches):
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


class OverflowInjector(Hooks):
    """A trainer hook that writes ``inf`` into a gradient with probability ``rate`` per step.

    Runs in ``after_backward`` (the gradients are still scaled), so ``unscale_`` finds the inf,
    the step is skipped and the scale backs off: overflow on demand. Draws come from its own
    generator seeded with ``seed`` (one draw per backward, whatever the rate), so a run repeats
    exactly and changing ``rate`` mid-run does not shift later draws. ``injected`` lists, per
    optimizer step, whether an inf was written. Raises ``ValueError`` for a rate outside [0, 1].
    """

    def __init__(self, rate: float = 0.0, seed: int = 0):
        self.rate = rate
        self.generator = torch.Generator().manual_seed(int(seed))
        self.injected: List[bool] = []
        self._this_step = False

    @property
    def rate(self) -> float:
        """The probability of an inf per backward pass, in [0, 1]."""
        return self._rate

    @rate.setter
    def rate(self, value: float) -> None:
        if not is_real(value) or not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"overflow injection rate must be in [0, 1]; got {value!r}")
        self._rate = float(value)

    def after_backward(self, trainer, micro_step):
        draw = float(torch.rand((), generator=self.generator))
        if draw < self._rate:
            grad = next((p.grad for p in trainer.model.parameters() if p.grad is not None), None)
            if grad is not None:
                grad[(0,) * grad.dim()] = float("inf")
                self._this_step = True

    def after_step(self, trainer, record):
        self.injected.append(self._this_step)
        self._this_step = False


def train_with_scaler(settings: ScalerSettings, steps: int, setup: RunSetup = RunSetup(),
                      injection_rate: float = 0.0, name: str = "run",
                      on_step: Optional[Callable] = None, evaluate: bool = True,
                      injector: Optional["OverflowInjector"] = None) -> ScalerRun:
    """Train ``steps`` optimizer steps in fp16 with a GradScaler set to ``settings``.

    Same seed, weights and batches for every call with the same ``setup``; an
    ``OverflowInjector(injection_rate, setup.seed)`` is installed. ``on_step(trainer, run)`` runs
    after every step; it may call ``trainer.set_scaler`` (a mid-run change) and returns
    ``False`` to stop early. Pass ``injector`` to keep a handle on it (its rate is then used and
    ``injection_rate`` ignored). Returns the ``ScalerRun`` (its ``trainer`` attribute holds the
    trainer). Raises ``ValueError`` for ``steps < 1`` and the trainer's documented errors for
    bad settings.
    """
    if not is_int(steps) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    injector = injector or OverflowInjector(injection_rate, seed=setup.seed)
    trainer, train, test = setup.build(settings, hooks=[injector])
    run = ScalerRun(name=name, settings=settings, trainer=trainer)
    batches = _forever(train)
    records = []
    for _ in range(steps):
        records.append(trainer.train_step([next(batches)]))
        if on_step is not None:  # live: read this step's numbers now (one small sync)
            run._take(records, injector)
            if on_step(trainer, run) is False:
                break
    trainer.history.materialize()  # the rest with one copy per field, no sync per step
    run._take(records, injector)
    if evaluate:
        run.evaluation = dict(trainer.evaluate(test))
    return run


class GradientCapture(Hooks):
    """A trainer hook that keeps each layer's true gradient magnitudes ``|g|``.

    Runs in ``after_unscale``: the gradients are unscaled (what the model really computed) and
    not yet clipped. Layers are the modules with a weight of two or more dimensions (convolutions
    and linear layers), weight and bias together, named ``"<module name> (<type>)"``. From step
    ``start_at`` (0-based) on, it keeps the latest step whose gradients are all finite (a skipped
    step's are not); ``magnitudes`` maps layer to a float32 array, ``step`` is the step they came
    from (``None`` before a capture).
    """

    def __init__(self, start_at: int = 0):
        if not is_int(start_at) or start_at < 0:
            raise ValueError(f"start_at must be an integer >= 0; got {start_at!r}")
        self.start_at = start_at
        self.magnitudes: Dict[str, np.ndarray] = {}
        self.step: Optional[int] = None
        self._count = 0

    def after_unscale(self, trainer):
        if self._count < self.start_at:
            return
        found = {}
        for name, module in trainer.model.named_modules():
            weight = getattr(module, "weight", None)
            if (not isinstance(weight, torch.nn.Parameter) or weight.dim() < 2
                    or weight.grad is None):
                continue
            parts = [weight.grad.detach().reshape(-1)]
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter) and bias.grad is not None:
                parts.append(bias.grad.detach().reshape(-1))
            found[f"{name} ({type(module).__name__})"] = torch.cat(parts).abs().float()
        if found and all(bool(torch.isfinite(g).all()) for g in found.values()):
            self.magnitudes = {k: v.cpu().numpy() for k, v in found.items()}
            self.step = self._count

    def after_step(self, trainer, record):
        self._count += 1


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
    batches = _forever(train)
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

@claims.decides("R2")
def verdict_r2(device_type: str = "cpu") -> claims.Verdict:
    """Claim R2 (PyTorch's GradScaler defaults) against a fresh scaler's getters on this torch."""
    measured = measured_defaults(device_type)
    got = {k: getattr(measured, k) for k in ARTICLE_R_DEFAULTS}
    wrong = [k for k, v in ARTICLE_R_DEFAULTS.items() if got[k] != v]
    text = ", ".join(f"{k} {v:g}" for k, v in got.items())
    why = ("every default matches" if not wrong else
           "differs in " + ", ".join(f"{k} (claimed {ARTICLE_R_DEFAULTS[k]:g}, "
                                     f"measured {got[k]:g})" for k in wrong))
    return claims.decide("R2", LESSON, f"torch {torch.__version__}: {text}", not wrong, why,
                         numbers=got)


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


def resnet50_scaler_pair(device_type: str, full: bool, steps: int = R3_RESNET50_STEPS,
                         setup: RunSetup = R3_RESNET50_SETUP
                         ) -> Optional[Tuple[ScalerRun, ScalerRun]]:
    """Claim R3's own comparison: ResNet-50 trained ``steps`` fp16 steps with PyTorch's
    defaults and with article R's settings (``ARTICLE_R_TUNED``), same seed and batches, on a
    CUDA GPU in the full profile; None elsewhere (a CPU or the quick profile: ``verdict_r3``
    says why)."""
    if device_type != "cuda" or not full:
        return None
    defaults = train_with_scaler(measured_defaults(device_type), steps, setup,
                                 name="ResNet-50, PyTorch defaults", evaluate=False)
    tuned = train_with_scaler(ScalerSettings(**ARTICLE_R_TUNED), steps, setup,
                              name="ResNet-50, article R's settings", evaluate=False)
    return defaults, tuned


@claims.decides("R3")
def verdict_r3(resnet50_pair: Optional[Tuple[ScalerRun, ScalerRun]],
               digits_pairs: Sequence[Tuple[ScalerRun, ScalerRun]] = (),
               device_type: str = "cpu", window: int = SETTLE_WINDOW) -> claims.Verdict:
    """Claim R3 ("for ResNet-50 these settings work best: the scale settles faster with less
    early wobble") decided on its own model: ``resnet50_pair`` (``resnet50_scaler_pair``: the
    defaults run, the article-settings run). Held when the article's settles strictly sooner
    with no more early skipped steps (``compare_settling``); not decided when neither run
    wobbled, or when ResNet-50 did not run here. ``digits_pairs`` (the digits model's pairs)
    are shown beside it and never rule: the claim is about ResNet-50."""
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
    return claims.decide("R3", LESSON, measured + beside, held, why,
                         numbers={"steps": min(len(defaults.steps), len(tuned.steps))},
                         cannot_decide=_too_short([defaults, tuned], "settling"))


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


@claims.decides("B4")
def verdict_b4(default_run: ScalerRun, b4_run: ScalerRun, base: ScalerRun, larger: ScalerRun,
               device_type: str = "cpu", wobbly: Optional[ScalerRun] = None,
               lower_start: Optional[ScalerRun] = None) -> claims.Verdict:
    """Claim B4 ("if convergence wobbles, increase scale_factor=2.0 or change the initial
    scale"), decided in its two parts (``claims.Part``).

    Part 1, "increase scale_factor=2.0", as written and generously. As written: GradScaler has
    no ``scale_factor``; read as ``growth_factor=2.0`` it is PyTorch's default, so ``b4_run``
    should repeat ``default_run``'s scaler behaviour step for step (same scales and skips;
    losses may differ in the last bits where kernels are not deterministic, so their largest
    difference is reported). Generously: a larger growth factor (``larger`` against ``base``,
    ``steadier``) steadies a wobbling run. Held when either reading changes the run for the
    better; runs that merely differ are not better. Part 2, "change the initial scale":
    ``wobbly`` (a start too high, with early skips) against ``lower_start`` (the same run from a
    lower ``init_scale``, ``lower_start_steadies``); not decided without them. Neither part is
    decided from runs shorter than ``MIN_DECIDING_STEPS``.
    """
    error = scale_factor_error(device_type)
    default_growth = measured_defaults(device_type).growth_factor
    same = default_run.scales == b4_run.scales and default_run.skipped == b4_run.skipped
    n = min(len(default_run.losses), len(b4_run.losses))
    diff = max((abs(a - b) for a, b in zip(default_run.losses[:n], b4_run.losses[:n])),
               default=0.0)
    changes_nothing = bool(error) and same
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
    first = claims.Part("increase scale_factor=2.0",
                        generous if generous is not None else (False if changes_nothing else None),
                        f"{no_knob}; read as growth_factor, {effect}. Raising growth_factor: "
                        f"{g_why}")
    runs = [default_run, b4_run, base, larger]
    if wobbly is not None and lower_start is not None:
        held2, m2, why2 = lower_start_steadies(wobbly, lower_start)
        measured += f"; {m2}"
        runs += [wobbly, lower_start]
    else:
        held2, why2 = None, "no run from a too-high start was given to steady"
    second = claims.Part("or change the initial scale", held2, why2)
    short = _too_short(runs, "steadying a wobbling run")
    return claims.decide("B4", LESSON, measured, None, "", parts=[first, second],
                         numbers={"scale_factor_accepted": not error, "same_as_default": same,
                                  "largest_loss_difference": diff}, cannot_decide=short)


def lost_line(magnitudes_by_layer: Mapping[str, np.ndarray], scale: float, fmt: str = "fp16",
              layer: Optional[str] = None) -> str:
    """What ``fmt`` loses of the nonzero gradients (of one ``layer``, or all) at ``scale``, in
    words: ``formats.lost_shares``, so a nonzero count never reads as 0%."""
    chosen = {layer: magnitudes_by_layer[layer]} if layer is not None else magnitudes_by_layer
    s = lost_shares(chosen, scale, fmt)
    return f"{s['flushed']} flushed, {s['subnormal']} subnormal, {s['overflow']} overflow"


#: The claims this lesson decides, derived from its ``claims.decides`` declarations.
DECIDES = claims.decided_in(__name__)
