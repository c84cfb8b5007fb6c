"""Hostile device specs and the flags around them (sweep F): absurd efficiencies and rates
refused when the spec is read (exit 2, naming the file and field), not blamed on memplan or
crashing the clock; calibrate that would measure the CPU for a GPU's spec; the devices
table's rates; a budget of a spec with no memory; paths that are not spec files; --device's
case; --margin named; a budget with no unit below 1 MiB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from profiles_factory import uniform_chain
from typer.testing import CliRunner

from memplan import devices
from memplan.cli import app
from memplan.devices import MIN_EFFICIENCY, load_device, resolve_budget
from memplan.errors import BadInputError, ProfileError
from memplan.profile import profile_to_yaml

runner = CliRunner()
SHIPPED = Path(__file__).resolve().parent.parent / "profiles" / "devices"
MLP = Path(__file__).resolve().parent.parent / "examples" / "mlp.py"


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def said(result) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(result.output.split())


def _spec(path: Path, base: str = "l4", **changes: object) -> Path:
    """The shipped spec ``base`` with ``changes`` (``efficiency`` merged), written to ``path``."""
    data = yaml.safe_load((SHIPPED / f"{base}.yaml").read_text())
    efficiency = changes.pop("efficiency", None)
    data.update(changes)
    if efficiency is not None:
        data["efficiency"] = {**data.get("efficiency", {}), **efficiency}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def here(tmp_path, monkeypatch):
    """tmp_path as the working directory (short relative paths in the messages), with a
    small profile measured on the CPU in it."""
    monkeypatch.chdir(tmp_path)
    Path("chain.profile.yaml").write_text(profile_to_yaml(uniform_chain(4).profile()))
    return tmp_path


# ------------------------------------------------------------------ E: absurd specs


@pytest.mark.parametrize("value", [1e-300, MIN_EFFICIENCY / 2])
@pytest.mark.parametrize("field", ["matmul", "attention", "memory", "interconnect"])
def test_an_efficiency_below_calibrates_floor_is_refused_naming_file_and_field(
    tmp_path, field, value
):
    path = _spec(tmp_path / "eff.yaml", "h100-80gb", efficiency={field: value})
    with pytest.raises(ProfileError) as caught:
        load_device(str(path))
    message = str(caught.value)
    assert caught.value.exit_code == 2
    assert str(path) in message and "field 'device.efficiency'" in message
    assert f"{field} is {value!r}, below 1e-09" in message
    assert "memplan calibrate" in message  # what to do
    # at the floor itself: a spec (calibrate writes no smaller fraction)
    ok = _spec(tmp_path / "ok.yaml", "h100-80gb", efficiency={field: MIN_EFFICIENCY})
    assert getattr(load_device(str(ok)).efficiency, field) == MIN_EFFICIENCY


@pytest.mark.parametrize(
    ("field", "value", "need"),
    [
        ("fp32_flops", 1.0e-290, "at least 1e+06 FLOP/s"),
        ("bf16_flops", 989.0, "at least 1e+06 FLOP/s"),  # TFLOP/s written where FLOP/s go
        ("fp8_flops", 1.0, "at least 1e+06 FLOP/s"),
        ("memory_bandwidth", 300.0, "at least 1e+06 bytes/s"),
        ("interconnect_bandwidth", 1.0e-290, "0 (unknown) or at least 1 bytes/s"),
        ("host_link_bandwidth", 0.5, "0 (unknown) or at least 1 bytes/s"),
    ],
)
def test_a_rate_below_its_floor_is_refused(tmp_path, field, value, need):
    path = _spec(tmp_path / "slow.yaml", **{field: value})
    with pytest.raises(ProfileError) as caught:
        load_device(str(path))
    message = str(caught.value)
    assert caught.value.exit_code == 2 and str(path) in message
    assert f"{field} is {value!r}; it must be {need}" in message
    assert "Write it in " in message  # what to do
    # the floor itself is a spec; a link may still be 0 (unknown)
    link = field.endswith("_bandwidth") and field != "memory_bandwidth"
    floor = devices.MIN_LINK_RATE if link else devices.MIN_RATE
    assert getattr(load_device(str(_spec(tmp_path / "ok.yaml", **{field: floor}))), field) == floor
    if link:
        assert getattr(load_device(str(_spec(tmp_path / "zero.yaml", **{field: 0.0}))), field) == 0


def test_solve_with_an_absurd_spec_is_bad_input_not_memplans_failure(here):
    _spec(here / "eff.yaml", "h100-80gb", efficiency={"matmul": 1e-300})
    _spec(here / "flops.yaml", fp32_flops=1.0e-290)
    for spec, what in (("eff.yaml", "matmul is 1e-300"), ("flops.yaml", "fp32_flops is 1e-290")):
        args = ("chain.profile.yaml", "--target-batch", 8, "--budget", "80%")
        result = invoke("solve", *args, "--device-profile", spec, "--json")
        assert result.exit_code == 2, result.output  # before: 3 (or 0 on a measured profile)
        shown = json.loads(result.stdout)
        assert shown["feasible"] is False and shown["exit_code"] == 2
        assert spec in shown["error"] and what in shown["error"]


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"fp32_flops": 1.0e-290}, "fp32_flops is 1e-290"),
        ({"efficiency": {"matmul": 1e-300, "memory": 1e-300}}, "is 1e-300, below 1e-09"),
    ],
)
def test_a_meta_probe_on_an_absurd_spec_is_exit_2_not_a_traceback(here, changes, what):
    # before: OverflowError from the clock's fits (exit 1, a traceback)
    _spec(here / "bad.yaml", "h100-80gb", **changes)
    result = invoke("probe", MLP, "--device", "meta", "--device-profile", "bad.yaml")
    assert result.exit_code == 2, result.output
    assert "bad.yaml" in said(result) and what in said(result)


# ------------------------------------------------------------------ J: calibrate with no GPU


def test_calibrate_a_gpu_spec_where_auto_finds_no_gpu_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "mine.yaml"
    result = invoke("calibrate", "h100-80gb", "-o", out, "--quick", "--precision", "fp32")
    assert result.exit_code == 2, result.output  # before: 0, the CPU's rates as an H100's
    text = said(result)
    assert "no GPU was found" in text and "--device cpu" in text
    assert not out.exists()


def test_calibrate_a_gpu_spec_on_the_cpu_when_asked_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "mine.yaml"
    args = ("-o", out, "--quick", "--precision", "fp32", "--device", "cpu")
    result = invoke("calibrate", "h100-80gb", *args)
    assert result.exit_code == 0, result.output
    assert "warning: --device cpu: the rates measured are this machine's CPU's" in said(result)
    assert load_device(str(out)).memory_bytes == load_device("h100-80gb").memory_bytes
    # a base with no capacity (a CPU's spec) is the CPU's to measure: no warning
    base = _spec(tmp_path / "base.yaml", "cpu", fp32_flops=1e14, memory_bandwidth=1e13)
    result = invoke("calibrate", base, "-o", tmp_path / "cpu.yaml", *args[2:])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output


# ------------------------------------------------------------------ M: the devices table


def test_the_devices_table_shows_rates_to_three_significant_figures():
    result = invoke("devices")
    assert result.exit_code == 0
    rows = {
        cells[0]: cells
        for line in result.output.splitlines()
        if len(cells := [c.strip() for c in line.strip("│ ").split("│")]) == 7
    }
    # cpu.yaml: bf16 and fp32 100 GFLOP/s; before: "0" and "0.1"
    assert rows["cpu"][3:6] == ["0.1", "0.1", "20 GB/s"]
    assert rows["h100-80gb"][3:6] == ["989", "67", "3350 GB/s"]
    assert rows["l4"][3:5] == ["121", "30.3"]


# ------------------------------------------------------------------ P, L: budgets and paths


def test_a_percentage_of_a_spec_with_one_byte_names_budget_and_memory(here):
    _spec(here / "tiny.yaml", memory_bytes=1)
    args = ("chain.profile.yaml", "--target-batch", 8, "--budget", "80%")
    result = invoke("solve", *args, "--device-profile", "tiny.yaml")
    assert result.exit_code == 2
    text = said(result)  # before: "budget_bytes must be a positive integer, got 0"
    assert "--budget '80%' of the device spec l4's memory (1 bytes) is 0 bytes" in text
    assert "memory_bytes" in text and "budget_bytes" not in text
    spec = load_device(str(here / "tiny.yaml"))
    with pytest.raises(BadInputError, match="budget '50%' of the device spec l4"):
        resolve_budget("50%", device_spec=spec, probed_capacity_bytes=None, what="budget")


def test_a_percentage_with_the_cpu_spec_says_it_has_no_memory(here):
    args = ("chain.profile.yaml", "--target-batch", 8, "--budget", "80%")
    result = invoke("solve", *args, "--device-profile", "cpu")
    assert result.exit_code == 2
    text = said(result)  # before: "Add --device-profile NAME", to one who had
    assert "the device spec cpu has no memory size" in text
    assert "Give --budget in bytes" in text and "Add --device-profile" not in text


def test_a_path_that_is_not_a_spec_file_says_what_is_wrong_with_it(here):
    (here / "specs").mkdir()
    (here / "specs.yaml").mkdir()
    (here / "mine.spec").write_text((SHIPPED / "l4.yaml").read_text())
    for given, problem in (
        ("specs", "Device spec specs is a folder, not a spec file"),
        ("specs.yaml", "Device spec specs.yaml is a folder, not a spec file"),
        ("mine.spec", "Device spec file mine.spec does not end in .yaml or .yml"),
    ):
        with pytest.raises(BadInputError) as caught:
            load_device(given)
        assert str(caught.value).startswith(problem), str(caught.value)
        assert "Unknown device profile" not in str(caught.value)
        result = invoke(
            "solve",
            "chain.profile.yaml",
            "--target-batch",
            8,
            "--budget",
            "1GiB",
            "--device-profile",
            given,
        )
        assert result.exit_code == 2 and problem in said(result)
    with pytest.raises(BadInputError, match=r"Rename or copy it to mine\.spec\.yaml"):
        load_device("mine.spec")
    # a name that is neither a file nor a shipped spec is still an unknown name
    with pytest.raises(BadInputError, match="Unknown device profile 'nope'"):
        load_device("nope")


# ------------------------------------------------------------------ V, U: flags


def test_probes_device_takes_any_case(tmp_path):
    # before: --device 'CPU' is not one of auto, cpu, cuda, meta (refused first)
    result = invoke("probe", MLP, "--device", "CPU", "--precision", "int8")
    assert result.exit_code == 2 and "--precision 'int8'" in said(result)
    result = invoke("probe", MLP, "--device", "Meta", "--timing-rounds", "1")
    assert result.exit_code == 2 and "a meta probe computes its times" in said(result)
    result = invoke("probe", MLP, "--device", "tpu")
    assert result.exit_code == 2 and "--device 'tpu' is not one of" in said(result)


def test_a_margin_of_one_names_the_flag(here):
    args = ("chain.profile.yaml", "--target-batch", 8, "--budget", "1GiB")
    result = invoke("solve", *args, "--margin", "1")
    assert result.exit_code == 2
    assert "--margin must be a fraction in [0, 1), got 1.0" in said(result)


def test_a_budget_with_no_unit_below_a_mebibyte_asks_if_gib_was_meant(here):
    args = ("chain.profile.yaml", "--target-batch", 8)
    result = invoke("solve", *args, "--budget", "24")
    assert result.exit_code == 1  # still 24 bytes: nothing fits
    assert "warning: --budget 24 is 24 bytes: did you mean 24GiB?" in said(result)
    for budget in ("24B", "24KiB", "2097152"):  # a unit, or a count of bytes that is no slip
        result = invoke("solve", *args, "--budget", budget)
        assert "did you mean" not in result.output, budget
