"""Casts that mixed precision makes and a checkpoint plan must count.

1. Under bf16/fp16 autocast, a kept layer's autograd keeps its weight casts (autocast's
   weight-cast cache made them) until its backward; a checkpointed layer's go when the
   forward leaves autocast. The all-checkpointed run's backward points lack them, so a
   checkpointed layer's backward next to kept layers must add the kept layers' casts
   (memory.terms.cast_extra_bytes). Measured before: timm ViT, 3 kept + 1 checkpointed
   block, bf16, micro-batch 16: −6.6% (294,912 B short); after: +0.1%.
2. Under ``--mixed-precision params`` the batch stays fp32 (what ``make_batch`` gives and
   training holds); FSDP2's root casts its floating inputs in its forward pre-hook
   (``cast_forward_inputs``). Before, the probe cast the batch itself and never counted the
   fp32 batch: −7.2% at micro-batch 16 on 2 FSDP ranks.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap

import pytest
from profiles_factory import _environment, per_sample, raw_profile

from memplan.memory import step_peak
from memplan.memory.bounds import step_bounds
from memplan.memory.peak import step_points
from memplan.modes import FULL, KEEP
from memplan.profile import Affine, Segment

CASTS = 1000  # bytes of bf16 weight casts per layer (batch-independent)


def _autocast_profile(precision: str = "bf16", mixed_precision: str = "autocast"):
    """Two layers; each saves CASTS + 100·b and checkpointing frees 80·b while it is held
    (the casts still in autocast's cache at the forward's end). The all-checkpointed run's
    backward of layer 1 lacks layer 0's casts (freed when the forward left autocast)."""
    segments = (
        Segment(held=0, active="none", points=((10_000.0, 0.0),)),
        Segment(
            held=0, active="fwd", points=((11_000.0, 100.0),), ckpt_points=((11_000.0, 100.0),)
        ),
        Segment(held=1, active="none", points=((11_000.0, 100.0),)),
        Segment(
            held=1, active="fwd", points=((12_000.0, 200.0),), ckpt_points=((12_000.0, 200.0),)
        ),
        Segment(held=2, active="none", points=((12_000.0, 200.0),)),
        # plain: both layers' casts live; all-checkpointed (normalised by savings 80·b):
        # layer 0's casts gone
        Segment(
            held=1, active="bwd", points=((12_500.0, 210.0),), ckpt_points=((11_600.0, 210.0),)
        ),
        Segment(
            held=0, active="bwd", points=((11_500.0, 110.0),), ckpt_points=((11_500.0, 110.0),)
        ),
    )
    timeline = {"no_grads": segments, "grads_resident": segments}
    profile = raw_profile(
        savings=[per_sample(80.0), per_sample(80.0)],
        fwd_seconds=[0.0, 0.0],
        timeline=timeline,
        optimizer_peak=0.0,
        environment=_environment(precision=precision, mixed_precision=mixed_precision),
    )
    layers = tuple(
        dataclasses.replace(layer, saved_bytes=Affine(intercept=float(CASTS), slope=100.0))
        for layer in profile.layers
    )
    return dataclasses.replace(profile, layers=layers)


def _bwd1(profile, b, checkpointed):
    points = step_points(profile, b, checkpointed, 1)
    return points[5].allocated_bytes


def test_checkpointed_backward_counts_kept_layers_casts():
    profile = _autocast_profile()
    b = 4
    # layer 0 kept, layer 1 checkpointed: its backward (recompute) runs beside layer 0's casts
    assert _bwd1(profile, b, {1: FULL}) == 11_600 + 210 * b + CASTS
    peak = step_peak(profile, b, {1: FULL}, 1)
    assert peak.allocated_bytes == 11_600 + 210 * b + CASTS
    # every layer checkpointed: nothing kept, no casts added (was exact, stays exact)
    assert _bwd1(profile, b, {0: FULL, 1: FULL}) == 11_600 + 210 * b - 80 * b
    # layer 1 kept: its plain points hold layer 0's casts already
    assert _bwd1(profile, b, {0: FULL}) == 12_500 + 210 * b - 80 * b
    assert _bwd1(profile, b, {}) == 12_500 + 210 * b


def test_no_casts_off_autocast():
    for precision, mixed in (("fp32", "autocast"), ("bf16", "params")):
        profile = _autocast_profile(precision, mixed)
        assert _bwd1(profile, 4, {1: FULL}) == 11_600 + 210 * 4


