"""The package's files: one atomic writer for everything it writes, and readers whose errors name
the file (docs/reliability.md, "Files").

``write_atomic(path, data)`` (or ``atomic_file(path)`` for a writer that streams, as ``torch.save``
does) writes into a temporary file next to ``path``, fsyncs it and renames it over ``path``: a
reader sees the old file or the new one, never a part. README blocks, JSON results, notebooks and
their static images, rehearsal records and training checkpoints are all written this way.

- The temporary name is ``.<name>.tmp-<host>-<pid>-<random>`` with ``<name>`` shortened so the
  whole fits the folder's file-name limit: any legal target name has a legal temporary name.
- A failure removes the temporary file at once and leaves the previous file intact. A full disk
  raises ``DiskFullError`` and a file-size limit (``ulimit -f``, EFBIG) ``FileTooLargeError``,
  both saying so and naming the file. A process killed mid-write (``kill -9``) cannot remove its
  temporary file; every later write or checkpoint read of that path removes the ones left by
  processes of this host that no longer run (``remove_stale_temp_files``).
- A new file gets the mode ``open()`` would give it (0666 less the umask); a replaced file keeps
  its mode.
- One rule for a file that is there already: it is replaced only where it could be written in
  place. A read-only file (no write permission for this user, or none for anyone: mode 0444,
  which root could write through a rename) is refused with ``ReadOnlyFileError`` before anything
  is written, never replaced by the rename; ``check_writable`` applies the same rule before a
  command's work starts.

``read_text``, ``read_json`` and ``read_notebook`` raise a ``ValueError`` that names the file for
content that cannot be read (not UTF-8, not JSON, not a valid notebook), so every command can
print it as one line.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import signal
import socket
import stat
import threading
from pathlib import Path
from typing import Any, Iterator, List, Union

PathLike = Union[str, Path]
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FILE_TOO_LARGE_ERRNOS = (errno.EFBIG,)
PID_DIGITS = 10  # room kept for any pid in a temporary name
RANDOM_HEX = 8


class DiskFullError(OSError):
    """A write ran out of disk space (ENOSPC/EDQUOT); the message names the file, and the
    previous file at the path is intact."""

    def __str__(self) -> str:
        return str(self.strerror)


class FileTooLargeError(OSError):
    """A write went past a file-size limit (EFBIG: ``ulimit -f``, the file system's largest
    file); the message names the file, and the previous file at the path is intact."""

    def __str__(self) -> str:
        return str(self.strerror)


class ReadOnlyFileError(PermissionError):
    """A file that is there already and cannot be written (``read_only_reason``); the message
    names it, and the file is left as it was."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_failure(path: PathLike, exc: OSError) -> str:
    """One line for a failed write of ``path`` that says "could not write" once: the message of
    the package's own errors (``DiskFullError``, ``FileTooLargeError``, ``ReadOnlyFileError``
    and the writer's other errors, which name the file), else "could not write <path>: <why>"."""
    if isinstance(exc, (DiskFullError, FileTooLargeError, ReadOnlyFileError)):
        return str(exc)
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if str(path) in why:  # the writer's own message names the file already
        return why
    return f"could not write {path}: {why}"


class NotANotebookError(ValueError):
    """A file that cannot be read as a Jupyter notebook; the message names it."""


# --- temporary names -----------------------------------------------------------------------------

