"""What a layout adds to the step (memplan.solver.layout_time): the bubble stretching each
micro-batch's collectives, TP at NCCL's bus bandwidth, the stage boundary under SP, FSDP's
accumulation; the facts behind them checked against torch's own classes."""

from __future__ import annotations

import dataclasses

import pytest
from profiles_factory import uniform_chain, with_tp_measurement

from memplan.devices import load_device
from memplan.parallel import Parallel
from memplan.solver import SolveRequest
from memplan.solver.layout_time import (
    INTER_NODE_BYTES_PER_SECOND,
    INTRA_NODE_BYTES_PER_SECOND,
    bubble_fraction,
    intra_node_bandwidth,
    layout_comm_seconds,
    stage_boundary_bytes,
)
from memplan.solver.options import fsdp_accumulate_bytes
from memplan.solver.parallel import LayoutRequest, solve_layout


def _tp_profile(n: int = 4):
    profile = uniform_chain(n, saved=[4000] * n, output=[400] * n).profile()
    return with_tp_measurement(profile, 0.75, hf_blocks=True)


def test_tp_runs_at_the_devices_nccl_bus_bandwidth():
    # h100-80gb: 450 GB/s one way × 0.80 (nccl-tests#326); a100-80gb: 300 × 0.767; no spec:
    # NVLink 4's line rate, as before
    assert intra_node_bandwidth(load_device("h100-80gb")) == pytest.approx(360e9)
    assert intra_node_bandwidth(load_device("a100-80gb")) == pytest.approx(230.1e9)
    assert intra_node_bandwidth(None) == INTRA_NODE_BYTES_PER_SECOND == 450e9


def test_the_stage_boundary_is_the_local_sequence_shard_under_sp_and_one_per_virtual_stage():
    # block input 8 B a sample, micro-batch 2: 16 B; tp 2 with SP: 8 B a rank; m 3 micro-
    # batches, forward and backward: 3·2·8 B; interleaved over 2 virtual stages: twice that
    profile = _tp_profile()
    assert profile.layers[0].input_bytes.slope == 8
    sp = Parallel(tp=2, pp=2, sequence_parallel=True)
    plain = Parallel(tp=2, pp=2)
    assert stage_boundary_bytes(profile, sp, 2) == 8
    assert stage_boundary_bytes(profile, plain, 2) == 16
    seconds = {p: layout_comm_seconds(profile, p, 2, 3, 2)["pp"] for p in (sp, plain)}
    assert seconds[sp] == pytest.approx(48 / INTER_NODE_BYTES_PER_SECOND)
    assert seconds[plain] == pytest.approx(96 / INTER_NODE_BYTES_PER_SECOND)
    looped = Parallel(tp=2, pp=2, sequence_parallel=True, schedule="interleaved_1f1b")
    looped = dataclasses.replace(looped, virtual_stages=2)
    assert layout_comm_seconds(profile, looped, 2, 3, 1)["pp"] == pytest.approx(
        96 / INTER_NODE_BYTES_PER_SECOND
    )


def test_the_bubble_stretches_each_micro_batchs_tp_collectives():
    # 4 blocks, tp 2 × pp 2 on 4 ranks, 4 micro-batches of 1: a stage holds 2 blocks, 4 ring
    # all-reduces each of ring(8 B, 2) = 8 B per micro-batch: 4·8·8 = 256 B at 360 GB/s,
    # through the bubble (4 + 1)/4: 320 B. Before: 256 B at 450 GB/s, outside the bubble.
    profile = _tp_profile()
    spec = load_device("h100-80gb")
    request = SolveRequest(
        target_batch=4, budget_bytes=1 << 40, world_size=4, strategy="ddp", device_spec=spec
    )
    result = solve_layout(
        profile, dataclasses.replace(request, modes=("keep",)), LayoutRequest(tp=2, pp=2)
    )
    (option,) = [o for o in result.options if o.micro_batch == 1]
    assert option.micro_batches == 4 and option.bubble == pytest.approx(1 / 5)
    assert option.comm_seconds["tp"] == pytest.approx(320 / 360e9)
    micro = max(s.plan.predicted.step_seconds - s.once_seconds for s in option.stages)
    once = max(s.once_seconds for s in option.stages)
    assert option.step_seconds == pytest.approx(
        micro * 5 / 4 + once + option.comm_seconds["tp"] + option.comm_seconds["pp"]
    )


def test_a_selective_blocks_recompute_runs_the_collectives_its_policy_does_not_keep():
    # 2 blocks a stage, 3 micro-batches of 2 at tp 2: an all-reduce's ring is 2 · 1/2 · 16 B
    # = 16 B. Kept: 4 a block. Full: 2 more. Per-op SAC keeps SP's reduce-scatters (torchtitan's
    # _save_list) and runs its two all-gathers again, one all-reduce's bytes; without SP its
    # two all-reduces. Before, a selective block was charged as a kept one.
    from memplan.modes import SAVE_OPS
    from memplan.solver.layout_time import redone_collectives

    assert "reduce_scatter_tensor" in SAVE_OPS
    assert not any(op.startswith(("all_gather", "all_reduce")) for op in SAVE_OPS)
    profile = _tp_profile()
    sp = Parallel(tp=2, sequence_parallel=True)
    plain = Parallel(tp=2)
    assert (redone_collectives(sp), redone_collectives(plain)) == (1.0, 2.0)

    def tp(parallel, full=0, selective=0):
        return layout_comm_seconds(profile, parallel, 2, 3, 2, full, 1.0, 0.0, selective)["tp"]

    assert tp(sp) == pytest.approx(3 * 4 * 2 * 16)
    assert tp(sp, full=2) == pytest.approx(3 * (8 + 4) * 16)
    assert tp(sp, selective=2) == pytest.approx(3 * (8 + 2) * 16)
    assert tp(plain, selective=2) == pytest.approx(3 * (8 + 4) * 16)


