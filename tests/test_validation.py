"""What memplan reads is checked before it is believed (#10, #23): profiles and plans that
cannot be real exit 2 naming the field (memplan.profile.read, memplan.plan), a plan made
for another model is refused, and every YAML file is read strictly: no alias bombs, no
duplicate keys, no checkpoint layer that is not a candidate (memplan.files.schema)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml
from plan_factory import hand_plan
from typer.testing import CliRunner

from memplan.cli import app
from memplan.plan import plan_to_yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "models"
MISBEHAVE = str(MODELS / "trust_misbehave.py")
TINY = str(MODELS / "cli_tiny_gpt.py")
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
runner = CliRunner()
SMALL = str(MODELS / "check_small.py")


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory) -> Path:
    """A profile of trust_misbehave.py (two Linear blocks: probes fast)."""
    path = tmp_path_factory.mktemp("trust") / "small.yaml"
    result = invoke("probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,2", "-o", path)
    assert result.exit_code == 0, result.output
    return path


# ------------------------------------------------------------------ 3: data is validated
def _mutated(tmp_path, edit) -> Path:
    data = yaml.safe_load(GPT_PROFILE.read_text())
    edit(data)
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["totals"].update(params_trainable_bytes=-5), "totals.params_trainable_bytes"),
        (lambda d: d["totals"].update(grad_bytes=10**400), "totals.grad_bytes"),
        (lambda d: d["layers"][0]["fwd_seconds"].update(slope=10**400), "fwd_seconds.slope"),
        (lambda d: d["layers"][0]["fwd_seconds"].update(slope=-1.0), "layers[0].fwd_seconds"),
        (lambda d: d["layers"][1]["input_bytes"].update(slope=math.nan), "input_bytes.slope"),
        (lambda d: d["optimizer_step_seconds"].update(intercept=math.inf), "optimizer_step"),
        (lambda d: d["timeline"].update(no_grads=[]), "timeline.no_grads"),
    ],
)
def test_impossible_profiles_exit_2_naming_the_field(tmp_path, edit, field):
    path = _mutated(tmp_path, edit)
    for args in (("show", path), ("solve", path, "--target-batch", 8, "--budget", "24GiB")):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert field in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["predicted"].update(step_seconds=math.nan), "step_seconds"),
        (lambda d: d.update(device="tpu"), "plan.device"),
        (lambda d: d["predicted"].update(peak_bytes=-1), "peak_bytes"),
    ],
)
def test_impossible_plans_exit_2(tmp_path, edit, field):
    data = yaml.safe_load(plan_to_yaml(hand_plan(TINY)))
    edit(data)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    for args in (("show", path), ("verify", TINY, path)):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert field in " ".join(result.output.split())


def test_a_plan_for_another_model_is_refused_and_old_plans_say_nothing_is_checked(
    small_profile, tmp_path
):
    plan_path = tmp_path / "plan.yaml"
    result = invoke(
        "solve", small_profile, "--target-batch", 4, "--budget", "1GiB", "-o", plan_path
    )
    assert result.exit_code == 0, result.output
    plan = yaml.safe_load(plan_path.read_text())
    # two Linear(8, 8) blocks: 2 × (64 + 8) fp32 parameters
    assert plan["model_fingerprint"] == {
        "parameter_bytes": 2 * (8 * 8 + 8) * 4,
        "candidate_layers": ["0", "1"],
        "hf_blocks": [],  # not a transformers model: HF checkpoints none of its blocks
    }

    result = invoke("verify", TINY, plan_path, "--steps", 1)
    assert result.exit_code == 2, result.output
    assert "made for another model" in " ".join(result.output.split())

    del plan["model_fingerprint"]  # as an older memplan wrote it
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(plan))
    result = invoke("verify", MISBEHAVE, old, "--steps", 1, "--json", "--no-grad-check")
    assert result.exit_code in (0, 1), result.output
    assert "nothing checks" in json.loads(result.stdout)["note"]


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
