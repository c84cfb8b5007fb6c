"""The one YAML load path: strict keys, named fields, versions, atomic writes."""

import dataclasses
import sys

import pytest

from memplan.errors import OutputExistsError, ProfileError
from memplan.files.io import write_text_atomic
from memplan.plan import Breakdown, Plan, Prediction, load_plan, plan_to_yaml
from memplan.profile import (
    Affine,
    Environment,
    ModelRef,
    Profile,
    Segment,
    Totals,
    load_profile,
    profile_to_yaml,
)


def tiny_profile() -> Profile:
    # live bytes holding the 80 B of state and 40 B of gradients the totals count
    seg = Segment(held=0, active="none", points=((200.0, 2.0), (150.0, 8.0)))
    zero = Affine.zero()
    return Profile(
        model=ModelRef(path="m.py"),
        environment=Environment(
            torch_version="2.13", memplan_version="0.1.0", device="cpu", device_name="cpu"
        ),
        micro_batches=(1, 2, 4),
        totals=Totals(
            params_trainable_bytes=40,
            params_frozen_bytes=0,
            buffer_bytes=0,
            grad_bytes=40,
            optimizer_state_bytes=80,
        ),
        layers=(),
        fixed=(),
        timeline={"no_grads": (seg,), "grads_resident": (seg,)},
        optimizer_step_peak_bytes=Affine.constant(200),
        optimizer_step_seconds=zero,
        step_fixed_seconds=zero,
    )


def tiny_plan() -> Plan:
    return Plan(
        target_batch=64,
        micro_batch_size=16,
        accumulation_steps=4,
        checkpoint={"h.0": "full"},
        budget_bytes=1000,
        predicted=Prediction(
            peak_bytes=900,
            step_seconds=0.5,
            breakdown=Breakdown(
                params=100, grads=100, optimizer=200, activations=400, transient=100, reserve=0
            ),
        ),
        model="m.py",
    )


def test_profile_round_trip(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(tiny_profile()))
    assert load_profile(path) == tiny_profile()


def test_unknown_key_named_with_suggestion(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(tiny_profile()).replace("micro_batches", "micro_batchs"))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert str(path) in message and "micro_batchs" in message
    assert "Did you mean micro_batches" in message


def test_wrong_type_names_the_dotted_field(tmp_path):
    path = tmp_path / "p.yaml"
    text = profile_to_yaml(tiny_profile()).replace("grad_bytes: 40", "grad_bytes: forty")
    path.write_text(text)
    with pytest.raises(ProfileError, match=r"profile\.totals\.grad_bytes' must be an integer"):
        load_profile(path)


def test_future_version_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        profile_to_yaml(tiny_profile()).replace("schema_version: 2", "schema_version: 9")
    )
    with pytest.raises(ProfileError, match="newer than this memplan"):
        load_profile(path)


def test_corrupted_file(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("layers: [unclosed\n  - : :")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(path)


def test_yaml_tags_are_not_executed(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ProfileError):
        load_profile(path)


def test_plan_round_trip_and_batch_rule(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(plan_to_yaml(tiny_plan()))
    assert load_plan(path) == tiny_plan()
    with pytest.raises(ValueError, match="16 × 3 × 1 = 48"):
        dataclasses.replace(tiny_plan(), accumulation_steps=3)


def test_plan_given_as_profile_is_named(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(plan_to_yaml(tiny_plan()))
    with pytest.raises(ProfileError, match="is a plan, not a profile"):
        load_profile(path)


def test_atomic_write_refuses_to_clobber(tmp_path):
    path = tmp_path / "out.yaml"
    write_text_atomic(path, "first")
    with pytest.raises(OutputExistsError, match="--force"):
        write_text_atomic(path, "second")
    assert path.read_text() == "first"
    write_text_atomic(path, "second", force=True)
    assert path.read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["out.yaml"]  # no temporary left behind


def test_core_modules_do_not_import_torch_or_rich():
    import subprocess

    code = (
        "import sys, memplan, memplan.profile, memplan.plan, memplan.units, memplan.devices;"
        "print('torch' in sys.modules, 'rich' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
