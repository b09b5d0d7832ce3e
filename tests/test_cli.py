"""`python -m amp_lessons ...`: train end to end in the quick sizes, and every command's user
errors: one line, a non-zero exit, never a traceback, paths checked before training."""
import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from amp_lessons import cli
from amp_lessons.cli import main

FAST = ["--model", "cnn", "--width", "4", "--batch-size", "256", "--no-progress"]
MLP = ["--model", "mlp", "--width", "4", "--batch-size", "256", "--no-progress"]  # 10x faster


def test_train_end_to_end_with_json_checkpoint_and_resume(tmp_path, capsys):
    out, ckpt = tmp_path / "run.json", tmp_path / "c.pt"
    assert main(["train", "--precision", "amp", "--epochs", "1", "--checkpoint", str(ckpt),
                 "--json", str(out), "--clip", "1.0"] + FAST) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "epoch 1/1:" in text and "test accuracy" in text and "peak memory" in text
    assert "summary: cnn at fp16" in text and ", 1 epoch\n" in text
    if not torch.cuda.is_available():  # fp16 on a CPU: one line says why it is slow
        assert captured.err.count("\n") == 1 and captured.err.startswith("hint: fp16 on a CPU")
    doc = json.loads(out.read_text())
    assert doc["summary"]["precision"] == "fp16" and len(doc["epochs"]) == 1
    assert doc["args"]["clip"] == 1.0 and len(doc["history"]["loss"]) == 6
    assert main(["train", "--precision", "amp", "--epochs", "2", "--resume", str(ckpt),
                 "--nonfinite", "raise"] + FAST) == 0
    text = capsys.readouterr().out
    assert "epoch 2/2:" in text and "epoch 1/2" not in text and ", 2 epochs" in text


@pytest.mark.parametrize("argv,message", [
    (["--precision", "fp8"], "invalid choice"),
    (["--model", "resnet"], "invalid choice"),
    (["--epochs", "0"], "expected a whole number >= 1"),
    (["--lr", "fast"], "expected a number"),
    (["--nonfinite", "warn"], "invalid choice"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train"] + argv + FAST)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize("argv,message", [
    (["--growth-factor", "1.0"], r"error: --growth-factor must be a finite number in \(1, "),
    (["--backoff-factor", "2"], r"error: --backoff-factor must be in the open interval \(0, 1\)"),
    (["--init-scale", "-1"], "error: --init-scale must be a finite number > 0"),
    (["--growth-interval", "0"], "error: --growth-interval must be a whole number >= 1"),
    (["--clip", "0"], "error: --clip must be None or a finite number > 0"),
    (["--lr", "0"], "error: --lr must be a finite number > 0"),
    (["--seed", "-2"], "error: --seed must be a whole number >= 0"),
    (["--resume", "missing.pt"], "error: --resume must name an existing checkpoint file"),
])
def test_bad_settings_are_one_line_errors(argv, message, capsys):
    """Each names the flag (an outside review: they named the Python parameters, clip_norm
    for --clip)."""
    assert main(["train"] + argv + FAST) == 2
    err = capsys.readouterr().err
    assert_one_line_error(err, "train", message)


def assert_one_line_error(err, command, message):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"python -m amp_lessons {command}: error: ")
    assert re.search(message, lines[0]), err


def test_module_entry_point_exit_status():
    proc = subprocess.run([sys.executable, "-m", "amp_lessons", "train", "--accumulate", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr



# --- files and paths: checked before training, one line each -------------------------------------

@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "good.pt"
    assert main(["train", "--epochs", "1", "--checkpoint", str(path)] + FAST) == 0
    return path


@pytest.mark.parametrize("damage,message", [
    ("truncated", "truncated or damaged archive"),
    ("random", "not a PyTorch archive"),
    ("empty", "the file is empty"),
    ("flipped", "corrupted"),
    ("mismatched", r"model: .* in the checkpoint but"),
])
def test_resume_with_a_bad_file_is_one_line(tmp_path, good_checkpoint, damage, message, capsys):
    capsys.readouterr()
    data = good_checkpoint.read_bytes()
    path = tmp_path / "bad.pt"
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 3])
    elif damage == "random":
        path.write_bytes(os.urandom(5000))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "flipped":
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x10
        path.write_bytes(bytes(bad))
    else:
        path.write_bytes(data)
    argv = FAST[:]
    if damage == "mismatched":
        argv[argv.index("--width") + 1] = "6"  # another model shape
    assert main(["train", "--epochs", "2", "--resume", str(path)] + argv) == 2
    out = capsys.readouterr()
    assert_one_line_error(out.err, "train", message)
    assert "epoch" not in out.out  # nothing trained


