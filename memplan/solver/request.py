"""What the solver is asked and what it answers: SolveRequest (validated field by field), Candidate
and SolveResult. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan import memory
from memplan.devices import DeviceSpec
from memplan.errors import BadInputError
from memplan.memory import Reserve
from memplan.modes import parse_modes
from memplan.plan import STRATEGIES, GradSync, Plan
from memplan.timing import TimingMode

_TIMING_MODES = ("auto", "measured", "roofline")
STRATEGY_CHOICES = (*STRATEGIES, "auto")


class SolveRequestError(BadInputError, ValueError):
    """A SolveRequest field is invalid (a ValueError naming the field; exit code 2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolveRequest:
    """What to plan for. Sizes are per rank; ``target_batch`` is the global effective batch."""

    target_batch: int
    """Effective batch: micro-batch × accumulation steps × world size, exactly."""
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
    bn_min_micro: int = 16
    """Smallest micro-batch for a model with BatchNorm (statistics use the micro-batch)."""
    allow_small_bn_micro: bool = False
    device_spec: DeviceSpec | None = None
    """GPU to plan for: adds the CUDA reserve, and times a meta profile by roofline."""
    device: str | None = None
    """Label for the plan's device; default: the spec's name, else the profile's device."""
    timing: TimingMode = "auto"
    """``auto``, ``measured`` or ``roofline`` (see memplan.timing.choose_timing_source)."""
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

    def __post_init__(self) -> None:
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
        for name in ("target_batch", "world_size", "min_micro", "bn_min_micro", "budget_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SolveRequestError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_micro is not None:
            if isinstance(self.max_micro, bool) or not isinstance(self.max_micro, int):
                raise SolveRequestError(f"max_micro must be an integer, got {self.max_micro!r}.")
            if self.max_micro < self.min_micro:
                raise SolveRequestError(
                    f"max_micro ({self.max_micro}) must be >= min_micro ({self.min_micro})."
                )
        if problem := memory.margin_problem(self.margin):
            raise SolveRequestError(f"{problem}.")
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
