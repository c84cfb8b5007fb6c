"""Tiny models of transformers' families, built from their config classes alone (never
weights), for the meta-vs-cpu sweep (bench/hf_sweep.py) and its CI sample
(tests/test_hf_sweep.py).

A family is a ``model_type`` of transformers' auto mappings in one of four kinds: causal-LM,
encoder (masked-LM), encoder-decoder (seq2seq-LM) and vision (image classification). Its
tiny config is the config class's defaults with every size field it has shrunk (hidden 32,
2 layers, 4 heads, vocabulary 128, images 32 × 32), sub-configs included; a family whose
model does not build that way, or stays big (over ``MAX_PARAMS``), is skipped with the
reason. ``model_file`` writes a model file (the memplan contract) for one family, so the
sweep probes it exactly as a user's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KINDS = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "encoder": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "encoder-decoder": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "vision": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
}
SEQ_LEN = 16
IMAGE = 32
VOCAB = 128
MAX_PARAMS = 8_000_000
"""A tiny model here holds well under a million parameters; one over this did not shrink."""

# Each size field a config may spell, and its tiny value (set only where the default is an
# int, so a field meaning something else in one family is left alone).
_SIZES = {
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "hidden_dim", "n_embed"), 32
    ),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "num_encoder_layers",
        ),
        2,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "n_inner",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "expert_intermediate_size",
            "ffn_hidden_size",
        ),
        64,
    ),
    "head_dim": 8,
    "rotary_dim": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "d_kv": 8,
    "vocab_size": VOCAB,
    # vocabularies and widths of other names (XLM/FlauBERT, LUKE's entities, RoCBERT's
    # pronunciation and shape embeddings, Gemma-4's per-layer inputs, BLT's global model)
    **dict.fromkeys(
        (
            "entity_vocab_size",
            "pronunciation_vocab_size",
            "shape_vocab_size",
            "vocab_size_per_layer_input",
        ),
        VOCAB,
    ),
    **dict.fromkeys(
        (
            "emb_dim",
            "entity_emb_size",
            "pronunciation_embed_dim",
            "shape_embed_dim",
            "hidden_size_per_layer_input",
            "hidden_size_global",
        ),
        32,
    ),
    "max_position_embeddings": 64,
    "n_positions": 64,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
    "n_shared_experts": 1,
    **dict.fromkeys(("index_n_heads", "index_head_dim", "index_topk"), 4),
    # state-space mixers (Mamba-2 and the hybrids): heads, state, groups
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads"), 4),
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 16),
    "n_groups": 1,
    "image_size": IMAGE,
    "patch_size": 4,
    "num_channels": 3,
    "embedding_size": 16,
}
WIDE_IMAGE = dict.fromkeys(
    (
        "mobilenet_v1",
        "mobilenet_v2",
        "mobilevit",
        "mobilevitv2",
        "swiftformer",
        "efficientnet",
        "regnet",
        "resnet",
        "swin",
        "donut-swin",
        "hiera",
    ),
    64,
)
"""Families whose stride-32 stem leaves 1 × 1 at 32 px: BatchNorm refuses one value per
channel in training at micro-batch 1 (on cpu as anywhere), so they get 64 px; and those whose
last stage must still hold a window or a query pool there (Swin, Hiera)."""
FAMILY = {
    # four stages halve a 16 × 16 patch grid to 2 × 2: a window of 2 tiles each (a stage
    # smaller than its window shrinks the window but not its bias table)
    "swin": {"window_size": 2},
    "donut-swin": {"window_size": 2},
    "mobilevitv2": {"image_size": 128},  # its last stage unfolds 4 × 4 patches of a /32 map
    "squeezebert": {"embedding_size": 32},  # its encoder asserts embeddings as wide as hidden
    "esm": {"pad_token_id": 1, "mask_token_id": 2},  # None by default; its embeddings mask pads
    # two layers of its pattern; axial position embeddings whose factors multiply to the
    # 16 tokens and whose widths sum to hidden; chunks that tile 16 tokens
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [4, 4],
        "axial_pos_embds_dim": [16, 16],
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
    },
    "causal-lm:reformer": {"is_decoder": True},  # its LM head asserts it
    # a quarter of B0's widths, one block a stage; its head is as wide as its top conv
    # (1280 × width_coefficient)
    "efficientnet": {"width_coefficient": 0.25, "depth_coefficient": 0.3, "hidden_dim": 320},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # None by default; LFM2's kinds
    "neomme": {"head_dim": 16},  # its M-RoPE rotates a quarter of a head in pairs of two
    "zaya": {"num_experts_per_tok": 1},  # its validator: one expert a token only
    # its validators: NVFP4 keys need head_dim a multiple of 16; an indexer head per KV group
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 1},
}
"""Per-family fields (``kind:family`` for one kind) the generic shrinking gets wrong, and why."""
_BLOCK_PATTERNS = ("layers_block_type", "layers_block_types")
_AT_MOST = {
    # dense layers before the first expert layer: one, so the second of two layers is a
    # mixture of experts (DeepSeek-V3's 3 would leave the tiny model dense)
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"), 1),
    # every layer's MLP sparse, not every 4th of two (Switch, NLLB-MoE)
    **dict.fromkeys(("decoder_sparse_step", "encoder_sparse_step"), 1),
    "num_groups": 4,  # GroupNorm's groups: they must divide the tiny widths (BiT)
    "window_size": 4,  # a window that tiles the 8 × 8 patch grid of a 32 px image
}
"""Counts capped where the default is larger (left alone where it is not)."""
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
_UNSET = {
    "head_dim": 8,
    "num_key_value_heads": 4,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "vocab_size": VOCAB,
}
"""Fields a config class leaves None for its model to derive, where some models read the None
itself: what the derivation gives (head_dim hidden / heads, as many KV heads as heads), and
where the default is an int elsewhere, its tiny value (experts, the vocabulary)."""


def _two_layers(pattern: list[Any]) -> list[Any]:
    """Two layers of a hybrid's per-layer block pattern: the first, and the first of another
    type where the pattern has one (its attention block beside its mamba blocks), so the
    tiny model runs both."""
    if not pattern:
        return pattern
    other = next((kind for kind in pattern if kind != pattern[0]), pattern[0])
    return [pattern[0], other]


def families(kind: str) -> list[str]:
    """The model types of ``kind`` in the pinned transformers, in its mapping's order."""
    from transformers.models.auto import modeling_auto

    return list(getattr(modeling_auto, KINDS[kind][0]))


