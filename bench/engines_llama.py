"""torchtitan's own Llama 3 (``torchtitan.models.llama3.Llama3Model``, torchtitan 0.3.0) at a
tiny size, as a memplan model file: what ``bench.engines`` probes and solves with memplan and
then trains with torchtitan's own parallelisation on gloo CPU ranks.

The blocks are torchtitan's ``debugmodel`` flavour's (dim 256, 16 heads, SwiGLU hidden 768,
vocabulary 2048, ``torchtitan/models/llama3/__init__.py`` ``_debugmodel``) built by the same
factory (``_build_llama3_layers``), with three configuration choices, no code changed:

* 4 blocks, not 6, and sequences of 128 tokens (a test's runtime);
* separate ``wq``/``wk``/``wv`` projections (``fuse_qkv=False``): memplan's TP plan splits
  modules by name, and a fused projection's rows are three matrices;
* attention by torchtitan's ``ScaledDotProductAttention`` (causal), not ``FlexAttention``:
  FlexAttention runs only through ``torch.compile`` (``models/common/attention.py``
  ``FlexAttention._compiled_flex_attn``, Inductor), which a CPU test cannot afford, and
  ``VarlenAttention`` is CUDA flash attention.

The loss is torchtitan's ``cross_entropy_loss`` (``components/loss.py``: a float32 sum over
tokens, divided here by the token count as ``CrossEntropyLoss`` divides by the global valid
tokens)."""

from __future__ import annotations

import dataclasses

import torch

VOCAB = 2048
DIM = 256
HEADS = 16
HIDDEN = 768  # compute_ffn_hidden_dim(256, multiple_of=256), as the debugmodel flavour
LAYERS = 4
SEQ_LEN = 128

# memplan's TP plan (memplan.run.tp_plan) of torchtitan's own split (models/common/
# decoder_sharding.py, models/llama3/sharding.py): the embedding by rows, q/k/v and w1/w3 by
# columns, wo and w2 by rows, the head by columns with its logits kept sharded (loss parallel).
TP_PLAN = {
    "tok_embeddings": "embedding_rowwise",
    "layers.*.attention.qkv_linear.wq": "colwise",
    "layers.*.attention.qkv_linear.wk": "colwise",
    "layers.*.attention.qkv_linear.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "lm_head": "colwise_gather_output",
}


def model_config(layers: int = LAYERS):
    """torchtitan's ``Llama3Model.Config`` of this file's model (see the module doc)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = llama3.model_registry("debugmodel").model
    blocks = llama3._build_llama3_layers(  # the factory every llama3 flavour uses
        n_layers=layers,
        dim=DIM,
        n_heads=HEADS,
        hidden_dim=HIDDEN,
        rope=ComplexRoPE.Config(
            dim=DIM // HEADS, max_seq_len=SEQ_LEN, theta=500000, scaling="llama"
        ),
        fuse_qkv=False,
        attn_backend="flex",
    )
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    config.layers = blocks
    assert config.dim == DIM and config.vocab_size == VOCAB
    return dataclasses.replace(config)


def build_model() -> torch.nn.Module:
    model = model_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def training_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    from torchtitan.components.loss import cross_entropy_loss

    tokens, labels = batch
    return cross_entropy_loss(model(tokens), labels) / labels.numel()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """torchtitan's ``default_adamw`` (components/optimizer/optimizer.py) with its default
    implementation, ``fused``."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
