"""Static images beside every plotly figure of the committed notebooks (GitHub shows them)."""
import base64
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from amp_lessons import snapshots

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_an_image_beside_every_figure_and_stay_small(path):
    nb = nbformat.read(path, as_version=4)
    assert snapshots.missing_images(nb) == [], \
        f"{path.name}: run `python -m amp_lessons figure-images` (cells {snapshots.missing_images(nb)})"
    for _, out in snapshots.figure_outputs(nb):
        assert "text/html" not in out["data"], f"{path.name}: a figure's data is stored twice"
    assert path.stat().st_size <= snapshots.MAX_NOTEBOOK_BYTES, f"{path.name} is over 600 KB"


def _figure_notebook(path: Path) -> Path:
    fig = {"data": [{"type": "scatter", "x": [1, 2, 3], "y": [2, 1, 3]}],
           "layout": {"title": {"text": "t"}, "height": 300}}
    out = new_output("display_data", data={snapshots.PLOTLY_MIME: fig, "text/html": "<div>copy</div>",
                                           "text/plain": "Figure"})
    nb = new_notebook(cells=[new_code_cell("fig", outputs=[out])])
    nbformat.write(nb, path)
    return path


@pytest.mark.skipif(shutil.which("chromium") is None and not Path("/usr/bin/chromium").exists(),
                    reason="static export needs Chromium (apt-get install chromium)")
def test_add_images_renders_a_png_and_drops_the_html_copy(tmp_path):
    path = _figure_notebook(tmp_path / "f.ipynb")
    assert snapshots.add_images_to([path]) == {str(path): 1}
    nb = nbformat.read(path, as_version=4)
    data = nb.cells[0].outputs[0]["data"]
    assert "text/html" not in data and snapshots.PLOTLY_MIME in data
    png = base64.b64decode(data[snapshots.IMAGE_MIME])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 60_000
    assert snapshots.add_images(path) == 0  # already there: nothing rendered again
    assert snapshots.missing_images(nb) == []


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="path must be an existing .ipynb"):
        snapshots.add_images(tmp_path / "nope.ipynb")
    with pytest.raises(ValueError, match="figure must be"):
        snapshots.render_png([1, 2])
    with pytest.raises(ValueError, match="scale must be"):
        snapshots.render_png({"data": []}, scale=10)


def test_missing_images_finds_figures_without_a_picture(tmp_path):
    nb = nbformat.read(_figure_notebook(tmp_path / "g.ipynb"), as_version=4)
    assert snapshots.missing_images(nb) == [0]
    assert [i for i, _ in snapshots.figure_outputs(nb)] == [0]


def test_find_chromium_honours_browser_path(monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", "/some/chrome")
    assert snapshots.find_chromium() == "/some/chrome"


def test_pack_figure_is_lossless_and_leaves_short_or_mixed_arrays_alone():
    import numpy as np

    ys = [0.1 * i + 1e-12 for i in range(100)]
    fig = {"data": [{"type": "scatter", "x": list(range(100)), "y": list(ys), "text": ["a"] * 100,
                     "customdata": [[1, 2]] * 100, "marker": {"size": 3}}, {"y": [1.0, 2.0]}]}
    assert snapshots.pack_figure(fig) == 2
    t = fig["data"][0]
    assert t["x"]["dtype"] == "i4" and t["y"]["dtype"] == "f8"
    assert np.frombuffer(base64.b64decode(t["y"]["bdata"]), "<f8").tolist() == ys
    assert np.frombuffer(base64.b64decode(t["x"]["bdata"]), "<i4").tolist() == list(range(100))
    assert t["text"] == ["a"] * 100 and t["customdata"] == [[1, 2]] * 100
    assert fig["data"][1]["y"] == [1.0, 2.0]
    assert snapshots.pack_figure(fig) == 0  # already packed


@pytest.mark.skipif(shutil.which("chromium") is None and not Path("/usr/bin/chromium").exists(),
                    reason="static export needs Chromium (apt-get install chromium)")
def test_plotly_js_draws_a_packed_figure_exactly_as_the_plain_one():
    plain = {"data": [{"type": "scatter", "y": [float(i % 7) for i in range(80)]}],
             "layout": {"title": {"text": "packed"}, "height": 300, "width": 400}}
    packed = __import__("copy").deepcopy(plain)
    assert snapshots.pack_figure(packed) == 1
    with snapshots._browser():
        assert snapshots.render_png(packed) == snapshots.render_png(plain)
