"""Atomic, non-clobbering file writes: a temporary file in the target folder, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from memplan.errors import OutputExistsError


def refuse_existing(path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Raise OutputExistsError when ``path`` exists and ``force`` is not given (so a
    command can refuse before it does any work)."""
    target = Path(path)
    if target.exists() and not force:
        raise OutputExistsError(
            f"{target} already exists; memplan does not overwrite files silently.",
            hint="Pass --force to replace it, or choose another path with -o.",
        )
    return target


def write_text_atomic(path: str | os.PathLike[str], text: str, *, force: bool = False) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one,
    never half of it. An existing file is kept unless ``force``."""
    return write_bytes_atomic(path, text.encode("utf-8"), force=force)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, force: bool = False) -> Path:
    """``write_text_atomic`` for bytes (images)."""
    target = refuse_existing(path, force=force)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target
