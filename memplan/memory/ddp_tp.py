"""DDP over TP-split parameters (issue 31): the gradients the backward holds outside DDP's
buckets. No torch.

DDP on a sliced device mesh composes with tensor parallelism through torch's
``_pre_dp_module_transform`` (torch 2.13 ``nn/parallel/distributed.py``, DDP's
``__init__`` when ``device_mesh`` is not the root mesh; ``distributed/tensor/parallel/
ddp.py``): the DTensor parameters are replaced by their local tensors, and a forward
pre-hook rebuilds DTensors from them with ``DTensor.from_local``. A TP-split weight's
gradient is therefore produced by the backward's matmul as a tensor of its own (the local
shard's size), not in the bucket view ``gradient_as_bucket_view`` gives a plain parameter,
and DDP's reducer copies it into its bucket (``mul.out``) only when the backward ends.
Measured with ``memplan verify`` (4 gloo ranks, tiny HF Llama, tp 2 × dp 2, every block
fully checkpointed, micro-batch 4): each block's backward left its split weights'
gradients (18,432 B a rank) alive until the end of the backward, as the head's (8,192 B),
so the last block's backward held 3 × 18,432 + 8,192 B more than the buckets; the plan
without checkpointing peaks at the loss, before any of them.

A rank's backward segment of block ``h`` therefore holds, besides the buckets, the split
gradients of every part whose backward has already run on the rank::

    extra(h) = Σ_{j in stage, j > h} split_j + [last stage] Σ_{head parts} split_p
    split    = tp_sharded_bytes / tp · grad_bytes / params            (per rank)

and the segment after the blocks' backwards (the embeddings, the reducer's copy) all of
them. Only DDP's path does this: FSDP2 (``dp_shard > 1``) keeps DTensor gradients and
reduce-scatters them per unit (memory.sharding), a pipeline all-reduces in place
(memplan.run.parallel), and without data parallelism there is no bucket.
"""

from __future__ import annotations

from memplan.memory.vocab import first_stage_part
from memplan.parallel import Parallel
from memplan.profile import FixedPart, Layer, Profile, Segment


def ddp_splits_grads(parallel: Parallel) -> bool:
    """Whether the layout runs DDP over TP-split parameters (memplan.run.parallel's
    ``_wrap_data_parallel``: DDP on ``dp_replicate`` when nothing is sharded and there is
    one pipeline stage)."""
    return (
        parallel.tp > 1
        and parallel.dp_replicate > 1
        and parallel.dp_shard == 1
        and parallel.pp == 1
    )


def split_grad_bytes(item: Layer | FixedPart, tp: int) -> float:
    """One rank's gradient bytes of the part's TP-split parameters."""
    params = item.params_trainable_bytes + item.params_frozen_bytes
    if params <= 0 or item.tp_sharded_bytes <= 0:
        return 0.0
    return item.tp_sharded_bytes / tp * item.grad_bytes / params


def held_split_grads(
    profile: Profile,
    parallel: Parallel,
    stage: range,
    last: bool,
    segments: tuple[Segment, ...],
) -> list[float]:
    """Per segment of one phase's timeline (the whole model's, before ``rank_profile``
    keeps the stage's): the bytes of ``extra`` in the module docstring; 0 where DDP does
    not run over TP-split parameters, and in the forward."""
    out = [0.0] * len(segments)
    if not ddp_splits_grads(parallel):
        return out
    n = len(profile.layers)
    grads = {j: split_grad_bytes(profile.layers[j], parallel.tp) for j in stage}
    head = (
        sum(
            split_grad_bytes(part, parallel.tp)
            for part in profile.fixed
            if not first_stage_part(part)
        )
        if last
        else 0.0
    )
    backward = False
    for i, seg in enumerate(segments):
        if seg.active == "none" and seg.held == n:  # the head and loss: forward, then back
            backward = True
            continue
        if not backward:
            continue
        if seg.active == "none":  # after the blocks' backwards
            out[i] = head + sum(grads.values())
        else:
            out[i] = head + sum(g for j, g in grads.items() if j > seg.held)
    return out
