"""The ``memplan`` command line: each command loads its input, calls one library function
and renders the result. Domain errors become one paragraph on stderr and an exit code in
one place (``memplan.cli.base.run_command``).

One module per command (``probe``, ``show`` with ``devices``, ``solve``, ``verify``, ``calibrate``,
``report``, ``check`` with ``init-check``); ``options`` holds what several share. This
module builds the app, registers them in ``--help`` order and handles signals."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Annotated, Any

import typer

from memplan.cli import calibrate, check, probe, report, show, solve, verify
from memplan.cli.base import state as _state
from memplan.cli.options import FORMATS_HELP
from memplan.errors import Interrupted
from memplan.version import __version__

__all__ = ["FORMATS_HELP", "app", "main"]

app = typer.Typer(
    name="memplan",
    help="Memory planner for PyTorch training: measure a model, pick micro-batch × "
    "accumulation × checkpointed layers that fit a budget, prove it with a real run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names, never cuts them
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memplan {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print version.")
    ] = False,
) -> None:
    _state["debug"] = debug


for _command in (
    probe.probe,
    show.show,
    solve.solve,
    verify.verify,
    report.report,
    show.devices,
    calibrate.calibrate,
):
    app.command()(_command)
check.register(app)


def _open_standard_streams() -> None:
    """A closed stdin, stdout or stderr (``2>&-``) opened on /dev/null: otherwise the next
    file memplan opens takes its number, and whatever writes to that stream (a warning from
    native code, a model's print under --json) writes into that file; and
    ``sys.__stderr__``, None then, made a writer like the others."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, name) is None:
            stream = open(  # noqa: SIM115 - the process's own stream, for its lifetime
                {"stdin": 0, "stdout": 1, "stderr": 2}[name],
                "r" if name == "stdin" else "w",
                closefd=False,
                encoding="utf-8",
            )
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)


class _QuietPipe:
    """A standard stream whose reader went away (``memplan solve ... | head``): the
    command's work goes on (its files are written, its exit code is its own) and what it
    prints after is dropped, the Python docs' recipe for ``BrokenPipeError`` (the stream's
    descriptor pointed at /dev/null) applied at the first failed write, not at the end."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what the pipe refused goes to /dev/null

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _quiet_pipes() -> None:
    """sys.stdout and sys.stderr as ``_QuietPipe``s (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _QuietPipe):
            setattr(sys, name, _QuietPipe(stream))


_deferred: list[int] = []
"""The signal that arrived while a module was being imported, if one did."""
_redelivering = threading.Event()


def _importing(frame: Any) -> bool:
    """Whether ``frame`` (or a caller of it) runs inside an ``import``."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _redeliver(signum: int, main_thread: int) -> None:
    """Deliver ``signum`` to the main thread again once it no longer imports."""
    while _importing(sys._current_frames().get(main_thread)):
        time.sleep(0.01)
    _redelivering.set()
    _thread.interrupt_main(signum)


def _interrupt(signum: int, frame: Any) -> None:
    """Raise ``Interrupted``, except inside an import: an exception raised there can land in
    native code that called back into Python (torch importing triton, whose nanobind
    extension turns it into a C++ exception and aborts the process: "terminate called
    after throwing an instance of 'nanobind::python_error'", exit 134). There the signal is
    noted and delivered again when the import has returned; a second signal meanwhile
    interrupts at once (a hung import stays interruptible)."""
    redelivered = _redelivering.is_set()
    _redelivering.clear()
    if _deferred and not redelivered:
        raise Interrupted(signum)  # asked twice
    if _importing(frame):
        if not _deferred:
            _deferred.append(signum)
        threading.Thread(
            target=_redeliver, args=(_deferred[0], threading.get_ident()), daemon=True
        ).start()
        return
    raise Interrupted(_deferred[0] if _deferred else signum)


def main() -> None:
    """Console-script entry point. SIGINT and SIGTERM unwind the command (so temporary files
    and child processes are cleaned up), print one line and exit 128 + the signal number:
    130 for Ctrl-C, 143 for SIGTERM."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    _open_standard_streams()
    _quiet_pipes()
    try:
        app()
    except (Interrupted, KeyboardInterrupt) as exc:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not print a traceback
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
        raise SystemExit(128 + signum) from None
    finally:
        # The command is over: a Ctrl-C during interpreter shutdown must not turn a finished
        # run into a death by SIGINT (rc -2); SIGTERM keeps its default action.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
