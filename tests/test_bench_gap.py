"""bench/gap.py: where the published 8B runs' step gap lies. Each kind of op's part of a
step is what the step gains when that kind's rate halves; the gap over each part is the
k − 1 that kind alone would need, and the kind whose k agrees best across one part's runs
is named. Numbers below are worked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.gap import (
    KINDS,
    SOLVED_KINDS,
    Gap,
    consistency_line,
    gap_line,
    halved,
    kind_factors,
    spread,
)
from memplan.devices import load_device, spec_digest


def test_halving_a_kind_halves_its_efficiencies_and_nothing_else():
    h100 = load_device("h100-80gb")  # matmul 0.803, float8 0.709, attention 0.638/0.524
    gemm = halved(h100, "GEMMs")
    assert (gemm.efficiency.matmul, gemm.efficiency.float8_matmul) == (0.4015, 0.3545)
    assert gemm.efficiency.attention == 0.638 and gemm.efficiency.memory == 0.84
    assert gemm.name == "h100-80gb-half-gemms" and gemm.bf16_flops == h100.bf16_flops
    attention = halved(h100, "attention")
    assert (attention.efficiency.attention, attention.efficiency.backward_attention) == (
        0.319,
        0.262,
    )
    assert attention.efficiency.matmul == 0.803
    assert halved(h100, "memory-bound ops").efficiency.memory == 0.42
    # a spec that leaves a field unset halves what it falls back to
    a100 = load_device("a100-80gb")  # matmul 0.869, no float8 efficiency of its own
    assert a100.efficiency.float8_matmul is None
    assert halved(a100, "GEMMs").efficiency.float8_matmul == pytest.approx(0.4345)
    # the halved spec's name differs per kind: a probe's meta clock is keyed by it
    names = {halved(h100, kind).name for kind in KINDS}
    assert len(names) == 4 and h100.name not in names
    # NVLink collectives: NCCL's share of the link, 0.80 → 0.40; the solver times them, so
    # that variant keeps the profile's clock (its fingerprint) where the others do not
    nvlink = halved(h100, "NVLink collectives")
    assert nvlink.efficiency.interconnect == 0.4 and nvlink.efficiency.matmul == 0.803
    assert {"NVLink collectives"} == SOLVED_KINDS
    for kind in KINDS:
        kept = spec_digest(halved(h100, kind)) == spec_digest(h100)
        assert kept == (kind in SOLVED_KINDS), kind


def test_a_runs_factors_are_its_gap_over_each_kinds_part():
    # Table 1 eager as the bench printed it: 2.84 published, 2.42 memplan
    gap = Gap("8B Table 1, eager", 2.84, 2.42, (1.05, 0.38, 0.84))
    assert gap.gap == pytest.approx(0.42)
    assert gap.factors() == pytest.approx((0.4, 0.42 / 0.38, 0.5))
    line = gap_line(gap)
    assert line == (
        "| 8B Table 1, eager | 2.84 s | 2.42 s | +0.42 s | 1.05 s | 0.38 s | 0.84 s "
        "| +0.40 | +1.11 | +0.50 |"
    )
    # a kind that adds nothing would need an infinite factor
    assert Gap("x", 2.0, 1.0, (1.0, 0.0, 0.5)).factors()[1] == math.inf


def test_the_kind_whose_factors_agree_best_is_named():
    # GEMMs need +0.40 and +0.50 (spread 1.25×), attention +1.00 and +2.00 (2×), memory-bound
    # ops +0.20 and +1.00 (5×): GEMMs, 1.40× to 1.50× slower
    # NVLink collectives +2.00 and +10.00 (5×)
    gaps = [
        Gap("eager", 3.0, 2.6, (1.0, 0.4, 2.0, 0.2)),
        Gap("compile", 2.5, 2.0, (1.0, 0.25, 0.5, 0.05)),
    ]
    assert kind_factors(gaps, "GEMMs") == pytest.approx([0.4, 0.5])
    line = consistency_line(gaps, "the H100s")
    assert "GEMMs +0.40, +0.50 (spread 1.25×)" in line, line
    assert "attention +1.00, +2.00 (spread 2.00×)" in line, line
    assert "memory-bound ops +0.20, +1.00 (spread 5.00×)" in line, line
    assert "NVLink collectives +2.00, +10.00 (spread 5.00×)" in line, line
    assert line.endswith("is GEMMs (spread 1.25×): that kind would have to run 1.40× to "
                         "1.50× slower than memplan charges it."), line  # fmt: skip
    # a run memplan overestimates (negative gap) is explained by no kind running slower
    gaps.append(Gap("float8", 1.0, 1.2, (0.5, 0.2, 0.3, 0.1)))
    line = consistency_line(gaps, "the H100s")
    assert "spread none: not all short" in line
    assert line.endswith("no one kind running slower explains every run's gap."), line


@given(
    st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=8),
    st.floats(min_value=1e-2, max_value=1e2),
)
def test_spread_is_at_least_one_and_blind_to_scale(values, scale):
    s = spread(values)
    assert s >= 1.0
    assert spread([v * scale for v in values]) == pytest.approx(s, rel=1e-9)
    assert spread([*values, 0.0]) == math.inf and spread([*values, -1.0]) == math.inf
    assert spread([*values, math.inf]) == math.inf and spread([]) == math.inf


GEMM_MODEL = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU(),
                         nn.Linear(1024, 1024, bias=False))


def make_batch(batch_size):
    return torch.randn(256 * batch_size, 1024)  # 256 rows a sample: every matmul compute-bound


def training_loss(model, batch):
    return model(batch).sum()
"""


