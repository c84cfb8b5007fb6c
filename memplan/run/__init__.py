"""The torch wing that runs a plan: checkpointing by module name (``apply`` / ``remove``,
memplan.run.checkpoint), gradient accumulation (``Accumulator``), the training state that
checkpointing must switch off (memplan.run.training_state), compiling a compiled plan's
layers (memplan.run.compile), the data-parallel wrapping
(memplan.run.wrap) and a parallel layout (memplan.run.parallel). It imports neither the
probe nor verify: both build on it. Names are loaded on first use."""

from __future__ import annotations

from memplan.lazy import loader

_HOMES = {
    "Accumulator": "accumulate",
    "move_to_device": "accumulate",
    "apply": "checkpoint",
    "compile_layers": "compile",
    "checkpointed_modes": "checkpoint",
    "checkpointed_names": "checkpoint",
    "layer_modes": "checkpoint",
    "remove": "checkpoint",
    "run_in_mode": "checkpoint",
    "disable_kv_cache": "training_state",
    "disable_layerdrop": "training_state",
    "kv_cache_note": "training_state",
    "layerdrop_note": "training_state",
    "no_dropout": "training_state",
}

__all__ = sorted(_HOMES)


__getattr__ = loader(__name__, _HOMES)
