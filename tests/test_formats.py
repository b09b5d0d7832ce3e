"""amp_lessons.numerics.formats: format facts against the IEEE 754 / OCP FP8 definitions, rounding, bits,
classification, loss-scale fractions, gradient collection, measured limits, swamping."""
import math

import numpy as np
import pytest
import torch

import amp_lessons as al
from amp_lessons.numerics import formats as F
from amp_lessons.numerics import fp8 as F8

# name: (exponent bits, mantissa bits, max, smallest normal, smallest subnormal, eps, has inf),
# written from the definitions: max = (2 - 2^-m) * 2^emax for IEEE-style formats,
# e4m3fn's max = 1.75 * 2^8 (its all-ones exponent holds finite values, mantissa 111 is NaN).
DEFINITIONS = {
    "fp32": (8, 23, (2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23, True),
    "tf32": (8, 10, (2 - 2**-10) * 2.0**127, 2.0**-126, 2.0**-136, 2.0**-10, True),
    "fp16": (5, 10, (2 - 2**-10) * 2.0**15, 2.0**-14, 2.0**-24, 2.0**-10, True),
    "bf16": (8, 7, (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7, True),
    "fp8_e4m3fn": (4, 3, 1.75 * 2.0**8, 2.0**-6, 2.0**-9, 2.0**-3, False),
    "fp8_e5m2": (5, 2, 1.75 * 2.0**15, 2.0**-14, 2.0**-16, 2.0**-2, True),
}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
UINT = {1: (torch.uint8, 0xFF), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF)}


# --- the table -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_limits_match_the_definitions(name):
    e, m, mx, normal, sub, eps, has_inf = DEFINITIONS[name]
    f = F.FORMATS[name]
    assert (f.exponent_bits, f.mantissa_bits, f.bits) == (e, m, 1 + e + m)
    assert f.max == mx and f.smallest_normal == normal and f.smallest_subnormal == sub
    assert f.eps == eps and f.has_inf is has_inf
    assert f.bias == 2 ** (e - 1) - 1 and f.min_exponent == 1 - f.bias
    assert f.decimal_digits == pytest.approx((m + 1) * math.log10(2))


def test_well_known_numbers():
    assert F.FORMATS["fp16"].max == 65504 and F.FORMATS["fp8_e4m3fn"].max == 448
    assert F.FORMATS["fp8_e5m2"].max == 57344
    assert F.FORMATS["fp32"].max == pytest.approx(3.4028234663852886e38, rel=0)
    assert F.FORMATS["bf16"].max == pytest.approx(3.3895313892515355e38, rel=0)
    assert list(F.FORMATS) == ["fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2"]


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_torch_finfo_and_formula_agree(name):
    f = F.FORMATS[name]
    fi = torch.finfo(TORCH_DTYPES[name])
    assert f.source == "torch.finfo" and f.torch_dtype == TORCH_DTYPES[name]
    assert (fi.max, fi.smallest_normal, fi.eps) == (f.max, f.smallest_normal, f.eps)
    formula = F._by_formula(f.exponent_bits, f.mantissa_bits, fn=not f.has_inf)
    assert formula["max"] == f.max and formula["smallest_subnormal"] == f.smallest_subnormal


def test_tf32_is_by_formula():
    f = F.FORMATS["tf32"]
    assert f.source == "formula" and f.torch_dtype is None and f.layout == "1/8/10"


def test_format_facts_rows_and_text():
    rows = F.format_facts()
    assert [r["format"] for r in rows] == list(F.FORMAT_NAMES)
    assert rows[2]["max"] == 65504 and rows[2]["smallest_subnormal"] == 2**-24
    assert F.format_facts(["fp16"])[0]["layout"] == "1/5/10"
    text = F.format_facts_text()
    lines = text.splitlines()
    assert lines[0].startswith("format") and len(lines) == 2 + len(F.FORMATS)
    fp16 = next(line for line in lines if line.startswith("fp16"))
    assert "65504" in fp16 and "5.960e-08 = 2^-24" in fp16 and "6.104e-05 = 2^-14" in fp16
    e4m3 = next(line for line in lines if line.startswith("fp8_e4m3fn"))
    assert " 448 " in e4m3 and e4m3.rstrip().endswith("no")
    assert text == F.format_facts_text()


@pytest.mark.parametrize("alias,name", [("FP16", "fp16"), ("half", "fp16"), ("bfloat16", "bf16"),
                                        ("e4m3fn", "fp8_e4m3fn"), ("e5m2", "fp8_e5m2"),
                                        (torch.float16, "fp16"), (torch.float8_e5m2, "fp8_e5m2"),
                                        ("tf32", "tf32"), ("float32", "fp32")])
def test_get_format_aliases(alias, name):
    assert F.get_format(alias).name == name
    assert F.get_format(F.FORMATS[name]) is F.FORMATS[name]


@pytest.mark.parametrize("bad", ["fp64", "", 16, torch.int32, None])
def test_unknown_format_lists_the_allowed_ones(bad):
    with pytest.raises(ValueError, match="fmt must be one of fp32, tf32, fp16, bf16, fp8_e4m3fn, "
                                         "fp8_e5m2"):
        F.get_format(bad)
    with pytest.raises(ValueError, match="fmt must be one of"):
        F.round_to(1.0, bad)


# --- rounding ------------------------------------------------------------------------------------

def _random_fp32(n=20000, lo=-40, hi=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 0.5
    exp = torch.randint(lo, hi, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return sign * mant * torch.exp2(exp)


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8_e5m2"])
def test_round_to_matches_torch_casts(name):
    x = torch.cat([_random_fp32(), torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e6,
                                                 2.0**-25, 2.0**-24, 3 * 2.0**-26, float("inf"),
                                                 -float("inf")])])
    ours = F.round_to(x, name)
    theirs = x.to(TORCH_DTYPES[name]).to(torch.float64)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


def test_round_to_matches_torch_for_e4m3fn_in_range():
    x = _random_fp32(lo=-12, hi=9)
    x = x[x.abs() <= 464]
    assert torch.equal(F.round_to(x, "e4m3fn"), x.to(torch.float8_e4m3fn).to(torch.float64))


def test_e4m3fn_overflow_is_nan_by_the_spec():
    r = F.round_to(torch.tensor([448.0, 464.0, 465.0, 1e6, float("inf")]), "fp8_e4m3fn")
    assert r[:2].tolist() == [448.0, 448.0] and torch.isnan(r[2:]).all()
    # torch's own cast saturates (or, in some versions, gives NaN): never a value above 448
    cast = torch.tensor([465.0, 1e6]).to(torch.float8_e4m3fn).float()
    assert all(v == 448.0 or math.isnan(v) for v in cast.tolist())


def _tf32_by_bits(x: torch.Tensor) -> torch.Tensor:
    """Reference: round the fp32 mantissa to 10 bits, ties to even, on the bit pattern."""
    bits = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) >> 13) << 13
    out = (rounded & 0xFFFFFFFF)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return out.to(torch.float64)


