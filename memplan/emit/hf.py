"""Hugging Face ``TrainingArguments`` as YAML, for
``HfArgumentParser((TrainingArguments,)).parse_yaml_file(path)``.

Only real ``TrainingArguments`` fields are written (per_device_train_batch_size,
gradient_accumulation_steps, gradient_checkpointing, gradient_checkpointing_kwargs, bf16, fp16,
output_dir, and use_cpu for a plan made for the CPU — see ``src/transformers/training_args.py`` in huggingface/transformers), because
the parser rejects unknown keys by default. Everything else is a YAML comment.

``gradient_checkpointing`` is all-or-nothing in the Trainer (it calls
``model.gradient_checkpointing_enable()``, which checkpoints every block the model declares:
each module of a ``_no_split_modules`` class, recorded by the probe as
``ModelFingerprint.hf_blocks``). So it is true only when the plan fully checkpoints exactly
those blocks; any other plan gets ``false`` plus a comment with the two lines that apply
exactly the plan's layers with ``memplan.apply``. The old names are
used (transformers 5 also accepts them, with a deprecation warning, under the new
``activation_checkpointing`` names), so the file loads on transformers 4.x and 5.x.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memplan.emit._common import apply_snippet, comment, dump_yaml, layers_phrase, summary
from memplan.plan import Plan

STRATEGIES = frozenset({"ddp", "zero1", "zero2", "fsdp"})
"""Plan strategies this format writes faithfully: DDP by itself; ZeRO through ``deepspeed:``; FSDP through ``fsdp`` + ``fsdp_config``."""


DEFAULT_OUTPUT_DIR = "memplan-output"
DEEPSPEED_FILENAME = "ds_config.json"
"""The deepspeed format's file name (memplan.emit.FORMATS), referenced by ``deepspeed:``."""


def folder_options(folder: Path) -> dict[str, Any]:
    """``emit_hf``'s options for a file written into ``folder`` (as ``memplan solve`` names
    it): ``deepspeed:`` names the DeepSpeed file there, as seen from the folder solve ran in.
    TrainingArguments opens that path against the working directory, not the YAML's folder,
    and training is run from the project's folder, where solve ran (before, a bare
    ``ds_config.json`` loaded only from inside ``--out-dir``)."""
    return {"deepspeed_path": (folder / DEEPSPEED_FILENAME).as_posix()}


def trainer_checkpointing(plan: Plan, candidate_layers: Sequence[str] | None = None) -> bool:
    """Whether the plan is exactly what Trainer's all-or-nothing ``gradient_checkpointing``
    does: full checkpointing of every block ``gradient_checkpointing_enable()`` checkpoints
    (``candidate_layers``, default the plan's ``model_fingerprint.hf_blocks``) and of no
    other layer. Any other plan needs ``memplan.apply``."""
    layers = set(plan.checkpoint_layers)
    if candidate_layers is None and plan.model_fingerprint is not None:
        candidate_layers = plan.model_fingerprint.hf_blocks or None
    all_full = all(mode == "full" for mode in plan.checkpoint.values())
    return (
        bool(layers)
        and all_full
        and candidate_layers is not None
        and layers == set(candidate_layers)
    )


def emit_hf(
    plan: Plan,
    *,
    model_path: str,
    candidate_layers: Sequence[str] | None = None,
    deepspeed_path: str = DEEPSPEED_FILENAME,
) -> str:
    """TrainingArguments YAML. ``candidate_layers``: the blocks Trainer's own
    ``gradient_checkpointing`` would checkpoint (default: the plan's
    ``model_fingerprint.hf_blocks``); when the plan fully checkpoints exactly those, it is
    switched on instead of asking for ``memplan.apply``. ``deepspeed_path``: what a ZeRO
    plan's ``deepspeed:`` names (``folder_options``), relative to where training runs."""
    layers = set(plan.checkpoint_layers)
    all_layers = trainer_checkpointing(plan, candidate_layers)
    notes = [*summary(plan, model_path=model_path), ""]
    notes += ["Load: HfArgumentParser((TrainingArguments,)).parse_yaml_file(this_file)"]
    if plan.world_size > 1:
        notes += [
            f"Launch {plan.world_size} processes (e.g. torchrun --nproc_per_node "
            f"{plan.world_size} train.py): per_device_train_batch_size is per process.",
        ]
    notes.append("")
    if not layers:
        notes += ["The plan checkpoints no layers: gradient_checkpointing stays false."]
    elif all_layers:
        notes += [
            f"The plan fully checkpoints exactly the {len(layers)} blocks that Trainer's "
            "all-or-nothing gradient_checkpointing",
            "checkpoints (model.gradient_checkpointing_enable()), so it is switched on.",
        ]
    else:
        notes += [
            f"Per-layer activation checkpointing: the plan checkpoints {layers_phrase(plan)}.",
            "TrainingArguments.gradient_checkpointing is all-or-nothing (full checkpointing of "
            "every block), so it is false here.",
            "Apply exactly the plan's layers to the model yourself, before building the Trainer:",
            "",
            *apply_snippet("model"),
            "    trainer = Trainer(model=model, args=training_args, ...)",
            "",
            "(gradient_checkpointing_kwargs below only matter if you switch it to true.)",
        ]
    data = {
        "output_dir": DEFAULT_OUTPUT_DIR,
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "gradient_checkpointing": all_layers,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": plan.precision == "bf16",
        "fp16": plan.precision == "fp16",
    }
    if plan.device == "cpu":  # otherwise TrainingArguments refuses bf16 without a GPU
        data["use_cpu"] = True
    if plan.compiled:  # its step was timed as torch.compile runs it (probe --compiled)
        data["torch_compile"] = True
    if plan.strategy in ("zero1", "zero2"):
        # TrainingArguments.deepspeed takes the path of a DeepSpeed config ("auto" values
        # are filled from these arguments); memplan's deepspeed format writes that file.
        data["deepspeed"] = deepspeed_path
        notes += [
            "",
            f"ZeRO stage {plan.strategy[-1]} runs under DeepSpeed: deepspeed names the "
            f"{DEEPSPEED_FILENAME} that memplan solve --format deepspeed writes beside this file,",
            "as a path from the folder memplan solve ran in: TrainingArguments opens it "
            "relative to the working directory,",
            "so run training from that folder (or edit the path).",
        ]
    elif plan.strategy == "fsdp":
        # transformers' TrainingArguments.fsdp / fsdp_config (FSDP2, one unit per block class).
        # A plan with no units (a model with no layers) shards the root alone: no auto_wrap.
        data["fsdp"] = "full_shard auto_wrap" if plan.shard_units else "full_shard"
        data["fsdp_config"] = {
            "version": 2,
            **(
                {"transformer_layer_cls_to_wrap": list(plan.shard_unit_types)}
                if plan.shard_units
                else {}
            ),
            "reshard_after_forward": True,
            "activation_checkpointing": False,
        }
    return comment(notes) + dump_yaml(data)
