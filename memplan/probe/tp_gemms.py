"""The GEMMs of the linears a block's TP plan splits, as ``Layer.tp_gemms`` records them
(issue 31): one more forward of the block as probed (memplan.probe.tp_measure), its planned
linears hooked for their shapes.

Under a TP plan a rank runs each split linear on its shard of the weight, but one of the
GEMM's activation operands stays whole on the rank: a colwise linear reads the whole
(sequence-gathered) input, a rowwise one writes the whole output whose partial sums TP
reduces afterwards (Megatron-LM's f/g, Shoeybi et al. 2019, §3; torch's ``ColwiseParallel``
and ``RowwiseParallel``). The input-gradient and weight-gradient GEMMs of backward touch the
same two operands, so all three take ``flops/t`` and move ``whole + split/t`` elements on a
rank of degree t (memplan.solver.tp_gemms charges the difference that makes against 1/t of
the whole GEMM's time).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.modes import RECOMPUTE_EVERY_NTH_MATMUL
from memplan.profile import TpGemm
from memplan.run.checkpoint import counted_matmuls


class _Counter(TorchDispatchMode):
    """Counts the matmuls the ``selective`` mode counts, as its policy does (from the
    block's first)."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = counted_matmuls()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in self.counted:
            self.count += 1
        return func(*args, **(kwargs or {}))


def style_kind(style: str) -> str | None:
    """``colwise`` or ``rowwise`` for a transformers TP style name that splits a linear's
    weight by its output or its input dimension; None for any other style."""
    for kind in ("colwise", "rowwise"):
        if style in (kind, f"local_{kind}") or style.startswith(f"{kind}_"):
            return kind
    return None


def is_float8(module: torch.nn.Module) -> bool:
    """Whether torchao converted ``module`` (its ``Float8Linear``: matmuls on float8
    operands, ``torch._scaled_mm``)."""
    return type(module).__name__.startswith("Float8")


def gemm_shapes(
    block: torch.nn.Module, styles: Mapping[str, str], args: tuple, kwargs: dict, size: int
) -> tuple[TpGemm, ...]:
    """The block's planned linears (``styles``: names within the block → style), as one
    forward at ``size`` samples runs them, in order, per sample. The caller runs it in the
    probe's context (its autocast and meta twins)."""
    modules = dict(block.named_modules())
    counter = _Counter()
    found: list[TpGemm] = []
    starts: dict[str, int] = {}

    def before(name: str, module: torch.nn.Module, _args: tuple) -> None:
        starts[name] = counter.count

    def after(name: str, kind: str, module: torch.nn.Module, inputs: tuple, out: Any) -> None:
        x = inputs[0] if inputs else None
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or x.dim() < 1:
            return
        n, k = module.weight.shape
        rows = x.numel() / max(x.shape[-1], 1) / size
        counted = counter.count > starts.get(name, counter.count)
        float8 = is_float8(module)
        whole, split = (rows * k, rows * n) if kind == "colwise" else (rows * n, rows * k)
        found.append(
            TpGemm(
                style=kind,  # type: ignore[arg-type]
                flops=2.0 * rows * n * k,
                whole=whole,
                split=split,
                input_size=1 if float8 else out.element_size(),
                output_size=out.element_size(),
                float8=float8,
                recomputed=counted and counter.count % RECOMPUTE_EVERY_NTH_MATMUL == 0,
            )
        )

    handles = []
    for name, style in styles.items():
        module, kind = modules.get(name), style_kind(style)
        weight = getattr(module, "weight", None)
        if module is None or kind is None or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() != 2:
            continue
        handles.append(module.register_forward_pre_hook(functools.partial(before, name)))
        handles.append(module.register_forward_hook(functools.partial(after, name, kind)))
    try:
        with torch.no_grad(), counter:
            block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(found)
