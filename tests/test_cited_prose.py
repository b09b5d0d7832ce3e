"""Lesson prose that quotes a committed run's number cites it (``report.cited_prose``): the
markdown cell keeps its text with citations in ``metadata.amp_lessons.cited``, and
``python -m amp_lessons readme`` fills the number the committed run published. Re-runs left
typed numbers stale in lessons 04 and 07 (fp16's lead over bf16, the FP8 speed-ups)."""
import json
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_markdown_cell, new_notebook

from amp_lessons.publish import report

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MEASURED = re.compile(r"(?<![\w.^-])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)\s*(img/s|GiB|x\b)")


def test_the_committed_lessons_cited_prose_is_current():
    assert report.cite_notebooks(NOTEBOOKS, write=False) == []
    cited = [p.name for p in NOTEBOOKS
             if report.cited_prose(nbformat.read(p, as_version=4), report.collect(NOTEBOOKS))]
    assert {"04_resnet50_memory_and_speed.ipynb", "07_fp8_training.ipynb"} <= set(cited)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_lesson_types_a_measured_number_its_run_does_not_show(path):
    """A number with img/s, GiB or x in a markdown cell that does not cite is one the notebook's
    own outputs show, or one a benchmark recorded (the cell names ``benchmarks/``)."""
    nb = json.loads(path.read_text())
    outputs = json.dumps([c.get("outputs", []) for c in nb["cells"]])
    typed = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "benchmarks/" in source or \
                "cited" in cell.get("metadata", {}).get("amp_lessons", {}):
            continue
        typed += [(i, m.group(0)) for m in MEASURED.finditer(source)
                  if m.group(1) not in outputs]
    assert not typed, f"{path.name}: cite these ({{{{KEY | ROW | COLUMN}}}}): {typed}"


def _notebook(tmp_path, name, cells):
    path = tmp_path / name
    nbformat.write(new_notebook(cells=cells), path)
    return path


def test_cite_notebooks_fills_writes_and_names_what_it_cannot_find(tmp_path):
    results = [{"key": "t.one", "columns": ["run", "x"], "rows": [{"run": "a", "x": 1.5}],
                "notebook": "n.ipynb", "run": {}}]
    cell = new_markdown_cell("old 1.2 x", metadata={"amp_lessons": {"cited": "now {{t.one | a | x}} x"}})
    nb = new_notebook(cells=[cell, new_markdown_cell("plain")])
    assert report.cited_prose(nb, results) == [(0, "now 1.50 x")]
    bad = new_notebook(cells=[new_markdown_cell("t", metadata={"amp_lessons": {"cited": "no citation"}})])
    with pytest.raises(ValueError, match="at least one"):
        report.cited_prose(bad, results)
    # a notebook citing a table no notebook publishes: named, nothing written
    path = _notebook(tmp_path, "n.ipynb", [cell])
    before = path.read_text()
    with pytest.raises(ValueError, match=r"n\.ipynb: citation .*no published table"):
        report.cite_notebooks([path])
    assert path.read_text() == before
    # with the table published beside it: filled (dry run first)
    from amp_lessons.publish.report import RESULT_MIME
    from nbformat.v4 import new_code_cell, new_output

    out = new_output("display_data", data={RESULT_MIME: {"key": "t.one", "title": "T",
                                                         "columns": ["run", "x"],
                                                         "rows": [{"run": "a", "x": 1.5}]}})
    source = _notebook(tmp_path, "s.ipynb", [new_code_cell("x", outputs=[out])])
    assert report.cite_notebooks([path, source], write=False) == [path]
    assert path.read_text() == before
    assert report.cite_notebooks([path, source]) == [path]
    assert nbformat.read(path, as_version=4).cells[0].source == "now 1.50 x"
    assert report.cite_notebooks([path, source]) == []


def test_cite_notebooks_refreshes_a_rendered_cheat_sheet(tmp_path):
    """Lesson 09 renders docs/cheat_sheet.md from the committed runs (``Markdown(lesson.
    cheat_sheet())``): a view computed by no device. When another lesson's run changes a number
    it cites, ``python -m amp_lessons readme`` refreshes that output with the cited prose
    (it stayed stale until lesson 09 itself ran again on a GPU); nothing else in the notebook
    moves, and a current one is left alone."""
    from nbformat.v4 import new_code_cell, new_output
    from amp_lessons.publish.report import RESULT_MIME

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cheat_sheet.md").write_text(
        "<!-- note to editors -->\nfp16 runs at **{{t.one | a | x}}** x.\n")
    (tmp_path / "notebooks").mkdir()
    table = new_output("display_data", data={RESULT_MIME: {
        "key": "t.one", "title": "T", "columns": ["run", "x"], "rows": [{"run": "a", "x": 2.25}]}})
    source = _notebook(tmp_path / "notebooks", "04.ipynb", [new_code_cell("x", outputs=[table])])
    shown = new_output("execute_result", data={"text/markdown": "fp16 runs at **1.00** x.\n",
                                               "text/plain": "<Markdown>"}, execution_count=3)
    other = new_output("stream", name="stdout", text="unrelated\n")
    path = _notebook(tmp_path / "notebooks", "09.ipynb", [
        new_code_cell("Markdown(lesson.cheat_sheet())", outputs=[shown]),
        new_code_cell("print('unrelated')", outputs=[other])])
    before = nbformat.read(path, as_version=4)
    assert report.cite_notebooks([source, path], write=False) == [path]
    assert nbformat.read(path, as_version=4) == before  # a dry run writes nothing
    assert report.cite_notebooks([source, path]) == [path]
    after = nbformat.read(path, as_version=4)
    assert after.cells[0].outputs[0].data["text/markdown"] == "fp16 runs at **2.25** x.\n"
    assert after.cells[0].outputs[0].data["text/plain"] == "<Markdown>"
    assert after.cells[1] == before.cells[1]
    assert report.cite_notebooks([source, path]) == []
