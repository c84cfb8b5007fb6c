"""memplan with a closed standard stream (#33 item 15): `memplan probe --json 2>&-` and
`memplan verify --json 2>&-` (``sys.__stderr__`` is None) still print their JSON and exit 0,
and no file memplan opens takes the closed stream's number. Run as real processes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "models" / "check_small.py"


def _run(args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = f"{sys.executable} -m memplan.cli {args} 2>&-"
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_probe_and_verify_json_with_stderr_closed(tmp_path):
    probe = _run(f"probe {MODEL} --device cpu --json -o profile.yaml", tmp_path)
    assert probe.returncode == 0, probe.stdout[-2000:]
    profile = json.loads(probe.stdout)
    assert profile["model"]["path"] == str(MODEL)
    assert (tmp_path / "profile.yaml").read_text().startswith("schema_version: 2")

    solve = _run("solve profile.yaml --target-batch 4 --budget 1GiB -o plan.yaml --json", tmp_path)
    assert solve.returncode == 0, solve.stdout[-2000:]
    assert json.loads(solve.stdout)["feasible"] is True

    verify = _run("verify plan.yaml --json --steps 1 --no-grad-check", tmp_path)
    assert verify.returncode in (0, 1), verify.stdout[-2000:]  # 1: outside the tolerance
    result = json.loads(verify.stdout)
    assert result["plan"]["target_batch"] == 4
