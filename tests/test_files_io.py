"""Writing files safely (#10; memplan.files.io): only regular files are replaced, no-clobber
holds under a race, replacing keeps permission bits and sweeps stale temporaries, and
outputs named twice or in impossible places are refused before anything is written or
probed."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import OutputExistsError
from memplan.files.io import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "models"
TINY = str(MODELS / "cli_tiny_gpt.py")
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


# ------------------------------------------------------------------ 4 and 7: file safety
def test_only_regular_files_are_ever_replaced(tmp_path):
    before = os.stat("/dev/null")
    result = invoke("solve", GPT_PROFILE, "--target-batch", 8, "--budget", "24GiB")
    assert result.exit_code == 0
    for target in ("/dev/null", "/dev/full", tmp_path):
        if not os.path.exists(target):
            continue
        result = invoke(
            "solve", GPT_PROFILE, "--target-batch", 8, "--budget", "24GiB", "-o", target, "--force"
        )
        assert result.exit_code == 2, result.output
        assert "not a regular file" in " ".join(result.output.split())
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_no_clobber_is_atomic_under_a_race(tmp_path):
    target = tmp_path / "plan.yaml"
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def write(i: int) -> None:
        barrier.wait()
        try:
            write_text_atomic(target, f"writer {i}\n")
            outcomes.append("wrote")
        except OutputExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["wrote"]
    assert target.read_text().startswith("writer ")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]  # no temporaries left


def test_replacing_keeps_permission_bits_and_removes_stale_temporaries(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("old\n")
    target.chmod(0o600)
    stale = tmp_path / ".plan.yaml.memplan-999999999-dead.tmp"  # no such pid
    stale.write_text("half")
    live = tmp_path / f".plan.yaml.memplan-{os.getpid()}-alive.tmp"  # a writer still running
    live.write_text("busy")
    write_text_atomic(target, "new\n", force=True)
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not stale.exists() and live.exists()


@pytest.mark.parametrize(
    "extra",
    [("--format", "hf,hf"), ("-o", "{dir}/hf_training_args.yaml", "--format", "hf,plan")],
)
def test_duplicate_targets_are_refused_before_anything_is_written(tmp_path, extra):
    args = [a.format(dir=tmp_path) for a in extra]
    result = invoke(
        "solve",
        GPT_PROFILE,
        "--target-batch",
        8,
        "--budget",
        "24GiB",
        "--out-dir",
        tmp_path,
        "--force",
        *args,
    )
    assert result.exit_code == 2, result.output
    assert "same file" in result.output
    assert list(tmp_path.iterdir()) == []


def test_bad_output_paths_fail_before_the_probe(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for output, force in ((a_file / "p.yaml", False), (tmp_path, True)):
        start = time.perf_counter()
        result = invoke("probe", TINY, "--device", "cpu", "-o", output, *(["--force"] * force))
        assert result.exit_code == 2, result.output
        assert "probing" not in result.output
        assert time.perf_counter() - start < 5  # refused, not probed (a probe takes longer)
