"""Hugging Face BERT (encoder-only) for sequence classification, from a tiny ``BertConfig``
with its default dropouts (hidden 0.1, attention-probs 0.1); the batch has a padding mask."""

import torch
from transformers import BertConfig, BertForSequenceClassification

SEQ_LEN = 16
CONFIG = BertConfig(
    vocab_size=512,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=SEQ_LEN,
    num_labels=3,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BertForSequenceClassification(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN), generator=g)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    mask[:, SEQ_LEN - 3 :] = 0  # padded tail
    labels = torch.randint(0, CONFIG.num_labels, (batch_size,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
