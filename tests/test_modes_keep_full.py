"""``--modes keep,full`` reproduces the plans memplan chose before per-layer modes existed:
tests/golden/keep_full_plans.json was written by tests/keep_full_cases.py with the solver
of commit cc2edd0 (every decision and figure of 450 solves and 1440 least-recompute sets)."""

import json
from pathlib import Path

import pytest
from keep_full_cases import GOLDEN, cases, chain_profile, decision, least_set

from memplan import memory, retime, timing
from memplan.solver import least_cost_modes

EXPECTED = json.loads(Path(GOLDEN).read_text())


def test_solves_reproduce_the_keep_full_plans():
    solves = [c for c in EXPECTED if "request" in c]
    got = [decision(profile, kwargs, modes="keep,full") for _, profile, kwargs in cases()]
    assert len(got) == len(solves) == 450
    mismatched = [
        (c["label"], c["plan"], g) for c, g in zip(solves, got, strict=True) if c["plan"] != g
    ]
    assert not mismatched, mismatched[:3]
    assert sum(bool(c["plan"].get("checkpoint_layers")) for c in solves) >= 30


def test_least_sets_reproduce_the_keep_full_sets():
    sets = [c for c in EXPECTED if "set" in c]
    assert len(sets) == 1440
    for case in sets:
        assert least_set(*case["set"]) == case["chosen"], case["label"]


@pytest.mark.parametrize("seed", [0, 7, 19])
def test_the_general_dp_restricted_to_keep_full_is_the_same(seed):
    """least_cost_modes on keep/full bounds returns the golden sets, all in mode full."""
    profile = chain_profile(seed)
    for case in (c for c in EXPECTED if c.get("set", [None])[0] == seed):
        _, b, k, limit = case["set"]
        times = retime.micro_step_times(profile, b)
        cost = [
            timing.to_picoseconds(times.checkpoint_seconds(i)) for i in range(len(profile.layers))
        ]
        got = least_cost_modes(memory.step_bounds(profile, b, k), limit, {"full": cost})
        expected = case["chosen"]
        assert got == (None if expected is None else dict.fromkeys(expected, "full"))
