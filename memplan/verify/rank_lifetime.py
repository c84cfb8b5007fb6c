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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memplan.errors import BadInputError, CannotMeasureError, MemplanError

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
        os._exit(128 + signum)

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


def join_group(rank: int, config: dict[str, Any], backend: str = "gloo") -> None:
    """A rank started by the launcher joins its process group: the launcher's loopback
    port, world size and timeout (``config``), over ``backend``."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{config['port']}",
        rank=rank,
        world_size=int(config["world_size"]),
        timeout=timedelta(seconds=float(config["timeout_s"])),
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


def rank_failure(folder: Path, world: int, what: str) -> MemplanError | None:
    """The clearest account of a failed run: the first rank that wrote an error (None when
    no rank did)."""
    for rank in range(world):
        path = folder / f"rank{rank}.json"
        if path.is_file():
            data = json.loads(path.read_text() or "{}")
            if data.get("bad_input"):  # the model file or plan, not the run: exit 2
                message = data.get("message", data["error"])
                return BadInputError(f"Rank {rank} of {world} failed: {message}")
            if "error" in data:
                tail = "\n".join(data.get("trace", "").strip().splitlines()[-6:])
                return CannotMeasureError(
                    f"Rank {rank} of {world} failed: {data['error']}",
                    hint=f"The run stopped ({what}) and the other ranks were killed. "
                    f"Its traceback ends:\n{tail}",
                )
    return None
