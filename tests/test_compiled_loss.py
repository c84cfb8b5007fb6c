"""memplan.run.losses.compiled_cross_entropy: the loss and gradient of eager cross-entropy
over fp32 logits, with the bytes of its torch.compile'd form. Checked against torch's own
cross_entropy (values, hypothesis over shapes), against inductor itself on CPU (what the
compiled function saves for backward), op by op (no fp32 tensor of tokens × vocabulary,
where eager makes several), and through memplan's probe (the peak falls by the bytes
computed by hand)."""

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from memplan import memory
from memplan.probe.runner import probe_model
from memplan.run.losses import CHUNK_BYTES, chunk_rows, compiled_cross_entropy


def eager_loss(pred, labels, ignore_index=-100):
    """torchtitan's loss (torchtitan/components/loss.py ``cross_entropy_loss``)."""
    return F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=ignore_index
    )


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 40),
    vocab=st.integers(1, 300),
    ignored=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**16),
)
def test_loss_and_gradient_equal_torchs_cross_entropy(batch, seq, vocab, ignored, seed):
    g = torch.Generator().manual_seed(seed)
    pred = (torch.randn(batch, seq, vocab, generator=g) * 4).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignored] = -100
    labels.view(-1)[0] = 0  # at least one target counts
    expected = eager_loss(pred, labels)
    (want,) = torch.autograd.grad(expected, pred)
    got = compiled_cross_entropy(pred, labels)
    (grad,) = torch.autograd.grad(got, pred)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)


def test_bf16_logits_give_a_bf16_gradient_close_to_eager():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 50, 1000, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (2, 50), generator=g)
    expected = eager_loss(pred, labels)
    (want,) = torch.autograd.grad(expected, pred)
    got = compiled_cross_entropy(pred, labels)
    (grad,) = torch.autograd.grad(got, pred)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), want.float(), rtol=1e-2, atol=1e-6)


def test_nan_logits_give_nan_as_eager_does_and_a_target_past_the_vocabulary_raises():
    pred = torch.full((1, 4, 5), float("nan"), requires_grad=True)
    labels = torch.tensor([[0, 1, 2, 3]])
    assert torch.isnan(compiled_cross_entropy(pred, labels))
    assert torch.isnan(eager_loss(pred, labels))
    with pytest.raises(RuntimeError, match="out of bounds"):
        compiled_cross_entropy(torch.zeros(1, 4, 5), torch.tensor([[0, 1, 2, 7]]))


def test_bad_shapes_are_refused_with_both_shapes_named():
    with pytest.raises(ValueError, match=r"\(4, 5\) and \(3,\)"):
        compiled_cross_entropy(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))


def saved_by(fn, pred, labels) -> Counter:
    """(elements, dtype) of every tensor with elements that ``fn`` saves for backward."""
    saved: Counter = Counter()

    def pack(t):
        if t.dim():
            saved[(t.numel(), t.dtype)] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(pred, labels).backward()
    return saved


_INDUCTOR = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_compiled_loss import eager_loss, saved_by
pred = torch.randn(2, 64, 1024).bfloat16().requires_grad_()
labels = torch.randint(0, 1024, (2, 64))
saved = saved_by(torch.compile(eager_loss), pred, labels)
print(json.dumps([[n, str(dtype), count] for (n, dtype), count in saved.items()]))
"""


def test_it_saves_what_inductor_saves_for_the_compiled_loss():
    """torch.compile (inductor, CPU) of torchtitan's loss saves the bf16 logits, the targets
    and two fp32 values per row; so does compiled_cross_entropy, where eager saves an fp32
    log-softmax of every logit. Inductor runs in a fresh process: its compile workers and
    threads left in pytest's process broke the gloo ranks later tests fork (SIGABRT at a
    rank's exit), and its environment doubled a probe subprocess's memory."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", _INDUCTOR, str(Path(__file__).parent)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    inductor = Counter(
        {(n, getattr(torch, dtype.removeprefix("torch."))): count
         for n, dtype, count in json.loads(run.stdout.strip().splitlines()[-1])}
    )  # fmt: skip
    pred = torch.randn(2, 64, 1024).bfloat16().requires_grad_()
    labels = torch.randint(0, 1024, (2, 64))
    rows = 2 * 64
    expected = Counter(
        {(rows * 1024, torch.bfloat16): 1, (rows, torch.int64): 1, (rows, torch.float32): 2}
    )
    assert inductor == expected
    assert saved_by(compiled_cross_entropy, pred, labels) == expected
    # eager: the fp32 log-softmax of every logit (saved by log_softmax and by nll_loss)
    assert saved_by(eager_loss, pred, labels)[(rows * 1024, torch.float32)] == 2


class Allocations(TorchDispatchMode):
    """The bytes of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t._base is None and func._schema.is_mutable is False:
                self.made.append((t.numel() * t.element_size(), t.dtype))
        return out


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_no_fp32_tensor_of_every_logit_is_made_where_eager_makes_them(device):
    rows, vocab = 1024, 8192  # small: pytest's own RSS is what later subprocesses inherit
    pred = torch.zeros(1, rows, vocab, dtype=torch.bfloat16, device=device, requires_grad=True)
    labels = torch.zeros(1, rows, dtype=torch.long, device=device)
    whole = rows * vocab * 4  # one fp32 copy of the logits: 32 MiB, over the 16 MiB chunk
    for fn, biggest_fp32 in ((compiled_cross_entropy, None), (eager_loss, whole)):
        with Allocations() as seen:
            fn(pred, labels).backward()
        fp32 = max(b for b, d in seen.made if d == torch.float32)
        if biggest_fp32 is None:  # the chunk's scratch: chunk_rows of the vocabulary
            assert fp32 == chunk_rows(rows, vocab) * vocab * 4 <= CHUNK_BYTES
        else:
            assert fp32 == biggest_fp32
        pred.grad = None


MODEL = """
import torch
from torch import nn
import torch.nn.functional as F
from memplan.run.losses import compiled_cross_entropy

VOCAB, SEQ, COMPILED = 32768, 1024, {compiled}


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        if COMPILED:
            return compiled_cross_entropy(logits, targets)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def build_model():
    return Head()


def make_batch(batch_size):
    t = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return t[:, :-1].clone(), t[:, 1:].clone()
"""


def test_the_probed_peak_falls_by_the_fp32_copies_eager_holds(tmp_path: Path):
    """At the loss's backward, eager holds three fp32 tensors of every logit (the saved
    log-softmax, the gradient it receives and the one it makes: 12 B each) where the
    compiled form holds the bf16 logits it saved and the bf16 gradient (4 B each), one
    chunk's fp32 scratch and its two fp32 values a row: the probe's peaks differ by exactly
    that, on meta."""
    peaks = {}
    for compiled in (False, True):
        path = tmp_path / f"head_{compiled}.py"
        path.write_text(MODEL.format(compiled=compiled))
        profile = probe_model(
            str(path), device="meta", precision="bf16", micro_batches=(1, 2), layers="layers.*"
        )
        peaks[compiled] = memory.step_peak(profile, 2, (), 1).peak_bytes
    tokens, vocab = 2 * 1024, 32768
    scratch = chunk_rows(tokens, vocab) * vocab * 4
    expected = 8 * tokens * vocab - scratch - 2 * 4 * tokens
    assert abs((peaks[False] - peaks[True]) - expected) <= 4096, (peaks, expected)
