"""Every exercise, graded three ways: the reference solution passes, the untouched stub says
"not answered yet" with its first hint only, and each typical wrong answer fails with the hint that
names its mistake (never a bare False). The hints themselves: graded levels whose first never gives
the answer away, read with ``exNN.hint(name, level)`` or unfolded in JupyterLab."""
import ast
import html
import importlib.util
import inspect
import linecache
import math
import re
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch
from torch import nn

import amp_lessons as al
from amp_lessons.measure import distributed
from amp_lessons.exercises import MODULES
from amp_lessons.exercises import ex01
from amp_lessons.exercises import ex02
from amp_lessons.exercises import ex03
from amp_lessons.exercises import ex04
from amp_lessons.exercises import ex05
from amp_lessons.exercises import ex06
from amp_lessons.exercises import ex07
from amp_lessons.exercises import ex08
from amp_lessons.exercises import ex09
from amp_lessons.exercises.check import Check, Hints, hint_book, is_blank, same_code
from amp_lessons.lessons import l03_scaler
from amp_lessons.lessons import l07_fp8
from amp_lessons.lessons import l08_weights
from amp_lessons.train.trainer import ScalerSettings


def assert_wrong(check, *fragments, hints=None):
    """A wrong answer whose message and first hint name the mistake (``fragments``); with
    ``hints`` (the exercise's), that first hint is the mistake's own, not the exercise's nudge,
    and the later levels are the exercise's, asked for with its ``hint`` call."""
    assert check.status == "wrong" and not check, check
    assert check.hint and all(f in check.message + check.hint for f in fragments), check
    if hints is not None:
        assert check.hint not in hints.levels, f"not specific to the mistake: {check.hint}"
        assert check.hints[1:] == hints.levels[1:] and hints.call(2) in repr(check), check
        assert all(level not in repr(check) for level in hints.levels[1:]), check


def assert_unanswered(check, hints=None):
    """Not answered yet: the first hint only, and how to read the next one."""
    assert check.status == "not answered yet" and check.hint, check
    assert "not answered yet" in repr(check) and "hint" in repr(check)
    if hints is not None:
        assert check.hints == hints.levels and check.hint in repr(check), check
        assert all(level not in repr(check) for level in hints.levels[1:]), check
        assert hints.call(2) in repr(check), check


# --- the result type --------------------------------------------------------------------------
def test_check_renders_as_text_and_is_true_only_when_passed():
    ok, bad = Check("E", "passed", "fine"), Check("E", "wrong", "off by one", "count again")
    assert ok and not bad and ok.passed
    assert repr(ok) == "[x] E: passed: fine" and "hint: count again" in repr(bad)
    assert bad.hints == ("count again",) and bad.hint == "count again" and ok.hint == ""
    with pytest.raises(ValueError, match="status must be one of"):
        Check("E", "maybe")


def test_a_check_shows_one_level_and_says_how_to_read_the_next():
    book = hint_book("ex99", {"demo": ("look at <b> & the table", "closer", "the answer: 42")})
    check = ex02.unanswered("Exercise 9", book["demo"])
    text = repr(check)
    assert "hint 1 of 3: look at <b> & the table" in text and 'ex99.hint("demo", 2)' in text
    assert "closer" not in text and "42" not in text
    assert check.hint_at(3) == "the answer: 42"
    for bad in (0, 4, 1.5):
        with pytest.raises(ValueError, match=r"level must be a whole number in \[1, 3\]"):
            check.hint_at(bad)
    mistake = ex02.wrong("Exercise 9", "off by one", book["demo"].after("count from 0"))
    assert mistake.hints == ("count from 0", "closer", "the answer: 42")
    assert "hint 1 of 3: count from 0" in repr(mistake) and "closer" not in repr(mistake)
    with pytest.raises(ValueError, match="2 or more"):
        Hints("ex99", "one", ("only one level",))


def test_the_html_repr_escapes_and_unfolds_each_later_level():
    book = hint_book("ex99", {"demo": ("look at <b> & the table", "use <i>x</i>", "the answer")})
    page = ex02.unanswered("Exercise <9>", book["demo"])._repr_html_()
    assert "<b>" not in page.replace("<b>[", "").replace("<b>hint", "")  # only our own bold
    assert "look at &lt;b&gt; &amp; the table" in page and "use &lt;i&gt;x&lt;/i&gt;" in page
    assert "Exercise &lt;9&gt;" in page
    assert page.count("<details>") == page.count("</details>") == 2  # levels 2 and 3 fold
    first, *later = page.split("<details>")
    assert "look at" in first and "use &lt;i&gt;" not in first and "the answer" in later[1]
    assert "<details>" not in ex02.passed("E", "fine")._repr_html_()
    assert "<details>" not in ex02.skipped("E", "no <GPU>")._repr_html_()
    assert "no &lt;GPU&gt;" in ex02.skipped("E", "no <GPU>")._repr_html_()
    real = ex02.check_fixed_loop(ex02.buggy_loop, "cpu")._repr_html_()
    assert html.escape(ex02.HINTS["loop"].levels[2]) in real.split("<details>")[2]


# --- the hints --------------------------------------------------------------------------------
EXERCISES = [(m, name) for m, module in MODULES.items() for name in module.HINTS]


def test_every_lesson_has_graded_hints_and_a_hint_reader_that_checks_its_input():
    for key, module in MODULES.items():
        assert len(module.HINTS) >= 3, key
        for name, hints in module.HINTS.items():
            assert hints.module == key and hints.name == name and len(hints.levels) >= 2
            assert len(set(hints.levels)) == len(hints.levels)
            for level, text in enumerate(hints.levels, start=1):
                got = module.hint(name, level)
                assert got == text and repr(got).startswith(f"{name}, hint {level} of ")
        name, n = next(iter(module.HINTS)), len(next(iter(module.HINTS.values())).levels)
        for bad in (0, n + 1, "2", True):
            with pytest.raises(ValueError, match=rf"level must be a whole number in \[1, {n}\]"):
                module.hint(name, bad)
        with pytest.raises(ValueError, match="exercise must be one of"):
            module.hint("no such exercise", 1)


def _first_below_one():
    return ex03.first_below_one(ex03.overflow_trace(ScalerSettings(), 40))


# What would give each exercise away: values of the reference solutions and the key tokens of their
# code or rule. The first hint level must say none of them; the last level (near the answer) says at
# least one, which proves the list is about the answer.
ANSWER_TOKENS = {
    ("ex01", "predict"): lambda: ["1.0", f"{ex01.fp16_truths()['hundredths']:.4g}", "swamp",
                                  "rounds back"],
    ("ex01", "master"): lambda: ["torch.float32", ".float()", ".half()", "master = master"],
    ("ex01", "scale"): lambda: [str(ex01.smallest_safe_exponent(
        torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-6)), "2**-24",
        "range(33)", "next(k", "k = 0, 1, 2"],
    ("ex02", "function"): lambda: ["custom_fwd", "custom_bwd"],
    ("ex02", "dtypes"): lambda: ["layer_norm", "'16-bit'", "'fp32'", "fp32 list",
                                 "float32 list"],
    ("ex02", "loop"): lambda: [".half()", "unscale_", "get_scale", "clip_grad_norm_",
                               "scheduler.step()"],
    ("ex03", "rule"): lambda: ["* backoff_factor", "*= backoff_factor", "by backoff_factor",
                               "* growth_factor", "== growth_interval", "restarts at 0"],
    ("ex03", "floor"): lambda: [str(_first_below_one()), "2**(a - i)", "**i", "step i uses",
                                "16 + 1"],
    ("ex03", "causes"): lambda: ["in a row", "never recover", "every step skipped", "burst"],
    ("ex04", "state"): lambda: ["4 bytes", "4 * n", "float32", "fp32"],
    ("ex04", "ratio"): lambda: ["0.5", "2 bytes", "half"],
    ("ex04", "layout"): lambda: ["torch.channels_last", "contiguous", "memory_format="],
    ("ex05", "checkpoint"): lambda: ["use_reentrant", "checkpoint(block"],
    ("ex05", "accumulate"): lambda: ["/ micro_batches", "divide", "chunk", "micro_batches times"],
    ("ex05", "resume"): lambda: ["scaler.state_dict", "optimizer.state_dict", "GradScaler",
                                 "scaler"],
    ("ex06", "script"): lambda: ["init_process_group", "DDP(make_model", "param_dtype",
                                 "reduce_dtype", "fully_shard(layer", "gloo"],
    ("ex06", "efficiency"): lambda: ["per_s_n / (n * per_s_1)", "/ (n", "n times", "n *"],
    ("ex06", "state"): lambda: ["4 bytes", "16 bytes", "16 in all", "16/N", "/ N", "8 / N",
                                "16 *"],
    ("ex07", "tensor"): lambda: [f"{ex07.e4m3_max():g}", "x.abs().max()", ".abs()"],
    ("ex07", "row"): lambda: ["dim=-1", "dim=1", "keepdim=True"],
    ("ex07", "filter"): lambda: ["% 16", "multiple of 16", "MIN_FEATURES", "first and the last",
                                 "names[0]"],
    ("ex08", "stochastic"): lambda: ["randint", "1 << 16", "2**16", "-65536", "0xFFFF0000",
                                     "view(torch.int32)"],
    ("ex08", "kahan"): lambda: ["update + compensation", "y - (new", "(new - w)",
                                "new.float() - w"],
    ("ex08", "memory"): lambda: ["16, 8 and 10", "104.3", "52.2", "65.2", "2**30", "gradient"],
    ("ex09", "overflow"): lambda: ["overflow[0]", "fp16_nonfinite[0]", "blocks.0.mlp.2",
                                  "output Linear"],
    ("ex09", "scale"): lambda: ["grad_absmax", "largest gradient", "math.floor", "log2",
                                "65504 / g"],
    ("ex09", "yours"): lambda: ["advice['fp16_safe']", "scale_exponent", "act_absmax"],
}


