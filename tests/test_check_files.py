"""The CI files users copy: the GitHub workflow parses and runs `memplan check`; the
pre-commit hook invokes the real console script; the repo's memplan.yaml is valid."""

import shlex
from pathlib import Path

import tomllib
import yaml

from memplan.check import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_github_workflow_parses_and_runs_memplan_check():
    workflow = yaml.safe_load((ROOT / "examples/ci/github-workflow.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert "pull_request" in triggers
    (job,) = workflow["jobs"].values()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    check_lines = [
        line
        for run in runs
        for line in run.splitlines()
        if line.strip().startswith("memplan check")
    ]
    assert check_lines, runs
    argv = shlex.split(check_lines[0])
    assert argv[:2] == ["memplan", "check"]
    assert "--junit" in argv


def test_docs_show_the_same_workflow_command():
    docs = (ROOT / "docs/ci.md").read_text()
    assert "memplan check --config memplan.yaml --junit memplan-report.xml" in docs
    assert "id: memplan-check" in docs


def test_pre_commit_hook_invokes_the_console_script():
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "memplan-check"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    argv = shlex.split(hook["entry"])
    assert argv[0] in scripts
    assert scripts[argv[0]] == "memplan.cli:main"
    assert argv[1] == "check"
    assert hook["language"] == "python"
    assert hook["pass_filenames"] is False


def test_pre_commit_entry_is_a_registered_command():
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.cli.check import register

    register(app)
    hook = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())[0]
    result = CliRunner().invoke(app, [*shlex.split(hook["entry"])[1:], "--help"])
    assert result.exit_code == 0, result.output
    assert "--update-baseline" in result.output


def test_repository_memplan_yaml_is_valid():
    config = load_config(ROOT / "memplan.yaml")
    names = {c.name for c in config.checks}
    assert len(names) == len(config.checks) >= 2
    for check in config.checks:
        assert check.spec.device == "meta"
        assert check.model_path.is_file()


def test_docs_list_every_json_key():
    from test_check_report import BREAKDOWN_SHAPE, CHECK_SHAPE, GROWTH_SHAPE, PLAN_SHAPE

    docs = (ROOT / "docs/ci.md").read_text()
    for shape in (CHECK_SHAPE, PLAN_SHAPE, GROWTH_SHAPE, BREAKDOWN_SHAPE):
        for key in shape:
            assert f'"{key}"' in docs, key
