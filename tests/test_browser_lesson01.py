"""Lesson 01 in a real browser: JupyterLab (started here, loopback + token) driven by Chromium.

Runs every cell of lesson 01 in the quick profile, types a value into the bit explorer and checks
its table, drives its slider to its top end (an exact 2^20), moves the loss-scale slider and
checks that the chart and the summary changed, and that no shown share reads 0.000%.
Screenshots go to test-output/. Skips only where no Chromium executable exists.
"""
import pytest

from browser_helpers import OUTPUT_DIR, REPO, chromium_page, lab_serving, open_and_run_all

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

NOTEBOOK = "01_fp16_ranges_and_underflow.ipynb"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with lab_serving(tmp_path_factory, [REPO / "notebooks" / NOTEBOOK]) as server:
        yield server


def test_lesson01_widgets_in_jupyterlab(chromium, lab):
    with chromium_page(chromium) as page:
        errors = open_and_run_all(page, lab, NOTEBOOK)
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
        # the sign box flips the typed value (never the slider's magnitude): 2**-40 -> -(2**-40)
        box.fill("2**-40")
        box.press("Enter")
        page.wait_for_function("el => /x = 9\\.094947017729282e-13/.test(el.textContent)",
                               arg=table.element_handle(), timeout=20_000)
        explorer.locator("input[type=checkbox]").first.check()
        page.wait_for_function("el => /x = -9\\.094947017729282e-13/.test(el.textContent)",
                               arg=table.element_handle(), timeout=20_000)
        assert box.input_value() == "-(2**-40)"
        explorer.locator("input[type=checkbox]").first.uncheck()
        page.wait_for_function("el => /x = 9\\.094947017729282e-13/.test(el.textContent)",
                               arg=table.element_handle(), timeout=20_000)
        # the slider's top end is exactly 2^20: no stray mantissa bit
        slider = explorer.locator(".amp-bit-slider .noUi-handle").first
        slider.focus()
        slider.press("End")
        page.wait_for_function("el => /x = 1048576\\.0/.test(el.textContent)",
                               arg=table.element_handle(), timeout=20_000)
        assert box.input_value() == "1048576.0"
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
        assert "0.000%" not in summary.inner_text()
        panel.screenshot(path=str(OUTPUT_DIR / "lesson01_loss_scale.png"))
