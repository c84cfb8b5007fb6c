"""Tiny test model: a stack of Linear → ReLU → Linear blocks whose bytes are computable by
hand (see tests/test_probe.py)."""

import torch
from torch import nn

D, H, LAYERS = 8, 32, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.act = nn.ReLU()
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(LAYERS)))


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, D)


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
