"""What the doctor is given, checked: a model (or a ``MODULE:FACTORY`` name), a batch, a loss.

Bad input raises a ``ValueError`` that says what is wrong and how to fix it: a factory that
cannot be imported (or that ends the program when imported), a model without parameters or with
parameters on the meta device, a batch that is not tensors, a pair of tensors that could be two
inputs or (inputs, target) (the message shows both ways to say it), a forward pass that fails
(the message names the layer it failed in, and the batch's shape), an output that holds several
tensors with none named ``logits`` or ``loss`` (the message lists them: pick one with
``output=``).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.numerics.modes import kept_modes
from amp_lessons.measure.dtype_trace import first_tensor, loss_name
from amp_lessons.tables import plural

# ``torchvision:resnet50`` means torchvision.models.resnet50, built without downloading weights
ZOO = {"torchvision": "torchvision.models"}


def _import(module_name: str, spec: str):
    """The module ``module_name`` names: a dotted module, or a ``.py`` file's path (imported
    under its file name, its folder first on ``sys.path`` so its own imports resolve)."""
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    path = os.path.abspath(os.path.expanduser(module_name))
    if not os.path.isfile(path):
        raise ValueError(f"model: the file {module_name!r} of {spec!r} does not exist")
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = os.path.splitext(os.path.basename(path))[0]
    found = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    try:
        found.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """The callable a ``MODULE:FACTORY`` name points to (``torchvision:resnet50`` reads
    ``torchvision.models.resnet50``; ``path/to/models.py:build`` a file's); ValueError saying
    why it cannot be loaded."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"model must be MODULE:FACTORY (e.g. mypackage.models:build, "
                         f"path/to/models.py:build or torchvision:resnet50); got {spec!r}")
    module_name, attr = spec.split(":")
    module_name = ZOO.get(module_name, module_name)
    try:
        module = _import(module_name, spec)
    except ValueError:
        raise
    except SystemExit as exc:  # a script without a __main__ guard ran its main() on import
        raise ValueError(f"model: importing {module_name!r} (of {spec!r}) ended the program "
                         f"(sys.exit({exc.code!r})): the module runs a script when imported. "
                         f"Put its top-level code under  if __name__ == '__main__':  or move the "
                         f"factory into a module that only defines things") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - any import failure is the learner's to fix
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
    except SystemExit as exc:
        raise ValueError(f"model: calling {spec!r} ended the program (sys.exit({exc.code!r})): "
                         f"a factory must return an nn.Module, not run a script") from None
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
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"model: its parameters are on the meta device and hold no data "
                         f"({meta[0]!r}{f' and {len(meta) - 1} more' if len(meta) > 1 else ''}; "
                         f"built under torch.device('meta') or an empty-weights context): "
                         f"materialise them first (model.to_empty(device=...), then initialise "
                         f"or load the weights)")
    return model


def forward_arity(model: nn.Module) -> Tuple[int, Optional[int]]:
    """``(required, most)`` positional inputs of ``model.forward``: the parameters without a
    default, and how many it takes at most (None for ``*args``, or where the signature cannot be
    read). A ``torch.compile``'d model is read through to the module it compiles."""
    inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper: forward(*args)
    forward = inner.forward if isinstance(inner, nn.Module) else model.forward
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return 0, None
    required, most = 0, 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return required, None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            most += 1
            required += p.default is p.empty
    return required, most


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


def as_float32(x):
    """``x`` with its 16-bit floating tensors (in a tuple, list or dict too) made float32: the
    batch of a model whose 16-bit weights the doctor measures on a float32 copy."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if isinstance(x, dict):
        return {k: as_float32(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(as_float32(v) for v in x)
    return x


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


def check_has_data(x, name: str) -> None:
    """ValueError naming ``name`` when a tensor of ``x`` (a tensor, or a tuple/list/dict of
    them) is on the meta device: it has a shape but no values to measure."""
    tensors = [x] if isinstance(x, torch.Tensor) else list(x.values()) if isinstance(x, dict) \
        else list(x)
    if any(t.is_meta for t in tensors):
        raise ValueError(f"{name} must hold data: its tensors are on the meta device (a shape, no "
                         f"values); pass real tensors from your data loader")


def shape_text(x) -> str:
    """The input's shape(s) as text, for messages and the report."""
    if isinstance(x, torch.Tensor):
        return "x".join(map(str, x.shape)) + f" {str(x.dtype).replace('torch.', '')}"
    items = x.items() if isinstance(x, dict) else enumerate(x)
    return ", ".join(f"{k}: {shape_text(v)}" for k, v in items)


