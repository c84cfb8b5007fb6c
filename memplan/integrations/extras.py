"""The optional frameworks the integrations drive, and the extra that installs each."""

from __future__ import annotations

import importlib
from types import ModuleType

from memplan.errors import MissingExtraError

EXTRAS = {
    "transformers": "hf",
    "lightning": "lightning",
    "accelerate": "accelerate",
}
"""Framework package -> the memplan extra that installs it (pyproject.toml)."""


def require(package: str, what: str) -> ModuleType:
    """``package`` imported, or MissingExtraError naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        extra = EXTRAS.get(package.split(".")[0], package)
        raise MissingExtraError(
            f"{what} needs {package.split('.')[0]}, which is not installed here ({exc}).",
            hint=f"Install it with: pip install 'memplan[{extra}]'",
        ) from exc
