"""A tiny GPT whose batches have a length (``make_batch(batch_size, seq_len)``), for the
sequence-length tests (issue 13). ``build_model`` uses eager attention (the ``s × s``
scores are materialised and saved: memory quadratic in the length); ``build_sdpa`` uses
``F.scaled_dot_product_attention`` (on CPU, the fused kernel: linear). Not in the zoo: the
probe has never seen it."""

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
D_MODEL = 32
N_HEADS = 2
N_LAYERS = 2
MAX_LEN = 4096


class Attention(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, N_HEADS, d // N_HEADS).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // N_HEADS)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention(sdpa)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block(sdpa) for _ in range(N_LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(sdpa=False)


def build_sdpa() -> nn.Module:
    torch.manual_seed(0)
    return GPT(sdpa=True)


def make_batch(batch_size: int, seq_len: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size * 100003 + seq_len)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
