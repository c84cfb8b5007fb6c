"""Issue 13's bar on a real model: a GPT with eager attention (tests/models/seq_gpt.py, not
in the zoo), probed at lengths 64 and 128, planned at 512 (4×) under a budget that binds;
an independent run of the plan is within 5% of the prediction and within the budget, and
``--seq-len max`` gives a length of at least 512 whose measured peak is too. Also the
contract (a model file without a length) and the CLI's exit codes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.model.loader import load_model_file
from memplan.plan import load_plan
from memplan.probe import measure_training_peak
from memplan.profile import load_profile, profile_to_yaml
from memplan.profile.seqlen import profile_at
from memplan.solver import SolveRequest, least_peak, solve

MODELS = Path(__file__).parent / "models"
GPT = str(MODELS / "seq_gpt.py")
NO_LENGTH = str(MODELS / "cli_tiny_gpt.py")  # make_batch(batch_size) only
TARGET = 4
runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def grid_path(tmp_path_factory) -> Path:
    """Micro-batches 2 and 4: at 1 the model runs other layout ops (a reshape that is a
    view only there), which the probe warns about; 2 and 4 run the same ops."""
    path = tmp_path_factory.mktemp("seq") / "gpt.profile.yaml"
    result = invoke(
        "probe", GPT, "--device", "cpu", "--seq-lens", "64,128", "--micro-batches", "2,4",
        "-o", path,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return path


def binding_budget(profile, seq_len: int) -> int:
    """Halfway between the least peak any plan needs at ``seq_len`` and the peak of the
    fastest plan with no budget: the budget decides the plan."""
    at = profile_at(profile, seq_len)
    loose = SolveRequest(target_batch=TARGET, budget_bytes=10**15, margin=0)
    low = least_peak(at, loose).peak_bytes
    high = solve(at, loose).plan.predicted.peak_bytes
    assert low < high
    return (low + high) // 2


def measured_peak(plan) -> int:
    mf = load_model_file(GPT).at_seq_len(plan.seq_len)
    run = measure_training_peak(
        mf,
        "cpu",
        plan.micro_batch_size,
        plan.accumulation_steps,
        checkpoint_modes=plan.checkpoint,
        steps=1,
    )
    return run.peak_bytes


def test_the_grid_holds_both_lengths(grid_path):
    profile = load_profile(grid_path)
    assert profile.seq is not None and profile.seq.seq_lens == (64, 128)
    assert profile.seq_len == 128
    assert profile.micro_batches == (2, 4)
    # the eager scores: per-sample bytes grow faster than the length in every block (2×)
    for layer_64, layer_128 in zip(
        profile.seq.profiles[0].layers, profile.seq.profiles[1].layers, strict=True
    ):
        assert layer_128.saved_bytes.slope > 2.2 * layer_64.saved_bytes.slope


def test_bar_a_plan_at_4x_the_longest_probed_length(grid_path, tmp_path):
    profile = load_profile(grid_path)
    budget = binding_budget(profile, 512)
    plan_path = tmp_path / "plan.yaml"
    result = invoke(
        "solve", grid_path, "--target-batch", TARGET, "--budget", budget, "--seq-len", 512,
        "--margin", 0, "-o", plan_path,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = load_plan(plan_path)
    assert plan.seq_len == 512
    unconstrained = solve(
        profile_at(profile, 512), SolveRequest(target_batch=TARGET, budget_bytes=10**15, margin=0)
    ).plan
    assert (plan.micro_batch_size, plan.checkpoint) != (
        unconstrained.micro_batch_size,
        unconstrained.checkpoint,
    ), "the budget must bind"
    measured = measured_peak(plan)
    error = plan.predicted.peak_bytes / measured - 1
    assert abs(error) <= 0.05, f"predicted {plan.predicted.peak_bytes} B, measured {measured} B"
    assert measured <= budget
    assert any("has no plan" in reason for reason in plan.reasons)


def test_bar_the_longest_length_runs_within_budget(grid_path, tmp_path):
    profile = load_profile(grid_path)
    budget = binding_budget(profile, 512)
    plan_path = tmp_path / "max.yaml"
    result = invoke(
        "solve", grid_path, "--target-batch", TARGET, "--budget", budget, "--seq-len", "max",
        "--margin", 0, "-o", plan_path, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = load_plan(plan_path)
    assert plan.seq_len >= 512 and plan.seq_len % 64 == 0
    measured = measured_peak(plan)
    assert abs(plan.predicted.peak_bytes / measured - 1) <= 0.05
    assert measured <= budget


def test_verify_runs_the_plan_at_its_length(grid_path, tmp_path):
    plan_path = tmp_path / "plan.yaml"
    result = invoke(
        "solve", grid_path, "--target-batch", 2, "--budget", "1GiB", "--seq-len", 192,
        "--max-micro", 1, "-o", plan_path,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    result = invoke("verify", GPT, plan_path, "--steps", 1, "--json")
    assert result.exit_code == 0, result.output
    assert '"passed": true' in result.output
    # a plan with a length on a model file whose make_batch takes none: exit 2, named
    result = invoke("verify", NO_LENGTH, plan_path, "--steps", 1)
    assert result.exit_code == 2
    assert "make_batch(batch_size, seq_len)" in result.output


def test_seq_lens_on_a_model_without_a_length_is_refused_before_probing():
    result = invoke("probe", NO_LENGTH, "--device", "cpu", "--seq-lens", "64,128")
    assert result.exit_code == 2
    assert "cli_tiny_gpt.py" in result.output
    assert "make_batch(batch_size, seq_len)" in result.output


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (("--seq-len", "0"), 2, "at least 1"),
        (("--seq-len", "-3"), 2, "at least 1"),
        (("--seq-len", str(2**40)), 2, "longer than any"),
        (("--seq-len", "12.5"), 2, "not a length"),
        (("--seq-len", "max", "--seq-multiple", "0"), 2, "--seq-multiple"),
        (("--seq-len", "max", "--budget", "1MiB"), 1, "even 64 tokens"),
        (("--seq-len", "512", "--tokens-per-batch", "1000"), 2, "Give the effective batch once"),
    ],
)
def test_hostile_solve_arguments(grid_path, args, code, text):
    base = ["solve", grid_path, "--target-batch", TARGET]
    if "--budget" not in args:
        base += ["--budget", "1GiB"]
    result = invoke(*base, *args)
    assert result.exit_code == code, result.output
    assert text in " ".join(result.output.split())


def test_a_profile_without_lengths_says_to_probe_them(grid_path, tmp_path):
    """A profile of one length (its model's own batches): --seq-len at another length is
    exit 2 naming --seq-lens; at its own length it plans."""
    one = load_profile(grid_path).seq.profiles[0]  # probed at 64 only
    path = tmp_path / "one.profile.yaml"
    path.write_text(profile_to_yaml(dataclasses.replace(one, seq_len=None)))
    result = invoke("solve", path, "--target-batch", 4, "--budget", "1GiB", "--seq-len", 512)
    assert result.exit_code == 2
    assert "--seq-lens" in result.output
    path.write_text(profile_to_yaml(one))
    result = invoke("solve", path, "--target-batch", 4, "--budget", "1GiB", "--seq-len", 64)
    assert result.exit_code == 0, result.output


def test_a_check_states_its_length(tmp_path):
    """memplan.yaml ``seq_len``: the probe makes batches of that length; a model file whose
    make_batch takes none is that check's error (exit 2), the other check still runs."""
    import yaml

    config = tmp_path / "memplan.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "checks": [
                    {"name": "gpt-256", "model": GPT, "target_batch": 4, "budget": "1GiB",
                     "device": "meta", "seq_len": 256, "micro_batches": [2, 4]},
                    {"name": "no-length", "model": NO_LENGTH, "target_batch": 4,
                     "budget": "1GiB", "device": "meta", "seq_len": 256},
                ]
            }
        )
    )  # fmt: skip
    result = invoke("check", "--config", config, "--json")
    assert result.exit_code == 2, result.output
    import json

    rows = {r["name"]: r for r in json.loads(result.stdout)["checks"]}
    assert rows["gpt-256"]["status"] == "pass"
    assert rows["no-length"]["status"] == "error"
    assert "make_batch(batch_size, seq_len)" in rows["no-length"]["message"]


def test_hf_references_take_the_length_natively(tmp_path):
    from transformers import LlamaConfig

    from memplan.errors import BadInputError

    LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=96,
    ).save_pretrained(tmp_path)
    mf = load_model_file(f"hf:{tmp_path}?task=causal-lm&seq-len=32")
    assert mf.takes_seq_len
    assert tuple(mf.make_batch(2)["input_ids"].shape) == (2, 32)
    assert tuple(mf.at_seq_len(80).make_batch(3)["input_ids"].shape) == (3, 80)
    with pytest.raises(BadInputError, match="exceeds the model's 96 positions"):
        mf.at_seq_len(128).make_batch(1)
