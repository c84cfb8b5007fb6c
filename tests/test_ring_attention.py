"""Context parallel's ring attention, measured: torch's own ring (torch.distributed.tensor.
experimental's ``_templated_ring_attention`` and its backward, the code ``context_parallel``
dispatches SDPA to) run on gloo ranks with the CPU's flash kernel in place of the GPU's, its
bytes counted op by op, set beside memplan's formulas (memplan.solver.ring): what every rank
sends through the collectives, and what the memory-bound ops around the kernels read and
write on the slowest rank. K and V come in transposed, as torchtitan's Attention passes them
to SDPA after ``repeat_kv``."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Any

import pytest
import torch

from memplan.parallel import Parallel
from memplan.profile import Affine
from memplan.solver.ring import (
    cp_within_node,
    ring_comm_bytes,
    ring_memory_bytes,
    ring_seconds,
)
from memplan.verify.rank_lifetime import join_group

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

B, H, S_LOCAL, D = 1, 2, 8, 16  # one rank's query: 8 tokens (two head-tail chunks of 4)
ELEMENTS = B * H * S_LOCAL * D
LSE = B * H * S_LOCAL  # the log-sum-exp's elements: 1/D of the rest


def _held(fn, keep):
    """Bytes the live tensors reached during ``fn()`` above those of ``keep``, and its
    result. Log-sum-exp tensors count too (their 1/D is what the formulas leave out)."""
    from memplan.probe.tracker import LiveTracker

    class Held(LiveTracker):
        # a collective's worker drops its buffers: let that land first. 0.01 s once was
        # too short in a CI rehearsal under load: a cp-8 backward peaked at 78 bytes an
        # element of K, where every run alone and under `yes` load reads 72 (bf16)
        settle_s = 0.03

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # torch 2.13 wraps a functional collective's output in an AsyncCollectiveTensor
            # (a view of the same storage, and not in the December 2024 torch): no bytes
            if "_wrap_tensor_autograd" in str(func):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    tracker = Held(record=False)
    tracker.track(keep)
    base = tracker.live_bytes
    with tracker:
        result = fn()
    return tracker.peak_bytes - base, result


def _count_ring(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """One gloo rank: torch's ring forward and backward over q, k, v (bf16 unless
    ``config["dtype"]``); the bytes every op reads and writes of K-sized tensors (the
    log-sum-exp's are left out; a fill only writes), what each collective is given, and the
    most the live tensors held in each, beside a plain SDPA call's over the same q, k, v."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    dtype = getattr(torch, config.get("dtype", "bfloat16"))
    kernels = {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    }
    factories = {aten.zeros_like.default, aten.empty_like.default}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.memory = 0
            self.sent: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            name = str(func)
            if func in kernels or "wait_tensor" in name or "_wrap_tensor" in name:
                return out
            if "_c10d_functional" in name:
                self.sent[name.split(".")[1]] += sum(t.nbytes for t in ins)
                return out
            storage = [t.untyped_storage().data_ptr() for t in (outs[:1] + ins[:1])]
            if len(storage) == 2 and storage[0] == storage[1] and not func._schema.is_mutable:
                return out  # a view: no bytes move
            # K-sized tensors (E or E/2 elements, flattened or not), not the log-sum-exp's
            big = [t for t in ([] if func in factories else ins) + outs if t.numel() > LSE]
            self.memory += sum(t.nbytes for t in big)
            return out

    join_group(rank, config)
    torch.manual_seed(rank)
    q, k, v = (torch.randn(B, S_LOCAL, H, D, dtype=dtype).transpose(1, 2) for _ in range(3))

    def forward_op(q, k, v, is_causal, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)

    def backward_op(query, key, value, out, logsumexp, is_causal, grad_out, **_):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, is_causal
        )

    group = dist.group.WORLD
    forward = Count()
    with forward:
        out, lse, *_ = ring._templated_ring_attention(group, 2, forward_op, q, k, v, True)
    grad = torch.ones_like(out)
    backward = Count()
    with backward:
        ring._templated_ring_attention_backward(
            group, 2, backward_op, grad, "grad_out", q, k, v, out, lse, is_causal=True
        )
    held_forward, (out, lse, *_) = _held(
        lambda: ring._templated_ring_attention(group, 2, forward_op, q, k, v, True), [q, k, v]
    )
    held_backward, _ = _held(
        lambda: ring._templated_ring_attention_backward(
            group, 2, backward_op, grad, "grad_out", q, k, v, out, lse, is_causal=True
        ),
        [q, k, v, out, lse, grad],
    )
    plain_forward, (out, lse, *_) = _held(lambda: forward_op(q, k, v, True), [q, k, v])
    plain_backward, _ = _held(
        lambda: backward_op(q, k, v, out, lse, True, grad), [q, k, v, out, lse, grad]
    )
    return {
        "forward": forward.memory,
        "backward": backward.memory,
        "forward_sent": dict(forward.sent),
        "backward_sent": dict(backward.sent),
        "held": (held_forward - plain_forward, held_backward - plain_backward),
    }


