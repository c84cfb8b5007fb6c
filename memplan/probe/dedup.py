"""Identical blocks are measured once on meta: a cache of meta-kernel results.

A meta probe spends nearly all its time in PyTorch's meta kernels, most of them Python
reference implementations (``torch._refs``, ``torch._prims``) that work out an output's shape,
strides and dtype. A block that repeats another — same class, same parameter shapes and
dtypes, same input shapes: a Llama has 80 — runs exactly the same ops on exactly the same
metadata, so only the first such block (its *representative*) needs them computed; the
others reuse the representative's results.

``MetaOpCache`` keys an aten call by the operator, the metadata of every tensor argument
(dtype, shape, strides, storage offset) and the value of every other argument, and keeps
what the meta kernel returned (fresh tensors: shapes, strides, dtypes, storage bytes) with
its FLOPs and bytes moved. On a hit it makes new meta tensors of that metadata instead of
running the kernel. Only calls whose result is provably a function of that key are cached:
functional operators (no mutable argument, no result that aliases an input) on plain meta
tensors, whose results are fresh, unshared storages of exactly the size their strides need.
Views and in-place ops always run. The tracker still sees every op and every storage, so a
deduplicated probe is the same profile, byte for byte, as a full one (tests/test_dedup.py);
it just does not recompute what it already knows.

``layers_reusing`` says, per candidate layer, whether its forward ran no meta kernel of its
own (every op was a cache hit): those layers reused their representative's measurement, and
the profile lists them (``Profile.deduplicated_layers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
_SCALARS += (torch.memory_format,)


class _Uncacheable(Exception):
    pass


def _meta_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or not value.is_meta:
            raise _Uncacheable
        if value.layout != torch.strided:
            raise _Uncacheable
        return (value.dtype, tuple(value.shape), value.stride(), value.storage_offset())
    if isinstance(value, list | tuple):
        return (type(value), tuple(_meta_key(item) for item in value))
    if isinstance(value, _SCALARS):
        return (type(value), value)  # type too: True and 1 hash alike
    raise _Uncacheable


@dataclass(frozen=True, slots=True)
class _Fresh:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")


@dataclass(frozen=True, slots=True)
class Entry:
    """A cached result: how to rebuild it, and what the tracker derived from it."""

    template: Any
    """A ``_Fresh`` or a tuple/list of ``_Fresh`` and ``None``."""
    flops: float
    moved_bytes: int

    def build(self) -> Any:
        t = self.template
        if isinstance(t, _Fresh):
            return t.make()
        return type(t)(None if item is None else item.make() for item in t)


def _is_functional(func: Any) -> bool:
    schema = func._schema
    if schema.is_mutable:
        return False
    return all(ret.alias_info is None for ret in schema.returns)


def _fresh(tensor: Any, input_storages: set[int], seen: set[int]) -> _Fresh:
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_meta
        or tensor.layout != torch.strided  # sparse: no storage of its own to stand in for
        or tensor.storage_offset()
    ):
        raise _Uncacheable
    storage = tensor.untyped_storage()
    if id(storage) in input_storages or id(storage) in seen:
        raise _Uncacheable
    seen.add(id(storage))
    fresh = _Fresh(tuple(tensor.shape), tensor.stride(), tensor.dtype)
    if fresh.make().untyped_storage().nbytes() != storage.nbytes():
        raise _Uncacheable  # the kernel allocated more than the strides need
    return fresh


class MetaOpCache:
    """Meta-kernel results by operator and argument metadata (see the module doc)."""

    def __init__(self) -> None:
        self._entries: dict[Any, Entry | None] = {}
        self._functional: dict[Any, bool] = {}
        self.hits = 0
        self.misses = 0

    def key(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The call's key, or None when it is not cacheable."""
        functional = self._functional.get(func)
        if functional is None:
            functional = self._functional[func] = _is_functional(func)
        if not functional:
            return None
        try:
            return (
                func,
                tuple(_meta_key(a) for a in args),
                tuple((k, _meta_key(v)) for k, v in kwargs.items()) if kwargs else (),
            )
        except _Uncacheable:
            return None

    def lookup(self, key: Any) -> Entry | None:
        if key is None:  # views, in-place ops: always run, not a miss
            return None
        if key not in self._entries:
            self.misses += 1
            return None
        entry = self._entries[key]
        if entry is not None:  # None: seen before, and its result is not reusable
            self.hits += 1
        return entry

    def store(
        self, key: Any, args: tuple, kwargs: dict, out: Any, flops: float, moved: int
    ) -> None:
        if key is None or key in self._entries:
            return
        inputs = {
            id(t.untyped_storage())
            for t in (*args, *kwargs.values())
            if isinstance(t, torch.Tensor)
        }
        for item in (*args, *kwargs.values()):
            if isinstance(item, list | tuple):
                inputs.update(id(t.untyped_storage()) for t in item if isinstance(t, torch.Tensor))
        seen: set[int] = set()
        try:
            if isinstance(out, torch.Tensor):
                template: Any = _fresh(out, inputs, seen)
            elif isinstance(out, list | tuple) and all(
                o is None or isinstance(o, torch.Tensor) for o in out
            ):
                template = type(out)(None if o is None else _fresh(o, inputs, seen) for o in out)
            else:
                raise _Uncacheable
        except _Uncacheable:
            self._entries[key] = None  # known uncacheable: never looked at again
            return
        self._entries[key] = Entry(template=template, flops=flops, moved_bytes=moved)


# --------------------------------------------------------------------------- reporting
class ForwardMisses:
    """Counts, per candidate layer, the cache misses during its forward (forward hooks that
    read a counter: they allocate nothing)."""

    def __init__(
        self, cache: MetaOpCache, layers: Sequence[torch.nn.Module], names: Sequence[str]
    ) -> None:
        self.cache = cache
        self.names = list(names)
        self.misses = [0] * len(layers)
        self.ran = [False] * len(layers)
        self._start = [0] * len(layers)
        self._handles = []
        for j, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(j)))
            self._handles.append(layer.register_forward_hook(self._post(j)))

    def _pre(self, j: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            self._start[j] = self.cache.misses

        return hook

    def _post(self, j: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            self.misses[j] += self.cache.misses - self._start[j]
            self.ran[j] = True

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def reusing(self, order: Sequence[str]) -> tuple[str, ...]:
        """Layers (in ``order``) whose forward ran and computed no meta kernel of its own."""
        done = {
            name
            for name, misses, ran in zip(self.names, self.misses, self.ran, strict=True)
            if ran and misses == 0
        }
        return tuple(name for name in order if name in done)
