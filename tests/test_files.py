"""amp_lessons.files: one atomic writer for every file the package writes (temporary names that
fit any legal target name, cleanup on failure, a full disk and a file-size limit said as such),
and readers whose errors name the file (issue 23)."""
import ast
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from amp_lessons.train import checkpoint as C
from amp_lessons import files as F
from amp_lessons.publish import rehearsal
from amp_lessons.publish import report
from amp_lessons.publish import notebooks as runner
from amp_lessons.train.records import History

PACKAGE = Path(F.__file__).resolve().parent
REPO = PACKAGE.parent


# --- every writer of the package is the atomic one ------------------------------------------------

# the only places that may open a file for writing themselves, and why
ALLOWED_WRITERS = {  # paths inside the package: a file moved elsewhere is scanned again
    "files.py": "the atomic writer itself",
    "measure/launch.py": "results of distributed worker processes, in a private temporary folder",
    "exercises/ex06.py": "the learner's script, written into a private temporary folder for "
                         "torchrun",
}


def _direct_writes(path: Path, root: Path = REPO):
    """Calls in ``path`` that write a file without the atomic writer (``torch.save`` into a name
    bound to an ``io.BytesIO()`` writes no file: a round trip in memory)."""
    found = []
    tree = ast.parse(path.read_text())
    in_memory = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call)
                 and getattr(node.value.func, "attr", getattr(node.value.func, "id", "")) == "BytesIO"
                 for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
        mode = next((a.value for a in node.args[1:2] if isinstance(a, ast.Constant)), None)
        mode = next((k.value.value for k in node.keywords if k.arg == "mode"
                     and isinstance(k.value, ast.Constant)), mode)
        if name in ("write_text", "write_bytes", "savefig", "write_image", "write_html") \
                or (owner == "nbformat" and name == "write") \
                or (owner == "json" and name == "dump") \
                or (owner == "torch" and name == "save" and path.name != "checkpoint.py"
                    and not (len(node.args) > 1 and isinstance(node.args[1], ast.Name)
                             and node.args[1].id in in_memory)) \
                or (name in ("open", "fdopen") and isinstance(mode, str) and set(mode) & set("wax")):
            found.append(f"{path.relative_to(root)}:{node.lineno} {owner + '.' if owner else ''}"
                         f"{name}")
    return found


def test_every_file_the_package_writes_goes_through_the_atomic_writer():
    found = [hit for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).as_posix() not in ALLOWED_WRITERS
             for hit in _direct_writes(p)]
    assert found == []
    assert all((PACKAGE / name).is_file() for name in ALLOWED_WRITERS)  # none left stale


def test_the_scan_finds_a_direct_write(tmp_path):
    """The control: the scan above catches README.write_text(...), open(..., "w") and
    nbformat.write, the writes that left half-written files."""
    probe = tmp_path / "probe.py"
    probe.write_text("from pathlib import Path\nPath('x').write_text('y')\nopen('z', 'w')\n"
                     "open('r')\nimport nbformat\nnbformat.write(None, 'n')\n"
                     "import io, torch\nbuf = io.BytesIO()\ntorch.save(1, buf)\n"
                     "torch.save(1, 'file.pt')\n")
    hits = [h.split(" ", 1)[1] for h in _direct_writes(probe, tmp_path)]
    assert hits == ["write_text", "open", "nbformat.write", "torch.save"]


# --- temporary names ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a", "c" * 243 + ".pt", "n" * 255, "é" * 127])
def test_temporary_names_fit_any_legal_target_name(tmp_path, name):
    """A 243-character checkpoint name made the old temporary name too long (ENAMETOOLONG)."""
    path = tmp_path / name
    tmp = F.temp_name(path)
    assert len(os.fsencode(tmp.name)) <= os.pathconf(tmp_path, "PC_NAME_MAX")
    assert tmp.parent == path.parent and F.host_tag() in tmp.name
    F.write_atomic(path, "text")
    assert path.read_text() == "text"
    C.atomic_save({"x": torch.ones(3)}, path)
    assert torch.equal(C.read_verified(path)["x"], torch.ones(3))
    # a dead process's temporary file of this long name is still found and removed
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = Path(str(F.temp_name(path)).replace(f"-{os.getpid()}-", f"-{dead}-"))
    stale.write_bytes(b"left by kill -9")
    assert F.remove_stale_temp_files(path) == [stale]
    assert sorted(os.listdir(tmp_path)) == [name]


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_umask(tmp_path):
    path = tmp_path / "r.json"
    old = os.umask(0o022)
    try:
        F.write_atomic(path, "1")
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o600)
        F.write_atomic(path, "2")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "2"