def _ring_ranks(cp: int, dtype: str = "bfloat16") -> list[dict[str, Any]]:
    """``_count_ring`` on ``cp`` gloo ranks: every rank's counts."""
    from memplan.verify.distributed import free_port, run_ranks

    config = {
        "parent_pid": os.getpid(),
        "world_size": cp,
        "device": "cpu",
        "port": free_port(),
        "timeout_s": 120.0,
        "rank_fn": _count_ring,
        "dtype": dtype,
    }
    return run_ranks(config, lambda *_: None)


def _assert_holds_what_memplan_charges(ranks: list[dict[str, Any]], cp: int, w: int) -> None:
    """What torch's ring held beyond a plain SDPA call's own, the most of any rank, against
    memplan.memory.ring. Before, memplan charged two K/V chunks of the block input's size
    (2·tp·w an element of K) whatever cp was, where the ring gathers every rank's K and V
    and keeps fp32 buffers besides: at cp 8 in bf16, 36 w an element (backward), not 2."""
    from memplan.memory.ring import ring_held_bytes

    forward, backward = ring_held_bytes(cp, w)
    most_forward = max(r["held"][0] for r in ranks)
    most_backward = max(r["held"][1] for r in ranks)
    # the log-sum-exp tensors (fp32, 1/D of K's elements) are what the formula leaves out
    lse = 4 * LSE
    assert forward * ELEMENTS <= most_forward <= forward * ELEMENTS + 2 * lse
    if cp > 2:
        assert backward * ELEMENTS <= most_backward <= backward * ELEMENTS + 2 * lse
    else:  # no later step concatenates K/V for an exchange: less (bf16 one w·E, fp32 5.875 E)
        short = {2: w, 4: 5.875}[w]
        assert most_backward == pytest.approx((backward - short) * ELEMENTS, abs=2 * lse)
    # the old charge at tp 1, 2w an element, is below what the ring holds at any cp
    assert most_backward > 2 * w * ELEMENTS


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_torch_ring_attention_moves_the_bytes_memplan_charges(cp):
    ranks = _ring_ranks(cp)
    w = 2  # bf16
    _assert_holds_what_memplan_charges(ranks, cp, w)
    # the collectives: each rank puts its K and V (2wE) into the all-gather once a ring
    # call, and in the backward its fp32 dK and dV (2 · 4 · E) into each of cp permutes
    for r in ranks:
        assert r["forward_sent"] == {"all_gather_into_tensor": 2 * w * ELEMENTS}
        assert r["backward_sent"] == {
            "all_gather_into_tensor": 2 * w * ELEMENTS,
            "all_to_all_single": cp * 2 * 4 * ELEMENTS,
        }
    # received: the other cp − 1 ranks' K and V, and the permutes' dK/dV
    fwd_recv, bwd_recv = ring_comm_bytes(cp, w)
    assert fwd_recv * ELEMENTS == (cp - 1) * r["forward_sent"]["all_gather_into_tensor"]
    assert bwd_recv * ELEMENTS == (cp - 1) * 2 * w * ELEMENTS + cp * 2 * 4 * ELEMENTS
    # the memory-bound ops: memplan's count is the last rank's, the most of any
    fwd_bytes, bwd_bytes = ring_memory_bytes(cp, w)
    assert ranks[-1]["forward"] == fwd_bytes * ELEMENTS
    assert ranks[-1]["backward"] == bwd_bytes * ELEMENTS
    assert ranks[-1]["forward"] == max(r["forward"] for r in ranks)
    assert ranks[-1]["backward"] == max(r["backward"] for r in ranks)
    # by hand at cp 4, bf16 (E = 256): forward 20 + 46 × 3 = 158 bytes an element, backward
    # 100 + 60 × 3 = 280; at cp 2: 66 and 160
    assert (fwd_bytes, bwd_bytes) == {2: (66, 160), 4: (158, 280)}[cp]


