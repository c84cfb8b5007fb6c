"""Issue 33, shortcut repro 1: sixteen blocks that look identical (same class, same
parameter shapes) but every 8th one takes a 16x wider intermediate, chosen by an index the
block holds privately (``self._idx``): the parent cannot see it, the blocks' signatures
agree, and only what each block runs tells them apart."""

import torch
from torch import nn

D, BLOCKS, WIDE = 8, 16, 16


class Block(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self._idx = i
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self._idx % 8 == 0:  # the wide path: a 16x wider intermediate, saved by relu
            h = torch.relu(h.repeat(1, WIDE)).view(x.shape[0], WIDE, 4 * D).mean(1)
        else:
            h = torch.relu(h)
        return x + self.down(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(BLOCKS))

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
