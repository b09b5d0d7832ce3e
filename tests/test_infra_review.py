"""An outside review of the infrastructure modules (report, claims, tables, runner, snapshots)
through their Python API: each class of bug it reproduced, held by a test."""
import json
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from amp_lessons.publish import claims
from amp_lessons.publish import report
from amp_lessons.publish import notebooks as runner
from amp_lessons.publish import snapshots


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


def test_decide_and_accuracy_gate_read_0d_tensors_and_arrays_as_numbers():
    for bad in (float("nan"), torch.tensor(float("nan")), np.array(np.inf)):
        assert claims.decide("R1", "01", "ran", True, "rule", {"s": bad}).outcome == \
            "not decided here"
    assert claims.accuracy_gate(torch.tensor(0.9), 10) is None  # was "the run diverged"
    assert claims.accuracy_gate(np.float32(0.9), 10) is None


def test_at_least_and_one_sided_never_read_against_their_ruling():
    assert claims.at_least("speedup", 39.6, 40).why == "39.6% < 40%"  # was "40% < 40%"
    assert claims.at_least("x", 1.46, 1.5, unit="x", digits=1).why == "1.46x < 1.5x"
    assert claims.at_least("s", 48, 40).why == "48% >= 40%"
    nan = claims.at_least("speedup", float("nan"), 40)
    assert nan.held is None and "not decided" in nan.why  # was ruled "did not hold"
    assert claims.one_sided(25.4, 20, 25, "%") == (True, "25.4% is 0.4% more than the claimed "
                                                         "20-25%")  # was "25% is 0% more"
    assert claims.one_sided(40, 20, 25, "%") == (True, "40% is 15% more than the claimed 20-25%")


def test_cheat_sheet_with_an_unclosed_comment_is_named():
    with pytest.raises(ValueError, match="leading comment .* is never closed"):
        report.cheat_sheet_body("<!-- unterminated\n# body")


def test_a_malformed_figure_is_named_with_its_cell(tmp_path):
    v = nbformat.v4
    nb = v.new_notebook(cells=[v.new_code_cell("x"), v.new_code_cell("f", outputs=[
        v.new_output("display_data", data={snapshots.PLOTLY_MIME: {"data": "bad", "layout": []}})])])
    path = tmp_path / "badfig.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match=r"badfig.ipynb: cell 1 holds a plotly figure that is "
                                         r"not one"):
        snapshots.add_images(path)


@pytest.mark.parametrize("timeout", [None, "10", float("nan"), 0, -5, 2.5])
def test_run_notebook_names_a_bad_timeout_before_starting_a_kernel(tmp_path, timeout):
    path = tmp_path / "ok.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), path)
    with pytest.raises(ValueError, match="timeout must be a whole number of seconds >= 1"):
        runner.run_notebook(Path(path), out=tmp_path / "o", timeout=timeout, progress=False)
    assert not (tmp_path / "o").exists()
