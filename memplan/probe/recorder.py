"""Layer boundaries of one micro-step: which segment (held, active) each op falls in.

Forward pre/post hooks on each candidate layer mark its forward; a tensor hook on a layer's
output (its gradient arrives: its backward begins) and on its input (its gradient is
computed: its backward has ended) mark its backward. The same hooks time each layer and
each fixed part. Hooks only read counters and register tensor hooks: they allocate no
tensor, and hold no reference to one, so they leave the live count alone.

They also keep weak references to the storages of each layer's inputs and outputs, and when
the forward is done (the model's and the loss's frames are gone) note which are still alive:
whether the caller's variables, an op's saved tensors or a checkpoint keep them until the
backward is what a layer's checkpoint really saves (``runner`` compares the plain run with
the checkpointed one).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from memplan.errors import MemplanError, internal_failure
from memplan.probe.tracker import LiveTracker, storages_bytes


def _owned(what: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, whose failures are memplan's own (InternalError naming ``what``), never
    an error of the model whose forward or backward ran it."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except MemplanError:
            raise
        except Exception as exc:
            raise internal_failure("layer recorder (probe/recorder.py)", what, exc) from exc

    return guarded


@dataclass(slots=True)
class Mark:
    pos: int
    """Index into the tracker's values where the new segment starts."""
    held: int
    active: str
    live: int


@dataclass(slots=True)
class LayerRecord:
    pre_pos: int = -1
    post_pos: int = -1
    pre_live: int = 0
    post_live: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    flops: float = 0.0
    fwd_t0: float = 0.0
    fwd_t1: float = 0.0
    bwd_pos0: int = -1
    bwd_pos1: int = -1
    bwd_live0: int = 0
    bwd_t0: float | None = None
    bwd_t1: float | None = None
    clock: dict[str, dict[Any, tuple[float, float]]] = field(default_factory=dict)
    """On the meta clock: its mix (``LiveTracker.clock_mix``) at each of the four times
    above that was taken, by the time's name."""
    calls: int = 0
    inputs_late: list[tuple[int, bool]] = field(default_factory=list)
    """Per distinct storage of the layer's tensor inputs, in order: its bytes, and whether it
    was still alive when the forward was done."""
    outputs_late: list[tuple[int, bool]] = field(default_factory=list)
    """The same for its outputs."""
    _refs: tuple[list[tuple[Any, int]], list[tuple[Any, int]]] = ([], [])


@dataclass(slots=True)
class PartRecord:
    """A fixed part (a module outside the layers), summed over its calls."""

    first_seen: int = -1
    saved_bytes: int = 0
    flops: float = 0.0
    fwd_seconds: float = 0.0
    bwd_t0: float | None = None
    bwd_t1: float | None = None
    _pre: tuple[int, float, float] = (0, 0.0, 0.0)


@dataclass(slots=True)
class StepRecord:
    """What one recorded micro-step leaves: boundary marks and per-module records."""

    marks: list[Mark] = field(default_factory=list)
    layers: list[LayerRecord] = field(default_factory=list)
    parts: dict[str, PartRecord] = field(default_factory=dict)
    loss_saved_bytes: int = 0
    loss_flops: float = 0.0
    loss_seconds: float = 0.0
    t_start: float = 0.0
    t_forward_done: float = 0.0
    t_end: float = 0.0
    layer_order: list[int] = field(default_factory=list)
    """Layer indices in the order their forward first ran (discovery)."""
    problems: list[str] = field(default_factory=list)
    shared: list[SharedRecord] = field(default_factory=list)
    """The tensors made outside the layers and passed to two or more of them, in the order
    they first reached a layer."""


@dataclass(slots=True)
class SharedRecord:
    """A storage made outside the candidate layers that two or more of them take as input
    (an attention mask, rotary cos/sin): whatever checkpoints one of them keeps it once."""

    nbytes: int
    layers: tuple[int, ...]
    freed_at: int | None
    """The tracker position (``LiveTracker.position``) when it was freed; None: alive when
    the step ended (or not tracked)."""


class _Input:
    """A layer input seen during one step, with the layers taking it and when it died."""

    __slots__ = ("freed_at", "layers", "nbytes", "ref")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.layers: list[int] = []
        self.freed_at: int | None = None
        self.ref: Any = None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _storage_refs(tensors: list[torch.Tensor]) -> list[tuple[Any, int]]:
    """Weak references to the distinct storages behind ``tensors``, with their bytes."""
    out: dict[int, tuple[Any, int]] = {}
    for tensor in tensors:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if id(storage) not in out:
            out[id(storage)] = (weakref.ref(storage), storage.nbytes())
    return list(out.values())


def _is_shared(entry: _Input | None) -> bool:
    return entry is not None and len(entry.layers) >= 2


