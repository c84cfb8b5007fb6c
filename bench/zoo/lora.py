"""LoRA fine-tuning of a GPT-style LM: every base weight (embeddings, blocks, head) is
frozen; only rank-8 adapters on the attention and MLP projections train. Frozen weights
have no gradients and no optimizer state, but their activations are still saved."""

import torch
import torch.nn.functional as F
from _data import tokens
from torch import nn

VOCAB = 2048
D_MODEL = 96
N_HEADS = 4
N_LAYERS = 4
SEQ_LEN = 32
RANK = 8


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(RANK, d_in) * 0.01)
        self.b = nn.Parameter(torch.zeros(d_out, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = LoRALinear(D_MODEL, 3 * D_MODEL)
        self.proj = LoRALinear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.up = LoRALinear(D_MODEL, 4 * D_MODEL)
        self.down = LoRALinear(4 * D_MODEL, D_MODEL)
        for norm in (self.ln1, self.ln2):
            norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, N_HEADS, d // N_HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LoRAGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        for frozen in (self.tok_emb, self.pos_emb, self.ln_f, self.head):
            frozen.requires_grad_(False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LoRAGPT()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(batch_size, SEQ_LEN, VOCAB)
