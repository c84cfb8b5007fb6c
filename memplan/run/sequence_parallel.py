"""Sequence parallelism with tensor parallelism (issue 25), as torchtitan's Llama
``apply_tp`` runs it (pytorch/torchtitan ``torchtitan/models/llama3/infra/parallelize.py``
at 018740b7): between the TP regions the residual stream is split by sequence
(``Shard(1)``), so the norms run on ``t/tp`` positions (``SequenceParallel``); each
attention/MLP block all-gathers its input to ``Replicate`` (torchtitan's
``PrepareModuleInput``), and its rowwise output projection reduce-scatters back to
``Shard(1)`` (``RowwiseParallel(output_layouts=Shard(1))``). The embedding is vocab-split
with a sequence-split output, and the head takes ``Shard(1)`` and gathers full logits
(torchtitan's ``output`` without loss parallel: the Hugging Face loss takes plain logits).

One difference from torchtitan: its residual stream is plain local tensors
(``use_local_output=True``); a transformers decoder reads the sequence length from its
hidden states' shape (positions, causal mask), so here the stream stays a DTensor, whose
shape is the global one, and the same bytes per rank are held."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from memplan.errors import BadInputError


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def sequence_parallel_plan(
    net: torch.nn.Module, modules: Mapping[str, str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The ParallelStyles for ``modules`` (the model's TP plan, name -> style) under sequence
    parallelism, the TP regions (parents of the rowwise projections: their inputs are
    gathered) and the norms split by sequence (those beside the regions in each block, and
    the final norm beside the block list)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for name, style in modules.items():
        if style == "rowwise":
            plan[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        elif style == "embedding_rowwise":
            plan[name] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            )
        elif style in ("colwise_gather_output", "colwise_rep"):
            plan[name] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        elif style == "colwise":
            plan[name] = ColwiseParallel()
        else:
            raise BadInputError(
                f"Sequence parallelism runs Llama-style TP plans (colwise/rowwise projections, "
                f"embedding_rowwise, a gathered head); {name} has style {style!r}.",
                hint="Plan this model without --sequence-parallel.",
            )
    regions = sorted({_parent(n) for n, s in modules.items() if s == "rowwise"})
    blocks = {_parent(r) for r in regions}
    stacks = {_parent(_parent(b)) for b in blocks}  # model.layers.0 -> model
    norms = [
        name
        for name, module in net.named_modules()
        if "norm" in name.rpartition(".")[2].lower()
        and not list(module.children())
        and _parent(name) in blocks | stacks
    ]
    embeds = [n for n, s in modules.items() if s == "embedding_rowwise"]
    heads = [n for n, s in modules.items() if s.startswith("colwise_")]
    if not regions or not norms or len(embeds) != 1 or len(heads) != 1:
        raise BadInputError(
            f"memplan runs sequence parallelism on decoders shaped like Llama (an embedding, "
            f"blocks of norm + attention/MLP, a final norm and a head); {type(net).__name__}'s "
            f"TP plan gives regions {regions}, norms {norms}, embeddings {embeds}, heads {heads}.",
            hint="Plan this model without --sequence-parallel.",
        )
    for name in norms:
        plan[name] = SequenceParallel()
    return plan, regions, norms


def gather_sequence(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook on a TP region: its hidden states (the first argument, or the
    ``hidden_states`` keyword, as transformers calls attention) all-gathered from
    ``Shard(1)`` to ``Replicate`` (torchtitan's ``PrepareModuleInput`` on attention and
    feed_forward; one hook because transformers passes the input either way)."""
    from torch.distributed.tensor import DTensor, Replicate

    def gather(x: Any) -> Any:
        if isinstance(x, DTensor) and any(p.is_shard() for p in x.placements):
            return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        return x

    if args:
        return (gather(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
    return args, kwargs
