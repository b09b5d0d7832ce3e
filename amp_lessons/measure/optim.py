"""The precision of weights and optimizer state: the pieces lesson 08 trains with.

- ``stochastic_round_bf16``: fp32 to bf16 rounded up or down at random, in proportion to the
  distance, so an update too small for bf16 still arrives on average;
- ``BF16AdamW``: AdamW for bf16 weights that computes its update in fp32 and stores it with a
  chosen rounding: ``nearest`` (what plain bf16 does), ``stochastic`` or ``kahan`` (a bf16
  compensation buffer carries what rounding dropped into the next step);
- ``RoundedAway``: the share of weights whose update was rounded away in a step (the weight got
  a non-zero gradient, yet its stored value did not change);
- ``state_bytes``: the bytes of an optimizer's state, tensor subclasses (torchao's 8-bit, 4-bit
  and FP8 states) counted by their inner tensors;
- ``WeightRecipe`` and ``train_recipe``: one way to store weights and optimizer state, trained on
  a workload with the same data for every recipe, measured (loss curve, update share rounded
  away, bytes by category, step times with ``timing.time_steps``, peak memory), a failure or an
  out-of-memory run reported in the row, never raised.

torchao is optional: the low-bit optimizer states come from ``torchao.optim``, imported when a
recipe needs it.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from amp_lessons._compat import found_inf, scale_tensor
from amp_lessons.validate import check_bool, check_choice, check_int, check_real, check_seed, is_int
from amp_lessons.measure import (BenchConfig, SavedActivations, Step, free_memory,
                    is_out_of_memory, optimizer_state_tensors, tensor_bytes)
from amp_lessons.measure.config import OPTIMIZER_IMPLS, OPTIMIZERS
from amp_lessons.measure.steps import build_optimizer as configured_optimizer
from amp_lessons.numerics.precision import as_device
from amp_lessons.measure.float8 import quiet, torchao_version  # noqa: F401 (one definition, also optim's API)
from amp_lessons.measure.timer import repeat_spread, time_steps

ROUNDINGS = ("nearest", "stochastic", "kahan")
MIB = 2 ** 20


# --- rounding ------------------------------------------------------------------------------------

def stochastic_round_bf16(x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 up or down at random: up with probability equal to the share
    of the gap between the two neighbouring bf16 values that ``x`` has covered, so the expected
    result is ``x`` itself. (A random 16-bit integer is added to the fp32 bit pattern, then the
    16 bits bf16 does not keep are cut off.)"""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise ValueError(f"x must be a float32 tensor; got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536  # -65536 = 0xFFFF0000 as an int32
    rounded = bits.view(torch.float32)
    # values that are not finite, or at the top of the range, keep round-to-nearest
    keep = ~torch.isfinite(rounded) | ~torch.isfinite(x)
    return torch.where(keep, x, rounded).to(torch.bfloat16)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW for bf16 weights, with the update computed in fp32 and stored with ``rounding``.

    ``nearest``: the new weight is rounded to the nearest bf16 value, so an update smaller than
    half a unit in the last place (ulp) of the weight is lost. ``stochastic``: rounded up or down
    at random (``stochastic_round_bf16``), unbiased. ``kahan``: Kahan-compensated summation: a
    bf16 buffer per weight keeps what the last rounding dropped and adds it to the next update,
    so small updates accumulate until they move the weight. The moments are kept in the weight's
    dtype (bf16), as with torch's AdamW on bf16 weights; ``seed`` fixes the random rounding.

    ``state_dict()`` holds everything that decides the next step: the moments, the step count,
    the Kahan compensation, and a ``BF16AdamW`` record with the rounding, the seed and the state
    of each device's random generator. ``load_state_dict`` checks the whole state first (another
    rounding, or torch's AdamW state, is refused with a ValueError) and leaves the optimizer
    exactly as it was when it refuses one; a resume is bitwise the run it continues.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, rounding: str = "kahan",
                 seed: int = 0):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        check_choice("rounding", rounding, ROUNDINGS)
        check_seed("seed", seed)
        self.rounding = rounding
        self.seed = int(seed)
        self._generators: Dict[torch.device, torch.Generator] = {}
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of parameters (``torch.optim.Optimizer.add_param_group``); its params must
        be bfloat16 tensors, as the constructor's, and at least one: a ValueError names what was
        found, and the group is not added. The constructor adds its own groups through here."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not isinstance(params, (torch.Tensor, set, list, tuple)):
            params = param_group["params"] = list(params)  # a generator is read once: keep it
        params = [params] if isinstance(params, torch.Tensor) else params
        if isinstance(params, (list, tuple)) and not params:
            raise ValueError(f"params: param group {len(self.param_groups)} holds no tensor; "
                             f"BF16AdamW needs at least one bfloat16 tensor to train in each "
                             f"group")
        for p in params if isinstance(params, (list, tuple)) else []:
            if isinstance(p, torch.Tensor) and p.dtype != torch.bfloat16:
                raise ValueError(f"params must be bfloat16 tensors (BF16AdamW stores bf16 "
                                 f"weights); got one of dtype {p.dtype}")
        super().add_param_group(param_group)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def state_dict(self) -> dict:
        """torch's optimizer state (moments, step counts, Kahan compensation; tensors are the
        live ones, as torch's) plus ``STATE_KEY``: the rounding, the seed and a copy of each
        device's generator state, so a stochastic-rounding resume draws the numbers the
        uninterrupted run would have drawn."""
        state = super().state_dict()
        state[STATE_KEY] = {"rounding": self.rounding, "seed": self.seed,
                            "generators": {str(d): g.get_state()
                                           for d, g in self._generators.items()}}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``state_dict()`` returned (of a ``BF16AdamW`` with the same rounding and
        parameter shapes). Everything is checked before anything changes: a state of torch's
        AdamW, of another rounding, with a group setting out of range, a moment of the wrong
        shape or dtype, a missing compensation buffer or a generator state that cannot be
        restored, a key BF16AdamW does not save (in the dict, its record or a param group:
        another optimizer's settings such as ``momentum``; a scheduler's ``initial_lr`` is
        fine), a moment on the meta device or a negative ``exp_avg_sq`` raises ValueError,
        and the optimizer stays exactly as it was (settings, state, generators). Tensors are
        copied in, so one state dict can be loaded into several optimizers."""
        generators, seed = self._check_loadable(state_dict)
        plain = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        plain["state"] = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                              for n, v in entry.items()}
                          for k, entry in state_dict["state"].items()}
        kept = dict(self.__dict__)  # what a failure inside torch's load puts back
        kept_defaults = dict(self.defaults)  # torch's load adds to this dict in place
        try:
            super().load_state_dict(plain)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(kept)
            self.defaults.clear()
            self.defaults.update(kept_defaults)
            raise
        self.defaults.clear()  # torch adds settings (differentiable) BF16AdamW does not have
        self.defaults.update(kept_defaults)
        self.seed = seed
        self._generators = generators

    def _check_loadable(self, state_dict) -> Tuple[Dict[torch.device, torch.Generator], int]:
        """ValueError unless ``state_dict`` is a ``BF16AdamW`` state this optimizer can take
        whole; returns the restored generators and the seed. Changes nothing."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
                or not isinstance(state_dict.get("param_groups"), list):
            raise ValueError("state_dict: not an optimizer state (a dict with 'state' and "
                             "'param_groups')")
        record = state_dict.get(STATE_KEY)
        extra = sorted(map(str, set(state_dict) - {"state", "param_groups", STATE_KEY}))
        if extra:
            raise ValueError(f"state_dict: holds {', '.join(map(repr, extra))} besides 'state', "
                             f"'param_groups' and {STATE_KEY!r}: not what BF16AdamW.state_dict() "
                             f"saves (another optimizer's, or a whole checkpoint?)")
        if not isinstance(record, dict):
            raise ValueError(f"state_dict: not a BF16AdamW state (no {STATE_KEY!r} record of "
                             f"rounding, seed and generators): saved by another optimizer, "
                             f"such as torch.optim.AdamW?")
        if record.get("rounding") != self.rounding:
            raise ValueError(f"state_dict: saved by a BF16AdamW with rounding="
                             f"{record.get('rounding')!r}; this one has rounding="
                             f"{self.rounding!r} (its state has other parts: build the "
                             f"optimizer with the same rounding)")
        extra = sorted(map(str, set(record) - set(_RECORD_KEYS)))
        if extra:
            raise ValueError(f"state_dict: the {STATE_KEY} record holds {', '.join(map(repr, extra))}"
                             f"; BF16AdamW saves only {', '.join(map(repr, _RECORD_KEYS))}")
        seed = check_seed("state_dict's seed", record.get("seed"))
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict: {len(groups)} param groups; this optimizer has "
                             f"{len(self.param_groups)}")
        params = {}
        for i, (saved, live) in enumerate(zip(groups, self.param_groups)):
            ids = saved.get("params") if isinstance(saved, dict) else None
            if not isinstance(ids, list) or len(ids) != len(live["params"]):
                raise ValueError(f"state_dict: param group {i} holds "
                                 f"{len(ids) if isinstance(ids, list) else 'no list of'} "
                                 f"parameters; this optimizer's holds {len(live['params'])}")
            extra = sorted(map(str, set(saved) - {"params", *_GROUP_SETTINGS,
                                                  *_SCHEDULER_KEYS} - set(live)))
            if extra:
                raise ValueError(f"state_dict: param group {i} has {', '.join(map(repr, extra))}"
                                 f", settings BF16AdamW does not have (it has "
                                 f"{', '.join(map(repr, _GROUP_SETTINGS))}): saved by another "
                                 f"optimizer?")
            try:
                _check_hyperparameters(saved.get("lr"), saved.get("betas"), saved.get("eps"),
                                       saved.get("weight_decay"))
            except ValueError as exc:
                raise ValueError(f"state_dict: param group {i}: {exc}") from None
            params.update(zip(ids, live["params"]))
        for key, entry in state_dict["state"].items():
            if key not in params:
                raise ValueError(f"state_dict: state for parameter {key!r}, which no param "
                                 f"group holds")
            _check_param_state(key, entry, params[key], self.rounding)
        generators = {}
        saved_generators = record.get("generators")
        if not isinstance(saved_generators, dict):
            raise ValueError("state_dict: the BF16AdamW record holds no generators dict")
        for name, value in saved_generators.items():
            try:
                device = torch.device(name)
                generator = torch.Generator(device=device)
                generator.set_state(value)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise ValueError(f"state_dict: the random generator of device {name!r} cannot "
                                 f"be restored here ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                                 ) from None
            generators[device] = generator
        return generators, seed

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            lr = float(lr)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    if self.rounding == "kahan":
                        state["compensation"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - b1)
                v = state["exp_avg_sq"].float().lerp_(g * g, 1 - b2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_() + eps)
                update = update.mul_(-lr).sub_(p.float(), alpha=lr * wd)
                add_rounded(p, update, self.rounding, state.get("compensation"),
                            self._generator(p.device) if self.rounding == "stochastic" else None)
        return loss


STATE_KEY = "BF16AdamW"  # BF16AdamW.state_dict()'s own record: rounding, seed, generators
_RECORD_KEYS = ("rounding", "seed", "generators")
_GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")  # what a param group of BF16AdamW holds
_SCHEDULER_KEYS = ("initial_lr",)  # what torch's LR schedulers add to a group


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """ValueError naming the first AdamW setting out of its range (constructor and loads)."""
    check_real("lr", lr, 0.0)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be two numbers in [0, 1); got {betas!r}")
    for b in betas:
        check_real("each of betas", b, 0.0, 1.0, high_open=True)
    check_real("eps", eps, 0.0)
    check_real("weight_decay", weight_decay, 0.0)


def _check_param_state(key, entry, param: torch.Tensor, rounding: str) -> None:
    """ValueError unless ``entry`` is the state BF16AdamW keeps for ``param``: a step count,
    two moments of its shape and dtype, and (kahan) a compensation buffer, nothing else; or
    nothing yet (a parameter that has not stepped)."""
    expected = {"step", "exp_avg", "exp_avg_sq"} | ({"compensation"} if rounding == "kahan"
                                                    else set())
    if isinstance(entry, dict) and not entry:  # a parameter that has not stepped yet
        return
    if not isinstance(entry, dict) or set(entry) != expected:
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"state_dict: parameter {key!r} has state {found}; a BF16AdamW with "
                         f"rounding={rounding!r} keeps {sorted(expected)}: saved by another "
                         f"optimizer or rounding?")
    step = entry["step"]
    if not is_int(step) or step < 0:
        raise ValueError(f"state_dict: parameter {key!r} has step {step!r}; BF16AdamW counts "
                         f"steps as a whole number >= 0 (a tensor step is torch's AdamW's)")
    for name in sorted(expected - {"step"}):
        t = entry[name]
        if not isinstance(t, torch.Tensor) or t.shape != param.shape or \
                t.dtype != param.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else \
                type(t).__name__
            raise ValueError(f"state_dict: parameter {key!r}: {name} is {got}; the parameter "
                             f"is {tuple(param.shape)} {param.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"state_dict: parameter {key!r}: {name} is on the meta device, "
                             f"which holds no values to resume from")
        if name == "exp_avg_sq" and bool((t < 0).any()):
            raise ValueError(f"state_dict: parameter {key!r}: exp_avg_sq holds negative values; "
                             f"an average of squared gradients never does (a damaged state?)")


