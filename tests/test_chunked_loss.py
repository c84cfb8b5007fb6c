"""memplan.run.losses.chunked_cross_entropy: torchtitan 0.3's chunked head and loss
(``ChunkedLossWrapper``). Checked against torch's own cross-entropy (values and every
gradient, hypothesis over shapes and chunk counts), against torchtitan's wrapper itself
(the same peak and final bytes in the forward, the same peak in the backward, the decoder
handed the saved gradient itself, on CPU), against the bytes by hand (the largest tensor
is one chunk's fp32 logits), and through memplan's probe and verify (the planned peak is
the measured one)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.probe.tracker import LiveTracker
from memplan.run.losses import chunked_cross_entropy

ROOT = Path(__file__).resolve().parent.parent


def _memplan(*args: str) -> subprocess.CompletedProcess:
    """``memplan`` run as a user runs it, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "memplan.cli", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip


def _inputs(batch, seq, width, vocab, ignored, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(width, vocab, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, width, generator=g))
    x = torch.randn(batch, seq, width, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < ignored] = -100
    labels.view(-1)[0] = 0  # at least one target counts
    return head, x, labels


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 3),
    per_chunk=st.integers(1, 6),
    chunks=st.integers(1, 8),
    width=st.integers(1, 12),
    vocab=st.integers(1, 60),
    ignored=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**16),
)
def test_loss_and_every_gradient_equal_torchs_cross_entropy(
    batch, per_chunk, chunks, width, vocab, ignored, seed
):
    head, x, labels = _inputs(batch, per_chunk * chunks, width, vocab, ignored, seed)
    hidden = x * 1.5  # a decoder in front: the loss's gradient reaches it through autograd
    expected = F.cross_entropy(head(hidden).flatten(0, 1).float(), labels.flatten(0, 1))
    want_x, want_w = torch.autograd.grad(expected, (x, head.weight))
    got = chunked_cross_entropy(x * 1.5, head, labels, chunks=chunks)
    assert got.dtype == torch.float32
    # the head's gradient is made inside the call (torchtitan's order); the decoder's after
    got_w = head.weight.grad.clone()
    (got_x,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_without_grad_it_returns_the_loss_and_makes_no_gradient():
    head, x, labels = _inputs(2, 16, 8, 30, 0.2, 1)
    with torch.no_grad():
        got = chunked_cross_entropy(x, head, labels, chunks=4)
        want = F.cross_entropy(head(x).flatten(0, 1), labels.flatten(0, 1))
    torch.testing.assert_close(got, want)
    assert head.weight.grad is None and x.grad is None


def test_nan_hidden_states_give_nan_and_every_target_ignored_gives_nan_as_eager_does():
    head, x, labels = _inputs(1, 8, 4, 9, 0.0, 2)
    with torch.no_grad():
        poisoned = x.clone()
        poisoned[0, 5, 1] = float("nan")
    got = chunked_cross_entropy(poisoned, head, labels, chunks=4)
    want = F.cross_entropy(head(poisoned).flatten(0, 1), labels.flatten(0, 1))
    assert torch.isnan(got) and torch.isnan(want)
    ignored = torch.full_like(labels, -100)
    got = chunked_cross_entropy(x.detach(), head, ignored, chunks=2)
    want = F.cross_entropy(head(x.detach()).flatten(0, 1), ignored.flatten(0, 1))
    assert torch.isnan(got) and torch.isnan(want)


@pytest.mark.parametrize(
    ("shape", "labels", "chunks", "needle"),
    [
        ((2, 16), (2, 16), 4, "(batch, sequence, width)"),
        ((2, 16, 8), (2, 15), 4, "(2, 15)"),
        ((2, 18, 8), (2, 18), 4, "sequence (18) must be a multiple of chunks (4)"),
        ((2, 16, 8), (2, 16), 0, "chunks must be a whole number >= 1, got 0"),
        ((2, 16, 8), (2, 16), True, "got True"),
        ((2, 16, 8), (2, 16), 2.0, "got 2.0"),
    ],
)
def test_bad_input_is_refused_naming_what_is_wrong(shape, labels, chunks, needle):
    head = torch.nn.Linear(shape[-1], 10, bias=False)
    with pytest.raises(ValueError) as err:
        chunked_cross_entropy(
            torch.randn(shape), head, torch.zeros(labels, dtype=torch.long), chunks
        )
    assert needle in str(err.value)


def _titan_step(head, hidden, labels, chunks):
    """torchtitan 0.3.0's own ``ChunkedLossWrapper`` on ``hidden``, the head set as its
    Trainer sets it: the loss, whose backward runs the decoder's."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    wrapper = ChunkedLossWrapper.Config(
        num_chunks=chunks, loss_fn=CrossEntropyLoss.Config()
    ).build()
    wrapper.set_lm_head(head)
    valid = (labels != -100).sum()
    loss, _ = wrapper(hidden, labels, valid)
    del valid  # the count this function makes for itself is gone by its backward, too
    return loss


def _memplan_step(head, hidden, labels, chunks):
    return chunked_cross_entropy(hidden, head, labels, chunks=chunks)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(("width", "vocab"), [(16, 500), (256, 50)])
def test_peak_and_final_bytes_are_torchtitans_own(batch, width, vocab):
    """memplan's tracker over torchtitan's wrapper and over this function, the same inputs:
    the same loss and gradients, and the same peak and bytes at the end (for one sample
    the chunks are views, for two they are copies), with the logits the larger part and
    with the hidden states the larger (the decoder's gradient at the backward's start)."""
    pytest.importorskip("torchtitan.components.loss")
    runs = {}
    for name, step in (("torchtitan", _titan_step), ("memplan", _memplan_step)):
        head, x, labels = _inputs(batch, 64, width, vocab, 0.1, 7)
        forward, backward = LiveTracker(record=False), LiveTracker(record=False)
        with forward:
            hidden = torch.nn.functional.gelu(x * 2.0)  # saves its input for the backward
            loss = step(head, hidden, labels, 8)
        with backward:  # counts what the backward makes beyond what the forward left
            loss.backward()
        bytes_ = (forward.peak_bytes, forward.live_bytes, backward.peak_bytes)
        runs[name] = (bytes_, loss, x.grad, head.weight.grad)
    titan, ours = runs["torchtitan"], runs["memplan"]
    assert ours[0] == titan[0], (ours[0], titan[0])
    for a, b in zip(ours[1:], titan[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("step", [_titan_step, _memplan_step])
def test_the_decoder_is_handed_the_saved_gradient_itself(step):
    """The backward's first gradient is the buffer the loss saved, no copy of it (the
    upstream 1 multiplies it in place), as torchtitan's Function returns it."""
    pytest.importorskip("torchtitan.components.loss")
    head, x, labels = _inputs(2, 64, 32, 50, 0.1, 5)
    hidden = torch.nn.functional.gelu(x * 2.0)
    seen = []
    hidden.register_hook(lambda g: seen.append(g.data_ptr()))
    loss = step(head, hidden, labels, 8)
    (saved,) = loss.grad_fn.saved_tensors
    loss.backward()
    assert seen == [saved.data_ptr()]


