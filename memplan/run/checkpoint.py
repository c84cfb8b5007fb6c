"""The checkpoint primitive: run a module's forward in one of memplan's per-layer modes
(memplan.modes), and patch modules by fully-qualified name so they do (``apply`` /
``remove``), permanently or for the length of a block (``checkpointed``, ``in_mode``).

One mechanism patches a forward: the instance's ``forward`` is replaced by a bound method
(not the module in its parent, not a closure), so fully-qualified names and ``state_dict``
keys stay as they were, forward hooks fire once per call and not again in the recompute, and
``copy.deepcopy(model)`` rebinds the patch to the copy. The probe measures through the same
patch that ``apply`` installs in a user's training loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memplan.errors import BadInputError
from memplan.modes import (
    COUNTED_MATMULS,
    FULL,
    KEEP,
    MODES,
    OFFLOAD,
    RECOMPUTE_EVERY_NTH_MATMUL,
    SAVE_OPS,
    SELECTIVE,
)
from memplan.plan import Plan
from memplan.run.training_state import (
    disable_hf_checkpointing,
    disable_kv_cache,
    hf_checkpointing_note,
    kv_cache_note,
)
from memplan.suggest import close_matches

# The one definition of how memplan checkpoints: non-reentrant, with the RNG state saved and
# restored around the recompute so that dropout masks match the forward.
CHECKPOINT_SETTINGS: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}

# A checkpoint context factory: () -> (forward context, recompute context), as
# torch.utils.checkpoint's ``context_fn``.
ContextFn = Callable[[], tuple[Any, Any]]

# Keys in a patched module's __dict__. Instance attributes, not submodules, parameters or
# buffers, so ``named_modules()`` and ``state_dict()`` keys do not change.
_MARK = "_memplan_checkpointed"  # the module's mode
_CONTEXT = "_memplan_context_fn"  # extra checkpoint contexts (the meta probe's autocast)
_SAVED_FORWARD = "_memplan_saved_forward"
_PATCH_KEYS = ("forward", _SAVED_FORWARD, _MARK, _CONTEXT)


class _Missing:
    """The instance had no forward of its own (the usual case). One object, kept one by
    ``copy.deepcopy`` and pickle (both reduce it to this module's ``_MISSING``): a bare
    ``object()`` became a new object in a copy, which then called it as its forward."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "_MISSING"

    def __repr__(self) -> str:
        return "<no forward of its own>"


_MISSING = _Missing()

_MAX_LISTED_NAMES = 30

_save_overloads: tuple[frozenset[Any], frozenset[Any]] | None = None


def _selective_ops() -> tuple[frozenset[Any], frozenset[Any]]:
    """The ``.default`` overloads of memplan.modes.SAVE_OPS and COUNTED_MATMULS this torch
    has (torchtitan matches ``.default`` overloads), in ``aten`` or ``_c10d_functional``."""
    global _save_overloads
    if _save_overloads is None:

        def overloads(names: tuple[str, ...]) -> frozenset[Any]:
            found = []
            for name in names:
                for namespace in (torch.ops.aten, torch.ops._c10d_functional):
                    try:
                        found.append(getattr(namespace, name).default)
                        break
                    except (AttributeError, RuntimeError):  # an op this build lacks
                        continue
            return frozenset(found)

        _save_overloads = (overloads(SAVE_OPS), overloads(COUNTED_MATMULS))
    return _save_overloads


def counted_matmuls() -> frozenset[Any]:
    """The op overloads the ``selective`` mode counts (memplan.modes.COUNTED_MATMULS): every
    second of them in a checkpointed call is recomputed."""
    return _selective_ops()[1]


def selective_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh policy for one checkpointed call: torchtitan's ``SelectiveAC`` (memplan.modes
    .SAVE_OPS): keep the outputs of the save-list ops, except every second matmul, counted
    from the call's first; recompute everything else. PyTorch asks the policy during the
    forward only (torch 2.13 ``_CachingTorchDispatchMode``; the recompute replays what the
    forward decided), so one counter per call is torchtitan's ``forward_mm_count``."""
    save, counted = _selective_ops()
    matmuls = 0

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        nonlocal matmuls
        del ctx, args, kwargs
        if op in counted:
            matmuls += 1
            if matmuls % RECOMPUTE_EVERY_NTH_MATMUL == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(extra: ContextFn | None = None) -> tuple[Any, Any]:
    """checkpoint's ``context_fn`` for the ``selective`` mode; ``extra`` adds contexts of
    its own to the forward and the recompute (the meta probe's autocast and attention
    kernels, which checkpoint cannot restore), entered around SAC's."""
    forward, recompute = create_selective_checkpoint_contexts(selective_policy())
    if extra is None:
        return forward, recompute
    extra_forward, extra_recompute = extra()
    return _Entered(extra_forward, forward), _Entered(extra_recompute, recompute)


