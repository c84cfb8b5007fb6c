"""Hugging Face ``GPT2LMHeadModel`` built from a small ``GPT2Config`` (no weights are
downloaded). The batch is a dict; the model's output has ``.loss``. Needs transformers."""

import torch
from _data import tokens
from transformers import GPT2Config, GPT2LMHeadModel

SEQ_LEN = 32
CONFIG = GPT2Config(
    vocab_size=2048,
    n_positions=SEQ_LEN,
    n_embd=64,
    n_layer=4,
    n_head=4,
    bos_token_id=0,
    eos_token_id=0,
    use_cache=False,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids, _ = tokens(batch_size, SEQ_LEN, CONFIG.vocab_size)
    return {"input_ids": ids, "labels": ids.clone()}
