"""The solver on hand-built profiles: choices, reasons, errors. Brute force lives in
test_solver_bruteforce.py."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import ChainSpec, raw_profile, uniform_chain

from memplan import memory
from memplan.devices import DeviceSpec
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.plan import Plan
from memplan.profile import Segment
from memplan.solver import SolveRequest, SolveRequestError, least_recompute_set, solve
from memplan.units import format_bytes

GPU = DeviceSpec(
    name="testgpu",
    display_name="Test GPU",
    memory_bytes=10**12,
    bf16_flops=2e12,
    fp16_flops=2e12,
    fp32_flops=1e12,
    memory_bandwidth=1e11,
)


def peak_of(profile, b, subset, k):
    return memory.step_peak(profile, b, subset, k).peak_bytes


def request(**kwargs):
    defaults = {"target_batch": 32, "budget_bytes": 10**9, "margin": 0.0}
    defaults.update(kwargs)
    return SolveRequest(**defaults)


def test_importing_the_solver_imports_neither_torch_nor_rich():
    code = (
        "import sys, memplan.solver, memplan.memory, memplan.timing; "
        "bad = [m for m in ('torch', 'rich') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_everything_fits_largest_micro_batch_without_checkpointing():
    profile = uniform_chain(4, fixed_seconds=1.0).profile()
    result = solve(profile, request())
    plan = result.plan
    assert (plan.micro_batch_size, plan.accumulation_steps, plan.checkpoint_layers) == (32, 1, ())
    assert plan.predicted.peak_bytes == peak_of(profile, 32, [], 1)
    assert [c.micro_batch for c in result.candidates] == [1, 2, 4, 8, 16, 32]
    assert [c.chosen for c in result.candidates] == [False] * 5 + [True]
    assert any("no activation checkpointing needed" in r for r in plan.reasons)


def test_checkpoints_earliest_layers_when_recompute_beats_accumulation():
    # A large per-micro-step overhead makes one micro-step of 32 with recompute faster than
    # two of 16 without it.
    profile = uniform_chain(8, fixed_seconds=100.0).profile()
    budget = peak_of(profile, 32, [0, 1, 2], 1)
    assert peak_of(profile, 32, [0, 1], 1) > budget  # two layers are not enough
    result = solve(profile, request(budget_bytes=budget))
    plan = result.plan
    assert plan.micro_batch_size == 32
    assert plan.checkpoint_layers == ("h.0", "h.1", "h.2")  # identical layers: earliest
    assert plan.predicted.peak_bytes <= budget
    assert any(r.startswith("checkpointing 3 of 8 layers (h.0, h.1, h.2)") for r in plan.reasons)


def test_accumulates_when_recompute_costs_more():
    profile = uniform_chain(8, fixed_seconds=0.125).profile()
    budget = peak_of(profile, 32, [0, 1, 2], 1)
    result = solve(profile, request(budget_bytes=budget))
    plan = result.plan
    assert plan.checkpoint_layers == ()
    # The largest micro-batch that fits without checkpointing (gradients resident from k = 2).
    largest = max(b for b in (1, 2, 4, 8, 16) if peak_of(profile, b, [], 32 // b) <= budget)
    assert plan.micro_batch_size == largest
    row32 = result.candidates[-1]
    assert row32.fits and row32.n_checkpointed == 3 and not row32.chosen
    assert row32.step_seconds > plan.predicted.step_seconds
    assert f"micro-batch {largest} is the fastest plan that fits" in plan.reasons[2]


def test_reason_says_how_far_over_budget_a_larger_micro_batch_is():
    profile = uniform_chain(2, fixed_seconds=0.0).profile()
    budget = peak_of(profile, 16, [0, 1], 2)
    result = solve(profile, request(budget_bytes=budget, never_checkpoint=("h.0", "h.1")))
    assert result.plan.micro_batch_size == 8  # 16 needs checkpointing, forbidden here
    need = peak_of(profile, 16, [], 2)
    line = f"micro-batch 16 would need {format_bytes(need)}: over budget by {format_bytes(need - budget)}"
    assert line in result.plan.reasons
    assert "over budget by" in result.candidates[4].note


def test_margin_is_applied_to_the_budget():
    profile = uniform_chain(2, fixed_seconds=1.0).profile()
    peak32 = peak_of(profile, 32, [], 1)
    assert solve(profile, request(budget_bytes=peak32, margin=0.0)).plan.micro_batch_size == 32
    plan = solve(profile, request(budget_bytes=peak32, margin=0.03)).plan
    assert plan.predicted.peak_bytes <= memory.usable_budget_bytes(peak32, 0.03)
    assert plan.margin == 0.03


def test_ties_prefer_fewer_checkpointed_layers_then_larger_micro_batch():
    # No time at all: every plan takes 0 s. Fewer checkpointed layers wins, then larger b.
    profile = uniform_chain(
        4, fixed_seconds=0.0, optimizer_seconds=0.0, fwd_seconds=[0.0] * 4
    ).profile()
    budget = peak_of(profile, 8, [], 2)
    plan = solve(profile, request(target_batch=32, budget_bytes=budget)).plan
    assert (plan.micro_batch_size, plan.checkpoint_layers) == (8, ())


def test_always_and_never_checkpoint_are_respected_and_globs_match():
    profile = uniform_chain(4, fixed_seconds=1.0).profile()
    plan = solve(profile, request(always_checkpoint=("h.3",))).plan
    assert plan.checkpoint_layers == ("h.3",)
    assert any("always checkpointed, as requested: h.3" in r for r in plan.reasons)
    plan = solve(profile, request(always_checkpoint=("h.*",))).plan
    assert plan.checkpoint_layers == ("h.0", "h.1", "h.2", "h.3")
    budget = peak_of(profile, 32, [1, 2, 3], 1)
    plan = solve(
        profile,
        request(budget_bytes=budget, never_checkpoint=("h.0",), target_batch=32, min_micro=32),
    ).plan
    assert "h.0" not in plan.checkpoint_layers
    assert plan.predicted.peak_bytes <= budget


def test_unknown_layer_names_list_the_valid_ones():
    profile = uniform_chain(3).profile()
    with pytest.raises(BadInputError) as err:
        solve(profile, request(always_checkpoint=("h.7", "h1")))
    text = str(err.value)
    assert "always_checkpoint" in text and "'h.7'" in text and "'h1'" in text
    assert "h.0, h.1, h.2" in text
    assert "Did you mean" in text
    assert err.value.exit_code == 2


def test_bad_target_names_the_nearest_valid_targets():
    profile = uniform_chain(2).profile()
    with pytest.raises(BadInputError, match="not a multiple of world_size 3") as err:
        solve(profile, request(target_batch=10, world_size=3))
    assert "9 or 12" in str(err.value)
    with pytest.raises(BadInputError, match="no micro-batch") as err:
        solve(profile, request(target_batch=7, min_micro=3, max_micro=4))
    assert "6 or 8" in str(err.value)


def test_nearest_valid_targets_end_on_any_input():
    """A --min-micro of 10**17 with a target of 8 stepped through every target below 10**17
    to find the nearest one above (no end in practice); a range of one micro-batch far below
    the target stepped once a world size per candidate. Both now answer at once, with targets
    that split."""
    from memplan.solver.batches import _nearest_valid_targets, micro_batch_sizes

    profile = uniform_chain(2).profile()
    with pytest.raises(BadInputError, match="no micro-batch") as err:
        solve(profile, request(target_batch=8, min_micro=10**17))
    assert str(err.value).endswith("Nearest valid target batches: 100000000000000000.")
    target = 10**15 + 7
    found = _nearest_valid_targets(target, 1, 10**6, 10**6)
    assert found == [10**15, 10**15 + 10**6]
    assert all(micro_batch_sizes(t, 1, 10**6, 10**6) == [10**6] for t in found)


@given(
    target=st.integers(1, 10**15),
    world=st.integers(1, 64),
    lo=st.integers(1, 10**9),
    span=st.one_of(st.none(), st.integers(0, 10**9)),
)
@settings(max_examples=200, deadline=None)
def test_nearest_valid_targets_are_valid_and_straddle_the_target(target, world, lo, span):
    from memplan.solver.batches import _nearest_valid_targets, micro_batch_sizes

    hi = None if span is None else lo + span
    found = _nearest_valid_targets(target, world, lo, hi)
    assert found and found[-1] > target and all(t < target for t in found[:-1])
    assert all(micro_batch_sizes(t, world, lo, hi) for t in found)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("target_batch", 10**20),
        ("budget_bytes", 10**30),
        ("min_micro", 2**62 + 1),
        ("max_micro", 10**19),
        ("world_size", 10**20),
        ("host_memory_bytes", 10**25),
    ],
)
def test_absurd_integers_are_the_users_input_not_memplans_failure(field, value):
    """A target batch of 10**20 (or a 10**30-byte budget) was solved, and the plan it made
    refused by memplan's own read-back: exit 3, "memplan's failure". Now exit 2 naming the
    field, before any solving."""
    fields = {"target_batch": 8, "budget_bytes": 2**30, field: value}
    with pytest.raises(SolveRequestError, match=rf"{field} {value} is absurdly large") as err:
        SolveRequest(**fields)
    assert err.value.exit_code == 2
    SolveRequest(**{**fields, field: 2**62})  # the largest a plan holds is still taken


def test_world_size_divides_the_target():
    profile = uniform_chain(2, fixed_seconds=1.0).profile()
    result = solve(profile, request(target_batch=64, world_size=4))
    plan = result.plan
    assert plan.micro_batch_size * plan.accumulation_steps == 16
    assert plan.world_size == 4
    assert [c.micro_batch for c in result.candidates] == [1, 2, 4, 8, 16]


# --------------------------------------------------------------------------- BatchNorm
def bn_profile():
    return uniform_chain(4, fixed_seconds=0.0, layer_has_batchnorm=[True] * 4).profile()


def test_batchnorm_floor_is_never_crossed_and_said_so():
    profile = bn_profile()
    budget = peak_of(profile, 16, [0, 1, 2, 3], 4)
    result = solve(profile, request(target_batch=64, budget_bytes=budget))
    plan = result.plan
    assert plan.micro_batch_size == 16  # 8 would be faster (no recompute) but is below 16
    assert any("micro-batches below 16 (1, 2, 4, 8) excluded" in r for r in plan.reasons)
    assert any("BatchNorm" in w for w in plan.warnings)
    assert any("update twice" in w for w in plan.warnings)
    rows = {c.micro_batch: c for c in result.candidates}
    assert rows[8].fits and not rows[8].feasible and "BatchNorm floor" in rows[8].note


def test_an_op_sequence_that_differed_is_warned_once_in_the_plan():
    """The probe records the warning in the profile; the plan said it in its own words (with
    the micro-batch to verify at) and then repeated the profile's: once now, as BatchNorm's
    and the extrapolation's are. A profile without the recorded warning still gets it."""
    import dataclasses

    recorded = (
        "The op sequence differed between probed sizes (data-dependent routing?): segment "
        "maxima were fitted, not points; verify plans at their micro-batch."
    )
    base = uniform_chain(4).profile()
    assert min(base.micro_batches) == 1
    one = (
        ", or micro-batch 1 taking its own path (a batch dimension of 1 skips copies): probe "
        "from 2 (--micro-batches 2,4,8) if the model routes nothing by data"
    )
    for warnings in ((recorded,), ()):
        profile = dataclasses.replace(base, op_sequence_stable=False, warnings=warnings)
        budget = peak_of(profile, 8, [], 1)
        plan = solve(profile, request(target_batch=16, budget_bytes=budget)).plan
        said = [w for w in plan.warnings if "op sequence differed" in w]
        assert said == [
            f"the op sequence differed between probed sizes (data-dependent routing{one}): "
            f"verify the plan at micro-batch {plan.micro_batch_size}"
        ], plan.warnings
    # probed from 2: micro-batch 1's own path is not the reason
    from_two = dataclasses.replace(base, op_sequence_stable=False, micro_batches=(2, 4))
    plan = solve(from_two, request(target_batch=16, budget_bytes=budget)).plan
    said = [w for w in plan.warnings if "op sequence differed" in w]
    assert said == [
        "the op sequence differed between probed sizes (data-dependent routing): "
        f"verify the plan at micro-batch {plan.micro_batch_size}"
    ], plan.warnings


