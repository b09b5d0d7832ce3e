"""How the graders talk to the learner, in every lesson: a ``Check`` renders as text and HTML
with one hint level at a time, hints run from a nudge that never gives the answer away to the
reference, a wrong answer never shows the expected value before the third attempt (or the last
hint), and odd answers (NaN, strings, other numeric types, keys in another case, no function at
all) get a message, never a traceback."""
import html
import linecache
import re
from pathlib import Path

import nbformat
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_lessons as al
from amp_lessons.exercises import MODULES
from amp_lessons.exercises import check as common
from amp_lessons.exercises import ex01, ex02, ex03, ex04, ex05, ex06, ex07, ex08, ex09
from amp_lessons.exercises.check import Check, Hints, hint_book, is_blank, same_code
from amp_lessons.train.trainer import ScalerSettings
from exercise_helpers import INF, NAN, assert_unanswered, assert_wrong, fresh_attempts, status  # noqa: F401


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
                               "scheduler.step()", "the top of the lesson"],
    ("ex03", "rule"): lambda: ["* backoff_factor", "*= backoff_factor", "by backoff_factor",
                               "* growth_factor", "== growth_interval", "restarts at 0"],
    ("ex03", "floor"): lambda: [str(_first_below_one()), "2**(a - i)", "**i", "step i uses",
                                "16 + 1"],
    ("ex03", "causes"): lambda: ["in a row", "never recover", "every step skipped", "burst"],
    ("ex04", "state"): lambda: ["4 bytes", "4 * n", "8 * n", "float32", "fp32"],
    ("ex04", "copies"): lambda: ["2 bytes", "2 * sum", "p.dim() > 1", "once per forward"],
    ("ex04", "layout"): lambda: ["torch.channels_last", "contiguous", "memory_format=",
                                 "moves it to a device"],
    ("ex05", "checkpoint"): lambda: ["use_reentrant", "checkpoint(block",
                                     "torch.utils.checkpoint.checkpoint"],
    ("ex05", "accumulate"): lambda: ["/ micro_batches", "divide", "chunk", "micro_batches times"],
    ("ex05", "resume"): lambda: ["scaler.state_dict", "optimizer.state_dict", "GradScaler",
                                 "scaler", "which objects"],
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
    ("ex09", "overflow"): lambda: ["register_forward_hook", "named_modules", "65,504",
                                  "fp16_max()", "next(n for"],
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


def test_tolerances_reject_nan_and_inf():
    within, close = common.within, common.close
    assert not within(NAN, 1.0, 0.5) and not within(INF, 1.0, 0.5) and within(1.2, 1.0, 0.5)
    assert not close(NAN, 1.0, abs_tol=1.0) and not close(None, 1.0, 1.0) and close(1.5, 1.0, 0, 1)


def test_numbers_in_any_numeric_type_count_and_strings_do_not():
    number, whole_number = common.number, common.whole_number
    for v in (3, 3.0, np.int64(3), np.float32(3), torch.tensor(3), torch.tensor(3.0,
                                                                                dtype=torch.bfloat16)):
        assert number(v) == 3.0 and whole_number(v) == 3, v
    for v in ("3", None, True, np.bool_(True), [3], torch.tensor([1.0, 2.0]), 3.5, NAN, INF):
        assert whole_number(v) is None, v
    assert number("3") is None and number(torch.tensor(True)) is None


def test_keys_match_whatever_their_case_and_spacing():
    keyed = common.keyed
    assert keyed({" FP16_safe": 1, "Scale Exponent": 2}, ("fp16 safe", "scale exponent")) == {
        "fp16 safe": 1, "scale exponent": 2}
    assert keyed({"a": 1, "A": 2}, ("A",)) is None and keyed([1], ("A",)) is None


MEASURED_STATE = {"params": 4_000_000, "grads": 4_000_000, "optimizer state": 8_000_000}


def test_nan_or_inf_predictions_are_wrong_with_a_message(monkeypatch):
    for b in (NAN, INF, -INF):
        check = ex01.check_fp16_predictions(1.0, b)
        assert status(check) == "wrong" and "finite" in check.message, check
    monkeypatch.setattr(ex04, "measure_state_bytes", lambda model, device=None: MEASURED_STATE)
    monkeypatch.setattr(ex04, "measure_weight_copies", lambda model, device=None: 2_000_000)
    check = ex04.check_state_bytes({"params": NAN, "grads": 4e6, "optimizer state": 8e6})
    assert status(check) == "wrong" and "finite" in check.message
    assert "finite" in ex04.check_weight_copies(NAN).message
    measured = {"ddp": 16.0, "zero": 12.0, "fsdp2": 8.0}
    assert status(ex06.check_state_per_rank({**measured, "ddp": NAN}, measured, 2)) == "wrong"


