"""Building the model on meta (memplan.probe.backends.build_on_meta): a builder that reads
values of tensors it makes (torchvision's RegNet computes its block widths with
``torch.arange`` and ``.tolist()``) is built again with CPU twins behind its small tensors,
as a meta step has; before, it was exit 2 blaming the model file for meta's limit."""

from __future__ import annotations

from pathlib import Path

from profile_bytes import assert_meta_equals_cpu, probe_on_meta, write_model

from memplan.probe import shadow
from memplan.probe.runner import probe_model

WIDTHS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        widths = (torch.arange(3) * 8 + 16).tolist()  # [16, 24, 32], read from a tensor
        depth = int(torch.tensor([1.6]).round())  # 2, from Python data
        self.stem = nn.Linear(8, widths[0])
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])
        )
        self.head = nn.Linear(widths[-1] * depth, 4)
        self.depth = depth

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.cat([x] * self.depth, dim=-1))


def build_model():
    return Net()


def make_batch(b):
    return torch.randn(b, 8, generator=torch.Generator().manual_seed(b))


def training_loss(model, x):
    return model(x).square().mean()
"""

REGNET = """
import sys, types
sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("_meta_registrations"))
import torch
import torch.nn.functional as F
from torchvision.models import regnet_x_400mf


def build_model():
    torch.manual_seed(0)
    return regnet_x_400mf(num_classes=10)


def make_batch(b):
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 64, 64, generator=g), torch.randint(0, 10, (b,), generator=g)


def training_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
"""


def test_a_builder_that_reads_its_own_tensors_builds_on_meta(tmp_path: Path) -> None:
    path = write_model(tmp_path, "widths.py", WIDTHS)
    meta = probe_model(path, device="meta", micro_batches=(1, 2, 4))
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2, 4), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)
    assert [layer.name for layer in meta.layers] == ["blocks.0", "blocks.1"]
    # 8·16 + 16 + 16·24 + 24 + 24·32 + 32 + 64·4 + 4 parameters, fp32
    assert meta.totals.params_trainable_bytes == 4 * 1612


def test_no_weight_or_buffer_keeps_a_twin_after_the_build(tmp_path: Path) -> None:
    """The twins serve the build only: the probe then runs as a plain meta build's, with no
    real copy of a weight or a buffer (a BatchNorm's running statistics) kept."""
    from memplan.model.loader import load_model_file
    from memplan.probe.backends import build_on_meta

    text = WIDTHS.replace("nn.ReLU()", "nn.BatchNorm1d(b)")
    model = build_on_meta(load_model_file(write_model(tmp_path, "bn.py", text)))
    tensors = (*model.parameters(), *model.buffers())
    assert len(tensors) == 18 and all(t.is_meta for t in tensors)
    assert not any(t in shadow._shadows for t in tensors)


def test_torchvision_regnet_probes_on_meta_as_on_cpu(tmp_path: Path) -> None:
    """torchvision's RegNet (``BlockParams.from_init_params``: ``torch.arange(depth) * w_a
    + w_0`` … ``.int().tolist()``). Before: exit 2, "build_model() raised
    NotImplementedError: Cannot copy out of meta tensor; no data! Fix build_model()"."""
    path = write_model(tmp_path, "regnet.py", REGNET)
    meta = probe_model(path, device="meta", micro_batches=(2, 4))
    cpu = probe_model(path, device="cpu", micro_batches=(2, 4), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)
    assert meta.totals.params_trainable_bytes == 4 * 5_098_986  # regnet_x_400mf, 10 classes


def test_a_value_read_from_a_weight_too_large_to_twin_is_exit_3(tmp_path: Path) -> None:
    """A builder that reads a value computed from a weight of more than
    shadow.MAX_SHADOW_ELEMENTS elements: no twin holds it, so it is meta's limit, exit 3
    naming the read and where the builder made it, and --device cpu as the way out."""
    text = WIDTHS.replace(
        "        self.depth = depth\n",
        "        self.depth = depth\n"
        "        big = nn.Linear(4100, 1024)  # 4,198,400 elements: no twin\n"
        "        self.scale = float(big.weight.abs().mean())\n",
    )
    path = write_model(tmp_path, "reads.py", text)
    run = probe_on_meta(path, tmp_path)
    said = run.said
    assert run.exit_code == 3 and not run.wrote, run.output
    assert "reads.py:" in said and "--device cpu" in said and "Fix build_model()" not in said


def test_a_builders_own_fault_on_meta_is_exit_2_and_built_once(tmp_path: Path) -> None:
    """A fault that is not a meta value read is the model file's (exit 2): no second build
    with twins (the counter file gets one line)."""
    calls = tmp_path / "calls.txt"
    text = WIDTHS.replace(
        "def build_model():\n    return Net()",
        f"def build_model():\n    open({str(calls)!r}, 'a').write('x\\n')\n"
        "    raise ValueError('no config for this size')",
    )
    path = write_model(tmp_path, "broken.py", text)
    run = probe_on_meta(path, tmp_path)
    said = run.said
    assert run.exit_code == 2 and "no config for this size" in said, run.output
    assert calls.read_text() == "x\n"


def test_a_builder_that_takes_nonzero_of_its_own_mask_builds_on_meta(tmp_path: Path) -> None:
    """``nonzero()`` of a tensor the builder made (peft's SHiRA picks its sparse pattern so:
    a random mask, then its positions): meta has no size for it ("a correct
    data-independent implementation does not exist"). Before: exit 2, "build_model() raised
    NotImplementedError … Fix build_model()"; now built again with twins, as a value read."""
    text = WIDTHS.replace(
        "        super().__init__()\n",
        "        super().__init__()\n"
        "        mask = (torch.arange(12) % 4) == 1  # 3 of 12, before any other read\n"
        "        self.register_buffer('picked', mask.nonzero().flatten())\n",
    ).replace("x = self.stem(x)", "x = self.stem(x) + x[:, :1] * self.picked.sum()")
    path = write_model(tmp_path, "picks.py", text)
    meta = probe_model(path, device="meta", micro_batches=(1, 2, 4))
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2, 4), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)
    assert meta.totals.buffer_bytes == 3 * 8  # the 3 positions, int64


