"""Tiny test model: a frozen embedding feeds blocks whose first op is frozen (LoRA-like), so
block 0's input needs no gradient and nothing but a checkpoint keeps it (tests/test_probe.py)."""

import torch
from torch import nn

VOCAB, SEQ, D, H, LAYERS = 32, 8, 16, 64, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.norm.requires_grad_(False)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(0))


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
