"""The learner's own training step and checkpoint, checked for GradScaler misuse (lessons 02, 03,
05).

Checking these needs the learner's code, so both are optional:

- ``step_fn(model, optimizer, scaler, batch)`` (and a ``scheduler`` keyword where it takes one):
  one training step as the learner writes it, with ``batch`` = ``(inputs, target)``. The doctor
  runs it a few times on a copy of the model with a ``GradScaler`` started too high, so the first
  steps overflow and must be skipped, and watches the order of calls: a gradient changed in place
  (clipping) before ``unscale_``, a second ``step`` before ``update``, ``optimizer.step()`` called
  outside ``scaler.step``, a missing ``update``, a loss never passed to ``scaler.scale``, and a
  learning-rate scheduler stepped on a step the scaler skipped.
- ``checkpoint_fn(model, optimizer, scaler)``: save and load as the learner resumes, returning the
  ``GradScaler`` the resumed run would use (a new one, loaded from what was saved). The doctor
  moves the scaler away from its defaults first, then compares.

Without them, the report says "not checked" and what to pass.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amp_lessons.measure.dtype_trace import first_tensor
from amp_lessons.doctor.scale import failure_text
from amp_lessons.tables import plural

UNSCALE_OP = "_amp_foreach_non_finite_check_and_unscale_"
NOT_MODIFYING = ("zero_", "_foreach_zero_", "detach_", "requires_grad_", UNSCALE_OP)


class _Log:
    def __init__(self):
        self.events: List[str] = []
        self.in_scaler_step = False
        self.grads: set = set()
        self.fp16 = False  # whether any op in the step returned float16

    def add(self, what: str) -> None:
        self.events.append(what)


def _spy_scaler(device_type: str, init_scale: float, log: _Log) -> torch.amp.GradScaler:
    class SpyScaler(torch.amp.GradScaler):
        def scale(self, outputs):
            log.add("scale")
            return super().scale(outputs)

        def unscale_(self, optimizer):
            log.add("unscale_")
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            log.add("scaler.step")
            log.in_scaler_step = True
            try:
                return super().step(optimizer, *args, **kwargs)
            finally:
                log.in_scaler_step = False

        def update(self, new_scale=None):
            log.add("update")
            return super().update(new_scale)

    SpyScaler.__name__ = SpyScaler.__qualname__ = "GradScaler"
    return SpyScaler(device_type, init_scale=init_scale)


class _GradWrites(TorchDispatchMode):
    """Logs in-place writes into parameter gradients outside backward and outside the
    optimizer's step (clipping, scaling by hand)."""

    def __init__(self, log: _Log, params):
        super().__init__()
        self.log, self.params = log, params

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.log.fp16 and isinstance(out, torch.Tensor) and out.dtype == torch.float16:
            self.log.fp16 = True
        if name == UNSCALE_OP:
            self.log.add("unscale op")
        elif name.endswith("_") and name not in NOT_MODIFYING and not self.log.in_scaler_step \
                and torch._C._current_graph_task_id() == -1 and args:
            first = args[0]
            targets = first if isinstance(first, (list, tuple)) else [first]
            grads = {p.grad.data_ptr() for p in self.params if p.grad is not None}
            if any(isinstance(t, torch.Tensor) and t.data_ptr() in grads for t in targets):
                self.log.add(f"grad write {name}")
        return out


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check_step(step_fn: Optional[Callable], make_model: Callable, make_optimizer: Callable,
               inputs, target, device, start_exponent: Optional[int],
               steps: int = 4) -> Dict[str, object]:
    """Run ``step_fn`` ``steps`` times on a fresh model copy with a spying ``GradScaler`` started
    at ``2**(start_exponent + 2)`` (two halvings above where the largest gradient fits, so the
    first two steps overflow and are skipped; ``2**24`` without an exponent) and report, as
    ``{"status", "reason", "problems", "calls"}``, each misuse with what was seen. ``status`` is
    "not checked" without a ``step_fn``, "error" where it raised something that is no misuse."""
    if step_fn is None:
        return {"status": "not checked", "problems": [], "calls": [],
                "reason": "needs your training step: pass step_fn(model, optimizer, scaler, "
                          "batch) (and a scheduler keyword if your step steps one)"}
    if not callable(step_fn):
        raise ValueError(f"step_fn must be callable as step_fn(model, optimizer, scaler, batch); "
                         f"got {step_fn!r}")
    device = torch.device(device)
    log = _Log()
    model = make_model()
    optimizer = make_optimizer(model)
    params = [p for p in model.parameters()]
    kwargs = {}  # the scheduler wraps optimizer.step: made before the doctor's spy does
    if _takes(step_fn, "scheduler"):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        inner_sched = scheduler.step

        def scheduler_step(*args, **kw):
            log.add("scheduler.step")
            return inner_sched(*args, **kw)

        scheduler.step = scheduler_step
        kwargs["scheduler"] = scheduler
    inner_step = optimizer.step

    def optimizer_step(*args, **kwargs):
        log.add("optimizer.step" if log.in_scaler_step else "optimizer.step (direct)")
        return inner_step(*args, **kwargs)

    optimizer.step = optimizer_step
    init = 2.0 ** min((start_exponent + 2) if start_exponent is not None else 24, 120)
    scaler = _spy_scaler(device.type, init, log)
    per_step: List[List[str]] = []
    problems: List[Dict[str, str]] = []
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's scheduler-order warning: reported below instead
        for _ in range(steps):
            start = len(log.events)
            try:
                with _GradWrites(log, params):
                    step_fn(model, optimizer, scaler, (inputs, target), **kwargs)
            except Exception as exc:  # noqa: BLE001 - misuse raises; other errors are reported
                error = exc
                per_step.append(log.events[start:])
                break
            per_step.append(log.events[start:])
    calls = [", ".join(e for e in s if e != "unscale op") or "(nothing)" for s in per_step]
    checked = {"status": "checked", "problems": problems, "calls": calls, "steps": len(per_step),
               "init_scale": init, "scheduler": "checked" if "scheduler" in kwargs else
               "not checked: step_fn takes no scheduler keyword"}
    scaler_calls = {"scale", "unscale_", "scaler.step", "update"}
    if error is None and not log.fp16 and not any(e in scaler_calls for s in per_step
                                                  for e in s):
        # a bf16 or float32 step: no fp16, so no GradScaler is needed and none is misused
        return dict(checked, reason=f"{plural(len(per_step), 'step')}: your step computes "
                                    f"nothing in fp16 and does not use the GradScaler (bf16 and "
                                    f"float32 need none): no misuse possible")
    problems += _misuse(per_step, error, "scheduler" in kwargs)
    if error is not None and not problems:
        return {"status": "error", "problems": [], "calls": calls,
                "reason": f"step_fn raised {failure_text(error)}"}
    return dict(checked, reason="" if problems else
                f"{plural(len(per_step), 'step')} from init_scale "
                f"2^{int(torch.tensor(init).log2())}, the first ones overflowing: no misuse seen")