def test_tf32_rounds_the_fp32_mantissa_to_10_bits():
    x = torch.cat([_random_fp32(lo=-140, hi=120), torch.tensor([1 + 2**-11, 1 + 3 * 2**-11,
                                                                 2.0**-130 * 1.3, 0.1])])
    assert torch.equal(F.round_to(x, "tf32"), _tf32_by_bits(x))
    assert F.round_to(1 + 2**-11, "tf32").item() == 1.0           # a tie goes to even
    assert F.round_to(1 + 3 * 2**-11, "tf32").item() == 1 + 2**-9


@pytest.mark.parametrize("value,expected", [
    (1 + 2**-11, 1.0), (1 + 3 * 2**-11, 1 + 2**-9), (2.0**-25, 0.0),
    (2.0**-25 * (1 + 2**-20), 2.0**-24), (65519.0, 65504.0), (65520.0, math.inf),
    (-65520.0, -math.inf), (2.0**-14 - 2.0**-25, 2.0**-14), (0.1, 0.0999755859375)])
def test_round_to_fp16_ties_and_edges(value, expected):
    assert F.round_to(value, "fp16").item() == expected


def test_round_trip_errors():
    rt = F.round_trip(0.1, "fp16")
    assert isinstance(rt.rounded, float) and rt.rounded == 0.0999755859375
    assert rt.abs_error == pytest.approx(0.1 - 0.0999755859375, rel=1e-12)
    assert rt.rel_error == pytest.approx(rt.abs_error / 0.1)
    t = F.round_trip(torch.tensor([0.0, 1.0, 1e-9, 70000.0]), "fp16")
    assert t.rel_error[0] == 0 and t.rel_error[1] == 0 and t.rel_error[2] == 1.0
    assert math.isnan(t.rel_error[3]) and math.isnan(t.abs_error[3])
    assert t.max_rel_error == 1.0 and t.max_abs_error == pytest.approx(1e-9)
    assert F.round_trip(np.array([0.5, 0.25]), "bf16").max_abs_error == 0


