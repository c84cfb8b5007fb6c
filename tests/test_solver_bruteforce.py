"""The solver against brute force over every checkpoint subset, on random profiles of up
to 12 layers with random sizes, savings (some negative) and segments.

The oracle computes peaks straight from the segments (its own loop, not memplan.memory's
bounds), enumerates all (micro-batch, subset) pairs and ranks them by the documented rule:
(step time in whole picoseconds, number of checkpointed layers, larger micro-batch first,
then the lexicographically smallest tuple of layer indices)."""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from profiles_factory import ChainSpec, raw_profile

from memplan import memory, retime, timing
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.profile import Affine, Segment
from memplan.solver import SolveRequest, least_peak, least_recompute_set, solve

small_ints = st.integers(0, 3000)
slopes = st.integers(0, 120)
times = st.sampled_from([0.0, 0.125, 0.25, 0.5])  # few values: ties are frequent


@st.composite
def segments(draw, n):
    count = draw(st.integers(1, 2 * n + 3))
    out = []
    for _ in range(count):
        held = draw(st.integers(0, n))
        active = "none" if held == n else draw(st.sampled_from(["none", "fwd", "bwd"]))
        points = tuple(draw(st.lists(st.tuples(small_ints, slopes), min_size=1, max_size=3)))
        ckpt = (
            ()
            if active == "none"
            else tuple(draw(st.lists(st.tuples(small_ints, slopes), min_size=1, max_size=2)))
        )
        out.append(Segment(held=held, active=active, points=points, ckpt_points=ckpt))
    return out


