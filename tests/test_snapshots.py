"""Static images beside every plotly figure of the committed notebooks (GitHub shows them)."""
import base64
import shutil
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook, new_output

from amp_lessons.publish import snapshots
import numpy as np

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


def _chart_like(path: Path):
    """White, with anti-aliased discs: many pixels of one orange, a few of a red, a blue and a
    teal (a chart whose series differ in size: lesson 04's fp16 and bf16 points)."""
    from PIL import Image, ImageDraw

    big = Image.new("RGB", (1600, 800), "white")
    draw = ImageDraw.Draw(big)
    for i in range(12):
        draw.ellipse([60 + 110 * i, 100, 140 + 110 * i, 180], fill="#F58518")
    for i, color in enumerate(("#E45756", "#E45756", "#4C78A8", "#72B7B2", "#72B7B2")):
        draw.ellipse([60 + 150 * i, 500, 140 + 150 * i, 580], fill=color)
    draw.text((40, 700), "peak allocated memory (GiB)", fill="#2a3f5f")
    big.resize((400, 200), Image.LANCZOS).save(path)
    return path


def test_the_small_png_keeps_every_series_colour(tmp_path):
    """The palette PNG keeps each solid colour (median cut, used before, turned the red and the
    teal series into others), and is smaller than the full-colour PNG."""
    import io

    import numpy as np
    from PIL import Image

    raw = _chart_like(tmp_path / "c.png").read_bytes()
    small = snapshots._small_png(raw)
    before = Image.open(io.BytesIO(raw)).convert("RGB")
    after = Image.open(io.BytesIO(small)).convert("RGB")
    assert snapshots._keeps_colors(before, after)
    pixels = np.asarray(after, dtype=np.int32).reshape(-1, 3)
    for hex_color in ("#F58518", "#E45756", "#4C78A8", "#72B7B2"):
        rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
        assert np.abs(pixels - rgb).sum(axis=1).min() <= 12, hex_color
    median = before.quantize(colors=8, method=Image.Quantize.MEDIANCUT).convert("RGB")
    assert not snapshots._keeps_colors(before, median)  # the check sees a lost series
    assert len(small) < len(raw)


def test_the_small_png_falls_back_to_full_colour_when_a_colour_would_be_lost(tmp_path,
                                                                             monkeypatch):
    import io

    from PIL import Image

    raw = _chart_like(tmp_path / "c.png").read_bytes()
    grey = Image.open(io.BytesIO(raw)).convert("L").convert("P")
    monkeypatch.setattr(Image.Image, "quantize", lambda self, *a, **k: grey)
    out = Image.open(io.BytesIO(snapshots._small_png(raw))).convert("RGB")
    assert snapshots._keeps_colors(Image.open(io.BytesIO(raw)).convert("RGB"), out)


def _trace_colors(figure: dict):
    """The hex colours a figure's visible traces name for their markers and lines."""
    found = set()
    for trace in figure.get("data", []):
        if trace.get("visible", True) is not True:
            continue
        for part in ("marker", "line"):
            color = (trace.get(part) or {}).get("color")
            if isinstance(color, str) and color.startswith("#") and len(color) == 7:
                found.add(color.lower())
    return sorted(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_committed_image_shows_each_series_colour(path):
    """The static image of each committed figure shows every colour its visible traces name
    (a palette that merges two series' colours, as median cut did to lesson 04's fp16 and bf16
    points, fails here)."""
    import io

    import numpy as np
    from PIL import Image

    nb = nbformat.read(path, as_version=4)
    for cell, out in snapshots.figure_outputs(nb):
        image = Image.open(io.BytesIO(base64.b64decode(out["data"][snapshots.IMAGE_MIME])))
        pixels = np.unique(np.asarray(image.convert("RGB"), dtype=np.int32).reshape(-1, 3),
                           axis=0)
        for color in _trace_colors(out["data"][snapshots.PLOTLY_MIME]):
            rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
            assert np.abs(pixels - rgb).sum(axis=1).min() <= 12, \
                f"{path.name} cell {cell}: {color} is not in its image"


def test_figure_colors_reads_every_colour_a_figure_names():
    fig = {"data": [{"marker": {"color": "#E45756"}, "line": {"color": "rgba(10, 20, 30, 0.5)"}}],
           "layout": {"template": {"layout": {"xaxis": {"gridcolor": "#ebf0f8"}}},
                      "paper_bgcolor": "rgb(300,0,0)"}}
    assert snapshots.figure_colors(fig).tolist() == [[10, 20, 30], [228, 87, 86],
                                                     [235, 240, 248], [255, 0, 0]]
    assert snapshots.figure_colors({"data": []}).shape == (0, 3)


def test_grid_lines_count_and_series_blends_do_not():
    """A pale grey line between pixel rows (two rows of blends) is a grid line; a pale pink
    run (the edge of a flat red series) and short runs are not."""
    import numpy as np

    a = np.full((40, 60, 3), 255, dtype=np.uint8)
    a[10, :] = (240, 244, 250)
    a[11, :] = (250, 251, 253)
    a[20, 5:55] = (248, 213, 212)
    a[30, 5:15] = (200, 200, 200)
    lines = snapshots._line_colors(a).tolist()
    assert [240, 244, 250] in lines and [250, 251, 253] in lines
    assert [248, 213, 212] not in lines and [200, 200, 200] not in lines


def test_a_malformed_figure_is_named_with_its_cell(tmp_path):
    v = nbformat.v4
    nb = v.new_notebook(cells=[v.new_code_cell("x"), v.new_code_cell("f", outputs=[
        v.new_output("display_data", data={snapshots.PLOTLY_MIME: {"data": "bad", "layout": []}})])])
    path = tmp_path / "badfig.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match=r"badfig.ipynb: cell 1 holds a plotly figure that is "
                                         r"not one"):
        snapshots.add_images(path)