# --- bits ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,bits,hexa,kind,exponent", [
    (1.0, "0 01111 0000000000", "0x3C00", "normal", 0),
    (-2.0, "1 10000 0000000000", "0xC000", "normal", 1),
    (65504.0, "0 11110 1111111111", "0x7BFF", "normal", 15),
    (2.0**-24, "0 00000 0000000001", "0x0001", "subnormal", -14),
    (2.0**-14 - 2.0**-24, "0 00000 1111111111", "0x03FF", "subnormal", -14),
    (2.0**-14, "0 00001 0000000000", "0x0400", "normal", -14),
    (float("inf"), "0 11111 0000000000", "0x7C00", "inf", None),
    (-float("inf"), "1 11111 0000000000", "0xFC00", "inf", None),
    (0.0, "0 00000 0000000000", "0x0000", "zero", None),
    (-0.0, "1 00000 0000000000", "0x8000", "zero", None),
    (70000.0, "0 11111 0000000000", "0x7C00", "inf", None),
])
def test_decode_fp16_known_values(value, bits, hexa, kind, exponent):
    d = F.decode(value, "fp16")
    assert (d.bits, d.hex, d.kind, d.exponent) == (bits, hexa, kind, exponent)
    assert d.overflow is (value == 70000.0)


def test_decode_nan_and_fields():
    d = F.decode(float("nan"), "fp16")
    assert d.kind == "nan" and d.exponent_bits == "11111" and int(d.mantissa_bits, 2) != 0
    assert math.isnan(d.rounded) and math.isnan(d.abs_error)
    e = F.decode(float("nan"), "e4m3fn")
    assert e.hex == "0x7F"
    d = F.decode(0.1, "fp16")
    assert d.rounded == 0.0999755859375 and d.formula() == "+1.1001100110 x 2^-4"
    assert F.decode(2.0**-24, "fp16").formula() == "+0.0000000001 x 2^-14"
    assert d.rel_error == pytest.approx(abs(0.0999755859375 - 0.1) / 0.1)


@pytest.mark.parametrize("value,name,hexa", [
    (1.0, "fp32", "0x3F800000"), (1.0, "bf16", "0x3F80"), (-2.0, "bf16", "0xC000"),
    (448.0, "fp8_e4m3fn", "0x7E"), (57344.0, "fp8_e5m2", "0x7B"),
    (float("inf"), "fp8_e5m2", "0x7C"), (1.0, "tf32", "0x1FC00"), (2.0**-149, "fp32", "0x00000001"),
])
def test_decode_other_formats(value, name, hexa):
    assert F.decode(value, name).hex == hexa


