"""What a check run returns: one ``CheckResult`` per check in a ``CheckReport``, plain data.

The exit code of a run (``CheckReport.exit_code``), the rule docs/ci.md documents:

* 1 when any check is over budget: the gate failed for a reason a person must act on, and
  that verdict stands whatever else went wrong;
* else 2 when any check could not be run because of its input: a model file that does not
  load, breaks the contract, raises, or ends its process (``sys.exit``, ``os._exit``), or a
  baseline that memplan will not write;
* else 3 when any check could not be measured here (the probe's ``CannotMeasureError``:
  no GPU for ``device: cuda``, an op without a meta kernel);
* else 0;
* 128 + N when signal N (SIGINT, SIGTERM) ended the run, after every report is written.

A check in ``error`` is 2 or 3 whatever code its error carried, so it never rolls up to 0.
Every check is always run and reported, whatever another check did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memplan.errors import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_MEASURE,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    MemplanError,
    exit_code_of,
)

Status = Literal["pass", "fail", "error"]


def _error_code(code: int) -> int:
    """A check in ``error`` is exit 3 (cannot measure) or 2 (anything else): never 0 or 1,
    whatever code the error carried."""
    return code if code == EXIT_CANNOT_MEASURE else EXIT_BAD_INPUT


def error_exit_code(exc: MemplanError) -> int:
    """The exit code of a check that ``exc`` put in ``error`` (``_error_code``)."""
    return _error_code(exit_code_of(exc))


GrowthKind = Literal["layer", "fixed", "total"]
Quantity = Literal[
    "params_bytes", "activation_bytes_per_sample", "grad_bytes", "optimizer_state_bytes"
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """The plan a passing check would use (or the closest plan of a failing one)."""

    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    checkpoint_layers: tuple[str, ...]
    n_layers: int
    checkpoint: tuple[tuple[str, str], ...] = ()
    """Each layer not kept and its mode (memplan.modes), in ``checkpoint_layers`` order: a
    baseline run's plan that turned a selective layer full shows here."""
    """Checkpoint candidates in the profile: ``len(checkpoint_layers)`` of ``n_layers``."""
    peak_bytes: int
    step_seconds: float
    peak_phase: str = ""
    """Where the peak happens, e.g. 'optimizer step', 'backward of blocks.0'."""
    breakdown: tuple[tuple[str, int], ...] = ()
    """Bytes at the peak by what holds them: params, grads, optimizer, activations,
    transient, reserve."""

    @property
    def checkpointed(self) -> int:
        return len(self.checkpoint_layers)


@dataclass(frozen=True, kw_only=True, slots=True)
class Growth:
    """One quantity that differs from the baseline profile."""

    name: str
    """Layer or fixed-part name, ``(total)`` for whole-model totals."""
    kind: GrowthKind
    quantity: Quantity
    baseline: float | None
    """None: the layer is new."""
    current: float | None
    """None: the layer is gone."""

    @property
    def delta(self) -> float:
        return (self.current or 0.0) - (self.baseline or 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    name: str
    status: Status
    model: str
    """As written in memplan.yaml."""
    device: str
    device_profile: str | None
    precision: str
    target_batch: int
    world_size: int
    budget_bytes: int
    margin: float
    min_peak_bytes: int | None = None
    """Least predicted peak of any plan for the target batch; None when not measured."""
    plan: PlanSummary | None = None
    """The plan it would use; on failure the closest plan, if the solver gave one."""
    baseline: str | None = None
    baseline_updated: bool = False
    baseline_note: str = ""
    """Why no comparison was made, or what differs in how the baseline was probed."""
    growth: tuple[Growth, ...] = ()
    """What grew (or shrank) since the baseline, largest first."""
    advice: tuple[str, ...] = ()
    message: str = ""
    """The error (status ``error``) or the solver's word on a failure."""
    exit_code: int = EXIT_OK
    probe_seconds: float = 0.0
    solve_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """Probe + solve: what a CI run spends on this check."""
        return self.probe_seconds + self.solve_seconds

    @property
    def usable_budget_bytes(self) -> int:
        return int(self.budget_bytes * (1 - self.margin))

    @property
    def headroom_bytes(self) -> int | None:
        if self.min_peak_bytes is None:
            return None
        return self.usable_budget_bytes - self.min_peak_bytes

    @property
    def exceeded_by_bytes(self) -> int | None:
        headroom = self.headroom_bytes
        return -headroom if headroom is not None and headroom < 0 else None

    @property
    def grown(self) -> tuple[Growth, ...]:
        return tuple(g for g in self.growth if g.delta > 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckReport:
    config: str
    results: tuple[CheckResult, ...]
    interrupted: int | None = None
    """The signal (SIGINT 2, SIGTERM 15) that ended the run early, else None: the results
    of the checks that finished are kept, and the others are errors saying so."""

    @property
    def passed(self) -> bool:
        return all(r.status == "pass" for r in self.results)

    @property
    def exit_code(self) -> int:
        """1 over budget, else 2 a check could not run, else 3 could not measure, else 0
        (the module docstring says why); 128 + N when signal N ended the run."""
        if self.interrupted is not None:
            return 128 + self.interrupted
        codes = {
            r.exit_code if r.status != "error" else _error_code(r.exit_code) for r in self.results
        }
        for code in (EXIT_OVER_BUDGET, EXIT_BAD_INPUT, EXIT_CANNOT_MEASURE):
            if code in codes:
                return code
        return EXIT_OK

    def count(self, status: Status) -> int:
        return sum(r.status == status for r in self.results)