def test_the_largest_tensor_is_one_chunks_fp32_logits():
    """By hand: 2 samples × 64 tokens × 500 words; in 8 chunks no tensor exceeds one
    chunk's logits in fp32 (2 × 8 × 500 × 4 = 32,000 B) where the whole loss makes
    2 × 64 × 500 × 4 = 256,000 B ones."""
    sizes = {}
    for chunks in (1, 8):
        head, x, labels = _inputs(2, 64, 16, 500, 0.0, 3)
        largest = 0

        class Largest(LiveTracker):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                nonlocal largest
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                        largest = max(largest, t.untyped_storage().nbytes())
                return out

        with Largest(record=False):
            _memplan_step(head, x * 1.0, labels, chunks).backward()
        sizes[chunks] = largest
    assert sizes[8] == 2 * 8 * 500 * 4 and sizes[1] == 2 * 64 * 500 * 4, sizes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "world"),
    [("bench/engines_llama_chunked.py", 1), ("tests/models/chunked_lm.py", 2)],
)
def test_verify_measures_the_planned_peak_of_a_chunked_loss(tmp_path: Path, model: str, world):
    """Probed, solved and verified on CPU: torchtitan 0.3.0's own Llama with its loss in 8
    chunks (bench/engines_llama_chunked.py, vocabulary 32768) in one process, and a small LM
    with a chunked loss on 2 gloo ranks under memplan's FSDP2 runtime (the head's backward
    runs inside the loss there too): the measured peak is the planned one within 2%, and
    verify's checks pass (the gradients against one process's, on 2 ranks)."""
    pytest.importorskip("torchtitan.models.llama3")
    path = ROOT / model
    layout = ["--world-size", "2", "--strategy", "fsdp"] if world == 2 else []
    ranks = ["--world-size", "2"] if world == 2 else []
    runs = (
        ("probe", str(path), "--device", "cpu", "--layers", "layers.*",
         "--micro-batches", "1,2", "--timing-rounds", "1", "-o", str(tmp_path / "p.yaml")),
        ("solve", str(tmp_path / "p.yaml"), "--target-batch", str(2 * world),
         "--min-micro", "2", "--max-micro", "2", "--budget", "1GiB", *layout,
         "--model", str(path), "-o", str(tmp_path / "plan.yaml")),
        ("verify", str(path), str(tmp_path / "plan.yaml"), *ranks, "--steps", "1", "--json"),
    )  # fmt: skip
    for args in runs:
        out = _memplan(*args)
        assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    predicted, measured = result["predicted_peak_bytes"], result["measured_peak_bytes"]
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)
    assert result["passed"] is True and not result["failures"], result