def test_huge_scale_exponents_get_a_message():
    grads = [torch.full((10,), 1e-6)]
    for k in (2000, -2000):
        assert ex01.check_scale_exponent(k, grads).status == "wrong"


def test_whole_numbers_in_any_type_pass():
    grads = [torch.full((10,), 1e-6)]
    k = ex01.smallest_safe_exponent(grads)
    for v in (np.int64(k), float(k), torch.tensor(k)):
        assert ex01.check_scale_exponent(v, grads), v
    for v in (17, 17.0, np.int64(17), torch.tensor(17)):
        assert ex03.check_steps_below_one(v, ScalerSettings()), v
    assert ex03.check_steps_below_one(17.5, ScalerSettings()).status == "wrong"
    rep = _report([{"layer": "fc1", "act_absmax": 3.0}, {"layer": "fc2", "act_absmax": 9e4}])
    for v in (14.0, np.int64(14), torch.tensor(14)):
        assert ex09.check_report_answers({"fp16 safe": False, "scale exponent": v,
                                          "largest activation": "fc2"}, rep), v


def test_string_answers_ignore_case_and_spaces(monkeypatch):
    rep = _report([{"layer": "fc1", "act_absmax": 3.0}, {"layer": "fc2", "act_absmax": 9e4}])
    for name in (" fc2", "FC2 "):
        assert ex09.check_report_answers({"FP16 safe": False, " scale_exponent": 14,
                                          "largest activation": name}, rep), name
    traces = {"A": ([2.0 ** (16 - i) for i in range(5)] + [2.0 ** 11] * 5,
                    [True] * 5 + [False] * 5),
              "B": ([2.0 ** (16 - i) for i in range(10)], [True] * 10),
              "C": ([65536.0] * 10, [False] * 10)}
    assert ex03.check_trace_causes({"a": " Init_Scale too high", "B": "inf or NaN every step",
                                    "C": "Healthy"}, traces)
    assert ex02.check_autocast_dtypes({"FC1": "16 bit", "norm": "16-bit", "fc2": "half",
                                       "loss": "single"}, "cpu")
    assert ex02.check_autocast_dtypes({"fc1": "16-bit", "norm": "16-bit", "fc2": "16-bit",
                                       "loss": "32 bit"}, "cpu")
    monkeypatch.setattr(ex04, "measure_state_bytes", lambda model, device=None: MEASURED_STATE)
    assert ex04.check_state_bytes({"Params": 4e6, "grads ": 4e6, "OPTIMIZER_state": 8e6})
    measured = {"ddp": 16.0, "zero": 12.0, "fsdp2": 8.0}
    assert ex06.check_state_per_rank({"DDP": 16.0, "ZeRO": 12.0, "FSDP2": 8.0}, measured, 2)


def _report(layers, **kw):
    """A doctor report's fields the graders read, with ``layers``."""
    base = dict(model="toy", layers=layers, scale_exponent=14,
                overflow=[{"layer": "fc2", "kind": "Linear", "value": 9e4}],
                fp16_nonfinite=["fc2"], advice={"fp16_safe": False})
    return SimpleNamespace(**{**base, **kw})


def test_memory_answers_with_keys_in_another_case():
    memory = [{"workload": "w", "recipe": r, "bytes per parameter": b, "weights MiB": 1.0,
               "gradients MiB": 1.0, "optimizer state MiB": 2.0}
              for r, b in (("fp32 master", 16.0), ("bf16", 8.0), ("bf16 + Kahan", 10.0))]
    right = ex08.reference_state_gib(memory)
    assert ex08.check_state_gib({k.upper(): v for k, v in right.items()}, memory)
    check = ex08.check_state_gib({"fp32": 1.0, "bf16": 2.0, "kahan": 3.0}, memory)
    assert check.status == "wrong" and "got None" not in check.message
    assert "no answer for 'fp32 master'" in check.message


def test_non_functions_are_not_answered_or_wrong_never_a_traceback():
    for check in (ex03.check_update_rule(None, [1.0, 1.0], [False, False], ScalerSettings()),
                  ex05.check_accumulation(None, device="cpu"),
                  ex05.check_checkpointing(None, "cpu"),
                  ex07.check_per_tensor_scale(None), ex07.check_per_row_scale(...),
                  ex08.check_stochastic_rounding(None), ex08.check_kahan_update(None)):
        assert check.status == "not answered yet", check
    assert ex07.check_per_row_scale(42).status == "wrong"
    assert ex05.check_resume(None, ex05.reference_load, "cpu").status == "not answered yet"
