"""Per-rank terms that verify found missing or wrong on correct plans (sweep D), by hand:

* ZeroRedundancyOptimizer's local step runs the wrapped optimizer on whole tensors: a
  tensor-by-tensor Adam keeps temporaries of the largest one, not 1/world of the probe's
  (an 8.5M-parameter MLP: −6% before);
* ZeroRedundancyOptimizer gives each rank whole tensors, greedily: the fullest rank's share,
  not 1/world (a head of 85% of the weights: −14% before)."""

from __future__ import annotations

import pytest
from profiles_factory import uniform_chain

from memplan.memory.rank_adjust import optimizer_adjust_bytes
from memplan.memory.sharding import (
    Sharding,
    rank_optimizer_state_bytes,
)
from memplan.memory.zero_partition import fullest_rank_bytes, greedy_partition

ZERO1 = Sharding(strategy="zero1", world_size=2)


def test_zero1_step_keeps_per_tensor_temporaries_of_the_largest_tensor():
    # a tensor-by-tensor Adam step: 3 temporaries of the largest tensor (a 1,000 B block),
    # as the probe measured on one process: a rank updating that tensor keeps all three
    spec = uniform_chain(4, optimizer_transient=3000)
    profile = spec.profile()
    ddp = Sharding(strategy="ddp", world_size=2)
    state = rank_optimizer_state_bytes(profile, ZERO1)
    full_state = 2 * spec.params_bytes()
    # the step's temporaries stay whole: only the state a rank does not hold comes off
    assert optimizer_adjust_bytes(profile, ZERO1) == -(full_state - state)
    assert optimizer_adjust_bytes(profile, ddp) == 0


def test_zero1_foreach_like_transient_still_scales_with_the_share():
    # temporaries as large as the whole state (a foreach step) over 4 ranks of 8 blocks:
    # the rank's share of them, not the per-tensor bound
    spec = uniform_chain(8, optimizer_transient=20000)
    profile = spec.profile()
    zero1 = Sharding(strategy="zero1", world_size=4)
    state = rank_optimizer_state_bytes(profile, zero1)
    total = 2 * spec.params_bytes()
    scaled = -(-20000 * state // total)
    assert scaled > 3 * 1000
    expected = -(total - state) - (20000 - scaled)
    assert optimizer_adjust_bytes(profile, zero1) == expected


def test_greedy_partition_is_torchs_rule():
    # bighead.py: head.weight 128,000 elements, head.bias 2,000, four blocks (fc 4,096 + 64,
    # norm 64 + 64), inp 2,048 + 64: the head's weight alone on rank 0
    blocks = [4096, 64, 64, 64] * 4
    sizes = [2048, 64, *blocks, 128000, 2000]
    assert greedy_partition([sizes], 2) == [128000, sum(sizes) - 128000]
    # ties go to the lowest rank; sizes carry over between parameter groups
    assert greedy_partition([[5, 5, 5], [4]], 2) == [10, 9]
    assert greedy_partition([[7]], 1) == [7]


def test_zero1_state_is_the_fullest_ranks_share():
    # one part (the head) holds most of the state: a rank holding it holds more than half
    spec = uniform_chain(4, head_params=17000)
    profile = spec.profile()
    total = 2 * spec.params_bytes()  # 2 × 21,500 = 43,000
    head = 2 * 17000
    worst = rank_optimizer_state_bytes(profile, ZERO1)
    # torch's rule over the parts, each one tensor: the head alone on one rank
    parts = [2 * 500, *[2 * 1000] * 4, head]
    assert worst == max(greedy_partition([parts], 2)) == head == 34000 > total // 2
    # DeepSpeed's ZeRO-2 and FSDP split every tensor (a flat buffer): half, as before
    assert rank_optimizer_state_bytes(profile, Sharding(strategy="zero2", world_size=2)) == 21500


def test_fullest_rank_deals_the_parts_by_torchs_rule():
    # 3→r0, 3→r1, 2→r0, 2→r1, 2→r0: 7 and 5; state in no part spread evenly; a negative
    # rest (a parameter counted in two parts) is not taken off
    assert fullest_rank_bytes([3, 3, 2, 2, 2], 0, 2) == 7
    assert fullest_rank_bytes([3, 3, 2, 2, 2], 4, 2) == 9
    assert fullest_rank_bytes([3, 3, 2, 2, 2], -3, 2) == 7
    # Llama 3 8B's Adam state over 8 ranks (GB): embedding and head 4.2 each, 32 blocks of
    # 1.75: within a block of the even share, where Graham's bound added 3.7 GB
    parts = [420, *[175] * 32, 420]
    even = -(-sum(parts) // 8)
    assert even <= fullest_rank_bytes(parts, 0, 8) <= even + 175


# ------------------------------------------------------------------ measured on 2 gloo ranks
TINY = """
import torch, torch.nn.functional as F
from torch import nn
class Block(nn.Module):
    def __init__(self, d):
        super().__init__(); self.fc = nn.Linear(d, d); self.norm = nn.LayerNorm(d)
    def forward(self, x):
        return x + F.gelu(self.norm(self.fc(x)))
class M(nn.Module):
    def __init__(self, d, n, out):
        super().__init__()
        self.inp = nn.Linear(32, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
        self.head = nn.Linear(d, out)
    def forward(self, x):
        return self.head(self.blocks(self.inp(x)).mean(1))
def make_batch(b):
    return {{"x": torch.randn(b, 16, 32), "y": torch.randint(0, {out}, (b,))}}
def training_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])
def build_model():
    torch.manual_seed(0)
    m = M({d}, 4, {out})
    {freeze}
    return m
"""

BIG_HEAD = TINY.format(d=64, out=2000, freeze="pass")  # the head: 85% of the weights


@pytest.mark.slow  # probe, solve and verify on 2 gloo ranks
@pytest.mark.parametrize(
    ("source", "strategy", "target"),
    [(BIG_HEAD, "zero1", 16)],
    ids=["zero1-big-head"],
)
def test_every_rank_verifies_within_2_percent(source, strategy, target, tmp_path):
    # Before: zero1 predicted the even share on both ranks, −14.3% (rank 0, over the
    # budget a plan had "fit") and +18.0% (rank 1).
    import json

    from typer.testing import CliRunner

    from memplan.cli import app

    model = tmp_path / "model.py"
    model.write_text(source)

    def run(*args):
        return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)

    profile, plan = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    done = run("probe", model, "--device", "cpu", "--timing-rounds", 1, "-o", profile)
    assert done.exit_code == 0, done.output
    done = run(
        *("solve", profile, "--target-batch", target, "--budget", "1GiB"),
        *("--world-size", 2, "--strategy", strategy, "-o", plan),
    )
    assert done.exit_code == 0, done.output
    done = run("verify", plan, "--steps", 2, "--json")
    data = json.loads(done.stdout)
    predicted = data["predicted_rank_peaks"]
    measured = [rank["peak_bytes"] for rank in data["ranks"]]
    errors = [p / m - 1 for p, m in zip(predicted, measured, strict=True)]
    assert all(abs(e) <= 0.02 for e in errors), (predicted, measured)
    assert done.exit_code == 0, done.output
