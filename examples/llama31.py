"""Llama 3.1 8B, 70B and 405B shapes, as torchtitan trains them in its published H100 runs
(benchmarks/llama3_h100_202412_torchtitan.md): sequence 8192, vocabulary 128256, grouped-
query attention with 8 key/value heads (Meta's released config.json of each size: hidden,
intermediate, layers, heads). The model code is examples/llama70b.py's (RMSNorm, rotary
embeddings, SwiGLU, an untied head, the loss in fp32 logits as torchtitan computes it).

Only ever probed on meta (405B has 4.1e11 parameters); the identical-block shortcut probes
4-6 blocks and extrapolates, so each probe takes about a minute::

    memplan probe examples/llama31.py:build_8b --device meta --precision bf16 \\
        --mixed-precision params --device-profile h100-80gb -o llama31-8b.yaml
    memplan solve llama31-8b.yaml --target-batch 16 --world-size 8 --strategy fsdp \\
        --budget 96GiB --device-profile h100-80gb

``make bench`` (section ``published``) sets each beside torchtitan's published figures.
"""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

_HERE = Path(__file__).resolve().parent
_NAME = "memplan_example_llama70b"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, _HERE / "llama70b.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
_base = sys.modules[_NAME]
Shape, Llama = _base.Shape, _base.Llama

SEQ_LEN, VOCAB = 8192, 128256
LLAMA31_8B = Shape(
    layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=VOCAB, seq_len=SEQ_LEN
)
LLAMA31_70B = Shape(
    layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=VOCAB, seq_len=SEQ_LEN
)
LLAMA31_405B = Shape(
    layers=126,
    hidden=16384,
    intermediate=53248,
    heads=128,
    kv_heads=8,
    vocab=VOCAB,
    seq_len=SEQ_LEN,
)
# torchtitan's Llama TP plan (torchtitan/models/llama3/infra/parallelize.py, apply_tp).
TP_PLAN = dict(_base.TP_PLAN)


def build_8b() -> nn.Module:
    return Llama(LLAMA31_8B)


def build_70b() -> nn.Module:
    return Llama(LLAMA31_70B)


def build_405b() -> nn.Module:
    return Llama(LLAMA31_405B)


def build_8b_compiled_loss() -> nn.Module:
    """8B with its loss as torchtitan compiles it under ``training.compile`` since June 2025
    (torchtitan/components/loss.py at e7c0cae; its December 2024 train.py left the loss
    eager): the bf16 logits and two fp32 values a row saved, the gradient written in bf16,
    no fp32 copy of the logits (memplan.run.losses)."""
    return Llama(LLAMA31_8B, compiled_loss=True)


def build_8b_torchtitan_ops() -> nn.Module:
    """8B with the ops torchtitan's own Llama ran in the December 2024 runs (9dec370:
    rotary embeddings on complex pairs, key/value heads repeated into full copies, its
    RMSNorm; examples/llama70b.py ``TitanDecoderLayer``), where ``build_8b`` has
    transformers' ops: the same shapes and parameters, another mix of memory-bound ops."""
    return Llama(LLAMA31_8B, titan_ops=True)


build_model = build_8b


# The long sequences of the published context-parallel runs (Tables 2 and 6: 32k to 256k
# tokens): the same shapes with rotary tables that long (torchtitan sizes its freqs_cis by
# the training seq_len too), probed with ``--seq-len`` at that length (make_batch below).
def _long(shape: Shape, seq_len: int) -> nn.Module:
    return Llama(dataclasses.replace(shape, seq_len=seq_len))


def build_8b_32k() -> nn.Module:
    return _long(LLAMA31_8B, 32768)


def build_8b_64k() -> nn.Module:
    return _long(LLAMA31_8B, 65536)


def build_8b_128k() -> nn.Module:
    return _long(LLAMA31_8B, 131072)


def build_8b_256k() -> nn.Module:
    return _long(LLAMA31_8B, 262144)


def build_405b_32k() -> nn.Module:
    return _long(LLAMA31_405B, 32768)


def build_405b_64k() -> nn.Module:
    return _long(LLAMA31_405B, 65536)


def build_405b_128k() -> nn.Module:
    return _long(LLAMA31_405B, 131072)


def build_405b_256k() -> nn.Module:
    return _long(LLAMA31_405B, 262144)


def make_batch(batch_size: int, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len + 1))
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()