def test_decode_e4m3fn_overflow():
    d = F.decode(500.0, "e4m3fn")
    assert d.kind == "nan" and d.overflow and d.bits == "0 1111 111"
    assert F.decode(448.0, "e4m3fn").bits == "0 1111 110"


@pytest.mark.parametrize("name", list(TORCH_DTYPES))
def test_decode_bits_match_torch_storage(name):
    dtype = TORCH_DTYPES[name]
    lo, hi = (-12, 9) if name == "fp8_e4m3fn" else (-40, 15)
    x = _random_fp32(300, lo, hi, seed=1)
    if name == "fp8_e4m3fn":
        x = x[x.abs() <= 448]
    stored = x.to(dtype)
    int_dtype, mask = UINT[stored.element_size()]
    ints = (stored.view(int_dtype).to(torch.int64) & mask).tolist()
    for v, want in zip(x.tolist(), ints):
        assert F.decode(v, name).as_int == want, (name, v)


def test_decode_rejects_bad_input():
    with pytest.raises(ValueError, match="value must be a real number"):
        F.decode("1.0", "fp16")
    with pytest.raises(ValueError, match="value must be a single number"):
        F.decode(torch.ones(2), "fp16")
    assert F.decode(torch.tensor(2.0), "fp16").hex == "0x4000"


def test_bits_table_text():
    text = F.bits_table_text([1.0, 70000.0], ["fp16", "bf16"])
    assert "0 01111 0000000000" in text and "inf (overflow)" in text and "70144.0" in text


# --- classifying ---------------------------------------------------------------------------------

MIXED = torch.tensor([0.0, -0.0, 1e-9, 2.0**-25, 2.0**-25 * (1 + 2**-20), 1e-6, -1e-6,
                      2.0**-14 - 2.0**-25, 1.0, -3.0, 65519.0, 65520.0, -1e5,
                      float("inf"), float("nan")], dtype=torch.float64)


def test_classify_fp16():
    c = F.classify(MIXED, "fp16")
    assert c.counts() == {"overflow": 2, "normal": 4, "subnormal": 3, "flushed": 2, "zero": 2,
                          "not_finite": 2}
    assert c.total == 15 and c.nonzero == 11 and c.underflow == 5
    assert sum(c.fractions().values()) == pytest.approx(1)
    assert sum(c.fractions(of="nonzero").values()) == pytest.approx(1)
    assert c.fractions(of="nonzero")["overflow"] == pytest.approx(2 / 11)
    with pytest.raises(ValueError, match="of must be 'all' or 'nonzero'"):
        c.fractions(of="some")


def test_classify_bf16_and_e4m3fn():
    c = F.classify(MIXED, "bf16")
    assert c.flushed == 0 and c.subnormal == 0 and c.overflow == 0 and c.normal == 11
    e = F.classify(torch.tensor([464.0, 465.0, 2.0**-10, 2.0**-8, 1e-4]), "e4m3fn")
    assert (e.normal, e.overflow, e.flushed, e.subnormal) == (1, 1, 2, 1)


def test_classify_accepts_lists_dicts_and_arrays():
    a = F.classify([torch.ones(3), np.zeros(2)], "fp16")
    b = F.classify({"w": torch.ones(3), "b": np.zeros(2)}, "fp16")
    c = F.classify(np.array([1.0, 1.0, 1.0, 0.0, 0.0]), "fp16")
    assert a == b == c and a.normal == 3 and a.zero == 2
    # (a cast, not torch.ones(dtype=...): torch 2.4 cannot fill a float8 tensor on a CPU)
    assert F.classify(torch.ones(4).to(torch.float8_e4m3fn), "fp16").normal == 4


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_band_limits_are_where_rounding_changes(name):
    f = F.FORMATS[name]
    b = F.band_limits(name)
    assert F.round_to(b["flushed_max"], name).item() == 0
    assert F.round_to(b["flushed_max"] * (1 + 1e-9), name).item() == f.smallest_subnormal
    r = F.round_to(b["overflow_from"], name).item()
    assert (math.isinf(r) if f.has_inf else r == f.max)
    assert not math.isfinite(F.round_to(b["overflow_from"] * (1 + 1e-9), name).item())
    assert F.round_to(b["max"], name).item() == f.max