def _says(text, token):
    """``token`` in ``text``, case-insensitive; a number only as a whole number (not the 6 of
    fp16)."""
    if re.fullmatch(r"[\d.]+", token):
        return re.search(rf"(?<![\w.]){re.escape(token)}(?![\w]|\.\d)", text) is not None
    return token.lower() in text.lower()


def test_every_exercise_has_its_answer_tokens():
    assert sorted(ANSWER_TOKENS) == sorted(EXERCISES)
    assert _says("fp16 is 16 bits", "16") and not _says("fp16", "6") and _says("k = 6.", "6")


@pytest.mark.parametrize("key", sorted(ANSWER_TOKENS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_the_first_hint_does_not_give_the_answer_away(key):
    hints = MODULES[key[0]].HINTS[key[1]]
    tokens = ANSWER_TOKENS[key]()
    assert not [t for t in tokens if _says(hints.levels[0], t)], hints.levels[0]
    assert [t for t in tokens if _says(hints.levels[-1], t)], hints.levels[-1]


def test_matching_mistake_needs_every_input_and_passes_over_one_that_cannot_be_made():
    from amp_lessons.exercises.check import matching_mistake
    mistakes = {"plus one": lambda v: v + 1, "doubled": lambda v: 2 * v,
                "inverse": lambda v: 1 / v}
    assert matching_mistake(mistakes, [(1, 2)]) == "plus one"  # one input: the first look-alike
    assert matching_mistake(mistakes, [(1, 2), (3, 6)]) == "doubled"  # every input decides
    assert matching_mistake(mistakes, [(0, 7)]) is None  # 1 / 0 raises: passed over, no crash
    assert matching_mistake({"inverse": mistakes["inverse"], **mistakes}, [(0, 0), (2, 4)]) \
        == "doubled"
    assert matching_mistake(mistakes, [(2, 0.5)], lambda a, b: abs(a - b) < 1e-9) == "inverse"


def test_blank_answers_and_unedited_code():
    assert is_blank(None) and is_blank(...) and is_blank({"a": None}) and not is_blank(0)
    assert same_code(ex02.buggy_loop, ex02.buggy_loop)
    assert not same_code(ex02.reference_loop, ex02.buggy_loop)
    source = ex02_stub_source()  # defined as IPython does: the cell's text in linecache
    linecache.cache["<lesson 02 cell>"] = (len(source), None, source.splitlines(True),
                                           "<lesson 02 cell>")
    namespace = {"torch": torch, "F": torch.nn.functional}
    exec(compile(source, "<lesson 02 cell>", "exec"), namespace)
    assert same_code(namespace["my_loop"], ex02.buggy_loop)
    fixed = source.replace("    model.half()\n", "")
    linecache.cache["<fixed cell>"] = (len(fixed), None, fixed.splitlines(True), "<fixed cell>")
    exec(compile(fixed, "<fixed cell>", "exec"), namespace)
    assert not same_code(namespace["my_loop"], ex02.buggy_loop)


def ex02_stub_source():
    """The fix-the-bug stub as lesson 02's exercise cell holds it."""
    nb = nbformat.read(next(Path(__file__).resolve().parent.parent.glob("notebooks/02_*.ipynb")),
                       as_version=4)
    return next(c.source for c in nb.cells if "exercise" in c.metadata.get("tags", [])
                and c.source.startswith("def my_loop"))


# --- lesson 01 --------------------------------------------------------------------------------
def test_ex01_predictions():
    t = ex01.fp16_truths()
    assert t["one_plus"] == 1.0 and 9.9 < t["hundredths"] < 10.0
    assert ex01.check_fp16_predictions(t["one_plus"], round(t["hundredths"], 2))
    hints = ex01.HINTS["predict"]
    assert_unanswered(ex01.check_fp16_predictions(None, None), hints)
    assert_wrong(ex01.check_fp16_predictions(1.0001, t["hundredths"]), "rounds back to 1.0",
                 hints=hints)
    assert_wrong(ex01.check_fp16_predictions(1.0, 10.0), "exact sum", hints=hints)
    # exact arithmetic for both: one mistake, named as such, not the first answer's fact alone
    exact = ex01.check_fp16_predictions(1 + 1e-4, 10.0)
    assert_wrong(exact, "both answers are the exact", "2**-7", hints=hints)
    assert "rounds back to 1.0" not in exact.hint


def test_ex01_scale_exponent():
    grads = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 1e-6
    k = ex01.smallest_safe_exponent(grads)
    assert al.formats.scaled_fractions(grads, 2.0 ** k)["flushed"] == 0
    assert al.formats.scaled_fractions(grads, 2.0 ** (k - 1))["flushed"] > 0
    assert ex01.check_scale_exponent(k, grads)
    hints = ex01.HINTS["scale"]
    assert_unanswered(ex01.check_scale_exponent(None, grads), hints)
    assert_wrong(ex01.check_scale_exponent(0, grads), "keep raising k", hints=hints)
    assert_wrong(ex01.check_scale_exponent(k + 4, grads), "lower k", hints=hints)
    assert_wrong(ex01.check_scale_exponent(2.0 ** k, grads), "integer exponent")


def test_ex01_master_weight():
    assert ex01.check_master_weight(ex01.reference_master_weight)
    assert_unanswered(ex01.check_master_weight(lambda start, update, steps: None),
                      ex01.HINTS["master"])
    for bad in ex01.WRONG_MASTER.values():
        assert_wrong(ex01.check_master_weight(bad), "swamped", "torch.float32",
                     hints=ex01.HINTS["master"])


# --- lesson 02 --------------------------------------------------------------------------------
def test_ex02_dtypes():
    real = ex02.autocast_dtypes("cpu")
    assert ex02.check_autocast_dtypes(dict(real), "cpu")
    assert ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "16-bit", "fc2": "bf16",
                                       "loss": "fp32"}, "cpu")
    hints = ex02.HINTS["dtypes"]
    assert_unanswered(ex02.check_autocast_dtypes(dict.fromkeys(ex02.LAYERS), "cpu"), hints)
    assert_wrong(ex02.check_autocast_dtypes({"fc1": "fp32", "norm": "16-bit", "fc2": "16-bit",
                                             "loss": "fp32"}, "cpu"), "matmul", hints=hints)
    assert_wrong(ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "16-bit", "fc2": "16-bit",
                                             "loss": "16-bit"}, "cpu"), "fp32 list", hints=hints)
    assert_wrong(ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "fp32", "fc2": "16-bit",
                                             "loss": "fp32"}, "cpu"), "layer_norm", hints=hints)


