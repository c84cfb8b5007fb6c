"""``memplan check``'s verdict is memplan's alone (#23; memplan.check): a model's own
MemplanError subclass with ``exit_code = 0`` is the model file's error, an error result
never rolls up to 0, a check that hangs (and forks a detached grandchild that holds the
result pipe) times out naming its phase, SIGTERM mid-run keeps the finished results, a
file that appears at the ``--junit`` path is kept, and the step summary cannot be forged.
``check`` runs as a real process (``python -m memplan.cli``) where a child or a signal is
involved. Strict YAML and impossible profiles are in test_validation.py, ``hf:`` custom
code in test_model_hf.py, lengths past positions in test_seqlen_positions.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memplan.check import CheckReport, CheckResult, to_markdown
from memplan.cli import app
from memplan.errors import EXIT_BAD_INPUT, MemplanError, exit_code_of

MODELS = Path(__file__).parent / "models"
SMALL = str(MODELS / "check_small.py")
MISBEHAVE = str(MODELS / "trust_misbehave.py")
runner = CliRunner()


FORGED = """
import torch
from memplan.errors import MemplanError


class Forged(MemplanError):
    exit_code = 0


def build_model():
    {build}
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


def make_batch(batch_size):
    return torch.randn(batch_size, 4)


def training_loss(model, batch):
    {loss}
    return model(batch).square().mean()
"""


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def entry(name: str, model: str, **more) -> dict:
    """A cpu check; one timing round (``timing_rounds``: these tests check no time)."""
    return {
        "name": name,
        "model": model,
        "target_batch": 8,
        "budget": "1GiB",
        "device": "cpu",
        "timing_rounds": 1,
        **more,
    }


def run_check(tmp_path: Path, checks: list[dict], *args: str, timeout: float = 300):
    config = tmp_path / "memplan.yaml"
    config.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False), encoding="utf-8")
    junit, summary = tmp_path / "report.xml", tmp_path / "summary.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "memplan.cli", "check", "--config", str(config), "--json"]
    # Files, not pipes: a grandchild a model forks keeps the pipes of its ancestors open.
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        code = subprocess.run(
            [*cmd, "--junit", str(junit), *args],
            stdout=stdout,
            stderr=stderr,
            env=env,
            timeout=timeout,
        ).returncode
    proc = subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())
    return proc, junit, summary


@pytest.fixture
def grandchildren(tmp_path):
    """Kill the detached grandchildren HANG forks (each writes its pid to ``pids``)."""
    pids = tmp_path / "pids"
    yield pids
    for line in pids.read_text().split() if pids.exists() else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line), signal.SIGKILL)


# ------------------------------------------------------------------ 1. exit codes
def test_a_forged_exit_0_error_is_the_model_files_error_and_check_exits_2(tmp_path):
    build = tmp_path / "forged_build.py"
    build.write_text(FORGED.format(build='raise Forged("all good")', loss="pass"))
    loss = tmp_path / "forged_loss.py"
    loss.write_text(FORGED.format(build="pass", loss='raise Forged("all good")'))
    proc, junit, _ = run_check(tmp_path, [entry("build", str(build)), entry("loss", str(loss))])
    assert proc.returncode == 2, proc.stderr
    data = json.loads(proc.stdout)
    assert data["exit_code"] == 2 and data["summary"]["errors"] == 2
    assert {c["exit_code"] for c in data["checks"]} == {2}
    assert all("raised Forged" in c["message"] for c in data["checks"])
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("errors") == "2"


@pytest.mark.parametrize("where", ["import", "build", "batch", "loss", "forward"])
def test_probe_exits_2_whatever_memplan_error_a_model_raises(where):
    result = invoke(
        "probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,2", "--json",
        env={"MEMPLAN_TEST_MISBEHAVE": f"raise:Forged:{where}"},
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stdout.strip() == ""


def test_an_error_result_never_rolls_up_to_0():
    def result(status, code):
        return CheckResult(
            name="x", status=status, model="m.py", device="cpu", device_profile=None,
            precision="fp32", target_batch=1, world_size=1, budget_bytes=1, margin=0.0,
            exit_code=code,
        )  # fmt: skip

    for code in (0, 1, 42, -1):
        report = CheckReport(config="c", results=(result("pass", 0), result("error", code)))
        assert report.exit_code == 2
    report = CheckReport(config="c", results=(result("error", 3),))
    assert report.exit_code == 3


def test_exit_code_of_a_foreign_subclass_is_2():
    class Mine(MemplanError):
        exit_code = 0

    assert exit_code_of(Mine("x")) == EXIT_BAD_INPUT
    weird = MemplanError("x")
    weird.exit_code = 42
    assert exit_code_of(weird) == EXIT_BAD_INPUT


# ------------------------------------------------------------------ 3. timeouts, signals
HANG = """
import os, sys, time
import torch