# --- loss scales ---------------------------------------------------------------------------------

GRADS = torch.tensor([2.0**-26, 2.0**-20, 2.0**-10, 1.0, 0.0])


@pytest.mark.parametrize("k,flushed,subnormal,normal,overflow", [
    (0, 0.25, 0.25, 0.5, 0.0), (8, 0.0, 0.25, 0.75, 0.0), (12, 0.0, 0.0, 1.0, 0.0),
    (16, 0.0, 0.0, 0.75, 0.25), (30, 0.0, 0.0, 0.5, 0.5)])
def test_scaled_fractions_at_scales(k, flushed, subnormal, normal, overflow):
    f = F.scaled_fractions(GRADS, 2.0**k, "fp16")
    assert (f["flushed"], f["subnormal"], f["normal"], f["overflow"]) == \
        (flushed, subnormal, normal, overflow)
    assert f["underflow"] == flushed + subnormal == F.underflow_fraction(GRADS, 2.0**k)


def test_scaled_fractions_other_formats_and_inputs():
    assert F.underflow_fraction({"a": GRADS}, 1.0, "bf16") == 0
    assert F.scaled_fractions(-GRADS, 2.0**16)["overflow"] == 0.25  # signs do not matter


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), float("inf"), "big", None])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        F.scaled_fractions(GRADS, scale)


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_scale_sweep_agrees_with_classify(name):
    x = torch.cat([_random_fp32(5000, -60, 20, seed=2).double(),
                   torch.tensor([2.0**-25, 2.0**-25 * (1 + 1e-12), 2.0**-14 - 2.0**-25, 65520.0,
                                 65519.99, 464.0, 464.001, 0.0, float("nan")])])
    for row in F.scale_sweep(x, range(-4, 24, 3), name):
        want = F.scaled_fractions(x, row["scale"], name)
        assert {k: row[k] for k in want} == want, (name, row["k"])


def test_scale_sweep_rows_and_best_scale():
    rows = F.scale_sweep(GRADS, range(0, 33))
    assert [r["k"] for r in rows] == list(range(33)) and rows[3]["scale"] == 8.0
    assert F.best_scale_exponent(rows) == 12
    with pytest.raises(ValueError, match="exponents must be integers"):
        F.scale_sweep(GRADS, [0.5])
    with pytest.raises(ValueError, match="at least one"):
        F.scale_sweep(GRADS, [])
    with pytest.raises(ValueError, match="at least one"):
        F.best_scale_exponent([])


def test_gradient_summary_and_scale_report():
    grads = {"a": GRADS, "b": torch.tensor([1e-3, 2e-3])}
    rows = F.gradient_summary(grads, fmt="fp16")
    assert [r["layer"] for r in rows] == ["a", "b", "all"]
    assert rows[0]["zeros"] == 1 and rows[0]["flushed"] == 0.25 and rows[1]["normal"] == 1.0
    assert rows[2]["values"] == 7 and rows[2]["max |g|"] == 1.0
    text = F.gradient_summary_text(rows)
    assert rows[0]["nonzero"] == 4 and rows[2]["nonzero"] == 6
    assert text.splitlines()[0].startswith("layer") and "25%" in text
    rep = F.scale_report(grads, [0, 16])
    assert rep[0]["underflow % at 2^0"] == 50.0 and rep[0]["overflow % at 2^16"] == 25.0
    assert rep[2]["nonzero values"] == 6
    with pytest.raises(ValueError, match="at least one layer"):
        F.gradient_summary({})
    with pytest.raises(ValueError, match="at least one layer"):
        F.scale_report({}, [0])


