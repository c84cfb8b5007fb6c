"""DeepSpeed config JSON.

DeepSpeed requires ``train_batch_size == train_micro_batch_size_per_gpu ×
gradient_accumulation_steps × number of GPUs`` (DeepSpeed config-json docs, "Batch Size
Related Parameters"); all three are written, so DeepSpeed checks the plan against the GPUs it
is launched on. ``gradient_clipping`` is 1.0, the common default (the plan does not decide
clipping). ZeRO stage 0: the memory model does not yet account for sharded optimizer state.

No ``activation_checkpointing`` section: it only configures DeepSpeed's own
``deepspeed.checkpointing.checkpoint`` (partitioning checkpoints across model-parallel ranks,
CPU offload, contiguous buffers), not which layers are checkpointed. The plan's layers are
applied with ``memplan.apply(model, plan)`` before ``deepspeed.initialize``. JSON has no
comments, so that note lives here and in the CLI output.
"""

from __future__ import annotations

import json

from memplan.plan import Plan

DEFAULT_GRADIENT_CLIPPING = 1.0


def deepspeed_config(plan: Plan) -> dict:
    return {
        "train_batch_size": plan.micro_batch_size * plan.accumulation_steps * plan.world_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "zero_optimization": {"stage": 0},
    }


def emit_deepspeed(plan: Plan, *, model_path: str | None = None) -> str:
    """DeepSpeed JSON (``model_path`` unused: the config does not name the model)."""
    del model_path
    return json.dumps(deepspeed_config(plan), indent=2) + "\n"
