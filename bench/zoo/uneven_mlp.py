"""MLP over each of a sample's positions, with blocks whose widths differ tenfold (64 to
960): what checkpointing a block saves differs tenfold too, so the best set is not a
prefix and not "every other one". The model of examples/mlp.py at other widths."""

import torch
import torch.nn.functional as F
from _data import generator
from _examples import example
from torch import nn

IN_FEATURES = 64
POSITIONS = 32
WIDTHS = (64, 640, 96, 960, 64)
CLASSES = 10


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return example("mlp").MLP(in_features=IN_FEATURES, widths=WIDTHS, classes=CLASSES)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(batch_size)
    x = torch.randn(batch_size, POSITIONS, IN_FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size,), generator=g)


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