def test_ex02_dtypes_one_answer_for_the_whole_model_is_named_as_such(monkeypatch):
    hints = ex02.HINTS["dtypes"]
    # On a CPU (the quick profile) "everything fp32" misses fc1, norm and fc2.
    assert_wrong(ex02.check_autocast_dtypes(ex02.WRONG_DTYPES["everything fp32"], "cpu"),
                 "does change", "fc1 returns", hints=hints)
    # On CUDA (the lead's GPU run) "everything 16-bit" misses norm and loss: the first of them
    # alone gave norm's hint, which is the hint for answering CUDA with a CPU's dtypes.
    cuda = {"fc1": torch.float16, "norm": torch.float32, "fc2": torch.float16,
            "loss": torch.float32}
    monkeypatch.setattr(ex02, "autocast_dtypes", lambda device=None: cuda)
    check = ex02.check_autocast_dtypes(ex02.WRONG_DTYPES["everything 16-bit"], "cpu")
    assert_wrong(check, "norm returns", "loss returns", "per operation", hints=hints)
    assert "CPU autocast keeps" not in check.hint
    cpu_answer = {"fc1": "16-bit", "norm": "16-bit", "fc2": "16-bit", "loss": "fp32"}
    assert_wrong(ex02.check_autocast_dtypes(cpu_answer, "cpu"), "layer_norm", hints=hints)


