"""Meta kernels for ops whose PyTorch meta kernel refuses what the CPU kernel runs, and
FLOP formulas that ``torch.utils.flop_counter`` lacks.

``aten._grouped_mm`` (mixture-of-experts layers: transformers' ``integrations/moe.py``
multiplies each expert's tokens by its weights in one call) has a meta kernel that checks
the CUDA kernel's constraints: bfloat16 inputs only, 16-byte aligned strides
(torch/_meta_registrations.py ``_meta_grouped_mm_common``). The CPU kernel takes float32,
so a float32 Mixtral runs on cpu and stopped the meta probe. Its result is a function of
shapes alone (``grouped_mm_meta``, the output sizes of ``_create_grouped_mm_output_tensor``
there), so the meta probe makes it itself, contiguous as the CPU kernel's.

Its FLOPs (``grouped_mm_flops``): each output element is a dot product over the
contraction dimension K, two FLOPs per term. With a 2-D ``mat_a`` (tokens × K) and a 3-D
``mat_b`` (experts × K × N), every token row meets one expert: 2 · tokens · K · N. With two
2-D operands (a weight gradient: K split into groups by ``offs``) the output is
(groups × M × N) and each group contracts its own slice of K: 2 · M · N · K in all.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def grouped_mm_meta(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten._grouped_mm`` on meta for any floating dtype: its output, contiguous."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        groups = offs.size(0) if offs is not None else 1
        size = (groups, mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        size = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        size = (mat_a.size(1), mat_b.size(1))
    else:
        size = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def grouped_mm_flops(
    mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """FLOPs of one ``aten._grouped_mm`` call (module docstring)."""
    contraction = mat_a.shape[-1]
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # K split among the groups of the output
        return 2 * mat_a.shape[0] * mat_b.shape[1] * contraction
    return 2 * out_val.numel() * contraction


META_KERNELS = {aten._grouped_mm.default: grouped_mm_meta}
"""Meta kernels used instead of PyTorch's (meta probes only)."""

FLOP_FORMULAS = {aten._grouped_mm: grouped_mm_flops}
"""Formulas by overload packet, added to torch.utils.flop_counter's."""
