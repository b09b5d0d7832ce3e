"""The claims registry: one claim, one deciding measurement; verdicts that cannot decide say so."""
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import amp_lessons.lessons as lessons_pkg
from amp_lessons.publish import claims
import numpy as np
import torch

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


# --- the finer verdict scale (issue 27) -------------------------------------------------------------

def test_the_outcomes_are_the_documented_scale():
    assert claims.OUTCOMES == ("held", "held, understated", "held, deprecated", "partly held",
                               "did not hold", "not decided here")
    text = claims.claims_markdown()
    assert "held, understated" in text and "partly held" in text and "held, deprecated" in text


def test_understated_and_deprecated_qualify_only_a_held_claim():
    v = claims.decide("R8", "05", "56% saved", True, "saved more", understated="56 vs 20-30")
    assert v.outcome == "held, understated" and "understated: 56 vs 20-30" in v.why
    assert claims.decide("R8", "05", "10% saved", False, "less",
                         understated="x").outcome == "did not hold"
    d = claims.decide("B6", "02", "warns", True, "runs", deprecated="use torch.amp")
    assert d.outcome == "held, deprecated" and "use torch.amp" in d.why and d.decided
    gated = claims.decide("R8", "05", "cpu", True, "x", understated="y", cannot_decide="on cpu")
    assert gated.outcome == "not decided here" and gated.qualifier == ""
    with pytest.raises(ValueError, match="understated or deprecated"):
        claims.decide("B6", "02", "x", True, "y", understated="a", deprecated="b")
    with pytest.raises(ValueError, match="deprecated must say"):
        claims.decide("B6", "02", "x", True, "y", deprecated=" ")


def test_parts_decide_a_compound_claim():
    P = claims.Part
    partly = claims.decide("B4", "03", "ran", None, "", parts=[P("a", False, "no knob"),
                                                               P("b", True, "fewer skips")])
    assert partly.outcome == "partly held" and partly.held is False and partly.decided
    assert partly.why == "a: did not hold (no knob); b: held (fewer skips)"
    assert claims.decide("B4", "03", "ran", None, "", parts=[P("a", True, "x"),
                                                             P("b", True, "y")]).outcome == "held"
    assert claims.decide("B4", "03", "ran", None, "", parts=[P("a", False, "x"),
                                                             P("b", None, "y")]).outcome == \
        "did not hold"
    assert claims.decide("B4", "03", "ran", None, "", parts=[P("a", True, "x"),
                                                             P("b", None, "y")]).outcome == \
        "partly held"
    undecided = claims.decide("B4", "03", "ran", None, "", parts=[P("a", None, "x")])
    assert undecided.outcome == "not decided here"
    with pytest.raises(ValueError, match="held must be None when parts"):
        claims.decide("B4", "03", "ran", True, "", parts=[P("a", True, "x")])
    with pytest.raises(ValueError, match="must say why"):
        P("a", True, "")
    with pytest.raises(ValueError, match="parts must be claims.Part"):
        claims.decide("B4", "03", "ran", None, "", parts=[("a", True, "x")])


def test_a_stand_in_is_named_in_the_outcome():
    v = claims.decide("B2", "04", "ran", True, "fast", stand_in="ResNet-50 for train.py")
    assert v.outcome == "held, on a stand-in" and v.why.startswith("on a stand-in (ResNet-50")
    u = claims.decide("B2", "04", "ran", True, "x", stand_in="s", cannot_decide="on cpu")
    assert u.outcome == "not decided here" and u.why == "on cpu"


@pytest.mark.parametrize("measured, held, understated", [
    (19.9, False, None), (20.0, True, None), (30.0, True, None), (30.5, True, "more than")])
def test_one_sided_saving(measured, held, understated):
    got_held, got = claims.one_sided(measured, 20, 30, "%")
    assert got_held is held and (got is None if understated is None else understated in got)


