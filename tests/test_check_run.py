"""Issue 23: the verdict is memplan's alone. No model file, YAML file, hang or race decides
an exit code or loses a result: a model's own MemplanError subclass with ``exit_code = 0``,
alias bombs and duplicate keys, a check that hangs (and forks a detached grandchild that
holds the result pipe), SIGTERM mid-run, an ``hf:`` config naming custom code, a file that
appears at the ``--junit`` path, profiles and plans that cannot be real, lengths past the
model's positions, and step-summary forgery. ``check`` runs as a real process
(``python -m memplan.cli``) where a child or a signal is involved."""

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

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "models"
SMALL = str(MODELS / "check_small.py")
MISBEHAVE = str(MODELS / "trust_misbehave.py")
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
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
    return {"name": name, "model": model, "target_batch": 8, "budget": "1GiB", "device": "cpu"}


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


# ------------------------------------------------------------------ 2 and 8. strict YAML
def alias_bomb(levels: int = 10) -> str:
    """~1 KB that expands to 10**levels items."""
    lines = ["- &b0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"- &b{i} [" + ", ".join([f"*b{i - 1}"] * 10) + "]")
    return "\n".join(lines)


PLAN_YAML = (ROOT / "tests" / "golden" / "plan.yaml").read_text()


@pytest.mark.parametrize("field", ["checkpoint", "reasons", "warnings"])
def test_an_alias_bomb_in_a_plan_is_refused(tmp_path, field):
    data = yaml.safe_load(PLAN_YAML)
    del data[field]
    bomb = "\n".join("  " + line for line in alias_bomb().splitlines())
    text = yaml.safe_dump(data, sort_keys=False) + f"{field}:\n{bomb}\n"
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    started = time.monotonic()
    result = invoke("show", path)
    assert result.exit_code == 2, result.output
    assert "alias" in result.output or "anchor" in result.output
    assert time.monotonic() - started < 60  # unrefused, it runs for minutes at gigabytes


def test_an_alias_bomb_as_a_budget_is_refused(tmp_path):
    text = (
        "bombs:\n" + "  " + alias_bomb().replace("\n", "\n  ") + "\n"
        f"checks:\n  - name: a\n    model: {SMALL}\n    target_batch: 8\n    budget: *b9\n"
    )
    config = tmp_path / "memplan.yaml"
    config.write_text(text)
    result = invoke("check", "--config", config)
    assert result.exit_code == 2, result.output
    assert "memplan.yaml" in result.output


def test_a_duplicate_key_is_refused_everywhere(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_YAML + "target_batch: 64\n")
    result = invoke("show", plan)
    assert result.exit_code == 2 and "duplicate key 'target_batch'" in result.output
    data = yaml.safe_load(PLAN_YAML)
    layer = next(iter(data["checkpoint"]))
    text = PLAN_YAML.replace(f"  {layer}: ", f"  {layer}: keep\n  {layer}: ", 1)
    plan.write_text(text)
    result = invoke("show", plan)
    assert result.exit_code == 2 and "duplicate key" in result.output
    config = tmp_path / "memplan.yaml"
    config.write_text(
        f"checks:\n  - name: a\n    name: b\n    model: {SMALL}\n    target_batch: 8\n"
        "    budget: 1GiB\n"
    )
    result = invoke("check", "--config", config)
    assert result.exit_code == 2 and "duplicate key 'name'" in result.output


@pytest.mark.parametrize("name", ["", "blocks", "head"])
def test_plans_refuse_checkpoint_layers_that_are_not_candidates(tmp_path, name):
    data = yaml.safe_load(PLAN_YAML)
    data["model_fingerprint"] = {
        "parameter_bytes": 1000,
        "candidate_layers": ["blocks.0", "blocks.1"],
    }
    data["checkpoint"] = {name: "full"}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    result = invoke("show", path)
    assert result.exit_code == 2, result.output
    assert "checkpoint" in result.output


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


# ------------------------------------------------------------------ 4. hf: custom code
def test_an_hf_config_naming_custom_code_is_refused_and_nothing_runs(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "vocab_size": 100,
                "auto_map": {
                    "AutoConfig": "configuration_evil.EvilConfig",
                    "AutoModelForCausalLM": "modeling_evil.EvilModel",
                },
            }
        )
    )
    for name in ("configuration_evil", "modeling_evil"):
        (folder / f"{name}.py").write_text(f"open({str(tmp_path / name)!r}, 'w').close()\n")
    for ref in (f"hf:{folder}", f"hf:{folder}/config.json"):
        proc = subprocess.run(
            [sys.executable, "-m", "memplan.cli", "probe", f"{ref}?task=causal-lm&seq-len=8",
             "--device", "meta", "-o", str(tmp_path / "p.yaml")],
            input="y\ny\ny\n", capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "auto_map" in proc.stderr
    assert not (tmp_path / "configuration_evil").exists()
    assert not (tmp_path / "modeling_evil").exists()


def test_a_local_looking_hf_reference_never_goes_to_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("memplan asked the Hub about a local path")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.chdir(tmp_path)
    result = invoke("probe", "hf:./x.json?task=causal-lm&seq-len=8", "--device", "meta")
    assert result.exit_code == 2 and "does not exist" in result.output


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


# ------------------------------------------------------------------ 6. impossible profiles
def mutated_profile(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(GPT_PROFILE.read_text())
    edit(data)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["layers"][0]["saved_bytes"].update(slope=-1.0), "saved_bytes.slope"),
        (lambda d: d["layers"][0]["input_bytes"].update(slope=-8.0), "input_bytes.slope"),
        (
            lambda d: d["layers"][1]["savings_bytes"].update(slope=-(10.0**9)),
            "savings_bytes.slope",
        ),
        (lambda d: d["layers"][1]["savings_bytes"].update(slope=10.0**12), "savings_bytes.slope"),
        (lambda d: d.update(max_seq_len=0), "max_seq_len"),
    ],
)
def test_a_negative_or_impossible_slope_is_exit_2(tmp_path, edit, field):
    path = mutated_profile(tmp_path, edit)
    for args in (("show", path), ("solve", path, "--target-batch", 8, "--budget", "24GiB")):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert field in result.output