def test_a_symbolic_link_is_written_through_and_stays_a_link(tmp_path):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target.name)
    F.write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to("made.json")
    F.write_json(dangling, {"a": 1})
    assert dangling.is_symlink() and json.loads((tmp_path / "made.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json",
                                                          "made.json", "target.json"]


def test_a_link_into_a_missing_folder_is_checked_and_written_there(tmp_path):
    """``check_writable`` and ``write_atomic`` follow the link: its target's folder is made
    (the write failed after the work was done, naming the missing folder)."""
    (tmp_path / "cw").mkdir()
    link = tmp_path / "cw" / "results.json"
    link.symlink_to("missing/out.json")
    F.check_writable(link, "results")
    F.write_json(link, {"ok": True})
    assert link.is_symlink() and json.loads((tmp_path / "cw" / "missing" / "out.json")
                                             .read_text()) == {"ok": True}


def test_a_loop_of_links_is_refused_by_name_and_left_alone(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.symlink_to(b.name)
    b.symlink_to(a.name)
    with pytest.raises(OSError, match=f"could not write results {a}: its symbolic links form a loop"):
        F.write_atomic(a, "x", what="results")
    with pytest.raises(ValueError, match="its symbolic links form a loop"):
        F.check_writable(a, "results")
    assert a.is_symlink() and b.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == \
        ["a.json", "b.json"]


def test_a_folder_in_the_files_place_is_named_not_the_temporary_file(tmp_path):
    folder = tmp_path / "results.json"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        F.write_atomic(folder, "x", what="results file")
    assert str(err.value).endswith(f"could not write results file {folder}: it is a folder")
    assert ".tmp" not in str(err.value) and list(tmp_path.iterdir()) == [folder]


# --- failures: nothing half-written, nothing left behind, the cause said -------------------------

def test_a_folder_that_refuses_the_file_is_named_with_the_target(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(F.os, "open", refuse)
    with pytest.raises(PermissionError, match=r"could not write README .*/README.md: Permission"):
        F.write_atomic(tmp_path / "README.md", "x", "README")


@pytest.fixture
def full_disk(monkeypatch):
    """A stand-in for a full disk: every write through the atomic writer fails with ENOSPC
    once 1,000 bytes are written."""
    real = F._KeepingWriter.write
    written = []

    def write(self, data):
        if sum(written) + len(data) > 1000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        written.append(len(data))
        return real(self, data)

    monkeypatch.setattr(F._KeepingWriter, "write", write)
    return written


README = (f"# title\n\n{report.START}\nold results\n{report.END}\n\n{rehearsal.README_START}\n"
          f"old rehearsal\n{rehearsal.README_END}\n\nA hand-written tail. " + "x" * 20_000 + "\n")


def _writers(tmp_path):
    """One call per kind of file the package writes, each writing ``tmp_path/<kind>``."""
    record = rehearsal.read_record(REPO / "docs" / "rehearsal_t4.json")
    big = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1\n" * 2000)])
    history = History()
    history.epochs = [{"epoch": i, "note": "y" * 100} for i in range(50)]
    return {
        "history.json": lambda p: history.to_json(p),
        "results.json": lambda p: F.write_json(p, {"rows": list(range(2000))}),
        "README.md": lambda p: report.update_readme(p, []),
        "REHEARSAL.md": lambda p: rehearsal.update_readme(p, record),
        "notebook.ipynb": lambda p: runner._write(big, p),
        "checkpoint.pt": lambda p: C.atomic_save({"w": torch.randn(5000)}, p),
    }


@pytest.mark.parametrize("kind", ["history.json", "results.json", "README.md", "REHEARSAL.md",
                                  "notebook.ipynb", "checkpoint.pt"])
def test_a_full_disk_keeps_the_earlier_file_and_says_so(tmp_path, full_disk, kind):
    """A full disk cut the README at 16 KiB and replaced JSON results with invalid JSON."""
    path = tmp_path / kind
    earlier = README.encode() if kind.endswith(".md") else b"the earlier file"
    path.write_bytes(earlier)
    with pytest.raises(F.DiskFullError, match=f"disk full: could not write .*{kind}"):
        _writers(tmp_path)[kind](path)
    assert path.read_bytes() == earlier
    assert os.listdir(tmp_path) == [kind]  # no temporary file left


FSIZE_SCRIPT = r"""
import json, resource, sys
from pathlib import Path
import nbformat, torch
from amp_lessons.train import checkpoint as C
from amp_lessons import files as F
folder = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
big = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1\n" * 2000)])
calls = {"ckpt.pt": lambda p: C.atomic_save({"w": torch.randn(5000)}, p),
         "text.md": lambda p: F.write_atomic(p, "y" * 10_000),
         "nb.ipynb": lambda p: F.write_notebook(big, p)}
out = {}
for name, call in calls.items():
    try:
        call(folder / name)
        out[name] = "written"
    except Exception as exc:
        out[name] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def test_a_file_size_limit_says_file_too_large_and_names_the_file(tmp_path):
    """EFBIG made torch.save say "unexpected pos 2240 vs 2134"."""
    names = ["ckpt.pt", "text.md", "nb.ipynb"]
    for name in names:
        (tmp_path / name).write_bytes(b"earlier")
    proc = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for name in names:
        kind, message = out[name]
        assert kind == "FileTooLargeError", out
        assert message.startswith("file too large: could not write") and name in message
        assert (tmp_path / name).read_bytes() == b"earlier"
    assert sorted(os.listdir(tmp_path)) == sorted(names)


# --- readers name the file ----------------------------------------------------------------------

def test_readers_name_the_file(tmp_path):
    empty, cut, latin = tmp_path / "empty.json", tmp_path / "cut.json", tmp_path / "latin.md"
    empty.write_text("")
    cut.write_text('{"card": "t4", "less')
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="empty.json' is empty"):
        F.read_json(empty)
    with pytest.raises(ValueError, match="cut.json' is not valid JSON"):
        F.read_json(cut)
    with pytest.raises(ValueError, match="latin.md' is not UTF-8"):
        F.read_text(latin, "README")
    with pytest.raises(ValueError, match="latin.md' is not UTF-8"):
        report.update_readme(latin, [])
    for bad in (empty, cut):
        with pytest.raises(ValueError, match=f"rehearsal record '.*{bad.name}'"):
            rehearsal.read_record(bad)


def _notebook_with(tmp_path, name, change):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    doc = json.loads(nbformat.writes(nb))
    change(doc)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_an_invalid_notebook_is_one_error_naming_the_file(tmp_path):
    """A code cell whose source is 5 gave an AttributeError traceback."""
    number = _notebook_with(tmp_path, "01_number.ipynb",
                            lambda d: d["cells"][0].__setitem__("source", 5))
    no_cells = _notebook_with(tmp_path, "02_none.ipynb", lambda d: d.pop("cells"))
    for path, message in ((number, "not a valid Jupyter notebook .*cells/0/source"),
                          (no_cells, "not a Jupyter notebook")):
        with pytest.raises(F.NotANotebookError, match=f"{path.name}: {message}"):
            F.read_notebook(path)
        with pytest.raises(ValueError, match=path.name):
            report.collect([path])
    for path in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        F.read_notebook(path)  # the course's own notebooks are valid


# --- one rule for a file that is there already (issue 41, class 6) ---------------------------------

def _read_only(path, text="the earlier file", mode=0o444):
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("kind", ["history.json", "results.json", "README.md", "REHEARSAL.md",
                                  "notebook.ipynb", "checkpoint.pt"])
@pytest.mark.parametrize("mode", [0o444, 0o400, 0o000])
def test_every_writer_refuses_a_read_only_file_and_leaves_it(tmp_path, kind, mode):
    """``readme --readme README.md`` at mode 444 replaced the file by a rename (root and the
    folder's owner may rename over a file they cannot write); every writer now refuses it."""
    path = tmp_path / kind
    earlier = README if kind.endswith(".md") else "the earlier file"
    _read_only(path, earlier, mode)
    try:
        with pytest.raises(F.ReadOnlyFileError, match=f"could not write .*{kind}: it exists and "
                                                      f"cannot be written \\(read-only: mode "
                                                      f"{mode:04o}\\)"):
            _writers(tmp_path)[kind](path)
        assert path.stat().st_mode & 0o777 == mode
    finally:
        path.chmod(0o644)
    assert path.read_text() == earlier and os.listdir(tmp_path) == [kind]


def test_a_read_only_file_is_refused_through_a_link_and_by_check_writable(tmp_path):
    target = _read_only(tmp_path / "target.json")
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    with pytest.raises(F.ReadOnlyFileError, match="target.json: it exists and cannot be written"):
        F.write_json(link, {"a": 1})
    for path in (target, link):
        with pytest.raises(ValueError, match=r"out: '.*target.json' exists and cannot be "
                                             r"written \(read-only: mode 0444\)"):
            F.check_writable(path, "out")
    assert target.read_text() == "the earlier file" and link.is_symlink()
    # the rule is about the file, not its folder: a writable file in it is replaced as before
    F.write_atomic(tmp_path / "other.json", "1")
    F.write_atomic(tmp_path / "other.json", "2")
    assert (tmp_path / "other.json").read_text() == "2"


def test_a_file_this_user_may_not_write_is_refused_even_with_a_write_bit(tmp_path, monkeypatch):
    """Mode 0644 owned by another user: a write bit is set, but not for this user (os.access
    stands in for another owner: the tests may run as root)."""
    path = tmp_path / "theirs.md"
    path.write_text("theirs")
    real = os.access
    monkeypatch.setattr(F.os, "access", lambda p, m: False if Path(p) == path else real(p, m))
    assert F.read_only_reason(path) == "this user may not write it: mode 0644"
    with pytest.raises(F.ReadOnlyFileError, match="this user may not write it"):
        F.write_atomic(path, "mine")
    assert path.read_text() == "theirs"
    assert F.read_only_reason(tmp_path / "missing.md") == ""


@pytest.mark.parametrize("error", [
    F.DiskFullError(errno.ENOSPC, "disk full: could not write README /x/README.md (the "
                                  "previous file there, if any, is intact)"),
    F.ReadOnlyFileError(errno.EACCES, "could not write README /x/README.md: it exists and "
                                      "cannot be written (read-only: mode 0444)"),
    PermissionError(errno.EACCES, "could not write README /x/README.md: Permission denied"),
    PermissionError(errno.EACCES, "Permission denied"),
    OSError(errno.EIO, "Input/output error"),
])
def test_a_failed_write_says_could_not_write_once(error):
    line = F.write_failure(Path("/x/README.md"), error)
    assert line.count("could not write") == 1 and line.count("/x/README.md") == 1, line
    assert "[Errno" not in line


def test_temp_files_of_finds_only_this_processs_unfinished_writes(tmp_path):
    path = tmp_path / "c.pt"
    assert F.temp_files_of(path) == []
    mine = F.temp_name(path)
    mine.write_bytes(b"x")
    theirs = Path(str(mine).replace(f"-{os.getpid()}-", "-1-"))
    theirs.write_bytes(b"x")
    assert F.temp_files_of(path) == [mine] and F.temp_files_of(path, pid=1) == [theirs]


def test_ctrl_c_during_a_write_keeps_the_earlier_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text("earlier")

    def interrupt(self, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(F._KeepingWriter, "write", interrupt)
    with pytest.raises(KeyboardInterrupt):
        F.write_json(path, {"rows": [1, 2]})
    with pytest.raises(KeyboardInterrupt):
        C.atomic_save({"w": torch.zeros(3)}, tmp_path / "c.pt")
    assert path.read_text() == "earlier" and sorted(os.listdir(tmp_path)) == ["results.json"]


@pytest.fixture
def python_sigint(monkeypatch):
    """SIGINT as a plain ``python`` process has it (an xdist worker ignores it)."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield signal
    signal.signal(signal.SIGINT, previous)


def test_a_real_ctrl_c_inside_torch_save_finishes_the_checkpoint_then_interrupts(
        tmp_path, monkeypatch, python_sigint):
    """A SIGINT that arrives inside torch.save's writer (the CI failure: torch turned it into
    ``RuntimeError: ... unexpected pos``) waits for the file, then raises KeyboardInterrupt."""
    path = tmp_path / "c.pt"
    C.atomic_save({"w": torch.zeros(3)}, path)
    sent = []
    write = C._HashingWriter.write

    def write_then_interrupt(self, data):
        if not sent:
            sent.append(os.kill(os.getpid(), python_sigint.SIGINT))
        return write(self, data)

    monkeypatch.setattr(C._HashingWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        C.atomic_save({"w": torch.ones(1000)}, path)
    assert sent and torch.equal(C.read_verified(path)["w"], torch.ones(1000))
    assert sorted(os.listdir(tmp_path)) == ["c.pt"]
    assert python_sigint.getsignal(python_sigint.SIGINT) is python_sigint.default_int_handler


def test_deferred_interrupt_leaves_a_block_without_ctrl_c_alone(python_sigint):
    with F.deferred_interrupt():
        x = 1
    assert x == 1 and python_sigint.getsignal(python_sigint.SIGINT) is python_sigint.default_int_handler
    with pytest.raises(ValueError):  # the block's own error passes through, the handler restored
        with F.deferred_interrupt():
            raise ValueError("mine")
    assert python_sigint.getsignal(python_sigint.SIGINT) is python_sigint.default_int_handler
