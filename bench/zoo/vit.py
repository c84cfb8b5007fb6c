"""Vision transformer with dropout (attention and MLP): the dropout masks are saved for
backward, and checkpoint recompute must replay the same masks (preserve_rng_state)."""

import torch
import torch.nn.functional as F
from _data import images
from torch import nn

IMAGE = 32
PATCH = 8
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 4
CLASSES = 10
DROPOUT = 0.1


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, D_MODEL, PATCH, stride=PATCH)
        tokens = (IMAGE // PATCH) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, D_MODEL))
        self.pos = nn.Parameter(torch.randn(1, tokens, D_MODEL) * 0.02)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                D_MODEL,
                N_HEADS,
                dim_feedforward=4 * D_MODEL,
                dropout=DROPOUT,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(N_LAYERS)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return ViT()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return images(batch_size, 3, IMAGE, CLASSES)


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
