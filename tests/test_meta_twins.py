"""Keep issue 22 fixed: a meta probe's CPU twins (probe/shadow.py) cannot diverge from their
meta tensors, whatever the batch's layout, and a failure of memplan's own machinery while
the user's code runs is memplan's (exit 3 naming memplan's op), never the user's line."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from profile_bytes import assert_meta_equals_cpu, write_model
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InternalError, ModelFileError
from memplan.probe import shadow
from memplan.probe.runner import probe_model
from memplan.probe.tracker import LiveTracker

SLICED_LM = """
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, T = 64, 32, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    return LM()


def make_batch(batch_size):
    t = torch.randint(0, VOCAB, (batch_size, T + 1))
    return t[:, :-1], t[:, 1:]  # nanoGPT's idiom: two views of one tensor, no clone


def training_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
"""


def test_a_sliced_batch_lm_probes_on_meta_as_on_cpu(tmp_path: Path) -> None:
    # the twin of t[:, :-1] kept the slice's strides while its meta tensor was contiguous:
    # flatten(0, 1) was a view on meta and failed on the twin (exit 2 blaming the user)
    path = write_model(tmp_path, "sliced_lm.py", SLICED_LM)
    meta = probe_model(path, device="meta", micro_batches=(2, 4))
    cpu = probe_model(path, device="cpu", micro_batches=(2, 4), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)


def test_the_meta_batch_keeps_cpu_storages_and_layouts() -> None:
    t = torch.arange(2 * 5).view(2, 5)
    cl = torch.zeros(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    batch = {
        "pair": (t[:, :-1], t[:, 1:]),
        "tr": [t.t()],
        "ex": torch.ones(1, 4, dtype=torch.bool).expand(3, 4),
        "cl": cl,
    }
    meta = shadow.mirror_batch(batch)
    x, y = meta["pair"]
    assert x.untyped_storage().nbytes() == 2 * 5 * 8  # one storage of the whole tensor
    assert x.untyped_storage()._cdata == y.untyped_storage()._cdata
    assert meta["tr"][0].untyped_storage()._cdata == x.untyped_storage()._cdata
    for m, c in [(x, t[:, :-1]), (y, t[:, 1:]), (meta["tr"][0], t.t()), (meta["ex"], batch["ex"])]:
        assert (m.shape, m.stride(), m.storage_offset()) == (
            c.shape,
            c.stride(),
            c.storage_offset(),
        )
    assert meta["cl"].stride() == cl.stride() and meta["cl"].untyped_storage().nbytes() == 384
    with LiveTracker(meta=True):
        assert x.flatten(0, 1).shape == (8,)  # a copy on both: the slice is not a view-able
        assert int(y.sum().item()) == int(t[:, 1:].sum())  # the twin answers the value read


def test_a_twin_that_cannot_run_an_op_leaves_it_to_meta() -> None:
    # a diverged twin (contiguous meta, sliced twin) must not fail what meta runs
    cpu = torch.arange(12).view(3, 4)[:, :3]
    meta = torch.empty(3, 3, dtype=torch.int64, device="meta")
    shadow._shadows[meta] = cpu
    with LiveTracker(meta=True) as tracker:
        flat = meta.view(9)
    assert flat.shape == (9,) and flat not in shadow._shadows
    assert tracker.ops == ["view"]


def test_a_result_laid_out_otherwise_on_cpu_gets_a_twin_of_the_meta_layout() -> None:
    meta = torch.empty_strided((2, 3), (1, 2), dtype=torch.int64, device="meta")
    real = torch.arange(6).view(2, 3)
    twin = shadow._matching(meta, real, [])
    assert twin.stride() == (1, 2) and torch.equal(twin, real)


# ----------------------------------------------------------------------------- layouts

LAYOUT_MODEL = """
import torch
import torch.nn.functional as F
from torch import nn

SPEC = {spec!r}
CONTAINER = {container!r}
T, W = 6, 8
DTYPES = {{"int64": torch.int64, "int32": torch.int32, "bool": torch.bool, "float32": torch.float32}}


def values(shape, dtype, g):
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 9, shape, generator=g).to(dtype)


def leaves(kind, dtype, b, g):
    if kind == "contiguous":
        return [values((b, T), dtype, g)]
    if kind == "slices":
        t = values((b, T + 1), dtype, g)
        return [t[:, :-1], t[:, 1:]]
    if kind == "transpose":
        return [values((T, b), dtype, g).t()]
    if kind == "expand":
        return [values((1, T), dtype, g).expand(b, T)]
    if kind == "as_strided":
        return [values((b + T,), dtype, g).as_strided((b, T), (1, 1))]
    return [values((b, 2, 3, 3), dtype, g).contiguous(memory_format=torch.channels_last)]


