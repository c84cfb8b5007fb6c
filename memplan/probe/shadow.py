"""Real values behind small meta tensors, so data-dependent reads work on ``meta``.

A meta tensor has a shape and no values, so ``.item()``, ``bool(t)``, ``nonzero()`` fail
on it. Models read values of small integer tensors all the time: Hugging Face's
``masking_utils`` asks whether an attention mask is all ones (``_ignore_causal_mask_sdpa``)
and whether position ids are packed (``find_packed_sequence_indices``), both ending in
``.all()`` and a Python ``bool``. Those values come from the batch (ids, masks, labels) and
from ``arange``, never from weights.

So the meta backend keeps a CPU *shadow* of the batch's integer and boolean tensors, and of
small integer/boolean results of factory ops. An op whose tensor arguments all have shadows
runs on the shadows for real (CPU, tiny), and its meta result is made from the real one
(same shape, dtype) and shadowed in turn; a value read is then answered from the shadow.
An op that touches one meta tensor without a shadow (anything computed from weights: a
router's top-k, a float comparison) runs on meta as before, and a value read of it is
still the probe's "cannot measure" (exit 3).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_SHADOW_ELEMENTS = 1 << 22
"""Largest result (elements) computed for real: masks and ids of a batch are far smaller;
a (batch, 1, seq, seq) attention mask of a long sequence is left to meta."""

_META = torch.device("meta")
_CPU = torch.device("cpu")


class _Shadows:
    """meta tensor -> its CPU twin, by identity (a WeakKeyDictionary would compare tensors
    with ``==``, which is elementwise), dropped when the meta tensor is freed."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def __contains__(self, meta: torch.Tensor) -> bool:
        entry = self._by_id.get(id(meta))
        return entry is not None and entry[0]() is meta

    def __getitem__(self, meta: torch.Tensor) -> torch.Tensor:
        return self._by_id[id(meta)][1]

    def __setitem__(self, meta: torch.Tensor, cpu: torch.Tensor) -> None:
        key = id(meta)
        self._by_id[key] = (weakref.ref(meta, lambda _ref, key=key: self._drop(key, _ref)), cpu)

    def _drop(self, key: int, ref: weakref.ref) -> None:
        entry = self._by_id.get(key)
        if entry is not None and entry[0] is ref:
            del self._by_id[key]

    def pop(self, meta: torch.Tensor) -> None:
        if meta in self:
            del self._by_id[id(meta)]


_shadows = _Shadows()


def shadow_batch(cpu_batch: Any, meta_batch: Any) -> None:
    """Give the integer and boolean tensors of a batch moved to meta their CPU originals."""
    cpu_leaves, _ = tree_flatten(cpu_batch)
    meta_leaves, _ = tree_flatten(meta_batch)
    for cpu, meta in zip(cpu_leaves, meta_leaves, strict=False):
        if isinstance(meta, torch.Tensor) and meta.is_meta and not cpu.is_floating_point():
            _shadows[meta] = cpu


def _small(value: Any) -> bool:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() for t in leaves if isinstance(t, torch.Tensor)) <= MAX_SHADOW_ELEMENTS


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _shadows[value] if value.is_meta else value
    if isinstance(value, torch.device) and value.type == "meta":
        return _CPU
    return value


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        meta = value.to(_META)
        _shadows[meta] = value
        return meta
    return value


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes to (in-place and ``out=`` ops)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name, args[i] if i < len(args) else None)
        out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


def run(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` when ``func`` ran on shadows (the result is meta tensors with
    shadows, or a Python value); ``(False, None)`` when it must run on meta as usual."""
    leaves, _ = tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    metas = [t for t in tensors if t.is_meta]
    if not metas:
        return False, None
    written = _written(func, args, kwargs)
    if all(t in _shadows for t in metas):
        if written:
            func(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))  # the shadows too
            return False, None
        real = func(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))
        if not _small(real):
            return False, None
        try:  # the meta kernel's own result keeps its strides (views depend on them)
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError):  # a value read, a data-dependent shape
            return True, tree_map(_to_meta, real)
        out_leaves, _ = tree_flatten(out)
        real_leaves, _ = tree_flatten(real)
        for meta, cpu in zip(out_leaves, real_leaves, strict=False):
            if isinstance(meta, torch.Tensor) and meta.is_meta and isinstance(cpu, torch.Tensor):
                _shadows[meta] = cpu
        return True, out
    for t in written:  # written from something without values: its shadow is stale
        _shadows.pop(t)
    return False, None


def shadow_factory(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """After a factory op (no tensor arguments) made a small integer/boolean meta tensor
    (``arange``, ``ones``, ``full``), make its CPU twin."""
    if not (
        isinstance(out, torch.Tensor)
        and out.is_meta
        and not out.is_floating_point()
        and not out.is_complex()
        and out.numel() <= MAX_SHADOW_ELEMENTS
    ):
        return
    leaves, _ = tree_flatten((args, kwargs))
    if any(isinstance(t, torch.Tensor) for t in leaves):
        return
    cpu_kwargs = {**kwargs, "device": _CPU} if "device" in kwargs else kwargs
    if "device" not in kwargs:
        return  # made on meta only by a default device we cannot redirect
    _shadows[out] = func(*args, **cpu_kwargs)
