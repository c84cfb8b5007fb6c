"""Keep issue 22's "real models' defaults" fixed: a batch dict with a plain value passed on as
a keyword argument, ``hf:`` with ``--seq-lens`` and no ``--seq-len``, a rotary table cached
in a Python dict counted as fixed memory, and the HF emitter switching on Trainer's own
gradient checkpointing when the plan checkpoints exactly HF's blocks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memplan import memory
from memplan.cli import app
from memplan.emit import emit_hf
from memplan.errors import ModelFileError
from memplan.model.batch import refused_batch_item
from memplan.model.loader import load_model_file
from memplan.plan import ModelFingerprint
from memplan.probe import measure_training_peak, probe_model

RETURN_LOSS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, return_loss=False, scale=1.0, tag=None):
        if return_loss is not True or scale != 0.5 or tag != "train":
            raise ValueError(f"got return_loss={return_loss!r} scale={scale!r} tag={tag!r}")
        for b in self.blocks:
            x = torch.relu(b(x))
        return x.pow(2).mean() * scale


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size):
    return {"x": torch.randn(batch_size, 8), "return_loss": True, "scale": 0.5, "tag": "train"}
"""

ROPE_DICT = """
import torch
from torch import nn

_ROPE = {}
DATASET = torch.randn(1000, 8)  # made at import: the host's, not a cache of the step


def rope(seq, dim, device):
    key = (seq, dim, str(device))
    if key not in _ROPE:
        pos = torch.arange(seq, device=device, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        _ROPE[key] = torch.outer(pos, inv).repeat(1, 2)  # seq x dim float32
    return _ROPE[key]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.tables = {}

    def forward(self, x):
        if x.shape[1] not in self.tables:  # a cache on the module, not a buffer
            self.tables[x.shape[1]] = torch.ones(x.shape[1], x.shape[2], device=x.device)
        x = x * self.tables[x.shape[1]]
        return x + torch.relu(self.fc(x * rope(x.shape[1], x.shape[2], x.device).cos()))


class Net(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 64, 32)
"""

LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- batches
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_plain_values_in_a_batch_dict_are_passed_as_keyword_arguments(
    tmp_path: Path, device: str
) -> None:
    # the forward raises unless it gets return_loss=True, scale=0.5 and tag="train"
    path = _file(tmp_path, "return_loss.py", RETURN_LOSS)
    profile = probe_model(path, device=device, micro_batches=(1, 2))
    # two Linear(8, 8): 2 × (64 + 8) × 4 B
    assert profile.totals.params_trainable_bytes == 576


def test_a_batch_item_memplan_cannot_pass_on_is_named(tmp_path: Path) -> None:
    import torch

    assert refused_batch_item({"x": torch.ones(1), "return_loss": True}) is None
    assert refused_batch_item({"x": torch.ones(1), "ids": [torch.ones(1), "a"]}) == (
        "batch['ids'][1]"
    )
    assert refused_batch_item({"flag": True}) == "batch"  # no tensor at all
    assert refused_batch_item([]) == "batch"
    path = _file(
        tmp_path,
        "odd.py",
        "import torch\nfrom torch import nn\n"
        "def build_model():\n    return nn.Linear(2, 2)\n"
        "def make_batch(b):\n    return {'x': torch.ones(b, 2), 'meta': {'names': object()}}\n",
    )
    with pytest.raises(ModelFileError) as info:
        load_model_file(path).make_batch(2)
    assert "batch['meta']['names'] is not a tensor" in info.value.message