def test_ring_bytes_by_hand():
    # fp32 activations: no casts, so the forward is 4w + (cp − 1)(4w + 8a) = 16 + 48 = 64
    assert ring_memory_bytes(2, 4) == (64, 12 + 16 + 16 + 32 + 24 + 16 + 12 + 16 + 24)
    assert ring_memory_bytes(1, 2) == (0, 0)
    assert ring_comm_bytes(8, 2) == (28, 28 + 64)


def test_cp_group_leaves_the_node_past_eight_gpus():
    # ranks numbered tp innermost, then cp (torchtitan's mesh): tp 8 × cp 2 spans two nodes
    assert cp_within_node(Parallel(cp=8), 8)
    assert cp_within_node(Parallel(tp=2, cp=4), 8)
    assert not cp_within_node(Parallel(tp=8, cp=2), 8)
    assert not cp_within_node(Parallel(tp=3, cp=2), 8)


def test_ring_seconds_of_the_published_8b_at_cp_8():
    # the published 8B at 262,144 tokens, cp 8 on one node: one rank's K after repeat_kv is
    # 32,768 tokens × 4,096 = 2^27 elements; the all-gather brings 7 ranks' K and V in bf16
    # (28 B an element, 3.76 GB) at NVLink's 450 GB/s
    from profiles_factory import uniform_chain

    from memplan.devices import load_device

    base = uniform_chain(2).profile()
    block_input = 262_144 * 4_096 * 2  # one sample's hidden states in bf16
    layers = tuple(
        dataclasses.replace(x, input_bytes=Affine(intercept=0.0, slope=float(block_input)))
        for x in base.layers
    )
    environment = dataclasses.replace(base.environment, precision="bf16")
    profile = dataclasses.replace(base, layers=layers, environment=environment)
    spec = load_device("h100-80gb")
    got = ring_seconds(profile, Parallel(cp=8), 1, spec, gpus_per_node=8)
    elements = 2**27
    assert got.fwd_comm == pytest.approx(28 * elements / 450e9)
    assert got.bwd_comm == pytest.approx((28 + 64) * elements / 450e9)
    rate = spec.memory_bandwidth * spec.efficiency.memory
    assert got.fwd_memory == pytest.approx((20 + 46 * 7) * elements / rate)
    assert got.bwd_memory == pytest.approx((100 + 60 * 7) * elements / rate)
    # across nodes (tp 8 × cp 8: every cp peer on another node) at 50 GB/s, over tp's share
    far = ring_seconds(profile, Parallel(tp=8, cp=8), 1, spec, gpus_per_node=8)
    assert far.fwd_comm == pytest.approx(28 * elements / 8 / 50e9)


