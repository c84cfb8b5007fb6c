"""bench/fused_norm.py: the published run's layout (pytorch/torchtitan#364's test plan and
train_configs/llama3_8b.toml of May 2024), the gain arithmetic by hand, and the fused-norm
stand-in's bytes (bench/fused_norm_model.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest
import torch

from bench import fused_norm


def test_the_layout_is_the_published_test_plan():
    row = fused_norm.layout()
    # 8 GPUs, tensor_parallel_degree 4 (data_parallel_degree -1: FSDP over 2), batch_size 4,
    # seq_len 8192, compile false, selective 'op' AC, no float8
    assert (row.gpus, row.tp, row.pp, row.cp, row.dp) == (8, 4, 1, 1, 2)
    assert (row.local_batch, row.micro, row.seq) == (4, 4, 8192)
    assert (row.ac, row.techniques, row.precision) == ("op-sac", "eager", "bf16")
    assert fused_norm.PUBLISHED == (0.07, 0.08)


def test_gain_and_the_slowed_steps_by_hand():
    assert fused_norm.gain(1.2, 1.0) == pytest.approx(0.2)
    # 1.282 + 0.5 × 0.393 = 1.4785 against 1.116 + 0.5 × 0.227 = 1.2295: +20.25%
    eager, fused = fused_norm.slowed(1.282, 0.393), fused_norm.slowed(1.116, 0.227)
    assert (eager, fused) == (pytest.approx(1.4785), pytest.approx(1.2295))
    assert fused_norm.gain(eager, fused) == pytest.approx(0.2025, abs=1e-4)


def test_the_verdict_quotes_what_the_saving_needs():
    text = fused_norm.verdict(1.282, 1.116, 0.2025)
    # +14.9% over the middle 7.5%: 1.98×, shown 2.0×; 0.166 s / 0.075 = 2.213 s, 1.98× 1.116
    assert "2.0× the published range's middle" in text and "further from it (+20.2%)" in text
    assert "(0.166 s a step)" in text and "fused step of 2.21 s, 1.98× memplan's" in text
    assert "within the published range" in fused_norm.verdict(1.075, 1.0, 0.07)


def test_the_stand_in_moves_one_pass_each_way():
    from bench.fused_norm_model import FusedNorm, _FusedBytes

    x = torch.randn(3, 5, requires_grad=True)
    weight = torch.randn(5, requires_grad=True)
    y = _FusedBytes.apply(x, weight)
    torch.testing.assert_close(y, x * weight)
    dy = torch.randn(3, 5)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy * x.detach())
    assert torch.count_nonzero(weight.grad) == 0
    with torch.device("meta"):
        from bench.fused_norm_model import build_eager, build_fused

        fused, eager = build_fused(), build_eager()
    norms = [m for m in fused.modules() if isinstance(m, FusedNorm)]
    assert len(norms) == 2 * 32 + 1  # two a block of Llama 3 8B's 32, and the final one
    assert not any(isinstance(m, FusedNorm) for m in eager.modules())
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in eager.parameters())
