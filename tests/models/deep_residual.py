"""A deep stack of tiny residual blocks, ``x + Linear(4, 4)(x)``: the model of issue #26,
where every cost of memplan that grows with the number of layers shows. ``build_model``
builds 10,000 blocks; ``blocks_100`` and ``blocks_1000`` fewer (``deep_residual.py:blocks_100``).
``varied_*`` builds blocks whose widths cycle through 4, 5, 6, 7 (no two neighbours alike,
each a bottleneck ``Linear(4, w) → Linear(w, 4)``), so nothing is identical to its
predecessor.
"""

import torch
from torch import nn

WIDTH = 4
BLOCKS = 10_000


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, width)
        self.out = nn.Linear(width, WIDTH) if width != WIDTH else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return x + (y if self.out is None else self.out(y))


class Net(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(w) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _identical(n: int) -> nn.Module:
    torch.manual_seed(0)
    return Net([WIDTH] * n)


def _varied(n: int) -> nn.Module:
    torch.manual_seed(0)
    return Net([WIDTH + i % 4 for i in range(n)])


def build_model() -> nn.Module:
    return _identical(BLOCKS)


def blocks_10() -> nn.Module:
    return _identical(10)


def blocks_100() -> nn.Module:
    return _identical(100)


def blocks_1000() -> nn.Module:
    return _identical(1000)


def varied_10() -> nn.Module:
    return _varied(10)


def varied_100() -> nn.Module:
    return _varied(100)


def varied_1000() -> nn.Module:
    return _varied(1000)


def varied_10000() -> nn.Module:
    return _varied(10_000)


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH)


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
