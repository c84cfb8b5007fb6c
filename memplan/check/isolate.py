"""Run one probe in a child process, so a model file cannot take ``memplan check`` down.

A model file is code, run with the user's rights. It can ``sys.exit(0)`` at import (which
would end the gate with exit 0: a pass nobody earned), ``os._exit`` (no exception, no
cleanup, no report), or ``sys.exit(3)`` (which would pose as memplan's own "cannot
measure"). So each probe runs in a child process and only a result the child sends back
counts: a profile, or a memplan error with its exit code. A child that ends in any other way
is an error for that check alone, named for what happened, and the parent goes on with the
next check and writes every report.

The children are forked from a ``multiprocessing`` fork server that imports torch and the
probe once (``set_forkserver_preload``), so a check pays torch's import once per run, not
once per check. In the child, stdout is pointed at stderr: a model that prints cannot break
``--json`` on stdout.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from memplan.errors import EXIT_BAD_INPUT, EXIT_CANNOT_MEASURE, MemplanError, exit_code_of
from memplan.probe.settings import ProbeSettings
from memplan.profile import Profile

# Imported once by the fork server, so every child starts with them: torch and the probe,
# and what the first probe would otherwise import lazily (torch._dynamo via the optimizer's
# constructor: 2 s of a 2.8 s first probe of a tiny model, measured).
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.optim",
    "torch.profiler",
    "torch.utils.checkpoint",
    "memplan.probe",
    "memplan.check.isolate",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeRequest:
    """One check's probe: the model, how to probe it, and its time limit."""

    model_arg: str
    settings: ProbeSettings
    seq_len: int | None = None
    """Tokens per sample (``make_batch(batch_size, seq_len)``); None: the file's own."""
    timeout_s: float | None = field(default=None, compare=False)
    """Seconds the probe may take before its process is killed and the check is an error
    naming the phase it was in; None: no limit. Not part of what makes two probes the same."""


@dataclass(frozen=True, slots=True)
class Phase:
    """Sent by the child as it enters the user's code or finishes a probe step."""

    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildError:
    """A probe that failed in the child: memplan's error, or how the child ended."""

    message: str
    exit_code: int = EXIT_BAD_INPUT


