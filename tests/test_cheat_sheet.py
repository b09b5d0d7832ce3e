"""The practitioner's cheat sheet (docs/cheat_sheet.md) is the README's "Cheat sheet" section,
cites only numbers the README's Results section publishes, and links to lessons that exist."""
import re
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
