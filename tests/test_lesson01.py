"""Lesson 01's own experiments (amp_lessons.lessons.l01_ranges): claim R1 measured and decided,
the dtypes under autocast, and the lesson's place in the claims registry."""
import pytest
import torch

import amp_lessons as al
from amp_lessons.publish import claims
from amp_lessons.lessons import l01_ranges as L


def test_lesson_decides_only_its_own_claims():
    assert L.LESSON == "01" and L.DECIDES == ("R1",)
    assert all(claims.CLAIMS[c].lesson == L.LESSON for c in L.DECIDES)


def test_check_range_r1_and_others():
    fp16 = L.check_range("fp16", "5.96e-8", "65504")
    assert fp16.holds and fp16.low_is == "smallest subnormal" and fp16.high_holds
    assert fp16.sentence().startswith("holds: 5.96e-8 is the smallest subnormal")
    fp32 = L.check_range("fp32", "1.4e-45", "3.4e38")
    assert fp32.holds and fp32.low_is == "smallest subnormal"
    normal = L.check_range("fp16", "6.1e-5", "65504")
    assert normal.holds and normal.low_is == "smallest normal"
    wrong = L.check_range("fp16", "1e-8", "65000")
    assert not wrong.holds and wrong.low_is == "neither" and not wrong.high_holds
    assert wrong.sentence().startswith("does not hold")
    assert not L.check_range("fp32", "1.4e-45", "3.5e38").holds
    text = L.range_checks_text([fp16, wrong])
    assert "fp16: claimed 5.96e-8 to 65504" in text and "does not hold" in text
    with pytest.raises(ValueError, match="plain decimal numbers"):
        L.check_range("fp16", "2^-24", "65504")


@pytest.mark.parametrize("written,actual,ok", [("5.96e-8", 2.0**-24, True), ("6e-8", 2.0**-24, True),
                                                ("5.97e-8", 2.0**-24, False), ("65504", 65504.0, True),
                                                ("65500", 65504.0, False)])
def test_matches_written_uses_the_written_precision(written, actual, ok):
    assert L.matches_written(written, actual) is ok


def test_decide_r1_is_a_verdict_from_the_measurement():
    checks = L.check_r1()
    assert [c.fmt for c in checks] == ["fp16", "fp32"]
    v = L.verdict_r1(checks, "cpu")
    assert isinstance(v, claims.Verdict) and v.claim == "R1" and v.lesson == "01"
    assert v.held is True and v.outcome == "held"
    assert v.numbers["fp16"]["max"] == 65504.0
    bad = L.verdict_r1(L.check_r1(claimed={"fp16": ("1e-8", "65504")}), "cpu")
    assert bad.held is False and "1e-8 is no limit" in bad.why
    with pytest.raises(ValueError, match="at least one"):
        L.verdict_r1([])
    with pytest.raises(ValueError, match="at least one format"):
        L.check_r1(claimed={})


def test_dtypes_under_autocast_on_cpu():
    x, y = al.data.digits("train")
    d = L.dtypes_under_autocast(al.models.MLP(hidden=(8,)), x[:16], y[:16], "cpu", torch.bfloat16)
    assert d["logits"] == torch.bfloat16 and d["grad of logits"] == torch.bfloat16
    assert d["loss"] == torch.float32 and d["parameter .grad"] == torch.float32
    assert d["parameter"] == torch.float32


def test_show_gradient_summary_shows_an_html_table_per_format(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append(obj))
    grads = {"fc": torch.tensor([1e-9, 1e-3, 0.0, 2.0])}
    L.show_gradient_summary(grads, "fp16")
    (bundle,) = shown
    html = bundle["text/html"]
    assert bundle["text/plain"].splitlines()[0] == "in fp16"
    assert html.count("<tr>") == 3 and "<th" in html  # heading, fc, all
    assert ">33.3%</td>" in html  # 1e-9 flushed: one of the three nonzero values
    rows = al.formats.gradient_summary_rows(al.formats.gradient_summary(grads, fmt="fp16"))
    assert rows[0]["values"] == 4 and rows[0]["zeros"] == 1 and rows[0]["max |g|"] == "2"
    with pytest.raises(ValueError, match="fmt must be one of"):
        L.show_gradient_summary(grads, "fp12")


def test_verdict_r1_sensitivity_rows_decide_by_the_same_rule():
    finfo = L.check_r1(finfo=True)
    assert finfo[0].measured["smallest_positive"] == 2.0 ** -24
    v = L.verdict_r1(L.check_r1("cpu"), "cpu", [("as torch.finfo states them", finfo)])
    assert v.held is True and v.sensitivity[0].held is True and "finfo" in v.row()["sensitivity"]
    # a source that disagreed (a flush-to-zero reading: no subnormals) would make it partly held
    flushed = [L.check_range(c.fmt, c.claimed_low, c.claimed_high,
                             measured=dict(c.measured, smallest_positive=c.measured["smallest_normal"]))
               for c in finfo]
    v = L.verdict_r1(L.check_r1("cpu"), "cpu", [("with subnormals flushed to zero", flushed)])
    assert v.outcome == "partly held" and "did not hold with subnormals flushed to zero" in v.why
    assert "held measured on cpu" in v.why
    with pytest.raises(ValueError, match="torch has a dtype"):
        L.finfo_limits("tf32")   # TF32 is a math mode, not a torch dtype
