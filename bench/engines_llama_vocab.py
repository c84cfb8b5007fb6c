"""bench/engines_llama.py's Llama 3 (torchtitan 0.3.0's own) with a vocabulary of 32768, 16
times the debugmodel flavour's 2048, so that the head's logits and torchtitan's loss make
each rank's peak: what ``bench.engines`` uses to check memplan's loss-parallel region
(memplan.memory.vocab) against torchtitan's own ``parallelize_llama`` and loss. Everything
else is the base file's; only the vocabulary is changed (the embedding's rows, the head's
columns, ``vocab_size``)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "memplan_bench_engines_llama", Path(__file__).with_name("engines_llama.py")
)
assert _spec is not None and _spec.loader is not None
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

VOCAB = 32768
DIM = _base.DIM
SEQ_LEN = _base.SEQ_LEN
TP_PLAN = _base.TP_PLAN
make_optimizer = _base.make_optimizer
training_loss = _base.training_loss


def model_config(layers: int = _base.LAYERS):
    """The base file's ``Llama3Model.Config`` with ``VOCAB`` tokens."""
    config = _base.model_config(layers)
    config.tok_embeddings = dataclasses.replace(config.tok_embeddings, num_embeddings=VOCAB)
    config.lm_head = dataclasses.replace(config.lm_head, out_features=VOCAB)
    config.vocab_size = VOCAB
    return config


def build_model() -> torch.nn.Module:
    model = model_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    assert model.lm_head.out_features == VOCAB
    return model


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
