"""Hugging Face Accelerate config YAML, for ``accelerate launch --config_file``.

Keys are ``ClusterConfig`` fields (``accelerate/commands/config/config_args.py`` in
huggingface/accelerate), which rejects unknown keys. Accumulation is not a config-file field:
it is ``Accelerator(gradient_accumulation_steps=...)``, given as a commented snippet with the
per-process DataLoader batch size and the ``memplan.apply`` line.

The plan's strategy picks the section: ``fsdp`` → ``distributed_type: FSDP`` with an FSDP2
``fsdp_config`` wrapping the plan's shard-unit classes one by one (as memplan's model
assumes); ``zero1``/``zero2`` → ``distributed_type: DEEPSPEED`` with ``deepspeed_config``'s
``zero_stage`` (and the accumulation steps, which DeepSpeed must know); ``ddp`` → plain
multi-process data parallelism.

A plan timed as torch.compile runs it (``probe --compiled``) adds ``dynamo_config``: the
inductor backend with regional compilation, which compiles the model's repeated blocks one
by one (``accelerate launch`` reads the section into its ``--dynamo_*`` options and the
``ACCELERATE_DYNAMO_*`` variables the Accelerator reads), as memplan's compiled clock ends a
fused region at every layer.
"""

from __future__ import annotations

from memplan.emit._common import apply_snippet, comment, dump_yaml, summary
from memplan.emit.deepspeed import DEFAULT_GRADIENT_CLIPPING, ZERO_STAGE
from memplan.plan import Plan

STRATEGIES = frozenset({"ddp", "zero1", "zero2", "fsdp"})
"""Plan strategies this format writes faithfully: ``distributed_type`` MULTI_GPU / DEEPSPEED / FSDP."""


_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _distributed_type(plan: Plan) -> str:
    if plan.strategy == "fsdp":
        return "FSDP"
    if plan.strategy in ("zero1", "zero2"):
        return "DEEPSPEED"
    if plan.world_size == 1:
        return "NO"
    return "MULTI_CPU" if plan.device == "cpu" else "MULTI_GPU"


def emit_accelerate(plan: Plan, *, model_path: str) -> str:
    k = plan.accumulation_steps
    notes = [
        *summary(plan, model_path=model_path),
        "",
        "Use: accelerate launch --config_file accelerate_config.yaml train.py",
        "Gradient accumulation is set on the Accelerator, not in this file:",
        "",
        "    from accelerate import Accelerator",
        f"    accelerator = Accelerator(gradient_accumulation_steps={k})",
        f"    loader = DataLoader(dataset, batch_size={plan.micro_batch_size})  # per process",
    ]
    if plan.checkpoint_layers:
        notes += apply_snippet("model")
    notes += [
        "    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)",
        "    for batch in loader:",
        "        with accelerator.accumulate(model):",
        "            accelerator.backward(loss_fn(model, batch))",
        "            if accelerator.sync_gradients:",
        "                accelerator.clip_grad_norm_(model.parameters(), 1.0)",
        "            optimizer.step()",
        "            scheduler.step()",
        "            optimizer.zero_grad()",
    ]
    data = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": _distributed_type(plan),
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED_PRECISION[plan.precision],
        "num_machines": 1,
        "num_processes": plan.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": plan.device == "cpu",
    }
    if plan.compiled:
        data["dynamo_config"] = {
            "dynamo_backend": "INDUCTOR",
            "dynamo_use_regional_compilation": True,
        }
    if plan.strategy == "fsdp":
        data["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": False,
            **_wrap_policy(plan),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": False,  # memplan.apply checkpoints the plan's layers
        }
    elif plan.strategy in ("zero1", "zero2"):
        data["deepspeed_config"] = {
            "zero_stage": ZERO_STAGE[plan.strategy],
            "gradient_accumulation_steps": k,
            "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
        }
    return comment(notes) + dump_yaml(data)


def _wrap_policy(plan: Plan) -> dict[str, str]:
    """One FSDP unit per block class, or, for a plan with no units (a model with no
    layers), the root alone: accelerate's ``NO_WRAP`` (an empty class list under
    ``TRANSFORMER_BASED_WRAP`` makes accelerate look for the model's ``_no_split_modules``
    and fail on a model that has none)."""
    if not plan.shard_units:
        return {"fsdp_auto_wrap_policy": "NO_WRAP"}
    return {
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": ",".join(plan.shard_unit_types),
    }
