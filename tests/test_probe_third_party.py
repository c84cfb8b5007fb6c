"""Keep issue 22 fixed: models memplan had not seen, probed on meta as on cpu (BART from an
``hf:`` config, Mixtral's grouped expert matmuls), a block called twice per forward, and
MobileNetV3-small's default candidates at a binding budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from profile_bytes import assert_meta_equals_cpu
from typer.testing import CliRunner

from memplan import memory
from memplan.cli import app
from memplan.probe.meta_kernels import grouped_mm_flops, grouped_mm_meta
from memplan.probe.runner import probe_model
from memplan.solver import SolveRequest, solve

REAL = Path(__file__).parent / "models" / "real"


def _config(tmp: Path, name: str, data: dict) -> str:
    folder = tmp / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)


BART = {
    "model_type": "bart",
    "vocab_size": 128,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
}
MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}


def test_bart_from_an_hf_config_probes_on_meta_as_on_cpu(tmp_path: Path) -> None:
    # the decoder makes a float torch.ones mask that masking_utils reads (.all()): a factory
    # twin answers it (was exit 3, aten._local_scalar_dense)
    ref = f"hf:{_config(tmp_path, 'bart', BART)}?task=seq2seq-lm&seq-len=16"
    meta = probe_model(ref, device="meta", micro_batches=(1, 2))
    cpu = probe_model(ref, device="cpu", micro_batches=(1, 2), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)


def test_mixtral_probes_on_meta_as_on_cpu_and_counts_its_expert_flops(tmp_path: Path) -> None:
    ref = f"hf:{_config(tmp_path, 'mixtral', MIXTRAL)}?task=causal-lm&seq-len=16"
    meta = probe_model(ref, device="meta", micro_batches=(1, 2))
    cpu = probe_model(ref, device="cpu", micro_batches=(1, 2), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)
    # per sample and layer, 16 tokens: experts (top-2 of 4: 32 rows) gate_up 2·32·32·128 +
    # down 2·32·64·32 = 393,216; q, k, v, o 2·16·32·(32+16+16+32) = 98,304; router
    # 2·16·32·4 = 4,096; attention 4·16·16·32 = 32,768
    expected = 393_216 + 98_304 + 4_096 + 32_768
    for profile in (meta, cpu):
        assert [layer.fwd_flops.slope for layer in profile.layers] == [expected, expected]


def test_grouped_mm_runs_on_meta_in_float32_with_its_flops() -> None:
    tokens = torch.empty(10, 8, device="meta")
    experts = torch.empty(3, 8, 5, device="meta")
    offs = torch.tensor([4, 7, 10], dtype=torch.int32, device="meta")
    out = grouped_mm_meta(tokens, experts, offs)
    assert out.shape == (10, 5) and out.dtype == torch.float32
    assert grouped_mm_flops(tokens, experts, offs, out_val=out) == 2 * 10 * 8 * 5
    # a weight gradient: K (10 tokens) split in 3 groups, output (3, 8, 5)
    grad = grouped_mm_meta(tokens.t(), torch.empty(10, 5, device="meta"), offs)
    assert grad.shape == (3, 8, 5)
    assert grouped_mm_flops(tokens.t(), torch.empty(10, 5), offs, out_val=grad) == 2 * 8 * 5 * 10


SHARED = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[1](x)  # shared, as ALBERT shares its layer
        return self.head(self.blocks[2](x)).pow(2).mean()


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(batch_size))
"""


def test_a_block_called_twice_is_dropped_with_a_warning_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "shared.py"
    path.write_text(SHARED)
    profile = probe_model(str(path), device="meta", micro_batches=(1, 2))
    assert profile.layer_names == ("blocks.0", "blocks.2")
    assert any("blocks.1 ran its forward 2 times" in w for w in profile.warnings)
    shared = next(part for part in profile.fixed if part.name == "blocks.1")
    assert shared.params_trainable_bytes == (16 * 16 + 16) * 4  # counted as a fixed part


def test_init_check_takes_layers(tmp_path: Path) -> None:
    path = tmp_path / "shared.py"
    path.write_text(SHARED)
    out = tmp_path / "memplan.yaml"
    result = CliRunner().invoke(
        app,
        [
            "init-check",
            str(path),
            "--layers",
            "blocks.0,blocks.2",
            "-o",
            str(out),
            "--budget",
            "1GiB",
        ],
    )
    assert result.exit_code == 0, result.output
    assert 'layers: "blocks.0,blocks.2"' in out.read_text()


MOBILENET = """
import _tv  # noqa: F401
import torch
import torch.nn.functional as F
from torchvision.models import mobilenet_v3_small


def build_model():
    return mobilenet_v3_small(num_classes=10)


def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    return torch.randn(batch_size, 3, 224, 224, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def training_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
"""


def test_mobilenet_v3_small_defaults_go_deeper_and_plan_at_the_halfway_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REAL))
    path = tmp_path / "mobilenet.py"
    path.write_text(MOBILENET)
    profile = probe_model(str(path), device="meta", micro_batches=(1, 2, 4))
    # its 6 repeated blocks (features.2/3's convolutions) hold 12 of its 88 layers; every block is
    # taken instead, and the profile says so
    assert profile.layer_names == tuple(f"features.{i}" for i in range(13))
    assert any("hold 14% of the model's layers" in w for w in profile.warnings)
    names = list(profile.layer_names)
    every = memory.step_peak(profile, 16, names, 1).peak_bytes
    none = memory.step_peak(profile, 16, [], 1).peak_bytes
    assert every < 0.5 * none  # the deeper candidates hold most of the activations
    plan = solve(
        profile,
        SolveRequest(target_batch=32, budget_bytes=(every + none) // 2, allow_small_bn_micro=True),
    ).plan
    assert plan.predicted.peak_bytes <= (every + none) // 2
    assert any("planned for no particular device" in r for r in plan.reasons)
