"""Wrap named modules in non-reentrant activation checkpointing, reversibly.

The module's ``forward`` is replaced on the instance (not the module in its parent), so
fully-qualified names stay as they were and forward hooks on the module fire once per call,
not again during recompute. ``memplan.runtime.apply`` is the user-facing equivalent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


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
    wrapped: list[tuple[torch.nn.Module, Any]] = []
    try:
        for module in modules:
            previous = module.__dict__.get("forward")
            module.forward = functools.partial(_checkpointed_forward, module.forward, context_fn)
            wrapped.append((module, previous))
        yield
    finally:
        for module, previous in reversed(wrapped):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
