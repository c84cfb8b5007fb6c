"""U-Net for per-pixel classification. Its blocks are one ModuleList (encoder, bottleneck,
decoder), and the encoder outputs are concatenated into the decoder: skip tensors stay
alive across the checkpointed blocks between them."""

import torch
import torch.nn.functional as F
from _data import generator
from torch import nn

IMAGE = 32
CLASSES = 4


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # enc0 (32x32), enc1 (16x16), bottleneck (8x8), dec1 (16x16), dec0 (32x32)
        self.blocks = nn.ModuleList(
            [
                ConvBlock(3, 16),
                ConvBlock(16, 32),
                ConvBlock(32, 64),
                ConvBlock(64 + 32, 32),
                ConvBlock(32 + 16, 16),
            ]
        )
        self.head = nn.Conv2d(16, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enc0, enc1, mid, dec1, dec0 = self.blocks
        s0 = enc0(x)
        s1 = enc1(F.max_pool2d(s0, 2))
        y = mid(F.max_pool2d(s1, 2))
        y = dec1(torch.cat([F.interpolate(y, scale_factor=2.0), s1], dim=1))
        y = dec0(torch.cat([F.interpolate(y, scale_factor=2.0), s0], dim=1))
        return self.head(y)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return UNet()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(batch_size)
    x = torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g)
    return x, torch.randint(0, CLASSES, (batch_size, IMAGE, IMAGE), generator=g)


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
