"""Keep issue 10 fixed: hypothesis over CLI arguments, profile and plan mutations, emitted
strings and misbehaving model files. Whatever comes in: no traceback, an exit code from the
contract (docs/contract.md) with its meaning, strict JSON on stdout with --json, nothing
written on failure and nothing outside the named outputs touched."""

import ast
import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import tomllib
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import FORMATS, emit
from memplan.errors import ProfileError
from memplan.plan import Breakdown, ModelFingerprint, Plan, Prediction, plan_from_data

ROOT = Path(__file__).resolve().parent.parent
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
MISBEHAVE = str(Path(__file__).parent / "models" / "trust_misbehave.py")
runner = CliRunner()
FAST = settings(
    max_examples=int(os.environ.get("MEMPLAN_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Any character, lone surrogates included (a path from argv may hold them).
ANY_TEXT = st.text(st.characters(exclude_categories=()), min_size=1, max_size=30)


def run(*args, env=None):
    result = runner.invoke(app, [str(a) for a in args], env=env)
    # CliRunner turns an escaped exception into result.exception; SystemExit is the exit.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.exit_code in (0, 1, 2, 3), result.exit_code
    return result


def strict_json(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))


# ------------------------------------------------------------------ emitted strings
def _plan(model: str, layers: list[str]) -> Plan:
    return Plan(
        target_batch=8,
        micro_batch_size=2,
        accumulation_steps=2,
        world_size=2,
        strategy="fsdp",
        device="h100-80gb",  # Lightning runs FSDP on GPUs only
        checkpoint=dict.fromkeys(layers[:-1], "full"),
        shard_units=tuple(layers),
        shard_unit_types=tuple(layers[:1]),
        budget_bytes=2**30,
        predicted=Prediction(
            peak_bytes=2**29,
            step_seconds=0.1,
            breakdown=Breakdown(
                params=2**29, grads=0, optimizer=0, activations=0, transient=0, reserve=0
            ),
            peak_phase=f"backward of {layers[0]}",
        ),
        model=model,
        model_fingerprint=ModelFingerprint(parameter_bytes=1, candidate_layers=tuple(layers)),
        reasons=tuple(f"checkpointing {name}" for name in layers),
        warnings=(layers[-1],),
    )


def _keys(fmt: str, text: str):
    if fmt == "deepspeed":
        return sorted(json.loads(text))
    if fmt in ("megatron", "torchtitan"):  # comments, then one assignment
        lines = [line for line in text.splitlines() if line and not line.startswith("#")]
        return sorted(line.split()[0] for line in lines)
    if fmt == "torchtitan-toml":
        return sorted(
            f"{section}.{key}" for section, fields in tomllib.loads(text).items() for key in fields
        )
    if fmt in ("torch", "torchrun"):
        tree = ast.parse(text)
        return sorted(
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        )

    def flat(data, prefix=""):
        out = []
        for key, value in data.items():
            out.append(prefix + str(key))
            if isinstance(value, dict):
                out += flat(value, f"{prefix}{key}.")
        return out

    return sorted(flat(yaml.safe_load(text)))


def _for(fmt: str, plan: Plan) -> Plan:
    """The plan, or its DDP twin for a format that cannot write its strategy (the torch
    script refuses fsdp: emit's capability contract)."""
    if plan.strategy in FORMATS[fmt].strategies:
        return plan
    return dataclasses.replace(plan, strategy="ddp", shard_units=(), shard_unit_types=())


BASELINE = {
    fmt: _keys(fmt, emit(_for(fmt, _plan("model.py", ["h.0", "h.1"])), fmt)[1])
    for fmt in FORMATS
    if fmt != "plan"
}


@FAST
@given(model=ANY_TEXT, layers=st.lists(ANY_TEXT, min_size=2, max_size=4, unique=True))
def test_every_format_parses_with_exactly_its_keys_whatever_the_strings(model, layers):
    plan = _plan(model, layers)
    for fmt in FORMATS:
        text = emit(_for(fmt, plan), fmt, model_path=model)[1]
        text.encode("utf-8")  # writable: no lone surrogate reached the file
        if fmt == "plan":
            again = plan_from_data(yaml.safe_load(text), source="emitted")
            assert again == plan  # every string round-trips through the YAML serializer
            continue
        assert _keys(fmt, text) == BASELINE[fmt], fmt
        if fmt in ("torch", "torchrun"):
            namespace: dict = {}
            tree = ast.parse(text)
            model_assign = next(
                n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "MODEL"
            )
            exec(compile(ast.Module([model_assign], []), "<emitted>", "exec"), namespace)
            assert namespace["MODEL"] == model


# ------------------------------------------------------------------ CLI arguments
NUMBERS = st.one_of(
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e400", "10" * 30, "", "x", "8"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
BUDGETS = st.one_of(
    st.sampled_from(["24GiB", "1KiB", "0", "-5GiB", "nan", "150%", "0%", "auto", "1e400GiB"]),
    st.text(max_size=12),
)


@FAST
@given(
    target=NUMBERS,
    budget=BUDGETS,
    world=NUMBERS,
    margin=NUMBERS,
    min_micro=NUMBERS,
    strategy=st.sampled_from(["ddp", "zero1", "fsdp", "auto", "tpu"]),
)
def test_solve_arguments(tmp_path, target, budget, world, margin, min_micro, strategy):
    out = tmp_path / "fuzz-out"
    out.mkdir(exist_ok=True)
    before = sorted(os.listdir(out))
    result = run(
        "solve",
        GPT_PROFILE,
        "--target-batch",
        target,
        "--budget",
        budget,
        "--world-size",
        world,
        "--margin",
        margin,
        "--min-micro",
        min_micro,
        "--strategy",
        strategy,
        "--json",
        "-o",
        out / "plan.yaml",
    )
    if result.exit_code in (0, 1) and result.stdout.strip():
        data = strict_json(result.stdout)
        assert data["feasible"] is (result.exit_code == 0)
    written = sorted(os.listdir(out))
    if result.exit_code == 0:
        assert written == sorted([*before, "plan.yaml"])
        (out / "plan.yaml").unlink()
    else:
        assert written == before  # nothing written on failure


# ------------------------------------------------------------------ profile and plan data
VALUES = st.one_of(
    st.integers(-(10**3), 10**3),
    st.sampled_from([10**400, -(10**400), 2**70]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _leaves(data, path=()):
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _leaves(value, (*path, i))
    yield path


def _set(data, path, value):
    if not path:
        return value
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


PROFILE_DATA = yaml.safe_load(GPT_PROFILE.read_text())
PROFILE_PATHS = [p for p in _leaves(PROFILE_DATA) if p]


@FAST
@given(where=st.sampled_from(PROFILE_PATHS), value=VALUES)
def test_profile_mutations(tmp_path, where, value):
    data = _set(yaml.safe_load(GPT_PROFILE.read_text()), where, value)
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    shown = run("show", path, "--json")
    if shown.exit_code == 0:
        strict_json(shown.stdout)
    else:
        assert shown.exit_code == 2  # bad data, never "over budget" or "cannot measure"
    solved = run("solve", path, "--target-batch", 8, "--budget", "24GiB", "--json")
    if solved.exit_code in (0, 1):
        strict_json(solved.stdout)


PLAN_DATA = yaml.safe_load(emit(_plan("m.py", ["a", "b"]), "plan")[1])
PLAN_PATHS = [p for p in _leaves(PLAN_DATA) if p]


@FAST
@given(where=st.sampled_from(PLAN_PATHS), value=VALUES)
def test_plan_mutations(tmp_path, where, value):
    data = _set(yaml.safe_load(yaml.safe_dump(PLAN_DATA)), where, value)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    shown = run("show", path, "--json")
    if shown.exit_code == 0:
        strict_json(shown.stdout)
    else:
        assert shown.exit_code == 2


def test_emitting_a_mutated_plan_never_crashes():
    for value in (math.nan, -1, 10**400, "tpu", "x\ny: 1"):
        data = yaml.safe_load(yaml.safe_dump(PLAN_DATA))
        data["device"] = value
        with pytest.raises(ProfileError):
            plan_from_data(data, source="p")


# ------------------------------------------------------------------ model files misbehaving
MODES = {
    # mode: exit codes it may give (0 ok · 2 bad input: the model file's fault)
    "": {0},
    "print": {0},
    "print_everywhere": {0},
    "build_raise": {2},
    "meta_batch": {2},
    "import_sys_exit_0": {2},
    "import_sys_exit_3": {2},
    "import_os_exit_0": {2},
    "build_sys_exit_0": {2},
    "build_os_exit_0": {2},
    "loss_posix_exit_0": {2},
    "nan_loss_at_1": {0},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_probe_and_verify_of_misbehaving_model_files(tmp_path, mode):
    env = {"MEMPLAN_TEST_MISBEHAVE": mode}
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("untouched")
    out = work / "profile.yaml"
    probed = run(
        "probe",
        MISBEHAVE,
        "--device",
        "cpu",
        "--micro-batches",
        "1,2",
        "--json",
        "-o",
        out,
        env=env,
    )
    assert probed.exit_code in MODES[mode], probed.output
    if probed.exit_code == 0:
        assert strict_json(probed.stdout)["micro_batches"] == [1, 2]
        assert sorted(os.listdir(work)) == ["keep.txt", "profile.yaml"]
    else:
        assert probed.stdout.strip() == ""  # no half JSON
        assert sorted(os.listdir(work)) == ["keep.txt"]  # nothing written on failure
    assert (work / "keep.txt").read_text() == "untouched"

    one_process = {
        "world_size": 1,
        "strategy": "ddp",
        "target_batch": 4,
        "shard_units": [],
        "shard_unit_types": [],
        "model_fingerprint": None,
        "checkpoint_layers": ["0"],
    }
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(PLAN_DATA | {"model": MISBEHAVE} | one_process))
    verified = run("verify", MISBEHAVE, plan, "--steps", "1", "--json", env=env)
    # 0 pass · 1 fail (NaN, or a peak off the hand-made prediction) · 2 the model's fault
    assert verified.exit_code in MODES[mode] | {1}, verified.output
    if verified.exit_code in (0, 1):
        strict_json(verified.stdout)


# ------------------------------------------------------------------ YAML attacks (issue 23)
CHECK_DATA = {
    "checks": [
        {
            "name": "a",
            "model": str(Path(__file__).parent / "models" / "check_small.py"),
            "target_batch": 8,
            "budget": "1GiB",
        }
    ]
}
DEVICE_DATA = yaml.safe_load((ROOT / "profiles" / "devices" / "rtx4090.yaml").read_text())
FILES = {
    "profile": (PROFILE_DATA, ("show",)),
    "plan": (PLAN_DATA, ("show",)),
    "config": (CHECK_DATA, ("check", "--config")),
    "device": (DEVICE_DATA, None),
}


def _attack(text: str, kind: str, data) -> str:
    """``text`` (a dumped file) with an anchor and alias, or a repeated key, added."""
    first_key = next(iter(data))
    if kind == "alias":
        return text + "x_anchor: &a [1, 2]\nx_alias: *a\n"
    if kind == "anchor":
        return text.replace(f"{first_key}:", f"{first_key}: &a", 1)
    return text + f"{first_key}: {json.dumps(data[first_key])}\n"  # a duplicate key


@FAST
@given(
    which=st.sampled_from(sorted(FILES)),
    kind=st.sampled_from(["alias", "anchor", "duplicate"]),
    number=st.sampled_from([10**400, -(10**18), 2**63, 1e308, -1]),
)
def test_every_file_refuses_anchors_aliases_and_duplicate_keys(tmp_path, which, kind, number):
    data, command = FILES[which]
    text = yaml.safe_dump(data, sort_keys=False)
    path = tmp_path / f"{which}.yaml"
    path.write_text(_attack(text, kind, data))
    if command is None:
        from memplan.devices import load_device

        with pytest.raises(ProfileError):
            load_device(str(path))
    else:
        result = run(*command, path)
        assert result.exit_code == 2, result.output
        assert "anchor" in result.output or "alias" in result.output or "duplicate" in result.output
    # an out-of-range number in the first numeric leaf: exit 2, never a traceback or a hang
    leaves = [p for p in _leaves(data) if p and isinstance(_get(data, p), int | float)]
    if leaves and command is not None:
        changed = _set(yaml.safe_load(text), leaves[0], number)
        path.write_text(yaml.safe_dump(changed, sort_keys=False))
        result = run(*command, path)
        assert result.exit_code in (0, 1, 2), result.output


def _get(data, path):
    for key in path:
        data = data[key]
    return data


# ------------------------------------------------------------------ every memplan error raised
def _memplan_error_classes() -> list[str]:
    from memplan import errors

    names = sorted(
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == "memplan.errors"
    )
    return [*names, "Forged"]


@pytest.mark.parametrize("cls", _memplan_error_classes())
@pytest.mark.parametrize("where", ["build", "forward"])
def test_a_model_raising_any_memplan_error_is_exit_2(cls, where):
    result = run(
        "probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,2", "--json",
        env={"MEMPLAN_TEST_MISBEHAVE": f"raise:{cls}:{where}"},
    )  # fmt: skip
    assert result.exit_code == 2, (cls, result.output)
    assert result.stdout.strip() == ""
