"""Hugging Face Mixtral from a tiny config with its router's load-balancing loss on
(``output_router_logits=True``): the auxiliary loss is computed over the micro-batch's
tokens, so micro-batches couple."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

SEQ_LEN = 8
CONFIG = MixtralConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=32,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
)


def build_model() -> torch.nn.Module:
    return MixtralForCausalLM(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
