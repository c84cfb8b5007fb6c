"""Identical blocks on meta reuse their representative's meta-kernel results
(memplan.probe.dedup): the profile is the same as a full probe's, and says which layers
reused."""

import dataclasses
from pathlib import Path

import pytest
import torch

from memplan.probe.dedup import MetaOpCache
from memplan.probe.runner import probe_model
from memplan.probe.tracker import LiveTracker

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")


def without_note(profile):
    return dataclasses.replace(profile, deduplicated_layers=())


@pytest.mark.parametrize(
    ("precision", "mixed"), [("fp32", "autocast"), ("bf16", "autocast"), ("bf16", "params")]
)
def test_reusing_identical_blocks_gives_the_full_probes_profile(precision, mixed):
    kwargs = {"device": "meta", "precision": precision, "micro_batches": (1, 2)}
    kwargs["mixed_precision"] = mixed
    reused = probe_model(GPT, **kwargs)
    full = probe_model(GPT, reuse_identical=False, **kwargs)
    assert without_note(reused) == without_note(full)
    # blocks.0 is the representative; the other three computed no meta kernel of their own
    assert reused.deduplicated_layers == ("blocks.1", "blocks.2", "blocks.3")
    assert full.deduplicated_layers == ()


def test_only_functional_calls_are_cached():
    cache = MetaOpCache()
    x = torch.empty(4, 8, device="meta")
    with LiveTracker(meta=True, op_cache=cache) as tracker:
        a = x * 2.0
        b = x * 2.0  # same op, same metadata: a hit, a fresh storage
        c = x * 3.0  # another scalar: a miss
        t = x.t()  # a view: always run, shares x's storage
        x.add_(1.0)  # in place: always run
    assert (cache.hits, cache.misses) == (1, 2)
    assert a.untyped_storage() is not b.untyped_storage()
    assert a.shape == b.shape == c.shape == (4, 8) and b.stride() == (8, 1)
    assert t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert tracker.flops == 0  # elementwise ops count no FLOPs, hit or miss


def test_cpu_tensors_are_never_cached():
    cache = MetaOpCache()
    x = torch.ones(3)
    with LiveTracker(op_cache=cache):
        y = x * 2.0
        z = x * 2.0
    assert cache.hits == 0 and torch.equal(y, z) and float(y.sum()) == 6.0


BLOCKS_READ_A_MASK = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        # a per-block mask whose value is read, as HF attention code does
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        if not bool(mask.any()):
            raise RuntimeError("empty mask")
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 8, 16)
"""


def test_a_reused_factory_result_keeps_its_real_values(tmp_path):
    # blocks.1 and blocks.2 rebuild the mask from the cache; a value read of it must still
    # be answered (probe/shadow.py), as it is in blocks.0
    model = tmp_path / "mask_blocks.py"
    model.write_text(BLOCKS_READ_A_MASK)
    reused = probe_model(str(model), device="meta", micro_batches=(1, 2))
    full = probe_model(str(model), device="meta", micro_batches=(1, 2), reuse_identical=False)
    assert without_note(reused) == without_note(full)
    assert reused.deduplicated_layers == ("blocks.1", "blocks.2")
