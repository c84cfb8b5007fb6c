"""Compile a model as a compiled plan was timed: each of its layers on its own.

``probe --compiled`` times the step with inductor's fused kernels, a fused region ending at
every layer boundary (docs/design.md, "A compiled step"): the way torchtitan compiles a
decoder, ``transformer_block.compile(...)`` for each block, after activation checkpointing
and before FSDP2 (torchtitan 0.3.0 ``torchtitan/distributed/compile.py`` ``apply_compile``).
``compile_layers`` does the same for the plan's layers (the profile's layers, which the plan
records in ``model_fingerprint.candidate_layers``), so an emitted script trains the step the
plan timed. ``Module.compile`` compiles in place: module names, ``state_dict`` keys and
memplan's checkpointing (a patched ``forward``, memplan.run.checkpoint) are unchanged.
"""

from __future__ import annotations

import torch

from memplan.errors import BadInputError
from memplan.plan import Plan


def compile_layers(model: torch.nn.Module, plan: Plan) -> list[str]:
    """Compile each of ``plan``'s layers of ``model`` in place (``Module.compile``), or the
    whole model when the plan names none (a plan without the profile's fingerprint).
    Nothing is compiled for a plan that was not timed compiled. Returns the names compiled
    (``""`` for the whole model). A layer the model does not have is a BadInputError: the
    plan was made for another model."""
    if not plan.compiled:
        return []
    fingerprint = plan.model_fingerprint
    names = list(fingerprint.candidate_layers) if fingerprint is not None else []
    if not names:
        model.compile()
        return [""]
    modules = dict(model.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        raise BadInputError(
            f"The plan's layer {missing[0]!r} is not a module of this model, so its layers "
            "cannot be compiled as the plan timed them.",
            hint="Use the model the plan was solved for (plan.model), or solve again from a "
            "profile of this one.",
        )
    for name in names:
        modules[name].compile()
    return names
