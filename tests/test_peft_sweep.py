"""A sample of bench/peft_sweep.py (meta equals cpu across peft's tuning methods), through
the bench's own model files: the whole sweep is ``python -m bench.run --device cpu --only
peft_sweep``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import peft_sweep

LLAMA = 2 * 128 * 64 + 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64)
"""The tiny Llama's parameters: embedding and head (not tied), the final norm, and per layer
the q/o (64 × 64), k/v (64 × 32: 2 K/V heads of 16), the MLP's three 64 × 128 and 2 norms."""

SAMPLE = {
    # DoRA (r 8 on q and v): A r × 64 and B out × r, and a magnitude for each output
    "lora-dora": 2 * ((8 * 64 + 64 * 8 + 64) + (8 * 64 + 32 * 8 + 32)),
    # prefix tuning: 4 virtual tokens of K and V (2 heads of 16) for each of 2 layers
    "prefix-tuning": 4 * 2 * 2 * 32,
    # BOFT (blocks of 4): 16 orthogonal 4 × 4 blocks on a 64-wide input, an output scale
    "boft": 2 * ((16 * 4 * 4 + 64) + (16 * 4 * 4 + 32)),
}
"""What each sampled method adds, by hand; the DoRA magnitudes recomputed every forward from
the base weight's column norms, the prefix through transformers' cache, BOFT's butterfly
blocks multiplied into the weight."""


@pytest.mark.parametrize("name", sorted(SAMPLE))
def test_meta_equals_cpu_for_a_sample_of_peft(tmp_path: Path, name: str) -> None:
    row = peft_sweep.probe_one(name, str(tmp_path))
    assert row["status"] == "equal", row
    assert row["params"] == LLAMA + SAMPLE[name] and LLAMA == 90_432


def test_a_method_that_reads_its_weights_stops_on_meta_naming_the_op(tmp_path: Path) -> None:
    """VB-LoRA asks ``vblora_logits_A[0, 0].isinf().any()`` in its forward: a value of a
    weight, which meta does not have. Exit 3 naming the read and where peft makes it."""
    row = peft_sweep.probe_one("vblora", str(tmp_path))
    assert row["status"] == "meta-fails", row
    assert row["detail"].startswith("exit 3:") and "vblora/layer.py" in row["detail"], row
