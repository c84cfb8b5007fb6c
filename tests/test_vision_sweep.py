"""A sample of bench/vision_sweep.py and bench/timm_sweep.py (meta equals cpu across
torchvision's models and timm's families), through the bench's own model files: the whole
sweeps are ``python -m bench.run --device cpu --only vision_sweep --only timm_sweep``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import timm_sweep, vision_sweep

SAMPLE = [
    "vit_b_32",  # nn.MultiheadAttention: SDPA called from F.multi_head_attention_forward
    "regnet_y_400mf",  # its builder reads block widths from tensors it makes
    "lraspp_mobilenet_v3_large",  # segmentation: a dict of outputs, per-pixel targets
    "deeplabv3_mobilenet_v3_large",  # probed at 2 and 4: ASPP pooling holds 1 value a channel
]


@pytest.mark.parametrize("name", SAMPLE)
def test_meta_equals_cpu_for_a_sample_of_torchvision(tmp_path: Path, name: str) -> None:
    row = vision_sweep.probe_one(name, str(tmp_path))
    assert row["status"] == "equal", row
    assert 0 < row["params"] <= vision_sweep.MAX_PARAMETERS


def test_a_model_over_the_limit_is_counted_on_meta_and_skipped(tmp_path: Path) -> None:
    """vit_h_14 is counted on meta, allocating nothing, and skipped: torchvision's
    632,045,800 parameters (1,000 classes at 224 × 224) less 252 of its 257 position
    embeddings of 1,280 (4 patches of 14 at 28 × 28, and the class token) and 990 of its
    1,000 classes (1,280 weights and a bias each)."""
    row = vision_sweep.probe_one("vit_h_14", str(tmp_path))
    expected = 632_045_800 - 252 * 1280 - 990 * 1281
    assert row["status"] == "skip" and row["params"] == expected == 630_455_050, row


@pytest.mark.parametrize(("module", "name"), [("convnext", "convnext_atto")])
def test_meta_equals_cpu_for_a_sample_of_timm(tmp_path: Path, module: str, name: str) -> None:
    assert timm_sweep.smallest(module) == name
    row = timm_sweep.probe_one(name, str(tmp_path))
    assert row["status"] == "equal", row
    assert 0 < row["params"] <= vision_sweep.MAX_PARAMETERS
