"""The solver with per-layer modes against brute force over every assignment of
layers × modes, on random profiles (any numbers, savings of either sign, ties frequent).

The oracle computes peaks straight from the segments with its own loop (each segment's
points for the active layer's mode, less the held layers' savings in their modes), times
with its own sums, and ranks fitting plans by the documented order: (step time in whole
picoseconds, number of layers not kept, larger micro-batch, then per layer the mode's tie
digit, earliest layer first); selective is left out of a layer where it is no faster than
full (both allowed). Also: a larger budget never gives a slower plan."""

import dataclasses
import itertools
import math
from fractions import Fraction

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from profiles_factory import raw_profile

from memplan import memory, retime, timing
from memplan.devices import DeviceSpec
from memplan.errors import NoPlanFitsError
from memplan.profile import Affine, Segment
from memplan.solver import SolveRequest, least_cost_modes, solve

small_ints = st.integers(0, 3000)
slopes = st.integers(0, 120)
times = st.sampled_from([0.0, 0.125, 0.25, 0.5])  # few values: ties are frequent
LINK = 64.0  # host link, bytes per second: offload times on the 0.125 s grid (ties)
SPEC = DeviceSpec(
    name="test-gpu",
    display_name="Test GPU",
    memory_bytes=10**9,
    bf16_flops=1e12,
    fp16_flops=1e12,
    fp32_flops=1e12,
    memory_bandwidth=1e12,
    host_link_bandwidth=LINK,
)


def pts(draw, lo=1, hi=3):
    return tuple(draw(st.lists(st.tuples(small_ints, slopes), min_size=lo, max_size=hi)))


@st.composite
def segments(draw, n):
    out = []
    for _ in range(draw(st.integers(1, 2 * n + 3))):
        held = draw(st.integers(0, n))
        active = "none" if held == n else draw(st.sampled_from(["none", "fwd", "bwd"]))
        extra = {} if active == "none" else {"ckpt_points": pts(draw, 1, 2)}
        if active != "none":
            extra["selective_points"] = pts(draw, 1, 2)
        out.append(Segment(held=held, active=active, points=pts(draw), **extra))
    return out


def affine(draw, lo, hi, slo, shi):
    return Affine(intercept=draw(st.integers(lo, hi)), slope=draw(st.integers(slo, shi)))


@st.composite
def problems(draw, max_layers=5):
    n = draw(st.integers(1, max_layers))
    profile = raw_profile(
        savings=[affine(draw, -30, 300, -3, 40) for _ in range(n)],
        fwd_seconds=[Affine(intercept=draw(times), slope=draw(times)) for _ in range(n)],
        bwd_seconds=[Affine(intercept=draw(times), slope=draw(times)) for _ in range(n)],
        timeline={"no_grads": draw(segments(n)), "grads_resident": draw(segments(n))},
        optimizer_peak=Affine(intercept=draw(small_ints), slope=draw(st.integers(0, 20))),
        step_fixed_seconds=Affine(intercept=draw(times), slope=draw(times)),
        optimizer_seconds=draw(times),
        names=[f"blocks.{i}" for i in range(n)],
    )
    layers = tuple(
        dataclasses.replace(
            layer,
            selective_savings_bytes=affine(draw, -30, 300, -3, 40),
            selective_recompute_seconds=Affine(intercept=draw(times), slope=draw(times)),
            # what offload moves: small multiples of 4 B, so its time ties with others
            saved_bytes=Affine(
                intercept=draw(st.sampled_from([0, 4, 8, 16, 32])),
                slope=draw(st.sampled_from([0, 4, 8])),
            ),
        )
        for layer in profile.layers
    )
    profile = dataclasses.replace(profile, layers=layers)
    offload = draw(st.booleans())
    modes = draw(
        st.sampled_from(
            ["keep,selective,full,offload", "keep,selective,full", "keep,offload", "keep,full"]
            if offload
            else ["keep,selective,full", "keep,selective", "keep,full"]
        )
    )
    if "offload" not in modes:
        offload = False
    target = draw(st.sampled_from([1, 2, 4, 6, 8]))
    # Budgets from below the least any plan needs to above the plain peak: some fit, some
    # not, many only with a mix of modes.
    all_modes = tuple(m for m in ("keep", "selective", "full", "offload") if m in modes)
    low = memory.min_allocated_bytes(memory.step_bounds(profile, 1, target, modes=all_modes))
    high = memory.step_peak(profile, target, [], 1).allocated_bytes
    reserve = memory.reserve_for(profile, SPEC if offload else None)
    allocated = draw(st.integers(max(1, low - 20), max(2, low + 20, high)))
    request = SolveRequest(
        target_batch=target,
        budget_bytes=allocated + reserve.bytes_for(allocated),
        margin=0.0,
        modes=modes,
        device_spec=SPEC if offload else None,
        host_memory_bytes=draw(st.sampled_from([None, 0, 16, 64, 200])) if offload else None,
        always_checkpoint=tuple(
            f"blocks.{i}" for i in sorted(draw(st.sets(st.integers(0, n - 1), max_size=1)))
        ),
    )
    return profile, request


