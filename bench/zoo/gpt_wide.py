"""GPT-style language model with wide blocks (d_model 512, sequence 32, vocab 256): its
matmuls dominate each block's time, so keeping their outputs and recomputing only the
pointwise ops (selective checkpointing) costs much less than a full recompute, even on a
CPU where selective checkpointing's per-op Python dispatch is expensive. The blocks are
gpt_lm's."""

import torch
import torch.nn.functional as F
from _data import tokens
from gpt_lm import Block
from torch import nn

VOCAB = 256
D_MODEL = 512
N_HEADS = 8
N_LAYERS = 2
SEQ_LEN = 32


class WideGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEADS) for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return WideGPT()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(batch_size, SEQ_LEN, VOCAB)
