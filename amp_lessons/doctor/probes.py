"""One forward and backward watched op by op: where a non-finite value first appears (module
path and op), which custom autograd Functions ran and how, which reductions lost accuracy in 16
bits, which parameters received no gradient, and what dtype the loss had.

``watch(model, ...)`` is a context manager around any forward and backward of ``model`` (the
doctor runs its fp16 autocast trace and its fp32 pass inside one). It installs, for the length of
the block only:

- forward hooks on every module, so each op knows the module path it ran in;
- a ``TorchDispatchMode`` that checks every op's output: the first op whose floating output holds
  inf/NaN while its inputs were finite is the site (in the forward, with the module; in the
  backward, with the module whose gradient was being computed);
- a wrapper of ``torch.autograd.Function.apply`` that records every custom Function outside
  torch (its input dtypes, whether ``torch.amp.custom_fwd``/``custom_bwd`` decorate it, an error
  it raised, and 16-bit-capable ops its backward ran in float32: a recompute outside autocast);
- on reduction ops (sum, mean, var, norm ...) with a 16-bit output: the same op again in float32
  and the relative difference;
- post-accumulate-grad hooks: the first parameter whose gradient is inf/NaN, in backward order;
- the op an exception came from, with its module (``Watch.error_op``; an op registered outside
  torch with ``torch.library`` is named as a custom op), and such custom ops' input dtypes;
- per module, the dtypes its matmuls returned in the forward and when its forward ran again in
  the backward (a checkpoint's recompute): ``Watch.recomputes`` lists the regions that differ.

Everything is removed when the block ends, also on an error (``Watch.error_site`` then names the
custom Function or module the error came from).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_lessons.measure.dtype_trace import first_tensor

LOW = (torch.float16, torch.bfloat16)
# ops whose 16-bit result is a sum over many values: checked against float32
REDUCTIONS = {"sum", "mean", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm",
              "logsumexp", "cumsum", "prod", "nansum"}
# ops autocast runs in 16 bits (a backward that runs them in float32 recomputes outside autocast)
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
           "conv1d", "conv2d", "conv3d", "addbmm"}
# ops whose output is uninitialised memory (dropout's mask starts as empty_like): never a site
UNINITIALISED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                 "empty_permuted")
REDUCTION_LIMIT = 0.01  # a 16-bit reduction off by more than 1% of its float32 value is reported
ROOT = "the model's own forward"


def _tensors(values) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or t.numel() == 0 or bool(torch.isfinite(t).all())


def _scalar_nonfinite(values) -> bool:
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, (tuple, list)) and _scalar_nonfinite(v):
            return True
    return False


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _decorated(fn, code_name: str) -> bool:
    """Whether ``fn`` is wrapped by ``torch.amp.custom_fwd`` (``decorate_fwd``) or
    ``custom_bwd`` (``decorate_bwd``), also through further ``functools.wraps`` layers."""
    seen = 0
    while fn is not None and seen < 10:
        if getattr(getattr(fn, "__code__", None), "co_name", "") == code_name:
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def function_site(exc: BaseException) -> Optional[str]:
    """The custom autograd Function an exception was raised in (its class name), found in the
    traceback's frames (``ctx``/``self`` of a Function's forward or backward), or None."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        for key in ("ctx", "self"):
            obj = tb.tb_frame.f_locals.get(key)
            cls = getattr(type(obj), "_forward_cls", None) if obj is not None else None
            if cls is not None and not cls.__module__.startswith("torch."):
                found = cls.__name__
        tb = tb.tb_next
    return found


@dataclass
class Watch:
    """What ``watch`` saw (every field plain data; see the module docstring)."""

    forward_nonfinite: Optional[Dict[str, object]] = None
    backward_nonfinite: Optional[Dict[str, object]] = None
    first_nonfinite_parameter: Optional[str] = None
    nonfinite_parameters: int = 0
    functions: Dict[str, Dict[str, object]] = field(default_factory=dict)
    reductions: List[Dict[str, object]] = field(default_factory=list)
    no_gradient: List[str] = field(default_factory=list)
    loss_dtype: Optional[str] = None
    error: Optional[str] = None
    error_site: Optional[str] = None
    error_op: Optional[Dict[str, object]] = None
    custom_ops: Dict[str, Dict[str, object]] = field(default_factory=dict)
    recomputes: List[Dict[str, object]] = field(default_factory=list)


