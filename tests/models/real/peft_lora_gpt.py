"""PEFT LoRA (r=8 on every projection of attention and MLP) around examples/gpt.py's GPT:
the whole base is frozen, only the adapters train. Probed in bf16, selective checkpointing
keeps each frozen projection's output, which the plain run frees at once, so its savings
shrink per sample faster than the block's inputs grow (issue 36)."""

import importlib.util
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

_spec = importlib.util.spec_from_file_location(
    "memplan_example_gpt", Path(__file__).resolve().parents[3] / "examples" / "gpt.py"
)
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

VOCAB, D_MODEL, HEADS, LAYERS, SEQ_LEN = 256, 64, 4, 3, 32


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    base = gpt.GPT(vocab=VOCAB, d=D_MODEL, heads=HEADS, layers=LAYERS, seq=SEQ_LEN)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["qkv", "proj", "mlp.0", "mlp.2"])
    return get_peft_model(base, lora)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()