def make_batch(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    flat = [t for kind, dtype, _ in SPEC for t in leaves(kind, DTYPES[dtype], batch_size, g)]
    if CONTAINER == "tuple":
        return tuple(flat)
    if CONTAINER == "list":
        return list(flat)
    if CONTAINER == "dict":
        return {{f"k{{i}}": t for i, t in enumerate(flat)}}
    return ({{"a": flat[:1], "b": {{"c": tuple(flat[1:])}}}}, ) if len(flat) > 1 else {{"a": [flat]}}


def flatten(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, dict) else batch
    return [t for item in items for t in flatten(item)]


def feature(leaf, op):
    b, d = leaf.shape[0], leaf.device
    flat = leaf.flatten(1)  # a view or a copy, as the layout allows
    h = flat.float().sum(1, keepdim=True)
    if op == "mask":
        m = leaf != 0
        if bool(m.all()):
            h = h + 1
        h = h + m.flatten(1).float().mean(1, keepdim=True)
    elif op == "item":
        n = int(leaf.float().abs().sum().item()) % 5 + 1
        h = h + torch.ones(n, 64, device=d).sum()
    elif op == "nonzero":
        nz = torch.nonzero(flat != 0)
        h = h + torch.ones(nz.shape[0] + 1, 16, device=d).sum()
    elif op == "tolist":  # reads storage without dispatching an op
        n = sum(v != 0 for v in flat[0].tolist()) + 1
        h = h + torch.ones(n, 8, device=d).sum()
    elif op == "arange":
        h = h + torch.arange(leaf.shape[-1], device=d).float().mean()
    elif op == "view":
        v = leaf.view(b, -1) if leaf.is_contiguous() else leaf.reshape(b, -1)
        h = h + v.float().mean(1, keepdim=True)
    return h


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


def build_model():
    return Net()


def training_loss(model, batch):
    leaves_ = flatten(batch)
    ops = [op for kind, _, op in SPEC for _ in range(2 if kind == "slices" else 1)]
    h = torch.cat([feature(t, op) for t, op in zip(leaves_, ops)], 1)
    return model(F.pad(h, (0, W - h.shape[1])))
"""

KINDS = ("contiguous", "slices", "transpose", "expand", "as_strided", "channels_last")
DTYPES = ("int64", "int32", "bool", "float32")
OPS = ("mask", "item", "nonzero", "arange", "view", "none", "tolist")
CONTAINERS = ("tuple", "list", "dict", "nested")


def _meta_equals_cpu(spec: list[tuple[str, str, str]], container: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        text = LAYOUT_MODEL.format(spec=spec, container=container)
        path = write_model(Path(tmp), "layouts.py", text)
        cpu = probe_model(path, device="cpu", micro_batches=(1, 2), timing_rounds=1)
        meta = probe_model(path, device="meta", micro_batches=(1, 2))
        assert_meta_equals_cpu(cpu, meta)


def test_every_layout_and_value_read_at_once_equals_cpu() -> None:
    spec = [(kind, DTYPES[i % 4], OPS[i % 6]) for i, kind in enumerate(KINDS)]
    spec += [("slices", "int64", "nonzero"), ("contiguous", "bool", "mask")]
    spec += [("transpose", "int32", "tolist"), ("expand", "float32", "tolist")]
    _meta_equals_cpu(spec, "nested")


@settings(max_examples=8, deadline=None)
@given(
    spec=st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from(DTYPES), st.sampled_from(OPS)),
        min_size=1,
        max_size=3,
    ),
    container=st.sampled_from(CONTAINERS),
)
def test_any_batch_layout_gives_the_cpu_profile_on_meta(spec, container) -> None:
    _meta_equals_cpu(spec, container)


# Values PyTorch makes from Python data below the dispatcher (no factory op to shadow):
# DeBERTa and BigBird in the hf_sweep ran transformers' padding check,
# ``pad_token_id in input_ids[:, [-1, 0]]``, and failed on meta with exit 3.
PYTHON_DATA = """
import torch
from torch import nn
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x, ids):
        scale = torch.tensor([float(i) for i in range(8)], device=x.device)
        width = torch.tensor(ids.shape[-1], dtype=torch.float, device=x.device)
        if 0 in ids[:, [-1, 0]]:  # a list index, then a value read
            scale = scale + 1
        kept = ids[:, [True] * 15 + [False]]  # a list of bools
        first = torch.as_tensor([3, 1], device=x.device)
        last = self.fc(x)[..., [-2]]  # Falcon's fused-QKV split: index saves its indices
        return self.fc(x) * scale * width.sqrt() + x + kept.sum() * 0 + first.max().item() + last
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x, ids)
        return x.pow(2).mean()
