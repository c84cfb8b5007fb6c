"""The benchmark zoo cannot rot: every model file in bench/zoo/ loads under the model-file
contract, builds, and trains one micro-batch of 1 (forward, backward, optimizer step)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from memplan.model.loader import load_model_file
from memplan.probe.layers import default_layers

ZOO = Path(__file__).resolve().parent.parent / "bench" / "zoo"
MODEL_FILES = sorted(p.name for p in ZOO.glob("*.py") if not p.name.startswith("_"))
NEEDS_TRANSFORMERS = {"hf_gpt2.py", "hf_gpt2_default.py", "hf_llama.py", "hf_lora_llama.py"}


def test_zoo_has_every_family() -> None:
    assert len(MODEL_FILES) >= 10


@pytest.mark.parametrize("name", MODEL_FILES)
def test_zoo_model_trains_one_step(name: str) -> None:
    if name in NEEDS_TRANSFORMERS and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (a bench-only extra)")
    mf = load_model_file(ZOO / name)
    model = mf.build_model()
    assert len(default_layers(model)) >= 2, "no repeated blocks to checkpoint"
    optimizer = mf.make_optimizer(model)
    loss = mf.loss(model, mf.make_batch(1))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert any(p.grad is not None for p in trained)
    optimizer.step()