def test_batchnorm_floor_can_be_waived():
    profile = bn_profile()
    budget = peak_of(profile, 16, [0, 1, 2, 3], 4)
    plan = solve(
        profile, request(target_batch=64, budget_bytes=budget, allow_small_bn_micro=True)
    ).plan
    assert plan.micro_batch_size < 16 and plan.checkpoint_layers == ()
    assert any("waived" in r for r in plan.reasons)


def test_batchnorm_target_below_the_floor_is_a_bad_input():
    with pytest.raises(BadInputError, match="BatchNorm") as err:
        solve(bn_profile(), request(target_batch=8))
    assert "16" in str(err.value) and "allow-small-bn-micro" in str(err.value)


def test_no_plan_fits_when_only_small_bn_micro_batches_would():
    profile = bn_profile()
    budget = peak_of(profile, 4, [], 16)
    assert budget < memory.min_allocated_bytes(memory.step_bounds(profile, 16, 4))
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(target_batch=64, budget_bytes=budget))
    assert "would fit" in err.value.hint and "allow-small-bn-micro" in err.value.hint


# --------------------------------------------------------------------------- nothing fits
def test_nothing_fits_reports_the_least_peak_and_the_closest_plan():
    profile = uniform_chain(4).profile()
    least = min(
        peak_of(profile, 1, subset, 32)
        for subset in [(), (0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 2, 3), (2, 3), (3,)]
    )
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(budget_bytes=least - 1))
    exc = err.value
    assert exc.exit_code == 1
    assert exc.min_peak_bytes == least
    assert isinstance(exc.closest, Plan)
    assert exc.closest.micro_batch_size == 1
    assert exc.closest.predicted.peak_bytes == least
    assert "a budget of at least" in exc.hint
    assert "LoRA" in exc.hint and "bf16" in exc.hint
    # And a budget of exactly that fits.
    assert solve(profile, request(budget_bytes=least)).plan.predicted.peak_bytes == least


