"""The claims registry: one claim, one deciding measurement; verdicts that cannot decide say so."""
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import amp_lessons.lessons as lessons_pkg
from amp_lessons import claims

ROOT = Path(__file__).resolve().parent.parent


def lesson_modules():
    return {m.name: importlib.import_module(f"amp_lessons.lessons.{m.name}")
            for m in pkgutil.iter_modules(lessons_pkg.__path__) if re.match(r"l\d\d_", m.name)}


def test_every_claim_has_at_most_one_deciding_lesson_and_it_declares_it():
    mods = lesson_modules()
    deciders = {}
    for name, mod in mods.items():
        assert re.fullmatch(r"\d\d", getattr(mod, "LESSON", "")), f"{name} has no LESSON"
        for cid in getattr(mod, "DECIDES", ()):
            deciders.setdefault(cid, []).append(name)
            assert claims.CLAIMS[cid].lesson == mod.LESSON, \
                f"{name} decides {cid}, which the registry gives to lesson {claims.CLAIMS[cid].lesson}"
    for cid, where in deciders.items():
        assert len(where) == 1, f"claim {cid} is decided by two lessons: {where}"
    for cid, claim in claims.CLAIMS.items():
        mod = next((m for m in mods.values() if getattr(m, "LESSON", None) == claim.lesson), None)
        if claim.lesson is not None and mod is not None:
            assert cid in getattr(mod, "DECIDES", ()), \
                f"lesson {claim.lesson} does not declare that it decides {cid}"


def test_lesson_sources_rule_only_on_their_own_claims():
    """A `decide("X", ...)` call in a lesson module names a claim that module decides."""
    for name, mod in lesson_modules().items():
        src = Path(mod.__file__).read_text()
        for cid in re.findall(r"decide\(\s*[\"']([A-Z]\d+[a-d]?)[\"']", src):
            assert cid in getattr(mod, "DECIDES", ()), f"{name} rules on {cid} but does not decide it"


def test_decide_refuses_a_ruling_from_another_lesson_but_allows_not_decided():
    with pytest.raises(ValueError, match="decided by lesson 04"):
        claims.decide("B1", "02", "0.76x on a small CNN", False, "slower")
    v = claims.not_decided("B1", "02", "0.76x on a small CNN", "launch-bound")
    assert v.outcome == claims.UNDECIDED and not v.decided and "launch-bound" in str(v)


def test_cannot_decide_overrides_held():
    v = claims.decide("B1", "04", "3.8x", True, "fast", cannot_decide="timed on cpu")
    assert v.held is None and v.why == "timed on cpu" and v.row()["verdict"] == "not decided here"


@pytest.mark.parametrize("kwargs, match", [
    (dict(claim_id="Z9"), "claim must be one of"),
    (dict(lesson="9"), "lesson must be one of"),
    (dict(held="yes"), "held must be"),
    (dict(measured=" "), "measured must"),
    (dict(why=""), "why must"),
])
def test_decide_rejects_bad_input(kwargs, match):
    args = dict(claim_id="B1", lesson="04", measured="3x", held=True, why="fast")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        claims.decide(**args)


def test_timing_gate():
    assert "cpu" in claims.timing_gate("cpu", 50)
    assert "warm-up" in claims.timing_gate("cuda", 50, warmup=0)
    assert "only 2 timed steps" in claims.timing_gate("cuda", 2)
    assert "idle 60%" in claims.timing_gate("cuda", 50, gpu_idle_fraction=0.6)
    assert claims.timing_gate("cuda", 50, gpu_idle_fraction=0.05) is None


def test_accuracy_gate():
    assert "near chance" in claims.accuracy_gate(0.109, 10)
    assert claims.accuracy_gate(None, 10) == "no accuracy was measured"
    assert claims.accuracy_gate(0.95, 10) is None


def test_docs_claims_md_is_generated_from_the_registry():
    text = (ROOT / "docs" / "claims.md").read_text()
    assert text == claims.claims_markdown(), "run `python -m amp_lessons claims` to update docs/claims.md"
    for cid in claims.CLAIMS:
        assert f"| {cid} |" in text


def test_get_claim():
    assert claims.get_claim("R8").lesson == "05"
    with pytest.raises(ValueError, match="claim must be one of"):
        claims.get_claim(None)


def test_a_ruling_on_a_nan_or_inf_number_is_not_decided():
    """The class behind every verdict: a number that is NaN or inf in ``numbers`` never rules."""
    import numpy as np
    for bad in (float("nan"), float("inf"), -float("inf"), np.float32("nan")):
        v = claims.decide("R8", "05", "ran", True, "rule", numbers={"memory_saved_pct": bad})
        assert v.held is None and v.outcome == "not decided here" and "not finite" in v.why
    ok = claims.decide("R8", "05", "ran", False, "rule", numbers={"memory_saved_pct": 12.0,
                                                                  "note": "nan"})
    assert ok.held is False
