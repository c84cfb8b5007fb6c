"""Context parallel's ranks share FSDP's shards: torchtitan folds ``dp_shard`` and ``cp``
into one ``fsdp`` mesh dimension and applies ``fully_shard`` over it (torchtitan 0.3.0
distributed/parallel_dims.py ``build_mesh``, models/llama3/parallelize.py; 9dec370, the
published runs' commit, did the same with ``dp_shard_cp``), so a rank of dp_shard 2 × cp 2
holds a quarter of the state, not a half. Measured on 4 gloo ranks with torchtitan's own
mesh, and set beside memplan's per-rank model (``memory.parallel.layout_sharding``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from memplan import memory
from memplan.memory.parallel import communicators, layout_sharding
from memplan.parallel import Parallel
from memplan.verify.rank_lifetime import join_group

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

BLOCKS, WIDTH = 4, 64  # 4 bias-free 64 × 64 fp32 linears: 16 KiB each, 64 KiB in all


def shard_bytes_rank(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """One gloo rank: the model fully sharded over torchtitan's ``fsdp`` mesh of dp_shard 2
    × cp 2, as parallelize_llama gathers it (``get_mesh(["fsdp"])``); its local bytes."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed import ParallelDims

    join_group(rank, config)
    titan_dims.device_type = "cpu"  # torchtitan falls back to "cuda" (bench/engines.py)
    dims = ParallelDims(
        dp_replicate=1,
        dp_shard=2,
        cp=2,
        tp=1,
        pp=1,
        ep=1,
        world_size=int(config["world_size"]),
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    mesh = dims.get_mesh(["fsdp"])
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS)))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"local": local, "whole": whole, "mesh": mesh.size()}


def test_fsdp_shards_over_data_and_context_parallel_ranks_together():
    pytest.importorskip("torchtitan.distributed")
    from memplan.verify.distributed import free_port, run_ranks

    config = {
        "parent_pid": os.getpid(),
        "world_size": 4,
        "device": "cpu",
        "port": free_port(),
        "timeout_s": 120.0,
        "rank_fn": shard_bytes_rank,
    }
    ranks = run_ranks(config, lambda *_: None)
    whole = BLOCKS * WIDTH * WIDTH * 4
    assert [r["whole"] for r in ranks] == [whole] * 4
    # each rank holds 16 KiB of the 64 KiB: a quarter, over the mesh of 4
    assert [r["local"] for r in ranks] == [whole // 4] * 4
    assert [r["mesh"] for r in ranks] == [4] * 4
    parallel = Parallel(dp_shard=2, cp=2)
    sharding = layout_sharding("fsdp", parallel)
    assert sharding.world_size == whole // ranks[0]["local"]  # 4; it was dp_shard's 2


def test_a_cp_rank_holds_its_share_of_the_state():
    # uniform_chain(4): 5000 B of fp32 parameters and gradients, 10000 B of AdamW moments.
    # dp_shard 2 × cp 2 holds what FSDP over 4 ranks holds (the measured rule above: about
    # a quarter, each part's shard rounded up), not what FSDP over 2 holds; FSDP 1 × CP 8
    # (the published 8B at 262,144 tokens) an eighth, where it was all of it.
    from profiles_factory import uniform_chain

    from memplan.memory import Sharding

    profile = uniform_chain(4).profile()
    quarter = memory.rank_state_bytes(profile, layout_sharding("fsdp", Parallel(dp_shard=2, cp=2)))
    assert quarter == memory.rank_state_bytes(profile, Sharding(strategy="fsdp", world_size=4))
    assert quarter != memory.rank_state_bytes(profile, Sharding(strategy="fsdp", world_size=2))
    assert 5000 // 4 <= quarter[0] <= 5000 // 4 + 4 * 4 * 2  # at most 4 B a part rounded
    eighth = memory.rank_state_bytes(profile, layout_sharding("fsdp", Parallel(cp=8)))
    assert eighth == memory.rank_state_bytes(profile, Sharding(strategy="fsdp", world_size=8))
    assert 10000 // 8 <= eighth[2] <= 10000 // 8 + 48  # not all 10000 B: it was world 1
    # the shards' communicator spans dp_shard × cp, the ring's cp: two, at dp_shard 1 too
    assert communicators(Parallel(cp=8)) == 2
