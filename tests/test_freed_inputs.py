"""What a pipeline rank holds of a bf16 Llama's blocks (issue 31): the block inputs the plain
step frees (``memory.activations.freed_inputs``), what a waiting micro-batch keeps, and a
later stage's own blocks, on a tiny Llama probed on meta in bf16 (examples/llama70b.py's
code): hidden 64, sequence 32, so one hidden state is 32 × 64 × 2 = 4,096 B a sample."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memplan.memory.activations import freed_inputs
from memplan.memory.parallel import rank_profile
from memplan.parallel import Parallel

ROOT = Path(__file__).resolve().parent.parent
HIDDEN_STATE = 32 * 64 * 2
MODEL = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("llama70b_tiny", {path!r})
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)
import torch
S = base.Shape(layers=6, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, seq_len=32)
TP_PLAN = dict(base.TP_PLAN)
def build_model():
    return base.Llama(S)
def make_batch(b):
    t = torch.randint(0, S.vocab, (b, S.seq_len + 1))
    return t[:, :-1].clone(), t[:, 1:].clone()
"""


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    from memplan.probe.runner import probe_model

    model = tmp_path_factory.mktemp("llama") / "tiny_llama.py"
    model.write_text(MODEL.format(path=str(ROOT / "examples" / "llama70b.py")))
    profile = probe_model(str(model), device="meta", precision="bf16", mixed_precision="params")
    # memplan's runtime splits only Hugging Face decoders into stages; the memory model
    # takes any chain of blocks (as bench/published.py does for the same code)
    return dataclasses.replace(profile, pipeline_refused=None)


def _first_forward_slope(profile, parallel, stage, m, modes=None):
    rank = rank_profile(profile, parallel, stage, m, modes)
    segment = next(s for s in rank.timeline["no_grads"] if s.active == "fwd")
    return segment.points[0][1]


def test_a_bf16_llama_block_frees_its_input_after_its_forward(bf16_llama):
    # RMSNorm saves x.float(), an fp32 copy; the residual add saves nothing: the bf16 input
    # of every block dies once the loop moves on. One hidden state, per sample.
    freed = freed_inputs(bf16_llama)
    assert [round(f.slope) for f in freed] == [HIDDEN_STATE] * 6
    assert all(f.intercept == 0 for f in freed)


@pytest.mark.parametrize(
    ("parallel", "share"),
    [
        (Parallel(pp=2, schedule="gpipe"), 1.0),
        (Parallel(pp=2, tp=2, sequence_parallel=True, schedule="gpipe"), 0.5),
    ],
)
def test_a_waiting_micro_batch_of_checkpointed_blocks_keeps_one_hidden_state_each(
    bf16_llama, parallel, share
):
    # GPipe holds every micro-batch: one more (m 3 against m 2) adds what one waiting
    # micro-batch keeps plus stage 0's gradient receive buffer (one hidden state). Every
    # block fully checkpointed keeps its output only (torch.utils.checkpoint saves the
    # input, the previous block's output): 3 blocks × 4,096 B a sample, the sequence half
    # under SP over tp 2. Before: both hidden states of each block, and under SP the
    # block's factor f of them.
    names = bf16_llama.layer_names
    modes = {names[j]: "full" for j in range(3)}
    grown = _first_forward_slope(bf16_llama, parallel, 0, 3, modes) - _first_forward_slope(
        bf16_llama, parallel, 0, 2, modes
    )
    buffer = share * HIDDEN_STATE
    assert grown - buffer == pytest.approx(3 * share * HIDDEN_STATE, abs=1e-6)


def test_a_later_stage_holds_its_first_block_as_the_first_stage_does(bf16_llama):
    # GPipe, pp 2, 2 micro-batches: both stages hold 3 identical blocks and the same
    # buffers (stage 0 a gradient receive buffer per micro-batch, stage 1 a receive buffer);
    # stage 1's first input is that buffer, kept, where stage 0's block 0 frees its input:
    # at each stage's first block's forward stage 1 holds one hidden state a sample more,
    # in its one waiting micro-batch. Before: stage 1's block was charged less the three
    # hidden states stage 0's blocks had freed (-12,288 B a sample).
    parallel = Parallel(pp=2, schedule="gpipe")
    later = _first_forward_slope(bf16_llama, parallel, 1, 2)
    first = _first_forward_slope(bf16_llama, parallel, 0, 2)
    assert later - first == pytest.approx(HIDDEN_STATE, abs=1e-6)
