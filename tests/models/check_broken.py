"""A model file that breaks the contract: it has no make_batch()."""

from torch import nn


def build_model() -> nn.Module:
    return nn.Linear(4, 4)