def _tiny_kwargs(config: Any) -> dict[str, Any]:
    from transformers import PretrainedConfig

    kwargs: dict[str, Any] = {}
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            kwargs[name] = {**value.to_dict(), **_tiny_kwargs(value)}
        elif name in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            kwargs[name] = _SIZES[name]
        elif name in ("depths", "num_layers_per_stage") and isinstance(value, (list, tuple)):
            kwargs[name] = [1 for _ in value]
        elif name == "layer_types" and isinstance(value, list):
            # the first two, with a full-attention layer where the pattern has one (Gemma-3's
            # five sliding to one full; validators and rope tables that ask for one); not
            # every kind: an indexer's layers have sizes this builder does not shrink
            full = "full_attention" in value and "full_attention" not in value[:2]
            kwargs[name] = [value[0], "full_attention"] if full else value[:2]
        elif name in _BLOCK_PATTERNS and isinstance(value, list):
            kwargs[name] = _two_layers(value)
        elif name == "intermediate_size" and isinstance(value, list):
            kwargs[name] = [64, 64]
        elif name == "use_cache":
            kwargs[name] = False  # training: a cache is never read
        elif name.endswith("layerdrop") and isinstance(value, float) and value > 0:
            # LayerDrop skips whole layers at random in training: a step's memory depends
            # on the draw (meta's twin draws differ from cpu's), and a checkpointed layer's
            # recompute can skip what its forward ran (LED, M2M-100, FSMT)
            kwargs[name] = 0.0
        elif name in _TOKEN_IDS and isinstance(value, int) and value >= VOCAB:
            kwargs[name] = {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2)
        elif name in _UNSET and value is None:
            # left for the model to derive, where some models then read None
            kwargs[name] = _UNSET[name]
        elif name in _AT_MOST and isinstance(value, int) and value > _AT_MOST[name]:
            kwargs[name] = _AT_MOST[name]
        elif name == "image_size" and isinstance(value, (list, tuple)) and len(value) == 2:
            kwargs[name] = [IMAGE, IMAGE]
        elif name == "num_heads" and isinstance(value, (list, tuple)):
            kwargs[name] = [2**i for i in range(len(value))]  # per stage, as widths double
        elif name == "attention_types" and isinstance(value, list):
            # GPT-Neo: [[pattern, repeats]]; one repeat of its two-layer pattern
            kwargs[name] = [[value[0][0], 1]]
    fields = vars(config)
    if fields.get("head_dim") is not None and fields.get("head_dim") == fields.get(
        "qk_rope_head_dim"
    ):
        # multi-head latent attention (DeepSeek-V3 and its kin) points head_dim at the rope
        # slice for the rotary embedding: it shrinks with that slice
        kwargs["head_dim"] = _SIZES["qk_rope_head_dim"]
    if isinstance(fields.get("expand"), int) and isinstance(fields.get("head_dim"), int):
        # Mamba-2 ties its heads to the width: heads × head_dim = expand × hidden
        heads = kwargs.get("num_heads", fields.get("num_heads"))
        if isinstance(heads, int):
            kwargs["head_dim"] = fields["expand"] * _SIZES["hidden_size"] // heads
    for kv, heads in (("num_key_value_heads", "num_attention_heads"), ("n_kv_heads", "n_heads")):
        if isinstance(fields.get(kv), int) and fields.get(kv) == fields.get(heads):
            # as many KV heads as heads by default (no grouping; latent attention expands
            # its K and V to every head): the tiny model keeps that
            kwargs[kv] = kwargs.get(heads, fields[heads])
    return kwargs