def host_tag() -> str:
    """This host's name as temporary names carry it (letters, digits, ``_`` and ``.``)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def _temp_stem(path: Path) -> str:
    """The part of the target's name a temporary name keeps: shortened (at a character
    boundary, counted in bytes) so ``.<stem>.tmp-<host>-<pid>-<random>`` fits the folder's
    file-name limit."""
    room = _name_max(path.parent) - len(f"..tmp-{host_tag()}--") - PID_DIGITS - RANDOM_HEX
    name = path.name
    while len(os.fsencode(name)) > max(room, 0):
        name = name[:-1]
    return name


def temp_name(path: PathLike) -> Path:
    """A fresh temporary name next to ``path``: ``.<name>.tmp-<host>-<pid>-<random>``, the
    name shortened where needed so it fits the folder's file-name limit."""
    path = Path(path)
    return path.with_name(f".{_temp_stem(path)}.tmp-{host_tag()}-{os.getpid()}-"
                          f"{secrets.token_hex(RANDOM_HEX // 2)}")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (a pid of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # exists, owned by someone else / not a pid
        return True
    return True


def temp_files_of(path: PathLike, pid: int = None) -> List[Path]:
    """The temporary files of writes of ``path`` by process ``pid`` (this one by default) on
    this host that are still there: none once every write has finished or failed."""
    path = Path(path)
    pid = os.getpid() if pid is None else pid
    prefix = f".{_temp_stem(path)}.tmp-{host_tag()}-{pid}-"
    try:
        return sorted(Path(e.path) for e in os.scandir(path.parent) if e.name.startswith(prefix))
    except OSError:
        return []


def remove_stale_temp_files(path: PathLike) -> List[Path]:
    """Remove the temporary files that interrupted writes of ``path`` left behind; return them.

    Only names of the form ``temp_name`` gives for ``path``, on this host, whose process is gone
    are removed: a write in progress in another live process keeps its file (a reused pid errs
    on the side of keeping), and files of other hosts sharing the folder are left to those hosts.
    """
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(_temp_stem(path))}\.tmp-{re.escape(host_tag())}-(\d+)-"
                         rf"[0-9a-f]+$")
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid() or pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except FileNotFoundError:  # another process cleaned it first
            pass
    return removed


# --- writing -------------------------------------------------------------------------------------

