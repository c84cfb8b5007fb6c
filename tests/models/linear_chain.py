"""Two blocks of four bias-free 1024 × 1024 linear layers in a row, on 512 tokens a sample:
hand-computable under torchtitan's per-op selective checkpointing (memplan.modes). Each
block keeps the outputs of its 1st and 3rd matmul and recomputes the 2nd (the 4th's output
is the block's own, and no backward needs it again)."""

import torch
from torch import nn

D, T = 1024, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(self.l3(self.l2(self.l1(x))))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build_model() -> nn.Module:
    return Chain()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, T, D)
