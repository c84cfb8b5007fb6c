"""A meta probe's CPU tensors: what a model moves to the host (``lengths.cpu()``, which
``pack_padded_sequence`` requires) is a CPU tensor with the batch's values, as on a device;
a CPU tensor counts as the planned device's memory on a CPU target only; a model with
recurrent layers probes on meta with a warning that their kernels' workspaces are not
measured there (memplan.probe.shadow, memplan.probe.meta_kernels.rnn_notes)."""

from __future__ import annotations

from pathlib import Path

from packed_lstm import packed_lstm
from profile_bytes import assert_meta_equals_cpu, probe_on_meta, write_model

from memplan.probe.runner import probe_model

HOST_LENGTHS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens, lengths):
        host = lengths.cpu()
        if host.device.type != "cpu":
            raise AssertionError(f"lengths.cpu() is on {host.device}")
        host.clamp_(max=11)  # on cpu, .cpu() is the batch's own tensor: this writes it
        longest = int(host.max())
        x = self.emb(tokens[:, :longest])
        steps = torch.arange(longest, device=x.device)
        keep = torch.stack([steps < n for n in host.tolist()])
        for block in self.blocks:
            x = x + torch.tanh(block(x)) * keep[..., None]
        return self.head(x), lengths.tolist()


def build_model():
    return Net()


def make_batch(b):
    tokens = torch.randint(0, 50, (b, 12), generator=torch.Generator().manual_seed(b))
    return tokens, torch.tensor([12 - (i % 4) for i in range(b)])


def training_loss(model, batch):
    logits, lengths = model(*batch)
    if max(lengths) != 11:  # the clamp above wrote the batch's lengths
        raise AssertionError(f"lengths {lengths}")
    return logits.logsumexp(-1).mean()
"""


HOST_SCRATCH = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        scratch = torch.ones(x.shape[0], 1024, device="cpu")  # 4 KiB a sample on the host
        return torch.tanh(self.fc(x)) * float(scratch.mean())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_model():
    return Net()


def make_batch(b):
    return torch.randn(b, 16, generator=torch.Generator().manual_seed(b))


def training_loss(model, x):
    return model(x).square().mean()
"""


def test_a_move_to_the_host_is_a_cpu_tensor_with_the_batchs_values(tmp_path: Path) -> None:
    """Before, ``lengths.cpu()`` on meta was another meta tensor: the model's own device
    check failed (exit 2). Now it is the twin, the batch's values on the CPU, written in
    place as cpu writes the batch's own tensor; it adds no bytes (on cpu it is the batch's
    tensor), so every byte field equals cpu's."""
    path = write_model(tmp_path, "host.py", HOST_LENGTHS)
    meta = probe_model(path, device="meta", micro_batches=(4, 8, 16))
    cpu = probe_model(path, device="cpu", micro_batches=(4, 8, 16), timing_rounds=1)
    assert_meta_equals_cpu(cpu, meta)


def test_a_packed_lstm_probes_on_meta_with_its_rnn_warning(tmp_path: Path) -> None:
    """``pack_padded_sequence(x, lengths.cpu(), ...)``: before, exit 3 naming
    ``aten._pack_padded_sequence`` ("'lengths' argument should be a 1D CPU int64 tensor,
    but got 1D meta Long tensor"). Now meta probes it: the lengths are on the CPU, the
    ``batch_sizes`` the packing makes there too, and the LSTM runs PyTorch's generic
    kernel on the packed data. What it keeps for the backward equals cpu's, in every
    layer and fixed part; the warning says the RNN kernels' workspaces are not measured."""
    path = write_model(tmp_path, "packed.py", packed_lstm(lengths_on_cpu=True))
    meta = probe_model(path, device="meta", micro_batches=(4, 8, 16))
    cpu = probe_model(path, device="cpu", micro_batches=(4, 8, 16), timing_rounds=1)
    assert [layer.name for layer in meta.layers] == ["rnns.0", "rnns.1"]
    for got, want in zip(meta.layers, cpu.layers, strict=True):
        assert (got.saved_bytes, got.savings_bytes, got.input_bytes) == (
            want.saved_bytes,
            want.savings_bytes,
            want.input_bytes,
        ), got.name
    assert [(p.name, p.saved_bytes) for p in meta.fixed] == [
        (p.name, p.saved_bytes) for p in cpu.fixed
    ]
    assert meta.totals == cpu.totals
    said = [w for w in meta.warnings if "recurrent layer" in w]
    assert len(said) == 1 and "(rnns.0, rnns.1)" in said[0] and "--device cpu or cuda" in said[0]
    assert not any("recurrent layer" in w for w in cpu.warnings)


def test_a_model_without_recurrent_layers_gets_no_rnn_warning(tmp_path: Path) -> None:
    path = write_model(tmp_path, "host.py", HOST_LENGTHS)
    meta = probe_model(path, device="meta", micro_batches=(1, 2))
    assert not any("recurrent layer" in w for w in meta.warnings)


def test_a_host_tensor_is_device_memory_on_a_cpu_target_only(tmp_path: Path) -> None:
    """A block that makes 4 KiB a sample on the CPU (``device="cpu"``): on a CPU target
    (meta without a GPU spec, as cpu counts it) that is the device's memory while the block
    runs; on an H100 target it is host memory, and the block's forward transient is
    exactly 4,096 B a sample smaller."""
    path = write_model(tmp_path, "scratch.py", HOST_SCRATCH)
    cpu = probe_model(path, device="cpu", micro_batches=(1, 2, 4), timing_rounds=1)
    on_cpu = probe_model(path, device="meta", micro_batches=(1, 2, 4))
    on_gpu = probe_model(path, device="meta", micro_batches=(1, 2, 4), device_profile="h100-80gb")
    assert_meta_equals_cpu(cpu, on_cpu)
    for host, device in zip(on_cpu.layers, on_gpu.layers, strict=True):
        assert host.fwd_transient_bytes.slope - device.fwd_transient_bytes.slope == 4096
        assert host.saved_bytes == device.saved_bytes


def test_a_move_to_the_host_of_an_activation_is_still_refused_naming_the_op(
    tmp_path: Path,
) -> None:
    """An activation has no values on meta: ``.cpu()`` of it stays exit 3, naming the op
    and where the model calls it, and --device cpu as the way out."""
    text = HOST_SCRATCH.replace(
        "return torch.tanh(self.fc(x)) * float(scratch.mean())",
        "return torch.tanh(self.fc(x)) * float(self.fc(x).cpu().mean())",
    )
    path = write_model(tmp_path, "activation.py", text)
    run = probe_on_meta(path, tmp_path)
    said = run.said
    assert run.exit_code == 3 and not run.wrote, run.output
    assert "aten._to_copy" in said and "activation.py" in said and "--device cpu" in said


def test_packing_lengths_left_on_meta_say_what_the_kernel_wants(tmp_path: Path) -> None:
    """Lengths passed as they come (on the device): torch refuses them on cuda as on meta
    ("should be a 1D CPU int64 tensor"), so meta's refusal quotes that, exit 3, and says
    to pass ``lengths.cpu()``, not to probe on another device."""
    path = write_model(tmp_path, "packed.py", packed_lstm())
    run = probe_on_meta(path, tmp_path)
    said = run.said
    assert run.exit_code == 3 and not run.wrote, run.output
    assert "aten._pack_padded_sequence" in said and "1D CPU int64 tensor" in said
    assert "pass lengths.cpu()" in said and "--device cpu" not in said
