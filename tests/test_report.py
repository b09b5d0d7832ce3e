"""Published results, and the README's results section rebuilt from the committed notebooks."""
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from amp_lessons import cli
from amp_lessons.publish import report
from amp_lessons.publish.notebooks import NOTEBOOK_DIR, course_notebooks
import json
import numpy as np
import torch
from amp_lessons.publish import claims

ROWS = [{"config": "fp32", "img/s": 905.4, "peak GiB": 21.4}, {"config": "fp16", "img/s": 2944.0,
                                                                "peak GiB": None}]


def test_markdown_table_formats_cells():
    text = report.markdown_table(ROWS)
    assert text.splitlines()[0] == "| config | img/s | peak GiB |"
    assert "| fp32 | 905 | 21.40 |" in text and "| fp16 | 2,944 | n/a |" in text  # tables.format_value
    with pytest.raises(ValueError, match="rows must hold at least one row"):
        report.markdown_table([])


def test_bundle_carries_rows_for_the_readme():
    bundle = report.result_bundle("lesson04.table", ROWS, "ResNet-50", note="batch 256")
    assert bundle[report.RESULT_MIME]["rows"][0]["img/s"] == 905.4
    assert bundle["text/html"].startswith("<p><strong>ResNet-50</strong></p>")
    assert "<table>" in bundle["text/html"] and "batch 256" in bundle["text/html"]
    assert bundle["text/plain"].startswith("ResNet-50") and "batch 256" in bundle["text/plain"]
    assert "text/markdown" not in bundle  # a notebook shows an HTML table; the README gets Markdown
    with pytest.raises(ValueError, match="key must be lowercase"):
        report.result_bundle("Bad Key", ROWS, "t")
    with pytest.raises(ValueError, match="title must be"):
        report.result_bundle("k", ROWS, "")


def _executed(tmp_path: Path) -> Path:
    nb = new_notebook(cells=[new_code_cell("publish(...)")])
    nb.cells[0].outputs = [new_output("display_data",
                                      data=report.result_bundle("k", ROWS, "Speed")), ]
    nb.metadata["amp_lessons"] = {"run": {"device_name": "NVIDIA H200", "torch": "2.11.0",
                                          "profile": "full", "date": "2026-11-29T10:00:00+00:00"}}
    path = tmp_path / "04_x.ipynb"
    nbformat.write(nb, path)
    return path


def test_collect_and_update_readme(tmp_path):
    nb = _executed(tmp_path)
    found = report.collect([nb])
    assert found[0]["title"] == "Speed" and found[0]["run"]["device_name"] == "NVIDIA H200"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.START}\nold\n{report.END}\nafter\n")
    assert report.update_readme(readme, [nb]) is True
    text = readme.read_text()
    assert "NVIDIA H200, torch 2.11.0, profile full, 2026-11-29" in text and "| fp32 | 905 |" in text
    assert text.startswith("intro\n") and text.endswith("after\n") and "old" not in text
    assert report.update_readme(readme, [nb]) is False
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(ValueError, match="lacks the results markers"):
        report.update_readme(tmp_path / "bare.md", [nb])


def test_readme_results_match_the_committed_notebooks():
    readme = (NOTEBOOK_DIR.parent / "README.md").read_text()
    assert report.results_section(course_notebooks()) in readme, \
        "README results are stale: run `python -m amp_lessons readme`"
    assert cli.main(["readme", "--check"]) == 0


def _verdict_notebook(tmp_path: Path, name: str, verdicts) -> Path:
    from amp_lessons.publish import claims

    rows = [dict(v.row(), lesson=v.lesson) for v in verdicts]
    nb = new_notebook(cells=[new_code_cell("publish_verdicts(...)")])
    nb.cells[0].outputs = [new_output("display_data", data=report.result_bundle(
        f"{report.VERDICT_PREFIX}l{verdicts[0].lesson}", rows, "claims", list(report.VERDICT_COLUMNS)))]
    nb.metadata["amp_lessons"] = {"run": {"device_name": "NVIDIA H200", "torch": "2.11.0",
                                          "profile": "full", "date": "2026-11-29T10:00:00+00:00"}}
    path = tmp_path / name
    nbformat.write(nb, path)
    assert claims.CLAIMS  # registry present
    return path


def test_readme_shows_each_claim_once_with_its_deciding_measurement(tmp_path):
    from amp_lessons.publish import claims

    n02 = _verdict_notebook(tmp_path, "02_x.ipynb", [
        claims.not_decided("B1", "02", "0.76x on the digits CNN", "launch-bound small model")])
    n04 = _verdict_notebook(tmp_path, "04_x.ipynb", [
        claims.decide("B1", "04", "3.3x on ResNet-50", True, "speed-up >= 1.5x")])
    section = report.results_section([n02, n04])
    b1 = [line for line in section.splitlines() if line.startswith("| B1 |")]
    assert len(b1) == 1 and "3.3x on ResNet-50" in b1[0] and "| held |" in b1[0]
    assert "0.76x" not in section  # lesson 02 only explains; it never shows as B1's verdict
    for cid in claims.CLAIMS:
        assert sum(line.startswith(f"| {cid} |") for line in section.splitlines()) == 1


def test_a_claim_published_twice_by_its_lesson_is_refused(tmp_path):
    from amp_lessons.publish import claims

    v = claims.decide("R8", "05", "+40% time", False, "more than 30%")
    path = _verdict_notebook(tmp_path, "05_x.ipynb", [v, v])
    with pytest.raises(ValueError, match="published twice"):
        report.results_section([path])


