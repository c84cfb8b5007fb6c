"""torchtitan's FSDP units outside the blocks (``Parallel.fsdp_units`` ``torchtitan-2507``,
``Sharding.edge_units``): which of the parts outside the candidate layers are gathered, and
whose gradients are still unsharded, at a segment. No torch. Used by memplan.memory.sharding.

torchtitan 83e6941 (July 2025, pytorch/torchtitan#1094) to 0.3.0 shards a Llama as
(torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder`` in the 0.3.0 wheel):

* ``fully_shard(model.tok_embeddings, reshard_after_forward=True)`` (no pipeline stages):
  the *lead* unit, gathered for its forward and again for its backward, the backward's
  last; FSDP2's backward prefetch gathers it when block 0's backward begins;
* ``fully_shard([model.norm, model.lm_head], reshard_after_forward=False)`` (policy
  "default"): the *tail* unit, gathered from its forward to its ``post_backward``, the
  backward's first, which reshards it and reduce-scatters its gradients; it prefetches
  the last block;
* every block its own unit, resharded after forward; ``fully_shard(model)``, the root,
  holds no parameter of its own.

Which parts are lead and which tail is decided by name as for pipeline stages
(``vocab.first_stage_part``: the embeddings lead, everything else trails); parameters
outside every part and every candidate layer trail (gathered at the peak: the safe side).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.memory.vocab import FIRST_STAGE_HINTS, first_stage_part
from memplan.profile import FixedPart, Profile, Segment


@dataclass(frozen=True, slots=True)
class EdgeBytes:
    """One edge unit's parameters (as probed), float8 weights among them, and gradients."""

    params: int
    float8: int
    grads: int


def _params(part: FixedPart) -> int:
    return part.params_trainable_bytes + part.params_frozen_bytes


def _has_lead(profile: Profile) -> bool:
    """Whether a part outside the blocks that holds parameters is named like embeddings."""
    return any(first_stage_part(part) and _params(part) for part in profile.fixed)


def edge_refusal(profile: Profile) -> str | None:
    """Why torchtitan's edge units cannot be planned for this profile: none of the parts
    outside the blocks that hold parameters is named like an embedding, so which unit runs
    before the blocks is unknown (None: they can)."""
    if _has_lead(profile):
        return None
    holding = [part.name for part in profile.fixed if _params(part)]
    return (
        f"--fsdp-units torchtitan-2507 shards the embeddings as a unit of their own, but no "
        f"part outside the blocks that holds parameters ({', '.join(holding) or 'none'}) is "
        f"named like embeddings (a name containing {', '.join(FIRST_STAGE_HINTS)}), so memplan "
        "cannot tell which of them run before the blocks."
    )


def edge_split(
    profile: Profile, root_params: int, root_grads: int
) -> tuple[EdgeBytes, EdgeBytes] | None:
    """(lead, tail): the root unit's ``root_params`` and ``root_grads`` bytes divided
    between the embeddings' unit and the norm + head unit. None where the two are one unit
    after all: a head tied to the embeddings (a parameter counted in two parts: torchtitan
    and memplan's runtime then shard them together, kept whole, as the root unit is), or no
    part named like embeddings (``edge_refusal``)."""
    if not _has_lead(profile):
        return None
    if sum(_params(part) for part in profile.fixed) > root_params:
        return None  # tied
    lead_parts = [part for part in profile.fixed if first_stage_part(part)]
    lead_params = sum(_params(p) for p in lead_parts)
    lead_grads = min(sum(p.grad_bytes for p in lead_parts), root_grads)
    lead_float8 = sum(p.float8_param_bytes for p in lead_parts)
    all_float8 = sum(p.float8_param_bytes for p in profile.fixed)
    lead = EdgeBytes(params=lead_params, float8=lead_float8, grads=lead_grads)
    tail = EdgeBytes(
        params=root_params - lead_params,
        float8=all_float8 - lead_float8,
        grads=root_grads - lead_grads,
    )
    return lead, tail


def edge_gathered(
    segments: tuple[Segment, ...] | list[Segment],
    index: int,
    n_layers: int,
    started: bool,
    prefetch: int,
) -> tuple[bool, bool]:
    """(lead, tail): whether each edge unit is gathered at segment ``index`` (``started``:
    the backward has begun there). The lead: the segment before block 0's forward (the
    embeddings' forward), the backward's last segment (theirs), and block ``h``'s backward
    when ``h < prefetch`` (FSDP2 prefetches the next unit in backward order, the lead
    after block 0). The tail: the segment after the last block's forward, which holds the
    head's forward, the loss, and the head's backward up to its ``post_backward``."""
    segment = segments[index]
    h = segment.held
    if segment.active == "fwd":
        return False, False
    if segment.active == "bwd":
        return h < prefetch, False
    if h == n_layers and not started:
        return n_layers == 0, True
    return h == 0, False
