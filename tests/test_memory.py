"""The peak-memory model, term by term, on profiles whose every byte is known."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import ChainSpec, raw_profile, uniform_chain

from memplan import memory
from memplan.devices import DeviceSpec
from memplan.errors import BadInputError
from memplan.profile import Affine, Segment
from memplan.units import MiB

H100 = DeviceSpec(
    name="h100-80gb",
    display_name="H100",
    memory_bytes=80 * 1024**3,
    bf16_flops=989e12,
    fp16_flops=989e12,
    fp32_flops=67e12,
    memory_bandwidth=3.35e12,
)
CPU = DeviceSpec(
    name="cpu",
    display_name="CPU",
    memory_bytes=None,
    bf16_flops=1e11,
    fp16_flops=1e11,
    fp32_flops=1e11,
    memory_bandwidth=2e10,
)


def two_layer_profile(**kwargs):
    """Two layers with savings 10·b and 20·b; every segment written out by hand."""
    seg = Segment
    no_grads = [
        seg(held=0, active="none", points=((100, 1),)),
        seg(held=0, active="fwd", points=((100, 15),), ckpt_points=((100, 6),)),
        seg(held=1, active="fwd", points=((100, 40),), ckpt_points=((100, 25),)),
        seg(held=2, active="none", points=((100, 50), (160, 40))),
        seg(held=1, active="bwd", points=((150, 42),), ckpt_points=((150, 60),)),
        seg(held=0, active="bwd", points=((180, 20),), ckpt_points=((180, 22),)),
    ]
    resident = [
        seg(held=0, active="none", points=((300, 1),)),
        seg(held=2, active="none", points=((300, 50),)),
        seg(held=1, active="bwd", points=((300, 42),), ckpt_points=((300, 60),)),
    ]
    defaults = {
        "savings": [10.0, 20.0],
        "fwd_seconds": [1.0, 1.0],
        "timeline": {"no_grads": no_grads, "grads_resident": resident},
        "optimizer_peak": 350,
        "params_bytes": 50,
        "grad_bytes": 50,
        "optimizer_state_bytes": 100,
        "names": ["h.0", "h.1"],
    }
    defaults.update(kwargs)
    return raw_profile(**defaults)


# --------------------------------------------------------------------------- terms
def test_resident_terms_come_from_the_totals():
    profile = two_layer_profile()
    assert memory.params_bytes(profile) == 50
    assert memory.grads_bytes(profile) == 50
    assert memory.optimizer_state_bytes(profile) == 100


def test_points_round_up_and_savings_round_down():
    assert memory.point_bytes((10.0, 0.5), 3) == 12  # 11.5 -> 12
    assert memory.affine_bytes(Affine(intercept=0.2, slope=0.0), 7) == 1
    profile = two_layer_profile(savings=[Affine(intercept=0.5, slope=1.0), 2.75])
    assert memory.savings_bytes(profile, 2) == (2, 5)  # 2.5 -> 2, 5.5 -> 5


def test_held_savings_count_only_checkpointed_layers_before_held():
    savings = (10, 20, 30)
    assert memory.held_savings_bytes(savings, frozenset({0, 2}), held=2) == 10
    assert memory.held_savings_bytes(savings, frozenset({0, 2}), held=3) == 40
    assert memory.held_savings_bytes(savings, frozenset(), held=3) == 0


def test_segment_peak_by_hand():
    profile = two_layer_profile()
    b = 4
    savings = memory.savings_bytes(profile, b)  # (40, 80)
    head = profile.timeline["no_grads"][3]  # held=2, points 100+50b=300, 160+40b=320
    assert memory.segment_peak_bytes(head, b, frozenset(), savings) == 320
    assert memory.segment_peak_bytes(head, b, frozenset({0}), savings) == 280
    assert memory.segment_peak_bytes(head, b, frozenset({0, 1}), savings) == 200
    bwd1 = profile.timeline["no_grads"][4]  # layer 1 backward: plain 150+42b, ckpt 150+60b
    assert memory.segment_peak_bytes(bwd1, b, frozenset(), savings) == 318
    # Checkpointed: its own savings are not subtracted (it is active), the recompute is used.
    assert memory.segment_peak_bytes(bwd1, b, frozenset({1}), savings) == 390
    assert memory.segment_peak_bytes(bwd1, b, frozenset({0, 1}), savings) == 350


def test_step_peak_by_hand_and_where():
    profile = two_layer_profile(optimizer_peak=300)
    # b = 4, no checkpoint: no_grads max = max(104, 160, 260, 320, 318, 260) = 320
    # grads_resident = max(304, 500, 468) = 500; optimizer 300.
    one = memory.step_peak(profile, 4, [], accumulation_steps=1)
    assert (one.peak_bytes, one.phase, one.where) == (320, "no_grads", "head and loss after h.1")
    two = memory.step_peak(profile, 4, [], accumulation_steps=2)
    assert two.peak_bytes == 500
    assert two.where == "head and loss after h.1 (accumulation micro-step, gradients resident)"
    # Checkpoint h.0: resident head 500 - 40 = 460; resident bwd h.1 468 - 40 = 428.
    assert memory.step_peak(profile, 4, ["h.0"], 2).peak_bytes == 460
    # Checkpoint both: head 500-120=380; bwd h.1 ckpt 300+240-40 = 500 -> recompute peaks.
    both = memory.step_peak(profile, 4, [0, 1], 2)
    assert both.peak_bytes == 540 - 40
    assert both.where.startswith("recompute and backward of h.1")


def test_optimizer_step_can_be_the_peak():
    profile = two_layer_profile(optimizer_peak=10_000)
    peak = memory.step_peak(profile, 1, [], 1)
    assert (peak.peak_bytes, peak.phase, peak.where) == (10_000, "optimizer_step", "optimizer step")
    bd = peak.breakdown
    assert (bd.params, bd.optimizer, bd.grads, bd.activations) == (50, 100, 50, 0)
    assert bd.transient == 10_000 - 200


def test_accumulation_one_can_peak_lower_than_accumulation_two():
    """k = 1: gradients appear layer by layer while activations are freed; k >= 2: every
    gradient is resident while the next micro-step's activations build up."""
    spec = uniform_chain(4)
    profile = spec.profile()
    one = memory.step_peak(profile, 8, [], 1).peak_bytes
    two = memory.step_peak(profile, 8, [], 2).peak_bytes
    assert one < two
    assert one == spec.simulate_peak_bytes(8, [], 1)
    assert two == spec.simulate_peak_bytes(8, [], 2)
    # k = 2 and k = 7 differ in nothing the memory model sees.
    assert memory.step_peak(profile, 8, [], 7).peak_bytes == two


