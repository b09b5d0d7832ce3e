"""Static images beside the live figures of executed notebooks, so every figure shows where
JavaScript does not run (GitHub's notebook view, nbconvert HTML, offline viewers).

Each plotly output keeps its figure data once (``application/vnd.plotly.v1+json``, which JupyterLab
renders live) and gains an ``image/png`` rendering of the same figure (which static viewers show).
The ``text/html`` copy that plotly's ``notebook_connected`` renderer adds (the data a second time,
plus a script that loads plotly.js from a CDN) is dropped. Rendering uses plotly's own static
export (kaleido) with the system's Chromium: ``python -m amp_lessons figure-images``.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Iterable, Iterator, List, Tuple

from amp_lessons.validate import is_real
from amp_lessons.files import read_notebook, write_notebook

PLOTLY_MIME = "application/vnd.plotly.v1+json"
IMAGE_MIME = "image/png"
DEFAULT_WIDTH = 900
DEFAULT_HEIGHT = 450
MAX_NOTEBOOK_BYTES = 600_000
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def figure_outputs(nb) -> Iterator[Tuple[int, dict]]:
    """``(cell index, output)`` for every output of ``nb`` that holds a plotly figure."""
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if PLOTLY_MIME in out.get("data", {}):
                yield i, out


def missing_images(nb) -> List[int]:
    """Indices of cells with a plotly output that has no static image beside it."""
    return [i for i, out in figure_outputs(nb) if IMAGE_MIME not in out["data"]]


def find_chromium() -> str:
    """The Chromium that kaleido should drive: ``BROWSER_PATH`` if set, else a system Chromium.

    Raises RuntimeError saying how to install one when there is none.
    """
    path = os.environ.get("BROWSER_PATH") or next(
        (p for p in CHROMIUM_CANDIDATES if os.path.exists(p)), None) or shutil.which("chromium")
    if not path:
        raise RuntimeError("static figure images need Chromium: `apt-get install chromium`, or set "
                           "BROWSER_PATH to a Chrome/Chromium executable")
    return path


def render_png(figure: dict, scale: float = 1.0) -> bytes:
    """PNG bytes of a plotly figure given as its JSON dict (``data`` and ``layout``)."""
    import plotly.io as pio

    if not isinstance(figure, dict) or "data" not in figure:
        raise ValueError("figure must be a plotly figure dict with a 'data' entry")
    if not (is_real(scale) and 0.25 <= scale <= 4):
        raise ValueError(f"scale must be a number in [0.25, 4]; got {scale!r}")
    os.environ.setdefault("BROWSER_PATH", find_chromium())
    fig = pio.from_json(json.dumps({"data": figure["data"], "layout": figure.get("layout", {})}),
                        skip_invalid=True)
    layout = figure.get("layout", {})
    width = layout.get("width") or DEFAULT_WIDTH
    height = layout.get("height") or DEFAULT_HEIGHT
    with warnings.catch_warnings():  # kaleido notes that a running server ignores its options
        warnings.simplefilter("ignore", UserWarning)
        png = pio.to_image(fig, format="png", width=width, height=height, scale=scale)
    return _small_png(png, keep=figure_colors(figure))


def _codes(rgb):
    """An RGB image's pixels as one int each (0xRRGGBB), same shape without the channels."""
    import numpy as np

    a = np.asarray(rgb, dtype=np.int32)
    return (a[..., 0] << 16) | (a[..., 1] << 8) | a[..., 2]


def _colors(codes):
    """``_codes``' ints back to an (n, 3) int array of RGB colours."""
    import numpy as np

    c = np.asarray(codes, dtype=np.int64).reshape(-1)
    return np.stack([(c >> 16) & 255, (c >> 8) & 255, c & 255], axis=1).astype(np.int32)


def _solid_colors(rgb, min_pixels: int = 10):
    """The colours of an RGB image that fill areas: colours of at least ``min_pixels`` pixels
    whose four neighbours share their colour (series markers, thick lines, fills, heatmap
    cells; not the blends anti-aliasing makes at edges and in text), an (n, 3) int array."""
    import numpy as np

    code = _codes(rgb)
    inner = code[1:-1, 1:-1]
    same = ((inner == code[:-2, 1:-1]) & (inner == code[2:, 1:-1])
            & (inner == code[1:-1, :-2]) & (inner == code[1:-1, 2:]))
    values, counts = np.unique(inner[same], return_counts=True)
    return _colors(values[counts >= min_pixels])


