"""Hugging Face ViTForImageClassification from a tiny config: attention key biases (whose
true gradient is zero: softmax ignores a per-query constant) and dropout in every block."""

import torch
from transformers import ViTConfig, ViTForImageClassification

CONFIG = ViTConfig(
    image_size=16,
    patch_size=4,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    qkv_bias=True,
    num_labels=3,
)


def build_model() -> torch.nn.Module:
    return ViTForImageClassification(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    pixels = torch.randn(batch_size, 3, 16, 16, generator=g)
    labels = torch.randint(0, 3, (batch_size,), generator=g)
    return {"pixel_values": pixels, "labels": labels}
