"""Lesson 04's exercises: predict the bytes of the parameters, gradients and AdamW state of the
lesson's model under AMP, and the bytes of autocast's 16-bit weight copies that one forward
saves for backward (both measured by the grader on this device, on a configuration no cell of
the lesson prints); put a model and its input in channels_last."""
import functools
from typing import Callable, Mapping

import torch
from torch import nn

from amp_lessons import models
from amp_lessons.measure.memory import SavedActivations, optimizer_state_tensors, tensor_bytes
from amp_lessons.models import SmallCNN
from amp_lessons.numerics.precision import as_device
from amp_lessons.validate import check_choice
from amp_lessons.exercises.check import (Check, graded, hint_book, hint_reader, is_blank, keyed,
                                         not_a_function, passed, read_number, tensor_problem,
                                         unanswered, within, wrong)
from amp_lessons.tables import plural

STATE = "Exercise 1 (predict, then run): bytes of weights, gradients and AdamW's state"
COPIES = "Exercise 2 (predict, then run): autocast's 16-bit copies of the weights"
LAYOUT = "Exercise 3 (implement): channels_last"
GIB = 2 ** 30
KEYS = ("params", "grads", "optimizer state")
MODELS = ("resnet18", "resnet50")  # the lesson's models (quick and full profile)
PROBE_IMAGE = 32                   # the grader's own batches: small images, a batch of 2 and 4
TOLERANCE = 0.05

HINTS = hint_book("ex04", {
    "state": (
        "Two questions. How many parameters does the model have? And which of the tensors a "
        "training step keeps per parameter does autocast touch: does it change the dtype of "
        "the weights the optimizer holds, or only make copies for each operation? Then count "
        "what AdamW keeps per parameter.",
        "Autocast never changes the stored parameters: they keep the dtype the model was built "
        "in, and a gradient takes its parameter's dtype. AdamW keeps two moments per parameter "
        "(exp_avg and exp_avg_sq), each a tensor like the parameter. Count the parameters with "
        "sum(p.numel() for p in getattr(al.models, MODEL)().parameters()).",
        "n = sum(p.numel() for p in getattr(al.models, MODEL)().parameters()); everything is "
        "float32: state_guess = {'params': 4 * n, 'grads': 4 * n, 'optimizer state': 8 * n}.",
    ),
    "copies": (
        "A convolution's backward needs its weight. Under autocast the convolution ran on a "
        "16-bit copy of that weight, not on the float32 parameter: what does autograd keep for "
        "backward, and how many bytes is that per weight value?",
        "Autocast casts each convolution's and Linear's weight to 16 bits once per forward (it "
        "caches the cast) and autograd saves that copy for backward: 2 bytes per value. "
        "BatchNorm's weights are not cast. Count the values of the 4-D convolution weights and "
        "the Linear weight.",
        "copies_guess = 2 * sum(p.numel() for p in getattr(al.models, MODEL)().parameters() "
        "if p.dim() > 1)  (the BatchNorm parameters are under 1% of the model: 2 * all "
        "parameters passes too)",
    ),
    "layout": (
        "channels_last changes how a tensor's values sit in memory (NHWC instead of NCHW), not "
        "its shape or values. Which of the two things the check gives you hold 4-D tensors "
        "whose memory order matters to a convolution?",
        "Both the model's 4-D weights and the input need it. For the model: the module method "
        "that moves it to a device also takes a memory format. For the input: the tensor "
        "method that returns a copy laid out in a given memory format. The format is torch's "
        "name for NHWC.",
        "return model.to(memory_format=torch.channels_last), "
        "x.contiguous(memory_format=torch.channels_last)",
    ),
})


hint = hint_reader(HINTS, __name__)


def _probe_model(model: str, device) -> nn.Module:
    check_choice("model", model, MODELS)
    torch.manual_seed(0)
    return getattr(models, model)().to(as_device(device))


def _half_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


@functools.lru_cache(maxsize=8)
def _state_bytes(model: str, device: str) -> tuple:
    return tuple(_measure_state_bytes(model, device).items())


