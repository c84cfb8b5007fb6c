"""The CUDA reserve as a model of its parts (issue 31, memplan.memory.budget): the CUDA
context, the caching allocator's rounding and fragmentation, FSDP2's all-gather and
reduce-scatter stream pools, NCCL's buffers; nothing off CUDA."""

from profiles_factory import uniform_chain
from test_memory import CPU, H100

from memplan import memory
from memplan.memory.budget import (
    DEFAULT_CONTEXT_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    fsdp_stream_bytes,
    reserve_for,
)
from memplan.memory.parallel import communicators
from memplan.parallel import Parallel
from memplan.units import MiB


def _profile():
    # 4 blocks of 1000 B of parameters, one of 3000 B: the largest FSDP unit
    return uniform_chain(5, params=[1000, 1000, 3000, 1000, 1000]).profile()


def test_cpu_plans_have_no_reserve_whatever_the_sharding():
    profile = _profile()
    fsdp = memory.Sharding(strategy="fsdp", world_size=8)
    assert reserve_for(profile, None, fsdp) == memory.NO_RESERVE
    assert reserve_for(profile, CPU, fsdp, 3) == memory.NO_RESERVE


def test_single_gpu_reserve_is_the_context_and_five_percent_as_before():
    reserve = reserve_for(_profile(), H100)
    assert reserve.fixed_bytes == DEFAULT_CONTEXT_BYTES == 512 * MiB
    assert reserve.bytes_for(1000) == 512 * MiB + 50
    assert (reserve.stream_bytes, reserve.nccl_bytes) == (0, 0)
    # what max_memory_reserved shows: allocated + the allocator's share, no context
    assert reserve.reserved_bytes(1000) == 1050


def test_fsdp_adds_one_unit_gathered_and_one_unsharded_gradient_in_stream_pools():
    profile = _profile()
    fsdp = memory.Sharding(strategy="fsdp", world_size=8)
    # fp32 profile: the largest unit's parameters (3000) + its gradients in fp32 (3000)
    assert fsdp_stream_bytes(profile, fsdp) == 6000
    assert fsdp_stream_bytes(profile, memory.Sharding(strategy="fsdp", world_size=1)) == 0
    assert fsdp_stream_bytes(profile, memory.Sharding(strategy="ddp", world_size=8)) == 0
    reserve = reserve_for(profile, H100, fsdp)
    assert reserve.stream_bytes == 6000
    assert reserve.nccl_bytes == NCCL_COMMUNICATOR_BYTES == 128 * MiB  # one communicator
    assert reserve.fixed_bytes == 512 * MiB + 6000 + 128 * MiB
    # the context and NCCL's buffers are device memory outside the caching allocator
    assert reserve.reserved_bytes(10_000) == 10_000 + 500 + 6000
    ddp = reserve_for(profile, H100, memory.Sharding(strategy="ddp", world_size=8))
    assert ddp.fixed_bytes == 512 * MiB + 128 * MiB


def test_a_layout_rank_has_one_communicator_per_dimension():
    assert communicators(Parallel(dp_shard=8)) == 1
    assert communicators(Parallel(dp_shard=32, tp=8)) == 2
    assert communicators(Parallel(dp_shard=8, tp=8, pp=8)) == 3
    assert communicators(Parallel(dp_replicate=2, dp_shard=4, tp=2, pp=2, cp=2)) == 5
    assert communicators(Parallel()) == 0
