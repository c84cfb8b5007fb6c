"""Keep issue 33's shortcut holes shut: blocks that look identical (one class, one
parameter shape) but behave differently are never extrapolated from a few of them
(memplan.probe.sameness). A meta probe of such a model equals the cpu probe to the byte, and
says why it measured every block; truly identical blocks still take the shortcut, exactly."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from profile_bytes import assert_meta_equals_cpu

from memplan.files.schema import safe_load, to_data
from memplan.probe import repeats
from memplan.probe.runner import probe_model
from memplan.profile import profile_from_data, profile_to_yaml

ROOT = Path(__file__).resolve().parent
MODELS = ROOT / "models"
SIZES = (1, 2)


def _peak(profile) -> int:
    """The highest timeline point at the largest probed size, both phases: what a plan
    without checkpointing needs for activations."""
    b = max(profile.micro_batches)
    return max(
        round(i + s * b)
        for segments in profile.timeline.values()
        for seg in segments
        for i, s in seg.points
    )


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (
            "lookalike_wide.py",
            "block blocks.8 runs otherwise than blocks.1 (step 5: runs aten.repeat",
        ),
        (
            "lookalike_window.py",
            "block blocks.8 runs otherwise than blocks.1 (receives None where the other receives 4)",
        ),
        ("lookalike_shared.py", "blocks.0.lin.weight is held by 6 of the 16 blocks of blocks.0–15"),
    ],
)
def test_lookalike_blocks_probe_on_meta_as_on_cpu(model, reason):
    path = str(MODELS / model)
    meta = probe_model(path, device="meta", micro_batches=SIZES)
    cpu = probe_model(path, device="cpu", micro_batches=SIZES, timing_rounds=1)
    assert meta.extrapolated_layers == ()
    assert meta.extrapolation_declined is not None
    assert meta.extrapolation_declined.startswith(reason), meta.extrapolation_declined
    assert_meta_equals_cpu(cpu, meta)
    assert _peak(meta) == _peak(cpu)
    # the profile says so in the file it writes, and reads it back
    back = profile_from_data(safe_load(profile_to_yaml(meta)))
    assert back.extrapolation_declined == meta.extrapolation_declined


def test_the_wide_block_counts_its_wide_intermediate():
    """Hand count for lookalike_wide.py, fp32 bytes saved per sample: every block keeps its
    input (8 floats, for ``up``); a narrow one relu's 32 outputs (which ``down`` keeps too):
    160 B; a wide one (blocks 0 and 8) relu's 16 x 32 outputs and the 32 means ``down``
    keeps: 2,208 B. The shortcut measured blocks 0-2 and copied block 2 to block 8."""
    meta = probe_model(str(MODELS / "lookalike_wide.py"), device="meta", micro_batches=SIZES)
    saved = {x.name: x.saved_bytes.slope for x in meta.layers}
    narrow, wide = (8 + 32) * 4, (8 + 16 * 32 + 32) * 4
    assert [saved[f"blocks.{i}"] for i in range(16)] == [
        wide if i % 8 == 0 else narrow for i in range(16)
    ]


def test_shared_weight_counts_each_weight_once():
    """lookalike_shared.py: 11 distinct 32x32 weights (one for blocks 0-5, one each for
    6-15) and 16 biases: 47,104 B, where a probe of the first 6 blocks sees 6,144."""
    meta = probe_model(str(MODELS / "lookalike_shared.py"), device="meta", micro_batches=SIZES)
    assert meta.totals.params_trainable_bytes == (11 * 32 * 32 + 16 * 32) * 4 == 47_104


def test_identical_blocks_still_take_the_shortcut_exactly():
    model = f"{MODELS / 'deep_residual.py'}:blocks_10"
    derived = probe_model(model, device="meta", micro_batches=SIZES)
    cpu = probe_model(model, device="cpu", micro_batches=SIZES, timing_rounds=1)
    assert derived.extrapolated_layers == tuple(f"blocks.{i}" for i in range(3, 9))
    assert derived.extrapolation_declined is None
    assert_meta_equals_cpu(cpu, derived)


def test_old_profiles_without_the_fields_still_load():
    meta = probe_model(str(MODELS / "lookalike_shared.py"), device="meta", micro_batches=SIZES)
    data = to_data(meta)
    del data["extrapolated_layers"], data["extrapolation_declined"]
    back = profile_from_data(data)
    assert back.extrapolated_layers == () and back.extrapolation_declined is None


def test_a_model_that_runs_a_fixed_count_of_blocks_declines_with_the_reason(tmp_path):
    """The cut model does not run (the forward indexes 12 blocks): a decline, named, and the
    full probe's answer; not a failure, and not a silent fallback."""
    path = tmp_path / "fixed_count.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in range(12))

                def forward(self, x):
                    for i in range(12):
                        x = x + self.blocks[i](x)
                    return x

            def build_model():
                return Net()

            def make_batch(b):
                return torch.randn(b, 4)

            def training_loss(model, batch):
                return model(batch).square().mean()
            """
        )
    )
    meta = probe_model(str(path), device="meta", micro_batches=SIZES)
    assert meta.extrapolation_declined.startswith(
        "the model does not run with blocks.0–11 cut to 4 blocks"
    ), meta.extrapolation_declined
    assert meta.extrapolated_layers == ()
    assert len(meta.layers) == 12


def test_a_failure_of_memplans_own_machinery_is_not_a_decline(monkeypatch):
    """Issue 30: a bug in the shortcut used to become a silent full probe. Now it surfaces
    as memplan's own failure (InternalError, exit 3) naming the part and the op."""
    from memplan.errors import InternalError
    from memplan.probe import sameness

    def broken(self, out):
        raise KeyError("boom")

    monkeypatch.setattr(sameness._Tracer, "_new", broken)
    with pytest.raises(
        InternalError, match=r"block trace \(probe/sameness.py\) failed on op aten\."
    ):
        probe_model(f"{MODELS / 'deep_residual.py'}:blocks_10", device="meta", micro_batches=SIZES)


