"""``train_torchrun.py``: the training script (memplan.emit.script's template and loop) for
``torchrun``, with the launch commands for one node and for several in its docstring.

Every rank shards the model with ``memplan.wrap.wrap_for_plan``, the code memplan's
memory model assumes and ``memplan verify --world-size N`` runs:

* ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)``;
* ``zero1``: the same, with ``torch.distributed.optim.ZeroRedundancyOptimizer``;
* ``fsdp``: FSDP2 ``fully_shard`` on each shard unit, then on the root, with
  ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` for a ``mixed_precision:
  params`` plan, reduce-scattering on the last micro-step or every one (``grad_sync``).

``zero2`` is refused: it is DeepSpeed's (use the ``deepspeed`` format).
"""

from __future__ import annotations

from memplan.emit.script import model_name, render_script
from memplan.errors import BadInputError
from memplan.plan import Plan

DEFAULT_GPUS_PER_NODE = 8

STRATEGIES = frozenset({"ddp", "zero1", "fsdp"})
"""Plan strategies this format writes faithfully: DDP, ZeroRedundancyOptimizer, FSDP2
(ZeRO-2 needs DeepSpeed)."""


def launch_commands(
    plan: Plan, script: str, gpus_per_node: int = DEFAULT_GPUS_PER_NODE
) -> list[str]:
    """torchrun command lines: one node, and, when the ranks fill several nodes of
    ``gpus_per_node``, the command every node runs."""
    world = plan.world_size
    lines = [
        f"    torchrun --standalone --nproc_per_node {world} {script} --steps 100   # one node"
    ]
    if world > gpus_per_node and world % gpus_per_node == 0:
        nodes = world // gpus_per_node
        lines += [
            "",
            f"    # {nodes} nodes × {gpus_per_node} GPUs; on node R (0 .. {nodes - 1}), HOST = node 0:",
            f"    torchrun --nnodes {nodes} --nproc_per_node {gpus_per_node} --node_rank R \\",
            f"        --rdzv_backend c10d --rdzv_endpoint HOST:29500 {script} --steps 100",
        ]
    return lines


def emit_torchrun(
    plan: Plan, *, model_path: str, gpus_per_node: int = DEFAULT_GPUS_PER_NODE
) -> str:
    """The script's text, for ``model_path`` (``path`` or ``path:factory``)."""
    if plan.strategy == "zero2":
        raise BadInputError(
            "A zero2 plan runs under DeepSpeed (ZeRO stage 2 has no torch engine).",
            hint="Emit --format deepspeed (or accelerate), or solve with --strategy zero1 or fsdp.",
        )
    script = "train_torchrun.py"
    launch = "Launch it:\n\n" + "\n".join(launch_commands(plan, script, gpus_per_node))
    return render_script(
        plan,
        model_path=model_path,
        script=script,
        title=f"Train {model_name(model_path)} with the memplan plan on {plan.world_size} "
        f"ranks ({plan.strategy}).",
        launch=launch,
    )