@pytest.mark.parametrize("measured, held, understated", [
    (40.5, False, None), (40.0, True, None), (20.0, True, None), (19.0, True, "less than")])
def test_one_sided_cost(measured, held, understated):
    got_held, got = claims.one_sided(measured, 20, 40, "%", larger_is_better=False)
    assert got_held is held and (got is None if understated is None else understated in got)


def test_one_sided_rejects_bad_numbers():
    with pytest.raises(ValueError, match="measured must be a finite number"):
        claims.one_sided(float("nan"), 20, 30, "%")
    with pytest.raises(ValueError, match="claimed_low must be <= claimed_high"):
        claims.one_sided(25, 30, 20, "%")


# --- one way to declare a decider, one naming scheme, the registry derived ---------------------------

def test_the_registry_is_derived_from_the_decides_declarations():
    found = lessons_pkg.all_deciders()
    measured = [cid for cid, c in claims.CLAIMS.items() if c.lesson is not None]
    assert list(found) == measured   # every claim a lesson decides has exactly one decider
    for cid, where in found.items():
        module, name = where.rsplit(".", 1)
        assert name == claims.verdict_name([cid]) or name == claims.verdict_name(
            [c for c, w in found.items() if w == where])
        assert cid in importlib.import_module(module).DECIDES
    for name, mod in lesson_modules().items():  # a lesson that decides nothing needs no DECIDES
        assert tuple(getattr(mod, "DECIDES", ())) == claims.decided_in(mod.__name__), name


def test_decides_checks_name_lesson_and_uniqueness():
    assert claims.verdict_name(["B1"]) == "verdict_b1"
    assert claims.verdict_name(["R10a", "R10b"]) == "verdict_r10"
    with pytest.raises(ValueError, match="share no stem"):
        claims.verdict_name(["R10a", "B1"])

    def decide_b1():
        pass
    with pytest.raises(ValueError, match="must be named verdict_b1"):
        claims.decides("B1")(decide_b1)

    def verdict_r8():   # its module (this test file) is no lesson: it has no LESSON
        pass
    with pytest.raises(ValueError, match="decided by lesson 05"):
        claims.decides("R8")(verdict_r8)
    with pytest.raises(ValueError, match="claim must be one of"):
        claims.decides("Z1")
    with pytest.raises(ValueError, match="at least one"):
        claims.decides()


def test_a_second_decider_of_a_claim_is_refused():
    ns = {"LESSON": "04"}
    exec("def verdict_b1():\n    pass\n", ns)
    fn = ns["verdict_b1"]
    fn.__module__ = "somewhere.else"
    lessons_pkg.all_deciders()
    with pytest.raises(ValueError, match="already decided by amp_lessons.lessons.l04"):
        claims.decides("B1")(fn)