def oracle_peak(profile, b, k, assignment):
    n = len(profile.layers)

    def saving(j):
        mode = assignment[j]
        layer = profile.layers[j]
        if mode == "keep":
            return 0
        if mode == "selective":
            return math.floor(layer.selective_savings_bytes.at(b))
        return math.floor(layer.savings_bytes.at(b))  # full and offload

    best = math.ceil(profile.optimizer_step_peak_bytes.at(b))
    for phase in ("no_grads",) if k == 1 else ("no_grads", "grads_resident"):
        for seg in profile.timeline[phase]:
            mode = assignment[seg.held] if seg.held < n else "keep"
            points = seg.points
            if seg.active != "none" and mode == "full":
                points = seg.ckpt_points
            elif seg.active != "none" and mode == "selective":
                points = seg.selective_points
            top = max(math.ceil(p[0] + p[1] * b) for p in points)
            best = max(best, top - sum(saving(j) for j in range(seg.held)))
    return best


def oracle_picoseconds(profile, b, k, assignment, link):
    """Step time from the per-layer times memplan.timing pools over identical layers (the
    modes' sums are the oracle's own; offload from the host link)."""
    ps = timing.to_picoseconds
    t = retime.micro_step_times(profile, b)
    micro = ps(t.fixed_seconds) + sum(map(ps, t.fwd_seconds)) + sum(map(ps, t.bwd_seconds))
    for j, mode in enumerate(assignment):
        if mode == "full":
            micro += ps(t.fwd_seconds[j])  # no measured recompute: one forward
        elif mode == "selective":
            micro += ps(t.selective_seconds[j])
        elif mode == "offload":
            micro += ps(2 * max(math.ceil(profile.layers[j].saved_bytes.at(b)), 0) / link)
    return k * micro + ps(t.optimizer_step_seconds)


def brute_force(profile, request):
    n = len(profile.layers)
    modes = request.modes
    always = {int(name.split(".")[1]) for name in request.always_checkpoint}
    micro = [b for b in range(1, request.target_batch + 1) if request.target_batch % b == 0]
    reserve = memory.reserve_for(profile, request.device_spec)
    limit = memory.allocated_limit_bytes(request.budget_bytes, request.margin, reserve)
    # the least peak a no-fit error names: within --host-memory where any assignment is
    best, least, least_any = None, None, None
    for b in micro:
        k = request.target_batch // b
        t = retime.micro_step_times(profile, b)
        ps = timing.to_picoseconds
        # selective is never offered where it is no faster than full (both allowed)
        barred = {
            j
            for j in range(n)
            if "selective" in modes
            and "full" in modes
            and ps(t.selective_seconds[j]) >= ps(t.fwd_seconds[j])
        }
        for assignment in itertools.product(modes, repeat=n):
            if any(assignment[j] == "keep" for j in always):
                continue
            if any(assignment[j] == "selective" for j in barred):
                continue
            peak = oracle_peak(profile, b, k, assignment)
            host = sum(
                max(math.ceil(profile.layers[j].saved_bytes.at(b)), 0)
                for j in range(n)
                if assignment[j] == "offload"
            )
            within_host = request.host_memory_bytes is None or host <= request.host_memory_bytes
            if within_host:
                least = peak if least is None else min(least, peak)
            least_any = peak if least_any is None else min(least_any, peak)
            if peak > limit or not within_host:
                continue
            rank = (
                oracle_picoseconds(profile, b, k, assignment, LINK),
                sum(m != "keep" for m in assignment),
                -b,
                tuple({"full": 0, "selective": 1, "offload": 2, "keep": 3}[m] for m in assignment),
            )
            if best is None or rank < best[0]:
                best = (rank, b, assignment, peak)
    return best, least if least is not None else least_any, reserve


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems())
def test_solver_with_modes_matches_brute_force(problem):
    _matches_brute_force(problem)


