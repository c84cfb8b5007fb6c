"""A small residual MLP for the `memplan check` tests: four same-type blocks (the checkpoint
candidates ``blocks.0`` .. ``blocks.3``), an input projection and a head."""

import torch
from torch import nn

WIDTH = 32
HIDDEN = 64


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, hiddens: list[int]) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH, h) for h in hiddens])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(hiddens: list[int]) -> nn.Module:
    torch.manual_seed(0)
    return Net(hiddens)


def build_model() -> nn.Module:
    return build([HIDDEN] * 4)


def make_batch(batch_size: int):
    return torch.randn(batch_size, 16), torch.randn(batch_size, 1)


def training_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
