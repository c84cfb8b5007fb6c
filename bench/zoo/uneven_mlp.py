"""MLP over each of a sample's positions, with blocks whose widths differ tenfold (64 to
960): what checkpointing a block saves differs tenfold too, so the best set is not a
prefix and not "every other one"."""

import itertools

import torch
import torch.nn.functional as F
from _data import generator
from torch import nn

IN_FEATURES = 64
POSITIONS = 32
WIDTHS = (64, 640, 96, 960, 64)
CLASSES = 10


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.fc(x)))


class UnevenMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        dims = (IN_FEATURES, *WIDTHS)
        self.blocks = nn.Sequential(*(Block(a, b) for a, b in itertools.pairwise(dims)))
        self.head = nn.Linear(dims[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return UnevenMLP()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(batch_size)
    x = torch.randn(batch_size, POSITIONS, IN_FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size,), generator=g)


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
