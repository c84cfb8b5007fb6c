"""What the layout search says: why the chosen layout won over the others (its reasons),
and, when none fits, what to try, told from what was searched and why a degree was not.
No torch."""

from __future__ import annotations

from memplan.memory import usable_budget_bytes
from memplan.memory.parallel import tp_measured
from memplan.parallel import Parallel, pipeline_refusal_by_kind
from memplan.profile import Profile
from memplan.solver.batches import divisors
from memplan.solver.request import LayoutOption, LayoutRequest, SolveRequest
from memplan.units import format_bytes


def layout_reasons(best: LayoutOption, options: list[LayoutOption]) -> list[str]:
    """The chosen layout, and against the fastest layout of another TP (PP) degree what its
    own degree does: memory, collectives and step, both figures side by side."""
    p = best.parallel
    out = [
        f"layout {p.describe()}: micro-batch {best.micro_batch}, {best.micro_batches} "
        f"{'pipeline micro-batch' if p.pp > 1 else 'accumulation step'}"
        f"{'' if best.micro_batches == 1 else 'es' if p.pp > 1 else 's'} per step; worst "
        f"rank (stage {best.worst_stage}) {format_bytes(best.peak_bytes)}; step "
        f"{best.step_seconds * 1e3:.1f} ms" + (f", bubble {best.bubble:.0%}" if p.pp > 1 else "")
    ]
    if p.pp > 1:
        peaks = ", ".join(
            f"{s}: {format_bytes(r.plan.predicted.peak_bytes)}" for s, r in enumerate(best.stages)
        )
        out.append(f"every stage's peak per rank ({p.schedule}): {peaks}")
    for dim in ("tp", "pp"):
        others = [o for o in options if getattr(o.parallel, dim) != getattr(p, dim)]
        if not others:
            continue
        alt = min(others, key=lambda o: o.step_seconds)
        mine, theirs = getattr(p, dim), getattr(alt.parallel, dim)
        what = (
            "each block's activations and TP-split weights divide by it"
            if dim == "tp"
            else "each rank holds fewer blocks; the bubble and the in-flight micro-batches grow with it"
        )
        out.append(
            f"{dim} {mine} over {dim} {theirs}: {what}; "
            f"{collectives_difference(best.comm_seconds[dim] - alt.comm_seconds[dim])}; peak "
            f"{format_bytes(best.peak_bytes)} vs "
            f"{format_bytes(alt.peak_bytes)}, step {best.step_seconds * 1e3:.1f} vs "
            f"{alt.step_seconds * 1e3:.1f} ms ({alt.parallel.describe()}, micro-batch "
            f"{alt.micro_batch})"
        )
    return out


def collectives_difference(extra_seconds: float) -> str:
    """What one degree's collectives take per step beside another's, in words: more, less,
    or the same to the tenth of a millisecond."""
    if abs(extra_seconds) < 0.05e-3:
        return "its collectives take the same time to the tenth of a millisecond"
    more = "more" if extra_seconds > 0 else "less"
    return f"its collectives take {abs(extra_seconds) * 1e3:.1f} ms {more} per step"


ONE_SHARD = "shard"
"""The kind of reason (``candidate_layouts``' ``why``) that says what to do itself."""


def one_shard(profile: Profile, degrees: str, shards: int) -> str:
    """Why ``degrees`` were left out of a profile probed with FSDP's mixed-precision
    policy: one shard, and what to do (the hint adds nothing to it)."""
    precision = profile.environment.precision
    return (
        f"{degrees} leaves {shards} data-parallel shard, and the profile was probed with "
        f"{precision} parameters (--mixed-precision params), which only FSDP's mixed-precision "
        "policy over 2 or more shards runs: give more ranks, a smaller degree, or probe again "
        f"with --precision {precision} (autocast) to plan one shard"
    )


Least = tuple[int, Parallel, int] | None
"""The least per-rank peak a search needs, with its layout and micro-batch; None: none ran."""


