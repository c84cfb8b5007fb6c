"""Llama 3 8B as torchtitan ran it in May 2024, with its RMSNorm either eager (torchtitan's
``RMSNorm``: examples/llama70b.py ``TitanRMSNorm``) or fused (``build_fused``): bench
section ``fused_norm``.

The fused norm is torchtitan's ``TritonFusedRMSNorm`` (torchtitan/models/norms.py, added by
pytorch/torchtitan#181, made to work under tensor parallelism by #364): one Triton kernel
forward that reads ``x`` and the weight and writes ``y`` (and one fp32 ``rstd`` a row), one
backward that reads ``x``, ``dy`` and the weight and writes ``dx`` (``dw`` as per-SM
partial sums, then one small reduction). A meta probe cannot run Triton, so ``FusedNorm``
stands in for it with ops that move the same bytes: forward ``x * weight`` (reads ``x``,
writes ``y``), backward ``dy * x`` (reads both, writes ``dx``); ``rstd`` and ``dw`` are
under a hundred-thousandth of them and left out. Its arithmetic is not RMSNorm's: it is
only ever probed for time and bytes, never trained.
"""

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_NAME = "memplan_example_llama31"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, _EXAMPLES / "llama31.py")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
_llama31 = sys.modules[_NAME]
_base = sys.modules["memplan_example_llama70b"]

TP_PLAN = dict(_llama31.TP_PLAN)
make_batch = _llama31.make_batch


class _FusedBytes(torch.autograd.Function):
    """The bytes of torchtitan's Triton RMSNorm kernels (module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return dy * x, torch.zeros_like(weight)


class FusedNorm(_base.TitanRMSNorm):
    """A norm whose forward and backward move what one fused kernel each way moves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedBytes.apply(x, self.weight)


def build_eager() -> nn.Module:
    """Llama 3 8B with torchtitan's own ops and its eager RMSNorm."""
    return _llama31.build_8b_torchtitan_ops()


def build_fused() -> nn.Module:
    """The same model with every RMSNorm fused (``FusedNorm``)."""
    model = build_eager()
    shape = model.s
    for layer in model.layers:
        layer.input_layernorm = FusedNorm(shape.hidden, shape.norm_eps)
        layer.post_attention_layernorm = FusedNorm(shape.hidden, shape.norm_eps)
    model.norm = FusedNorm(shape.hidden, shape.norm_eps)
    return model


build_model = build_eager
