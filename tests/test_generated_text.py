"""Counts in generated text go through ``tables.plural``: "1 step", "3 steps", "1,500 steps"
(issue 24 found "1 epochs", "smoothed over 1 steps" and "1 early skips"). An f-string of the
package that writes a count straight before a plural noun is flagged unless the count cannot be
one (a constant, a decimal, the total in "N of TOTAL") or the word before the noun is a name, not
a count (listed in NOT_COUNTS, with why)."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "amp_lessons"
NOUNS = ("steps|skips|epochs|seeds|runs|layers|batches|micro-batches|processes|ranks|repeats|"
         "rounds|exercises|files|warnings|parameters|rows|values|cells|GPUs|samples|trials|"
         "tensors|blocks|images|sequences|tokens|bytes|times|columns|notebooks|lessons|claims|"
         "models|calls|kernels|configurations|widths|cards|workers|questions|hints|entries|"
         "checks|errors|failures|units")
# "{n} nonzero gradient values", "{n} early skips": up to two words between count and noun.
FOLLOWS = re.compile(r"^ ((?:[a-z][a-z-]* ){0,2})(" + NOUNS + r")\b")
NOT_ADJECTIVES = {"is", "are", "was", "of", "more", "fewer", "the", "a", "an", "per", "in", "to",
                  "and", "or"}
NOT_COUNTS = {  # (module, expression): a name, never a count
    ("lessons/l05_checkpointing.py", "amp_ckpt"): "a technique's name: 'no fp32 and X rows'",
    ("lessons/l05_checkpointing.py", "amp"): "a technique's name: 'no fp32 and X rows'",
    ("ui/fp8_plots.py", "name"): "the baseline's name: 'bf16 seeds (min to max)'",
}


def _may_be_one(before, value: ast.FormattedValue) -> bool:
    e = value.value
    spec = "".join(v.value for v in value.format_spec.values
                   if isinstance(v, ast.Constant)) if value.format_spec else ""
    if re.search(r"[f%eg]", spec):  # a decimal or a percentage: "0.5 points" is right
        return False
    if isinstance(e, ast.Constant) or isinstance(e, ast.IfExp):
        return False
    if isinstance(e, ast.Name) and e.id.isupper():  # a module constant, fixed above one
        return False
    if isinstance(e, ast.Attribute) and (e.attr.isupper() or isinstance(e.value, ast.Name)
                                         and e.value.id.isupper()):  # DEFAULT.growth_interval
        return False
    if isinstance(e, ast.Call) and getattr(e.func, "id", getattr(e.func, "attr", "")) in (
            "plural", "join"):
        return False
    # "{n} of {total} steps": the noun belongs to the total, which reads right unless it is 1
    return not (isinstance(before, ast.Constant) and isinstance(before.value, str)
                and re.search(r"\b(of|all)\s*$", before.value))


def bare_counts(source: str) -> list:
    """``(line, expression, text)`` of each f-string in ``source`` that writes an expression
    straight before a plural noun, where the expression may be 1."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.JoinedStr):
            continue
        parts = [None] + node.values
        for before, value, after in zip(parts, parts[1:], parts[2:]):
            if not (isinstance(value, ast.FormattedValue) and isinstance(after, ast.Constant)
                    and isinstance(after.value, str)):
                continue
            m = FOLLOWS.match(after.value)
            if m and not set(m.group(1).split()) & NOT_ADJECTIVES and _may_be_one(before, value):
                found.append((node.lineno, ast.unparse(value.value), m.group(0).strip()))
    return found


def test_the_rule_sees_a_bare_count_and_lets_the_right_forms_pass():
    assert bare_counts('f"settled after {k} steps"') == [(1, "k", "steps")]
    assert bare_counts('f"{ed} early skips, {s[\'nonzero\']:,} nonzero gradient values"') == [
        (1, "ed", "early skips"), (1, "s['nonzero']", "nonzero gradient values")]
    assert bare_counts('f"{len(rows)} rows"') == [(1, "len(rows)", "rows")]
    for fine in ('f"after {plural(k, \'step\')}"', 'f"{STEPS} steps"', 'f"{gain:+.1f} points"',
                 'f"{n} of {total} steps"', 'f"{x} is more processes"', 'f"{w:.0%} runs"',
                 'f"{\'fewer\' if a else \'more\'} steps"', 'f"{cfg.STEPS} steps"'):
        assert bare_counts(fine) == [], fine


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_counts_in_generated_text_go_through_plural(path):
    rel = str(path.relative_to(PACKAGE))
    found = [(line, expr, text) for line, expr, text in bare_counts(path.read_text())
             if (rel, expr) not in NOT_COUNTS]
    assert not found, (f"{rel}: write these counts with tables.plural(count, word) "
                       f"(\"1 step\", \"3 steps\"): {found}")


def test_every_not_count_entry_is_still_there():
    for (rel, expr), why in NOT_COUNTS.items():
        assert why and any(e == expr for _, e, _ in bare_counts((PACKAGE / rel).read_text())), \
            f"{rel}: {expr!r} no longer writes a noun after it; remove it from NOT_COUNTS"
