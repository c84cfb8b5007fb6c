"""One HF Llama block's training step, compiled by inductor on the CPU and traced by
memplan's fused clock (tests/test_compiled_clock.py): prints the bytes each counts as JSON.

inductor's count is its own (``GraphLowering.count_bytes``: each scheduler node's read and
write buffers, logged under the ``inductor_metrics`` artifact); the nodes that are extern
kernels (matmuls, attention) are left out, as memplan's fused regions leave the anchors out.
"""

from __future__ import annotations

import json
import sys

import torch


def build():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0)
    batch, seq = 2, 512
    x = torch.randn(batch, seq, 512, requires_grad=True)
    positions = torch.arange(seq)[None].expand(batch, seq)
    embeddings = LlamaRotaryEmbedding(config)(x, positions)

    def step(x: torch.Tensor) -> None:
        out = layer(x, position_embeddings=embeddings, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()

    return layer, x, step


def main() -> None:
    from memplan.model.loader import settle_torchvision

    settle_torchvision()
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    from memplan.probe.roofline import Roofline
    from memplan.probe.tracker import LiveTracker

    layer, x, step = build()
    roofline = Roofline(flops_by_dtype={}, default_flops=1e30, memory_bandwidth=1.0)
    counts = {}
    for fused in (False, True):
        tracker = LiveTracker(record=False, roofline=roofline, fused=fused)
        with tracker:
            step(x)
        moved = tracker.virtual_seconds  # bytes at 1 B/s, no compute: closes the region
        if fused:  # the anchors (matmuls, attention) are charged one by one, as before
            counts["memplan_fused"] = tracker.fused_bytes
            counts["memplan_anchors"] = moved - tracker.fused_bytes
        else:
            counts["memplan_eager"] = moved
        layer.zero_grad()
        x.grad = None
    torch._logging.set_logs(inductor_metrics=True)
    inductor_config.fx_graph_cache = False
    metrics.reset()
    torch.compile(step)(x)
    counts["inductor_fused"] = sum(
        n * 4 for node, n in metrics.nodes_num_elem if "Extern" not in type(node).__name__
    )
    counts["inductor_extern"] = sum(
        n * 4 for node, n in metrics.nodes_num_elem if "Extern" in type(node).__name__
    )
    json.dump(counts, sys.stdout)


if __name__ == "__main__":
    main()
