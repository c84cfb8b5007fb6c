"""Which modules are checkpoint candidates ("layers"), and which are fixed parts.

Candidates default to the children of the largest ``nn.ModuleList``/``nn.Sequential`` whose
children are all of one type (the repeated blocks); a glob over fully-qualified names
overrides that. Fixed parts are the largest subtrees that hold no candidate: embeddings,
final norm, head.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from memplan.errors import BadInputError


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_layers(model: nn.Module) -> list[str]:
    """Fully-qualified names of the repeated blocks (empty when the model has none)."""
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
    outer = [n for n in matched if not any(n.startswith(m + ".") for m in matched if m != n)]
    if not outer:
        examples = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise BadInputError(
            f"--layers {pattern!r} matches no module of the model.",
            hint=f"Globs match fully-qualified module names, e.g. {examples}.",
        )
    return outer


def fixed_parts(model: nn.Module, layer_names: list[str]) -> list[str]:
    """The largest subtrees that contain no candidate and are not inside one."""
    layer_set = set(layer_names)
    ancestors = {""}
    for name in layer_names:
        parts = name.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    out = []
    for name, _ in model.named_modules():
        if not name or name in layer_set or name in ancestors:
            continue
        parent = name.rpartition(".")[0]
        if parent in ancestors:
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