class _Entered:
    """Several contexts as one, entered in order. A class, not a ``@contextmanager``
    generator: checkpoint stops a recompute early by raising through the recompute
    context, and a generator's frame changed when the block's tensors were released
    (a meta probe's selective backward held one activation less than the cpu probe's)."""

    def __init__(self, *contexts: Any) -> None:
        self._contexts = contexts
        self._stack: ExitStack | None = None

    def __enter__(self) -> None:
        self._stack = ExitStack()
        for context in self._contexts:
            self._stack.enter_context(context)

    def __exit__(self, *exc: Any) -> bool:
        stack, self._stack = self._stack, None
        return bool(stack is not None and stack.__exit__(*exc))


def require_offload_device() -> None:
    """``offload`` copies saved tensors to pinned host memory: it needs CUDA."""
    if not torch.cuda.is_available():
        raise BadInputError(
            "The plan offloads layers to host memory, which needs a CUDA device; this "
            "machine has none.",
            hint="Solve for this device without offload (--modes keep,selective,full).",
        )


def run_in_mode(
    mode: str, forward: Any, *args: Any, context_fn: ContextFn | None = None, **kwargs: Any
) -> Any:
    """``forward(*args, **kwargs)`` in ``mode``: ``full`` and ``selective`` through
    checkpoint with :data:`CHECKPOINT_SETTINGS`, ``offload`` under
    ``torch.autograd.graph.save_on_cpu(pin_memory=True)``. ``context_fn`` replaces ``full``
    mode's (empty) checkpoint contexts, and is entered around ``selective`` mode's."""
    if mode == FULL:
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return checkpoint(forward, *args, **CHECKPOINT_SETTINGS, **extra, **kwargs)
    if mode == SELECTIVE:
        return checkpoint(
            forward,
            *args,
            **CHECKPOINT_SETTINGS,
            context_fn=lambda: selective_context_fn(context_fn),
            **kwargs,
        )
    if mode == OFFLOAD:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return forward(*args, **kwargs)
    if mode == KEEP:
        return forward(*args, **kwargs)
    raise ValueError(f"unknown mode {mode!r}")


# --------------------------------------------------------------------------- the patch


