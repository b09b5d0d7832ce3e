"""`run-notebooks`: executes a notebook, records the run, names the failing cell."""
import os

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from amp_lessons import cli
from amp_lessons.publish import notebooks as runner
from pathlib import Path

pytestmark = pytest.mark.slow


def _write(path, *sources, tags=None):
    nb = new_notebook(cells=[new_markdown_cell("# tiny")] +
                      [new_code_cell(s, metadata={"tags": (tags or {}).get(i, [])})
                       for i, s in enumerate(sources)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_executes_in_place_and_records_the_run(tmp_path):
    path = _write(tmp_path / "01_tiny.ipynb",
                  "import os\nprint(os.environ['AMP_LESSONS_PROFILE'])", "print(6 * 7)")
    written = runner.run_notebook(path, profile="quick", progress=False)
    assert written == path
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[1].outputs[0].text.strip() == "quick"
    assert nb.cells[2].outputs[0].text.strip() == "42"
    assert [c.execution_count for c in nb.cells[1:]] == [1, 2]
    run = nb.metadata["amp_lessons"]["run"]
    assert run["profile"] == "quick" and run["torch"] and run["device_name"] and run["date"]
    assert run["seconds"] >= 0


def test_gpu_cells_are_left_alone_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "_device_count", lambda: 0)
    path = _write(tmp_path / "02_gpu.ipynb", "print('cpu')", "raise SystemError('needs a GPU')",
                  tags={1: ["requires-gpu"]})
    runner.run_notebook(path, profile="quick", progress=False)
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[2].outputs == [] and nb.cells[2].execution_count is None


def test_failing_cell_is_named_and_source_kept(tmp_path):
    path = _write(tmp_path / "03_broken.ipynb", "x = 1", "y = x / 0  # boom", "print('never')")
    before = path.read_text()
    with pytest.raises(runner.NotebookRunError) as info:
        runner.run_notebook(path, profile="quick", progress=False)
    message = str(info.value)
    assert "03_broken.ipynb: cell 2" in message and "y = x / 0" in message
    assert "ZeroDivisionError" in message
    assert path.read_text() == before, "a failed run must not overwrite the notebook"


def test_out_folder_and_cli(tmp_path, capsys):
    path = _write(tmp_path / "04_cli.ipynb", "print('hi')")
    out = tmp_path / "executed"
    assert cli.main(["run-notebooks", "--profile", "quick", "--out", str(out), "--no-progress",
                     str(path)]) == 0
    assert (out / "04_cli.ipynb").is_file()
    assert "wrote" in capsys.readouterr().out
    assert nbformat.read(path, as_version=4).cells[1].outputs == []


def test_cli_reports_failure_with_status_1(tmp_path, capsys):
    path = _write(tmp_path / "05_fail.ipynb", "raise RuntimeError('bad cell')")
    assert cli.main(["run-notebooks", "--profile", "quick", "--no-progress", str(path)]) == 1
    err = capsys.readouterr().err
    assert "05_fail.ipynb: cell 1" in err and "bad cell" in err


def test_cli_bad_flags_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run-notebooks", "--profile", "fast"])
    assert info.value.code == 2
    assert cli.main(["run-notebooks", str(tmp_path / "missing.ipynb")]) == 2


def test_course_notebooks_are_in_order(tmp_path):
    for name in ("02_b.ipynb", "01_a.ipynb", "notes.ipynb"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in runner.course_notebooks(tmp_path)] == ["01_a.ipynb", "02_b.ipynb"]


def test_bad_timeout(tmp_path):
    path = _write(tmp_path / "06_t.ipynb", "1")
    with pytest.raises(ValueError, match="timeout must be a whole number of seconds >= 1"):
        runner.run_notebook(path, timeout=0)


def test_widget_outputs_get_a_short_stand_in(tmp_path):
    path = _write(tmp_path / "07_widget.ipynb",
                  "import ipywidgets as w\nw.IntSlider(value=3, description='x' * 5000)")
    runner.run_notebook(path, profile="quick", progress=False)
    nb = nbformat.read(path, as_version=4)
    data = nb.cells[1].outputs[0]["data"]
    assert runner.WIDGET_MIME in data and data["text/plain"] == runner.WIDGET_NOTE
    assert "widgets" not in nb.metadata, "widget state must not be saved"


def test_environment_variable_sets_and_restores(monkeypatch):
    from amp_lessons.publish.notebooks import environment_variable
    monkeypatch.delenv("AMP_LESSONS_TEST_VAR", raising=False)
    with environment_variable("AMP_LESSONS_TEST_VAR", "a"):
        assert os.environ["AMP_LESSONS_TEST_VAR"] == "a"
        with environment_variable("AMP_LESSONS_TEST_VAR", "b"):
            assert os.environ["AMP_LESSONS_TEST_VAR"] == "b"
        assert os.environ["AMP_LESSONS_TEST_VAR"] == "a"
    assert "AMP_LESSONS_TEST_VAR" not in os.environ


@pytest.mark.parametrize("timeout", [None, "10", float("nan"), 0, -5, 2.5])
def test_run_notebook_names_a_bad_timeout_before_starting_a_kernel(tmp_path, timeout):
    path = tmp_path / "ok.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), path)
    with pytest.raises(ValueError, match="timeout must be a whole number of seconds >= 1"):
        runner.run_notebook(Path(path), out=tmp_path / "o", timeout=timeout, progress=False)
    assert not (tmp_path / "o").exists()