class IsolatedProbeError(MemplanError):
    """The model's child process failed or ended without a result (exit code as reported)."""

    def __init__(
        self, message: str, *, exit_code: int = EXIT_BAD_INPUT, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.exit_code = exit_code


def _probe(request: ProbeRequest, on_progress: Callable[[int, int, str], None]) -> Profile:
    from memplan.probe import probe_model

    if request.seq_len is not None:
        from memplan.probe.seqgrid import probe_seq_grid

        probe_model = functools.partial(probe_seq_grid, seq_lens=(request.seq_len,))
    s = request.settings
    return probe_model(
        request.model_arg,
        device=s.device,
        micro_batches=s.micro_batches,
        precision=s.precision,
        layers=s.layers,
        device_profile=s.device_profile,
        mixed_precision=s.mixed_precision,
        reuse_identical=s.reuse_identical,
        timing_rounds=s.timing_rounds,
        on_progress=on_progress,
    )


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return type(exc).__name__


def _child_main(conn: Connection, request: ProbeRequest) -> None:
    """In the child: probe, send ``Profile`` or ``ChildError`` back, and return."""
    from memplan.model.loader import observe_calls

    sys.stdout.flush()
    os.dup2(2, 1)  # the model's prints go to stderr; stdout may be --json
    sys.stdout = sys.stderr
    with contextlib.suppress(OSError):
        os.setsid()  # its own process group: a timeout kills the model's children with it
    if request.timeout_s is not None:  # should the parent die without killing it
        signal.alarm(int(request.timeout_s) + 60)
    step = ""

    def entering(what: str) -> None:
        conn.send(Phase(f"{what}{step}"))

    def progress(done: int, total: int, what: str) -> None:
        nonlocal step
        step = f" (probe step {done} of {total} done: {what})"
        conn.send(Phase(f"measuring{step}"))

    reply: Profile | ChildError
    try:
        with observe_calls(entering):
            reply = _probe(request, progress)
    except MemplanError as exc:
        reply = ChildError(message=_text(exc), exit_code=exit_code_of(exc))
    except SystemExit as exc:
        code = exc.code if exc.code is not None else 0
        reply = ChildError(
            message=f"{request.model_arg}: the model file called sys.exit({code!r}) while "
            "memplan probed it. A model file must not end the process: define "
            "build_model() and make_batch() and let memplan call them."
        )
    except BaseException as exc:  # a bug in memplan or an exception the loader let through
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        reply = ChildError(message=f"{request.model_arg}: probing failed: {last}")
    conn.send(reply)
    conn.close()


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _noop() -> None:
    return None


def _start(process: multiprocessing.process.BaseProcess) -> None:
    # multiprocessing re-runs the parent's main module in each child (pytest, the memplan
    # script); the child needs none of it, only its target, pickled by reference.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        with _stdout_withheld():
            process.start()
    finally:
        sys.modules["__main__"] = main


@contextlib.contextmanager
def _stdout_withheld() -> Iterator[None]:
    """File descriptor 1 on /dev/null while processes start: the fork server and the resource
    tracker that the first start launches (and that live on while any process they served
    lives, such as one the model forked) never hold memplan's stdout, so `memplan check
    --json | cat` ends when memplan does. The children write to stderr anyway."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.__stdout__.flush()  # type: ignore[union-attr]
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to withhold
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def start_fork_server() -> None:
    """Start the fork server and wait until it has imported torch and the probe, rather than
    at the first probe (the benchmark does, so torch's import is not the first check's)."""
    process = _context().Process(target=_noop, daemon=True)
    _start(process)
    process.join()


def probe_isolated(request: ProbeRequest) -> Profile:
    """Probe in a child process and return the profile; else IsolatedProbeError with the
    child's memplan error (and its exit code), naming how the child ended (exit 2), or
    naming the phase it was in when ``request.timeout_s`` ran out (exit 3).

    The parent waits on the pipe *and* the child's end, never on the pipe alone: a process
    the model forked keeps the pipe open after the child is gone, and must not hold up the
    run."""
    context = _context()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child_main, args=(send, request), daemon=True)
    _start(process)
    send.close()
    timeout = request.timeout_s
    deadline = None if timeout is None else time.monotonic() + timeout
    phase = Phase(f"importing {request.model_arg}")
    reply: object = None
    timed_out = False
    try:
        while reply is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                timed_out = True
                break
            ready = wait([receive, process.sentinel], timeout=left)
            if receive in ready:
                message = _receive(receive)
                if isinstance(message, Phase):
                    phase = message
                elif message is not None:
                    reply = message
                else:
                    break  # the pipe closed: the child (and all it forked) ended
            elif process.sentinel in ready:
                for _ in range(10_000):  # what it sent before it ended, if anything
                    if reply is not None or not receive.poll(0):
                        break
                    message = _receive(receive)
                    reply = None if isinstance(message, Phase) else message
                    if message is None:
                        break
                break
    except BaseException:  # Ctrl-C or SIGTERM in the parent: the child goes with it
        _kill(process)
        raise
    finally:
        receive.close()
        if timed_out:
            _kill(process)
        process.join(timeout=10)
        if process.is_alive():  # sent its result, then would not end (a thread it started)
            _kill(process)
        else:  # what the model started in the child's process group ends with the probe
            _kill_group(process)
    if timed_out:
        raise IsolatedProbeError(
            f"{request.model_arg}: the probe did not finish within the check's timeout of "
            f"{timeout:g} s; it was in {phase.text[:300]}. memplan stopped it.",
            exit_code=EXIT_CANNOT_MEASURE,
            hint="If the model is just slow here, raise the limit (timeout: SECONDS in the "
            "check's memplan.yaml entry, or memplan check --timeout SECONDS); if it hangs, "
            "run it with `memplan probe` to see where.",
        )
    if isinstance(reply, Profile):
        return reply
    if isinstance(reply, ChildError):
        # An error result is exit 2 or 3, whatever the child said (a check in error never
        # rolls up to 0, and "over budget" is the solver's verdict, made in this process).
        code = reply.exit_code if reply.exit_code == EXIT_CANNOT_MEASURE else EXIT_BAD_INPUT
        raise IsolatedProbeError(str(reply.message)[:4000], exit_code=code)
    if reply is not None:
        raise IsolatedProbeError(
            f"{request.model_arg}: the process probing this model sent "
            f"{type(reply).__name__}, not a result; something in the model wrote to "
            "memplan's result pipe."
        )
    code = process.exitcode
    how = (
        f"was killed by signal {-code}"
        if code is not None and code < 0
        else (f"ended with exit code {code}")
    )
    raise IsolatedProbeError(
        f"{request.model_arg}: the process probing this model {how} before it reported a "
        "result (os._exit, a crash in native code, or the kernel's out-of-memory killer). "
        "The model file must not end the process; run it with `memplan probe` to see where."
    )


def _receive(receive: Connection) -> object:
    """The next message from the child; None when the pipe is closed or what came is not
    a message (bytes the model wrote to the pipe itself)."""
    try:
        return receive.recv()
    except EOFError:
        return None
    except Exception:
        return b""


def _kill_group(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL what is left of the finished child's process group (the child made it with
    ``setsid``; a process the model forked stays in it unless it left on purpose)."""
    pid = process.pid
    if pid is not None and process.exitcode is not None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _kill(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL the child and its process group (what the model started, unless it left the
    group on purpose)."""
    pid = process.pid
    if pid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.kill()
