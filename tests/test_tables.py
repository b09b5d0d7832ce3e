"""The one table formatter, value and percentage formatting, and the JSON helper."""
import json
import math

import numpy as np
import pytest
import torch

from amp_lessons import tables
from amp_lessons.train.checkpoint import CheckpointError, check_optimizer_state


@pytest.mark.parametrize("part, whole, text", [
    (0, 10, "0%"), (5, 10, "50%"), (10, 10, "100%"), (1, 3, "33.3%"),
    (431, 100_000_000, "< 0.001% (431 of 100,000,000)"),
    (4, 232_000, "0.00172%"), (999_999, 1_000_000, "> 99.999% (999,999 of 1,000,000)"),
    (9_999_999, 10_000_000, "> 99.999% (9,999,999 of 10,000,000)"),
    (25_557_031, 25_557_032, "> 99.999% (25,557,031 of 25,557,032)"),
    (99_995, 100_000, "99.995%"), (np.int64(3), np.int64(10), "30%"), (np.float32(0.5), 1, "50%"),
])
def test_percent_never_rounds_a_nonzero_share_to_zero(part, whole, text):
    """Nor all but a few to 100%; NumPy scalars count as numbers."""
    assert tables.percent(part, whole) == text


@pytest.mark.parametrize("part, whole", [(-1, 10), (11, 10), (1, 0), (True, 3), (1, "3"),
                                          (float("nan"), 3), (1, float("inf"))])
def test_percent_rejects_bad_input(part, whole):
    with pytest.raises(ValueError, match="must be"):
        tables.percent(part, whole)


def test_format_value():
    assert tables.format_value(None) == "n/a"
    assert tables.format_value(1234.5) == "1,234"
    assert tables.format_value(0.000123) == "0.000123"
    assert tables.format_value(7.77e39) == "7.77e+39"
    assert tables.format_value(True) == "yes"
    assert tables.format_value(float("nan")) == "nan"


def test_text_table_plain_keeps_every_digit_and_applies_formats():
    text = tables.text_table([{"fmt": "fp16", "max": 65504.0, "eps": 0.0009765625}], formats={"max": ".0f"})
    assert text.splitlines() == ["fmt   max    eps", "----  -----  ------------", "fp16  65504  0.0009765625"]


def test_text_table_columns_status_reason_and_alignment():
    rows = [{"label": "fp32", "img_per_s": 905.2, "status": "ok"},
            {"label": "bf16", "img_per_s": None, "status": "skipped", "reason": "no native bf16"}]
    text = tables.text_table(rows, [("label", "run"), ("img_per_s", "img/s"), ("status", "status"),
                                    ("absent", "never")])
    lines = text.splitlines()
    assert lines[0].split() == ["run", "img/s", "status"]
    assert lines[2].endswith("ok") and "  905  " in lines[2]
    assert lines[3].endswith("skipped: no native bf16") and " n/a " in lines[3]
    assert tables.text_table([{"x": 0.5}], [("x", "share", "{:.0%}")]).splitlines()[2] == "  50%"


def test_text_table_rejects_bad_input():
    with pytest.raises(ValueError, match="rows must"):
        tables.text_table([])
    with pytest.raises(ValueError, match="columns must name"):
        tables.text_table([{"a": 1}], [("b", "b")])
    with pytest.raises(ValueError, match="columns must hold"):
        tables.text_table([{"a": 1}], [("a",)])


def test_json_safe_gives_plain_json():
    doc = {"a": np.float32(1.5), "b": torch.tensor(2.0), "c": (1, float("nan")), 3: np.int64(4),
           "d": torch.float16, "e": [float("inf")]}
    out = tables.json_safe(doc)
    assert out == {"a": 1.5, "b": 2.0, "c": [1, None], "3": 4, "d": "torch.float16", "e": [None]}
    json.dumps(out, allow_nan=False)
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in out["c"] if v is not None)


@pytest.mark.parametrize("count, word, many, text", [
    (1, "epoch", None, "1 epoch"), (3, "epoch", None, "3 epochs"), (0, "step", None, "0 steps"),
    (1500, "step", None, "1,500 steps"), (1.0, "step", None, "1 step"),
    (2, "batch", "batches", "2 batches"), (np.int64(1), "seed", None, "1 seed")])
def test_plural(count, word, many, text):
    assert tables.plural(count, word, many) == text


def test_plural_rejects_bad_input():
    with pytest.raises(ValueError, match="count must be a number"):
        tables.plural("3", "step")
    with pytest.raises(ValueError, match="word must be"):
        tables.plural(3, "")


