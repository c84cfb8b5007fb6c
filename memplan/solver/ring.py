"""What context parallelism's ring attention adds to a step (issue 25): the K/V exchange
and the memory-bound ops torch's ring runs around its attention kernels. No torch.

As torch runs it (torch/distributed/tensor/experimental/_attention.py, the same in 2.13's
``_context_parallel/_attention.py``; the runs of December 2024 used it through torchtitan's
``context_parallel``): a block's SDPA becomes ``cp`` kernel calls, the query against each
rank's K/V chunk, causal load balance by head-tail chunks (the FLOPs of a rank are the ideal
``1/cp`` of the attention, which the rank profile already charges). What is *not* in the
probed block, per ring call, for ``E`` elements of one rank's K (``b · S/cp`` tokens ×
the heads after torchtitan's ``repeat_kv`` (models/llama/model.py ``Attention.forward``:
``repeat_kv``, then ``transpose(1, 2)``, then SDPA): ``n_heads/tp · head_dim`` = ``d_model/tp``
for Llama, not the K/V heads), activations of ``w`` bytes, accumulators of ``a = 4``
(``_ContextParallelOptions.convert_to_f32``):

- collectives (``_AllGatherRotater``: torch 2.13's default ``rotate_method``, added in
  pytorch/pytorch PR 132820, August 2024, and torchtitan's ``context_parallel_rotate_method``
  default "allgather", torchtitan PR 728, December 2024; dK/dV always
  ``_AllToAllRotater``): forward, one all-gather of K and V, ``(cp − 1) · 2wE`` received
  (the all-to-all rotation receives the same bytes in ``cp − 1`` permutes, so the count
  does not hinge on which one the runs used); backward, the same all-gather again, and
  ``cp`` permutes of dK and dV in fp32, ``2aE`` each. The head-tail load balance and the
  fp32 merges date from PR 132442 (August 2024), before the runs' torch (1963fc8). Under full AC the recompute runs the forward's all-gather again.
  The cp group is every tp-th rank (torchtitan's mesh: tp innermost, cp next), so it leaves
  the node when ``tp · cp`` GPUs do not fit in one.
- memory-bound ops on the compute stream, the slowest rank's (the last: every step after
  its own merges a full-length partial output), ``ring_memory_bytes``: the K/V copies
  (``key.contiguous()`` of torchtitan's transposed SDPA inputs; ``torch.cat`` of K and V
  before each exchange), the fp32 cast of each step's output and its merge with the running
  output (``_SDPAMerger``: two subtractions and a product over the output per step), and in
  the backward the fp32 dQ/dK/dV accumulators (zero-filled, added to, re-concatenated by
  ``_partial_update``, concatenated for each exchange, cast back). Log-sum-exp tensors
  (``1/head_dim`` of these) are left out.

Timing, as for the layout's other collectives: bytes over the link's bandwidth, not
overlapped (an upper bound: the source issues each all-gather before the step-0 kernel and
waits for it after, and each dK/dV permute overlaps the next step's kernel; the block's
attention share of its time, which bounds that overlap, is not in a profile); the
memory-bound bytes at the device's memory bandwidth × its memory efficiency, in the stage's
compute (eager: torch.compile may fuse the merges)."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.devices import DeviceSpec
from memplan.memory.ring import ACCUM_BYTES, activation_itemsize, rank_k_elements
from memplan.parallel import Parallel
from memplan.profile import Profile
from memplan.solver.layout_time import (
    INTER_NODE_BYTES_PER_SECOND,
    INTRA_NODE_BYTES_PER_SECOND,
)


def ring_memory_bytes(cp: int, w: int, a: int = ACCUM_BYTES) -> tuple[int, int]:
    """Bytes the slowest rank (``cp − 1``) reads and writes in the memory-bound ops of one
    ring forward and one ring backward, per element of its K (module docstring); K and V
    come in non-contiguous (transposed) as torchtitan passes them. ``c``: one cast between
    the activation and accumulator dtypes (none when they are the same)."""
    if cp <= 1:
        return 0, 0
    c = 0 if w == a else w + a
    forward = (
        4 * w  # key/value .contiguous()
        + (cp - 1) * 4 * w  # cat(K, V) before each exchange but the last
        + cp * c  # each step's output to fp32
        + (cp - 1) * 8 * a  # merge: out − block_out, × sigmoid(Δlse), out − that
        + c  # the merged output back
    )
    backward = (
        3 * a  # zero-filled dQ, dK, dV accumulators
        + 4 * w  # key/value .contiguous()
        + (cp - 1) * 4 * w  # cat(K, V) before each exchange but the last
        + cp * 4 * a  # cat(dK, dV) before each exchange
        + 2 * (2 * a + w)  # step 0: dK += dK_, dV += dV_ (fp32 += activation dtype)
        + 4 * a  # ... then flattened for the exchange: a copy (zeros_like kept K's strides)
        + (cp - 1) * (2 * a + w)  # later steps: half of dK, dV added in place ...
        + (cp - 1) * 4 * a  # ... and dK, dV concatenated whole again (_partial_update)
        + cp * (2 * a + w)  # dQ += dQ_ at every step
        + 3 * c  # dQ, dK, dV cast back
    )
    return forward, backward


def ring_comm_bytes(cp: int, w: int, a: int = ACCUM_BYTES) -> tuple[int, int]:
    """Bytes one rank receives per element of its K: one ring forward (the K/V all-gather),
    one ring backward (the all-gather again, and ``cp`` fp32 dK/dV permutes)."""
    if cp <= 1:
        return 0, 0
    gather = (cp - 1) * 2 * w
    return gather, gather + cp * 2 * a


def cp_within_node(parallel: Parallel, gpus_per_node: int) -> bool:
    """Whether a cp group stays in one node: ranks are numbered tp innermost, then cp, so a
    group spans ``tp · cp`` consecutive ranks."""
    span = parallel.tp * parallel.cp
    return span <= gpus_per_node and gpus_per_node % span == 0


@dataclass(frozen=True, slots=True)
class RingSeconds:
    """Per block, per micro-batch, on the slowest rank: one ring forward and one backward."""

    fwd_comm: float = 0.0
    bwd_comm: float = 0.0
    fwd_memory: float = 0.0
    bwd_memory: float = 0.0

    def comm(self, blocks: int, recomputed: int) -> float:
        """The exchanges of ``blocks`` blocks, ``recomputed`` of them re-running the forward."""
        return blocks * (self.fwd_comm + self.bwd_comm) + recomputed * self.fwd_comm

    def memory(self, blocks: int, recomputed: int) -> float:
        return blocks * (self.fwd_memory + self.bwd_memory) + recomputed * self.fwd_memory


def ring_seconds(
    profile: Profile,
    parallel: Parallel,
    b: int,
    spec: DeviceSpec | None,
    gpus_per_node: int = 8,
    intra: float = INTRA_NODE_BYTES_PER_SECOND,
) -> RingSeconds:
    """The ring's extra seconds per block and micro-batch of ``b`` samples (module
    docstring); none without context parallelism. Without a device spec, no memory-bound
    time."""
    if parallel.cp <= 1 or not profile.layers:
        return RingSeconds()
    w = activation_itemsize(profile)
    elements = rank_k_elements(profile, profile.layers[0], parallel) * b
    # within a node at ``intra`` (NCCL's bus bandwidth of the spec's link, as TP's)
    link = intra if cp_within_node(parallel, gpus_per_node) else INTER_NODE_BYTES_PER_SECOND
    fwd_comm, bwd_comm = ring_comm_bytes(parallel.cp, w)
    out = RingSeconds(fwd_comm=fwd_comm * elements / link, bwd_comm=bwd_comm * elements / link)
    if spec is None or not spec.memory_bandwidth:
        return out
    rate = spec.memory_bandwidth * spec.efficiency.memory
    fwd_mem, bwd_mem = ring_memory_bytes(parallel.cp, w)
    return RingSeconds(
        fwd_comm=out.fwd_comm,
        bwd_comm=out.bwd_comm,
        fwd_memory=fwd_mem * elements / rate,
        bwd_memory=bwd_mem * elements / rate,
    )
