"""The meta clock's rates: what one op takes on a device spec (``Roofline``), its FLOPs
counted by torch's formulas and memplan's own (``ROOFLINE_FLOP_FORMULAS``), and where the
clock's mix files it (``ClockKey``, memplan.profile.ClockShare)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from memplan.probe.float8 import FLOAT8_DTYPES
from memplan.probe.meta_kernels import FLOP_FORMULAS

_EMPTY: dict[str, Any] = {}


def _flop_formulas() -> dict[Any, Any]:
    """torch.utils.flop_counter's formulas, plus ``_grouped_mm``'s and the CPU flash
    attention kernel and its backward, which it lacks: the same FLOPs as the CUDA flash kernel's formulas (both
    compute softmax(QKᵀ)V and its gradients; torch/utils/flop_counter.py sdpa_flop)."""
    aten = torch.ops.aten
    formulas = dict(flop_registry)
    aliases = {
        "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            "_scaled_dot_product_flash_attention_backward"
        ),
    }
    for name, like in aliases.items():
        if hasattr(aten, name) and getattr(aten, like, None) in formulas:
            formulas.setdefault(getattr(aten, name), formulas[getattr(aten, like)])
    for packet, formula in FLOP_FORMULAS.items():  # probe/meta_kernels.py: MoE matmuls
        formulas.setdefault(packet, formula)
    return formulas


ROOFLINE_FLOP_FORMULAS = _flop_formulas()
"""What the roofline counts each op's FLOPs with (memplan.probe.calibrate counts so too)."""


