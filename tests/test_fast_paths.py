"""The solver's and the profile reader's fast paths against the paths they stand in for, on
random input: each must give the same answer to the bit (or the same error), never a close
one. The solver: the bound tightened from the knapsack lower bound, the sparse suffix
knapsacks, the least peak in one backward pass, the step bounds and step peak in array
operations, per-layer values and times in arrays. The reader: the path-free fast reader
against the full one, JSON floats in flow values, the collector paused while reading."""

import copy
import dataclasses
import gc
import math
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_modes_bruteforce import SPEC, problems

from memplan import memory, retime, timing
from memplan.errors import ProfileError
from memplan.files import schema
from memplan.memory import bounds as bounds_module
from memplan.memory import peak as peak_module
from memplan.profile import Affine, Profile, load_profile, profile_to_yaml
from memplan.solver import layer_modes

SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
GPT = "examples/ci/baselines/gpt.profile.yaml"


def _random_costs(data, profile, modes):
    return {
        m: [data.draw(st.sampled_from([0, 1, 2, 5, 7])) for _ in profile.layers]
        for m in modes
        if m != "keep"
    }


@settings(max_examples=150, **SLOW)
@given(problem=problems(max_layers=6), data=st.data())
def test_tightened_bounds_and_sparse_knapsacks_never_change_the_answer(problem, data):
    """Any schedule of tightened bounds, and suffix knapsacks kept at a single layer (every
    other layer reads a superset's bound), give the unpruned DP's answer."""
    profile, request = problem
    b, k = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 2))
    host = data.draw(st.sampled_from([None, 0, 16, 64]))
    bounds = memory.step_bounds(profile, b, k, modes=request.modes, host_limit_bytes=host)
    low = memory.min_allocated_bytes(bounds)
    limit = data.draw(st.integers(low - 3, max(low, memory.bounds_peak_bytes(bounds, []))))
    costs = _random_costs(data, profile, request.modes)
    slow = layer_modes.least_cost_modes(bounds, limit, costs, prune=False)
    shifts = data.draw(st.sampled_from([(), (0,), (40, 1), (3, 2, 1), (1, 1, 1)]))
    kept = data.draw(st.sampled_from([1, 2, 256]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_modes, "_TIGHTEN_SHIFTS", shifts)
        patch.setattr(layer_modes, "_KNAPSACKS_KEPT", kept)
        assert layer_modes.least_cost_modes(bounds, limit, costs) == slow


def test_sparse_knapsacks_read_a_superset_and_keep_the_ends_exact():
    """With 40 layers and 4 lists kept: layer i reads the list of the kept layer at or
    before it (its steps and a few more), the first and the last 10 layers their own."""
    savings = [{"full": 10 + i} for i in range(40)]
    costs = {"full": [3 * i + 1 for i in range(40)], "selective": [0] * 40, "offload": [0] * 40}
    from test_modes_bruteforce import _Options

    options = _Options(savings)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_modes, "_KNAPSACKS_KEPT", 4)
        sparse = layer_modes._suffix_knapsacks(options, costs, frozenset(), frozenset())
    exact = layer_modes._suffix_knapsacks(options, costs, frozenset(), frozenset())
    for i in range(41):
        kept = i if i % 10 == 0 or i >= 30 else i - i % 10
        assert sparse[i] == exact[kept], i
    assert sparse[0][0][-1] == sum(10 + i for i in range(40))  # all 40 savings summed


@settings(max_examples=150, **SLOW)
@given(problem=problems(max_layers=6), data=st.data())
def test_the_least_peak_in_one_pass_is_the_binary_search(problem, data):
    profile, request = problem
    b, k = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 2))
    bounds = memory.step_bounds(profile, b, k, modes=request.modes)
    n = len(profile.layers)
    forced_in = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=2)))
    forced_out = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=2))) - forced_in
    forced = {"forced_in": forced_in, "forced_out": forced_out}
    if any(not bounds.allowed(h, **forced) for h in forced_in):
        return  # no assignment at all: the caller never asks
    some = {h: bounds.allowed(h, **forced)[0] for h in forced_in}
    hi = memory.bounds_peak_bytes(bounds, some)
    lo = -(10**6)
    while hi - lo > 1:  # the search the one pass replaced, on a range sure to hold it
        mid = (lo + hi) // 2
        if memory.fits_somehow(bounds, mid, **forced):
            hi = mid
        else:
            lo = mid
    assert memory.min_allocated_bytes(bounds, **forced) == hi


def _fractional_points(profile, data):
    """``profile`` with fractions added to its points' intercepts and slopes, so that
    rounding up matters (the drawn points are whole numbers)."""
    fraction = st.sampled_from([0.0, 0.25, 0.5, -0.5, 0.75, 1e-9])

    def moved(points):
        return tuple((a + data.draw(fraction), s + data.draw(fraction)) for a, s in points)

    timeline = {
        phase: tuple(
            dataclasses.replace(
                seg,
                points=moved(seg.points),
                ckpt_points=moved(seg.ckpt_points),
                selective_points=moved(seg.selective_points),
            )
            for seg in segments
        )
        for phase, segments in profile.timeline.items()
    }
    return dataclasses.replace(profile, timeline=timeline)


@settings(max_examples=150, **SLOW)
@given(problem=problems(max_layers=6), data=st.data())
def test_step_bounds_and_step_peak_in_arrays_equal_the_walk(problem, data):
    profile, request = problem
    profile = _fractional_points(profile, data)
    b, k = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 3))
    modes = tuple(request.modes)
    fast = memory.step_bounds(profile, b, k, modes=modes)
    assignment = {
        j: m
        for j, m in enumerate(
            data.draw(
                st.lists(
                    st.sampled_from(modes),
                    min_size=len(profile.layers),
                    max_size=len(profile.layers),
                )
            )
        )
        if m != "keep"
    }
    fast_peak = memory.step_peak(profile, b, assignment, k)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bounds_module, "_held_maxima", lambda *args: False)
        patch.setattr(peak_module, "first_highest_segment", lambda *args: None)
        assert memory.step_bounds(profile, b, k, modes=modes) == fast
        assert memory.step_peak(profile, b, assignment, k) == fast_peak


floats = st.floats(-1e6, 1e6, allow_nan=False) | st.sampled_from([0.0, -0.0, 0.5, 2.5, -2.5])