def _alive(refs: list[tuple[Any, int]]) -> list[tuple[int, bool]]:
    return [(nbytes, ref() is not None) for ref, nbytes in refs]


class Recorder:
    """Installs boundary hooks on ``layers`` (in execution order) and ``parts``; each
    :meth:`begin` starts a fresh :class:`StepRecord`."""

    def __init__(
        self,
        root: torch.nn.Module,
        layers: list[torch.nn.Module],
        parts: dict[str, torch.nn.Module],
        clock: Callable[[], float],
    ) -> None:
        self.root = root
        self.layers = layers
        self.parts = parts
        self.clock = clock
        self.tracker: LiveTracker | None = None
        self.rec = StepRecord()
        self.held = 0
        self.active = "none"
        self._root_post: tuple[int, float, float] | None = None
        self._handles: list[Any] = []
        self._inputs: dict[int, _Input] = {}
        """Live layer-input storages by id (an entry leaves when its storage dies)."""
        self._seen: list[_Input] = []
        self._outputs: dict[int, Any] = {}
        """Weak references to the layers' output storages, by id."""
        self._layer_inputs: list[list[_Input | None]] = []

    # --------------------------------------------------------------------------- plumbing
    def install(self) -> None:
        for index, layer in enumerate(self.layers):
            self._handles.append(
                layer.register_forward_pre_hook(self._layer_pre(index), with_kwargs=True)
            )
            self._handles.append(
                layer.register_forward_hook(self._layer_post(index), with_kwargs=True)
            )
        for name, part in self.parts.items():
            self._handles.append(
                part.register_forward_pre_hook(self._part_pre(name), with_kwargs=True)
            )
            self._handles.append(
                part.register_forward_hook(self._part_post(name), with_kwargs=True)
            )
        self._handles.append(
            self.root.register_forward_hook(_owned("the model's forward hook", self._root_hook))
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _live(self) -> int:
        return self.tracker.live_bytes if self.tracker is not None else 0

    def _pos(self) -> int:
        return self.tracker.position if self.tracker is not None else 0

    def _mix(self, rec: LayerRecord, time: str) -> None:
        """Note the meta clock's mix at ``rec``'s ``time`` (nothing off meta)."""
        if self.tracker is not None and self.tracker.roofline is not None:
            rec.clock[time] = self.tracker.clock_mix()

    def _flops(self) -> float:
        return self.tracker.flops if self.tracker is not None else 0.0

    def _set_state(self, held: int, active: str) -> None:
        if (held, active) == (self.held, self.active):
            return
        if self.active == "bwd":  # leaving a layer's backward closes it
            closing = self.rec.layers[self.held]
            if closing.bwd_t1 is None:
                closing.bwd_t1 = self.clock()
                closing.bwd_pos1 = self._pos()
                self._mix(closing, "bwd_t1")
        self.held, self.active = held, active
        self.rec.marks.append(Mark(self._pos(), held, active, self._live()))

    def begin(self, tracker: LiveTracker | None) -> StepRecord:
        self.tracker = tracker
        self.rec = StepRecord(layers=[LayerRecord() for _ in self.layers])
        self.held, self.active = 0, "none"
        self.rec.marks.append(Mark(self._pos(), 0, "none", self._live()))
        self._root_post = None
        self._inputs, self._seen, self._outputs = {}, [], {}
        self._layer_inputs = [[] for _ in self.layers]
        self.rec.t_start = self.clock()
        return self.rec

    def forward_done(self) -> None:
        """The loss is computed; backward is next."""
        self.rec.t_forward_done = self.clock()
        if self._root_post is not None:
            live0, flops0, t0 = self._root_post
            self.rec.loss_saved_bytes = self._live() - live0
            self.rec.loss_flops = self._flops() - flops0
            self.rec.loss_seconds = self.rec.t_forward_done - t0
        for rec, entries in zip(self.rec.layers, self._layer_inputs, strict=True):
            ins, outs = rec._refs
            if len(entries) == len(ins):  # a shared input is charged once, not per layer
                ins = [r for r, e in zip(ins, entries, strict=True) if not _is_shared(e)]
            rec.inputs_late, rec.outputs_late = _alive(ins), _alive(outs)
            rec._refs = ([], [])

    def end(self) -> StepRecord:
        self._set_state(self.held, "none")
        self.rec.t_end = self.clock()
        self.rec.shared = [
            SharedRecord(e.nbytes, tuple(e.layers), e.freed_at) for e in self._seen if _is_shared(e)
        ]
        self._inputs, self._seen, self._outputs = {}, [], {}
        self._layer_inputs = [[] for _ in self.layers]
        for part in self.rec.parts.values():
            if part.bwd_t0 is not None and part.bwd_t1 is None:
                part.bwd_t1 = self.rec.t_end
        self.tracker = None
        return self.rec

    def _note_inputs(self, index: int, inputs: list[torch.Tensor]) -> list[_Input | None]:
        """Per distinct input storage (in ``_storage_refs``' order): its entry, or None for
        a candidate layer's output (the hidden state flowing from layer to layer)."""
        out: list[_Input | None] = []
        done: set[int] = set()
        for tensor in inputs:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = id(storage)
            if key in done:
                continue
            done.add(key)
            made_by_layer = self._outputs.get(key)
            if made_by_layer is not None and made_by_layer() is storage:
                out.append(None)
                continue
            entry = self._inputs.get(key)
            if entry is None or entry.ref() is not storage:
                entry = _Input(storage.nbytes())
                entry.ref = weakref.ref(storage, self._freed(key, entry))
                self._inputs[key] = entry
                self._seen.append(entry)
            if index not in entry.layers:
                entry.layers.append(index)
            out.append(entry)
        return out

    def _freed(self, key: int, entry: _Input) -> Callable[[Any], None]:
        def callback(_ref: Any) -> None:
            entry.freed_at = self._pos()
            if self._inputs.get(key) is entry:
                del self._inputs[key]

        return callback

    # ------------------------------------------------------------------------------ hooks
    def _layer_pre(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            rec = self.rec.layers[index]
            rec.calls += 1
            if rec.calls > 1:
                self.rec.problems.append(f"layer {index} ran its forward more than once")
                return
            self.rec.layer_order.append(index)
            self._set_state(index, "fwd")
            rec.pre_pos, rec.pre_live = self._pos(), self._live()
            inputs = _tensors((args, kwargs))
            rec.input_bytes = storages_bytes(inputs)
            rec._refs = (_storage_refs(inputs), [])
            self._layer_inputs[index] = self._note_inputs(index, inputs)
            rec.flops = self._flops()
            for tensor in inputs:
                if tensor.requires_grad:
                    tensor.register_hook(self._bwd_end(index))
            rec.fwd_t0 = self.clock()
            self._mix(rec, "fwd_t0")

        return _owned(f"the forward pre-hook of layer {index}", hook)

    def _layer_post(self, index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            rec = self.rec.layers[index]
            if rec.calls > 1:
                return
            rec.fwd_t1 = self.clock()
            self._mix(rec, "fwd_t1")
            rec.post_pos, rec.post_live = self._pos(), self._live()
            rec.flops = self._flops() - rec.flops
            outputs = _tensors(output)
            rec.output_bytes = storages_bytes(outputs)
            rec._refs = (rec._refs[0], _storage_refs(outputs))
            for ref, _ in rec._refs[1]:
                storage = ref()
                if storage is not None:
                    self._outputs[id(storage)] = ref
            for tensor in outputs:
                if tensor.requires_grad:
                    tensor.register_hook(self._bwd_begin(index))
            self._set_state(index + 1, "none")

        return _owned(f"the forward hook of layer {index}", hook)

    def _bwd_begin(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if (self.held, self.active) == (index, "bwd"):
                return
            self._set_state(index, "bwd")
            rec = self.rec.layers[index]
            rec.bwd_t0 = self.clock()
            self._mix(rec, "bwd_t0")
            rec.bwd_pos0, rec.bwd_live0 = self._pos(), self._live()

        return _owned(f"the backward hook of layer {index}", hook)

    def _bwd_end(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if (self.held, self.active) == (index, "bwd"):
                self._set_state(index, "none")

        return _owned(f"the backward hook of layer {index}", hook)

    def _part_pre(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            part = self.rec.parts.get(name)
            if part is None:
                part = self.rec.parts[name] = PartRecord(first_seen=len(self.rec.parts))
            part._pre = (self._live(), self._flops(), self.clock())
            for tensor in _tensors((args, kwargs)):
                if tensor.requires_grad:
                    tensor.register_hook(self._part_bwd(name, end=True))

        return _owned(f"the forward pre-hook of {name}", hook)

    def _part_post(self, name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            part = self.rec.parts[name]
            live0, flops0, t0 = part._pre
            part.fwd_seconds += self.clock() - t0
            part.saved_bytes += self._live() - live0
            part.flops += self._flops() - flops0
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._part_bwd(name, end=False))

        return _owned(f"the forward hook of {name}", hook)

    def _part_bwd(self, name: str, *, end: bool) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            part = self.rec.parts[name]
            now = self.clock()
            if end:
                part.bwd_t1 = now
            elif part.bwd_t0 is None:
                part.bwd_t0 = now

        return _owned(f"the backward hook of {name}", hook)

    def _root_hook(self, module: Any, args: Any, output: Any) -> None:
        self._root_post = (self._live(), self._flops(), self.clock())
