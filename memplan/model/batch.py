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


def named_tensors(batch: Any, where: str = "batch") -> list[tuple[str, Any]]:
    """Each tensor of ``batch`` with where it sits (``batch['temp']``, ``batch[1]``), in
    ``map_batch``'s order."""
    if isinstance(batch, _tensor_type()):
        return [(where, batch)]
    if isinstance(batch, tuple | list):
        return [p for i, item in enumerate(batch) for p in named_tensors(item, f"{where}[{i}]")]
    if isinstance(batch, dict):
        return [p for k, v in batch.items() for p in named_tensors(v, f"{where}[{k!r}]")]
    return []


def sample_rows(full: Any, other: Any, count: int, other_count: int) -> list[bool]:
    """Per tensor of ``full``, a batch of ``count`` samples (``map_batch``'s order): whether
    it holds the samples along its first dimension, as ``count`` there and ``other_count``
    in ``other`` (the same function's batch of ``other_count`` samples). A tensor of the
    same shape in both (a 0-dim temperature, a mask every sample shares) holds none and is
    passed whole (False). Raises ValueError naming a tensor that changes with the batch
    size in another way, or a batch in which none holds the samples first."""
    mine, theirs = named_tensors(full), named_tensors(other)
    if len(mine) != len(theirs):
        raise ValueError(
            f"the batches of {count} and {other_count} samples hold {len(mine)} and "
            f"{len(theirs)} tensors"
        )
    rows = []
    for (where, t), (_, u) in zip(mine, theirs, strict=True):
        first = t.dim() > 0 and u.dim() > 0 and (t.shape[0], u.shape[0]) == (count, other_count)
        if not first and tuple(t.shape) != tuple(u.shape):
            raise ValueError(
                f"{where} has shape {tuple(t.shape)} in the batch of {count} samples and "
                f"{tuple(u.shape)} in the batch of {other_count}, so its first dimension "
                "is not the samples"
            )
        rows.append(first)
    if not any(rows):
        raise ValueError(
            f"no tensor holds the samples along its first dimension (the batches of {count} "
            f"and {other_count} samples have the same shapes)"
        )
    return rows


def cut_batch(batch: Any, rows: list[bool] | None, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``batch``: each tensor that ``rows`` (``sample_rows``)
    marks sliced along its first dimension, the others whole; ``rows`` None: the batch is
    one micro-batch, whole."""
    if rows is None:
        return batch
    marks = iter(rows)
    return map_batch(batch, lambda t: t[start:stop] if next(marks) else t)