def _solve(profile: Path, *args: str) -> subprocess.CompletedProcess:
    return _memplan("solve", str(profile), "--target-batch", "4", "--budget", "1GiB", *args)


def test_the_probe_records_that_ddp_cannot_train_it_and_solve_plans_fsdp(tmp_path: Path):
    """A loss that makes the head's gradient in the forward: the probe names the parameter
    (``ddp_refused``), a plain model gets none, solve refuses DDP (its default) and ZeRO-1
    on 2 ranks with exit 2 naming it and writes nothing (one rank has no DDP: planned as
    before), and ``--strategy auto`` plans FSDP."""
    from memplan.probe.runner import probe_model

    profile = probe_model(str(ROOT / "tests/models/chunked_lm.py"), device="cpu",
                          layers="layers.*", micro_batches=(1, 2), timing_rounds=1)  # fmt: skip
    assert profile.ddp_refused is not None and "lm_head.weight" in profile.ddp_refused
    assert "embed.weight" not in profile.ddp_refused  # made by the outer backward
    plain = probe_model(str(ROOT / "tests/models/linear_chain.py"), device="cpu",
                        micro_batches=(1, 2), timing_rounds=1)  # fmt: skip
    assert plain.ddp_refused is None
    from memplan.profile import profile_to_yaml

    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(profile), encoding="utf-8")
    for strategy in ("ddp", "zero1", None):  # None: solve's default, ddp
        chosen = ["--strategy", strategy] if strategy else []
        run = _solve(path, "--world-size", "2", *chosen, "-o",
                     str(tmp_path / f"{strategy}.yaml"))  # fmt: skip
        assert run.returncode == 2, run.stderr
        said = " ".join(run.stderr.split())
        assert "lm_head.weight" in said and "--strategy fsdp" in said, said
        assert not (tmp_path / f"{strategy}.yaml").exists()
    one = _solve(path, "--strategy", "ddp", "-o", str(tmp_path / "one.yaml"))
    assert one.returncode == 0, one.stderr
    auto = _solve(
        path, "--world-size", "2", "--strategy", "auto", "-o", str(tmp_path / "auto.yaml")
    )
    assert auto.returncode == 0, auto.stderr
    assert "strategy: fsdp" in (tmp_path / "auto.yaml").read_text()


@pytest.mark.slow
def test_ddp_itself_refuses_the_chunked_loss_as_the_profile_says(tmp_path: Path):
    """What ``ddp_refused`` stands for, run: the same profile with the refusal lifted, a DDP
    plan on 2 gloo ranks, and memplan verify fails with DDP's own error, blamed on the
    model file's loss."""
    import dataclasses

    from memplan.probe.runner import probe_model
    from memplan.profile import profile_to_yaml

    model = ROOT / "tests/models/chunked_lm.py"
    profile = probe_model(
        str(model), device="cpu", layers="layers.*", micro_batches=(1, 2), timing_rounds=1
    )
    lifted = dataclasses.replace(profile, ddp_refused=None)
    (tmp_path / "p.yaml").write_text(profile_to_yaml(lifted), encoding="utf-8")
    plan = tmp_path / "plan.yaml"
    run = _solve(tmp_path / "p.yaml", "--world-size", "2", "--strategy", "ddp", "-o", str(plan))
    assert run.returncode == 0, run.stderr
    out = _memplan("verify", str(model), str(plan), "--world-size", "2")
    said = " ".join(out.stderr.split())
    assert out.returncode != 0 and "mark a variable ready only once" in said, said
    assert "training_loss()" in said