def build_model():
    return M()
def make_batch(n):
    return torch.randint(0, 50, (n, 16), generator=torch.Generator().manual_seed(n))
"""


def test_tensors_from_python_data_have_twins_and_equal_cpu(tmp_path: Path) -> None:
    path = write_model(tmp_path, "python_data.py", PYTHON_DATA)
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2), timing_rounds=1)
    meta = probe_model(path, device="meta", micro_batches=(1, 2))
    assert_meta_equals_cpu(cpu, meta)


def test_a_python_index_is_a_twinned_tensor() -> None:
    with shadow.PythonData():
        made = torch.tensor([[1, 2], [3, 4]], device="meta")
        index = shadow._twinned_indices((slice(None), [-1, 0]))[1]
    assert shadow._to_cpu(index).tolist() == [-1, 0]
    assert made.is_meta and shadow._to_cpu(made).tolist() == [[1, 2], [3, 4]]
    assert not shadow._python_index([1, slice(None)])  # a list with a slice: left alone


# A convolution fed a transposed view (SegFormer's and PVTv2's Mix-FFN: tokens back to an
# image with ``transpose(1, 2).view(...)``): the CPU kernel answers channels-last at some
# sizes, so what follows is a view; PyTorch's meta convolution answered contiguous, and
# the meta probe counted copies the CPU never makes.
CONV_OF_A_VIEW = """
import torch
from torch import nn
class MixFFN(nn.Module):
    def __init__(self, c=32, side=8):
        super().__init__()
        self.side = side
        self.up = nn.Linear(c, 4 * c)
        self.dw = nn.Conv2d(4 * c, 4 * c, 3, padding=1, groups=4 * c)
        self.down = nn.Linear(4 * c, c)
    def forward(self, x):
        b, n, _ = x.shape
        h = self.up(x).transpose(1, 2).view(b, -1, self.side, self.side)
        h = self.dw(h).flatten(2).transpose(1, 2)
        return x + self.down(torch.nn.functional.gelu(h))
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MixFFN() for _ in range(2))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()
def build_model():
    return M()
def make_batch(n):
    return torch.randn(n, 64, 32, generator=torch.Generator().manual_seed(n))
"""


# A layer norm of a permuted view (PVTv2 in the hf_sweep): the CPU and CUDA kernels give a
# contiguous input gradient, PyTorch's meta kernel the input's strides, and the meta probe
# then counted a copy the devices never make.
def test_layer_norm_backward_on_meta_lays_the_gradient_out_as_the_cpu_kernel() -> None:
    from memplan.probe.meta_kernels import META_KERNELS

    op = torch.ops.aten.native_layer_norm_backward.default
    x = torch.randn(2, 160, 4).transpose(1, 2)  # a permuted view
    weight, bias = torch.ones(160), torch.zeros(160)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [160], weight, bias, 1e-5)
    grad = torch.randn(2, 160, 4).transpose(1, 2)  # and a permuted gradient (PVTv2's)
    args = (grad, x, [160], mean, rstd, weight, bias, [True, True, True])
    on_cpu = op(*args)
    on_meta = META_KERNELS[op](*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert [t.stride() for t in on_meta] == [t.stride() for t in on_cpu]
    assert [t.shape for t in on_meta] == [t.shape for t in on_cpu]
    plain = op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert plain[0].stride() != on_cpu[0].stride()  # PyTorch's own meta kernel differs


def test_a_convolution_of_a_transposed_view_is_laid_out_as_on_cpu(tmp_path: Path) -> None:
    path = write_model(tmp_path, "mix_ffn.py", CONV_OF_A_VIEW)
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2, 4), timing_rounds=1)
    meta = probe_model(path, device="meta", micro_batches=(1, 2, 4))
    assert_meta_equals_cpu(cpu, meta)


# ------------------------------------------------------------------- own failures are own


def _broken(*_args, **_kwargs):
    raise ValueError("simulated bug")


@pytest.mark.parametrize(
    ("target", "attribute", "part"),
    [
        ("memplan.probe.shadow", "run", "CPU twins"),
        ("memplan.probe.shadow", "_from_data", "CPU twins"),
        ("memplan.probe.dedup.MetaOpCache", "key", "meta op cache"),
        ("memplan.probe.recorder", "storages_bytes", "layer recorder"),
    ],
)
def test_a_failure_inside_memplan_is_exit_3_naming_memplans_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, attribute: str, part: str
) -> None:
    import importlib

    module_name, _, cls = target.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), cls)
    except (ImportError, AttributeError):
        owner = importlib.import_module(target)
    monkeypatch.setattr(owner, attribute, _broken)
    text = PYTHON_DATA if attribute == "_from_data" else SLICED_LM
    path = write_model(tmp_path, "sliced_lm.py", text)
    with pytest.raises(InternalError) as raised:
        probe_model(path, device="meta", micro_batches=(1, 2))
    assert not isinstance(raised.value, ModelFileError)
    assert part in raised.value.message and "simulated bug" in raised.value.message
    assert "sliced_lm.py:" not in raised.value.message  # never the user's line
    result = CliRunner().invoke(
        app, ["probe", path, "--device", "meta", "-o", str(tmp_path / "p.yaml")]
    )
    assert result.exit_code == 3, result.output
    assert part in result.output


# ------------------------------------------------------- indexing by masks from the batch
MASKED = """\
import torch
import torch.nn.functional as F
from torch import nn

