"""tests/models/real/hf_mistral.py with ``attn_implementation="sdpa"`` and no attention
dropout, so that on CPU ``scaled_dot_product_attention`` takes its fused kernel, here with
the sliding window (8 of 16 tokens) as an ``attn_mask``."""

import torch
from hf_mistral import CONFIG, make_batch  # noqa: F401  (the same batches)
from transformers import MistralConfig, MistralForCausalLM

SDPA_CONFIG = MistralConfig(
    vocab_size=CONFIG.vocab_size,
    hidden_size=CONFIG.hidden_size,
    intermediate_size=CONFIG.intermediate_size,
    num_hidden_layers=CONFIG.num_hidden_layers,
    num_attention_heads=CONFIG.num_attention_heads,
    num_key_value_heads=CONFIG.num_key_value_heads,
    max_position_embeddings=CONFIG.max_position_embeddings,
    sliding_window=CONFIG.sliding_window,
    attention_dropout=0.0,
    attn_implementation="sdpa",
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MistralForCausalLM(SDPA_CONFIG)