@pytest.mark.parametrize("text, markdown", [
    ("TypeError: GradScaler.__init__() got 'scale_factor'",
     "TypeError: `GradScaler.__init__()` got '`scale_factor`'"),
    ("use torch.amp.GradScaler(device_type), e.g. now", "use `torch.amp.GradScaler(device_type)`, e.g. now"),
    ("already `a_b | c` here | there", "already `a_b \\| c` here \\| there"),
    ("2 warning(s), fp32 (TF32 off), x -> y >= 2, 3 *bold* <b>", "2 warning(s), fp32 (TF32 off), x -> y >= 2, "
     "3 \\*bold\\* \\<b>"),
    ("version 2.11.0 and docs/claims.md", "version 2.11.0 and docs/`claims.md`"),
])
def test_markdown_text_puts_code_in_code_spans(text, markdown):
    assert tables.markdown_text(text, in_table=True) == markdown


def test_html_text_and_table_use_the_same_code_words():
    assert tables.html_text("a <b> & channels_last") == "a &lt;b&gt; &amp; <code>channels_last</code>"
    html = tables.html_table([{"name": "x_y", "n": 2.5}, {"name": "z", "n": None}], ["name", "n"])
    assert "<code>x_y</code>" in html and ">2.50</td>" in html and ">n/a</td>" in html
    assert html.count("<tr>") == 3
    with pytest.raises(ValueError, match="rows must hold"):
        tables.html_table([], ["a"])


def test_not_compared_says_measured_and_why():
    assert tables.not_compared(" no CUDA GPU ") == "measured, not compared: no CUDA GPU"
    with pytest.raises(ValueError, match="why must say"):
        tables.not_compared("")


def test_shown_technique_says_tf32_only_where_the_math_is_tf32():
    from amp_lessons.tables import shown_technique, technique_report_rows

    gpu = {"technique": "fp32 + checkpointing", "config": {"precision": "tf32"}, "device_type": "cuda"}
    assert shown_technique(gpu) == "TF32 + checkpointing"
    assert shown_technique(dict(gpu, device_type="cpu")) == "fp32 + checkpointing"
    assert shown_technique(dict(gpu, config={"precision": "fp32"})) == "fp32 + checkpointing"
    assert shown_technique({"technique": "AMP", "precision": "fp16", "device_type": "cuda"}) == "AMP"
    rows = [dict(gpu, technique="fp32", status="ok", step_ms=2.0, memory_gib=4.0, img_per_s=1.0),
            {"technique": "AMP", "config": {"precision": "fp16"}, "device_type": "cuda",
             "status": "ok", "step_ms": 1.0, "memory_gib": 2.0, "img_per_s": 2.0}]
    table = technique_report_rows(rows)
    assert [r["technique"] for r in table] == ["TF32", "AMP"]
    assert table[1]["memory x TF32"] == 0.5 and table[1]["time x TF32"] == 0.5


@pytest.mark.parametrize("part, whole, digits, text", [
    (45.3, 100, 1, "50%"), (1234, 10_000, 1, "10%"), (654, 1000, 1, "70%"), (3, 7, 2, "43%")])
def test_percent_never_uses_scientific_notation(part, whole, digits, text):
    assert tables.percent(part, whole, digits=digits) == text  # 5e+01%, 1e+01%, 7e+01%: fixed
    assert tables.percent(1.5e-8, 1, floor=1e-9) == "0.0000015%"


def test_percent_never_reads_100_for_a_share_below_it():
    """However few digits are asked for: 99,997 of 100,000 at one digit read '100%'."""
    assert tables.percent(99_997, 100_000, digits=1) == "99.997%"
    assert tables.percent(9_999_999_990, 10 ** 10, floor=1e-9) == "99.9999999%"
    assert tables.percent(99.99, 100, digits=1) == "99.99%"


@pytest.mark.parametrize("setting, kwargs", [("digits", dict(digits=0)), ("digits", dict(digits=1.5)),
                                             ("floor", dict(floor=0)), ("floor", dict(floor=60))])
def test_percent_names_a_bad_setting_and_its_range(setting, kwargs):
    with pytest.raises(ValueError, match=rf"{setting} must be"):
        tables.percent(1, 3, **kwargs)