def _line_colors(rgb, length: int = 24, pale: int = 200, grey: int = 16):
    """The colours of an RGB image's grid lines: pale (every channel at least ``pale``), nearly
    grey (channels within ``grey`` of each other) colours that run unchanged for ``length``
    pixels along a row or a column, also where a line falls between pixel rows and is drawn as
    blends (a series' colours are the figure's own, ``figure_colors``; the pale blends at the
    edges of its flat stretches do not count), an (n, 3) int array."""
    import numpy as np

    code = _codes(rgb)
    found = set()
    for grid in (code, code.T):
        starts = grid.shape[1] - length + 1  # where a run of ``length`` can begin
        if starts < 1:
            continue
        run = np.ones((grid.shape[0], starts), dtype=bool)
        for k in range(1, length):
            run &= grid[:, k: starts + k] == grid[:, :starts]
        found.update(np.unique(grid[:, :starts][run]).tolist())
    colors = _colors(sorted(found))
    spread = colors.max(axis=1, initial=0) - colors.min(axis=1, initial=255)
    return colors[(colors >= pale).all(axis=1) & (spread <= grey)]


_HEX = re.compile(r"#([0-9a-fA-F]{6})\b")
_RGB = re.compile(r"rgba?\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)")


def figure_colors(figure: dict):
    """Every colour a plotly figure's JSON names (``#rrggbb``, ``rgb(...)``, ``rgba(...)``: its
    traces', its layout's and its template's), an (n, 3) int array."""
    import numpy as np

    text = json.dumps(figure)
    found = {tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) for h in _HEX.findall(text)}
    found |= {tuple(min(int(v), 255) for v in m) for m in _RGB.findall(text)}
    return np.array(sorted(found), dtype=np.int32).reshape(-1, 3)


def _wanted_colors(before, colors=None, min_pixels: int = 10, lines=None):
    """The colours of ``before`` that a smaller copy must keep: each of ``colors`` (a figure's
    own, ``figure_colors``) that ``before`` shows as such (within 2) on at least ``min_pixels``
    pixels, or without ``colors`` each solid colour of ``before`` (``_solid_colors``), and the
    colour of every grid line (``lines``, else ``_line_colors(before)``), an (n, 3) int array."""
    import numpy as np

    if colors is None:
        wanted = list(_solid_colors(before, min_pixels))
    else:
        shown = np.unique(np.asarray(before, dtype=np.int32).reshape(-1, 3), axis=0,
                          return_counts=True)
        wanted = [c for c in np.asarray(colors, dtype=np.int32).reshape(-1, 3)
                  if shown[1][np.abs(shown[0] - c).sum(axis=1) <= 2].sum() >= min_pixels]
    wanted += list(_line_colors(before) if lines is None else lines)
    return np.array(wanted, dtype=np.int32).reshape(-1, 3)


def _shows(after, wanted, tolerance: int = 12) -> bool:
    """Whether the RGB image ``after`` shows each of ``wanted`` within ``tolerance`` (the sum of
    the three channels' differences)."""
    import numpy as np

    a = np.unique(np.asarray(after, dtype=np.int32).reshape(-1, 3), axis=0)
    return all(np.abs(a - c).sum(axis=1).min() <= tolerance for c in wanted)


def _keeps_colors(before, after, colors=None, tolerance: int = 12,
                  min_pixels: int = 10) -> bool:
    """Whether ``after`` still shows every colour of ``before`` that matters
    (``_wanted_colors``), within ``tolerance``: no series takes another's colour and no grid
    line fades."""
    return _shows(after, _wanted_colors(before, colors, min_pixels), tolerance)


def _quantized(image, colors: int, keep, lines, pixels):
    """``image`` in a median-cut palette of ``colors`` colours plus the colours of ``keep`` that
    it shows (each as itself, within 2) and of its grid lines (``lines``: ``_line_colors``), at
    most 256: every pixel takes its nearest palette colour, without dithering. ``pixels``: the
    image's distinct colours."""
    import numpy as np
    from PIL import Image

    base = image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    used = len(base.getcolors(256) or []) or colors
    palette = np.array(base.getpalette()[: 3 * used], dtype=np.int32).reshape(-1, 3)
    wanted = list(keep if keep is not None else []) + list(lines)
    extra = [c for c in wanted if np.abs(pixels - c).sum(axis=1).min() <= 2
             and np.abs(palette - c).sum(axis=1).min() > 2]
    palette = np.concatenate([np.array(extra, dtype=np.int32).reshape(-1, 3), palette])[:256]
    holder = Image.new("P", (1, 1))
    holder.putpalette(palette.astype(np.uint8).ravel().tolist()
                      + [0] * (768 - 3 * len(palette)))
    return image.quantize(palette=holder, dither=Image.Dither.NONE)


