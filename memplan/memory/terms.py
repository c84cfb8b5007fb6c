"""One process's terms: parameters, gradients, optimizer state, timeline points and savings per
micro-batch, per-layer modes, and a segment's peak under a checkpoint assignment. No torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from memplan.errors import BadInputError
from memplan.memory.memo import by_identity
from memplan.modes import FULL, KEEP, MODES, OFFLOAD, SELECTIVE
from memplan.profile import Affine, Phase, Point, Profile, Segment
from memplan.profile.arrays import layer_values, rounded_ints

# Bound used where a layer has no segment of some kind: lower than any byte count.
NO_BOUND = -(1 << 100)

PHASE_NO_GRADS: Phase = "no_grads"
PHASE_GRADS_RESIDENT: Phase = "grads_resident"
OPTIMIZER_STEP = "optimizer_step"


# --------------------------------------------------------------------------- terms
def params_bytes(profile: Profile) -> int:
    """Parameters (trainable and frozen), buffers and the tensors the model caches between
    steps: resident all step."""
    t = profile.totals
    return t.params_trainable_bytes + t.params_frozen_bytes + t.buffer_bytes + t.cached_bytes


def grads_bytes(profile: Profile) -> int:
    """Gradients of the trainable parameters, when all of them exist."""
    return profile.totals.grad_bytes


def optimizer_state_bytes(profile: Profile) -> int:
    """Optimizer state (AdamW: two moments): resident all step after the first."""
    return profile.totals.optimizer_state_bytes


def point_bytes(point: Point, micro_batch: int) -> int:
    """Live bytes at a timeline point, rounded up."""
    return math.ceil(point[0] + point[1] * micro_batch)


def affine_bytes(value: Affine, micro_batch: int) -> int:
    """An affine byte count at ``micro_batch``, rounded up."""
    return math.ceil(value.at(micro_batch))


def savings_bytes(profile: Profile, micro_batch: int) -> tuple[int, ...]:
    """Per layer: bytes freed while it is held if it is checkpointed, rounded down."""
    fast = rounded_ints(layer_values(profile, "savings_bytes", micro_batch), "floor")
    if fast is not None:
        return fast
    return tuple(math.floor(layer.savings_bytes.at(micro_batch)) for layer in profile.layers)


# --------------------------------------------------------------------------- modes
# With per-layer modes (memplan.modes) the segment formula reads, for a mode per layer μ:
#
#     peak_segment(b, μ) = max(points_μ(active)(b)) − Σ_{j < held} savings_μ(j), j(b)
#
# keep: plain points, no saving; full: ckpt_points and savings_bytes (the all-checkpointed
# run); selective: selective_points and selective_savings_bytes (the all-selective run,
# normalised the same way); offload: plain points (its forward and backward hold at most
# what the plain run holds: tensors leave for the host after they are saved and come back
# one autograd node at a time) and the full checkpoint's savings (the layer's input may
# stay alive on the device as the previous layer's output; counting it as kept is safe).
# Each mode's points and savings are per layer, independent of the other layers' modes,
# so the solver's DP over prefix savings stays exact.
Checkpointed = Iterable[int | str] | Mapping[int | str, str]
"""Layers to checkpoint: indices or names (meaning ``full``), or a mapping to modes."""


def mode_of(checkpointed: Iterable[int] | Mapping[int, str], layer: int) -> str:
    """The mode of ``layer`` in a set (members are ``full``) or a mapping (absent: keep)."""
    if isinstance(checkpointed, Mapping):
        return checkpointed.get(layer, KEEP)
    return FULL if layer in checkpointed else KEEP  # type: ignore[operator]


def layer_modes(profile: Profile, checkpointed: Checkpointed) -> dict[int, str]:
    """Layer index -> mode for every layer not kept, from indices or names (``full``) or a
    mapping of indices or names to modes."""
    pairs = (
        list(checkpointed.items())
        if isinstance(checkpointed, Mapping)
        else [(item, FULL) for item in checkpointed]
    )
    indices = layer_indices(profile, [name for name, _ in pairs])
    del indices  # validates every name
    index = _name_index(profile) if any(isinstance(item, str) for item, _ in pairs) else {}
    out: dict[int, str] = {}
    for item, mode in pairs:
        if mode not in MODES:
            raise BadInputError(
                f"Layer {item!r} has mode {mode!r}.", hint=f"Modes are {', '.join(MODES)}."
            )
        i = index[item] if isinstance(item, str) else int(item)
        if mode != KEEP:
            out[i] = mode
    return dict(sorted(out.items()))


def has_selective(profile: Profile) -> bool:
    """Whether the probe measured the ``selective`` mode (every layer and active segment)."""
    if not profile.layers or any(layer.selective_savings_bytes is None for layer in profile.layers):
        return False
    return all(
        seg.selective_points
        for segments in profile.timeline.values()
        for seg in segments
        if seg.active != "none"
    )


def available_modes(profile: Profile) -> tuple[str, ...]:
    """The modes this profile measured (offload, which depends on the device planned for,
    aside): keep and full, and selective when the probe ran it."""
    return (KEEP, SELECTIVE, FULL) if has_selective(profile) else (KEEP, FULL)


def mode_savings_bytes(profile: Profile, micro_batch: int, mode: str) -> tuple[int, ...]:
    """Per layer: bytes freed while it is held in ``mode``, rounded down."""
    if mode == KEEP:
        return (0,) * len(profile.layers)
    if mode in (FULL, OFFLOAD):
        return savings_bytes(profile, micro_batch)
    if mode == SELECTIVE:
        if not has_selective(profile):
            raise BadInputError(
                "This profile has no measurement of the selective mode.",
                hint="Probe the model again with this memplan, or leave selective out of --modes.",
            )
        fast = rounded_ints(layer_values(profile, "selective_savings_bytes", micro_batch), "floor")
        if fast is not None:
            return fast
        return tuple(
            math.floor(layer.selective_savings_bytes.at(micro_batch))  # type: ignore[union-attr]
            for layer in profile.layers
        )
    raise ValueError(f"unknown mode {mode!r}")


def offload_host_bytes(profile: Profile, micro_batch: int) -> tuple[int, ...]:
    """Per layer: bytes an offloaded layer copies to host memory (and back) per micro-step:
    everything its forward saves for backward, rounded up (more than the device frees, which
    is safe for both the host-memory cap and the copy time)."""
    fast = rounded_ints(layer_values(profile, "saved_bytes", micro_batch), "ceil")
    if fast is not None:
        return tuple(max(value, 0) for value in fast)
    return tuple(max(affine_bytes(layer.saved_bytes, micro_batch), 0) for layer in profile.layers)


# --------------------------------------------------------------------------- shared inputs
# A tensor made outside the layers and passed to several of them (profile.SharedInput: a
# mask, rotary cos/sin) is kept by a checkpoint of each of them until that layer's
# backward, but it is one tensor: kept once however many of them are checkpointed, and not
# at all where the plain run holds it anyway (``Segment.shared_live``: the model's frame
# during the forward, an op that saved it). So it is no part of any layer's savings; a
# segment adds
#
#     Σ_T bytes_T(b) · [T not in shared_live] · [some layer j of T is not kept, and is held
#                                                (j < held) or in its backward (j = held)]
#
# to ``peak_segment`` (the probe takes the same term with every layer checkpointed off the
# checkpointed points). Not additive over layers: the solver's bounds charge it to every
# layer of T instead (``shared_charge_bytes``), which never predicts less.
def shared_extra_bytes(
    profile: Profile,
    segment: Segment,
    micro_batch: int,
    checkpointed: Iterable[int] | Mapping[int, str],
) -> int:
    """What the shared inputs add at ``segment`` under a checkpoint assignment."""
    total = 0
    live = segment.shared_live
    h, bwd = segment.held, segment.active == "bwd"
    for i, shared in enumerate(profile.shared_inputs):
        if i in live:
            continue
        if any(
            (j < h or (bwd and j == h)) and mode_of(checkpointed, j) != KEEP for j in shared.layers
        ):
            total += affine_bytes(shared.bytes, micro_batch)
    return total


def shared_charge_bytes(profile: Profile, micro_batch: int) -> tuple[int, ...]:
    """Per layer: the bytes of the shared inputs it takes that some segment after it (held
    beyond it) lacks in ``shared_live``, each charged in full: the solver's safe, additive
    stand-in for ``shared_extra_bytes``."""
    charge = [0] * len(profile.layers)
    segments = [seg for phase in profile.timeline.values() for seg in phase]
    for i, shared in enumerate(profile.shared_inputs):
        lacking = [seg.held for seg in segments if i not in seg.shared_live]
        for j in shared.layers:
            if any(h > j for h in lacking):
                charge[j] += affine_bytes(shared.bytes, micro_batch)
    return tuple(charge)


# --------------------------------------------------------------------------- autocast casts
# Under autocast (bf16/fp16 over fp32 parameters) a layer's forward casts its weights, and
# autocast's weight-cast cache holds those casts until the forward region is left. A plain
# layer's autograd then keeps them until its backward; a checkpointed (or selective) layer's
# go with the cache, so they are freed when the forward ends. The probe measures a layer's
# savings at its forward's end, where both runs still hold them: ``savings_bytes`` lacks
# them, and the all-checkpointed run's backward points, normalised by those savings, lack
# every held layer's casts. Where the active layer's checkpoint runs its backward next to
# kept layers, those kept layers' casts are added back (measured: 294,912 B, three kept timm
# ViT blocks' bf16 weights, with the last block checkpointed). The casts are read from the
# profile as the batch-independent part of what the plain forward keeps that the
# checkpointed forward still holds at its end: ``saved.intercept − savings.intercept``,
# autocast's cache holding parameters only (batch-independent).
@by_identity(64)
def autocast_cast_bytes(profile: Profile, mode: str = FULL) -> tuple[int, ...]:
    """Per layer: the weight casts autocast's cache holds through its forward, which a plain
    layer keeps until its backward and a layer in ``mode`` (full, selective) does not;
    zeros off autocast (fp32, or parameters in the compute dtype)."""
    env = profile.environment
    if env.precision not in ("bf16", "fp16") or env.mixed_precision != "autocast":
        return (0,) * len(profile.layers)
    out = []
    for layer in profile.layers:
        savings = (
            layer.selective_savings_bytes
            if mode == SELECTIVE and layer.selective_savings_bytes is not None
            else layer.savings_bytes
        )
        saved = max(layer.saved_bytes.intercept, 0.0)
        out.append(math.ceil(min(max(saved - savings.intercept, 0.0), saved)))
    return tuple(out)


def cast_extra_bytes(
    profile: Profile,
    segment: Segment,
    checkpointed: Iterable[int] | Mapping[int, str],
) -> int:
    """What a backward segment adds under a checkpoint assignment: when its active layer is
    checkpointed (full or selective, whose points are the all-checkpointed run's), the
    autocast weight casts of the held layers that are kept (``autocast_cast_bytes``)."""
    if segment.active != "bwd":
        return 0
    h = segment.held
    mode = mode_of(checkpointed, h)
    if mode not in (FULL, SELECTIVE):
        return 0
    casts = autocast_cast_bytes(profile, mode)
    return sum(casts[j] for j in range(min(h, len(casts))) if mode_of(checkpointed, j) == KEEP)


def cast_charge_bytes(profile: Profile, segment: Segment, mode: str) -> int:
    """The solver's safe, additive stand-in for ``cast_extra_bytes``: every held layer's casts,
    as if all were kept (the solver's state is the held savings, not which layers are kept)."""
    if segment.active != "bwd" or mode not in (FULL, SELECTIVE):
        return 0
    return sum(autocast_cast_bytes(profile, mode)[: segment.held])


@by_identity(64)
def has_autocast_casts(profile: Profile) -> bool:
    """Whether ``autocast_cast_bytes`` has any non-zero layer (in full or selective)."""
    return any(autocast_cast_bytes(profile, FULL)) or (
        has_selective(profile) and any(autocast_cast_bytes(profile, SELECTIVE))
    )


def shared_own_bytes(profile: Profile, segment: Segment, micro_batch: int) -> int:
    """What the active layer's own checkpoint keeps of the shared inputs in its backward
    (those the plain run does not hold there)."""
    if segment.active != "bwd" or not profile.shared_inputs:
        return 0
    return sum(
        affine_bytes(shared.bytes, micro_batch)
        for i, shared in enumerate(profile.shared_inputs)
        if i not in segment.shared_live and segment.held in shared.layers
    )


def held_savings_bytes(savings: Sequence[int], checkpointed: frozenset[int], held: int) -> int:
    """Savings of the checkpointed layers among the ``held`` ones (layers 0 .. held-1)."""
    return sum(savings[j] for j in checkpointed if j < held)


def held_savings_prefix_bytes(savings: Sequence[int], checkpointed: frozenset[int]) -> list[int]:
    """``held_savings_bytes`` for every ``held`` from 0 to n at once."""
    prefix = [0]
    for j, saving in enumerate(savings):
        prefix.append(prefix[-1] + (saving if j in checkpointed else 0))
    return prefix


def held_mode_prefix_bytes(
    profile: Profile, micro_batch: int, checkpointed: Iterable[int] | Mapping[int, str]
) -> list[int]:
    """Held savings for every ``held`` from 0 to n, each layer in its own mode."""
    if not checkpointed:  # every layer kept: nothing saved
        return [0] * (len(profile.layers) + 1)
    per_mode: dict[str, tuple[int, ...]] = {}
    prefix = [0]
    for j in range(len(profile.layers)):
        mode = mode_of(checkpointed, j)
        if mode not in per_mode:
            per_mode[mode] = mode_savings_bytes(profile, micro_batch, mode)
        prefix.append(prefix[-1] + per_mode[mode][j])
    return prefix


def segment_points_bytes(
    segment: Segment, micro_batch: int, active_checkpointed: bool | str
) -> int:
    """Highest no-checkpoint-reference point of a segment, for the active layer's mode
    (``True``: full, ``False``: keep): the all-checkpointed points when it is checkpointed,
    the all-selective ones when selective, else the plain ones."""
    mode = (
        active_checkpointed
        if isinstance(active_checkpointed, str)
        else (FULL if active_checkpointed else KEEP)
    )
    points = segment.points
    if segment.active != "none":
        if mode == FULL:
            points = segment.ckpt_points
        elif mode == SELECTIVE:
            if not segment.selective_points:
                raise ValueError("segment has no selective_points")
            points = segment.selective_points
    # ceil is monotone: the ceiling of the highest point is the highest ceiling (one call,
    # not one per point: this is the solver's innermost loop)
    return math.ceil(max([a + s * micro_batch for a, s in points]))


def segment_peak_bytes(
    segment: Segment, micro_batch: int, checkpointed: frozenset[int], savings: Sequence[int]
) -> int:
    """``peak_segment(b, C)`` of profile.py's docstring."""
    top = segment_points_bytes(segment, micro_batch, segment.held in checkpointed)
    return top - held_savings_bytes(savings, checkpointed, segment.held)


def optimizer_step_peak_bytes(profile: Profile, micro_batch: int) -> int:
    """Live-byte peak of the optimizer step (params, grads, state and its transient)."""
    return affine_bytes(profile.optimizer_step_peak_bytes, micro_batch)


def phases_for(accumulation_steps: int) -> tuple[Phase, ...]:
    """Micro-step phases one optimizer step runs: with k = 1 gradients are never resident
    during a forward, so only the first-micro-step timeline applies."""
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    if accumulation_steps == 1:
        return (PHASE_NO_GRADS,)
    return (PHASE_NO_GRADS, PHASE_GRADS_RESIDENT)


def _name_index(profile: Profile) -> dict[str, int]:
    return {layer.name: i for i, layer in enumerate(profile.layers)}


def layer_indices(profile: Profile, layers: Iterable[int | str]) -> frozenset[int]:
    """Layer indices from indices or fully-qualified names."""
    layers = list(layers)
    index = _name_index(profile) if any(isinstance(item, str) for item in layers) else {}
    out = set()
    for item in layers:
        if isinstance(item, str) and item not in index:
            raise BadInputError(
                f"Layer {item!r} is not a checkpoint candidate of this profile.",
                hint="Its layers are: " + (", ".join(profile.layer_names) or "(none)") + ".",
            )
        i = index[item] if isinstance(item, str) else int(item)
        if not 0 <= i < len(profile.layers):
            raise IndexError(f"layer index {i} out of range")
        out.add(i)
    return frozenset(out)


def backward_started(segments: Sequence[Segment], index: int) -> bool:
    """Whether a backward segment comes at or before ``index``."""
    return _first_backward(segments) <= index


@by_identity(256)
def _first_backward(segments: Sequence[Segment]) -> int | float:
    """The index of the first backward segment (infinity without one)."""
    return next((i for i, seg in enumerate(segments) if seg.active == "bwd"), math.inf)


def grads_at_bytes(profile: Profile, phase: str, index: int | None) -> int:
    """Gradient bytes alive at a segment. Resident phases and the optimizer step hold all of
    them; the first micro-step holds those of the layers whose backward has finished (fixed
    parts' gradients counted once backward has reached a layer: an estimate, since fixed
    parts carry no position)."""
    if phase != PHASE_NO_GRADS or index is None:
        return grads_bytes(profile)
    segments = profile.timeline[phase]
    segment = segments[index]
    if not backward_started(segments, index):
        return 0
    first_done = segment.held + 1 if segment.active == "bwd" else segment.held
    after = _layer_grads_from(profile)  # after[i]: layers i.. n-1's gradients
    layer_grads = after[min(first_done, len(after) - 1)]
    fixed_grads = fixed_grads_bytes(profile)
    return layer_grads + (fixed_grads if segment.held < len(profile.layers) else 0)


def fixed_grads_bytes(profile: Profile) -> int:
    """Gradients outside the candidate layers (the fixed parts': FSDP's root unit)."""
    return max(grads_bytes(profile) - _layer_grads_from(profile)[0], 0)


@by_identity(256)
def _layer_grads_from(profile: Profile) -> tuple[int, ...]:
    """The candidate layers' gradient bytes from each layer on (``n + 1`` running sums, the
    last 0): what ``grads_at_bytes`` reads at every segment of every micro-batch."""
    sums = [0]
    for layer in reversed(profile.layers):
        sums.append(sums[-1] + layer.grad_bytes)
    return tuple(reversed(sums))
