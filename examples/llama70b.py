"""A Llama-2-70B-shaped model: RMSNorm, rotary position embeddings, SwiGLU MLP, 80 layers,
hidden 8192, intermediate 28672, 64 query heads sharing 8 key/value heads (grouped-query
attention), vocabulary 32000, sequence 4096 (Touvron et al. 2023, "Llama 2", Table 1 and
§2.2; the released config: num_key_value_heads 8).

Only ever probed on meta: it has 6.9e10 parameters, 276 GB in fp32. Planned the way it is
trained, with FSDP's mixed-precision policy (docs/big-models.md)::

    memplan probe examples/llama70b.py --device meta --precision bf16 \\
        --mixed-precision params -o llama70b.yaml
    memplan solve llama70b.yaml --target-batch 512 --world-size 64 --strategy fsdp \\
        --budget 80GiB --device-profile h100-80gb

``build_llama2_7b`` and ``build_llama2_13b`` build the smaller Llama 2 shapes with the same
code (``examples/llama70b.py:build_llama2_13b``); the big-model benchmark uses all three.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 32000
    seq_len: int = 4096
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# The released Llama 2 configs (config.json of each size).
LLAMA2_7B = Shape(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32)
LLAMA2_13B = Shape(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40)
LLAMA2_70B = Shape(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8)
# Llama 3.1 405B's config.json (its 128256-token vocabulary; batches keep ids below 32000).
LLAMA31_405B = Shape(
    layers=126, hidden=16384, intermediate=53248, heads=128, kv_heads=8, vocab=128256
)
SEQ_LEN, VOCAB = 4096, 32000  # the same for all three: make_batch serves every factory

# Which modules tensor parallelism splits (memplan.run.tp_plan): torchtitan's Llama plan
# (torchtitan/models/llama3/infra/parallelize.py, apply_tp) in transformers' style names.
TP_PLAN = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).type_as(x) * self.weight


def rotary_angles(head_dim: int, seq: int) -> torch.Tensor:
    """Each position's angle for each pair of features, (seq, head_dim / 2)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.outer(torch.arange(seq).float(), inv_freq)


def rotary_tables(head_dim: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = rotary_angles(head_dim, seq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention: ``kv_heads`` key/value heads shared by the query heads."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.s
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds heads / tp of them.
        q = self.q_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, s.head_dim).transpose(1, 2)
        cos, sin = cos[:t].to(q.dtype), sin[:t].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        gqa = s.kv_heads != s.heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.norm_eps)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TitanRMSNorm(RMSNorm):
    """torchtitan's RMSNorm (9dec370, torchtitan/models/norms.py ``RMSNorm``): ``x`` cast to
    fp32 once, normalised, cast back, then scaled (``RMSNorm`` above casts it twice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_pairs_table(head_dim: int, seq: int) -> torch.Tensor:
    """``rotary_angles`` as torchtitan keeps them (``precompute_freqs_cis``: one
    complex64 ``cis`` a position and pair), stored as its real view, (seq, head_dim / 2, 2)
    fp32."""
    angles = rotary_angles(head_dim, seq)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


def rotate_pairs(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """torchtitan's rotary embedding of ``x`` (batch, seq, heads, head_dim): each adjacent
    pair of features read as one complex number in fp32, multiplied by its position's
    ``cis``, and cast back (9dec370 ``apply_rotary_emb``). It rotates pair ``(2i, 2i+1)``
    where ``rotate_half`` rotates ``(i, i + head_dim / 2)``: the same attention once the
    query and key projections' rows are ordered to match."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    cis = torch.view_as_complex(table[: x.shape[1]]).view(1, x.shape[1], 1, -1)
    return torch.view_as_real(pairs * cis).flatten(3).type_as(x)


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """Each key/value head copied ``n`` times, materialised (torchtitan 9dec370
    ``repeat_kv``: expand, then a reshape that copies), where ``Attention`` lets SDPA share
    the heads (``enable_gqa``)."""
    if n == 1:
        return x
    b, t, heads, d = x.shape
    return x.unsqueeze(3).expand(b, t, heads, n, d).reshape(b, t, heads * n, d)


class TitanAttention(Attention):
    """``Attention`` with the ops torchtitan's Llama ran in its December 2024 runs (9dec370,
    torchtitan/models/llama/model.py ``Attention.forward``): rotary embeddings on complex
    pairs in fp32 before the heads are transposed, grouped key/value heads repeated into
    full-size copies, SDPA on those, its output made contiguous."""

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        s = self.s
        b, t, _ = x.shape
        q = rotate_pairs(self.q_proj(x).view(b, t, -1, s.head_dim), table)
        k = rotate_pairs(self.k_proj(x).view(b, t, -1, s.head_dim), table)
        v = self.v_proj(x).view(b, t, -1, s.head_dim)
        n = q.shape[2] // k.shape[2]  # a TP rank holds heads / tp and kv_heads / tp
        k, v = repeat_kv(k, n), repeat_kv(v, n)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.o_proj(y.transpose(1, 2).contiguous().view(b, t, -1))


class TitanDecoderLayer(DecoderLayer):
    """``DecoderLayer`` with torchtitan's norms and attention (``TitanRMSNorm``,
    ``TitanAttention``); its MLP is the same SwiGLU."""

    def __init__(self, s: Shape) -> None:
        super().__init__(s)
        self.input_layernorm = TitanRMSNorm(s.hidden, s.norm_eps)
        self.self_attn = TitanAttention(s)
        self.post_attention_layernorm = TitanRMSNorm(s.hidden, s.norm_eps)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), table)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, s: Shape, compiled_loss: bool = False, titan_ops: bool = False) -> None:
        super().__init__()
        self.s = s
        # torchtitan compiles its loss with training.compile since 2025 (e7c0cae,
        # torchtitan/components/loss.py): no fp32 copy of the logits (memplan.run.losses)
        self.compiled_loss = compiled_loss
        # titan_ops: the blocks run the ops of torchtitan's own Llama (TitanDecoderLayer)
        self.titan_ops = titan_ops
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        block = TitanDecoderLayer if titan_ops else DecoderLayer
        self.layers = nn.ModuleList(block(s) for _ in range(s.layers))
        norm = TitanRMSNorm if titan_ops else RMSNorm
        self.norm = norm(s.hidden, s.norm_eps)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        if titan_ops:
            table = rotary_pairs_table(s.head_dim, s.seq_len)
            self.register_buffer("table", table, persistent=False)
        else:
            cos, sin = rotary_tables(s.head_dim, s.seq_len)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        rope = (self.table,) if self.titan_ops else (self.cos, self.sin)
        for layer in self.layers:
            x = layer(x, *rope)
        if self.compiled_loss:
            from memplan.run.losses import compiled_cross_entropy

            return compiled_cross_entropy(self.lm_head(self.norm(x)), targets)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, self.s.vocab), targets.view(-1))


def build_model() -> nn.Module:
    return Llama(LLAMA2_70B)


def build_llama2_13b() -> nn.Module:
    return Llama(LLAMA2_13B)


def build_llama2_7b() -> nn.Module:
    return Llama(LLAMA2_7B)


def build_llama31_405b() -> nn.Module:
    return Llama(LLAMA31_405B)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()