def tiny_config(kind: str, family: str) -> Any:
    """The config of ``family``'s tiny model: its class's defaults, every size shrunk."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    kwargs = _tiny_kwargs(cls())
    if family in WIDE_IMAGE and isinstance(kwargs.get("image_size"), int):
        kwargs["image_size"] = WIDE_IMAGE[family]
    elif family in WIDE_IMAGE and "image_size" in kwargs:
        kwargs["image_size"] = [WIDE_IMAGE[family]] * 2
    kwargs.update(FAMILY.get(family, {}))
    kwargs.update(FAMILY.get(f"{kind}:{family}", {}))
    config = cls(**kwargs)
    if kind == "encoder-decoder" and getattr(config, "decoder_start_token_id", None) is None:
        # transformers 5 keeps it in the generation config, which a config class alone lacks;
        # T5's convention (the decoder starts from the pad token) shifts the labels right
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    model_class = _model_classes(kind, family)
    if len(model_class) > 1 and not getattr(config, "architectures", None):
        config.architectures = [model_class[0]]  # a mapping to several: the first, by name
    return config


def _model_classes(kind: str, family: str) -> tuple[str, ...]:
    """The class name(s) transformers' auto mapping of ``kind`` gives ``family``."""
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, KINDS[kind][0])[family]
    return tuple(names) if isinstance(names, (list, tuple)) else (names,)


def build(kind: str, family: str) -> Any:
    """``family``'s tiny model of ``kind``, random weights (seeded), training mode."""
    import torch

    from memplan.model.loader import settle_torchvision

    settle_torchvision()  # before transformers imports it (memplan.model.loader says why)
    import transformers

    config = tiny_config(kind, family)
    torch.manual_seed(0)
    model = getattr(transformers, KINDS[kind][1]).from_config(config)
    params = sum(p.numel() for p in model.parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"stays big: {params:,} parameters from its tiny config")
    return model.train()


def make_batch(kind: str, family: str, batch_size: int) -> dict[str, Any]:
    """A batch of ``batch_size`` samples: token ids and labels (``SEQ_LEN`` tokens), or
    ``IMAGE`` × ``IMAGE`` images and class labels; seeded by the size."""
    import torch

    g = torch.Generator().manual_seed(1000 + batch_size)
    if kind == "vision":
        config = tiny_config(kind, family)
        channels = int(getattr(config, "num_channels", 3) or 3)
        size = getattr(config, "image_size", None)
        size = size[0] if isinstance(size, (list, tuple)) else size
        if not isinstance(size, int):  # a config without image_size
            size = WIDE_IMAGE.get(family, IMAGE)
        return {
            "pixel_values": torch.randn(batch_size, channels, size, size, generator=g),
            "labels": torch.randint(0, 2, (batch_size,), generator=g),
        }
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN), generator=g)
    labels = torch.randint(3, VOCAB, (batch_size, SEQ_LEN), generator=g)
    return {"input_ids": ids, "labels": labels if kind == "encoder-decoder" else ids.clone()}


_TEMPLATE = '''"""{family} ({kind}), tiny, from its config class (bench/hf_families.py)."""
from bench import hf_families

KIND, FAMILY = {kind!r}, {family!r}


def build_model():
    return hf_families.build(KIND, FAMILY)


def make_batch(batch_size):
    return hf_families.make_batch(KIND, FAMILY, batch_size)
'''


def model_file(folder: Path, kind: str, family: str) -> Path:
    """A model file for ``family``'s tiny model in ``folder``."""
    path = folder / f"{kind}_{family}.py".replace("-", "_")
    path.write_text(_TEMPLATE.format(kind=kind, family=family), encoding="utf-8")
    return path
