"""What the solver is asked and what it answers: SolveRequest (validated field by field; it
carries the effective batch, in samples or tokens, the sequence length and the parallel layout,
so that ``memplan.solver.solve`` is the one entry point), LayoutRequest, Candidate and
SolveResult. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from memplan import memory
from memplan.devices import DeviceSpec
from memplan.errors import BadInputError
from memplan.files.schema import LARGEST_INT
from memplan.memory import Reserve
from memplan.modes import parse_modes
from memplan.parallel import (
    FSDP_UNITS,
    KEPT_OUTPUTS,
    SCHEDULES,
    STAGE_SPLITS,
    FsdpUnits,
    KeptOutputs,
    Parallel,
    Schedule,
    StageSplit,
)
from memplan.plan import STRATEGIES, GradSync, Plan
from memplan.profile.seqlen import DEFAULT_SEQ_MULTIPLE
from memplan.timing import TimingMode

_TIMING_MODES = ("auto", "measured", "roofline")
STRATEGY_CHOICES = (*STRATEGIES, "auto")


BN_MIN_MICRO = 16
"""The smallest micro-batch a BatchNorm model is planned with unless told otherwise
(``--bn-min-micro``, ``--allow-small-bn-micro``)."""


class SolveRequestError(BadInputError, ValueError):
    """A SolveRequest field is invalid (a ValueError naming the field; exit code 2)."""


def _positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _refuse_absurd(request: object, names: tuple[str, ...]) -> None:
    """Integers over 2**62, which no plan file may hold (memplan.files.schema): named here as
    the user's input, not found later as memplan's own unreadable plan (exit 3)."""
    for name in names:
        value = getattr(request, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > LARGEST_INT:
            raise SolveRequestError(
                f"{name} {value} is absurdly large (over 2**62, the largest integer a plan holds).",
                hint="Check the number: budgets are bytes per rank (e.g. 80GiB), batches are "
                "samples or tokens, degrees and micro-batches are counts.",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutRequest:
    """Which parallel layouts to consider (memplan.solver.parallel)."""

    tp: int | None = None
    """Fixed tensor-parallel degree; None: searched (``auto``) or 1."""
    pp: int | None = None
    cp: int | None = None
    auto: bool = False
    """Search every factorisation of the world size for the degrees not fixed."""
    gpus_per_node: int = 8
    """TP (× CP) stays within a node: at most this many ranks."""
    schedule: Schedule = "1f1b"
    sequence_parallel: bool | None = None
    """None: on with TP in ``auto`` (less memory, the same bytes moved), off otherwise."""
    virtual_stages: int = 1
    loss_parallel: bool | None = None
    """None: on with TP where the model's TP plan splits its head (torchtitan's default,
    Megatron's only way); False: logits gathered whole on every TP rank."""
    kept_outputs: KeptOutputs = "none"
    """Which pipeline stages the engine lets keep every micro-batch's output to the step's
    end (``Parallel.kept_outputs``): ``none`` as memplan's runtime and torch 2.13 with
    ``return_outputs=False`` run; set for a run of another engine version."""
    stage_split: StageSplit = "memplan"
    """Which rule divides the blocks into pipeline stages (``Parallel.stage_split``):
    memplan's own, or a torchtitan version's default split."""
    fsdp_units: FsdpUnits = "memplan"
    """How FSDP groups the parameters outside the blocks (``Parallel.fsdp_units``):
    memplan's one root unit, or torchtitan's since July 2025."""

    def __post_init__(self) -> None:
        _refuse_absurd(self, ("tp", "pp", "cp", "gpus_per_node", "virtual_stages"))
        for name in ("tp", "pp", "cp"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise SolveRequestError(f"--{name} must be a positive integer, got {value!r}.")
        if not _positive_int(self.gpus_per_node):
            raise SolveRequestError(
                f"--gpus-per-node must be a positive integer, got {self.gpus_per_node!r}."
            )
        if self.schedule not in SCHEDULES:
            raise SolveRequestError(
                f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}."
            )
        if not _positive_int(self.virtual_stages):
            raise SolveRequestError(
                f"--virtual-stages must be a positive integer, got {self.virtual_stages!r}.",
                hint="Give 1, or 2 or more with --schedule interleaved_1f1b.",
            )
        if self.kept_outputs not in KEPT_OUTPUTS:
            raise SolveRequestError(
                f"kept_outputs must be one of {', '.join(KEPT_OUTPUTS)}, got {self.kept_outputs!r}."
            )
        if self.stage_split not in STAGE_SPLITS:
            raise SolveRequestError(
                f"--stage-split must be one of {', '.join(STAGE_SPLITS)}, got {self.stage_split!r}."
            )
        if self.fsdp_units not in FSDP_UNITS:
            raise SolveRequestError(
                f"--fsdp-units must be one of {', '.join(FSDP_UNITS)}, got {self.fsdp_units!r}."
            )
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise SolveRequestError(
                f"--virtual-stages {self.virtual_stages} needs --schedule interleaved_1f1b "
                f"(the {self.schedule} schedule runs one stage per pipeline rank).",
                hint="Add --schedule interleaved_1f1b, or drop --virtual-stages.",
            )


