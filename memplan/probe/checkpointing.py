"""Wrap named modules in non-reentrant activation checkpointing, reversibly, and run a
forward in any of memplan's per-layer modes (memplan.modes).

The module's ``forward`` is replaced on the instance (not the module in its parent), so
fully-qualified names stay as they were and forward hooks on the module fire once per call,
not again during recompute. ``memplan.runtime.apply`` is the user-facing equivalent and runs
its modes through :func:`run_in_mode`, so the probe measures what ``apply`` runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memplan.errors import BadInputError
from memplan.modes import FULL, KEEP, OFFLOAD, SAVE_OPS, SELECTIVE

_save_packets: frozenset[Any] | None = None


def _save_ops() -> frozenset[Any]:
    """The aten op packets of memplan.modes.SAVE_OPS this torch has."""
    global _save_packets
    if _save_packets is None:
        found = []
        for name in SAVE_OPS:
            try:
                found.append(getattr(torch.ops.aten, name))
            except (AttributeError, RuntimeError):  # an op this torch build lacks
                continue
        _save_packets = frozenset(found)
    return _save_packets


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of matmul, convolution and attention ops; recompute the rest
    (PyTorch's selective activation checkpointing API, torch.utils.checkpoint docs)."""
    del ctx, args, kwargs
    packet = getattr(op, "overloadpacket", op)
    return (
        CheckpointPolicy.MUST_SAVE if packet in _save_ops() else CheckpointPolicy.PREFER_RECOMPUTE
    )


def selective_context_fn() -> tuple[Any, Any]:
    """checkpoint's ``context_fn`` for the ``selective`` mode."""
    return create_selective_checkpoint_contexts(_selective_policy)


def require_offload_device() -> None:
    """``offload`` copies saved tensors to pinned host memory: it needs CUDA."""
    if not torch.cuda.is_available():
        raise BadInputError(
            "The plan offloads layers to host memory, which needs a CUDA device; this "
            "machine has none.",
            hint="Solve for this device without offload (--modes keep,selective,full).",
        )


def run_in_mode(mode: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` in ``mode``: ``full`` and ``selective`` through
    non-reentrant checkpoint (RNG state preserved, so dropout masks match in the
    recompute), ``offload`` under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``."""
    if mode == FULL:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    if mode == SELECTIVE:
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=selective_context_fn,
            **kwargs,
        )
    if mode == OFFLOAD:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return forward(*args, **kwargs)
    if mode == KEEP:
        return forward(*args, **kwargs)
    raise ValueError(f"unknown mode {mode!r}")


def _mode_forward(forward: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
    return run_in_mode(mode, forward, *args, **kwargs)


def _checkpointed_forward(forward: Any, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs
    )


@contextmanager
def checkpointed(
    modules: Iterable[torch.nn.Module], *, context_fn: Callable[[], tuple[Any, Any]] | None = None
) -> Iterator[None]:
    """Within the block, each of ``modules`` runs under non-reentrant checkpoint.
    ``context_fn`` is checkpoint's (forward context, recompute context) factory; the meta
    backend uses it to recompute under its own autocast, which checkpoint cannot restore."""
    with _forwards_wrapped(modules, _checkpointed_forward, context_fn):
        yield


@contextmanager
def in_mode(modules: Iterable[torch.nn.Module], mode: str) -> Iterator[None]:
    """Within the block, each of ``modules`` runs in ``mode`` (see :func:`run_in_mode`)."""
    with _forwards_wrapped(modules, _mode_forward, mode):
        yield


@contextmanager
def _forwards_wrapped(
    modules: Iterable[torch.nn.Module], wrapper: Callable[..., Any], arg: Any
) -> Iterator[None]:
    """Within the block, each module's ``forward`` is ``wrapper(original_forward, arg, ...)``;
    on exit every module gets back exactly what it had (its own instance attribute, or none)."""
    wrapped: list[tuple[torch.nn.Module, Any]] = []
    try:
        for module in modules:
            previous = module.__dict__.get("forward")
            module.forward = functools.partial(wrapper, module.forward, arg)
            wrapped.append((module, previous))
        yield
    finally:
        for module, previous in reversed(wrapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
