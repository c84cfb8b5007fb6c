"""Hugging Face Wav2Vec2ForCTC from a tiny config with SpecAugment on (LayerDrop 0): its
masks are drawn from numpy's global generator in the wrapper, outside every checkpointed
layer (issue 37: verify blamed encoder.layers.0)."""

import sys
import types

import torch

# PyPI's torchvision registers meta kernels the CPU torch lacks; transformers imports it
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("_meta_registrations"))

from transformers import Wav2Vec2Config, Wav2Vec2ForCTC  # noqa: E402

SAMPLES = 400
CONFIG = Wav2Vec2Config(
    vocab_size=12,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    conv_dim=(8, 8),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=8,
    num_conv_pos_embedding_groups=2,
    layerdrop=0.0,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    feat_proj_dropout=0.0,
    final_dropout=0.0,
    apply_spec_augment=True,
    mask_time_prob=0.5,
    mask_time_length=2,
    mask_feature_prob=0.3,
    mask_feature_length=2,
    ctc_loss_reduction="mean",
    pad_token_id=0,
)


def build_model() -> torch.nn.Module:
    return Wav2Vec2ForCTC(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    return {
        "input_values": torch.randn(batch_size, SAMPLES, generator=g),
        "labels": torch.randint(1, 12, (batch_size, 4), generator=g),
    }


def training_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss
