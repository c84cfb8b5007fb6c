"""Two wide pre-norm transformer blocks (width 1024, 16 heads, MLP 4096, sequence 512) under a
mean-square loss: matmul- and attention-bound on a CPU, unlike the small examples, whose
steps are mostly per-op overhead. bench ``calibrate`` times it three ways."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, SEQ = 1024, 16, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, WIDTH // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class WideBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.blocks(x), target)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return WideBlocks()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, SEQ, WIDTH), torch.randn(batch_size, SEQ, WIDTH)
