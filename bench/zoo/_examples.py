"""The model classes of ``examples/``, for zoo files that measure the same architecture at
other sizes: one definition of each model, in examples/, and no copy here.

``examples/`` is not a package, so a file there is loaded by path, once, under a name of
its own (``memplan_example_<stem>``)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(stem: str) -> ModuleType:
    """The module of ``examples/<stem>.py``."""
    name = f"memplan_example_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{stem}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
