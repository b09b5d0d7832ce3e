"""Lesson 03 in a real browser: JupyterLab (started here, loopback + token) driven by Chromium.

Runs every cell of lesson 03 in the quick profile, moves the scaler panel's init_scale slider,
presses Run, and checks that the chart's trace and the summary line changed; then a long run
(3000 steps) must show its result within 2x of the kernel's own training time (the run's time
less the chart's, as the panel reports it), stay responsive to typing while it runs, and stop
at once on Reset; and the panel must stay usable in a 760 px window. The three tests share one
page with every cell run once (in file order; the last one narrows the window). Screenshots go
to test-output/ (ignored); the README's still image is updated only when
AMP_LESSONS_UPDATE_IMAGES=1. Skips only where no Chromium executable exists (``.ci/run``
installs Debian's).
"""
import json
import os
import re
import shutil
import time

import pytest

from browser_helpers import OUTPUT_DIR, REPO, chromium_page, lab_serving, open_and_run_all

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

NOTEBOOK = "03_grad_scaler_tuning.ipynb"
README_IMAGE = REPO / "docs" / "images" / "lesson03_panel.png"
RUN_ALL_TIMEOUT_MS = 150_000
LONG_STEPS = 3000

# The panel's chart as plotly.js holds it: each trace's name, x and y (typed arrays as lists).
CHART_DATA = """el => el.data.map(t => ({name: t.name,
    x: Array.from(t.x || []), y: Array.from(t.y || [])}))"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with lab_serving(tmp_path_factory, [REPO / "notebooks" / NOTEBOOK]) as server:
        yield server


@pytest.fixture(scope="module")
def lesson03(chromium, lab):
    """(page, stderr texts): lesson 03 open in one page with every cell run, shared by the tests
    below in file order (running every cell takes about 25 s on a 2-core CI machine); the
    last test narrows the window."""
    with chromium_page(chromium) as page:
        errors = open_and_run_all(page, lab, NOTEBOOK, kernel_timeout_ms=60_000,
                                  run_timeout_ms=RUN_ALL_TIMEOUT_MS)
        yield page, errors


def _chart(page, css):
    # a FigureWidget is itself the .js-plotly-plot element; the Output fallback holds one inside
    return page.locator(f"{css}.js-plotly-plot, {css} .js-plotly-plot").first.evaluate(CHART_DATA)


def _type(page, panel, css, text):
    box = panel.locator(f"{css} input").first
    box.fill(text)
    return box


def test_lesson03_panel_in_jupyterlab(lesson03):
    page, errors = lesson03
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
    field = panel.locator(".amp-init-scale-field input").first
    page.wait_for_function("([el, v]) => el.value === v",
                           arg=[field.element_handle(), str(target)], timeout=20_000)
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
    assert re.search(r"Run 2: skipped [\d,]+ of [\d,]+ steps", text), text

    # a value typed into an integer field is kept as typed and refused next to the field
    _type(page, panel, ".amp-growth-interval", "2.5")
    message = panel.locator(".amp-growth-interval-message").first
    page.wait_for_function("el => /whole number/.test(el.textContent)",
                           arg=message.element_handle(), timeout=20_000)
    assert panel.locator(".amp-growth-interval input").first.input_value() == "2.5"
    _type(page, panel, ".amp-growth-interval", "2000")
    page.wait_for_function("el => el.textContent.trim() === ''",
                           arg=message.element_handle(), timeout=20_000)

    page.wait_for_timeout(500)  # let the last redraw settle before the pictures
    page.screenshot(path=str(OUTPUT_DIR / "lesson03_page.png"))
    shot = OUTPUT_DIR / "lesson03_panel.png"
    panel.screenshot(path=str(shot))
    if os.environ.get("AMP_LESSONS_UPDATE_IMAGES") == "1":
        README_IMAGE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, README_IMAGE)
    (OUTPUT_DIR / "lesson03_chart.json").write_text(json.dumps(
        {"before": before, "after": after, "summary": text}, indent=1))


def test_lesson03_long_run_is_linear_responsive_and_resets_quickly(lesson03):
    page, _ = lesson03
    panel = page.locator(".amp-scaler-panel").first
    panel.scroll_into_view_if_needed()
    summary = panel.locator(".amp-summary")

    # a long run: Run until its result shows in the browser
    _type(page, panel, ".amp-steps", str(LONG_STEPS))
    page.wait_for_timeout(1000)  # the kernel has the new step count
    started = time.monotonic()
    panel.locator(".amp-run").first.click()
    page.wait_for_function("el => /Running/.test(el.textContent)",
                           arg=summary.element_handle(), timeout=20_000)

    # typing registers during the run: the kernel's message beside the field comes back
    typed = time.monotonic()
    _type(page, panel, ".amp-growth-interval", "12.7")
    page.wait_for_function("el => /whole number/.test(el.textContent)",
                           arg=panel.locator(".amp-growth-interval-message").first
                           .element_handle(), timeout=10_000)
    typing_lag = time.monotonic() - typed
    _type(page, panel, ".amp-growth-interval", "2000")

    page.wait_for_function(f"el => /Run \\d+: skipped [\\d,]+ of {LONG_STEPS:,} steps/"
                           f".test(el.textContent)", arg=summary.element_handle(),
                           timeout=300_000)
    in_browser = time.monotonic() - started
    points = _chart(page, ".amp-scaler-panel .amp-scaler-chart")[0]["x"]
    assert len(points) == LONG_STEPS

    # the kernel's own training time: the run's seconds less the chart's, as it reports them
    m = re.search(r"ran ([\d.]+) s, of which the chart ([\d.]+) s", summary.inner_text())
    training = float(m.group(1)) - float(m.group(2))
    (OUTPUT_DIR / "lesson03_long_run.json").write_text(json.dumps(
        {"steps": LONG_STEPS, "browser_s": in_browser, "kernel_run_s": float(m.group(1)),
         "kernel_chart_s": float(m.group(2)), "kernel_training_s": training,
         "typing_lag_s": typing_lag}, indent=1))
    assert in_browser <= 2 * training + 2, (in_browser, training)
    assert typing_lag < 3, typing_lag

    # Reset during a long run stops it at once
    panel.locator(".amp-run").first.click()
    page.wait_for_function("el => /Running/.test(el.textContent)",
                           arg=summary.element_handle(), timeout=20_000)
    page.wait_for_timeout(2000)
    reset = time.monotonic()
    panel.locator(".amp-reset").first.click()
    page.wait_for_function("el => /Press Run/.test(el.textContent)",
                           arg=summary.element_handle(), timeout=15_000)
    assert time.monotonic() - reset < 5


def test_lesson03_panel_usable_in_a_narrow_window(lesson03):
    page, _ = lesson03
    page.set_viewport_size({"width": 760, "height": 900})
    page.wait_for_timeout(1000)  # JupyterLab lays the notebook out again
    panel = page.locator(".amp-scaler-panel").first
    panel.scroll_into_view_if_needed()
    for css in (".amp-init-scale", ".amp-growth-factor", ".amp-backoff-factor",
                ".amp-overflow-rate"):
        box = panel.locator(css).first.bounding_box()
        assert box and box["width"] >= 120, (css, box)         # not shrunk to a dot
    for css in (".amp-run", ".amp-reset"):
        button = panel.locator(css).first
        fits = button.evaluate("el => el.scrollWidth <= el.clientWidth + 1")
        assert fits, css                                      # the label is not cut to "…"
    table = page.locator(".amp-presets-table").first
    table.scroll_into_view_if_needed()
    scrolls = table.evaluate("""el => { const d = el.querySelector('.amp-scroll');
        return d !== null && getComputedStyle(d).overflowX === 'auto'; }""")
    assert scrolls                                            # wide tables scroll, not clip
    page.screenshot(path=str(OUTPUT_DIR / "lesson03_narrow.png"), full_page=False)
    panel.scroll_into_view_if_needed()
    panel.screenshot(path=str(OUTPUT_DIR / "lesson03_narrow_panel.png"))
