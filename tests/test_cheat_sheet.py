"""The practitioner's cheat sheet (docs/cheat_sheet.md) is the README's "Cheat sheet" section,
cites its numbers from the tables the committed notebooks publish (no number typed by hand),
links to lessons that exist, and holds for current PyTorch: its loop runs, asks for native bf16
only, waits for no GPU in the step and holds the schedule on a skipped step; its TF32 line names
the API and the defaults it states."""
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
from pathlib import Path

from amp_lessons.publish import report

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "cheat_sheet.md").read_text()
README = (ROOT / "README.md").read_text()
RESULTS = report.collect(sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
RAW = DOC.split("-->", 1)[1].strip("\n")
BODY = report.cheat_sheet_body(DOC, RESULTS)


def test_every_number_is_cited_not_typed():
    """Every bold number is a citation: the raw sheet holds none typed in, at least 20
    citations, and each resolves to one published cell."""
    assert not re.findall(r"\*\*[+-]?\d[\d,]*\.?\d*\*\*", RAW)
    citations = report.CITATION.findall(RAW)
    assert len(citations) >= 20
    assert len(re.findall(r"\*\*\{\{", RAW)) >= 20
    for c in citations:
        assert report.cite(RESULTS, c)


def test_a_citation_names_what_it_cannot_find():
    rows = [{"run": "a", "x": 1.5, "y": "p"}, {"run": "b", "x": 2.0, "y": "p"},
            {"run": "c", "x": 3.0, "y": "`q`"}]
    results = [{"key": "t.one", "columns": ["run", "x", "y"], "rows": rows}]
    assert report.cite(results, "t.one | b | x") == "2.00"
    assert report.cite(results, "t.one | y=p; run=a | x") == "1.50"
    assert report.cite(results, " t.one | `c` |  x ") == "3.00"  # backticks and spaces as shown
    assert report.resolve_citations("**{{t.one | a | y}}** and {{t.one|c|y}}", results) == \
        "**p** and `q`"
    for bad, message in (("t.one | b", "must read"), ("t.two | b | x", "no published table"),
                         ("t.one | b | z", "no column 'z'"), ("t.one | y=p | x", "2 rows"),
                         ("t.one | d | x", "0 rows"), ("t.one | run=a; run=b | x", "0 rows")):
        with pytest.raises(ValueError, match=message):
            report.cite(results, bad)
    with pytest.raises(ValueError, match="results must be given"):
        report.cheat_sheet_body("<!-- n -->\n**{{t.one | a | x}}**")


def test_a_cited_value_is_written_as_markdown_that_shows_it():
    """A published cell with Markdown's special characters reads as itself in the prose: the
    value ``2*3 [ms]_total`` must not open emphasis or a link (it did: cited raw)."""
    rows = [{"run": "a", "label": "2*3 [ms]_total", "cfg": "torch.compile(mode='max-autotune')"}]
    results = [{"key": "t.two", "columns": ["run", "label", "cfg"], "rows": rows}]
    assert report.resolve_citations("x {{t.two | a | label}} y", results) == \
        r"x 2\*3 \[ms\]`_total` y"  # identifiers in code spans, as everywhere
    assert report.resolve_citations("{{t.two | a | cfg}}", results) == \
        "`torch.compile(mode='max-autotune')`"


def test_readme_cheat_sheet_is_the_doc():
    section = README.split("\n## Cheat sheet\n", 1)[1].split("\n## ", 1)[0]
    assert BODY in section
    for part in ("### Which precision: a decision chart", "### The AMP loop, to copy",
                 "### Symptom, cause, fix"):
        assert part in BODY


def test_every_bold_number_is_published_in_the_results():
    results = README.split("<!-- results:start", 1)[1].split("<!-- results:end", 1)[0]
    numbers = re.findall(r"\*\*([+-]?\d[\d,]*\.?\d*)\*\*", BODY)
    assert len(numbers) >= 20, numbers
    missing = [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", results)]
    assert not missing, f"cited but not in the README's results: {missing}"


def test_links_point_at_lessons_that_exist_and_every_symptom_is_covered():
    links = re.findall(r"blob/main/(notebooks/[\w.]+\.ipynb)", BODY)
    assert links and all((ROOT / link).exists() for link in links)
    table = BODY.split("### Symptom, cause, fix", 1)[1]
    for symptom in ("loss scale halves", "fused SGD", "no speed-up", "GPU sits idle",
                    "FP8 slower than bf16", "weights stop moving"):
        assert symptom in table, symptom


def test_readme_block_is_rebuilt_from_the_doc():
    from amp_lessons.publish import report

    stale = f"# R\n\n{report.CHEAT_START}\nold text, **1.00**\n{report.CHEAT_END}\n\n## Next\n"
    new = report.with_cheat_sheet(stale, DOC, results=RESULTS)
    assert "old text" not in new and BODY in new and new.endswith("\n\n## Next\n")
    assert "The practitioner's cheat sheet" not in new  # the doc's note to editors stays out
    assert report.with_cheat_sheet(new, DOC, results=RESULTS) == new
    # the committed copy is current: the doc, cited from the committed notebooks
    assert report.with_cheat_sheet(README, DOC, results=RESULTS) == README
    with pytest.raises(ValueError, match="cheat-sheet markers"):
        report.with_cheat_sheet("# R\n", DOC, "README.md", RESULTS)


def test_readme_with_generated_takes_the_doc_beside_the_readme(tmp_path):
    from amp_lessons.publish import report

    readme = tmp_path / "README.md"
    text = (f"# R\n\n{report.START}\n{report.END}\n\n{report.CHEAT_START}\nSTALE-COPY\n"
            f"{report.CHEAT_END}\n")
    assert "STALE-COPY" in report.readme_with_generated(readme, text, [])  # no doc beside it: kept
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cheat_sheet.md").write_text(DOC)
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    new = report.readme_with_generated(readme, text, notebooks)
    assert "STALE-COPY" not in new and BODY in new  # cited from the notebooks given
    with pytest.raises(ValueError, match="no published table"):
        report.readme_with_generated(readme, text, [])


def test_lesson_09_shows_the_cheat_sheet_of_the_committed_runs():
    """Lesson 09 renders the cheat sheet from the other lessons' committed runs when it runs:
    the numbers in its committed output (the bold citations, in order) must be those the
    committed runs give now (a lesson re-run after lesson 09 left them stale until
    ``python -m amp_lessons readme`` refreshes them: ``report.rendered_cheat_sheets``)."""
    import json

    nb = json.loads((ROOT / "notebooks" / "09_your_model.ipynb").read_text())
    (cell,) = [c for c in nb["cells"] if c["cell_type"] == "code"
               and "lesson.cheat_sheet()" in "".join(c["source"])]
    (shown,) = [o["data"]["text/markdown"] for o in cell["outputs"]
                if "text/markdown" in o.get("data", {})]
    def numbers(text):
        return re.findall(r"\*\*([+-]?\d[\d,]*\.?\d*)\*\*", text)

    assert numbers("".join(shown)) == numbers(BODY), "lesson 09's cheat sheet is stale: run python -m amp_lessons readme"
    assert len(numbers(BODY)) >= 20


# --- the copy-paste loop and the chart, checked against this torch -----------------------------
LOOP = DOC.split("### The AMP loop, to copy", 1)[1].split("```python", 1)[1].split("```", 1)[0]


class _Net(torch.nn.Module):
    """A small convolutional model for the sheet's loop."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


def _run_loop(code, batches, total_steps=10):
    """Run the sheet's loop on a CPU with ``batches``; returns its namespace and the learning
    rate each batch was trained with."""
    lrs = []

    class Loader:
        def __iter__(self):
            for x, y in batches:
                yield x, y
                lrs.append(namespace["optimizer"].param_groups[0]["lr"])
    namespace = {"MyModel": _Net, "loader": Loader(), "total_steps": total_steps}
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:  # the sheet saves ckpt.pt where it runs
        os.chdir(tmp)
        try:
            exec(compile(code, "<cheat sheet loop>", "exec"), namespace)
        finally:
            os.chdir(cwd)
    return namespace, lrs


def _batches(n, bad=()):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(4, 3, 8, 8, generator=g)
        if i in bad:
            x[0, 0, 0, 0] = 1e6  # past fp16's range: the fp16 forward overflows
        out.append((x, torch.randint(0, 5, (4,), generator=g)))
    return out


def test_the_loop_runs_on_a_cpu_in_bf16_without_a_scaler():
    namespace, lrs = _run_loop(LOOP, _batches(4))
    assert namespace["dtype"] == torch.bfloat16 and not namespace["scaler"].is_enabled()
    assert lrs[0] == pytest.approx(3e-4) and lrs[0] > lrs[1] > lrs[2] > lrs[3]  # the cosine


def test_in_fp16_a_skipped_step_does_not_advance_the_schedule():
    fp16 = LOOP.replace("dtype = torch.bfloat16 if native_bf16 else torch.float16",
                        "dtype = torch.float16")
    assert fp16 != LOOP
    namespace, lrs = _run_loop(fp16, _batches(5, bad={2}))
    assert namespace["scaler"].is_enabled()
    assert lrs[2] == lrs[3] and lrs[1] > lrs[2] > lrs[4]  # step 2 skipped: step 3 reuses its rate
    assert int(namespace["optimizer"].state[namespace["first"]]["step"]) == 4


def test_the_bf16_check_excludes_emulation(monkeypatch):
    """A T4 (sm_75) emulates bf16: ``is_bf16_supported()`` says True by default, and the sheet's
    own chart sends it to fp16 + GradScaler, so the loop must ask for native bf16 only."""
    assert "is_bf16_supported(including_emulation=False)" in LOOP
    head = LOOP.split("torch.set_float32_matmul_precision", 1)[0]
    for native, want in ((False, torch.float16), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                            lambda including_emulation=True, native=native:
                            including_emulation or native)
        namespace = {}
        exec(compile(head, "<cheat sheet head>", "exec"), namespace)
        assert namespace["dtype"] == want, (native, namespace["dtype"])


def test_the_loop_waits_for_no_gpu():
    """No host sync in the step: no .item(), no get_scale(), no float() of a GPU tensor; the one
    int() reads AdamW's step count, a CPU tensor for the default (foreach) AdamW."""
    body = LOOP.split("for x, y in loader:", 1)[1].split("torch.save", 1)[0]
    code = "\n".join(line.split("#", 1)[0] for line in body.splitlines())
    assert ".item()" not in code and "get_scale" not in code and "float(" not in code
    assert code.count("int(") == 1 and 'int(optimizer.state[first].get("step", 0))' in code
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p])
    p.sum().backward()
    opt.step()
    assert opt.state[p]["step"].device.type == "cpu"  # the default (not fused, not capturable)


def test_the_tf32_line_names_the_api_and_what_is_on_by_default():
    chart = BODY.split("### The AMP loop, to copy", 1)[0]
    assert 'torch.set_float32_matmul_precision("high")' in chart
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in chart
    assert "cuDNN convolutions already use TF32 by default" in chart
    # the defaults the line states, in a fresh interpreter, and what the named call changes
    code = ("import torch; print(torch.backends.cudnn.allow_tf32, "
            "torch.backends.cuda.matmul.allow_tf32); "
            "torch.set_float32_matmul_precision('high'); "
            "print(torch.backends.cuda.matmul.allow_tf32)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "False", "True"], out


def test_no_verdict_string_is_pasted_and_the_ddp_advice_says_what_it_rests_on():
    assert "{{claims." not in RAW  # a verdict's text is the claims table's, not the chart's
    item = BODY.split("6. **", 1)[1].split("7. **", 1)[0]
    assert "one GPU" in item and "run lesson 06 on your own GPUs" in item
    assert "processes=1" in RAW.split("6. **", 1)[1].split("7. **", 1)[0]
