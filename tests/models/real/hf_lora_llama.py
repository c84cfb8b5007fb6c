"""A PEFT LoRA (r=8 on q_proj, v_proj) around a tiny Hugging Face Llama: the base is
frozen, only the adapters train."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SEQ_LEN = 16
CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.05)
    return get_peft_model(LlamaForCausalLM(CONFIG), lora)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, SEQ_LEN), generator=g)
    mask = torch.ones(batch_size, SEQ_LEN, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
