"""Hugging Face ``Wav2Vec2ForCTC`` (speech, CTC loss) from a tiny ``Wav2Vec2Config`` that keeps
the defaults that matter in training: LayerDrop 0.1 (each encoder layer skipped at random,
per step) and SpecAugment (``mask_time_prob`` 0.05, masks drawn from numpy's RNG), and the
default convolutional feature extractor (7 convolutions, stride 320 in all). 8,000 samples
of audio make 24 frames."""

import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

SAMPLES = 8000
FRAMES = 24
"""What the feature extractor makes of SAMPLES (kernels 10,3,3,3,3,2,2; strides 5,2,...)."""
CONFIG = Wav2Vec2Config(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    intermediate_size=64,
    conv_dim=(32,) * 7,
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
    vocab_size=32,
)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Wav2Vec2ForCTC(CONFIG)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    audio = torch.randn(batch_size, SAMPLES, generator=g)
    labels = torch.randint(1, CONFIG.vocab_size, (batch_size, 6), generator=g)
    return {"input_values": audio, "labels": labels}
