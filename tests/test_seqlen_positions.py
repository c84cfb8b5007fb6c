"""Lengths past a model's positions (#23): the profile records the model's positions, solve
refuses a length past them and ``--seq-len max`` stops at them, and a grid profile out of
order or of another model is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memplan.cli import app

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


# ------------------------------------------------------------------ 7. lengths past positions
@pytest.fixture(scope="module")
def hf_grid(tmp_path_factory) -> Path:
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=64, vocab_size=64).save_pretrained(
        folder
    )
    out = folder / "p.yaml"
    result = invoke(
        "probe", f"hf:{folder}?task=causal-lm&seq-len=32", "--device", "meta",
        "--seq-lens", "16,32", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_the_profile_records_the_models_positions(hf_grid):
    from memplan.profile import load_profile

    profile = load_profile(hf_grid)
    assert profile.max_seq_len == 64
    assert {p.max_seq_len for p in profile.seq.profiles} == {64}


def test_solve_refuses_lengths_past_the_models_positions(hf_grid, tmp_path):
    result = invoke(
        "solve", hf_grid, "--target-batch", 4, "--budget", "64GiB", "--seq-len", 4096,
        "-o", tmp_path / "plan.yaml",
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "64 positions" in result.output
    assert not (tmp_path / "plan.yaml").exists()
    result = invoke(
        "solve", hf_grid, "--target-batch", 4, "--budget", "64GiB", "--seq-len", "max",
        "--seq-multiple", 16, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["seq_len"] == 64


def test_a_seq_grid_out_of_order_or_of_another_model_is_refused(hf_grid, tmp_path):
    data = yaml.safe_load(hf_grid.read_text())

    def swapped(d):
        d["seq"]["profiles"].reverse()

    def other_model(d):
        d["seq"]["profiles"][0]["model"]["path"] = "other.py"

    def outside(d):
        d["seq_len"] = 48

    for edit, field in ((swapped, "seq_len"), (other_model, "model"), (outside, "seq_len")):
        changed = yaml.safe_load(yaml.safe_dump(data))
        edit(changed)
        path = tmp_path / "g.yaml"
        path.write_text(yaml.safe_dump(changed))
        result = invoke("show", path)
        assert result.exit_code == 2, result.output
        assert field in result.output