def test_a_forced_offload_that_outgrows_the_host_is_not_the_least_peak_named():
    # Found by the test above: blocks.1 must be offloaded (4 B a sample) into a 16 B host,
    # so micro-batch 6 (24 B) cannot run; its least peak with the host dropped (0 B: no
    # gradients resident at accumulation 1) was named over micro-batch 1's (2 B) that the
    # host allows.
    zero = Affine.zero()
    profile = raw_profile(
        savings=[zero] * 5,
        fwd_seconds=[zero] * 5,
        timeline={
            "no_grads": (Segment(held=0, active="none", points=((0, 0),)),),
            "grads_resident": (Segment(held=0, active="none", points=((0, 2),)),),
        },
        optimizer_peak=zero,
        names=[f"blocks.{i}" for i in range(5)],
    )
    saved = [Affine(intercept=0, slope=4 if i == 1 else 0) for i in range(5)]
    layers = tuple(
        dataclasses.replace(layer, saved_bytes=s, selective_savings_bytes=zero)
        for layer, s in zip(profile.layers, saved, strict=True)
    )
    profile = dataclasses.replace(profile, layers=layers)
    reserve = memory.reserve_for(profile, SPEC)
    request = SolveRequest(
        target_batch=6,
        budget_bytes=1 + reserve.bytes_for(1),
        margin=0.0,
        modes="keep,offload",
        device_spec=SPEC,
        host_memory_bytes=16,
        always_checkpoint=("blocks.1",),
    )
    _matches_brute_force((profile, request))


def _event(text: str) -> None:
    """hypothesis's ``event``, a no-op outside a hypothesis test (the fixed cases)."""
    from hypothesis.control import currently_in_test_context

    if currently_in_test_context():
        event(text)


def _matches_brute_force(problem):
    profile, request = problem
    best, least, reserve = brute_force(profile, request)
    if best is None:
        _event("nothing fits")
        try:
            solve(profile, request)
        except NoPlanFitsError as exc:
            assert exc.min_peak_bytes == least + reserve.bytes_for(least)
            return
        raise AssertionError("expected NoPlanFitsError")
    _, b, assignment, peak = best
    used = sorted(set(assignment) - {"keep"})
    _event(f"modes used: {used}")
    _event("a mix of modes" if len(used) > 1 else "one mode or none")
    plan = solve(profile, request).plan
    names = profile.layer_names
    assert plan.micro_batch_size == b
    assert plan.checkpoint == {names[j]: m for j, m in enumerate(assignment) if m != "keep"}
    assert plan.predicted.peak_bytes == peak + reserve.bytes_for(peak)
    assert memory.plan_peak(profile, plan, request.device_spec).allocated_bytes == peak


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(max_layers=6), data=st.data())
def test_branch_and_bound_and_the_host_staircase_never_change_the_answer(problem, data):
    profile, request = problem
    b, k = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 2))
    host = data.draw(st.sampled_from([None, 0, 16, 64, 200]))
    bounds = memory.step_bounds(profile, b, k, modes=request.modes, host_limit_bytes=host)
    low = memory.min_allocated_bytes(bounds)
    limit = data.draw(st.integers(low - 5, max(low, memory.bounds_peak_bytes(bounds, []))))
    costs = {
        m: [data.draw(st.sampled_from([0, 1, 2, 5])) for _ in profile.layers]
        for m in request.modes
        if m != "keep"
    }
    fast = least_cost_modes(bounds, limit, costs)
    slow = least_cost_modes(bounds, limit, costs, prune=False)
    assert fast == slow
    # and the exhaustive answer
    n = len(profile.layers)
    best = None
    for assignment in itertools.product(request.modes, repeat=n):
        chosen = {j: m for j, m in enumerate(assignment) if m != "keep"}
        if memory.bounds_peak_bytes(bounds, chosen) > limit:
            continue
        if host is not None and memory.host_total_bytes(bounds, chosen) > host:
            continue
        rank = (
            sum(costs[m][j] for j, m in chosen.items()),
            len(chosen),
            tuple({"full": 0, "selective": 1, "offload": 2, "keep": 3}[m] for m in assignment),
        )
        if best is None or rank < best[0]:
            best = (rank, chosen)
    assert fast == (None if best is None else best[1])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), extra=st.integers(1, 5000))
