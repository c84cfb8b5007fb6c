"""The CUDA reserve as a model of its parts (issue 31, memplan.memory.budget): the CUDA
context, the caching allocator's rounding and fragmentation, FSDP2's all-gather and
reduce-scatter stream pools, NCCL's buffers; nothing off CUDA."""

import os

import pytest
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


def test_fsdp_pools_hold_the_largest_gathered_unit_and_every_sharded_gradient():
    profile = _profile()
    fsdp = memory.Sharding(strategy="fsdp", world_size=8)
    # fp32 profile. All-gather pool: the largest unit gathered, block 2's 3000 B (the root,
    # embedding and head of 500 B each, gathers 1000). Reduce-scatter pool: every unit's
    # shard, padded to whole elements per rank: the 1000 B units (250 elements) 32 elements
    # = 128 B each, four blocks and the root; block 2 (750 elements) 94 elements = 376 B.
    shards = 5 * 128 + 376
    assert memory.fsdp_sharded_grads_bytes(profile, fsdp) == shards == 1016
    assert fsdp_stream_bytes(profile, fsdp) == 3000 + shards
    assert fsdp_stream_bytes(profile, memory.Sharding(strategy="fsdp", world_size=1)) == 0
    assert fsdp_stream_bytes(profile, memory.Sharding(strategy="ddp", world_size=8)) == 0
    reserve = reserve_for(profile, H100, fsdp)
    assert reserve.stream_bytes == 4016
    assert reserve.nccl_bytes == NCCL_COMMUNICATOR_BYTES == 128 * MiB  # one communicator
    assert reserve.fixed_bytes == 512 * MiB + 4016 + 128 * MiB
    # the context and NCCL's buffers are device memory outside the caching allocator
    assert reserve.reserved_bytes(10_000) == 10_000 + 500 + 4016
    ddp = reserve_for(profile, H100, memory.Sharding(strategy="ddp", world_size=8))
    assert ddp.fixed_bytes == 512 * MiB + 128 * MiB


def test_the_root_unit_is_the_gathered_pool_when_it_is_the_largest():
    # blocks of 1000 B, embedding and head of 500 B each: the root (1000 B) ties the
    # blocks; with a 4000 B embedding the root gathers 4500 B, the pool's largest unit
    profile = uniform_chain(3, embed_params=4000).profile()
    fsdp = memory.Sharding(strategy="fsdp", world_size=2)
    assert memory.gathered_root_bytes(profile) == 4500
    shards = 3 * 500 + 2252  # per rank 125 of a block's 250 elements, 563 of the root's 1125
    assert fsdp_stream_bytes(profile, fsdp) == 4500 + shards


def test_shards_resident_across_micro_steps_are_allocated_bytes_not_a_pool():
    # Reduce-scattering every micro-step with accumulation, the shards of the first
    # micro-step stay live through the next ones: the allocated peak holds them already.
    # Reducing on the last micro-step only, or with one micro-step, they are freed by
    # zero_grad before the next forward and the pool keeps their blocks.
    profile = _profile()
    every = memory.Sharding(strategy="fsdp", world_size=8, grad_sync="every_micro_step")
    last = memory.Sharding(strategy="fsdp", world_size=8)
    assert memory.fsdp_shards_resident(every, 2)
    assert not memory.fsdp_shards_resident(every, 1)
    assert not memory.fsdp_shards_resident(last, 2)
    assert fsdp_stream_bytes(profile, every, 2) == 3000
    assert fsdp_stream_bytes(profile, every, 1) == fsdp_stream_bytes(profile, last, 2) == 4016
    assert reserve_for(profile, H100, every, accumulation_steps=2).stream_bytes == 3000


def test_a_layout_rank_has_one_communicator_per_dimension():
    assert communicators(Parallel(dp_shard=8)) == 1
    assert communicators(Parallel(dp_shard=32, tp=8)) == 2
    assert communicators(Parallel(dp_shard=8, tp=8, pp=8)) == 3
    assert communicators(Parallel(dp_replicate=2, dp_shard=4, tp=2, pp=2, cp=2)) == 5
    assert communicators(Parallel()) == 0


def _sharded_grad_storages(rank: int, world: int, init_file: str, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist
    from gloo_ranks import leave_gloo
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from memplan.verify.distributed import _loopback_interface

    interface = _loopback_interface()  # as verify's ranks: gloo on loopback, not the hostname's
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    model(torch.randn(4, 8)).sum().backward()
    storages = {
        name: param.grad.to_local().untyped_storage().data_ptr()
        for name, param in model.named_parameters()
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(storages, f)
    leave_gloo()


@pytest.mark.slow
def test_fsdp2_sharded_gradients_are_views_of_one_reduce_scatter_output_per_unit(tmp_path):
    # The reduce-scatter pool's premise, on the installed torch: a unit's sharded gradients
    # are views of the one reduce-scatter output foreach_reduce allocates (in the
    # reduce-scatter stream on CUDA), not tensors of their own; so the pool keeps every
    # unit's output until zero_grad drops the gradients.
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "storages")
    mp.spawn(_sharded_grad_storages, args=(2, str(tmp_path / "init"), out), nprocs=2, join=True)
    for rank in range(2):
        storages = json.loads((tmp_path / f"storages.{rank}").read_text())
        assert storages["0.weight"] == storages["0.bias"]
        assert storages["1.weight"] == storages["1.bias"]
        assert storages["0.weight"] != storages["1.weight"]