@pytest.mark.parametrize("flag", ["--checkpoint", "--json"])
def test_output_paths_are_checked_before_training(tmp_path, flag, capsys):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    assert main(["train", "--epochs", "1", flag, str(folder)] + FAST) == 2
    out = capsys.readouterr()
    assert_one_line_error(out.err, "train", "must name a file, not a folder")
    assert "epoch 1" not in out.out
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["train", "--epochs", "1", flag, str(blocker / "sub" / "x.out")] + FAST) == 2
    out = capsys.readouterr()
    assert_one_line_error(out.err, "train", "is not a folder")
    assert "epoch 1" not in out.out


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_unwritable_json_folder_is_found_before_training(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["train", "--epochs", "1", "--json", str(locked / "r.json")] + FAST) == 2
    finally:
        locked.chmod(0o700)
    assert_one_line_error(capsys.readouterr().err, "train", "is not writable")


def test_check_writable_refuses_unwritable_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="json: the folder .* is not writable"):
        cli.check_writable(tmp_path / "r.json", "json")
    monkeypatch.undo()
    cli.check_writable(tmp_path / "new" / "deeper" / "r.json", "json")  # folders can be made


def test_readme_check_with_a_missing_file(tmp_path, capsys):
    assert main(["readme", "--check", "--readme", str(tmp_path / "nope.md")]) == 2
    assert_one_line_error(capsys.readouterr().err, "readme", "no README at")
    assert main(["readme", "--readme", str(tmp_path / "nope.md")]) == 2
    assert_one_line_error(capsys.readouterr().err, "readme", "no README at")


