"""What the exercise tests share: how a wrong and an unanswered grade must look, and a fresh count
of wrong attempts for every test (a grade shows its answer from the third wrong attempt on)."""
import pytest

from amp_lessons.exercises import check as common

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def fresh_attempts():
    """Every test starts with no wrong attempt counted, so that no grade reveals its answer
    unless the test makes three wrong attempts itself."""
    common.reset_attempts()
    yield
    common.reset_attempts()


def status(check):
    """A grade's status ("passed", "wrong", "not answered yet", "skipped")."""
    return check.status


def assert_wrong(check, *fragments, hints=None):
    """A wrong answer whose message and first hint name the mistake (``fragments``), and which
    says when its answer shows; with ``hints`` (the exercise's), that first hint is the
    mistake's own, not the exercise's nudge, and the later levels are the exercise's, asked for
    with its ``hint`` call, none of them shown."""
    assert check.status == "wrong" and not check, check
    assert check.hint and all(f in check.message + check.hint for f in fragments), check
    assert "the answer shows after 3 wrong attempts" in repr(check) or check.revealed, check
    if hints is not None:
        assert check.hint not in hints.levels, f"not specific to the mistake: {check.hint}"
        assert check.hints[1:] == hints.levels[1:] and hints.call(2) in repr(check), check
        if not check.revealed:
            assert all(level not in repr(check) for level in hints.levels[1:]), check


def assert_unanswered(check, hints=None):
    """Not answered yet: the first hint only, and how to read the next one."""
    assert check.status == "not answered yet" and check.hint, check
    assert "not answered yet" in repr(check) and "hint" in repr(check)
    if hints is not None:
        assert check.hints == hints.levels and check.hint in repr(check), check
        assert all(level not in repr(check) for level in hints.levels[1:]), check
        assert hints.call(2) in repr(check), check
