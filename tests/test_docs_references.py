"""Every test a document names as the proof of a promise exists (docs/reliability.md names
``test_file.py::test_name`` and, after it in the same cell, ``::test_other``)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
REF = re.compile(r"`(?:(test_[a-z0-9_]+\.py))?::(test_[a-zA-Z0-9_]+)`")


def references(text: str):
    """(file, test) pairs, a bare ``::test`` taking the file named before it on its line."""
    for line in text.splitlines():
        current = None
        for m in REF.finditer(line):
            current = m.group(1) or current
            if current is not None:
                yield current, m.group(2)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_named_test_exists(doc):
    missing = []
    for file, name in references(doc.read_text()):
        path = ROOT / "tests" / file
        if not path.exists() or not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(f"{file}::{name}")
    assert not missing, f"{doc.name} names tests that do not exist: {missing}"


def test_references_reads_bare_names_after_their_file():
    got = list(references("| x | `a_test.py` `test_a.py::test_one`, `::test_two` |"))
    assert got == [("test_a.py", "test_one"), ("test_a.py", "test_two")]