def _recorded(exc: BaseException, writer=None):
    """The OSError behind ``exc``: itself, its cause or context, or the one ``writer`` kept
    (torch turns a writer's exceptions into a bare "unexpected pos" RuntimeError)."""
    for e in (getattr(writer, "error", None), exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno is not None:
            return e
    return None


def write_error(exc: BaseException, path: Path, what: str = "file", writer=None):
    """The error to raise for a failed write of ``path``: ``DiskFullError`` or
    ``FileTooLargeError`` naming the file when that is the cause, else None (raise ``exc``)."""
    cause = _recorded(exc, writer)
    if cause is None:
        return None
    if cause.errno in DISK_FULL_ERRNOS:
        return DiskFullError(errno.ENOSPC, f"disk full: could not write {what} {path} (the "
                                           f"previous file there, if any, is intact)")
    if cause.errno in FILE_TOO_LARGE_ERRNOS:
        return FileTooLargeError(errno.EFBIG, f"file too large: could not write {what} {path} "
                                              f"(a file-size limit, e.g. `ulimit -f`; the "
                                              f"previous file there, if any, is intact)")
    return None


class _KeepingWriter:
    """A binary file object that remembers the OSError of a failed write (see ``_recorded``)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def read_only_reason(path: PathLike) -> str:
    """Why the file at ``path`` may not be replaced ("" when it may, or when there is none):
    this user may not write it, or nobody may (no write bit: mode 0444, which root could still
    replace by a rename). The package's one rule, in ``atomic_file`` and ``check_writable``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return ""
    if not stat.S_ISREG(mode):
        return ""
    if not mode & 0o222:
        return f"read-only: mode {mode & 0o7777:04o}"
    if not os.access(path, os.W_OK):
        return f"this user may not write it: mode {mode & 0o7777:04o}"
    return ""


_SPECIAL_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def special_file_reason(path: PathLike) -> str:
    """What ``path`` is when it is there and is neither a regular file nor a folder (a device
    such as /dev/null, a named pipe, a socket), else "". The writer replaces a file whole by a
    rename, which would put a regular file in the device's or pipe's place (as root, /dev/null
    itself): such a path is refused, in ``atomic_file`` and ``check_writable`` alike."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return ""
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), "")


def _special_file_error(path: Path, what: str, kind: str) -> OSError:
    return OSError(errno.EINVAL, f"could not write {what} {path}: it is {kind}, not a regular "
                                 f"file (the writer replaces a file whole, which would replace "
                                 f"the {kind.split(' ', 1)[1].split(' (')[0]} itself); name a "
                                 f"regular file")


def _read_only_error(path: Path, what: str, reason: str) -> ReadOnlyFileError:
    return ReadOnlyFileError(errno.EACCES, f"could not write {what} {path}: it exists and "
                                           f"cannot be written ({reason}); make it writable "
                                           f"(chmod u+w) or name another file")


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block ends, then raise ``KeyboardInterrupt``: a file being
    written is finished first. Without it, a Ctrl-C inside ``torch.save``'s writer surfaces as
    torch's ``RuntimeError: ... unexpected pos`` instead of an interrupt. Only the main thread,
    under Python's own SIGINT handler, is changed; elsewhere (a worker thread, an ignored SIGINT,
    a kernel's own handler) the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def atomic_file(path: PathLike, what: str = "file") -> Iterator[Any]:
    """Yield a binary file object; on leaving the block its bytes replace ``path`` atomically
    (see the module docstring). ``what`` names the kind of file in errors ("checkpoint",
    "notebook"). The folder must exist. A symbolic link is written through: its target gets the
    bytes and the link stays a link (as an editor saves it); a folder is refused by name, and a
    read-only file (``read_only_reason``) by ``ReadOnlyFileError``, before anything is written.
    A Ctrl-C waits until the file is written or the write failed (``deferred_interrupt``)."""
    with deferred_interrupt():
        with _atomic_file(path, what) as writer:
            yield writer


@contextlib.contextmanager
def _atomic_file(path: PathLike, what: str = "file") -> Iterator[Any]:
    """``atomic_file``'s work, with Ctrl-C as it is."""
    path = _through_links(path, what)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"could not write {what} {path}: it is a folder")
    kind = special_file_reason(path)
    if kind:
        raise _special_file_error(path, what, kind)
    reason = read_only_reason(path)
    if reason:
        raise _read_only_error(path, what, reason)
    remove_stale_temp_files(path)
    tmp = temp_name(path)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    except OSError as exc:  # say which file could not be written, not the temporary name
        better = write_error(exc, path, what)
        if better is not None:
            raise better from None
        raise type(exc)(exc.errno, f"could not write {what} {path}: {exc.strerror}") from None
    writer = None
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _KeepingWriter(f)
            yield writer
            f.flush()
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, (DiskFullError, FileTooLargeError)):  # said so already
            raise
        better = write_error(exc, path, what, writer) if isinstance(exc, Exception) else None
        if better is not None:
            raise better from exc
        raise


def _through_links(path: PathLike, what: str = "file") -> Path:
    """``path``, or the file its symbolic link (or chain of links) names: a write goes there
    and the link stays a link. OSError naming ``path`` when the links form a loop."""
    path = Path(path)
    if not path.is_symlink():
        return path
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath stops inside a loop
        raise OSError(errno.ELOOP, f"could not write {what} {path}: its symbolic links form a "
                                   f"loop")
    return target


