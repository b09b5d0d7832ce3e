"""Facts about the number formats of mixed precision, and what they do to real values.

Introduced in lesson 01 (``notebooks/01_fp16_ranges_and_underflow.ipynb``), reused by lesson 03.
Facts only: the lessons set these beside what articles say (``lessons/l01_ranges.py``).

- ``FORMATS`` / ``format_facts()``: fp32, tf32, fp16, bf16, fp8 e4m3fn and e5m2 as IEEE 754 and
  the OCP 8-bit floating point specification define them: exponent and mantissa bits, largest
  finite value, smallest normal and subnormal, machine epsilon, decimal digits.
- ``round_to`` / ``round_trip`` / ``decode``: a value rounded to a format (round to nearest, ties
  to even), its error, and its bits (sign, exponent, mantissa).
- ``classify`` / ``scaled_counts`` / ``scaled_fractions`` / ``underflow_fraction`` / ``scale_sweep``:
  how many values of a tensor overflow, stay normal, become subnormal or are flushed to zero, at a
  given loss scale.
- ``collect_gradients``: per-layer gradient magnitudes of a short plain fp32 training run.
- ``measure_limits``: the range of a format measured by arithmetic on a device.

Rounding here follows the specifications by formula (exact in float64), so it is the same on every
machine and torch version. Where torch has the dtype, the tests check that torch's own cast agrees
(torch 2.x saturates an fp8 e4m3fn cast at +-448 instead of giving NaN; lesson 01 shows it).
TF32 has no torch dtype: it is fp32 with the mantissa rounded to 10 bits, which is what
``round_to(x, "tf32")`` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from amp_lessons.tables import percent, text_table
from amp_lessons.lineage import traced  # explain names what made each row

__all__ = [
    "FormatInfo", "FORMATS", "FORMAT_NAMES", "get_format", "format_facts", "format_facts_text",
    "round_to", "RoundTrip", "round_trip", "Decoded", "decode", "bits_table_text",
    "Classification", "classify", "check_scale", "scaled_counts", "scaled_fractions",
    "underflow_fraction", "scale_sweep", "gradient_summary", "gradient_summary_rows",
    "gradient_summary_text", "collect_gradients", "measure_limits", "accumulate", "KINDS",
    "band_limits", "SWAMPING_RUNS", "swamping_runs", "swamping_rows", "best_scale_exponent",
    "scale_report", "ulp",
]

# --- the formats ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FormatInfo:
    """One binary floating-point format: its layout and the limits that follow from it.

    ``bias`` is the exponent bias; ``min_exponent`` the exponent of the smallest normal (its
    subnormals share it); ``max_exponent`` the exponent of the largest finite value. ``has_inf``
    is False for fp8 e4m3fn, which spends its all-ones exponent on finite values and NaN only.
    ``source`` says where the limits came from: ``torch.finfo`` or ``formula``.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    decimal_digits: float
    has_inf: bool
    torch_dtype_name: Optional[str]
    source: str
    note: str = ""

    @property
    def bits(self) -> int:
        """Total width: sign + exponent + mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal number (1 - bias)."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite number."""
        return math.frexp(self.max)[1] - 1

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The torch dtype that stores this format, or None (tf32; fp8 on a torch without it)."""
        return getattr(torch, self.torch_dtype_name, None) if self.torch_dtype_name else None

    @property
    def layout(self) -> str:
        """Bit layout as ``sign/exponent/mantissa``, e.g. ``1/5/10`` for fp16."""
        return f"1/{self.exponent_bits}/{self.mantissa_bits}"


def _by_formula(exponent_bits: int, mantissa_bits: int, fn: bool = False) -> dict:
    """Limits of a binary format from its widths (IEEE 754; ``fn``: OCP's finite-and-NaN-only)."""
    bias = 2 ** (exponent_bits - 1) - 1
    emin = 1 - bias
    if fn:
        # e4m3fn: the all-ones exponent holds finite values too, except mantissa all-ones (NaN).
        emax = bias + 1
        largest = (2 - 2 * 2.0 ** -mantissa_bits) * 2.0 ** emax
    else:
        emax = bias
        largest = (2 - 2.0 ** -mantissa_bits) * 2.0 ** emax
    return dict(bias=bias, max=largest, smallest_normal=2.0 ** emin,
                smallest_subnormal=2.0 ** (emin - mantissa_bits), eps=2.0 ** -mantissa_bits,
                decimal_digits=(mantissa_bits + 1) * math.log10(2))


def _from_finfo(dtype_name: str, formula: dict) -> tuple:
    """Limits from ``torch.finfo`` where torch has the dtype; the formula's otherwise."""
    dtype = getattr(torch, dtype_name, None)
    if dtype is None:
        return formula, "formula"
    fi = torch.finfo(dtype)
    facts = dict(formula, max=float(fi.max), smallest_normal=float(fi.smallest_normal),
                 eps=float(fi.eps),
                 # finfo has no subnormal entry: the smallest subnormal is one unit in the last
                 # place of the smallest normal.
                 smallest_subnormal=float(fi.smallest_normal) * float(fi.eps))
    return facts, "torch.finfo"


def _make(name, e, m, dtype_name, fn=False, note="", use_finfo=True) -> FormatInfo:
    formula = _by_formula(e, m, fn)
    facts, source = _from_finfo(dtype_name, formula) if (dtype_name and use_finfo) else (formula, "formula")
    return FormatInfo(name=name, exponent_bits=e, mantissa_bits=m, has_inf=not fn,
                      torch_dtype_name=dtype_name, source=source, note=note, **facts)


FORMATS: Dict[str, FormatInfo] = {
    f.name: f for f in (
        _make("fp32", 8, 23, "float32", note="IEEE 754 binary32"),
        _make("tf32", 8, 10, None, note="NVIDIA TensorFloat-32: fp32 range, 10-bit mantissa; "
                                        "a tensor-core math mode, no storage dtype"),
        _make("fp16", 5, 10, "float16", note="IEEE 754 binary16"),
        _make("bf16", 8, 7, "bfloat16", note="bfloat16: fp32 range, 7-bit mantissa"),
        _make("fp8_e4m3fn", 4, 3, "float8_e4m3fn", fn=True,
              note="OCP FP8 E4M3: no infinity, NaN = all ones, max 448"),
        _make("fp8_e5m2", 5, 2, "float8_e5m2", note="OCP FP8 E5M2: IEEE-style, has infinity"),
    )
}
FORMAT_NAMES = tuple(FORMATS)

_ALIASES = {
    "float32": "fp32", "float": "fp32", "single": "fp32", "binary32": "fp32",
    "tensorfloat32": "tf32", "tensorfloat-32": "tf32",
    "float16": "fp16", "half": "fp16", "binary16": "fp16",
    "bfloat16": "bf16",
    "e4m3fn": "fp8_e4m3fn", "e4m3": "fp8_e4m3fn", "float8_e4m3fn": "fp8_e4m3fn",
    "fp8e4m3fn": "fp8_e4m3fn", "fp8_e4m3": "fp8_e4m3fn",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "fp8e5m2": "fp8_e5m2",
}


def get_format(fmt: Union[str, FormatInfo, torch.dtype], setting: str = "fmt") -> FormatInfo:
    """Look a format up by name (``"fp16"``, ``"bf16"``, ...), alias, torch dtype or FormatInfo.
    Raises ``ValueError`` naming ``setting`` and listing the allowed names for anything else."""
    if isinstance(fmt, FormatInfo):
        return fmt
    if isinstance(fmt, torch.dtype):
        for info in FORMATS.values():
            if info.torch_dtype == fmt:
                return info
        raise ValueError(f"{setting} must be one of {', '.join(FORMAT_NAMES)} (or their torch "
                         f"dtypes); got {fmt}")
    if isinstance(fmt, str):
        key = fmt.strip().lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"{setting} must be one of {', '.join(FORMAT_NAMES)}; got {fmt!r}")


