"""Which modules are checkpoint candidates ("layers"), and which are fixed parts.

Candidates default to the repeated blocks (``default_layers`` says how they are found); a
glob over fully-qualified names overrides that. Fixed parts are the largest subtrees that hold no candidate: embeddings,
final norm, head.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from memplan.errors import BadInputError


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_layers(model: nn.Module) -> list[str]:
    """Fully-qualified names of the repeated blocks (empty when the model has none), in
    module order.

    A Hugging Face model says which classes are its blocks (``_no_split_modules``: what
    ``device_map`` never splits and ``gradient_checkpointing_enable`` checkpoints); those
    that occur more than once are the candidates, outermost first (T5's ``encoder.block.*``
    and ``decoder.block.*``; a PEFT wrapper's inner model too). Otherwise the repeated blocks
    of every stage: the children of each innermost ``nn.ModuleList``/``nn.Sequential`` whose
    children are two or more modules of one type that have submodules of their own
    (ResNet's ``layer1``–``layer4`` blocks, ConvNeXt's blocks in every stage). Failing both,
    the children of the largest container of same-type children (a stack of plain layers).

    When those hold less than ``MIN_COVERAGE`` of the model's layers (modules with
    parameters of their own: MobileNetV3-small's 6 repeated blocks hold 12 of its 88), every block of
    every stage is a candidate instead (``default_candidates`` says so)."""
    return default_candidates(model)[0]


MIN_COVERAGE = 0.5
"""Least share of the model's layers (modules with parameters of their own) that the
default candidates hold before memplan looks a level deeper (``default_candidates``)."""


def default_candidates(model: nn.Module) -> tuple[list[str], str | None]:
    """The default candidates (``default_layers``) and, when the repeated blocks covered
    too little of the model and every block is taken instead, a note that says so."""
    names = _declared_blocks(model) or _stage_blocks(model) or _largest_repeat(model)
    covered = coverage(model, names)
    if covered >= MIN_COVERAGE:
        return names, None
    deeper = _every_block(model)
    if coverage(model, deeper) <= covered:
        return names, None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") if names else "none"
    return deeper, (
        f"the repeated blocks ({shown}) hold {covered:.0%} of the model's layers, so every "
        f"block is a candidate instead: {len(deeper)} blocks, {deeper[0]} to {deeper[-1]} "
        "(choose others with --layers GLOB)"
    )


def coverage(model: nn.Module, names: list[str]) -> float:
    """Share of the model's modules with parameters of their own that lie in ``names``."""
    own = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if not own:
        return 0.0
    chosen = set(names)  # a module lies in a name when it or one of its parents is it:
    # checked by its dotted prefixes, not against every name (10,000 blocks: 10^8 compares)
    inside = [n for n in own if any(p in chosen for p in _prefixes(n))]
    return len(inside) / len(own)


def _inside_any(name: str, names: set[str]) -> bool:
    """Whether a parent of module ``name`` (not the module itself) is one of ``names``."""
    return any(p in names for p in itertools.islice(_prefixes(name), 1, None))


def _prefixes(name: str) -> Iterator[str]:
    """``a.b.c``, ``a.b``, ``a``: the module's own name and each parent's (the root's, "",
    only itself, as ``n == c`` had it)."""
    yield name
    while "." in name:
        name = name.rpartition(".")[0]
        yield name


def _every_block(model: nn.Module) -> list[str]:
    """Every block of every stage: the children (with submodules) of the container that
    holds the most of the model's layers, a child that is itself a stage (a container of
    blocks) giving way to its blocks."""
    best: tuple[float, list[str]] = (0.0, [])
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        prefix = f"{name}." if name else ""
        blocks: list[str] = []
        for child_name, child in module.named_children():
            inner = list(child.named_children())
            if not inner:
                continue
            stage = isinstance(child, nn.ModuleList | nn.Sequential) and all(
                any(True for _ in c.children()) for _, c in inner
            )
            if stage:
                blocks.extend(f"{prefix}{child_name}.{n}" for n, _ in inner)
            else:
                blocks.append(prefix + child_name)
        if len(blocks) >= 2:
            share = coverage(model, blocks)
            if share > best[0]:
                best = (share, blocks)
    return best[1]


def _declared_blocks(model: nn.Module) -> list[str]:
    declared: set[str] = set()
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if isinstance(names, list | tuple | set):
            declared.update(str(n) for n in names)
    if not declared:
        return []
    named = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in declared]
    counts: dict[str, int] = {}
    for _, m in named:
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    out: list[str] = []
    kept: set[str] = set()
    for name, module in named:
        if counts[type(module).__name__] < 2 or _inside_any(name, kept):
            continue
        out.append(name)
        kept.add(name)
    return out


def _repeats(module: nn.Module) -> bool:
    """A container whose children are two or more modules of one type, each with
    submodules (blocks, not a stack of plain layers)."""
    if not isinstance(module, nn.ModuleList | nn.Sequential):
        return False
    children = list(module.children())
    return (
        len(children) >= 2
        and len({type(child) for child in children}) == 1
        and any(True for _ in children[0].children())
    )


