"""What every ``memplan`` command shares: the ``--debug`` state and ``run_command``, which
maps a ``MemplanError`` (and only it) to one paragraph on stderr and its exit code. Every
command module imports it; none imports ``memplan.cli`` itself, which registers them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from memplan.errors import (
    MemplanError,
    ModelFileError,
    checkpointing_failure,
    exit_code_of,
    first_line,
)

state = {"debug": False}
"""Set by the app callback from ``--debug``."""

F = TypeVar("F", bound=Callable[..., Any])


def run_command(func: F) -> F:
    """Map MemplanError (and a failure of checkpointing's recompute) to its exit code
    with a clean message; Python warnings raised meanwhile (memplan's own and the libraries'
    the model uses) print through memplan's renderer, once each."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from memplan import render

        render.reset_warnings()
        try:
            with render.warnings_rendered():
                return func(*args, **kwargs)
        except MemplanError as exc:
            code = exit_code_of(exc)
            if not type(exc).__module__.startswith("memplan."):
                exc = _foreign(exc)  # a model file's own MemplanError subclass: exit 2
            render.error(exc, debug=state["debug"])
            raise typer.Exit(code) from None
        except Exception as exc:
            # Checkpointing's recompute runs inside the backward, outside every call into
            # the user's code that the loader wraps: it is named here as a last resort.
            known = checkpointing_failure(exc, "the model")
            if known is None:
                raise
            render.error(known, debug=state["debug"])
            raise typer.Exit(known.exit_code) from None

    return wrapper  # type: ignore[return-value]


def _foreign(exc: MemplanError) -> ModelFileError:
    """A ``MemplanError`` subclass that is not memplan's (a model file defined it and it
    escaped where no loader call wraps the user's code, e.g. a custom autograd backward) as
    the model file's error, its text cut short and read without trusting its ``__str__``."""
    try:
        text = first_line(exc)
    except Exception:
        text = ""
    text = text if len(text) <= 300 else text[:297] + "..."
    return ModelFileError(
        f"the model's code raised {type(exc).__name__}" + (f": {text}" if text else ""),
        hint="An error raised by the model file is the model file's (exit 2), whatever its class.",
    )
