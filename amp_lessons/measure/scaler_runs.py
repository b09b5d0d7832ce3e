"""One loss-scaled fp16 run, recorded step by step, and what a trainer hook does to it.

- ``RunSetup`` / ``train_with_scaler``: one fp16 run of a digits model (or ResNet-50 on the
  digits) with given ``ScalerSettings``, the same seed, weights and batches every time;
- ``ScalerRun``: the scales, skipped steps and losses of one run, with its summary
  (``steps_to_settle``, ``last_skip``, ``final_loss``, ``settled_text``, ``longest_skip_streak``);
- ``OverflowInjector``: a trainer hook that writes an inf into a gradient at a chosen rate
  (overflow on demand); ``GradientCapture``: one that keeps each layer's true gradient magnitudes;
- ``scaler_getter_trace``: what GradScaler's getters return, step by step, beside its scale.

Lesson 03 builds its runs on these (``lessons.l03_scaler.train_with_scaler``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from amp_lessons.data import digits_loaders
from amp_lessons.models import DIGITS_MODELS, build_digits_model, resnet50
from amp_lessons.numerics.precision import as_device
from amp_lessons.tables import plural, pow2_text
from amp_lessons.train.trainer import Hooks, ScalerSettings, TrainConfig, Trainer
from amp_lessons.validate import check_int, is_int, is_real

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


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What every run of a comparison shares: model, data, optimizer and seed.

    ``model``: one of ``trainer.DIGITS_MODELS`` built by ``trainer.build_digits_model(model,
    width)``: ``"mlp"`` (flat 8x8 digits; fast on a CPU) or ``"cnn"`` (``SmallCNN`` on digits
    upsampled to ``image_size``), as in lesson 02, or ``"resnet50"`` (torchvision's ResNet-50,
    its stem adapted to 1-channel digits at ``image_size``). SGD with momentum
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
        if self.model == "resnet50":  # its stem adapted to the digits
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


def endless(batches):
    """Yield ``batches`` (``data.TensorBatches``) epoch after epoch, setting each epoch first,
    for runs counted in steps rather than epochs."""
    epoch = 0
    while True:
        batches.set_epoch(epoch)
        yield from batches
        epoch += 1


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
    batches = endless(train)
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


def longest_skip_streak(skipped: Sequence[bool]) -> int:
    """The most steps skipped in a row: how long the scale kept falling without a step between
    (each skipped step backs the scale off once)."""
    best = run = 0
    for skip in skipped:
        run = run + 1 if skip else 0
        best = max(best, run)
    return best


def scaler_getter_trace(device=None, steps: int = 12, growth_interval: int = 2,
                        overflow_steps: Sequence[int] = (7,),
                        init_scale: float = 2.0 ** 10) -> Dict[str, list]:
    """What ``torch.amp.GradScaler``'s getters return over a short run of a one-weight model:
    per step, ``scale`` (``get_scale()`` after ``update()``), ``growth_factor``
    (``get_growth_factor()``) and ``skipped`` (an inf written into the gradient at
    ``overflow_steps``, 0-based). With a short ``growth_interval`` the scale grows within the
    run; overflow at every step makes it only back off."""
    check_int("steps", steps, 1)
    check_int("growth_interval", growth_interval, 1)
    if any(not is_int(i) or not 0 <= i < steps for i in overflow_steps):
        raise ValueError(f"overflow_steps must be steps in [0, {steps}); got {overflow_steps!r}")
    dev = as_device(device)
    weight = torch.nn.Parameter(torch.ones(4, device=dev))
    opt = torch.optim.SGD([weight], lr=1e-3)
    scaler = torch.amp.GradScaler(dev.type, init_scale=init_scale,
                                  growth_interval=growth_interval)
    out: Dict[str, list] = {"scale": [], "growth_factor": [], "skipped": []}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale((weight * 1e-3).sum()).backward()
        if step in overflow_steps:
            weight.grad[0] = float("inf")
        before = float(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        out["scale"].append(float(scaler.get_scale()))
        out["growth_factor"].append(float(scaler.get_growth_factor()))
        out["skipped"].append(out["scale"][-1] < before)
    return out


def measured_defaults(device_type: str = "cpu") -> ScalerSettings:
    """PyTorch's GradScaler defaults, read from a fresh ``torch.amp.GradScaler(device_type)``.

    Measured, not typed: ``get_scale()``, ``get_growth_factor()``, ``get_backoff_factor()`` and
    ``get_growth_interval()`` of a scaler built with no arguments.
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


def preset_note(steps: int = FINAL_LOSS_WINDOW) -> str:
    """The presets table's note for runs of ``steps`` steps: what "final loss" (the mean of the
    last ``FINAL_LOSS_WINDOW`` steps, or of all of a shorter run's), "settled" and "last skip"
    mean. The preset panel (lesson 03) says it for the steps it ran (a 4-step run averages 4, not 10)."""
    check_int("steps", steps, 1)
    which = (f"the last {FINAL_LOSS_WINDOW} steps" if steps >= FINAL_LOSS_WINDOW else
             "its one step" if steps == 1 else f"all {steps} steps")
    return (f"final loss: mean training loss of {which}; {SETTLED_MEANS}; last skip: the step "
            f"number of the run's last skipped step.")
