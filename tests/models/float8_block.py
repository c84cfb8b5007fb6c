"""A tiny Llama-like model for float8 (tests/test_float8.py): two blocks of an RMSNorm and
three linears float8 converts (64x64, 64x128, 128x64), one it cannot (64x4: not divisible
by 16), and an output head torchtitan leaves in bf16."""

import torch
import torch.nn as nn

DIM, VOCAB, SEQ = 64, 128, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, 4, bias=False)  # 4 not divisible by 16: stays bf16

    def forward(self, x):
        h = self.norm(x)
        x = x + self.wq(h)
        return x + self.w2(torch.relu(self.w1(h))) + self.gate(h).sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def training_loss(model, batch):
    logits = model(batch)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())
