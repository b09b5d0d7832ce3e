"""The doctor's verdict: one line per device saying what to train in, in the words of the course's
cheat sheet (``docs/cheat_sheet.md``: "No GPU with tensor cores? Stay in fp32"; "compute
capability 8.0 or more: bf16 needs no scaler"; "7.x: fp16 + GradScaler").

The verdict comes first in every form of the report (the command's output, the HTML page, the
JSON). It is decided from what was measured, in this order:

1. the model is not finite in float32: no precision helps, fix it first;
2. a CPU: stay in fp32 (mixed precision saves memory there but rarely time);
3. a CUDA GPU with native bf16: bf16 autocast (fp32's range: no overflow, no underflow to
   manage), with fp32 master weights where the weights are 16-bit now;
4. a CUDA GPU without it: fp16 + GradScaler at the advised ``init_scale`` where every fp16 check
   passed, else "fp16 is unsafe here because ..." with the first reason.

Problems no precision choice removes (a custom Function that breaks under autocast, a misused
scaler, a loss computed in 16 bits) follow as "fix first: ...".
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence


# alarms that no choice of precision removes: the verdict names them as "fix first"
FIX_FIRST = ("custom-function", "checkpoint-recompute", "loss-16bit", "reduction-16bit",
             "scaler-misuse", "scaler-resume", "16bit-optimizer-state")


def _exponent(settings: Optional[Mapping]) -> Optional[int]:
    scale = (settings or {}).get("init_scale")
    return int(round(math.log2(scale))) if scale else None


def verdict(device_type: str, device_name: str, bf16_native: bool, advice: Mapping,
            fix_first: Sequence[str] = (), weights_low: Sequence[str] = ()) -> Dict[str, object]:
    """The verdict for this device as data: ``device``, ``precision`` ("fp32", "bf16", "fp16",
    "fp32 (fp16 unsafe)" or "none"), ``init_scale_exponent`` (fp16 only), ``text`` (the one line)
    and ``fix_first`` (the problems to fix whatever the precision). ``advice`` is
    ``scale.advice``'s; ``weights_low``: the 16-bit dtypes the model's weights are stored in."""
    fixes = list(dict.fromkeys(f for f in fix_first if f))
    masters = (f"; keep fp32 master weights (your weights are {' and '.join(weights_low)} now: "
               f"see the weights finding)" if weights_low else "")
    k = None
    if str(advice.get("precision", "")) == "none (16 bits in your code)":
        precision = "none"
        text = ("fix your code first: it computes in 16 bits itself (an explicit .half()) and "
                "gives inf/NaN even in a float32 run; compute that part in float32 (see the "
                "findings for where)")
    elif str(advice.get("precision", "")).startswith("none"):
        precision = "none"
        text = ("fix the model in fp32 first: it already gives inf/NaN in float32, and no "
                "precision helps (see the findings for where)")
    elif device_type != "cuda":
        precision = "fp32"
        text = "stay in fp32: CPU (mixed precision saves memory there but rarely time)"
    elif bf16_native:
        precision = "bf16"
        text = f"train in bf16 autocast (this GPU has native bf16){masters}"
    elif advice.get("fp16_safe"):
        precision = "fp16"
        k = _exponent(advice.get("settings"))
        text = (f"fp16 + GradScaler, init_scale 2^{k} (this GPU has no native bf16)"
                if k is not None else "fp16 + GradScaler (this GPU has no native bf16)") + masters
    else:
        precision = "fp32 (fp16 unsafe)"
        why = next((line for line in advice.get("lines", []) if "not safe" in line),
                   "fp16 was not checked on this device")
        why = why.split(": ", 1)[1] if why.startswith("fp16 is not safe") and ": " in why \
            else why
        text = (f"fp16 is unsafe here because {why.rstrip('.')}; this GPU has no native bf16: "
                f"train in fp32, or keep the named layers in fp32 (selective autocast)")
    if fixes:
        text += "; fix first: " + "; ".join(fixes[:3]) + (" ..." if len(fixes) > 3 else "")
    return {"device": f"{device_type} ({device_name})", "precision": precision,
            "init_scale_exponent": k, "text": text, "fix_first": fixes}


def words(v: Mapping) -> str:
    """The verdict as the first line of the command's output and the report: ``verdict for
    DEVICE: TEXT``."""
    return f"verdict for {v['device']}: {v['text']}"


def gpu_outlook(advice: Mapping, fp16_raised: str = "", cpu_op: str = "") -> str:
    """What the measurements say for a CUDA GPU, for a report made on a CPU: bf16 where the GPU
    has it, and whether fp16 + GradScaler passed (on a GPU without bf16). ``fp16_raised``: the
    error the CPU's fp16 pass raised, if it did; that says nothing of a GPU's fp16 kernels (CPU
    fp16 autocast has no kernel for some layers: nn.LSTM), so fp16 is then "not checked".
    ``cpu_op``: the op whose inf/NaN made fp16 fail here, where CUDA autocast runs it in float32
    (``diagnose.cpu_only``): fp16 is then "not decided" for a GPU either."""
    if str(advice.get("precision", "")) == "none (16 bits in your code)":
        return "on a GPU: compute in float32 the part your code casts to 16 bits, then measure again"
    if str(advice.get("precision", "")).startswith("none"):
        return "on a GPU: fix the model in fp32 first"
    if cpu_op and not advice.get("fp16_safe"):
        return (f"on a GPU: bf16 autocast where it has native bf16; fp16 not decided by this CPU "
                f"run (its inf/NaN came from {cpu_op}, which CUDA autocast runs in float32 and "
                f"this CPU's autocast in fp16): run the doctor there")
    if fp16_raised:
        return (f"on a GPU: bf16 autocast where it has native bf16; fp16 not checked for a GPU "
                f"(the fp16 pass raised on this CPU: {fp16_raised}): run the doctor there")
    if advice.get("fp16_safe"):
        k = _exponent(advice.get("settings"))
        return (f"on a GPU: bf16 autocast where it has native bf16; otherwise fp16 + GradScaler"
                + (f", init_scale 2^{k}" if k is not None else ""))
    if advice.get("fp16_safe") is None:
        return "on a GPU: bf16 autocast where it has native bf16; fp16 not checked here"
    why = _reason(advice)
    return ("on a GPU: bf16 autocast where it has native bf16; fp16 is unsafe for this model"
            + (f" ({why})" if why else ""))


def _reason(advice: Mapping) -> str:
    """The first sentence of the advice line that says why fp16 is not safe ("" if none)."""
    lines = advice.get("lines", [])
    line = next((x for x in lines if "not safe" in x),
                next((x for x in lines if "flushed to zero" in x and "Even there" in x), ""))
    if line.startswith("fp16 is not safe") and ": " in line:
        line = line.split(": ", 1)[1]
    elif line.startswith("Even there, "):
        line = line[len("Even there, "):]
    first = line.split(". ")[0].rstrip(".")
    return first[:240]


def alarm_lines(findings: Sequence[Mapping]) -> List[str]:
    """The findings marked ``alarm``, as short texts."""
    return [str(f["finding"]) for f in findings if f.get("severity") == "alarm"]
