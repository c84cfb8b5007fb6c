"""The plan's FSDP units as an auto-wrap policy for FSDP1 wrappers that take one
(Lightning's ``FSDPStrategy``): each module whose class is one of the plan's
``shard_unit_types`` is its own unit, as memplan's runtime and the plan shard them. Named by
class name rather than by class, so a config file can give it without importing the model
(``memplan.wrap.PlanUnits``, as the Lightning format writes it). Without a policy, Lightning's
``strategy: fsdp`` wraps the root alone: every parameter gathered whole through the forward
and the backward."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class PlanUnits(ModuleWrapPolicy):
    """FSDP1 auto-wrap policy: a unit for each module whose class name is in ``class_names``
    (``Plan.shard_unit_types``)."""

    def __init__(self, class_names: Iterable[str]) -> None:
        super().__init__(())
        self.class_names = frozenset(class_names)

    def _run_policy(
        self,
        root_module: torch.nn.Module,
        ignored_modules: set[torch.nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[torch.nn.Module, dict[str, Any]]:
        return {
            module: copy.copy(root_kwargs)
            for module in root_module.modules()
            if module not in ignored_modules and type(module).__name__ in self.class_names
        }
