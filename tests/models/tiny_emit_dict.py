"""A tiny model file with a dict batch, training_loss and make_optimizer (SGD), for the
emitted training script."""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))


def make_batch(batch_size: int):
    return {"inputs": torch.randn(batch_size, 3), "targets": torch.randn(batch_size, 1)}


def training_loss(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["inputs"]), batch["targets"])


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    print("tiny_emit_dict: make_optimizer called", flush=True)
    return torch.optim.SGD(model.parameters(), lr=0.01)
