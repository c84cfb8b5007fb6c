"""examples/llama70b.py's torchtitan-ops Llama (``Llama(..., titan_ops=True)``, issue 31):
torchtitan 9dec370's rotary embeddings on complex pairs, its repeated key/value heads and its
RMSNorm compute the same function as the transformers-style blocks (``titan_ops=False``),
once the query and key projections' rows are ordered for pairwise rotation; and its probe on
meta (complex numbers, the repeated heads' copies) has the cpu probe's bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def _example():
    spec = importlib.util.spec_from_file_location(
        "llama70b_titan", ROOT / "examples" / "llama70b.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = _example()
TINY = EX.Shape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=50, seq_len=8)


def _pairwise_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A q/k projection's rows reordered from rotate_half's layout (pair ``(i, i + d/2)``)
    to adjacent pairs (``(2i, 2i + 1)``), head by head."""
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()
    heads = weight.shape[0] // head_dim
    order = torch.cat([h * head_dim + within for h in range(heads)])
    return weight[order]


def test_torchtitan_ops_compute_the_same_loss_as_the_transformers_ops():
    torch.manual_seed(0)
    hf = EX.Llama(TINY)
    titan = EX.Llama(TINY, titan_ops=True)
    state = hf.state_dict()
    for name in list(state):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = _pairwise_rows(state[name], TINY.head_dim)
    titan.load_state_dict(state)
    idx = torch.randint(0, TINY.vocab, (3, TINY.seq_len))
    targets = torch.randint(0, TINY.vocab, (3, TINY.seq_len))
    ours, theirs = hf(idx, targets), titan(idx, targets)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    # and the rows' order matters: unpermuted weights give another function
    titan.load_state_dict(hf.state_dict())
    assert abs(titan(idx, targets).item() - ours.item()) > 1e-4


def test_repeated_heads_equal_sdpa_sharing_them():
    torch.manual_seed(1)
    q = torch.randn(2, 6, 4, 8)  # (batch, seq, heads, head_dim)
    k, v = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    k4, v4 = EX.repeat_kv(k, 2), EX.repeat_kv(v, 2)
    assert k4.shape == (2, 6, 4, 8) and k4.is_contiguous()
    assert torch.equal(k4[:, :, 0], k[:, :, 0]) and torch.equal(k4[:, :, 1], k[:, :, 0])
    assert torch.equal(k4[:, :, 2], k[:, :, 1])
    full = F.scaled_dot_product_attention(
        q.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), is_causal=True
    )
    shared = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(full, shared)
    assert EX.repeat_kv(k, 1) is k


def test_rotation_by_pairs_keeps_each_pairs_length_and_turns_it_by_its_angle():
    table = EX.rotary_pairs_table(head_dim=4, seq=3)
    assert table.shape == (3, 2, 2) and table.dtype == torch.float32
    x = torch.tensor([[[[3.0, 4.0, 1.0, 0.0]]]]).expand(1, 3, 1, 4).contiguous()
    out = EX.rotate_pairs(x, table)
    # position 2, pair 0 turns by 2 rad (inv_freq 1), pair 1 by 2 / 100 rad (10000 ** -0.5)
    for pos, (a0, a1) in enumerate(((0.0, 0.0), (1.0, 0.01), (2.0, 0.02))):
        c0, s0 = torch.cos(torch.tensor(a0)), torch.sin(torch.tensor(a0))
        c1, s1 = torch.cos(torch.tensor(a1)), torch.sin(torch.tensor(a1))
        want = torch.stack((3 * c0 - 4 * s0, 3 * s0 + 4 * c0, c1, s1))
        torch.testing.assert_close(out[0, pos, 0], want)
    assert out.dtype == x.dtype


MODEL_FILE = """
import importlib.util, torch
spec = importlib.util.spec_from_file_location("llama70b_titan_file", {path!r})
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
SHAPE = ex.Shape(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=50, seq_len=8)

def build_model():
    return ex.Llama(SHAPE, titan_ops=True)

def make_batch(batch_size):
    tokens = torch.randint(0, 50, (batch_size, 9))
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()
"""


def test_torchtitan_ops_probe_on_meta_as_on_cpu(tmp_path):
    """The complex-pair rotary and the repeated heads on meta: every layer's bytes equal the
    cpu probe's, and the parameters are the hand count."""
    from memplan.probe.runner import probe_model

    model = tmp_path / "titan_tiny.py"
    model.write_text(MODEL_FILE.format(path=str(ROOT / "examples" / "llama70b.py")))
    meta = probe_model(str(model), device="meta", micro_batches=(1, 2))
    cpu = probe_model(str(model), device="cpu", micro_batches=(1, 2))
    block = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32
    params = 50 * 32 + 2 * block + 32 + 32 * 50
    assert meta.totals.params_trainable_bytes == cpu.totals.params_trainable_bytes == 4 * params
    assert [layer.name for layer in meta.layers] == ["layers.0", "layers.1"]
    for ours, theirs in zip(meta.layers, cpu.layers, strict=True):
        for field in ("saved_bytes", "output_bytes", "fwd_transient_bytes", "bwd_transient_bytes"):
            assert getattr(ours, field) == getattr(theirs, field), (ours.name, field)
    assert meta.optimizer_step_peak_bytes == cpu.optimizer_step_peak_bytes
