"""The Profile: everything the probe measured about one model, as frozen data.

No torch here: the probe builds a Profile, the memory model, timing model and solver read
it, and YAML stores it (schema-versioned, strict). All byte and second quantities that grow
with the micro-batch ``b`` are ``Affine`` fits over the probed sizes.

How the memory timeline works (docs/design.md, "The profile"): the probe records live
bytes after every op of a training micro-step. Candidate layers (the checkpointable blocks)
run once each, in order, so every point of the step lies in a *segment* described by

* ``held`` — how many candidate layers have finished their forward and not begun their
  backward (always layers ``0 .. held-1``), and
* ``active`` — whether layer ``held`` itself is running its forward (``fwd``), its backward
  (``bwd``), or no layer is running (``none``: embeddings, head, loss, optimizer glue).

For a checkpoint set ``C`` the live bytes at a point are the no-checkpoint bytes minus the
``savings_bytes`` of every layer in ``C`` that is held. A checkpointed active layer behaves
differently from a plain one (it saves nothing in forward; it recomputes in backward), so an
active segment also carries ``ckpt_points`` measured from an all-checkpointed run and
normalised to the same reference (all-checkpointed live bytes plus the savings of the held
layers). Hence, for every segment::

    peak_segment(b, C) = max(points(b) if active layer not in C else ckpt_points(b))
                         - sum(savings_bytes_j(b) for j < held if j in C)

With per-layer modes (memplan.modes) the same holds with each mode's own points and
savings: ``selective_points`` and ``selective_savings_bytes`` from an all-selective run;
offload reads the plain points and the full checkpoint's savings (memplan.memory).

and the peak of the micro-step is the maximum over segments (memplan.memory does this).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from memplan.model.reference import ModelRef

PROFILE_SCHEMA_VERSION = 2
"""2: optional ``seq_len`` and ``seq`` (a probe over sequence lengths, memplan.profile.seqlen).
1 (still read, unchanged): neither."""

Device = Literal["cpu", "cuda", "meta"]
Precision = Literal["fp32", "bf16", "fp16"]
Phase = Literal["no_grads", "grads_resident"]
Active = Literal["none", "fwd", "bwd"]
MixedPrecision = Literal["autocast", "params"]
"""How a bf16/fp16 step was run: ``autocast`` over fp32 parameters (single device, DDP), or
``params``: parameters cast to the compute dtype for the step and fp32 master weights kept
elsewhere, as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` does
(activations, gathered parameters and unsharded gradients in bf16)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Affine:
    """``value(b) = intercept + slope * b`` fitted over the probed micro-batch sizes."""

    intercept: float
    """Value at micro-batch 0 (bytes or seconds)."""
    slope: float
    """Increase per sample."""
    residual: float = 0.0
    """Largest |measured − fitted| / max(|measured|, 1) over the probed sizes."""

    def at(self, batch: int | float) -> float:
        return self.intercept + self.slope * batch

    @staticmethod
    def constant(value: float) -> Affine:
        return Affine(intercept=float(value), slope=0.0)

    @staticmethod
    def zero() -> Affine:
        return Affine(intercept=0.0, slope=0.0)


def affine_scale(value: Affine, factor: float) -> Affine:
    """``value`` times ``factor`` (its residual kept)."""
    return Affine(
        intercept=value.intercept * factor, slope=value.slope * factor, residual=value.residual
    )


def affine_sum(*values: Affine) -> Affine:
    """The sum of ``values`` (no residual)."""
    return Affine(intercept=sum(v.intercept for v in values), slope=sum(v.slope for v in values))


def affine_sub(a: Affine, b: Affine) -> Affine:
    """``a`` less ``b`` (no residual)."""
    return Affine(intercept=a.intercept - b.intercept, slope=a.slope - b.slope)


# A timeline point: (intercept_bytes, slope_bytes_per_sample). Plain tuples keep profiles
# with thousands of points small in YAML.
Point = tuple[float, float]


def point_at(point: Point, batch: int | float) -> float:
    return point[0] + point[1] * batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """Live-byte points between two layer boundaries of one micro-step (see module doc)."""

    held: int
    """Number of candidate layers whose forward finished and backward has not begun."""
    active: Active
    """What layer ``held`` is doing in this segment."""
    points: tuple[Point, ...]
    """Undominated live-byte points of the no-checkpoint run."""
    ckpt_points: tuple[Point, ...] = ()
    """For active segments: undominated points of the all-checkpointed run, normalised by
    adding the savings of the ``held`` layers before it. Empty for ``active == 'none'``."""
    selective_points: tuple[Point, ...] = ()
    """For active segments: the same from the all-selective run (memplan.modes), normalised
    by the held layers' ``selective_savings_bytes``. Empty when not measured."""
    shared_live: tuple[int, ...] = ()
    """Indices into ``Profile.shared_inputs`` of the shared inputs the plain run still held
    at the segment's end (the model's own frame during the forward, an op that saved one):
    alive whatever is checkpointed. Any other shared input is alive here only while a
    checkpoint of one of its layers keeps it (memplan.memory.terms.shared_extra_bytes)."""

    def __post_init__(self) -> None:
        if self.held < 0:
            raise ValueError(f"held must be >= 0, got {self.held}")
        if not self.points:
            raise ValueError("points must not be empty")
        if self.active != "none" and not self.ckpt_points:
            raise ValueError("an active segment needs ckpt_points")


TpStyle = Literal["colwise", "rowwise"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TpGemm:
    """One linear of a block that the model's TP plan splits, as one of its three GEMMs
    (forward, input gradient, weight gradient) sees it, per sample of the micro-batch and
    whole (TP degree 1); weights left out. Each of the three reads or writes one activation
    operand that TP leaves whole on a rank (colwise: the input, rowwise: the output, whose
    partial sums TP reduces afterwards) and one that it splits, and takes the same FLOPs, so
    at degree t a rank's GEMMs take 1/t of the FLOPs but move ``whole + split/t`` elements:
    a narrow projection (a key/value head's) turns memory-bound (memplan.solver.tp_gemms)."""

    style: TpStyle
    flops: float
    """FLOPs of each of the three GEMMs, per sample, whole."""
    whole: float
    """Elements per sample of the activation operand TP leaves whole."""
    split: float
    """Elements per sample of the activation operand TP splits, whole."""
    input_size: int = 2
    """Bytes an element of the GEMMs' inputs (2: bf16; 1: float8, torchao's casts)."""
    output_size: int = 2
    """Bytes an element of their outputs."""
    float8: bool = False
    """Run on float8 operands (at the spec's float8 rate)."""
    recomputed: bool = False
    """Re-run by selective checkpointing's recompute (every second counted matmul,
    memplan.modes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    """One checkpoint candidate (a repeated block), addressed by fully-qualified name."""

    name: str
    """Fully-qualified module name, e.g. ``transformer.h.3``."""
    module_type: str
    params_trainable_bytes: int
    params_frozen_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    input_bytes: Affine
    """Bytes of the layer's tensor inputs: what a checkpoint keeps."""
    output_bytes: Affine
    saved_bytes: Affine
    """Bytes its forward leaves alive (for backward, including its output)."""
    savings_bytes: Affine
    """Bytes freed by checkpointing it: saved_bytes(no ckpt) − saved_bytes(ckpt), measured."""
    fwd_transient_bytes: Affine
    """Peak above the level at the start of its forward."""
    bwd_transient_bytes: Affine
    """Peak above the level at the start of its backward (no checkpoint)."""
    recompute_transient_bytes: Affine
    """Peak above the level at the start of its backward when checkpointed (recompute+bwd)."""
    fwd_seconds: Affine
    bwd_seconds: Affine
    fwd_flops: Affine
    recompute_seconds: Affine | None = None
    """Measured extra time per micro-step when checkpointed: (forward + backward under
    checkpoint) − (forward + backward plain). The recompute is one more forward plus the
    checkpoint machinery's own cost (saved-tensor hooks, RNG state), which on small layers
    is as large as the forward. None (meta, older profiles): one forward is assumed."""
    selective_savings_bytes: Affine | None = None
    """Bytes freed while held under selective checkpointing (memplan.modes), measured as
    ``savings_bytes`` is but from an all-selective run; None when not measured."""
    selective_recompute_seconds: Affine | None = None
    """Measured extra time per micro-step under selective checkpointing; None: not
    measured."""
    tp_sharded_bytes: int = 0
    """Parameter bytes (whole, unsharded) that tensor parallelism splits over the TP ranks:
    the parameters the model's TP plan shards (memplan.run.tp_plan), as ``parallelize_module``
    left them on one rank of a TP-2 fake process group × 2. A rank of TP degree t holds
    ``params − tp_sharded_bytes·(1 − 1/t)``; gradients and optimizer state alike."""
    tp_saved_fraction: float | None = None
    """Share of ``saved_bytes`` inside the TP region (divided by the TP degree): the probe
    runs the block again under TP 2 on a fake process group and solves
    ``saved(t) = outside + inside/t`` from the two runs. None: not measured (no TP plan,
    or an older profile); the rest is the norm/residual region that only sequence parallel
    divides."""
    tp_selective_fraction: float | None = None
    """The same share of what the block keeps under selective checkpointing (``saved_bytes
    − selective_savings_bytes``: the matmul and attention outputs the policy keeps, most of
    them inside the TP region), measured the same way. None: not measured (no TP plan, no
    selective figures, or an older profile): a rank then keeps all of it."""
    float8_param_bytes: int = 0
    """Bytes of its parameters (as probed) that are weights of linears converted to float8
    (``Environment.float8``): what FSDP2 gathers at one byte an element under float8
    all-gather."""
    tp_gemms: tuple[TpGemm, ...] = ()
    """The linears the TP plan splits, in forward order, as their GEMMs' shapes (measured
    with ``tp_saved_fraction``); empty: not measured (no TP plan, or an older profile), and
    a TP rank's GEMMs are then charged 1/t of the whole block's time."""
    affine: bool = True
    """False when a quantity's fit residual exceeds the probe's tolerance: flagged, and
    extrapolation from it is not trusted."""
    has_batchnorm: bool = False
    fwd_clock: tuple[ClockMix, ...] = ()
    """A meta probe's clock over the layer's forward (``fwd_seconds``), in bins, at the
    smallest and the largest probed size; empty: not a meta probe, or an older profile."""
    bwd_clock: tuple[ClockMix, ...] = ()
    """The same over its backward (``bwd_seconds``)."""
    selective_clock: tuple[ClockMix, ...] = ()
    """The same over what selective checkpointing adds (``selective_recompute_seconds``);
    empty: not measured (then re-timed as its forward)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedInput:
    """A tensor made outside the candidate layers and passed to several of them (an
    attention mask, rotary cos/sin, position ids): a checkpoint of any of them keeps it
    until that layer's backward, once however many of them are checkpointed. Not part of
    any layer's ``savings_bytes``; the memory model charges it per segment."""

    bytes: Affine
    """Its storage's bytes."""
    layers: tuple[int, ...]
    """Indices of the candidate layers it is an input of, ascending."""


ClockKind = Literal["memory", "matmul", "float8_matmul", "attention", "attention_backward"]


ClockKind = Literal["memory", "matmul", "float8_matmul", "attention", "attention_backward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ClockShare:
    """A bin of a meta probe's clock (memplan.probe.roofline.Roofline) over one stretch of
    a micro-step: ops of one FLOP kind, run at one peak, whose FLOPs' and bytes' seconds
    stand within 2^(1/4) of one ratio; or the ops with no FLOPs. Another spec re-times the
    stretch from its bins (memplan.retime)."""

    kind: ClockKind
    """The spec efficiency their FLOPs ran at; ``memory``: ops with no FLOPs."""
    peak: Literal["fp32", "bf16", "fp16", "float8"] | None
    """The spec's peak their FLOPs ran at (None for ``memory``)."""
    flop_rate: float
    """Their FLOPs' achievable rate on the clock, FLOP/s (0 for ``memory``)."""
    memory_rate: float
    """The clock's achievable memory rate, bytes/s."""
    compute: float
    """Seconds of their FLOPs at ``flop_rate``."""
    memory: float
    """Seconds of their bytes at ``memory_rate`` (each op took the longer of its two)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClockMix:
    """A stretch of a meta probe's micro-step at one probed size, in bins."""

    micro_batch: int
    bins: tuple[ClockShare, ...]
    """By kind, peak, rate and their FLOPs' seconds over their bytes'."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FixedPart:
    """Everything outside the candidate layers (embeddings, head, loss), in execution order."""

    name: str
    module_type: str
    params_trainable_bytes: int
    params_frozen_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    saved_bytes: Affine
    fwd_seconds: Affine
    bwd_seconds: Affine
    fwd_flops: Affine
    tp_sharded_bytes: int = 0
    """Parameter bytes the TP plan splits (e.g. ``lm_head``, the embedding); see
    ``Layer.tp_sharded_bytes``."""
    float8_param_bytes: int = 0
    """Bytes of its parameters that are weights of linears converted to float8 (see
    ``Layer.float8_param_bytes``; 0 for the output head, which stays in bf16)."""


Float8Recipe = Literal["tensorwise", "rowwise"]
"""torchao's float8 training recipes (torchao/float8/config.py ``Float8LinearRecipeName``):
one dynamic scale per tensor (torchao's default ``Float8LinearConfig``, the recipe of
torchtitan's December 2024 runs), or one per row (torchtitan 0.3's only recipe)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Float8:
    """How a probe ran the model's linears in float8, as torchao's
    ``convert_to_float8_training`` converts them (memplan.probe.float8)."""

    recipe: Float8Recipe = "tensorwise"
    fsdp_float8_all_gather: bool = False
    """FSDP2 all-gathers the converted linears' weights in float8 (torchao's
    ``enable_fsdp_float8_all_gather``: 1 byte an element gathered, not 2; tensorwise only).
    A plan property: the single-process probe gathers nothing."""
    torchao_version: str = ""
    """The torchao that converted the model ("" when it was modelled without one)."""
    converted: int = 0
    """``nn.Linear`` modules converted to ``Float8Linear``."""
    converted_param_bytes: int = 0
    """Their weights' bytes as probed (in the compute dtype)."""
    skipped: tuple[str, ...] = ()
    """Linears left in the compute dtype, each as ``name: why`` (the filter's FQN, or a
    dimension not divisible by 16)."""
    modelled: tuple[str, ...] = ()
    """Parts of the float8 step that were modelled rather than run, each with its source;
    empty: everything ran."""


TIMING_ROUNDS = 5
"""Interleaved timing rounds per size of a cpu or cuda probe unless ``--timing-rounds``
says otherwise (memplan.probe.sizes.time_size)."""
MAX_TIMING_ROUNDS = 100
"""The most ``--timing-rounds`` takes: each round runs three micro-steps at every timed
size, and a median of 100 rounds is already steady; a typo of 10**6 would probe for days."""


def timing_rounds_problem(rounds: object) -> str | None:
    """What is wrong with ``rounds`` as a count of timing rounds, else None."""
    if isinstance(rounds, bool) or not isinstance(rounds, int):
        return f"{rounds!r} is not a whole number"
    if not 1 <= rounds <= MAX_TIMING_ROUNDS:
        return f"{rounds} is not from 1 to {MAX_TIMING_ROUNDS}"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Environment:
    torch_version: str
    memplan_version: str
    device: Device
    device_name: str
    """GPU name from NVML, ``cpu``, or ``meta (timed as <device profile>)``."""
    device_capacity_bytes: int | None = None
    device_profile: str | None = None
    """Name of the profiles/devices/ spec used for meta timing or capacity, if any (a spec
    file's absolute path)."""
    device_spec_digest: str | None = None
    """That spec's numbers, fingerprinted (memplan.devices.spec_digest): a spec file the
    profile was timed against is recognised wherever it is later (moved, renamed, another
    checkout), so its meta clock is kept. None: no spec, or written before memplan kept it."""
    precision: Precision = "fp32"
    optimizer_class: str = "AdamW"
    param_dtype: str = "float32"
    """Dtype of the parameters during the probed step (``bfloat16`` under ``params``)."""
    mixed_precision: MixedPrecision = "autocast"
    """``params``: probed with parameters in the compute dtype (no autocast), for sharded
    plans that run under the engine's mixed-precision policy; see ``MixedPrecision``."""
    float8: Float8 | None = None
    """The linears ran in float8 (``probe --precision float8``; ``precision`` is then the
    dtype of everything else, bf16); None: no float8."""
    compiled: bool = False
    """The meta clock timed the step as torch.compile runs it (``probe --compiled``)."""
    timing_rounds: int | None = None
    """cpu and cuda: the interleaved timing rounds per probed size whose medians the times
    are (``probe --timing-rounds``, 5 unless given). None on meta (its clock is
    computed, not run) and in profiles written before memplan recorded it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Totals:
    params_trainable_bytes: int
    params_frozen_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    cached_bytes: int = 0
    """Tensors the model keeps from one step to the next outside its parameters and buffers
    (a rotary table cached in a Python dict): resident all step, as buffers are."""


NOT_CHECKPOINTABLE = "cannot be checkpointed"
"""Words of the warning a profile records when the probe left candidate layers out because
their recompute does not match their forward; the solver quotes it when a request names
one of them."""

LOSS_NOT_FINITE = "The training loss was "
"""How the warning a profile records for a NaN or infinite loss in a probe step begins;
the refusal of a profile fitted through two op paths quotes it (a NaN step takes its own)."""

BOUNDARIES_DIFFERED = "The layer boundaries differed between probed sizes"
"""How the probe's warning begins when the probed sizes ran different layer boundaries
(``memplan.probe.alignment``): the one case where it leaves segments out (those a size
lacks), so the one profile whose timeline the reader lets lack some (``profile.read``)."""

OP_SEQUENCE_DIFFERED = "op sequence differed"
"""Words of the warning a profile records when ``op_sequence_stable`` is False, which the
solver and the renderer look for, to say it once in their own words."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    schema_version: int = PROFILE_SCHEMA_VERSION
    model: ModelRef
    environment: Environment
    micro_batches: tuple[int, ...]
    """The probed micro-batch sizes."""
    totals: Totals
    layers: tuple[Layer, ...]
    fixed: tuple[FixedPart, ...]
    timeline: dict[str, tuple[Segment, ...]]
    """Per phase: ``no_grads`` (first micro-step, gradients absent) and ``grads_resident``
    (later micro-steps of an accumulation, gradients present)."""
    optimizer_step_peak_bytes: Affine
    """Absolute live-byte peak while the optimizer steps (params, grads, state, transient)."""
    optimizer_step_seconds: Affine
    step_fixed_seconds: Affine
    """Micro-step time outside the candidate layers (fwd + bwd of the fixed parts)."""
    allocator_reserve_bytes: int | None = None
    """CUDA only: max_memory_reserved − max_memory_allocated at the largest probed size."""
    context_bytes: int | None = None
    """CUDA only: process memory (NVML) − max_memory_reserved: CUDA context and kernels."""
    has_batchnorm: bool = False
    op_sequence_stable: bool = True
    """False when the op sequence differed between probed sizes (data-dependent routing):
    segment maxima, not points, were fitted; plans should be verified at their size. The
    probe records a warning saying so (``OP_SEQUENCE_DIFFERED`` in its text)."""
    warnings: tuple[str, ...] = ()
    deduplicated_layers: tuple[str, ...] = ()
    """Candidate layers not traced themselves: each is identical to an earlier one (same
    class, parameter shapes and dtypes, input shapes) and reuses its measurement; see
    ``memplan.probe.dedup``. Empty for a full probe."""
    extrapolated_layers: tuple[str, ...] = ()
    """Candidate layers whose numbers no probe measured: a meta probe proved them copies of
    one block (memplan.probe.sameness), probed the model with their run cut to 4, 5 and 6
    blocks, and derived them (and the whole profile) from those probes
    (memplan.probe.repeats). Empty: every layer was measured (no profile written before
    memplan recorded this field was extrapolated unless ``deduplicated_layers`` lists the
    run's middle blocks)."""
    extrapolation_declined: str | None = None
    """Why a meta probe that found a run of look-alike blocks did not take the shortcut
    and measured every block (the blocks were not shown to be the same, or the short probes
    did not extrapolate exactly). None: no such run, or the shortcut was taken."""
    seq_len: int | None = None
    """Tokens per sample of the batches these numbers describe: the length probed (the
    longest one, with ``seq``), or the length a profile was evaluated at
    (``memplan.profile.seqlen.profile_at``). None: the model file's own batches."""
    seq: SeqGrid | None = None
    """The probe at several sequence lengths (``memplan probe --seq-lens``); None: one."""
    max_seq_len: int | None = None
    """The longest sequence the model takes (its position embeddings: ``hf:`` configs'
    ``max_position_embeddings``), where known; ``solve`` plans no longer length. None:
    not known (a model file)."""
    tp_degree_divides: int | None = None
    """Every tensor-parallel degree must divide this: the greatest common divisor of the
    model's attention heads, key/value heads and the dimensions its TP plan splits (each TP
    rank holds whole heads and equal slices; memplan.run.tp_plan.tp_degree_divides). None:
    not known (no TP plan, or a profile written before memplan recorded it)."""
    hf_blocks: tuple[str, ...] = ()
    """The blocks Hugging Face's own ``gradient_checkpointing_enable()`` checkpoints (each
    module of a ``_no_split_modules`` class that transformers checkpoints), by
    fully-qualified name; empty for a model that is not a transformers model."""
    fixed_clock: tuple[ClockMix, ...] = ()
    """A meta probe's clock over the micro-step outside the layers (``step_fixed_seconds``:
    the fixed parts, the loss), in bins, at the smallest and the largest probed size; empty
    (or a layer's clock empty): not a meta probe, or a profile written before memplan
    recorded it (then another spec re-times it from FLOPs and bytes per layer)."""
    shared_inputs: tuple[SharedInput, ...] = ()
    """Tensors made outside the candidate layers and passed to several of them; segments
    name those the plain run holds (``Segment.shared_live``). Empty: none, or a profile
    written before memplan recorded them (its savings then charge each layer its own)."""
    pipeline_refused: str | None = None
    """Why memplan cannot run this model under pipeline stages (no pipeline plan, tied
    embeddings, or a split whose stages do not compute the model's forward:
    ``memplan.run.parallel.pipeline_refusal``); None: it can, or not known (an older
    profile). ``solve`` plans no ``pp > 1`` for it."""
    tp_refused: str | None = None
    """Why memplan cannot run this model under tensor parallelism (no TP plan, or its blocks
    fail under one); None: it can, or not known. ``solve`` plans no ``tp > 1`` for it."""
    ddp_refused: str | None = None
    """Why DDP (and ZeRO-1, which runs over it) cannot train this model on several ranks:
    its forward made parameters' gradients (a loss that runs a backward of its own, as
    ``memplan.run.losses.chunked_cross_entropy`` and torchtitan's ``ChunkedLossWrapper``
    do), which DDP's reducer refuses ("Expected to mark a variable ready only once");
    None: it can, or not known (an older profile). ``solve`` refuses ``--strategy ddp`` and
    ``zero1`` for it and tries only FSDP under ``auto``."""

    def __post_init__(self) -> None:
        if self.schema_version != PROFILE_SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version} is not {PROFILE_SCHEMA_VERSION}"
            )
        if len(self.micro_batches) < 1 or any(b < 1 for b in self.micro_batches):
            raise ValueError("micro_batches must be positive sizes")
        for phase in ("no_grads", "grads_resident"):
            if phase not in self.timeline:
                raise ValueError(f"timeline must have phase '{phase}'")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names must be unique")
        for phase, segments in self.timeline.items():
            for seg in segments:
                if seg.held > len(self.layers) or (
                    seg.active != "none" and seg.held >= len(self.layers)
                ):
                    raise ValueError(f"timeline.{phase}: segment held={seg.held} out of range")

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def device(self) -> str:
        return self.environment.device


@dataclass(frozen=True, kw_only=True, slots=True)
class SeqGrid:
    """A profile per probed sequence length, for ``memplan.profile.seqlen`` to fit across lengths.
    Each holds the same layers, segments and timeline points in the same order (point i of
    a segment is the same op at every length), pruned together: a point is dropped only
    where its fit in ``(b, s)`` is dominated at every ``b, s >= 0``."""

    seq_lens: tuple[int, ...]
    """The probed lengths, ascending."""
    profiles: tuple[Profile, ...]
    """One per length, in the same order; their own ``seq`` is None."""

    def __post_init__(self) -> None:
        if len(self.seq_lens) < 2 or list(self.seq_lens) != sorted(set(self.seq_lens)):
            raise ValueError("seq_lens must hold at least two distinct lengths, ascending")
        if any(s < 1 for s in self.seq_lens):
            raise ValueError("seq_lens must be positive")
        if len(self.profiles) != len(self.seq_lens):
            raise ValueError("profiles must hold one profile per length")
        if any(p.seq is not None for p in self.profiles):
            raise ValueError("profiles must not nest another seq grid")


def is_finite_affine(value: Affine) -> bool:
    return math.isfinite(value.intercept) and math.isfinite(value.slope)
