"""Lesson 04's exercises: predict the bytes of parameters, gradients and momentum and AMP's
activation ratio (within 5% of the measured rows); put a model and its input in channels_last."""
import math
from typing import Callable, Mapping

import torch
from torch import nn

from amp_lessons.models import SmallCNN
from amp_lessons.numerics.precision import as_device
from amp_lessons.exercises.check import (Check, close, hint_book, hint_reader, is_blank, keyed, not_a_function, number,
                    passed, skipped, unanswered, within, wrong)

STATE = "Exercise 1 (predict, then run): bytes of weights, gradients and momentum"
RATIO = "Exercise 2 (predict, then run): AMP's activation memory against fp32's"
LAYOUT = "Exercise 3 (implement): channels_last"
GIB = 2 ** 30
KEYS = {"params": "params_gib", "grads": "grads_gib", "momentum": "optimizer_state_gib"}

HINTS = hint_book("ex04", {
    "state": (
        "Two questions. How many parameters does the model have (sum p.numel() over "
        "getattr(al.models, MODEL)().parameters())? And what does autocast do to the weights the "
        "optimizer holds: does it change their dtype, or only make copies for each operation?",
        "Autocast never changes the stored parameters: they keep the dtype the model was built "
        "in. The gradients take their parameter's dtype, and SGD's momentum buffer is one more "
        "tensor like each parameter.",
        "n = sum(p.numel() for p in getattr(al.models, MODEL)().parameters()); each of the three "
        "copies is float32, 4 * n bytes: state_guess = {'params': 4 * n, 'grads': 4 * n, "
        "'momentum': 4 * n}.",
    ),
    "ratio": (
        "Think of which tensors autograd saves for backward in a conv net (the inputs of "
        "convolutions, BatchNorms, ReLUs...) and which dtype each of them has under autocast.",
        "Convolutions run in 16 bits under autocast, and the layers after them follow their "
        "input's dtype, so most saved tensors take 2 bytes per value instead of 4; a few stay "
        "float32 (BatchNorm's statistics, the loss).",
        "Expect a ratio a little above 0.5. On a tiny model, autocast's 16-bit copies of the "
        "weights (saved for backward too) can even push it above 1: read the memory table after "
        "this check, the saved-activations column of the AMP and the fp32 rows, and divide.",
    ),
    "layout": (
        "channels_last changes how a tensor's values sit in memory (NHWC instead of NCHW), not "
        "its shape or values. Both the model's 4-D weights and the input need it; a module "
        "converts through the same method that moves it to a device.",
        "For the model: model.to(memory_format=...). For the input: the tensor method that "
        "returns a copy laid out in a given memory format (or .to(memory_format=...)). The "
        "format is torch's name for NHWC.",
        "return model.to(memory_format=torch.channels_last), "
        "x.contiguous(memory_format=torch.channels_last)",
    ),
})


hint = hint_reader(HINTS, __name__)


def reference_state_bytes(model: torch.nn.Module) -> dict:
    """The reference solution: 4 bytes per parameter, for each of the three fp32 copies."""
    n = sum(p.numel() for p in model.parameters())
    return {"params": 4 * n, "grads": 4 * n, "momentum": 4 * n}


