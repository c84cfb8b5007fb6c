"""A rank that dies tearing gloo down after every rank reported (torch's "terminate called
without an active exception", seen in CI under load) does not throw the run's figures
away; one that dies before reporting still fails the run."""

import atexit
import os

import pytest
import torch.distributed as dist

from memplan.errors import CannotMeasureError
from memplan.verify.distributed import free_port, run_ranks
from memplan.verify.rank_lifetime import join_group

pytestmark = pytest.mark.slow


def _abort_at_exit(rank, config):
    join_group(rank, config)
    dist.barrier()
    if rank == 1:
        atexit.register(os.abort)  # after the launcher's final barrier and teardown
    return {"rank": rank, "figure": 100 + rank}


def _abort_before_reporting(rank, config):
    join_group(rank, config)
    if rank == 1:
        os.abort()
    dist.barrier()
    return {"rank": rank}


def _config(rank_fn):
    return {
        "parent_pid": os.getpid(),
        "world_size": 2,
        "device": "cpu",
        "port": free_port(),
        "timeout_s": 120.0,
        "rank_fn": rank_fn,
    }


def test_a_rank_that_dies_after_reporting_keeps_the_figures_with_a_warning():
    results = run_ranks(_config(_abort_at_exit), lambda *_: None)
    assert [r["figure"] for r in results] == [100, 101]
    for result in results:
        (said,) = [w for w in result["warnings"] if "tearing down" in w]
        assert said.startswith("rank 1 was killed by signal SIGABRT while tearing down")


def test_a_rank_that_dies_before_reporting_fails_the_run():
    with pytest.raises(CannotMeasureError) as err:
        run_ranks(_config(_abort_before_reporting), lambda *_: None)
    assert "rank 1 was killed by signal SIGABRT" in str(err.value)