def _one_bug(bug):
    """The reference loop with one of the three bugs put back."""
    import torch.nn.functional as F

    def loop(model, optimizer, scheduler, batches, device_type, init_scale):
        if bug == "half":
            model.half()
        scaler = torch.amp.GradScaler(device_type, init_scale=init_scale)
        for x, y in batches:
            with torch.autocast(device_type, dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if bug == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.unscale_(optimizer)
            if bug not in ("clip", "no clipping"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            if bug == "scheduler" or (bug != "no scheduler" and scaler.get_scale() >= scale):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return loop


def test_ex02_fixed_loop_matches_the_trainer_bitwise():
    hints = ex02.HINTS["loop"]
    assert ex02.check_fixed_loop(ex02.reference_loop, "cpu")
    assert_unanswered(ex02.check_fixed_loop(ex02.buggy_loop, "cpu"), hints)
    half = ex02.check_fixed_loop(_one_bug("half"), "cpu")
    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # torch notices it too
        scheduler = ex02.check_fixed_loop(_one_bug("scheduler"), "cpu")
    clip = ex02.check_fixed_loop(_one_bug("clip"), "cpu")
    assert_wrong(half, ".half() bug", "delete the model.half()", hints=hints)
    assert_wrong(scheduler, "scheduler bug", "get_scale()", hints=hints)
    assert_wrong(clip, "clipping bug is the one left", "clip after scaler.unscale_", hints=hints)
    unclipped = ex02.check_fixed_loop(_one_bug("no clipping"), "cpu")  # not the clipping order
    assert_wrong(unclipped, "something else in the loop changed", "clip to 1.0", hints=hints)
    never = ex02.check_fixed_loop(_one_bug("no scheduler"), "cpu")  # fixed too far: never steps
    assert_wrong(never, "stepped less often", "after every other one", hints=hints)
    # each says which bug remains and hints at that one only, not the list of three
    others = {"half": ("clip", "scheduler"), "scheduler": ("half()", "clip"),
              "clip": ("half()", "scheduler")}
    for check, bug in ((half, "half"), (scheduler, "scheduler"), (clip, "clip")):
        assert not [w for w in others[bug] if w in check.hint], (bug, check.hint)


def test_ex02_the_clipping_bug_is_named_when_it_moves_a_skip(monkeypatch):
    # Clipping the scaled gradients moves the weights less, and the scaler's overflows move with
    # them: on the CPU the trainer's run skips step 7, the clip-first loop does not (it skips a
    # later one). Cut at 8 steps, the clip-first loop steps the scheduler once more and its rate
    # ends lower: the rate alone named the scheduler bug, which that loop does not have.
    monkeypatch.setattr(ex02, "LOOP_STEPS", 8)
    ex02.trainer_result.cache_clear()
    try:
        clip_lr = _final_lr(ex02._clip_before_unscale)
        assert clip_lr < ex02.trainer_result("cpu")[1]  # the case: a rate that differs
        hints = ex02.HINTS["loop"]
        clip = ex02.check_fixed_loop(_one_bug("clip"), "cpu")
        assert_wrong(clip, "clipping bug is the one left", "clip after scaler.unscale_",
                     hints=hints)
        assert "scheduler bug" not in repr(clip)
        with pytest.warns(UserWarning, match="lr_scheduler.step"):
            scheduler = ex02.check_fixed_loop(_one_bug("scheduler"), "cpu")
        assert_wrong(scheduler, "scheduler bug", "get_scale()", hints=hints)
        assert ex02.check_fixed_loop(ex02.reference_loop, "cpu")
    finally:
        ex02.trainer_result.cache_clear()


def _final_lr(loop):
    model, optimizer, scheduler, batches = ex02._loop_setup(torch.device("cpu"))
    loop(model, optimizer, scheduler, batches, "cpu", ex02.LOOP_INIT_SCALE)
    return scheduler.get_last_lr()[0]


def test_ex02_autograd_function():
    assert ex02.check_autograd_function(ex02.reference_function("cpu"), "cpu")
    hints = ex02.HINTS["function"]
    assert_unanswered(ex02.check_autograd_function(None, "cpu"), hints)
    assert_wrong(ex02.check_autograd_function(ex02.undecorated_function(), "cpu"),
                 "ran outside autocast", "decorator pair", hints=hints)


# --- lesson 03 --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scaler_runs():
    settings = ScalerSettings(init_scale=2.0 ** 24, growth_interval=2)
    demo = l03_scaler.train_with_scaler(settings, 20, evaluate=False)
    floor = l03_scaler.train_with_scaler(ScalerSettings(), 19, injection_rate=1.0,
                                         evaluate=False)
    healthy = l03_scaler.train_with_scaler(ScalerSettings(init_scale=2.0 ** 8), 10,
                                           evaluate=False)
    return settings, demo, floor, healthy


def test_ex03_update_rule_replays_a_run(scaler_runs):
    settings, demo, _, _ = scaler_runs
    assert any(demo.skipped) and len(set(demo.scales)) > 3
    assert ex03.check_update_rule(ex03.reference_update, demo.scales, demo.skipped, settings)
    hints = ex03.HINTS["rule"]
    assert_unanswered(ex03.check_update_rule(lambda *a: None, demo.scales, demo.skipped,
                                             settings), hints)
    for bad in ex03.WRONG_RULES.values():
        assert_wrong(ex03.check_update_rule(bad, demo.scales, demo.skipped, settings),
                     "growth_interval", hints=hints)


def test_ex03_update_rule_names_the_mistake_from_the_whole_trace():
    # Lesson 03's own demo (quick profile: 2^24, growth_interval 10, 30 steps): both typical
    # mistakes first go wrong after a clean step, where one generic hint covered both; the whole
    # replayed trace tells which rule the learner wrote.
    settings = ScalerSettings(init_scale=2.0 ** 24, growth_interval=10)
    demo = l03_scaler.train_with_scaler(settings, 30, evaluate=False)
    assert any(demo.skipped[6:]) and max(demo.scales[5:]) > min(demo.scales[5:])
    assert ex03.check_update_rule(ex03.reference_update, demo.scales, demo.skipped, settings)
    hints = ex03.HINTS["rule"]
    for name, bad in ex03.WRONG_RULES.items():
        check = ex03.check_update_rule(bad, demo.scales, demo.skipped, settings)
        assert_wrong(check, ex03.RULE_MISTAKES[name], hints=hints)
        others = [m for n, m in ex03.RULE_MISTAKES.items() if n != name]
        assert not [m for m in others if m in repr(check)], check

    def no_backoff(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
        return ex03.reference_update(scale, tracker, False, growth_factor, backoff_factor,
                                     growth_interval) if not found_inf else (scale, 0)
    assert_wrong(ex03.check_update_rule(no_backoff, demo.scales, demo.skipped, settings),
                 "after a skipped step", "backoff_factor", hints=hints)


def test_ex03_trace_causes(scaler_runs):
    _, demo, floor, healthy = scaler_runs
    traces = {"A": (floor.scales, floor.skipped), "B": (demo.scales, demo.skipped),
              "C": (healthy.scales, healthy.skipped)}
    right = {"A": "inf or NaN every step", "B": "init_scale too high", "C": "healthy"}
    assert ex03.check_trace_causes(right, traces)
    text = ex03.traces_text(traces)
    assert text.count("\n") == 2 and "A: log2(scale) per step: 16x 15x" in text
    hints = ex03.HINTS["causes"]
    assert_unanswered(ex03.check_trace_causes(dict.fromkeys(traces), traces), hints)
    assert_wrong(ex03.check_trace_causes({**right, "A": "init_scale too high",
                                          "B": "inf or NaN every step"}, traces),
                 "trace A is not", "never recovered", hints=hints)
    assert_wrong(ex03.check_trace_causes({**right, "B": "healthy"}, traces), "trace B",
                 "steps in a row", hints=hints)
    assert_wrong(ex03.check_trace_causes({**right, "C": "init_scale too high"}, traces),
                 "trace C", "doing its job", hints=hints)
    assert_wrong(ex03.check_trace_causes({**right, "C": "too big"}, traces), "the causes are")


def test_ex03_steps_below_one(scaler_runs):
    floor = scaler_runs[2]
    assert ex03.first_below_one(floor.scales) == 17
    assert ex03.overflow_trace(ScalerSettings(), 19) == floor.scales  # the trainer's own trace
    assert ex03.check_steps_below_one(17, ScalerSettings())
    hints = ex03.HINTS["floor"]
    assert_unanswered(ex03.check_steps_below_one(None, ScalerSettings()), hints)
    assert_wrong(ex03.check_steps_below_one(16, ScalerSettings()), "not below 1", hints=hints)
    assert_wrong(ex03.check_steps_below_one(8, ScalerSettings()), "backoff_factor", hints=hints)
    assert ex03.check_steps_below_one(4, ScalerSettings(init_scale=8.0))


# --- lesson 04 --------------------------------------------------------------------------------
def test_ex04_state_bytes_and_activation_ratio():
    model = al.models.resnet18(num_classes=10)
    ref = ex04.reference_state_bytes(model)
    n = sum(p.numel() for p in model.parameters())
    row = {"params_gib": 4 * n / 2 ** 30, "grads_gib": 4 * n / 2 ** 30,
           "optimizer_state_gib": 4 * n / 2 ** 30}
    assert ex04.check_state_bytes(ref, row)
    state, ratio = ex04.HINTS["state"], ex04.HINTS["ratio"]
    assert_unanswered(ex04.check_state_bytes(dict.fromkeys(ref), row), state)
    assert_wrong(ex04.check_state_bytes({k: v / 2 for k, v in ref.items()}, row), "16 bits",
                 hints=state)
    assert_wrong(ex04.check_state_bytes({k: v / 2 ** 30 for k, v in ref.items()}, row), "GiB",
                 hints=state)
    grads16 = ex04.check_state_bytes({**ref, "grads": ref["grads"] / 2}, row)
    assert_wrong(grads16, "grads:", "gradient takes its parameter's dtype", hints=state)
    assert_wrong(ex04.check_state_bytes({**ref, "momentum": 2 * ref["momentum"]}, row),
                 "one momentum buffer", hints=state)
    amp, fp32 = {"activations_gib": 1.05}, {"activations_gib": 2.0}
    assert ex04.check_activation_ratio(0.5, amp, fp32)
    assert_unanswered(ex04.check_activation_ratio(None, amp, fp32), ratio)
    assert_wrong(ex04.check_activation_ratio(1.0, amp, fp32), "does save", hints=ratio)
    assert_wrong(ex04.check_activation_ratio(0.25, amp, fp32), "halves", hints=ratio)


def test_ex04_activation_ratio_on_lesson_04s_quick_rows():
    # Lesson 04's quick profile (ResNet-18, 32x32, batch 4, on a CPU, AMP in bf16), its two plain
    # rows measured as the notebook measures them: bf16 saves many times fp32's activation bytes
    # (autocast's 16-bit weight copies dominate at this size), not the GPU's ~0.5 of the fixture
    # above, so every answer, the textbook 0.5 included, gets the hint about what it counts.
    from amp_lessons.lessons import l04_resnet50
    configs = [c for c in l04_resnet50.lesson_configs("resnet18", 4, 32, amp="bf16",
                                                      compile_precision=None)
               if c.precision in ("fp32", "bf16") and not c.channels_last and c.compile is None
               and not c.cuda_graph and c.model == "resnet18"
               and c.optimizer == l04_resnet50.STANDARD["optimizer"]
               and c.impl == l04_resnet50.STANDARD["impl"]]
    quick = al.measure.standard_settings(quick=True)
    rows = al.measure.run_configs(configs, "cpu", warmup=quick["warmup"], steps=quick["steps"])
    amp, fp32 = (l04_resnet50.plain_row(rows, p, "resnet18") for p in ("bf16", "fp32"))
    measured = amp["activations_gib"] / fp32["activations_gib"]
    assert measured > 1 and ex04.check_activation_ratio(measured, amp, fp32)
    for guess in (0.5, 1.0, 0.25):
        assert_wrong(ex04.check_activation_ratio(guess, amp, fp32), "tiny sizes",
                     hints=ex04.HINTS["ratio"])


def test_ex04_channels_last():
    assert ex04.check_channels_last(ex04.reference_channels_last)
    hints = ex04.HINTS["layout"]
    assert_unanswered(ex04.check_channels_last(lambda model, x: None), hints)
    assert_wrong(ex04.check_channels_last(lambda m, x: (m, x)), "NCHW", hints=hints)
    assert_wrong(ex04.check_channels_last(
        lambda m, x: (m.to(memory_format=torch.channels_last), x)), "input", hints=hints)


# --- lesson 05 --------------------------------------------------------------------------------
def test_ex05_accumulation():
    assert ex05.check_accumulation(ex05.reference_accumulate)
    hints = ex05.HINTS["accumulate"]
    assert_unanswered(ex05.check_accumulation(lambda model, x, y, n: None), hints)
    assert_wrong(ex05.check_accumulation(ex05.WRONG_ACCUMULATE["loss not divided"]), "4.00x",
                 hints=hints)
    assert_wrong(ex05.check_accumulation(ex05.WRONG_ACCUMULATE["gradients zeroed per micro-batch"]),
                 "zeroed", hints=hints)


def test_ex05_accumulation_names_a_mistake_from_all_the_gradients():
    # Splitting with x.split(n) (slices of n samples) instead of x.chunk(n) (n slices), each
    # loss divided by n: twice the right gradients. The first parameter's ratio alone is not
    # n, so the last branch blamed zeroing the gradients, which this loop never does.
    import torch.nn.functional as F
    hints = ex05.HINTS["accumulate"]

    def split_not_chunk(model, x, y, micro_batches):
        for xs, ys in zip(x.split(micro_batches), y.split(micro_batches)):
            (F.cross_entropy(model(xs), ys) / micro_batches).backward()
    check = ex05.check_accumulation(split_not_chunk)
    assert_wrong(check, "2.00x", "x.split(n)", hints=hints)
    assert "zeroed" not in repr(check)

    def last_half_only(model, x, y, micro_batches):  # neither a size nor a known mistake
        half = len(x) // 2
        F.cross_entropy(model(x[half:]), y[half:]).backward()
    other = ex05.check_accumulation(last_half_only)
    assert other.status == "wrong" and "in direction" in other.message, other
    assert "zeroed" not in repr(other) and other.hints == hints.levels


def test_ex05_checkpointing():
    assert ex05.check_checkpointing(ex05.reference_checkpointed_forward)
    hints = ex05.HINTS["checkpoint"]
    assert_unanswered(ex05.check_checkpointing(lambda blocks, x: None), hints)

    def plain(blocks, x):
        for b in blocks:
            x = b(x)
        return x
    assert_wrong(ex05.check_checkpointing(plain), "nothing was checkpointed", hints=hints)

    def reentrant(blocks, x):
        for b in blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True)
        return x
    with pytest.warns(UserWarning):
        assert_wrong(ex05.check_checkpointing(reentrant), "use_reentrant=False", hints=hints)


def test_ex05_resume_keeps_the_scaler():
    assert ex05.check_resume(ex05.reference_save, ex05.reference_load)
    hints = ex05.HINTS["resume"]
    assert_unanswered(ex05.check_resume(lambda m, o, s: None, lambda *a: None), hints)
    for save, load in ex05.WRONG_RESUME.values():
        assert_wrong(ex05.check_resume(save, load), "scaler.state_dict()", hints=hints)

    def load_no_optimizer(state, model, optimizer, scaler):
        model.load_state_dict(state["model"])
        scaler.load_state_dict(state["scaler"])
    assert_wrong(ex05.check_resume(ex05.reference_save, load_no_optimizer),
                 "optimizer.state_dict()", hints=hints)


def test_ex05_resume_names_every_piece_that_did_not_come_back():
    # Saving the model only loses the optimizer's momentum and the scaler's state; the loss
    # scale differs first, so the check named the scaler alone (the other mistake's hint).
    hints = ex05.HINTS["resume"]
    model_only = ex05.check_resume(*ex05.WRONG_RESUME["model only"])
    assert_wrong(model_only, "scaler.state_dict()", "optimizer.state_dict()", hints=hints)
    no_scaler = ex05.check_resume(*ex05.WRONG_RESUME["no scaler state"])
    assert_wrong(no_scaler, "scaler.state_dict()", hints=hints)
    assert "optimizer.state_dict()" not in repr(no_scaler)

    def load_no_model(state, model, optimizer, scaler):  # the weights stay the fresh ones
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    no_model = ex05.check_resume(ex05.reference_save, load_no_model)
    assert_wrong(no_model, "model.state_dict()", hints=hints)
    assert "optimizer.state_dict()" not in no_model.hint


# --- lesson 06 --------------------------------------------------------------------------------
def test_ex06_stub_is_unanswered_without_running():
    assert_unanswered(ex06.check_script(ex06.STUB), ex06.HINTS["script"])
    assert_unanswered(ex06.check_script(ex06.STUB_BODY), ex06.HINTS["script"])
    assert ex06.full_script(ex06.REFERENCE_BODY) == ex06.REFERENCE
    assert "init_process_group" not in ex06.STUB and "fully_shard(layer" in ex06.REFERENCE


def test_ex06_script_is_skipped_where_torch_cannot_shard_on_a_cpu(monkeypatch):
    """torch < 2.9 cannot run FSDP2 correctly on CPU processes: the grader says so instead of
    failing the learner's script with torch's own error (or grading wrong sums)."""
    monkeypatch.setattr(distributed, "torch_version", lambda: (2, 6))
    check = ex06.check_script(ex06.REFERENCE_BODY)
    assert check.status == "skipped" and "FSDP2 on CPU processes needs torch >= 2.9" in str(check)


NO_FSDP2_CPU = pytest.mark.skipif(distributed.fsdp2_problem("cpu") is not None,
                                  reason=str(distributed.fsdp2_problem("cpu")))


@pytest.fixture(scope="module")
def reference_reports():
    result = ex06.run_script(ex06.REFERENCE)
    assert result["returncode"] == 0, result["error"]
    return result["reports"]


@pytest.mark.slow
@NO_FSDP2_CPU
def test_ex06_script_runs_with_torchrun_on_two_cpu_processes(reference_reports):
    assert ex06.grade_reports(reference_reports), ex06.grade_reports(reference_reports)
    assert [r["rank"] for r in reference_reports] == [0, 1]


@pytest.mark.slow
@NO_FSDP2_CPU
def test_ex06_script_without_ddp_fails_with_its_hint():
    body = ex06.REFERENCE_BODY.replace("ddp = DDP(make_model())", "ddp = make_model()")
    assert_wrong(ex06.check_script(body), "wrap the model in DDP",  # a body, as in the notebook
                 hints=ex06.HINTS["script"])


@NO_FSDP2_CPU
def test_ex06_reports_of_typical_mistakes(reference_reports):
    one_unit = [dict(r, fsdp_units=1) for r in reference_reports]
    hints = ex06.HINTS["script"]
    assert_wrong(ex06.grade_reports(one_unit), "on each nn.Linear", hints=hints)
    fp32 = [dict(r, fsdp_output="torch.float32") for r in reference_reports]
    assert_wrong(ex06.grade_reports(fp32), "param_dtype=torch.bfloat16", hints=hints)
    unsharded = [dict(r, fsdp_local=r["full"]) for r in reference_reports]
    assert_wrong(ex06.grade_reports(unsharded), "nothing is sharded", hints=hints)
    assert "root only" in ex06.WRONG_SCRIPTS


def test_ex06_state_per_rank():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    held = al.distributed.local_state_bytes(model, opt)
    n = sum(p.numel() for p in model.parameters())
    ddp = sum(held.values()) / ex06.MIB  # one process's full copy, measured
    assert abs(ddp / ex06.reference_state_per_rank(n, 1)["ddp"] - 1) < 0.01  # + AdamW's steps
    measured = {"ddp": ddp, "zero": ddp * 12 / 16, "fsdp2": ddp / 2}
    assert ex06.check_state_per_rank(ex06.reference_state_per_rank(n, 2), measured, 2)
    hints = ex06.HINTS["state"]
    assert_unanswered(ex06.check_state_per_rank(dict.fromkeys(measured), measured, 2), hints)
    assert_wrong(ex06.check_state_per_rank({**measured, "zero": ddp / 2}, measured, 2),
                 "only the optimizer state", hints=hints)
    assert_wrong(ex06.check_state_per_rank({**measured, "fsdp2": ddp}, measured, 2), "16/N",
                 hints=hints)


def test_ex06_efficiency():
    summary = [{"label": "ddp bf16", "world_size": 1, "per_s": 100.0, "efficiency": 1.0},
               {"label": "ddp bf16", "world_size": 2, "per_s": 190.0, "efficiency": 0.95}]
    assert ex06.check_efficiency(ex06.reference_efficiency, summary)
    hints = ex06.HINTS["efficiency"]
    assert_unanswered(ex06.check_efficiency(lambda a, b, n: None, summary), hints)
    assert_wrong(ex06.check_efficiency(lambda a, b, n: b / a, summary), "speed-up", hints=hints)
    assert ex06.check_efficiency(ex06.reference_efficiency, summary[:1]).status == "skipped"


def test_ex06_state_in_the_wrong_unit_is_not_blamed_on_ddp():
    # Answers in bytes (or GiB) with every split right: the first key alone gave DDP's hint,
    # "DDP replicates everything", the hint for a DDP answer that splits something.
    n, world = 1_000_000, 2
    measured = ex06.reference_state_per_rank(n, world)
    hints = ex06.HINTS["state"]
    in_bytes = {k: v * ex06.MIB for k, v in measured.items()}
    check = ex06.check_state_per_rank(in_bytes, measured, world)
    assert_wrong(check, "those are bytes", "2**20", hints=hints)
    assert "replicates" not in check.hint
    in_gib = {k: v / 1024 for k, v in measured.items()}
    assert_wrong(ex06.check_state_per_rank(in_gib, measured, world), "those are GiB", hints=hints)
    twelve = {k: v * 12 / 16 for k, v in measured.items()}  # 12 bytes per parameter everywhere
    assert_wrong(ex06.check_state_per_rank(twelve, measured, world), "bytes per parameter",
                 hints=hints)
    fsdp_for_zero = {**measured, "zero": measured["fsdp2"]}  # one key off: its own fact
    assert_wrong(ex06.check_state_per_rank(fsdp_for_zero, measured, world),
                 "only the optimizer state", hints=hints)


def test_ex06_efficiency_names_a_mistake_from_every_row():
    # At 2 processes, speed-up / (n - 1) equals the speed-up: the first row alone told a learner
    # who divides to divide. A sweep with 2 and 4 processes (the full profile) tells them apart.
    summary = [{"label": "ddp bf16", "world_size": 1, "per_s": 100.0, "efficiency": 1.0},
               {"label": "ddp bf16", "world_size": 2, "per_s": 190.0, "efficiency": 0.95},
               {"label": "ddp bf16", "world_size": 4, "per_s": 360.0, "efficiency": 0.9}]
    hints = ex06.HINTS["efficiency"]
    off_by_one = ex06.check_efficiency(lambda a, b, n: b / a / (n - 1), summary)
    assert off_by_one.status == "wrong" and off_by_one.hints == hints.levels, off_by_one
    assert_wrong(ex06.check_efficiency(ex06.WRONG_EFFICIENCY["the speed-up"], summary),
                 "speed-up", hints=hints)
    assert_wrong(ex06.check_efficiency(ex06.WRONG_EFFICIENCY["the inverse"], summary),
                 "inverse", hints=hints)
    assert ex06.check_efficiency(ex06.reference_efficiency, summary)


# --- lesson 07 --------------------------------------------------------------------------------
def test_ex07_scales_match_the_lessons_amax_scale():
    x = ex07.test_tensor()
    assert torch.allclose(ex07.reference_per_tensor(x), l07_fp8.amax_scale(x, "e4m3"))
    assert torch.allclose(ex07.reference_per_row(x), l07_fp8.amax_scale(x, "e4m3", "rowwise"))
    assert ex07.check_per_tensor_scale(ex07.reference_per_tensor)
    assert ex07.check_per_row_scale(ex07.reference_per_row)
    tensor, row = ex07.HINTS["tensor"], ex07.HINTS["row"]
    assert_unanswered(ex07.check_per_tensor_scale(lambda x: None), tensor)
    assert_unanswered(ex07.check_per_row_scale(lambda x: None), row)
    fragments = {"inverted": "inverse", "no abs": "x.abs()", "e5m2's max": "e5m2"}
    for name, bad in ex07.WRONG_TENSOR.items():
        assert_wrong(ex07.check_per_tensor_scale(bad), fragments[name], hints=tensor)
    assert_wrong(ex07.check_per_row_scale(ex07.WRONG_ROW["per column"]), "per column",
                 "the last dimension", hints=row)
    assert_wrong(ex07.check_per_row_scale(ex07.WRONG_ROW["per tensor"]), "whole tensor",
                 "each row's own values", hints=row)


def test_ex07_a_wrong_scale_is_named_only_by_its_own_mistake():
    # Before, any scale that was neither the inverse nor e5m2's was told to use x.abs().
    tensor, row = ex07.HINTS["tensor"], ex07.HINTS["row"]
    fnuz = ex07.check_per_tensor_scale(lambda x: 240.0 / x.abs().max())  # e4m3fnuz's max
    assert_wrong(fnuz, "0.5357x", "not e4m3's 448", hints=tensor)
    assert "x.abs()" not in fnuz.hint
    mean = ex07.check_per_tensor_scale(lambda x: 448.0 / x.abs().mean())  # a second input tells
    assert mean.status == "wrong" and mean.hints == tensor.levels, mean  # it from a wrong max
    rows_mean = ex07.check_per_row_scale(lambda x: 448.0 / x.abs().mean(dim=-1, keepdim=True))
    assert rows_mean.status == "wrong" and rows_mean.hints == row.levels, rows_mean
    assert_wrong(ex07.check_per_row_scale(lambda x: 448.0 / x.amax(dim=-1, keepdim=True)),
                 "x.abs()", hints=row)


def test_ex07_module_filter_names_every_layer_it_gets_wrong():
    # Lesson 07's own model (shapes only): converting every Linear gets the first and the last
    # layer wrong, for two reasons; the first layer's alone was the hint of a filter that only
    # forgot the first layer.
    with torch.device("meta"):
        big = l07_fp8.example_transformer(d_model=2048, n_layers=2)
    plan = l07_fp8.conversion_plan(big, 2048)  # MIN_FEATURES where no speed-up was measured
    hints = ex07.HINTS["filter"]
    every = ex07.check_module_filter(ex07.wrong_filter_all_linear, big, plan)
    assert_wrong(every, "2 of 9", "head", "first layer", "last layer", hints=hints)
    names = [r["layer"] for r in plan]
    first_only = ex07.check_module_filter(lambda m, fqn: fqn != names[-1], big, plan)
    assert_wrong(first_only, names[0], "first layer", hints=hints)
    assert "last layer" not in first_only.hint


def test_ex07_module_filter():
    model = l07_fp8.mlp_stack(256, blocks=2)
    plan = l07_fp8.conversion_plan(model, min_features=256)
    assert ex07.check_module_filter(l07_fp8.module_filter(plan), model, plan)
    hints = ex07.HINTS["filter"]
    assert_unanswered(ex07.check_module_filter(lambda m, fqn: None, model, plan), hints)
    assert_wrong(ex07.check_module_filter(ex07.wrong_filter_all_linear, model, plan),
                 "first layer", hints=hints)


# --- lesson 08 --------------------------------------------------------------------------------
def test_ex08_stochastic_rounding_is_unbiased():
    assert ex08.check_stochastic_rounding(ex08.reference_stochastic_round)
    hints = ex08.HINTS["stochastic"]
    assert_unanswered(ex08.check_stochastic_rounding(lambda x: None), hints)
    fragments = {"round to nearest": "round-to-nearest", "truncate": "toward zero",
                 "noise, then round to nearest": "cut the low 16 bits off"}
    for name, bad in ex08.WRONG_STOCHASTIC.items():
        assert_wrong(ex08.check_stochastic_rounding(bad), fragments[name], hints=hints)
    def int64_noise(x):  # torch.randint's default dtype makes the sum int64
        noise = torch.randint(0, 1 << 16, x.shape)
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    assert_wrong(ex08.check_stochastic_rounding(int64_noise), "torch.int32", hints=hints)
    assert_wrong(ex08.check_stochastic_rounding(lambda x: x.clone()), "torch.bfloat16",
                 hints=hints)


def test_ex08_rounding_every_value_up_is_not_called_a_double_rounding():
    # All the way up (the largest 16-bit value added below the cut, not a random one): every
    # positive value is biased by more than 0.3 ulp, the test the double rounding's hint used.
    def always_up(x):
        return ((x.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32).to(torch.bfloat16)
    check = ex08.check_stochastic_rounding(always_up)
    assert_wrong(check, "upper neighbour", "must be random", hints=ex08.HINTS["stochastic"])
    assert "rounds to nearest a second time" not in check.hint


def test_ex08_stochastic_rounding_must_draw_fresh_noise_each_call():
    """A rounding that is unbiased over a tensor but fixed from call to call (a generator seeded
    inside the function, or a pattern) repeats the same error at every step: not stochastic."""
    def seeded_inside(x):
        g = torch.Generator().manual_seed(1234)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=g)
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    def pattern(x):
        noise = (torch.arange(x.numel(), dtype=torch.int32) * 40503) % 65536
        return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

    for fixed in (seeded_inside, pattern):
        assert_wrong(ex08.check_stochastic_rounding(fixed), "second call", "fresh random",
                     hints=ex08.HINTS["stochastic"])

    def uniform_draw(x):  # another correct way: compare a uniform draw with the share of the gap
        low = (x.view(torch.int32) & -65536).view(torch.float32)
        high = (low.view(torch.int32) + 65536).view(torch.float32)
        return torch.where(torch.rand_like(x) < (x - low) / (high - low), high, low).to(
            torch.bfloat16)

    assert ex08.check_stochastic_rounding(uniform_draw)

def test_ex08_kahan_update_keeps_small_updates():
    assert ex08.check_kahan_update(ex08.reference_kahan_add)
    hints = ex08.HINTS["kahan"]
    assert_unanswered(ex08.check_kahan_update(lambda w, c, u: None), hints)
    fragments = {"no compensation": "never changes", "sign flipped": "negative",
                 "compensation kept but never added": "never receives it"}
    for name, bad in ex08.WRONG_KAHAN.items():
        assert_wrong(ex08.check_kahan_update(bad), fragments[name], hints=hints)
    assert_wrong(ex08.check_kahan_update(lambda w, c, u: (w, c)), "unchanged", hints=hints)



def test_ex08_kahan_update_that_keeps_its_own_fp32_copy_fails():
    """A learner's update that keeps an fp32 master copy between calls (in a closure) and only
    casts it to bf16 ends exact, but is not a Kahan update: the same inputs must give the same
    outputs, whatever was called before."""
    master = {}

    def fp32_master(weight, compensation, update):
        total = master.setdefault("w", weight.float().clone())
        total += update
        return total.to(torch.bfloat16), compensation

    assert_wrong(ex08.check_kahan_update(fp32_master), "same inputs", hints=ex08.HINTS["kahan"])

    def textbook(weight, compensation, update):  # Kahan with the buffer's sign the other way
        w = weight.float()
        y = update - compensation.float()
        new = (w + y).to(torch.bfloat16)
        return new, ((new.float() - w) - y).to(torch.bfloat16)

    assert ex08.check_kahan_update(textbook)

@pytest.fixture(scope="module")
def lesson08_memory():
    workload = l08_weights.teacher_student(16, 16, 2, "cpu")
    rows = l08_weights.run_recipes(workload, ex08.MEMORY_RECIPES, "cpu", seeds=(0,), bf16=True)
    return l08_weights.memory_table(rows)


def test_ex08_state_gib_against_the_measured_table(lesson08_memory):
    memory = lesson08_memory
    ref = ex08.reference_state_gib(memory)
    assert sorted(ref) == sorted(ex08.MEMORY_RECIPES)
    assert abs(ref["fp32 master"] / (16 * 7e9 / 2 ** 30) - 1) < 0.01  # measured, near 16 B
    assert ex08.check_state_gib(ref, memory)
    assert ex08.check_state_gib({"fp32 master": 104.3, "bf16": 52.2, "bf16 + Kahan": 65.2}, memory)
    hints = ex08.HINTS["memory"]
    assert_unanswered(ex08.check_state_gib(dict.fromkeys(ex08.MEMORY_RECIPES), memory), hints)
    assert_wrong(ex08.check_state_gib({k: v * 2 ** 30 / 1e9 for k, v in ref.items()}, memory),
                 "GB", hints=hints)
    assert_wrong(ex08.check_state_gib({**ref, "fp32 master": 12 * 7e9 / 2 ** 30}, memory),
                 "gradients too", hints=hints)
    assert_wrong(ex08.check_state_gib({**ref, "bf16": 16 * 7e9 / 2 ** 30}, memory),
                 "2 bytes each", hints=hints)
    assert_wrong(ex08.check_state_gib({**ref, "bf16 + Kahan": ref["bf16"]}, memory),
                 "compensation", hints=hints)
    only_ref = [m for m in memory if m["recipe"] == "fp32 master"]
    assert ex08.check_state_gib(ref, only_ref)  # recipes not measured are not graded
    assert ex08.check_state_gib(ref, []).status == "skipped"


# --- lesson 09 --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def doctor_reports():
    """The doctor on two tiny models: one whose middle Linear overflows fp16, one with a large
    batch, so small gradients (a loss scale far from the default 2^16)."""
    reports = []
    for name, factor, n in (("overflowing", 1e6, 8), ("small gradients", 1.0, 1024)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16),
                              nn.Linear(16, 4))
        with torch.no_grad():
            model[2].weight.mul_(factor)
        batch = (torch.randn(n, 8), torch.randint(0, 4, (n,)))
        reports.append(al.doctor(model, batch, name=name, precisions=(), trial_steps=0,
                                 compile=False))
    return reports


def test_ex09_overflow_layer(doctor_reports):
    over, plain = doctor_reports
    assert over.overflow and not plain.overflow
    assert ex09.check_overflow_layer(ex09.reference_overflow_layer(over), over)
    assert ex09.check_overflow_layer("2", over) and not ex09.check_overflow_layer("0", over)
    hints = ex09.HINTS["overflow"]
    assert_unanswered(ex09.check_overflow_layer(None, over), hints)
    fragments = {"a layer inf only reaches": "downstream", "not a layer of the report":
                 "layer column"}
    for name, bad in ex09.WRONG_OVERFLOW.items():
        assert_wrong(ex09.check_overflow_layer(bad(over), over), fragments[name], hints=hints)
    assert ex09.check_overflow_layer("2", plain).status == "skipped"


def test_ex09_scale_exponent_from_the_ranges(doctor_reports):
    assert doctor_reports[1].scale_exponent > 16  # the default's exponent would be wrong here
    assert ex09.check_scale_exponent(ex09.reference_scale_exponent, doctor_reports)
    hints = ex09.HINTS["scale"]
    assert_unanswered(ex09.check_scale_exponent(lambda r: None, doctor_reports), hints)
    fragments = {"from the activations": "not the activations", "rounded up": "round the exponent down",
                 "from the smallest gradient": "not the smallest",
                 "the default init_scale": "default init_scale"}
    for name, bad in ex09.WRONG_SCALE.items():
        assert_wrong(ex09.check_scale_exponent(bad, doctor_reports[::-1]), fragments[name],
                     hints=hints)
    assert_wrong(ex09.check_scale_exponent(lambda r: 2.0 ** ex09.reference_scale_exponent(r),
                                           doctor_reports[1:]),
                 "not the scale", hints=hints)



def _fake_report(model, grad_exp, act_exp):
    """A doctor report's ranges only: the largest gradient fp16's max / 2**grad_exp, the largest
    activation fp16's max / 2**act_exp."""
    from types import SimpleNamespace
    top = 65504.0
    layers = [{"name": "fc", "grad_absmax": top / 2 ** grad_exp, "act_absmax": top / 2 ** act_exp,
               "grad_min": top / 2 ** (grad_exp + 9)}]
    return SimpleNamespace(model=model, layers=layers, scale_exponent=math.floor(grad_exp))


def test_ex09_a_mistake_is_named_from_every_report_not_the_first_alone():
    # On report a, the exponent from the activations (12) is also the gradients' rounded up
    # (11.5 -> 12): the first report alone would blame rounding. Report b tells them apart.
    a, b = _fake_report("a", 11.5, 12.2), _fake_report("b", 20.5, 5.3)
    check = ex09.check_scale_exponent(ex09.WRONG_SCALE["from the activations"], [a, b])
    assert_wrong(check, "not the activations", hints=ex09.HINTS["scale"])
    assert "round the exponent down" not in str(check)
    rounded = ex09.check_scale_exponent(ex09.WRONG_SCALE["rounded up"], [a, b])
    assert_wrong(rounded, "round the exponent down", hints=ex09.HINTS["scale"])
    # an answer that is none of the typical mistakes still gets the fact about its exponent
    odd = ex09.check_scale_exponent(lambda r: {"a": 12, "b": 3}[r.model], [a, b])
    assert_wrong(odd, "round the exponent down", hints=ex09.HINTS["scale"])
    assert ex09.check_scale_exponent(ex09.reference_scale_exponent, [a, b])
    # the smallest gradient's exponent, on a report whose gradients are all close together, is
    # also the largest one's rounded up (12): report d tells them apart
    c, d = _fake_report("c", 11.5, 5.0), _fake_report("d", 20.5, 5.0)
    c.layers[0]["grad_min"], d.layers[0]["grad_min"] = 65504.0 / 2 ** 12.2, 65504.0 / 2 ** 25
    smallest = ex09.check_scale_exponent(ex09.WRONG_SCALE["from the smallest gradient"], [c, d])
    assert_wrong(smallest, "not the smallest", hints=ex09.HINTS["scale"])
    assert "round the exponent down" not in str(smallest)


def test_ex09_scale_exponent_that_is_not_finite_is_wrong_not_a_crash(doctor_reports):
    for k in (float("inf"), float("nan")):
        assert_wrong(ex09.check_scale_exponent(lambda r: k, doctor_reports), "whole",
                     hints=ex09.HINTS["scale"])


def test_ex09_scale_exponent_cannot_return_the_doctors_own_answer(doctor_reports):
    """The exercise is to compute k from report.layers: handing back report.scale_exponent (or
    the advice) fails, and the learner's function cannot change the report either."""
    check = ex09.check_scale_exponent(lambda r: r.scale_exponent, doctor_reports)
    assert check.status == "wrong" and "report.layers only" in check.message, check
    before = [dict(r) for r in doctor_reports[1].layers]

    def sorts_in_place(report):
        report.layers.sort(key=lambda r: -(r["grad_absmax"] or 0))
        report.layers.clear()
        return 0

    ex09.check_scale_exponent(sorts_in_place, doctor_reports)
    assert doctor_reports[1].layers == before

def test_ex09_answers_from_your_report(doctor_reports):
    hints = ex09.HINTS["yours"]
    for report in doctor_reports:
        assert ex09.check_report_answers(ex09.reference_answers(report), report)
        assert_unanswered(ex09.check_report_answers(dict.fromkeys(ex09.QUESTIONS), report), hints)
        assert_wrong(ex09.check_report_answers(ex09.WRONG_ANSWERS["the last layer"](report),
                                               report), "not always the last", hints=hints)
    small = doctor_reports[1]
    assert_wrong(ex09.check_report_answers(ex09.WRONG_ANSWERS["the default init_scale"](small),
                                           small), "default start", hints=hints)
    assert_wrong(ex09.check_report_answers({**ex09.reference_answers(small), "fp16 safe": False},
                                           small), "fp16 safe", hints=hints)



def test_ex09_answers_accept_numpy_values(doctor_reports):
    np = pytest.importorskip("numpy")
    small = doctor_reports[1]
    ref = ex09.reference_answers(small)
    answers = {**ref, "fp16 safe": np.bool_(ref["fp16 safe"]),
               "scale exponent": np.int64(ref["scale exponent"])}
    assert ex09.check_report_answers(answers, small)
    assert not ex09.check_report_answers({**answers, "fp16 safe": np.bool_(not ref["fp16 safe"])},
                                         small)
    assert not ex09.check_report_answers({**ref, "fp16 safe": 1}, small)
    assert_wrong(ex09.check_report_answers({**ref, "fp16 safe": str(ref["fp16 safe"])}, small),
                 "expected True or False", "no quotes", hints=ex09.HINTS["yours"])

# --- the notebooks --------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
LESSONS_WITH_EXERCISES = sorted(ROOT.glob("notebooks/0[1-9]_*.ipynb"))


@pytest.mark.parametrize("path", LESSONS_WITH_EXERCISES, ids=lambda p: Path(p).name[:2])
def test_each_lesson_has_three_graded_exercises_and_questions_before_checks(path):
    nb = nbformat.read(path, as_version=4)
    cells = nb.cells
    exercises = [i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])]
    assert len(exercises) >= 3, f"{path.name}: {len(exercises)} exercise cells"
    module = f"ex{path.name[:2]}."
    for i in exercises:
        check = cells[i + 1]
        assert check.cell_type == "code" and module in check.source and "check_" in check.source, \
            f"{path.name}: the cell after exercise cell {i} does not grade it"
    heads = [c.source.splitlines()[0] for c in cells if c.cell_type == "markdown" and c.source]
    sections = [h for h in heads if h.startswith("## ")]
    assert sections[-2:] == ["## Questions", "## Checks"], sections[-3:]
    questions = next(c.source for c in cells if c.cell_type == "markdown"
                     and c.source.startswith("## Questions"))
    assert 5 <= questions.count("<details>") <= 10
    assert questions.count("<details>") == questions.count("</details>")