SPARSE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.values = nn.Parameter(torch.ones(4))
        self.register_buffer("where", torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]))

    def forward(self, x):
        delta = torch.sparse_coo_tensor(self.where, self.values, (8, 8))
        return self.base(x) + x @ delta.to_dense()


"""
SPARSE += WIDTHS[WIDTHS.index("def build_model():") :]


def test_a_sparse_tensor_on_meta_is_meta_s_limit_naming_the_op(tmp_path: Path) -> None:
    """A sparse COO tensor made in the forward (peft's SHiRA adds one to its weight). Meta
    has no kernel for some sparse ops: exit 3 naming the op and --device cpu. Before, the
    meta op cache asked the sparse result for its storage and memplan blamed itself ("the
    live tracker failed … This is memplan's failure")."""
    path = write_model(tmp_path, "sparse.py", SPARSE)
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2), timing_rounds=1)
    assert cpu.totals.params_trainable_bytes == 4 * (8 * 8 + 8 + 4)  # the cpu probe runs it
    run = probe_on_meta(path, tmp_path)
    said = run.said
    assert run.exit_code == 3 and not run.wrote, run.output
    assert "memplan's failure" not in said and "--device cpu" in said, said
    assert "sparse" in said, said


def test_nonzero_of_a_tensor_too_large_to_twin_is_exit_3(tmp_path: Path) -> None:
    """The nonzero() retry holds only for tensors small enough to twin: over 5,000,000
    elements (shadow.MAX_SHADOW_ELEMENTS is 4,194,304) the second build reaches the op on
    meta too, and that is exit 3 naming ``aten.nonzero`` and the builder's line, not exit 2
    blaming the model file, and no profile is written."""
    text = WIDTHS.replace(
        "        super().__init__()\n",
        "        super().__init__()\n"
        "        n = int((torch.arange(5_000_000) % 7 == 0).nonzero().shape[0])\n",
    )
    path = write_model(tmp_path, "bignz.py", text)
    run = probe_on_meta(path, tmp_path)
    said = run.said
    assert run.exit_code == 3 and not run.wrote, run.output
    assert "aten.nonzero" in said and "bignz.py:" in said and "Fix build_model()" not in said
