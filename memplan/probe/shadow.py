"""Real values behind small meta tensors, so data-dependent reads work on ``meta``.

A meta tensor has a shape and no values, so ``.item()``, ``bool(t)``, ``nonzero()`` fail
on it. Models read values of small integer tensors all the time: Hugging Face's
``masking_utils`` asks whether an attention mask is all ones (``_ignore_causal_mask_sdpa``)
and whether position ids are packed (``find_packed_sequence_indices``), both ending in
``.all()`` and a Python ``bool``. Those values come from the batch (ids, masks, labels) and
from factories (``arange``, a decoder's ``torch.ones`` mask), never from weights.

So the meta backend keeps a CPU *shadow* (twin) of every tensor of the batch, and of small
results of factory ops. An op whose tensor arguments all have shadows
runs on the shadows for real (CPU, tiny), and its meta result is made from the real one
(same shape, dtype) and shadowed in turn; a value read is then answered from the shadow.
An op that touches one meta tensor without a shadow (anything computed from weights: a
router's top-k, a float comparison) runs on meta as before, and a value read of it is
still the probe's "cannot measure" (exit 3).

A twin can never diverge from its meta tensor: both have the same shape, strides, storage
offset and dtype, and twins share storages exactly where their meta tensors do. The batch
is mirrored onto meta storage by storage (``mirror_batch``: ``t[:, :-1]`` and ``t[:, 1:]``
stay two views of one storage, as on cpu, instead of two contiguous copies), and a result
whose CPU layout differs from the meta kernel's is re-laid out to the meta one
(``_matching``), so a view that runs on meta runs on the twin. An op that fails on the
twins runs on meta alone (its results have no twin), so a twin never fails a model that
meta runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from memplan.errors import CannotMeasureError, MemplanError, internal_failure
from memplan.probe.call_site import call_site

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


def forget(meta: torch.Tensor) -> None:
    """Drop ``meta``'s twin, if it has one (a weight or buffer after a build with twins)."""
    _shadows.pop(meta)


