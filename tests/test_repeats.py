"""A long run of identical blocks is probed at 4, 5 and 6 blocks and the rest derived
(memplan.probe.repeats, memplan.probe.expand): every byte of the profile equals a full
probe's, seconds agree to 1e-9, and a block that differs in one shape is never merged."""

import dataclasses
from pathlib import Path

import pytest
from torch import nn

from memplan.probe.expand import same_profile
from memplan.probe.repeats import longest_run, signature
from memplan.probe.runner import probe_model

ROOT = Path(__file__).resolve().parent
DEEP = ROOT / "models" / "deep_residual.py"

NEAR_IDENTICAL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(4, hidden)
        self.down = nn.Linear(hidden, 4)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # block 9 is wider: it must stay a block of its own
        self.blocks = nn.ModuleList(Block(12 if i == 9 else 8) for i in range(20))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 3, 4)
"""


def _bytes_equal(derived, full):
    """Every byte field equal, seconds within 1e-9 (virtual times fitted in another order)."""
    assert same_profile(derived, full)
    strip = {"deduplicated_layers": (), "extrapolated_layers": ()}
    a = dataclasses.replace(derived, **strip)
    b = dataclasses.replace(full, **strip)
    assert a.timeline == b.timeline  # bytes only: equal to the last byte
    assert a.totals == b.totals and a.optimizer_step_peak_bytes == b.optimizer_step_peak_bytes
    for x, y in zip(a.layers, b.layers, strict=True):
        assert x.name == y.name
        for f in dataclasses.fields(x):
            if f.name.endswith("_bytes"):
                assert getattr(x, f.name) == getattr(y, f.name), (x.name, f.name)


def test_ten_identical_blocks_derive_the_full_probes_profile():
    model = f"{DEEP}:blocks_10"
    derived = probe_model(model, device="meta", micro_batches=(1, 2))
    full = probe_model(model, device="meta", micro_batches=(1, 2), reuse_identical=False)
    _bytes_equal(derived, full)
    # blocks 0, 1, 2 and 9 measured in the 4-block probe; 3..8 copy block 2
    assert derived.deduplicated_layers == tuple(f"blocks.{i}" for i in range(3, 9))
    assert derived.extrapolated_layers == derived.deduplicated_layers
    assert derived.extrapolation_declined is None and full.extrapolated_layers == ()
    # hand count: each block holds its input (4 floats = 16 B per sample) for backward
    assert [x.saved_bytes.slope for x in derived.layers] == [16.0] * 10


def test_a_block_differing_in_one_shape_is_never_merged(tmp_path):
    path = tmp_path / "near.py"
    path.write_text(NEAR_IDENTICAL)
    derived = probe_model(str(path), device="meta", micro_batches=(1, 2))
    full = probe_model(str(path), device="meta", micro_batches=(1, 2), reuse_identical=False)
    _bytes_equal(derived, full)
    assert "blocks.9" not in derived.deduplicated_layers
    # the longest run (blocks.10-19) was cut; blocks 13..18 derived
    assert derived.deduplicated_layers == tuple(f"blocks.{i}" for i in range(13, 19))
    wide, narrow = derived.layers[9], derived.layers[8]
    assert wide.params_trainable_bytes == (4 * 12 + 12 + 12 * 4 + 4) * 4
    assert narrow.params_trainable_bytes == (4 * 8 + 8 + 8 * 4 + 4) * 4


def test_varied_blocks_are_probed_in_full():
    model = f"{DEEP}:varied_10"
    profile = probe_model(model, device="meta", micro_batches=(1, 2))
    assert not any(name in profile.deduplicated_layers for name in ("blocks.1", "blocks.2"))


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (nn.Linear(4, 4), nn.Linear(4, 4), True),
        (nn.Linear(4, 4), nn.Linear(4, 5), False),
        (nn.Linear(4, 4), nn.Linear(4, 4, bias=False), False),
        (nn.Dropout(0.1), nn.Dropout(0.2), False),
        (nn.LayerNorm(4), nn.LayerNorm(4, eps=1e-3), False),
        (nn.Linear(4, 4).half(), nn.Linear(4, 4), False),
    ],
)
def test_signature_tells_shapes_dtypes_and_hyper_parameters_apart(a, b, same):
    assert (signature(a) == signature(b)) is same


def test_a_frozen_block_is_not_like_a_trained_one():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight.requires_grad_(False)
    assert signature(a) != signature(b)


def test_only_runs_of_eight_or_more_are_cut():
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4)) for _ in range(7)))
    assert longest_run(model, [str(i) for i in range(7)]) is None
    model = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4)) for _ in range(8)))
    run = longest_run(model, [str(i) for i in range(8)])
    assert (run.container, run.start, run.length, run.first) == ("", 0, 8, 0)
