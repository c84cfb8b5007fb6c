"""A plain MLP classifier applied to each of a sample's POSITIONS feature vectors, then pooled;
blocks of uneven width, so layers differ in what they save. Activations, not parameters,
dominate memory from a few samples up."""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

IN_FEATURES = 128
POSITIONS = 64
CLASSES = 10
WIDTHS = (256, 512, 256, 384, 128, 256)


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.fc(x)))


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int = IN_FEATURES,
        widths: tuple[int, ...] = WIDTHS,
        classes: int = CLASSES,
    ) -> None:
        super().__init__()
        dims = (in_features, *widths)
        self.blocks = nn.Sequential(*(Block(a, b) for a, b in itertools.pairwise(dims)))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(batch_size, POSITIONS, IN_FEATURES),
        "y": torch.randint(0, CLASSES, (batch_size,)),
    }


def training_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])
