"""What a parallel layout adds to a step's time: the links, the collectives of tensor, pipeline
and context parallelism, and the pipeline's bubble (memplan.solver.parallel's docstring has
the formula). No torch.

The collectives of one micro-batch (TP's, CP's, the stage boundary's sends) run inside each
stage's forward and backward, so the pipeline's schedule stretches them as it stretches the
compute: torch's schedules wait on each transfer before the compute that needs it
(torch.distributed.pipelining ``Schedule1F1B._step_microbatches``: every receive, and each
send fused with the next receive, is waited, ``_wait_batch_p2p``; the December 2024
``PipelineScheduleMulti._step_microbatches`` that ran ``ScheduleInterleaved1F1B`` waited one
batch of sends and receives after every action), and Megatron's f/g all-reduces sit between
a block's matmuls. Before, they were added to the step once, outside the bubble: the 405B
pipeline rows (dp 8 × tp 8 × pp 8, 8 micro-batches) were charged 8 micro-batches' TP
collectives where their slowest stage's path runs 15.
"""

from __future__ import annotations

from memplan import timing
from memplan.devices import DeviceSpec
from memplan.parallel import Parallel
from memplan.profile import Profile

INTRA_NODE_BYTES_PER_SECOND = 450e9
"""NVLink 4 (H100 SXM): 900 GB/s bidirectional per GPU, 450 GB/s one way (NVIDIA H100
datasheet). TP and CP stay within a node; a device spec's own link rate and NCCL bus
bandwidth replace it (``intra_node_bandwidth``)."""
INTER_NODE_BYTES_PER_SECOND = 50e9
"""One 400 Gb/s InfiniBand NDR NIC per GPU (DGX H100): 50 GB/s one way. Pipeline stages
and data-parallel groups that span nodes."""


def intra_node_bandwidth(spec: DeviceSpec | None) -> float:
    """Bytes per second of TP's and CP's collectives within a node: the spec's link at
    NCCL's bus bandwidth (``timing.interconnect_bandwidth``: H100 360 of 450 GB/s,
    nccl-tests#326), as the data-parallel collectives are timed; without a spec figure,
    NVLink 4's line rate. Before, TP ran at the line rate on every device."""
    if spec is None or spec.interconnect_bandwidth <= 0:
        return INTRA_NODE_BYTES_PER_SECOND
    return timing.interconnect_bandwidth(spec)[0]


