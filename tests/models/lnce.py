"""Tiny test model of Linear, LayerNorm, GELU and cross-entropy (meta and cpu must agree)."""

import torch
import torch.nn.functional as F
from torch import nn

D, CLASSES = 24, 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 2 * D)
        self.norm = nn.LayerNorm(2 * D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.norm(self.fc(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), y.flatten())


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, 5, D), "y": torch.randint(0, CLASSES, (batch_size, 5))}
