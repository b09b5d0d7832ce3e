"""The course's shared training loop (lesson 02 introduces it; lessons 03-05 train through it).

``Trainer._step`` is one step, for every precision, in the order of PyTorch's AMP examples page:
autocast forward, ``scaler.scale(loss).backward()`` per micro-batch, ``unscale_`` where something
reads the true gradients, clipping, ``scaler.step``, ``scaler.update()``, ``zero_grad``; the
scheduler steps only when the optimizer really stepped (docs/trainer_vs_nanogpt.md sets it beside
nanoGPT's loop). ``Precision`` gives the autocast context and a ``GradScaler(enabled=...)``, so
precision is no branch in the step; ``NonFinite`` says what a step with inf/NaN does. Around the
step: skip-safe BatchNorm, hooks that may cancel a step, a record per step, epochs, evaluation and
checkpoints that resume exactly::

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      TrainConfig(precision="fp16", clip_norm=1.0))
    trainer.fit(train_loader, epochs=3, eval_loader=test_loader)
    trainer.history.columns()["scale"]
"""
from __future__ import annotations

import enum
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons._compat import forget_step
from amp_lessons.data import set_loader_epoch  # noqa: F401 (lesson 02 imports it from here)
from amp_lessons.numerics.modes import restore_modes, saved_modes
from amp_lessons.numerics.precision import (PRECISIONS, Device, as_device,  # noqa: F401
                                            autocast_for, check_precision, normalize_precision,
                                            precision_settings)
from amp_lessons.train.checkpoint import (CHECKSUM_KEY, atomic_save, check_training_state,
                                          read_verified, rng_state, set_rng_state, CheckpointError)
from amp_lessons.train.checks import (batch_rows, check_owns_parameters, check_scheduler,
                                      class_ids, length_text, loss_reduction, moved, plain_module)
from amp_lessons.train.config import (EVAL_PRECISIONS, NONFINITE_POLICIES,  # noqa: F401
                                      ScalerSettings, TrainConfig)
from amp_lessons.train.policies import NonFinite, Precision
from amp_lessons.train.records import History, StepRecord, epoch_summary
from amp_lessons.train.skipsafe import (BufferGuard, fused_sgd_needs_priming,
                                        prime_momentum_buffers)
from amp_lessons.validate import check_bool, check_int, is_int

CHECKPOINT_FORMAT = "amp-lessons-trainer/2"
READABLE_FORMATS = ("amp-lessons-trainer/1", CHECKPOINT_FORMAT)


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``TrainConfig(nonfinite="raise")``; names the step."""


class Phase(enum.Enum):
    """How far the step in progress got: ``cancel_step`` works while it is ``BACKWARD``, and a
    step that raises is undone according to it."""

    IDLE = "between steps"
    BACKWARD = "forward, backward, unscale, clip (BatchNorm statistics saved)"
    STEPPED = "the optimizer stepped"


class Hooks:
    """Observe (or meddle with) each step without copying the loop: subclass, override any of
    these, pass ``Trainer(..., hooks=[MyHooks()])``. They run in this order every step."""

    def after_backward(self, trainer: "Trainer", micro_step: int) -> None:
        """After one micro-batch's backward: gradients are still SCALED (inject inf/NaN here)."""

    def after_unscale(self, trainer: "Trainer") -> None:
        """After ``unscale_``: the true gradients, before clipping (histograms go here)."""

    def before_step(self, trainer: "Trainer") -> None:
        """Just before the optimizer step: true gradients, clipped. ``trainer.cancel_step(reason)``
        here (or in the two hooks above) cancels the step."""

    def after_step(self, trainer: "Trainer", record: StepRecord) -> None:
        """After the optimizer step, scaler update and scheduler, with the step's record."""


def _overrides(hook: Hooks, name: str) -> bool:
    return getattr(type(hook), name) is not getattr(Hooks, name)


def _model_device(model: nn.Module) -> torch.device:
    return next((t.device for t in list(model.parameters()) + list(model.buffers())),
                torch.device("cpu"))


