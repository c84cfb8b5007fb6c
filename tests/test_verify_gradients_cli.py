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


QUICK_CPU_PROBE = ("--device", "cpu", "--micro-batches", "1,2", "--timing-rounds", 1)
"""Sizes 1 and 2, one timing round: these tests check plans and verdicts, not times."""


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def solved_plan(tmp_path: Path, model: str) -> Path:
    """A plan of micro-batch 2 × 2 accumulation steps with every layer checkpointed."""
    profile = tmp_path / "profile.yaml"
    out = invoke("probe", MODELS / model, *QUICK_CPU_PROBE, "-o", profile)
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


# ------------------------------------------------------------------ what verify reads
def test_the_model_and_its_hf_options_come_from_the_plan(tmp_path) -> None:
    from memplan.errors import BadInputError
    from memplan.model.reference import planned_model_reference

    planned = "hf:cfg?task=causal-lm&seq-len=64&lora=r=4,alpha=8,targets=c_attn"
    lora = "&lora=r=4,alpha=8,targets=c_attn"
    assert planned_model_reference(None, planned, tmp_path) == planned
    # retyped without its options: the plan's fill them in; what is typed wins
    assert planned_model_reference("hf:cfg", planned, tmp_path) == planned
    assert (
        planned_model_reference("hf:cfg", planned, tmp_path, seq_len=32)
        == f"hf:cfg?task=causal-lm&seq-len=32{lora}"
    )
    assert (
        planned_model_reference("hf:cfg?seq-len=16", planned, tmp_path)
        == f"hf:cfg?task=causal-lm&seq-len=16{lora}"
    )
    # a model file the plan names, found beside the plan when not from here
    (tmp_path / "m.py").write_text("")
    assert planned_model_reference(None, "m.py:build", tmp_path) == f"{tmp_path / 'm.py'}:build"
    with pytest.raises(BadInputError, match="only apply to an hf: reference"):
        planned_model_reference(None, "m.py", tmp_path, task="causal-lm")


WARNS = """
import warnings
exec(open({model!r}).read())
_build = build_model


def build_model():
    warnings.warn("this model warns when built")
    return _build()
"""


def test_python_warnings_print_through_memplans_renderer_once(tmp_path) -> None:
    model = tmp_path / "warns.py"
    model.write_text(WARNS.format(model=str(MODELS / "dropout_stack.py")))
    plan = solved_plan(tmp_path, str(model))
    out = invoke("verify", model, plan, "--steps", 1)
    assert out.exit_code == 0, out.output
    assert out.output.count("warning: this model warns when built") == 1, out.output
    assert "UserWarning" not in out.output


def test_a_no_fit_paragraph_prints_once(tmp_path) -> None:
    profile = tmp_path / "p.yaml"
    model = MODELS / "dropout_stack.py"
    out = invoke("probe", model, *QUICK_CPU_PROBE, "-o", profile)
    assert out.exit_code == 0, out.output
    out = invoke("solve", profile, "--target-batch", 8, "--budget", "1KiB")
    assert out.exit_code == 1
    assert " ".join(out.output.split()).count("No plan (ddp on 1 rank(s)) for target") == 1


def test_step_times_say_when_they_mean_nothing() -> None:
    from memplan.verify.single import timing_caveat

    assert timing_caveat([0.10, 0.11, 0.12], 0.5, 4) == ""
    # (0.2 − 0.1) / median 0.12 = 83%
    assert timing_caveat([0.1, 0.12, 0.2], 0.5, 4) == (
        "the 3 timed steps spread by 83% of their median"
    )
    assert timing_caveat([0.1], 12.9, 2) == "the machine's load 12.9 exceeds its 2 core(s)"
    assert timing_caveat([], None, 2) == ""
