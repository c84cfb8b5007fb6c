"""Layers whose recompute does not match their forward: the probe leaves them out of the
candidates (counted as fixed parts, named in a warning) and plans the rest, as it must for
transformers' XLM, whose forward fills a key/value cache whatever ``use_cache`` says."""

from __future__ import annotations

from pathlib import Path

import pytest
from packed_lstm import packed_lstm
from plan_factory import independent_peak
from profile_bytes import assert_meta_equals_cpu
from typer.testing import CliRunner

from memplan import memory
from memplan.cli import app
from memplan.errors import (
    BadInputError,
    CannotMeasureError,
    CheckpointingError,
    checkpointing_failure,
)
from memplan.probe import measure_training_peak, probe_model
from memplan.probe.layers import fixed_parts
from memplan.profile.read import profile_to_yaml
from memplan.solver import SolveRequest, solve
from memplan.verify import verify_plan

_NET_FILE_TAIL = """

def build_model():
    return Net()


def make_batch(b):
    return torch.randn(b, 6, 8)


def training_loss(model, x):
    return model(x).pow(2).mean()
"""
"""The end of a model file whose model is ``Net`` and whose batch is (b, 6, 8)."""

_CACHED = (
    """\
import torch
from torch import nn

CACHED = {cached}


class Block(nn.Module):
    def __init__(self, cached):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)
        self.cached = cached

    def forward(self, x, cache):
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.cached:  # the keys of every call so far, as a key/value cache keeps them
            cache.setdefault(id(self), []).append(k)
            k = torch.cat(cache[id(self)], 1)
            v = torch.cat([v] * len(cache[id(self)]), 1)
        return x + self.out(torch.softmax(q @ k.transpose(1, 2), -1) @ v)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i in CACHED) for i in range(4))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        cache = {{}}  # a new cache each call; a recompute finds it filled by its forward
        for block in self.blocks:
            x = block(x, cache)
        return self.head(x)

"""
    + _NET_FILE_TAIL
)


def _model(tmp_path: Path, cached: tuple[int, ...]) -> str:
    path = tmp_path / f"cached_{'_'.join(map(str, cached)) or 'none'}.py"
    path.write_text(_CACHED.format(cached=set(cached) or "set()"))
    return str(path)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_layers_whose_recompute_differs_are_left_out_and_named(
    tmp_path: Path, device: str
) -> None:
    path = _model(tmp_path, (1, 3))
    profile = probe_model(path, device=device, micro_batches=(1, 2), timing_rounds=1)
    assert profile.layer_names == ("blocks.0", "blocks.2")
    assert {"blocks.1", "blocks.3", "head"} <= {part.name for part in profile.fixed}
    (warning,) = [w for w in profile.warnings if "cannot be checkpointed" in w]
    assert warning.startswith("2 of 4 candidate layer(s) cannot be checkpointed")
    assert "(blocks.1, blocks.3: " in warning


def test_meta_equals_cpu_and_the_plan_verifies(tmp_path: Path) -> None:
    """The profile without the cached blocks is exact: meta equals cpu to the byte, and a
    plan that checkpoints a remaining block verifies, its gradient checked, an independent
    run within 1% of the prediction."""
    path = _model(tmp_path, (1, 3))
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2), timing_rounds=1)
    meta = probe_model(path, device="meta", micro_batches=(1, 2), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)
    every = memory.step_peak(cpu, 8, list(cpu.layer_names), 1).peak_bytes
    none = memory.step_peak(cpu, 8, [], 1).peak_bytes
    assert every < none
    request = SolveRequest(  # a remaining block checkpointed, whatever the clock says
        target_batch=8, budget_bytes=none, model_path=path, always_checkpoint=("blocks.0",)
    )
    plan = solve(cpu, request).plan
    assert "blocks.0" in plan.checkpoint and set(plan.checkpoint) <= {"blocks.0", "blocks.2"}
    result = verify_plan(path, plan, steps=1)
    assert result.passed, result.failures
    if plan.accumulation_steps > 1:
        assert result.gradient_check.status == "pass"
    peak = independent_peak(path, plan)
    assert abs(plan.predicted.peak_bytes - peak) <= 0.01 * peak


