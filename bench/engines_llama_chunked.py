"""bench/engines_llama_vocab.py's Llama 3 (torchtitan 0.3.0's own, vocabulary 32768) with the
loss every Llama config of torchtitan 0.3.0 trains with: ``ChunkedLossWrapper``, the head
and the cross-entropy run in 8 chunks of the sequence (torchtitan/components/loss.py,
models/llama3/config_registry.py). The model file computes it with
``memplan.run.losses.chunked_cross_entropy`` (the same chunks, buffers and order), so memplan
plans what torchtitan runs; ``bench.engines`` checks that against torchtitan's own wrapper.
Everything else is the vocabulary file's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "memplan_bench_engines_llama_vocab", Path(__file__).with_name("engines_llama_vocab.py")
)
assert _spec is not None and _spec.loader is not None
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

CHUNKS = 8
"""``ChunkedLossWrapper.Config.num_chunks``'s default, which torchtitan 0.3.0's configs keep."""
VOCAB = _base.VOCAB
DIM = _base.DIM
SEQ_LEN = _base.SEQ_LEN
TP_PLAN = _base.TP_PLAN
make_optimizer = _base.make_optimizer
model_config = _base.model_config
make_batch = _base.make_batch


def build_model() -> torch.nn.Module:
    model = _base.build_model()
    model._skip_lm_head = True  # the decoder returns the final norm's output (Trainer)
    return model


def training_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    from memplan.run.losses import chunked_cross_entropy

    tokens, labels = batch
    head = getattr(model, "module", model).lm_head  # a DDP wrapper holds the model
    return chunked_cross_entropy(model(tokens), head, labels, chunks=CHUNKS)
