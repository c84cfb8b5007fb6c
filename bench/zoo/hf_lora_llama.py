"""A PEFT LoRA (r=8 on q_proj and v_proj) around a small Hugging Face ``LlamaForCausalLM``
with its default ``use_cache=True``: the base is frozen, only the adapters train. It
over-predicted by 5.7% with 3 of 4 blocks checkpointed at micro-batch 16 (issue 16) while
the cache was on under checkpointing. Needs transformers and peft."""

import torch
from _data import tokens
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 32
CONFIG = LlamaConfig(
    vocab_size=2048, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return get_peft_model(LlamaForCausalLM(CONFIG), lora)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids, _ = tokens(batch_size, SEQ_LEN, CONFIG.vocab_size)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
