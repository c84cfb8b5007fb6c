"""Hugging Face ``GPT2LMHeadModel`` from a small ``GPT2Config`` left at its defaults
otherwise: ``use_cache=True`` and dropout 0.1 everywhere (attention included). With the
cache on, checkpointed blocks' keys and values stayed alive in the cache: the probe
under-predicted by 2.4-4.1% whenever some but not all blocks were checkpointed (issue 16);
memplan now turns the cache off wherever it checkpoints. Needs transformers."""

import torch
from _data import tokens
from transformers import GPT2Config, GPT2LMHeadModel

SEQ_LEN = 32
CONFIG = GPT2Config(
    vocab_size=2048, n_positions=SEQ_LEN, n_embd=64, n_layer=4, n_head=4,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids, _ = tokens(batch_size, SEQ_LEN, CONFIG.vocab_size)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
