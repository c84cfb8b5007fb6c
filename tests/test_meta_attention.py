"""A meta probe runs the attention kernel the target device would pick
(memplan.probe.meta_attention): for a cpu target, the bytes of every op of an SDPA forward
and backward equal the CPU's, fused kernel or math fallback alike; for a CUDA target, the
kernel follows PyTorch's CUDA selection rules as far as the device spec decides them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from profile_bytes import assert_meta_equals_cpu
from torch.nn.attention import SDPBackend, sdpa_kernel

from memplan.devices import load_device
from memplan.probe import probe_model
from memplan.probe.backends import make_backend
from memplan.probe.meta_attention import (
    CPU,
    CUDA,
    EFFICIENT,
    FLASH,
    MATH,
    MetaAttention,
    SdpaCall,
    cuda_kernel,
)
from memplan.probe.tracker import LiveTracker

MODELS = Path(__file__).parent / "models"
B, H, S, D = 2, 4, 8, 16
FP32 = 4

Inputs = tuple[list[torch.Tensor], tuple[Any, ...], dict[str, Any]]


def _leaf(shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype).requires_grad_(True)


def _qkv(device: str, *, heads_kv: int = H, head_v: int = D, dtype=torch.float32) -> Inputs:
    q = _leaf((B, H, S, D), device, dtype)
    k = _leaf((B, heads_kv, S, D), device, dtype)
    v = _leaf((B, heads_kv, S, head_v), device, dtype)
    return [q, k, v], (q, k, v), {}


def _with(extra: dict[str, Any], make: Callable[[str], Inputs] = _qkv) -> Callable[[str], Inputs]:
    def build(device: str) -> Inputs:
        leaves, args, kwargs = make(device)
        added = {k: v(device) if callable(v) else v for k, v in extra.items()}
        leaves += [t for t in added.values() if isinstance(t, torch.Tensor)]
        return leaves, args, {**kwargs, **added}

    return build


def _bool_mask(device: str) -> torch.Tensor:
    return torch.ones(B, 1, S, S, dtype=torch.bool, device=device).tril()


def _transposed(device: str) -> Inputs:
    """q, k, v whose last dimension is not contiguous (stride S)."""
    bases = [_leaf((B, H, D, S), device) for _ in range(3)]
    return bases, tuple(t.transpose(-1, -2) for t in bases), {}


def _three_d(device: str) -> Inputs:
    leaves = [_leaf((B * H, S, D), device) for _ in range(3)]
    return leaves, tuple(leaves), {}


# name, inputs, kernel the CPU runs
CASES = [
    ("plain", _qkv, FLASH),
    ("causal", _with({"is_causal": True}), FLASH),
    ("bool mask", _with({"attn_mask": _bool_mask}), FLASH),
    ("float 2-D mask", _with({"attn_mask": lambda d: torch.zeros(S, S, device=d)}), FLASH),
    ("scale", _with({"scale": 0.5}), FLASH),
    ("grouped heads", _with({"enable_gqa": True}, lambda d: _qkv(d, heads_kv=2)), FLASH),
    ("bf16", lambda d: _qkv(d, dtype=torch.bfloat16), FLASH),
    # what the CPU's fused kernel refuses (sdp_utils_cpp): the math path on both sides
    ("dropout", _with({"dropout_p": 0.25}), MATH),
    ("mask that requires grad", _with({"attn_mask": lambda d: _leaf((S, S), d)}), MATH),
    ("3-D mask", _with({"attn_mask": lambda d: torch.zeros(1, S, S, device=d)}), MATH),
    ("value head dim differs", lambda d: _qkv(d, head_v=8), MATH),
    ("last dim not contiguous", _transposed, MATH),
    ("3-D inputs", _three_d, MATH),
]


def _tracked(device: str, build: Callable[[str], Inputs]) -> tuple[list[str], list[int], int]:
    """Ops and live bytes after each op of one SDPA forward and backward on ``device`` (on
    meta, under the cpu-target attention mode)."""
    torch.manual_seed(0)
    leaves, args, kwargs = build(device)
    tracker = LiveTracker(meta=device == "meta")
    tracker.track(leaves)
    mode = MetaAttention(CPU, None, []) if device == "meta" else None
    with tracker:
        if mode is None:
            out = F.scaled_dot_product_attention(*args, **kwargs)
        else:
            with mode:
                out = F.scaled_dot_product_attention(*args, **kwargs)
        out.float().sum().backward()
        del out
    return tracker.ops, tracker.values, tracker.peak_bytes


@pytest.mark.parametrize(("name", "build", "kernel"), CASES, ids=[c[0] for c in CASES])
def test_meta_sdpa_has_the_cpus_bytes_op_by_op(name: str, build: Any, kernel: str) -> None:
    cpu_ops, cpu_values, cpu_peak = _tracked("cpu", build)
    meta_ops, meta_values, meta_peak = _tracked("meta", build)
    fused = "_scaled_dot_product_flash_attention_for_cpu"
    assert (fused in cpu_ops) == (kernel == FLASH), cpu_ops
    assert meta_ops == cpu_ops
    assert meta_values == cpu_values
    assert meta_peak == cpu_peak


def test_the_fused_kernel_saves_output_and_logsumexp_where_math_saves_probabilities() -> None:
    """By hand, for plain attention (B, H, S, D) = (2, 4, 8, 16) in fp32: besides the three
    inputs, flash keeps its output and a log-sum-exp per query row alive for backward; the
    math path keeps S × S probabilities per head as well."""
    saved: dict[str, int] = {}
    for label, mode in (("flash", MetaAttention(CPU, None, [])), ("math", None)):
        q, k, v = (_leaf((B, H, S, D), "meta") for _ in range(3))
        tracker = LiveTracker(meta=True)
        tracker.track([q, k, v])
        with tracker:
            if mode is None:
                out = F.scaled_dot_product_attention(q, k, v)
            else:
                with mode:
                    out = F.scaled_dot_product_attention(q, k, v)
            saved[label] = tracker.live_bytes - 3 * B * H * S * D * FP32
            del out
    output, logsumexp, probs = B * H * S * D * FP32, B * H * S * FP32, B * H * S * S * FP32
    assert saved["flash"] == output + logsumexp
    assert saved["math"] > output + probs  # the scaled inputs and scores come with it


def test_kernels_disabled_by_the_user_are_honoured_as_on_cpu() -> None:
    with sdpa_kernel(SDPBackend.MATH):
        cpu_ops, cpu_values, _ = _tracked("cpu", _qkv)
        meta_ops, meta_values, _ = _tracked("meta", _qkv)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in cpu_ops
    assert (meta_ops, meta_values) == (cpu_ops, cpu_values)


def test_only_meta_calls_are_rerouted() -> None:
    q = torch.randn(B, H, S, D)
    with MetaAttention(CPU, None, []):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_bad_calls_fail_as_pytorch_says() -> None:
    q = torch.empty(B, H, S, D, device="meta")
    half_mask = torch.zeros(S, S, device="meta", dtype=torch.float16)
    with MetaAttention(CPU, None, []), pytest.raises(RuntimeError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=half_mask)
    with MetaAttention(CPU, None, []), pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)  # scale is keyword-only
    k = torch.empty(B, H, S, D, device="meta", dtype=torch.bfloat16)
    with MetaAttention(CPU, None, []), pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k, q)
    assert SdpaCall.bind((q, q, q), {"query": q}) is None


# ------------------------------------------------------------------------- CUDA targets
def _meta_call(dtype=torch.bfloat16, head: int = 64, grad: bool = False, **kwargs: Any) -> SdpaCall:
    q, k, v = (
        torch.empty(B, H, 128, head, device="meta", dtype=dtype, requires_grad=grad)
        for _ in range(3)
    )
    return SdpaCall(
        query=q,
        key=k,
        value=v,
        attn_mask=kwargs.get("attn_mask"),
        dropout_p=kwargs.get("dropout_p", 0.0),
        is_causal=kwargs.get("is_causal", False),
        scale=None,
        enable_gqa=False,
    )


@pytest.mark.parametrize(
    ("capability", "call", "kernel"),
    [
        (9.0, _meta_call(), FLASH),
        (8.0, _meta_call(dropout_p=0.1, is_causal=True), FLASH),  # flash does dropout itself
        (8.0, _meta_call(torch.float32), EFFICIENT),  # flash needs fp16/bf16
        (7.5, _meta_call(torch.float16), EFFICIENT),  # T4: flash needs sm80
        (7.5, _meta_call(torch.bfloat16), MATH),  # no bf16 kernel before sm80
        (8.0, _meta_call(head=512), EFFICIENT),  # flash: head dim <= 256
        (8.0, _meta_call(head=60), FLASH),  # padded to 64 by the composite
        (8.0, _meta_call(head=60, attn_mask=torch.zeros(128, 128, device="meta")), MATH),
        (8.0, _meta_call(attn_mask=torch.zeros(128, 128, device="meta")), EFFICIENT),
        (8.6, _meta_call(head=200, grad=True), EFFICIENT),  # sm86 flash bwd: 192 < d <= 224
        (8.6, _meta_call(head=200), FLASH),  # ...but inference is fine
        (8.0, _meta_call(torch.float32, head=6), MATH),  # efficient: fp32 head dims align to 4
    ],
)
def test_cuda_kernel_follows_the_cuda_rules(capability: float, call: SdpaCall, kernel: str) -> None:
    assert cuda_kernel(call, capability).kernel == kernel


def test_what_the_spec_cannot_decide_keeps_the_math_path_and_says_so() -> None:
    assert cuda_kernel(_meta_call(), None).kernel == MATH
    assert "compute_capability" in (cuda_kernel(_meta_call(), None).note or "")
    assert "cuDNN" in (cuda_kernel(_meta_call(), 9.0).note or "")
    assert cuda_kernel(_meta_call(), 8.0).note is None


def test_cuda_flash_on_meta_saves_output_and_logsumexp_and_pads_odd_head_dims() -> None:
    """Flash on an H100 in bf16: output (2 B) and a float32 log-sum-exp per row, plus the
    kernel's RNG state (16 + 8 B); a head dim of 12 is padded to 16 first (three copies)."""
    for head, padded in ((16, 16), (12, 16)):
        q, k, v = (_leaf((B, H, S, head), "meta", torch.bfloat16) for _ in range(3))
        tracker = LiveTracker(meta=True)
        tracker.track([q, k, v])
        with tracker:
            with MetaAttention(CUDA, 9.0, []):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert out.shape == (B, H, S, head)
            held = tracker.live_bytes - 3 * B * H * S * head * 2
            copies = 0 if head == padded else 3 * B * H * S * padded * 2
            assert held == copies + B * H * S * padded * 2 + B * H * S * FP32 + 16 + 8
            out.float().sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape


def test_a_gpu_spec_targets_cuda_and_the_cpu_spec_or_none_targets_cpu() -> None:
    assert make_backend("meta", "fp32", None).attention_target == CPU
    assert make_backend("meta", "fp32", "cpu").attention_target == CPU
    backend = make_backend("meta", "bf16", "h100")
    assert backend.attention_target == CUDA
    assert load_device("h100").compute_capability == 9.0
    assert load_device("t4").compute_capability == 7.5


# ----------------------------------------------------------------- whole probes, in bytes
def test_a_gpt_with_sdpa_probes_the_same_on_meta_as_on_cpu() -> None:
    path = f"{MODELS / 'seq_gpt.py'}:build_sdpa"
    # not micro-batch 1: there make_batch's two slices of one tensor are contiguous and
    # share its storage on the host, while moved to meta they are two storages
    cpu = probe_model(path, device="cpu", micro_batches=(2, 4), timing_rounds=1)
    meta = probe_model(path, device="meta", micro_batches=(2, 4))
    assert_meta_equals_cpu(cpu, meta)
    # By hand: per sample and block, the fused kernel keeps a log-sum-exp per head and token
    # (2 × 64 × 4 B) where the math path, which meta ran before, keeps the 64 × 64
    # probabilities per head (2 × 64 × 64 × 4 B); the rest of the block is the same.
    with sdpa_kernel(SDPBackend.MATH):
        math_path = probe_model(path, device="meta", micro_batches=(2, 4))
    heads, seq = 2, 64
    for fused, unfused in zip(meta.layers, math_path.layers, strict=True):
        gap = unfused.saved_bytes.slope - fused.saved_bytes.slope
        assert gap == heads * seq * seq * FP32 - heads * seq * FP32