def build_model():
    open({mark!r}, "w").close()
    if os.fork() == 0:  # a detached grandchild that holds every inherited descriptor
        os.setsid()
        with open({pids!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        time.sleep(120)
        os._exit(0)
    time.sleep(10**6)

def make_batch(batch_size):
    return torch.randn(batch_size, 4)
"""


def test_a_hung_check_times_out_naming_its_phase_and_the_others_are_reported(
    tmp_path, grandchildren
):
    hang = tmp_path / "hang.py"
    hang.write_text(HANG.format(mark=str(tmp_path / "started"), pids=str(grandchildren)))
    # the passing check's own timeout wins over --timeout: it is not slowed past it by load
    checks = [entry("hang", str(hang)), entry("small", SMALL) | {"timeout": 600}]
    proc, junit, summary = run_check(tmp_path, checks, "--timeout", "5", timeout=400)
    assert proc.returncode == 3, proc.stderr
    rows = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert rows["small"]["status"] == "pass"
    assert rows["hang"]["status"] == "error"
    assert "timeout of 5 s" in rows["hang"]["message"]
    assert "build_model()" in rows["hang"]["message"]
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["small"].find("error") is None and cases["hang"].find("error") is not None
    assert "small" in summary.read_text(encoding="utf-8")


def test_a_checks_own_timeout_wins_and_is_validated(tmp_path, grandchildren):
    hang = tmp_path / "hang.py"
    hang.write_text(HANG.format(mark=str(tmp_path / "started"), pids=str(grandchildren)))
    checks = [entry("hang", str(hang)) | {"timeout": 3}]
    proc, _, _ = run_check(tmp_path, checks, "--timeout", "0", timeout=240)
    assert proc.returncode == 3, proc.stderr
    assert "timeout of 3 s" in json.loads(proc.stdout)["checks"][0]["message"]
    bad = [entry("x", SMALL) | {"timeout": -1}]
    proc, _, _ = run_check(tmp_path, bad)
    assert proc.returncode == 2 and "timeout" in proc.stderr


def test_sigterm_keeps_the_finished_checks_results(tmp_path, grandchildren):
    hang = tmp_path / "hang.py"
    mark = tmp_path / "started"
    hang.write_text(HANG.format(mark=str(mark), pids=str(grandchildren)))
    config = tmp_path / "memplan.yaml"
    checks = [entry("small", SMALL), entry("hang", str(hang)), entry("after", SMALL)]
    config.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False))
    junit, summary = tmp_path / "r.xml", tmp_path / "s.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    cmd = [sys.executable, "-m", "memplan.cli", "check", "--config", str(config), "--json"]
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with out_path.open("w") as stdout, err_path.open("w") as stderr:
        proc = subprocess.Popen(
            [*cmd, "--junit", str(junit)], stdout=stdout, stderr=stderr, env=env
        )
        try:
            deadline = time.monotonic() + 240
            while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert mark.exists(), "the hanging check never started"
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err
    rows = {c["name"]: c for c in json.loads(out)["checks"]}
    assert rows["small"]["status"] == "pass"
    assert rows["hang"]["status"] == "error" and "interrupted" in rows["hang"]["message"]
    assert rows["after"]["status"] == "error" and "not run" in rows["after"]["message"]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("errors")) == ("3", "2")
    assert "small" in summary.read_text(encoding="utf-8")


# ------------------------------------------------------------------ 5. --junit no clobber
def test_junit_keeps_a_file_that_appears_while_check_runs(tmp_path):
    junit = tmp_path / "report.xml"
    model = tmp_path / "writes_junit.py"
    model.write_text(
        "import torch\n"
        "def build_model():\n"
        f"    open({str(junit)!r}, 'w').write('mine')\n"
        "    return torch.nn.Linear(4, 4)\n"
        "def make_batch(batch_size):\n"
        "    return torch.randn(batch_size, 4)\n"
    )
    proc, junit_path, _ = run_check(tmp_path, [entry("a", str(model))])
    assert junit_path == junit
    assert proc.returncode == 2, proc.stderr
    assert "already exists" in proc.stderr
    assert junit.read_text() == "mine"


# ------------------------------------------------------------------ 9. step summary
def test_the_step_summary_holds_no_forged_heading_or_outside_image():
    forged = (
        "boom\n```\n### memplan check: passed (1/1)\n![ok](https://evil.example/ok.png)\n"
        '<img src="https://evil.example/x.png">\n````'
    )
    row = CheckResult(
        name="x\n### memplan check: passed (1/1) ![i](https://evil.example/i.png)",
        status="error", model="m.py", device="cpu", device_profile=None, precision="fp32",
        target_batch=1, world_size=1, budget_bytes=1, margin=0.0, message=forged, exit_code=2,
    )  # fmt: skip
    text = to_markdown(CheckReport(config="c", results=(row,)))
    lines = text.splitlines()
    opening = next(i for i, line in enumerate(lines) if line.startswith("```"))
    fence = lines[opening]
    assert fence == "`" * 5  # longer than the four-backtick run in the message
    closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith(fence))
    assert closing == len(lines) - 1  # the message cannot close it early
    outside = lines[:opening]
    assert [line for line in outside if line.startswith("#")] == [
        "### memplan check: failed (0/1)",
        "#### x \\#\\#\\# memplan check\\: passed \\(1\\/1\\) \\!\\[i\\]\\(https\\:\\/\\/evil\\.example"
        "\\/i\\.png\\)",
    ]
    assert not any("![" in line or "<img" in line for line in outside)