# --- real gradients ------------------------------------------------------------------------------

@pytest.mark.slow  # the first backward of a process warms torch up: seconds on a busy CPU
def test_collect_gradients_trains_and_records():
    al.seed_everything(0)
    train, _ = al.data.digits_loaders(64, seed=0)
    model = al.models.MLP(hidden=(16,))
    before = model.net[0].weight.detach().clone()
    grads = F.collect_gradients(model, train, steps=30, lr=0.1, record=3)  # > one epoch (22)
    assert list(grads) == ["net.0", "net.2"]
    assert grads["net.0"].dtype == np.float32 and grads["net.0"].size == 3 * (64 * 16 + 16)
    assert grads["net.2"].size == 3 * (16 * 10 + 10)
    assert (grads["net.0"] >= 0).all() and grads["net.0"].max() > 0
    assert not torch.equal(before, model.net[0].weight)


@pytest.mark.parametrize("kwargs,match", [({"steps": 0}, "steps must be"),
                                          ({"steps": 2, "record": 0}, "record must be"),
                                          ({"steps": 2, "lr": -1.0}, "lr must be")])
def test_collect_gradients_bad_settings(kwargs, match):
    train, _ = al.data.digits_loaders(64)
    with pytest.raises(ValueError, match=match):
        F.collect_gradients(al.models.MLP(hidden=(4,)), train, **kwargs)


# --- measured limits ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_measure_limits_match_the_table(name):
    m = F.measure_limits(name)
    f = F.FORMATS[name]
    assert (m["smallest_positive"], m["smallest_normal"], m["max"]) == \
        (f.smallest_subnormal, f.smallest_normal, f.max)


def test_measure_limits_rejects_formats_without_arithmetic():
    with pytest.raises(ValueError, match="fmt must be one of fp32, fp16, bf16"):
        F.measure_limits("fp8_e4m3fn")


# --- swamping ------------------------------------------------------------------------------------

def test_accumulate_swamps_small_updates():
    assert F.accumulate(1e-4, 100, "fp16", start=1.0)[-1] == 1.0
    assert F.accumulate(1e-4, 100, "fp32", start=1.0)[-1] == pytest.approx(1.01, rel=1e-4)
    # a running sum stalls once half its gap exceeds the addend: 0.25 in fp16, 2^-5 in bf16
    assert F.accumulate(1e-4, 5000, "fp16")[-1] == 0.25
    assert F.accumulate(1e-4, 5000, "bf16")[-1] == 2.0**-5
    master = F.accumulate(1e-4, 10, "fp32", start=1.0, update_fmt="fp16")
    assert len(master) == 11 and master[-1] == pytest.approx(1 + 10 * F.round_to(1e-4, "fp16").item(),
                                                             rel=1e-6)


@pytest.mark.parametrize("kwargs,match", [({"fmt": "fp8_e5m2"}, "fmt must be one of fp32"),
                                          ({"update_fmt": "tf32"}, "update_fmt must be one of"),
                                          ({"steps": 0}, "steps must be")])
def test_accumulate_bad_settings(kwargs, match):
    args = dict(update=1e-4, steps=3, fmt="fp16") | kwargs
    with pytest.raises(ValueError, match=match):
        F.accumulate(**args)


def test_swamping_rows_and_text_table():
    runs = F.swamping_runs(1e-4, 200, start=1.0)
    rows = F.swamping_rows(runs, 1e-4, start=1.0)
    assert [r["run"] for r in rows] == list(F.SWAMPING_RUNS)
    assert rows[0]["final"] == 1.0 and rows[0]["update applied %"] == 0
    assert rows[2]["update applied %"] == pytest.approx(100, abs=0.05)
    text = al.tables.text_table(rows, formats={"final": ".4f"})
    assert text.splitlines()[0].split()[:2] == ["run", "steps"] and "1.0000" in text


