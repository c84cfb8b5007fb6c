"""Hugging Face Swinv2ForImageClassification from a tiny config with stochastic depth
(``drop_path_rate``: ``floor(keep + torch.rand(...))`` per sample) and a cross-entropy loss;
its attention's ``logit_scale`` parameter is not CLIP's (issue 37: verify named "a
contrastive loss" as the likely cause of a batch coupling)."""

import sys
import types

import torch

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("_meta_registrations"))

from transformers import Swinv2Config, Swinv2ForImageClassification  # noqa: E402

CONFIG = Swinv2Config(
    image_size=16,
    patch_size=2,
    num_channels=3,
    embed_dim=8,
    depths=[1, 1],
    num_heads=[2, 2],
    window_size=4,
    mlp_ratio=2.0,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    drop_path_rate=0.3,
    num_labels=3,
)


def build_model() -> torch.nn.Module:
    return Swinv2ForImageClassification(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    return {
        "pixel_values": torch.randn(batch_size, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 3, (batch_size,), generator=g),
    }


def training_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss
