"""Loss parallel (issue 31): which bytes after the blocks a TP rank keeps whole and which
it holds sharded by vocabulary when the head's logits and the cross-entropy stay sharded
over the TP ranks (``Parallel.loss_parallel``). No torch. Used by memplan.memory.parallel."""

from __future__ import annotations

import math

from memplan.memory.activations import freed_inputs
from memplan.profile import Affine, FixedPart, Profile

FIRST_STAGE_HINTS = ("embed", "wte", "wpe", "tok", "pos")
"""A fixed part whose name contains one of these runs before the blocks (first stage); the
others (final norm, head, loss) run after them (last stage). Fixed parts carry no position
in the profile, so the split is by name."""


def first_stage_part(part: FixedPart) -> bool:
    return first_stage_name(part.name)


def first_stage_name(name: str) -> bool:
    """Whether a module outside the blocks, by its qualified name, runs before them."""
    return any(hint in name.lower() for hint in FIRST_STAGE_HINTS)


def tp_measured(profile: Profile) -> bool:
    """Whether the probe measured every block's TP split (a model with a TP plan)."""
    return bool(profile.layers) and all(
        layer.tp_saved_fraction is not None for layer in profile.layers
    )


def vocab_split(
    rest: float, whole: float, vocab: float, most: float = math.inf, lp_most: float = math.inf
) -> float:
    """A point after the blocks on a TP rank under loss parallel: of the whole-logits run's
    ``rest`` bytes, ``whole`` stay whole and the excess is vocabulary-sized, held as a
    ``vocab`` share. The whole run's excess reaches ``most`` at its peak; loss parallel's
    reaches ``lp_most`` (``loss_parallel_most``): where that is less the excess is capped at
    it, where it is more (loss parallel's handlers hold more fp32 temporaries than the plain
    kernels) every excess is scaled by ``lp_most / most``, so the region's peak is
    ``lp_most`` and its shape the measured run's."""
    excess = max(rest - whole, 0.0)
    if lp_most <= most:
        excess = min(excess, lp_most)
    elif most > 0:
        excess *= lp_most / most
    return min(rest, whole) + excess * vocab


def loss_parallel_most(profile: Profile, whole: Affine) -> tuple[float, float]:
    """The most vocabulary-sized bytes per sample, before dividing by ``tp``: the whole-
    logits run's, once its blocks have run (``most``), and loss parallel's
    (``fused_loss_most``, from the head's logits, its saved bytes, in the profile's element
    size)."""
    most = 0.0
    # what the blocks hold once they have run (their saved bytes less the inputs the plain
    # step freed, memory.activations.freed_inputs)
    freed = sum(value.slope for value in freed_inputs(profile))
    held = sum(layer.saved_bytes.slope for layer in profile.layers) - freed
    for segments in profile.timeline.values():
        for seg in segments:
            if seg.active == "none" and seg.held == len(profile.layers):
                most = max(most, *(p[1] - held - whole.slope for p in seg.points))
    logits = sum(max(p.saved_bytes.slope, 0.0) for p in profile.fixed if is_head(p))
    element = 2 if profile.environment.precision in ("bf16", "fp16") else 4
    return most, fused_loss_most(most, logits, element)


def fused_loss_most(most: float, logits: float, element: int) -> float:
    """What torch's loss parallel holds at its peak, whole (``tp`` ranks hold it as
    ``1/tp`` shards), from the logits' bytes (``logits``, ``element`` bytes each; ``F`` =
    their fp32 size). Its handlers (torch 2.13, torch/distributed/tensor/parallel/loss.py)
    run the cross-entropy as local ops, each a tensor a device's allocator holds:

    - forward (``_log_softmax``): the logits, their fp32 copy when they are not fp32
      (``.float()``, as torchtitan's loss upcasts), ``shifted = x - max`` and its ``exp``
      (freed once summed): ``logits + F + 2F`` in bf16, ``3F`` in fp32;
    - backward (``_nll_loss_and_log_softmax_backward``, NLL's and log-softmax's backwards
      fused): the saved log-probabilities, a ``zeros_like`` gradient, ``exp`` of the
      log-probabilities and their sum (``(grad_input + exp(x)) * grad_output``): ``4F``.

    torchtitan 0.3.0's own ``_LossParallelCrossEntropy`` (components/loss.py) on local
    shards holds the same. Measured on 2 gloo ranks with the distributed tracker seeing
    into the handlers (tests/test_loss_parallel_region.py, 256 tokens, vocabulary 8192):
    each rank 4F/2 in fp32 and bf16, where the plain kernels hold 3F (fp32: the log-softmax,
    NLL's gradient, log-softmax's) and loss parallel, counted by its outputs only, 2F.
    ``most`` (the whole-logits run's most) stands when no head's logits were found."""
    if logits <= 0:
        return most
    f32 = logits * 4 / element
    upcast = f32 if element < 4 else 0.0
    forward = logits + upcast + 2 * f32
    backward = 4 * f32
    return max(forward, backward)


LOSS_PART = "(loss)"
"""The probe's name for the loss computed outside the model's modules (memplan.probe.assemble)."""


def is_head(part: FixedPart) -> bool:
    """A fixed part after the blocks whose weight TP splits (the output projection to the
    vocabulary, colwise): the part loss parallel keeps sharded."""
    return not first_stage_part(part) and part.name != LOSS_PART and part.tp_sharded_bytes > 0


def loss_parallel_possible(profile: Profile) -> bool:
    """Whether the model's TP plan splits its head (a colwise output projection), so the
    logits can stay sharded by vocabulary (``Parallel.loss_parallel``)."""
    return tp_measured(profile) and any(is_head(part) for part in profile.fixed)


def loss_parallel_whole_bytes(profile: Profile) -> Affine:
    """Under loss parallel, what stays whole on a TP rank once the blocks have run (per
    sample and fixed): the last block's output and what the parts after the blocks other
    than the head and the loss keep (the final norm's saved bytes; its output is the head's
    input, which the colwise head keeps whole, ``Replicate``). The rest of those segments'
    bytes are the logits, their fp32 copy, the log-softmax and the logits' gradient, all
    vocabulary-sized, which torchtitan's ``loss_parallel`` (torch.distributed.tensor.parallel
    .loss, ``_log_softmax_handler`` and ``_nll_loss_forward_handler``: a log-softmax and NLL
    over the local vocabulary shard, the max and sum all-reduced) and Megatron's
    ``vocab_parallel_cross_entropy`` (megatron/core/tensor_parallel/cross_entropy.py) hold as
    ``1/tp`` shards. Measured on 4 gloo ranks (docs/design.md)."""
    out = Affine.zero()
    if profile.layers:
        out = profile.layers[-1].output_bytes
    for part in profile.fixed:
        if first_stage_part(part) or part.name == LOSS_PART or is_head(part):
            continue
        out = Affine(
            intercept=out.intercept + max(part.saved_bytes.intercept, 0.0),
            slope=out.slope + max(part.saved_bytes.slope, 0.0),
        )
    return out
