"""Pipeline stages whose waiting micro-batches keep only what their blocks' modes keep, and
an interleaved-1F1B plan whose ``checkpoint:`` names every block (issue 31), on hand-made
chain profiles (memplan.memory.parallel.rank_profile, memplan.solver.parallel)."""

from __future__ import annotations

import dataclasses

from profiles_factory import uniform_chain

from memplan.memory.parallel import layout_peaks, own_checkpoint, stage_blocks, stage_checkpoint
from memplan.parallel import Parallel
from memplan.solver import SolveRequest
from memplan.solver.parallel import LayoutRequest, solve_layout


def _profile(n: int):
    """A chain of ``n`` blocks, as of a transformers decoder (``hf_blocks`` named): a model
    memplan splits into pipeline stages."""
    profile = uniform_chain(n, saved=[4000] * n, output=[400] * n).profile()
    return dataclasses.replace(profile, hf_blocks=profile.layer_names)


def test_interleaved_stand_ins_map_to_every_rank_block_once():
    layout = Parallel(pp=8, schedule="interleaved_1f1b", virtual_stages=2)
    owned = []
    for stage in range(8):
        run, own = stage_blocks(126, layout, stage)
        assert len(run) == len(own)
        owned.extend(own)
    assert sorted(owned) == list(range(126))  # every block on exactly one rank
    profile = _profile(126)
    every = dict.fromkeys(profile.layer_names, "full")
    for stage in range(8):
        mine = stage_checkpoint(profile, layout, stage, every)
        assert own_checkpoint(profile, layout, stage, mine) == {
            profile.layer_names[j]: "full" for j in stage_blocks(126, layout, stage)[1]
        }


def test_interleaved_plan_with_always_checkpoint_covers_every_block():
    # The bug: 126 blocks, pp 8 × 2 virtual stages, --always-checkpoint on every block, and
    # the plan's map named only the stand-in runs (blocks 62-109 left out).
    profile = _profile(126)
    request = SolveRequest(
        target_batch=64,
        budget_bytes=1 << 40,
        world_size=16,
        strategy="fsdp",
        always_checkpoint=("h.*",),
    )
    ask = LayoutRequest(pp=8, schedule="interleaved_1f1b", virtual_stages=2)
    plan = solve_layout(profile, request, ask).plan
    assert set(plan.checkpoint) == set(profile.layer_names)
    assert set(plan.checkpoint.values()) == {"full"}


def test_waiting_micro_batches_keep_only_their_checkpointed_inputs():
    # 1F1B, pp 4, 8 micro-batches: stage 0 holds 4 in flight. Every block fully
    # checkpointed: each waiting micro-batch keeps its blocks' inputs only, so stage 0's
    # peak is far below the plain run's; before, each waiting micro-batch was charged its
    # un-checkpointed bytes and the peak fell by a few percent only.
    n, b = 16, 2
    profile = _profile(n)
    layout = Parallel(pp=4, dp_shard=2)
    from memplan.plan import Breakdown, Plan, Prediction

    zero = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)

    def plan_with(checkpoint):
        return Plan(
            target_batch=b * 8 * 2,
            micro_batch_size=b,
            accumulation_steps=8,
            world_size=8,
            strategy="fsdp",
            shard_units=profile.layer_names,
            checkpoint=checkpoint,
            budget_bytes=1 << 40,
            predicted=Prediction(peak_bytes=0, step_seconds=1.0, breakdown=zero),
            model="m",
            parallel=layout,
        )

    plain = layout_peaks(profile, plan_with({})).stages[0].peak.allocated_bytes
    full = layout_peaks(profile, plan_with(dict.fromkeys(profile.layer_names, "full")))
    stage0 = full.stages[0]
    assert stage0.in_flight == 4
    layer = profile.layers[0]
    saved, kept = layer.saved_bytes.at(b), layer.saved_bytes.at(b) - layer.savings_bytes.at(b)
    # 3 waiting micro-batches × 4 blocks: each keeps `kept`, not `saved`
    drop = plain - stage0.peak.allocated_bytes
    assert drop >= 3 * 4 * (saved - kept), (plain, stage0.peak.allocated_bytes)
    # the solver's plan predicts what layout_peaks says for it
    request = SolveRequest(
        target_batch=b * 8 * 2,
        budget_bytes=1 << 40,
        world_size=8,
        strategy="fsdp",
        always_checkpoint=("h.*",),
        min_micro=b,
        max_micro=b,
    )
    solved = solve_layout(profile, request, LayoutRequest(pp=4)).plan
    assert solved.predicted.stage_peak_bytes == tuple(
        s.peak.peak_bytes for s in layout_peaks(profile, solved).stages
    )
    assert dataclasses.replace(solved).checkpoint == dict.fromkeys(profile.layer_names, "full")