def test_a_plan_ruled_out_only_by_the_margin_says_so_and_how_to_plan_anyway():
    """The closest plan fits the budget itself; only the 3% margin rules it out."""
    profile = uniform_chain(4).profile()
    least = min(
        peak_of(profile, 1, subset, 32)
        for subset in [(), (0,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 2, 3), (2, 3), (3,)]
    )
    budget = least + least // 100  # 1% above the least peak: within the budget, not the margin
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(budget_bytes=budget, margin=0.03))
    hint = err.value.hint
    assert "only the 3% safety margin rules it out" in hint and "--margin 0 " in hint
    accepted = float(hint.split("(or --margin ")[1].split(")")[0])
    assert 0.009 <= accepted < 0.01
    # Both suggestions plan: margin 0 and the margin named.
    for margin in (0.0, accepted):
        plan = solve(profile, request(budget_bytes=budget, margin=margin)).plan
        assert least <= plan.predicted.peak_bytes <= memory.usable_budget_bytes(budget, margin)
    # A budget below the least peak gets no such hint: the margin is not what rules it out.
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(budget_bytes=least - 1, margin=0.03))
    assert "safety margin rules it out" not in err.value.hint


def test_model_state_too_big_suggests_sharding():
    profile = uniform_chain(2, params=[10**6, 10**6]).profile()
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(budget_bytes=10**6))
    assert "model state alone" in err.value.hint and "FSDP" in err.value.hint


