"""The practitioner's cheat sheet (docs/cheat_sheet.md) is the README's "Cheat sheet" section,
cites only numbers the README's Results section publishes, and links to lessons that exist."""
import re

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "cheat_sheet.md").read_text()
README = (ROOT / "README.md").read_text()
BODY = DOC.split("-->", 1)[1].strip("\n")


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
    from amp_lessons import report

    stale = f"# R\n\n{report.CHEAT_START}\nold text, **1.00**\n{report.CHEAT_END}\n\n## Next\n"
    new = report.with_cheat_sheet(stale, DOC)
    assert "old text" not in new and BODY in new and new.endswith("\n\n## Next\n")
    assert "The practitioner's cheat sheet" not in new  # the doc's note to editors stays out
    assert report.with_cheat_sheet(new, DOC) == new
    assert report.with_cheat_sheet(README, DOC) == README  # the committed copy is current
    with pytest.raises(ValueError, match="cheat-sheet markers"):
        report.with_cheat_sheet("# R\n", DOC, "README.md")


def test_readme_with_generated_takes_the_doc_beside_the_readme(tmp_path):
    from amp_lessons import report

    readme = tmp_path / "README.md"
    text = (f"# R\n\n{report.START}\n{report.END}\n\n{report.CHEAT_START}\nSTALE-COPY\n"
            f"{report.CHEAT_END}\n")
    assert "STALE-COPY" in report.readme_with_generated(readme, text, [])  # no doc beside it: kept
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "cheat_sheet.md").write_text(DOC)
    new = report.readme_with_generated(readme, text, [])
    assert "STALE-COPY" not in new and BODY in new
