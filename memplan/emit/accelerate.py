"""Hugging Face Accelerate config YAML, for ``accelerate launch --config_file``.

Keys are ``ClusterConfig`` fields (``accelerate/commands/config/config_args.py`` in
huggingface/accelerate), which rejects unknown keys. Accumulation is not a config-file field:
it is ``Accelerator(gradient_accumulation_steps=...)``, given as a commented snippet with the
per-process DataLoader batch size and the ``memplan.apply`` line.
"""

from __future__ import annotations

from memplan.emit._common import apply_snippet, comment, dump_yaml, summary
from memplan.plan import Plan

_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _distributed_type(plan: Plan) -> str:
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
    return comment(notes) + dump_yaml(data)