@torch.no_grad()
def add_rounded(weight: torch.Tensor, update: torch.Tensor, rounding: str,
                compensation: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None) -> None:
    """``weight += update`` for a bf16 ``weight`` and an fp32 ``update``, the sum formed in fp32
    and stored with ``rounding`` (see ``BF16AdamW``); ``kahan`` needs the ``compensation``
    buffer (bf16, same shape), which it updates in place."""
    check_choice("rounding", rounding, ROUNDINGS)
    w = weight.float()
    if rounding == "nearest":
        weight.copy_(w + update)
    elif rounding == "stochastic":
        weight.copy_(stochastic_round_bf16(w + update, generator))
    else:
        if compensation is None:
            raise ValueError("compensation must be a tensor shaped like weight for kahan rounding")
        y = update + compensation.float()       # the update plus what earlier roundings dropped
        new = (w + y).to(weight.dtype)
        compensation.copy_(y - (new.float() - w))  # what this rounding dropped
        weight.copy_(new)


def accumulate_bf16(update: float, steps: int, start: float = 1.0, rounding: str = "nearest",
                    seed: int = 0) -> List[float]:
    """Add ``update`` to a bf16 weight ``start`` ``steps`` times with ``rounding`` (``add_rounded``);
    returns the ``steps + 1`` values. Round-to-nearest loses every update below half an ulp."""
    check_real("update", update)
    check_real("start", start)
    check_int("steps", steps, 1)
    check_choice("rounding", rounding, ROUNDINGS)
    check_int("seed", seed, 0)
    w = torch.tensor([start], dtype=torch.bfloat16)
    c = torch.zeros_like(w)
    u = torch.tensor([update], dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    values = [float(w)]
    for _ in range(steps):
        add_rounded(w, u, rounding, c, g)
        values.append(float(w))
    return values


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate; in place where the optimizer keeps it as a tensor
    (torchao's optimizers do, so a compiled step does not recompile when it changes)."""
    check_real("lr", lr, 0.0)
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


# --- counting ------------------------------------------------------------------------------------

class RoundedAway:
    """The share of weights whose update was rounded away in one optimizer step.

    Call ``before()`` just before ``optimizer.step()`` and ``share()`` just after (before the
    gradients are cleared): among the weights with a non-zero gradient, the share whose stored
    value did not change. ``share`` returns a 0-d tensor on the weights' device (no host sync).
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = [p for p in params if isinstance(p, torch.Tensor)]
        if not self.params:
            raise ValueError("params must hold at least one tensor")
        self._old: Optional[List[torch.Tensor]] = None

    @torch.no_grad()
    def before(self) -> None:
        """Remember the weights as they are before the step."""
        self._old = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def share(self) -> torch.Tensor:
        """Share (0 to 1) of the weights with a non-zero gradient that the step left unchanged."""
        if self._old is None:
            raise ValueError("before() must be called before share(): no weights were saved")
        stuck = total = None
        for p, old in zip(self.params, self._old):
            if p.grad is None:
                continue
            moved_for = p.grad != 0
            s, n = ((p == old) & moved_for).sum(), moved_for.sum()
            stuck, total = (s, n) if stuck is None else (stuck + s, total + n)
        self._old = None
        if stuck is None:
            return torch.zeros(())
        return stuck.float() / total.clamp(min=1).float()


def _inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """A tensor subclass's inner tensors (``__tensor_flatten__``), recursively; a plain tensor is
    itself."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    found: List[torch.Tensor] = []
    for name in names:
        found += _inner_tensors(getattr(t, name))
    return found


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state, each storage once; a tensor
    subclass (torchao's 8-bit, 4-bit and FP8 states) counts its inner tensors (codes, scales)."""
    tensors = [inner for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) for inner in _inner_tensors(v)]
    return tensor_bytes(tensors)


# --- recipes ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightRecipe:
    """How weights and optimizer state are stored. ``weights``: ``fp32`` (trained under autocast)
    or ``bf16`` (the model itself in bf16, no autocast). ``optimizer``: ``adamw`` (torch's,
    state in the weights' dtype; fused on CUDA), ``bf16-stochastic`` / ``bf16-kahan``
    (``BF16AdamW``), ``ao-8bit`` / ``ao-4bit`` / ``ao-fp8`` (torchao's low-bit AdamW states)."""

    name: str
    weights: str
    optimizer: str
    about: str

    @property
    def needs_torchao(self) -> bool:
        """True for torchao's low-bit optimizer states."""
        return self.optimizer.startswith("ao-")

    @property
    def needs_bf16(self) -> bool:
        """True where the weights themselves are bf16."""
        return self.weights == "bf16"


RECIPES: Dict[str, WeightRecipe] = {r.name: r for r in (
    WeightRecipe("fp32 master", "fp32", "adamw",
                 "fp32 weights and AdamW state, half-precision autocast: the reference"),
    WeightRecipe("bf16", "bf16", "adamw", "pure bf16 weights, torch AdamW (bf16 state)"),
    WeightRecipe("bf16 + stochastic rounding", "bf16", "bf16-stochastic",
                 "pure bf16 weights, update rounded at random (BF16AdamW)"),
    WeightRecipe("bf16 + Kahan", "bf16", "bf16-kahan",
                 "pure bf16 weights, Kahan-compensated update (BF16AdamW)"),
    WeightRecipe("8-bit state", "fp32", "ao-8bit", "fp32 weights, torchao AdamW8bit"),
    WeightRecipe("4-bit state", "fp32", "ao-4bit", "fp32 weights, torchao AdamW4bit"),
    WeightRecipe("FP8 state", "fp32", "ao-fp8", "fp32 weights, torchao AdamWFp8"),
)}
_AO_CLASSES = {"ao-8bit": "AdamW8bit", "ao-4bit": "AdamW4bit", "ao-fp8": "AdamWFp8"}


def get_recipe(name: str) -> WeightRecipe:
    """The recipe called ``name``; ValueError naming the known ones otherwise."""
    if name not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}; got {name!r}")
    return RECIPES[name]


def skip_reason(recipe: WeightRecipe, device, bf16: bool, torchao: Optional[str]) -> str:
    """Why ``recipe`` cannot run here ("" when it can): no native bf16 for bf16 weights; torchao
    missing, or no CUDA GPU, for its low-bit states (they compile a kernel per parameter shape
    with Triton)."""
    if recipe.needs_bf16 and not bf16:
        return "no native bf16 on this GPU"
    if recipe.needs_torchao:
        if torchao is None:
            return "torchao not installed"
        if torch.device(device).type != "cuda":
            return "torchao's low-bit optimizers run on CUDA GPUs"
    return ""


def build_optimizer(recipe: WeightRecipe, params, lr: float, betas=(0.9, 0.95),
                    weight_decay: float = 0.1, seed: int = 0,
                    device=None) -> torch.optim.Optimizer:
    """The optimizer of ``recipe`` over ``params`` (AdamW in every case, same hyperparameters)."""
    params = list(params)
    if recipe.optimizer == "adamw":
        fused = torch.device(device).type == "cuda" if device is not None else False
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                 fused=fused)
    if recipe.optimizer in ("bf16-stochastic", "bf16-kahan"):
        return BF16AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                         rounding=recipe.optimizer.split("-")[1], seed=seed)
    with quiet():
        ao = importlib.import_module("torchao.optim")
    return getattr(ao, _AO_CLASSES[recipe.optimizer])(params, lr=lr, betas=betas,
                                                       weight_decay=weight_decay)


