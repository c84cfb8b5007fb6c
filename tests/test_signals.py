"""Signals (#10): SIGINT and SIGTERM end memplan with one line and the conventional exit
code, the progress display restores the terminal, and verify's ranks die with their
parent and leave no temporary folder (memplan.verify.rank_lifetime). Each test waits for
an event the child makes (a line on its stderr, a file), never a fixed time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app

MODELS = Path(__file__).parent / "models"
MISBEHAVE = str(MODELS / "trust_misbehave.py")
TINY = str(MODELS / "cli_tiny_gpt.py")
MEMPLAN = [sys.executable, "-m", "memplan.cli"]
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory) -> Path:
    """A profile of trust_misbehave.py (two Linear blocks: probes fast)."""
    path = tmp_path_factory.mktemp("trust") / "small.yaml"
    result = invoke("probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,2", "-o", path)
    assert result.exit_code == 0, result.output
    return path


# ------------------------------------------------------------------ 8: signals
def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _handles_sigterm(pid: int) -> bool:
    """memplan's main() has set its handlers (SIGINT's, then SIGTERM's, which Python itself
    never catches): the caught-signal mask in /proc says so."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


class _Collected:
    """A child's stream, read on a thread as it comes: ``wait_for(needle)`` blocks until the
    child has written it (or the stream ended, or the timeout passed)."""

    def __init__(self, stream):
        self.data = bytearray()
        self._changed = threading.Condition()
        self._done = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        while chunk := stream.read1(65536):
            with self._changed:
                self.data += chunk
                self._changed.notify_all()
        with self._changed:
            self._done = True
            self._changed.notify_all()

    def wait_for(self, needle: bytes, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: needle in self.data or self._done, timeout=timeout
            ) and (needle in self.data)

    def text(self, timeout: float = 60) -> str:
        self._thread.join(timeout)
        return self.data.decode("utf-8", "replace")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_die_with_the_parent_and_leave_no_temporary_folder(tmp_path, small_profile, sig):
    plan_path = tmp_path / "plan2.yaml"
    solved = invoke(
        "solve",
        small_profile,
        "--target-batch",
        8,
        "--budget",
        "1GiB",
        "--world-size",
        2,
        "-o",
        plan_path,
    )
    assert solved.exit_code == 0, solved.output
    tmp = tmp_path / "tmp"
    marks = tmp_path / "marks"
    tmp.mkdir()
    marks.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "MEMPLAN_TEST_STEP_MARKS": str(marks)}
    proc = subprocess.Popen(
        [*MEMPLAN, "verify", MISBEHAVE, str(plan_path), "--steps", "1000000"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        # Both ranks are training and each has been through a step's collectives and into
        # the next micro-step: from now on they spend their time in gloo's collectives (C++),
        # where the SIGTERM handler of the old death signal never ran.
        def both_in_the_loop() -> bool:
            steps = [p.read_text().count("step") for p in marks.iterdir()]
            return len(steps) == 2 and min(steps) >= 3

        assert _wait_for(both_in_the_loop, 300), "the ranks never trained"
        ranks = [int(p.name) for p in marks.iterdir()]
        assert all(_running(pid) for pid in ranks)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        assert err.strip().splitlines()[-1] == "interrupted"
        assert "Traceback" not in err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert _wait_for(lambda: not any(_running(pid) for pid in ranks), timeout=120), ranks
    assert _wait_for(lambda: not list(tmp.glob("memplan-dist-*")), timeout=120)
    # and the reaper that removed the folder is gone too
    assert _wait_for(lambda: not _processes_naming(str(tmp)), timeout=120)


def test_run_folders_of_dead_owners_are_swept_and_others_kept(tmp_path):
    from memplan.verify.rank_lifetime import OWNER_FILE, sweep_orphaned_folders

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    folders = {}
    for name, owner in (("dead", dead.pid), ("alive", os.getppid()), ("me", os.getpid())):
        folders[name] = tmp_path / f"memplan-dist-{name}"
        folders[name].mkdir()
        (folders[name] / OWNER_FILE).write_text(f"{owner}\n")
        (folders[name] / "rank0.json").write_text("{}")
    starting = tmp_path / "memplan-dist-starting"  # no owner file yet: a run being set up
    starting.mkdir()
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{dead.pid}\n")
    assert sweep_orphaned_folders(tmp_path) == [folders["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elsewhere",
        "memplan-dist-alive",
        "memplan-dist-me",
        "memplan-dist-starting",
    ]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphaned rank is reaped by whoever adopts it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes() and _running(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_sigint_prints_one_line_and_exits_130(tmp_path):
    proc = subprocess.Popen(
        [*MEMPLAN, "probe", TINY, "--device", "cpu", "--micro-batches", "1,2,4,8,16,32,64"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        # memplan's handlers are set before anything slow (importing torch, probing): wait
        # for them, however long a loaded machine takes to get there
        assert _wait_for(lambda: _handles_sigterm(proc.pid), 300), "the handlers were never set"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err


SIZES = "1,2,4,8,16,32,64"


_WAITS_IN_MAKE_BATCH = """
import os, time
import torch
from torch import nn


def build_model():
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])


def make_batch(n):
    if n == 2:  # the display is on: the warm-up at micro-batch 1 is done
        with open(os.environ["MEMPLAN_TEST_MARK"], "w") as mark:
            mark.write("measuring")
        time.sleep(600)
    return torch.randn(n, 8)


def training_loss(model, batch):
    return model(batch).sum()
"""


def test_sigint_during_the_progress_display_exits_130_and_restores_the_terminal(tmp_path):
    """The same with the progress display on (FORCE_COLOR makes rich treat stderr as a
    terminal): the display unwinds, the cursor it hid is shown again, one line says so,
    and no profile is left half-written. The model file marks when the probe reaches
    micro-batch 2 and waits there, so the signal lands mid-probe on any machine, fast or
    loaded."""
    model = tmp_path / "waits.py"
    model.write_text(_WAITS_IN_MAKE_BATCH)
    mark = tmp_path / "measuring"
    out = tmp_path / "p.yaml"
    proc = subprocess.Popen(
        [
            *MEMPLAN,
            "probe",
            str(model),
            "--device",
            "cpu",
            "--micro-batches",
            "1,2,4",
            "-o",
            str(out),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "FORCE_COLOR": "1", "MEMPLAN_TEST_MARK": str(mark)},
    )
    try:
        err = _Collected(proc.stderr)
        deadline = time.monotonic() + 300  # torch's import first, however loaded the machine
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the child's mark, not a fixed wait
        assert mark.exists(), err.text(0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    text = err.text()
    assert proc.returncode == 130, text
    assert "probing" in text  # the display was on
    assert "\x1b[?25l" in text and text.rindex("\x1b[?25h") > text.rindex("\x1b[?25l")
    assert "interrupted" in text.strip().splitlines()[-1] and "Traceback" not in text
    assert not out.exists()


def test_a_signal_during_the_model_files_import_is_an_interruption_not_its_error(tmp_path):
    """memplan's handler raises from memplan/cli while the model file's top level runs: that
    is memplan's interruption (exit 130), not an error in the model file (exit 2), wherever
    in the memplan package the raising frame is."""
    from memplan.errors import Interrupted
    from memplan.model.loader import load_model_file

    model = tmp_path / "interrupted.py"
    model.write_text(
        "from memplan.cli import _interrupt\n"
        "_interrupt(2, None)  # as if Ctrl-C arrived while this file was being imported\n"
    )
    with pytest.raises(Interrupted):
        load_model_file(str(model))
