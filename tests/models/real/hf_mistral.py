"""Hugging Face Mistral (decoder-only) with attention dropout and a sliding window, from a
tiny ``MistralConfig`` left at its default ``use_cache=True``; the batch has a mask."""

import torch
from transformers import MistralConfig, MistralForCausalLM

SEQ_LEN = 16
CONFIG = MistralConfig(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    sliding_window=8,
    attention_dropout=0.1,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MistralForCausalLM(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN), generator=g)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