def test_no_lesson_types_in_a_ruling():
    """No verdict is typed in: no call to claims.decide passes a literal True or False as held."""
    import ast
    for name, mod in lesson_modules().items():
        tree = ast.parse(Path(mod.__file__).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "decide":
                held = node.args[3] if len(node.args) > 3 else next(
                    (k.value for k in node.keywords if k.arg == "held"), None)
                assert not (isinstance(held, ast.Constant) and held.value in (True, False)), \
                    f"{name}:{node.lineno} types in held={held.value}"


# --- one helper applies the timing gate to rows -------------------------------------------------------

def _timed(**extra):
    row = {"label": "r", "status": "ok", "timer": "CUDA events", "steps": 15, "warmup": 5,
           "gpu_idle_fraction": 0.05}
    row.update(extra)
    return row


def test_rows_timing_gate():
    assert claims.rows_timing_gate(_timed(), _timed()) is None
    assert "idle 26%" in claims.rows_timing_gate(_timed(), _timed(gpu_idle_fraction=0.26))
    assert claims.rows_timing_gate(_timed(gpu_idle_fraction=0.25)) is None   # the threshold
    assert "not measured" in claims.rows_timing_gate(_timed(gpu_idle_fraction=None))
    assert claims.rows_timing_gate(_timed(gpu_idle_fraction=None), busy=False) is None
    assert "cpu" in claims.rows_timing_gate(_timed(), _timed(timer="perf_counter"))
    assert "cpu" in claims.rows_timing_gate(_timed(timer=None, device_type="cpu"))
    assert claims.rows_timing_gate(_timed(timer=None, device_type="cuda")) is None
    assert "only 9 timed steps" in claims.rows_timing_gate(_timed(steps=9))
    assert claims.rows_timing_gate(_timed(steps=10)) is None
    assert "warm-up" in claims.rows_timing_gate(_timed(warmup=0))
    assert "did not run" in claims.rows_timing_gate(_timed(status="out of memory"))
    assert claims.rows_timing_gate(_timed(spread=0.10), _timed(spread=None)) is None  # the limit
    assert "disagree by 12%" in claims.rows_timing_gate(_timed(), _timed(spread=0.12))
    with pytest.raises(ValueError, match="at least one"):
        claims.rows_timing_gate()
    with pytest.raises(ValueError, match="measured rows"):
        claims.rows_timing_gate("row")


def test_at_least_writes_the_comparison_on_both_sides_of_its_threshold():
    from amp_lessons.publish import claims as C
    held = C.at_least("saves memory", 48.2, 40)
    assert held.held is True and held.why == "48% >= 40%"
    missed = C.at_least("faster", 1.36, 1.5, "x", 2, " against the default fp32")
    assert missed.held is False and missed.why == "1.36x < 1.5x against the default fp32"


# --- sensitivity rows, compound parts, accuracy where a difference can show --------------------------

def test_every_claim_declares_its_sensitivity_rows_and_what_it_depends_on():
    for cid, c in claims.CLAIMS.items():
        assert c.depends, cid
        if c.lesson is not None:
            assert c.alternatives, f"{cid} names no alternative a reviewer would try"
    text = claims.claims_markdown()
    for cid, c in claims.CLAIMS.items():
        assert f"### {cid}:" in text
    assert "untested: top-1 on ImageNet" in text and "**sensitivity rows**" in text
    assert "**depends on**" in text


def _alt(held, setting="with channels_last on both sides"):
    return claims.Alternative(setting, held, "numbers")


def test_a_verdict_that_flips_under_an_alternative_is_partly_held_and_names_both():
    v = claims.decide("B1", "04", "m", False, "1.35x < 1.5x", sensitivity=[_alt(True)],
                      condition="on NCHW")
    assert v.outcome == "partly held" and v.held is False
    assert "held with channels_last on both sides; did not hold on NCHW" in v.why
    held = claims.decide("B1", "04", "m", True, "ok", sensitivity=[_alt(False)],
                         condition="on NCHW", understated="more")
    assert held.outcome == "partly held" and "held on NCHW; did not hold with channels_last" \
        in held.why
    # agreeing or undecided rows change nothing but are shown
    same = claims.decide("B1", "04", "m", True, "ok", sensitivity=[_alt(True), _alt(None, "x")])
    assert same.outcome == "held" and "x: not decided here" in same.row()["sensitivity"]
    # a run that cannot decide is not decided, whatever its rows say
    cannot = claims.decide("B1", "04", "m", True, "ok", sensitivity=[_alt(False)],
                           cannot_decide="a CPU timing")
    assert cannot.outcome == "not decided here" and cannot.sensitivity
    assert claims.decide("B1", "04", "m", True, "ok").row()["sensitivity"] == \
        "no alternative measured in this run"
    with pytest.raises(ValueError, match="Alternative"):
        claims.decide("B1", "04", "m", True, "ok", sensitivity=["channels_last"])
    with pytest.raises(ValueError, match="condition"):
        claims.decide("B1", "04", "m", True, "ok", condition=" ")
    with pytest.raises(ValueError, match="setting"):
        claims.Alternative("", True, "w")


def test_untested_parts_do_not_flip_against_an_agreeing_row():
    parts = [claims.Part("memory", True, "47% >= 33%"),
             claims.Part("untested: top-1", None, "no ImageNet run")]
    v = claims.decide("R6", "04", "m", None, "", parts=parts,
                      sensitivity=[claims.alternative("against TF32 off", parts=parts[:1])])
    assert v.outcome == "partly held" and "It depends" not in v.why
    v = claims.decide("R6", "04", "m", None, "", parts=parts, sensitivity=[
        claims.alternative("against TF32 off", parts=[claims.Part("memory", False, "30%")])])
    assert "did not hold against TF32 off" in v.why
    alt = claims.alternative("x", parts=[claims.Part("a", True, "w"), claims.Part("b", None, "-")])
    assert alt.held is True and "b: not decided here" in alt.why
    assert claims.alternative("x", held=True, why="w", cannot_decide="idle GPU").held is None
    with pytest.raises(ValueError, match="held must be None"):
        claims.alternative("x", parts=[claims.Part("a", True, "w")], held=True)


def test_accuracy_effect_decides_only_where_a_difference_can_show():
    says = "guarantee classification accuracy"
    # saturated: 99.1% on 450 images leaves under the 1 point a gain must exceed
    p = claims.accuracy_effect(says, [0.991], [1.0], 0.01, 450, 10)
    assert p.held is None and "ceiling" in p.why and "0.22 points" in p.why
    # one seed is not enough on an unsaturated task
    p = claims.accuracy_effect(says, [0.80], [0.90], 0.01, 450, 10)
    assert p.held is None and "1 seed per arm" in p.why
    # three seeds: a gain beyond twice the seed spread holds; inside it, it does not
    assert claims.accuracy_effect(says, [0.80, 0.81, 0.79], [0.90, 0.91, 0.89], 0.01, 450,
                                  10).held is True
    assert claims.accuracy_effect(says, [0.80, 0.81, 0.79], [0.70, 0.95, 0.80], 0.01, 450,
                                  10).held is False
    assert claims.accuracy_effect(says, [0.80] * 3, [0.805] * 3, 0.01, 450, 10).held is False
    # near chance decides nothing
    assert claims.accuracy_effect(says, [0.11] * 3, [0.12] * 3, 0.01, 450, 10).held is None
    with pytest.raises(ValueError, match="min_gain"):
        claims.accuracy_effect(says, [0.8], [0.9], 2, 450, 10)
    with pytest.raises(ValueError, match="base and variant"):
        claims.accuracy_effect(says, [], [0.9], 0.01, 450, 10)


def test_decide_and_accuracy_gate_read_0d_tensors_and_arrays_as_numbers():
    for bad in (float("nan"), torch.tensor(float("nan")), np.array(np.inf)):
        assert claims.decide("R1", "01", "ran", True, "rule", {"s": bad}).outcome == \
            "not decided here"
    assert claims.accuracy_gate(torch.tensor(0.9), 10) is None  # was "the run diverged"
    assert claims.accuracy_gate(np.float32(0.9), 10) is None


def test_at_least_and_one_sided_never_read_against_their_ruling():
    assert claims.at_least("speedup", 39.6, 40).why == "39.6% < 40%"  # was "40% < 40%"
    assert claims.at_least("x", 1.46, 1.5, unit="x", digits=1).why == "1.46x < 1.5x"
    assert claims.at_least("s", 48, 40).why == "48% >= 40%"
    nan = claims.at_least("speedup", float("nan"), 40)
    assert nan.held is None and "not decided" in nan.why  # was ruled "did not hold"
    assert claims.one_sided(25.4, 20, 25, "%") == (True, "25.4% is 0.4% more than the claimed "
                                                         "20-25%")  # was "25% is 0% more"
    assert claims.one_sided(40, 20, 25, "%") == (True, "40% is 15% more than the claimed 20-25%")
