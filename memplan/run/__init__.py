"""The torch wing that runs a plan: checkpointing by module name (``apply`` / ``remove``,
memplan.run.checkpoint), gradient accumulation (``Accumulator``), the training state that
checkpointing must switch off (memplan.run.training_state) and the data-parallel wrapping
(memplan.run.wrap). It imports neither the probe nor verify: both build on it."""

from __future__ import annotations

from memplan.run.accumulate import Accumulator, move_to_device
from memplan.run.checkpoint import (
    apply,
    checkpointed_modes,
    checkpointed_names,
    layer_modes,
    remove,
    run_in_mode,
)
from memplan.run.training_state import disable_kv_cache, kv_cache_note, no_dropout

__all__ = [
    "Accumulator",
    "apply",
    "checkpointed_modes",
    "checkpointed_names",
    "disable_kv_cache",
    "kv_cache_note",
    "layer_modes",
    "move_to_device",
    "no_dropout",
    "remove",
    "run_in_mode",
]