def data_parallel_bandwidth(
    parallel: Parallel, intra: float, gpus_per_node: int, sharded: bool = True
) -> float:
    """Bytes per second per rank of the data-parallel collectives of ``parallel``. Ranks
    are numbered tp innermost, then cp, dp, pp (torchtitan's mesh order, ``memory.parallel.
    stage_of_rank``): a sharded group (FSDP over dp × cp, ``layout_sharding``) takes every
    tp-th rank, DDP's replicas every (tp·cp)-th. Within a node (ranks × stride ≤
    gpus_per_node) on NVLink (``intra``); across nodes its g = gpus_per_node / stride ranks
    a node each bring a NIC (DGX H100: a 400 Gb/s ConnectX-7 per GPU, NVIDIA's user guide;
    NCCL runs a ring channel per NIC): g × 50 GB/s (nccl-tests: 8 NICs give about 400 GB/s),
    at most NVLink. Before, all ran at NVLink: FSDP at dp 32 × tp 8 (70B) 9× too fast."""
    shards = (parallel.dp * parallel.cp, parallel.tp)
    ranks, stride = shards if sharded else (parallel.dp, parallel.tp * parallel.cp)
    if ranks <= 1 or ranks * stride <= gpus_per_node:
        return intra
    per_node = max(1, gpus_per_node // stride)
    return min(intra, per_node * INTER_NODE_BYTES_PER_SECOND)


def block_input_bytes(profile: Profile, parallel: Parallel, b: int) -> float:
    """One rank's share of a block's input at micro-batch ``b``: the probe's bytes a sample,
    over ``cp`` (its sequence split); what TP's, PP's and CP's exchanges are sized from."""
    return profile.layers[0].input_bytes.slope * b / parallel.cp if profile.layers else 0.0


def stage_boundary_bytes(profile: Profile, parallel: Parallel, b: int) -> float:
    """Bytes one rank sends across a stage boundary per micro-batch and direction: a block's
    input at micro-batch ``b`` (over ``cp``). Under sequence parallelism a block's output is
    the local sequence shard (torchtitan 9dec370 ``apply_tp``: ``feed_forward.w2`` is
    ``RowwiseParallel(output_layouts=Shard(1))``, local output; torch's ``PipelineStage``
    sends that local tensor), so 1/tp of it; without, each TP rank sends the whole
    replicated activation to its peer."""
    act = block_input_bytes(profile, parallel, b)
    return act / parallel.tp if parallel.sequence_parallel else act


def layout_comm_seconds(
    profile: Profile,
    parallel: Parallel,
    b: int,
    m: int,
    stage_layers: int,
    recomputed: int = 0,
    intra: float = INTRA_NODE_BYTES_PER_SECOND,
    cp_seconds: float = 0.0,
    selective: int = 0,
) -> dict[str, float]:
    """The collectives a layout adds to ``m`` micro-batches of a stage, in seconds, before
    the bubble stretches them (``pipeline_seconds``); ``recomputed`` of the stage's blocks
    fully checkpointed, whose recompute runs the forward's two TP collectives again
    (Korthikanti et al. 2022, §4: full recomputation repeats the forward's all-reduces, or
    SP's all-gathers and reduce-scatters); ``selective`` of them under per-op SAC, whose
    recompute runs again the forward collectives whose outputs its policy does not keep
    (``redone_collectives``). Each micro-batch crosses ``virtual_stages`` boundaries a rank
    sends over, forward and backward. ``cp_seconds``: one micro-batch's ring-attention
    exchanges on the stage (``memplan.solver.ring``, ``RingSeconds.comm``)."""
    act = block_input_bytes(profile, parallel, b)
    out = {"tp": 0.0, "pp": 0.0, "cp": 0.0}
    if parallel.tp > 1:
        ring = 2 * timing.ring_fraction(parallel.tp) * act  # per all-reduce
        redone = 2 * recomputed + redone_collectives(parallel) * selective
        out["tp"] = m * (4 * stage_layers + redone) * ring / intra
    if parallel.pp > 1:
        sends = 2 * parallel.virtual_stages
        out["pp"] = (
            m * sends * stage_boundary_bytes(profile, parallel, b) / INTER_NODE_BYTES_PER_SECOND
        )
    if parallel.cp > 1:
        out["cp"] = m * cp_seconds
    return out


def redone_collectives(parallel: Parallel) -> float:
    """A per-op SAC block's TP collectives run again in its recompute, in all-reduces'
    bytes. The policy keeps the outputs of matmuls, attention and SP's reduce-scatters, not
    all-gathers' or all-reduces' (memplan.modes.SAVE_OPS; torchtitan 9dec370
    torchtitan/parallelisms/parallelize_llama.py ``_save_list``: ``reduce_scatter_tensor``
    and no other collective), and a matmul's backward needs its input: under SP the two
    all-gathers before the attention's and the MLP's matmuls come again (two all-gathers,
    one all-reduce's bytes); without SP the two all-reduces after them. Before, a selective
    block's recompute was charged no collective (the 8B TP 8 rows of June 2025: 0.13 s a
    step at 360 GB/s)."""
    return 1.0 if parallel.sequence_parallel else 2.0


def bubble_fraction(parallel: Parallel, m: int) -> float:
    """Idle share of a pipeline step: (pp − 1) / (m + pp − 1), over v when interleaved
    (Narayanan et al. 2021, §2.2)."""
    if parallel.pp == 1:
        return 0.0
    idle = (parallel.pp - 1) / parallel.virtual_stages
    return idle / (m + idle)


def pipeline_seconds(
    parallel: Parallel, m: int, micro_seconds: float, comm: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """The slowest stage's ``micro_seconds`` (its ``m`` micro-batches' compute) and the
    per-micro-batch collectives ``comm`` (``layout_comm_seconds``) through the bubble: the
    step's share of each, the collectives as they count in the step."""
    stretch = 1.0 / (1.0 - bubble_fraction(parallel, m))
    return micro_seconds * stretch, {k: v * stretch for k, v in comm.items()}
