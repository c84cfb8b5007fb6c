"""A meta probe's clock (memplan.probe.roofline.Roofline): each op timed against the device
spec's peaks times the spec's efficiency for the op's kind, computed here by hand."""

import pytest
import torch

from memplan.probe.dedup import MetaOpCache
from memplan.probe.roofline import Roofline
from memplan.probe.tracker import LiveTracker

aten = torch.ops.aten
PEAK = 1e12  # bf16 FLOP/s
BANDWIDTH = 1e11  # bytes/s


def clock(**efficiency: float) -> Roofline:
    return Roofline(
        flops_by_dtype={torch.bfloat16: PEAK},
        default_flops=PEAK,
        memory_bandwidth=BANDWIDTH,
        **efficiency,
    )


def timed(run, roofline: Roofline, cache=None) -> float:
    with LiveTracker(record=False, roofline=roofline, meta=True, op_cache=cache) as tracker:
        run()
    return tracker.virtual_seconds


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


EFFICIENCY = {"matmul_efficiency": 0.5, "attention_efficiency": 0.25, "memory_efficiency": 0.8}


def test_a_matmul_at_the_matmul_efficiency():
    a, b = meta(256, 512), meta(512, 1024)
    # 2·m·k·n FLOPs = 268,435,456 at 0.5 × 1 TFLOP/s; its 1,835,008 bytes at 80 GB/s would
    # take 22.9 µs, less than the 536.9 µs of compute.
    assert timed(lambda: torch.mm(a, b), clock(**EFFICIENCY)) == pytest.approx(
        2 * 256 * 512 * 1024 / 5e11, rel=1e-12
    )
    assert timed(lambda: torch.mm(a, b), clock()) == pytest.approx(
        2 * 256 * 512 * 1024 / 1e12, rel=1e-12
    )


def flash(causal: bool):
    q, k, v = meta(1, 4, 2048, 64), meta(1, 4, 2048, 64), meta(1, 4, 2048, 64)
    return lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)


# torch's formula: QKᵀ and PV, 2 · (2·s·s·d) per head = 4·4·2048²·64 = 4,294,967,296 FLOPs.
ATTENTION_FLOPS = 4 * 4 * 2048 * 2048 * 64


def test_fused_attention_at_the_attention_efficiency_and_causal_at_half_the_flops():
    full = timed(flash(False), clock(**EFFICIENCY))
    assert full == pytest.approx(ATTENTION_FLOPS / 2.5e11, rel=1e-12)
    causal = timed(flash(True), clock(**EFFICIENCY))
    assert causal == pytest.approx(ATTENTION_FLOPS / 2 / 2.5e11, rel=1e-12)
    # Memory-efficient attention, causal, twice: the second call is the op cache's replay
    # (identical blocks), timed by the same kind and the same causal flag.
    q, k, v = meta(1, 4, 2048, 64), meta(1, 4, 2048, 64), meta(1, 4, 2048, 64)
    cache = MetaOpCache()

    def efficient():
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)

    twice = timed(lambda: (efficient(), efficient()), clock(**EFFICIENCY), cache)
    assert (cache.hits, cache.misses) == (1, 1)
    assert twice == pytest.approx(2 * causal, rel=1e-12)


def test_attention_backward_at_its_own_efficiency():
    # The flash kernel's backward: torch's formula counts 2.5 × the forward's FLOPs
    # (10,737,418,240), timed at attention_backward (0.2 × 1 TFLOP/s), causal at half;
    # without attention_backward at the forward's 0.25 (the clock before it was told apart).
    q, k, v = meta(1, 4, 2048, 64), meta(1, 4, 2048, 64), meta(1, 4, 2048, 64)
    out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False
    )

    def backward(causal: bool):
        grad = meta(1, 4, 2048, 64)
        return lambda: aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset
        )

    split = clock(**EFFICIENCY, attention_backward_efficiency=0.2)
    assert timed(backward(False), split) == pytest.approx(2.5 * ATTENTION_FLOPS / 2e11, rel=1e-12)
    assert timed(backward(True), split) == pytest.approx(
        2.5 * ATTENTION_FLOPS / 2 / 2e11, rel=1e-12
    )
    assert timed(backward(False), clock(**EFFICIENCY)) == pytest.approx(
        2.5 * ATTENTION_FLOPS / 2.5e11, rel=1e-12
    )
    # the forward stays at attention's 0.25
    assert timed(flash(False), split) == pytest.approx(ATTENTION_FLOPS / 2.5e11, rel=1e-12)


def test_a_memory_bound_op_at_the_memory_efficiency():
    x, y = meta(1024, 1024), meta(1024, 1024)
    # Two 2 MiB inputs and a 2 MiB output: 6,291,456 bytes at 0.8 × 100 GB/s; no FLOPs.
    assert timed(lambda: torch.add(x, y), clock(**EFFICIENCY)) == pytest.approx(
        3 * 1024 * 1024 * 2 / 8e10, rel=1e-12
    )


def test_a_float8_matmul_replayed_from_the_cache_keeps_the_float8_peak():
    """``torch._scaled_mm`` on plain float8 tensors, twice: the second call is the op cache's
    replay, and it too runs at the float8 peak and float8 efficiency (it was timed at its
    bf16 output's peak and the bf16 matmul efficiency: 0.270 ms where 0.196 ms is right)."""
    n = 4096
    roofline = Roofline(
        flops_by_dtype={torch.bfloat16: PEAK, torch.float8_e4m3fn: 2 * PEAK},
        default_flops=PEAK,
        memory_bandwidth=1e15,
        matmul_efficiency=0.8,
        float8_matmul_efficiency=0.7,
    )
    a = torch.empty(n, n, device="meta", dtype=torch.float8_e4m3fn)
    b = torch.empty(n, n, device="meta", dtype=torch.float8_e4m3fn).t()
    scale = torch.ones((), device="meta")

    def scaled_mm():
        return torch._scaled_mm(a, b, scale, scale, out_dtype=torch.bfloat16)

    cache = MetaOpCache()
    twice = timed(lambda: (scaled_mm(), scaled_mm()), roofline, cache)
    assert (cache.hits, cache.misses) == (1, 1)
    assert twice == pytest.approx(2 * (2 * n**3) / (2 * PEAK * 0.7), rel=1e-12)
