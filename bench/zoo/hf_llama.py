"""Hugging Face ``LlamaForCausalLM`` built from a small ``LlamaConfig`` (RoPE, RMSNorm,
SwiGLU, grouped-query attention; no weights are downloaded). Needs transformers."""

import torch
from _data import tokens
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 32
CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ_LEN,
    use_cache=False,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids, _ = tokens(batch_size, SEQ_LEN, CONFIG.vocab_size)
    return {"input_ids": ids, "labels": ids.clone()}
