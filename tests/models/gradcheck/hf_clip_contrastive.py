"""Hugging Face CLIPModel from tiny text and vision configs with ``return_loss=True``: a
contrastive two-tower loss over every image-text pair of the batch."""

import torch
from transformers import CLIPConfig, CLIPModel

SEQ_LEN = 8
CONFIG = CLIPConfig(
    text_config={
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": SEQ_LEN,
    },
    vision_config={
        "image_size": 16,
        "patch_size": 8,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    },
    projection_dim=16,
)


def build_model() -> torch.nn.Module:
    return CLIPModel(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    return {
        "input_ids": torch.randint(0, 64, (batch_size, SEQ_LEN), generator=g),
        "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
    }


def training_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch, return_loss=True).loss