@pytest.mark.slow
def test_a_thousand_identical_blocks_are_derived_from_the_short_probes():
    """Issue 26's model at 1,000 blocks: the run's middle blocks derived from the short
    probes, none measured one by one (nothing declined). Its bar at 10,000 blocks, under
    120 s and 1 GiB on meta, is a time and memory target: bench/scale.py measures it in a
    fresh process (BENCHMARKS.md, 'Scale')."""
    p = probe_model(
        f"{MODELS / 'deep_residual.py'}:blocks_1000", device="meta", micro_batches=(1, 2, 4)
    )
    assert len(p.layers) == 1_000
    assert len(p.extrapolated_layers) == 1_000 - 4 and p.extrapolation_declined is None


# ------------------------------------------------------------------------- property test
TEMPLATE = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

N, PERIOD, OFFSET, KIND, RESIDUAL, D, T, W = {n}, {period}, {offset}, {kind!r}, {residual}, 8, 8, 2


def hidden(i):
    return KIND != "none" and i % PERIOD == OFFSET


class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("shift", torch.zeros(D))
        self._wide = KIND == "width" and hidden(i)  # private: no signature sees it
        self._ckpt = KIND == "checkpoint" and hidden(i)

    def body(self, x, window, flag, mask):
        h = self.lin(x) + self.shift
        if self._wide:
            h = torch.relu(h.repeat(1, 1, 4)).view(*h.shape[:2], 4, D).sum(2)
        elif flag:
            h = h * torch.sigmoid(h)
        else:
            h = torch.relu(h)
        b, t, _ = h.shape
        if window is None:
            s = torch.softmax(h @ h.transpose(-1, -2), -1)
            if mask is not None:
                s = s * mask
            y = s @ h
        else:
            z = h.reshape(b, t // window, window, D)
            y = (torch.softmax(z @ z.transpose(-1, -2), -1) @ z).reshape(b, t, D)
        return x + y

    def forward(self, x, window=None, flag=False, mask=None):
        if self._ckpt:
            return checkpoint(self.body, x, window, flag, mask, use_reentrant=False)
        return self.body(x, window, flag, mask)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(i) for i in range(N))
        marked = [b for i, b in enumerate(self.blocks) if hidden(i)]
        if KIND == "shared":  # the marked blocks share one weight; the others own theirs
            for b in marked[1:]:
                b.lin.weight = marked[0].lin.weight
        if KIND == "tied":  # the marked blocks' weight is the head's
            for b in marked:
                b.lin.weight = self.head.weight
        if KIND == "buffer":  # the marked blocks share one buffer
            for b in marked[1:]:
                b.shift = marked[0].shift

    def forward(self, x):
        ones = torch.ones(T, T, device=x.device)
        band = torch.tril(ones)
        for i, block in enumerate(self.blocks):
            h = hidden(i)
            y = block(
                x,
                window=W if KIND == "window" and not h else None,
                flag=KIND == "flag" and h,
                mask=(ones if h else band) if KIND == "mask" else None,
            )
            x = x + y if RESIDUAL else y  # the parent's own op between blocks
            if KIND == "parent_op" and h:
                x = torch.cat([x, x], -1)[..., :D] * 1.0
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, T, D)


def training_loss(model, batch):
    return model(batch).square().mean()
"""

KINDS = (
    "none",
    "width",
    "window",
    "flag",
    "mask",
    "shared",
    "tied",
    "buffer",
    "checkpoint",
    "parent_op",
)


@st.composite
def lookalikes(draw):
    n = draw(st.integers(repeats.MIN_RUN, 11))
    period = draw(st.sampled_from((2, 3, 5, 8, 16)))
    offset = draw(st.integers(0, min(period, n) - 1))
    kind = draw(st.sampled_from(KINDS))
    return {
        "n": n,
        "period": period,
        "offset": offset,
        "kind": kind,
        "residual": draw(st.booleans()),
    }


@settings(
    max_examples=int(os.environ.get("MEMPLAN_LOOKALIKE_EXAMPLES", "6")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=lookalikes())
@example(case={"n": 9, "period": 2, "offset": 0, "kind": "none", "residual": True})
@example(case={"n": 11, "period": 8, "offset": 0, "kind": "width", "residual": False})
@example(case={"n": 10, "period": 16, "offset": 0, "kind": "window", "residual": True})
@example(case={"n": 9, "period": 3, "offset": 2, "kind": "shared", "residual": False})
def test_lookalike_blocks_are_measured_or_proven_alike(tmp_path, case):
    path = tmp_path / "lookalike_{kind}_{n}_{period}_{offset}_{residual}.py".format(**case)
    path.write_text(TEMPLATE.format(**case))
    meta = probe_model(str(path), device="meta", micro_batches=SIZES)
    taken = bool(meta.extrapolated_layers)
    assert taken == (meta.extrapolation_declined is None), meta.extrapolation_declined
    if case["kind"] == "none":
        assert taken, "identical blocks must take the shortcut"
    if taken:  # the answer must be the full one: compare with the cpu probe, byte for byte
        cpu = probe_model(str(path), device="cpu", micro_batches=SIZES, timing_rounds=1)
        assert_meta_equals_cpu(cpu, meta)
