"""The shared training loop of the course (introduced in lesson 02, used by lessons 03-05).

One loop for every precision, in the order of PyTorch's AMP examples page::

    for each micro-batch:  autocast forward, loss / accumulate, scaler.scale(loss).backward()
    scaler.unscale_(optimizer)          # true gradients from here on
    clip (by norm or by value)          # optional, always AFTER unscale_
    scaler.step(optimizer); scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()                    # only when the optimizer really stepped

Precisions: ``fp32`` (TF32 off), ``tf32`` (TF32 matmuls and convolutions on CUDA), ``fp16``
(autocast + GradScaler; ``amp`` is an alias) and ``bf16`` (autocast, no scaler).

Cheap on purpose: ``Trainer.train_step`` never waits for the GPU unless a scheduler has to know
whether the step was skipped. Each ``StepRecord`` keeps loss, scale, gradient norm, skipped flag
and step time as device tensors (or CUDA events) until read (``History.columns()``: one copy per
field); the norm as per-parameter norms (one foreach kernel), the fp16 scale replayed from
GradScaler's flags (``_compat.ScaleLog``), the peak memory once per window of steps. So the lean
step makes no device call the hand loop does not, and one micro-batch with nothing to do between
backward and step takes fewer Python layers (``_lean_step``). Turn off what you do not need with
``TrainConfig(track_grad_norm=False, track_memory=False, track_time=False)``.

Skip-safe BatchNorm: when GradScaler skips a step (inf/NaN gradients), BatchNorm running statistics
are put back to their values before that step, without a host sync (``torch.where`` on a flat
copy), so a skipped step leaves the whole model exactly as it was.

Non-finite values without a GradScaler (fp32, tf32, bf16): ``TrainConfig(nonfinite=...)`` decides.
``"skip"`` (the default) skips the step the way GradScaler does, on the device and without a host
sync (a non-fused optimizer: as ``TrainConfig(nonfused_skip=...)`` chooses); ``"raise"`` stops
with ``NonFiniteError`` naming the step, without a per-step sync; ``"ignore"`` trains on. See
``TrainConfig`` and docs/reliability.md. Each of these, and GradScaler, is a small policy object
(``_policies``) with one interface, so the step itself is nanoGPT's: forward, backward, the
policy's unscale and check, clip, step, update.

Hooks (``Hooks``) see the step at four points; a hook cancels a step with
``trainer.cancel_step(reason)``.

A step that raises (a bad micro-batch, Stop pressed) is undone: the trainer is as it was before it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.train.checks import (batch_rows, check_owns_parameters, check_scheduler, class_ids,
                      length_text, loss_reduction, moved, plain_module)
from amp_lessons.train.config import (EVAL_PRECISIONS, NONFINITE_POLICIES, NONFUSED_SKIPS,  # noqa: F401
                      TrainConfig)  # (re-exported: the trainer's public API)
from amp_lessons.train.scaler import ScalerSettings
from amp_lessons.train.policies import SKIPPED_RAISE, make_policy
from amp_lessons.train.skipsafe import BufferGuard, fused_sgd_needs_priming, prime_momentum_buffers
from amp_lessons.validate import check_bool, check_int, is_int
from amp_lessons.train.checkpoint import (CHECKSUM_KEY, CheckpointError, atomic_save, check_training_state,
                         read_verified, rng_state, set_rng_state)
from amp_lessons.numerics.precision import (HALF_DTYPES, PRECISIONS, Device, as_device,  # noqa: F401 (PRECISIONS)
                        autocast_for, check_precision, normalize_precision, precision_settings)
from amp_lessons.train.graphed import GraphedStep as _GraphedStep
from amp_lessons.numerics.modes import restore_modes, saved_modes
from amp_lessons.train.lazy import (NormParts as _NormParts, PeakWindow as _PeakWindow, StepClock as _StepClock,
                    total_norm as _total_norm)
from amp_lessons.data import set_loader_epoch  # noqa: F401 (re-exported: lesson 02 imports it from here)
from amp_lessons.train.records import (SKIPPED_BY_SCALER, SKIPPED_NONFINITE, History, StepRecord, epoch_summary)

CHECKPOINT_FORMAT = "amp-lessons-trainer/2"
READABLE_FORMATS = ("amp-lessons-trainer/1", CHECKPOINT_FORMAT)


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``TrainConfig(nonfinite="raise")``; names the step."""


# --- hooks ---------------------------------------------------------------------------------------

class Hooks:
    """Observe (or meddle with) each step without copying the loop. Override any of these; the
    trainer calls them in this order every optimizer step."""

    def after_backward(self, trainer: "Trainer", micro_step: int) -> None:
        """After one micro-batch's backward: gradients are still SCALED (inject inf/NaN here)."""

    def after_unscale(self, trainer: "Trainer") -> None:
        """After ``unscale_``: the true gradients, before clipping (histograms go here)."""

    def before_step(self, trainer: "Trainer") -> None:
        """Just before the optimizer step: true gradients, clipped. Call
        ``trainer.cancel_step(reason)`` here (or in the two hooks above) to cancel the step."""

    def after_step(self, trainer: "Trainer", record: StepRecord) -> None:
        """After the optimizer step, scaler update and scheduler, with the step's record."""


def _overrides(hooks: Sequence[Hooks], name: str) -> list:
    base = getattr(Hooks, name)
    return [h for h in hooks if getattr(type(h), name, base) is not base]


