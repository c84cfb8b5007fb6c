"""DDP over TP-split parameters (issue 31, memplan.memory.ddp_tp): the split weights'
gradients are tensors of their own from their block's backward to the end of the backward,
besides DDP's buckets. Bytes by hand on a chain of four blocks of 1,000 B of parameters,
every one split by TP."""

from __future__ import annotations

import pytest
from profiles_factory import uniform_chain, with_tp_measurement
from tiny_llama import llama_reference

from memplan.memory.ddp_tp import ddp_splits_grads
from memplan.memory.parallel import rank_profile
from memplan.parallel import Parallel


def _profile():
    return with_tp_measurement(uniform_chain(4).profile(), 0.6)


def test_only_ddp_over_tp_holds_split_gradients_apart():
    assert ddp_splits_grads(Parallel(dp_replicate=2, tp=2))
    assert not ddp_splits_grads(Parallel(dp_shard=2, tp=2))  # FSDP2: DTensor gradients
    assert not ddp_splits_grads(Parallel(dp_replicate=2))  # nothing split
    assert not ddp_splits_grads(Parallel(tp=2))  # no DDP, no bucket
    assert not ddp_splits_grads(Parallel(dp_replicate=2, tp=2, pp=2))  # in-place all-reduce


def test_backward_of_block_h_holds_the_later_blocks_split_gradients():
    # tp 2: each block's split gradient on a rank is 1000 / 2 = 500 B. The backward of
    # block h holds those of blocks h+1..3: 3 → 0, 2 → 500, 1 → 1000, 0 → 1500; the
    # segment after the backwards all four (2000). The forward holds none.
    profile = _profile()
    plain = rank_profile(profile, Parallel(tp=2), 0, 1)
    ddp = rank_profile(profile, Parallel(dp_replicate=2, tp=2), 0, 1)
    seen = {}
    backward = False
    for a, b in zip(plain.timeline["no_grads"], ddp.timeline["no_grads"], strict=True):
        assert (a.held, a.active) == (b.held, b.active)
        extra = {q[0] - p[0] for p, q in zip(a.points, b.points, strict=True)}
        assert {q[1] - p[1] for p, q in zip(a.points, b.points, strict=True)} == {0}
        if a.active == "none" and a.held == 4:
            backward = True
        key = (a.held, a.active, backward)
        seen[key] = pytest.approx(extra.pop()) if len(extra) == 1 else extra
    assert seen[(0, "fwd", False)] == 0 and seen[(3, "fwd", False)] == 0
    assert seen[(4, "none", True)] == 0
    assert [seen[(h, "bwd", True)] for h in (3, 2, 1, 0)] == [0, 500, 1000, 1500]
    assert seen[(0, "none", True)] == 2000


@pytest.mark.slow
def test_tp2_ddp2_every_block_checkpointed_within_three_percent_on_four_ranks(tmp_path):
    # probe, solve --tp 2 (dp 2: DDP) at micro-batch 4 with every block fully checkpointed,
    # verify on 4 gloo ranks. Without the split gradients the prediction was 8.9% under
    # every rank (505,882 B against 555,352 measured; docs/design.md).
    import json

    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.plan import load_plan

    model = llama_reference(tmp_path / "llama")
    profile, plan_path = tmp_path / "p.yaml", tmp_path / "out" / "plan.yaml"
    runner = CliRunner()
    steps = [
        ["probe", model, "--timing-rounds", "1", "-o", str(profile)],
        [
            *("solve", str(profile), "--budget", "1GiB", "--target-batch", "8"),
            *("--world-size", "4", "--tp", "2", "--no-sequence-parallel"),
            *("--min-micro", "4", "--max-micro", "4"),
            # full only: with selective among the modes, which of the two is faster comes
            # from one timing round, and a busy machine flipped it (CI rehearsal)
            *("--always-checkpoint", "model.layers.*", "--modes", "keep,full"),
            *("-o", str(plan_path)),
        ],
        [
            *("verify", model, str(plan_path), "--world-size", "4", "--steps", "1"),
            *("--json", "--no-grad-check"),
        ],
    ]
    for args in steps:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    plan = load_plan(plan_path)
    assert plan.parallel.tp == 2 and plan.parallel.dp_replicate == 2
    assert set(plan.checkpoint.values()) == {"full"} and len(plan.checkpoint) == 4
    predicted = plan.predicted.peak_bytes
    measured = [r["peak_bytes"] for r in json.loads(result.stdout)["ranks"]]
    assert len(measured) == 4
    for peak in measured:
        assert abs(predicted / peak - 1) < 0.03, (predicted, measured)