class _Mode(TorchDispatchMode):
    def __init__(self, watcher: "_Watcher"):
        super().__init__()
        self.w = watcher

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            try:
                self.w.on_error(func, args, kwargs)
            except Exception:  # noqa: BLE001
                pass
            raise
        try:
            self.w.on_op(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - the watch never breaks the model's own pass
            pass
        return out


class _Watcher:
    def __init__(self, model: nn.Module, low: Optional[torch.dtype]):
        self.model, self.low, self.result = model, low, Watch()
        self.stack: List[str] = []
        self.backward_module: Optional[str] = None
        self.function_stack: List[str] = []
        self.backward_function: Optional[str] = None
        self.kinds = {name or ROOT: type(m).__name__ for name, m in model.named_modules()}
        # per module, the dtypes its matmuls returned in the forward and when recomputed in the
        # backward (a checkpoint: the module's forward runs again while gradients are computed)
        self.forward_dtypes: Dict[str, set] = {}
        self.recompute_dtypes: Dict[str, set] = {}
        self.recomputed: set = set()  # modules whose forward ran during a backward

    # -- where the op runs ---------------------------------------------------------------------
    def where(self, backward: bool) -> str:
        if self.function_stack:
            return f"custom Function {self.function_stack[-1]}"
        if backward:
            if self.backward_function:
                return f"custom Function {self.backward_function}"
            return self.backward_module or "the loss"
        return self.stack[-1] if self.stack else "the loss"

    def on_error(self, func, args, kwargs) -> None:
        """The op an exception came from (the first one), with the module it ran in."""
        if self.result.error_op is not None:
            return
        backward = torch._C._current_graph_task_id() != -1
        ins = list(_tensors(list(args) + list((kwargs or {}).values())))
        self.result.error_op = {"op": _op_name(func), "custom": _custom_op(func),
                                "module": self.where(backward), "backward": backward,
                                "input_dtypes": sorted({_short(t.dtype) for t in ins
                                                        if t.is_floating_point()})}

    def on_op(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        backward = torch._C._current_graph_task_id() != -1
        outs = [t for t in _tensors([out]) if t.is_floating_point()]
        r = self.result
        if _custom_op(func) and self.low is not None and len(r.custom_ops) < 50:
            ins = list(_tensors(list(args) + list(kwargs.values())))
            rec = r.custom_ops.setdefault(_op_name(func), {
                "op": _op_name(func), "module": self.where(backward), "input_dtypes": []})
            rec["input_dtypes"] = sorted(set(rec["input_dtypes"]) | {
                _short(t.dtype) for t in ins if t.is_floating_point()})
        if not outs or name in UNINITIALISED:
            return
        if name in MATMULS and self.stack and not self.function_stack and \
                self.backward_function is None:
            # the module running now and its ancestors (a checkpoint that stops its recompute
            # early leaves stale names on the stack); in the backward only a recompute counts:
            # a module whose forward ran again there, with gradients on (backward kernels run
            # without)
            top = self.stack[-1]
            chain = {m for m in self.stack if m == top or m == ROOT or top.startswith(m + ".")}
            if backward:
                if torch.is_grad_enabled():
                    for module in chain & self.recomputed:
                        self.recompute_dtypes.setdefault(module, set()).add(
                            _short(outs[0].dtype))
            else:
                for module in chain:
                    self.forward_dtypes.setdefault(module, set()).add(_short(outs[0].dtype))
        if self.backward_function is not None and backward and name in MATMULS:
            rec = r.functions.get(self.backward_function)
            if rec is not None and self.low is not None and outs[0].dtype == torch.float32:
                rec["backward_fp32_ops"] = rec.get("backward_fp32_ops", 0) + 1
        if self.function_stack and not backward and name in MATMULS:
            rec = r.functions.get(self.function_stack[-1])
            if rec is not None and outs[0].dtype in LOW:
                rec["forward_low_ops"] = rec.get("forward_low_ops", 0) + 1
        slot = "backward_nonfinite" if backward else "forward_nonfinite"
        if getattr(r, slot) is None and not all(_finite(t) for t in outs):
            ins = list(_tensors(list(args) + list(kwargs.values())))
            if all(_finite(t) for t in ins) and not _scalar_nonfinite(list(args) +
                                                                      list(kwargs.values())):
                where = self.where(backward)
                biggest = max((float(t.detach().float().abs().max()) for t in ins
                               if t.is_floating_point() and t.numel()), default=None)
                setattr(r, slot, {"op": f"aten.{name}", "module": where,
                                  "kind": self.kinds.get(where, ""),
                                  "input_dtypes": sorted({_short(t.dtype) for t in ins
                                                          if t.is_floating_point()}),
                                  "output_dtype": _short(outs[0].dtype),
                                  "largest_input": biggest,
                                  "zero_operand": _zero_operand(name, args)})
        if not backward and name in REDUCTIONS and outs[0].dtype in LOW and \
                len(r.reductions) < 50:
            self.check_reduction(func, name, args, kwargs, outs[0])

    def check_reduction(self, func, name, args, kwargs, got: torch.Tensor) -> None:
        wide = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
        kw = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in kwargs.items() if k != "dtype"}
        ref = first_tensor(func(*wide, **kw))
        if ref is None:
            return
        ref = ref.float()
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        if not math.isfinite(scale):
            return  # the float32 value is not finite either: not the 16 bits' doing
        diff = (got.float() - ref).abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        rel = worst / scale if scale else (0.0 if worst == 0 else math.inf)
        if not math.isfinite(rel) or rel > REDUCTION_LIMIT:
            counted = next((a.numel() for a in args if isinstance(a, torch.Tensor)), 0)
            self.result.reductions.append({"op": f"aten.{name}", "module": self.where(False),
                                           "dtype": _short(got.dtype), "values": counted,
                                           "relative_difference": rel,
                                           "largest_fp32": scale})

    # -- custom autograd Functions ---------------------------------------------------------------
    def function_apply(self, original):
        watcher = self

        def apply(cls, *args, **kwargs):
            call = original.__get__(None, cls)
            if cls.__module__.startswith("torch."):
                return call(*args, **kwargs)
            name = cls.__name__
            rec = watcher.result.functions.setdefault(name, {
                "function": name, "module": watcher.stack[-1] if watcher.stack else "the loss",
                "custom_fwd": _decorated(getattr(cls, "forward", None), "decorate_fwd"),
                "custom_bwd": _decorated(getattr(cls, "backward", None), "decorate_bwd"),
                "autocast": False, "input_dtypes": [], "error": None, "calls": 0})
            rec["calls"] += 1
            device_type = next((t.device.type for t in _tensors(args)), "cpu")
            if torch.is_autocast_enabled(device_type) if _takes_device() else \
                    torch.is_autocast_enabled():
                rec["autocast"] = True
            rec["input_dtypes"] = sorted(set(rec["input_dtypes"]) | {
                _short(t.dtype) for t in _tensors(args) if t.is_floating_point()})
            watcher.function_stack.append(name)
            try:
                out = call(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - recorded, then raised as it was
                rec["error"] = rec["error"] or _text(exc)
                raise
            finally:
                watcher.function_stack.pop()
            node = getattr(first_tensor(out), "grad_fn", None)
            if node is not None:
                node.register_prehook(lambda grads, n=name: watcher._enter_backward(n))
                node.register_hook(lambda gi, go: watcher._leave_backward())
            return out

        return classmethod(apply)

    def _enter_backward(self, name: str):
        self.backward_function = name
        return None

    def _leave_backward(self):
        self.backward_function = None
        return None


def _zero_operand(name: str, args) -> bool:
    """Whether the op divides by, or takes the log / reciprocal root of, a 16-bit zero: inf/NaN
    that comes from an underflow (a value flushed to 0), not from a value too large."""
    at = {"div": 1, "div_": 1, "reciprocal": 0, "rsqrt": 0, "log": 0, "log2": 0, "log10": 0}
    i = at.get(name)
    t = args[i] if i is not None and len(args) > i else None
    return isinstance(t, torch.Tensor) and t.dtype in LOW and bool((t == 0).any())


def _op_name(func) -> str:
    """``aten.mm``, or ``mylib::my_op`` for an op registered outside torch."""
    name = func.overloadpacket.__name__
    return f"{func.namespace}::{name}" if _custom_op(func) else f"aten.{name}"


def _custom_op(func) -> bool:
    """Whether ``func`` is an op registered outside torch (``torch.library``), which autocast
    does not cast unless it registers an autocast rule."""
    return getattr(func, "namespace", "aten") not in ("aten", "prims", "prim", "_c10d_functional",
                                                      "c10d", "profiler", "quantized", "_quant")


def _takes_device() -> bool:
    try:
        torch.is_autocast_enabled("cpu")
        return True
    except TypeError:
        return False


def _text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}".rstrip(": ")


@contextmanager
def watch(model: nn.Module, low: Optional[torch.dtype] = None) -> Iterator[Watch]:
    """Watch every forward and backward of ``model`` inside the block (see the module docstring);
    ``low`` is the autocast dtype the block runs under (None: float32). Yields the ``Watch``,
    filled as the block runs; parameters without a gradient are listed when the block ends
    (those with ``requires_grad`` that no backward in the block accumulated a gradient into)."""
    w = _Watcher(model, low)
    handles = []
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    got: set = set()  # parameters a gradient was accumulated into

    def pre(name):
        def hook(module, inputs):
            w.stack.append(name)
            if torch._C._current_graph_task_id() != -1:
                w.recomputed.add(name)
        return hook

    def post(name):
        def hook(module, inputs, output):
            if w.stack and w.stack[-1] == name:
                w.stack.pop()
            for t in _tensors([output]) if not isinstance(output, dict) else \
                    _tensors(list(output.values())):
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: setattr(w, "backward_module", name))
                    break
        return hook

    for name, module in model.named_modules():
        label = name or ROOT
        handles.append(module.register_forward_pre_hook(pre(label)))
        handles.append(module.register_forward_hook(post(label)))

    def grad_hook(name):
        def hook(p):
            got.add(name)
            if p.grad is not None and p.grad.is_floating_point() and \
                    not bool(torch.isfinite(p.grad).all()):
                w.result.nonfinite_parameters += 1
                if w.result.first_nonfinite_parameter is None:
                    w.result.first_nonfinite_parameter = name
        return hook

    if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        handles += [p.register_post_accumulate_grad_hook(grad_hook(n)) for n, p in params]
    original = torch.autograd.Function.__dict__["apply"]
    torch.autograd.Function.apply = w.function_apply(original)
    mode = _Mode(w)
    try:
        with mode:
            yield w.result
    except Exception as exc:
        w.result.error = _text(exc)
        site = function_site(exc)
        if site is None:
            site = next((n for n, r in w.result.functions.items()
                         if r.get("error")), None)
        op = w.result.error_op
        if site:
            w.result.error_site = f"custom Function {site}"
        elif op and op["custom"]:
            w.result.error_site = f"custom op {op['op']} (called in {op['module']})"
        elif op:
            w.result.error_site = f"{_module_words(op['module'])}, op {op['op']}" + \
                (" (in the backward)" if op["backward"] else "")
        elif w.stack:
            w.result.error_site = _module_words(w.stack[-1])
        raise
    finally:
        w.result.recomputes = [
            {"module": m, "forward": sorted(w.forward_dtypes[m]), "recompute": sorted(d)}
            for m, d in w.recompute_dtypes.items()
            if m in w.forward_dtypes and d != w.forward_dtypes[m] and not any(
                m.startswith(o + ".") for o in w.recompute_dtypes
                if o != m and w.recompute_dtypes[o] != w.forward_dtypes.get(o))]
        torch.autograd.Function.apply = original
        for h in handles:
            h.remove()
        if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            w.result.no_gradient = [n for n, _ in params if n not in got]


def _module_words(module: str) -> str:
    return module if module in (ROOT, "the loss") or module.startswith("custom Function ") \
        else f"module {module}"


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the report writes it ("float32", "float16", ...)."""
    return _short(dtype)