def measure_state_bytes(model: str, device=None) -> dict:
    """The bytes of ``model``'s parameters, gradients and AdamW state after one AMP step
    (autocast in the device's half type, AdamW, a batch of 2 images of 32x32), counted tensor by
    tensor with ``measure.memory``: what exercise 1 is graded against. ``model`` is one of
    ``MODELS``; measured once per model and device."""
    check_choice("model", model, MODELS)
    return dict(_state_bytes(model, str(as_device(device))))


def _measure_state_bytes(model: str, device=None) -> dict:
    device = as_device(device)
    net = _probe_model(model, device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(2, 3, PROBE_IMAGE, PROBE_IMAGE, device=device)
    y = torch.randint(0, 1000, (2,), device=device)
    with torch.autocast(device.type, dtype=_half_dtype(device)):
        loss = nn.functional.cross_entropy(net(x), y)
    loss.float().backward()
    params = list(net.parameters())
    grads = tensor_bytes(p.grad for p in params if p.grad is not None)
    opt.step()
    state = [t for t in optimizer_state_tensors(opt) if t.dim() > 0]  # not the step counters
    return {"params": tensor_bytes(params), "grads": grads, "optimizer state": tensor_bytes(state)}


def measure_weight_copies(model: str, device=None) -> int:
    """The bytes of 16-bit weight copies that one autocast forward of ``model`` saves for
    backward (see ``_measure_weight_copies``); measured once per model and device."""
    check_choice("model", model, MODELS)
    return _weight_copies(model, str(as_device(device)))


@functools.lru_cache(maxsize=8)
def _weight_copies(model: str, device: str) -> int:
    return _measure_weight_copies(model, device)


def _measure_weight_copies(model: str, device=None) -> int:
    """The bytes of 16-bit weight copies that one autocast forward of ``model`` saves for
    backward, measured as the part of the saved tensors that does not grow with the batch: the
    saved bytes (``SavedActivations``, parameters left out) at a batch of 2 and of 4 images of
    32x32, ``2 * saved(2) - saved(4)`` (activations double with the batch, the copies do not).
    ``model`` is one of ``MODELS``."""
    device = as_device(device)
    net = _probe_model(model, device)
    params = list(net.parameters())
    saved = {}
    for batch in (2, 4):
        x = torch.randn(batch, 3, PROBE_IMAGE, PROBE_IMAGE, device=device)
        with torch.autocast(device.type, dtype=_half_dtype(device)):
            with SavedActivations(exclude=params) as counter:
                net(x)
        saved[batch] = counter.bytes
    return 2 * saved[2] - saved[4]


def reference_state_bytes(model: torch.nn.Module) -> dict:
    """The reference solution: 4 bytes per parameter for the weights and the gradients, 8 for
    AdamW's two moments (all float32 under AMP)."""
    n = sum(p.numel() for p in model.parameters())
    return {"params": 4 * n, "grads": 4 * n, "optimizer state": 8 * n}


def reference_weight_copies(model: torch.nn.Module) -> int:
    """The reference solution: 2 bytes per value of every weight autocast casts (the
    convolutions' and the Linear's, the parameters of more than one dimension)."""
    return 2 * sum(p.numel() for p in model.parameters() if p.dim() > 1)


def _unit_hint(hints, got: float, measured: float, per_value: str):
    """The hint for a number of bytes off by a unit or a count, else None."""
    if within(got * GIB, measured, TOLERANCE):
        return hints.after("that is GiB: the question asks for bytes, 2**30 to a GiB")
    if within(got * 2 ** 20, measured, TOLERANCE) or within(got * 1e6, measured, TOLERANCE):
        return hints.after("that is MiB or MB: the question asks for bytes")
    if 0 < got < 16:
        return hints.after(f"that is the size of one value; the question asks for the bytes of "
                           f"the whole set: multiply {per_value} by the number of values")
    return None


def _bytes(value: float) -> str:
    """A number of bytes as a message writes it, with its unit: whole and grouped from 1,000 on,
    else with its digits (a GiB answer of 0.0437 must not read as 0)."""
    number = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return number + (" byte" if value == 1 else " bytes")


@graded
def check_state_bytes(answer: Mapping[str, float], model: str = "resnet18",
                      device=None) -> Check:
    """Grade ``answer`` ({"params", "grads", "optimizer state"} -> bytes) for ``model`` (one of
    ``MODELS``) trained under AMP with AdamW, within 5% of ``measure_state_bytes`` on
    ``device``. A wrong grade names the wrong part and the likely mistake, never the bytes
    (shown from the third attempt)."""
    hint = HINTS["state"]
    if is_blank(answer):
        return unanswered(STATE, hint)
    measured = measure_state_bytes(model, device)  # the reference first
    reveal = ", ".join(f"{k}: {plural(measured[k], 'byte')}" for k in KEYS)
    given = keyed(answer, KEYS)
    if given is None:
        return wrong(STATE, f"answer must be a dict with the keys {', '.join(map(repr, KEYS))}",
                     hint)
    for key in KEYS:
        got, bad = read_number(given[key], key)
        if bad:
            return wrong(STATE, bad, hint)
        want = measured[key]
        if got <= 0:
            return wrong(STATE, f"{key}: you said {_bytes(got)}; a tensor of this model "
                         f"holds more than 0", hint, reveal)
        if within(got, want, TOLERANCE):
            continue
        ratio = got / want
        why = _unit_hint(hint, got, want, "the bytes per value")
        if why is None:
            why = (hint.after({
                "params": "2 bytes per value: autocast does not store the weights in 16 bits, it "
                          "casts copies per operation",
                "grads": "2 bytes per value: a gradient takes its parameter's dtype, and the "
                         "16-bit copies' gradients flow back into the float32 weights' .grad",
                "optimizer state": "that is half of AdamW's state: one tensor per parameter "
                                   "(SGD's momentum), or two in 16 bits; count AdamW's tensors "
                                   "per parameter and their dtype"}[key])
                if abs(ratio - 0.5) < 0.05 else
                hint.after("that is a count of values, not bytes: each float32 value takes 4 "
                           "bytes") if within(got * 4, want, TOLERANCE) else hint)
        way = "too many" if got > want else "too few"
        return wrong(STATE, f"{key}: {_bytes(got)} is {way}", why, reveal)
    return passed(STATE, ", ".join(f"{k} {plural(measured[k], 'byte')}" for k in KEYS)
                  + f": measured after one AMP step of {model} with AdamW")


@graded
def check_weight_copies(answer, model: str = "resnet18", device=None) -> Check:
    """Grade ``answer``: the bytes of 16-bit weight copies that one autocast forward of
    ``model`` (one of ``MODELS``) saves for backward, within 5% of ``measure_weight_copies`` on
    ``device``. A wrong grade names the likely mistake, never the bytes (shown from the third
    attempt)."""
    hint = HINTS["copies"]
    if is_blank(answer):
        return unanswered(COPIES, hint)
    measured = measure_weight_copies(model, device)  # the reference first
    reveal = plural(measured, "byte")
    got, bad = read_number(answer, "copies_guess")
    if bad:
        return wrong(COPIES, bad, hint)
    if within(got, measured, TOLERANCE):
        return passed(COPIES, f"{plural(measured, 'byte')} of 16-bit weight copies, saved for backward "
                      f"whatever the batch: at this lesson's GPU batch they are a sliver of the "
                      f"activations; at the quick profile's 4 images of 32x32 they are most of "
                      f"what autocast saves")
    ratio = got / measured if measured else float("inf")
    why = _unit_hint(hint, got, measured, "2 bytes") if got > 0 else None
    if why is None:
        why = (hint.after("twice the copies: either 4 bytes per value (the copies are 16-bit, "
                          "2 bytes each) or two copies per weight (autocast caches its cast: one "
                          "copy per weight per forward)") if abs(ratio - 2) < 0.1 else
               hint.after("that is a count of values, not bytes: each 16-bit value takes 2")
               if abs(ratio - 0.5) < 0.03 else
               hint.after("autocast does keep copies: a convolution's backward needs the weight "
                          "it multiplied, and under autocast that is the 16-bit cast, saved for "
                          "backward like an activation") if got < 0.05 * measured else hint)
    way = "too many" if got > measured else "too few"
    return wrong(COPIES, f"{_bytes(got)} is {way}", why, reveal)


def reference_channels_last(model: torch.nn.Module, x: torch.Tensor):
    """The reference solution."""
    return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


@graded
def check_channels_last(fn: Callable, device=None) -> Check:
    """Grade ``fn(model, x) -> (model, x)``: a conv net's 4-D weights and the input must come
    back channels_last, on the device they came on, the output unchanged. The reference output
    is computed first; ``fn`` gets copies of the model and the input."""
    hint = HINTS["layout"]
    if (stub := not_a_function(LAYOUT, fn, hint)) is not None:
        return stub
    import copy
    device = as_device(device)
    torch.manual_seed(0)
    model = SmallCNN(in_channels=3, width=8).to(device).eval()
    x = torch.randn(2, 3, 16, 16, device=device)
    with torch.no_grad():
        want = model(x)
    try:
        out = fn(copy.deepcopy(model), x.clone())
    except Exception as exc:  # noqa: BLE001 - the learner's code: report, do not crash
        return wrong(LAYOUT, f"{type(exc).__name__}: {exc}", hint)
    if is_blank(out):
        return unanswered(LAYOUT, hint)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return wrong(LAYOUT, f"return two things, (model, x); got {type(out).__name__}", hint)
    m, y = out
    if isinstance(m, torch.Tensor) and isinstance(y, nn.Module):
        return wrong(LAYOUT, "the two are swapped: return (model, x), the model first",
                     hint.after("the check unpacks model, x = fn(model, x): return them in "
                                "that order"))
    if isinstance(y, torch.Tensor) and (problem := tensor_problem(y, device, want.dtype,
                                                                  "the input")) is not None:
        return wrong(LAYOUT, problem, hint.after(
            "channels_last changes the memory order only: convert with "
            "memory_format=torch.channels_last and nothing else (no device, no dtype)"))
    if isinstance(m, nn.Module) and (bad := next((tensor_problem(p, device, want.dtype,
                                                                 "a weight of the model")
                                                  for p in m.parameters()
                                                  if tensor_problem(p, device, want.dtype)),
                                                 None)) is not None:
        return wrong(LAYOUT, bad, hint.after(
            "channels_last changes the memory order only: convert with "
            "memory_format=torch.channels_last and nothing else (no device, no dtype)"))
    if not isinstance(m, nn.Module) or not isinstance(y, torch.Tensor):
        return wrong(LAYOUT, f"return (model, x), a module and a tensor; got "
                     f"({type(m).__name__}, {type(y).__name__})", hint)
    cl = torch.channels_last
    weights = [p for p in m.parameters() if p.dim() == 4]
    dtypes = {p.dtype for p in m.parameters()} | {y.dtype}
    if dtypes != {want.dtype}:
        return wrong(LAYOUT, f"the model or the input changed dtype ({', '.join(sorted(map(str, dtypes)))}; "
                     f"it was {want.dtype})", hint.after(
                         "channels_last changes the memory order only: convert with "
                         "memory_format=torch.channels_last and nothing else (no .half())"))
    if y.shape != x.shape:
        return wrong(LAYOUT, f"the input's shape changed to {tuple(y.shape)} (it was "
                     f"{tuple(x.shape)})", hint.after(
                         "channels_last keeps the shape (N, C, H, W) and changes the memory "
                         "order: use memory_format, not permute"))
    if not all(p.is_contiguous(memory_format=cl) for p in weights):
        return wrong(LAYOUT, "the convolution weights are still NCHW",
                     hint.after("model.to(memory_format=torch.channels_last) returns the model "
                                "with its 4-D weights converted"))
    if not y.is_contiguous(memory_format=cl):
        return wrong(LAYOUT, "the weights are channels_last, but the input is still NCHW",
                     hint.after("the input needs its own conversion, "
                                "x.contiguous(memory_format=torch.channels_last): same values, "
                                "NHWC in memory"))
    try:
        with torch.no_grad():
            same = torch.allclose(m(y), want, atol=1e-5, rtol=1e-4)
    except Exception as exc:  # noqa: BLE001 - the learner's model: report, do not crash
        return wrong(LAYOUT, f"the returned model failed on the returned input: "
                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", hint)
    if not same:
        return wrong(LAYOUT, "the output changed", hint.after(
            "channels_last changes the memory order, not the values or the shape"))
    return passed(LAYOUT, "weights and input are NHWC in memory, the output is the same")