# --- counts and shares that never read as zero ---------------------------------------------------

def test_scaled_counts_agree_with_fractions():
    grads = {"a": GRADS, "b": torch.tensor([1e-3, 2e-3])}
    c = F.scaled_counts(grads, 1.0, "fp16")
    f = F.scaled_fractions(grads, 1.0, "fp16")
    assert c["nonzero"] == 6
    for key in ("flushed", "subnormal", "normal", "overflow", "underflow"):
        assert c[key] / c["nonzero"] == f[key]
    assert c["underflow"] == c["flushed"] + c["subnormal"]
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        F.scaled_counts(grads, 0.0)


def test_check_scale_is_public_and_validates():
    assert F.check_scale(2) == 2.0 and isinstance(F.check_scale(2), float)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        F.check_scale(-1)


def test_gradient_summary_text_never_shows_a_lost_value_as_zero():
    # one flushed value among 300,000: 0.00033%, which "%.3f" printed as 0.000
    big = np.full(300_000, 1e-3, dtype=np.float64)
    big[0] = 1e-10
    text = F.gradient_summary_text(F.gradient_summary({"fc": big}, fmt="fp16"))
    line = next(x for x in text.splitlines() if x.startswith("fc "))
    assert "< 0.001% (1 of 300,000)" in line
    assert " 0.000 " not in text


def test_formats_knows_no_claims():
    import inspect
    import re
    src = inspect.getsource(F)
    assert not re.search(r"\b(claim_|[RB]\d+[a-d]?\b)", src), "formats is engine: no claim ids"


def test_format_infos_names_the_setting_an_unknown_format_came_from():
    with pytest.raises(ValueError, match="formats_shown must be one of fp32, .*; got 'fp64'"):
        F.format_infos(["fp16", "fp64"], "formats_shown")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity,shape", [("tensorwise", (8,)), ("rowwise", (4, 8))])
def test_dynamic_scaling_clips_nothing_so_reports_no_saturation(fmt, granularity, shape):
    """amax lands on the format's largest value give or take an fp32 ulp: not clipped (381 of
    2,000 random tensors read as saturated before)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        x = torch.randn(shape, generator=g) * 3
        assert F8.quantization_error(x, fmt, granularity)["saturated"] == 0.0
    assert F8.quantization_error(torch.tensor([10.62462043762207, 1.0, -3.0, 0.5]), "e4m3",
                                 "tensorwise")["saturated"] == 0.0


def test_unscaled_values_past_the_range_still_count_as_saturated():
    assert F8.quantization_error(torch.tensor([500.0, 1.0]), "e4m3", "none")["saturated"] == 0.5


def test_tiny_tensors_reach_the_top_of_the_range_and_zero_ones_keep_a_finite_scale():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-18
    assert float(F8.amax_scale(x, "e4m3") * x.abs().max()) == pytest.approx(448.0)
    assert F8.quantization_error(x, "e4m3")["underflow"] == 0.0  # was 0.96
    for p2 in (False, True):
        scale = F8.amax_scale(torch.zeros(3), "e4m3", power_of_2=p2)
        assert torch.isfinite(scale)
        assert torch.equal(F8.fake_quantize(torch.zeros(3), power_of_2=p2), torch.zeros(3))


@pytest.mark.parametrize("granularity,shape,scale_shape", [
    ("tensorwise", (0, 4), ()), ("tensorwise", (0,), ()), ("rowwise", (4, 0), (4, 1)),
    ("rowwise", (0, 4), (0, 1))])
def test_empty_tensors_round_trip_with_scale_one(granularity, shape, scale_shape):
    x = torch.zeros(shape)
    assert F8.amax_scale(x, "e4m3", granularity).shape == scale_shape
    assert F8.fake_quantize(x, granularity=granularity).shape == x.shape
