"""Which modules tensor parallelism splits, and how (issue 25): a model's TP plan as a
mapping of module-name pattern (``*`` matches one name component, as in transformers'
plans) to style (``colwise``, ``rowwise``, …).

Hugging Face models bring their own (``model._tp_plan`` and the config's
``base_model_tp_plan``, prefixed with the base model's attribute name); a model file may
declare ``TP_PLAN`` (a dict) or define ``tp_plan(model)``. Without one, TP is refused."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from typing import Any

import torch

from memplan.errors import BadInputError


def hf_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The TP plan a transformers model declares (empty when it declares none): the config's
    ``base_model_tp_plan`` under the base model's prefix, then the model's own ``_tp_plan``
    (e.g. ``lm_head``), as transformers' ``PreTrainedModel`` combines them."""
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base_attr = bool(prefix) and isinstance(getattr(model, prefix, None), torch.nn.Module)
    for pattern, style in base.items():
        plan[f"{prefix}.{pattern}" if has_base_attr else pattern] = str(style)
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping):
        plan.update({str(k): str(v) for k, v in own.items()})
    return plan


def tp_plan_for(model: torch.nn.Module, declared: Any = None) -> dict[str, str]:
    """The model's TP plan: ``declared`` (a model file's ``TP_PLAN`` or the result of its
    ``tp_plan(model)``) if given, else the Hugging Face plan. Raises BadInputError naming
    what to add when there is none."""
    plan = dict(declared) if declared else hf_tp_plan(model)
    if not plan:
        raise BadInputError(
            f"{type(model).__name__} declares no tensor-parallel plan, so memplan cannot tell "
            "which modules to split.",
            hint="Add TP_PLAN = {'layers.*.attn.q_proj': 'colwise', …, "
            "'layers.*.attn.o_proj': 'rowwise', …} to the model file (module-name patterns "
            "to colwise/rowwise), or plan without tensor parallelism (--tp 1).",
        )
    return plan


def tp_degree_divides(model: torch.nn.Module, modules: Mapping[str, str]) -> int:
    """The greatest common divisor of the model's attention and key/value head counts and of
    every dimension ``modules`` (name -> style) splits: colwise linears' output features,
    rowwise linears' input features. A TP degree splits the model evenly, whole heads per
    rank, only when it divides this (memplan.run.parallel.check_tp_divisible refuses the
    rest at run time)."""
    out = 0
    for heads in _head_counts(model):
        out = math.gcd(out, heads)
    named = dict(model.named_modules())
    for name, style in modules.items():
        module = named.get(name)
        if isinstance(module, torch.nn.Linear) and style.startswith(("colwise", "rowwise")):
            out = math.gcd(out, int(module.weight.shape[0 if style.startswith("colwise") else 1]))
    return out or 1


_HEAD_COUNTS = frozenset(
    {
        "num_attention_heads",
        "num_key_value_heads",
        "num_heads",
        "num_kv_heads",
        "n_heads",
        "n_head",
        "n_kv_heads",
        "heads",
        "kv_heads",
    }
)
"""Attribute names that count attention heads (transformers' configs and modules,
``nn.MultiheadAttention``, and the usual spellings of model files)."""


def _head_counts(model: torch.nn.Module) -> set[int]:
    """Every head count the model states: an int attribute of ``_HEAD_COUNTS`` on a module,
    or on a plain object a module holds (a config, a shape dataclass: ``self.config``,
    ``self.s``). A model file's TP degree must split whole heads too, and its linears'
    sizes alone do not say so: Llama 3.1 8B's are all multiples of 256, its key/value heads
    8 (before, a model file was offered TP 16, whose ranks would hold half a head)."""
    found: set[int] = set()
    seen: set[int] = set()
    for module in model.modules():
        holders = [module, *(v for v in vars(module).values() if _plain(v))]
        for holder in holders:
            if id(holder) in seen:
                continue
            seen.add(id(holder))
            for name in _HEAD_COUNTS:
                value = getattr(holder, name, None)  # a config's aliases too (attribute_map)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.add(value)
    return found


def _plain(value: object) -> bool:
    """A plain object that may hold head counts: not a tensor, module, container or
    primitive."""
    return hasattr(value, "__dict__") and not isinstance(
        value, torch.nn.Module | torch.Tensor | type
    )


def tp_modules(model: torch.nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Fully-qualified module name -> style for every module ``plan`` matches (a ``*``
    stands for one name component)."""
    out: dict[str, str] = {}
    for name, _ in model.named_modules():
        if not name:
            continue
        parts = name.split(".")
        for pattern, style in plan.items():
            pat = pattern.split(".")
            if len(pat) == len(parts) and all(
                fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pat, strict=True)
            ):
                out[name] = style
                break
    return out
