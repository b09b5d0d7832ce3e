"""Progress bars: a live bar while running, one line of plain text in the saved notebook."""
import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from tqdm.std import tqdm as plain_tqdm

from amp_lessons import progress
from amp_lessons.publish import notebooks as runner


def test_summary_text():
    assert progress.summary_text("configurations", 16, 16, "it", 192.4) == \
        "configurations: 16/16 in 03:12"
    assert progress.summary_text("epoch 2", 1, 1, "batch", 1.0) == "epoch 2: 1/1 batch in 00:01"
    assert progress.summary_text("epoch 2", 3, 23, "step", 1.0) == \
        "epoch 2: 3/23 steps in 00:01 (stopped)"
    assert progress.summary_text("", 5, None, "step", 61.0) == "5 steps in 01:01"


def test_outside_a_notebook_it_is_tqdms_text_bar():
    bar = progress.progress_bar(range(3), desc="x", disable=True)
    assert isinstance(bar, plain_tqdm) and list(bar) == [0, 1, 2]


def test_a_shown_bar_in_a_terminal_is_a_text_bar(capsys):
    # pytest is no Jupyter kernel: tqdm.auto gives its asyncio text bar, which takes no `display`
    # (`python -m amp_lessons train` failed on it in every terminal)
    assert not progress.IN_NOTEBOOK
    bar = progress.progress_bar(range(3), desc="epoch 1", unit="batch")
    assert isinstance(bar, plain_tqdm) and list(bar) == [0, 1, 2]
    bar = progress.progress_bar(total=4, desc="x", leave=False)
    bar.update(4)
    bar.close()
    assert "3/3" in capsys.readouterr().err


@pytest.mark.slow
def test_a_finished_bar_leaves_plain_text_in_the_saved_notebook(tmp_path):
    """Run in a real kernel: the saved output is text, not a widget a static view cannot show."""
    nb = new_notebook(cells=[new_code_cell(
        "from amp_lessons.progress import progress_bar\n"
        "for _ in progress_bar(range(3), desc='configurations', leave=False):\n    pass\n"
        "bar = progress_bar(total=4, desc='epoch 1')\nbar.update(2)\nbar.close()\nprint('done')")])
    path = tmp_path / "bars.ipynb"
    nbformat.write(nb, path)
    runner.run_notebook(path, profile="quick", progress=False)
    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    data = [o for o in outputs if o.output_type == "display_data"]
    assert all(set(o.data) == {"text/plain"} for o in data), [o.data for o in data]
    texts = [o.data["text/plain"] for o in data]
    assert texts[0].startswith("configurations: 3/3 in 00:0")
    assert texts[1].startswith("epoch 1: 2/4 in 00:0") and texts[1].endswith("(stopped)")
    assert [o.text for o in outputs if o.output_type == "stream"] == ["done\n"]