def _pow2(value: float) -> str:
    """``2^k`` when ``value`` is a power of two, else ``''``."""
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 else ""


def format_infos(names=None, setting: str = "names") -> List[FormatInfo]:
    """The formats ``names`` asks for: None for all of them, one name (``"fp16"``, a dtype) or a
    sequence of names; ValueError naming ``setting`` for an empty sequence or an unknown name."""
    if isinstance(names, (str, FormatInfo, torch.dtype)):
        names = [names]
    names = list(FORMAT_NAMES if names is None else names)
    if not names:
        raise ValueError(f"{setting} must name at least one format of "
                         f"{', '.join(FORMAT_NAMES)} (None for all of them); got an empty list")
    return [get_format(n, setting) for n in names]


# 2**k is a finite, nonzero float64 for k in this range (scales and scale sweeps)
SCALE_EXPONENT_RANGE = (-1074, 1023)


def check_scale_exponent(k, setting: str = "exponents") -> int:
    """``k`` as an int when ``2**k`` is a finite, nonzero float64 (``SCALE_EXPONENT_RANGE``);
    ValueError naming ``setting`` otherwise (3.5 is refused, not truncated)."""
    lo, hi = SCALE_EXPONENT_RANGE
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not lo <= k <= hi:
        raise ValueError(f"{setting} must be integers in [{lo}, {hi}] (2**k a finite, nonzero "
                         f"float64); got {k!r}")
    return int(k)


def format_facts(names: Optional[Sequence[str]] = None) -> List[dict]:
    """One row (a dict) per format: layout, limits, epsilon, decimal digits, infinity."""
    infos = format_infos(names)
    return [dict(format=f.name, bits=f.bits, layout=f.layout, exponent_bits=f.exponent_bits,
                 mantissa_bits=f.mantissa_bits, bias=f.bias, max=f.max,
                 smallest_normal=f.smallest_normal, smallest_subnormal=f.smallest_subnormal,
                 eps=f.eps, decimal_digits=round(f.decimal_digits, 2), has_inf=f.has_inf)
            for f in infos]


