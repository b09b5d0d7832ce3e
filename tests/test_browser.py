"""Lesson 03 in a real browser: JupyterLab (started here, loopback + token) driven by Chromium.

Runs every cell of lesson 03 in the quick profile, moves the scaler panel's init_scale slider,
presses Run, and checks that the chart's trace and the summary line changed. Saves screenshots
under test-output/ and the panel's as docs/images/lesson03_panel.png (the README's still image).
Skips only where no Chromium executable exists (``.ci/run`` installs Debian's).
"""
import json
import re
import shutil

import pytest

from browser_helpers import OUTPUT_DIR, REPO, chromium_page, lab_serving, open_and_run_all

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

NOTEBOOK = "03_grad_scaler_tuning.ipynb"
README_IMAGE = REPO / "docs" / "images" / "lesson03_panel.png"
RUN_ALL_TIMEOUT_MS = 150_000

# The panel's chart as plotly.js holds it: each trace's name, x and y (typed arrays as lists).
CHART_DATA = """el => el.data.map(t => ({name: t.name,
    x: Array.from(t.x || []), y: Array.from(t.y || [])}))"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with lab_serving(tmp_path_factory, (REPO / "notebooks").glob("*.ipynb")) as server:
        yield server


def _chart(page, css):
    # a FigureWidget is itself the .js-plotly-plot element; the Output fallback holds one inside
    return page.locator(f"{css}.js-plotly-plot, {css} .js-plotly-plot").first.evaluate(CHART_DATA)


def test_lesson03_panel_in_jupyterlab(chromium, lab):
    with chromium_page(chromium) as page:
        errors = open_and_run_all(page, lab, NOTEBOOK, kernel_timeout_ms=60_000,
                                  run_timeout_ms=RUN_ALL_TIMEOUT_MS)
        on_purpose = "unexpected keyword argument 'scale_factor'"  # the B4 cell
        unexpected = [e for e in errors if ("Traceback" in e or "Error" in e)
                      and on_purpose not in e]
        assert not unexpected, unexpected[:2]

        panel = page.locator(".amp-scaler-panel").first
        panel.scroll_into_view_if_needed()
        summary = panel.locator(".amp-summary")
        assert "Run 1:" in summary.inner_text()
        before = _chart(page, ".amp-scaler-panel .amp-scaler-chart")
        first_log2 = before[0]["y"][0]

        # move init_scale 4 steps down with the keyboard on the slider's handle
        handle = panel.locator(".amp-init-scale .noUi-handle").first
        handle.focus()
        for _ in range(4):
            handle.press("ArrowLeft")
        target = int(first_log2) - 4
        readout = panel.locator(".amp-init-scale .widget-readout").first
        assert readout.inner_text().strip() == str(target)
        # the label beside it is written by the kernel's observer: the kernel has the value
        page.wait_for_function(
            "([el, text]) => el.textContent.trim() === text",
            arg=[panel.locator(".amp-init-scale-value").first.element_handle(),
                 f"= {2 ** target:,}"], timeout=20_000)

        panel.locator(".amp-run").first.click()
        page.wait_for_function(
            "el => /Run 2:/.test(el.textContent)", arg=summary.element_handle(),
            timeout=60_000)
        after = _chart(page, ".amp-scaler-panel .amp-scaler-chart")
        assert after != before
        assert after[0]["name"] == "loss scale" and after[0]["y"][0] == target
        assert len(after[0]["x"]) == len(before[0]["x"])  # same number of steps
        text = summary.inner_text()
        assert re.search(r"Run 2: skipped \d+ of \d+ steps", text), text

        page.wait_for_timeout(500)  # let the last redraw settle before the pictures
        page.screenshot(path=str(OUTPUT_DIR / "lesson03_page.png"))
        shot = OUTPUT_DIR / "lesson03_panel.png"
        panel.screenshot(path=str(shot))
        README_IMAGE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, README_IMAGE)
        (OUTPUT_DIR / "lesson03_chart.json").write_text(json.dumps(
            {"before": before, "after": after, "summary": text}, indent=1))