def test_a_larger_budget_is_never_slower(problem, extra):
    profile, request = problem
    try:
        small = solve(profile, request).plan
    except NoPlanFitsError:
        return
    larger = dataclasses.replace(request, budget_bytes=request.budget_bytes + extra)
    big = solve(profile, larger).plan
    assert big.predicted.step_seconds <= small.predicted.step_seconds + 1e-12
    event("faster" if big.predicted.step_seconds < small.predicted.step_seconds else "same")


class _Options:
    """The part of StepBounds the pruning bounds read: each layer's saving per mode."""

    def __init__(self, savings: list[dict[str, int]]) -> None:
        self.by_layer = savings
        self.plain_bytes = [0] * len(savings)

    def allowed(self, h, forced_in=frozenset(), forced_out=frozenset()):
        return ("keep", *self.by_layer[h])

    def saving(self, mode, h):
        return 0 if mode == "keep" else self.by_layer[h][mode]


@st.composite
def layer_options(draw):
    n = draw(st.integers(1, 4))
    savings, costs = [], {m: [0] * n for m in ("selective", "full", "offload")}
    for h in range(n):
        modes = draw(st.lists(st.sampled_from(["selective", "full", "offload"]), unique=True))
        savings.append({m: draw(st.integers(-50, 400)) for m in modes})
        for m in modes:
            costs[m][h] = draw(st.integers(0, 900))
    return savings, costs


@given(layer_options(), st.integers(1, 1700))
@settings(max_examples=300, deadline=None)
def test_the_pruning_lower_bound_never_exceeds_the_least_cost(problem, deficit):
    """The DP prunes a state when its cost plus a lower bound on the least cost of saving
    ``deficit`` more bytes with the layers ahead exceeds a known plan's: the bound (the LP
    relaxation over each layer's hull steps) must never exceed the true least cost, found
    here by trying every mode of every layer."""
    from memplan.solver.layer_modes import _hull_steps, _suffix_knapsacks

    savings, costs = problem
    options = _Options(savings)
    n = len(savings)
    for h in range(n):  # hull steps: positive savings, cost per byte rising
        steps = _hull_steps(options, costs, h, list(savings[h]))
        assert all(s > 0 and c >= 0 for c, s, _ in steps)
        ratios = [Fraction(c, s) for c, s, _ in steps]
        assert ratios == sorted(ratios) and len(set(ratios)) == len(ratios)
    cum_saving, cum_cost, items = _suffix_knapsacks(options, costs, frozenset(), frozenset())[0]
    least = None
    for choice in itertools.product(*[("keep", *s) for s in savings]):
        saved = sum(options.saving(m, h) for h, m in enumerate(choice))
        if saved >= deficit:
            cost = sum(costs[m][h] for h, m in enumerate(choice) if m != "keep")
            least = cost if least is None else min(least, cost)
    k = next((i for i, total in enumerate(cum_saving) if total >= deficit), len(items))
    if k == len(items):  # the bound says the layers cannot save that much
        assert least is None
        return
    assert least is not None
    before_s, before_c = (cum_saving[k - 1], cum_cost[k - 1]) if k else (0, 0)
    item_cost, item_saving = items[k]
    bound = before_c + (deficit - before_s) * item_cost // item_saving
    assert bound <= least
