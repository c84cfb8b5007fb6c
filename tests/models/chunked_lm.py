"""A small LM whose loss is torchtitan 0.3's chunked head and loss
(memplan.run.losses.chunked_cross_entropy): its forward makes the head's gradient."""

import torch
from torch import nn

from memplan.run.losses import chunked_cross_entropy

VOCAB, WIDTH, SEQ, CHUNKS = 256, 32, 16, 4


class ChunkedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def build_model() -> nn.Module:
    return ChunkedLM()


def make_batch(batch_size: int):
    t = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return t[:, :-1].clone(), t[:, 1:].clone()


def training_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    head = getattr(model, "module", model).lm_head  # a DDP or FSDP wrapper holds the model
    return chunked_cross_entropy(model(tokens), head, targets, chunks=CHUNKS)
