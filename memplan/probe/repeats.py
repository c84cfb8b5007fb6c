"""A long run of identical blocks is probed at three short lengths and the rest derived.

Blocks that look identical (same class, parameter and buffer shapes and dtypes,
hyper-parameters: :func:`signature`) may still differ in what they run; the shortcut is
taken only for a run memplan.probe.sameness proves to be one block repeated (its state,
and a traced forward of every block), and declined, with a reason, otherwise. A stack of
``n`` identical blocks runs the same ops ``n`` times, and every quantity a
profile holds is linear in ``n``: each held block adds its saved bytes to every later
point, each block's parameters, gradients and optimizer state add theirs, each block's
forward and backward look like its neighbour's. So the run is cut to ``r`` = 4, 5 and 6 of
its blocks (the container's children re-keyed, the rest of the model untouched), each
short model probed as usual, and the profile of the ``n``-block model extrapolated from the
first two (memplan.probe.expand). The third checks the extrapolation: the 6-block profile
predicted from the 4- and 5-block ones must equal the measured one (bytes exactly, seconds
to 1e-9), or the model is probed in full. The first two blocks of the run and its last are
measured in their own right (the first sees an input that may need no gradient, the last
feeds whatever follows); the blocks between copy the run's third block, and the profile
lists them as derived (``Profile.extrapolated_layers``, and ``deduplicated_layers``).

Only the longest run is cut, and only one of at least :data:`MIN_RUN` blocks whose
container (``nn.ModuleList``/``nn.Sequential``) iterates them: a model that indexes its
blocks by a fixed count fails the traced cut model and is probed in full.
"""

from __future__ import annotations

import copy as copy_module
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MIN_RUN = 8
"""Shorter runs are probed in full: three short probes would cost more than they save."""

LENGTHS = (4, 5, 6)
"""The run lengths probed: two to extrapolate from, one to check the extrapolation."""

_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _hyper(value: Any) -> Any:
    if isinstance(value, _SIMPLE):
        return (type(value), value)
    if isinstance(value, tuple | list) and all(isinstance(v, _SIMPLE) for v in value):
        return (type(value), tuple((type(v), v) for v in value))
    return ("id", id(value))  # a shared config object is alike; a per-block one is not


def signature(module: nn.Module) -> tuple:
    """What makes two blocks run the same ops on the same shapes: every submodule's class,
    hyper-parameters (non-private attributes, ``training`` included) and hooks, and every
    parameter's and buffer's shape, dtype and ``requires_grad``."""
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(sorted((k, _hyper(v)) for k, v in vars(sub).items() if not k.startswith("_")))
        hooks = tuple(
            len(getattr(sub, h, ()))
            for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
        )
        own = tuple(
            (k, tuple(p.shape), p.dtype, p.requires_grad)
            for k, p in sub._parameters.items()
            if p is not None
        )
        bufs = tuple((k, tuple(b.shape), b.dtype) for k, b in sub._buffers.items() if b is not None)
        parts.append((name, type(sub), attrs, hooks, own, bufs))
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class Repeat:
    """A run of identical candidate layers, children ``start .. start+length-1`` of one
    container, which are candidates ``first .. first+length-1``."""

    container: str
    start: int
    length: int
    first: int


def longest_run(model: nn.Module, layer_names: list[str]) -> Repeat | None:
    """The longest run of at least MIN_RUN consecutive, identical candidates that are
    consecutive children of one ``ModuleList``/``Sequential`` (None if there is none)."""
    modules = dict(model.named_modules())
    best: Repeat | None = None
    j = 0
    while j < len(layer_names):
        parent, _, key = layer_names[j].rpartition(".")
        container = modules.get(parent)
        if not isinstance(container, nn.ModuleList | nn.Sequential) or not key.isdigit():
            j += 1
            continue
        sig = signature(modules[layer_names[j]])
        k = j + 1
        while k < len(layer_names):
            p, _, kk = layer_names[k].rpartition(".")
            if p != parent or kk != str(int(key) + k - j):
                break
            if signature(modules[layer_names[k]]) != sig:
                break
            k += 1
        length = k - j
        if length >= MIN_RUN and (best is None or length > best.length):
            best = Repeat(container=parent, start=int(key), length=length, first=j)
        j = k
    if best is None:
        return None
    keys = list(modules[best.container]._modules)
    if keys != [str(i) for i in range(len(keys))]:
        return None
    return best


def shrink(model: nn.Module, repeat: Repeat, length: int) -> None:
    """Cut ``repeat`` to its first ``length`` blocks (children after it re-keyed)."""
    container = dict(model.named_modules())[repeat.container]
    children = list(container._modules.values())
    stop = repeat.start + repeat.length
    kept = children[: repeat.start + length] + children[stop:]
    container._modules = {str(i): child for i, child in enumerate(kept)}


def shrunk_copy(model: nn.Module, repeat: Repeat, length: int) -> nn.Module:
    """A deep copy of ``model`` with ``repeat`` cut to ``length`` blocks."""
    copy = copy_module.deepcopy(model)
    shrink(copy, repeat, length)
    return copy
