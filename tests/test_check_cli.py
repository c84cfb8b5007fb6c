"""`memplan check` end to end with the real probe (on cpu: milliseconds) and solver, on the tiny models
in tests/models/: a model that grows flips a passing check to exit 1 naming the grown
layer; --json validates against the documented shape; --junit parses and counts failures;
`init-check` writes a starter config that passes."""

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from test_check_report import validate_json_shape
from typer.testing import CliRunner

MODELS = Path(__file__).parent / "models"
SMALL = str(MODELS / "check_small.py")
GROWN = str(MODELS / "check_grown.py")


@pytest.fixture(scope="module")
def app():
    from memplan.cli import app
    from memplan.cli.check import register

    register(app)
    return app


def invoke(app, *args, env=None):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})


def write(path: Path, checks: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False), encoding="utf-8")
    return path


def entry(name: str, model: str, budget, baseline: str | None = "small.profile.yaml") -> dict:
    check = {
        "name": name,
        "model": model,
        "target_batch": 32,
        "budget": budget,
        "device": "cpu",
        "timing_rounds": 1,  # the verdicts are memory's: one timing round per size
        "baseline": baseline,
    }
    return {key: value for key, value in check.items() if value is not None}


@pytest.fixture(scope="module")
def baseline(app, tmp_path_factory):
    """A passing run of the small model that writes its baseline; returns (folder, JSON)."""
    folder = tmp_path_factory.mktemp("check")
    config = write(folder / "memplan.yaml", [entry("mlp", SMALL, "1GiB")])
    result = invoke(app, "check", "--config", str(config), "--update-baseline", "--json")
    assert result.exit_code == 0, result.output
    assert (folder / "small.profile.yaml").is_file()
    return folder, json.loads(result.stdout)


def test_real_run_json_validates(baseline):
    _, data = baseline
    validate_json_shape(data)
    (check,) = data["checks"]
    assert check["status"] == "pass" and check["baseline_updated"] is True
    assert check["min_peak_bytes"] > 0
    assert check["plan"]["micro_batch_size"] * check["plan"]["accumulation_steps"] == 32
    assert check["plan"]["n_layers"] == 4
    assert check["seconds"]["total"] > 0
    # the check's probe (in its child process) ran the rounds the check asked for
    from memplan.profile import load_profile

    folder, _ = baseline
    assert load_profile(folder / "small.profile.yaml").environment.timing_rounds == 1


def baseline_of(small_baseline: Path, model: str, target: Path) -> str:
    """``small_baseline`` as the baseline of ``model`` before it grew: check_grown.py stands
    for check_small.py after an edit, and a baseline that records another model's file is
    not compared (it is a note)."""
    from memplan.profile import load_profile, profile_to_yaml

    recorded = load_profile(small_baseline)
    recorded = dataclasses.replace(recorded, model=dataclasses.replace(recorded.model, path=model))
    target.write_text(profile_to_yaml(recorded), encoding="utf-8")
    return str(target)


def test_growth_flips_pass_to_exit_1_naming_the_layer(app, baseline):
    folder, data = baseline
    min_peak = data["checks"][0]["min_peak_bytes"]
    budget = int(min_peak * 1.3)  # 30% headroom for the small model: it passes
    config = write(folder / "memplan.yaml", [entry("mlp", SMALL, budget)])
    result = invoke(app, "check", "--config", str(config))
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output

    before = baseline_of(folder / "small.profile.yaml", GROWN, folder / "grown.profile.yaml")
    write(config, [entry("mlp", GROWN, budget, before)])
    result = invoke(app, "check", "--config", str(config))
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output and "exceeded by" in result.output
    assert "grew since the baseline" in result.output
    lines = result.output.splitlines()
    start = lines.index("grew since the baseline:")
    end = lines.index("what to do:")
    grown_layers = {
        line.split(":")[0].strip()
        for line in lines[start + 1 : end]
        if line.strip().startswith("blocks.")
    }
    assert grown_layers == {"blocks.2"}, lines[start:end]
    assert "raise the budget" in result.output and "checks[0].budget" in result.output


