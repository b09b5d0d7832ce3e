"""What the doctor is given, checked: a model (or a ``MODULE:FACTORY`` name), a batch, a loss.

Bad input raises a ``ValueError`` that says what is wrong and how to fix it: a factory that
cannot be imported, a model without parameters, a batch that is not tensors, a forward pass that
fails (the message names the layer it failed in, and the batch's shape).
"""
from __future__ import annotations

import copy
import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.numerics.modes import kept_modes
from amp_lessons.doctor.dtype_trace import first_tensor, loss_name

# ``torchvision:resnet50`` means torchvision.models.resnet50, built without downloading weights
ZOO = {"torchvision": "torchvision.models"}


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """The callable a ``MODULE:FACTORY`` name points to (``torchvision:resnet50`` reads
    ``torchvision.models.resnet50``); ValueError saying why it cannot be loaded."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"model must be MODULE:FACTORY (e.g. mypackage.models:build or "
                         f"torchvision:resnet50); got {spec!r}")
    module_name, attr = spec.split(":")
    module_name = ZOO.get(module_name, module_name)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the learner's to fix
        raise ValueError(f"model: the module {module_name!r} of {spec!r} cannot be imported "
                         f"({type(exc).__name__}: {exc}); is it installed, or on PYTHONPATH?"
                         ) from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"model: {module_name!r} has no {attr!r} (from {spec!r})")
    if not callable(factory):
        raise ValueError(f"model: {spec!r} is not callable (a function or class that builds "
                         f"an nn.Module)")
    return factory


def build_model(spec: str) -> nn.Module:
    """Call the factory ``spec`` names with no arguments (torchvision's with ``weights=None``:
    random weights, nothing downloaded) and check it built an ``nn.Module``."""
    factory = load_factory(spec)
    zoo = spec.split(":")[0] in ZOO
    try:
        model = factory(weights=None) if zoo else factory()
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"model: calling {spec!r} failed ({type(exc).__name__}: {exc})") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: {spec!r} returned a {type(model).__name__}, not a "
                         f"torch.nn.Module")
    return model


def parse_shape(text: str) -> Tuple[int, ...]:
    """``"8,3,224,224"`` (or ``8x3x224x224``) as a tuple of whole numbers >= 1."""
    parts = [p for p in str(text).replace("x", ",").split(",") if p.strip()]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"batch shape must be whole numbers >= 1 separated by commas, e.g. "
                         f"8,3,224,224; got {text!r}")
    return shape


def check_model(model) -> nn.Module:
    """``model`` if it is an ``nn.Module`` with trainable parameters; ValueError otherwise."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"model must have parameters to train; {type(model).__name__} has none")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"model must have trainable parameters; every parameter of "
                         f"{type(model).__name__} has requires_grad=False")
    return model


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters live."""
    return next(model.parameters()).device


def _is_tensors(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return bool(x) and all(isinstance(v, torch.Tensor) for v in x)
    if isinstance(x, dict):
        return bool(x) and all(isinstance(v, torch.Tensor) for v in x.values())
    return False


def move(x, device):
    """A tensor, or the tensors of a tuple/list/dict, on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: v.to(device) for k, v in x.items()}
    return type(x)(v.to(device) for v in x)


def batch_size(x) -> int:
    """The leading dimension of the (first) input tensor: the batch size."""
    t = first_tensor(x)
    return int(t.shape[0]) if t is not None and t.dim() else 1


def input_dtype(x) -> torch.dtype:
    """The dtype of the (first) input tensor: what the model is fed (token ids are int64)."""
    t = first_tensor(x)
    return t.dtype if t is not None else torch.float32


def is_class_ids(target: torch.Tensor) -> bool:
    """True for an integer target (any signed or unsigned width: int8 ... int64, uint8 ...
    uint64): class ids or next tokens, taken with cross-entropy. Bool and float targets are
    values (mean squared error)."""
    return not (target.is_floating_point() or target.is_complex() or target.dtype == torch.bool)


def check_not_empty(x, shape: str) -> None:
    """ValueError when an input tensor has no rows: a batch of 0 samples measures nothing (its
    loss is NaN, its speed 0)."""
    tensors = [x] if isinstance(x, torch.Tensor) else list(x.values()) if isinstance(x, dict) \
        else list(x)
    if any(t.dim() and t.shape[0] == 0 for t in tensors):
        raise ValueError(f"batch must hold at least one sample; got a batch of shape {shape} "
                         f"(0 rows): pass a batch from your data loader")


def shape_text(x) -> str:
    """The input's shape(s) as text, for messages and the report."""
    if isinstance(x, torch.Tensor):
        return "x".join(map(str, x.shape)) + f" {str(x.dtype).replace('torch.', '')}"
    items = x.items() if isinstance(x, dict) else enumerate(x)
    return ", ".join(f"{k}: {shape_text(v)}" for k, v in items)


class Call(nn.Module):
    """``model`` called on one input object: a tensor, a tuple/list (``model(*x)``) or a dict
    (``model(**x)``), so the engine's steps (which call ``model(x)``) run any forward signature.
    The output is the logits where the model returns them (a ``.logits`` attribute, as a
    ModelOutput has, or a ``"logits"`` key of a dict), else the first tensor it returns."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            out = self.model(x)
        elif isinstance(x, dict):
            out = self.model(**x)
        else:
            out = self.model(*x)
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, dict):
            logits = out.get("logits")
        return logits if isinstance(logits, torch.Tensor) else first_tensor(out)


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension for integer targets (classes, next tokens), mean
    squared error (in float32) for float targets of the output's shape."""
    if is_class_ids(target):
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten().long())
    return F.mse_loss(output.float(), target.float())


