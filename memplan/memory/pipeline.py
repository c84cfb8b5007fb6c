"""What ``torch.distributed.pipelining`` keeps on a pipeline rank besides its blocks' saved
bytes (issue 31): the last stage's output per micro-batch in flight, and the schedule's
receive buffers and the received inputs' gradients, and the outputs an engine version keeps
to the step's end (``kept_output_bytes``). No torch; ``memory.parallel`` adds
them to a rank's timeline. Also a stage rank's totals and its own optimizer and fixed-part
seconds (``rank_totals``, ``rank_times``)."""

from __future__ import annotations

import dataclasses

from memplan.memory.activations import hidden_factor
from memplan.memory.sharding import optimizer_transient_bytes
from memplan.memory.vocab import LOSS_PART
from memplan.parallel import Parallel
from memplan.profile import (
    Affine,
    FixedPart,
    Layer,
    Profile,
    Totals,
    affine_scale,
    affine_sum,
)


def stage_output_bytes(profile: Profile, parallel: Parallel) -> Affine:
    """What the last stage's output holds per micro-batch in flight: torch.distributed.
    pipelining keeps a stage's forward output until that micro-batch's backward (its
    ``fwd_cache``), where a plain step lets the loss free it. Measured: the bytes the loss
    frees (the negative ``saved_bytes`` of the probe's ``(loss)`` part, the logits)."""
    freed = Affine.zero()
    vocab = 1.0 / parallel.tp if parallel.loss_parallel else 1.0
    for part in profile.fixed:
        if part.name == LOSS_PART and part.saved_bytes.slope < 0:
            freed = affine_scale(part.saved_bytes, -vocab / parallel.cp)
    return freed


def kept_output_bytes(profile: Profile, parallel: Parallel, stage: int) -> tuple[Affine, Affine]:
    """``(kept, merged)`` per sample of a micro-batch on pipeline rank ``stage`` under
    ``parallel.kept_outputs`` (memplan.parallel.Parallel): ``kept``, the outputs one finished
    micro-batch leaves in ``PipelineStage.output_chunks`` (torch/distributed/pipelining/
    stage.py ``forward_one_chunk``; its ``fwd_cache`` entry, which ``stage_output_bytes``
    and the blocks' bytes count while it is in flight, is gone after its backward, the
    output stays to the next step's ``clear_runtime_states``): the last stage's logits
    (``stage_output_bytes``), and under ``all`` each other chunk's hidden state as sent;
    ``merged``, on the last rank, what ``step`` allocates at its end to return them merged
    (``_merge_outputs``: one ``torch.cat`` of every micro-batch's logits, beside the
    chunks). Zero under ``none``. Measured: tests/test_kept_outputs.py (torch 2.13,
    ``return_outputs=True`` against ``False``, 2 gloo ranks)."""
    zero = Affine.zero()
    if parallel.pp == 1 or parallel.kept_outputs == "none":
        return zero, zero
    chunks = parallel.stage_ranges(len(profile.layers))
    kept = zero
    for v in range(parallel.virtual_stages):
        index = stage + v * parallel.pp
        if index == parallel.stages - 1:
            kept = affine_sum(kept, stage_output_bytes(profile, parallel))
        elif parallel.kept_outputs == "all" and chunks[index]:
            hidden = profile.layers[chunks[index].stop - 1].output_bytes
            kept = affine_sum(kept, affine_scale(hidden, hidden_factor(parallel)))
    merged = stage_output_bytes(profile, parallel) if stage == parallel.pp - 1 else zero
    return kept, merged


def with_merged_outputs(rank: Profile, merged: Affine) -> Profile:
    """A stage rank's profile with the step's merged outputs (``merged``, every micro-batch's:
    ``kept_output_bytes``) at its end. ``step`` returns them before the optimizer runs, so
    that point holds the optimizer step's bytes less its temporaries, plus ``merged``: when
    ``merged`` outgrows the temporaries at every micro-batch size it is that point (the
    optimizer step's figure less its temporaries, plus ``merged``); otherwise ``merged`` is
    counted at the optimizer step whole, an over-estimate by at most the smaller of the
    two."""
    if merged.slope <= 0 and merged.intercept <= 0:
        return rank
    temporaries = optimizer_transient_bytes(rank)
    if merged.intercept + merged.slope < temporaries:
        temporaries = 0
    peak = rank.optimizer_step_peak_bytes
    return dataclasses.replace(
        rank,
        optimizer_step_peak_bytes=Affine(
            intercept=peak.intercept + merged.intercept - temporaries,
            slope=peak.slope + merged.slope,
        ),
    )