def test_a_cp_layout_step_carries_the_rings_exchanges_and_merges():
    # 4 blocks on 8 ranks, dp 4 × cp 2, fully checkpointed, on an H100 spec: the layout's
    # step is the stage's plus its collectives (cp's: m · (4 · (g_f + g_b) + 4 · g_f)) plus
    # the ring's merges in the stage's compute (m · (4 · (r_f + r_b) + 4 · r_f)); without
    # cp neither is there
    from profiles_factory import uniform_chain

    from memplan.devices import load_device
    from memplan.solver import SolveRequest
    from memplan.solver.layout_time import intra_node_bandwidth
    from memplan.solver.parallel import LayoutRequest, solve_layout

    spec = load_device("h100-80gb")
    profile = uniform_chain(4).profile()
    request = SolveRequest(
        target_batch=16,
        budget_bytes=1 << 40,
        world_size=8,
        strategy="fsdp",
        device_spec=spec,
        always_checkpoint=profile.layer_names,
        modes=("full",),
        min_micro=2,
        max_micro=2,
    )
    result = solve_layout(profile, request, LayoutRequest(cp=2))
    (option,) = [o for o in result.options if o.micro_batch == 2]
    m = option.micro_batches
    # within a node at NCCL's bus bandwidth of the spec's link, as TP's collectives
    intra = intra_node_bandwidth(spec)
    assert intra == pytest.approx(360e9)
    ring = ring_seconds(profile, option.parallel, 2, spec, gpus_per_node=8, intra=intra)
    assert ring.fwd_memory > 0 and ring.bwd_comm > ring.fwd_comm > 0
    assert option.comm_seconds["cp"] == pytest.approx(m * ring.comm(4, 4))
    stage = option.stages[0].plan.predicted.step_seconds
    assert option.step_seconds == pytest.approx(
        stage + sum(option.comm_seconds.values()) + m * ring.memory(4, 4)
    )
    plain = solve_layout(profile, request, LayoutRequest(cp=1))
    (no_cp,) = [o for o in plain.options if o.micro_batch == 2]
    assert no_cp.comm_seconds.get("cp", 0.0) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(("cp", "dtype"), [(8, "bfloat16"), (4, "float32"), (2, "float32")])
def test_torch_ring_attention_holds_what_memplan_charges(cp, dtype):
    # cp 2 and 4 in bf16 are checked with the bytes moved (above)
    from memplan.memory.ring import ring_held_bytes

    _assert_holds_what_memplan_charges(_ring_ranks(cp, dtype), cp, 2 if dtype == "bfloat16" else 4)
    # by hand, bf16 (a = 4): forward 2cp·w gathered + 8w, backward 2cp·w + 6w + 7a: at cp 4,
    # 32 and 56 bytes an element of K
    assert ring_held_bytes(4, 2) == (32, 56)


def test_a_cp_rank_holds_the_rings_buffers_while_a_block_runs(monkeypatch):
    # The memory model: each block's forward and backward segment of a cp rank holds the
    # ring's buffers beyond the plain run's, at the rank's share of K (block input per
    # sample / (w · cp · tp) elements); the loss and optimizer segments hold none. Before,
    # two K/V chunks of the block input's size over cp (2·tp·w an element) were charged at
    # every point of the step, the loss's included.
    from profiles_factory import uniform_chain

    from memplan.memory import parallel as layout
    from memplan.memory.ring import ring_held_bytes, ring_held_slopes

    base = uniform_chain(4).profile()
    block_input = 4096 * 64 * 2.0  # bytes a sample: 4,096 tokens × width 64, bf16
    layers = tuple(
        dataclasses.replace(x, input_bytes=Affine(intercept=0.0, slope=block_input))
        for x in base.layers
    )
    environment = dataclasses.replace(base.environment, precision="bf16")
    profile = dataclasses.replace(base, layers=layers, environment=environment)
    cp = 4
    with_ring = layout.rank_profile(profile, Parallel(cp=cp), 0, 1)
    monkeypatch.setattr(layout, "ring_held_slopes", lambda *_: (0.0, 0.0))
    without = layout.rank_profile(profile, Parallel(cp=cp), 0, 1)
    elements = block_input / (2 * cp)  # one sample's K on a rank: 1,024 tokens × 64
    forward, backward = ring_held_bytes(cp, 2)
    expected = {"none": 0.0, "fwd": forward * elements, "bwd": backward * elements}
    assert expected["bwd"] == 56 * 65_536  # 3.5 MiB a sample
    seen = set()
    for phase, segments in with_ring.timeline.items():
        for new, old in zip(segments, without.timeline[phase], strict=True):
            seen.add(new.active)
            for p, q in zip(
                new.points + new.ckpt_points, old.points + old.ckpt_points, strict=True
            ):
                assert p[0] == q[0]
                assert p[1] - q[1] == pytest.approx(expected[new.active])
    assert seen == {"none", "fwd", "bwd"}
    # without context parallel the ring holds nothing
    assert ring_held_slopes(profile, profile.layers[0], Parallel(tp=2)) == (0.0, 0.0)
    assert ring_held_slopes(profile, profile.layers[0], Parallel(cp=cp)) == (
        forward * elements,
        backward * elements,
    )