def test_numpy_scalars_and_0d_tensors_are_numbers_in_tables():
    """Right-aligned and formatted like Python numbers (they were left-aligned text)."""
    np = pytest.importorskip("numpy")
    import torch
    rows = [{"a": "x", "b": np.float32(1.5), "c": np.int64(12345)},
            {"a": "yy", "b": torch.tensor(2.25), "c": 7}]
    columns = [("a", "A"), ("b", "B"), ("c", "C")]
    python = [{"a": "x", "b": 1.5, "c": 12345}, {"a": "yy", "b": 2.25, "c": 7}]
    assert tables.text_table(rows, columns) == tables.text_table(python, columns)
    assert tables.text_table(rows, columns).splitlines()[2:] == ["x   1.50  12,345", "yy  2.25       7"]
    assert tables.html_table(rows, columns) == tables.html_table(python, columns)
    assert tables.text_table([{"b": np.float32(1.5)}]).splitlines()[-1] == "1.5"
    assert tables.format_value(np.float64(123456.7)) == "123,457"


def test_the_readme_cells_are_the_one_cell_formatter():
    """The README's tables, cited values and notebook tables write a value the same way:
    ``tables.format_value`` (there were five formatters)."""
    from amp_lessons.publish import report
    np = pytest.importorskip("numpy")
    rows = [{"k": 131072.0}, {"k": np.float64(123456.0)}, {"k": 16777216.0}, {"k": 0.5},
            {"k": None}, {"k": True}, {"k": 0.000123}]
    table = report.markdown_table(rows)
    assert table.splitlines()[2:] == ["| 131,072 |", "| 123,456 |", "| 1.68e+07 |", "| 0.5 |",
                                      "| n/a |", "| yes |", "| 0.000123 |"]
    assert [line.strip() for line in tables.text_table(rows, ["k"]).splitlines()[2:]] == \
        ["131,072", "123,456", "1.68e+07", "0.5", "n/a", "yes", "0.000123"]
    results = [{"key": "t.k", "columns": ["name", "k"], "rows": [{"name": "a", "k": 131072.0}]}]
    assert report.cite(results, "t.k | a | k") == tables.format_value(131072.0)


def test_format_value_takes_digits_and_the_missing_text():
    assert tables.format_value(None, missing="-") == "-"
    assert tables.format_value(12.3456, digits=3) == "12.346"
    assert tables.format_value(0.0123456, digits=3) == "0.01235"
    with pytest.raises(ValueError, match="digits must be a whole number >= 0"):
        tables.format_value(1.0, digits=-1)


def test_noisy_is_written_in_one_place():
    from amp_lessons.measure import rows, timer
    assert rows.noisy is tables.noisy and timer.NOISY_SPREAD is tables.NOISY_SPREAD
    assert tables.noisy({"spread": 0.25}).startswith("noisy: repeats differ by 25% (over 10%)")
    assert tables.noisy({"spread": 0.05}) is None and tables.noisy({}) is None
    assert tables.noisy({"spread": float("nan")}) is None


def test_text_table_cells_stay_on_one_line_and_wide_characters_count_twice():
    table = tables.text_table([{"a": "模型", "b": 1.5}, {"a": "two\nlines", "b": 22.25},
                               {"a": "crlf\r\nend", "b": 3}], [("a", "name"), ("b", "B")])
    lines = table.splitlines()
    assert len(lines) == 5 and lines[3] == "two lines  22.25" and lines[4] == "crlf end       3"
    assert lines[2] == "模型" + " " * 8 + "1.50"  # two wide characters take four columns
    assert {tables.display_width(x) for x in lines} == {16}
    assert tables.display_width("abc") == 3 and tables.display_width("e\u0301") == 1
    assert tables.display_width("e\u200bz") == 2  # a zero-width space takes no column


def test_a_spread_past_100_percent_is_shown_not_raised_nor_clamped():
    from amp_lessons.measure import rows as R
    from amp_lessons.doctor.report import DoctorReport
    from amp_lessons.tables import percent, spread_text

    assert spread_text(0.0123) == percent(0.0123, 1.0) and spread_text(1.0) == "100.0%"
    assert spread_text(8.188529515752963) == "818.9%"
    assert spread_text(0.9999999) == "100.0%" and spread_text(1.004) == "100.4%"
    for bad in (-0.1, float("nan"), None, "0.5"):
        with pytest.raises(ValueError, match="spread must be a number >= 0"):
            spread_text(bad)
    assert DoctorReport._cell("spread", 37.55) == "3,755.0%"
    (_, _, fmt), = [c for c in R.DEFAULT_COLUMNS if c[0] == "spread"]
    assert fmt(2.5) == "250.0%"  # was clamped to "100%"
