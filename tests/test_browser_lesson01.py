"""Lesson 01 in a real browser: JupyterLab (started here, loopback + token) driven by Chromium.

Runs every cell of lesson 01 in the quick profile, types a value into the bit explorer and checks
its table, moves the loss-scale slider and checks that the chart and the summary changed.
Screenshots go to test-output/. Skips only where no Chromium executable exists.
"""
import re
import shutil

import pytest

from browser_helpers import CHROMIUM_ARGS, OUTPUT_DIR, REPO, JupyterLabServer, chromium_executable

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

NOTEBOOK = "01_fp16_ranges_and_underflow.ipynb"
ALL_CELLS_RAN = """() => {
    const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
        .map(e => e.textContent.trim());
    return prompts.length > 0 && prompts.every(t => /^\\[\\d+\\]:$/.test(t));
}"""
# the status bar reads "Python 3 (ipykernel) | Idle" once the kernel is up
KERNEL_IDLE = "() => /\\|\\s*Idle/.test(document.body.innerText)"


@pytest.fixture(scope="module")
def chromium():
    path = chromium_executable()
    if path is None:
        pytest.skip("no Chromium executable (install Debian's: apt-get install -y chromium)")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("notebooks")
    shutil.copy(REPO / "notebooks" / NOTEBOOK, root / NOTEBOOK)
    with JupyterLabServer(root, tmp_path_factory.mktemp("jupyter"),
                          env={"AMP_LESSONS_PROFILE": "quick"}) as server:
        yield server


def test_lesson01_widgets_in_jupyterlab(chromium, lab):
    from playwright.sync_api import sync_playwright

    OUTPUT_DIR.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(lab.url(f"lab/tree/{NOTEBOOK}"))
            page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
            page.locator(".jp-Notebook").first.click()
            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
            try:
                page.wait_for_function(ALL_CELLS_RAN, timeout=150_000)
            except Exception:
                page.screenshot(path=str(OUTPUT_DIR / "lesson01_run_all_failed.png"), full_page=True)
                raise AssertionError(f"not every cell ran; server log:\n{lab.log()}")
            errors = page.locator(".jp-OutputArea-output[data-mime-type="
                                  "'application/vnd.jupyter.stderr']").all_inner_texts()
            assert not [e for e in errors if "Traceback" in e or "Error" in e], errors[:2]

            # the bit explorer: type 65520, fp16 shows infinity (0x7C00)
            explorer = page.locator(".amp-bit-explorer").first
            explorer.scroll_into_view_if_needed()
            table = explorer.locator(".amp-bit-table")
            assert "0x2E66" in table.inner_text()                        # 0.1 in fp16
            box = explorer.locator(".amp-bit-text input").first
            box.fill("65520")
            box.press("Enter")
            page.wait_for_function("el => /0x7C00/.test(el.textContent)",
                                   arg=table.element_handle(), timeout=20_000)
            assert "x = 65520.0" in table.inner_text()
            explorer.screenshot(path=str(OUTPUT_DIR / "lesson01_bit_explorer.png"))

            # the loss-scale slider: 12 steps right, the chart's title and the summary follow
            panel = page.locator(".amp-l01-scale").first
            panel.scroll_into_view_if_needed()
            summary = panel.locator(".amp-l01-summary")
            before = summary.inner_text()
            chart = panel.locator(".js-plotly-plot").first
            assert "× 2^0 " in chart.evaluate("el => el.layout.title.text")
            handle = panel.locator(".amp-l01-k .noUi-handle").first
            handle.focus()
            for _ in range(12):
                handle.press("ArrowRight")
            page.wait_for_function("([el, s]) => el.textContent !== s",
                                   arg=[summary.element_handle(), before], timeout=30_000)
            page.wait_for_function("el => /× 2\\^12 /.test(el.layout.title.text)",
                                   arg=chart.element_handle(), timeout=30_000)
            assert "4096" in summary.inner_text()
            panel.screenshot(path=str(OUTPUT_DIR / "lesson01_loss_scale.png"))
        finally:
            browser.close()
