"""Lesson 04's exercises: predict the bytes of parameters, gradients and momentum and AMP's
activation ratio (within 5% of the measured rows); put a model and its input in channels_last."""
from typing import Callable, Mapping

import torch

from ..models import SmallCNN
from ..precision import as_device
from .check import Check, is_blank, number, passed, skipped, unanswered, within, wrong

STATE = "Exercise 1 (predict, then run): bytes of weights, gradients and momentum"
RATIO = "Exercise 2 (predict, then run): AMP's activation memory against fp32's"
LAYOUT = "Exercise 3 (implement): channels_last"
GIB = 2 ** 30
KEYS = {"params": "params_gib", "grads": "grads_gib", "momentum": "optimizer_state_gib"}


def reference_state_bytes(model: torch.nn.Module) -> dict:
    """The reference solution: 4 bytes per parameter, for each of the three fp32 copies."""
    n = sum(p.numel() for p in model.parameters())
    return {"params": 4 * n, "grads": 4 * n, "momentum": 4 * n}


def check_state_bytes(answer: Mapping[str, float], row: Mapping) -> Check:
    """Grade ``answer`` ({"params", "grads", "momentum"} -> bytes) against a measured row of
    ``al.measure`` (its ``params_gib``, ``grads_gib``, ``optimizer_state_gib``), within 5%."""
    hint = ("count the parameters (sum(p.numel() for p in model.parameters())); autocast keeps "
            "the weights fp32, so each copy is 4 bytes per parameter")
    if is_blank(answer):
        return unanswered(STATE, hint)
    if row is None or any(row.get(c) is None for c in KEYS.values()):
        return skipped(STATE, "the row was not measured here: "
                       f"{(row or {}).get('status', 'no such row')}")
    if not isinstance(answer, Mapping) or set(answer) != set(KEYS):
        return wrong(STATE, f"answer must be a dict with the keys {', '.join(KEYS)}", hint)
    for key, column in KEYS.items():
        got, measured = number(answer[key]), row[column] * GIB
        if got is None:
            return wrong(STATE, f"{key}: expected a number of bytes; got {answer[key]!r}", hint)
        if not within(got, measured, 0.05):
            ratio = got / measured if measured else float("inf")
            why = ("that is 2 bytes per parameter: the weights are not stored in 16 bits, "
                   "autocast only casts copies per operation" if abs(ratio - 0.5) < 0.05 else
                   "that counts GiB or millions, not bytes" if ratio < 1e-3 else hint)
            return wrong(STATE, f"{key}: you said {got:,.0f} bytes, measured {measured:,.0f}", why)
    return passed(STATE, f"each of the three copies holds {row['params_gib'] * GIB:,.0f} bytes, "
                  f"in every precision")


def check_activation_ratio(answer, amp_row: Mapping, fp32_row: Mapping) -> Check:
    """Grade ``answer`` (AMP's saved activations over fp32's) against the two measured rows'
    ``activations_gib``, within 5%."""
    hint = ("most saved activations are outputs of convolutions, which autocast computes in 16 "
            "bits: 2 bytes instead of 4; a few (BatchNorm's statistics, the loss) stay fp32")
    if is_blank(answer):
        return unanswered(RATIO, hint)
    got = number(answer)
    if got is None:
        return wrong(RATIO, f"answer must be a number; got {answer!r}", hint)
    if any(r is None or not r.get("activations_gib") for r in (amp_row, fp32_row)):
        return skipped(RATIO, "the two rows were not both measured here")
    measured = amp_row["activations_gib"] / fp32_row["activations_gib"]
    if not within(got, measured, 0.05):
        why = ("AMP does not move the activations out of memory: it halves their bytes"
               if got < 0.4 else "AMP does save activation memory" if got >= 0.9 else hint)
        if measured > 1:
            why = ("at this run's tiny sizes the saved tensors are mostly autocast's 16-bit "
                   "copies of the weights (counted with the saved activations), not activations: "
                   "read the table's saved-activations column for both rows")
        return wrong(RATIO, f"measured {measured:.3f}, you said {got:.3f}", why)
    return passed(RATIO, f"measured {measured:.3f}: {amp_row['activations_gib']:.3g} GiB against "
                  f"{fp32_row['activations_gib']:.3g} GiB")


def reference_channels_last(model: torch.nn.Module, x: torch.Tensor):
    """The reference solution."""
    return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


def check_channels_last(fn: Callable, device=None) -> Check:
    """Grade ``fn(model, x) -> (model, x)``: a conv net's 4-D weights and the input must come
    back channels_last, the output unchanged."""
    hint = ("model.to(memory_format=torch.channels_last) rewrites the 4-D weights; the input "
            "needs x.contiguous(memory_format=torch.channels_last) (or .to(memory_format=...))")
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
    if not (isinstance(out, tuple) and len(out) == 2):
        return wrong(LAYOUT, "return (model, x)", hint)
    m, y = out
    cl = torch.channels_last
    weights = [p for p in m.parameters() if p.dim() == 4]
    if not all(p.is_contiguous(memory_format=cl) for p in weights):
        return wrong(LAYOUT, "the convolution weights are still NCHW",
                     "model.to(memory_format=torch.channels_last) returns the model converted")
    if not y.is_contiguous(memory_format=cl):
        return wrong(LAYOUT, "the input is still NCHW", "x.contiguous(memory_format=torch."
                     "channels_last): same values, NHWC in memory")
    if not torch.allclose(m(y), want, atol=1e-5, rtol=1e-4):
        return wrong(LAYOUT, "the output changed", "channels_last changes the memory order, "
                     "not the values or the shape")
    return passed(LAYOUT, "weights and input are NHWC in memory, the output is the same")
