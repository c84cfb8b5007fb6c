"""A model file whose build_model() switches on transformers' own activation checkpointing
(``gradient_checkpointing_enable``). The CLI probe left it on: every layer's backward held
HF's recompute, no layer saved anything by checkpointing (saved 8 KiB a sample, 0 B
saving, where the same model without it saves 137 KiB and 129 KiB), the plan said "no
activation checkpointing needed" while every layer was recomputed, and on meta the probe
failed with exit 3, blaming the model's state. Now the probe and ``memplan.apply`` switch
it off and say so, as they switch off the key/value cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.profile import load_profile

pytest.importorskip("transformers")

MODEL = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
def build_model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, use_cache=False))
    {enable}
    m.train()
    return m
def make_batch(b):
    ids = torch.randint(0, 256, (b, 32)); return {{"input_ids": ids, "labels": ids}}
"""


def _probe(tmp_path: Path, name: str, enable: str, device: str):
    model = tmp_path / f"{name}.py"
    model.write_text(MODEL.format(enable=enable))
    out = tmp_path / f"{name}.{device}.yaml"
    args = ["probe", str(model), "--device", device, "--micro-batches", "1,2", "-o", str(out)]
    if device == "cpu":
        args += ["--timing-rounds", "1"]
    done = CliRunner().invoke(app, args, catch_exceptions=False)
    return done, out


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_probe_switches_off_hf_checkpointing_and_measures_as_without_it(tmp_path, device):
    done, on = _probe(tmp_path, "gc", "m.gradient_checkpointing_enable()", device)
    said = " ".join(done.output.split())
    assert done.exit_code == 0, said
    assert "transformers' gradient_checkpointing_enable) was switched off" in said
    plain, off = _probe(tmp_path, "plain", "pass", device)
    assert plain.exit_code == 0, plain.output
    assert "gradient_checkpointing_enable" not in plain.output
    measured, reference = load_profile(on), load_profile(off)
    for a, b in zip(measured.layers, reference.layers, strict=True):
        assert (a.saved_bytes, a.savings_bytes) == (b.saved_bytes, b.savings_bytes)
        assert a.savings_bytes.slope > 0  # checkpointing a layer saves its activations
    assert measured.timeline == reference.timeline


def test_apply_switches_off_hf_checkpointing_so_only_the_plans_layers_recompute(tmp_path):
    import runpy

    import memplan
    from memplan.run.checkpoint import checkpointed_names

    path = tmp_path / "gc.py"
    path.write_text(MODEL.format(enable="m.gradient_checkpointing_enable()"))
    model = runpy.run_path(str(path))["build_model"]()
    assert model.is_gradient_checkpointing
    with pytest.warns(UserWarning, match="gradient_checkpointing_enable\\) was switched off"):
        memplan.apply(model, {"model.layers.1": "full"})
    assert not model.is_gradient_checkpointing
    assert checkpointed_names(model) == ["model.layers.1"]