def test_asking_to_checkpoint_a_left_out_layer_says_why_it_cannot_be(tmp_path: Path) -> None:
    path = _model(tmp_path, (1, 3))
    profile = probe_model(path, device="meta", micro_batches=(1, 2))
    request = SolveRequest(
        target_batch=8, budget_bytes=2**30, model_path=path, always_checkpoint=("blocks.1",)
    )
    with pytest.raises(BadInputError) as info:
        solve(profile, request)
    assert info.value.exit_code == 2
    assert "blocks.1: the probe left it out of the candidates" in str(info.value)
    assert "recompute in the backward not matching their forward" in str(info.value)
    with pytest.raises(BadInputError) as other:  # a name that is no module: no such words
        solve(profile, SolveRequest(**{**vars_of(request), "always_checkpoint": ("nope",)}))
    assert "left it out" not in str(other.value)


def vars_of(request: SolveRequest) -> dict:
    import dataclasses

    return {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}


def test_every_block_cached_leaves_an_accumulation_only_profile(tmp_path: Path) -> None:
    path = _model(tmp_path, (0, 1, 2, 3))
    profile = probe_model(path, device="cpu", micro_batches=(1, 2), timing_rounds=1)
    assert profile.layer_names == ()
    assert [part.name for part in profile.fixed][:4] == [f"blocks.{i}" for i in range(4)]
    plan = solve(profile, SolveRequest(target_batch=4, budget_bytes=2**30, model_path=path)).plan
    assert plan.checkpoint == {}
    assert verify_plan(path, plan, steps=1).passed


def test_checkpointing_a_cached_block_anyway_is_exit_3(tmp_path: Path) -> None:
    """What the probe saw is real: a run that checkpoints a cached block fails in its
    backward, and memplan's commands say why (exit 3), not with torch's traceback."""
    path = _model(tmp_path, (1,))
    with pytest.raises(Exception) as raw:
        measure_training_peak(
            path, device="cpu", micro_batch=2, checkpoint_modes={"blocks.1": "full"}
        )
    known = checkpointing_failure(raw.value, path)
    assert isinstance(known, CheckpointingError) and known.exit_code == 3
    assert "recompute does not match its forward" in str(known)
    measure_training_peak(  # the other blocks checkpoint
        path, device="cpu", micro_batch=2, checkpoint_modes={"blocks.0": "full"}
    )


def test_fixed_parts_are_the_children_of_a_plain_container() -> None:
    """A ModuleList or ModuleDict has no forward, so its children are the parts; a
    container inside a part stays inside it."""
    from torch import nn

    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    model.norms = nn.ModuleList(nn.LayerNorm(2) for _ in range(2))
    model.heads = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Sequential(nn.ModuleList())})
    model.head = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model.empty = nn.ModuleList()
    assert fixed_parts(model, ["blocks.0", "blocks.2"]) == [
        "blocks.1",
        "norms.0",
        "norms.1",
        "heads.a",
        "heads.b",
        "head",
        "empty",
    ]


_LATE_SELECTIVE = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        if x.shape[0] >= 4:  # from micro-batch 4 on, in place on what the policy saved
            h.mul_(1.0)
        return torch.relu(h)


def build_model():
    return nn.Sequential(*(Block() for _ in range(3)))


def make_batch(b):
    return torch.randn(b, 16)


def training_loss(model, x):
    return model(x).pow(2).mean()