def pipeline_buffers(
    profile: Profile, parallel: Parallel, stage: int, micro_batches: int
) -> tuple[Affine, Affine]:
    """What ``torch.distributed.pipelining`` keeps on pipeline rank ``stage`` besides the
    blocks' saved bytes, per sample of the micro-batch (torch 2.13,
    ``torch/distributed/pipelining/stage.py``), as ``(buffers, input_grads)``:

    - ``buffers``, resident all step: ``PipelineStage._setup_forward_recv_info`` allocates
      one receive buffer per micro-batch (``for chunk_id in range(num_microbatches)``) for
      every stage but the first, the hidden state the previous stage sends; it becomes that
      micro-batch's input (``_retrieve_recv_activations``: the buffer itself, made a leaf
      that requires grad), so it also stands for the input a waiting micro-batch keeps.
      ``_setup_backward_recv_info`` / ``_create_grad_recv_info`` allocate one gradient
      receive buffer per micro-batch for every stage but the last, the size of the stage's
      output. Both are made once, at the schedule's first step, and kept.
    - ``input_grads``, in the later micro-batches' backwards: ``stage_backward`` runs
      ``torch.autograd.backward`` without ``inputs=``, so each received buffer's gradient
      accumulates in its ``.grad`` and stays there until ``clear_runtime_states`` at the next
      step: ``m − 1`` of them while the last micro-batch runs its backward.

    Interleaved 1F1B: each of the rank's ``v`` chunks is a stage with buffers of its own.
    Measured on 4 gloo ranks (tiny HF Llama, pp 2, dp 2, 2 micro-batches): the two
    buffers of each stage were what the prediction lacked (8 KB of stage 0's 8.2 KB
    remainder; tests/test_pipeline_modes.py)."""
    if parallel.pp == 1:
        return Affine.zero(), Affine.zero()
    chunks = parallel.stage_ranges(len(profile.layers))
    received = Affine.zero()
    sent = Affine.zero()
    recv_count = 0
    for v in range(parallel.virtual_stages):
        index = stage + v * parallel.pp
        chunk = chunks[index]
        if index > 0:
            hidden = profile.layers[chunk.start - 1].output_bytes
            received = Affine(
                intercept=received.intercept + micro_batches * hidden.intercept,
                slope=received.slope + micro_batches * hidden.slope,
            )
            recv_count += 1
        if index < parallel.stages - 1:
            out = profile.layers[chunk.stop - 1].output_bytes
            sent = Affine(
                intercept=sent.intercept + micro_batches * out.intercept,
                slope=sent.slope + micro_batches * out.slope,
            )
    buffers = affine_sum(received, sent)
    grads = (
        affine_scale(received, (micro_batches - 1) / micro_batches) if recv_count else Affine.zero()
    )
    return buffers, grads


def fixed_seconds_share(profile: Profile, fixed: list[FixedPart] | tuple[FixedPart, ...]) -> float:
    """A stage rank's share of the whole model's fixed-part seconds (embeddings, norm, head,
    loss): its own parts' forward FLOPs (``fixed`` as the rank holds them: a TP-split head's
    divided by ``tp``), or their parameters where the profile records no FLOPs for them."""
    by_flops = any(part.fwd_flops.slope > 0 for part in profile.fixed)

    def size(part: FixedPart) -> float:
        if by_flops:
            return part.fwd_flops.slope
        return part.params_trainable_bytes + part.params_frozen_bytes

    whole = sum(map(size, profile.fixed))
    return sum(map(size, fixed)) / whole if whole > 0 else 1.0


def rank_totals(profile: Profile, layers: list[Layer], fixed: list[FixedPart]) -> Totals:
    """A stage rank's totals: its blocks' and fixed parts' state (``memory.parallel``).

    A parameter shared by two parts (a head tied to the embeddings: the probe counts it in
    both) is counted once: the parts' excess over the profile's totals, taken in the
    rank's share of the parts' bytes (the whole excess where the rank holds every part, as
    without pipeline stages, the only layout a tied model gets: ``Profile.
    pipeline_refused``, memplan.run.pipeline). Before, a tied GPT-2 on FSDP 2 was planned
    11.7% over."""
    parts = [*layers, *fixed]
    whole = [*profile.layers, *profile.fixed]

    def once(field: str) -> int:
        held = sum(getattr(p, field) for p in parts)
        every = sum(getattr(p, field) for p in whole)
        excess = every - getattr(profile.totals, field)
        if excess <= 0 or every <= 0:
            return held
        return held - round(excess * held / every)

    return Totals(
        params_trainable_bytes=once("params_trainable_bytes"),
        params_frozen_bytes=once("params_frozen_bytes"),
        buffer_bytes=profile.totals.buffer_bytes,
        grad_bytes=once("grad_bytes"),
        optimizer_state_bytes=once("optimizer_state_bytes"),
    )


def rank_times(profile: Profile, fixed: list[FixedPart], state_ratio: float) -> dict[str, Affine]:
    """A stage rank's own once-per-step and fixed-part seconds: it steps only its share of
    the state (``state_ratio``) and runs only its stage's fixed parts, TP-split
    (``fixed_seconds_share``). Before, every rank was charged the whole model's."""
    return {
        "optimizer_step_seconds": affine_scale(profile.optimizer_step_seconds, state_ratio),
        "step_fixed_seconds": affine_scale(
            profile.step_fixed_seconds, fixed_seconds_share(profile, fixed)
        ),
    }