SPECIAL, PAD, VOCAB = 3, 0, 40


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.special = nn.Parameter(torch.randn(16))
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        h[ids == SPECIAL] = self.special  # T5Gemma2's end-of-image token, written in place
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def build_model():
    return LM()


def make_batch(b):
    ids = torch.randint(4, VOCAB, (b, 9), generator=torch.Generator().manual_seed(b))
    ids[:, 2] = SPECIAL
    ids[:, -(1 + b % 3):] = PAD  # a different number of padded tokens at each size
    return ids


def training_loss(model, ids):
    logits = model(ids[:, :-1])
    labels = ids[:, 1:]
    keep = labels != PAD
    return F.cross_entropy(logits[keep], labels[keep])  # only the tokens that are not padding
"""


def test_indexing_by_a_mask_of_the_batch_probes_on_meta_as_on_cpu(tmp_path: Path) -> None:
    """``logits[labels != PAD]`` and ``h[ids == SPECIAL] = ...``: the data has no twin
    (computed from weights; in the backward, a gradient), the mask has one (the batch), and
    the result's size is the mask's count. Meta's kernel asks ``nonzero`` of the mask,
    which meta cannot know: before, exit 3 naming ``aten.index.Tensor``. The twin knows
    the positions, so meta indexes by them, equal to the byte to cpu."""
    path = write_model(tmp_path, "masked.py", MASKED)
    meta = probe_model(path, device="meta", micro_batches=(1, 2, 4))
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2, 4), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)
    assert [layer.name for layer in meta.layers] == ["blocks.0", "blocks.1"]
    # a mask without a twin (computed from weights) is still refused, naming the op:
    # test_probe.test_meta_op_without_meta_kernel_is_cannot_measure


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    plan=st.lists(st.sampled_from(["mask", "none", "long"]), min_size=1, max_size=3),
    mask_dims=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_indexing_by_twinned_masks_has_cpus_shape_and_strides(
    shape: list[int], plan: list[str], mask_dims: int, seed: int
) -> None:
    """Any mix of boolean masks (with twins), None and long indices (with twins) over a
    tensor without a twin: meta's result has the CPU's size, dtype and layout."""
    g = torch.Generator().manual_seed(seed)
    cpu_indices: list[torch.Tensor | None] = []
    dim = 0
    for kind in plan:
        if dim >= len(shape):
            break
        if kind == "mask":
            dims = shape[dim : dim + mask_dims]
            cpu_indices.append(torch.randint(0, 2, dims, generator=g).bool())
            dim += len(dims)
        elif kind == "long":
            cpu_indices.append(torch.randint(0, shape[dim], (3,), generator=g))
            dim += 1
        else:
            cpu_indices.append(None)
            dim += 1
    assume(any(i is not None for i in cpu_indices))  # torch's own kernel needs one
    data = torch.randn(shape, generator=g)
    meta_indices = [None if i is None else shadow._to_meta(i) for i in cpu_indices]
    meta_data = torch.empty_strided(data.shape, data.stride(), device="meta")
    try:
        expected = torch.ops.aten.index.Tensor(data, cpu_indices)
    except (IndexError, RuntimeError):  # masks whose counts do not broadcast: meta refuses too
        with LiveTracker(meta=True), pytest.raises(Exception):  # noqa: B017
            torch.ops.aten.index.Tensor(meta_data, meta_indices)
        return
    with LiveTracker(meta=True):
        got = torch.ops.aten.index.Tensor(meta_data, meta_indices)
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype)
    if expected.numel():  # the layout, where it means anything (a size-1 dim has any stride)
        assert [st for n, st in zip(got.shape, got.stride(), strict=True) if n > 1] == [
            st for n, st in zip(expected.shape, expected.stride(), strict=True) if n > 1
        ]
