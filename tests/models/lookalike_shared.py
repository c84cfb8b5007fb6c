"""Issue 33, shortcut repro 3: sixteen blocks of one class and one parameter shape, the
first six of which share one weight (``blocks[k].lin.weight is blocks[0].lin.weight`` for
k < 6) while the other ten own theirs. A probe of the first 4, 5 or 6 blocks sees one
weight however many blocks there are."""

import torch
from torch import nn

D, BLOCKS, SHARED = 32, 16, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        for block in self.blocks[1:SHARED]:
            block.lin.weight = self.blocks[0].lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, D)


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