def write_atomic(path: PathLike, data: Union[str, bytes], what: str = "file") -> Path:
    """Write ``data`` (text is encoded as UTF-8) to ``path`` atomically; return ``path``.
    Makes the folder when it is missing (the link's target's, for a symbolic link)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    _through_links(path, what).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, what) as f:
        f.write(data)
    return path


def write_json(path: PathLike, doc, what: str = "JSON file", indent: int = 1) -> Path:
    """``json.dumps(doc)`` (strict: no NaN) written atomically to ``path``; the text is built
    before the file is touched."""
    return write_atomic(path, json.dumps(doc, indent=indent, allow_nan=False), what)


def check_writable(path: PathLike, what: str) -> None:
    """ValueError unless a file can be written at ``path`` (checked before the work starts):
    not a folder, not a read-only file (the writer's rule, ``read_only_reason``), and its folder
    exists (or can be made) and is writable; through a symbolic link, its target's. Not a
    device, named pipe or socket either (``special_file_reason``). Any error of the system's
    while checking (a name too long for the file system, say) is a ValueError naming ``what``
    and the path, as the writer would have failed later."""
    try:
        _check_writable(_through_links(path, what), what)
    except OSError as exc:  # a loop of links, ENAMETOOLONG, EACCES above ...: named, one line
        why = str(exc.strerror or exc)
        raise ValueError(why if str(path) in why else
                         f"{what}: '{path}' cannot be written: {why}") from None


def _check_writable(path: Path, what: str) -> None:
    """``check_writable``'s checks on a path with its links followed."""
    if path.is_dir():
        raise ValueError(f"{what} must name a file, not a folder; got '{path}'")
    kind = special_file_reason(path)
    if kind:
        raise ValueError(f"{what}: '{path}' is {kind}, not a regular file; name a regular file "
                         f"(the writer replaces a file whole, by a rename)")
    reason = read_only_reason(path)
    if reason:
        raise ValueError(f"{what}: '{path}' exists and cannot be written ({reason}); make it "
                         f"writable (chmod u+w) or name another file")
    check_folder_writable(path.parent, what, f"'{path}'")


def check_folder_writable(folder: PathLike, what: str, target: str = "") -> None:
    """ValueError unless files can be written in ``folder``: it is a writable folder, or the
    nearest part of it that exists is one (the rest can be made)."""
    folder = Path(folder)
    target = target or f"files in '{folder}'"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what}: '{existing}' is not a folder, so {target} cannot be written")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: the folder '{existing}' is not writable, so {target} cannot "
                         f"be written")


# --- reading -------------------------------------------------------------------------------------

def read_text(path: PathLike, what: str = "file") -> str:
    """The UTF-8 text of ``path``; ValueError naming the file when it is not UTF-8 (OSErrors,
    such as a missing file, name it already and pass through)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} '{path}' is not UTF-8 text (byte {exc.start}: "
                         f"{exc.reason})") from None


def read_json(path: PathLike, what: str = "JSON file"):
    """The JSON document in ``path``; ValueError naming the file when it is empty, truncated or
    not JSON."""
    path = Path(path)
    text = read_text(path, what)
    if not text.strip():
        raise ValueError(f"{what} '{path}' is empty (an interrupted copy?); a JSON document is "
                         f"needed")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} '{path}' is not valid JSON (truncated or damaged?): {exc.msg} "
                         f"at line {exc.lineno} column {exc.colno}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


def read_notebook(path: PathLike):
    """Read a notebook (as version 4) and check it against the notebook format's schema, or
    raise ``NotANotebookError`` naming the file and what is wrong (unreadable, not UTF-8, not
    JSON, not a notebook, or a notebook with an invalid field such as a code cell whose
    ``source`` is a number). What ``nbformat.read`` does, except that it only logs an invalid
    notebook and returns it."""
    import nbformat
    from nbformat import reader

    path = Path(path)
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:  # JSON and UTF-8 decoding errors are ValueErrors
        raise NotANotebookError(f"{path}: not a readable Jupyter notebook "
                                f"({_first_line(exc)})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cells", doc.get("worksheets")), list):
        raise NotANotebookError(f"{path}: not a Jupyter notebook (no cells)")
    try:
        nb = reader.reads(json.dumps(doc))
        nb = nbformat.convert(nb, 4)
        nbformat.validate(nb)
    except nbformat.ValidationError as exc:
        where = "/".join(str(p) for p in getattr(exc, "absolute_path", None) or [])
        raise NotANotebookError(f"{path}: not a valid Jupyter notebook "
                                f"({_first_line(exc)}{f' at {where}' if where else ''})") from None
    except Exception as exc:  # noqa: BLE001 - an unknown nbformat version and the like
        raise NotANotebookError(f"{path}: not a readable Jupyter notebook "
                                f"({_first_line(exc)})") from None
    return nb


def write_notebook(nb, path: PathLike) -> Path:
    """Write a notebook node to ``path`` atomically (the text is built before the file is
    touched)."""
    import nbformat

    return write_atomic(path, nbformat.writes(nb), "notebook")