# --------------------------------------------------------------------------- hf: --seq-lens
def test_hf_reference_with_seq_lens_needs_no_seq_len(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    out = tmp_path / "p.yaml"
    result = CliRunner().invoke(
        app,
        [
            "probe",
            f"hf:{folder}",
            "--task",
            "causal-lm",
            "--seq-lens",
            "32,64",
            "--device",
            "meta",
            "--micro-batches",
            "1,2",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(out.read_text())
    assert data["seq"]["seq_lens"] == [32, 64]
    assert [p["seq_len"] for p in data["seq"]["profiles"]] == [32, 64]
    assert data["seq_len"] == 64  # the longest length probed
    assert data["model"]["path"].endswith("?task=causal-lm&seq-len=32")  # the shortest
    # --seq-len with --seq-lens is still one too many
    both = CliRunner().invoke(
        app,
        ["probe", f"hf:{folder}", "--task", "causal-lm", "--seq-len", "32", "--seq-lens", "32,64"],
    )
    assert both.exit_code == 2 and "give one" in both.output


# --------------------------------------------------------------------------- cached tensors
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_table_cached_in_a_python_dict_is_fixed_memory(tmp_path: Path, device: str) -> None:
    path = _file(tmp_path, f"rope_{device}.py", ROPE_DICT)
    profile = probe_model(path, device=device, micro_batches=(1, 2))
    # the rotary table (64 × 32 float32 = 8,192 B) and each block's ones table (another
    # 8,192 B each); DATASET existed before the first step, so it is not counted
    assert profile.totals.cached_bytes == 3 * 8192
    assert memory.params_bytes(profile) == profile.totals.params_trainable_bytes + 3 * 8192


def test_the_cached_table_makes_the_prediction_the_measured_peak(tmp_path: Path) -> None:
    path = _file(tmp_path, "rope_measure.py", ROPE_DICT)
    profile = probe_model(path, device="cpu", micro_batches=(1, 2))
    names = list(profile.layer_names)
    for layers in ([], names):
        predicted = memory.step_peak(profile, 4, layers, 1).allocated_bytes
        # a fresh model file (its own _ROPE): the measurement fills the caches itself
        fresh = _file(tmp_path, f"rope_fresh_{len(layers)}.py", ROPE_DICT + f"\n# {len(layers)}\n")
        measured = measure_training_peak(fresh, "cpu", 4, 1, layers, "fp32", steps=1).peak_bytes
        assert predicted == measured  # 24,576 B short before the tables were counted


# --------------------------------------------------------------------------- HF emitter
def test_hf_blocks_are_recorded_and_switch_on_trainers_checkpointing(tmp_path: Path) -> None:
    from memplan.solver import SolveRequest, solve

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    profile = probe_model(
        f"hf:{folder}?task=causal-lm&seq-len=16", device="meta", micro_batches=(1, 2)
    )
    assert profile.hf_blocks == ("model.layers.0", "model.layers.1")
    plan = solve(profile, SolveRequest(target_batch=8, budget_bytes=1 << 40)).plan
    assert plan.model_fingerprint is not None
    assert plan.model_fingerprint.hf_blocks == profile.hf_blocks
    full = replace(plan, checkpoint={name: "full" for name in profile.hf_blocks})
    data = yaml.safe_load(emit_hf(full, model_path="m.py"))
    assert data["gradient_checkpointing"] is True
    # one block fewer, or a selective mode: Trainer's all-or-nothing flag cannot say it
    one = replace(plan, checkpoint={"model.layers.0": "full"})
    assert yaml.safe_load(emit_hf(one, model_path="m.py"))["gradient_checkpointing"] is False
    modes = dict.fromkeys(profile.hf_blocks, "full") | {"model.layers.1": "selective"}
    mixed = replace(plan, checkpoint=modes)
    assert yaml.safe_load(emit_hf(mixed, model_path="m.py"))["gradient_checkpointing"] is False
    # a model that is not a transformers model records no blocks: never switched on
    other = replace(
        full,
        model_fingerprint=ModelFingerprint(
            parameter_bytes=1, candidate_layers=profile.hf_blocks, hf_blocks=()
        ),
    )
    assert yaml.safe_load(emit_hf(other, model_path="m.py"))["gradient_checkpointing"] is False
