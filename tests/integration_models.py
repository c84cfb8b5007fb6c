"""Tiny models, data and measuring helpers shared by the integration tests (issue 32)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from memplan.probe.tracker import LiveTracker, resident_tensors

FEATURES = 8
TARGET = 32


class Blocks(nn.Module):
    """An MLP of residual blocks (the probe's checkpoint candidates), in float64."""

    def __init__(self, width: int = 32, hidden: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)


def blocks_model(seed: int = 0) -> Blocks:
    torch.manual_seed(seed)
    return Blocks().double()


def data(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=False).sin()


def sgd(params: Any) -> torch.optim.Optimizer:
    """The optimizer of the weight comparisons: linear in the gradients, so that summing a
    batch in another order moves the weights by rounding only (Adam divides by the root of
    its second moment, which turns the rounding of a near-zero gradient into a whole step)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def state_digest(model: nn.Module, optimizer: Any = None) -> str:
    """A hash of everything planning must leave alone: parameters, buffers, gradients,
    training flags, optimizer state and hyperparameters, and the RNG states."""
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(str((tuple(t.shape), t.dtype, t.device)).encode())
        if t.device.type != "meta":
            h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())

    for name, p in model.named_parameters():
        h.update(name.encode())
        add(p)
        h.update(str(p.requires_grad).encode())
        if p.grad is not None:
            add(p.grad)
    for name, b in model.named_buffers():
        h.update(name.encode())
        add(b)
    h.update(str([m.training for m in model.modules()]).encode())
    if optimizer is not None:
        state = optimizer.state_dict()
        for key, entry in sorted(state["state"].items()):
            h.update(str(key).encode())
            for k, v in sorted(entry.items()):
                h.update(k.encode())
                add(v) if isinstance(v, torch.Tensor) else h.update(repr(v).encode())
        h.update(repr(state["param_groups"]).encode())
    add(torch.get_rng_state())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    return h.hexdigest()


def tracked_peak(run: Callable[[], Any], model: nn.Module, optimizer: Any = None) -> int:
    """Peak live tensor bytes while ``run()`` trains ``model``: memplan's live-tensor
    tracker (the instrument of ``memplan verify``), with what is resident before counted."""
    tracker = LiveTracker(record=False)
    tracker.track(resident_tensors(model, optimizer, None))
    with tracker:
        run()
    return tracker.peak_bytes


def tightest_budget(plan: Any) -> int:
    """The least budget under which ``plan``'s prediction still fits its margin."""
    return math.ceil(plan.predicted.peak_bytes / (1 - plan.margin))


def max_difference(a: nn.Module, b: nn.Module) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    return max(float((pa[n] - pb[n]).detach().abs().max()) for n in pa)


def tiny_llama(transformers: Any) -> nn.Module:
    """The integrations' Hugging Face model: a two-layer Llama from its config (no weights
    downloaded), seeded."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def lightning_fit(L: Any, module: Any, callbacks: list, steps: int, datamodule: Any = None) -> Any:
    """A Lightning fit of ``steps`` steps on the CPU, nothing logged or saved."""
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer
