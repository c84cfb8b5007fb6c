"""How the ranks of ``memplan verify --world-size N`` and their run folder end with the
``memplan`` process that started them, however it ends.

* Normal end, exception, SIGINT or SIGTERM: the parent kills its ranks and removes the
  folder itself (``memplan.distributed``).
* SIGKILL of the parent: it can do nothing. The kernel kills every rank at once
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, see prctl(2): SIGKILL, because a rank blocked in a
  gloo collective sits in C++, where a Python SIGTERM handler never runs). A *reaper*, a
  small Python process without torch started next to the ranks, sees the parent's end of a
  pipe close without the word ``done``, kills any rank still there (a rank still importing
  torch has not armed its death signal yet), waits for them and removes the folder.
* The reaper itself killed too (``kill -9`` of the whole process group): each run folder
  names its owner's pid in ``owner``, and the next distributed verify removes the folders of
  owners that are gone (``sweep_orphaned_folders``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from memplan.errors import BadInputError, CannotMeasureError, MemplanError

_REAL_EXIT = os._exit
"""The rank's own way out (``die_with_parent``), taken before the model file's code runs
under ``loader.contain_exits``, which replaces ``os._exit`` to catch the model's exits."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest run ``verify --timeout`` takes (7 days): the process group's timeout is held
in milliseconds by gloo (1e10 s raised DistNetworkError) and Python's timedelta ends near
1e14 s (1e15 s raised OverflowError)."""
PREFIX = "memplan-dist-"
OWNER_FILE = "owner"
"""In each run folder: the pid of the ``memplan`` process that made it."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The reaper's whole program (run with ``python -I -c``: no torch, no memplan import, so it
# starts in milliseconds). argv[1] is the folder; stdin carries rank pids, one line each,
# then "done" once the parent has ended its ranks itself. At end of input (the parent exited
# or died) it kills ranks not declared done, waits for them, and removes the folder.
_REAPER = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: not ours
folder, pids, done = sys.argv[1], [], False
for line in sys.stdin:
    word = line.strip()
    if word == "done":
        done = True
    elif word.isdigit():
        pids.append(int(word))

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True

def is_rank(pid):  # a pid freed and taken again by another program is left alone
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True

