"""Names a package loads on first use (PEP 562's module ``__getattr__``): the one home of
the loader that ``memplan``, ``memplan.run``, ``memplan.probe`` and ``memplan.integrations``
share, so that importing a package costs no torch (or training framework) import until one
of its names is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def loader(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each exported name to the
    module it lives in, relative to ``package`` (``"checkpoint"``) or absolute
    (``"memplan.run"``)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = home if home.startswith("memplan.") else f"{package}.{home}"
        return getattr(importlib.import_module(module), name)

    return __getattr__
