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