if not done:
    for pid in pids:
        if alive(pid) and is_rank(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
for _ in range(50):
    shutil.rmtree(folder, ignore_errors=True)
    if not os.path.exists(folder):
        break
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return stat.rsplit(b")", 1)[1].split()[0] != b"Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def sweep_orphaned_folders(parent: Path | None = None) -> list[Path]:
    """Remove this user's run folders whose owner process is gone (left by a SIGKILL that
    also took the reaper). Folders without an ``owner`` file are left alone: they belong to
    a run that is just starting, or to an older memplan. Returns what it removed."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(PREFIX + "*"):
        with contextlib.suppress(OSError, ValueError):
            if folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            owner = int((folder / OWNER_FILE).read_text().strip())
            if owner != os.getpid() and not _alive(owner):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


class RunFolder:
    """The temporary folder of one distributed run, with its reaper (see the module doc).

    ``with RunFolder() as run:`` makes the folder and starts the reaper; ``run.watch(pids)``
    hands it the ranks; ``run.ranks_ended()`` says the parent has ended them itself; leaving
    the block removes the folder and lets the reaper go."""

    def __init__(self) -> None:
        sweep_orphaned_folders()
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX))
        (self.path / OWNER_FILE).write_text(f"{os.getpid()}\n")
        self._reaper: subprocess.Popen[bytes] | None = None
        with contextlib.suppress(OSError):
            self._reaper = subprocess.Popen(
                [sys.executable, "-I", "-c", _REAPER, str(self.path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def _tell(self, text: str) -> None:
        if self._reaper is not None and self._reaper.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self._reaper.stdin.write(text.encode())
                self._reaper.stdin.flush()

    def watch(self, pids: Iterable[int | None]) -> None:
        self._tell("".join(f"{pid}\n" for pid in pids if pid))

    def ranks_ended(self) -> None:
        self._tell("done\n")

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        reaper = self._reaper
        if reaper is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if reaper.stdin is not None:
                reaper.stdin.close()
        try:
            reaper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()


def die_with_parent(parent_pid: int, folder: Path) -> None:
    """Called first in each rank: a rank must not outlive the ``memplan verify`` that
    started it. Linux: the kernel sends SIGKILL when the parent dies (PR_SET_PDEATHSIG; the
    reaper then removes the folder). Elsewhere a thread watches the parent pid and the rank
    removes the folder and exits 143 itself. A SIGTERM sent to a rank by someone else ends it
    the same way, without the traceback a KeyboardInterrupt in atexit would print. Ctrl-C
    reaches the whole process group: ranks ignore it and let the parent end them."""

    def parent_gone(signum: int = signal.SIGTERM, frame: Any = None) -> None:
        if os.getppid() != parent_pid:  # else the parent ended us and reads the folder
            shutil.rmtree(folder, ignore_errors=True)
        _REAL_EXIT(128 + signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, parent_gone)
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != parent_pid:  # it died before the line above took effect
        parent_gone()
    if not armed:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            parent_gone()

        threading.Thread(target=watch, daemon=True).start()


RANK_BYTES = 256 * 2**20
"""The least one CPU rank takes: a Python process with torch imported and a gloo group up
(its resident size before the model is built)."""


def startable_cpu_ranks() -> int:
    """How many CPU ranks this machine can start: its available memory over ``RANK_BYTES``,
    within the process limit (RLIMIT_NPROC); at least 2."""
    available = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        try:
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 2 * RANK_BYTES
    most = available // RANK_BYTES
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY:
            most = min(most, soft)
    return max(2, most)


def warning_text(caught: warnings.WarningMessage) -> str:
    """A warning a rank caught, as one line (its category named unless a UserWarning)."""
    text = str(caught.message).removeprefix("memplan: ")
    if caught.category is not UserWarning:
        text = f"{text} ({caught.category.__name__})"
    return text


def rank_warnings(per_rank: list[list[str]]) -> list[str]:
    """Each distinct warning the ranks raised, once, in the order first raised, with the
    ranks that raised it: ``"… (ranks 0, 1)"``; ``"… (all 4 ranks)"`` when every rank did."""
    ranks: dict[str, list[int]] = {}
    for rank, texts in enumerate(per_rank):
        for text in dict.fromkeys(texts):
            ranks.setdefault(text, []).append(rank)
    world = len(per_rank)
    return [
        f"{text} (all {world} ranks)"
        if len(who) == world and world > 1
        else f"{text} (rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))})"
        for text, who in ranks.items()
    ]


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Ctrl-C ignored while the ranks are started: each rank inherits SIGINT ignored (a
    handler would not survive its exec, and spawn resets the signal mask), and Python then
    installs no KeyboardInterrupt of its own, so a Ctrl-C while a rank imports torch, before
    ``die_with_parent``, no longer prints its traceback. The parent's window is the spawn
    calls alone (milliseconds); it takes Ctrl-C again before it waits for its ranks."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def model_exits_contained(config: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """In a rank, the model file's ``sys.exit``/``os._exit`` become its error (exit 2 naming
    the file, ``loader.contain_exits``), as in one process; before, ``os._exit(0)`` ended the
    rank without a result and a peer's "Connection reset by peer" was blamed."""
    if not config.get("model"):
        return contextlib.nullcontext()
    from memplan.model.loader import contain_exits

    return contain_exits(str(config["model"]))