def test_run_notebooks_on_a_file_that_is_not_a_notebook(tmp_path, capsys):
    path = tmp_path / "01_text.ipynb"
    path.write_text("just text")
    assert main(["run-notebooks", "--no-progress", str(path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "run-notebooks", "not a readable Jupyter")
    assert path.read_text() == "just text"


def _notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("source,message", [
    ("import time; time.sleep(30)", r"cell 0 .* failed: timed out after 2 s"),
    ("import os; os.kill(os.getpid(), 9)", r"cell 0 .* failed: the kernel died"),
    ("1 / 0", r"cell 0 .* failed: ZeroDivisionError"),
])
def test_run_notebooks_cell_failures_are_one_line_and_keep_the_notebook(tmp_path, source,
                                                                        message, capsys):
    path = _notebook(tmp_path / "01_x.ipynb", source)
    before = path.read_bytes()
    for out in ([], ["--out", str(tmp_path)]):  # --out the notebook's own folder: still intact
        assert main(["run-notebooks", "--no-progress", "--profile", "quick", "--timeout", "2",
                     str(path)] + out) == 1
        assert_one_line_error(capsys.readouterr().err, "run-notebooks", message)
        assert path.read_bytes() == before


def test_bench_json_path_is_checked_before_measuring(tmp_path, capsys):
    assert main(["bench", "--profile", "quick", "--json", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert_one_line_error(out.err, "bench", "json must name a file, not a folder")
    assert out.out == ""  # nothing was measured


def test_bench_on_a_cpu_says_its_rows_are_no_speed_comparison(capsys):
    # issue 24: fp16 at a tenth of fp32's speed on a CPU, printed with no word on why
    assert main(["bench", "--profile", "quick", "--steps", "1", "--image-size", "16",
                 "--batch-size", "2", "--precision", "fp32", "amp"]) == 0
    out = capsys.readouterr().out
    assert "fp16 + GradScaler" in out and "note: no speed comparison: timed on cpu" in out
    assert "hint: fp16 on a CPU runs slower than fp32" in out


def test_claims_command_checks_docs_claims_md(capsys):
    assert main(["claims", "--check"]) == 0
    assert "current" in capsys.readouterr().out


def test_claims_command_prints_and_writes_only_where_asked(tmp_path, capsys, monkeypatch):
    from amp_lessons.publish.claims import claims_markdown

    monkeypatch.chdir(tmp_path)
    assert main(["claims"]) == 0
    assert capsys.readouterr().out == claims_markdown()
    assert list(tmp_path.iterdir()) == []  # printed, nothing written
    out = tmp_path / "sub" / "claims.md"
    assert main(["claims", "--out", str(out)]) == 0
    assert out.read_text() == claims_markdown() and f"wrote {out}" in capsys.readouterr().out
    assert main(["claims", "--check", "--out", str(out)]) == 0
    out.write_text("old")
    assert main(["claims", "--check", "--out", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["claims", "--out", str(tmp_path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "claims", "out must name a file, not a folder")


def test_cpu_half_hint_only_for_fp16_on_a_cpu():
    assert cli.cpu_half_hint("fp16", "cpu").startswith("hint: fp16 on a CPU runs slower")
    assert cli.cpu_half_hint("amp", "cpu") == cli.cpu_half_hint("fp16", "cpu")
    assert "\n" not in cli.cpu_half_hint("fp16", "cpu")
    assert cli.cpu_half_hint("fp32", "cpu") == "" and cli.cpu_half_hint("bf16", "cpu") == ""
    assert cli.cpu_half_hint("fp16", "cuda") == ""


def test_figure_images_refuses_a_non_notebook_in_one_line(tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a notebook")
    assert main(["figure-images", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not a notebook file" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_check_notebooks_names_what_is_wrong(tmp_path):
    from amp_lessons.cli import check_notebooks
    with pytest.raises(ValueError, match="no such notebook"):
        check_notebooks([tmp_path / "missing.ipynb"])
    bad = tmp_path / "bad.ipynb"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not a readable Jupyter notebook"):
        check_notebooks([bad])
    import nbformat
    good = tmp_path / "good.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), good)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="out must be a folder"):
        check_notebooks([good], a_file)
    check_notebooks([good], tmp_path)  # fine


# --- inputs checked before the work, every error naming its file (issue 23) ----------------------

def _marker_notebook(tmp_path, name="01_x.ipynb"):
    """A notebook whose one cell leaves a file behind when it runs."""
    ran = tmp_path / "ran.txt"
    return _notebook(tmp_path / name, f"open({str(ran)!r}, 'w').close()"), ran


def test_run_notebooks_refuses_an_unwritable_output_before_running(tmp_path, capsys,
                                                                  monkeypatch):
    path, ran = _marker_notebook(tmp_path)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert main(["run-notebooks", "--no-progress", "--out", str(a_file / "sub"), str(path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "run-notebooks",
                          r"out: '.*file.txt' is not a folder, so .*01_x.ipynb' cannot be written")
    # in place, in a folder this user cannot write (os.access stands in: the tests may run as root)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) in (tmp_path, path)
                        else real_access(p, mode))
    assert main(["run-notebooks", "--no-progress", str(path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "run-notebooks",
                          r"01_x.ipynb' exists and cannot be written")
    assert not ran.exists()  # no cell ran


def test_an_invalid_notebook_is_one_line_naming_it_in_every_command(tmp_path, capsys):
    """"source": 5 in a code cell was an AttributeError traceback; figure-images on a notebook
    that is not JSON said "need Chromium"."""
    bad = tmp_path / "01_bad.ipynb"
    doc = json.loads(nbformat.writes(new_notebook(cells=[new_code_cell("1")])))
    doc["cells"][0]["source"] = 5
    bad.write_text(json.dumps(doc))
    text = tmp_path / "02_text.ipynb"
    text.write_text("not json")
    for path, message in ((bad, "01_bad.ipynb: not a valid Jupyter notebook"),
                          (text, "02_text.ipynb: not a readable Jupyter notebook")):
        for argv in (["run-notebooks", "--no-progress", str(path)],
                     ["rehearse", "--out", str(tmp_path / "r"), str(path)],
                     ["figure-images", str(path)]):
            assert main(argv) == 2
            assert_one_line_error(capsys.readouterr().err, argv[0], message)


@pytest.mark.parametrize("content", [b"", b'{"card": "t4", "lessons": [{"noteb', b"\xff\xfe"])
def test_rehearse_update_with_a_damaged_record_names_it(tmp_path, capsys, content):
    path, ran = _marker_notebook(tmp_path)
    record = tmp_path / "rehearsal_t4.json"
    record.write_bytes(content)
    assert main(["rehearse", "--out", str(tmp_path / "r"), "--update", str(record),
                 str(path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "rehearse",
                          r"update '.*rehearsal_t4.json' is (empty|not valid JSON|not UTF-8)")
    assert not ran.exists()


def _readme(tmp_path):
    from amp_lessons.publish import rehearsal
    from amp_lessons.publish import report

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{report.START}\nold\n{report.END}\n{rehearsal.README_START}\nold\n"
                      f"{rehearsal.README_END}\nThe hand-written tail.\n" + "t" * 20_000)
    return readme


def test_readme_errors_name_the_file_and_a_full_disk_keeps_it(tmp_path, capsys, monkeypatch):
    """readme on a full disk cut the README at 16 KiB, losing its hand-written tail."""
    from amp_lessons import files

    latin = tmp_path / "latin.md"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    assert main(["readme", "--readme", str(latin)]) == 2
    assert_one_line_error(capsys.readouterr().err, "readme", r"README '.*latin.md' is not UTF-8")
    readme = _readme(tmp_path)
    before = readme.read_bytes()

    def full(self, data):
        self.error = OSError(errno.ENOSPC, "No space left on device")
        raise self.error

    monkeypatch.setattr(files._KeepingWriter, "write", full)
    assert main(["readme", "--readme", str(readme)]) == 1
    assert_one_line_error(capsys.readouterr().err, "readme",
                          r"disk full: could not write README .*README.md")
    assert readme.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["README.md", "latin.md"]


@pytest.mark.slow
def test_a_cell_timeout_prints_no_kernel_traceback(tmp_path, capfd):
    """The kernel, stopped mid-cell, printed a raw zmq traceback before the CLI's line."""
    path = _notebook(tmp_path / "01_x.ipynb", "import time; time.sleep(30)")
    assert main(["run-notebooks", "--no-progress", "--profile", "quick", "--timeout", "2",
                 str(path)]) == 1
    out = capfd.readouterr()
    assert_one_line_error(out.err, "run-notebooks", "timed out after 2 s")
    assert "Traceback" not in out.out + out.err and "zmq" not in out.out + out.err


def test_readme_into_another_readme_leaves_the_checkouts_notebooks_alone(tmp_path, capsys,
                                                                          monkeypatch):
    """``readme --readme COPY`` writes the copy only: it rewrote the checkout's notebooks
    (their cited prose) too (an outside review of the CLI)."""
    from pathlib import Path as P

    from amp_lessons.publish import report
    calls = []

    def cite(notebooks, write=True, results=None):
        calls.append(write)
        return [P("04_x.ipynb")] if not write else []
    monkeypatch.setattr(report, "cite_notebooks", cite)
    copy = tmp_path / "README.md"
    copy.write_text((Path(__file__).resolve().parent.parent / "README.md").read_text())
    assert main(["readme", "--readme", str(copy)]) == 0
    assert calls == [False]  # looked at, never written
    assert "not written (--readme names another README): the cited prose of 04_x.ipynb" in \
        capsys.readouterr().out
    assert main(["readme", "--check", "--readme", str(copy)]) == 0  # the copy itself is current


def test_explain_lists_the_claims_keys_and_refuses_unknown_ones(capsys):
    """``explain``'s key list named the prefix ``claims.`` (not a key) and accepted any
    ``claims.<anything>`` with exit 0 (an outside review of the CLI)."""
    assert main(["explain"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    published = [k for k in keys if k.startswith("claims.l")]
    assert "claims." not in keys and published  # those the committed notebooks publish
    for bad in ("claims.", "claims.l99"):
        assert main(["explain", bad]) == 2
        err = capsys.readouterr().err
        assert "did you mean claims.l0" in err and f"keyed '{bad}'" in err


def test_a_growth_interval_past_64_bits_is_named(capsys):
    argv = ["train", "--no-progress", "--precision", "amp", "--growth-interval",
            str(2 ** 70), "--epochs", "1"]
    assert main(argv) == 2
    assert "--growth-interval must be a whole number >= 1 and below 2**63" in capsys.readouterr().err


def test_notebook_paths_name_folders_missing_files_and_colliding_outputs(tmp_path, capsys):
    """A folder read as "no such notebook", a missing x.ipynb as "not a notebook file", and two
    notebooks of one name into one --out overwrote each other without a word (an outside
    review of the CLI); nothing runs when the paths are wrong."""
    path, ran = _marker_notebook(tmp_path)
    (tmp_path / "x").mkdir()
    twin = tmp_path / "x" / path.name
    twin.write_text(path.read_text())
    cases = [
        (["run-notebooks", "--no-progress", "--out", str(tmp_path / "o"), str(path), str(twin)],
         "would both be written to"),
        (["run-notebooks", "--no-progress", str(path), str(path)], "would both be written to"),
        (["run-notebooks", "--no-progress", str(tmp_path / "x")], "a folder, not a notebook"),
        (["rehearse", "--out", str(tmp_path / "r"), str(tmp_path / "x")], "a folder, not a notebook"),
        (["figure-images", str(tmp_path / "x")], "a folder, not a notebook"),
        (["figure-images", str(tmp_path / "gone.ipynb")], "no such notebook: .*gone.ipynb"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert_one_line_error(capsys.readouterr().err, argv[0], message)
    assert not ran.exists() and not (tmp_path / "o").exists()


def test_as_flag_renames_only_a_leading_setting_the_command_has():
    from amp_lessons.cli import as_flag

    dests = {"lr", "init_scale", "resume"}
    assert as_flag("lr must be > 0", dests) == "--lr must be > 0"
    assert as_flag("init_scale must be x", dests) == "--init-scale must be x"
    assert as_flag("resume: 'ck.pt' was trained", dests) == "--resume: 'ck.pt' was trained"
    assert as_flag("clip_norm must be y", dests, {"clip_norm": "--clip"}) == "--clip must be y"
    assert as_flag("width must be z", dests) == "width must be z"  # not one of its arguments
    assert as_flag("the lr must be", dests) == "the lr must be"


def test_doctor_help_states_its_defaults_and_claims_check_names_a_missing_file(tmp_path, capsys):
    """From the CLI review: doctor --help gave no defaults, a bad --precisions printed a Python
    tuple, and claims --check called a missing file "out of date"."""
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for said in ("default: all four", "(default 5)", "(default 15)", "default: lesson 07's "
                 "committed run", "default: a float batch"):
        assert said in text, said
    from amp_lessons.doctor.inputs import as_sequence
    with pytest.raises(ValueError, match=r"got 'fp64'$"):
        as_sequence(("fp64",), "precisions", ("fp32", "bf16"))
    with pytest.raises(ValueError, match=r"got none$"):
        as_sequence((), "precisions", ("fp32", "bf16"))
    missing = tmp_path / "claims.md"
    assert main(["claims", "--check", "--out", str(missing)]) == 1
    assert "no such file" in capsys.readouterr().err and not missing.exists()


def test_figure_images_says_written_when_forced(tmp_path, capsys, monkeypatch):
    """--force draws every image again: it said "5 images added" for images that were there."""
    from amp_lessons.publish import snapshots

    path, _ = _marker_notebook(tmp_path)
    monkeypatch.setattr(snapshots, "add_images_to", lambda paths, force=False: {str(path): 5})
    assert main(["figure-images", str(path)]) == 0
    assert capsys.readouterr().out.strip().endswith("5 images added")
    assert main(["figure-images", "--force", str(path)]) == 0
    assert capsys.readouterr().out.strip().endswith("5 images written")


# --- issue 41: one rule for read-only files, "could not write" once, Ctrl-C, no traceback -------

def _locked(path, text="the earlier file"):
    path.write_text(text)
    path.chmod(0o444)
    return path


def test_readme_refuses_a_read_only_readme_as_claims_does(tmp_path, capsys):
    """readme --readme README.md at mode 444 said 'README.md: updated', replacing the file by a
    rename, while claims --out refused the same file."""
    readme = _readme(tmp_path)
    before = readme.read_bytes()
    readme.chmod(0o444)
    try:
        for argv in (["readme", "--readme", str(readme)], ["claims", "--out", str(readme)]):
            assert main(argv) == 2
            assert_one_line_error(capsys.readouterr().err, argv[0],
                                  r"README.md' exists and cannot be written \(read-only: mode "
                                  r"0444\)")
        assert main(["readme", "--check", "--readme", str(readme)]) in (0, 1)  # reading is fine
        capsys.readouterr()
        assert readme.stat().st_mode & 0o777 == 0o444
    finally:
        readme.chmod(0o644)
    assert readme.read_bytes() == before and os.listdir(tmp_path) == ["README.md"]


@pytest.mark.parametrize("argv", [["train", "--epochs", "1", "--json", "{p}"] + FAST,
                                  ["train", "--epochs", "1", "--checkpoint", "{p}"] + FAST,
                                  ["bench", "--steps", "1", "--json", "{p}"],
                                  ["claims", "--out", "{p}"]])
def test_every_command_refuses_a_read_only_output_before_its_work(tmp_path, capsys, argv):
    path = _locked(tmp_path / "out.file")
    link = tmp_path / "link.file"
    link.symlink_to(path.name)
    try:
        for target in (path, link):
            assert main([a.replace("{p}", str(target)) for a in argv]) == 2
            out = capsys.readouterr()
            assert_one_line_error(out.err, argv[0], r"out.file' exists and cannot be written")
            assert "epoch 1" not in out.out and "img/s" not in out.out
    finally:
        path.chmod(0o644)
    assert path.read_text() == "the earlier file"


@pytest.fixture
def full_disk(monkeypatch):
    from amp_lessons import files

    def full(self, data):
        self.error = OSError(errno.ENOSPC, "No space left on device")
        raise self.error

    monkeypatch.setattr(files._KeepingWriter, "write", full)


def test_a_full_disk_says_could_not_write_once_in_every_command(tmp_path, capsys, full_disk,
                                                                monkeypatch):
    from amp_lessons.publish import rehearsal

    notebook = tmp_path / "nb" / "01_x.ipynb"
    notebook.parent.mkdir()
    _notebook(notebook, "1")
    record = rehearsal.read_record(Path(cli.__file__).parents[1] / "docs" / "rehearsal_t4.json")
    monkeypatch.setattr(rehearsal, "rehearse", lambda *a, **k: record)  # the run, not its record
    monkeypatch.setattr(cli, "update_problem", lambda profile: "")  # as on a GPU
    cases = [(["rehearse", "--out", str(tmp_path / "nb"), "--update", str(tmp_path / "t4.json"),
               str(notebook)], "t4.json"),
             (["claims", "--out", str(tmp_path / "claims.md")], "claims.md"),
             (["train", "--epochs", "1", "--json", str(tmp_path / "r.json")] + MLP, "r.json"),
             (["train", "--epochs", "1", "--checkpoint", str(tmp_path / "c.pt")] + MLP, "c.pt")]
    for argv, name in cases:
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert_one_line_error(err, argv[0], f"disk full: could not write .*{name}")
        assert err.count("could not write") == 1 and err.count(name) == 1, err
    assert os.listdir(tmp_path) == ["nb"] and os.listdir(tmp_path / "nb") == ["01_x.ipynb"]


def test_claims_check_on_a_file_it_cannot_read_is_one_line(tmp_path, capsys):
    latin = tmp_path / "claims.md"
    latin.write_bytes(b"\xff\xfe not utf-8")
    assert main(["claims", "--check", "--out", str(latin)]) == 2
    assert_one_line_error(capsys.readouterr().err, "claims", r"claims.md' is not UTF-8")
    assert main(["claims", "--check", "--out", str(tmp_path)]) == 2
    assert_one_line_error(capsys.readouterr().err, "claims", "must name a file, not a folder")


@pytest.mark.parametrize("argv", [
    ["readme", "--readme", ""], ["claims", "--out", ""], ["train", "--json", ""],
    ["train", "--checkpoint", ""], ["train", "--resume", ""], ["bench", "--json", ""],
    ["run-notebooks", ""], ["run-notebooks", "--out", ""], ["figure-images", ""],
    ["rehearse", "--out", ""], ["rehearse", "--out", "x", "--update", ""]])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(argv, capsys):
    """`--out "$OUT"` with OUT unset gave Path("") = ".": rehearse ran every notebook into
    the current folder."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "expected a path, got an empty string" in capsys.readouterr().err


def test_bench_errors_name_its_flags(capsys):
    assert main(["bench", "--image-size", "4", "--steps", "1"]) == 2
    assert_one_line_error(capsys.readouterr().err, "bench", r"^.*error: --image-size must be")


def test_a_run_too_large_for_memory_is_one_line_with_the_bytes(capsys):
    assert main(["train", "--epochs", "1", "--model", "mlp", "--width", "100000000000",
                 "--no-progress", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert_one_line_error(err, "train", r"out of memory on cpu: one allocation asked for "
                                        r"[\d,]+ bytes, and this machine has [\d,]+ bytes of "
                                        r"memory; lower --width \(now 100000000000\)")


def _interrupting_train_digits(monkeypatch, after_epochs=0, save_first=None):
    """train_digits replaced by a run that finishes ``after_epochs`` epochs (saving each, as
    the real one does), optionally saves once more unreported, then is interrupted."""
    from amp_lessons.train import checkpoint as C
    from amp_lessons.train import recipes

    def run(*args, checkpoint=None, on_epoch=None, **kwargs):
        for e in range(after_epochs):
            if checkpoint is not None:
                C.atomic_save({"epoch": e + 1}, checkpoint)
            on_epoch({"epoch": e, "time_s": 1.0, "peak_memory_bytes": None, "train_loss": 1.0,
                      "test_accuracy": 0.5, "skipped": 0})
        if save_first is not None and checkpoint is not None:
            C.atomic_save({"epoch": save_first}, checkpoint)
        raise KeyboardInterrupt

    monkeypatch.setattr(recipes, "train_digits", run)


@pytest.mark.parametrize("after,unreported,existing,expected", [
    (0, None, False, r"before an epoch of this run finished: checkpoint .*c.pt not written; "
                     r"--json .*r.json not written; no temporary file left behind$"),
    (0, None, True, r"before an epoch of this run finished: checkpoint .*c.pt left as it was"),
    (2, None, False, r"in epoch 3 of 5 \(2 epochs finished in this run\): checkpoint .*c.pt "
                     r"holds 2 finished epochs \(continue with --resume .*c.pt\); --json "
                     r".*r.json not written"),
    (1, 2, True, r"in epoch 2 of 5 \(1 epoch finished in this run\): checkpoint .*c.pt holds 2 "
                 r"finished epochs"),
])
def test_train_interrupted_says_what_it_wrote_in_one_line(tmp_path, capsys, monkeypatch, after,
                                                         unreported, existing, expected):
    from amp_lessons.train import checkpoint as C

    ckpt, out = tmp_path / "c.pt", tmp_path / "r.json"
    if existing:
        C.atomic_save({"epoch": 7}, ckpt)
    _interrupting_train_digits(monkeypatch, after, unreported)
    assert main(["train", "--epochs", "5", "--checkpoint", str(ckpt), "--json", str(out)]
                + FAST) == 130
    err = capsys.readouterr().err
    assert_one_line_error(err, "train", r"interrupted \(Ctrl-C\) " + expected)
    assert not out.exists() and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == (["c.pt"] if existing or after or unreported else [])


def test_train_interrupted_without_outputs_says_nothing_was_written(capsys, monkeypatch):
    _interrupting_train_digits(monkeypatch)
    assert main(["train", "--epochs", "2"] + FAST) == 130
    assert_one_line_error(capsys.readouterr().err, "train",
                          "nothing written \\(no --checkpoint or --json given\\)")


@pytest.mark.parametrize("command", ["claims", "readme"])
def test_ctrl_c_in_any_command_is_one_line_with_status_130(tmp_path, capsys, monkeypatch,
                                                           command):
    from amp_lessons import files

    def interrupt(self, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(files._KeepingWriter, "write", interrupt)
    target = _readme(tmp_path) if command == "readme" else tmp_path / "claims.md"
    before = target.read_bytes() if target.exists() else None
    flag = "--readme" if command == "readme" else "--out"
    assert main([command, flag, str(target)]) == 130
    assert_one_line_error(capsys.readouterr().err, command, r"interrupted \(Ctrl-C\) before it "
                                                            r"finished: a file it was writing "
                                                            r"was not written")
    assert (target.read_bytes() if target.exists() else None) == before
    assert [p.name for p in tmp_path.iterdir()] == ([target.name] if before else [])


def test_an_unexpected_error_is_one_line_and_shown_whole_when_asked(capsys, monkeypatch):
    from amp_lessons.publish import claims

    def broken():
        raise RuntimeError("a bug\nsecond line")

    monkeypatch.setattr(claims, "claims_markdown", broken)
    assert main(["claims"]) == 1
    assert_one_line_error(capsys.readouterr().err, "claims",
                          r"unexpected RuntimeError: a bug \(run again with "
                          r"AMP_LESSONS_TRACEBACK=1 to see where\)$")
    monkeypatch.setenv("AMP_LESSONS_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["claims"])


def test_a_closed_output_pipe_ends_quietly(capsys, monkeypatch):
    import io

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["claims"]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_ctrl_c_in_a_real_train_run_is_one_line_status_130_and_a_whole_checkpoint(tmp_path):
    """SIGINT to a real process after its first epoch: the issue's example (a traceback ending
    KeyboardInterrupt)."""
    import signal
    import time

    ckpt, out = tmp_path / "c.pt", tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "amp_lessons", "train", "--epochs", "500",
                             "--checkpoint", str(ckpt), "--json", str(out)] + MLP,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            # an xdist worker ignores SIGINT, and its children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.readline()  # "epoch 1/500: ..." once the first epoch is saved
    assert first.startswith("epoch 1/500"), first + proc.stderr.read()
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert_one_line_error(err, "train", r"interrupted \(Ctrl-C\) in epoch \d+ of 500 .*: "
                                        r"checkpoint .*c.pt holds \d+ finished epochs? .*--json "
                                        r".*r.json not written; no temporary file left behind")
    assert os.listdir(tmp_path) == ["c.pt"]
    from amp_lessons.train.checkpoint import read_verified

    assert read_verified(ckpt)["epoch"] >= 1


def test_run_notebooks_interrupted_names_what_it_wrote(tmp_path, capsys, monkeypatch):
    from amp_lessons.publish import notebooks

    first, _ = _marker_notebook(tmp_path, "01_a.ipynb")
    second, _ = _marker_notebook(tmp_path, "02_b.ipynb")
    third, _ = _marker_notebook(tmp_path, "03_c.ipynb")
    calls = []

    def run(path, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(notebooks, "run_notebook", run)
    assert main(["run-notebooks", "--no-progress", "--allow-busy-gpu", str(first),
                 str(second), str(third)]) == 130
    assert_one_line_error(capsys.readouterr().err, "run-notebooks",
                          r"interrupted \(Ctrl-C\) while running .*02_b.ipynb: it was not "
                          r"written \(left as it was\); wrote .*01_a.ipynb; not run: "
                          r".*03_c.ipynb$")


@pytest.mark.parametrize("other", ["--checkpoint", "--resume"])
def test_train_refuses_json_over_its_own_checkpoint(tmp_path, capsys, other):
    """--json c.pt --checkpoint c.pt trained, then replaced the checkpoint with the results."""
    ckpt = tmp_path / "c.pt"
    ckpt.write_bytes(b"PK\x03\x04 stands in")
    (tmp_path / "sub").mkdir()
    for json_path in (ckpt, tmp_path / "sub" / ".." / "c.pt"):
        assert main(["train", "--epochs", "1", "--json", str(json_path), other, str(ckpt)]
                    + FAST) == 2
        out = capsys.readouterr()
        assert_one_line_error(out.err, "train", f"--json and {other} name the same file")
        assert "epoch 1" not in out.out
    assert ckpt.read_bytes() == b"PK\x03\x04 stands in"