def test_chain_breakdown_by_hand():
    spec = uniform_chain(2, params=[1000, 1000], saved=[100, 100], output=[10, 10])
    profile = spec.profile()
    peak = memory.step_peak(profile, 1, [], 2)
    bd = peak.breakdown
    params = 2000 + 500 + 500
    assert (bd.params, bd.grads, bd.optimizer, bd.reserve) == (params, params, 2 * params, 0)
    assert bd.total == peak.peak_bytes
    # Peak: head and loss (resident): 4·params + embed 8 + 200 + head 20 + loss 30 per sample.
    assert peak.peak_bytes == 4 * params + 8 + 200 + 20 + 30
    assert bd.activations == 8 + 200 + 20  # held layers' saved bytes + fixed parts' saved
    assert bd.transient == 30


@pytest.mark.parametrize("accumulation", [1, 2])
def test_model_matches_direct_simulation_for_every_subset(accumulation):
    spec = ChainSpec(
        params=[100, 400, 50, 300],
        saved=[100, 300, 50, 200],
        output=[10, 30, 5, 20],
        fwd_seconds=[0.25, 0.5, 0.125, 0.25],
        recompute_transient=[200, 100, 500, 50],
    )
    profile = spec.profile()
    for b in (1, 3, 16):
        bounds = memory.step_bounds(profile, b, accumulation)
        for r in range(5):
            for subset in itertools.combinations(range(4), r):
                peak = memory.step_peak(profile, b, subset, accumulation)
                assert peak.peak_bytes == spec.simulate_peak_bytes(b, subset, accumulation)
                assert memory.bounds_peak_bytes(bounds, subset) == peak.allocated_bytes
                assert peak.breakdown.total == peak.peak_bytes


