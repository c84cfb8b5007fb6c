"""Training state that checkpointing, the probe and the gradient check must switch off: a
Hugging Face model's key/value cache (``disable_kv_cache``), LayerDrop
(``disable_layerdrop``: the probe measures the step that runs every layer) and dropout of
every kind (``no_dropout``). ``memplan.run`` re-exports them."""

from __future__ import annotations

import contextlib
import copy
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


def _where(changed: Sequence[str], root: str) -> str:
    """Up to three module names (``root`` for the root's ""), then an ellipsis."""
    return ", ".join(name or root for name in changed[:3]) + (", …" if len(changed) > 3 else "")


def kv_cache_note(changed: Sequence[str]) -> str | None:
    """The one line that says ``disable_kv_cache`` changed something, or None."""
    return KV_CACHE_NOTE.format(where=_where(changed, "the model's config")) if changed else None


_HF_CHECKPOINTING = (
    ("is_activation_checkpointing", "activation_checkpointing_disable"),  # transformers 5
    ("is_gradient_checkpointing", "gradient_checkpointing_disable"),
)


def disable_hf_checkpointing(model: torch.nn.Module) -> list[str]:
    """Switch off a transformers model's own activation checkpointing
    (``gradient_checkpointing_enable``) wherever it is on, and return the names of the
    models switched off ("" for the root). memplan measures every layer without it and
    checkpoints the plan's layers itself: left on, the probe measured HF's recompute as
    each layer's backward and no layer as saving anything, and the plan said no layer is
    recomputed while every one was."""
    changed = []
    for name, module in model.named_modules():
        for flag, off in _HF_CHECKPOINTING:
            if not (hasattr(type(module), flag) or flag in vars(module)):
                continue
            if getattr(module, flag, False) and callable(getattr(module, off, None)):
                getattr(module, off)()
                changed.append(name)
            break
    return changed


HF_CHECKPOINTING_NOTE = (
    "the model's own activation checkpointing (transformers' gradient_checkpointing_enable) "
    "was switched off ({where}): memplan measures each layer without it and checkpoints "
    "the plan's layers itself, where it would recompute every layer whatever the plan says."
)


def hf_checkpointing_note(changed: Sequence[str]) -> str | None:
    """The one line that says ``disable_hf_checkpointing`` changed something, or None."""
    return HF_CHECKPOINTING_NOTE.format(where=_where(changed, "the model")) if changed else None


def _layerdrop_fields(obj: Any) -> list[tuple[str, float]]:
    """``(name, probability)`` of each attribute of ``obj`` (a module or a config) whose
    name ends in ``layerdrop`` (``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``)
    and holds a probability above 0."""
    found = []
    for name, value in vars(obj).items():
        if (
            name.lower().endswith("layerdrop")
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value > 0
        ):
            found.append((name, float(value)))
    return found


def _config_without_layerdrop(config: Any, done: dict[int, Any], changed: list[str]) -> Any:
    """A shallow copy of ``config`` (and of the configs it nests: a composite model's
    ``text_config``) with every LayerDrop probability 0, made once per config object."""
    if id(config) in done:
        return done[id(config)]
    fields = _layerdrop_fields(config)
    nested = {
        name: value
        for name, value in vars(config).items()
        if type(value).__name__.endswith("Config") and hasattr(value, "__dict__")
    }
    copies = {name: _config_without_layerdrop(v, done, changed) for name, v in nested.items()}
    if not fields and all(copies[name] is nested[name] for name in nested):
        done[id(config)] = config
        return config
    fresh = copy.copy(config)
    for name, value in fields:
        setattr(fresh, name, 0.0)
        changed.append(f"config.{name} = {value:g}")
    for name, value in copies.items():
        setattr(fresh, name, value)
    done[id(config)] = fresh
    return fresh


def disable_layerdrop(model: torch.nn.Module) -> list[str]:
    """Switch off LayerDrop in ``model`` and return what was switched off
    (``config.layerdrop = 0.1``, ``encoder.layerdrop = 0.05``), each once.

    LayerDrop (Fan et al., 2019) skips whole layers at random in training: Hugging Face's
    speech encoders (Wav2Vec2, HuBERT, WavLM: ``config.layerdrop``, 0.1 by default) and
    encoder-decoders (BART, M2M-100, Whisper: ``encoder_layerdrop``/``decoder_layerdrop``)
    draw ``torch.rand([])`` per layer and step. A step then holds the activations of the
    layers it drew, so no profile fits it (the probe measured negative byte slopes and
    residuals of millions of percent), and the step that runs every layer is the most any
    draw needs: memplan measures that one. The switch is an attribute whose name ends in
    ``layerdrop`` and holds a probability above 0, on a module or on the ``config`` a
    module holds (and the configs that config nests). A config is replaced by a copy, the
    same copy in every module that shares it, so the model file's own config object (a
    module-level ``CONFIG`` that later builds read) keeps its value."""
    changed: list[str] = []
    done: dict[int, Any] = {}
    for name, module in model.named_modules():
        for field_name, value in _layerdrop_fields(module):
            setattr(module, field_name, 0.0)
            changed.append(f"{name + '.' if name else ''}{field_name} = {value:g}")
        config = module.__dict__.get("config")
        if config is not None and hasattr(config, "__dict__"):
            fresh = _config_without_layerdrop(config, done, changed)
            if fresh is not config:
                module.__dict__["config"] = fresh
    return list(dict.fromkeys(changed))


LAYERDROP_NOTE = (
    "LayerDrop was turned off for the probe ({what}): it skips whole layers at random in "
    "training, so no two steps hold the same layers' activations. The profile is of the "
    "step that runs every layer, the most any draw needs: plans from it are an upper bound "
    "for training with LayerDrop on (which needs less memory and time on most steps)."
)


def layerdrop_note(changed: Sequence[str]) -> str | None:
    """The one line that says ``disable_layerdrop`` changed something, or None."""
    if not changed:
        return None
    what = ", ".join(changed[:3]) + (", …" if len(changed) > 3 else "")
    return LAYERDROP_NOTE.format(what=what)


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