def test_min_micro_excluding_a_fitting_micro_batch_is_suggested():
    profile = uniform_chain(2).profile()
    budget = peak_of(profile, 2, [0, 1], 16)
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(budget_bytes=budget, min_micro=4))
    assert "micro-batch 2 would fit" in err.value.hint and "--min-micro" in err.value.hint


# --------------------------------------------------------------------------- CUDA reserve
def test_planning_for_a_gpu_adds_the_reserve():
    profile = uniform_chain(2, fixed_seconds=1.0).profile()
    reserve = memory.reserve_for(profile, GPU)
    alloc = memory.step_peak(profile, 32, [], 1).allocated_bytes
    budget = alloc + reserve.bytes_for(alloc)
    plan = solve(profile, request(budget_bytes=budget, device_spec=GPU)).plan
    assert plan.micro_batch_size == 32
    assert plan.predicted.breakdown.reserve == reserve.bytes_for(alloc)
    assert plan.predicted.peak_bytes == budget
    assert plan.device == "testgpu"
    assert any("reserved for CUDA" in r for r in plan.reasons)
    smaller = solve(profile, request(budget_bytes=budget - 1, device_spec=GPU)).plan
    assert smaller.predicted.peak_bytes <= budget - 1


# --------------------------------------------------------------------------- request
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("target_batch", 0),
        ("budget_bytes", -1),
        ("world_size", 0),
        ("min_micro", 0),
        ("margin", 1.0),
        ("margin", -0.1),
        ("max_micro", 0),
        ("timing", "guess"),
    ],
)
def test_request_validation_names_the_field(field, value):
    with pytest.raises(SolveRequestError, match=field) as err:
        request(**{field: value})
    assert isinstance(err.value, ValueError) and isinstance(err.value, BadInputError)