def join_group(rank: int, config: dict[str, Any], backend: str = "gloo") -> None:
    """A rank started by the launcher joins its process group: the launcher's loopback
    port, world size and timeout (``config``, at most ``MAX_TIMEOUT_S``), over ``backend``.
    First it sets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), before the model file is imported: a file that reads it runs
    here as under the emitted torchrun script."""
    from datetime import timedelta

    import torch.distributed as dist

    world = int(config["world_size"])
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(config["port"]),
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{config['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=min(float(config["timeout_s"]), MAX_TIMEOUT_S)),
    )


# --------------------------------------------------------------------------- how ranks ended
def reported_before_teardown(folder: Path, world: int, rank: int) -> bool:
    """Whether a rank that died had passed the final barrier (``rank<r>.done``) and every
    rank had written a result without an error: then it died tearing gloo down (torch's
    "terminate called without an active exception" at ``destroy_process_group`` or exit,
    seen under load), after every figure was in."""
    if not (folder / f"rank{rank}.done").is_file():
        return False
    for r in range(world):
        path = folder / f"rank{r}.json"
        if not path.is_file():
            return False
        try:
            data = json.loads(path.read_text() or "{}")
        except ValueError:
            return False
        if "error" in data:
            return False
    return True


def _by_signal(code: int) -> bool:
    """Whether a rank's exit code says a signal ended it (negative: the signal; 143:
    ``die_with_parent``'s exit on SIGTERM)."""
    return code < 0 or code == 128 + signal.SIGTERM


def _how(rank: int, code: int) -> str:
    """How a rank's process ended, from its exit code."""
    if _by_signal(code):
        number = -code if code < 0 else int(signal.SIGTERM)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        return f"rank {rank} was killed by signal {name}"
    return f"rank {rank} exited with code {code}"


def wait_for_ranks(
    processes: list[Any], folder: Path, timeout_s: float, model: str | None = None
) -> str:
    """Wait until every rank has ended with its result, or ``timeout_s``. Returns '' or,
    for a rank that died tearing gloo down after every rank reported
    (``reported_before_teardown``), the warning that says so; else a rank that failed
    (a non-zero exit, or any exit without its ``rank<r>.json``) raises ``rank_failure``."""
    from multiprocessing.connection import wait

    world = len(processes)
    deadline = time.monotonic() + timeout_s
    ended: dict[int, int] = {}  # rank: exit code, in the order seen
    while True:
        for rank, process in enumerate(processes):
            if rank not in ended and process.exitcode is not None:
                ended[rank] = int(process.exitcode)
        failed = [
            r for r, code in ended.items() if code or not (folder / f"rank{r}.json").is_file()
        ]
        if failed:
            first = failed[0]
            if ended[first] and reported_before_teardown(folder, world, first):
                return (
                    f"{_how(first, ended[first])} while tearing down its process group, after "
                    "every rank had reported and met at the final barrier: the figures stand"
                )
            raise rank_failure(folder, world, ended, model)
        if len(ended) == world:
            return ""
        left = deadline - time.monotonic()
        if left <= 0:
            raise CannotMeasureError(
                f"The {world}-rank run did not finish within {timeout_s:g} s; its "
                "processes were killed.",
                hint="A rank may wait on a collective another never reached; raise "
                "--timeout for a slow model.",
            )
        wait([p.sentinel for r, p in enumerate(processes) if r not in ended], min(1.0, left))


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
"""gloo's words for a peer that went away: a consequence of another rank's failure."""


def rank_failure(
    folder: Path, world: int, ended: dict[int, int], model: str | None = None
) -> MemplanError:
    """The clearest account of a failed run, its cause before its consequences: first a rank
    that ended without writing its result (in the order the ranks were seen to end: killed
    by a signal, exit 3; an exit of its own, the model file's, exit 2); else the rank whose
    error came first, a peer's "Connection reset by peer" after any other error."""
    for rank, code in ended.items():
        if not (folder / f"rank{rank}.json").is_file():
            return _died(rank, world, code, model)
    errors = []
    for rank in range(world):
        data = {}
        with contextlib.suppress(OSError, ValueError):  # (a rank still writing it)
            data = json.loads((folder / f"rank{rank}.json").read_text() or "{}")
        if "error" in data:
            peer = any(words in data["error"] for words in _PEER_GONE)
            errors.append((peer, float(data.get("time", 0.0)), rank, data))
    if not errors:
        rank, code = next(iter(ended.items()))
        return CannotMeasureError(f"A rank died: {_how(rank, code)}.")
    _, _, rank, data = min(errors, key=lambda error: error[:3])
    if data.get("bad_input"):  # the model file or plan, not the run: exit 2
        message = data.get("message", data["error"])
        return BadInputError(f"Rank {rank} of {world} failed: {message}")
    tail = "\n".join(data.get("trace", "").strip().splitlines()[-6:])
    return CannotMeasureError(
        f"Rank {rank} of {world} failed: {data['error']}",
        hint=f"The run stopped (rank {rank} raised) and the other ranks were killed. "
        f"Its traceback ends:\n{tail}",
    )


def _died(rank: int, world: int, code: int, model: str | None) -> MemplanError:
    """A rank that ended without its result: what ended it, named."""
    how = f"{_how(rank, code)} before it reported a result (of {world} ranks)"
    if _by_signal(code):
        hint = "Something outside the rank ended it."
        if code == -signal.SIGKILL:
            hint = (
                "SIGKILL is what the kernel's out-of-memory killer sends (see `dmesg`): "
                "verify with more memory free, or a plan with a smaller peak."
            )
        return CannotMeasureError(
            f"A rank died: {how}; the other ranks' errors follow from it.", hint=hint
        )
    source = model or "the rank's code"
    return BadInputError(
        f"A rank died: {how}: {source}, or native code it calls, ended the process "
        "(os._exit, sys.exit, exit() in a C extension).",
        hint=f"Remove the exit from {source}: memplan runs it in each rank as a training "
        "script would, and a rank must return to report its figures.",
    )
