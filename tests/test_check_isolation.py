"""`memplan check` against model files that misbehave (#10 item 1, item 5): a model file that
ends the process at import must not pass the gate or stop it. Each check's model runs in a
child process; a check whose model cannot be loaded or run is an error for that check, every
other check still runs, and JSON, JUnit and the step summary are always written. Run as a
real process (``python -m memplan.cli``): an ``os._exit`` in-process would end pytest too."""

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import yaml

MODELS = Path(__file__).parent / "models"
SMALL = str(MODELS / "check_small.py")
GROWN = str(MODELS / "check_grown.py")


def entry(name: str, model: str, budget="1GiB", **more) -> dict:
    return {"name": name, "model": model, "target_batch": 8, "budget": budget, "device": "cpu"}


def run_cli(tmp_path: Path, checks: list[dict]) -> tuple[subprocess.CompletedProcess, Path, Path]:
    config = tmp_path / "memplan.yaml"
    config.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False), encoding="utf-8")
    junit, summary = tmp_path / "report.xml", tmp_path / "summary.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary), "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "memplan.cli", "check", "--config", str(config), "--json"]
    proc = subprocess.run(
        [*cmd, "--junit", str(junit)], capture_output=True, text=True, env=env, timeout=300
    )
    return proc, junit, summary


def test_exiting_model_files_are_errors_and_the_other_checks_still_run(tmp_path):
    checks = [
        entry("exit0", str(MODELS / "check_exit0.py")),
        entry("small", SMALL),
        entry("os_exit", str(MODELS / "check_os_exit.py")),
        entry("exit3", str(MODELS / "check_exit3.py")),
        entry("noisy", str(MODELS / "check_noisy.py")),
    ]
    proc, junit, summary = run_cli(tmp_path, checks)
    assert proc.returncode == 2, proc.stderr  # a model that cannot be run: exit 2, not 0 or 3
    assert "Traceback" not in proc.stderr
    data = json.loads(proc.stdout)
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert status == {
        "exit0": "error",
        "small": "pass",
        "os_exit": "error",
        "exit3": "error",
        "noisy": "pass",
    }
    assert "building the model" in proc.stderr  # the model's prints: stderr, not the JSON
    by_name = {c["name"]: c for c in data["checks"]}
    assert "sys.exit(0)" in by_name["exit0"]["message"]
    assert "sys.exit(3)" in by_name["exit3"]["message"]
    assert "exit code 0" in by_name["os_exit"]["message"]
    assert {by_name[n]["exit_code"] for n in ("exit0", "os_exit", "exit3")} == {2}
    assert data["exit_code"] == 2 and data["summary"]["errors"] == 3
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("5", "0", "3")
    assert "⚠️ error" in summary.read_text(encoding="utf-8")


def test_over_budget_outranks_a_broken_model(tmp_path):
    checks = [entry("exit0", str(MODELS / "check_exit0.py")), entry("grown", GROWN, "64KiB")]
    proc, junit, _ = run_cli(tmp_path, checks)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert [c["status"] for c in data["checks"]] == ["error", "fail"]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("1", "1")


def test_check_json_piped_ends_with_the_check_when_the_model_leaves_processes(tmp_path):
    # `memplan check --json | cat`: the pipe ends when every holder of memplan's stdout has
    # closed it. The model forks a grandchild and a setsid daemon that sleep for 60 s; the
    # fork server and resource tracker memplan starts must not hold stdout either. (stderr
    # goes to a file: the daemon, which left memplan's process group, keeps its stderr.)
    config = tmp_path / "memplan.yaml"
    config.write_text(yaml.safe_dump({"checks": [entry("forks", str(MODELS / "check_forks.py"))]}))
    err = tmp_path / "err.txt"
    script = f"{sys.executable} -m memplan.cli check --config {config} --json 2>{err} | cat"
    env = {**os.environ, "MEMPLAN_TEST_FORK_SLEEP": "60"}
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", script], stdout=subprocess.PIPE, text=True, env=env, timeout=200
    )
    took = time.monotonic() - start
    assert proc.returncode == 0, err.read_text()
    assert json.loads(proc.stdout)["checks"][0]["status"] == "pass"
    assert took < 45, f"the pipe stayed open {took:.0f} s, past the check"
