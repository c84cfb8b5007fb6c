"""GPT-style language model with wide blocks (d_model 512, sequence 32, vocab 256): its
matmuls dominate each block's time, so keeping their outputs and recomputing only the
pointwise ops (selective checkpointing) should cost less than a full recompute, even on a
CPU where selective checkpointing's per-op Python dispatch is expensive. The model of
examples/gpt.py at another size (bench `modes` only)."""

import torch
from _data import tokens
from _examples import example
from torch import nn

VOCAB = 256
D_MODEL = 512
N_HEADS = 8
N_LAYERS = 2
SEQ_LEN = 32


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return example("gpt").GPT(vocab=VOCAB, d=D_MODEL, heads=N_HEADS, layers=N_LAYERS, seq=SEQ_LEN)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(batch_size, SEQ_LEN, VOCAB)