def _row(recipe: WeightRecipe, seed: int, status: str) -> dict:
    return {"recipe": recipe.name, "about": recipe.about, "seed": seed, "status": status,
            "losses": [], "rounded_away": [], "skipped_steps": [], "final_loss": None,
            "params": None,
            "weights_mib": None, "grads_mib": None, "state_mib": None, "activations_mib": None,
            "step_ms": None, "optimizer_ms": None, "optimizer_compiled_ms": None,
            "step_spread": None, "optimizer_spread": None, "optimizer_compiled_spread": None,
            "peak_mib": None, "timer": None, "compile_error": None, "seconds": None}


def train_recipe(recipe: WeightRecipe, make_model: Callable[[], nn.Module],
                 batch: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int,
                 lr_at: Callable[[int], float], device, seed: int = 0,
                 amp_dtype: torch.dtype = torch.bfloat16, clip: Optional[float] = None,
                 count_every: int = 1, time_steps_n: int = 0, warmup: int = 3,
                 betas=(0.9, 0.95), weight_decay: float = 0.1, bf16: bool = True,
                 torchao: Optional[str] = None) -> dict:
    """Train ``make_model()`` (built after ``torch.manual_seed(seed)``) for ``steps`` steps with
    ``recipe``; ``batch(step)`` gives the step's inputs and targets (the same for every recipe).

    fp32-weight recipes run the forward under autocast in ``amp_dtype`` (a GradScaler where that
    is fp16); bf16-weight recipes cast the model to bf16 and run without autocast. ``lr_at(step)``
    sets the learning rate of every step. Every ``count_every`` steps the share of weights whose
    update was rounded away is recorded (``RoundedAway``), except on steps GradScaler skipped
    (inf/NaN gradients in fp16: no weight moved, and none was rounded away): those are listed in
    ``skipped_steps`` (step indices) instead. After training: bytes of weights,
    gradients, optimizer state and saved activations (one more step, counted); with
    ``time_steps_n`` > 0 the median training step and optimizer step (``timing.time_steps``) and,
    for torchao states, the optimizer step under ``torch.compile``, each with its repeat spread
    (``*_spread``: ``bench.repeat_spread``), then peak memory on a GPU. Returns a row; ``status``
    is ``trained``, ``diverged``, ``not trained: GradScaler skipped all <n> steps``,
    ``not run: <why>``, ``out of memory`` or ``error: <what>``.
    """
    check_int("steps", steps, 1)
    check_int("seed", seed, 0)
    check_int("count_every", count_every, 1)
    check_int("time_steps_n", time_steps_n, 0)
    check_int("warmup", warmup, 1)
    check_bool("bf16", bf16)
    device = torch.device(device)
    row = _row(recipe, seed, "trained")
    why = skip_reason(recipe, device, bf16, torchao)
    if why:
        row["status"] = f"not run: {why}"
        return row
    started = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:  # what an earlier run left in the allocator's cache; a CPU run skips the slow gc
        free_memory(device)
    try:
        with quiet():
            _train(row, recipe, make_model, batch, loss_fn, steps, lr_at, device, seed,
                   amp_dtype, clip, count_every, time_steps_n, warmup, betas, weight_decay)
    except Exception as exc:  # noqa: BLE001 - a failed recipe is a row, never a dead kernel
        row["status"] = "out of memory" if is_out_of_memory(exc) else \
            f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
    finally:
        if cuda:
            free_memory(device, reset_compiler=recipe.needs_torchao)
    row["seconds"] = time.perf_counter() - started
    return row


