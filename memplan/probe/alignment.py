"""Reading runs across sizes: aligning op sequences, fitting each timeline point, the segments of a
phase and each layer's savings.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import torch

from memplan.probe.fitting import add_affine, fit_affine, fit_seconds, sum_affine
from memplan.probe.fitting import undominated as _undominated
from memplan.probe.recorder import StepRecord
from memplan.probe.session import Run, Series, SizeRuns
from memplan.probe.tracker import state_tensors, storages_bytes
from memplan.profile import BOUNDARIES_DIFFERED, Affine, Point, Segment, SharedInput

LAYOUT_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "clone", "contiguous", "expand",
    "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "slice", "select",
    "detach", "alias", "copy_", "empty_like", "_to_copy", "split", "split_with_sizes",
})  # fmt: skip
"""Ops whose presence can depend on the batch size without data-dependent routing: a
reshape of a size-1 dimension is a view at micro-batch 1 and a copy above it."""


# --------------------------------------------------------------------------- assembling
def fit_sizes(sizes: Sequence[int], values: Sequence[float]) -> Affine:
    return fit_affine(list(sizes), [float(v) for v in values])


def layer_seconds(record: StepRecord, j: int) -> float:
    """Forward plus backward of layer j in one timed micro-step."""
    x = record.layers[j]
    return x.fwd_t1 - x.fwd_t0 + backward_seconds(x.bwd_t0, x.bwd_t1)


def fit_time(sizes: Sequence[int], values: Sequence[float]) -> Affine:
    return fit_seconds(list(sizes), [float(v) for v in values])


def _align(ref_ops: list[str], values: list[int], ops: list[str]) -> list[tuple[int, bool]] | None:
    """``values`` (of a smaller size) aligned to the ops of the largest size, each with
    whether this size really ran that op. Where the two differ only by layout ops (a
    reshape that is a view at micro-batch 1 and a copy above it), a missing op gets the
    live bytes after the differing stretch (a view allocates nothing). None when they differ
    in anything else: the op sequence depends on the data."""
    if ops == ref_ops:
        return [(v, True) for v in values]
    out: list[tuple[int, bool]] = []
    matcher = difflib.SequenceMatcher(None, ref_ops, ops, autojunk=False)
    for tag, a1, a2, b1, b2 in matcher.get_opcodes():
        if tag == "equal":
            out.extend((v, True) for v in values[b1:b2])
        elif any(op not in LAYOUT_OPS for op in (*ref_ops[a1:a2], *ops[b1:b2])):
            return None
        else:
            after = values[b2 - 1] if b2 > b1 else values[max(b1 - 1, 0)]
            out.extend([(after, False)] * (a2 - a1))
    return out


def _fit_series(
    sizes: Sequence[int], series: Sequence[Series], excluded: set[int]
) -> tuple[list[Point], bool]:
    """Fit point i across sizes, aligned on the largest size's ops. A point that a size
    lacks is fitted from the sizes that have it when there are two; else from all, with the
    live bytes the lacking size had there (which over-estimates the slope: safe). When the
    sequences differ in more than layout ops the op sequence depends on the data: the
    segment maximum is fitted instead (second result False)."""
    _, ref_ops = series[-1]
    aligned = [_align(ref_ops, values, ops) for values, ops in series]
    if any(a is None for a in aligned):
        return _fit_series_maxima(sizes, series), False
    points = []
    for column in zip(*aligned, strict=True):  # type: ignore[misc]
        have = [(b, v) for b, (v, real) in zip(sizes, column, strict=True) if real]
        if len(have) < len(sizes):
            excluded.update(b for b, (_, real) in zip(sizes, column, strict=True) if not real)
            if len(have) < 2:
                have = [(b, v) for b, (v, _) in zip(sizes, column, strict=True)]
        fit = fit_sizes([b for b, _ in have], [v for _, v in have])
        points.append((fit.intercept, fit.slope))
    return points, True


def _fit_series_maxima(sizes: Sequence[int], series: Sequence[Series]) -> list[Point]:
    fit = fit_sizes(sizes, [max(values) for values, _ in series])
    return [(fit.intercept, fit.slope)]


def _nth_occurrences(
    segments: list[tuple[tuple[int, str], Series]],
) -> dict[tuple[int, str, int], Series]:
    seen: dict[tuple[int, str], int] = {}
    out = {}
    for key, values in segments:
        n = seen.get(key, 0)
        seen[key] = n + 1
        out[(*key, n)] = values
    return out


def shared_inputs(runs: Sequence[SizeRuns], warnings: list[str]) -> tuple[SharedInput, ...]:
    """The tensors made outside the layers that several layers take (the recorder's
    ``StepRecord.shared``), their bytes fitted across sizes. Every size and phase must see
    the same ones, taken by the same layers; else none, with a warning."""
    seen = [
        [sh.layers for sh in run.record.shared]
        for r in runs
        for run in (r.no_grads, r.grads_resident)
        if run.record is not None
    ]
    if not seen or any(s != seen[0] for s in seen):
        if any(seen):
            warnings.append(
                "The tensors several candidate layers share (a mask, rotary tables) differed "
                "between probed sizes; checkpointing subsets of those layers may be predicted wrong by their bytes: verify the plan."
            )
        return ()
    sizes = [r.size for r in runs]
    return tuple(
        SharedInput(
            bytes=fit_sizes(sizes, [r.no_grads.record.shared[i].nbytes for r in runs]),  # type: ignore[union-attr]
            layers=layers,
        )
        for i, layers in enumerate(seen[0])
    )


def _live_shared(run: Run, count: int) -> dict[tuple[int, str, int], frozenset[int]]:
    """Per segment occurrence of a plain run: the shared inputs still alive at its end."""
    record = run.record
    assert record is not None
    marks = record.marks
    seen: dict[tuple[int, str], int] = {}
    out = {}
    for k, mark in enumerate(marks):
        end = marks[k + 1].pos if k + 1 < len(marks) else len(run.values)
        key = (mark.held, mark.active)
        n = seen.get(key, 0)
        seen[key] = n + 1
        out[(*key, n)] = frozenset(
            i
            for i, sh in enumerate(record.shared[:count])
            if sh.freed_at is None or sh.freed_at >= end
        )
    return out


def kept_shared_affine(
    shared: Sequence[SharedInput], held: int, active: str, live: frozenset[int]
) -> Affine:
    """What the shared inputs not in ``live`` add at a segment when every layer is
    checkpointed: each one that a held layer (or the active one, in its backward) takes.
    The probe takes it off the all-checkpointed points; memplan.memory adds it back for the
    layers a plan checkpoints."""
    kept = [
        sh.bytes
        for i, sh in enumerate(shared)
        if i not in live and any(j < held or (active == "bwd" and j == held) for j in sh.layers)
    ]
    return sum_affine(kept)


def fit_timeline(
    sizes: list[int],
    plain: list[Run],
    ckpt: list[Run],
    savings: list[Affine],
    warnings: list[str],
    selective: list[Run] | None = None,
    selective_savings: list[Affine] | None = None,
    prune: bool = True,
    shared: Sequence[SharedInput] = (),
) -> tuple[tuple[Segment, ...], bool]:
    """``prune`` False keeps every point, in op order (memplan.probe.seqgrid prunes the
    points of several sequence lengths together). ``shared``: the shared inputs
    (``shared_inputs``); each segment names those the plain run holds at its end at every
    size, and the checkpointed points leave out what the others add."""
    undominated = _undominated if prune else tuple
    per_size = [run.segments() for run in plain]
    keys = [[key for key, _ in segs] for segs in per_size]
    stable = True
    if any(k != keys[0] for k in keys):
        # Different boundaries per size: align by (segment, occurrence) where possible.
        warnings.append(f"{BOUNDARIES_DIFFERED}; segments were aligned by occurrence.")
        stable = False
    plain_occ = [_nth_occurrences(segs) for segs in per_size]
    ckpt_occ = [_nth_occurrences(run.segments()) for run in ckpt]
    sel_occ = [_nth_occurrences(run.segments()) for run in selective] if selective else None
    order = list(plain_occ[-1].keys())
    live_occ = [_live_shared(run, len(shared)) for run in plain] if shared else []
    excluded: set[int] = set()
    segments = []
    for occ in order:
        held, active, _ = occ
        if not all(occ in p for p in plain_occ):
            stable = False
            continue
        points, ok = _fit_series(sizes, [p[occ] for p in plain_occ], excluded)
        stable &= ok
        live: frozenset[int] = frozenset()
        if shared:
            live = frozenset.intersection(*(lv.get(occ, frozenset()) for lv in live_occ))
        kept = kept_shared_affine(shared, held, active, live) if shared else Affine.zero()
        unkept = Affine(intercept=-kept.intercept, slope=-kept.slope)
        ckpt_points: tuple[Point, ...] = ()
        if active != "none":
            if all(occ in c for c in ckpt_occ):
                raw, ok = _fit_series(sizes, [c[occ] for c in ckpt_occ], excluded)
                stable &= ok
                shift = sum_affine([*savings[:held], unkept])
                ckpt_points = undominated([add_affine(p, shift) for p in raw])
            else:
                warnings.append(
                    f"segment held={held} {active} is missing from the "
                    "checkpointed run; its no-checkpoint points are used."
                )
                ckpt_points = undominated(points)
        sel_points: tuple[Point, ...] = ()
        if active != "none" and sel_occ is not None and selective_savings is not None:
            if all(occ in c for c in sel_occ):
                raw, ok = _fit_series(sizes, [c[occ] for c in sel_occ], excluded)
                stable &= ok
                shift = sum_affine([*selective_savings[:held], unkept])
                sel_points = undominated([add_affine(p, shift) for p in raw])
            else:
                sel_points = undominated(points)
        segments.append(
            Segment(
                held=held,
                active=active,
                points=undominated(points),
                ckpt_points=ckpt_points,
                selective_points=sel_points,
                shared_live=tuple(sorted(live)),
            )
        )
    # A size that runs different layout ops (a reshape that is a view only there): the
    # points it lacks are fitted from the other sizes; nothing for the user to do, so no
    # warning (verify measures the plan's own size).
    return tuple(segments), stable


def window_peak(values: list[int], start: int, stop: int, base: int) -> int:
    window = values[start:stop] if 0 <= start <= stop else []
    return max([base, *window]) - base


def grad_and_state_bytes(
    model: torch.nn.Module, optimizer: Any
) -> tuple[dict[int, int], dict[int, int]]:
    grads = {id(p): storages_bytes([p.grad]) for p in model.parameters() if p.grad is not None}
    state = {}
    for p in model.parameters():
        if p in optimizer.state:
            state[id(p)] = storages_bytes(state_tensors(optimizer.state[p]))
    return grads, state


def unique_params(module: torch.nn.Module, *, recurse: bool = True) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in module.parameters(recurse=recurse)}.values())


def backward_seconds(t0: float | None, t1: float | None) -> float:
    return (t1 - t0) if t0 is not None and t1 is not None else 0.0


def _same_sequence(a: Run, b: Run) -> bool:
    """Whether two runs (of different sizes) ran the same ops, segment by segment, up to
    layout ops (see ``_align``)."""
    if a.ops == b.ops:
        return True
    segs_a, segs_b = a.segments(), b.segments()
    if [k for k, _ in segs_a] != [k for k, _ in segs_b]:
        return False
    return all(
        _align(ops_a, values_b, ops_b) is not None
        for (_, (_, ops_a)), (_, (values_b, ops_b)) in zip(segs_a, segs_b, strict=True)
    )


def consistent_runs(runs: list[SizeRuns], warnings: list[str]) -> list[SizeRuns]:
    """The runs of the sizes that ran the same op sequence as most others, when one or more
    sizes ran a different one and at least two remain. ``nn.TransformerEncoderLayer``, for
    one, takes another path at micro-batch 1: that size tells nothing about the others, and
    fitting segment maxima instead of points would under-predict. A sequence that differs at
    every size (data-dependent routing) is left to ``fit_timeline``'s fallback."""
    if len(runs) < 3:
        return runs

    def same(a: SizeRuns, b: SizeRuns) -> bool:
        return all(
            _same_sequence(getattr(a, phase), getattr(b, phase))
            for phase in (
                "no_grads",
                "grads_resident",
                "ckpt_no_grads",
                "ckpt_grads_resident",
                *(("sel_no_grads", "sel_grads_resident") if a.sel_no_grads else ()),
            )
        )

    groups: list[list[SizeRuns]] = []
    for r in reversed(runs):  # larger sizes first: on a tie, the larger sizes win
        for group in groups:
            if same(group[0], r):
                group.append(r)
                break
        else:
            groups.append([r])
    best = max(groups, key=len)
    if len(groups) == 1 or len(best) < 2:
        return runs
    kept = sorted(best, key=lambda r: r.size)
    dropped = [r.size for r in runs if r not in kept]
    warnings.append(
        f"Micro-batch {', '.join(map(str, dropped))} ran a different op sequence from "
        f"{', '.join(str(r.size) for r in kept)} (a path taken only at that size); it was left "
        "out of the fits."
        + (
            f" The fits rest on two sizes, so they are unchecked (a line fits any two points): "
            f"probe a third size too (e.g. --micro-batches "
            f"{','.join(str(s) for s in (*(r.size for r in runs), 2 * runs[-1].size))})."
            if len(kept) == 2
            else ""
        )
    )
    return kept


