"""Tiny test model: each block's output feeds an op that saves nothing for backward (a
multiply by a constant, like U-Net's interpolate and cat), so a checkpointed block's output
is freed once consumed, while a plain block's last ReLU keeps it (tests/test_probe.py)."""

import torch
from torch import nn

SEQ, D, H, LAYERS = 32, 16, 64, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.down(torch.relu(self.up(x))))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * 2.0
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Chain()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, SEQ, D, generator=torch.Generator().manual_seed(0))


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
