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


# --- class 1: lesson 08's optimizer refuses what it does not save, and resumes from any step -----

def _bf16_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(32, generator=g).to(torch.bfloat16)),
            nn.Parameter(torch.randn(4, 4, generator=g).to(torch.bfloat16))]


def _steps(opt, ps, n, start=0):
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(500 + s)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        opt.step()
    return [p.detach().clone() for p in ps]


def _optimizer_view(opt):
    return ([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            dict(opt.defaults),
            {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in opt.state.items()},
            {str(d): g.get_state() for d, g in opt._generators.items()})


def _same_view(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[2].keys() == b[2].keys()
    for k in a[2]:
        for n in a[2][k]:
            x, y = a[2][k][n], b[2][k][n]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert a[3].keys() == b[3].keys() and all(torch.equal(a[3][d], b[3][d]) for d in a[3])


def _damaged(change):
    from amp_lessons.measure import optim as O

    ps = _bf16_params()
    opt = O.BF16AdamW(ps, rounding="stochastic", seed=4)
    _steps(opt, ps, 2)
    import copy
    state = copy.deepcopy(opt.state_dict())
    change(state)
    return state


@pytest.mark.parametrize("name,change,message", [
    ("another optimizer's group setting", lambda s: s["param_groups"][0].update(momentum=0.9),
     "param group 0 has 'momentum', settings BF16AdamW does not have"),
    ("torch AdamW's foreach flag", lambda s: s["param_groups"][0].update(foreach=True),
     "param group 0 has 'foreach'"),
    ("a key beside state and param_groups", lambda s: s.update(model={}),
     "holds 'model' besides 'state'"),
    ("a key in BF16AdamW's record", lambda s: s["BF16AdamW"].update(generator=None),
     "the BF16AdamW record holds 'generator'"),
    ("a moment on the meta device", lambda s: s["state"][1].update(
        exp_avg=s["state"][1]["exp_avg"].to("meta")), "exp_avg is on the meta device"),
    ("a negative second moment", lambda s: s["state"][0]["exp_avg_sq"].fill_(-1.0),
     "exp_avg_sq holds negative values"),
])
def test_bf16adamw_refuses_what_it_never_saves_and_changes_nothing(name, change, message):
    from amp_lessons.measure import optim as O

    state = _damaged(change)
    ps = _bf16_params(1)
    opt = O.BF16AdamW(ps, rounding="stochastic", seed=4)
    _steps(opt, ps, 3)
    before = _optimizer_view(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    _same_view(_optimizer_view(opt), before)


def test_bf16adamw_loads_a_state_saved_beside_an_lr_scheduler():
    from amp_lessons.measure import optim as O

    ps = _bf16_params()
    opt = O.BF16AdamW(ps, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _steps(opt, ps, 1)
    sched.step()
    saved = opt.state_dict()
    assert "initial_lr" in saved["param_groups"][0]
    fresh = O.BF16AdamW(_bf16_params(), lr=1e-2)  # no scheduler yet: initial_lr is no stranger
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == pytest.approx(5e-3)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_state_from_fewer_steps_loads_into_an_optimizer_that_ran_more(rounding):
    """Resume after a different number of steps: an optimizer that ran 5 steps, given the state
    of step 2, continues as the run that stopped at step 2, bit for bit."""
    from amp_lessons.measure import optim as O

    ps = _bf16_params()
    straight = O.BF16AdamW(ps, rounding=rounding, seed=7)
    _steps(straight, ps, 2)
    saved = {k: v for k, v in straight.state_dict().items()}
    import copy
    saved = copy.deepcopy(saved)
    weights = [p.detach().clone() for p in ps]
    end = _steps(straight, ps, 4, start=2)
    ps2 = [nn.Parameter(w.clone()) for w in _bf16_params(3)]
    other = O.BF16AdamW(ps2, rounding=rounding, seed=0)
    _steps(other, ps2, 5, start=20)  # further on, with other moments and another generator
    other.load_state_dict(saved)
    with torch.no_grad():
        for p, w in zip(ps2, weights):
            p.copy_(w)
    for a, b in zip(end, _steps(other, ps2, 4, start=2)):
        assert torch.equal(a, b)


# --- classes 3-5: train names its flag for sizes it would not honour, before any training ---------

@pytest.mark.parametrize("argv,message", [
    (["--accumulate", "1000000000"], "--accumulate must be a whole number in [1, 22] (the "
                                     "batches in one epoch of 1,347 examples in batches of 64)"),
    (["--batch-size", "1347", "--accumulate", "2"], "--accumulate must be a whole number in "
                                                   "[1, 1]"),
    (["--batch-size", str(10 ** 18)], "--batch-size must be a whole number in [1, 1347]"),
    (["--lr", "1e308", "--precision", "fp16"], "--lr must be a finite number in [0, 3.40282e+38]"),
    (["--lr", "1e39"], "--lr must be a finite number in [0, 3.40282e+38]"),
])
def test_train_refuses_sizes_it_would_not_honour_by_flag(tmp_path, capsys, argv, message):
    from amp_lessons.cli import main

    out = tmp_path / "r.json"
    status = main(["train", "--epochs", "1", "--no-progress", "--json", str(out)] + argv)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("python -m amp_lessons train: error: " + message)
    assert not out.exists()  # refused before training


def test_the_largest_batch_and_accumulation_the_check_allows_are_taken():
    from amp_lessons.train.recipes import check_train_sizes

    check_train_sizes(3e38, 1347, 1)
    check_train_sizes(0.05, 64, 22)
    check_train_sizes(0.0, 1, 1347)


# --- class 2 (capstone): a state without the parts the grade reads is not passed unread -----------

def _reference_state_but(part, value):
    from amp_lessons.exercises import capstone

    def make_state(model, precision):
        state = dict(zip(("optimizer", "scaler", "scheduler"),
                         capstone.reference_make_state(model, precision)))
        state[part] = value
        return state["optimizer"], state["scaler"], state["scheduler"]
    return make_state


def _step_without_scheduler(model, optimizer, scaler, scheduler, x, y, precision):
    from amp_lessons.exercises import capstone

    class Ignored:
        def step(self):
            pass
    return capstone.reference_train_step(model, optimizer, scaler, Ignored(), x, y, precision)


@pytest.mark.parametrize("part,value,kind", [
    ("scheduler", None, "its scheduler is NoneType, not a learning-rate scheduler"),
    ("scheduler", "cosine", "its scheduler is str, not a learning-rate scheduler"),
])
def test_capstone_training_refuses_a_state_without_a_scheduler(part, value, kind):
    """Without a scheduler the held-schedule checks never ran, and the grade said 'the
    overflowing step skipped with the schedule held'."""
    from amp_lessons.exercises import capstone

    check = capstone.check_training(_reference_state_but(part, value), _step_without_scheduler)
    assert check.status == "wrong" and kind in check.message, check


@pytest.mark.parametrize("part,value,kind", [
    ("optimizer", None, "its optimizer is NoneType, not a torch.optim optimizer"),
    ("scaler", None, "its scaler is NoneType, not a torch.amp.GradScaler"),
])
def test_capstone_make_state_parts_are_checked_before_a_step(part, value, kind):
    from amp_lessons.exercises import capstone

    model = capstone.unet(width=4)
    state, bad = capstone._make(_reference_state_but(part, value), model, "fp16")
    assert state is None and kind in bad


def test_capstone_resume_says_part_2_first_instead_of_a_star_unpacking_error():
    from amp_lessons.exercises import capstone

    check = capstone.check_resume(_reference_state_but("scheduler", None),
                                  _step_without_scheduler, capstone.reference_save,
                                  capstone.reference_load)
    assert check.status == "skipped" and check.message.startswith("part 2 first: "), check
    assert "not a learning-rate scheduler" in check.message


def test_figure_images_refuses_a_read_only_notebook_before_chromium_starts(tmp_path, capsys,
                                                                           monkeypatch):
    import nbformat

    from amp_lessons.cli import main
    from amp_lessons.publish import snapshots

    path = tmp_path / "locked.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), path)
    path.chmod(0o444)
    monkeypatch.setattr(snapshots, "add_images_to",
                        lambda *a, **k: pytest.fail("rendered a notebook it cannot write"))
    try:
        status = main(["figure-images", "--force", str(path)])
    finally:
        path.chmod(0o644)
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"notebook: '{path}' exists and cannot be written (read-only: mode 0444)" in err


@pytest.mark.parametrize("argv", [["claims", "--out", "{d}/claims.md/"],
                                  ["train", "--json", "{d}/results/"],
                                  ["train", "--checkpoint", "{d}/c.pt/"],
                                  ["bench", "--json", "{d}/rows.json/"],
                                  ["readme", "--readme", "{d}/README.md/"]])
def test_a_file_flag_ending_in_a_slash_is_refused_not_written_as_a_file(tmp_path, capsys, argv):
    """``Path`` drops a trailing '/': ``claims --out claims.md/`` wrote a file claims.md."""
    from amp_lessons.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([a.replace("{d}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "its trailing '/' names a folder" in err, err
    assert not list(tmp_path.iterdir())