def _late_difference(plain: list[tuple[int, bool]], ckpt: list[tuple[int, bool]], sign: int) -> int:
    """Bytes of the storages (matched by position) alive at the end of the forward in one
    run and not the other: ``sign`` 1 counts those only the plain run keeps, -1 those only
    the checkpointed run keeps."""
    if len(plain) != len(ckpt):
        return 0
    total = 0
    for (nbytes, alive_plain), (_, alive_ckpt) in zip(plain, ckpt, strict=True):
        if sign > 0 and alive_plain and not alive_ckpt:
            total += nbytes
        elif sign < 0 and alive_ckpt and not alive_plain:
            total -= nbytes
    return total


def measured_savings(r: SizeRuns, j: int, mode_run: str = "ckpt_no_grads") -> int:
    """What checkpointing layer j frees while it is held, measured: what its forward keeps
    beyond its inputs (plain minus checkpointed, at its forward's end), plus its outputs
    when, by the end of the forward, only the plain run still keeps them (a consumer that
    saves nothing, like interpolate or cat, lets the checkpointed outputs go once it ran),
    minus its inputs when only the checkpoint keeps them (an input that needs no gradient,
    from a frozen embedding, is kept by nothing else)."""
    plain, ckpt = r.no_grads.record, getattr(r, mode_run).record
    assert plain is not None and ckpt is not None
    x, y = plain.layers[j], ckpt.layers[j]
    own = (x.post_live - x.pre_live) - (y.post_live - y.pre_live)
    outputs = _late_difference(x.outputs_late, y.outputs_late, 1)
    inputs = _late_difference(x.inputs_late, y.inputs_late, -1)
    return own + outputs + inputs