"""


@pytest.mark.parametrize(
    ("sizes", "failing"),
    [((1, 2, 4), 4), ((1, 2), 8)],  # a measured size; the timing-only size (4 × the last)
)
def test_selective_that_fails_only_at_a_later_size_is_dropped_not_fatal(
    tmp_path: Path, sizes: tuple[int, ...], failing: int
) -> None:
    """torch refuses a selective recompute whose saved tensor was changed in place; a model
    that does so from micro-batch 4 on passes the trial at the smallest size. The probe
    drops selective from the whole profile (the earlier sizes' figures too), says at which
    size, and keeps keep and full (before: exit 3, no profile)."""
    path = tmp_path / "late.py"
    path.write_text(_LATE_SELECTIVE)
    profile = probe_model(str(path), device="cpu", micro_batches=sizes, timing_rounds=1)
    assert [layer.name for layer in profile.layers] == ["0", "1", "2"]
    assert all(layer.selective_savings_bytes is None for layer in profile.layers)
    assert all(layer.selective_recompute_seconds is None for layer in profile.layers)
    assert all(not seg.selective_points for seg in profile.timeline["no_grads"])
    (said,) = [w for w in profile.warnings if "selective checkpointing does not run" in w]
    assert f"at micro-batch {failing} (RuntimeError: Tensor cached during selective" in said
    assert all(layer.saved_bytes.slope == 64 for layer in profile.layers)  # 16 fp32 a sample


def test_two_sizes_on_two_paths_are_the_sizes_fault_not_memplans(tmp_path: Path) -> None:
    """An LSTM over sequences packed with enforce_sorted=False sorts a batch of 2 and not
    one of 1: micro-batches 1 and 2 run different op sequences, and the line through them
    gives the first LSTM negative saved bytes per sample. Exit 3 naming the sizes, the
    layer and what to probe instead, not "memplan's failure" from the read-back; sizes
    that take one path probe (the size that differs left out)."""
    path = tmp_path / "lstm.py"
    path.write_text(packed_lstm())
    profile = probe_model(str(path), device="cpu", micro_batches=(1, 2), timing_rounds=1)
    assert not profile.op_sequence_stable
    with pytest.raises(CannotMeasureError) as info:  # every writer takes its text from here
        profile_to_yaml(profile)
    message = str(info.value)
    out = tmp_path / "lstm.yaml"
    args = ["probe", str(path), "--device", "cpu", "--micro-batches", "1,2", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3 and not out.exists()
    assert "ran different op sequences" in " ".join(result.output.split())
    assert info.value.exit_code == 3 and "memplan's failure" not in message
    assert "micro-batches 1, 2 ran different op sequences" in message
    assert "profile.layers[0].saved_bytes.slope (rnns.0) is -" in message
    assert "--micro-batches 2,4,8" in message
    profile = probe_model(str(path), device="cpu", micro_batches=(2, 4, 8), timing_rounds=1)
    assert profile.layer_names == ("rnns.0", "rnns.1")
    assert all(layer.saved_bytes.slope > 0 for layer in profile.layers)


_OWN_CACHE = (
    """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.keys = []  # a cache the block keeps itself: no parameter, no buffer

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        self.keys.append(k)
        k = torch.cat(self.keys, 1)
        v = torch.cat([v] * len(self.keys), 1)
        return x + torch.softmax(q @ k.transpose(1, 2), -1) @ v


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(12))

    def forward(self, x):
        for block in self.blocks:
            block.keys = []
        for block in self.blocks:
            x = block(x)
        return x

"""
    + _NET_FILE_TAIL
)


def test_a_run_of_identical_blocks_that_cannot_be_checkpointed_is_measured_block_by_block(
    tmp_path: Path,
) -> None:
    """On meta, 12 look-alike blocks would be probed cut to 4, 5 and 6 and the rest
    derived; each cut leaves its blocks out of the candidates, so the cuts do not
    extrapolate, the shortcut says why, and every block is measured (none derived)."""
    path = tmp_path / "own_cache.py"
    path.write_text(_OWN_CACHE)
    profile = probe_model(str(path), device="meta", micro_batches=(1, 2))
    assert profile.layer_names == () and not profile.extrapolated_layers
    assert [part.name for part in profile.fixed] == [*(f"blocks.{i}" for i in range(12)), "(loss)"]
    assert profile.extrapolation_declined == (
        "the probes of 4 and 5 blocks do not extrapolate (layer counts: the cuts to 4 and 5 "
        "blocks kept 0 and 0 checkpoint candidates, where each block of the run adds one)"
    )