def format_facts_text(names: Optional[Sequence[str]] = None) -> str:
    """``format_facts`` as fixed-width text: the same on every machine (a checked notebook cell)."""
    head = ("format", "s/e/m", "max", "smallest normal", "smallest subnormal", "eps",
            "digits", "inf")
    rows = []
    for r in format_facts(names):
        rows.append((r["format"], r["layout"], f"{r['max']:.5g}",
                     f"{r['smallest_normal']:.3e} = {_pow2(r['smallest_normal'])}",
                     f"{r['smallest_subnormal']:.3e} = {_pow2(r['smallest_subnormal'])}",
                     f"{r['eps']:.3e} = {_pow2(r['eps'])}", f"{r['decimal_digits']:.2f}",
                     "yes" if r["has_inf"] else "no"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip()
             for line in (head, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def band_limits(fmt: Union[str, FormatInfo, torch.dtype]) -> Dict[str, float]:
    """Where rounding to ``fmt`` changes what happens to a magnitude ``|x|``.

    ``flushed_max``: up to it (inclusive) a value rounds to zero (half the smallest subnormal;
    the tie goes to the even zero). ``smallest_subnormal`` / ``smallest_normal`` / ``max``: the
    format's limits. ``overflow_from``: from it a finite value rounds past ``max`` (for IEEE
    formats inclusive; for e4m3fn, whose max has an even mantissa, the tie still rounds to max
    and only larger values overflow).
    """
    info = get_format(fmt)
    half_ulp_at_max = 2.0 ** (info.max_exponent - info.mantissa_bits) / 2
    return {"flushed_max": info.smallest_subnormal / 2,
            "smallest_subnormal": info.smallest_subnormal,
            "smallest_normal": info.smallest_normal, "max": info.max,
            "overflow_from": info.max + half_ulp_at_max}


# --- rounding ------------------------------------------------------------------------------------

Number = Union[int, float]
TensorLike = Union[torch.Tensor, np.ndarray, Number, Sequence[Number]]


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dtype.is_floating_point and t.element_size() == 1:  # fp8: no direct float64 cast
            t = t.float()
        return t.to(device="cpu", dtype=torch.float64)
    try:
        return torch.as_tensor(np.asarray(x, dtype=np.float64))
    except OverflowError:
        raise ValueError("x must hold numbers within float64's range (magnitude at most about "
                         "1.8e308); got an integer beyond it") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"x must be a number, a sequence of numbers or a tensor; got "
                         f"{type(x).__name__} ({exc})") from None


def _round_f64(x: torch.Tensor, info: FormatInfo) -> torch.Tensor:
    """Round float64 values to ``info`` with round-to-nearest-even; overflow gives +-inf (NaN
    for formats without infinity, as OCP's non-saturating conversion does)."""
    a = x.abs()
    _, e = torch.frexp(a)
    e = torch.clamp(e - 1, min=info.min_exponent)          # floor(log2 a), at least emin
    quantum = torch.ldexp(torch.ones_like(a), (e - info.mantissa_bits).to(torch.float64))
    r = torch.round(a / quantum) * quantum                   # torch.round: ties to even; exact
    over = torch.isinf(a) | (r > info.max)
    r = torch.where(over, torch.full_like(r, math.inf if info.has_inf else math.nan), r)
    r = torch.where(torch.isnan(a), a, r)
    return torch.copysign(r, x)


def round_to(x: TensorLike, fmt: Union[str, FormatInfo, torch.dtype]) -> torch.Tensor:
    """``x`` rounded to ``fmt`` (nearest, ties to even), returned as float64 on the CPU.

    Exact for every input that float64 holds. ``round_to(x, "tf32")`` rounds the fp32 mantissa of
    ``x`` to 10 bits, which is what a TF32 tensor core does to its inputs.
    """
    info = get_format(fmt)
    return _round_f64(_as_float64(x), info)


@dataclass(frozen=True)
class RoundTrip:
    """A value and its round trip through a format: ``rounded``, ``abs_error``, ``rel_error``.

    Floats for a scalar input, float64 tensors otherwise. ``rel_error`` is 0 where the input is 0
    and NaN where the input is not finite or the rounded value is not.
    """

    fmt: str
    value: Union[float, torch.Tensor]
    rounded: Union[float, torch.Tensor]
    abs_error: Union[float, torch.Tensor]
    rel_error: Union[float, torch.Tensor]

    @property
    def max_abs_error(self) -> float:
        """Largest absolute error (NaN-safe: ignores non-finite entries)."""
        return _finite_max(self.abs_error)

    @property
    def max_rel_error(self) -> float:
        """Largest relative error over the finite entries."""
        return _finite_max(self.rel_error)


def _finite_max(t) -> float:
    t = torch.as_tensor(t, dtype=torch.float64).reshape(-1)
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else math.nan


def round_trip(x: TensorLike, fmt: Union[str, FormatInfo, torch.dtype]) -> RoundTrip:
    """Round ``x`` to ``fmt`` and back; return the rounded value and its absolute/relative error."""
    info = get_format(fmt)
    scalar = isinstance(x, (int, float)) and not isinstance(x, bool)
    v = _as_float64(x)
    r = _round_f64(v, info)
    abs_err = (r - v).abs()
    rel = torch.where(v == 0, torch.zeros_like(v), abs_err / v.abs())
    rel = torch.where(torch.isfinite(v) & torch.isfinite(r), rel, torch.full_like(v, math.nan))
    abs_err = torch.where(torch.isfinite(v) & torch.isfinite(r), abs_err,
                          torch.full_like(v, math.nan))
    if scalar:
        return RoundTrip(info.name, float(v), float(r), float(abs_err), float(rel))
    return RoundTrip(info.name, v, r, abs_err, rel)


# --- bits ----------------------------------------------------------------------------------------

KINDS = ("zero", "subnormal", "normal", "inf", "nan")


@dataclass(frozen=True)
class Decoded:
    """A value's encoding in one format.

    ``value`` is the input, ``rounded`` what the format stores (as a float), ``sign`` 0 or 1,
    ``exponent_bits`` / ``mantissa_bits`` the fields as strings of 0 and 1, ``exponent`` the
    unbiased exponent (the subnormals' shared ``1 - bias`` for a subnormal; None for zero, inf,
    NaN), ``kind`` one of ``KINDS``. ``overflow`` is True when a finite input was too large.
    """

    fmt: str
    value: float
    rounded: float
    sign: int
    exponent_bits: str
    mantissa_bits: str
    exponent: Optional[int]
    kind: str
    overflow: bool

    @property
    def bits(self) -> str:
        """All bits, fields separated by spaces: ``'0 01111 0000000000'`` for 1.0 in fp16."""
        return f"{self.sign} {self.exponent_bits} {self.mantissa_bits}"

    @property
    def as_int(self) -> int:
        """The encoding as an unsigned integer (what ``tensor.view(torch.uint16)`` would show)."""
        return int(self.bits.replace(" ", ""), 2)

    @property
    def hex(self) -> str:
        """The encoding in hexadecimal, padded to the format's width."""
        width = (len(self.bits.replace(" ", "")) + 3) // 4
        return f"0x{self.as_int:0{width}X}"

    @property
    def abs_error(self) -> float:
        """|rounded - value| (NaN when either is not finite)."""
        if not (math.isfinite(self.value) and math.isfinite(self.rounded)):
            return math.nan
        return abs(self.rounded - self.value)

    @property
    def rel_error(self) -> float:
        """|rounded - value| / |value| (0 for a zero input, NaN when not finite)."""
        if self.value == 0:
            return 0.0 if self.rounded == 0 else math.nan
        return self.abs_error / abs(self.value)

    def formula(self) -> str:
        """How the fields give the value, e.g. ``+1.1001100110 x 2^-4``."""
        s = "-" if self.sign else "+"
        if self.kind in ("inf", "nan"):
            return f"{s}{self.kind}" if self.kind == "inf" else "nan"
        if self.kind == "zero":
            return f"{s}0"
        lead = "1" if self.kind == "normal" else "0"
        return f"{s}{lead}.{self.mantissa_bits} x 2^{self.exponent}"


def decode(value: Number, fmt: Union[str, FormatInfo, torch.dtype]) -> Decoded:
    """Round a Python number to ``fmt`` and split the result into sign, exponent and mantissa."""
    info = get_format(fmt)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"value must be a single number; got a tensor of {value.numel()}")
        value = float(value.detach().float().cpu())
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"value must be a real number; got {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"value must be within float64's range (magnitude at most about "
                         f"1.8e308); got an integer of {len(str(abs(int(value))))} digits") from None
    rounded = float(_round_f64(torch.tensor([value], dtype=torch.float64), info)[0])
    e_bits, m_bits = info.exponent_bits, info.mantissa_bits
    all_ones = 2 ** e_bits - 1
    sign = 1 if math.copysign(1.0, rounded) < 0 else 0
    a = abs(rounded)
    exponent: Optional[int] = None
    if math.isnan(rounded):
        sign = 1 if math.copysign(1.0, value) < 0 and math.isnan(value) else 0
        # canonical quiet NaN; e4m3fn's only NaN has every exponent and mantissa bit set
        exp_field = all_ones
        man_field = (2 ** m_bits - 1) if not info.has_inf else 2 ** (m_bits - 1)
        kind = "nan"
    elif math.isinf(rounded):
        exp_field, man_field, kind = all_ones, 0, "inf"
    elif a == 0:
        exp_field, man_field, kind = 0, 0, "zero"
    elif a < info.smallest_normal:
        exp_field, kind, exponent = 0, "subnormal", info.min_exponent
        man_field = int(a / info.smallest_subnormal)
    else:
        m, e = math.frexp(a)
        exponent = e - 1
        exp_field = exponent + info.bias
        man_field = int((a / 2.0 ** exponent - 1) * 2 ** m_bits)
        kind = "normal"
    overflow = math.isfinite(value) and not math.isfinite(rounded)
    return Decoded(fmt=info.name, value=value, rounded=rounded, sign=sign,
                   exponent_bits=format(exp_field, f"0{e_bits}b"),
                   mantissa_bits=format(man_field, f"0{m_bits}b"), exponent=exponent, kind=kind,
                   overflow=overflow)