def test_ex06_a_rank_dying_in_teardown_after_a_complete_report_still_counts():
    abort = "terminate called without an active exception\nChildFailedError:"
    complete = [{"rank": 0}, {"rank": 1}]
    assert ex06._aborted_at_exit(abort, complete)
    assert not ex06._aborted_at_exit(abort, [{"rank": 0}, None])  # a rank never reported
    assert not ex06._aborted_at_exit(abort, None)  # no report at all
    assert not ex06._aborted_at_exit("RuntimeError: boom", complete)  # a real failure


def _sections_without_takeaway(path):
    """The ``## `` sections of a notebook whose last markdown line, before the section's
    exercises (``### Exercise ...`` subsections, which come after what they practise; the takeaway
    may stand before or after them), is not a ``**Takeaway:**`` line. Questions and Checks are no teaching sections, and the Summary is a
    list of takeaways."""
    nb = nbformat.read(path, as_version=4)
    lines = [line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()]
    sections, current, last, in_exercise = [], None, "", False
    for line in lines + ["## end"]:
        if line.startswith("## "):
            if current and current not in ("## Questions", "## Checks", "## Summary"):
                sections.append((current, last.startswith("**Takeaway:**")))
            current, last, in_exercise = line, "", False
        elif line.startswith("### "):
            in_exercise = line.startswith("### Exercise")
            if not in_exercise:
                last = line
        elif line.startswith("**Takeaway:**") or (line.strip() and not in_exercise):
            last = line
    return [s for s, ok in sections if not ok]


