"""The live-tensor tracker: bytes of tensor storage alive after every op.

A ``TorchDispatchMode`` sees every aten op (forward, autograd's backward, the optimizer)
and the tensors each one returns. Storages are counted once each, by identity, when an op
first returns them; a weak reference to the storage subtracts its bytes when it is freed.
Tensors that exist before tracking starts (parameters, buffers, gradients, optimizer
state, the batch) are registered with :meth:`LiveTracker.track`.

This counts what the program keeps alive, not what an allocator reserves (block rounding,
caching); on CUDA the probe cross-checks it with ``torch.cuda.max_memory_allocated``.

It also counts forward FLOPs per op (``torch.utils.flop_counter``'s formulas) and, on
``meta``, advances a virtual clock by each op's roofline time (FLOPs against the device's
peak, bytes against its bandwidth), so a meta probe has times without running anything.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memplan.errors import CannotMeasureError, MemplanError, first_line, internal_failure
from memplan.probe import shadow
from memplan.probe.call_site import call_site
from memplan.probe.float8 import float8_bits, is_float8
from memplan.probe.meta_kernels import META_KERNELS, REFUSAL_HINTS, refuse_mixed_dtypes
from memplan.probe.roofline import ROOFLINE_FLOP_FORMULAS, ClockKey, Roofline
from memplan.probe.shadow import tensors_in

_EMPTY: dict[str, Any] = {}


_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def _no_kernel(func: Any) -> bool:
    """Whether ``func`` only makes a view of its input (``view``, ``t``, ``transpose``,
    ``detach``, ``slice``, ``expand``; ``_unsafe_view``, which matmul's folding and
    ``reshape`` use, is one though its schema does not say so): no kernel runs and no byte
    moves, so it takes no time on the roofline. Charged as a read and a write, the views
    of a Llama 3.1 8B block's forward cost a fifth of its time on the H100 spec, and
    selective checkpointing's ``detach`` of every kept output made its recompute look as
    dear as the whole forward."""
    return func.is_view or func is _UNSAFE_VIEW


def _tensor_bytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    if type(value) is not torch.Tensor and is_float8(value):  # torchao's float8 subclass
        value = float8_bits(value)  # its bits: one byte an element
    return value.numel() * value.element_size()


def _storage(tensor: torch.Tensor) -> Any:
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, no storage
        return None


class FusedRegion:
    """The memory-bound ops between two anchors (a matmul, an attention kernel, a graph
    boundary) as torch.compile's inductor runs them: fused into kernels that read each
    input from outside the region once and write only what outlives the region, so a
    tensor made and freed inside it moves no byte. An output still alive when the region
    closes (a matmul's input, a tensor saved for backward, a block's output) is written;
    eager autograd saves some intermediates that inductor's partitioner would recompute,
    so the writes err high. Checked against inductor's own byte count of a compiled HF
    Llama block on the CPU (tests/test_compiled_clock.py)."""

    def __init__(self) -> None:
        self.read_bytes = 0
        # id(storage) -> weak reference, of the storages read from outside the region, and
        # -> (weak reference, bytes) of those made in it (a dead entry's id may be reused)
        self._read: dict[int, weakref.ref] = {}
        self._made: dict[int, tuple[weakref.ref, int]] = {}

    def pending(self) -> bool:
        return bool(self.read_bytes or self._made)

    def _seen(self, key: int) -> bool:
        made = self._made.get(key)
        if made is not None and made[0]() is not None:
            return True
        read = self._read.get(key)
        return read is not None and read() is not None

    def add(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        for tensor in inputs:
            storage = _storage(tensor)
            if storage is None or self._seen(id(storage)):
                continue
            self._read[id(storage)] = weakref.ref(storage)
            self.read_bytes += _tensor_bytes(tensor)
        for tensor in outputs:
            storage = _storage(tensor)
            if storage is None:
                continue
            made = self._made.get(id(storage))
            if made is None or made[0]() is None:
                self._made[id(storage)] = (weakref.ref(storage), _tensor_bytes(tensor))

    def close(self) -> int:
        """Bytes the region's kernels move: its reads and the writes of what is alive."""
        written = sum(n for ref, n in self._made.values() if ref() is not None)
        moved = self.read_bytes + written
        self.read_bytes = 0
        self._read.clear()
        self._made.clear()
        return moved


class LiveTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes; records the count after every op when ``record``."""

    settle_s = 0.0
    """Seconds to give up the GIL before taking a new peak, so that frees other threads
    owe (a collective backend's worker dropping a finished call's buffers) land first.
    0: never (one process, no collectives: the probe)."""
    settle_rounds = 10
    """At most this many ``settle_s`` waits before one new peak: another while the count
    still falls, as frees land one by one on a loaded machine."""

    def __init__(
        self,
        *,
        record: bool = True,
        roofline: Roofline | None = None,
        meta: bool = False,
        op_cache: Any = None,
        fused: bool = False,
        host_is_device: bool = True,
    ) -> None:
        super().__init__()
        self.host_is_device = host_is_device
        """Meta only: whether CPU tensors are the planned device's memory (a CPU target)
        or host memory, not counted (a GPU target; memplan.probe.shadow.counted)."""
        self.fused = fused and roofline is not None
        """Time the memory-bound ops as torch.compile's fused kernels move bytes (see
        ``FusedRegion``), not one kernel each (only with ``roofline``)."""
        self._region = FusedRegion()
        self._seconds = 0.0
        self._mix: dict[ClockKey, list[float]] = {}
        """Per ``ClockKey``: the seconds of its ops' FLOPs and of their bytes."""
        self.fused_bytes = 0
        """Bytes the closed fused regions moved (with ``fused``)."""
        self.live_bytes = 0
        self.peak_bytes = 0
        self.record = record
        self.values: list[int] = []
        """Live bytes after each op (when ``record``)."""
        self.ops: list[str] = []
        """The name of each of those ops (aligns sequences that differ between sizes)."""
        self.flops = 0.0
        """Forward+backward FLOPs seen so far (callers difference it around a region)."""
        self.roofline = roofline
        self.meta = meta
        self.op_cache = op_cache
        """A ``memplan.probe.dedup.MetaOpCache`` (meta only): identical calls reuse results."""
        # id(storage) -> (weak reference, bytes). The weak reference's callback removes the
        # entry before the id can be reused.
        self._storages: dict[int, tuple[weakref.ref, int]] = {}

    @property
    def virtual_seconds(self) -> float:
        """Roofline time of the ops seen so far (only with ``roofline``); reading it closes
        the fused region (a compiled graph's boundary: torchtitan compiles each block)."""
        self._close_region()
        return self._seconds

    @virtual_seconds.setter
    def virtual_seconds(self, value: float) -> None:
        """Set the clock: what the open region holds is replaced by ``value`` (a cast timed
        as a whole, memplan.probe.float8, a memory-bound kernel: the change is the memory
        rate's)."""
        assert self.roofline is not None  # only a roofline's clock is set
        self._region = FusedRegion()
        change = value - self._seconds
        self._seconds = value
        self._mix.setdefault(self.roofline.memory_key, [0.0, 0.0])[1] += change

    def _close_region(self) -> None:
        """Charge the open fused region, a memory-bound kernel, to the clock."""
        if self._region.pending():
            assert self.roofline is not None  # only a roofline's clock fuses
            moved = self._region.close()
            self.fused_bytes += moved
            seconds = moved / self.roofline.memory_bandwidth
            self._charge(seconds, self.roofline.memory_key, 0.0, seconds)

    def _charge(self, seconds: float, key: ClockKey, compute: float, memory: float) -> None:
        self._seconds += seconds
        entry = self._mix.setdefault(key, [0.0, 0.0])
        entry[0] += compute
        entry[1] += memory

    def clock_mix(self) -> dict[ClockKey, tuple[float, float]]:
        """The clock so far as ``ClockKey`` bins, each with its ops' FLOPs' and bytes'
        seconds (the memory bin always, the clock's memory rate in its key); empty without
        a roofline."""
        if self.roofline is None:
            return {}
        self._close_region()
        return {self.roofline.memory_key: (0.0, 0.0)} | {
            k: (c, m) for k, (c, m) in self._mix.items()
        }

    # ------------------------------------------------------------------ storage accounting
    def _free(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def _add_tensor(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is None:
            return
        key = id(storage)
        nbytes = storage.nbytes()
        entry = self._storages.get(key)
        if entry is not None:
            if entry[1] != nbytes:  # resized in place (out= ops, resize_)
                self.live_bytes += nbytes - entry[1]
                self._storages[key] = (entry[0], nbytes)
            return
        ref = weakref.ref(storage, lambda _ref, key=key: self._free(key))
        self._storages[key] = (ref, nbytes)
        self.live_bytes += nbytes

    def track(self, tensors: Iterable[Any]) -> None:
        """Count tensors that exist before tracking starts (each storage once)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add_tensor(tensor)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    @property
    def position(self) -> int:
        """Index of the next recorded op (a boundary between ops)."""
        return len(self.values)

    # ------------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or _EMPTY
        if self.meta:  # operands cpu and cuda refuse to mix: the model's error (exit 2)
            refuse_mixed_dtypes(func, args)
        handled, out, key = False, None, None
        cache = self.op_cache
        try:  # memplan's own machinery: a failure here is memplan's (InternalError)
            part = "CPU twins (probe/shadow.py)"
            if self.meta:  # small integer tensors with real values behind them (shadow.py)
                handled, out = shadow.run(func, args, kwargs)
            if cache is not None and not handled:
                part = "meta op cache (probe/dedup.py)"
                key = cache.key(func, args, kwargs)
                entry = cache.lookup(key)
                if entry is not None:
                    out = self._cached(func, entry, args, kwargs)
                    if self.meta:  # a factory's rebuilt result needs its real twin too
                        shadow.shadow_factory(func, args, kwargs, out)
                    return out
        except MemplanError:
            raise
        except Exception as exc:
            raise internal_failure(part, func, exc) from exc
        if not handled:
            try:  # the user's op itself: its errors are the user's (or meta's limits)
                kernel = META_KERNELS.get(func) if self.meta else None
                out = func(*args, **kwargs) if kernel is None else kernel(*args, **kwargs)
            except (NotImplementedError, RuntimeError) as exc:
                if self.meta:
                    first = first_line(exc)
                    model_fix = REFUSAL_HINTS.get(func)
                    why = (
                        "it has no meta kernel or its output shape depends on tensor values"
                        if model_fix is None
                        else "the model's call, which cuda refuses too"
                    )
                    raise CannotMeasureError(
                        f"The meta probe cannot run op {func}{call_site()} ({first[:200]}); {why}.",
                        hint=model_fix or "Probe with --device cpu (or cuda) instead.",
                    ) from exc
                raise
        try:
            if self.meta and not handled:
                part = "CPU twins (probe/shadow.py)"
                shadow.shadow_factory(func, args, kwargs, out)
            part = "live tracker (probe/tracker.py)"
            self._account(func, args, kwargs, out, cache if not handled else None, key)
        except MemplanError:
            raise
        except Exception as exc:
            raise internal_failure(part, func, exc) from exc
        return out

    def _take_peak(self) -> None:
        """The peak, past the count now; with ``settle_s``, once the frees other threads
        owe have landed: waited for while the count falls (``settle_rounds`` at most)."""
        if self.live_bytes <= self.peak_bytes:
            return
        for _ in range(self.settle_rounds if self.settle_s else 0):
            before = self.live_bytes
            time.sleep(self.settle_s)
            if self.live_bytes >= before or self.live_bytes <= self.peak_bytes:
                break
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _account(
        self, func: Any, args: tuple, kwargs: dict, out: Any, cache: Any, key: Any
    ) -> None:
        """An op's bookkeeping: its new storages, the peak, its FLOPs and roofline time,
        and (on meta) its result into the op cache."""
        outputs = tensors_in(out, [])
        counted = outputs
        if self.meta:  # CPU tensors are the planned device's memory on a CPU target only
            counted = shadow.counted(outputs, self.host_is_device)
        for tensor in counted:
            self._add_tensor(tensor)
        self._take_peak()
        packet = func._overloadpacket
        if self.record:
            self.values.append(self.live_bytes)
            self.ops.append(packet.__name__)
        op_flops = 0.0
        counter = ROOFLINE_FLOP_FORMULAS.get(packet)
        if counter is not None:
            try:
                op_flops = float(counter(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not fit this call: count no FLOPs
                op_flops = 0.0
            self.flops += op_flops
        moved, inputs = 0, []
        if self.roofline is not None or cache is not None:
            inputs = tensors_in((args, kwargs), [])
            moved = sum(_tensor_bytes(a) for a in inputs) + sum(_tensor_bytes(t) for t in outputs)
        if self.fused and not op_flops and not _no_kernel(func):
            self._region.add(inputs, outputs)
        elif self.roofline is not None and not _no_kernel(func):
            self._close_region()  # a matmul closes the fused region before it
            self._charge(
                *self.roofline.charge(
                    op_flops, moved, _timed_dtype(op_flops, args, outputs), func, args, kwargs
                )
            )
        if cache is not None:
            cache.store(key, args, kwargs, out, op_flops, moved)

    def _cached(self, func: Any, entry: Any, args: tuple, kwargs: dict) -> Any:
        """The bookkeeping of ``__torch_dispatch__`` for a result rebuilt from the cache."""
        out = entry.build()
        outputs = tensors_in(out, [])
        for tensor in outputs:
            self._add_tensor(tensor)
        self._take_peak()
        if self.record:
            self.values.append(self.live_bytes)
            self.ops.append(func._overloadpacket.__name__)
        self.flops += entry.flops
        if self.fused and not entry.flops and not _no_kernel(func):
            self._region.add(tensors_in((args, kwargs), []), outputs)
        elif self.roofline is not None and not _no_kernel(func):
            dtype = _timed_dtype(entry.flops, args, outputs)
            self._close_region()  # a matmul closes the fused region before it
            self._charge(
                *self.roofline.charge(entry.flops, entry.moved_bytes, dtype, func, args, kwargs)
            )
        return out


def _timed_dtype(flops: float, args: tuple, outputs: list) -> torch.dtype | None:
    """The dtype whose peak times an op: its output's, but a matmul (an op with FLOPs) on
    float8 operands runs at the float8 peak, whether it ran or was rebuilt from the cache
    (``_cached``; a replayed ``_scaled_mm`` was timed at its bf16 output's peak)."""
    dtype = outputs[0].dtype if outputs else None
    if flops:
        dtype = next((float8_bits(t).dtype for t in tensors_in(args, []) if is_float8(t)), dtype)
    return dtype


def storages_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared storages counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def kept_tensors(roots: Iterable[Any], depth: int = 4) -> list[torch.Tensor]:
    """The tensors held in ``roots`` (objects' attributes, dicts, lists, tuples, sets), up
    to ``depth`` containers deep: where a model keeps a table between steps."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(value: Any, left: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif left > 0 and isinstance(value, dict):
            for item in list(value.values()):
                walk(item, left - 1)
        elif left > 0 and isinstance(value, list | tuple | set | frozenset):
            for item in list(value):
                walk(item, left - 1)

    for root in roots:
        walk(root, depth)
    return found


def state_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside an optimizer state entry (dicts, lists, tensors)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in state_tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in state_tensors(v)]
    return []


def resident_tensors(model: torch.nn.Module, optimizer: Any, batch: Any) -> list[torch.Tensor]:
    """What is alive before a micro-step starts: parameters, buffers, gradients, optimizer
    state, tensors held as plain module attributes (caches), and the batch."""
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
    for p in model.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    tensors.extend(model.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(state_tensors(state))
    tensors.extend(t for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
    return tensors