def _misuse(per_step: List[List[str]], error: Optional[BaseException],
            scheduler: bool) -> List[Dict[str, str]]:
    found: Dict[str, Dict[str, str]] = {}

    def add(kind, what, evidence, fix):
        found.setdefault(kind, {"misuse": kind, "what": what, "evidence": evidence, "fix": fix})

    text = str(error) if error is not None else ""
    first = text.splitlines()[0] if text else ""
    last = [e for e in per_step[-1] if e != "unscale op"] if per_step else []
    n = len(per_step)

    def missing_update():  # what GradScaler's refusals mean where the step itself looks right
        add("missing update", "scaler.update() is not called after scaler.step()",
            f"step {n - 1} ended without update(); at step {n} GradScaler raised: {first}",
            "call scaler.update() once per step, after scaler.step()")

    if "step() has already been called since the last update()" in text:
        if last.count("scaler.step") > 1:
            add("second step", "scaler.step() called twice before update()",
                f"step {n}: calls {', '.join(last)}; GradScaler raised: {first}",
                "one scaler.step(optimizer) per scaler.update()")
        else:
            missing_update()
    if "unscale_() has already been called on this optimizer since the last update()" in text:
        if last.count("unscale_") > 1:
            add("second unscale_", "scaler.unscale_(optimizer) is called twice in one step (by "
                "your step and by a helper, say): GradScaler refuses the second",
                f"step {n}: calls {', '.join(last)}; GradScaler raised: {first}",
                "call scaler.unscale_(optimizer) once per step, before clipping; scaler.step "
                "does not unscale again (lesson 02)")
        else:
            missing_update()
    if "unscale_() is being called after step()" in text:
        if "scaler.step" in last:
            add("unscale_ after step", "scaler.unscale_(optimizer) is called after "
                "scaler.step(): the step already used (and unscaled) the gradients",
                f"step {n}: calls {', '.join(last)}; GradScaler raised: {first}",
                "order: scaler.scale(loss).backward(), scaler.unscale_, clip, scaler.step, "
                "scaler.update (lesson 02)")
        else:
            missing_update()
    if "No inf checks were recorded prior to update" in text:
        add("update before step", "scaler.update() is called before scaler.step() (or "
            "without it): the scale is updated from no inf check, and GradScaler refuses",
            f"step {n}: calls {', '.join(last)}; GradScaler raised: {first}",
            "order: scaler.step(optimizer), then scaler.update() (lesson 02)")
    for i, events in enumerate(per_step, 1):
        names = [e for e in events if e != "unscale op"]
        first_unscale = next((j for j, e in enumerate(events) if e in ("unscale_", "unscale op",
                                                                         "scaler.step")), None)
        writes = [e for j, e in enumerate(events) if e.startswith("grad write")
                  and (first_unscale is None or j < first_unscale)]
        if writes and "scale" in events:
            add("clip before unscale_", "gradients are changed in place (clipping) before "
                "scaler.unscale_(optimizer): they are still multiplied by the loss scale, so "
                "the clipping threshold is compared with scaled gradients",
                f"step {i}: {writes[0].replace('grad write ', '')} on the gradients before "
                f"unscale_ (calls: {', '.join(names)})",
                "call scaler.unscale_(optimizer) before clip_grad_norm_ (lesson 02)")
        late = [j for j, e in enumerate(names) if e == "unscale_" and "update" in names[:j]]
        if late and error is None:
            # after update() GradScaler does not refuse it: the "unscaled" mark is carried into
            # the next step, whose scaler.step then does not unscale its new gradients
            nxt = per_step[i] if i < len(per_step) else []
            stale = "scaler.step" in nxt and "unscale op" not in nxt[:nxt.index("scaler.step")]
            add("unscale_ after step", "scaler.unscale_(optimizer) is called after "
                "scaler.step() (clipping after the step, say): the clipping changes nothing "
                "in this step's update, and the optimizer stays marked as unscaled, so the next "
                "step's scaler.step() applies its gradients still multiplied by the loss scale",
                f"step {i}: calls {', '.join(names)}" + (
                    f"; step {i + 1}'s scaler.step() unscaled nothing" if stale else ""),
                "order: scaler.scale(loss).backward(), scaler.unscale_, clip, scaler.step, "
                "scaler.update (lesson 02)")
        if names.count("scaler.step") > 1:
            add("second step", "scaler.step() is called more than once per step",
                f"step {i}: {plural(names.count('scaler.step'), 'call')}", "one scaler.step per update")
        if "optimizer.step (direct)" in names:
            add("direct optimizer step", "optimizer.step() is called outside scaler.step(): "
                "steps with inf/NaN gradients are not skipped, and the gradients are not "
                "unscaled", f"step {i}: optimizer.step() called directly",
                "call scaler.step(optimizer) instead (lesson 02)")
        if "scaler.step" in names and "update" not in names and error is None:
            add("missing update", "scaler.update() is not called after scaler.step(): the "
                "scale never backs off after an overflow nor grows",
                f"step {i}: calls {', '.join(names)}",
                "call scaler.update() once per step, after scaler.step() (lesson 03)")
        if "scale" not in names and ("scaler.step" in names or "optimizer.step (direct)" in names):
            add("loss not scaled", "the loss is not passed through scaler.scale() before "
                "backward: fp16 gradients are not scaled, and unscale_ divides them by the "
                "scale", f"step {i}: no scaler.scale call",
                "scaler.scale(loss).backward() (lesson 02)")
        skipped = ("scaler.step" in names and "optimizer.step" not in names)
        if scheduler and skipped and "scheduler.step" in names:
            add("scheduler on skipped step", "the learning-rate scheduler is stepped on steps "
                "the scaler skipped (inf/NaN gradients): the schedule runs ahead of the "
                "weights", f"step {i}: skipped by the scaler, scheduler.step() still called",
                "step the scheduler only when the scale did not drop (compare "
                "scaler.get_scale() before and after update), as lesson 02 shows")
    return list(found.values())