def made_target(output: torch.Tensor, seed: int = 0) -> Tuple[torch.Tensor, str]:
    """A target for a batch given without one: random class ids over the output's last
    dimension (a classifier's or a language model's logits), else zeros of its shape."""
    g = torch.Generator(device=output.device).manual_seed(seed)
    if output.dim() >= 2 and output.shape[-1] >= 2:
        y = torch.randint(0, output.shape[-1], output.shape[:-1], device=output.device, generator=g)
        return y, f"random class ids in [0, {output.shape[-1]}) (no target given)"
    return torch.zeros_like(output), "zeros of the output's shape (no target given)"


@dataclass
class Batch:
    """One checked batch: ``inputs`` (what the model is called on), ``target``, the loss and
    what the report says about them."""

    inputs: object
    target: torch.Tensor
    loss_fn: Callable
    loss_text: str
    size: int
    shape: str
    loss_name: str = "loss"


@contextmanager
def naming_layer(model: nn.Module, shape: str) -> Iterator[None]:
    """Run a forward pass that, if it fails, raises a ValueError naming the innermost layer it
    failed in and the batch's shape (a wrong batch shape, a dtype the model does not take)."""
    stack: list = []
    handles = []

    def leave(module, inputs, output):  # returns None: a forward hook's value would replace output
        if stack:
            stack.pop()

    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(
                lambda m, i, name=name: stack.append(name) and None))
            handles.append(module.register_forward_hook(leave))
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised with the layer named
        where = f"in layer '{stack[-1]}' ({type(dict(model.named_modules())[stack[-1]]).__name__})" \
            if stack else "outside any layer"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"the model's forward failed {where} on a batch of shape {shape}: "
                         f"{type(exc).__name__}: {first}. Check the batch shape and dtype the "
                         f"model expects") from exc
    finally:
        for h in handles:
            h.remove()


def split_batch(batch):
    """``(inputs, target)`` from a batch: a 2-tuple/list whose second item is a tensor is
    ``(inputs, target)`` (pass a model of two inputs as ``((a, b), target)`` or a dict); a tensor
    or a tuple/list/dict of tensors is inputs alone (target None)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and _is_tensors(batch[0]) \
            and isinstance(batch[1], torch.Tensor):
        return batch[0], batch[1]
    if _is_tensors(batch):
        return batch, None
    raise ValueError(f"batch must be a tensor of inputs, a tuple/list/dict of input tensors, or "
                     f"(inputs, target); got {type(batch).__name__}")


def check_batch(model: nn.Module, batch, loss_fn: Optional[Callable], device) -> Batch:
    """Check ``batch`` (``split_batch``) against ``model`` (the doctor's working copy) with one
    forward pass in eval mode (no statistics move; the mode is put back), and choose the loss (``default_loss`` unless ``loss_fn`` is given; a target is
    made with ``made_target`` when the batch has none)."""
    inputs, target = split_batch(batch)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, target); got {loss_fn!r}")
    inputs = move(inputs, device)
    shape = shape_text(inputs)
    check_not_empty(inputs, shape)
    with kept_modes(model, False), torch.no_grad(), naming_layer(model, shape):
        out = Call(model)(inputs)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise ValueError(f"the model's output must hold a floating-point tensor to take a loss "
                         f"of; got {type(out).__name__}")
    if target is None:
        target, against = made_target(out)
    else:
        target, against = target.to(device), "the target given"
    if target.dim() and target.shape[0] == 0:
        raise ValueError(f"the target must hold at least one sample; got shape "
                         f"{tuple(target.shape)}")
    if loss_fn is not None:
        text = f"the loss_fn given, against {against}"
        name = loss_name(loss_fn)
    elif is_class_ids(target):
        text, name = f"cross-entropy against {against}", "cross_entropy"
    else:
        text, name = f"mean squared error against {against}", "mse_loss"
    chosen = loss_fn or default_loss
    try:
        loss = chosen(out, target)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the loss failed on the model's output {tuple(out.shape)} and the "
                         f"target {tuple(target.shape)}: {type(exc).__name__}: {exc}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn must return a single-number tensor (a scalar loss)")
    return Batch(inputs, target, chosen, text, batch_size(inputs), shape, name)


def work_copy(model: nn.Module, device) -> nn.Module:
    """A deep copy of ``model`` on ``device``, in training mode as the shared trainer puts it: a
    model in training mode keeps each module's own mode (a BatchNorm or dropout the learner put
    in eval mode stays so, and is measured as the learner runs it); a model wholly in eval mode
    is put in training mode. The doctor trains and hooks the copy, so the learner's model is
    never touched."""
    try:
        clone = copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"model cannot be copied (copy.deepcopy failed: {type(exc).__name__}: "
                         f"{exc}); the doctor measures a copy so your model stays as it was"
                         ) from None
    clone = clone.to(device)
    if not clone.training:  # the trainer's rule (Trainer.train_step): only a model in eval mode
        clone.train()
    return clone


def as_sequence(values, name: str, allowed: Sequence[str]) -> Tuple[str, ...]:
    """A tuple of names, each one of ``allowed``; ValueError naming ``name`` otherwise."""
    if isinstance(values, str):
        values = (values,)
    try:
        values = tuple(values)
    except TypeError:
        raise ValueError(f"{name} must be names from {', '.join(allowed)} (a tuple, list or one "
                         f"name); got {values!r}") from None
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise ValueError(f"{name} must be names from {', '.join(allowed)}; got "
                         f"{', '.join(map(repr, values)) or 'none'}")
    return values
