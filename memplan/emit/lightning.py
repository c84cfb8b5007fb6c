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
    trainer: dict = {
        "accelerator": "cpu" if plan.device == "cpu" else "gpu",
        "devices": plan.world_size,
    }
    if plan.strategy != "ddp" or plan.world_size > 1:
        trainer["strategy"] = LIGHTNING_STRATEGY[plan.strategy]
    trainer["precision"] = LIGHTNING_PRECISION[plan.precision]
    trainer["accumulate_grad_batches"] = plan.accumulation_steps
    return comment(notes) + dump_yaml({"trainer": trainer})
