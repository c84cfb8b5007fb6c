"""The solver: micro-batch × accumulation × checkpoint set, exact under the model. No torch.

For every data-parallel strategy asked for (``ddp``, ``zero1``, ``zero2``, ``fsdp``; ``auto``
tries them all) and every micro-batch ``b`` with ``b × k × world == target`` it finds the
checkpoint set of least recompute time whose predicted per-rank peak fits the budget (less
the margin), then picks the plan with the least predicted step time, communication included
(the effective batch is fixed, so that is the least time per effective batch). Ties: fewer
checkpointed layers, then the larger micro-batch; within one micro-batch, among sets of
equal time and size, the one checkpointing earlier layers (they are held longest).

``auto`` takes the least-sharded strategy for which any plan fits (sharding costs
communication, and every rank's state depends on every other), then the fastest plan of that
strategy; when a more sharded strategy would be faster (it fits with less recompute or a
larger micro-batch), the reasons say so and by how much.

FSDP with accumulation is tried both ways (``memplan.plan.GradSync``): reduce-scatter on the
last micro-step only (unsharded gradients until then, one reduce-scatter) and on every
micro-step (sharded gradients, k reduce-scatters); the faster one that fits wins, and the
reasons give the other's peak and time. A profile probed with ``--mixed-precision params``
plans FSDP only: that is the engine whose mixed-precision policy it measured.

Why it is exact and fast (docs/design.md, "The solver"): with ``P_h`` the savings of the
checkpointed layers before layer h, every point of the step is a lower bound on a prefix
sum, ``P_h >= point − limit``, whose point depends only on whether layer h itself is
checkpointed (memplan.memory.StepBounds). So a left-to-right DP over layers whose state is
``P`` is exact: a state with more savings and less cost dominates. Each layer's cost is an
integer (picoseconds) and ties are broken through the same integer key, so the DP's choice
is exactly brute force's. States that cannot be completed are dropped (``R[h]``, exact), and
``P`` is capped where every completion is feasible, which merges states.

The package, one job per module: ``entry`` (``solve``, the one entry point: a request that
carries the batch, the length and the layout, sent to the search that answers it),
``request`` (what is asked and answered), ``batches``
(splitting the target batch), ``layer_modes`` (the per-layer DP), ``options`` (one option
evaluated), ``search`` (``solve_batch`` and ``least_peak`` at one batch), ``seqlen`` (over sequence
lengths), ``parallel`` (over parallel layouts), ``explain`` (reasons, warnings and
candidates), ``no_fit`` (the no-fit error and its hints) and ``compare`` (one request on
several profiles of a model, the fastest that fits: ``solve --compare``).
"""

from memplan.solver.entry import solve
from memplan.solver.layer_modes import least_cost_modes, least_recompute_set
from memplan.solver.options import MANY_MICRO_BATCHES
from memplan.solver.request import (
    STRATEGY_CHOICES,
    Candidate,
    LayoutRequest,
    SolveRequest,
    SolveRequestError,
    SolveResult,
    layout_request,
)
from memplan.solver.search import LeastPeak, has_plan, least_peak, solve_batch, solve_if_fits

__all__ = [
    "MANY_MICRO_BATCHES",
    "STRATEGY_CHOICES",
    "Candidate",
    "LayoutRequest",
    "LeastPeak",
    "SolveRequest",
    "SolveRequestError",
    "SolveResult",
    "has_plan",
    "layout_request",
    "least_cost_modes",
    "least_peak",
    "least_recompute_set",
    "solve",
    "solve_batch",
    "solve_if_fits",
]