def _small_png(png: bytes, colors: int = 64, keep=None) -> bytes:
    """The same picture in a palette of ``colors`` colours (about 8 kB instead of 26 kB a chart)
    or a few more: the first of an octree palette (which keeps a series' colour even when few
    pixels carry it), then median-cut palettes of ``colors``, twice that and 224 colours (which
    keep the pale blends of grid lines) with ``keep``'s colours added (``_quantized``), that
    keeps every colour that matters (``_wanted_colors``, over ``keep``: the figure's own
    colours, else the image's solid ones, and its lines' colours); else the full-colour PNG.
    Median cut alone, used before, turned lesson 04's bf16 points the orange of fp16."""
    import numpy as np
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    lines = _line_colors(image)  # what every candidate is checked against, found once
    wanted = _wanted_colors(image, keep, lines=lines)
    pixels = np.unique(np.asarray(image, dtype=np.int32).reshape(-1, 3), axis=0)
    small = image  # unless a palette keeps every colour that matters: the first that does
    candidates = [lambda: image.quantize(colors=colors, method=Image.Quantize.FASTOCTREE)]
    candidates += [lambda n=n: _quantized(image, n, keep, lines, pixels)
                   for n in (colors, 2 * colors, 224)]
    for make in candidates:
        candidate = make()
        if _shows(candidate.convert("RGB"), wanted):
            small = candidate
            break
    out = io.BytesIO()
    small.save(out, format="PNG", optimize=True)
    return out.getvalue()


@contextlib.contextmanager
def _browser():
    """One Chromium for all figures of a run (kaleido >= 1 starts one per figure otherwise)."""
    os.environ.setdefault("BROWSER_PATH", find_chromium())
    try:
        import kaleido
        start, stop = kaleido.start_sync_server, kaleido.stop_sync_server
    except (ImportError, AttributeError):  # kaleido 0.2 has its own browser and no server
        yield
        return
    start(silence_warnings=True)
    try:
        yield
    finally:
        stop(silence_warnings=True)



MIN_PACKED = 64  # arrays shorter than this stay readable lists


def _packed(values):
    """A long list of plain numbers as plotly's typed-array form (``{"dtype", "bdata"}``: the same
    numbers, base64 of float64 or int32, exactly), or None when it should stay a list."""
    import numpy as np

    if not isinstance(values, list) or len(values) < MIN_PACKED:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    ints = all(isinstance(v, int) for v in values)
    if ints and all(-2**31 <= v < 2**31 for v in values):
        array, dtype = np.asarray(values, dtype="<i4"), "i4"
    else:
        array, dtype = np.asarray(values, dtype="<f8"), "f8"
    return {"dtype": dtype, "bdata": base64.b64encode(array.tobytes()).decode("ascii")}


def pack_figure(figure: dict) -> int:
    """Store each trace's long numeric arrays in plotly's typed-array form (lossless: float64 and
    int32 bytes, base64), which plotly.js 2.28+ reads. A notebook stores a figure one number a line
    otherwise, which made a 2,000-step loss curve 700 kB. Returns the number of arrays packed."""
    packed = 0
    for trace in figure.get("data", []):
        for key, value in list(trace.items()):
            if isinstance(value, list) and value and isinstance(value[0], list):
                continue  # 2-D data (customdata rows, heatmaps) stays as it is
            new = _packed(value)
            if new is not None:
                trace[key] = new
                packed += 1
    return packed


def add_images(path: Path, scale: float = 1.0, force: bool = False) -> int:
    """Give every plotly output of the notebook at ``path`` a PNG beside it, drop its HTML copy and
    pack its long numeric arrays (``pack_figure``).

    Only outputs without an image are rendered unless ``force``. Writes the notebook only when it
    changed, atomically (``files.write_notebook``); returns the number of images added.
    ``NotANotebookError`` (a ValueError) names a file that is not a valid notebook.
    """
    path = Path(path)
    if not path.is_file() or path.suffix != ".ipynb":
        raise ValueError(f"path must be an existing .ipynb file; got '{path}'")
    nb = read_notebook(path)
    added = 0
    changed = False
    for i, out in figure_outputs(nb):
        data = out["data"]
        fig = data[PLOTLY_MIME]
        if not (isinstance(fig, dict) and isinstance(fig.get("data", []), list)
                and isinstance(fig.get("layout", {}), dict)):
            raise ValueError(f"{path.name}: cell {i} holds a plotly figure that is not one (a "
                             f"figure is a dict with a list 'data' and a dict 'layout')")
        if "text/html" in data:
            del data["text/html"]
            changed = True
        if IMAGE_MIME not in data or force:
            png = render_png(copy.deepcopy(data[PLOTLY_MIME]), scale=scale)
            data[IMAGE_MIME] = base64.b64encode(png).decode("ascii")
            added += 1
            changed = True
        if pack_figure(data[PLOTLY_MIME]):
            changed = True
    if changed:
        write_notebook(nb, path)
    return added


def add_images_to(paths: Iterable[Path], scale: float = 1.0, force: bool = False) -> dict:
    """``add_images`` for each notebook; returns ``{path: images added}``. Every path is checked
    first (an existing, valid notebook: ValueError naming the file otherwise), before Chromium
    is looked for or started."""
    paths = [Path(p) for p in paths]
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            raise ValueError(f"path must be an existing .ipynb file; got '{p}'")
        read_notebook(p)
    with _browser():
        return {str(p): add_images(Path(p), scale=scale, force=force) for p in paths}
