"""`memplan verify` end to end on models whose loss couples a batch, or whose blocks are not
checkpoint-safe: probe, solve (micro-batch 2 × 2, every layer checkpointed), verify the
plan with the model read from it. Correct plans exit 0 and report the coupling; a plan
that checkpoints blocks that recompute differently exits 1 naming the gradient check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.profile import load_profile

MODELS = Path(__file__).parent / "models" / "gradcheck"
runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def solved_plan(tmp_path: Path, model: str) -> Path:
    """A plan of micro-batch 2 × 2 accumulation steps with every layer checkpointed."""
    profile = tmp_path / "profile.yaml"
    out = invoke(
        "probe", MODELS / model, "--device", "cpu", "--micro-batches", "1,2", "-o", profile
    )
    assert out.exit_code == 0, out.output
    layers = ",".join(layer.name for layer in load_profile(profile).layers)
    plan = tmp_path / "plan.yaml"
    out = invoke(
        *("solve", profile, "--target-batch", 4, "--max-micro", 2, "--budget", "4GiB"),
        *("--always-checkpoint", layers, "-o", plan),
    )
    assert out.exit_code == 0, out.output
    return plan


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "precision", "coupling", "cause"),
    [
        ("hf_vit_keybias.py", "fp64", "equivalent", ""),  # key biases: zero true gradient
        # Mixtral's expert matmul (grouped_mm) has no float64 kernel on CPU: fp32
        ("hf_mixtral_aux.py", "fp32", "differs", "MoE auxiliary"),
        ("hf_clip_contrastive.py", "fp64", "differs", "contrastive"),
    ],
)
def test_correct_plans_pass_and_report_the_batch_coupling(
    tmp_path, model, precision, coupling, cause
):
    pytest.importorskip("transformers")
    plan = solved_plan(tmp_path, model)
    # The model comes from the plan; --json carries both results.
    out = invoke("verify", plan, "--steps", 1, "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    check = data["gradient_check"]
    assert check["status"] == "pass", check
    assert check["precision"] == precision
    assert check["relative_error"] < {"fp64": 1e-9, "fp32": 1e-5}[precision]
    assert data["batch_coupling"]["status"] == coupling
    assert cause in data["batch_coupling"]["cause"]
    assert data["batch_coupling"]["effective_batch"] == 4
    if coupling == "differs":
        assert data["batch_coupling"]["relative_error"] > 1e-6
    assert "UserWarning" not in out.output  # memplan's warnings go through its renderer


def test_checkpointed_blocks_that_recompute_differently_fail_naming_the_layer(tmp_path):
    plan = solved_plan(tmp_path, "stateful_blocks.py")
    out = invoke("verify", MODELS / "stateful_blocks.py", plan, "--steps", 1)
    assert out.exit_code == 1, out.output
    text = " ".join(out.output.split())
    assert "gradient check failed" in text
    assert "checkpointing layer blocks.0 alone changes the gradients" in text
    assert "batch coupling:" in text
    assert "step time:" in text