class Roofline:
    """Time of one op on a device spec: max(FLOPs / achievable FLOP/s, bytes / achievable
    bandwidth), where achievable is the datasheet peak times the spec's efficiency for the
    op's kind (memplan.devices.Efficiency): fused attention kernels at ``attention`` (their
    backward kernels, ``*_backward``, at ``attention_backward``, which defaults to it), every
    other op with counted FLOPs (matmuls, convolutions) at ``matmul``, and bytes at
    ``memory``. A causal attention call is charged half its counted FLOPs: torch's formula
    (torch/utils/flop_counter.py ``sdpa_flop_count``) counts the full QKᵀ and PV products,
    while the kernels skip the masked half and their measured TFLOP/s (the FlashAttention
    papers' convention) divide by the halved count."""

    def __init__(
        self,
        *,
        flops_by_dtype: dict[torch.dtype, float],
        default_flops: float,
        memory_bandwidth: float,
        matmul_efficiency: float = 1.0,
        attention_efficiency: float = 1.0,
        memory_efficiency: float = 1.0,
        attention_backward_efficiency: float | None = None,
        float8_matmul_efficiency: float | None = None,
        default_peak: str | None = None,
    ) -> None:
        """``default_peak``: the spec's name for ``default_flops`` (``bf16``, ``fp32``, ...),
        which the clock's mix (``charge``) records for ops of other dtypes."""
        self.flops_by_dtype = flops_by_dtype
        self.default_flops = default_flops
        self.memory_bandwidth = memory_bandwidth * memory_efficiency
        self.matmul_efficiency = matmul_efficiency
        self.attention_efficiency = attention_efficiency
        self.attention_backward_efficiency = (
            attention_efficiency
            if attention_backward_efficiency is None
            else attention_backward_efficiency
        )
        self.float8_matmul_efficiency = (
            matmul_efficiency if float8_matmul_efficiency is None else float8_matmul_efficiency
        )
        self.default_peak = default_peak
        self.memory_key: ClockKey = ("memory", None, self.memory_bandwidth, None)
        """Where the clock's mix files the ops with no FLOPs."""
        self._kinds: dict[Any, tuple[bool, int | None, int | None, bool]] = {}

    def _kind(self, func: Any) -> tuple[bool, int | None, int | None, bool]:
        """(is a fused attention op, position of ``is_causal``, of ``custom_mask_type``, is
        a backward kernel: ``_scaled_dot_product_flash_attention_backward``,
        ``_efficient_attention_backward``, ...) in the op's schema, once per op."""
        kind = self._kinds.get(func)
        if kind is None:
            name = func._overloadpacket.__name__
            attention = "attention" in name
            names = [a.name for a in func._schema.arguments] if attention else []
            kind = (
                attention,
                names.index("is_causal") if "is_causal" in names else None,
                names.index("custom_mask_type") if "custom_mask_type" in names else None,
                attention and name.endswith("_backward"),
            )
            self._kinds[func] = kind
        return kind

    def _causal(self, func: Any, args: tuple, kwargs: dict) -> bool:
        _, causal_at, mask_at, _ = self._kind(func)
        for name, at in (("is_causal", causal_at), ("custom_mask_type", mask_at)):
            if at is None:
                continue
            value = kwargs.get(name, args[at] if at < len(args) else None)
            if value:  # True, or a causal mask type (1: from the top left, 2: bottom right)
                return True
        return False

    def seconds(
        self,
        flops: float,
        bytes_moved: int,
        dtype: torch.dtype | None,
        func: Any = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> float:
        return self.charge(flops, bytes_moved, dtype, func, args, kwargs)[0]

    def charge(
        self,
        flops: float,
        bytes_moved: int,
        dtype: torch.dtype | None,
        func: Any = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> tuple[float, ClockKey, float, float]:
        """The op's seconds (the longer of its FLOPs' and its bytes'), where the clock's mix
        files it (``ClockKey``), and its FLOPs' and bytes' seconds."""
        in_table = dtype is not None and dtype in self.flops_by_dtype
        peak = self.flops_by_dtype[dtype] if in_table else self.default_flops
        kind = self._kind(func) if flops and func is not None else None
        if kind is not None and kind[0]:
            if self._causal(func, args, kwargs or _EMPTY):
                flops = flops / 2
            name = "attention_backward" if kind[3] else "attention"
            efficiency = (
                self.attention_backward_efficiency if kind[3] else self.attention_efficiency
            )
        elif dtype in FLOAT8_DTYPES:
            name, efficiency = "float8_matmul", self.float8_matmul_efficiency
        else:
            name, efficiency = "matmul", self.matmul_efficiency
        compute = max(flops / (peak * efficiency), 0.0)
        memory = max(bytes_moved / self.memory_bandwidth, 0.0)
        if not compute:
            return memory, self.memory_key, 0.0, memory
        peak_name = _PEAK_NAMES.get(dtype) if in_table else self.default_peak
        # ops of one kind whose FLOPs and bytes take about the same ratio share a bin
        ratio = math.floor(_BINS_PER_OCTAVE * math.log2(compute / memory)) if memory else None
        key = (name, peak_name, peak * efficiency, ratio)
        return max(compute, memory), key, compute, memory


ClockKey = tuple[str, str | None, float, int | None]
"""Where the meta clock's mix files an op (memplan.profile.ClockShare): its FLOP kind
(``matmul``, ``float8_matmul``, ``attention``, ``attention_backward``; ``memory`` for an op
with no FLOPs), the spec field of the peak it ran at (``bf16``, ``fp16``, ``fp32``,
``float8``), that kind's achievable FLOP/s, and the bin of its FLOPs' seconds over its
bytes' (``_BINS_PER_OCTAVE`` a factor of 2; None: no bytes)."""

_BINS_PER_OCTAVE = 4
"""Ops within 2^(1/4) of one ratio of FLOPs' to bytes' seconds share a bin: on another spec
a bin's FLOPs and bytes scale by one ratio each, so the longer of the two sums stands for
each op's longer to within that factor near the spec's ridge point, and exactly away from it."""

_PEAK_NAMES: dict[Any, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    **dict.fromkeys(FLOAT8_DTYPES, "float8"),
}
