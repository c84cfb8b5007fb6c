"""Whether a run of look-alike blocks is provably one block repeated: the condition under
which memplan.probe.repeats may measure a few of them and derive the rest.

Blocks of one class with the same parameter shapes (``repeats.signature``) can still
differ in what they run: a block that picks a 16x wider path by an index it holds
privately, a parent that gives every 8th block global attention and the others a window,
blocks that share a weight with some of their neighbours and not others. A measurement of
the first few such blocks says nothing about the others, so the shortcut is taken only when
memplan shows, for the model at hand, that every block of the run is the same:

1. **State** (:func:`shared_state`): every parameter and buffer of a block of the run is
   that block's alone, or held by every block of the run (the same tensor, or a view of
   the same storage); anything else (the first 6 of 16 blocks sharing a weight, the last
   block tied to the head) declines.
2. **Behaviour** (:func:`traced_reason`): one forward of the whole model at the smallest
   probed size, on meta (shapes only: seconds for 10,000 blocks), under a dispatch mode
   that records, per block of the run, what it receives (each tensor's shape, dtype and
   strides and where it comes from: the previous block's output, something the parent made
   between the two blocks, or a tensor made before the run, by identity; every other value
   by value, or an object by identity), every aten op it runs (arguments and results: shape,
   dtype, strides, and which tensor each argument is: its own parameter by name, its input
   by position, a result of its own earlier op by position, or an outside tensor by
   identity), every tensor autograd saves for its backward, and what it returns. The
   parent's ops between consecutive blocks are recorded the same way. Every block after
   the second must record what the second records, and every gap after the second block
   what the gap after the second records (the first block and the gap after it are
   measured in their own right: their inputs come from before the run); the blocks must
   run once each, in order. A tensor is named relative to the segment (block or gap) that
   made it for two blocks back (:data:`_LOOKBACK`), by identity beyond that.
3. **The cut model** runs the same: the model with the run cut to its first 4, 5 and 6
   blocks is traced again (a model that indexes its blocks by a fixed count fails here), and
   its blocks and gaps must record what the whole model's do.

Anything else declines the shortcut, with a reason (:class:`Declined`): the blocks are then
probed in full, so the shortcut can make a probe faster but never change its answer.
Memplan's own failures are not declines: they surface as its own errors (exit 3).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memplan.errors import MemplanError, ModelFileError, first_line, internal_failure
from memplan.model.loader import ModelFile
from memplan.probe.backends import Backend
from memplan.probe.repeats import Repeat
from memplan.probe.tracker import LiveTracker, tensors_in
from memplan.run.training_state import disable_kv_cache

_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
_SIMPLE += (torch.memory_format,)
_PART = "block trace (probe/sameness.py)"
_LOOKBACK = 4
"""Segments (blocks and the gaps between them) back that a tensor is named relative to:
two blocks. An older tensor is named by identity, so a block that takes one the block two
before it made is unlike its neighbours (declined, never wrongly alike)."""


@dataclass(frozen=True, slots=True)
class Declined:
    """The shortcut was not taken: why, in words (``Profile.extrapolation_declined``)."""

    reason: str


def run_blocks(model: nn.Module, repeat: Repeat) -> list[nn.Module]:
    container = dict(model.named_modules())[repeat.container]
    return [container._modules[str(repeat.start + i)] for i in range(repeat.length)]


def _block_name(repeat: Repeat, i: int) -> str:
    prefix = f"{repeat.container}." if repeat.container else ""
    return f"{prefix}{repeat.start + i}"


def _run_label(repeat: Repeat) -> str:
    return f"{_block_name(repeat, 0)}–{repeat.start + repeat.length - 1}"


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested)
        return id(tensor)


# ------------------------------------------------------------------------------- state
def shared_state(model: nn.Module, repeat: Repeat) -> str | None:
    """Why the run's parameters and buffers are not each one block's own, or every block's
    (None when they are)."""
    prefix = f"{repeat.container}." if repeat.container else ""
    first, stop = repeat.start, repeat.start + repeat.length
    holders: dict[int, set[int]] = {}
    outside: set[int] = set()
    names: dict[int, str] = {}
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in tensors:
        key = _storage_key(tensor)
        block = None
        if name.startswith(prefix):
            head = name[len(prefix) :].partition(".")[0]
            if head.isdigit() and first <= int(head) < stop:
                block = int(head) - first
        if block is None:
            outside.add(key)
        else:
            holders.setdefault(key, set()).add(block)
            names.setdefault(key, name)
    everyone = set(range(repeat.length))
    for key, blocks in holders.items():
        if blocks == everyone or (len(blocks) == 1 and key not in outside):
            continue
        where = (
            f"{len(blocks)} of the {repeat.length} blocks"
            if blocks != everyone
            else "every block and by modules outside the run"
        )
        if len(blocks) == 1:
            where = "one block and by modules outside the run"
        return (
            f"{names[key]} is held by {where} of {_run_label(repeat)} (shared or tied "
            "parameters that differ between blocks): the blocks are not all alike"
        )
    return None


# ----------------------------------------------------------------------------- tracing
def _meta_of(tensor: torch.Tensor) -> tuple:
    try:
        layout = (tuple(tensor.stride()), tensor.storage_offset())
    except (RuntimeError, NotImplementedError):
        layout = ()
    return (tensor.dtype, tuple(tensor.shape), layout, tensor.layout, type(tensor))


class _Tracer(LiveTracker):
    """Records, per block of a run and per gap between two, what it receives, runs, saves
    for backward and returns (see the module doc), and compares each with the first. A
    tracker (not recording) underneath, as the probe's untracked steps run under one: on
    meta it runs memplan's meta kernels and the op cache (one dispatch mode, not two)."""

    def __init__(self, blocks: list[nn.Module], repeat: Repeat, backend: Backend) -> None:
        super().__init__(
            record=False,
            roofline=backend.roofline,
            meta=backend.device == "meta",
            op_cache=backend.op_cache,
        )
        self.blocks = blocks
        self.repeat = repeat
        self.ops: list[tuple] | None = None
        """What the current segment (a block's forward, or a gap) has recorded."""
        self.local: dict[int, tuple] = {}
        """id(tensor) -> its token within the current segment."""
        self.keep: list[Any] = []
        """The segment's tensors, kept alive so that no id is reused within it."""
        self.recent: deque[tuple[dict[int, tuple], list[Any]]] = deque(maxlen=_LOOKBACK)
        """The last segments' ``local`` and ``keep``: a tensor one of them made is named by
        how many segments back, and its name there."""
        self.outside: dict[int, tuple[int, Any]] = {}
        """id(object) -> (number, object): tensors and objects from outside a segment."""
        self.params: list[dict[int, str]] = []
        self.calls: list[int] = []
        """Block indices in the order their forwards ran."""
        self.block_ref: tuple | None = None
        self.gap_ref: tuple | None = None
        self.reason: str | None = None
        self.refs: dict[str, tuple] = {}
        """Set by a traced cut model: the whole model's block and gap records to match."""
        self._handles: list[Any] = []
        self._block = -1
        self._in_block = False

    # ------------------------------------------------------------------- tokens
    def _outside(self, value: Any) -> tuple:
        entry = self.outside.get(id(value))
        if entry is None or entry[1] is not value:
            entry = self.outside[id(value)] = (len(self.outside), value)
        return ("x", entry[0])

    def _token(self, tensor: torch.Tensor) -> tuple:
        token = self._recent(tensor)
        if token is None:
            token = self._outside(tensor)
        return (token, _meta_of(tensor))

    def _recent(self, tensor: torch.Tensor) -> tuple | None:
        token = self.local.get(id(tensor))
        if token is not None:
            return token
        entry = self.outside.get(id(tensor))
        if entry is not None and entry[1] is tensor:  # made before the run: by identity
            return ("x", entry[0])
        for back, (names, _) in enumerate(reversed(self.recent), 1):
            token = names.get(id(tensor))
            if token is not None:
                return ("r", back, token)
        return None

    def _next_segment(self, local: dict[int, tuple], keep: list[Any]) -> None:
        self.recent.append((self.local, self.keep))
        self.local, self.keep = local, keep

    def _canon(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._token(value)
        if isinstance(value, _SIMPLE):
            return (type(value), value)
        if isinstance(value, list | tuple):
            return (type(value), tuple(self._canon(v) for v in value))
        if isinstance(value, dict):
            return (dict, tuple((k, self._canon(v)) for k, v in value.items()))
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return (type(value), str(value))
        return ("obj", type(value), self._outside(value))

    def _new(self, out: Any) -> Any:
        """Tokens for an op's results: each tensor the next of the segment's own."""
        if isinstance(out, torch.Tensor):
            if id(out) not in self.local:
                self.local[id(out)] = ("o", len(self.keep))
                self.keep.append(out)
            return self._token(out)
        if isinstance(out, list | tuple):
            return (type(out), tuple(self._new(v) for v in out))
        return self._canon(out)

    # --------------------------------------------------------------- recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self.ops is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        try:
            entry = (func, self._canon(args), self._canon(kwargs or {}))
        except Exception as exc:
            raise internal_failure(_PART, func, exc) from exc
        out = super().__torch_dispatch__(func, types, args, kwargs)
        try:
            self.ops.append((*entry, self._new(out)))
        except Exception as exc:
            raise internal_failure(_PART, func, exc) from exc
        return out

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor autograd saves for backward: recorded in the segment, kept as is."""
        if self.ops is not None:
            token = self._recent(tensor) or ("?",)  # autograd may save an alias
            self.ops.append(("saved", token, _meta_of(tensor)))
        return tensor

    # ------------------------------------------------------------------- hooks
    def install(self) -> None:
        for i, block in enumerate(self.blocks):
            self.params.append(
                {
                    id(t): name
                    for name, t in (
                        *block.named_parameters(remove_duplicate=False),
                        *block.named_buffers(remove_duplicate=False),
                    )
                }
            )
            self._handles.append(block.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post(i), with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            try:
                self._enter(i, args, kwargs)
            except MemplanError:
                raise
            except Exception as exc:
                raise internal_failure(_PART, f"the forward pre-hook of block {i}", exc) from exc

        return hook

    def _post(self, i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            try:
                self._leave(i, output)
            except MemplanError:
                raise
            except Exception as exc:
                raise internal_failure(_PART, f"the forward hook of block {i}", exc) from exc

        return hook

    def _enter(self, i: int, args: Any, kwargs: Any) -> None:
        self.calls.append(i)
        if self._in_block or i != len(self.calls) - 1:
            self._fail(f"the blocks of {_run_label(self.repeat)} do not run once each, in order")
            self.ops = None
            return
        if self.ops is not None and i > 0:  # the gap since the previous block ends
            self._compare("gap", i - 1, tuple(self.ops))
        received = self._canon((args, kwargs))  # named from the gap before the block
        local = {key: ("p", name) for key, name in self.params[i].items()}
        inputs: list[torch.Tensor] = []
        tensors_in((args, kwargs), inputs)
        for k, tensor in enumerate(inputs):
            local.setdefault(id(tensor), ("i", k))
        self._next_segment(local, inputs)
        self.ops = [("in", received)]
        self._in_block = True

    def _leave(self, i: int, output: Any) -> None:
        if not self._in_block or self.ops is None:
            return
        self._in_block = False
        returned = self._canon(output)
        self.ops.append(("out", returned))
        self._compare("block", i, tuple(self.ops))
        outputs: list[torch.Tensor] = []
        tensors_in(output, outputs)
        for k, tensor in enumerate(outputs):  # named by position for whoever takes them
            self.local[id(tensor)] = ("out", k)
        self.keep.extend(outputs)
        self._next_segment({}, [])  # the gap after the block
        self.ops = [] if i + 1 < len(self.blocks) else None

    # ---------------------------------------------------------------- verdicts
    def _fail(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def _compare(self, kind: str, i: int, record: tuple) -> None:
        if self.reason is not None:
            return
        if i == 0:
            return  # the run's first block, and what follows it, are measured in their own right
        name = _block_name(self.repeat, i)
        ref = self.refs.get(kind)
        if ref is None:
            if kind == "block":
                if self.block_ref is None:
                    self.block_ref = record
                    return
                ref = self.block_ref
            else:
                if self.gap_ref is None:
                    self.gap_ref = record
                    return
                ref = self.gap_ref
        if record == ref:
            return
        first = _block_name(self.repeat, 1)
        if kind == "block":
            what = f"block {name} runs otherwise than {first}"
        else:
            what = f"the model runs other ops after {name} than after {first}"
        self._fail(f"{what} ({_first_difference(ref, record)}): the blocks are not all alike")


_WHERE = {
    "x": "a tensor from outside the block",
    "r": "a tensor made by the previous block or the model between blocks",
    "o": "a tensor made here",
    "i": "its input",
    "p": "its parameter",
    "?": "a tensor",
}


def _is_tensor(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], tuple)
        and isinstance(value[1], tuple)
        and len(value[1]) == 5
        and isinstance(value[1][0], torch.dtype)
    )


def _is_leaf(value: Any) -> bool:
    if not isinstance(value, tuple) or _is_tensor(value):
        return True
    if len(value) == 2 and isinstance(value[0], type) and value[0] not in (tuple, list, dict):
        return True  # (type, value)
    return bool(value) and value[0] == "obj"


def _leaf(value: Any) -> str:
    """One canonical value in words: a tensor's shape and where it comes from, or a value."""
    if _is_tensor(value):
        token, meta = value
        where = _WHERE.get(token[0], "a tensor") if token else "a tensor"
        return f"{where} of shape {list(meta[1])}"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        return repr(value[1])[:60]
    if isinstance(value, tuple) and value and value[0] == "obj":
        return f"a {value[1].__name__} object"
    return repr(value)[:60]


def _difference(a: Any, b: Any) -> tuple[str, str] | None:
    """The first leaf where two canonical values differ, each in words."""
    if a == b:
        return None
    if not (_is_leaf(a) or _is_leaf(b)) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            found = _difference(x, y)
            if found is not None:
                return found
    return _leaf(a), _leaf(b)


def _describe(entry: Any) -> str:
    if not isinstance(entry, tuple) or not entry:
        return repr(entry)[:120]
    head = entry[0]
    if head in ("in", "out"):
        return "receives" if head == "in" else "returns"
    if head == "saved":
        return f"saves a tensor of shape {list(entry[2][1])} for backward"
    shapes = [list(m[1]) for m in _metas(entry[1:])]
    return f"runs {head} on {shapes[:4]}"[:200]


def _metas(value: Any) -> Iterator[tuple]:
    if isinstance(value, tuple):
        if len(value) == 5 and isinstance(value[0], torch.dtype):
            yield value
            return
        for item in value:
            yield from _metas(item)


def _first_difference(ref: tuple, record: tuple) -> str:
    for k, (a, b) in enumerate(zip(ref, record, strict=False)):
        if a == b:
            continue
        if a[0] == b[0] and a[0] in ("in", "out"):
            found = _difference(a[1], b[1]) or ("?", "?")
            return f"{_describe(b)} {found[1]} where the other {_describe(a)} {found[0]}"
        if a[0] == b[0] and len(a) == len(b) == 4:  # the same op on other tensors or values
            found = _difference(a[1:], b[1:]) or ("?", "?")
            return f"step {k}: {a[0]} takes {found[1]} where the other takes {found[0]}"
        return f"step {k}: {_describe(b)} where the other {_describe(a)}"
    return f"{len(record)} steps where the other has {len(ref)}"


# ------------------------------------------------------------------------------ running
def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextmanager
def _rng_kept() -> Iterator[None]:
    """The trace's batch and forward leave the random state as they found it."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(state)


def _trace(
    model_file: ModelFile,
    backend: Backend,
    model: nn.Module,
    repeat: Repeat,
    size: int,
    refs: dict[str, tuple],
) -> _Tracer:
    disable_kv_cache(model)  # as the probe's session does
    tracer = _Tracer(run_blocks(model, repeat), repeat, backend)
    tracer.refs = refs
    tracer.install()
    try:
        with _rng_kept():
            batch = backend.batch(model_file, size)
            with tracer, backend.forward_context():
                with torch.autograd.graph.saved_tensors_hooks(tracer.pack, _unpack):
                    loss = model_file.loss(model, batch)
                del loss
    finally:
        tracer.remove()
    if tracer.reason is None and len(tracer.calls) != repeat.length:
        tracer._fail(
            f"{len(tracer.calls)} forwards of the {repeat.length} blocks of {_run_label(repeat)} ran"
        )
    return tracer


def traced_reason(
    model_file: ModelFile,
    backend: Backend,
    whole: nn.Module,
    repeat: Repeat,
    size: int,
    cuts: list[tuple[nn.Module, Repeat]],
) -> str | None:
    """Why the run's blocks are not provably one block repeated (None when they are), from a
    traced forward of ``whole`` (a copy of the model: a forward may fill caches the probe
    counts) and of each cut model in ``cuts`` (copies too, with their cut runs)."""
    try:
        tracer = _trace(model_file, backend, whole, repeat, size, {})
    except ModelFileError as exc:  # the model's own code; the full probe reports it
        return f"the model's forward failed while its blocks were traced ({first_line(exc)[:200]})"
    if tracer.reason is not None:
        return tracer.reason
    refs = {k: v for k, v in (("block", tracer.block_ref), ("gap", tracer.gap_ref)) if v}
    for cut, cut_repeat in cuts:
        try:
            traced = _trace(model_file, backend, cut, cut_repeat, size, refs)
        except ModelFileError as exc:
            return (
                f"the model does not run with {_run_label(repeat)} cut to {cut_repeat.length} "
                f"blocks ({first_line(exc)[:200]})"
            )
        if traced.reason is not None:
            return f"with {_run_label(repeat)} cut to {cut_repeat.length} blocks, {traced.reason}"
    return None