@pytest.mark.parametrize("path", LESSONS_WITH_EXERCISES, ids=lambda p: Path(p).name[:2])
def test_every_section_of_every_lesson_ends_with_a_takeaway(path):
    assert _sections_without_takeaway(path) == []


def test_a_section_without_its_takeaway_is_found(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## 1. A\n\ntext\n\n**Takeaway:** one line."),
        nbformat.v4.new_markdown_cell("## 2. B\n\n**Claim:** a verdict alone."),
        nbformat.v4.new_markdown_cell("## 3. C\n\n**Takeaway:** first.\n\n### Exercise 1\n\nDo it."),
        nbformat.v4.new_markdown_cell("## 4. D\n\n**Takeaway:** x.\n\n### More\n\nNew text."),
        nbformat.v4.new_markdown_cell("## Questions\n\nQ"), nbformat.v4.new_markdown_cell("## Checks")])
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert _sections_without_takeaway(path) == ["## 2. B", "## 4. D"]


def _bound_names(sources) -> set:
    """Names that code cells bind (imports, assignments, definitions, loop and with targets);
    IPython's %magic and !shell lines are left out."""
    names = set()
    for source in sources:
        code = "\n".join(line for line in source.splitlines()
                         if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
    return names


def _modules_a_solution_uses(module) -> set:
    """The modules (``torch``, ``math``...) that the bodies of an exercise module's reference
    solutions use by a global name: what a learner's answer, written like the reference, needs."""
    used = set()
    for name, fn in vars(module).items():
        if not (name.startswith("reference_") and callable(fn)):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        body = ast.Module(body=tree.body[0].body, type_ignores=[])  # not the annotations
        for node in ast.walk(body):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                    and inspect.ismodule(getattr(module, node.id, None)):
                used.add(node.id)
    return used


@pytest.mark.parametrize("path", LESSONS_WITH_EXERCISES, ids=lambda p: Path(p).name[:2])
def test_an_answer_written_like_the_reference_finds_its_modules_in_the_notebook(path):
    # A learner writes `torch.` in an exercise cell: the lesson must have imported it by then
    # (lessons 05, 07 and 08 had not: a right answer failed with NameError: name 'torch').
    from amp_lessons import exercises
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if "exercise" in c.metadata.get("tags", []))
    bound = _bound_names(c.source for c in nb.cells[:first] if c.cell_type == "code")
    needed = _modules_a_solution_uses(exercises.MODULES[f"ex{path.name[:2]}"])
    assert needed - bound == set(), f"{path.name}: import {sorted(needed - bound)} before cell {first}"


def test_the_module_finder_sees_torch_in_a_reference_and_the_binder_sees_imports(tmp_path):
    (tmp_path / "exfake.py").write_text(
        "import math\nimport torch\nfrom torch import nn\n\n"
        "def reference_x(t: nn.Module):\n    return torch.zeros(1) + math.pi\n\n"
        "def helper(t):\n    return nn.Identity()(t)\n")
    spec = importlib.util.spec_from_file_location("exfake", tmp_path / "exfake.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert _modules_a_solution_uses(module) == {"torch", "math"}
    assert _bound_names(["%matplotlib inline\nimport torch.nn as nn\nfrom math import pi\nx = 1"]) \
        == {"nn", "pi", "x"}