def test_request_rejects_a_layer_both_always_and_never():
    with pytest.raises(ValueError, match=r"h\.1"):
        request(always_checkpoint=("h.1",), never_checkpoint=("h.1",))


def test_request_accepts_a_single_name_string():
    assert request(always_checkpoint="h.1").always_checkpoint == ("h.1",)


# --------------------------------------------------------------------------- edges
def test_profile_without_candidate_layers():
    profile = raw_profile(
        savings=[],
        fwd_seconds=[],
        timeline={
            "no_grads": [Segment(held=0, active="none", points=((0, 10),))],
            "grads_resident": [Segment(held=0, active="none", points=((5, 10),))],
        },
        optimizer_peak=0,
        step_fixed_seconds=1.0,
    )
    plan = solve(profile, request(target_batch=8, budget_bytes=85)).plan
    assert (plan.micro_batch_size, plan.checkpoint_layers) == (8, ())
    plan = solve(profile, request(target_batch=8, budget_bytes=60)).plan
    assert plan.micro_batch_size == 4  # 5 + 40 = 45 <= 60 < 80 + 0
    assert plan.predicted.peak_phase.startswith("micro-step")


def test_least_recompute_set_rejects_an_impossible_limit():
    profile = uniform_chain(3).profile()
    bounds = memory.step_bounds(profile, 4, 2)
    assert least_recompute_set(bounds, 0, [1, 1, 1]) is None
    assert least_recompute_set(bounds, 10**12, [1, 1, 1]) == ()


def test_plan_carries_model_and_profile_paths():
    profile = ChainSpec().profile()
    plan = solve(profile, request(model_path="m.py:other", profile_path="p.yaml")).plan
    assert (plan.model, plan.profile) == ("m.py:other", "p.yaml")
    assert solve(profile, request()).plan.model == "synthetic.py"


def test_a_micro_batch_that_does_not_divide_the_target_is_never_offered_as_min_micro():
    """Target 64 with --min-micro 48: 45 would fit, but 64 is no multiple of it; the largest
    divisor below 48 that fits (32) is what --min-micro should be lowered to."""
    profile = uniform_chain(2).profile()
    budget = peak_of(profile, 45, [0, 1], 2)
    assert peak_of(profile, 32, [0, 1], 2) <= budget < peak_of(profile, 48, [0, 1], 2)
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(target_batch=64, budget_bytes=budget, margin=0.0, min_micro=48))
    hint = err.value.hint
    assert "micro-batch 32 would fit" in hint and "lower --min-micro to 32" in hint
    assert "45" not in hint.split("micro-batch 32")[0]


def test_no_fit_says_whether_layers_would_help():
    """Every candidate checkpointed and still over: --layers helps only if the fixed parts
    keep at least the missing bytes."""
    profile = uniform_chain(2).profile()
    least = peak_of(profile, 1, [0, 1], 16)
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(target_batch=16, budget_bytes=least - 1, margin=0.0))
    outside = sum(p.saved_bytes.at(1) for p in profile.fixed)
    assert outside >= 1
    assert "--layers GLOB" in err.value.hint
    with pytest.raises(NoPlanFitsError) as err:
        solve(profile, request(target_batch=16, budget_bytes=int(least // 4), margin=0.0))
    assert "not --layers" in err.value.hint


@pytest.mark.parametrize("option", [{"virtual_stages": -3}, {"gpus_per_node": 0}])
def test_layout_options_are_checked_without_a_layout(option):
    """Without --tp/--pp/--cp/--layout the layout options were dropped unread: `solve
    --virtual-stages -3` planned as if it were not there (exit 0)."""
    from memplan.solver.request import layout_request

    with pytest.raises(SolveRequestError, match="must be a positive integer"):
        layout_request(None, **option)
    assert layout_request(None) is None
