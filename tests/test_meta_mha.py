"""``nn.MultiheadAttention`` on meta (memplan.probe.meta_attention.MetaAttention._multi_head):
``F.multi_head_attention_forward`` calls SDPA from its own body, where a function mode is
off, so before this the meta probe ran the math path for every ``nn.TransformerEncoderLayer``
(and torchvision's ViT) and saved the attention probabilities, O(seq²) a head, where the CPU
and the GPU run a fused kernel that saves the output and a log-sum-exp."""

from __future__ import annotations

from pathlib import Path

import pytest
from profile_bytes import assert_meta_equals_cpu

from memplan.probe.runner import probe_model

ENCODER = """
import torch
from torch import nn

SEQ = {seq}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout={dropout}, batch_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Net()


def make_batch(b):
    return torch.randint(0, 64, (b, SEQ), generator=torch.Generator().manual_seed(b))


def training_loss(model, ids):
    return model(ids).logsumexp(-1).mean()
"""


def _write(tmp: Path, seq: int, dropout: float = 0.0) -> str:
    path = tmp / f"encoder_{seq}_{dropout}.py"
    path.write_text(ENCODER.format(seq=seq, dropout=dropout))
    return str(path)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_transformer_encoder_probes_on_meta_as_on_cpu(tmp_path: Path, dropout: float) -> None:
    """Without dropout the CPU runs its flash kernel inside ``nn.MultiheadAttention``; with
    attention dropout it refuses it and runs the math path. Meta follows both, to the byte.
    Before: 4 heads × 16 × 16 probabilities saved on meta in each layer that cpu's flash
    kernel does not save."""
    path = _write(tmp_path, 16, dropout)
    meta = probe_model(path, device="meta", micro_batches=(2, 4, 8))
    cpu = probe_model(path, device="cpu", micro_batches=(2, 4, 8), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)


def test_on_a_gpu_target_the_saved_bytes_grow_with_the_sequence_not_its_square(
    tmp_path: Path,
) -> None:
    """On an H100 target in bf16 the layer runs a fused kernel there too: twice the tokens
    keep exactly twice the bytes. The math path, which meta ran before, keeps the
    probabilities too, 4 × s² a sample: at micro-batches 1 and 2 it kept 168,960 → 468,992 B
    a sample (×2.78)."""
    slopes = []
    for seq in (64, 128):
        profile = probe_model(
            _write(tmp_path, seq),
            device="meta",
            micro_batches=(2, 4),
            device_profile="h100-80gb",
            precision="bf16",
        )
        slopes.append([layer.saved_bytes.slope for layer in profile.layers])
    assert slopes[0][0] > 0
    assert slopes[1] == [2 * s for s in slopes[0]]
