"""The live model as an in-memory model file (``memplan.model.loader.ModelFile``), and what keeps
it as it was while a copy of it is probed: ``live_model_file`` (the functions the probe
calls), ``planning_copy`` (the copy), ``rng_preserved`` and ``unchanged`` (memplan.
integrations.api's module docstring says what they guarantee)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import itertools
import random
import sys
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from memplan.errors import BadInputError
from memplan.model.batch import batch_tensors, map_batch
from memplan.model.loader import ModelFile, takes_seq_len
from memplan.model.reference import DEFAULT_FACTORY
from memplan.run.accumulate import samples_in
from memplan.run.checkpoint import remove, unwrap

__all__ = [
    "hf_checkpointing_off",
    "live_model_file",
    "planning_copy",
    "rng_preserved",
    "unchanged",
]


def live_model_file(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    batch: Any,
    *,
    loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    optimizer: Any = None,
    device: str = "cpu",
    where: Path | None = None,
    keep: Sequence[Any] = (),
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> ModelFile:
    """A ModelFile whose functions are the live model's: see the module docstring. ``keep``:
    objects the copy refers to rather than copies (a Lightning module's trainer);
    ``prepare(copy)`` readies each copy for the probe (the integrations' framework hooks)."""
    if isinstance(model, torch.nn.Module):
        if not any(p.requires_grad for p in model.parameters()):
            raise BadInputError(
                f"The model ({type(model).__name__}) has no trainable parameters "
                "(requires_grad is False on every one): there is nothing to train and "
                "nothing to plan.",
                hint="Unfreeze the parameters you train (requires_grad_(True)) before planning.",
            )
        live = model

        def build_model() -> torch.nn.Module:
            twin = planning_copy(live, device, keep=keep)
            if prepare is not None:
                prepare(twin)
            return twin

        factory = DEFAULT_FACTORY
    elif callable(model):
        build_model = model
        factory = getattr(model, "__name__", "")
        factory = factory if factory.isidentifier() else DEFAULT_FACTORY
    else:
        raise BadInputError(
            f"plan_model() takes an nn.Module or a function returning one, got "
            f"{type(model).__name__}."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise BadInputError(f"loss_fn must be a function (model, batch) -> loss, got {loss_fn!r}.")
    make_batch = batch if callable(batch) else _sampler(batch)
    namespace = types.SimpleNamespace(
        build_model=build_model,
        make_batch=make_batch,
        make_optimizer=_optimizer_factory(optimizer, model),
    )
    if loss_fn is not None:
        namespace.training_loss = loss_fn
    if factory != DEFAULT_FACTORY:
        setattr(namespace, factory, build_model)
    path = Path(where) if where is not None else Path(_source_of(make_batch) or "<script>")
    return ModelFile(
        path=path,
        factory=factory,
        module=namespace,
        sha256=_fingerprint(model),
        has_training_loss=loss_fn is not None,
        has_make_optimizer=True,
        takes_seq_len=callable(batch) and takes_seq_len(batch),
        labels=_labels(make_batch=batch if callable(batch) else None, training_loss=loss_fn),
        batch_text=None if callable(batch) else "the batch",
    )


def _labels(**functions: Any) -> tuple[tuple[str, str], ...]:
    """Messages name the script's own functions by their names (``raises``, ``<lambda>``),
    not by the model-file contract's (``make_batch``, ``training_loss``) that the script
    never defined."""
    return tuple(
        (slot, name)
        for slot, fn in functions.items()
        if fn is not None and isinstance(name := getattr(fn, "__name__", None), str) and name
    )


def planning_copy(
    model: torch.nn.Module, device: str = "cpu", *, keep: Sequence[Any] = ()
) -> torch.nn.Module:
    """A copy of ``model`` to probe, in training mode, without memplan's or Hugging Face's
    checkpointing: parameters and buffers copied without their gradients (on meta, as meta
    tensors, no data copied), shared tensors shared in the copy too."""
    # the module inside torch.compile's (or DDP's) wrapper: the probe checkpoints its
    # candidates itself, which dynamo cannot trace (a compiled model failed as the user's
    # loss raising), and plan names are the unwrapped model's, as memplan.apply reads them
    model = unwrap(model)
    memo: dict[int, Any] = {id(obj): obj for obj in keep}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) in memo:
            continue
        data = tensor.detach()
        data = torch.empty_like(data, device="meta") if device == "meta" else data.clone()
        if isinstance(tensor, torch.nn.Parameter):
            data = torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = data
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as exc:
        raise BadInputError(
            f"memplan plans a copy of the model, and {type(model).__name__} cannot be copied "
            f"({type(exc).__name__}: {exc}).",
            hint="Pass a function that builds the model instead: plan_model(lambda: "
            "build_model(), ...).",
        ) from exc
    twin.train()
    remove(twin)  # the probe checkpoints the candidates itself
    hf_checkpointing_off(twin)
    return twin


def hf_checkpointing_off(model: torch.nn.Module) -> None:
    """Switch off a transformers model's own activation checkpointing, if it is on
    (``run.training_state.disable_hf_checkpointing``)."""
    from memplan.run.training_state import disable_hf_checkpointing

    disable_hf_checkpointing(model)


def _sampler(batch: Any) -> Callable[[int], Any]:
    """``make_batch(n)`` from one batch: ``n`` of its samples, cycling when it has fewer."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)  # a BatchEncoding
    count = samples_in(batch)
    if count is None or count < 1:
        raise BadInputError(
            f"batch must be a batch (a tensor, tuple/list or dict of tensors whose first "
            f"dimension is the samples) or a function batch_size -> batch; got "
            f"{_what_batch_is(batch, count)}.",
        )

    def make_batch(size: int) -> Any:
        index = torch.arange(size) % count

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or t.shape[0] != count:
                return t
            return t[index.to(t.device)]

        return map_batch(batch, take)

    return make_batch


def _what_batch_is(batch: Any, count: int | None) -> str:
    """What is wrong with ``batch`` as a batch, in a few words: empty, no samples, or no
    tensor in it (before, an empty tuple read "got tuple", as if a tuple were refused)."""
    kind = type(batch).__name__
    if batch is None:
        return "None"
    if count == 0:
        shapes = [tuple(t.shape) for t in batch_tensors(batch)]
        return f"a {kind} with 0 samples (first dimension 0: {', '.join(map(str, shapes))})"
    if isinstance(batch, torch.Tensor):
        return "a 0-dimensional tensor, which has no samples"
    if isinstance(batch, Mapping | tuple | list):
        return f"an empty {kind}" if not batch else f"a {kind} that holds no tensor"
    return f"a {kind}"


def _optimizer_factory(optimizer: Any, model: Any) -> Callable[[torch.nn.Module], Any]:
    """``make_optimizer(copy)``: the user's optimizer rebuilt over the copy (its class, and
    its parameter groups matched by parameter name), a user's factory, or AdamW."""
    if optimizer is None:
        return lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):
            return optimizer
        raise BadInputError(
            f"optimizer must be a torch.optim.Optimizer or a function model -> optimizer, "
            f"got {type(optimizer).__name__}."
        )
    if not isinstance(model, torch.nn.Module):
        raise BadInputError(
            "With a model factory, give the optimizer as a function model -> optimizer.",
            hint="optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-4)",
        )
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise BadInputError(
                f"The optimizer ({type(optimizer).__name__}) holds {len(missing)} tensor(s) "
                "that are not parameters of the model.",
                hint="Pass the optimizer made over this model's parameters, or a function "
                "model -> optimizer.",
            )
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append((settings, [names[id(p)] for p in group["params"]]))
    kind = type(optimizer)

    def make_optimizer(copied: torch.nn.Module) -> Any:
        params = dict(copied.named_parameters(remove_duplicate=False))
        rebuilt = [
            {**settings, "params": [params[n] for n in wanted if n in params]}
            for settings, wanted in groups
        ]
        rebuilt = [g for g in rebuilt if g["params"]]
        try:
            return kind(rebuilt, **optimizer.defaults)
        except TypeError:
            try:
                return kind(rebuilt)
            except Exception as exc:
                raise BadInputError(
                    f"memplan cannot rebuild the optimizer {kind.__name__} over the copy of "
                    f"the model it plans ({type(exc).__name__}: {exc}).",
                    hint="Pass optimizer=lambda model: <your optimizer over model.parameters()>.",
                ) from exc

    return make_optimizer


