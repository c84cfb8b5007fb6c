"""Seeded batches shared by the zoo's model files: the same batch size always gives the
same data, so data-dependent models (the MoE) measure the same thing in every run."""

import torch


def generator(batch_size: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + batch_size)


def tokens(batch_size: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of ``batch_size`` random sequences."""
    seq = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator(batch_size))
    return seq[:, :-1].clone(), seq[:, 1:].clone()


def images(batch_size: int, channels: int, size: int, classes: int):
    g = generator(batch_size)
    x = torch.randn(batch_size, channels, size, size, generator=g)
    return x, torch.randint(0, classes, (batch_size,), generator=g)
