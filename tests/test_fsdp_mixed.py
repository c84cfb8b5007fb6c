"""FSDP as big models train: the mixed-precision policy (bf16 parameters gathered per unit,
fp32 master shards) and the two ways to accumulate (reduce-scatter on the last micro-step or
on every one), by hand on a hand-made profile, through the solver, and for real on 2 gloo
ranks."""

import dataclasses

import pytest
from profiles_factory import uniform_chain

from memplan import memory, timing
from memplan.collective import Collective
from memplan.errors import BadInputError
from memplan.memory import Sharding
from memplan.plan import Breakdown, Plan, Prediction
from memplan.solver import SolveRequest, solve

# uniform_chain(4) read as a bf16-parameter probe: layers of 1000 B (500 bf16 elements),
# embedding and head 500 B each. P = G = 5000 B of bf16, AdamW moments S = 10000 B.
# A rank keeps fp32 masters: 2 × those bytes, split over the ranks.
P, G, S, ROOT, UNIT = 5000, 5000, 10000, 1000, 1000


def mixed(profile=None):
    profile = profile or uniform_chain(4).profile()
    env = dataclasses.replace(
        profile.environment, precision="bf16", param_dtype="bfloat16", mixed_precision="params"
    )
    return dataclasses.replace(profile, environment=env)


def index_of(profile, phase, where):
    for index in range(len(profile.timeline[phase])):
        if memory.describe_segment(profile, phase, index).split(" (")[0] == where:
            return index
    raise AssertionError(where)


def test_rank_state_is_fp32_master_shards():
    profile = mixed()
    for world in (2, 4):
        fsdp = Sharding(strategy="fsdp", world_size=world)
        assert memory.rank_state_bytes(profile, fsdp) == (
            2 * P // world,
            2 * G // world,
            2 * S // world,
        )
    # The optimizer step works on those: bf16 copies out, fp32 shards in (no transient here).
    fsdp = Sharding(strategy="fsdp", world_size=4)
    assert memory.optimizer_adjust_bytes(profile, fsdp) == -(P + S + G) + 2 * (P + S + G) // 4


def test_forward_holds_shards_and_one_gathered_bf16_unit():
    profile = mixed()
    fwd = index_of(profile, "no_grads", "forward of h.1")
    fsdp = Sharding(strategy="fsdp", world_size=4)
    # bf16 params and moments measured (P + S) out; fp32 quarters in; root + h.1 gathered.
    assert memory.segment_adjust_bytes(profile, fsdp, "no_grads", fwd, 2) == (
        -(P + S) + 2 * (P + S) // 4 + ROOT + UNIT
    )


@pytest.mark.parametrize(
    ("grad_sync", "phase", "grads"),
    [
        # A unit is 1000 B of bf16 gradients: 2000 B in fp32, a 500 B shard on each of 4
        # ranks, a 2000 B reduce-scatter input. In the backward of h.2, h.3's post_backward
        # has run; the root (1000 B of bf16 gradients) reduces only at the end.
        # First micro-step, no reduce-scatter: h.3 upcast to fp32, the root's in bf16.
        ("last_micro_step", "no_grads", 2000 + 1000),
        # Reduce-scatter every micro-step: h.3's shard and its input, kept until the next
        # unit's post_backward; the root's in bf16.
        ("every_micro_step", "no_grads", 500 + 2000 + 1000),
        # Last micro-step: h.3 reduced (shard and kept input), h.0 to h.2 and the root still
        # accumulated in fp32, the root's new bf16 gradients apart from its accumulator.
        ("last_micro_step", "grads_resident", 500 + 2000 + 3 * 2000 + 2000 + 1000),
        # Sharded every micro-step: every unit's shard, the kept input, the root's bf16.
        ("every_micro_step", "grads_resident", 5 * 500 + 2000 + 1000),
    ],
)
def test_accumulating_backward_by_hand(grad_sync, phase, grads):
    profile = mixed()
    fsdp = Sharding(strategy="fsdp", world_size=4, grad_sync=grad_sync)
    bwd = index_of(profile, phase, "backward of h.2")
    # gathered: root, h.2 and the prefetched h.1 (3000), all bf16 as measured
    assert memory.fsdp_gathered_bytes(profile, fsdp, phase, bwd) == ROOT + 2 * UNIT
    assert memory.fsdp_grads_bytes(profile, fsdp, phase, bwd, 2) == grads
    held = memory.grads_at_bytes(profile, phase, bwd)  # the probe's bf16 gradients, out
    assert held == (2000 if phase == "no_grads" else G)
    assert memory.segment_adjust_bytes(profile, fsdp, phase, bwd, 2) == (
        -(P + S) + 2 * (P + S) // 4 + ROOT + 2 * UNIT + grads - held
    )


def test_post_backward_puts_the_input_next_to_the_unsharded_gradients():
    # Right after h.2's backward in the last micro-step: after its post_backward h.2 and h.3
    # are shards (1000), h.0 and h.1 fp32 (4000), the root fp32 and bf16 (3000), h.2's
    # input kept (2000): 10000. During it, the input was allocated while h.2's 2000 B of
    # fp32 gradients were still alive and before its shard: 10000 - 500 + 2000 = 11500.
    profile = mixed()
    fsdp = Sharding(strategy="fsdp", world_size=4)
    after = index_of(profile, "grads_resident", "backward between h.2 and h.1")
    assert memory.fsdp_grads_bytes(profile, fsdp, "grads_resident", after, 2) == 11500