def _patched_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Bound to a module instance as its ``forward``."""
    saved = self.__dict__.get(_SAVED_FORWARD, _MISSING)
    inner = type(self).forward.__get__(self) if saved is _MISSING else saved
    # Recompute only pays off when something is saved for backward: training with grad on.
    if self.training and torch.is_grad_enabled():
        mode = self.__dict__.get(_MARK)
        return run_in_mode(
            mode if isinstance(mode, str) else FULL,
            inner,
            *args,
            context_fn=self.__dict__.get(_CONTEXT),
            **kwargs,
        )
    return inner(*args, **kwargs)


class _PatchedForward:
    """``_patched_forward`` bound to one module: an object, not ``types.MethodType``, so a
    patched model pickles (a bound method pickles as ``getattr(module, its name)``, which no
    module has) and a deep copy binds its own module (the memo maps ``__self__``)."""

    __slots__ = ("__self__",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.__self__ = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _patched_forward(self.__self__, *args, **kwargs)


def _patch(module: torch.nn.Module, mode: str, context_fn: ContextFn | None = None) -> None:
    """Run ``module`` in ``mode`` from now on (an already patched module changes mode)."""
    state = module.__dict__
    if not state.get(_MARK):
        state[_SAVED_FORWARD] = state.get("forward", _MISSING)
        state["forward"] = _PatchedForward(module)
    state[_MARK] = mode
    if context_fn is None:
        state.pop(_CONTEXT, None)
    else:
        state[_CONTEXT] = context_fn


def _unpatch(module: torch.nn.Module) -> None:
    state = module.__dict__
    saved = state.pop(_SAVED_FORWARD, _MISSING)
    if saved is _MISSING:
        state.pop("forward", None)
    else:
        state["forward"] = saved
    state.pop(_MARK, None)
    state.pop(_CONTEXT, None)


@contextmanager
def modes_applied(
    modes: Iterable[tuple[torch.nn.Module, str]], *, context_fn: ContextFn | None = None
) -> Iterator[None]:
    """Within the block, each module runs in its mode; on exit every module gets back exactly
    what it had (its own ``forward`` or none, and any patch ``apply`` had made)."""
    before: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    try:
        for module, mode in modes:
            before.append((module, {k: module.__dict__.get(k, _MISSING) for k in _PATCH_KEYS}))
            _patch(module, mode, context_fn if mode in (FULL, SELECTIVE) else None)
        yield
    finally:
        for module, state in reversed(before):
            for key, value in state.items():
                if value is _MISSING:
                    module.__dict__.pop(key, None)
                else:
                    module.__dict__[key] = value


@contextmanager
def checkpointed(
    modules: Iterable[torch.nn.Module], *, context_fn: ContextFn | None = None
) -> Iterator[None]:
    """Within the block, each of ``modules`` runs fully checkpointed. ``context_fn`` is
    checkpoint's (forward context, recompute context) factory; the meta backend uses it to
    recompute under its own autocast, which checkpoint cannot restore."""
    with modes_applied(((m, FULL) for m in modules), context_fn=context_fn):
        yield


@contextmanager
def in_mode(
    modules: Iterable[torch.nn.Module], mode: str, *, context_fn: ContextFn | None = None
) -> Iterator[None]:
    """Within the block, each of ``modules`` runs in ``mode`` (see :func:`run_in_mode`;
    ``context_fn`` as there)."""
    with modes_applied(((m, mode) for m in modules), context_fn=context_fn):
        yield


# --------------------------------------------------------------------------- by name


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP / DataParallel / torch.compile wrappers: plan names are
    fully-qualified names in the unwrapped model."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def layer_modes(plan: Plan | Mapping[str, str] | Iterable[str]) -> dict[str, str]:
    """Module name -> mode of every layer not kept: a Plan's ``checkpoint``, a mapping of
    name to mode, or names (one string or several, every one ``full``)."""
    if isinstance(plan, Plan):
        modes: Mapping[str, str] = plan.checkpoint
    elif isinstance(plan, Mapping):
        modes = plan
    elif isinstance(plan, str):
        return {plan: FULL}
    elif isinstance(plan, Iterable):
        return dict.fromkeys((str(name) for name in plan), FULL)
    else:
        raise BadInputError(
            f"apply() needs a memplan Plan, a mapping of module name to mode, or module "
            f"names; got {type(plan).__name__}."
        )
    out = {}
    for name, mode in modes.items():
        if mode not in MODES:
            raise BadInputError(
                f"apply(): module {name!r} has mode {mode!r}.",
                hint=f"Modes are {', '.join(MODES)}.",
            )
        if mode != KEEP:
            out[str(name)] = mode
    return out


def _unknown_name_error(name: str, valid: list[str]) -> BadInputError:
    close = close_matches(name, valid, n=5, cutoff=0.5)
    rest = [n for n in valid if n not in close]
    listed = close + rest[: max(0, _MAX_LISTED_NAMES - len(close))]
    more = len(valid) - len(listed)
    tail = f", … and {more} more" if more > 0 else ""
    did_you_mean = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return BadInputError(
        f"Module {name!r} is not in the model.{did_you_mean}",
        hint=f"Valid module names (closest first): {', '.join(listed)}{tail}.",
    )


def _has_batchnorm_with_stats(module: torch.nn.Module) -> bool:
    return any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
        for m in module.modules()
    )


def apply(model: torch.nn.Module, plan: Plan | Mapping[str, str] | Iterable[str]) -> list[str]:
    """Checkpoint exactly the named modules of ``model``, each in its mode (see
    :func:`run_in_mode`).

    ``plan`` is a memplan ``Plan`` (its ``checkpoint``: each layer in its mode, ``full``,
    ``selective`` or ``offload``; see memplan.modes), a mapping of module name to mode, or
    fully-qualified module names (``full``). ``offload`` needs CUDA and is refused without
    it. Names are looked up in the unwrapped model (through DDP, DataParallel and
    ``torch.compile``). No wrapper module is inserted, so module names and ``state_dict``
    keys do not change.

    Idempotent: afterwards exactly the named modules are checkpointed — modules checkpointed
    by an earlier call but not named now are restored. Checkpointing happens only while the
    module is training and grad is enabled. Warns when a checkpointed module contains
    BatchNorm (its running statistics update again during the recompute).

    It also switches off a Hugging Face model's key/value cache (``config.use_cache``), as
    ``gradient_checkpointing_enable`` does, and warns once: the cache breaks recompute, and
    the probe measured the model without it, so a plan's prediction holds only without it.

    Returns the names now checkpointed. Raises ``BadInputError`` for a name not in the
    model, listing valid names with the closest matches first."""
    root = unwrap(model)
    wanted = layer_modes(plan)  # ordered, duplicates dropped
    modules = dict(root.named_modules(remove_duplicate=False))
    for name in wanted:
        if name not in modules:
            raise _unknown_name_error(name, [n for n in modules if n])
    if OFFLOAD in wanted.values():
        require_offload_device()

    for name in checkpointed_names(root):
        if name not in wanted:
            _unpatch(modules[name])

    for note in (
        kv_cache_note(disable_kv_cache(root)),
        hf_checkpointing_note(disable_hf_checkpointing(root)),
    ):
        if note:
            warnings.warn(f"memplan: {note}", UserWarning, stacklevel=2)

    with_batchnorm = []
    for name, mode in wanted.items():
        if _has_batchnorm_with_stats(modules[name]):
            with_batchnorm.append(name)
        _patch(modules[name], mode)
    if with_batchnorm:
        warnings.warn(
            f"memplan: checkpointed module(s) {', '.join(with_batchnorm)} contain BatchNorm: "
            "its running statistics are updated twice per step (once more in the recompute "
            "during backward). Leave these modules out of checkpoint_layers, or accept "
            "slightly different running statistics.",
            UserWarning,
            stacklevel=2,
        )
    return list(wanted)


def remove(model: torch.nn.Module) -> list[str]:
    """Undo ``apply``: restore the original ``forward`` of every checkpointed module.
    Returns the names that were restored."""
    root = unwrap(model)
    restored = checkpointed_names(root)
    modules = dict(root.named_modules(remove_duplicate=False))
    for name in restored:
        _unpatch(modules[name])
    return restored


def checkpointed_modes(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> mode of every module ``apply`` has patched, in module order."""
    return {
        name: module.__dict__[_MARK]
        for name, module in unwrap(model).named_modules(remove_duplicate=False)
        if module.__dict__.get(_MARK)
    }


def checkpointed_names(model: torch.nn.Module) -> list[str]:
    """Fully-qualified names of the modules ``apply`` has checkpointed, in module order."""
    return list(checkpointed_modes(model))