def test_fsdp_accumulates_unreduced_gradients_at_memory_bandwidth():
    # bf16 gradients G = 100 B, fp32 accumulator 200 B, 4 micro-steps unreduced: the first
    # copied (100 + 200), three added (100 + 2·200 each): 300 + 1500. Reduced every
    # micro-step over 2 ranks: three adds of the 100 B fp32 shard, 3·3·100. Same dtype,
    # unreduced: autograd's own adds, as every engine's (none charged). One micro-step: 0.
    assert fsdp_accumulate_bytes(100, 200, 4, 2, every=False) == 1800
    assert fsdp_accumulate_bytes(100, 200, 4, 2, every=True) == 900
    assert fsdp_accumulate_bytes(100, 100, 4, 2, every=False) == 0
    assert fsdp_accumulate_bytes(100, 200, 1, 2, every=False) == 0


def _lockstep_makespan(orders, p, v, forward, backward, c=0.0):
    """The December 2024 ``PipelineScheduleMulti._step_microbatches`` (the runtime of its
    ``ScheduleInterleaved1F1B``): at every time step each rank runs its action, then one
    batch of its sends and the receives of what its neighbours ran at that step, waited."""
    stages = p * v
    done = [0.0] * p
    for step in range(max(len(o) for o in orders)):
        acts = [o[step] if step < len(o) else None for o in orders]
        ready = [
            done[r]
            + ((forward if a.computation_type.name == "FORWARD" else backward) if a else 0.0)
            for r, a in enumerate(acts)
        ]
        new = []
        for r in range(p):
            peers = []
            for q, a in enumerate(acts):
                if a is None:
                    continue
                fwd = a.computation_type.name == "FORWARD"
                to = a.stage_index + 1 if fwd else a.stage_index - 1
                if not 0 <= to < stages:
                    continue
                if q == r:
                    peers.append(to % p)
                elif to % p == r:
                    peers.append(q)
            new.append(max([ready[r]] + [ready[q] for q in peers]) + (c if peers else 0.0))
        done = new
    return max(done)


def test_torchs_interleaved_order_run_in_lockstep_takes_what_the_bubble_formula_says():
    # The 405B rows' shape: pp 8, 8 micro-batches, 2 stages a rank; full recompute makes a
    # backward (recompute + backward) about 3.1 forwards (memplan's 405B stage: 0.437 s
    # forward, 1.36 s backward a micro-batch). torch's own ScheduleInterleaved1F1B order
    # (its 2024 warm-up rule is the same for 8 micro-batches on 8 ranks) run in lockstep
    # takes 20.88 s; memplan's (m + (pp − 1)/v) · (F + B) = 11.5 · 1.797 = 20.67 s (1% less);
    # a 3 ms transfer per hop (134 MB at 50 GB/s, the SP shard) adds 0.13 s, 44 transfers,
    # where memplan charges (m + (pp − 1)/v) · 2v = 46.
    pytest.importorskip("torch")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    p, m, v, forward, backward = 8, 8, 2, 0.437, 1.36
    orders = get_schedule_ops("Interleaved1F1B", p, m, v)
    ops = [a for row in orders for a in row if a is not None]
    assert len(ops) == 2 * p * v * m  # every chunk's forward and backward, once
    makespan = _lockstep_makespan(orders, p, v, forward / v, backward / v)
    formula = (m + (p - 1) / v) * (forward + backward)
    assert formula == pytest.approx(20.6655)
    assert makespan == pytest.approx(20.884, abs=1e-3)
    assert makespan / formula == pytest.approx(1.0, abs=0.02)
    assert bubble_fraction(Parallel(pp=p, schedule="interleaved_1f1b", virtual_stages=v), m) == (
        pytest.approx(3.5 / 11.5)
    )
    with_sends = _lockstep_makespan(orders, p, v, forward / v, backward / v, c=0.003)
    assert with_sends - makespan == pytest.approx(44 * 0.003, abs=1e-6)


def test_a_torchtitan_sp_block_hands_the_next_stage_its_local_sequence_shard():
    # torchtitan 9dec370's apply_tp on a block: SequenceParallel norms, the projections in,
    # RowwiseParallel(output_layouts=Shard(1)) out, local outputs. On a fake group of 4
    # ranks a block of batch 2 × sequence 16 × width 8 takes and returns the local shard
    # [2, 4, 8]: a plain tensor, what torch's PipelineStage sends (stage_boundary_bytes:
    # 1/tp of the block input).
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    class FeedForward(torch.nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.w1 = torch.nn.Linear(d, 4 * d, bias=False)
            self.w2 = torch.nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            return self.w2(torch.relu(self.w1(x)))

    class Block(torch.nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.ffn_norm = torch.nn.RMSNorm(d)
            self.feed_forward = FeedForward(d)

        def forward(self, x):
            return x + self.feed_forward(self.ffn_norm(x))

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        block = parallelize_module(
            Block(8),
            mesh,
            {
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
        out = block(torch.randn(2, 16 // 4, 8))
    finally:
        if started:
            dist.destroy_process_group()
    assert type(out) is torch.Tensor and tuple(out.shape) == (2, 4, 8)