def _grad_norm(params) -> Optional[torch.Tensor]:
    """The total 2-norm of the gradients, as ``clip_grad_norm_`` computes it (no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class Trainer:
    """Train ``model`` with ``optimizer`` under ``config`` (a ``TrainConfig``).

    ``device``: where batches go (the model is moved there; None keeps the model's device).
    ``scheduler`` steps once per optimizer step that was not skipped; ``loss_fn(output, target)``
    returns one number per batch; ``hooks``: ``Hooks`` instances. Attributes: model, optimizer,
    scheduler, scaler (a GradScaler, enabled for fp16 only), precision, nonfinite, config,
    history, step (steps taken, skipped ones included), epoch (finished epochs).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: Optional[TrainConfig] = None, device: Device = None, scheduler=None,
                 loss_fn: Callable = F.cross_entropy, hooks: Sequence[Hooks] = ()):
        config = config if config is not None else TrainConfig()
        for name, value, kind, text in (
                ("config", config, TrainConfig, "TrainConfig"),
                ("model", model, nn.Module, "torch.nn.Module"),
                ("optimizer", optimizer, torch.optim.Optimizer, "torch.optim.Optimizer")):
            if not isinstance(value, kind):
                raise ValueError(f"{name} must be a {text}; got {type(value).__name__}")
        check_owns_parameters(model, optimizer)
        check_scheduler(scheduler, optimizer)
        self._reduction = loss_reduction(loss_fn)
        try:
            hook_list = None if isinstance(hooks, Hooks) else list(hooks or ())
        except TypeError:
            hook_list = None
        if hook_list is None or not all(isinstance(h, Hooks) for h in hook_list):
            got = "one Hooks instance: pass hooks=[it]" if isinstance(hooks, Hooks) else repr(hooks)
            raise ValueError(f"hooks must be a list of Hooks instances; got {got}")
        self.device = as_device(device) if device is not None else _model_device(model)
        config = replace(config, precision=check_precision(config.precision, self.device))
        if config.eval_precision != "same":
            check_precision(config.eval_precision, self.device)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if config.precision == "fp16" and config.scaler.enabled and any(
                p.dtype == torch.float16 for p in self._params):
            raise ValueError("model parameters must stay float32 under fp16 AMP (autocast "
                             "casts per operation, GradScaler cannot unscale float16 "
                             "gradients); got float16 parameters: was .half() called on "
                             "the model?")
        if device is not None:  # None: the model stays where it is
            model.to(self.device)
        if config.channels_last:
            model.to(memory_format=torch.channels_last)
        self.model, self.optimizer, self.scheduler, self.loss_fn = model, optimizer, scheduler, loss_fn
        self.hooks = hook_list
        self.precision = Precision(config.precision, self.device, config.scaler)
        self.scaler = self.precision.scaler
        self._bn = BufferGuard(model)
        self._config = config
        self._configure()
        self.history, self.step, self.epoch = History(), 0, 0
        # micro-batches of the epoch trained (resume) and of the step fit runs; a one-shot
        # iterator a max_steps stop left mid-epoch
        self._batches_done, self._fit_batches, self._open_iterator = 0, 0, None
        self._phase, self._cancelled = Phase.IDLE, None
        if config.seed is not None:
            torch.manual_seed(config.seed)

    # -- configuration --------------------------------------------------------------------------

    @property
    def config(self) -> TrainConfig:
        """The TrainConfig in use. Assign a new one between steps to change settings:
        ``trainer.config = dataclasses.replace(trainer.config, clip_norm=1.0)``; the precision
        cannot change on a live Trainer."""
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
        # refused before anything changes: a damped fused SGD where steps could now be skipped
        fused_sgd_needs_priming(self.optimizer, config.nonfinite == "skip" or (
            self._config.precision == "fp16" and config.scaler.enabled))
        old, self._config = self._config, replace(config, precision=self._config.precision)
        if config.scaler != old.scaler:
            self.set_scaler(config.scaler)
        self._configure()

    def set_scaler(self, settings: ScalerSettings) -> None:
        """Change the scaler's knobs between steps (lesson 03's widgets). Switching ``enabled``
        builds a new GradScaler, whose scale starts again at ``init_scale``."""
        if not isinstance(settings, ScalerSettings):
            raise ValueError(f"settings must be a ScalerSettings; got {type(settings).__name__}")
        self._config = replace(self._config, scaler=settings)
        if self.precision.name == "fp16":
            if self.scaler.is_enabled() == settings.enabled:
                settings.apply_to(self.scaler)
            else:
                self.scaler = self.precision.scaler = self.precision.make_scaler(settings)
        self._configure()

    def _configure(self) -> None:
        """What each step does, derived once from the config, the scaler and the hooks."""
        cfg = self._config
        self.nonfinite = NonFinite(cfg.nonfinite, self.scaler, self.optimizer, self._params,
                                   self.device)
        reads_grads = any(_overrides(h, "after_unscale") or _overrides(h, "before_step")
                          for h in self.hooks)
        # unscale_ explicitly only where something reads the true gradients before the step;
        # otherwise scaler.step unscales (a fused optimizer inside its kernel), as the recipe does
        self._unscale = self.scaler.is_enabled() and (
            cfg.clip_norm is not None or cfg.clip_value is not None or cfg.track_grad_norm
            or reads_grads)
        guarded = bool(self._bn.modules) and cfg.skip_safe_batchnorm and (
            self.nonfinite.mode != "ignore" or bool(self.hooks))
        self._guard = self._bn if guarded else None
        if fused_sgd_needs_priming(self.optimizer, self.nonfinite.can_skip):
            prime_momentum_buffers(self.optimizer)

    # -- one optimizer step ---------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> StepRecord:
        """One optimizer step over ``micro_batches``, a list of ``(x, y)`` pairs (normally
        ``config.accumulate`` of them: each loss is divided by their number); returns its record.

        Waits for the GPU only where PyTorch's recipe does (``GradScaler.step`` with a non-fused
        optimizer), where a non-fused optimizer skips a non-finite step, under "raise", and to
        tell a scheduler whether a skippable step was skipped. A step that raises is undone.
        """
        batches = self._pairs(micro_batches)
        lr = self.optimizer.param_groups[0]["lr"]  # the step's, before a scheduler changes it
        if isinstance(lr, torch.Tensor):  # a tensor learning rate may change in place later
            lr = lr.detach().clone()
        if not self.model.training:  # (a submodule frozen with .eval() stays frozen)
            self.model.train()
        try:
            with self.precision.settings():
                loss, grad_norm, found_inf, scale, cause = self._step(batches)
        except BaseException:
            self._undo_failed_step()
            raise
        finally:
            self._phase = Phase.IDLE
        failed = None
        if self.scheduler is not None and found_inf is not True and (
                found_inf is None or not bool(found_inf)):  # the step really stepped
            try:
                self.scheduler.step()
            except Exception as exc:  # noqa: BLE001 - the step is applied: record, then raise
                failed = exc
        record = StepRecord(self.step, self.epoch, loss, scale,
                            False if found_inf is None else found_inf, grad_norm, lr, cause)
        self.step += 1
        self._batches_done += self._fit_batches  # fit's place in the epoch, before any hook
        self._fit_batches = 0
        self.history.append(record)
        for h in self.hooks:
            h.after_step(self, record)
        if failed is not None:  # e.g. OneCycleLR past its total_steps
            raise RuntimeError(f"scheduler.step() raised after step {record.step}'s optimizer "
                               f"step; that step is applied and recorded (trainer.step is now "
                               f"{self.step}): {type(failed).__name__}: {failed}") from failed
        return record

    def _step(self, batches):
        """The step's work, in the recipe's order; returns (loss, grad norm, skipped flag, scale
        used, skip cause), device tensors not read."""
        model, opt, scaler, n = self.model, self.optimizer, self.scaler, len(batches)
        if self._guard is not None:
            self._guard.snapshot()  # BatchNorm statistics, put back if the step is skipped
        self._phase, self._cancelled = Phase.BACKWARD, None
        loss_sum = None
        for i, (x, y) in enumerate(batches):
            with self.precision.autocast():
                loss = self.loss_fn(model(x), y)
                if n > 1:
                    loss = loss / n
            scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            for h in self.hooks:
                h.after_backward(self, i)
        scale = self.precision.scale_used()
        if self._unscale:
            scaler.unscale_(opt)  # true gradients from here on
        for h in self.hooks:
            h.after_unscale(self)
        cfg, grad_norm = self._config, None
        if cfg.clip_norm is not None:  # returns the norm before clipping
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, cfg.clip_norm)
        elif cfg.track_grad_norm:
            grad_norm = _grad_norm(self._params)
        found_inf = self.nonfinite.check(loss_sum)  # before clipping by value could hide an inf
        if cfg.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, cfg.clip_value)
        for h in self.hooks:
            h.before_step(self)
        if self._cancelled is not None:  # cancel_step: nothing moves
            self._undo_failed_step()
            return loss_sum, grad_norm, True, scale, self._cancelled
        if self.nonfinite.mode == "raise" and bool(found_inf):
            raise NonFiniteError(f"step {self.step} (epoch {self.epoch}): non-finite loss or "
                                 f"gradient under {cfg.precision} with nonfinite='raise'; the "
                                 f"model is as it was before this step")
        found_inf = self.nonfinite.step(found_inf)
        self._phase = Phase.STEPPED
        if self._guard is not None and found_inf is not None:
            self._guard.restore_if(found_inf)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, found_inf, scale, self.nonfinite.cause

    def cancel_step(self, reason: str = "cancelled by a hook") -> None:
        """Cancel the step in progress, from a hook's ``after_backward``, ``after_unscale`` or
        ``before_step`` (or a module or tensor hook, or the loss function): the optimizer does
        not step, the scaler keeps its scale, gradients are dropped and BatchNorm statistics put
        back (``skip_safe_batchnorm``); the step is recorded as skipped with ``reason``."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"reason must be a non-empty string; got {reason!r}")
        if self._phase is not Phase.BACKWARD:
            raise ValueError("cancel_step works only during a step, before the optimizer steps "
                             "(from a hook, the forward or backward pass); it was called outside")
        self._cancelled = reason

    def _undo_failed_step(self) -> None:
        """Leave the trainer as before a step that raised or was cancelled: no gradients,
        BatchNorm statistics back from the snapshot, GradScaler's record of the step forgotten
        (no "unscale_() has already been called" next time). An applied update is kept."""
        if self._phase is Phase.BACKWARD and self._guard is not None:
            self._guard.restore()
        self.optimizer.zero_grad(set_to_none=True)
        forget_step(self.scaler, self.optimizer)

    def _pairs(self, micro_batches) -> list:
        """``micro_batches`` as a list of ``(x, y)`` on the trainer's device (tensors, or tuples,
        lists and dicts of them: ``model(x)`` gets the container), channels_last where asked."""
        if isinstance(micro_batches, (torch.Tensor, dict)) or not hasattr(micro_batches, "__len__"):
            raise ValueError(f"micro_batches must be a list of (x, y) pairs; got "
                             f"{type(micro_batches).__name__} (a generator? pass list(...))")
        if len(micro_batches) < 1:
            raise ValueError("micro_batches must hold at least one (x, y) batch; got none")
        if isinstance(micro_batches[0], torch.Tensor):
            raise ValueError("micro_batches must be a list of (x, y) pairs; got a sequence of "
                             "tensors (one pair?): pass [(x, y)]")
        pairs = []
        for i, batch in enumerate(micro_batches):
            try:
                x, y = batch
            except (TypeError, ValueError):
                raise ValueError(f"micro_batches must hold (x, y) pairs; micro-batch {i} is a "
                                 f"{type(batch).__name__}{length_text(batch)}") from None
            x, y = moved(x, self.device, "x"), moved(y, self.device, "y")
            if self._config.channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            pairs.append((x, y))
        return pairs

    def wait(self) -> None:
        """Wait for every queued step on the device (before reading a wall clock, say)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- epochs ---------------------------------------------------------------------------------

    def fit(self, loader, epochs: int = 1, max_steps: Optional[int] = None,
            eval_loader=None) -> History:
        """Train ``epochs`` more epochs (a resumed, half-done epoch counts as one), grouping
        ``config.accumulate`` batches per step (an epoch's last, shorter group is one step, its
        loss divided by its own size); stop after ``max_steps`` steps of this call. Each finished
        epoch adds a summary to ``history.epochs`` (with test loss and accuracy from
        ``eval_loader``). Returns ``self.history``.

        ``loader``: a list, ``TensorBatches``, a DataLoader (its ``set_epoch`` is called; a
        resumed epoch skips the batches already trained) or a one-shot iterator, which holds one
        epoch and goes on where a ``max_steps`` stop left it. An epoch without any batch raises
        ValueError.
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
        from amp_lessons.progress import progress_bar  # plain text in a saved notebook
        acc, taken = self._config.accumulate, 0
        memory = self._config.track_memory and self.device.type == "cuda"
        for _ in range(epochs):
            set_loader_epoch(loader, self.epoch)
            skip = self._batches_done
            # a one-shot iterator left open by a max_steps stop goes on where it stopped
            to_skip = 0 if one_shot and loader is self._open_iterator else skip
            self._open_iterator = None
            try:
                total = -(-max(0, len(loader) - skip) // acc)
            except TypeError:
                total = None
            self.wait()
            if memory:
                torch.cuda.reset_peak_memory_stats(self.device)
            t0, first = time.perf_counter(), len(self.history)
            bar = progress_bar(total=total, desc=f"epoch {self.epoch + 1}", leave=False,
                               disable=not self._config.progress)
            group, stopped, drawn = [], False, 0
            try:
                # batches a resumed epoch already trained are drawn again (a loader may not
                # seek), then the random generators are put back: the checkpoint counted them
                generators = rng_state() if to_skip else None
                iterator = iter(loader)
                for _ in range(to_skip):
                    if next(iterator, None) is None:
                        break
                    drawn += 1
                if to_skip:
                    set_rng_state(generators)
                for batch in iterator:
                    drawn += 1
                    group.append(batch)
                    if len(group) == acc:
                        self._fit_step(group, bar)
                        group, taken = [], taken + 1
                        if max_steps is not None and taken >= max_steps:
                            stopped = total is None or self._batches_done < len(loader)
                            break
                if group and not stopped:
                    self._fit_step(group, bar)
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
            self._open_iterator = None
            self.wait()
            peak = torch.cuda.max_memory_allocated(self.device) if memory else None
            summary = epoch_summary(self.epoch, self.history[first:], time.perf_counter() - t0,
                                    peak, resumed_at_batch=skip)
            if eval_loader is not None:
                result = self.evaluate(eval_loader)
                summary["test_loss"], summary["test_accuracy"] = result["loss"], result["accuracy"]
            self.history.epochs.append(summary)
            self.epoch, self._batches_done = self.epoch + 1, 0
            if max_steps is not None and taken >= max_steps:
                break
        return self.history

    def _fit_step(self, group, bar) -> None:
        self._fit_batches = len(group)  # counted in the epoch once the step is applied
        try:
            self.train_step(group)
        finally:
            self._fit_batches = 0
        bar.update(1)

    # -- evaluation -----------------------------------------------------------------------------

    def evaluate(self, loader, precision: Optional[str] = None) -> dict:
        """Mean loss and accuracy (a fraction in [0, 1]) over ``loader``, without gradients.
        The loss is per example (``loss_fn``'s batch mean weighted by the batch's rows, or its
        sum where ``loss_fn.reduction == "sum"``); accuracy is None unless the model gives class
        scores (``[N, C, ...]``) for integer targets (``[N, ...]``).

        ``precision``: None uses ``config.eval_precision``; "same" is training's autocast; a
        precision name (e.g. "fp32") runs under that one instead. Each module's train/eval mode
        is restored afterwards.
        """
        name = self.config.eval_precision if precision is None else precision
        if not isinstance(name, str):
            raise ValueError(f"precision must be None or one of {', '.join(EVAL_PRECISIONS)}; "
                             f"got {name!r}")
        name = self.config.precision if name.strip().lower() == "same" else check_precision(
            name, self.device)
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
                    ((x, y),) = self._pairs([(x, y)])
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
        """Everything a resumed run needs, as tensors and plain containers only."""
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
        """Write a training checkpoint atomically (``checkpoint.atomic_save``): a failed or
        killed save leaves the previous checkpoint intact; a full disk raises
        ``DiskFullError`` and a file-size limit ``FileTooLargeError``, both naming the file."""
        return atomic_save(self.state_dict(), path)

    def load_checkpoint(self, path: Union[str, Path], load_scaler: bool = True) -> dict:
        """Load a checkpoint written by ``save_checkpoint`` and continue exactly where it stopped
        (model, optimizer, scaler, scheduler, counters, history, random generators);
        ``load_scaler=False`` keeps this trainer's scaler. All or nothing: the file's checksum and
        every part are checked against this trainer (``weights_only=True``) before anything
        changes; a problem raises ``CheckpointError`` (a ValueError) naming the file. Returns the
        loaded dict.
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
        self._configure()  # fused SGD primed again: a checkpoint before the first step has none
        if load_scaler and state["scaler"] and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self._batches_done, self._open_iterator = int(state["batches_done"]), None
        self.history = History.from_columns(state["history"]["steps"], state["history"]["epochs"])
        set_rng_state(state["rng"])
        return state