def check_state_bytes(answer: Mapping[str, float], row: Mapping) -> Check:
    """Grade ``answer`` ({"params", "grads", "momentum"} -> bytes) against a measured row of
    ``al.measure`` (its ``params_gib``, ``grads_gib``, ``optimizer_state_gib``), within 5%;
    skipped, never graded, where the row holds no optimizer state (no step ran)."""
    hint = HINTS["state"]
    if is_blank(answer):
        return unanswered(STATE, hint)
    if row is None or any(row.get(c) is None for c in KEYS.values()):
        return skipped(STATE, "the row was not measured here: "
                       f"{(row or {}).get('status', 'no such row')}")
    if not row["optimizer_state_gib"]:  # no step ran: nothing to grade the momentum against
        return skipped(STATE, "the row's optimizer state is 0 bytes: no optimizer step ran "
                       "(GradScaler skipped every step); measure the row again")
    given = keyed(answer, KEYS)
    if given is None:
        return wrong(STATE, f"answer must be a dict with the keys {', '.join(KEYS)}", hint)
    answer = given
    for key, column in KEYS.items():
        got, measured = number(answer[key]), row[column] * GIB
        if got is None or not math.isfinite(got):
            return wrong(STATE, f"{key}: expected a finite number of bytes; got "
                         f"{answer[key]!r}", hint)
        if got <= 0:
            return wrong(STATE, f"{key}: you said {got:,.0f} bytes; a tensor of this model "
                         f"holds more than 0 bytes (measured {measured:,.0f})", hint)
        if close(got, 4, abs_tol=0.5) or close(got, 2, abs_tol=0.5) or close(got, 8, abs_tol=0.5):
            return wrong(STATE, f"{key}: you said {got:g} bytes, the size of one parameter's "
                         f"value; measured {measured:,.0f} for the whole model", hint.after(
                             "the question asks for the bytes of the whole tensor set: multiply "
                             "the bytes per value by the model's number of parameters"))
        if not within(got, measured, 0.05):
            ratio = got / measured if measured else float("inf")
            half = {"params": "the weights are not stored in 16 bits, autocast only casts "
                              "copies per operation",
                    "grads": "a gradient takes its parameter's dtype: the 16-bit copies' "
                             "gradients flow back into the float32 weights' .grad",
                    "momentum": "SGD's momentum buffer takes its parameter's dtype, float32"}
            why = (hint.after(f"that is 2 bytes per parameter: {half[key]}")
                   if abs(ratio - 0.5) < 0.05 else
                   hint.after("SGD keeps one momentum buffer per parameter (Adam keeps two)")
                   if key == "momentum" and abs(ratio - 2) < 0.1 else
                   hint.after("that is GiB: the question asks for bytes, 2**30 to a GiB")
                   if within(got * GIB, measured, 0.05) else
                   hint.after("that is MiB or MB: the question asks for bytes")
                   if within(got * 2 ** 20, measured, 0.05) or within(got * 1e6, measured, 0.05)
                   else hint.after("that is a count of parameters, not bytes: each float32 "
                                   "value takes 4 bytes") if within(got * 4, measured, 0.05)
                   else hint)
            return wrong(STATE, f"{key}: you said {got:,.0f} bytes, measured {measured:,.0f}"
                         if got >= 1000 else f"{key}: you said {got:.4g} bytes, measured "
                         f"{measured:,.0f}", why)
    return passed(STATE, f"each of the three copies holds {row['params_gib'] * GIB:,.0f} bytes, "
                  f"in every precision")


def check_activation_ratio(answer, amp_row: Mapping, fp32_row: Mapping) -> Check:
    """Grade ``answer`` (AMP's saved activations over fp32's) against the two measured rows'
    ``activations_gib``, within 5%."""
    hint = HINTS["ratio"]
    if is_blank(answer):
        return unanswered(RATIO, hint)
    got = number(answer)
    if got is None or not math.isfinite(got):
        return wrong(RATIO, f"answer must be a finite number; got {answer!r}", hint)
    if any(r is None or not r.get("activations_gib") for r in (amp_row, fp32_row)):
        return skipped(RATIO, "the two rows were not both measured here")
    measured = amp_row["activations_gib"] / fp32_row["activations_gib"]
    if not within(got, measured, 0.05):
        why = (hint.after("AMP does not move the activations out of memory: it halves their "
                          "bytes") if got < 0.4 else
               hint.after("AMP does save activation memory: most saved tensors are 16-bit "
                          "under autocast") if got >= 0.9 else hint)
        if measured > 1:
            why = hint.after("at this run's tiny sizes the saved tensors are mostly autocast's "
                             "16-bit copies of the weights (counted with the saved activations), "
                             "not activations: read the table's saved-activations column for "
                             "both rows")
        return wrong(RATIO, f"measured {measured:.3f}, you said {got:.3f}", why)
    return passed(RATIO, f"measured {measured:.3f}: {amp_row['activations_gib']:.3g} GiB against "
                  f"{fp32_row['activations_gib']:.3g} GiB")


def reference_channels_last(model: torch.nn.Module, x: torch.Tensor):
    """The reference solution."""
    return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


def check_channels_last(fn: Callable, device=None) -> Check:
    """Grade ``fn(model, x) -> (model, x)``: a conv net's 4-D weights and the input must come
    back channels_last, the output unchanged."""
    hint = HINTS["layout"]
    if (stub := not_a_function(LAYOUT, fn, hint)) is not None:
        return stub
    torch.manual_seed(0)
    model = SmallCNN(in_channels=3, width=8).to(as_device(device)).eval()
    x = torch.randn(2, 3, 16, 16, device=as_device(device))
    want = model(x)
    try:
        out = fn(model, x)
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
        same = torch.allclose(m(y), want, atol=1e-5, rtol=1e-4)
    except Exception as exc:  # noqa: BLE001 - the learner's model: report, do not crash
        return wrong(LAYOUT, f"the returned model failed on the returned input: "
                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", hint)
    if not same:
        return wrong(LAYOUT, "the output changed", hint.after(
            "channels_last changes the memory order, not the values or the shape"))
    return passed(LAYOUT, "weights and input are NHWC in memory, the output is the same")
