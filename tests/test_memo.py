"""The per-rank terms' memory (memplan/memory/memo.py): remembered by identity, never by
equality, bounded; and FSDP's gradient table, whose running sums must equal the sum over
every layer the segment used to take (brute force, on arbitrary gradients and every flag)."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import uniform_chain

from memplan import memory
from memplan.memory import Sharding
from memplan.memory.memo import by_identity
from memplan.memory.sharding import _grads_table


class _Box:
    """An object hashed by value, so that only identity tells two equal ones apart."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Box) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def test_remembered_by_identity_and_bounded():
    calls = []

    @by_identity(2)
    def double(box: _Box, extra: int) -> int:
        calls.append((box.value, extra))
        return 2 * box.value + extra

    a, a_twin = _Box(1), _Box(1)
    assert double(a, 0) == 2 and double(a, 0) == 2
    assert calls == [(1, 0)]  # the second call was remembered
    assert double(a_twin, 0) == 2
    assert calls == [(1, 0), (1, 0)]  # equal but another object: computed again
    a.value = 5  # memplan's objects are frozen; a mutated one shows the key is identity
    assert double(a, 0) == 2
    assert double(a, 1) == 11  # other arguments: computed; the bound of 2 drops (a, 0)
    assert double(a, 0) == 10
    assert double(a, extra=0) == 10  # by keyword: the same value, remembered apart
    assert double(a, extra=0) == 10
    double.cache_clear()
    assert double(a_twin, 0) == 2
    assert len(calls) == 6


def _mixed_chain(grads: list[int]):
    """A 4-layer chain read as a bf16-parameter probe, layer i with ``grads[i]`` bytes of
    parameters (so of gradients)."""
    profile = uniform_chain(len(grads), params=grads).profile()
    env = dataclasses.replace(
        profile.environment, precision="bf16", param_dtype="bfloat16", mixed_precision="params"
    )
    return dataclasses.replace(profile, environment=env)


@settings(max_examples=60, deadline=None)
@given(
    grads=st.lists(st.integers(1, 10**9).map(lambda x: 2 * x), min_size=1, max_size=12),
    world=st.sampled_from([2, 3, 8, 128]),
    grad_sync=st.sampled_from(["last_micro_step", "every_micro_step"]),
    steps=st.sampled_from([1, 2, 5]),
    phase=st.sampled_from(["no_grads", "grads_resident"]),
    after_schedule=st.booleans(),
)
def test_grads_table_running_sums_equal_the_sum_over_every_layer(
    grads, world, grad_sync, steps, phase, after_schedule
):
    profile = _mixed_chain(grads)
    sharding = Sharding(
        strategy="fsdp",
        world_size=world,
        grad_sync=grad_sync,
        reduce_after_schedule=after_schedule,
    )
    table = _grads_table(profile, sharding, phase, steps)
    units = table.units
    assert [u.probed for u in units] == grads
    for first in range(len(units) + 1):
        brute = sum(table.held(u, j >= first) for j, u in enumerate(units))
        assert table.unposted[first] + table.posted[first] == brute


def test_a_changed_profile_is_not_answered_from_the_first():
    # Layer grads of 1000 B of bf16 on 4 ranks: a 2000 B fp32 unit, a 500 B shard. Sharded
    # every micro-step, the last micro-step's backward of h.2 holds every unit's shard, the
    # kept 2000 B input of h.3 and the root's new 1000 B of bf16 (test_fsdp_mixed).
    fsdp = Sharding(strategy="fsdp", world_size=4, grad_sync="every_micro_step")
    first = _mixed_chain([1000] * 4)
    bwd = next(
        i
        for i in range(len(first.timeline["grads_resident"]))
        if memory.describe_segment(first, "grads_resident", i).startswith("backward of h.2")
    )
    assert memory.fsdp_grads_bytes(first, fsdp, "grads_resident", bwd, 2) == 5 * 500 + 2000 + 1000
    assert memory.rank_params_bytes(first, fsdp) == 2 * 5000 // 4
    # The same model, every layer twice as large: 1000 B shards, a 4000 B input.
    second = _mixed_chain([2000] * 4)
    assert memory.fsdp_grads_bytes(second, fsdp, "grads_resident", bwd, 2) == (
        4 * 1000 + 500 + 4000 + 1000
    )
    assert memory.rank_params_bytes(second, fsdp) == 2 * 9000 // 4
    # and the first is still answered as itself
    assert memory.fsdp_grads_bytes(first, fsdp, "grads_resident", bwd, 2) == 5 * 500 + 2000 + 1000


@settings(max_examples=40, deadline=None)
@given(grads=st.lists(st.integers(0, 10**12).map(lambda x: 2 * x), min_size=1, max_size=10))
def test_gradients_held_at_a_segment_equal_the_sum_over_the_layers_done(grads):
    # grads_at_bytes reads running sums; brute force: the layers whose backward has
    # finished, and the fixed parts' once the backward has reached a layer
    from memplan.memory.terms import backward_started, grads_at_bytes, grads_bytes

    profile = _mixed_chain(grads)
    segments = profile.timeline["no_grads"]
    n = len(profile.layers)
    fixed = max(grads_bytes(profile) - sum(grads), 0)
    for index, segment in enumerate(segments):
        if not backward_started(segments, index):
            brute = 0
        else:
            first = segment.held + 1 if segment.active == "bwd" else segment.held
            brute = sum(grads[first:]) + (fixed if segment.held < n else 0)
        assert grads_at_bytes(profile, "no_grads", index) == brute


def test_profiles_made_and_dropped_in_turn_are_each_answered_as_themselves():
    # Python reuses a collected object's id; an entry holds its profile, so a new profile
    # can never take the id of one still remembered. Built to fool an id-only key: each
    # profile dropped at once, the next with other gradients (1000·i B a layer on 4 ranks:
    # fp32 masters 2000·i B, parameters and root 2·(4·1000·i + 1000) / 4 a rank).
    fsdp = Sharding(strategy="fsdp", world_size=4)
    for i in range(1, 40):
        profile = _mixed_chain([1000 * i] * 4)
        assert memory.rank_params_bytes(profile, fsdp) == 2 * (4 * 1000 * i + 1000) // 4
        del profile
