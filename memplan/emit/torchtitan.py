"""torchtitan's job config (``--format torchtitan``, issue 25).

The layout engines' configs (issue 25): torchtitan's job TOML and Megatron-LM's arguments.

**torchtitan** (``--format torchtitan``): field names as torchtitan's ``JobConfig`` defines
them (pytorch/torchtitan ``torchtitan/config/job_config.py`` at 000204a4: ``[parallelism]``
``data_parallel_replicate_degree``, ``data_parallel_shard_degree``,
``tensor_parallel_degree``, ``pipeline_parallel_degree``, ``pipeline_parallel_schedule``,
``pipeline_parallel_microbatch_size``, ``context_parallel_degree``; ``[training]``
``local_batch_size`` (per data-parallel rank per step; with PP split into micro-batches of
``pipeline_parallel_microbatch_size``), ``global_batch_size`` (more than local × dp means
gradient accumulation), ``seq_len``; ``[activation_checkpoint]`` ``mode`` (selective, full,
none) and ``selective_ac_option`` ("op", or "N": every N-th block)). torchtitan's Llama TP
always shards the norms by sequence (SequenceParallel), so a plan without SP is written
with a comment saying so. torchtitan checkpoints the same modules in every block; a plan
whose blocks differ is written as the nearest every-N-th choice that checkpoints at least
as many blocks (more memory saved, not less), and the comment names the plan's own.
"""

from __future__ import annotations

import json

from memplan.emit._common import comment_string, plan_blocks, plan_layout
from memplan.modes import FULL, SELECTIVE
from memplan.parallel import stage_layers
from memplan.plan import Plan

TORCHTITAN_STRATEGIES = frozenset({"ddp", "fsdp"})
"""torchtitan replicates (DDP) or shards with FSDP2; it has no optimizer-only sharding."""

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
"""memplan's schedule -> torch.distributed.pipelining's class name less ``Schedule``
(what torchtitan's ``pipeline_parallel_schedule`` takes)."""


def _every(n: int) -> str:
    """1 -> "every block", 2 -> "every 2nd block", 3 -> "every 3rd block", 11 -> "every
    11th block"."""
    if n == 1:
        return "every block"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"every {n}{suffix} block"


def _every_nth(plan: Plan, n_blocks: int) -> int:
    """The largest N such that checkpointing every N-th block covers as many blocks as the
    plan checkpoints (0: none)."""
    count = len(plan.checkpoint)
    if count == 0:
        return 0
    return max(1, n_blocks // count)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def emit_torchtitan(plan: Plan, *, model_path: str) -> str:
    """torchtitan's job config (TOML) for ``plan``."""
    p = plan_layout(plan)
    modes = set(plan.checkpoint.values())
    n_blocks = plan_blocks(plan)
    notes = [
        f"memplan plan for {comment_string(model_path)}: {p.describe()}, strategy {plan.strategy}"
    ]
    if not plan.checkpoint:
        ac = {"mode": "none"}
    elif modes == {FULL} and len(plan.checkpoint) == n_blocks:
        ac = {"mode": "full"}
    elif modes == {SELECTIVE} and len(plan.checkpoint) == n_blocks:
        ac = {"mode": "selective", "selective_ac_option": "op"}
    else:
        nth = _every_nth(plan, n_blocks)
        ac = {"mode": "selective", "selective_ac_option": str(nth)}
        notes.append(
            f"the plan checkpoints {len(plan.checkpoint)} of {n_blocks} blocks "
            f"({', '.join(sorted(modes))}); torchtitan checkpoints {_every(nth)} fully"
        )
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's Llama TP always shards the norms by sequence (SP)")
    local = plan.micro_batch_size * (plan.accumulation_steps if p.pp > 1 else 1)
    training = {
        "local_batch_size": local,
        "global_batch_size": plan.target_batch,
    }
    if plan.seq_len is not None:
        training["seq_len"] = plan.seq_len
    parallelism: dict[str, object] = {
        "data_parallel_replicate_degree": p.dp_replicate,
        "data_parallel_shard_degree": p.dp_shard,
        "tensor_parallel_degree": p.tp,
        "pipeline_parallel_degree": p.pp,
        "context_parallel_degree": p.cp,
    }
    if p.tp > 1:  # torchtitan's loss parallel is on unless disabled (JobConfig.Parallelism)
        parallelism["disable_loss_parallel"] = not p.loss_parallel
    if p.pp > 1:
        parallelism["pipeline_parallel_schedule"] = _SCHEDULES[p.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = plan.micro_batch_size
        if p.virtual_stages > 1:
            layers = stage_layers(n_blocks, p.stages)
            parallelism["pipeline_parallel_layers_per_stage"] = len(layers[0])
    lines = [f"# {note}" for note in notes]
    lines.append(
        f"# predicted peak per rank {plan.predicted.peak_bytes} B (worst stage), step "
        f"{plan.predicted.step_seconds:.3f} s"
    )
    for section, fields in (
        ("training", training),
        ("parallelism", parallelism),
        ("activation_checkpoint", ac),
    ):
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"
