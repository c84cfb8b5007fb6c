"""Tiny test model: ``nn.TransformerEncoderLayer`` blocks, which run another op sequence at
micro-batch 1 than above it (tests/test_probe.py)."""

import torch
from torch import nn

SEQ, D, LAYERS = 8, 16, 3


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 2, 4 * D, dropout=0.0, batch_first=True)
            for _ in range(LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, SEQ, D, generator=torch.Generator().manual_seed(0))


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