def check_checkpoint(checkpoint_fn: Optional[Callable], make_model: Callable,
                     make_optimizer: Callable, run_step: Callable, device,
                     start_exponent: Optional[int]) -> Dict[str, object]:
    """Move a ``GradScaler`` away from its defaults (started at ``2**(start_exponent - 3)``, or
    ``2**10``, and two real steps taken with ``run_step(model, optimizer, scaler)``), call
    ``checkpoint_fn(model, optimizer, scaler)`` and compare the scaler it returns (or the one in
    a tuple, list or dict it returns) with the one before: scale and growth tracker. "not checked"
    without a ``checkpoint_fn``."""
    if checkpoint_fn is None:
        return {"status": "not checked", "problems": [],
                "reason": "needs your save/load: pass checkpoint_fn(model, optimizer, scaler) "
                          "returning the GradScaler your resumed run would use"}
    if not callable(checkpoint_fn):
        raise ValueError(f"checkpoint_fn must be callable as checkpoint_fn(model, optimizer, "
                         f"scaler); got {checkpoint_fn!r}")
    device = torch.device(device)
    model = make_model()
    optimizer = make_optimizer(model)
    k = (start_exponent - 3) if start_exponent is not None else 10
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** k, growth_interval=3)
    try:
        for _ in range(2):
            run_step(model, optimizer, scaler)
        before = scaler.state_dict()
        got = checkpoint_fn(model, optimizer, scaler)
    except Exception as exc:  # noqa: BLE001
        return {"status": "error", "problems": [],
                "reason": f"checkpoint_fn raised {failure_text(exc)}"}
    values = list(got.values()) if isinstance(got, dict) else \
        list(got) if isinstance(got, (tuple, list)) else [got]
    restored = next((v for v in values if isinstance(v, torch.amp.GradScaler)), None)
    if restored is None:
        return {"status": "error", "problems": [],
                "reason": f"checkpoint_fn returned {type(got).__name__} with no GradScaler in "
                          f"it: return the scaler the resumed run would use"}
    if restored is scaler:
        return {"status": "error", "problems": [],
                "reason": "checkpoint_fn returned the same GradScaler it was given: load the "
                          "saved state into a new one, as a resumed run does"}
    after = restored.state_dict()
    problems = []
    if not restored.is_enabled():
        problems.append({"misuse": "scaler state lost on resume", "what": "the GradScaler the "
                         "resumed run uses is disabled (enabled=False): it loads no state and "
                         "scales no loss, so fp16 gradients that underflow are lost and steps "
                         "with inf/NaN gradients are no longer skipped",
                         "evidence": f"scale {before.get('scale')!r} before saving; the resumed "
                                     f"scaler is disabled",
                         "fix": "make the resumed GradScaler enabled as the saved one was, then "
                                "call scaler.load_state_dict() (lesson 05)"})
    for key in ("scale", "_growth_tracker") if not problems else ():
        if before.get(key) != after.get(key):
            what = ("the GradScaler's state is not saved and loaded with the checkpoint: a "
                    "resumed run starts again from init_scale" if key == "scale" else
                    "the scale comes back but the GradScaler's growth tracker does not (a "
                    "scaler made from the saved scale alone): a resumed run counts its clean "
                    "steps from 0 again, so the scale grows later than it would have")
            problems.append({"misuse": "scaler state lost on resume", "what": what,
                             "evidence": f"{key.strip('_')} {before.get(key)!r} before saving, "
                                         f"{after.get(key)!r} after loading",
                             "fix": "save scaler.state_dict() in the checkpoint and call "
                                    "scaler.load_state_dict() on resume (lesson 05)"})
            break
    return {"status": "checked", "problems": problems,
            "reason": "" if problems else f"scale {before.get('scale')!r} and growth tracker "
                                          f"{before.get('_growth_tracker')!r} come back"}


def amp_step(loss_of: Callable, device_type: str) -> Callable:
    """A plain fp16 AMP step (``run_step(model, optimizer, scaler)``) for ``check_checkpoint``:
    ``loss_of(model)`` is the loss of the doctor's batch."""
    def run_step(model, optimizer, scaler):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.float16):
            loss = loss_of(model)
        scaler.scale(first_tensor(loss).float()).backward()
        scaler.step(optimizer)
        scaler.update()
    return run_step