def test_publish_verdicts_checks_its_input():
    from amp_lessons.publish import claims

    with pytest.raises(ValueError, match="verdicts must hold"):
        report.publish_verdicts("04", [], "t")
    v = claims.decide("R8", "05", "+40% time", False, "more than 30%")
    with pytest.raises(ValueError, match="lesson must be"):
        report.publish_verdicts("04", [v], "t")


def test_committed_readme_lists_each_claim_at_most_once():
    from amp_lessons.publish import claims

    readme = (NOTEBOOK_DIR.parent / "README.md").read_text()
    section = readme.split(report.START, 1)[1].split(report.END, 1)[0]
    for cid in claims.CLAIMS:
        rows = [line for line in section.splitlines() if line.startswith(f"| {cid} |")]
        assert len(rows) <= 1, f"claim {cid} appears {len(rows)} times in the README results"


def test_replace_block_swaps_what_lies_between_the_markers():
    text = "a\n<s>\nold\n<e>\nb\n"
    assert report.replace_block(text, "<s>", "<e>", "<s>new<e>", "demo") == "a\n<s>new<e>\nb\n"
    with pytest.raises(ValueError, match="the README lacks the demo markers"):
        report.replace_block("no markers", "<s>", "<e>", "x", "demo")
    with pytest.raises(ValueError, match="end marker '<e>' before its start marker"):
        report.replace_block("a<e>b<s>c", "<s>", "<e>", "x", "demo")
    with pytest.raises(ValueError, match="more than once"):
        report.replace_block("<s>1<e><s>2<e>", "<s>", "<e>", "x", "demo")


def test_tables_in_notebooks_are_html_with_a_text_fallback():
    """The one display helper: an HTML table (code in <code>) and the aligned text table."""
    rows = [{"config": "fp16, channels_last", "img/s": 2944.0}, {"config": "fp32", "img/s": 905.4}]
    bundle = report.table_bundle(rows, [("config", "configuration"), ("img/s", "img/s", ".0f")],
                                 title="Speed of <x>", note="see GradScaler.__init__()")
    html = bundle["text/html"]
    assert "<td style=\"text-align: left\">fp16, <code>channels_last</code></td>" in html
    assert "<td style=\"text-align: right\">2944</td>" in html and "Speed of &lt;x&gt;" in html
    assert "<code>GradScaler.__init__()</code>" in html
    lines = bundle["text/plain"].splitlines()
    assert lines[0] == "Speed of <x>" and lines[2].split() == ["configuration", "img/s"]


def _prose(line: str) -> str:
    return re.sub(r"`[^`]*`", "", line)


def test_generated_markdown_keeps_identifiers_in_code_spans():
    """Every generated Markdown table (README results, claims table, docs/claims.md): no
    underscore or asterisk outside a code span unescaped, so `__init__` never renders bold."""
    from amp_lessons.publish import claims

    verdict = claims.Verdict(claim="B4", lesson="03", held=False,
                             measured="TypeError: GradScaler.__init__() got 'scale_factor'",
                             why="use growth_factor=2.0 *or* torch.amp.GradScaler(device)")
    text = report.markdown_table([verdict.row()], list(report.VERDICT_COLUMNS))
    assert "`GradScaler.__init__()`" in text and "`growth_factor=2.0`" in text
    assert "`torch.amp.GradScaler(device)`" in text and "\\*or\\*" in text
    generated = [text, claims.claims_markdown(), report.results_section(course_notebooks())]
    for block in generated:
        for line in block.splitlines():
            if line.startswith("|"):
                assert not re.search(r"(?<!\\)[_*]", _prose(line)), line


def test_each_readme_table_names_its_key_for_explain(tmp_path):
    nb = _executed(tmp_path)
    section = report.results_section([nb])
    key = report.collect([nb])[0]["key"]
    assert f"key `{key}`: `python -m amp_lessons explain {key}`" in section


def test_collect_without_validation_reads_the_same_results(tmp_path):
    """``explain`` reads the notebooks' JSON as it is (no schema check: ten times faster); it
    finds the same tables, and a file that is not a notebook is still named."""
    notebooks = course_notebooks()[:3]
    assert report.collect(notebooks, validate=False) == report.collect(notebooks)
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.ipynb: not a readable Jupyter notebook"):
        report.collect([bad], validate=False)
    bad.write_text("[]")
    with pytest.raises(ValueError, match="bad.ipynb: not a Jupyter notebook"):
        report.collect([bad], validate=False)


def test_published_rows_are_plain_json_numbers_and_non_finite_values_are_null():
    """A NumPy float was published as its text ('1.23456') and NaN/inf as bare NaN/Infinity,
    which is not JSON."""
    bundle = report.result_bundle("lesson02.fp32_vs_amp", [
        {"name": "fp16", "ms": np.float32(1.5), "n": np.int64(3), "t": torch.tensor(2.0)},
        {"name": "bf16", "ms": float("nan"), "n": float("inf"), "t": None}], "T")
    rows = bundle[report.RESULT_MIME]["rows"]
    assert rows[0] == {"name": "fp16", "ms": 1.5, "n": 3, "t": 2.0}
    assert rows[1] == {"name": "bf16", "ms": None, "n": None, "t": None}
    json.dumps(bundle[report.RESULT_MIME], allow_nan=False)  # strict JSON


def test_cheat_sheet_with_an_unclosed_comment_is_named():
    with pytest.raises(ValueError, match="leading comment .* is never closed"):
        report.cheat_sheet_body("<!-- unterminated\n# body")