def bits_table_text(values: Sequence[Number], names: Sequence[str] = ("fp32", "fp16", "bf16")) -> str:
    """Fixed-width text: each value's bits, stored value and kind in each format."""
    lines = []
    infos = format_infos(names)
    for v in values:
        lines.append(f"value {v!r}")
        for n in infos:
            d = decode(v, n)
            kind = f"{d.kind} (overflow)" if d.overflow else d.kind
            lines.append(f"  {d.fmt:<11} {d.bits:<36} {d.rounded!r:<24} {kind}")
    return "\n".join(lines)


# --- classifying values against a format ---------------------------------------------------------

_CATEGORIES = ("overflow", "normal", "subnormal", "flushed", "zero", "not_finite")


@dataclass(frozen=True)
class Classification:
    """Counts of a tensor's values by what ``fmt`` does to them.

    ``overflow``: finite values too large (they become inf, or NaN in e4m3fn); ``normal``;
    ``subnormal``: nonzero values that land below the smallest normal (precision lost);
    ``flushed``: nonzero values that round to zero; ``zero``: values that were exactly zero;
    ``not_finite``: inf or NaN already. The counts add up to ``total``.
    """

    fmt: str
    total: int
    overflow: int
    normal: int
    subnormal: int
    flushed: int
    zero: int
    not_finite: int

    @property
    def nonzero(self) -> int:
        """Finite values that are not exactly zero: the ones a format can lose."""
        return self.total - self.zero - self.not_finite

    @property
    def underflow(self) -> int:
        """Values flushed to zero or made subnormal."""
        return self.flushed + self.subnormal

    def counts(self) -> Dict[str, int]:
        """Every category's count."""
        return {c: getattr(self, c) for c in _CATEGORIES}

    def fractions(self, of: str = "all") -> Dict[str, float]:
        """Each category as a fraction of ``of="all"`` values or of the ``"nonzero"`` ones
        (then ``zero`` and ``not_finite`` are left out)."""
        if of not in ("all", "nonzero"):
            raise ValueError(f"of must be 'all' or 'nonzero'; got {of!r}")
        if of == "all":
            n = self.total
            return {c: (getattr(self, c) / n if n else 0.0) for c in _CATEGORIES}
        n = self.nonzero
        return {c: (getattr(self, c) / n if n else 0.0)
                for c in ("overflow", "normal", "subnormal", "flushed")}


