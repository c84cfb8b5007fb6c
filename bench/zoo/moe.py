"""Transformer-free mixture of experts: blocks of LayerNorm + a top-1 routed MoE MLP. Which
tokens reach which expert depends on the data, so the op shapes do too (``nonzero`` has
no meta kernel: a meta probe cannot measure it)."""

import torch
import torch.nn.functional as F
from _data import generator
from torch import nn

D_MODEL = 64
N_EXPERTS = 4
N_LAYERS = 4
SEQ_LEN = 64
CLASSES = 10


class MoE(nn.Module):
    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gate, choice = self.router(flat).softmax(dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * gate[rows, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D_MODEL)
        self.moe = MoE(D_MODEL, N_EXPERTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D_MODEL, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MoEModel()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(batch_size)
    x = torch.randn(batch_size, SEQ_LEN, D_MODEL, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size,), generator=g)


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
