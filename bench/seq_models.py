"""Model files for the sequence-length bench (``bench/seqlen.py``): each factory's batches
have a length (``make_batch(batch_size, seq_len)``).

* ``build_eager``: a GPT whose attention materialises the ``s × s`` scores (quadratic);
* ``build_sdpa``: the same GPT with ``F.scaled_dot_product_attention`` (linear on CPU);
* ``build_llama``: a Hugging Face ``LlamaForCausalLM`` built from a config (no weights),
  with transformers' default attention (SDPA), rotary positions and its own masks.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 512
D_MODEL = 48
N_HEADS = 3
N_LAYERS = 3
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
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(MAX_LEN, D_MODEL)
        self.blocks = nn.ModuleList(Block(sdpa) for _ in range(N_LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def build_model() -> nn.Module:
    return build_eager()


def build_eager() -> nn.Module:
    torch.manual_seed(0)
    return GPT(sdpa=False)


def build_sdpa() -> nn.Module:
    torch.manual_seed(0)
    return GPT(sdpa=True)


def build_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=4 * D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_HEADS,
        max_position_embeddings=MAX_LEN,
    )
    return LlamaForCausalLM(config)


def make_batch(batch_size: int, seq_len: int = 128) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size * 100003 + seq_len)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
