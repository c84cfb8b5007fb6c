"""Stacked single-layer ``nn.LSTM``s (the checkpoint candidates) over a sequence, then a
classifier on the last step. On CPU an LSTM runs as many small per-timestep ops."""

import torch
import torch.nn.functional as F
from _data import generator
from torch import nn

IN_FEATURES = 32
HIDDEN = 96
N_LAYERS = 4
SEQ_LEN = 24
CLASSES = 10


class StackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, HIDDEN)
        self.lstms = nn.ModuleList(
            nn.LSTM(HIDDEN, HIDDEN, batch_first=True) for _ in range(N_LAYERS)
        )
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for lstm in self.lstms:
            x = x + lstm(x)[0]
        return self.head(x[:, -1])


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return StackedLSTM()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(batch_size)
    x = torch.randn(batch_size, SEQ_LEN, IN_FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size,), generator=g)


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
