"""bench/fms_fsdp.py: fms-fsdp's published Llama 2 7B runs, a second engine beside the
torchtitan rows. The recipe and the published steps are checked against the source by
hand (README.md at 4ffb9bd and ed74fd5; fms_fsdp/utils/config_utils.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench import fms_fsdp
from bench.fms_fsdp import RUNS, Run, replica_all_reduce_seconds, spec_for


def test_the_runs_are_the_published_recipe_and_tokens_per_second():
    # 4ffb9bd (eager): 7b HSDP, no AC, batch 2: A100 3700, H100 7500 tokens/sec/GPU;
    # ed74fd5 (compile): 4550 and 9600; 128 A100s, 96 H100s
    published = {(r.device, r.compiled): (r.tps, r.gpus, r.commit) for r in RUNS}
    assert published == {
        ("a100-80gb", False): (3700, 128, "4ffb9bd"),
        ("h100-80gb", False): (7500, 96, "4ffb9bd"),
        ("a100-80gb", True): (4550, 128, "ed74fd5"),
        ("h100-80gb", True): (9600, 96, "ed74fd5"),
    }
    # the step: batch 2 × sequence 4096 tokens a GPU over its tokens per second
    steps = {(r.device, r.compiled): r.step_seconds for r in RUNS}
    assert steps[("a100-80gb", False)] == pytest.approx(8192 / 3700)  # 2.214 s
    assert steps[("h100-80gb", True)] == pytest.approx(0.853, abs=5e-4)


def test_the_model_is_fms_7b_shape():
    # fms's LLaMAConfig() defaults ("7b"): emb_dim 4096, 32 heads (kvheads 0: all), 32
    # layers, hidden_grow_factor 8/3 rounded to a multiple of 256: 11008; vocab 32000
    from examples.llama70b import LLAMA2_7B, SEQ_LEN

    assert fms_fsdp.FACTORY == "build_llama2_7b" and SEQ_LEN == fms_fsdp.SEQ == 4096
    assert (LLAMA2_7B.hidden, LLAMA2_7B.heads, LLAMA2_7B.kv_heads, LLAMA2_7B.layers) == (
        4096,
        32,
        32,
        32,
    )
    assert LLAMA2_7B.intermediate == 256 * -(-int(4096 * 8 / 3) // 256) == 11008
    assert LLAMA2_7B.vocab == 32000


def test_the_replicas_all_reduce_by_hand():
    # 16e9 B of gradients: a GPU's shard 2e9 B; 16 nodes of 8 on 400 Gb/s a node: 6.25e9 B/s
    # a GPU; a ring all-reduce moves 2 × 15/16 of the shard: 3.75e9 B, 0.6 s
    run = Run("a100-80gb", False, 3700, 128, 400, "4ffb9bd")
    assert replica_all_reduce_seconds(16e9, run) == pytest.approx(0.6)
    # twice the network, 12 nodes: 2 × 11/12 × 2e9 / 12.5e9
    h100 = Run("h100-80gb", False, 7500, 96, 800, "4ffb9bd")
    assert replica_all_reduce_seconds(16e9, h100) == pytest.approx(2 * 11 / 12 * 2e9 / 12.5e9)


def test_the_h100_runs_are_timed_at_flashattention_2s_rates():
    from bench.published import FA2_H100, FA2_H100_BACKWARD
    from memplan.devices import load_device

    h100 = spec_for("h100-80gb")
    assert h100.efficiency.attention == round(FA2_H100, 3) == 0.333
    assert h100.efficiency.backward_attention == round(FA2_H100_BACKWARD, 3)
    assert h100.efficiency.matmul == load_device("h100-80gb").efficiency.matmul == 0.803
    assert spec_for("a100-80gb") == load_device("a100-80gb")  # FlashAttention-2 already
