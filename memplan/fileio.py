"""Atomic, non-clobbering file writes: a temporary file in the target folder, then rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from memplan.errors import OutputExistsError


def write_text_atomic(path: str | os.PathLike[str], text: str, *, force: bool = False) -> Path:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one,
    never half of it. An existing file is kept unless ``force``."""
    target = Path(path)
    if target.exists() and not force:
        raise OutputExistsError(
            f"{target} already exists; memplan does not overwrite files silently.",
            hint="Pass --force to replace it, or choose another path with -o.",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        # mkstemp creates the file 0600; give it the mode a plain open() would (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target