def test_solver_bounds_never_below_step_peak():
    profile = _autocast_profile()
    for b in (1, 4, 16):
        bounds = step_bounds(profile, b, 1)
        for modes in ({}, {0: FULL}, {1: FULL}, {0: FULL, 1: FULL}):
            prefix = [0]
            for h in range(2):
                prefix.append(prefix[-1] + bounds.saving(modes.get(h, KEEP), h))
            bound = max(
                [bounds.none_bytes[h] - prefix[h] for h in range(3)]
                + [bounds.active(modes.get(h, KEEP), h) - prefix[h] for h in range(2)]
                + [bounds.optimizer_bytes]
            )
            assert bound >= step_peak(profile, b, modes, 1).allocated_bytes


# --------------------------------------------------------------------------- probe + verify
_VIT_LIKE = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)
        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    class M(nn.Module):
        def __init__(self, d=64, n=4):
            super().__init__()
            self.inp = nn.Linear(16, d)
            self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
            self.head = nn.Linear(d, 10)
        def forward(self, x):
            return self.head(self.blocks(self.inp(x)).mean(1))

    def build_model():
        torch.manual_seed(0)
        return M()

    def make_batch(b):
        return torch.randn(b, 32, 16), torch.randint(0, 10, (b,))

    def training_loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def make_optimizer(model):  # no state: the peak is in the backward, not the step
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    """
)


def _cli(*args):
    from typer.testing import CliRunner

    from memplan.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def _peak_errors(output: str) -> list[float]:
    """Every ``peak error ±x.x%`` verify printed."""
    return [float(m) for m in re.findall(r"peak error ([+-]?[0-9.]+)%", output)]


@pytest.mark.slow
def test_bf16_autocast_last_block_checkpointed_verifies(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(_VIT_LIKE)
    probe = _cli(
        "probe",
        "m.py",
        "--device",
        "cpu",
        "--precision",
        "bf16",
        "--timing-rounds",
        "1",
        "--micro-batches",
        "1,2",
        "-o",
        "p.yaml",
    )
    assert probe.exit_code == 0, probe.output
    solve = _cli(
        "solve",
        "p.yaml",
        "--target-batch",
        4,
        "--min-micro",
        4,
        "--budget",
        "1GiB",
        "--modes",
        "keep,full",
        "--always-checkpoint",
        "blocks.3",
        "-o",
        "plan.yaml",
    )
    assert solve.exit_code == 0, solve.output
    assert "blocks.3" in (tmp_path / "plan.yaml").read_text()
    verify = _cli("verify", "plan.yaml", "--steps", 2)
    errors = _peak_errors(verify.output)
    assert errors and all(abs(e) < 2.0 for e in errors), verify.output


_WIDE_INPUT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc = nn.Linear(d, d)
            self.norm = nn.LayerNorm(d)
        def forward(self, x):
            return x + F.gelu(self.norm(self.fc(x)))

    class M(nn.Module):
        def __init__(self, d=64, n=4):
            super().__init__()
            self.inp = nn.Linear(32, d)
            self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
            self.head = nn.Linear(d, 10)
        def forward(self, x):
            return self.head(self.blocks(self.inp(x)).mean(1))

    def build_model():
        torch.manual_seed(0)
        return M()

    def make_batch(b):
        return {"x": torch.randn(b, 16, 32), "y": torch.randint(0, 10, (b,))}

    def training_loss(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])
    """
)


@pytest.mark.slow
def test_fsdp_bf16_params_counts_the_fp32_batch(tmp_path, monkeypatch):
    """2 KiB a sample of fp32 input (16 × 32): before, −7.2% at micro-batch 16."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(_WIDE_INPUT)
    probe = _cli(
        "probe",
        "m.py",
        "--device",
        "cpu",
        "--precision",
        "bf16",
        "--mixed-precision",
        "params",
        "--timing-rounds",
        "1",
        "--micro-batches",
        "4,8",
        "-o",
        "p.yaml",
    )
    assert probe.exit_code == 0, probe.output
    solve = _cli(
        "solve",
        "p.yaml",
        "--target-batch",
        32,
        "--min-micro",
        16,
        "--budget",
        "480KiB",
        "--world-size",
        2,
        "--strategy",
        "fsdp",
        "-o",
        "plan.yaml",
    )
    assert solve.exit_code == 0, solve.output
    verify = _cli("verify", "plan.yaml", "--steps", 2)
    errors = _peak_errors(verify.output)
    assert errors and all(abs(e) < 2.0 for e in errors), verify.output