def test_what_a_halved_gemm_rate_adds_is_the_gemms_own_time_on_the_meta_clock(tmp_path):
    """The part the bench reads off is the roofline's: a probe of two 1024 × 1024 linears
    (fp32, 67 TFLOP/s on h100-80gb at 0.803; 2 × 256 × 1024 × 1024 FLOPs a sample, by
    hand) timed again with GEMMs at half rate gains, per linear and sample, exactly those
    FLOPs / (67e12 × 0.803), 9.98 µs; the memory-bound ReLU between them gains nothing."""
    from bench.published import spec_file
    from memplan.probe.runner import probe_model
    from tests.profile_bytes import write_model

    model = write_model(tmp_path, "gemms.py", GEMM_MODEL)
    h100 = load_device("h100-80gb")
    base, slow = (
        {
            part.name: part
            for part in probe_model(
                model, device="meta", device_profile=str(spec_file(spec, tmp_path))
            ).fixed
        }
        for spec in (h100, halved(h100, "GEMMs"))
    )
    flops = 2 * 256 * 1024 * 1024
    for name in ("0", "2"):  # the linears
        for batch in (1, 4):
            added = slow[name].fwd_seconds.at(batch) - base[name].fwd_seconds.at(batch)
            assert added == pytest.approx(batch * flops / (67e12 * 0.803), rel=1e-9)
        assert base[name].fwd_seconds.at(1) == pytest.approx(9.98e-6, rel=1e-3)
    assert slow["1"].fwd_seconds.at(4) == base["1"].fwd_seconds.at(4) > 0  # the ReLU


def test_the_nvlink_collectives_part_of_a_tp_layout_is_its_tp_collectives():
    """The solved kind's part, read off as the others are (the step with its rate halved,
    less the step): on tp 2 alone (2 ranks, no data-parallel traffic) it is exactly the
    layout's TP collectives, 4 ring all-reduces a block of ring(8 B, 2) = 8 B at 360 GB/s
    on h100-80gb: 4 blocks · 4 · 8 B = 128 B, 0.36 ns; halved, they take twice that."""
    from profiles_factory import uniform_chain, with_tp_measurement

    from memplan.solver import SolveRequest
    from memplan.solver.parallel import LayoutRequest, solve_layout

    profile = with_tp_measurement(
        uniform_chain(4, saved=[4000] * 4, output=[400] * 4).profile(), 0.75, hf_blocks=True
    )
    h100 = load_device("h100-80gb")
    steps = {}
    for spec in (h100, halved(h100, "NVLink collectives")):
        request = SolveRequest(
            target_batch=1,
            budget_bytes=1 << 40,
            world_size=2,
            strategy="ddp",
            device_spec=spec,
            modes=("keep",),
        )
        (option,) = solve_layout(profile, request, LayoutRequest(tp=2, pp=1)).options
        steps[spec.name] = (option.step_seconds, option.comm_seconds["tp"])
    (step, tp), (slower, tp_slower) = steps[h100.name], steps[f"{h100.name}-half-nvlink"]
    assert tp == pytest.approx(128 / 360e9) and tp_slower == pytest.approx(2 * tp)
    assert slower - step == pytest.approx(tp, rel=1e-9)


