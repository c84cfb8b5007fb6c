"""Every file memplan writes goes through here: atomic, never a silent overwrite, never over
anything but a regular file.

* The text goes to a temporary file in the target's folder, then:
  without ``force`` it is hard-linked to the target (``os.link`` fails if the name exists, so
  two racing writers cannot both win — no check-then-rename window), falling back to an
  ``O_CREAT | O_EXCL`` open where the file system has no hard links; with ``force`` it is
  renamed over the target (``os.replace``), keeping the replaced file's permission bits.
* A target that exists but is not a regular file (a directory, ``/dev/full``, a socket) is
  refused: memplan never replaces a device node or a folder.
* Temporary files are named ``.<name>.memplan-<pid>-<random>.tmp``; one left behind by a
  process that was killed (its pid no longer runs) is removed by the next write into that
  folder.
* :func:`check_outputs` does all of these checks (and rejects two outputs naming the same
  file) without writing anything, so a command can refuse before minutes of probing and a
  refused run writes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from memplan.errors import BadInputError, OutputExistsError

_TMP_MARK = ".memplan-"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _nearest_existing(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file: spelled alike once resolved, or one inode (a hard
    link); False where either does not exist and the spellings differ."""
    if os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b)):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def refuse_input_as_output(
    target: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]], option: str
) -> None:
    """Raise when ``target`` is one of the command's own ``inputs``: ``--force`` replaces
    an output, never what the command reads (before, ``solve p.yaml -o p.yaml --force``
    replaced the profile with its plan, whose ``profile:`` then named itself)."""
    for source in inputs:
        if same_file(target, source):
            raise BadInputError(
                f"{target} is this command's input ({source}); memplan does not write an "
                "output over what it reads, --force or not.",
                hint=f"Choose another path with {option}.",
            )


def check_output(
    path: str | os.PathLike[str],
    *,
    force: bool,
    option: str = "-o",
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> Path:
    """Raise unless ``path`` can be written by :func:`write_text_atomic` with ``force``;
    writes nothing. Returns the path that will be written (a symlink resolved, so the
    link itself is kept). ``option``: the flag that named the path, which the hints name;
    ``inputs``: the files the command reads, which no output may replace."""
    target = Path(path)
    refuse_input_as_output(target, inputs, option)
    if os.path.lexists(target):
        try:
            info = os.stat(target)
        except OSError:
            raise BadInputError(
                f"{target} is a broken symbolic link; memplan does not write through it.",
                hint=f"Remove the link or choose another path with {option}.",
            ) from None
        if not stat.S_ISREG(info.st_mode):
            raise BadInputError(
                f"{target} is {_kind(info.st_mode)}, not a regular file; memplan only "
                "replaces regular files.",
                hint=f"Choose a file path with {option}.",
            )
        if not force:
            raise OutputExistsError(
                f"{target} already exists; memplan does not overwrite files silently.",
                hint=f"Pass --force to replace it, or choose another path with {option}.",
            )
        target = Path(os.path.realpath(target))
    folder = _nearest_existing(target.parent if str(target.parent) else Path("."))
    if not folder.is_dir():
        raise BadInputError(
            f"Cannot write {target}: {folder} is not a directory.",
            hint=f"Choose another path with {option}.",
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BadInputError(
            f"Cannot write {target}: the directory {folder} is not writable.",
            hint=f"Choose a writable path with {option}.",
        )
    return target


def check_outputs(
    paths: Iterable[str | os.PathLike[str]],
    *,
    force: bool,
    options: Sequence[str] | None = None,
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> list[Path]:
    """:func:`check_output` for each path, and no two naming the same file (e.g. ``-o``
    equal to an emitted format's file, or ``--format hf,hf``). ``options``: for each path,
    the flag that named it (default ``-o`` for all), which the hints name; ``inputs``: the
    files the command reads, which no output may replace."""
    seen: dict[str, Path] = {}
    checked = []
    for index, path in enumerate(paths):
        option = options[index] if options is not None else "-o"
        target = check_output(path, force=force, option=option, inputs=inputs)
        key = os.path.normcase(os.path.abspath(os.path.realpath(target)))
        if key in seen:
            raise BadInputError(
                f"Two outputs would be written to the same file {target}.",
                hint="Give -o another name, or list each --format once.",
            )
        seen[key] = target
        checked.append(target)
    return checked


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def remove_stale_temporaries(folder: Path, name: str) -> None:
    """Remove ``.<name>.memplan-<pid>-*.tmp`` files whose writer no longer runs."""
    prefix = f".{name}{_TMP_MARK}"
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
                continue
            pid_text = entry.name[len(prefix) :].split("-", 1)[0]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def refuse_existing(
    path: str | os.PathLike[str], *, force: bool = False, option: str = "-o"
) -> Path:
    """:func:`check_output` (the name callers used before it checked more than existence)."""
    return check_output(path, force=force, option=option)


def write_text_atomic(path: str | os.PathLike[str], text: str, *, force: bool = False) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one,
    never half of it. An existing file is kept unless ``force``; see the module doc."""
    return write_bytes_atomic(path, text.encode("utf-8"), force=force)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, force: bool = False) -> Path:
    """:func:`write_text_atomic` for bytes (images)."""
    target = check_output(path, force=force)
    try:
        return _write(target, data, force=force)
    except OSError as exc:
        raise BadInputError(
            f"Cannot write {target}: {exc.strerror or exc}.",
            hint="Choose another path with -o, or free space / fix permissions there.",
        ) from None


def _write(target: Path, data: bytes, *, force: bool) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent, target.name)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode) if force else _default_mode()
    except FileNotFoundError:
        mode = _default_mode()
    fd, tmp_name = tempfile.mkstemp(
        prefix=f".{target.name}{_TMP_MARK}{os.getpid()}-", suffix=".tmp", dir=target.parent
    )
    try:
        os.fchmod(fd, mode)  # mkstemp makes it 0600: give it the mode it will keep
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if force:
            os.replace(tmp_name, target)
        else:
            _link_exclusive(tmp_name, target, data, mode)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
    return target


def _link_exclusive(tmp_name: str, target: Path, data: bytes, mode: int) -> None:
    """Create ``target`` from ``tmp_name`` only if the name is free, atomically."""
    try:
        os.link(tmp_name, target)
        return
    except FileExistsError:
        raise _exists(target) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
    # No hard links here (some network and FAT file systems): O_EXCL still refuses a
    # file that appeared meanwhile; the content is written in one call.
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise _exists(target) from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _exists(target: Path) -> OutputExistsError:
    return OutputExistsError(
        f"{target} was created by someone else while memplan was writing it; it was kept.",
        hint="Pass --force to replace it, or choose another path with -o.",
    )


def write_outputs(outputs: Sequence[tuple[Path, str]], *, force: bool) -> list[Path]:
    """Write several files, all checked first (:func:`check_outputs`), so a refused run
    writes none of them."""
    check_outputs((path for path, _ in outputs), force=force)
    return [write_text_atomic(path, text, force=force) for path, text in outputs]
