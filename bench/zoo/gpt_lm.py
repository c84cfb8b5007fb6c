"""GPT-style language model whose logits (vocab 4096) outweigh every block: the fixed
parts at the end of the forward hold the step's peak. The model of examples/gpt.py at
other sizes."""

import torch
from _data import tokens
from _examples import example
from torch import nn

VOCAB = 4096
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 4
SEQ_LEN = 32


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return example("gpt").GPT(vocab=VOCAB, d=D_MODEL, heads=N_HEADS, layers=N_LAYERS, seq=SEQ_LEN)


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(batch_size, SEQ_LEN, VOCAB)