def no_layout_hint(
    profile: Profile,
    request: SolveRequest,
    ask: LayoutRequest,
    layouts: list[Parallel],
    *,
    least: Least = None,
    smaller: Least = None,
    more: Least = None,
    strategy: str = "fsdp",
) -> str:
    """What to try when none of ``layouts`` (those searched) fits: where the search had no
    layout with TP (stages), why; then the search where the degrees were fixed, a larger
    fixed degree where one could run, and the asks any plan has, each where it was tried
    and helps: ``smaller``, the least peak at the smallest target every layout splits
    (``--target-batch`` the world), where it fits; ``more``, at twice the ranks (the same
    batch a rank), where it needs less than ``least``, what the search needed; a larger
    budget always. Under DDP, where more ranks do not help, that the model state is whole
    on every rank. Before, more ranks and a smaller target were offered whatever they did."""
    world, notes, tries = request.world_size, [], []
    if ask.auto and not ask.tp and max((p.tp for p in layouts), default=1) == 1:
        notes.append(_why_no_tp(profile, world, ask.gpus_per_node, ask.cp or 1))
    if ask.auto and not ask.pp and max((p.pp for p in layouts), default=1) == 1:
        notes.append(_why_no_pp(profile, world))
    if not ask.auto:
        tries.append("--layout auto, to search every tp × pp × dp of the ranks")
    heads = profile.tp_degree_divides
    if ask.tp and any(
        ask.tp < t <= ask.gpus_per_node and not (heads and heads % t)
        for t in _degrees_beside(world, ask.pp, ask.cp)
    ):
        tries.append("a larger --tp")
    if ask.pp and any(
        ask.pp < p <= len(profile.layers) for p in _degrees_beside(world, ask.tp, ask.cp)
    ):
        tries.append("a larger --pp")
    limit = usable_budget_bytes(request.budget_bytes, request.margin)
    helps = more is not None and least is not None and more[0] < least[0]
    if helps:
        tries.append(f"more ranks ({2 * world} need {format_bytes(more[0])} a rank)")
    if smaller is not None and smaller[0] <= limit and request.target_batch != world:
        tries.append(f"a smaller --target-batch ({world} needs {format_bytes(smaller[0])})")
    tries.append("a larger --budget")
    if strategy == "ddp" and not helps:
        notes.append(
            "DDP keeps every parameter, gradient and optimizer state whole on each "
            "data-parallel rank, so more ranks alone do not shrink them: --strategy fsdp shards "
            "them (a profile probed with --mixed-precision params), or, without --layout, "
            "--strategy zero1 or zero2"
        )
    return "".join(f"{note[0].upper()}{note[1:]}. " for note in notes) + (
        "Try " + "; ".join(tries) + "."
    )


def _degrees_beside(world: int, *fixed: int | None) -> list[int]:
    """The degrees a dimension can take beside the other fixed ones: the divisors of the
    ranks they leave (none where they do not divide the world)."""
    other = 1
    for degree in fixed:
        other *= degree or 1
    return divisors(world // other) if world % other == 0 else []


def _why_no_tp(profile: Profile, world: int, gpus_per_node: int, cp: int) -> str:
    """Why the search had no TP degree above 1, and what would give it one (beside a fixed
    ``--cp``, TP divides the ranks cp leaves)."""
    if profile.tp_refused:
        return f"tensor parallelism was not searched ({profile.tp_refused})"
    if not tp_measured(profile):
        return (
            "tensor parallelism was not searched: the profile has no TP measurement (probe "
            "the model again; a model with a TP plan is measured under TP 2)"
        )
    ranks = world // cp if world % cp == 0 else 1
    within = [t for t in divisors(ranks) if 1 < t <= gpus_per_node]
    if not within:
        these = (
            f"the {ranks} of {world} ranks that --cp {cp} leaves" if cp > 1 else f"{world} ranks"
        )
        return (
            f"tensor parallelism was not searched: no degree from 2 to --gpus-per-node "
            f"{gpus_per_node} divides {these}; a multiple of {gpus_per_node * cp} ranks lets "
            "TP split the blocks"
        )
    heads = profile.tp_degree_divides
    if heads and all(heads % t for t in within):
        return (
            f"tensor parallelism was not searched: the degrees that divide {ranks} ranks "
            f"within a node ({', '.join(map(str, within))}) do not divide the model's {heads} "
            "(the greatest common divisor of its heads, key/value heads and split dimensions)"
        )
    return (
        "tensor parallelism was not searched: with it, fewer than 2 ranks would shard the "
        "state, which a profile probed under FSDP's mixed-precision policy needs"
    )


def _why_no_pp(profile: Profile, world: int) -> str:
    """Why the search had no pipeline degree above 1, and what would give it one."""
    why = profile.pipeline_refused or pipeline_refusal_by_kind(
        profile.model.spec, profile.hf_blocks
    )
    if why:
        return f"pipeline stages were not searched ({why.rstrip('.')})"
    n = len(profile.layers)
    return (
        f"pipeline stages were not searched: no degree from 2 to the model's {n} blocks "
        f"divides {world} ranks"
    )
