"""A TP rank's GEMMs at their own shapes (memplan.solver.tp_gemms): a split linear's GEMMs
take 1/t of the FLOPs but still move the operand TP leaves whole, so a narrow projection
turns memory-bound on a rank. Figures by hand on the h100-80gb spec (989 TFLOP/s bf16 at
0.803, 3.35 TB/s at 0.84)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from profiles_factory import uniform_chain, with_tp_measurement

from memplan.devices import load_device
from memplan.parallel import Parallel
from memplan.profile import Affine, TpGemm
from memplan.solver import SolveRequest
from memplan.solver.parallel import LayoutRequest, solve_layout
from memplan.solver.tp_gemms import added_seconds, gemm_spec, with_rank_gemms

H100 = load_device("h100-80gb")
R = 989e12 * 0.803  # bf16 GEMMs, FLOP/s
B = 3.35e12 * 0.84  # memory, B/s
TOKENS, HIDDEN, KV = 8192, 4096, 1024  # Llama 3.1 8B: one sample, 8 key/value heads × 128


def _gemm(n: int, k: int, style: str = "colwise", **kwargs) -> TpGemm:
    whole, split = (TOKENS * k, TOKENS * n) if style == "colwise" else (TOKENS * n, TOKENS * k)
    return TpGemm(style=style, flops=2.0 * TOKENS * n * k, whole=whole, split=split, **kwargs)


def test_a_key_projection_at_tp_8_is_memory_bound_on_a_rank():
    # Whole: 68.7 GFLOP (86.5 µs) against 83.9 MB (29.8 µs): compute-bound, 1/8 of it 10.8 µs.
    # On a rank: 10.8 µs of FLOPs against the whole 4,096-wide input and 1/8 of the 1,024-wide
    # output, (33.55 M + 1.05 M) × 2 B = 69.2 MB: 24.6 µs. Each of the three GEMMs: +13.8 µs.
    compute = 2.0 * TOKENS * KV * HIDDEN / R
    rank = (TOKENS * HIDDEN + TOKENS * KV / 8) * 2 / B
    want = rank - compute / 8
    assert want == pytest.approx(13.77e-6, rel=1e-3)
    got = added_seconds(_gemm(KV, HIDDEN), 8, H100, "bf16")
    assert got == pytest.approx((want, want, want), rel=1e-12)


def test_a_wide_projection_stays_compute_bound_and_adds_nothing():
    # q at TP 8: 34.6 µs of FLOPs a rank against (33.55 M + 4.19 M) × 2 B = 26.8 µs of bytes.
    assert added_seconds(_gemm(HIDDEN, HIDDEN), 8, H100, "bf16") == (0.0, 0.0, 0.0)
    assert added_seconds(_gemm(KV, HIDDEN), 1, H100, "bf16") == (0.0, 0.0, 0.0)


def test_a_float8_gemm_reads_float8_and_writes_bf16_at_the_float8_rate():
    # Rowwise (the attention output, k = 4096 / 8 = 512 on a rank, n = 4096): forward reads
    # the split input in float8 and writes the whole output in bf16; the input gradient
    # reads the whole output's gradient in float8 and writes the split input's in bf16; the
    # weight gradient reads both in float8.
    gemm = _gemm(HIDDEN, HIDDEN, "rowwise", input_size=1, output_size=2, float8=True)
    rate = 1979e12 * 0.709
    compute = gemm.flops / rate
    whole, split = TOKENS * HIDDEN, TOKENS * HIDDEN / 8
    ranks = (split * 1 + whole * 2, whole * 1 + split * 2, (whole + split) * 1)
    wholes = (whole * 3, whole * 3, whole * 2)
    want = tuple(
        max(max(compute / 8, r / B) - max(compute, w / B) / 8, 0.0)
        for r, w in zip(ranks, wholes, strict=True)
    )
    assert want[0] > 0 and want[2] == 0.0  # the forward memory-bound, the weight's not
    assert added_seconds(gemm, 8, H100, "bf16") == pytest.approx(want, rel=1e-12)


@given(
    n=st.integers(1, 1 << 16),
    k=st.integers(1, 1 << 16),
    t=st.integers(1, 64),
    style=st.sampled_from(["colwise", "rowwise"]),
    size=st.sampled_from([1, 2]),
)
def test_a_rank_never_gains_time_and_never_loses_its_whole_gemm_share(n, k, t, style, size):
    gemm = _gemm(n, k, style, input_size=size, output_size=2, float8=size == 1)
    added = added_seconds(gemm, t, H100, "bf16")
    assert all(a >= 0.0 for a in added)
    # never more than the rank's bytes at the memory rate: the most a GEMM can take
    whole, split = gemm.whole, gemm.split / t
    assert all(a <= 2 * (whole + split) / B * (1 + 1e-9) for a in added)


def test_a_rank_layer_gains_its_forward_backward_and_recomputes():
    layer = uniform_chain(1).profile().layers[0]
    k_proj = _gemm(KV, HIDDEN, recomputed=True)
    q_proj = _gemm(HIDDEN, HIDDEN)
    layer = dataclasses.replace(
        layer,
        tp_gemms=(q_proj, k_proj),
        recompute_seconds=Affine(intercept=1.0, slope=2.0),
        selective_recompute_seconds=Affine(intercept=0.5, slope=1.0),
    )
    fwd, dx, dw = added_seconds(k_proj, 8, H100, "bf16")
    rank = with_rank_gemms(layer, Parallel(tp=8, cp=2), H100, "bf16")
    assert rank.fwd_seconds.slope == pytest.approx(layer.fwd_seconds.slope + fwd / 2)
    assert rank.bwd_seconds.slope == pytest.approx(layer.bwd_seconds.slope + (dx + dw) / 2)
    assert rank.recompute_seconds == Affine(intercept=1.0, slope=2.0 + fwd / 2)
    assert rank.selective_recompute_seconds == Affine(intercept=0.5, slope=1.0 + fwd / 2)
    assert rank.fwd_seconds.intercept == layer.fwd_seconds.intercept
    # no TP, no spec or no measured GEMMs: unchanged
    assert with_rank_gemms(layer, Parallel(tp=1, dp_shard=8), H100, "bf16") is layer
    assert with_rank_gemms(layer, Parallel(tp=8), None, "bf16") is layer


def test_the_layout_search_charges_a_rank_its_gemms():
    # 4 blocks, each with one key projection; tp 8 on 8 ranks, 4 micro-batches of 1 sample
    # (the factory's per-sample fits): every micro-batch's 4 blocks add forward + input and
    # weight gradients, 3 × 13.8 µs each, to the step (no checkpointing, no pipeline).
    profile = with_tp_measurement(uniform_chain(4).profile(), 0.5)
    bf16 = dataclasses.replace(profile.environment, precision="bf16")
    profile = dataclasses.replace(profile, environment=bf16)
    request = SolveRequest(
        target_batch=4, budget_bytes=1 << 40, world_size=8, modes=("keep",), device_spec=H100,
        min_micro=1, max_micro=1,
    )  # fmt: skip
    gemms = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(x, tp_gemms=(_gemm(KV, HIDDEN),)) for x in profile.layers)
    )  # fmt: skip
    ask = LayoutRequest(tp=8)
    before = solve_layout(profile, request, ask).plan.predicted.step_seconds
    after = solve_layout(gemms, request, ask).plan.predicted.step_seconds
    assert after - before == pytest.approx(
        4 * 4 * sum(added_seconds(_gemm(KV, HIDDEN), 8, H100, "bf16")), rel=1e-6
    )


def test_a_meta_profile_without_a_spec_is_re_timed_on_its_clock():
    profile = uniform_chain(1).profile()
    meta = dataclasses.replace(
        profile,
        environment=dataclasses.replace(
            profile.environment, device="meta", device_name="meta (timed as a100-80gb)"
        ),
    )
    assert gemm_spec(meta, None).name == "a100-80gb"
    assert gemm_spec(meta, H100) is H100
    assert gemm_spec(profile, None) is None  # measured: charged 1/t


def test_a_profile_keeps_its_gemms_through_yaml_and_refuses_a_negative_one():
    import yaml

    from memplan.errors import ProfileError
    from memplan.profile import profile_from_data, profile_to_yaml

    profile = uniform_chain(2).profile()
    gemms = (_gemm(KV, HIDDEN, recomputed=True), _gemm(HIDDEN, HIDDEN, "rowwise", input_size=1))
    layers = tuple(dataclasses.replace(x, tp_gemms=gemms) for x in profile.layers)
    profile = dataclasses.replace(profile, layers=layers)
    data = yaml.safe_load(profile_to_yaml(profile))
    assert profile_from_data(data).layers[1].tp_gemms == gemms
    del data["layers"][0]["tp_gemms"]  # a profile written before: none measured
    assert profile_from_data(data).layers[0].tp_gemms == ()
    data["layers"][1]["tp_gemms"][1]["whole"] = -1.0
    with pytest.raises(ProfileError, match=r"layers\[1\]\.tp_gemms\[1\]\.whole"):
        profile_from_data(data, source="p.yaml")


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("flops", float("nan"), "not a finite number"),
        ("whole", float("inf"), "not a finite number"),
        ("style", "diagonal", "expected one of 'colwise', 'rowwise'"),
        ("split", 1e300, "absurdly large"),
        ("input_size", 1.5, "must be an integer"),
        ("recomputed", "yes", "must be true or false"),
    ],
)
def test_an_edited_gemm_is_refused_naming_its_field(field, value, says):
    import yaml

    from memplan.errors import ProfileError
    from memplan.profile import profile_from_data, profile_to_yaml

    profile = uniform_chain(1).profile()
    layers = tuple(dataclasses.replace(x, tp_gemms=(_gemm(KV, HIDDEN),)) for x in profile.layers)
    data = yaml.safe_load(profile_to_yaml(dataclasses.replace(profile, layers=layers)))
    data["layers"][0]["tp_gemms"][0][field] = value
    with pytest.raises(ProfileError, match=rf"layers\[0\]\.tp_gemms\[0\]\.{field}'.*{says}"):
        profile_from_data(data, source="p.yaml")