chains = st.integers(min_value=1, max_value=6).flatmap(
    lambda n: st.builds(
        ChainSpec,
        params=st.lists(st.integers(0, 5000), min_size=n, max_size=n),
        saved=st.lists(st.integers(20, 400), min_size=n, max_size=n),
        output=st.lists(st.integers(1, 20), min_size=n, max_size=n),
        fwd_seconds=st.just([0.25] * n),
        fwd_transient=st.lists(st.integers(0, 300), min_size=n, max_size=n),
        bwd_transient=st.lists(st.integers(0, 300), min_size=n, max_size=n),
        recompute_transient=st.lists(st.integers(0, 800), min_size=n, max_size=n),
        loss_transient=st.integers(0, 500),
        optimizer_transient=st.integers(0, 20000),
    )
)


@settings(max_examples=60, deadline=None)
@given(spec=chains, b=st.integers(1, 64), accumulation=st.integers(1, 3), data=st.data())
def test_model_matches_simulation_on_random_chains(spec, b, accumulation, data):
    profile = spec.profile()
    subset = data.draw(st.sets(st.integers(0, spec.n - 1)))
    peak = memory.step_peak(profile, b, subset, accumulation)
    assert peak.peak_bytes == spec.simulate_peak_bytes(b, subset, accumulation)
    assert peak.breakdown.total == peak.peak_bytes
    assert (
        min(
            peak.breakdown.params,
            peak.breakdown.grads,
            peak.breakdown.activations,
            peak.breakdown.transient,
        )
        >= 0
    )


# --------------------------------------------------------------------------- smallest peak
def brute_min_allocated(profile, b, accumulation, forced_in=frozenset(), forced_out=frozenset()):
    n = len(profile.layers)
    best = None
    for mask in range(1 << n):
        subset = {i for i in range(n) if mask >> i & 1}
        if not forced_in <= subset or subset & forced_out:
            continue
        value = memory.step_peak(profile, b, subset, accumulation).allocated_bytes
        best = value if best is None else min(best, value)
    return best


def test_checkpointing_everything_is_not_always_the_least_peak():
    # Layer 2's recompute brings back far more than it saves: checkpointing it raises the peak.
    spec = ChainSpec(recompute_transient=[90, 90, 5000, 90])
    profile = spec.profile()
    bounds = memory.step_bounds(profile, 4, 2)
    everything = memory.bounds_peak_bytes(bounds, range(4))
    least = memory.min_allocated_bytes(bounds)
    assert least < everything
    assert least == brute_min_allocated(profile, 4, 2)
    assert least == memory.bounds_peak_bytes(bounds, [0, 1, 3])


def test_least_peak_respects_forced_layers():
    profile = uniform_chain(4).profile()
    bounds = memory.step_bounds(profile, 4, 2)
    forced_out = frozenset({0, 1})
    assert memory.min_allocated_bytes(bounds, forced_out=forced_out) == brute_min_allocated(
        profile, 4, 2, forced_out=forced_out
    )
    assert memory.min_allocated_bytes(bounds, forced_out=forced_out) > memory.min_allocated_bytes(
        bounds
    )


# --------------------------------------------------------------------------- reserve, budget
def test_no_reserve_on_cpu():
    profile = uniform_chain(2).profile()
    assert memory.reserve_for(profile) == memory.NO_RESERVE
    assert memory.reserve_for(profile, CPU) == memory.NO_RESERVE