def test_reduce_scatter_every_micro_step_costs_k_reductions():
    kw = {"params_bytes": 100, "grads_bytes": 200, "accumulation_steps": 3}
    last = timing.communication_bytes("fsdp", 4, Collective(**kw))
    every = timing.communication_bytes("fsdp", 4, Collective(**kw, reduce_every_micro_step=True))
    assert last == pytest.approx(2 * 3 * 0.75 * 100 + 0.75 * 200)
    assert every == pytest.approx(2 * 3 * 0.75 * 100 + 3 * 0.75 * 200)


def request(**kwargs):
    fields = {
        "target_batch": 16,
        "world_size": 4,
        "strategy": "fsdp",
        "budget_bytes": 10**9,
        "margin": 0.0,
        "min_micro": 1,
        "max_micro": 1,
    }
    fields.update(kwargs)
    return SolveRequest(**fields)


def test_the_solver_picks_the_sync_by_memory_then_time():
    profile = mixed()
    peaks = {
        sync: memory.step_peak(
            profile,
            1,
            [0, 1, 2, 3],
            4,
            sharding=Sharding(strategy="fsdp", world_size=4, grad_sync=sync),
        ).peak_bytes
        for sync in ("last_micro_step", "every_micro_step")
    }
    assert peaks["every_micro_step"] < peaks["last_micro_step"]
    # Room for both: one reduce-scatter per step is faster.
    roomy = solve(profile, request()).plan
    assert roomy.grad_sync == "last_micro_step"
    assert roomy.mixed_precision == "params"
    assert any("the other way also fits" in r for r in roomy.reasons)
    # Only sharded gradients fit: the plan says so and records it.
    tight = solve(profile, request(budget_bytes=peaks["last_micro_step"] - 1)).plan
    assert tight.grad_sync == "every_micro_step"
    assert tight.predicted.peak_bytes <= peaks["last_micro_step"] - 1
    assert any(
        "reduce-scatters every micro-step" in r and "does not fit" in r for r in tight.reasons
    )


def test_profiles_and_strategies_that_do_not_go_together_are_refused():
    with pytest.raises(BadInputError, match="--strategy fsdp"):
        solve(mixed(), request(strategy="ddp"))
    with pytest.raises(BadInputError, match="--world-size 2 or more"):
        solve(mixed(), request(world_size=1, target_batch=4))
    autocast = dataclasses.replace(
        uniform_chain(4).profile(),
        environment=dataclasses.replace(mixed().environment, mixed_precision="autocast"),
    )
    with pytest.raises(BadInputError, match="--mixed-precision params"):
        solve(autocast, request())
    auto = solve(autocast, request(strategy="auto", max_micro=None))
    assert "fsdp" not in {c.strategy for c in auto.candidates}
    with pytest.raises(ValueError, match="mixed_precision 'params' needs"):
        Plan(
            target_batch=2,
            micro_batch_size=1,
            accumulation_steps=1,
            world_size=2,
            strategy="ddp",
            precision="bf16",
            mixed_precision="params",
            budget_bytes=1,
            model="m.py",
            predicted=Prediction(
                peak_bytes=1,
                step_seconds=1.0,
                breakdown=Breakdown(
                    params=1, grads=0, optimizer=0, activations=0, transient=0, reserve=0
                ),
            ),
        )


def test_probing_params_needs_a_low_precision():
    from memplan.probe.backends import make_backend

    with pytest.raises(BadInputError, match="--precision bf16"):
        make_backend("meta", "fp32", None, "params")
    with pytest.raises(BadInputError, match="autocast, params"):
        make_backend("meta", "bf16", None, "fp8")


@pytest.mark.parametrize("grad_sync", ["last_micro_step", "every_micro_step"])
def test_a_pipeline_stage_reduces_after_its_schedule(grad_sync):
    # torch.distributed.pipelining turns gradient sync off for every micro-batch's backward
    # and reduces after the schedule: in the last micro-batch's backward of h.2 no unit has
    # reduced, whatever the plan's grad_sync. h.0 to h.3 and the root accumulated in fp32
    # (5 × 2000), the root's new bf16 gradients apart (1000); no shard, no kept input.
    profile = mixed()
    stage = Sharding(
        strategy="fsdp",
        world_size=4,
        grad_sync=grad_sync,
        reshard_after_forward=False,
        reduce_after_schedule=True,
    )
    bwd = index_of(profile, "grads_resident", "backward of h.2")
    assert memory.fsdp_grads_bytes(profile, stage, "grads_resident", bwd, 2) == 5 * 2000 + 1000
    # the first micro-batch: h.3 upcast to fp32 by its post_backward, the root's in bf16
    first = index_of(profile, "no_grads", "backward of h.2")
    assert memory.fsdp_grads_bytes(profile, stage, "no_grads", first, 2) == 2000 + 1000
