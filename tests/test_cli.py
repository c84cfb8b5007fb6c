"""The command line end to end on a tiny model: exit codes, files written, numbers shown."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.plan import load_plan
from memplan.profile import load_profile

MODEL = str(Path(__file__).parent / "models" / "cli_tiny_gpt.py")
runner = CliRunner()


def _build():
    from memplan.model.loader import load_model_file

    return load_model_file(MODEL).build_model()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny.profile.yaml"
    result = invoke("probe", MODEL, "--device", "cpu", "-o", path)
    assert result.exit_code == 0, result.output
    return path


def test_probe_writes_a_loadable_profile(profile_path):
    profile = load_profile(profile_path)
    assert profile.layer_names == ("blocks.0", "blocks.1", "blocks.2")
    assert profile.micro_batches == (1, 2, 4)
    # AdamW keeps two fp32 moments per trainable parameter and a 4-byte step count per tensor.
    n_tensors = len(list(torch.nn.Module.parameters(_build())))
    expected = 2 * profile.totals.params_trainable_bytes + 4 * n_tensors
    assert profile.totals.optimizer_state_bytes == expected


def test_probe_refuses_to_overwrite_before_probing(profile_path):
    before = profile_path.read_bytes()
    result = invoke("probe", MODEL, "--device", "cpu", "-o", profile_path)
    assert result.exit_code == 2
    assert "--force" in result.output
    assert profile_path.read_bytes() == before


def test_probe_json_is_the_profile(tmp_path):
    result = runner.invoke(
        app, ["probe", MODEL, "--device", "meta", "--micro-batches", "1,2", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["environment"]["device"] == "meta"
    assert [layer["name"] for layer in data["layers"]] == ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["probe", "no/such/model.py"], 2, "does not exist"),
        (["probe", MODEL, "--micro-batches", "4"], 2, "at least two"),
        (["probe", MODEL, "--precision", "fp8"], 2, "fp8"),
        (["probe", MODEL, "--device", "tpu"], 2, "tpu"),
    ],
)
def test_probe_bad_input(args, code, needle):
    result = invoke(*args)
    assert result.exit_code == code
    assert needle in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_probe_cuda_without_gpu_exits_3():
    result = invoke("probe", MODEL, "--device", "cuda")
    assert result.exit_code == 3
    assert "--device cpu" in result.output


def test_an_op_sequence_that_differed_is_warned_once(profile_path, monkeypatch):
    """The probe records the warning in the profile (memplan.probe.assemble); showing the
    profile printed it from there and again from ``op_sequence_stable``. Once now, and a
    profile of an older memplan, without the recorded warning, still gets it."""
    import dataclasses

    from memplan import render

    said: list[str] = []
    monkeypatch.setattr(render, "warn", said.append)
    profile = load_profile(profile_path)
    recorded = (
        "The op sequence differed between probed sizes (data-dependent routing?): segment "
        "maxima were fitted, not points; verify plans at their micro-batch."
    )
    unstable = dataclasses.replace(profile, op_sequence_stable=False, warnings=(recorded,))
    render.show_profile(unstable)
    assert sum("op sequence differed" in m for m in said) == 1, said
    said.clear()
    render.show_profile(dataclasses.replace(unstable, warnings=()))
    assert sum("op sequence differed" in m for m in said) == 1, said


def test_show_renders_profile_and_rejects_corruption(profile_path, tmp_path):
    assert invoke("show", profile_path).exit_code == 0
    broken = tmp_path / "broken.yaml"
    broken.write_text(profile_path.read_text().replace("micro_batches", "micro_batchez"))
    result = invoke("show", broken)
    assert result.exit_code == 2
    assert "micro_batchez" in result.output and "micro_batches" in result.output


def test_solve_writes_plan_and_formats(profile_path, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    result = invoke(
        "solve",
        profile_path,
        "--target-batch",
        8,
        "--budget",
        "1GiB",
        "-o",
        plan_path,
        "--format",
        "hf,deepspeed,torch",
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(plan_path)
    assert plan.micro_batch_size * plan.accumulation_steps == 8
    assert plan.budget_bytes == 1024**3
    assert plan.predicted.peak_bytes <= 0.97 * plan.budget_bytes
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 4, written  # plan + three formats
    ds = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert ds["train_batch_size"] == 8

    # A second run refuses to overwrite anything and leaves every file as it was.
    stamps = {p: p.read_bytes() for p in tmp_path.iterdir()}
    again = invoke(
        "solve",
        profile_path,
        "--target-batch",
        8,
        "--budget",
        "1GiB",
        "-o",
        plan_path,
        "--format",
        "hf,deepspeed,torch",
    )
    assert again.exit_code == 2
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == stamps


def test_solve_infeasible_exits_1_with_the_memory_needed(profile_path):
    result = invoke("solve", profile_path, "--target-batch", 8, "--budget", "64KiB")
    assert result.exit_code == 1
    assert "MiB" in result.output or "KiB" in result.output


def test_solve_bad_target_and_budget_exit_2(profile_path):
    result = invoke(
        "solve", profile_path, "--target-batch", 7, "--budget", "1GiB", "--world-size", 2
    )
    assert result.exit_code == 2
    assert "8" in result.output  # names a valid target near 7
    result = invoke("solve", profile_path, "--target-batch", 8, "--budget", "lots")
    assert result.exit_code == 2 and "24GiB" in result.output
    result = invoke(
        "solve", profile_path, "--target-batch", 8, "--budget", "1GiB", "--format", "keras"
    )
    assert result.exit_code == 2 and "keras" in result.output


def test_solve_percent_budget_with_device_profile(profile_path):
    result = runner.invoke(
        app,
        [
            "solve",
            str(profile_path),
            "--target-batch",
            "8",
            "--budget",
            "50%",
            "--device-profile",
            "t4",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert plan["budget_bytes"] == 15360 * 1024**2 // 2  # half of a T4's 15360 MiB


# "MY-T4.YAML" was looked up as a shipped spec's name ("Unknown device profile"), while a
# plan naming it passed plan.py's case-insensitive check: one rule now (names_spec_file).
@pytest.mark.parametrize("file_name", ["my-t4.yaml", "MY-T4.YAML"])
def test_a_plan_solved_for_a_spec_file_names_the_file(profile_path, tmp_path, file_name):
    # A device spec of one's own (a copy of t4 under another name and capacity): the plan
    # is written (it was refused at write, exit 3, naming plan.device) and names the file,
    # which reads back as the spec its reserve was computed for.
    import yaml

    from memplan.devices import load_device, profiles_dir
    from memplan.report import device_spec_for_plan

    spec = yaml.safe_load((profiles_dir() / "devices" / "t4.yaml").read_text())
    spec.update(name="my-t4", memory_bytes=8 * 1024**3)
    spec_path = tmp_path / file_name
    spec_path.write_text(yaml.safe_dump(spec))
    plan_path = tmp_path / "plan.yaml"
    result = invoke(
        "solve", profile_path, "--target-batch", "8", "--budget", "50%",
        "--device-profile", spec_path, "-o", plan_path,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = load_plan(plan_path)
    assert plan.device == str(spec_path.resolve())
    assert plan.budget_bytes == 4 * 1024**3
    assert device_spec_for_plan(plan) == load_device(str(spec_path))


def test_a_meta_profile_timed_against_a_spec_file_solves_without_naming_it_again(tmp_path):
    # It recorded the spec's name, which no file or shipped spec has: solve then made a plan
    # naming "my-t4" and refused it (exit 3, plan.device). Now the profile records the
    # file's path: the plan names it, the meta clock is the probe's (no re-timing), and a
    # spec without a capacity (a CPU's) adds no CUDA reserve.
    import yaml

    from memplan.devices import profiles_dir

    def spec_file(name: str, memory_bytes: int | None):
        spec = yaml.safe_load((profiles_dir() / "devices" / "t4.yaml").read_text())
        spec.update(name=name, memory_bytes=memory_bytes)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    for path, reserved in (
        (spec_file("my-t4", 8 * 1024**3), True),
        (spec_file("mine", None), False),
    ):
        profile = tmp_path / f"{path.stem}.profile.yaml"
        result = invoke(
            "probe", MODEL, "--device", "meta", "--device-profile", path,
            "--precision", "fp16", "--micro-batches", "2,4", "-o", profile,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        assert load_profile(profile).environment.device_profile == str(path.resolve())
        for again in ((), ("--device-profile", path)):
            result = invoke(
                "solve", profile, "--target-batch", "4", "--budget", "4GiB", *again, "--json"
            )
            assert result.exit_code == 0, result.output
            plan = json.loads(result.stdout)["plan"]
            assert plan["device"] == str(path.resolve())
            assert not any(
                "by roofline" in r or "rescaled to" in r for r in plan["reasons"]
            )  # the probe's clock
            assert (plan["predicted"]["breakdown"]["reserve"] > 0) is reserved


def test_a_spec_file_moved_after_the_probe_is_still_the_probes_clock(tmp_path):
    # The profile recorded the spec file's absolute path only: once the file was moved (or
    # the project checked out elsewhere), solve --device-profile NEW/PATH found no file at
    # the recorded path and re-timed the meta profile by roofline, a different step time.
    # The profile now also records the spec's numbers (device_spec_digest).
    import shutil

    import yaml

    from memplan.devices import profiles_dir

    spec = yaml.safe_load((profiles_dir() / "devices" / "t4.yaml").read_text())
    spec.update(name="lab-t4")
    first = tmp_path / "a" / "lab-t4.yaml"
    first.parent.mkdir()
    first.write_text(yaml.safe_dump(spec))
    profile = tmp_path / "p.yaml"
    result = invoke(
        "probe", MODEL, "--device", "meta", "--device-profile", first,
        "--precision", "fp16", "--micro-batches", "2,4", "-o", profile,
    )  # fmt: skip
    assert result.exit_code == 0, result.output

    def solved(spec_path):
        result = invoke(
            "solve", profile, "--target-batch", "4", "--budget", "4GiB",
            "--device-profile", spec_path, "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout)["plan"]
        return plan["predicted"]["step_seconds"], any(
            "by roofline" in r or "rescaled to" in r for r in plan["reasons"]
        )

    before, retimed = solved(first)
    assert not retimed
    moved = tmp_path / "b" / "renamed.yaml"
    moved.parent.mkdir()
    shutil.move(first, moved)
    assert solved(moved) == (before, False)
    # A copy differing only in what the solver reads itself (its link, NCCL's share of it,
    # the capacity) is the same clock: kept (before, every number counted: re-timed)
    linked = dict(spec, interconnect_bandwidth=64e9, memory_bytes=2 * spec["memory_bytes"])
    linked["efficiency"] = dict(spec.get("efficiency") or {}, interconnect=0.5)
    pcie = tmp_path / "b" / "pcie.yaml"
    pcie.write_text(yaml.safe_dump(linked))
    assert solved(pcie) == (before, False)
    # A spec with other numbers is another device: re-timed (rescaled from its clock), as before.
    spec["efficiency"] = dict(spec.get("efficiency") or {}, matmul=0.5)
    other = tmp_path / "b" / "slower.yaml"
    other.write_text(yaml.safe_dump(spec))
    after, retimed = solved(other)
    assert retimed and after != before


def test_verify_measures_within_tolerance(profile_path, tmp_path):
    # A budget just above micro-batch 8's best peak, so the plan runs close to it.
    plan_path = tmp_path / "plan.yaml"
    result = runner.invoke(
        app,
        [
            "solve",
            str(profile_path),
            "--target-batch",
            "8",
            "--budget",
            "1GiB",
            "--json",
            "--max-micro",
            "8",
        ],
    )
    rows = json.loads(result.stdout)["candidates"]
    row8 = next(r for r in rows if r["micro_batch"] == 8)
    assert (
        invoke(
            "solve",
            profile_path,
            "--target-batch",
            8,
            "--budget",
            str(int(row8["peak_bytes"] * 1.01)),
            "--margin",
            "0",
            "-o",
            plan_path,
        ).exit_code
        == 0
    )
    result = runner.invoke(app, ["verify", MODEL, str(plan_path), "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert abs(data["peak_error"]) <= 0.05
    assert data["within_budget"] is True
    assert data["effective_batch"] == 8
    assert data["gradient_check"]["status"] in ("pass", "skipped")


def test_a_gpu_plan_verified_on_cpu_leaves_out_the_cuda_reserve(profile_path, tmp_path):
    # Planned for a T4: the prediction carries a CUDA context and allocator reserve that a
    # CPU run does not have; verify compares the tensor bytes and says so.
    plan_path = tmp_path / "t4.yaml"
    result = invoke(
        "solve",
        profile_path,
        "--target-batch",
        8,
        "--budget",
        "4GiB",
        "--device-profile",
        "t4",
        "-o",
        plan_path,
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(plan_path)
    reserve = plan.predicted.breakdown.reserve
    assert reserve >= 512 * 1024**2
    result = runner.invoke(
        app,
        [
            "verify",
            MODEL,
            str(plan_path),
            "--steps",
            "1",
            "--device",
            "cpu",
            "--no-grad-check",
            "--json",
        ],
    )
    data = json.loads(result.stdout)
    assert data["predicted_peak_bytes"] == plan.predicted.peak_bytes - reserve
    assert "CUDA reserve" in data["note"]
    assert abs(data["peak_error"]) <= 0.05


def test_formats_help_lists_every_registered_format():
    from memplan.cli import FORMATS_HELP
    from memplan.emit import FORMATS

    listed = FORMATS_HELP.removeprefix("Comma-separated: ").rstrip(".").split(", ")
    assert listed == list(FORMATS)


@pytest.mark.parametrize("command", ["probe", "solve", "verify", "report", "show", "check"])
def test_help_at_80_columns_names_every_option_whole(command):
    import typer.main

    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    names = [
        name
        for param in click_command.params
        for name in (*param.opts, *param.secondary_opts)
        if name.startswith("--")
    ]
    assert names  # the command has long options, and each is shown whole
    missing = [name for name in names if name not in result.output]
    assert missing == [], missing
    assert max(len(line) for line in result.output.splitlines()) <= 80


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("show", "{d}"), "profile or plan file {d} is a folder"),
        (
            ("solve", "{d}", "--target-batch", "2", "--budget", "1GiB"),
            "profile file {d} is a folder",
        ),
        (("verify", MODEL, "{d}"), "plan file {d} is a folder"),
        (("check", "--config", "{d}"), "config file {d} is a folder"),
    ],
)
def test_a_folder_where_a_file_belongs_is_called_a_folder(tmp_path, args, said):
    # It was "does not exist. Check the path.", about a path that exists.
    d = str(tmp_path)
    result = runner.invoke(app, [a.format(d=d) for a in args])
    assert result.exit_code == 2, result.output
    assert said.format(d=d) in " ".join(result.output.split())


def test_solve_from_another_folder_finds_the_probed_model_file(tmp_path, monkeypatch):
    """A profile records the model's path relative to where probe ran ('models/m.py');
    solved from another folder, the plan and its script named a file that was not there,
    without a word. Now the file is found beside the profile's folder or above it (its
    bytes the probed ones), and the script names it relative to its own folder."""
    import shutil

    project, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (project / "models").mkdir(parents=True)
    (project / "profiles").mkdir()
    elsewhere.mkdir()
    shutil.copy(MODEL, project / "models" / "m.py")
    monkeypatch.chdir(project)
    probed = invoke("probe", "models/m.py", "--device", "meta", "-o", "profiles/m.yaml")
    assert probed.exit_code == 0, probed.output
    assert load_profile(project / "profiles" / "m.yaml").model.path == "models/m.py"
    monkeypatch.chdir(elsewhere)
    args = ("solve", "../proj/profiles/m.yaml", "--target-batch", "4", "--budget", "1GiB")
    solved = invoke(*args, "-o", "out/plan.yaml", "--format", "plan,torch")
    assert solved.exit_code == 0, solved.output
    assert load_plan(elsewhere / "out" / "plan.yaml").model == "../proj/models/m.py"
    script = (elsewhere / "out" / "train_memplan.py").read_text()
    assert 'MODEL = "../../proj/models/m.py"' in script
    assert (elsewhere / "out" / "../../proj/models/m.py").resolve().is_file()
    # another file of that name (not the probed bytes) is not taken: the path is kept, said
    (project / "models" / "m.py").write_text("# edited\n")
    kept = invoke(*args, "-o", "again.yaml")
    assert kept.exit_code == 0
    assert load_plan(elsewhere / "again.yaml").model == "models/m.py"
    assert "Pass --model PATH" in " ".join(kept.output.split())


def test_solve_model_names_a_file_it_checks_against_the_probed_one(tmp_path, monkeypatch):
    """--model was written into the plan and its scripts without a word: another model's
    file (the torch script then trained it with this plan's numbers) or no file at all. Now
    each is warned of; the probed file itself, or a copy of it, is not. An absolute model
    path recorded on another machine is found by its name beside the profile."""
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(MODEL, tmp_path / "m.py")
    probed = invoke("probe", "m.py", "--device", "meta", "-o", "m.yaml")
    assert probed.exit_code == 0, probed.output
    args = ("solve", "m.yaml", "--target-batch", "4", "--budget", "1GiB")
    shutil.copy(MODEL, tmp_path / "copy.py")
    (tmp_path / "other.py").write_text(Path(MODEL).read_text() + "\n# another model\n")
    said = {}
    for name in ("m.py", "copy.py", "other.py", "gone/m.py"):
        done = invoke(*args, "--model", name, "-o", f"plan-{name.replace('/', '-')}")
        assert done.exit_code == 0, done.output
        said[name] = " ".join(done.output.split())
    assert "--model" not in said["m.py"] and "--model" not in said["copy.py"]
    assert "--model other.py is not the file the profile measured (m.py)" in said["other.py"]
    assert "--model gone/m.py is not a file here" in said["gone/m.py"]
    # the profile recorded /home/alice/proj/m.py: m.py beside it, of the probed bytes
    text = (tmp_path / "m.yaml").read_text().replace("path: m.py", "path: /home/alice/proj/m.py")
    (tmp_path / "abs.yaml").write_text(text)
    done = invoke("solve", "abs.yaml", "--target-batch", "4", "--budget", "1GiB", "-o", "a.yaml")
    assert done.exit_code == 0 and "not found from here" not in done.output, done.output
    assert load_plan(tmp_path / "a.yaml").model == "m.py"


def test_no_output_replaces_the_commands_own_input_even_with_force(tmp_path, monkeypatch):
    """solve p.yaml -o p.yaml --force replaced the profile with its plan (whose profile:
    then named itself), and --format plan --out-dir over an input called plan.yaml too. Now
    every spelling of an input (a hard link included) is refused, and the input is kept."""
    import os
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copy(MODEL, tmp_path / "m.py")
    model_text = (tmp_path / "m.py").read_text()
    done = invoke("probe", "m.py", "--device", "meta", "-o", "m.py", "--force")
    assert done.exit_code == 2 and "is this command's input (m.py)" in done.output
    assert (tmp_path / "m.py").read_text() == model_text
    assert invoke("probe", "m.py", "--device", "meta", "-o", "plan.yaml").exit_code == 0
    profile_text = (tmp_path / "plan.yaml").read_text()
    os.link(tmp_path / "plan.yaml", tmp_path / "hard.yaml")
    args = ("solve", "plan.yaml", "--target-batch", "4", "--budget", "1GiB", "--force")
    for more in (
        ("-o", "plan.yaml"),
        ("-o", "./sub/../plan.yaml"),
        ("-o", "hard.yaml"),
        ("--format", "plan", "--out-dir", "."),
    ):
        done = invoke(*args, *more)
        assert done.exit_code == 2, (more, done.output)
        assert "is this command's input (plan.yaml)" in " ".join(done.output.split()), more
    assert (tmp_path / "plan.yaml").read_text() == profile_text
    assert invoke(*args, "-o", "other.yaml").exit_code == 0  # any other path is written
