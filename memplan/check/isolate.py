"""Run one probe in a child process, so a model file cannot take ``memplan check`` down.

A model file is code, run with the user's rights. It can ``sys.exit(0)`` at import (which
would end the gate with exit 0: a pass nobody earned), ``os._exit`` (no exception, no
cleanup, no report), or ``sys.exit(3)`` (which would pose as memplan's own "cannot
measure"). So each probe runs in a child process and only a result the child sends back
counts: a profile, or a memplan error with its exit code. A child that ends in any other way
is an error for that check alone, named for what happened, and the parent goes on with the
next check and writes every report.

What the child sends is data, never a pickle: a pickle is code to whoever loads it, and a
model file can reach the pipe (``gc.get_objects()`` finds the ``Connection``) and send an
object whose ``__reduce__`` ends memplan with the exit code of its choice. Each message is
a tag byte, a length and that many bytes: a phase's text, a profile's YAML (read back as
any profile file is, ``profile_from_data``) or an error's JSON. The parent reads the pipe's
bytes itself, never waiting on a message that is only half there, and whatever does not
read as one of those three is an error for that check alone, naming the model file.

The children are forked from a ``multiprocessing`` fork server that imports torch and the
probe once (``set_forkserver_preload``), so a check pays torch's import once per run, not
once per check. In the child, stdout is pointed at stderr: a model that prints cannot break
``--json`` on stdout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import signal
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from memplan.errors import EXIT_BAD_INPUT, EXIT_CANNOT_MEASURE, MemplanError, exit_code_of
from memplan.files.schema import gc_paused, safe_load
from memplan.probe.settings import ProbeSettings
from memplan.profile import Profile, profile_from_data, profile_to_yaml

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

# The result pipe's messages: a tag, the payload's length (8 bytes, big-endian), the payload.
_HEADER = struct.Struct("!cQ")
_PHASE, _PROFILE, _ERROR = b"S", b"P", b"E"
MAX_MESSAGE_BYTES = 1 << 31
"""The longest message the parent takes (a profile's YAML: a 10,000-layer profile is tens
of MiB); a longer length is garbage in the pipe, not a result."""


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


def _send(conn: Connection, tag: bytes, payload: bytes) -> None:
    """One message to the parent: ``tag``, the payload's length, the payload (plain bytes,
    written to the pipe's descriptor: nothing the parent reads is ever unpickled)."""
    data = memoryview(_HEADER.pack(tag, len(payload)) + payload)
    fd = conn.fileno()
    while data:
        data = data[os.write(fd, data) :]


def _child_main(conn: Connection, request: ProbeRequest) -> None:
    """In the child: probe, send the profile's YAML or a ``ChildError`` back, and return."""
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
        _send(conn, _PHASE, f"{what}{step}".encode("utf-8", "replace"))

    def progress(done: int, total: int, what: str) -> None:
        nonlocal step
        step = f" (probe step {done} of {total} done: {what})"
        _send(conn, _PHASE, f"measuring{step}".encode("utf-8", "replace"))

    reply: ChildError | None = None
    try:
        with observe_calls(entering):
            profile = _probe(request, progress)
        text = profile_to_yaml(profile)  # refuses a profile memplan would not read (exit 3)
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
    if reply is None:
        _send(conn, _PROFILE, text.encode("utf-8", "surrogatepass"))
    else:
        error = {"message": reply.message, "exit_code": reply.exit_code}
        _send(conn, _ERROR, json.dumps(error).encode("ascii"))
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


def _start_child(
    context: multiprocessing.context.BaseContext, send: Connection, request: ProbeRequest
) -> multiprocessing.process.BaseProcess:
    """Start ``request``'s child; if the fork server is gone (a model killed it: the child's
    parent is the fork server, so ``os.kill(os.getppid(), SIGTERM)`` reaches it), stop what
    is left of it and try once more on a fresh one, so that one model file fails its own
    check only and not the next one's start."""
    for attempt in (1, 2):
        process = context.Process(target=_child_main, args=(send, request), daemon=True)
        try:
            _start(process)
            return process
        except (EOFError, OSError) as exc:
            if attempt == 2:
                raise IsolatedProbeError(
                    f"{request.model_arg}: memplan could not start the process to probe this "
                    f"model: its fork server failed twice ({type(exc).__name__}: {exc}).",
                    exit_code=EXIT_CANNOT_MEASURE,
                    hint="Run the check again; if it fails the same way, run the model with "
                    "`memplan probe` to see whether it ends other processes.",
                ) from None
            restart_fork_server()
    raise AssertionError("unreachable")  # pragma: no cover


