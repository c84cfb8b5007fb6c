"""The GPT-style LM of gpt_lm.py trained with plain SGD with momentum instead of AdamW: one
state tensor per parameter instead of two, and another optimizer-step transient."""

import torch
from gpt_lm import build_model, make_batch

__all__ = ["build_model", "make_batch", "make_optimizer"]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
