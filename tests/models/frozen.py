"""Tiny test model with frozen blocks (0 and 2): they get no gradient and no optimizer state."""

import torch
from torch import nn

D = 16


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)))
    for index in (0, 2):
        model[index].requires_grad_(False)
    return model


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, D)


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).mean()
