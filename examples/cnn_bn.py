"""A small CNN with BatchNorm; its blocks sit in an nn.Sequential (the checkpoint candidates).

memplan warns for BatchNorm models: statistics come from the micro-batch, and under
checkpoint recompute the running statistics update twice.
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE = 32
CLASSES = 10


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.Sequential(
            ConvBlock(32, 32, 1),
            ConvBlock(32, 64, 2),
            ConvBlock(64, 64, 1),
            ConvBlock(64, 128, 2),
            ConvBlock(128, 128, 1),
        )
        self.head = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return CNN()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch_size,))


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)
