"""memplan.yaml is read strictly: every mistake is exit 2 naming the field path."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memplan.check import load_config, run_checks
from memplan.errors import BadInputError

MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def app():
    from memplan.cli import app
    from memplan.cli.check import register

    register(app)
    register(app)  # idempotent
    return app


def write_config(tmp_path: Path, check: dict, **top) -> Path:
    entry = {
        "name": "small",
        "model": str(MODELS / "check_small.py"),
        "target_batch": 8,
        "budget": "1GiB",
        "device": "meta",
    }
    entry.update(check)
    entry = {k: v for k, v in entry.items() if v is not None}
    path = tmp_path / "memplan.yaml"
    path.write_text(yaml.safe_dump({"checks": [entry], **top}), encoding="utf-8")
    return path


def test_register_is_idempotent(app):
    names = [c.name for c in app.registered_commands]
    assert names.count("check") == 1
    assert names.count("init-check") == 1


def test_valid_config_resolves_paths_and_budget(tmp_path):
    (tmp_path / "m.py").write_text((MODELS / "check_small.py").read_text())
    path = write_config(
        tmp_path,
        {"model": "m.py:build_model", "budget": "512MiB", "baseline": "base/m.profile.yaml"},
    )
    config = load_config(path)
    (check,) = config.checks
    assert check.budget_bytes == 512 * 1024**2
    assert check.model_path == tmp_path / "m.py"
    assert check.baseline_path == tmp_path / "base" / "m.profile.yaml"
    assert check.spec.margin == 0.03 and check.spec.device == "meta"


def test_percent_budget_uses_device_profile(tmp_path):
    config = load_config(write_config(tmp_path, {"budget": "50%", "device_profile": "rtx4090"}))
    assert config.checks[0].budget_bytes == 25757220864 // 2
    # No budget at all: the device profile's whole memory.
    config = load_config(write_config(tmp_path, {"budget": None, "device_profile": "rtx4090"}))
    assert config.checks[0].budget_bytes == 25757220864


def test_a_spec_file_device_profile_is_relative_to_the_config(tmp_path, monkeypatch):
    """Like every path in memplan.yaml, a spec file is found beside it, whatever the working
    directory: it was looked up from the working directory, so `check -c sub/memplan.yaml`
    refused a spec that `cd sub && check` accepted."""
    from memplan.devices import load_device, profiles_dir

    folder = tmp_path / "project"
    folder.mkdir()
    text = (profiles_dir() / "devices" / "rtx4090.yaml").read_text()
    (folder / "mine.yaml").write_text(text.replace("name: rtx4090", "name: mine"))
    path = write_config(folder, {"budget": "50%", "device_profile": "mine.yaml"})
    monkeypatch.chdir(tmp_path)
    (check,) = load_config(path).checks
    assert check.device_profile == str((folder / "mine.yaml").resolve())
    assert check.device_spec == load_device(str(folder / "mine.yaml"))
    assert check.device_spec.name == "mine" and check.budget_bytes == 25757220864 // 2
    (check,) = load_config(write_config(folder, {"device_profile": "rtx4090"})).checks
    assert check.device_profile == "rtx4090"  # a shipped spec's name stays a name


def test_a_missing_spec_file_is_named_as_a_missing_file(tmp_path):
    path = write_config(tmp_path, {"device_profile": "gone.yml"})
    with pytest.raises(BadInputError) as raised:
        load_config(path)
    message = raised.value.message
    assert "checks[0].device_profile" in message and "gone.yml does not exist" in message
    assert "Unknown device profile" not in message and ".." not in message


@pytest.mark.parametrize(
    ("check", "top", "field"),
    [
        ({"budjet": "1GiB"}, {}, "checks[0]"),  # unknown key, with a did-you-mean
        ({"budget": "24 GiBs"}, {}, "checks[0].budget"),
        ({"budget": "50%"}, {}, "checks[0].budget"),  # % without a device profile
        ({"budget": "auto"}, {}, "checks[0].budget"),
        ({"budget": None}, {}, "checks[0].budget"),
        ({"model": "no/such/model.py"}, {}, "checks[0].model"),
        ({"device": "tpu"}, {}, "checks[0].device"),
        ({"target_batch": "many"}, {}, "checks[0].target_batch"),
        ({"target_batch": 10, "world_size": 4}, {}, "checks[0]"),
        ({"device_profile": "gtx9999"}, {}, "checks[0].device_profile"),
        ({"micro_batches": [4]}, {}, "checks[0].micro_batches"),
        ({"seq_len": 0}, {}, "checks[0]"),
        ({"seq_len": "long"}, {}, "checks[0].seq_len"),
        ({"timing_rounds": 2}, {}, "checks[0]"),  # a meta probe runs no timing rounds
        ({"timing_rounds": 0, "device": "cpu"}, {}, "checks[0]"),
        ({"timing_rounds": 101, "device": "cpu"}, {}, "checks[0]"),
        ({"timing_rounds": True, "device": "cpu"}, {}, "checks[0].timing_rounds"),
        ({"timing_rounds": 1.5, "device": "cpu"}, {}, "checks[0].timing_rounds"),
        ({}, {"chekcs": []}, "(top level)"),
    ],
)
def test_bad_config_is_exit_2_naming_the_field(app, tmp_path, check, top, field):
    path = write_config(tmp_path, check, **top)
    with pytest.raises(BadInputError) as info:
        load_config(path)
    assert f"'{field}" in info.value.message
    result = CliRunner().invoke(app, ["check", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert field in result.output
    assert "Traceback" not in result.output


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(BadInputError) as info:
        load_config(write_config(tmp_path, {"budjet": "1GiB"}))
    assert "budjet" in info.value.message and "budget" in (info.value.hint or "")


def test_duplicate_names_and_unknown_only(app, tmp_path):
    path = tmp_path / "memplan.yaml"
    entry = {
        "name": "a",
        "model": str(MODELS / "check_small.py"),
        "target_batch": 8,
        "budget": "1GiB",
    }
    # two copies: the same dict twice would be dumped as an anchor and an alias (refused)
    path.write_text(yaml.safe_dump({"checks": [entry, dict(entry)]}), encoding="utf-8")
    with pytest.raises(BadInputError, match=r"checks\[1\]\.name"):
        load_config(path)
    path.write_text(yaml.safe_dump({"checks": [entry]}), encoding="utf-8")
    with pytest.raises(BadInputError, match="--only nope"):
        run_checks(path, only=["nope"])
    result = CliRunner().invoke(app, ["check", "--config", str(path), "--only", "nope"])
    assert result.exit_code == 2


def test_missing_config_and_non_mapping(app, tmp_path):
    result = CliRunner().invoke(app, ["check", "--config", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2 and "init-check" in result.output
    bad = tmp_path / "memplan.yaml"
    bad.write_text("checks: {name: x}\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["check", "--config", str(bad)])
    assert result.exit_code == 2 and "checks" in result.output
