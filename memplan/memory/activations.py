"""What a rank of a parallel layout keeps of a block's activations (issues 25, 31): the share
of its saved bytes under TP, SP and CP, the hidden states split by sequence, and the inputs the
plain step frees, from which what one micro-batch holds on a rank after its forward follows.
No torch. Used by memplan.memory.parallel (a rank's profile) and memplan.memory.vocab."""

from __future__ import annotations

from memplan.parallel import Parallel
from memplan.profile import Affine, Layer, Profile

SP_GATHERED_INPUTS = 2
"""TP regions per block whose input sequence parallel all-gathers: attention and MLP (the
Llama shape of torchtitan's ``apply_tp`` and transformers' TP plans)."""


def sp_gathered_share(layer: Layer) -> float:
    """Share of the block's saved bytes (per sample) that sequence parallel keeps whole: the
    all-gathered (``Replicate``) input of each TP region, one hidden-state tensor (the block's
    output size) each, saved by the region's colwise projections. PyTorch's SP (DTensor, as
    torchtitan runs it) saves that gathered tensor; Megatron's SP saves the sequence shard and
    gathers again in the backward, which its formula (34·s·b·h/t) assumes. Measured with
    ``memplan verify --world-size 4`` on a tiny HF Llama: without this term the prediction
    was 4.2% under every rank (docs/design.md)."""
    saved = layer.saved_bytes.slope
    if saved <= 0:
        return 0.0
    return min(1.0, SP_GATHERED_INPUTS * max(layer.output_bytes.slope, 0.0) / saved)


def activation_factor(layer: Layer, parallel: Parallel) -> float:
    """``f_j`` of the module docstring: what a rank keeps of the block's saved bytes."""
    if parallel.sequence_parallel:
        return (1.0 / parallel.tp + sp_gathered_share(layer) * (1.0 - 1.0 / parallel.tp)) / (
            parallel.cp
        )
    inside = (layer.tp_saved_fraction or 0.0) if parallel.tp > 1 else 0.0
    return ((1.0 - inside) + inside / parallel.tp) / parallel.cp


def hidden_factor(parallel: Parallel) -> float:
    """What a rank holds of a hidden state (a block's input or output): split by sequence
    under SP (over ``tp``) and CP (over ``cp``), whole otherwise."""
    return (1.0 / parallel.cp) / (parallel.tp if parallel.sequence_parallel else 1)


def freed_inputs(profile: Profile) -> tuple[Affine, ...]:
    """Per block: the bytes of its input that the plain step frees once the block's forward
    has run, because nothing the block saves for backward is that tensor. A bf16 Llama block
    is one: its RMSNorm saves an fp32 copy of the input (``x.float()``), the residual add
    saves nothing, so the hidden state entering block ``j`` dies when the model's loop moves
    on (``x = layer(x)``). ``saved_bytes`` is what the block's forward adds, so a run of
    blocks holds ``Σ saved_j − Σ freed_j``; a fully checkpointed block keeps its input and
    its output, which is the next block's input (torch.utils.checkpoint saves the inputs), so
    its ``saved − savings`` is both hidden states, one of which the plain run freed.

    Read from the no-gradient timeline: the most of the ``none`` segment after block ``j``
    comes at its start, before the step drops block ``j − 1``'s input, so block ``j``'s
    input is ``none_{j+1} + saved_{j+1} − none_{j+2}``, kept within ``[0, input_j]``. The
    last two blocks (the segment after the last one runs the head) take the block before's
    share of their input; with fewer than three blocks nothing is read (none freed)."""
    layers = profile.layers
    n = len(layers)
    nones = {
        seg.held: max(seg.points, key=lambda p: (p[1], p[0]))
        for seg in profile.timeline.get("no_grads", ())
        if seg.active == "none"
    }
    out: list[Affine] = []
    for j, layer in enumerate(layers):
        given = layer.input_bytes
        if j + 2 < n and j + 1 in nones and j + 2 in nones:
            after, later = nones[j + 1], nones[j + 2]
            nxt = layers[j + 1].saved_bytes
            intercept = after[0] + nxt.intercept - later[0]
            slope = after[1] + nxt.slope - later[1]
        elif out and layers[j - 1].input_bytes.slope > 0:
            share = out[-1].slope / layers[j - 1].input_bytes.slope
            intercept, slope = out[-1].intercept, share * given.slope
        else:
            intercept = slope = 0.0
        out.append(
            Affine(
                intercept=min(max(intercept, 0.0), max(given.intercept, 0.0)),
                slope=min(max(slope, 0.0), max(given.slope, 0.0)),
            )
        )
    return tuple(out)


def held_bytes(
    profile: Profile, parallel: Parallel, blocks: range, freed: tuple[Affine, ...]
) -> dict[int, Affine]:
    """Per block of ``blocks`` (one stage's, in the whole model's numbering): what it adds to
    one micro-batch's bytes on a rank once its forward has run, un-checkpointed: its saved
    bytes times its factor ``f`` less the input the plain step freed (``freed_inputs``, a
    hidden state: ``hidden_factor``). A later stage's first input is its receive buffer,
    which ``torch.distributed.pipelining`` keeps (memory.pipeline), so nothing is freed there.
    A checkpointed block keeps ``hidden_factor`` of its ``saved − savings − freed``: its
    output (memory.parallel's rank savings). ``freed``: ``freed_inputs(profile)``, which
    the caller has read already."""
    out = {}
    for j in blocks:
        layer = profile.layers[j]
        f = activation_factor(layer, parallel)
        share = hidden_factor(parallel) if j != blocks.start or j == 0 else 0.0
        out[j] = Affine(
            intercept=f * layer.saved_bytes.intercept - share * freed[j].intercept,
            slope=f * layer.saved_bytes.slope - share * freed[j].slope,
        )
    return out
