"""``nn.MultiheadAttention`` on meta (memplan.probe.meta_nested): ``F.multi_head_attention_
forward`` makes its linear and SDPA calls from its own body, where the meta function modes
are off, so before this the meta probe ran the math path for every
``nn.TransformerEncoderLayer`` (and torchvision's ViT), saving the attention probabilities,
O(seq²) a head, where the CPU and the GPU run a fused kernel that saves the output and a
log-sum-exp; and under bf16 its linears ran in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
from profile_bytes import _bytes_fields, assert_meta_equals_cpu

from memplan.files.schema import to_data
from memplan.probe.runner import probe_model

ENCODER = """
import torch
from torch import nn

SEQ = {seq}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 64, dropout={dropout}, batch_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Net()


def make_batch(b):
    return torch.randint(0, 64, (b, SEQ), generator=torch.Generator().manual_seed(b))


def training_loss(model, ids):
    return model(ids).logsumexp(-1).mean()
"""


def _write(tmp: Path, seq: int, dropout: float = 0.0) -> str:
    path = tmp / f"encoder_{seq}_{dropout}.py"
    path.write_text(ENCODER.format(seq=seq, dropout=dropout))
    return str(path)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_transformer_encoder_probes_on_meta_as_on_cpu(tmp_path: Path, dropout: float) -> None:
    """Without dropout the CPU runs its flash kernel inside ``nn.MultiheadAttention``; with
    attention dropout it refuses it and runs the math path. Meta follows both, to the byte.
    Before: 4 heads × 16 × 16 probabilities saved on meta in each layer that cpu's flash
    kernel does not save."""
    path = _write(tmp_path, 16, dropout)
    meta = probe_model(path, device="meta", micro_batches=(2, 4, 8))
    cpu = probe_model(path, device="cpu", micro_batches=(2, 4, 8), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)


def test_on_a_gpu_target_the_saved_bytes_grow_with_the_sequence_not_its_square(
    tmp_path: Path,
) -> None:
    """On an H100 target in bf16 the layer runs a fused kernel there too: twice the tokens
    keep exactly twice the bytes. The math path, which meta ran before, keeps the
    probabilities too, 4 × s² a sample: at micro-batches 1 and 2 it kept 168,960 → 468,992 B
    a sample (×2.78)."""
    slopes = []
    for seq in (64, 128):
        profile = probe_model(
            _write(tmp_path, seq),
            device="meta",
            micro_batches=(2, 4),
            device_profile="h100-80gb",
            precision="bf16",
        )
        slopes.append([layer.saved_bytes.slope for layer in profile.layers])
    assert slopes[0][0] > 0
    assert slopes[1] == [2 * s for s in slopes[0]]


def test_under_bf16_its_linears_are_cast_as_autocast_casts_them(tmp_path: Path) -> None:
    """bf16 autocast: CUDA's (meta's emulation) and the CPU's cast the same calls here, so
    every byte field of the layers is cpu's. Before: the linears in the body ran in float32
    on meta, 19,968 B a sample kept in each layer where cpu keeps 14,848."""
    path = _write(tmp_path, 16)
    meta = probe_model(path, device="meta", micro_batches=(2, 4, 8), precision="bf16")
    cpu = probe_model(
        path, device="cpu", micro_batches=(2, 4, 8), precision="bf16", timing_rounds=1
    )
    assert [layer.name for layer in meta.layers] == ["layers.0", "layers.1"]
    assert _bytes_fields(to_data(meta.layers)) == _bytes_fields(to_data(cpu.layers))
    assert [layer.saved_bytes.slope for layer in meta.layers] == [14_848.0, 14_848.0]


def test_asking_for_the_weights_casts_each_call_of_the_body_as_cuda_autocast() -> None:
    """``need_weights=True`` takes the body's other path: ``bmm`` (``baddbmm`` with a mask),
    ``softmax`` and ``bmm`` again, each cast as CUDA's autocast casts it, to bf16, float32
    (its list) and bf16 (the CPU's keeps softmax in bf16, so cpu is no reference here);
    the body's replacements are gone after the call."""
    import torch

    from memplan.probe.meta_autocast import MetaAutocast
    from memplan.probe.tracker import LiveTracker

    attn = torch.nn.MultiheadAttention(32, 4, batch_first=True, device="meta")
    x = torch.empty(2, 16, 32, device="meta", requires_grad=True)
    seen: dict[str, torch.dtype] = {}

    class Dtypes(LiveTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func._overloadpacket.__name__ in ("baddbmm", "_softmax", "bmm", "addmm", "mm"):
                seen.setdefault(func._overloadpacket.__name__, out.dtype)
            return out

    before = (torch.bmm, torch.nn.functional.linear, torch.nn.functional.softmax)
    with MetaAutocast(torch.bfloat16), Dtypes(meta=True):
        out, weights = attn(x, x, x, need_weights=True)
    assert seen == {
        "addmm": torch.bfloat16,  # the projections (mm: the packed in-projection's)
        "mm": torch.bfloat16,
        "_softmax": torch.float32,
        "bmm": torch.bfloat16,  # both: the float32 probabilities are cast back for the second
    }, seen
    assert out.dtype == torch.bfloat16 and weights.dtype == torch.float32
    assert (torch.bmm, torch.nn.functional.linear, torch.nn.functional.softmax) == before


def test_a_fault_in_the_body_leaves_torch_as_it_was() -> None:
    """A call the body refuses (key and query widths that do not match) raises the user's
    error, and the replaced globals are back."""
    import torch

    from memplan.probe.meta_autocast import MetaAutocast

    attn = torch.nn.MultiheadAttention(32, 4, batch_first=True, device="meta")
    before = (torch.bmm, torch.baddbmm, torch.nn.functional.linear)
    x = torch.empty(2, 16, 32, device="meta")
    with pytest.raises(AssertionError), MetaAutocast(torch.bfloat16):
        attn(x, torch.empty(2, 16, 8, device="meta"), x)
    assert (torch.bmm, torch.baddbmm, torch.nn.functional.linear) == before
