"""DeepSpeed config JSON.

DeepSpeed requires ``train_batch_size == train_micro_batch_size_per_gpu ×
gradient_accumulation_steps × number of GPUs`` (DeepSpeed config-json docs, "Batch Size
Related Parameters"); all three are written, so DeepSpeed checks the plan against the GPUs it
is launched on. ``gradient_clipping`` is 1.0, the common default (the plan does not decide
clipping).

``zero_optimization.stage`` follows the plan's strategy: ddp → 0, zero1 → 1, zero2 → 2,
fsdp → 3 (ZeRO-3 shards parameters as FSDP does; memplan's per-rank model is FSDP2's, with
its unit-by-unit all-gathers: DeepSpeed's prefetch buckets are sized to match roughly, not
exactly). For stage 2 the ``reduce_bucket_size`` memplan's model assumes is written
explicitly (memplan.memory.Sharding.zero2_bucket_elements), so the config and the prediction
agree.

No ``activation_checkpointing`` section: it only configures DeepSpeed's own
``deepspeed.checkpointing.checkpoint`` (partitioning checkpoints across model-parallel ranks,
CPU offload, contiguous buffers), not which layers are checkpointed. The plan's layers are
applied with ``memplan.apply(model, plan)`` before ``deepspeed.initialize``. JSON has no
comments, so that note lives here and in what ``memplan solve`` prints (``deepspeed_notes``),
with, for a plan timed compiled (``probe --compiled``), how to compile: DeepSpeed's engine
compiles its module in place on ``model_engine.compile()`` (deepspeedai/DeepSpeed#5581);
its config's ``compile`` section has meant different things across releases
(``disable``/``backend`` when torch.compile support came, deepspeedai/DeepSpeed#4878;
DeepCompile's switches since #7154), so none is written.
"""

from __future__ import annotations

import json

from memplan.emit._common import apply_snippet
from memplan.plan import Plan

STRATEGIES = frozenset({"ddp", "zero1", "zero2", "fsdp"})
"""Plan strategies this format writes faithfully: ZeRO stage 0, 1, 2; fsdp as stage 3 (parameters sharded too)."""


DEFAULT_GRADIENT_CLIPPING = 1.0
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
# memplan.memory.Sharding.zero2_bucket_elements; repeated here so the emitter stays pure text
ZERO2_REDUCE_BUCKET_ELEMENTS = 500_000_000


def zero_section(plan: Plan) -> dict:
    stage = ZERO_STAGE[plan.strategy]
    section: dict = {"stage": stage}
    if stage == 2:
        section.update(
            reduce_bucket_size=ZERO2_REDUCE_BUCKET_ELEMENTS,
            contiguous_gradients=True,
            overlap_comm=False,
        )
    return section


def deepspeed_config(plan: Plan) -> dict:
    return {
        "train_batch_size": plan.micro_batch_size * plan.accumulation_steps * plan.world_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "zero_optimization": zero_section(plan),
    }


def deepspeed_notes(plan: Plan) -> list[str]:
    """What the JSON cannot say: the plan's checkpointed layers and its compiled step."""
    notes = []
    if plan.checkpoint_layers:
        apply_line = apply_snippet(indent="")[-1]
        notes.append(
            f"checkpoint the plan's layers with {apply_line} before deepspeed.initialize "
            "(the config has no such setting)"
        )
    if plan.compiled:
        notes.append(
            "the step was timed as torch.compile runs it: call model_engine.compile() after "
            "deepspeed.initialize, or it trains eager and slower than planned"
        )
    return notes


def emit_deepspeed(plan: Plan, *, model_path: str | None = None) -> str:
    """DeepSpeed JSON (``model_path`` unused: the config does not name the model)."""
    del model_path
    return json.dumps(deepspeed_config(plan), indent=2) + "\n"
