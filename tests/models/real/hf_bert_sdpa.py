"""tests/models/real/hf_bert.py with ``attn_implementation="sdpa"`` and no attention-probs
dropout, so that on CPU ``scaled_dot_product_attention`` takes its fused kernel, here with
the padding mask as an ``attn_mask``."""

import torch
from hf_bert import CONFIG, make_batch  # noqa: F401  (the same batches)
from transformers import BertConfig, BertForSequenceClassification

SDPA_CONFIG = BertConfig(
    vocab_size=CONFIG.vocab_size,
    hidden_size=CONFIG.hidden_size,
    num_hidden_layers=CONFIG.num_hidden_layers,
    num_attention_heads=CONFIG.num_attention_heads,
    intermediate_size=CONFIG.intermediate_size,
    max_position_embeddings=CONFIG.max_position_embeddings,
    num_labels=CONFIG.num_labels,
    attention_probs_dropout_prob=0.0,
    attn_implementation="sdpa",
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(SDPA_CONFIG)
