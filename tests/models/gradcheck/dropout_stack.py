"""A small stack with dropout in every block and a mean loss: the model the gradient
check's mutation tests inject runtime faults under."""

import torch
from torch import nn

WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(batch_size))