def _geometry(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _meta_like(cpu: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """A meta tensor laid out as ``cpu`` (shape, strides, offset, storage bytes), a view of
    the uint8 meta storage ``base`` when given (else a new one of ``cpu``'s storage size)."""
    nbytes = cpu.untyped_storage().nbytes()
    if nbytes % cpu.element_size():
        return cpu.to(_META)
    if base is None:
        base = torch.empty(nbytes, dtype=torch.uint8, device=_META)
    typed = base if cpu.dtype == torch.uint8 else base.view(cpu.dtype)
    meta = typed.as_strided(cpu.shape, cpu.stride(), cpu.storage_offset())
    if cpu.requires_grad:
        meta.requires_grad_(True)
    return meta


def mirror_batch(cpu_batch: Any) -> Any:
    """The batch on meta, storage by storage as on cpu, every tensor with its CPU original
    as twin. Tensors sharing a CPU storage share one meta storage of the same bytes, at the
    same strides and offsets: the meta probe counts what the cpu probe counts, and a view
    of the twin runs wherever the meta view does."""
    from memplan.model.batch import map_batch

    bases: dict[tuple[int, int], torch.Tensor] = {}

    def mirror(cpu: torch.Tensor) -> torch.Tensor:
        if cpu.is_meta or cpu.layout != torch.strided:
            return cpu.to(_META)
        storage = cpu.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] == 0:  # an empty storage: nothing to share
            key = (id(cpu), 0)
        if key not in bases:
            bases[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, device=_META)
        meta = _meta_like(cpu, bases[key])
        _shadows[meta] = cpu
        return meta

    return map_batch(cpu_batch, mirror)


def _matching(meta: torch.Tensor, cpu: torch.Tensor, twins_in: list[torch.Tensor]) -> torch.Tensor:
    """``cpu`` (an op's CPU result) laid out as ``meta`` (its meta result): itself when the
    layouts agree; else, for a view of an input, the same view of that input's twin;
    else a copy at the meta layout."""
    if _geometry(meta) == _geometry(cpu):
        return cpu
    storage = meta.untyped_storage()
    for twin in twins_in:
        if twin.untyped_storage().data_ptr() == cpu.untyped_storage().data_ptr():
            typed = twin if twin.dtype == meta.dtype else twin.view(meta.dtype)
            return typed.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    base = torch.empty(storage.nbytes(), dtype=torch.uint8)
    typed = base if meta.dtype == torch.uint8 else base.view(meta.dtype)
    fixed = typed.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    return fixed.copy_(cpu)


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
        meta = _meta_like(value) if value.layout == torch.strided else value.to(_META)
        _shadows[meta] = value
        return meta
    return value


def tensors_in(value: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (lists, tuples, dicts): a cheaper walk
    than pytree's for the per-op hot path."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, list | tuple):
        for item in value:
            tensors_in(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            tensors_in(item, out)
    return out


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}
"""Per op overload, the (position, name) of each argument its schema says it writes."""


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes to (in-place and ``out=`` ops)."""
    writes = _WRITES.get(func)
    if writes is None:
        writes = _WRITES[func] = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
    out: list[torch.Tensor] = []
    for i, name in writes:
        tensors_in(kwargs.get(name, args[i] if i < len(args) else None), out)
    return out


def run(func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` when ``func`` ran on shadows (the result is meta tensors with
    shadows, or a Python value); ``(False, None)`` when it must run on meta as usual."""
    metas = [t for t in tensors_in((args, kwargs), []) if t.is_meta]
    if not metas:
        return False, None
    host = _to_host(func, args, kwargs)
    if host is not None:
        return True, host
    written = _written(func, args, kwargs)
    if not all(t in _shadows for t in metas):
        for t in written:  # written from something without values: its shadow is stale
            _shadows.pop(t)
        if func is _INDEX and not kwargs:
            indexed = _index_by_twinned_masks(func, args)
            if indexed is not None:
                return True, indexed
        return False, None
    try:
        real = func(*tree_map(_to_cpu, args), **tree_map(_to_cpu, kwargs))
    except Exception:  # the twins cannot run it: meta alone does, its results without twins
        for t in written:
            _shadows.pop(t)
        return False, None
    if written:  # the shadows were written too; meta runs the op itself
        return False, None
    if not _small(real):
        return False, None
    try:  # the meta kernel's own result keeps its strides (views depend on them)
        out = func(*args, **kwargs)
    except (NotImplementedError, RuntimeError):  # a value read, a data-dependent shape
        return True, tree_map(_to_meta, real)
    twins_in = [_shadows[t] for t in metas]
    out_leaves, _ = tree_flatten(out)
    real_leaves, _ = tree_flatten(real)
    for meta, cpu in zip(out_leaves, real_leaves, strict=False):
        if isinstance(meta, torch.Tensor) and meta.is_meta and isinstance(cpu, torch.Tensor):
            if meta.layout == torch.strided and cpu.layout == torch.strided:
                cpu = _matching(meta, cpu, twins_in)
            _shadows[meta] = cpu
    return True, out


_TO_COPY = torch.ops.aten._to_copy.default


def _to_host(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``t.cpu()`` (``t.to("cpu")``) of a meta tensor with a twin: a CPU tensor, as the
    model asked, not a meta one. ``pack_padded_sequence`` takes its lengths only on the CPU
    (``lengths.cpu()``, which every model that packs on a GPU calls). A plain move is the
    twin itself: on a CPU device ``.cpu()`` is the tensor it is called on, and a write to
    it writes the batch's values, as there. A move that also converts (a dtype, a layout)
    is a copy of the twin, as on the CPU. None when it is not that case."""
    if func is not _TO_COPY or len(args) != 1:
        return None
    device = kwargs.get("device")
    meta = args[0]
    if device is None or torch.device(device).type != "cpu" or meta not in _shadows:
        return None
    twin = _shadows[meta]
    plain = (
        kwargs.get("dtype") in (None, twin.dtype)
        and kwargs.get("layout") in (None, twin.layout)
        and kwargs.get("memory_format") in (None, torch.preserve_format)
        and not meta.requires_grad
    )
    if not plain:
        return func(twin, **kwargs)
    _handed_out.add(twin.untyped_storage())
    return twin


_handed_out: weakref.WeakSet = weakref.WeakSet()
"""Storages of the twins ``_to_host`` gave the model: on the CPU they are the batch's own
tensors, counted once as their meta tensors, whatever the model does with them."""


def counted(outputs: list[torch.Tensor], host_is_device: bool) -> list[torch.Tensor]:
    """Of a meta probe's op outputs, those in the planned device's memory. Meta tensors
    are; CPU tensors (``lengths.cpu()``, the ``batch_sizes`` that packing a sequence makes
    there) are host memory on a GPU target and device memory on a CPU one
    (``host_is_device``), except a twin ``_to_host`` handed out (and what the model writes
    in place into it, or views of it), which on the CPU is the batch's tensor, already
    counted."""
    if not any(t.device.type == "cpu" for t in outputs):
        return outputs
    return [
        t
        for t in outputs
        if t.is_meta or (host_is_device and t.untyped_storage() not in _handed_out)
    ]


_INDEX = torch.ops.aten.index.Tensor
_MASK_DTYPES = (torch.bool, torch.uint8)


def _index_by_twinned_masks(func: Any, args: tuple) -> torch.Tensor | None:
    """``aten.index.Tensor`` of a tensor without a twin (computed from weights: a gradient
    in the backward) by boolean masks that have one (from the batch: T5Gemma2's
    ``embeds[input_ids == eoi_token_index] = ...``, whose backward reads the gradient at the
    mask). Meta's kernel turns each mask into its ``nonzero()`` positions, which meta
    cannot know; the twin does, so each mask is replaced by those positions (one long
    index per mask dimension, as torch's own meta kernel expands a mask) and the meta
    kernel runs on them. None when a mask has no twin or is too large to read."""
    data, indices = args[0], list(args[1])
    if not any(i is not None and i.dtype in _MASK_DTYPES for i in indices):
        return None
    expanded: list[torch.Tensor | None] = []
    for index in indices:
        if index is None or index.dtype not in _MASK_DTYPES:
            expanded.append(index)
            continue
        if not (index.is_meta and index in _shadows and _small(_shadows[index])):
            return None
        expanded.extend(_to_meta(column) for column in _shadows[index].nonzero().unbind(1))
    return func(data, expanded)


def shadow_factory(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """After a factory op (no meta tensor arguments) made a small meta tensor (``arange``,
    ``ones``, ``full``, a CPU tensor copied over with ``.to(device)``), make its CPU twin. Floating ones too: a decoder's
    ``torch.ones(batch, seq, device=...)`` mask is float (BART's), and masking_utils reads
    whether it is all ones."""
    if not (
        isinstance(out, torch.Tensor)
        and out.is_meta
        and not out.is_complex()
        and out.numel() <= MAX_SHADOW_ELEMENTS
    ):
        return
    if "device" not in kwargs:
        return  # made on meta only by a default device we cannot redirect
    if any(t.is_meta for t in tensors_in((args, kwargs), [])):
        return  # made from meta tensors: shadowed by run() when they all had twins
    _shadows[out] = _matching(out, func(*args, **{**kwargs, "device": _CPU}), [])


def _python_index(index: Any) -> bool:
    """Whether ``index`` is a (nested) list of Python ints or bools: an advanced index that
    PyTorch turns into a tensor below the dispatcher, on the indexed tensor's device."""
    if not isinstance(index, list) or not index:
        return False
    return all(
        _python_index(i) if isinstance(i, list) else isinstance(i, (bool, int)) for i in index
    )


def _twinned_indices(index: Any) -> Any:
    """``index`` with each list of Python ints or bools as a meta tensor with its twin."""
    if _python_index(index):
        with _disable_current_modes():  # the twin is no part of the probed step
            cpu = torch.tensor(index)
        return _to_meta(cpu)  # tracked: on cpu the tracker sees this tensor (lift_fresh)
    if isinstance(index, tuple):
        return tuple(_twinned_indices(i) for i in index)
    return index


def _from_data(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``torch.tensor``/``torch.as_tensor`` of Python data (or a CPU tensor) onto meta: the
    meta tensor with the CPU one as its twin; None when it is not that case."""
    if not args or kwargs.get("requires_grad") or kwargs.get("out") is not None:
        return None
    device = kwargs.get("device")
    device = torch.get_default_device() if device is None else torch.device(device)
    leaves, _ = tree_flatten(args[0])
    if device.type != "meta" or any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
        return None
    with _disable_current_modes():  # the twin is no part of the probed step
        cpu = func(args[0], **{**kwargs, "device": _CPU})
    if cpu.numel() > MAX_SHADOW_ELEMENTS or cpu.layout != torch.strided or cpu.is_complex():
        return None
    if isinstance(args[0], torch.Tensor) and cpu.untyped_storage().data_ptr() == (
        args[0].untyped_storage().data_ptr()
    ):
        cpu = cpu.clone()  # as_tensor of a CPU tensor is that tensor: the twin is a copy
    return _to_meta(cpu)  # tracked: on cpu the tracker sees this tensor (lift_fresh)


class PythonData(TorchFunctionMode):
    """Twins for meta tensors PyTorch makes from Python data without a dispatched factory
    op: ``torch.tensor(values, device=...)`` and list indices (``ids[:, [-1, 0]]``, which
    transformers' padding check reads with ``in``). Without it, such a tensor is meta
    without values, and a value read of anything computed from it fails."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        try:  # memplan's own twins: a failure here is memplan's (InternalError)
            if func is torch.tensor or func is torch.as_tensor:
                made = _from_data(func, args, kwargs)
                if made is not None:
                    return made
            elif func in _READS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                return _read(func, args, kwargs)
            elif (
                func in _INDEXING
                and len(args) >= 2
                and isinstance(args[0], torch.Tensor)
                and args[0].is_meta
            ):
                args = (args[0], _twinned_indices(args[1]), *args[2:])
        except MemplanError:
            raise
        except Exception as exc:
            raise internal_failure("CPU twins (probe/shadow.py)", func, exc) from exc
        return func(*args, **kwargs)


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
_READS = (torch.Tensor.tolist, torch.Tensor.numpy)
"""Value reads that are no dispatched op: they read a tensor's storage in C++, where a meta
tensor has none (``.item()`` and ``bool()`` dispatch ``_local_scalar_dense``; run answers
those)."""


def _read(func: Any, args: tuple, kwargs: dict) -> Any:
    """``t.tolist()`` (or ``t.numpy()``) of a meta tensor: its twin's values, or the probe's
    "cannot measure" (exit 3) where it has none, naming the read and where the model made
    it. Not the model's error: cpu would have read it."""
    meta = args[0]
    if meta in _shadows:
        return func(_shadows[meta], *args[1:], **kwargs)
    raise CannotMeasureError(
        f"The meta probe cannot read the values of a tensor (Tensor.{func.__name__}"
        f"{call_site()}): they are computed from weights or activations, which meta does "
        "not have.",
        hint="Probe with --device cpu (or cuda) instead.",
    )