_MISSING = object()
OUTPUT_KEYS = ("logits", "loss")  # the outputs taken by default, in this order


def output_items(out) -> List[Tuple[Union[str, int, None], torch.Tensor]]:
    """The tensors of a model's output with their keys: ``[(None, t)]`` for a tensor; the keys
    of a dict (a ``ModelOutput`` too), the fields of a dataclass or named tuple, or the indices of
    a tuple/list otherwise (entries that are not tensors left out)."""
    if isinstance(out, torch.Tensor):
        return [(None, out)]
    return [(k, v) for k, v in _entries(out) if isinstance(v, torch.Tensor)]


def _entries(out) -> List[Tuple[Union[str, int], object]]:
    """Every entry of a dict, dataclass, named tuple, tuple or list output, tensors or not."""
    if isinstance(out, dict):
        pairs = list(out.items())
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        pairs = [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    elif isinstance(out, tuple) and hasattr(out, "_fields"):
        pairs = list(zip(out._fields, out))
    elif isinstance(out, (tuple, list)):
        pairs = list(enumerate(out))
    else:
        pairs = []
    return pairs


def _describe(items) -> str:
    return ", ".join(f"{k!r} ({'x'.join(map(str, v.shape)) or 'scalar'} "
                     f"{str(v.dtype).replace('torch.', '')})" for k, v in items)


def check_output_key(output) -> Union[str, int, None]:
    """``output`` as given (None, a key string, or a whole-number index); ValueError otherwise."""
    if output is None or isinstance(output, str) or (isinstance(output, int) and
                                                      not isinstance(output, bool)):
        return output
    raise ValueError(f"output must be None (take 'logits' or 'loss' where the model returns "
                     f"several tensors), a key (a string) or an index (a whole number); got "
                     f"{output!r}")


def choose_output(out, output=None) -> Tuple[torch.Tensor, Union[str, int, None], str]:
    """Which tensor of the model's output the loss is taken of: ``(tensor, key, how)``.

    ``output`` names it (a key, field or index; an index also reads a key that is a digit string
    given on the command line). By default a lone tensor is taken as it is; of several, the one
    named ``logits``, else ``loss``; a single floating tensor among other outputs is taken with a
    note. Several tensors with neither name raise a ValueError listing them."""
    items = output_items(out)
    if not items:
        raise ValueError(f"the model's output must hold a tensor to take a loss of; got "
                         f"{type(out).__name__}")
    keys = {k: v for k, v in items}
    if output is not None:
        key = output
        if key not in keys and isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        if key not in keys and isinstance(key, int) and -len(items) <= key < len(items) and \
                all(isinstance(k, str) for k, _ in items):
            key = items[key][0]
        if key not in keys:
            other = dict(_entries(out)).get(key, _MISSING)
            if other is None:
                raise ValueError(f"output {output!r} is None for this batch (a model that "
                                 f"computes its loss returns it when given its labels: pass "
                                 f"them as an input); the model's tensor outputs are "
                                 f"{_describe(items)}")
            if other is not _MISSING:
                raise ValueError(f"output {output!r} is a {type(other).__name__}, not a tensor: "
                                 f"the loss is taken of one tensor; the model's tensor outputs "
                                 f"are {_describe(items)}")
            raise ValueError(f"output {output!r} is not among the model's outputs: "
                             f"{_describe(items)}")
        return keys[key], key, f"output {key!r} (as given)"
    if len(items) == 1 and items[0][0] is None:
        return items[0][1], None, "the model's output"
    for name in OUTPUT_KEYS:
        if name in keys:
            return keys[name], name, (f"output {name!r} (by default; the model returns "
                                      f"{_describe(items)}; choose another with output=)")
    floating = [(k, v) for k, v in items if v.is_floating_point()]
    if len(items) == 1 or len(floating) == 1:
        k, v = (items if len(items) == 1 else floating)[0]
        return v, k, f"output {k!r} (the only {'tensor' if len(items) == 1 else 'floating tensor'})"
    raise ValueError(f"the model returns {plural(len(items), 'tensor')} and none is named 'logits' or "
                     f"'loss': {_describe(items)}. Say which one the loss is taken of: "
                     f"al.doctor(..., output=KEY) in Python, --output KEY on the command line")


@contextmanager
def quiet_no_grad() -> Iterator[None]:
    """Silences the warning a reentrant ``torch.utils.checkpoint`` gives in the doctor's own
    no-grad forwards ("None of the inputs have requires_grad=True"): it is about the doctor's
    pass, not the learner's training, and would print on every run of such a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")
        yield


class Call(nn.Module):
    """``model`` called on one input object: a tensor, a tuple/list (``model(*x)``) or a dict
    (``model(**x)``), so the engine's steps (which call ``model(x)``) run any forward signature.
    It returns the output ``choose_output`` picks (``output``: a key, field or index; by default
    ``logits``, else ``loss``, of a dict, dataclass or tuple)."""

    def __init__(self, model: nn.Module, output=None):
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            out = self.model(x)
        elif isinstance(x, dict):
            out = self.model(**x)
        else:
            out = self.model(*x)
        if isinstance(out, torch.Tensor):
            return out
        return choose_output(out, self.output)[0]


def default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension for integer targets (classes, next tokens), or over
    dimension 1 where the target has the output's shape without it (a segmentation map: output
    N x C x H x W, target N x H x W, as F.cross_entropy takes them); mean squared error (in
    float32) for float targets of the output's shape."""
    if is_class_ids(target):
        dense = tuple(output.shape[:1]) + tuple(output.shape[2:])
        if output.dim() > 2 and tuple(target.shape) == dense and \
                tuple(target.shape) != tuple(output.shape[:-1]):
            return F.cross_entropy(output.float(), target.long())
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
    what the report says about them: ``output`` (the output key used, None for a lone tensor),
    ``output_text`` (which output and why) and ``read_as`` (how the batch was read)."""

    inputs: object
    target: Optional[torch.Tensor]
    loss_fn: Callable
    loss_text: str
    size: int
    shape: str
    loss_name: str = "loss"
    output: Union[str, int, None] = None
    output_text: str = "the model's output"
    read_as: str = "inputs"


CHECK_BATCH = "Check the batch shape and dtype the model expects"
CHECK_TRAINS = ("It must train in float32 before precision can be measured: a BatchNorm needs "
                "more than one sample, the output must carry a gradient (not detached or made "
                "under torch.no_grad)")


@contextmanager
def naming_layer(model: nn.Module, shape: str, what: str = "the model's forward",
                 hint: str = CHECK_BATCH) -> Iterator[None]:
    """Run a forward pass that, if it fails, raises a ValueError naming ``what`` failed, the
    innermost layer it failed in and the batch's shape, then ``hint`` (by default: a wrong batch
    shape, a dtype the model does not take)."""
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
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the layer named
        if is_out_of_memory(exc):
            raise
        where = f"in layer '{stack[-1]}' ({type(dict(model.named_modules())[stack[-1]]).__name__})" \
            if stack else "outside any layer"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{what} failed {where} on a batch of shape {shape}: "
                         f"{type(exc).__name__}: {first}. {hint}") from exc
    finally:
        for h in handles:
            h.remove()


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error of any device (CUDA's, the CPU allocator's)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or \
        "out of memory" in text or "can't allocate memory" in text


_UNSET = object()
BOTH_FORMS = ("al.doctor(model, inputs=(a, b)) for a model of two inputs (the doctor then makes a "
              "target), or al.doctor(model, inputs=x, target=y) for inputs and a target; on the "
              "command line, --input SHAPE once per input")


def split_batch(batch, model: Optional[nn.Module] = None):
    """``(inputs, target, how it was read)`` from a batch: a tensor, dict or tuple/list of tensors
    is inputs; ``((a, b), y)`` is (inputs, target). A pair of tensors ``(x, y)`` is (inputs,
    target) where ``model.forward`` takes one input; where it takes two or more, or its signature
    cannot tell, the pair is refused with a message showing both ways to say it (``inputs=`` and
    ``target=``)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and \
            isinstance(batch[0], (tuple, list, dict)) and _is_tensors(batch[0]) and \
            isinstance(batch[1], torch.Tensor):
        return batch[0], batch[1], "(inputs, target)"
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and _is_tensors(batch):
        required, most = forward_arity(model) if model is not None else (1, 1)
        if required <= 1 and most is not None:
            return batch[0], batch[1], ("(inputs, target): the model's forward takes one input"
                                        if most == 1 else
                                        "(inputs, target): the model's forward requires one input")
        takes = (f"takes {required} inputs" if required >= 2 else
                 "takes any number of inputs (*args)")
        raise ValueError(f"batch is a pair of tensors and the model's forward {takes}: it could "
                         f"be two inputs or (inputs, target). Say which: {BOTH_FORMS}")
    if _is_tensors(batch):
        return batch, None, "inputs (no target)"
    raise ValueError(f"batch must be a tensor of inputs, a tuple/list/dict of input tensors, or "
                     f"(inputs, target); got {type(batch).__name__}")


