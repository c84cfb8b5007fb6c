"""The test suite itself (#35): a test that coordinates with another process waits for
something the process does (a line on its stderr, a file, a socket), with a generous
timeout, never for a fixed time. A ``time.sleep`` outside a loop followed, in the same
function, by a signal sent or a child's output read is that bug: on a loaded machine the
child is not there yet. A sleep inside a loop is a poll and is fine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Sending a signal, and reading what a child wrote or waiting on it.
SIGNALS = {"send_signal", "kill", "killpg", "terminate"}
READS = {"communicate", "read", "read1", "readline", "readlines", "read_text", "read_bytes"}
WAITS = {"wait"}


def _is_sleep(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id == "sleep"


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _calls(node: ast.AST, in_loop: bool, out: list[tuple[ast.Call, bool]]) -> None:
    """Every call in ``node``'s function, with whether it sits inside a loop there (nested
    functions and lambdas are their own functions, checked on their own)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(child, ast.Call):
            out.append((child, in_loop))
        _calls(child, in_loop or isinstance(child, ast.While | ast.For | ast.AsyncFor), out)


def sleeps_before_a_signal_or_read(source: str, filename: str = "<test>") -> list[str]:
    """``file:line`` of each ``time.sleep`` that is not inside a loop of its function and is
    followed, later in that function, by a signal sent or a read of a child's output."""
    found = []
    for function in ast.walk(ast.parse(source, filename)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls: list[tuple[ast.Call, bool]] = []
        _calls(function, False, calls)
        for sleep, in_loop in calls:
            if in_loop or not _is_sleep(sleep):
                continue
            later = [
                c
                for c, _ in calls
                if (c.lineno, c.col_offset) > (sleep.lineno, sleep.col_offset)
                and _called_name(c) in SIGNALS | READS | WAITS
            ]
            if later:
                found.append(f"{filename}:{sleep.lineno} then {_called_name(later[0])}()")
    return found


def test_no_test_waits_a_fixed_time_for_another_process():
    found = []
    for folder in ("tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            found += sleeps_before_a_signal_or_read(path.read_text(encoding="utf-8"), rel)
    assert found == [], "wait for an event the child makes, not a fixed time: " + ", ".join(found)


def test_the_check_finds_a_planted_sleep_and_lets_a_poll_pass():
    planted = """
import signal, subprocess, time

def test_planted():
    proc = subprocess.Popen(["x"])
    time.sleep(3)
    proc.send_signal(signal.SIGINT)

def test_planted_read():
    from time import sleep
    proc = subprocess.Popen(["x"], stderr=subprocess.PIPE)
    if True:
        sleep(1)
    with proc:
        _, err = proc.communicate(timeout=30)
"""
    assert sleeps_before_a_signal_or_read(planted, "planted.py") == [
        "planted.py:6 then send_signal()",
        "planted.py:13 then communicate()",
    ]
    poll = """
import time

def test_poll(mark, proc):
    while not mark.exists():
        time.sleep(0.2)
    proc.send_signal(15)
    proc.wait(timeout=60)

def test_sleep_in_a_child_model():
    text = "import time\\ntime.sleep(120)\\n"
    return text.read_text()

def test_sleep_with_nothing_after():
    time.sleep(0.01)
"""
    assert sleeps_before_a_signal_or_read(poll, "poll.py") == []


def test_every_file_of_the_quick_loop_exists():
    """A renamed test file must not drop out of ``make test-fast`` unnoticed."""
    from conftest import FAST_FILES

    missing = sorted(name for name in FAST_FILES if not (ROOT / "tests" / name).is_file())
    assert missing == []
