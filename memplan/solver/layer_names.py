"""Checkpoint candidates by name: ``--always-checkpoint`` / ``--never-checkpoint`` names
and globs resolved against a profile's layers (each refused name said with the valid ones),
cut to a pipeline stage's blocks, and layer lists written short. No torch."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Sequence

from memplan.errors import BadInputError
from memplan.profile import NOT_CHECKPOINTABLE, Profile
from memplan.solver.request import SolveRequest
from memplan.suggest import did_you_mean


def resolve_layers(profile: Profile, names: Iterable[str], field: str) -> frozenset[int]:
    index = {name: i for i, name in enumerate(profile.layer_names)}
    chosen, unknown = set(), []
    for name in names:
        if name in index:
            chosen.add(index[name])
        elif any(ch in name for ch in "*?[") and (hits := fnmatch.filter(index, name)):
            chosen.update(index[hit] for hit in hits)
        else:
            unknown.append(name)
    if unknown:
        valid = list(profile.layer_names)
        shown = ", ".join(valid[:20]) + (f", … ({len(valid)} in all)" if len(valid) > 20 else "")
        maybe = did_you_mean(sorted(unknown), valid)
        maybe = f" {maybe}" if maybe else ""
        left_out = _left_out(profile, unknown)
        if left_out:
            maybe = f" {left_out}"
        raise BadInputError(
            f"{field} names unknown layer(s): {', '.join(map(repr, unknown))}.",
            hint=f"Valid layer names: {shown or '(the profile has no checkpoint candidates)'}."
            f"{maybe}",
        )
    return frozenset(chosen)


def forced_layers(profile: Profile, request: SolveRequest) -> tuple[frozenset[int], frozenset[int]]:
    """The layers ``request`` always and never checkpoints, by index,
    each name or glob checked against ``profile``'s candidates; naming one layer in both
    lists is refused."""
    forced_in = resolve_layers(profile, request.always_checkpoint, "always_checkpoint")
    forced_out = resolve_layers(profile, request.never_checkpoint, "never_checkpoint")
    if forced_in & forced_out:
        raise BadInputError(
            "always_checkpoint and never_checkpoint both match "
            f"{', '.join(layer_names_of(profile, forced_in & forced_out))}.",
            hint="Name each layer in one of them only.",
        )
    return forced_in, forced_out


def on_stage(request: SolveRequest, layer_names: Sequence[str]) -> SolveRequest:
    """``request`` with its always and never lists cut to the names and globs that match one
    of ``layer_names``, a pipeline stage's blocks (checked against the whole model first,
    ``forced_layers``): before, each stage refused the other stages' names as unknown, and
    a glob had to match on every stage."""
    if not request.always_checkpoint and not request.never_checkpoint:
        return request

    def here(names: Sequence[str]) -> tuple[str, ...]:
        return tuple(
            name
            for name in names
            if name in layer_names
            or (any(ch in name for ch in "*?[") and fnmatch.filter(layer_names, name))
        )

    return dataclasses.replace(
        request,
        always_checkpoint=here(request.always_checkpoint),
        never_checkpoint=here(request.never_checkpoint),
    )


def _left_out(profile: Profile, unknown: list[str]) -> str:
    """Why the probe left named modules out of the candidates, when it did: its warning
    that their recompute does not match their forward (they are fixed parts now)."""
    fixed = {part.name for part in profile.fixed}
    named = [name for name in unknown if name in fixed]
    said = [w for w in profile.warnings if NOT_CHECKPOINTABLE in w]
    if not (named and said):
        return ""
    return (
        f"{', '.join(named)}: the probe left {'it' if len(named) == 1 else 'them'} out of "
        f"the candidates, and no plan can checkpoint {'it' if len(named) == 1 else 'them'} "
        f"(the profile's warning: {said[0]})."
    )


def layer_names_of(profile: Profile, indices: Iterable[int]) -> tuple[str, ...]:
    layers = profile.layers
    return tuple(layers[i].name for i in sorted(indices))


def short_list(names: Sequence[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]}, {names[1]}, …, {names[-1]}"