def restart_fork_server() -> None:
    """Stop multiprocessing's fork server (it is this process's child), so the next start
    launches a fresh one. It is killed first: a healthy one would wait for every process
    that holds its "alive" pipe, and one a model's child signalled may be dying but not yet
    reaped, which ``ensure_running`` takes for alive. Nothing probes while this runs."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is None or pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    try:
        server._stop()  # closes its end of the alive pipe, reaps it, removes its socket
    except Exception:  # already reaped, or another Python's internals: start afresh anyway
        for name in ("_forkserver_pid", "_forkserver_alive_fd", "_forkserver_address"):
            with contextlib.suppress(Exception):
                setattr(server, name, None)


class _Inbox:
    """The child's messages, read from the pipe's bytes as they come (never blocking on a
    message that is only half there, so the timeout holds whatever the model writes)."""

    def __init__(self, receive: Connection, model_arg: str) -> None:
        self.fd = receive.fileno()
        os.set_blocking(self.fd, False)
        self.model_arg = model_arg
        self.buffer = bytearray()
        self.closed = False
        self.garbled = False

    def fill(self) -> None:
        """Read what the pipe holds now; ``closed`` once every writer is gone."""
        for _ in range(64):  # at most 64 MiB a call: the caller checks the time between
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self.buffer += chunk

    def take(self, phase: Phase) -> tuple[Profile | ChildError | None, Phase]:
        """(the result, if one has come whole; the latest phase)."""
        while len(self.buffer) >= _HEADER.size:
            tag, length = _HEADER.unpack_from(self.buffer)
            if tag not in (_PHASE, _PROFILE, _ERROR) or length > MAX_MESSAGE_BYTES:
                return self._garbage("bytes that are not one of memplan's messages"), phase
            end = _HEADER.size + length
            if len(self.buffer) < end:
                break
            payload = bytes(self.buffer[_HEADER.size : end])
            del self.buffer[:end]
            if tag == _PHASE:
                phase = Phase(payload[:2000].decode("utf-8", "replace"))
            else:
                return self._decode(tag, payload), phase
        if self.closed and self.buffer:
            return self._garbage("half a message"), phase
        return None, phase

    def _decode(self, tag: bytes, payload: bytes) -> Profile | ChildError:
        """A result from untrusted bytes: read as strictly as a file a user hands memplan."""
        if tag == _ERROR:
            try:
                data = json.loads(payload)
            except (ValueError, RecursionError):
                data = None
            ok = isinstance(data, dict) and set(data) == {"message", "exit_code"}
            message, code = (data["message"], data["exit_code"]) if ok else (None, None)
            if not isinstance(message, str) or type(code) is not int:
                return self._garbage("an error result that does not read as one")
            return ChildError(message=message, exit_code=code)
        try:
            with gc_paused():
                data = safe_load(payload.decode("utf-8", "surrogatepass"))
                if not isinstance(data, dict):
                    raise ValueError(f"a YAML {type(data).__name__}, not a mapping")
                return profile_from_data(data, source="the profile")
        except MemplanError as exc:
            what = exc.message
        except Exception as exc:  # YAML, Unicode, nesting: whatever the bytes were
            what = f"{type(exc).__name__}: {_text(exc)}"
        return self._garbage(f"a profile memplan cannot read ({what[:500].rstrip('.')})")

    def _garbage(self, what: str) -> ChildError:
        self.garbled = True
        return ChildError(
            message=f"{self.model_arg}: the process probing this model sent {what}, not a "
            "result; something in the model wrote to memplan's result pipe, so memplan "
            "stopped it. A model file must only define the model, its batches and its loss "
            "and leave memplan's processes and pipes alone."
        )


def probe_isolated(request: ProbeRequest) -> Profile:
    """Probe in a child process and return the profile; else IsolatedProbeError with the
    child's memplan error (and its exit code), naming how the child ended (exit 2), what it
    sent that is not a result (exit 2), or the phase it was in when ``request.timeout_s``
    ran out (exit 3).

    The parent waits on the pipe *and* the child's end, never on the pipe alone: a process
    the model forked keeps the pipe open after the child is gone, and must not hold up the
    run."""
    context = _context()
    receive, send = context.Pipe(duplex=False)
    try:
        process = _start_child(context, send, request)
    except BaseException:
        receive.close()
        raise
    finally:
        send.close()
    timeout = request.timeout_s
    deadline = None if timeout is None else time.monotonic() + timeout
    phase = Phase(f"importing {request.model_arg}")
    reply: Profile | ChildError | None = None
    timed_out = False
    inbox = _Inbox(receive, request.model_arg)
    try:
        while reply is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                timed_out = True
                break
            ready = wait([receive, process.sentinel], timeout=left)
            if receive in ready:
                inbox.fill()
                reply, phase = inbox.take(phase)
                if reply is None and inbox.closed:
                    break  # the pipe closed: the child (and all it forked) ended
            elif process.sentinel in ready:
                for _ in range(16):  # what it sent before it ended, if anything
                    inbox.fill()
                    reply, phase = inbox.take(phase)
                    if reply is not None or inbox.closed or not inbox.buffer:
                        break
                break
    except BaseException:  # Ctrl-C or SIGTERM in the parent: the child goes with it
        _kill(process)
        raise
    finally:
        receive.close()
        if timed_out or inbox.garbled:
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
    code = process.exitcode
    how = (
        f"was killed by signal {-code}"
        if code is not None and code < 0
        else (f"ended with exit code {code}")
    )
    raise IsolatedProbeError(
        f"{request.model_arg}: the process probing this model {how} before it reported a "
        "result (os._exit, a crash in native code, the kernel's out-of-memory killer, or "
        "a signal to memplan's fork server, its parent). The model file must not end a "
        "process; run it with `memplan probe` to see where."
    )


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
