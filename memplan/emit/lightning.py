"""Lightning ``LightningCLI`` config YAML (``python main.py fit --config ...``): the
``trainer`` section only. Precision strings are Lightning 2.x's (``32-true``, ``bf16-mixed``,
``16-mixed``, as in ``lightning.pytorch.plugins.precision.MixedPrecision``). The micro-batch
size belongs to the user's DataModule, whose argument names memplan cannot know, so it is a
comment; so is the ``memplan.apply`` line for the LightningModule, and for a plan timed as
torch.compile runs it (``probe --compiled``) the ``torch.compile`` of the module before
``trainer.fit`` (the Trainer has no compile setting; Lightning 2.x fits a compiled
LightningModule).
"""

from __future__ import annotations

from memplan.emit._common import apply_snippet, comment, dump_yaml, summary
from memplan.errors import BadInputError
from memplan.plan import Plan

STRATEGIES = frozenset({"ddp", "zero1", "zero2", "fsdp"})
"""Plan strategies this format writes faithfully: ``strategy`` ddp / deepspeed_stage_1 / deepspeed_stage_2 / fsdp."""


LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
LIGHTNING_STRATEGY = {
    "ddp": "ddp",
    "zero1": "deepspeed_stage_1",
    "zero2": "deepspeed_stage_2",
    "fsdp": "fsdp",
}
"""Lightning 2.x registered strategy names (``lightning.pytorch.strategies.StrategyRegistry``)."""

GPU_ONLY = {"zero1": "DeepSpeed", "zero2": "DeepSpeed", "fsdp": "FSDP"}
"""Strategies Lightning refuses with ``accelerator: cpu`` (``_check_strategy_and_fallback``
for FSDP, ``DeepSpeedStrategy.setup_environment`` for DeepSpeed, lightning 2.6)."""

FSDP_STRATEGY = "lightning.pytorch.strategies.FSDPStrategy"
PLAN_UNITS = "memplan.wrap.PlanUnits"
"""The plan's FSDP units as an auto-wrap policy (memplan.run.fsdp1_policy): Lightning's bare
``strategy: fsdp`` wraps the root alone, every parameter gathered whole all step."""


def _strategy(plan: Plan) -> str | dict:
    """The Trainer's ``strategy``: a registered name, or for an FSDP plan with units
    ``FSDPStrategy`` with ``memplan.wrap.PlanUnits`` as its auto-wrap policy (a unit for
    each block class, as the plan shards them), in LightningCLI's class_path form."""
    if plan.strategy != "fsdp" or not plan.shard_units:
        return LIGHTNING_STRATEGY[plan.strategy]
    return {
        "class_path": FSDP_STRATEGY,
        "init_args": {
            "auto_wrap_policy": {
                "class_path": PLAN_UNITS,
                "init_args": {"class_names": list(plan.shard_unit_types)},
            }
        },
    }


def emit_lightning(plan: Plan, *, model_path: str) -> str:
    notes = [
        *summary(plan, model_path=model_path),
        "",
        "Use: python main.py fit --config lightning_config.yaml",
        f"The micro-batch size is your DataLoader's batch_size: {plan.micro_batch_size} per "
        "device, e.g. in the data section:",
        "",
        "    data:",
        f"      batch_size: {plan.micro_batch_size}",
    ]
    if plan.checkpoint_layers:
        notes += [
            "",
            "Activation checkpointing: in your LightningModule (e.g. configure_model or "
            "__init__), on the wrapped model:",
            "",
            *apply_snippet("self.model"),
        ]
    if plan.compiled:
        notes += [
            "",
            "The step was timed as torch.compile runs it: compile the module before fitting, "
            "or it trains eager and slower than planned:",
            "",
            "    model = torch.compile(model)",
            "    trainer.fit(model)",
        ]
    if plan.strategy in GPU_ONLY and plan.device == "cpu":
        raise BadInputError(
            f"--format lightning cannot write a {plan.strategy} plan for the cpu: Lightning "
            f"runs {GPU_ONLY[plan.strategy]} on CUDA GPUs only (its Trainer refuses strategy "
            f"{LIGHTNING_STRATEGY[plan.strategy]} with accelerator cpu).",
            hint="Emit --format torchrun (memplan's runtime runs it on cpu ranks), or solve "
            "for a GPU with --device-profile.",
        )
    if plan.strategy == "fsdp" and plan.shard_units:
        notes += [
            "",
            f"FSDP units: one per {', '.join(plan.shard_unit_types)}, by {PLAN_UNITS} (training "
            "imports memplan); Lightning's bare strategy fsdp would",
            "shard the whole model as one unit, every parameter gathered at once.",
        ]
    trainer: dict = {
        "accelerator": "cpu" if plan.device == "cpu" else "gpu",
        "devices": plan.world_size,
    }
    if plan.strategy != "ddp" or plan.world_size > 1:
        trainer["strategy"] = _strategy(plan)
    trainer["precision"] = LIGHTNING_PRECISION[plan.precision]
    trainer["accumulate_grad_batches"] = plan.accumulation_steps
    return comment(notes) + dump_yaml({"trainer": trainer})
