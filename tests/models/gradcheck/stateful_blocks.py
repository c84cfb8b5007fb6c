"""A stack whose blocks are not checkpoint-safe: each forward reads and advances a Python
counter (a schedule kept on the module), so the recompute during backward runs with another
value than the forward did. Checkpointed, its gradients are wrong."""

import torch
from torch import nn

WIDTH = 16


class ScheduledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        gain = 1.0 if self.calls % 2 else 0.5  # Python-side state the recompute sees anew
        return x + torch.tanh(gain * self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScheduledBlock() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def build_model() -> nn.Module:
    return Net()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(batch_size))
