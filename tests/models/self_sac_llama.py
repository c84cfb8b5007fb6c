"""A tiny Llama (examples/llama70b.py's code, hidden 64, 4 blocks, sequence 32) whose blocks
checkpoint themselves with per-op selective checkpointing (``build_self_sac``), as a
torchtitan model wrapped by its ``SelectiveAC`` does, beside the same model left alone
(``build_model``). Both declare torchtitan's Llama TP plan."""

import importlib.util
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from memplan.run.checkpoint import CHECKPOINT_SETTINGS, selective_context_fn

_NAME = "memplan_example_llama70b"
if _NAME not in sys.modules:
    _path = Path(__file__).resolve().parents[2] / "examples" / "llama70b.py"
    _spec = importlib.util.spec_from_file_location(_NAME, _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
_base = sys.modules[_NAME]

SHAPE = _base.Shape(
    layers=4, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256, seq_len=32
)
TP_PLAN = dict(_base.TP_PLAN)


class SelfCheckpointed(_base.DecoderLayer):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        inner = super().forward
        return checkpoint(
            inner, x, cos, sin, **CHECKPOINT_SETTINGS, context_fn=selective_context_fn
        )


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _base.Llama(SHAPE)


def build_self_sac() -> torch.nn.Module:
    model = build_model()
    for block in model.layers:
        block.__class__ = SelfCheckpointed
    return model


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, SHAPE.vocab, (batch_size, SHAPE.seq_len + 1))
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()