# ------------------------------------------------------------------ state and checks
@contextlib.contextmanager
def rng_preserved(*, cuda: bool = True) -> Iterator[None]:
    """Within the block the RNGs may be used; afterwards torch's CPU (and, where CUDA is
    initialised, every GPU's), Python's ``random`` and numpy's global states are as before."""
    cpu = torch.get_rng_state()
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    gpus = (
        torch.cuda.get_rng_state_all()
        if cuda and torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(python)
        if np_state is not None:
            numpy.random.set_state(np_state)
        if gpus is not None:
            torch.cuda.set_rng_state_all(gpus)


def _versions(model: torch.nn.Module) -> list[tuple[Any, ...]]:
    out = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        grad = t.grad if isinstance(t, torch.nn.Parameter) else None
        out.append((t._version, id(grad), None if grad is None else grad._version))
    out.append(tuple(m.training for m in model.modules()))
    return out


@contextlib.contextmanager
def unchanged(model: torch.nn.Module | None) -> Iterator[None]:
    """Raise when the block changed ``model`` in place (a parameter, buffer or gradient
    written, a gradient made, a training flag switched): a loss or batch function that uses
    the live model instead of the model it is given."""
    before = _versions(model) if model is not None else None
    yield
    if model is not None and _versions(model) != before:
        raise BadInputError(
            "Planning changed the live model: the loss function or the batch function used "
            "it (or its optimizer) instead of the model it was given.",
            hint="Write loss_fn(model, batch) in terms of its model argument; memplan "
            "measures a copy of the model, and the live one must stay as it was.",
        )


def _fingerprint(model: Any) -> str:
    """A digest of the model's class and parameter names, shapes and dtypes (a live model
    has no file whose bytes could be hashed)."""
    digest = hashlib.sha256()
    kind = type(model) if isinstance(model, torch.nn.Module) else model
    digest.update(f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', '')}".encode())
    if isinstance(model, torch.nn.Module):
        for name, p in model.named_parameters():
            digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return digest.hexdigest()


def _source_of(fn: Any) -> str | None:
    try:
        return inspect.getsourcefile(fn)
    except TypeError:
        return None
