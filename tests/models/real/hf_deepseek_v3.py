"""Hugging Face DeepSeek-V3 from a tiny ``DeepseekV3Config``: multi-head latent attention
(queries and keys/values through low-rank projections, a rope slice of each head) and a
mixture of experts after one dense layer (4 routed experts, 2 a token, 1 shared; grouped
routing). transformers runs the experts as one grouped matmul over every token's choices
(``torch.nn.functional.grouped_mm``), so the bytes do not depend on where the router sends a
token, only the values do; it has no float64 kernel, so verify's gradient check compares in
fp32. The batch has a mask."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEQ_LEN = 16
CONFIG = DeepseekV3Config(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    max_position_embeddings=64,
    use_cache=False,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN), generator=g)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
