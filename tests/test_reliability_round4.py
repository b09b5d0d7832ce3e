"""Reliability, round four (issue 41's six classes, cases no earlier round tried): files the user
names that are not regular files or cannot even be looked up, graders fed the wrong answers a
learner would plausibly write (the mistake a hint warns about first), lesson 08's optimizer
refusing states of another kind, and the CLI's one-line errors."""
import errno
import os
import stat
import sys

import pytest
import torch
from torch import nn

from amp_lessons import files
from exercise_helpers import fresh_attempts  # noqa: F401


# --- class 6: one rule for every file a user names ------------------------------------------------

@pytest.fixture
def fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_a_named_pipe_is_refused_by_the_check_and_by_the_writer_and_stays_a_pipe(fifo):
    with pytest.raises(ValueError, match=r"--out: '.*pipe' is a named pipe \(FIFO\), not a "
                                         r"regular file"):
        files.check_writable(fifo, "--out")
    with pytest.raises(OSError, match="it is a named pipe"):
        files.write_atomic(fifo, "text", "claims page")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # not replaced by a regular file
    assert not files.temp_files_of(fifo)


def test_a_device_is_refused_before_any_write():
    # only the check runs here: the writer given /dev/null as root replaced the device itself
    # by a regular file (a rename), the case this round found
    if not os.path.exists(os.devnull) or not stat.S_ISCHR(os.stat(os.devnull).st_mode):
        pytest.skip("no character device at os.devnull")
    assert files.special_file_reason(os.devnull) == "a character device"
    with pytest.raises(ValueError, match="is a character device, not a regular file"):
        files.check_writable(os.devnull, "json")


@pytest.mark.parametrize("argv", [["claims", "--out", "{p}"], ["train", "--json", "{p}"],
                                  ["train", "--checkpoint", "{p}"], ["bench", "--json", "{p}"]])
def test_every_command_refuses_a_named_pipe_in_one_line(fifo, capsys, argv):
    from amp_lessons.cli import main

    status = main([a.replace("{p}", str(fifo)) for a in argv])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert err.strip().endswith("not a regular file; name a regular file (the writer replaces "
                                "a file whole, by a rename)"), err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("flag", ["claims --out", "train --json", "bench --json"])
def test_a_name_too_long_for_the_file_system_names_the_flag_and_the_file(tmp_path, capsys, flag):
    from amp_lessons.cli import main

    path = tmp_path / ("n" * 300 + ".md")
    command, option = flag.split()
    status = main([command, option, str(path)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "Traceback" not in err, err
    assert f"{option.lstrip('-') if command != 'claims' else option}: '{path}' cannot be " \
           f"written: File name too long" in err, err


# --- class 2: graders never accept the mistake their hint warns about, nor trust what comes back -

def test_ex01_refuses_an_update_left_in_fp32_the_mistake_its_hint_warns_about():
    from amp_lessons.exercises import ex01

    check = ex01.check_master_weight(ex01._update_left_in_fp32)
    assert check.status == "wrong", check
    assert "added as an fp32 number, never rounded to fp16" in check.message
    assert "dtype=torch.float16" in check.hint
    # and the reveal is not shown on a first attempt: the message names only the learner's value
    assert str(ex01.master_truth(*ex01.MASTER_INPUTS[-1])) not in check.text()


def test_ex01_names_the_fp32_update_on_the_given_inputs_too():
    from amp_lessons.exercises import ex01

    check = ex01.check_master_weight(ex01._update_left_in_fp32, 0.1, 2.9e-3, 300)
    assert check.status == "wrong" and "never rounded to fp16" in check.message, check


def test_ex01_still_passes_a_float64_master_and_the_reference():
    from amp_lessons.exercises import ex01

    def float64_master(start, update, steps):
        master = start
        for _ in range(steps):
            master += float(torch.tensor(update, dtype=torch.float16))
        return float(torch.tensor(master).half())

    assert ex01.check_master_weight(ex01.reference_master_weight)
    assert ex01.check_master_weight(float64_master)


def _big_gpt_plan():
    from amp_lessons.measure.float8 import conversion_plan
    from amp_lessons.models import TinyTransformer

    with torch.device("meta"):
        model = TinyTransformer(vocab_size=1000, d_model=2048, n_layers=2, n_heads=8, seq_len=64)
    return model, conversion_plan(model, 2048)


@pytest.mark.parametrize("answer,said", [
    (lambda m, fqn: torch.tensor([True, False]), "got a bool tensor of shape (2,)"),
    (lambda m, fqn: "no", "got str 'no'"),  # true to Python: it converted every layer
    (lambda m, fqn: 1, "got int 1"),
    (lambda m, fqn: torch.tensor(1.0), "got a tensor of torch.float32"),
])
def test_ex07_filter_answers_that_are_not_bools_are_named_not_read_as_truth(answer, said):
    from amp_lessons.exercises import ex07

    check = ex07.check_module_filter(answer, *_big_gpt_plan())
    assert check.status == "wrong", check
    assert "must be True or False" in check.message and said in check.message, check


def test_ex07_filter_takes_numpy_and_one_value_tensor_bools():
    import numpy as np

    from amp_lessons.exercises import ex07

    model, plan = _big_gpt_plan()
    rows = {r["layer"]: r["precision"] == "float8" for r in plan}
    for wrap in (np.bool_, torch.tensor):  # read as bools: graded on big_gpt (the held-out
        check = ex07.check_module_filter(  # GPTs then show that it copies the table)
            lambda m, fqn: wrap(rows.get(fqn, False)), model, plan)
        assert "must be True or False" not in check.message, check
        assert "right on big_gpt" in check.message, check


@pytest.mark.parametrize("answer,said", [
    (lambda w, c, u: w, "got a torch.bfloat16 tensor of shape (256,)"),
    (lambda w, c, u: (w, c, u), "got a tuple of 3"),
    (lambda w, c, u: (w.tolist(), c), "got a tuple of 2: list, a torch.bfloat16 tensor"),
    (lambda w, c, u: {"weight": w, "compensation": c}, "got dict"),
])
def test_ex08_kahan_answers_of_the_wrong_shape_are_named_not_unpacked(answer, said):
    from amp_lessons.exercises import ex08

    check = ex08.check_kahan_update(answer)
    assert check.status == "wrong", check
    assert check.message.startswith("expected (new_weight, new_compensation), two tensors")
    assert said in check.message, check
    assert "unpack" not in check.message


@pytest.mark.parametrize("grade", ["ex08 stochastic", "ex07 per tensor", "ex01 master"])
def test_an_answer_that_calls_exit_is_a_wrong_grade_not_a_dead_cell(grade):
    from amp_lessons.exercises import ex01, ex07, ex08

    def quits(*args):
        sys.exit(3)

    check = {"ex08 stochastic": ex08.check_stochastic_rounding,
             "ex07 per tensor": ex07.check_per_tensor_scale,
             "ex01 master": ex01.check_master_weight}[grade](quits)
    assert check.status == "wrong" and "sys.exit() (SystemExit: 3)" in check.message, check
    assert check.attempt == 0  # not counted against the learner