def _train(row, recipe, make_model, batch, loss_fn, steps, lr_at, device, seed, amp_dtype, clip,
           count_every, time_steps_n, warmup, betas, weight_decay) -> None:
    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    model = make_model().to(device)
    if recipe.needs_bf16:
        model = model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(recipe, params, lr_at(0), betas, weight_decay, seed, device)
    use_amp = not recipe.needs_bf16
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp and amp_dtype == torch.float16)
    counter = RoundedAway(params)
    weight_dtype = params[0].dtype

    def forward(x, y):
        if x.is_floating_point():
            x = x.to(weight_dtype)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
            return loss_fn(model(x), y)

    def backward(loss):
        scaler.scale(loss).backward()

    def update(count=False):
        """One optimizer step through the scaler: (rounded-away share or None, skipped flag: a
        0-d tensor, 1.0 where GradScaler skipped the step, or None without a scaler)."""
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        if count:
            counter.before()
        scaler.step(opt)  # (step leaves the scale alone: update moves it)
        skipped = found_inf(scaler, opt) if scaler.is_enabled() else None
        skipped = skipped.clone() if skipped is not None else None
        scale_before = None
        if skipped is None and scaler.is_enabled():  # the flag unreadable: watch the scale
            scale_before = scale_tensor(scaler)
            scale_before = scale_before.clone() if scale_before is not None else None
        scaler.update()
        if skipped is None and scale_before is not None:  # a skipped step backs the scale off
            after = scale_tensor(scaler)
            skipped = (after < scale_before).float() if after is not None else None
        shared = counter.share() if count else None
        opt.zero_grad(set_to_none=True)
        return shared, skipped

    losses = torch.zeros(steps, device=device)
    skips = torch.zeros(steps, device=device)
    shares = []
    for step in range(steps):
        set_lr(opt, lr_at(step))
        x, y = batch(step)
        loss = forward(x, y)
        backward(loss)
        share, skipped = update(count=step % count_every == 0)
        losses[step] = loss.detach().float()
        if skipped is not None:
            skips[step] = skipped.to(skips.device).float()
        if share is not None:
            shares.append((step, share))
    curve = losses.cpu().tolist()
    row["losses"] = curve
    skipped_steps = [s for s, flag in enumerate(skips.cpu().tolist()) if flag]
    row["skipped_steps"] = skipped_steps
    skipped_set = set(skipped_steps)
    row["rounded_away"] = [(s, float(v)) for s, v in shares if s not in skipped_set]
    if len(skipped_steps) == steps:
        row["status"] = f"not trained: GradScaler skipped all {steps} steps"
    tail = curve[-max(1, steps // 10):]
    row["final_loss"] = statistics.fmean(tail) if all(map(math.isfinite, tail)) else math.nan
    row["params"] = sum(p.numel() for p in params)
    if not all(map(math.isfinite, curve)) and row["status"] == "trained":
        row["status"] = "diverged"
    # where the memory goes: one more step, activations counted as autograd saves them
    x, y = batch(steps)
    with SavedActivations(exclude=params) as saved:
        loss = forward(x, y)
    backward(loss)
    row["grads_mib"] = tensor_bytes(p.grad for p in params if p.grad is not None) / MIB
    update()
    row["weights_mib"] = tensor_bytes(params) / MIB
    row["state_mib"] = state_bytes(opt) / MIB
    row["activations_mib"] = saved.bytes / MIB
    if not time_steps_n:
        return
    plain = Step(model, opt, scaler, forward, backward, lambda: update()[0])
    timed = time_steps(plain, x, y, warmup=warmup, steps=time_steps_n, device=device)
    row["step_ms"], row["timer"] = statistics.median(timed["times_ms"]), timed["timer"]
    row["step_spread"] = repeat_spread(timed["times_ms"])
    backward(forward(x, y))  # gradients in place: the optimizer alone is timed below
    optimizer_only = time_steps(lambda a, b: opt.step(), x, y, warmup=warmup,
                                steps=time_steps_n, device=device, reset_peak=False)
    row["optimizer_ms"] = statistics.median(optimizer_only["times_ms"])
    row["optimizer_spread"] = repeat_spread(optimizer_only["times_ms"])
    if cuda:
        row["peak_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    if recipe.needs_torchao:  # torchao compiles per parameter; compiling the whole step fuses more
        try:
            compiled = torch.compile(opt.step)
            done = time_steps(lambda a, b: compiled(), x, y, warmup=warmup, steps=time_steps_n,
                              device=device, reset_peak=False)
            row["optimizer_compiled_ms"] = statistics.median(done["times_ms"])
            row["optimizer_compiled_spread"] = repeat_spread(done["times_ms"])
        except Exception as exc:  # noqa: BLE001 - the eager step's numbers stand without it
            if is_out_of_memory(exc):
                raise
            row["compile_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def memory_rows(rows: Sequence[dict]) -> List[dict]:
    """Per trained recipe: MiB of weights, gradients, optimizer state and activations, their sum,
    bytes per parameter of model state (weights + gradients + optimizer state), and the peak
    allocated while it was timed (GPU only, else None)."""
    out = []
    for r in rows:
        if r.get("weights_mib") is None:
            continue
        model_state = r["weights_mib"] + r["grads_mib"] + r["state_mib"]
        out.append({"recipe": r["recipe"], "weights MiB": r["weights_mib"],
                    "gradients MiB": r["grads_mib"], "optimizer state MiB": r["state_mib"],
                    "activations MiB": r["activations_mib"],
                    "total MiB": model_state + r["activations_mib"],
                    "bytes per parameter": model_state * MIB / r["params"],
                    "peak MiB": r.get("peak_mib")})
    return out


# --- optimizers under AMP: skipped steps, the dtype Adam computes in, torch.optim._multi_tensor --


def skipped_step_check(optimizer: str = "sgd", impl: str = "fused", device=None,
                       size: int = 1024, prime_momentum: bool = False) -> Dict[str, object]:
    """Does a step that GradScaler skips leave the optimizer exactly as it was?

    One parameter vector, two steps: the first step's gradient holds an inf (GradScaler skips
    it, as it does early in fp16 training while the scale settles), the second is finite. The
    parameters after step two are compared with those of the for-loop optimizer, which skips
    cleanly. Returns ``max_abs_diff`` (0.0 when ``impl`` agrees), ``finite`` and
    ``state_after_skip`` (whether the skipped step created optimizer state).
    ``prime_momentum=True`` applies the course's workaround (zero SGD momentum buffers before the
    first step) to a fused SGD being checked; ``primed`` says whether it was applied."""
    if not isinstance(prime_momentum, bool):
        raise ValueError(f"prime_momentum must be True or False; got {prime_momentum!r}")
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("impl", impl, OPTIMIZER_IMPLS)
    check_int("size", size, 2)
    device = as_device(device)
    results = {}
    primed = prime_momentum and optimizer == "sgd" and impl == "fused"

    def state_count(opt) -> int:  # state tensors of the parameter's size (not step counters)
        return sum(1 for t in optimizer_state_tensors(opt) if t.numel() > 1)

    for name in ("for-loop", impl):
        p = nn.Parameter(torch.linspace(-1, 1, size, device=device))
        opt = configured_optimizer(BenchConfig(optimizer=optimizer, impl=name), [p],
                                   prime_momentum=prime_momentum and name == impl)
        before = state_count(opt)  # primed buffers exist before any step
        scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
        bad = torch.ones(size, device=device)
        bad[0] = float("inf")
        state_after_skip = None
        for c in (bad, torch.ones(size, device=device)):
            scaler.scale((p * c).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if state_after_skip is None:
                state_after_skip = state_count(opt) > before
        results[name] = (p.detach().clone(), state_after_skip)
    ref, got = results["for-loop"][0], results[impl][0]
    diff = (got - ref).abs().max().item() if torch.isfinite(got).all() else float("inf")
    return {"optimizer": optimizer, "impl": impl, "primed": primed, "device": str(device),
            "max_abs_diff": diff, "finite": bool(torch.isfinite(got).all()),
            "state_after_skip": results[impl][1],
            "reference_state_after_skip": results["for-loop"][1]}


def adam_precision_facts(device=None) -> Dict[str, object]:
    """Which dtype Adam computes in under AMP (does its eps ever meet float16?).

    One autocast step of a small model with Adam (fp16 on a GPU, bf16 on a CPU): parameters,
    gradients and Adam's state are float32, so eps never meets float16. For contrast, what
    float16 would make of 1e-8 and 1e-7."""
    device = as_device(device)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.autocast(device_type=device.type, dtype=dtype):
        out = model(torch.randn(4, 8, device=device))
    out.float().pow(2).mean().backward()
    grad_dtype = model[0].weight.grad.dtype
    opt.step()
    state = opt.state[model[0].weight]
    return {"autocast_dtype": str(dtype), "activation_dtype": str(out.dtype),
            "param_dtype": str(model[0].weight.dtype), "grad_dtype": str(grad_dtype),
            "exp_avg_sq_dtype": str(state["exp_avg_sq"].dtype),
            "eps_1e-8_in_fp16": float(torch.tensor(1e-8, dtype=torch.float16)),
            "eps_1e-7_in_fp16": float(torch.tensor(1e-7, dtype=torch.float16)),
            "eps_1e-8_in_fp32": float(torch.tensor(1e-8, dtype=torch.float32))}


def multi_tensor_status() -> Dict[str, object]:
    """``torch.optim._multi_tensor``: does it exist in this PyTorch, and what is it?

    Where it exists, its ``Adam`` is built on one dummy parameter to read what it really is:
    a subclass of ``torch.optim.Adam`` and the ``foreach`` setting it fixes."""
    try:
        mod = importlib.import_module("torch.optim._multi_tensor")
    except ImportError as exc:
        return {"exists": False, "has_adam": False, "subclass_of_adam": False, "foreach": None,
                "error": f"{type(exc).__name__}: {exc}"}
    adam = getattr(mod, "Adam", None)
    out = {"exists": True, "has_adam": adam is not None, "subclass_of_adam": False,
           "foreach": None, "error": ""}
    if adam is not None:
        out["subclass_of_adam"] = isinstance(adam, type) and issubclass(adam, torch.optim.Adam)
        out["foreach"] = adam([nn.Parameter(torch.zeros(1))]).defaults.get("foreach")
    return out