@st.composite
def problems(draw):
    n = draw(st.integers(1, 12))
    savings = [
        Affine(intercept=draw(st.integers(-30, 300)), slope=draw(st.integers(-3, 40)))
        for _ in range(n)
    ]
    fwd = [Affine(intercept=draw(times), slope=draw(times)) for _ in range(n)]
    names = [f"blocks.{i}" for i in range(n)]
    profile = raw_profile(
        savings=savings,
        fwd_seconds=fwd,
        bwd_seconds=[Affine(intercept=draw(times), slope=draw(times)) for _ in range(n)],
        timeline={"no_grads": draw(segments(n)), "grads_resident": draw(segments(n))},
        optimizer_peak=Affine(intercept=draw(small_ints), slope=draw(st.integers(0, 20))),
        step_fixed_seconds=Affine(intercept=draw(times), slope=draw(times)),
        optimizer_seconds=draw(times),
        names=names,
        has_batchnorm=draw(st.booleans()),
    )
    world = draw(st.sampled_from([1, 1, 2, 3]))
    target = world * draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24]))
    layers = list(range(n))
    always = draw(st.sets(st.sampled_from(layers), max_size=2))
    never = draw(st.sets(st.sampled_from(layers), max_size=2)) - always
    # Budgets around the no-checkpoint peak of the smallest micro-batch: some fit, some not.
    reference = memory.step_peak(profile, 1, [], 2).peak_bytes
    request = SolveRequest(
        target_batch=target,
        budget_bytes=draw(st.integers(max(1, reference // 2), max(2, 3 * reference))),
        world_size=world,
        margin=draw(st.sampled_from([0.0, 0.03])),
        min_micro=draw(st.sampled_from([1, 1, 2, 3])),
        max_micro=draw(st.sampled_from([None, None, 4, 8])),
        always_checkpoint=tuple(names[i] for i in sorted(always)),
        never_checkpoint=tuple(names[i] for i in sorted(never)),
        bn_min_micro=draw(st.sampled_from([1, 2, 4])),
        allow_small_bn_micro=draw(st.booleans()),
    )
    return profile, request, frozenset(always), frozenset(never)


def segment_tops(profile, b, k):
    """Per segment of the phases a step runs: (held, plain top, checkpointed top)."""
    tops = []
    for phase in memory.phases_for(k):
        for seg in profile.timeline[phase]:
            plain = max(memory.point_bytes(p, b) for p in seg.points)
            ckpt = (
                max(memory.point_bytes(p, b) for p in seg.ckpt_points) if seg.ckpt_points else plain
            )
            tops.append((seg.held, plain, ckpt if seg.active != "none" else plain))
    return tops


def brute_peak(profile, b, subset, k, tops=None, savings=None):
    """Allocated peak straight from the segment formula."""
    tops = tops if tops is not None else segment_tops(profile, b, k)
    savings = savings if savings is not None else memory.savings_bytes(profile, b)
    best = memory.optimizer_step_peak_bytes(profile, b)
    for held, plain, ckpt in tops:
        top = ckpt if held in subset else plain
        best = max(best, top - sum(savings[j] for j in subset if j < held))
    return best


def brute_force(profile, request, always, never):
    """All valid (b, subset): the best fitting one by the documented order, and the least
    peak over allowed micro-batches. None when no split is valid."""
    n = len(profile.layers)
    per_rank, rem = divmod(request.target_batch, request.world_size)
    hi = request.max_micro or per_rank
    micro = [b for b in range(request.min_micro, min(hi, per_rank) + 1) if per_rank % b == 0]
    if rem or not micro:
        return None
    if profile.has_batchnorm and not request.allow_small_bn_micro:
        micro = [b for b in micro if b >= request.bn_min_micro]
        if not micro:
            return None
    limit = memory.allocated_limit_bytes(request.budget_bytes, request.margin, memory.NO_RESERVE)
    subsets = [frozenset(i for i in range(n) if mask >> i & 1) for mask in range(1 << n)]
    subsets = [s for s in subsets if always <= s and not s & never]
    best, least = None, None
    for b in micro:
        k = per_rank // b
        t = retime.micro_step_times(profile, b)
        tops, savings = segment_tops(profile, b, k), memory.savings_bytes(profile, b)
        for subset in subsets:
            peak = brute_peak(profile, b, subset, k, tops, savings)
            least = peak if least is None else min(least, peak)
            if peak <= limit:
                rank = (
                    timing.step_picoseconds(t, k, subset),
                    len(subset),
                    -b,
                    tuple(sorted(subset)),
                )
                if best is None or rank < best[0]:
                    best = (rank, b, subset, peak)
    return best, least


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_solver_matches_brute_force(problem):
    profile, request, always, never = problem
    oracle = brute_force(profile, request, always, never)
    event(
        "no valid split"
        if oracle is None
        else "nothing fits"
        if oracle[0] is None
        else "a plan fits"
    )
    if oracle is None:
        try:
            solve(profile, request)
        except BadInputError:
            return
        raise AssertionError("expected BadInputError for a target with no valid split")
    best, least = oracle
    if best is None:
        try:
            solve(profile, request)
        except NoPlanFitsError as exc:
            assert exc.min_peak_bytes == least
            assert exc.closest.predicted.peak_bytes == least
            return
        raise AssertionError("expected NoPlanFitsError")
    result = solve(profile, request)
    plan = result.plan
    _, b, subset, peak = best
    names = profile.layer_names
    assert plan.micro_batch_size == b
    assert plan.checkpoint_layers == tuple(names[i] for i in sorted(subset))
    assert plan.predicted.peak_bytes == peak
    assert plan.predicted.breakdown.total == peak
    chosen = [c for c in result.candidates if c.chosen]
    assert len(chosen) == 1 and chosen[0].micro_batch == b


@settings(max_examples=150, deadline=None)
@given(problem=problems(), b=st.integers(1, 40), k=st.integers(1, 3), data=st.data())
def test_memory_model_matches_the_segment_formula(problem, b, k, data):
    profile = problem[0]
    n = len(profile.layers)
    subset = frozenset(data.draw(st.sets(st.integers(0, n - 1))))
    peak = memory.step_peak(profile, b, subset, k)
    assert peak.allocated_bytes == brute_peak(profile, b, subset, k)
    assert (
        memory.bounds_peak_bytes(memory.step_bounds(profile, b, k), subset) == peak.allocated_bytes
    )
    assert peak.breakdown.total == peak.peak_bytes


@settings(max_examples=100, deadline=None)
@given(problem=problems(), b=st.integers(1, 40), k=st.integers(1, 3))
def test_least_peak_matches_brute_force(problem, b, k):
    profile, _, always, never = problem
    n = len(profile.layers)
    bounds = memory.step_bounds(profile, b, k)
    tops, savings = segment_tops(profile, b, k), memory.savings_bytes(profile, b)
    expected = min(
        brute_peak(profile, b, s, k, tops, savings)
        for s in (frozenset(i for i in range(n) if mask >> i & 1) for mask in range(1 << n))
        if always <= s and not s & never
    )
    assert memory.min_allocated_bytes(bounds, forced_in=always, forced_out=never) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_least_peak_answers_directly_and_matches_brute_force(problem):
    """``solver.least_peak`` is brute force's least peak over every allowed micro-batch and
    checkpoint set, whatever the request's budget, and its plan peaks at exactly that."""
    profile, request, always, never = problem
    oracle = brute_force(profile, request, always, never)
    if oracle is None:
        try:
            least_peak(profile, request)
        except BadInputError:
            return
        raise AssertionError("expected BadInputError for a target with no valid split")
    _, least = oracle
    answer = least_peak(profile, request)
    assert answer.peak_bytes == least
    assert answer.plan.predicted.peak_bytes == least
    assert set(answer.plan.checkpoint_layers) >= {profile.layer_names[i] for i in always}


@st.composite
def chain_problems(draw):
    """Longer chains (too long for brute force) with varied sizes and costs."""
    n = draw(st.integers(12, 40))
    sizes = st.lists(st.integers(20, 400), min_size=n, max_size=n)
    spec = ChainSpec(
        params=[1000] * n,
        saved=draw(sizes),
        output=draw(st.lists(st.integers(1, 19), min_size=n, max_size=n)),
        fwd_seconds=draw(
            st.lists(st.sampled_from([0.125, 0.25, 0.375, 0.5, 1.0]), min_size=n, max_size=n)
        ),
        recompute_transient=draw(st.one_of(st.none(), sizes)),
    )
    b = draw(st.integers(1, 64))
    k = draw(st.integers(1, 2))
    profile = spec.profile()
    bounds = memory.step_bounds(profile, b, k)
    low = memory.min_allocated_bytes(bounds)
    high = memory.bounds_peak_bytes(bounds, [])
    limit = draw(st.integers(low - 10, max(low, high)))
    never = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=3)))
    return profile, bounds, limit, never


@settings(max_examples=150, deadline=None)
@given(problem=chain_problems())
def test_branch_and_bound_never_changes_the_answer(problem):
    profile, bounds, limit, never = problem
    times = retime.micro_step_times(profile, bounds.micro_batch)
    cost = [timing.to_picoseconds(t) for t in times.fwd_seconds]
    fast = least_recompute_set(bounds, limit, cost, forced_out=never)
    slow = least_recompute_set(bounds, limit, cost, forced_out=never, prune=False)
    assert fast == slow
    if fast is not None:
        assert memory.bounds_peak_bytes(bounds, fast) <= limit
