"""Issue 33, shortcut repro 2: the Gemma2 / Mistral pattern. Sixteen identical attention
blocks; the parent gives every 8th one global attention and the others a sliding window
(``window=None`` or ``WINDOW``), so the blocks are alike in every attribute and parameter
and differ only in what the parent passes them."""

import torch
from torch import nn

D, T, WINDOW, BLOCKS = 8, 32, 4, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, window: int | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if window is None:  # global: every position attends to every other (t x t scores)
            scores = q @ k.transpose(-1, -2) / D**0.5
            y = torch.softmax(scores, dim=-1) @ v
        else:  # local: attention within chunks of `window` positions (t x window scores)
            q, k, v = (z.reshape(b, t // window, window, D) for z in (q, k, v))
            scores = q @ k.transpose(-1, -2) / D**0.5
            y = (torch.softmax(scores, dim=-1) @ v).reshape(b, t, D)
        return x + self.out(y)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, None if i % 8 == 0 else WINDOW)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, T, D)


def training_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()
