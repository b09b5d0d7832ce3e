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
import shutil
import warnings
from pathlib import Path
from typing import Iterable, Iterator, List, Tuple

from ._validate import is_real
from .files import read_notebook, write_notebook

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
    return _small_png(png)


def _small_png(png: bytes, colors: int = 64) -> bytes:
    """The same picture in a 64-colour palette: charts have few colours, and the notebook stays
    small (about 13 kB instead of 55 kB a figure)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, format="PNG",
                                                                         optimize=True)
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
    for _, out in figure_outputs(nb):
        data = out["data"]
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