def test_junit_and_json_count_the_failure(app, baseline, tmp_path):
    folder, data = baseline
    budget = int(data["checks"][0]["min_peak_bytes"] * 1.3)
    base = str(folder / "small.profile.yaml")
    before = baseline_of(folder / "small.profile.yaml", GROWN, tmp_path / "grown.profile.yaml")
    config = write(
        tmp_path / "memplan.yaml",
        [entry("small", SMALL, budget, base), entry("grown", GROWN, budget, before)],
    )
    report = tmp_path / "report.xml"
    summary = tmp_path / "summary.md"
    result = invoke(
        app,
        "check",
        "--config",
        str(config),
        "--json",
        "--junit",
        str(report),
        env={"GITHUB_STEP_SUMMARY": str(summary)},
    )
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout)
    validate_json_shape(out)
    assert out["summary"] == {**out["summary"], "total": 2, "passed": 1, "failed": 1, "errors": 0}
    grown = out["checks"][1]
    assert grown["exceeded_by_bytes"] > 0
    grew = {g["name"] for g in grown["growth"] if g["kind"] == "layer" and g["delta"] > 0}
    assert grew == {"blocks.2"}

    suite = ET.parse(report).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("2", "1", "0")
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["grown"]
    assert "blocks.2" in suite.find("testcase[@name='grown']/failure").text
    assert "❌ fail" in summary.read_text()

    # The report is not overwritten without --force; with it, it is.
    again = invoke(app, "check", "--config", str(config), "--junit", str(report), "--only", "small")
    assert again.exit_code == 2 and "--force" in again.output
    again = invoke(
        app, "check", "--config", str(config), "--junit", str(report), "--only", "small", "--force"
    )
    assert again.exit_code == 0, again.output
    assert ET.parse(report).getroot().find("testsuite").get("tests") == "1"


def test_contract_breaking_model_is_exit_2(app, tmp_path):
    config = write(
        tmp_path / "memplan.yaml", [entry("broken", str(MODELS / "check_broken.py"), "1GiB", None)]
    )
    result = invoke(app, "check", "--config", str(config))
    assert result.exit_code == 2, result.output
    assert "make_batch" in result.output


def test_cuda_without_gpu_is_exit_3(app, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    check = {**entry("gpu", SMALL, "1GiB", None), "device": "cuda"}
    result = invoke(app, "check", "--config", str(write(tmp_path / "memplan.yaml", [check])))
    assert result.exit_code == 3, result.output


def test_init_check_writes_a_passing_starter(app, tmp_path):
    output = tmp_path / "memplan.yaml"
    result = invoke(
        app, "init-check", SMALL, "-o", str(output), "--target-batch", "16", "--device", "cpu"
    )
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(output.read_text())
    (check,) = data["checks"]
    assert check["target_batch"] == 16 and check["device"] == "cpu"
    assert check["timing_rounds"] == 1  # a cpu gate checks bytes: one timing round
    assert (tmp_path / check["model"]).resolve() == Path(SMALL).resolve()
    result = invoke(app, "check", "--config", str(output))
    assert result.exit_code == 0, result.output

    result = invoke(app, "init-check", SMALL, "-o", str(output), "--budget", "2GiB")
    assert result.exit_code == 2 and "--force" in result.output
    result = invoke(
        app,
        "init-check",
        SMALL,
        "-o",
        str(output),
        "--budget",
        "2GiB",
        "--force",
        "--name",
        "renamed",
        "--baseline",
        "base/small.profile.yaml",
    )
    assert result.exit_code == 0, result.output
    (check,) = yaml.safe_load(output.read_text())["checks"]
    assert check["name"] == "renamed" and check["budget"] == "2GiB"
    assert "timing_rounds" not in check  # meta, the default device, runs no rounds
    assert check["baseline"] == "base/small.profile.yaml"


def test_init_check_rejects_bad_input(app, tmp_path):
    output = tmp_path / "memplan.yaml"
    assert invoke(app, "init-check", str(tmp_path / "nope.py"), "-o", str(output)).exit_code == 2
    result = invoke(app, "init-check", SMALL, "-o", str(output), "--budget", "lots")
    assert result.exit_code == 2 and "--budget" in result.output
    assert not output.exists()


def test_check_model_times_one_check_without_a_config():
    from memplan.check import check_model

    result = check_model(SMALL, target_batch=8, budget="1GiB", device="cpu")
    assert result.status == "pass" and result.name == "check_small"
    assert result.probe_seconds > 0 and result.solve_seconds > 0
    assert result.seconds == result.probe_seconds + result.solve_seconds


def test_repository_gate_passes_for_the_gpt_example(app, monkeypatch):
    """The dogfood config: the GPT example on meta against its committed budget."""
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    result = invoke(app, "check", "--only", "gpt-rtx4090", "--json")
    assert result.exit_code == 0, result.output
    (check,) = json.loads(result.stdout)["checks"]
    assert check["status"] == "pass" and check["device"] == "meta"
    assert check["headroom_bytes"] > 0
