"""How ``torch.distributed.optim.ZeroRedundancyOptimizer`` (memplan's ``zero1``) divides the
optimizer state and the optimizer step's temporaries between the ranks. No torch.

torch 2.13 ``torch/distributed/optim/zero_redundancy_optimizer.py``
``ZeroRedundancyOptimizer._partition_parameters`` assigns whole tensors, not slices: for
each parameter group it sorts the parameters by ``numel`` (largest first) and gives each
to the rank with the fewest elements so far (``_get_min_index(sizes)``, the lowest rank on
a tie), ``sizes`` carried over from one group to the next. A rank's state is that of its
tensors, so one tensor larger than the others (a head of 85% of the weights) puts most of
the state on one rank. The profile records bytes per part (a layer, a fixed part), not per
tensor, so the rule is applied to the parts (``fullest_rank_bytes``); ``greedy_partition``
is the rule itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from memplan.profile import Profile

PER_TENSOR_TEMPORARIES = 3
"""Parameter-sized temporaries alive at once in a tensor-by-tensor (not foreach) Adam/AdamW
step: torch 2.13 ``torch/optim/adam.py`` ``_single_tensor_adam`` computes ``denom =
(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` (the square root and the quotient)
while the previous parameter's ``denom`` is still bound. Measured on 2 gloo ranks (8.5M
parameters, 4 MiB largest tensor): three 4,194,304 B temporaries at the step's peak."""


def greedy_partition(groups: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Elements per rank as ``ZeroRedundancyOptimizer._partition_parameters`` assigns the
    tensors of ``groups`` (each a parameter group's tensor sizes in elements): per group,
    largest first, each to the rank with the fewest elements so far (the first such rank)."""
    sizes = [0] * max(world_size, 1)
    for group in groups:
        for numel in sorted(group, reverse=True):  # sorted(..., reverse=True) is stable
            rank = sizes.index(min(sizes))
            sizes[rank] += numel
    return sizes


def rank_shares(parts: Sequence[int], rest: int, world_size: int) -> list[int]:
    """Each rank's bytes, in rank order, when torch's rule (``greedy_partition``) deals the
    profile's parts (each layer's and fixed part's state) as if each were one tensor, with
    ``rest`` (state in no part; negative where a shared parameter's is counted in two
    parts, then not taken off) spread evenly. Parts are coarser than tensors: where one
    tensor dominates it is the rule's own answer (bighead.py, a head of 85% of the weights:
    that part on rank 0, as torch puts it; the even share was 14.3% under rank 0's measured
    peak), and where many tensors are spread the fullest rank is high by up to about a
    part's share (a block's tensors, which torch spreads more finely). Graham's bound,
    ``total / w + p·(1 − 1/w)``, was tried: on Llama 3 8B over 8 ranks its 4.2 GB embedding
    state would add 3.7 GB per rank that torch never puts there."""
    w = max(world_size, 1)
    sizes = greedy_partition([[p for p in parts if p > 0]], w)
    spread = max(-(-rest // w), 0)
    return [size + spread for size in sizes]


def fullest_rank_bytes(parts: Sequence[int], rest: int, world_size: int) -> int:
    """The fullest rank's bytes of ``rank_shares``."""
    return max(rank_shares(parts, rest, world_size))


def rank_step_transient_bytes(transient: int, share: int, total: int, largest_part: int) -> int:
    """The optimizer step's temporaries on a ZeRO rank, of the probe's ``transient`` (all
    parameters on one process): a foreach step's temporaries are as large as the tensors it
    updates (``share`` of ``total`` state bytes), a tensor-by-tensor step's are
    ``PER_TENSOR_TEMPORARIES`` of the largest tensor the rank updates, which can be the
    model's largest (torch's default for CPU tensors: ``torch/optim/optimizer.py``
    ``_default_to_fused_or_foreach`` picks foreach only for native CUDA-like tensors). The
    profile does not say which ran, so the larger of the two, never above the probe's.
    Not counted: the third temporary when a rank updates two largest tensors in a row (its
    partition is sorted largest first, the model's order is not: the probe saw two, an
    8.5M-parameter MLP's rank three)."""
    if total <= 0:
        return transient
    scaled = -(-transient * share // total)
    per_tensor = min(transient, PER_TENSOR_TEMPORARIES * max(largest_part, 0))
    return max(scaled, per_tensor)


def largest_part_bytes(profile: Profile, what: str) -> int:
    """The largest candidate layer's or fixed part's optimizer state (``state``) or
    trainable parameters (``params``): no tensor is larger (the profile keeps no tensors)."""
    parts = [*profile.layers, *profile.fixed]
    if what == "state":
        return max((part.optimizer_state_bytes for part in parts), default=0)
    return max((part.params_trainable_bytes for part in parts), default=0)
