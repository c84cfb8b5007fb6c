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

import functools
import multiprocessing
import os
import sys
import traceback
import types
from dataclasses import dataclass
from multiprocessing.connection import Connection

from memplan.errors import EXIT_BAD_INPUT, MemplanError
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
    """The arguments of ``memplan.probe.probe_model`` for one check."""

    model_arg: str
    device: str
    precision: str
    layers: str | None = None
    device_profile: str | None = None
    micro_batches: tuple[int, ...] | None = None
    seq_len: int | None = None
    """Tokens per sample (``make_batch(batch_size, seq_len)``); None: the file's own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChildError:
    """A probe that failed in the child: memplan's error, or how the child ended."""

    message: str
    exit_code: int = EXIT_BAD_INPUT


class IsolatedProbeError(MemplanError):
    """The model's child process failed or ended without a result (exit code as reported)."""

    def __init__(self, message: str, *, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _probe(request: ProbeRequest) -> Profile:
    from memplan.probe import probe_model

    if request.seq_len is not None:
        from memplan.probe.seqgrid import probe_seq_grid

        probe_model = functools.partial(probe_seq_grid, seq_lens=(request.seq_len,))
    if request.micro_batches is None:
        return probe_model(
            request.model_arg,
            device=request.device,
            precision=request.precision,
            layers=request.layers,
            device_profile=request.device_profile,
        )
    return probe_model(
        request.model_arg,
        device=request.device,
        precision=request.precision,
        layers=request.layers,
        device_profile=request.device_profile,
        micro_batches=request.micro_batches,
    )


def _child_main(conn: Connection, request: ProbeRequest) -> None:
    """In the child: probe, send ``Profile`` or ``ChildError`` back, and return."""
    sys.stdout.flush()
    os.dup2(2, 1)  # the model's prints go to stderr; stdout may be --json
    sys.stdout = sys.stderr
    reply: Profile | ChildError
    try:
        reply = _probe(request)
    except MemplanError as exc:
        reply = ChildError(message=str(exc), exit_code=exc.exit_code)
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
        process.start()
    finally:
        sys.modules["__main__"] = main


def start_fork_server() -> None:
    """Start the fork server and wait until it has imported torch and the probe, rather than
    at the first probe (the benchmark does, so torch's import is not the first check's)."""
    process = _context().Process(target=_noop, daemon=True)
    _start(process)
    process.join()


def probe_isolated(request: ProbeRequest) -> Profile:
    """Probe in a child process and return the profile; else IsolatedProbeError with the
    child's memplan error (and its exit code), or naming how the child ended (exit 2)."""
    context = _context()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child_main, args=(send, request), daemon=True)
    _start(process)
    send.close()
    reply: Profile | ChildError | None
    try:
        reply = receive.recv()
    except EOFError:  # the child ended without a word
        reply = None
    except BaseException:  # Ctrl-C or SIGTERM in the parent: the child goes with it
        process.kill()
        raise
    finally:
        receive.close()
        process.join()
    if isinstance(reply, Profile):
        return reply
    if isinstance(reply, ChildError):
        raise IsolatedProbeError(reply.message, exit_code=reply.exit_code)
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
