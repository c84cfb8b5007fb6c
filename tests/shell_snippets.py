"""Reading an emitted bash snippet as bash reads it (shared by the emitter tests)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def shell_words(text: str, variable: str, tmp_path: Path) -> list[str]:
    """The words ``$variable`` expands to once bash has sourced ``text``."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed: the emitted snippet is a bash snippet")
    path = tmp_path / "snippet.sh"
    path.write_text(text)
    out = subprocess.run(
        ["bash", "-c", f'. "$1" && printf "%s\\0" ${variable}', "_", str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,  # where a snippet writes its files (a float8 config module)
    ).stdout
    return out.split("\0")[:-1]
