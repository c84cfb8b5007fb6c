"""A tiny model file for the emitted training script: the memplan model-file contract with
no training_loss (the forward returns the scalar loss), a second factory, and dropout."""

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def build_model() -> nn.Module:
    return TinyMLP()


def build_wide() -> nn.Module:
    return TinyMLP(width=16, depth=3)


def make_batch(batch_size: int):
    return torch.randn(batch_size, 4), torch.randn(batch_size)