def test_measured_cuda_reserve_is_used_as_is():
    profile = ChainSpec(
        device="cuda",
        profile_kwargs={"allocator_reserve_bytes": 64 * MiB, "context_bytes": 400 * MiB},
    ).profile()
    reserve = memory.reserve_for(profile)
    assert (reserve.fixed_bytes, reserve.fragmentation_fraction) == (464 * MiB, 0.0)
    peak = memory.step_peak(profile, 2, [], 2, reserve=reserve)
    assert peak.peak_bytes == peak.allocated_bytes + 464 * MiB
    assert peak.breakdown.reserve == 464 * MiB
    assert peak.breakdown.total == peak.peak_bytes


def test_default_reserve_when_planning_a_cpu_profile_for_a_gpu():
    profile = uniform_chain(2).profile()
    reserve = memory.reserve_for(profile, H100)
    assert reserve.fixed_bytes == memory.DEFAULT_CONTEXT_BYTES == 512 * MiB
    assert reserve.fragmentation_fraction == memory.DEFAULT_FRAGMENTATION_FRACTION
    assert reserve.bytes_for(1000) == 512 * MiB + 50


def test_allocated_limit_is_the_largest_that_fits():
    reserve = memory.Reserve(fixed_bytes=1000, fragmentation_fraction=0.05)
    budget, margin = 1_000_000, 0.03
    usable = memory.usable_budget_bytes(budget, margin)
    assert usable == 970_000
    limit = memory.allocated_limit_bytes(budget, margin, reserve)
    assert limit + reserve.bytes_for(limit) <= usable
    assert limit + 1 + reserve.bytes_for(limit + 1) > usable
    assert memory.allocated_limit_bytes(budget, 0.0, memory.NO_RESERVE) == budget


def test_budget_for_peak_inverts_the_margin():
    for peak in (1, 999, 123_456_789):
        budget = memory.budget_for_peak_bytes(peak, 0.03)
        assert memory.usable_budget_bytes(budget, 0.03) >= peak
        assert memory.usable_budget_bytes(budget - 1, 0.03) < peak


def test_phases_for_accumulation():
    assert memory.phases_for(1) == ("no_grads",)
    assert memory.phases_for(4) == ("no_grads", "grads_resident")
    with pytest.raises(ValueError, match="accumulation_steps"):
        memory.phases_for(0)


def test_unknown_layer_name_is_a_bad_input():
    with pytest.raises(BadInputError, match="nope"):
        memory.step_peak(uniform_chain(2).profile(), 1, ["nope"], 1)


def test_plan_peak_reads_the_plan():
    from memplan.solver import SolveRequest, solve

    profile = uniform_chain(4).profile()
    plan = solve(profile, SolveRequest(target_batch=16, budget_bytes=10**6)).plan
    peak = memory.plan_peak(profile, plan)
    assert peak.peak_bytes == plan.predicted.peak_bytes
    assert peak.breakdown == plan.predicted.breakdown


def test_allocated_limit_below_the_reserve_is_exact():
    from memplan.memory import Reserve, allocated_limit_bytes, usable_budget_bytes

    reserve = Reserve(fixed_bytes=512 * 2**20, fragmentation_fraction=0.05, source="test")
    for budget in (1, 256 * 2**20, 527 * 2**20):
        usable = usable_budget_bytes(budget, 0.03)
        assert allocated_limit_bytes(budget, 0.03, reserve) == usable - reserve.fixed_bytes
    # Above the reserve the limit is the largest allocation whose total still fits.
    limit = allocated_limit_bytes(24 * 2**30, 0.03, reserve)
    usable = usable_budget_bytes(24 * 2**30, 0.03)
    assert limit + reserve.bytes_for(limit) <= usable < limit + 1 + reserve.bytes_for(limit + 1)