@settings(max_examples=100, **SLOW)
@given(problem=problems(max_layers=6), data=st.data())
def test_per_layer_values_and_times_in_arrays_equal_one_by_one(problem, data):
    """Savings, host bytes, roofline times and costs at random float coefficients
    (signed zeros, halves that round to even, negatives clipped at zero) equal the
    one-layer-at-a-time formulas, signs of zero included."""
    profile, _ = problem

    def fit():
        return Affine(intercept=data.draw(floats), slope=data.draw(floats))

    layers = tuple(
        dataclasses.replace(
            layer,
            savings_bytes=fit(),
            selective_savings_bytes=fit(),
            saved_bytes=fit(),
            input_bytes=fit(),
            fwd_flops=fit(),
            params_trainable_bytes=data.draw(st.integers(0, 10**9)),
        )
        for layer in profile.layers
    )
    profile = dataclasses.replace(profile, layers=layers)
    b = data.draw(st.integers(1, 4096))
    assert memory.savings_bytes(profile, b) == tuple(
        math.floor(layer.savings_bytes.at(b)) for layer in layers
    )
    assert memory.mode_savings_bytes(profile, b, "selective") == tuple(
        math.floor(layer.selective_savings_bytes.at(b)) for layer in layers
    )
    assert memory.offload_host_bytes(profile, b) == tuple(
        max(math.ceil(layer.saved_bytes.at(b)), 0) for layer in layers
    )
    fast = retime.roofline_times(profile, b, SPEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(retime, "_roofline_layer_seconds", lambda *args: None)
        slow = retime.roofline_times(profile, b, SPEC)
    assert repr(fast) == repr(slow)  # repr: -0.0 and 0.0 differ
    fast = dataclasses.replace(fast, recompute_seconds=tuple(x * 1.5 for x in fast.fwd_seconds))
    # roofline times charge selective its measured share of a forward, where measured
    timed = ("full", "selective") if fast.selective_seconds else ("full",)
    for mode in timed:
        assert timing.mode_picoseconds(fast, mode) == [
            timing.to_picoseconds(fast.mode_seconds(i, mode)) for i in range(len(layers))
        ]
    if not fast.selective_seconds:
        with pytest.raises(ValueError, match="no selective times"):
            timing.mode_picoseconds(fast, "selective")


def _gpt_data():
    return schema.load_yaml_file(GPT, what="profile")


def _mutations():
    """(path, new value) edits of a profile's plain data, of the kinds a hand-edited file
    holds: right and wrong types, signed zeros, huge numbers, unknown and missing keys."""
    values = st.sampled_from(
        [0, 1, -0.0, 0.0, 2.5, 10**40, 1e31, "x", None, True, [], {}, [1.0], [1.0, 2.0], 3]
    )
    return st.tuples(st.integers(0, 10**6), values, st.sampled_from(["set", "set", "drop", "add"]))


def _leaves(node, out):
    """Every (container, key) in ``node`` whose value is not a non-empty container."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        if isinstance(value, (dict, list)) and value:
            _leaves(value, out)
        else:
            out.append((node, key))
    return out


def _edit(data, choice, value, how):
    """Change one leaf of ``data`` (or drop its key, or add an unknown one beside it)."""
    leaves = _leaves(data, [])
    node, key = leaves[choice % len(leaves)]
    if isinstance(node, list) or how == "set":
        node[key] = value
    elif how == "drop":
        del node[key]
    else:
        node["unknown_key"] = value


@settings(max_examples=200, **SLOW)
@given(edits=st.lists(_mutations(), max_size=3))
def test_the_fast_reader_builds_what_the_full_one_does(edits):
    """Same object (to the repr) or the same error, word for word."""
    data = _gpt_data()
    for choice, value, how in edits:
        _edit(data, choice, copy.deepcopy(value), how)  # a drawn list is one shared object

    def read(how):
        try:
            return repr(how(data))
        except ProfileError as exc:
            return f"error: {exc} | {exc.hint}"

    fast = read(lambda d: schema.from_data(Profile, d, source="p.yaml", path="profile"))
    full = read(lambda d: schema._convert(Profile, d, source="p.yaml", path="profile"))
    assert fast == full


@pytest.mark.parametrize(
    "line",
    [
        "a: [1e5, 2.0]",
        "a: [1.5E-5]",
        "a: [1.5e5]",
        'a: {"x": -12e-3, "y": 1.0e+5}',
        'a: ["1e5", 1.0e-05]',
        "a: [1.0e-05, 2.5e+10, -0.0]",
    ],
)
def test_json_floats_in_flow_values_read_as_yaml_does(line):
    assert schema.safe_load(line + "\n") == yaml.safe_load(line + "\n")


def test_reading_a_profile_pauses_the_collector_and_restores_it(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(load_profile(GPT)), encoding="utf-8")
    seen = []
    real = schema.from_data

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("memplan.profile.read.from_data", spy)
        assert gc.isenabled()
        load_profile(path)
        assert gc.isenabled() and seen == [False]
        gc.disable()
        try:
            load_profile(path)
            assert not gc.isenabled()
        finally:
            gc.enable()
        path.write_text("schema_version: 2\ntarget_batch: 4\n", encoding="utf-8")
        with pytest.raises(ProfileError, match="is a plan, not a profile"):
            load_profile(path)
        assert gc.isenabled()


def test_memplan_check_loads_its_modules_on_first_use():
    """``memplan solve`` registers ``check`` on its command line, and must not pay for
    the gate's modules; the names still resolve, and a wrong one is an AttributeError."""
    code = (
        "import sys, memplan.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('memplan.check.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert "memplan.check.run" not in loaded and "memplan.check.formats" not in loaded
    import memplan.check
    from memplan.check.run import run_checks

    assert memplan.check.run_checks is run_checks
    with pytest.raises(AttributeError, match="no_such_name"):
        memplan.check.no_such_name  # noqa: B018
