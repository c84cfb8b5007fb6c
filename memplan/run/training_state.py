"""Training state that checkpointing and the gradient check must switch off: a Hugging
Face model's key/value cache (``disable_kv_cache``) and dropout of every kind
(``no_dropout``). ``memplan.run`` re-exports both."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def disable_kv_cache(model: torch.nn.Module) -> list[str]:
    """Switch off the key/value cache of every module whose ``config.use_cache`` is true
    (Hugging Face models) and return the names of those modules ("" for the root).

    A cache is filled during the forward and read by the next forward: under activation
    checkpointing the recompute writes to it again, so the recompute saves other tensors
    than the forward did (``CheckpointError``) or sees a longer sequence (shape mismatch).
    Training does not use it; transformers' own ``gradient_checkpointing_enable`` switches
    it off the same way (``PreTrainedModel.gradient_checkpointing_enable`` and the warning
    in its layers' ``__call__``, transformers 5.x ``modeling_layers.py``)."""
    changed = []
    for name, module in model.named_modules():  # wrappers (DDP) included: they hold it
        config = module.__dict__.get("config")
        if config is not None and getattr(config, "use_cache", False) is True:
            config.use_cache = False
            changed.append(name)
        generation = module.__dict__.get("generation_config")
        if generation is not None and getattr(generation, "use_cache", False) is True:
            generation.use_cache = False
    return changed


KV_CACHE_NOTE = (
    "use_cache was turned off ({where}): a key/value cache is of no use in training and "
    "breaks activation checkpointing's recompute."
)


def kv_cache_note(changed: Sequence[str]) -> str | None:
    """The one line that says ``disable_kv_cache`` changed something, or None."""
    if not changed:
        return None
    where = ", ".join(name or "the model's config" for name in changed[:3])
    return KV_CACHE_NOTE.format(where=where + (", …" if len(changed) > 3 else ""))


class _NoDropout(TorchDispatchMode):
    """Every dropout draws no mask while active, fused ones included.

        Seen at the level of aten ops (a ``TorchDispatchMode``), which autograd keeps active
        while activation checkpointing recomputes a layer inside the backward (a
        ``TorchFunctionMode`` is not: the recompute ran with dropout on). It covers what an
        ``nn.Dropout`` module search misses: functional ``F.dropout`` (Hugging Face attention
        dropout), ``nn.MultiheadAttention``'s dropout, ``scaled_dot_product_attention``'s
        ``dropout_p`` (fused kernels take it as an argument) and stochastic depth (a
    ``bernoulli_`` mask, or ``floor(keep_prob + torch.rand(...))`` as Hugging Face's
    ``drop_path`` draws it: that floor is made all ones). On CPU a
        dropout is ``bernoulli_`` then a scale (ATen ``Dropout.cpp``, ``_dropout_impl``): the
        mask is made all ones, so what is left is the deterministic ``1 / (1 - p)`` scale, the
        same in every run. Fused kernels (``native_dropout``, the attention kernels) get
        probability 0. The model stays in training mode, so checkpointing still runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        """Dropout ops it neutralised (for the caller to report)."""
        self._uniform: dict[int, weakref.ref] = {}
        """``rand`` outputs, then ``keep + rand`` sums: the mask of a drop-path written as
        ``floor(keep_prob + torch.rand(...))`` (Hugging Face's ``drop_path``)."""

    def _mark(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._uniform[id(t)] = weakref.ref(t)

    def _marked(self, t: Any) -> bool:
        ref = self._uniform.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        name = func._overloadpacket.__name__
        if name == "bernoulli_":
            self.seen += 1
            return args[0].fill_(1)
        if name == "bernoulli":
            self.seen += 1
            return torch.ones_like(args[0])
        if name in ("floor", "floor_") and args and self._marked(args[0]):
            # drop-path's mask floor(keep + U[0, 1)): all ones, the 1 / keep scale stays
            self.seen += 1
            return args[0].fill_(1) if name == "floor_" else torch.ones_like(args[0])
        if name in ("rand", "rand_like"):
            out = func(*args, **kwargs)
            self._mark(out)
            return out
        if name in ("add", "add_") and len(args) >= 2 and any(map(self._marked, args[:2])):
            other = args[1] if self._marked(args[0]) else args[0]
            out = func(*args, **kwargs)
            if isinstance(other, float | int) or (
                isinstance(other, torch.Tensor) and other.numel() == 1
            ):
                self._mark(out)
            return out
        for index, arg in enumerate(func._schema.arguments):
            if arg.name == "dropout_p" or (arg.name == "p" and "dropout" in name):
                if arg.name in kwargs:
                    self.seen += bool(kwargs[arg.name])
                    kwargs[arg.name] = 0.0
                elif index < len(args):
                    self.seen += bool(args[index])
                    args = (*args[:index], 0.0, *args[index + 1 :])
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_dropout() -> Iterator[_NoDropout]:
    """Within the block, dropout of every kind draws no mask (see ``_NoDropout``); the
    result's ``seen`` counts the ops it neutralised. Run the backward inside it too."""
    mode = _NoDropout()
    with mode:
        yield mode
