"""A sample of bench/hf_sweep.py (meta equals cpu across transformers' families): a few
families of each kind, built tiny from their config classes, probed on cpu and meta at
micro-batches 1 and 2, equal in every byte field. The whole sweep is
``python -m bench.run --device cpu --only hf_sweep``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import hf_families, hf_sweep

SAMPLE = [
    ("causal-lm", "llama"),
    ("causal-lm", "gpt2"),
    ("causal-lm", "qwen2_moe"),
    ("causal-lm", "deepseek_v3"),  # latent attention: K and V expanded from a low rank
    ("encoder", "bert"),
    ("encoder", "deberta"),  # transformers' padding check reads a list index (PythonData)
    ("encoder", "xlm"),  # its forward fills a key/value cache: attentions not checkpointable
    ("encoder-decoder", "t5"),  # its labels shifted right from decoder_start_token_id
    ("encoder-decoder", "t5gemma2"),  # embeds[ids == eoi] = ...: a batch mask indexes
]


@pytest.mark.parametrize(("kind", "family"), SAMPLE)
def test_meta_equals_cpu_for_a_sample_of_families(tmp_path: Path, kind: str, family: str) -> None:
    row = hf_sweep.probe_family(kind, family, str(tmp_path))
    assert row["status"] == "equal", row
    assert 0 < row["params"] < hf_families.MAX_PARAMS
    # the sweep's bytes-only shortcuts are undone: later probes in this process time and
    # run selective as usual
    from memplan.probe import runner, sizes

    assert runner.try_selective is sizes.try_selective
    assert runner.time_extra_size is sizes.time_extra_size


def test_xlm_plans_its_feed_forward_blocks_and_keeps_its_attentions(tmp_path: Path) -> None:
    """transformers' XLMModel.forward makes a key/value cache whenever none is passed
    (modeling_xlm.py: ``if cache is None: cache = EncoderDecoderCache(...)``), so a
    checkpointed attention's recompute attends to its forward's keys twice. The probe
    leaves the attentions out of the candidates and says so; the feed-forward blocks
    stay."""
    from memplan.model.loader import settle_torchvision
    from memplan.probe import probe_model

    settle_torchvision()
    path = hf_families.model_file(tmp_path, "encoder", "xlm")
    profile = probe_model(str(path), device="cpu", micro_batches=(1, 2), timing_rounds=1)
    assert profile.layer_names == ("transformer.ffns.0", "transformer.ffns.1")
    assert {"transformer.attentions.0", "transformer.attentions.1"} <= {
        part.name for part in profile.fixed
    }
    (warning,) = [w for w in profile.warnings if "cannot be checkpointed" in w]
    assert "2 of 4 candidate layer(s)" in warning
    assert "(transformer.attentions.0, transformer.attentions.1: RuntimeError: " in warning


def test_the_sweep_names_the_first_differing_field() -> None:
    from memplan.probe import probe_model

    path = str(Path(__file__).parent.parent / "examples" / "mlp.py")
    profile = probe_model(path, device="meta", micro_batches=(1, 2))
    assert hf_sweep.byte_difference(profile, profile) is None
    totals = dataclasses.replace(profile.totals, cached_bytes=8)
    assert hf_sweep.byte_difference(profile, dataclasses.replace(profile, totals=totals)) == (
        "totals"
    )
    layer = dataclasses.replace(profile.layers[1], saved_bytes=profile.layers[0].output_bytes)
    moved = dataclasses.replace(profile, layers=(profile.layers[0], layer, *profile.layers[2:]))
    assert hf_sweep.byte_difference(profile, moved) == f"layers {layer.name}: saved_bytes"


def test_families_are_the_pinned_transformers_mappings() -> None:
    causal = hf_families.families("causal-lm")
    assert {"llama", "gpt2", "mixtral", "gemma2"} <= set(causal)
    config = hf_families.tiny_config("causal-lm", "llama")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 128)


def test_tiny_configs_set_what_a_config_class_alone_leaves_unset() -> None:
    """Families the sweep skipped before because their config class's defaults do not build
    a tiny model (t5, longt5 and switch_transformers; gpt_neo; ministral, nemotron and
    hunyuan; deit), each for one field."""
    # transformers 5 keeps decoder_start_token_id in the generation config: T5's rule
    t5 = hf_families.tiny_config("encoder-decoder", "t5")
    assert t5.decoder_start_token_id == t5.pad_token_id == 0
    # GPT-Neo's [[pattern, repeats]]: one repeat of its two layers, for two layers
    neo = hf_families.tiny_config("causal-lm", "gpt_neo")
    assert neo.attention_layers == ["global", "local"] and neo.num_layers == 2
    # head_dim left None (the model reads it): hidden 32 over 4 heads
    ministral = hf_families.tiny_config("causal-lm", "ministral")
    assert (ministral.head_dim, ministral.num_attention_heads) == (8, 4)
    # a mapping to two classes reads config.architectures, None from a config class
    deit = hf_families.tiny_config("vision", "deit")
    assert deit.architectures == ["DeiTForImageClassification"]
    # per-stage head counts double with the widths (Swin-V2: 32, 64, 128, 256 wide)
    swin = hf_families.tiny_config("vision", "swinv2")
    assert list(swin.num_heads) == [1, 2, 4, 8] and list(swin.depths) == [1, 1, 1, 1]


def test_tiny_configs_keep_what_latent_attention_and_windows_need() -> None:
    """Families skipped before this rule, each for one field: DeepSeek-V3 and its kin
    (head_dim is the rope slice; as many KV heads as heads; expert groups), Swin (a window
    per stage), Hiera (its image size a pair), Reformer (its layer pattern and axial shapes)."""
    ds = hf_families.tiny_config("causal-lm", "deepseek_v3")
    assert ds.head_dim == ds.qk_rope_head_dim == 4
    assert ds.num_key_value_heads == ds.num_attention_heads == 4
    assert (ds.n_group, ds.topk_group, ds.n_routed_experts) == (1, 1, 4)
    # one dense layer first, so the second of two is a mixture of experts (its default 3
    # left the tiny model dense); Switch's every-4th sparse layer becomes every layer
    assert ds.first_k_dense_replace == 1
    model = hf_families.build("causal-lm", "deepseek_v3")
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "DeepseekV3MLP",
        "DeepseekV3MoE",
    ]
    assert (
        hf_families.tiny_config("encoder-decoder", "switch_transformers").decoder_sparse_step == 1
    )
    # grouped-query defaults still shrink to grouped: llama's None becomes 4 of 4; mistral's
    # 8 of 32 becomes 2 of 4
    mistral = hf_families.tiny_config("causal-lm", "mistral")
    assert (mistral.num_key_value_heads, mistral.num_attention_heads) == (2, 4)
    swin = hf_families.tiny_config("vision", "swin")
    assert (swin.window_size, swin.image_size) == (2, 64)
    # 64 px / patch 4 = 16, halved three times: 2 × 2 in the last stage, one window
    assert swin.image_size // swin.patch_size // 2 ** (len(swin.depths) - 1) == swin.window_size
    hiera = hf_families.tiny_config("vision", "hiera")
    assert list(hiera.image_size) == [64, 64]
    batch = hf_families.make_batch("vision", "hiera", 2)
    assert tuple(batch["pixel_values"].shape) == (2, 3, 64, 64)
    assert tuple(hf_families.make_batch("vision", "mobilevitv2", 1)["pixel_values"].shape) == (
        1,
        3,
        128,
        128,
    )
    causal = hf_families.tiny_config("causal-lm", "reformer")
    assert causal.is_decoder and not hf_families.tiny_config("encoder", "reformer").is_decoder
    assert causal.num_hidden_layers == 2 and sum(causal.axial_pos_embds_dim) == 32


def test_tiny_configs_of_state_space_and_hybrid_families() -> None:
    """Mamba-2's validator ties heads × head_dim to expand × hidden; a hybrid's per-layer
    block pattern keeps one block of each type in its two (the attention block beside the
    mamba one)."""
    mamba = hf_families.tiny_config("causal-lm", "mamba2")
    assert mamba.num_heads * mamba.head_dim == mamba.expand * mamba.hidden_size == 64
    zamba = hf_families.tiny_config("causal-lm", "zamba2")
    assert zamba.layers_block_type == ["linear_attention", "hybrid"]
    assert hf_families._two_layers(["a", "a", "a"]) == ["a", "a"]
    assert hf_families._two_layers(["a", "a", "b", "c"]) == ["a", "b"]
    assert hf_families._two_layers([]) == []
    assert hf_families.tiny_config("causal-lm", "bamba").mamba_n_heads == 4
    # a full-attention layer kept where the pattern has one beyond its first two (Gemma-3's
    # five sliding to one full); a pattern without one keeps its first two
    gemma = hf_families.tiny_config("causal-lm", "gemma3_text")
    assert gemma.layer_types == ["sliding_attention", "full_attention"]
    qwen = hf_families.tiny_config("causal-lm", "qwen4_exp_text")
    assert qwen.layer_types == ["linear_attention", "linear_attention"]


def test_tiny_configs_shrink_widths_and_vocabularies_of_other_names() -> None:
    """XLM's emb_dim, LUKE's entity vocabulary, RoCBERT's pronunciation and shape tables:
    left at their defaults, each family stayed over MAX_PARAMS (101 M, 129 M, 13 M)."""
    assert hf_families.tiny_config("encoder", "xlm").emb_dim == 32
    luke = hf_families.tiny_config("encoder", "luke")
    assert (luke.entity_vocab_size, luke.entity_emb_size) == (128, 32)
    roc = hf_families.tiny_config("encoder", "roc_bert")
    assert (roc.pronunciation_vocab_size, roc.shape_vocab_size) == (128, 128)
    assert hf_families.build("encoder", "luke").num_parameters() < hf_families.MAX_PARAMS
