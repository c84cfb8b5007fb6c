"""One rank's bytes at each point of a step under data parallelism (``Sharding``): the
per-rank terms of memplan.memory.sharding summed into what a rank holds beside, or instead
of, what the single-process probe measured. No torch."""

from __future__ import annotations

from memplan.memory.memo import by_identity
from memplan.memory.sharding import (
    SINGLE,
    Sharding,
    bucket_views_replace_grads,
    ddp_bucket_bytes,
    fsdp_gathered_bytes,
    fsdp_grads_bytes,
    master_bytes,
    master_element_bytes,
    optimizer_transient_bytes,
    rank_optimizer_state_bytes,
    rank_params_bytes,
    shard_bytes,
    sharded_grads_removed_bytes,
    zero2_bucket_bytes,
)
from memplan.memory.terms import grads_at_bytes, grads_bytes, optimizer_state_bytes, params_bytes
from memplan.memory.zero_partition import largest_part_bytes, rank_step_transient_bytes
from memplan.profile import Profile


@by_identity(200_000)
def segment_adjust_bytes(
    profile: Profile,
    sharding: Sharding,
    phase: str,
    index: int,
    accumulation_steps: int,
) -> int:
    """``_segment_adjust_bytes``, remembered by the profile's identity: it depends on no
    micro-batch and no checkpoint set, but every solve of every micro-batch asks it again
    (the layout search, of hundreds)."""
    return _segment_adjust_bytes(profile, sharding, phase, index, accumulation_steps)


def _segment_adjust_bytes(
    profile: Profile,
    sharding: Sharding,
    phase: str,
    index: int,
    accumulation_steps: int,
) -> int:
    """Per-rank live bytes at a segment minus what the single-process probe measured there:

    * − parameters a rank does not hold (FSDP), − optimizer state it does not hold (ZeRO-1+),
      − gradients it does not hold (ZeRO-2; FSDP without accumulation);
    * + DDP's buckets less the gradients already counted (see ``ddp_bucket_bytes``: with
      bucket views a synchronised micro-step copies each new gradient into its bucket and
      frees it, so with k = 1 the probe's growing gradients are replaced by the bucket);
    * + ZeRO-2's reduction bucket; + FSDP's gathered units; FSDP's gradients and
      reduce-scatter buffers in place of the probe's gradients (``fsdp_grads_bytes``).

    Zero for one process (any strategy but FSDP, whose all-gathers still copy)."""
    if sharding == SINGLE:
        return 0
    held_grads = grads_at_bytes(profile, phase, index)
    delta = _resting_adjust_bytes(profile, sharding)
    delta -= sharded_grads_removed_bytes(profile, sharding, held_grads, accumulation_steps)
    bucket = ddp_bucket_bytes(profile, sharding)
    if bucket:
        replaced = bucket_views_replace_grads(sharding, phase, accumulation_steps)
        delta += bucket - (held_grads if replaced else 0)
    if sharding.strategy == "fsdp":
        delta += fsdp_gathered_bytes(profile, sharding, phase, index)
        if sharding.world_size > 1:
            delta += fsdp_grads_bytes(profile, sharding, phase, index, accumulation_steps)
            delta -= held_grads
    return delta


@by_identity(256)
def _resting_adjust_bytes(profile: Profile, sharding: Sharding) -> int:
    """The part of ``_segment_adjust_bytes`` no segment changes: − the parameters and the
    optimizer state a rank does not hold, + ZeRO-2's reduction bucket."""
    delta = -(params_bytes(profile) - rank_params_bytes(profile, sharding))
    delta -= optimizer_state_bytes(profile) - rank_optimizer_state_bytes(profile, sharding)
    return delta + zero2_bucket_bytes(profile, sharding)


def optimizer_adjust_bytes(profile: Profile, sharding: Sharding) -> int:
    """Per-rank optimizer-step peak minus the probe's: the step runs on what a rank holds, and
    its temporaries scale with the parameters it updates (ZeRO-1 and up: 1/world). DDP's
    buckets are the gradients (bucket views); without bucket views they are a second copy."""
    if sharding == SINGLE:
        return 0
    w, e = sharding.world_size, master_element_bytes(profile, sharding)
    delta = -(params_bytes(profile) - rank_params_bytes(profile, sharding))
    delta -= optimizer_state_bytes(profile) - rank_optimizer_state_bytes(profile, sharding)
    if sharding.strategy in ("zero2", "fsdp"):
        grads = grads_bytes(profile)
        delta -= grads - shard_bytes(master_bytes(profile, sharding, grads), w, e)
    if sharding.strategy == "zero1":
        delta += _zero1_transient_bytes(profile, sharding) - optimizer_transient_bytes(profile)
    elif sharding.strategy != "ddp":
        transient = optimizer_transient_bytes(profile)
        delta -= transient - shard_bytes(master_bytes(profile, sharding, transient), w, e)
    if ddp_bucket_bytes(profile, sharding) and not sharding.gradient_as_bucket_view:
        delta += ddp_bucket_bytes(profile, sharding)
    return delta


def _zero1_transient_bytes(profile: Profile, sharding: Sharding) -> int:
    """ZeroRedundancyOptimizer's step temporaries on its fullest rank: its local step runs
    the wrapped optimizer on the rank's whole tensors (``_local_step``: ``self.optim.step``),
    so a tensor-by-tensor step keeps temporaries of the largest tensor, not 1/world of the
    probe's (memplan.memory.zero_partition.rank_step_transient_bytes). Its ``_sync_params``
    then broadcasts each rank's parameters in place (``dist.broadcast(tensor=param.data)``,
    ``parameters_as_bucket_view=False`` as memplan's ``zero1`` builds it): nothing allocated."""
    return rank_step_transient_bytes(
        optimizer_transient_bytes(profile),
        rank_optimizer_state_bytes(profile, sharding),
        master_bytes(profile, sharding, optimizer_state_bytes(profile)),
        largest_part_bytes(profile, "params"),
    )


def rank_state_bytes(profile: Profile, sharding: Sharding) -> tuple[int, int, int]:
    """(params, grads, optimizer state) one rank holds in the optimizer step."""
    w, e = sharding.world_size, master_element_bytes(profile, sharding)
    grads = grads_bytes(profile)
    if sharding.strategy in ("zero2", "fsdp"):
        grads = shard_bytes(master_bytes(profile, sharding, grads), w, e)
    return (
        rank_params_bytes(profile, sharding),
        grads,
        rank_optimizer_state_bytes(profile, sharding),
    )