def layout_request(
    layout: str | None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    gpus_per_node: int = 8,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    sequence_parallel: bool | None = None,
    loss_parallel: bool | None = None,
    stage_split: str = "memplan",
    fsdp_units: str = "memplan",
) -> LayoutRequest | None:
    """The layout asked for by ``--layout``, ``--tp``, ``--pp``, ``--cp`` and the pipeline
    options, validated; None for data parallelism alone (no degree, no ``--layout``, memplan's
    FSDP units)."""
    if layout is not None and layout != "auto":
        raise SolveRequestError(f"--layout takes auto, got {layout!r}.", hint="Use --layout auto.")
    if schedule not in SCHEDULES:
        raise SolveRequestError(
            f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}."
        )
    if layout is None and tp is None and pp is None and cp is None and fsdp_units == "memplan":
        # (an engine's FSDP units make a layout of data parallelism alone); the options are
        # still checked, all of them together, so that a careless --virtual-stages -3 or
        # --stage-split bogus is not silently dropped (before, only two were, and against
        # the default schedule: --schedule interleaved_1f1b --virtual-stages 2 was told to
        # add --schedule interleaved_1f1b)
        LayoutRequest(
            gpus_per_node=gpus_per_node,
            schedule=schedule,  # type: ignore[arg-type]
            virtual_stages=virtual_stages,
            stage_split=stage_split,  # type: ignore[arg-type]
        )
        return None
    return LayoutRequest(
        tp=tp,
        pp=pp,
        cp=cp,
        auto=layout == "auto",
        gpus_per_node=gpus_per_node,
        schedule=schedule,  # type: ignore[arg-type]
        sequence_parallel=sequence_parallel,
        virtual_stages=virtual_stages,
        loss_parallel=loss_parallel,
        stage_split=stage_split,  # type: ignore[arg-type]
        fsdp_units=fsdp_units,  # type: ignore[arg-type]
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveRequest:
    """What to plan for. Sizes are per rank; ``target_batch`` is the global effective batch.
    Exactly one of ``target_batch`` and ``tokens_per_batch`` is given."""

    target_batch: int | None = None
    """Effective batch: micro-batch × accumulation steps × world size, exactly."""
    tokens_per_batch: int | None = None
    """Effective batch in tokens instead (packed samples of ``seq_len`` tokens: the length
    given, else the profile's)."""
    seq_len: int | Literal["max"] | None = None
    """Plan at this many tokens per sample, or ``max``: the longest step of ``seq_multiple``
    with a plan (memplan.solver.seqlen). None: the profile's own batches."""
    seq_multiple: int = DEFAULT_SEQ_MULTIPLE
    """Step of ``seq_len="max"``, in tokens."""
    layout: LayoutRequest | None = None
    """Tensor, pipeline and context parallel layouts to search (memplan.solver.parallel);
    None: data parallelism over ``world_size``."""
    budget_bytes: int
    """Device memory one rank may use."""
    world_size: int = 1
    """Data-parallel ranks."""
    strategy: str = "ddp"
    """``ddp``, ``zero1``, ``zero2``, ``fsdp``, or ``auto`` (the least-sharded strategy that
    fits; see the module doc)."""
    margin: float = memory.DEFAULT_MARGIN
    """Fraction of the budget kept free; predicted peaks must stay within the rest."""
    min_micro: int = 1
    max_micro: int | None = None
    """Largest micro-batch to consider; None: target_batch / world_size."""
    always_checkpoint: tuple[str, ...] = ()
    """Layer names (or globs) that are checkpointed in every plan."""
    never_checkpoint: tuple[str, ...] = ()
    """Layer names (or globs) that are never checkpointed."""
    bn_min_micro: int = BN_MIN_MICRO
    """Smallest micro-batch for a model with BatchNorm (statistics use the micro-batch)."""
    allow_small_bn_micro: bool = False
    device_spec: DeviceSpec | None = None
    """GPU to plan for: adds the CUDA reserve, and times a meta profile by roofline."""
    device: str | None = None
    """Label for the plan's device; default: the spec's name, else the profile's device."""
    timing: TimingMode = "auto"
    """``auto``, ``measured`` or ``roofline`` (see memplan.retime.choose_timing_source)."""
    model_path: str | None = None
    """Model file named in the plan; default: the profile's (``path`` or ``path:factory``)."""
    profile_path: str = ""
    """The profile file named in the plan."""
    modes: tuple[str, ...] | None = None
    """Modes a layer may take (memplan.modes; ``keep`` is always allowed). None: every mode
    the profile and device support (``selective`` when the probe measured it, ``offload``
    when planning for CUDA)."""
    host_memory_bytes: int | None = None
    """Host memory the offloaded layers of one rank may take together; None: no limit."""
    reshard_after_forward: bool = True
    """FSDP: free a unit's gathered parameters after its forward (False for a pipeline
    stage's rank, as torchtitan and memplan's runtime shard stages: ``Sharding``)."""
    edge_units: bool = False
    """FSDP: the parts outside the blocks sharded as torchtitan's two units (``Sharding.
    edge_units``; a layout with ``fsdp_units`` torchtitan-2507 and no pipeline stages)."""
    reduce_after_schedule: bool = False
    """FSDP: gradients reduce-scatter once, after the whole pipeline schedule (True for a
    pipeline stage's rank: ``Sharding``)."""
    data_parallel_bandwidth: float | None = None
    """Bytes per second per rank of the data-parallel collectives; None: the device spec's
    interconnect. The layout search sets it from where each layout's data-parallel group
    lies (``solver.parallel.data_parallel_bandwidth``: NVLink within a node, the NICs
    between nodes)."""
    communicators: int | None = None
    """NCCL communicators a rank belongs to, for the CUDA reserve (``memory.reserve_for``);
    None: one when the data-parallel world spans two or more ranks. The layout search sets
    each stage's from its layout (``memory.parallel.communicators``), as the plan's peak does."""

    def __post_init__(self) -> None:
        _refuse_absurd(
            self,
            (
                "target_batch",
                "tokens_per_batch",
                "seq_len",
                "seq_multiple",
                "budget_bytes",
                "world_size",
                "min_micro",
                "max_micro",
                "bn_min_micro",
                "host_memory_bytes",
            ),
        )
        if self.modes is not None:
            object.__setattr__(self, "modes", parse_modes(self.modes))
        if self.host_memory_bytes is not None and (
            isinstance(self.host_memory_bytes, bool)
            or not isinstance(self.host_memory_bytes, int)
            or self.host_memory_bytes < 0
        ):
            raise SolveRequestError(
                f"host_memory_bytes must be a non-negative integer, got {self.host_memory_bytes!r}."
            )
        if (self.target_batch is None) == (self.tokens_per_batch is None):
            raise SolveRequestError(
                "Give the effective batch once: --target-batch (samples) or --tokens-per-batch "
                "(tokens, with --seq-len); in Python target_batch or tokens_per_batch."
            )
        if self.layout is not None and (
            self.seq_len is not None or self.tokens_per_batch is not None
        ):
            raise SolveRequestError(
                "--seq-len and --tokens-per-batch are not yet planned with a parallel layout.",
                hint="Probe at the length you train at and solve the layout without them.",
            )
        if self.seq_len is not None and self.seq_len != "max" and not _positive_int(self.seq_len):
            raise SolveRequestError(
                f"seq_len must be a positive number of tokens or 'max', got {self.seq_len!r}."
            )
        batch = ("target_batch",) if self.target_batch is not None else ()
        for name in (*batch, "world_size", "min_micro", "bn_min_micro", "budget_bytes"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise SolveRequestError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_micro is not None:
            if isinstance(self.max_micro, bool) or not isinstance(self.max_micro, int):
                raise SolveRequestError(f"max_micro must be an integer, got {self.max_micro!r}.")
            if self.max_micro < self.min_micro:
                raise SolveRequestError(
                    f"max_micro ({self.max_micro}) must be >= min_micro ({self.min_micro})."
                )
        if problem := memory.margin_problem(self.margin):  # named as the flag (scripts: margin=)
            raise SolveRequestError(f"--{problem}.")
        for name in ("always_checkpoint", "never_checkpoint"):
            value = getattr(self, name)
            names = (value,) if isinstance(value, str) else tuple(value)
            if not all(isinstance(item, str) and item for item in names):
                raise SolveRequestError(f"{name} must be layer names, got {value!r}.")
            object.__setattr__(self, name, names)
        both = sorted(set(self.always_checkpoint) & set(self.never_checkpoint))
        if both:
            raise SolveRequestError(
                f"always_checkpoint and never_checkpoint both name {', '.join(both)}."
            )
        if self.strategy not in STRATEGY_CHOICES:
            raise SolveRequestError(
                f"strategy must be one of {', '.join(STRATEGY_CHOICES)}, got {self.strategy!r}."
            )
        if self.timing not in _TIMING_MODES:
            raise SolveRequestError(
                f"timing must be one of {', '.join(_TIMING_MODES)}, got {self.timing!r}."
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One row of the table behind the choice: the best plan at one micro-batch."""

    micro_batch: int
    accumulation_steps: int
    feasible: bool
    """Fits the budget and is allowed (not below the BatchNorm floor)."""
    fits: bool
    """Fits the budget (allowed or not)."""
    chosen: bool
    checkpoint_layers: tuple[str, ...]
    """Layers not kept in the least-cost assignment that fits; when nothing fits, in the
    assignment of least peak."""
    n_checkpointed: int
    peak_bytes: int
    """Predicted peak of that set (when nothing fits: the least any set needs)."""
    step_seconds: float
    samples_per_second: float
    peak_phase: str
    note: str
    """Why it was or was not chosen."""
    strategy: str = "ddp"
    """Data-parallel strategy of this row (one row per strategy and micro-batch)."""
    grad_sync: GradSync = "last_micro_step"
    """FSDP with accumulation: when gradients are reduce-scattered (one row per way)."""
    checkpoint: dict[str, str] = field(default_factory=dict)
    """Layer -> mode for the layers in ``checkpoint_layers``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveResult:
    plan: Plan
    candidates: tuple[Candidate, ...]
    """One row per micro-batch that divides the target, in increasing micro-batch."""
    usable_budget_bytes: int
    """Budget less the margin: the most a predicted peak may be."""
    reserve: Reserve
    timing_source: str
    seq: Any = None
    """With a sequence length: the search over lengths (memplan.solver.seqlen.SeqSolve,
    whose ``result`` is this one without it); None without one. (``Any``: the searches
    over lengths and layouts import this module, not the other way round.)"""
    once_seconds: float = 0.0
    """Of the plan's step, what runs once per step, not per micro-batch: the optimizer step
    and the data-parallel collectives (a pipeline's bubble does not stretch them)."""
    layouts: tuple[Any, ...] = ()
    """With a layout: every layout and micro-batch that fits
    (``LayoutOption``); ``candidates`` is then empty."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutOption:
    """One layout at one micro-batch: every stage solved."""

    parallel: Parallel
    micro_batch: int
    micro_batches: int
    stages: tuple[SolveResult, ...]
    step_seconds: float
    comm_seconds: dict[str, float]
    bubble: float

    @property
    def peak_bytes(self) -> int:
        return max(s.plan.predicted.peak_bytes for s in self.stages)

    @property
    def worst_stage(self) -> int:
        peaks = [s.plan.predicted.peak_bytes for s in self.stages]
        return peaks.index(max(peaks))