def test_the_gap_rows_are_the_fsdp_8b_runs_the_h100_tp_runs_and_the_405b_pipelines():
    # nine 8B runs with FSDP alone (H100 Tables 1 and 3, two A100, two H200) in their
    # device's part; the five H100 runs with TP 8 and neither stages nor CP (70B Table 4,
    # and the June 2025 vanilla-TP runs of 70B and 8B, bf16 and float8) in a part of their
    # own; the two 405B pipeline runs of Table 5 in a third; no CP or long-sequence run
    from bench.published import DEVICE, PP_PART, TP_PART, gap_part, gap_rows

    rows = gap_rows()
    parts = [(row.model, row.table, row.techniques, gap_part(row)) for row in rows]
    tp = [p for p in parts if p[3] == TP_PART]
    assert [(m, t, tech) for m, t, tech, _ in tp] == [
        ("70B", "Table 4", "compile+float8"),
        ("70B", "asyncTP 2025-06, vanilla TP", "compile"),
        ("70B", "asyncTP 2025-06, vanilla TP", "compile+float8"),
        ("8B", "asyncTP 2025-06, vanilla TP", "compile"),
        ("8B", "asyncTP 2025-06, vanilla TP", "compile+float8"),
    ]
    pp = [row for row in rows if gap_part(row) == PP_PART]
    assert [(r.model, r.table, r.pp, r.schedule) for r in pp] == [
        ("405B", "Table 5", 8, "1f1b"),
        ("405B", "Table 5", 8, "interleaved_1f1b"),
    ]
    fsdp = [p for p in parts if p[3] not in (TP_PART, PP_PART)]
    assert len(fsdp) == 9 and {p[0] for p in fsdp} == {"8B"}
    assert sum(p[3] == DEVICE for p in fsdp) == 5
    assert all(row.cp == 1 and row.seq == 8192 for row in rows)


def test_each_h100_part_gets_its_verdict_and_the_others_their_gemms():
    # the FSDP and TP parts each get which kind agrees best; the pipeline part (one layout
    # in two schedules, every kind agreeing) only its GEMMs' k − 1; the A100 part its GEMMs'
    from bench.published import DEVICE, PP_PART, TP_PART, gap_section

    two = [Gap("a", 3.0, 2.0, (1.0, 2.0, 4.0, 8.0)), Gap("b", 3.0, 2.5, (1.0, 1.0, 1.0, 1.0))]
    lines = gap_section(
        {
            DEVICE: two,
            TP_PART: two,
            PP_PART: [Gap("1f1b", 4.0, 3.0, (2.5, 1.0, 1.0, 1.0))],
            "a100-80gb": [Gap("x", 2.2, 2.0, (2.0, 1.0, 1.0, 1.0))],
        }
    )
    text = "\n".join(lines)
    # GEMMs +1.00, +0.50 (2×); attention +0.50, +0.50 (1×): attention agrees best
    assert text.count("So the kind whose factors agree best is attention (spread 1.00×)") == 2
    assert "which differ only in schedule (so every kind's factors agree across them), " in text
    assert "GEMMs' k − 1 is +0.40." in text
    assert "GEMMs' k − 1 +0.10 on the A100s (April 2024)." in text
    assert sum(line.startswith("| ") for line in lines) == 1 + 2 + 2 + 1 + 1