def _flatten(values) -> torch.Tensor:
    """One float64 CPU vector from a tensor, array, number, list of them or dict of them."""
    if isinstance(values, Mapping):
        values = list(values.values())
    if isinstance(values, (list, tuple)) and values and not isinstance(values[0], (int, float)):
        parts = [_as_float64(v).reshape(-1) for v in values]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return _as_float64(values).reshape(-1)


def classify(values, fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> Classification:
    """Count what ``fmt`` does to each value of ``values`` (a tensor, array, or a list/dict of them)."""
    info = get_format(fmt)
    x = _flatten(values)
    r = _round_f64(x, info)
    finite_in = torch.isfinite(x)
    zero = int((x == 0).sum())
    not_finite = int((~finite_in).sum())
    overflow = int((finite_in & ~torch.isfinite(r)).sum())
    nz = finite_in & (x != 0)
    flushed = int((nz & (r == 0)).sum())
    ra = r.abs()
    subnormal = int((nz & (ra > 0) & (ra < info.smallest_normal)).sum())
    normal = int((nz & torch.isfinite(r) & (ra >= info.smallest_normal)).sum())
    return Classification(info.name, int(x.numel()), overflow, normal, subnormal, flushed, zero,
                          not_finite)


def check_scale(scale) -> float:
    """``scale`` as a float; ValueError unless it is a positive finite number."""
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a positive finite number; got {scale!r}") from None
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    return s


def scaled_counts(grads, scale: float = 1.0,
                  fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> Dict[str, int]:
    """What happens to ``grads * scale`` in ``fmt``, as counts: ``nonzero`` (the finite nonzero
    values), and of them ``underflow`` (= ``flushed`` + ``subnormal``), ``flushed``,
    ``subnormal``, ``normal`` and ``overflow``. Shown with ``tables.percent(count, nonzero)``, a
    share never reads as zero while a value is lost."""
    s = check_scale(scale)
    c = classify(_flatten(grads) * s, fmt)
    return {"nonzero": c.nonzero, "underflow": c.flushed + c.subnormal, "flushed": c.flushed,
            "subnormal": c.subnormal, "normal": c.normal, "overflow": c.overflow}


def scaled_fractions(grads, scale: float = 1.0,
                     fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> Dict[str, float]:
    """What happens to ``grads * scale`` in ``fmt``, as fractions of the nonzero finite values.

    Returns ``underflow`` (= ``flushed`` + ``subnormal``), ``flushed``, ``subnormal``, ``normal``
    and ``overflow``. A loss scale multiplies every gradient (backward is linear in the loss), so
    this is what a scaled fp16 backward would store.
    """
    s = check_scale(scale)
    c = classify(_flatten(grads) * s, fmt)
    f = c.fractions(of="nonzero")
    return {"underflow": f["flushed"] + f["subnormal"], **f}


def underflow_fraction(grads, scale: float = 1.0,
                       fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> float:
    """Fraction of the nonzero gradient values that ``fmt`` flushes to zero or makes subnormal
    once multiplied by ``scale``."""
    return scaled_fractions(grads, scale, fmt)["underflow"]


def scale_sweep(grads, exponents: Iterable[int] = range(0, 33),
                fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> List[dict]:
    """``scaled_fractions`` at each loss scale ``2**k``: one row per ``k`` (with ``k``, ``scale``)."""
    info = get_format(fmt)
    x = _flatten(grads)
    x, _ = torch.sort(x[torch.isfinite(x) & (x != 0)].abs())
    n = x.numel()
    limits = band_limits(info)
    # Where rounding changes category (see band_limits): a tie at half the smallest subnormal
    # goes to zero, a tie between the largest subnormal and the smallest normal goes to the
    # normal, and a tie just above max overflows for IEEE formats only.
    normal_from = info.smallest_normal - info.smallest_subnormal / 2
    rows = []
    for k in exponents:
        k = check_scale_exponent(k)
        s = 2.0 ** k  # a power of two: x * s and t / s are exact, so x * s <= t iff x <= t / s
        cut = torch.tensor([limits["flushed_max"] / s, normal_from / s,
                            limits["overflow_from"] / s], dtype=torch.float64)
        flushed = int(torch.searchsorted(x, cut[0:1], right=True))
        below_normal = int(torch.searchsorted(x, cut[1:2], right=False))
        below_overflow = int(torch.searchsorted(x, cut[2:3], right=not info.has_inf))
        f = {"overflow": n - below_overflow, "normal": below_overflow - below_normal,
             "subnormal": below_normal - flushed, "flushed": flushed}
        f = {key: (v / n if n else 0.0) for key, v in f.items()}
        rows.append({"k": int(k), "scale": s,
                     "underflow": f["flushed"] + f["subnormal"], **f})
    if not rows:
        raise ValueError("exponents must hold at least one integer")
    return rows


def gradient_summary(grads_by_layer: Mapping[str, TensorLike], scale: float = 1.0,
                     fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> List[dict]:
    """Per layer (and ``all``): how many values, exact zeros, magnitudes, and the fractions of
    the nonzero ones that ``fmt`` flushes, makes subnormal, keeps normal or overflows."""
    info = get_format(fmt)
    s = check_scale(scale)
    if not grads_by_layer:
        raise ValueError("grads_by_layer must name at least one layer")
    items = list(grads_by_layer.items()) + [("all", list(grads_by_layer.values()))]
    rows = []
    for name, g in items:
        x = _flatten(g) * s
        c = classify(x, info)
        f = c.fractions(of="nonzero")
        nz = x[torch.isfinite(x) & (x != 0)].abs()
        rows.append({"layer": name, "values": c.total, "zeros": c.zero,
                     "min |g|": float(nz.min()) if nz.numel() else math.nan,
                     "median |g|": float(nz.median()) if nz.numel() else math.nan,
                     "max |g|": float(nz.max()) if nz.numel() else math.nan,
                     "nonzero": c.nonzero, "flushed": f["flushed"], "subnormal": f["subnormal"],
                     "normal": f["normal"], "overflow": f["overflow"]})
    return rows


def gradient_summary_rows(rows: Sequence[Mapping]) -> List[dict]:
    """``gradient_summary`` rows as shown: |g| to 3 digits, shares of the nonzero values in
    percent (``tables.percent``: a nonzero share never reads as 0; below 0.001%, the count)."""
    def share(r, key):
        n = r["nonzero"]
        return percent(round(r[key] * n), n) if n else "n/a"
    return [{"layer": str(r["layer"]), "values": r["values"], "zeros": r["zeros"],
             **{k: f"{r[k]:.3g}" for k in ("min |g|", "median |g|", "max |g|")},
             **{k: share(r, k) for k in ("flushed", "subnormal", "normal", "overflow")}} for r in rows]


def gradient_summary_text(rows: Sequence[Mapping]) -> str:
    """``gradient_summary_rows`` as a text table (counts right-aligned)."""
    shown = gradient_summary_rows(rows)
    return text_table(shown, list(shown[0]) if shown else None)


# --- real gradients ------------------------------------------------------------------------------


def collect_gradients(model: torch.nn.Module, loader, steps: int, lr: float = 0.1,
                      record: int = 5) -> Dict[str, np.ndarray]:
    """Train ``model`` for ``steps`` plain fp32 SGD steps on ``loader`` and return the gradient
    magnitudes ``|g|`` of each layer (weights and bias together), from ``record`` steps spread
    evenly over the run (the first and the last included), as float32 arrays keyed by module name.

    The loader yields ``(x, y)`` batches already on the model's device (``data.digits_loaders``);
    it is cycled when ``steps`` exceeds its length. The loss is cross-entropy.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    if not isinstance(record, int) or record < 1:
        raise ValueError(f"record must be an integer >= 1; got {record!r}")
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive finite number; got {lr!r}")
    record = min(record, steps)
    keep = {round(i * (steps - 1) / max(record - 1, 1)) for i in range(record)}
    params = [p for p in model.parameters() if p.requires_grad]
    layers: Dict[str, List[torch.Tensor]] = {}
    model.train()
    step, epoch = 0, 0
    while step < steps:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for x, y in loader:
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if step in keep:
                for name, p in model.named_parameters():
                    if p.grad is not None:
                        layer = name.rsplit(".", 1)[0] if "." in name else name
                        layers.setdefault(layer, []).append(
                            p.grad.detach().abs().reshape(-1).float().cpu())
            with torch.no_grad():  # plain SGD, written out: w <- w - lr * g
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-lr)
            step += 1
            if step >= steps:
                break
        epoch += 1
        if epoch > steps:  # an empty loader would loop forever
            raise ValueError("loader yielded no batches")
    return {name: torch.cat(parts).numpy() for name, parts in layers.items()}


# --- measured limits -----------------------------------------------------------------------------


def measure_limits(fmt: Union[str, FormatInfo, torch.dtype],
                   device: Union[str, torch.device, None] = None) -> Dict[str, float]:
    """Find a format's limits by arithmetic in its torch dtype on ``device``.

    ``smallest_positive``: halve 1 until the next halving gives 0. ``smallest_normal``: the
    smallest power of two ``x`` with ``x * (1 + eps) != x`` (below it, precision is lost).
    ``max``: double 1 while the result stays finite, then add the halves, quarters, ... that keep
    it finite. Only formats torch can do arithmetic in (fp32, fp16, bf16).
    """
    info = get_format(fmt)
    if info.name not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"fmt must be one of fp32, fp16, bf16 (torch has arithmetic for them); "
                         f"got {info.name!r}")
    dtype = info.torch_dtype

    def t(v):
        return torch.tensor(v, dtype=dtype, device=device)

    x, smallest_normal = t(1.0), None
    one_plus_eps = t(1.0) + t(info.eps)
    while True:
        if smallest_normal is None and bool(x * one_plus_eps == x):
            smallest_normal = float(x) * 2
        half = x * 0.5
        if bool(half == 0):
            break
        x = half
    smallest_positive = float(x)
    if smallest_normal is None:
        smallest_normal = smallest_positive
    big = t(1.0)
    while bool(torch.isfinite(big * 2)):
        big = big * 2
    step = big * 0.5
    while bool(step > 0) and bool(step >= big * info.eps / 2):
        trial = big + step
        if bool(torch.isfinite(trial)) and bool(trial > big):
            big = trial
        step = step * 0.5
    return {"smallest_positive": smallest_positive, "smallest_normal": smallest_normal,
            "max": float(big)}


# --- swamping ------------------------------------------------------------------------------------


def accumulate(update: float, steps: int, fmt: Union[str, FormatInfo, torch.dtype],
               start: float = 0.0, device: Union[str, torch.device, None] = None,
               update_fmt: Optional[Union[str, FormatInfo, torch.dtype]] = None) -> np.ndarray:
    """Add ``update`` to ``start`` ``steps`` times, the running value stored in ``fmt``'s dtype
    on ``device``; return the ``steps + 1`` values (float64). Each addition rounds to ``fmt``,
    so small updates are swamped once they fall below half a unit in the last place.

    ``update_fmt`` (default: ``fmt``) is the dtype of the update itself, e.g. an fp16 gradient
    step added to an fp32 master weight.
    """
    info = get_format(fmt)
    if info.name not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"fmt must be one of fp32, fp16, bf16; got {info.name!r}")
    upd_info = get_format(update_fmt) if update_fmt is not None else info
    if upd_info.name not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"update_fmt must be one of fp32, fp16, bf16; got {upd_info.name!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps!r}")
    w = torch.tensor(start, dtype=info.torch_dtype, device=device)
    u = torch.tensor(update, dtype=upd_info.torch_dtype, device=device)
    out = torch.empty(steps + 1, dtype=info.torch_dtype, device=device)
    out[0] = w
    for i in range(steps):
        w = w + u.to(info.torch_dtype)
        out[i + 1] = w
    return out.to("cpu", torch.float64).numpy()


def ulp(x: Number, fmt: Union[str, FormatInfo, torch.dtype]) -> float:
    """The unit in the last place of ``x`` in ``fmt``: the gap from ``|x|`` (rounded to ``fmt``)
    to the next larger value. Adding less than half of it to ``x`` leaves ``x`` unchanged under
    round-to-nearest (the swamping of ``accumulate``)."""
    info = get_format(fmt)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"x must be a finite number; got {x!r}")
    a = float(round_to(abs(x), info))
    if not math.isfinite(a):
        raise ValueError(f"x must lie within {info.name}'s range (at most {info.max:g}); got {x!r}")
    exponent = max(math.frexp(a)[1] - 1 if a else info.min_exponent, info.min_exponent)
    return 2.0 ** (exponent - info.mantissa_bits)


SWAMPING_RUNS = {"fp16 weight": ("fp16", None), "bf16 weight": ("bf16", None),
                 "fp32 master weight, fp16 update": ("fp32", "fp16")}


def swamping_runs(update: float = 1e-4, steps: int = 10_000, start: float = 1.0,
                  device: Union[str, torch.device, None] = None) -> Dict[str, np.ndarray]:
    """The same update added ``steps`` times to a weight stored three ways (``accumulate``):
    in fp16, in bf16, and as an fp32 master weight that receives an fp16 update (what mixed
    precision does). Returns each run's ``steps + 1`` values."""
    return {name: accumulate(update, steps, fmt, start, device, update_fmt=upd)
            for name, (fmt, upd) in SWAMPING_RUNS.items()}


def swamping_rows(runs: Mapping[str, np.ndarray], update: float, start: float = 1.0) -> List[dict]:
    """Per run: final value, the exact float64 result, and the percent of the total update that
    reached the weight."""
    rows = []
    for name, values in runs.items():
        steps = len(values) - 1
        exact = start + steps * update
        applied = (float(values[-1]) - start) / (exact - start) if exact != start else math.nan
        rows.append({"run": name, "steps": steps, "final": float(values[-1]), "exact": exact,
                     "update applied %": 100 * applied})
    return rows




def best_scale_exponent(sweep_rows: Sequence[Mapping]) -> int:
    """The ``k`` of ``scale_sweep`` rows that loses the fewest values (underflow + overflow);
    ties go to the smallest ``k``, the one furthest from overflow."""
    if not sweep_rows:
        raise ValueError("sweep_rows must hold at least one scale_sweep row")
    return min(sweep_rows, key=lambda r: (r["underflow"] + r["overflow"], r["k"]))["k"]


@traced
def scale_report(grads_by_layer: Mapping[str, TensorLike], exponents: Sequence[int],
                 fmt: Union[str, FormatInfo, torch.dtype] = "fp16") -> List[dict]:
    """Per layer (and ``all``): nonzero values, and at each scale ``2**k`` the percent of them
    that underflow (flushed or subnormal) and that overflow in ``fmt``."""
    if not grads_by_layer:
        raise ValueError("grads_by_layer must name at least one layer")
    info = get_format(fmt)
    exponents = [check_scale_exponent(k) for k in exponents]
    if not exponents:
        raise ValueError("exponents must hold at least one integer")
    rows = []
    for name, g in list(grads_by_layer.items()) + [("all", list(grads_by_layer.values()))]:
        x = _flatten(g)
        row = {"layer": name, "nonzero values": classify(x, info).nonzero}
        for k in exponents:
            f = scaled_fractions(x, 2.0 ** int(k), info)
            row[f"underflow % at 2^{int(k)}"] = 100 * f["underflow"]
            row[f"overflow % at 2^{int(k)}"] = 100 * f["overflow"]
        rows.append(row)
    return rows

def scale_window(magnitudes_by_layer: Mapping[str, np.ndarray], fmt: str = "fp16",
                 exponents: Sequence[int] = range(-8, 41)) -> dict:
    """Where a loss scale 2^k keeps these gradients in ``fmt``: ``no_flush_from`` (the smallest k
    at which no nonzero value is flushed to zero), ``no_overflow_up_to`` (the largest k with no
    overflow), and the fractions at k = 0 (no scaling). None where no k in ``exponents`` does."""
    rows = scale_sweep(list(magnitudes_by_layer.values()), exponents, fmt)
    no_flush = [r["k"] for r in rows if r["flushed"] == 0]
    no_over = [r["k"] for r in rows if r["overflow"] == 0]
    at_one = next((r for r in rows if r["k"] == 0), None)
    return {"no_flush_from": min(no_flush) if no_flush else None,
            "no_overflow_up_to": max(no_over) if no_over else None,
            "at_scale_1": at_one}


def fraction_rows(magnitudes_by_layer: Mapping[str, np.ndarray], scale: float,
                  fmt: str = "fp16") -> List[dict]:
    """Per layer: its values, nonzero values, and the fractions of the nonzero ones that ``fmt``
    flushes to zero, makes subnormal, or overflows once multiplied by ``scale``
    (``formats.gradient_summary`` without its ``all`` row)."""
    return [{k: r[k] for k in ("layer", "values", "nonzero", "flushed", "subnormal", "overflow")}
            for r in gradient_summary(magnitudes_by_layer, scale, fmt)[:-1]]


def lost_shares(magnitudes_by_layer: Mapping[str, object], scale: float, fmt: str = "fp16") -> dict:
    """Shares (text from ``tables.percent``: a nonzero count never reads as 0%) of the nonzero
    gradient values ``fmt`` flushes, makes subnormal, keeps normal, overflows at ``scale``."""
    c = scaled_counts(list(magnitudes_by_layer.values()), scale, fmt)
    n = c["nonzero"]
    out = {k: (percent(c[k], n) if n else "n/a")
           for k in ("flushed", "subnormal", "normal", "overflow", "underflow")}
    return dict(out, nonzero=n)
