"""What autocast runs in which dtype: the trace lesson 02 introduces, reused by the doctor.

``autocast_report`` runs one forward and backward under ``torch.autocast`` and records, for every
leaf layer, the dtype of its output and of the gradient flowing back into it (and, for the
doctor, which layers' outputs held inf or NaN). ``op_dtypes`` counts the ops autocast dispatched,
by output dtype: which ran in 16 bits and which autocast kept in float32.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from amp_lessons.numerics.modes import restore_modes, saved_modes
from amp_lessons.tables import text_table


def dtype_label(dtype: torch.dtype, low: torch.dtype) -> str:
    """``"16-bit"`` for the autocast dtype ``low`` (fp16 or bf16), else the dtype's short name, so
    a table reads the same whichever half type a device uses."""
    return "16-bit" if dtype == low else str(dtype).replace("torch.", "")


def first_tensor(output) -> Optional[torch.Tensor]:
    """The first tensor in a layer's output (a tensor, or a tuple/list/dict holding tensors)."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else \
        output if isinstance(output, (tuple, list)) else ()
    for v in values:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


@dataclass
class AutocastReport:
    """What one forward + backward under autocast produced (``autocast_report``).

    ``layers``: ``(name, kind, output dtype, dtype of the gradient flowing back into that
    output)`` per leaf module, in call order; ``loss``: the loss's dtype; ``parameters`` and
    ``gradients``: the set of dtypes of the parameters and of their ``.grad``; ``low``: the
    autocast dtype; ``input``: the input batch's dtype; ``nonfinite``: names of the layers whose
    output held inf or NaN, in call order; ``loss_name``: the loss function's name (the loss
    row's kind); ``loss_finite``: whether the loss itself was finite.
    """

    layers: List[Tuple[str, str, torch.dtype, Optional[torch.dtype]]]
    loss: torch.dtype
    parameters: set
    gradients: set
    low: torch.dtype
    input: torch.dtype
    nonfinite: List[str] = field(default_factory=list)
    loss_name: str = "loss"
    loss_finite: bool = True

    def rows(self) -> List[dict]:
        """Plain rows with dtype labels ("16-bit" = the autocast dtype)."""
        lab = lambda d: "-" if d is None else dtype_label(d, self.low)  # noqa: E731
        out = [{"what": "input batch", "kind": "data", "dtype": lab(self.input), "grad": "-"}]
        out += [{"what": name, "kind": kind, "dtype": lab(dt), "grad": lab(gd)}
                for name, kind, dt, gd in self.layers]
        out.append({"what": "loss", "kind": self.loss_name, "dtype": lab(self.loss), "grad": "-"})
        out.append({"what": "every parameter", "kind": "weights",
                    "dtype": ", ".join(sorted(lab(d) for d in self.parameters)),
                    "grad": ", ".join(sorted(lab(d) for d in self.gradients))})
        return out

    def format(self) -> str:
        """A text table: each tensor's dtype and the dtype of the gradient that flows back."""
        return text_table(self.rows(), [("what", "tensor"), ("kind", "layer"), ("dtype", "dtype"),
                                        ("grad", "gradient dtype")])


def trace(model: nn.Module, run: Callable[[], torch.Tensor], device_type: str,
          dtype: torch.dtype, input_dtype: torch.dtype = torch.float32,
          loss_name: str = "loss") -> AutocastReport:
    """Call ``run()`` (forward and loss of ``model``) under ``torch.autocast(device_type, dtype)``,
    backpropagate, and record every leaf layer's output and gradient dtype (``AutocastReport``;
    ``input_dtype`` and ``loss_name`` label its input and loss rows). The pass runs in training
    mode as the shared trainer runs it: a model in training mode keeps each module's own mode (a
    frozen BatchNorm stays in eval mode), a model wholly in eval mode is put in training mode;
    every module's mode comes back afterwards. Gradients are cleared afterwards; BatchNorm
    statistics move as in any training forward."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16; got {dtype!r}")
    layers: list = []
    grads: Dict[int, torch.dtype] = {}
    bad: List[str] = []
    handles = []

    def hook(module, inputs, output, name=None):
        out = first_tensor(output)
        if out is None:
            return
        index = len(layers)
        layers.append([name, type(module).__name__, out.dtype, None])
        if out.is_floating_point() and not bool(torch.isfinite(out).all()):
            bad.append(name)
        if out.requires_grad:
            out.register_hook(lambda g, i=index: grads.__setitem__(i, g.dtype))

    for name, module in model.named_modules():
        if name and not list(module.children()):
            handles.append(module.register_forward_hook(
                lambda m, i, o, name=name: hook(m, i, o, name)))
    modes = saved_modes(model)  # each module's own mode comes back afterwards
    if not model.training:  # the trainer's rule: a frozen BatchNorm in a training model stays so
        model.train()
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device_type, dtype=dtype):
            loss = run()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        restore_modes(modes)
    report = AutocastReport(
        layers=[(n, k, d, grads.get(i)) for i, (n, k, d, _) in enumerate(layers)],
        loss=loss.dtype, parameters={p.dtype for p in model.parameters()},
        gradients={p.grad.dtype for p in model.parameters() if p.grad is not None},
        low=dtype, input=input_dtype, nonfinite=list(dict.fromkeys(bad)), loss_name=loss_name,
        loss_finite=bool(torch.isfinite(loss.detach()).all()))
    model.zero_grad(set_to_none=True)
    return report


def autocast_report(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device_type: str,
                    dtype: torch.dtype, loss_fn: Callable = F.cross_entropy) -> AutocastReport:
    """Run one forward + backward of ``model`` under ``torch.autocast(device_type, dtype)`` and
    record the dtype of every leaf layer's output, of the gradient flowing back into it, of the
    loss, of the parameters and of their gradients (lesson 02). Gradients are cleared afterwards;
    BatchNorm statistics move as in any training forward."""
    return trace(model, lambda: loss_fn(model(x), y), device_type, dtype, x.dtype,
                 loss_name(loss_fn))


def loss_name(loss_fn: Callable) -> str:
    """What a trace row calls ``loss_fn``: its function or class name ("loss_fn" for a lambda)."""
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    return "loss_fn" if name == "<lambda>" else name


def op_dtypes(run: Callable[[], torch.Tensor], device_type: str,
              dtype: torch.dtype) -> List[Dict[str, object]]:
    """The ops one forward (``run()``) dispatches under autocast, counted by output dtype: one row
    per op with ``op``, ``dtype`` (its output's, labelled as in ``dtype_label``) and ``calls``,
    16-bit ops first (views and in-place ops left out). An op autocast keeps in float32
    (softmax, layer_norm, the loss) shows it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            t = first_tensor(out)
            if t is not None and t.is_floating_point() and not getattr(func, "is_view", False):
                name = func.overloadpacket.__name__
                if not name.endswith("_") and name not in ("detach", "view", "t", "_to_copy",
                                                           "clone", "copy", "alias"):
                    seen[(name, t.dtype)] += 1
            return out

    with torch.no_grad(), torch.autocast(device_type=device_type, dtype=dtype), _Count():
        run()
    rows = [{"op": op, "dtype": dtype_label(dt, dtype), "calls": n}
            for (op, dt), n in seen.items()]
    return sorted(rows, key=lambda r: (r["dtype"] != "16-bit", r["op"]))
