"""Hugging Face T5 (encoder-decoder) from a tiny ``T5Config`` with everything else at its
defaults: ``use_cache=True``, dropout 0.1."""

import torch
from transformers import T5Config, T5ForConditionalGeneration

SEQ_LEN = 16
CONFIG = T5Config(
    vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
    decoder_start_token_id=0,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return T5ForConditionalGeneration(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN), generator=g)
    labels = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN // 2), generator=g)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