# --- the trainer ---------------------------------------------------------------------------------

_NO_CONTEXT = contextlib.nullcontext()
# how far a step got, for undoing one that raised (Trainer._undo_failed_step)
_STARTED, _SNAPSHOT_TAKEN, _STEPPED, _IDLE = 0, 1, 2, 3  # _IDLE: between steps


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """Train ``model`` with ``optimizer`` under ``config`` (see the module docstring for the order).

    ``device``: where batches go (the model is moved there); None keeps the model's device.
    ``scheduler`` steps once per optimizer step that was not skipped. ``hooks``: Hooks instances.
    Attributes: model, optimizer, scheduler, scaler (a GradScaler, enabled only for fp16), config,
    history (a History), step (optimizer steps taken, skipped ones included), epoch (finished
    epochs). Under fp16 (and with ``nonfinite`` "skip" or "raise"), a fused SGD gets zero
    momentum buffers before its first step (see ``prime_momentum_buffers``; param groups added
    later are not primed). The optimizer must own every trainable parameter of the model
    (ValueError if not). ``wait()`` waits for queued steps (and reports a pending non-finite step
    under "raise"); hooks cancel a step with ``cancel_step(reason)``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: Optional[TrainConfig] = None, device: Device = None, scheduler=None,
                 loss_fn: Callable = F.cross_entropy, hooks: Sequence[Hooks] = ()):
        config = config if config is not None else TrainConfig()
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig; got {type(config).__name__}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; "
                             f"got {type(optimizer).__name__}")
        check_owns_parameters(model, optimizer)
        check_scheduler(scheduler, optimizer)
        self._reduction = loss_reduction(loss_fn)
        self.device = as_device(device) if device is not None else _model_device(model)
        config = replace(config, precision=check_precision(config.precision, self.device))
        if config.eval_precision != "same":
            check_precision(config.eval_precision, self.device)
        if device is not None:
            model.to(self.device)
        if config.channels_last:
            model.to(memory_format=torch.channels_last)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if config.precision == "fp16" and config.scaler.enabled:
            half = [p for p in self._params if p.dtype == torch.float16]
            if half:
                raise ValueError("model parameters must stay float32 under fp16 AMP (autocast "
                                 "casts per operation, GradScaler cannot unscale float16 "
                                 "gradients); got float16 parameters: was .half() called on "
                                 "the model?")
        self.model, self.optimizer, self.scheduler, self.loss_fn = model, optimizer, scheduler, loss_fn
        if isinstance(hooks, Hooks):
            raise ValueError("hooks must be a list of Hooks instances; got one Hooks instance: "
                             "pass hooks=[it]")
        try:
            self.hooks = list(hooks if hooks is not None else ())
        except TypeError:
            raise ValueError(f"hooks must be a list of Hooks instances; "
                             f"got {type(hooks).__name__}") from None
        for h in self.hooks:
            if not isinstance(h, Hooks):
                raise ValueError(f"hooks must be Hooks instances; got {type(h).__name__}")
        self._bn_guard = BufferGuard(model)
        self._config = config
        self._clock = _StepClock(self.device.type == "cuda")  # the step time (track_time)
        self.scaler = self._make_scaler(config.scaler)
        self._configure()
        self._prime_fused_sgd()
        self.history = History()
        self.step = 0
        self.epoch = 0
        self._batches_done = 0  # micro-batches consumed in the current epoch (for exact resume)
        self._fit_batches = 0  # micro-batches of the step fit is running (added when applied)
        self._open_iterator = None  # a one-shot iterator whose epoch a max_steps stop left open
        self._phase, self._cancelled = _IDLE, None
        self._window: Optional[_PeakWindow] = None  # the open peak-memory window (track_memory)
        if config.seed is not None:
            torch.manual_seed(config.seed)

    # -- configuration --------------------------------------------------------------------------

    @property
    def config(self) -> TrainConfig:
        """The (immutable) TrainConfig in use. Assign a new one, e.g.
        ``trainer.config = dataclasses.replace(trainer.config, clip_norm=1.0)``, to change
        settings between steps; the precision cannot change on a live Trainer."""
        return self._config

    @config.setter
    def config(self, config: TrainConfig) -> None:
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig; got {type(config).__name__}")
        if normalize_precision(config.precision) != self._config.precision:
            raise ValueError(f"precision cannot change on a live Trainer (it is "
                             f"{self._config.precision!r}); got {config.precision!r}: build a "
                             f"new Trainer")
        if config.eval_precision != "same":
            check_precision(config.eval_precision, self.device)
        # refused before anything changes: a damped fused SGD where steps can now be skipped
        fused_sgd_needs_priming(self.optimizer, config.nonfinite != "ignore" or (
            self._config.precision == "fp16" and config.scaler.enabled))
        if self._policy.name == "raise" and config.nonfinite != "raise":
            self._raise_if_nonfinite(wait=True)  # a pending bad step is reported first
        scaler_changed = config.scaler != self._config.scaler
        self._config = replace(config, precision=self._config.precision)
        if scaler_changed:
            self.set_scaler(config.scaler)
        self._configure()
        self._prime_fused_sgd()  # steps may be skipped from now on (nonfinite 'ignore' -> 'skip')

    def _configure(self) -> None:
        """Derive what each step does from the config, the scaler and the hooks (once, not per
        step): the precision policy (``_policies``), whether to unscale before the step, the
        BatchNorm guard."""
        cfg = self._config
        self._after_backward = _overrides(self.hooks, "after_backward")
        self._after_unscale = _overrides(self.hooks, "after_unscale")
        self._before_step = _overrides(self.hooks, "before_step")
        self._after_step = _overrides(self.hooks, "after_step")
        policy = make_policy(cfg.precision, cfg.nonfinite, self.scaler, self.optimizer,
                             self._params, self.device, cfg.nonfused_skip)
        old = getattr(self, "_policy", None)
        if old is not None:
            policy.adopt(old)
        self._policy = policy
        self._scaling = policy.scaling
        self._fused_skip = policy.fused
        has_bn = bool(self._bn_guard.modules)
        hooked = bool(self._after_backward or self._after_unscale or self._before_step)
        self._guard = self._bn_guard if has_bn and (
            (policy.can_skip and (policy.name != "scaler" or cfg.skip_safe_batchnorm))
            or (hooked and cfg.skip_safe_batchnorm)) else None
        # unscale_ explicitly only when something reads the gradients between backward and step;
        # otherwise scaler.step unscales (fused optimizers then do it inside their kernel)
        needed = policy.unscale_first(self._guard)
        self._unscale_first = bool(cfg.clip_norm is not None or cfg.clip_value is not None
                                   or cfg.track_grad_norm or self._after_unscale
                                   or self._before_step or needed)
        self._check_first = policy.checks_before_step(self._unscale_first)
        # without a scaler gradients are true gradients already: no unscale_ call a step
        self._unscale_first = self._unscale_first and policy.scaling
        self._norm_wanted = cfg.clip_norm is not None or cfg.track_grad_norm
        self._track_memory = self.device.type == "cuda" and cfg.track_memory
        if not self._track_memory and getattr(self, "_window", None) is not None:
            self._window.read()  # untracked steps to come are not the open window's
        self._timed = cfg.track_time
        self._clock.reset()  # a step after a config or scaler change is timed from its start
        self._half = HALF_DTYPES.get(cfg.precision)  # autocast dtype, None for fp32/tf32
        # nothing between backward and step needs the host (no guard, hooks there, clipping,
        # gradient norm or raise): one micro-batch then takes _lean_step (the same kernels and
        # record, fewer Python layers; after_step hooks, memory and time records allowed)
        self._lean = (self._half is not None and self._guard is None
                      and not self._unscale_first and not self._norm_wanted
                      and cfg.clip_value is None and not hooked and policy.name != "raise")
        # gradients have their parameter's device and dtype: one group for the norm's kernels?
        self._one_group = len({(p.device, p.dtype) for p in self._params}) == 1

    # -- pieces ---------------------------------------------------------------------------------

    def _prime_fused_sgd(self) -> None:
        """Where steps can be skipped (fp16 with GradScaler, ``nonfinite`` skip or raise), give
        fused SGD zero momentum buffers (``_skipsafe.fused_sgd_needs_priming``)."""
        if fused_sgd_needs_priming(self.optimizer, self._policy.can_skip):
            prime_momentum_buffers(self.optimizer)

    def _make_scaler(self, settings: ScalerSettings):
        if self._config.precision != "fp16":
            settings = replace(settings, enabled=False)
        return settings.make(self.device.type)

    def set_scaler(self, settings: ScalerSettings) -> None:
        """Change the scaler's knobs mid-run (lesson 03's widgets). Switching ``enabled`` builds a
        new GradScaler (its scale starts again at ``init_scale``)."""
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"settings must be a ScalerSettings; got {type(settings).__name__}")
        self._config = replace(self._config, scaler=settings)
        if self._config.precision == "fp16":
            if self.scaler.is_enabled() == settings.enabled:
                settings.apply_to(self.scaler)
            else:
                self.scaler = settings.make(self.device.type)
        self._configure()
        self._prime_fused_sgd()

    def _pair_on_device(self, batch, i: int = 0):
        """Micro-batch ``i``'s ``(x, y)`` on the trainer's device: tensors, or tuples, lists and
        dicts of them (a model that takes several inputs; ``model(x)`` gets the container)."""
        try:
            x, y = batch
        except (TypeError, ValueError):
            raise ValueError(f"micro_batches must hold (x, y) pairs; micro-batch {i} is a "
                             f"{type(batch).__name__}{length_text(batch)}") from None
        device = self.device  # (type() first: no Python call for a plain tensor, short steps)
        if type(x) is not torch.Tensor and not isinstance(x, torch.Tensor):
            x = moved(x, device, "x")
        elif x.device != device:  # a no-op .to() still costs a dispatcher call on a short step
            x = x.to(device, non_blocking=True)
        if type(y) is not torch.Tensor and not isinstance(y, torch.Tensor):
            y = moved(y, device, "y")
        elif y.device != device:
            y = y.to(device, non_blocking=True)
        if self._config.channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def cancel_step(self, reason: str = "cancelled by a hook") -> None:
        """Cancel the step in progress, from a hook's ``after_backward``, ``after_unscale`` or
        ``before_step`` (or a module or tensor hook, or the loss function): the optimizer does
        not step, the scaler keeps its scale, gradients are dropped and BatchNorm statistics put
        back (``skip_safe_batchnorm``); the step is recorded as skipped with ``skip_reason``
        "``reason``" and counts as a step. A host-side decision: nothing on the device."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"reason must be a non-empty string; got {reason!r}")
        if self._phase not in (_STARTED, _SNAPSHOT_TAKEN):
            raise ValueError("cancel_step works only during a step, before the optimizer steps "
                             "(from a hook, the forward or backward pass); it was called outside")
        self._cancelled = reason

    def wait(self) -> None:
        """Wait for every queued step; under ``nonfinite="raise"`` raise ``NonFiniteError`` for a
        non-finite step the host had not yet seen (``train_step`` never waits for one)."""
        _sync(self.device)
        self._raise_if_nonfinite(wait=True)

    def _raise_if_nonfinite(self, wait: bool = False) -> None:
        """Under ``nonfinite="raise"``: if a finished step was non-finite, put the counters back
        to that step (the device skipped it and every later step, so model, optimizer and
        BatchNorm are as they were before it) and raise NonFiniteError naming it."""
        bad = self._policy.first_bad(wait)
        if bad is None:
            return
        step, epoch, batches_done = bad
        self._clock.reset()
        del self.history[max(0, len(self.history) - (self.step - step)):]
        self.step, self.epoch, self._batches_done = step, epoch, batches_done
        raise NonFiniteError(f"step {step} (epoch {epoch}): non-finite loss or gradient under "
                             f"{self._config.precision} with nonfinite='raise'; the model is as "
                             f"it was before this step")

    # -- one optimizer step ---------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> StepRecord:
        """One optimizer step over ``micro_batches`` (a list of ``(x, y)``; their number is
        normally ``config.accumulate``: the loss of each is divided by that number).

        Never waits for the GPU itself, except to decide whether a scheduler may step after a
        step that could be skipped, and on the first step of a non-fused optimizer under
        ``nonfinite="skip"``/``"raise"`` (its state does not exist yet). With ``track_memory``
        on CUDA the first step after a peak was read resets the device's peak-memory counter,
        so ``peak_memory_bytes`` read right after the step is this step's own peak (unread,
        it is the peak of the window of steps since).

        Cost beyond a hand-written loop (benchmarks/NOTES.md measures it): with ``track_time``
        one clock call a step, its end mark (a CUDA event recorded, taken from a pool of events
        whose times have been read; a start mark too where the chain of step ends is broken:
        ``time_s`` is the step's period, see ``StepRecord``), no host sync; one
        detach per micro-batch (no kernel); for fp16 nothing for the scale a step used (a
        ``ScaleLog`` replays GradScaler's update when the record is read, with one copy of the
        scale and its growth tracker per 256 steps); with ``track_grad_norm`` one
        foreach norm over the gradients (its stack and final norm run when the record is read;
        under fp16 an explicit ``unscale_``, which ``scaler.step`` would do anyway); with ``nonfinite``
        skip/raise one check kernel, over the per-parameter norms when the norm is tracked (its
        flag comes from a block of zeros made once per 256 steps; fused optimizers then skip
        inside their kernel; others copy parameters and state aside); with skip-safe BatchNorm
        (models with BatchNorm only) about ten small kernels over one flat copy of the BN
        buffers; with ``track_memory`` no allocator call while a memory window is open (one
        reset per window, one read when it is read).
        ``TrainConfig(track_grad_norm=False, track_memory=False, track_time=False,
        nonfinite="ignore")`` leaves only the detach on a model without BatchNorm: no device
        call beyond the hand loop's.
        """
        try:
            n = len(micro_batches)
        except TypeError:
            raise ValueError(f"micro_batches must be a list of (x, y) pairs; got "
                             f"{type(micro_batches).__name__} (a generator? pass list(...))"
                             ) from None
        if n < 1:
            raise ValueError("micro_batches must hold at least one (x, y) batch; got none")
        first = micro_batches[0]  # (type() first: no Python call where it is a pair)
        if type(first) not in (tuple, list) and isinstance(first, torch.Tensor):
            raise ValueError("micro_batches must be a list of (x, y) pairs; got a sequence of "
                             "tensors (one pair?): pass [(x, y)]")
        policy = self._policy
        raising = policy.name == "raise"
        if raising:
            self._raise_if_nonfinite()
        if not self.model.training:
            self.model.train()
        window = self._memory_window() if self._track_memory else None
        timed, clock = self._timed, self._clock
        if timed and clock.last is None:  # the chain of step ends is broken: mark a start
            clock.begin()
        lr = self.optimizer.param_groups[0]["lr"]  # the step's, before a scheduler changes it
        if type(lr) is not float and isinstance(lr, torch.Tensor):  # changed in place later
            lr = lr.detach().clone()
        if self._lean and n == 1 and self.scheduler is None and type(micro_batches) in (list, tuple):
            return self._lean_step(first, lr, window)
        loss_sum, grad_norm, found_inf, scale, cause = self._kernels(micro_batches)
        failed = None
        if self.scheduler is not None and found_inf is not True and (
                found_inf is None or not bool(found_inf.item())):  # the one sync, only here
            try:
                self.scheduler.step()
            except Exception as exc:  # noqa: BLE001 - the optimizer stepped: record, then raise
                failed = exc
        elapsed = clock.end() if timed else None  # one clock call (a CUDA event) a step
        if self._cancelled is not None or failed is not None:  # timed from its own start
            clock.reset()
        if raising:  # a finished non-finite step (on a CPU: this one) raises before its record
            self._raise_if_nonfinite()
        record = self._record(loss_sum, grad_norm, found_inf, scale, cause, lr, elapsed, window)
        if failed is not None:  # e.g. OneCycleLR past its total_steps
            raise RuntimeError(f"scheduler.step() raised after step {record.step}'s optimizer "
                               f"step; that step is applied and recorded (trainer.step is now "
                               f"{self.step}): {type(failed).__name__}: {failed}") from failed
        return record

    def _lean_step(self, batch, lr, window) -> StepRecord:
        """The rest of ``train_step`` for one micro-batch where nothing between backward and step
        needs the host (``_configure``'s ``_lean``): ``_kernels_in``'s kernels and record in fewer
        Python layers, a short step's cost (benchmarks/NOTES.md, ninth session)."""
        policy, self._phase, self._cancelled = self._policy, _STARTED, None
        try:
            x, y = self._pair_on_device(batch, 0)
            with torch.autocast(self.device.type, dtype=self._half, cache_enabled=True):
                loss = self.loss_fn(self.model(x), y)
            policy.backward(loss)
            loss = loss.detach()
            found_inf = policy.check(loss, None) if self._check_first else None
            cancelled = self._cancelled  # cancel_step from a module or tensor hook, loss_fn
            if cancelled is None:
                found_inf = policy.step(found_inf)
                self._phase = _STEPPED
                policy.update()
                scale, cause = policy.scale, policy.cause
            else:  # as _kernels_in cancels a step
                scale, found_inf, cause = self._cancel_now(), True, cancelled
            self.optimizer.zero_grad(set_to_none=True)
        except BaseException:
            self._undo_failed_step()
            raise
        finally:
            self._phase = _IDLE
        elapsed = self._clock.end() if self._timed else None
        if cancelled is not None:  # the next step is timed from its own start
            self._clock.reset()
        return self._record(loss, None, found_inf, scale, cause, lr, elapsed, window)

    def _memory_window(self) -> _PeakWindow:
        """The open peak-memory window, or a new one (the device's peak counter reset) when the
        last one has been read: per window, not per step (see ``StepRecord``)."""
        window = self._window
        if window is None or window.value is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
            window = self._window = _PeakWindow(self.device)
        return window

    def _close_memory_window(self) -> None:
        """Read the open peak-memory window now (an epoch starts: its peak is its own)."""
        if self._window is not None:
            self._window.read()

    def _record(self, loss_sum, grad_norm, found_inf, scale, cause, lr, elapsed,
                window) -> StepRecord:
        if loss_sum.dtype != torch.float32:
            loss_sum = loss_sum.float()
        if grad_norm is not None and grad_norm.dtype != torch.float32:
            grad_norm = grad_norm.float()
        record = StepRecord.lazy(self.step, self.epoch, loss_sum, scale,
                                 found_inf if found_inf is not None else False, grad_norm, lr,
                                 elapsed, window, cause)
        self.step += 1
        self._batches_done += self._fit_batches  # fit's place in the epoch, before any hook runs
        self._fit_batches = 0
        self.history.append(record)
        for h in self._after_step:
            h.after_step(self, record)
        return record

    def _kernels(self, micro_batches, cache_enabled: bool = True, graphed: bool = False):
        """The step's device work: forward, backward, unscale, clip, step, update, zero_grad.
        Returns (loss, grad_norm, skipped flag, scale used, skip cause), tensors not read (the
        norm a ``_NormParts`` unless ``graphed``: a CUDA graph's launches cost nothing).
        A step that raises (a bad micro-batch, a hook, Ctrl-C) is undone: ``_undo_failed_step``."""
        self._phase, self._cancelled = _STARTED, None
        try:
            if self._half is not None:  # fp16/bf16 leave the TF32 switches alone
                return self._kernels_in(micro_batches, cache_enabled, graphed)
            with precision_settings(self._config.precision, self.device):
                return self._kernels_in(micro_batches, cache_enabled, graphed)
        except BaseException:
            self._undo_failed_step()
            raise
        finally:
            self._phase = _IDLE  # cancel_step means nothing between steps

    def _cancel_now(self):
        """A cancelled step's undo, before its gradients go (both paths): BatchNorm statistics
        back where a snapshot was taken, GradScaler's record forgotten; the scale it used."""
        scale = self._policy.scale_used()
        if self._phase == _SNAPSHOT_TAKEN:
            self._guard.restore()
        self._policy.forget()
        return scale

    def _undo_failed_step(self) -> None:
        """Leave the trainer as before a step that raised (docs/reliability.md): no gradients,
        BatchNorm statistics back from a snapshot, GradScaler's record of the step forgotten (no
        "unscale_() has already been called" next time); an update already made is kept."""
        if self._phase == _SNAPSHOT_TAKEN:
            self._guard.restore()
        self.optimizer.zero_grad(set_to_none=True)
        self._policy.forget()
        self._clock.reset()  # the next step is timed from its own start

    def _kernels_in(self, micro_batches, cache_enabled: bool, graphed: bool = False):
        """The step, as nanoGPT writes it: forward and backward per micro-batch, the policy's
        unscale and check, clip, step, update (``_policies`` holds what differs by precision)."""
        policy, guard, opt, half = self._policy, self._guard, self.optimizer, self._half
        n, model, device_type = len(micro_batches), self.model, self.device.type
        if guard is not None:
            guard.snapshot()
            self._phase = _SNAPSHOT_TAKEN
        loss_sum = None
        for i, batch in enumerate(micro_batches):
            x, y = self._pair_on_device(batch, i)
            with (_NO_CONTEXT if half is None else
                  torch.autocast(device_type, dtype=half, cache_enabled=cache_enabled)):
                loss = self.loss_fn(model(x), y)
                if n > 1:
                    loss = loss / n
            policy.backward(loss)
            d = loss.detach()
            loss_sum = d if loss_sum is None else loss_sum + d
            for h in self._after_backward:
                h.after_backward(self, i)
        if self._unscale_first:  # true gradients from here on
            policy.unscale_()
        for h in self._after_unscale:
            h.after_unscale(self)
        grad_norm = None
        if self._config.clip_norm is not None:  # returns the norm before clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self._config.clip_norm)
        elif self._norm_wanted:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads and self._one_group and not graphed:  # reduced when read (_NormParts)
                grad_norm = _NormParts(torch._foreach_norm(grads))
            else:
                grad_norm = _total_norm(grads, self._one_group) if grads else None
        # the policy's check, before clipping by value could hide an inf
        found_inf = policy.check(loss_sum, grad_norm) if self._check_first else None
        if policy.name == "raise":  # the host reads it once the device is there, never waiting
            policy.watch(found_inf, self.step, self.epoch, self._batches_done)
        if self._config.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, self._config.clip_value)
        for h in self._before_step:
            h.before_step(self)
        if self._cancelled is not None:
            scale = self._cancel_now()
            opt.zero_grad(set_to_none=True)
            return loss_sum, grad_norm, True, scale, self._cancelled
        restored = guard is not None and found_inf is not None
        if restored:  # queued before the step, whose host sync (if any) would idle the GPU
            guard.restore_if(found_inf)
        found_inf = policy.step(found_inf)
        self._phase = _STEPPED
        if guard is not None and not restored and found_inf is not None:
            guard.restore_if(found_inf)
        policy.update()
        opt.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, found_inf, policy.scale, policy.cause

    def capture(self, x: torch.Tensor, y: torch.Tensor, warmup: int = 3) -> Callable:
        """Opt-in: capture the whole step in one CUDA graph; returns ``step(x, y) -> StepRecord``.

        For static shapes on CUDA: the graph reads ``x, y`` themselves (copies of them if they
        are not on the device); each call copies its ``x, y`` into those (nothing when they are
        those tensors, as in PyTorch's CUDA-graph recipe) and replays every kernel of the step
        with one launch, plus one copy of the record's numbers,
        so the host's Python and launch costs vanish (benchmarks/NOTES.md: it beats the hand loop
        on small steps). Records, history and the step counter are kept as by ``train_step``.
        ``warmup`` ordinary steps on ``(x, y)`` run first (on a side stream, as PyTorch's
        CUDA-graph recipe does), so lazily made state exists; they train and are recorded.

        ValueError unless: the device is CUDA; ``accumulate == 1``; no hooks and no scheduler
        (both need the host between kernels); under fp16 the optimizer is fused (GradScaler
        steps other optimizers from the host); ``nonfinite`` is not "raise". The learning rate,
        clip settings and scaler knobs are frozen into the graph: capture again after changing
        them.
        """
        cfg = self._config
        problems = []
        if self.device.type != "cuda":
            problems.append(f"a CUDA device (this trainer runs on {self.device.type})")
        if cfg.accumulate != 1:
            problems.append(f"accumulate == 1 (got {cfg.accumulate})")
        if self.hooks or self.scheduler is not None:
            problems.append("no hooks and no scheduler")
        if self._scaling and not self._fused_skip:
            problems.append("a fused optimizer under fp16 (e.g. SGD(..., fused=True))")
        if self._policy.name == "raise":
            problems.append("nonfinite 'skip' or 'ignore', not 'raise'")
        if self._policy.can_skip and not self._policy.fused and \
                getattr(self._policy, "non_fused", None) == "sync":
            problems.append("nonfused_skip 'copy' for a non-fused optimizer (a graph cannot "
                            "wait for the host's decision; or a fused optimizer)")
        if problems:
            raise ValueError(f"capture needs {'; '.join(problems)}")
        check_int("warmup", warmup, 1)
        # the graph reads its inputs where they are: x, y themselves when already on the device
        # (as PyTorch's CUDA-graph recipe does), so passing them again copies nothing
        static_x, static_y = x.to(self.device), y.to(self.device)
        # the graph must zero its own inf/NaN flag at every replay: no pre-zeroed flags here
        # (nor in the warm-up, on another stream)
        self._policy.capturing(True)
        self._clock.reset()  # the warm-up steps run on a side stream: timed from their start
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.train_step([(static_x, static_y)])
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.optimizer.zero_grad(set_to_none=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = self._kernels([(static_x, static_y)], cache_enabled=False, graphed=True)
                # the record's numbers in one small tensor, so a replay costs one copy of them
                loss, grad_norm, found_inf, scale, _ = outs
                fields = [t for t in (loss, grad_norm, found_inf, scale)
                          if isinstance(t, torch.Tensor)]
                packed = torch.stack([t.reshape(()).float() for t in fields])
        finally:
            self._policy.capturing(False)
            self._clock.reset()  # the first replay (or step) is timed from its own start
        if not self.model.training:
            self.model.train()
        return _GraphedStep(self, graph, static_x, static_y, outs, packed)
    # -- epochs ---------------------------------------------------------------------------------

    def fit(self, loader, epochs: int = 1, max_steps: Optional[int] = None,
            eval_loader=None) -> History:
        """Train for ``epochs`` more epochs (a resumed, half-done epoch counts as one), grouping
        ``config.accumulate`` batches per optimizer step; stop early after ``max_steps`` steps of
        this call. Calls ``loader.set_epoch(epoch)`` (or its sampler's) where it exists and skips
        the batches a resumed epoch already used. An epoch's last, shorter group is one step with
        its loss divided by its own size. With ``eval_loader``, each finished epoch is evaluated.
        Returns ``self.history``; ``history.epochs`` gets one summary per finished epoch
        (``records.epoch_summary``: marked ``partial`` when it covers only a resumed part).

        Every batch taken from ``loader`` is trained: the step budget is checked before the next
        batch is drawn. ``loader`` is iterated once per epoch (a list, ``TensorBatches``, a
        DataLoader). A one-shot iterator (a generator) holds one epoch: ``epochs > 1`` without
        ``max_steps`` is refused before training, and after a ``max_steps`` stop, ``fit`` on the
        same iterator continues where it stopped. An epoch that gets no batch at all (an empty
        loader, an exhausted generator) raises ValueError, as ``evaluate`` does, and is not
        counted.
        """
        epochs = check_int("epochs", epochs, 1)
        if not hasattr(loader, "__iter__"):
            raise ValueError(f"loader must be iterable (a list of (x, y) batches, TensorBatches, "
                             f"a DataLoader, a generator); got {type(loader).__name__}")
        if max_steps is not None and (not is_int(max_steps) or max_steps < 1):
            raise ValueError(f"max_steps must be None or a whole number >= 1; got {max_steps!r}")
        one_shot = isinstance(loader, Iterator)
        if one_shot and epochs > 1 and max_steps is None:
            raise ValueError(f"epochs must be 1 for a one-shot iterator (a generator yields its "
                             f"batches once); got epochs={epochs}: pass a re-iterable loader (a "
                             f"list, TensorBatches, a DataLoader) to train more epochs")
        from amp_lessons.progress import progress_bar as tqdm  # plain text in a saved notebook

        acc, taken = self._config.accumulate, 0
        self._close_memory_window()  # an epoch's peak is its own steps'
        for _ in range(epochs):
            set_loader_epoch(loader, self.epoch)
            skip = self._batches_done
            # a one-shot iterator that a max_steps stop left open goes on where it stopped: the
            # batches it already gave were trained, and drawing them again would drop new ones
            to_skip = 0 if one_shot and loader is self._open_iterator else skip
            self._open_iterator = None
            try:
                remaining = max(0, len(loader) - skip)
                total = -(-remaining // acc)
            except TypeError:
                total = None
            _sync(self.device)
            self._clock.reset()  # an epoch's first step is timed from its own start
            t0, first = time.perf_counter(), len(self.history)
            bar = tqdm(total=total, desc=f"epoch {self.epoch + 1}", leave=False,
                       disable=not self._config.progress)
            every = max(1, (total or 50) // 10)
            group, stopped, drawn = [], False, 0
            try:
                # batches a resumed epoch already used are drawn again (a loader may not support
                # seeking), with the random generators put back afterwards, since drawing them
                # (and a DataLoader's iter(), which draws its base seed) used random numbers the
                # checkpoint's RNG state already counted
                generators = rng_state() if to_skip else None
                iterator = iter(loader)
                if to_skip:
                    for _ in range(to_skip):
                        if next(iterator, None) is None:
                            break
                        drawn += 1
                    set_rng_state(generators)
                for batch in iterator:
                    drawn += 1
                    group.append(batch)
                    if len(group) < acc:
                        continue
                    self._run(group, bar, every)
                    group, taken = [], taken + 1
                    if max_steps is not None and taken >= max_steps:
                        stopped = total is None or self._batches_done < len(loader)
                        break
                if group and not stopped:
                    self._run(group, bar, every)
                    taken += 1
            finally:
                bar.close()
                if one_shot:  # a stop or an error: the iterator goes on from where it is
                    self._open_iterator = loader
            if stopped:
                return self.history
            if drawn == 0 and to_skip == skip:
                raise ValueError(f"loader must yield at least one batch per epoch; epoch "
                                 f"{self.epoch + 1} got none (an empty loader, or an iterator "
                                 f"or generator already used up); nothing was trained")
            self._open_iterator = None  # a whole epoch: nothing of it is left to skip
            self._end_epoch(first, t0, eval_loader, skip)
            if max_steps is not None and taken >= max_steps:
                break
        return self.history

    def _run(self, group, bar, every) -> None:
        self._fit_batches = len(group)  # counted in the epoch once the step is applied (_record)
        try:
            record = self.train_step(group)
        finally:
            self._fit_batches = 0
        bar.update(1)
        if not bar.disable and bar.n % every == 0:
            bar.set_postfix(loss=f"{record.loss:.4f}", scale=f"{record.scale:g}")

    def _end_epoch(self, first: int, t0: float, eval_loader, resumed_at: int) -> None:
        self.wait()
        seconds = time.perf_counter() - t0
        self.history.materialize()
        summary = epoch_summary(self.epoch, self.history[first:], seconds,
                                resumed_at_batch=resumed_at)
        if eval_loader is not None:
            result = self.evaluate(eval_loader)
            summary["test_loss"], summary["test_accuracy"] = result["loss"], result["accuracy"]
        self.history.epochs.append(summary)
        self.epoch += 1
        self._batches_done = 0

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, loader, precision: Optional[str] = None) -> dict:
        """Mean loss and accuracy (a fraction in [0, 1]) over ``loader``, without gradients.
        The loss is per example (``loss_fn``'s batch mean weighted by the batch's rows, or its
        sum where ``loss_fn.reduction == "sum"``); accuracy is None unless the model gives class
        scores (``[N, C, ...]``) for integer targets (``[N, ...]``): a regression, a dict output.

        ``precision``: None uses ``config.eval_precision``; "same" is training's autocast; a
        precision name (e.g. "fp32") runs under that one instead. The model's train/eval mode is
        restored afterwards. An open peak-memory window is read first (``track_memory``): the
        evaluation's memory does not count in the peak of the training steps before it.
        """
        name = self.config.eval_precision if precision is None else precision
        if not isinstance(name, str):
            raise ValueError(f"precision must be None or one of {', '.join(EVAL_PRECISIONS)}; "
                             f"got {name!r}")
        name = self.config.precision if name.strip().lower() == "same" else check_precision(
            name, self.device)
        self._close_memory_window()  # steps trained before keep their own peak
        self._clock.reset()  # the next step is timed from its own start, not from before this
        modes = saved_modes(self.model)  # each module's own mode comes back (a frozen BN too)
        self.model.eval()
        total_loss = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        count, classified, summed = 0, True, self._reduction == "sum"
        try:
            with torch.no_grad(), precision_settings(name, self.device), \
                    autocast_for(name, self.device.type):
                for batch in loader:
                    try:
                        x, y = batch
                    except (TypeError, ValueError):
                        raise ValueError(f"loader must yield (x, y) pairs; got a "
                                         f"{type(batch).__name__}{length_text(batch)}") from None
                    x, y = self._pair_on_device((x, y))
                    out = self.model(x)
                    rows = batch_rows(y)
                    loss = self.loss_fn(out, y).float()
                    total_loss += loss if summed else loss * rows
                    classified = classified and class_ids(out, y)
                    if classified:
                        correct += (out.argmax(dim=1) == y).sum()
                    count += rows
        finally:
            restore_modes(modes)
        if count == 0:
            raise ValueError("loader must yield at least one batch; got none")
        return {"loss": total_loss.item() / count,
                "accuracy": correct.item() / count if classified else None,
                "examples": count, "precision": name}

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything a resumed run needs, as tensors and plain containers only. Under
        ``nonfinite="raise"`` a non-finite step not yet reported raises here (a checkpoint never
        holds the skipped steps after one)."""
        self._raise_if_nonfinite(wait=True)
        self._clock.reset()  # the next step is timed from its own start, not across the save
        return {
            "format": CHECKPOINT_FORMAT,
            CHECKSUM_KEY: True,
            "model": plain_module(self.model).state_dict(),  # torch.compile's keys too
            "optimizer": self.optimizer.state_dict(),
            "optimizer_class": type(self.optimizer).__name__,
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step": self.step, "epoch": self.epoch, "batches_done": self._batches_done,
            "config": self._config.as_dict(),
            "history": {"steps": self.history.columns(),
                        "epochs": [dict(e) for e in self.history.epochs]},
            "rng": rng_state(),
        }

    def save_checkpoint(self, path: Union[str, Path]) -> Path:
        """Write a training checkpoint atomically (temporary file + rename; see
        ``checkpoint.atomic_save``): a failed or killed save leaves the previous checkpoint
        intact, temporary files of killed saves are removed by the next save or load, a full
        disk raises ``DiskFullError`` and a file-size limit ``FileTooLargeError`` (both name the
        file)."""
        return atomic_save(self.state_dict(), path)

    def load_checkpoint(self, path: Union[str, Path], load_scaler: bool = True) -> dict:
        """Load a checkpoint written by ``save_checkpoint`` and continue exactly where it stopped
        (model, optimizer, scaler, scheduler, counters, history, RNG). ``load_scaler=False``
        keeps this trainer's scaler. Returns the loaded dict. The optimizer's settings (lr,
        momentum, ...) come from the checkpoint, as ``optimizer.load_state_dict`` does.

        All or nothing: every byte is verified (checksum), the file is read with
        ``weights_only=True``, and every part is checked against this trainer (model keys,
        shapes and dtypes; optimizer kind, groups and state shapes; scaler; scheduler; counters;
        history; RNG) before anything live changes. Any problem raises ``CheckpointError`` (a
        ValueError) naming the file and what is wrong, and leaves the trainer untouched: a
        missing file is also a ``FileNotFoundError``, a folder an ``IsADirectoryError``, and a
        checkpoint of a newer format (``CheckpointFromNewerRelease``) says which formats this
        release reads.
        """
        check_bool("load_scaler", load_scaler)
        path = Path(path)
        state = read_verified(path)
        try:
            check_training_state(state, plain_module(self.model), self.optimizer,
                                 self.scaler if load_scaler else None, self.scheduler,
                                 formats=READABLE_FORMATS)
        except CheckpointError as exc:
            raise type(exc)(f"{path}: {exc}") from None
        plain_module(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._prime_fused_sgd()  # a checkpoint saved before the first step holds no buffers
        if load_scaler and state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self._batches_done = int(state["batches_done"])
        self._open_iterator = None
        self.history = History.from_columns(state["history"]["steps"], state["history"]["epochs"])
        self._policy.reset()  # flags of steps before the load mean nothing now
        self._close_memory_window()  # records kept from before the load keep their own peak
        self._clock.reset()  # the next step is timed from its own start
        set_rng_state(state["rng"])
        return state