def _stage_blocks(model: nn.Module) -> list[str]:
    """Children of the outermost repeating containers; a ``Sequential`` whose children are
    stages (each holding a repeating container of its own, as ConvNeXt's ``stages``) gives
    way to those inner containers. A ``ModuleList`` is not descended: its children are the
    blocks even when each holds a list of its own (a mixture of experts)."""

    def outermost(root: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        found = []
        for name, module in root.named_children():
            full = prefix + name
            if _repeats(module):
                found.append((full, module))
            else:
                found.extend(outermost(module, full + "."))
        return found

    def blocks(name: str, container: nn.Module) -> list[str]:
        children = list(container.named_children())
        inner = [outermost(child, f"{name}.{child_name}.") for child_name, child in children]
        if isinstance(container, nn.Sequential) and all(inner):
            return [b for found in inner for n, c in found for b in blocks(n, c)]
        return [f"{name}.{child_name}" for child_name, _ in children]

    roots = [("", model)] if _repeats(model) else outermost(model, "")
    out = []
    for name, container in roots:
        if name:
            out.extend(blocks(name, container))
        else:
            out.extend(child for child, _ in container.named_children())
    return out


def _largest_repeat(model: nn.Module) -> list[str]:
    best: tuple[int, int, list[str]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(child) for _, child in children}) != 1:
            continue
        prefix = f"{name}." if name else ""
        key = (len(children), _param_count(module), [prefix + child for child, _ in children])
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else []


def glob_layers(model: nn.Module, pattern: str) -> list[str]:
    """Modules whose fully-qualified name matches ``pattern`` (comma-separated globs),
    outermost only: a match inside another match is dropped."""
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    names = [n for n, _ in model.named_modules() if n]
    matched = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    chosen = set(matched)
    outer = [n for n in matched if not _inside_any(n, chosen)]
    if not outer:
        examples = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise BadInputError(
            f"--layers {pattern!r} matches no module of the model.",
            hint=f"Globs match fully-qualified module names, e.g. {examples}.",
        )
    return outer


def fixed_parts(model: nn.Module, layer_names: list[str]) -> list[str]:
    """The largest subtrees that contain no candidate and are not inside one. A plain
    container (``nn.ModuleList``, ``nn.ModuleDict``) has no forward of its own, so its
    children are the parts: each runs, and is recorded (blocks left out of the candidates,
    such as layers whose recompute does not match their forward)."""
    layer_set = set(layer_names)
    ancestors = {""}
    for name in layer_names:
        parts = name.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    out = []
    for name, module in model.named_modules():  # parents before children
        if not name or name in layer_set or name in ancestors:
            continue
        parent = name.rpartition(".")[0]
        if parent not in ancestors:
            continue
        if type(module) in (nn.ModuleList, nn.ModuleDict) and len(module):
            ancestors.add(name)
        else:
            out.append(name)
    return out


def own_params_owners(model: nn.Module, layer_names: list[str]) -> list[str]:
    """Ancestors of candidates (the root included) that hold parameters directly."""
    layer_set = set(layer_names)
    ancestors = {""}
    for name in layer_names:
        parts = name.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    modules = dict(model.named_modules())
    return [
        n
        for n in sorted(ancestors)
        if n in modules
        and n not in layer_set
        and any(True for _ in modules[n].parameters(recurse=False))
    ]


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def param_bytes(module: nn.Module, *, recurse: bool = True) -> tuple[int, int]:
    """(trainable, frozen) parameter bytes, each parameter once."""
    seen: dict[int, torch.nn.Parameter] = {}
    for p in module.parameters(recurse=recurse):
        seen[id(p)] = p
    trainable = sum(p.numel() * p.element_size() for p in seen.values() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in seen.values() if not p.requires_grad)
    return trainable, frozen


def hf_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """The modules Hugging Face's ``gradient_checkpointing_enable()`` checkpoints, by name:
    those of a ``_no_split_modules`` class of a transformers model (or of the model a peft
    wrapper holds) that transformers can checkpoint (a ``GradientCheckpointingLayer``,
    where this transformers has that class). Empty for any other model."""
    import sys

    if "transformers" not in sys.modules:
        return ()
    inner = model
    for _ in range(3):  # peft: PeftModel.base_model (LoraModel).model (the PreTrainedModel)
        if hasattr(inner, "_no_split_modules") or not hasattr(inner, "base_model"):
            break
        inner = getattr(inner, "base_model", inner)
        inner = getattr(inner, "model", inner)
    kinds = set(getattr(inner, "_no_split_modules", None) or ())
    if not kinds or not getattr(inner, "supports_gradient_checkpointing", False):
        return ()
    layer = getattr(
        sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None
    )
    return tuple(
        name
        for name, m in model.named_modules()
        if type(m).__name__ in kinds and (layer is None or isinstance(m, layer))
    )
