"""A batch as make_batch returns it: a tensor, a tuple/list of tensors or a dict of tensors
and plain values, nesting allowed; walking it, mapping its tensors, naming what it cannot
hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _tensor_type() -> type:
    import torch

    return torch.Tensor


PASSED_THROUGH = (bool, int, float, str, type(None))
"""Plain values a batch dict may hold beside its tensors (``return_loss=True``): memplan
passes them to the model unchanged, as keyword arguments."""


def refused_batch_item(batch: Any, where: str = "batch") -> str | None:
    """Where ``batch`` holds something memplan cannot pass on (``batch['ids'][1]``), or None
    when it is a tensor, a tuple/list of tensors or a dict of tensors and plain values
    (``PASSED_THROUGH``), nesting allowed, with at least one tensor."""
    tensor = _tensor_type()
    if isinstance(batch, tensor):
        return None
    if isinstance(batch, tuple | list) and batch:
        for i, item in enumerate(batch):
            found = refused_batch_item(item, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(batch, dict) and batch:
        for key, value in batch.items():
            if isinstance(value, PASSED_THROUGH):
                continue
            found = refused_batch_item(value, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None if batch_tensors(batch) else where
    return where


def is_tensor_batch(batch: Any) -> bool:
    """A tensor, a tuple/list of tensors or a dict of tensors and plain values (nesting
    allowed; ``refused_batch_item``)."""
    return refused_batch_item(batch) is None


def map_batch(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor of a batch, keeping its structure."""
    tensor = _tensor_type()
    if isinstance(batch, tensor):
        return fn(batch)
    if isinstance(batch, tuple | list):
        items = [map_batch(item, fn) for item in batch]
        return type(batch)(items) if isinstance(batch, list) else tuple(items)
    if isinstance(batch, dict):
        return {key: map_batch(value, fn) for key, value in batch.items()}
    return batch


def batch_tensors(batch: Any) -> list[Any]:
    out: list[Any] = []
    map_batch(batch, out.append)
    return out


def move_batch(batch: Any, device: Any) -> Any:
    """The batch on ``device`` (memplan moves batches itself; model files make them on CPU)."""
    return map_batch(batch, lambda t: t.to(device))