def check_batch(model: nn.Module, batch, loss_fn: Optional[Callable], device, inputs=_UNSET,
                target: Optional[torch.Tensor] = None, output=None) -> Batch:
    """Check the batch against ``model`` (the doctor's working copy) with one forward pass in
    eval mode (no statistics move; the mode is put back), choose the output (``choose_output``)
    and the loss (``default_loss`` unless ``loss_fn`` is given; a target is made with
    ``made_target`` when there is none; an output named ``loss`` that is one number is the loss
    itself, as is a lone 0-dim output given without a target or loss_fn). The batch is ``batch`` (read by ``split_batch``) or, explicitly, ``inputs=`` (a
    tensor, a tuple/list of positional inputs or a dict of keyword inputs) and ``target=``."""
    output = check_output_key(output)
    if inputs is not _UNSET:
        if batch is not None:
            raise ValueError("give the batch either as batch or as inputs= (and target=), not "
                             "both")
        if not _is_tensors(inputs):
            raise ValueError(f"inputs must be a tensor, a tuple/list of tensors (positional "
                             f"inputs) or a dict of tensors (keyword inputs); got "
                             f"{type(inputs).__name__}")
        if target is not None and not isinstance(target, torch.Tensor):
            raise ValueError(f"target must be a tensor or None; got {type(target).__name__}")
        read_as = "inputs= and target= (as given)" if target is not None else "inputs= (as given)"
    else:
        if batch is None:
            raise ValueError(f"give a batch: al.doctor(model, batch) or {BOTH_FORMS}")
        if target is not None:
            raise ValueError("target= goes with inputs=: al.doctor(model, inputs=x, target=y)")
        inputs, target, read_as = split_batch(batch, model)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable as loss_fn(output, target); got {loss_fn!r}")
    check_has_data(inputs, "inputs" if read_as.startswith("inputs=") else "batch")
    if target is not None:
        check_has_data(target, "target")
    inputs = move(inputs, device)
    shape = shape_text(inputs)
    check_not_empty(inputs, shape)
    with kept_modes(model, False), torch.no_grad(), naming_layer(model, shape), \
            quiet_no_grad():
        raw = Call(model, None)
        out_all = raw.model(inputs) if isinstance(inputs, torch.Tensor) else \
            raw.model(**inputs) if isinstance(inputs, dict) else raw.model(*inputs)
    out, key, output_text = choose_output(out_all, output)
    own = dict(output_items(out_all)).get("loss")
    if output is None and target is None and loss_fn is None and key == "logits" and \
            own is not None and own.is_floating_point() and own.numel() == 1:
        # HF style: labels went in, the model computed its loss; logits against made-up targets
        # would measure another loss than the one it trains on
        out, key = own, "loss"
        output_text = (f"output 'loss' (by default: the model computes its own loss and no "
                       f"target was given, so its logits would be measured against made-up "
                       f"targets; the model returns {_describe(output_items(out_all))}; choose "
                       f"another with output=, or give target=)")
    if not out.is_floating_point():
        raise ValueError(f"{output_text} must be a floating-point tensor to "
                         f"take a loss of; got {str(out.dtype).replace('torch.', '')}: choose "
                         f"another with output=")
    # a one-number 'loss' output, or a lone 0-dim output without a target (forward(x, y)
    # returning its loss): the model's own loss, taken as it is
    own_loss = loss_fn is None and out.numel() == 1 and (
        key == "loss" or (key is None and out.dim() == 0 and target is None))
    if own_loss:
        which = "its output 'loss'" if key == "loss" else "its one-number output"
        return Batch(inputs, target.to(device) if target is not None else None,
                     lambda o, t: o, f"the model's own loss ({which})", batch_size(inputs),
                     shape, "model's loss", key, output_text, read_as)
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
        raise ValueError(f"the loss failed on {output_text} {tuple(out.shape)} and "
                         f"the target {tuple(target.shape)}: {type(exc).__name__}: {exc}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("loss_fn must return a single-number tensor (a scalar loss)")
    return Batch(inputs, target, chosen, text, batch_size(inputs), shape, name, key, output_text,
                 read_as)


def trainer_target(inputs, target: Optional[torch.Tensor]) -> torch.Tensor:
    """The target the shared trainer and the engine are given: ``target``, or, for a model that
    returns its own loss (no target), zeros of one per sample. They take ``(inputs, target)``
    batches and count samples on the target; the model's own loss ignores it."""
    if target is not None:
        return target
    t = first_tensor(inputs)
    return torch.zeros(batch_size(inputs), device=t.device if t is not None else None)


def check_trains(model: nn.Module, run: Callable[[], torch.Tensor], shape: str) -> None:
    """One plain float32 forward and backward of ``run()`` (which returns the loss) on ``model``
    in the modes the doctor trains it in; a ValueError naming the layer where it raises. A model
    that cannot train on the batch in float32 (a BatchNorm given one sample, an output without a
    gradient, a forward that fails only in training mode) has no precision to measure, and its
    failure is not fp16's."""
    model.zero_grad(set_to_none=True)
    try:
        with naming_layer(model, shape, "the model's float32 training step (forward and "
                          "backward, in training mode)", CHECK_TRAINS):
            run().backward()
    finally:
        model.zero_grad(set_to_none=True)


def available_bytes(device) -> Optional[int]:
    """Memory free for new tensors on ``device``: CUDA's free memory, or the CPU's available
    physical memory (None where it cannot be read)."""
    device = torch.device(device)
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def check_fits(shape: Sequence[int], dtype: torch.dtype, device, what: str = "--batch-shape"
               ) -> int:
    """The bytes a tensor of ``shape`` and ``dtype`` needs; ValueError naming ``what``, the bytes
    needed and the bytes ``device`` has free where it needs more than half of them (the model's
    activations need room too)."""
    n = 1
    for d in shape:
        n *= int(d)
    need = n * torch.empty((), dtype=dtype).element_size()
    free = available_bytes(device)
    if free is not None and need > free // 2:
        raise ValueError(f"{what} {'x'.join(map(str, shape))}: the batch alone needs "
                         f"{plural(need, 'byte')} and {torch.device(device)} has {plural(free, 'byte')} free "
                         f"(the model's activations need as much again): use a smaller batch")
    return need


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