# ------------------------------------------------------------------ 7. lengths past positions
@pytest.fixture(scope="module")
def hf_grid(tmp_path_factory) -> Path:
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=64, vocab_size=64).save_pretrained(
        folder
    )
    out = folder / "p.yaml"
    result = invoke(
        "probe", f"hf:{folder}?task=causal-lm&seq-len=32", "--device", "meta",
        "--seq-lens", "16,32", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_the_profile_records_the_models_positions(hf_grid):
    from memplan.profile import load_profile

    profile = load_profile(hf_grid)
    assert profile.max_seq_len == 64
    assert {p.max_seq_len for p in profile.seq.profiles} == {64}


def test_solve_refuses_lengths_past_the_models_positions(hf_grid, tmp_path):
    result = invoke(
        "solve", hf_grid, "--target-batch", 4, "--budget", "64GiB", "--seq-len", 4096,
        "-o", tmp_path / "plan.yaml",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "64 positions" in result.output
    assert not (tmp_path / "plan.yaml").exists()
    result = invoke(
        "solve", hf_grid, "--target-batch", 4, "--budget", "64GiB", "--seq-len", "max",
        "--seq-multiple", 16, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["seq_len"] == 64


def test_a_seq_grid_out_of_order_or_of_another_model_is_refused(hf_grid, tmp_path):
    data = yaml.safe_load(hf_grid.read_text())

    def swapped(d):
        d["seq"]["profiles"].reverse()

    def other_model(d):
        d["seq"]["profiles"][0]["model"]["path"] = "other.py"

    def outside(d):
        d["seq_len"] = 48

    for edit, field in ((swapped, "seq_len"), (other_model, "model"), (outside, "seq_len")):
        changed = yaml.safe_load(yaml.safe_dump(data))
        edit(changed)
        path = tmp_path / "g.yaml"
        path.write_text(yaml.safe_dump(changed))
        result = invoke("show", path)
        assert result.exit_code == 2, result.output
        assert field in result.output


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
