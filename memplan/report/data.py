"""What a report shows, as plain data: no torch, no matplotlib, no rich.

The predicted timeline is memplan's own memory model read segment by segment
(memplan.memory, the functions ``step_peak`` uses): for every segment of every phase the
live bytes are ``segment_points_bytes − held savings + per-rank adjustment``, plus the
reserve for that level. Its highest bar is therefore exactly the predicted peak, not a
redrawing of it. The split of each bar into parameters, gradients, optimizer state, saved
activations and transients is ``memory.breakdown_at`` (the total is exact, the split an
estimate, as in a plan's breakdown).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from memplan import host_link, memory, retime, timing
from memplan.devices import DeviceSpec
from memplan.memory import Reserve, Sharding
from memplan.modes import FULL, KEEP, OFFLOAD
from memplan.plan import Plan
from memplan.profile import Profile
from memplan.report import runs
from memplan.solver import Candidate

KINDS = ("params", "grads", "optimizer", "activations", "transient", "reserve")
"""The stacked kinds of a timeline bar, bottom to top (fields of memplan.plan.Breakdown)."""

KIND_LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "saved activations",
    "transient": "transient",
    "reserve": "CUDA reserve",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TimelineBar:
    """One segment of the step: the live bytes while it runs, split by kind."""

    micro_step: str
    """``micro-step 1``, ``micro-steps 2-4`` (gradients resident) or ``optimizer step``."""
    phase: str
    """``no_grads``, ``grads_resident`` or ``optimizer_step``."""
    segment_index: int | None
    """Index into ``profile.timeline[phase]``; None for the optimizer step."""
    where: str
    """In words, e.g. 'backward of h.3' (memory.describe_segment)."""
    active: str
    """``fwd``, ``bwd`` or ``none`` (no candidate layer running; also the optimizer step)."""
    layer: str | None
    """The candidate layer running (``active`` != none), else None."""
    checkpointed: bool
    """The running layer is checkpointed (its forward keeps only its input; its backward
    recomputes)."""
    after_forward: bool
    """The model's forward has returned here (head and loss after the last layer, the
    backward, the optimizer step): where a measured micro-step's ops after its forward go."""
    total_bytes: int
    """Predicted live bytes, reserve included."""
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    reserve: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    bars: tuple[TimelineBar, ...]
    peak_index: int
    """Index of the first bar reaching the peak (the model's own tie rule: first wins)."""
    micro_batch: int
    accumulation_steps: int

    @property
    def peak_bytes(self) -> int:
        return self.bars[self.peak_index].total_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerRow:
    """One candidate layer at the plan's micro-batch."""

    name: str
    module_type: str
    held_bytes: int
    """What its forward keeps alive for backward, not checkpointed."""
    savings_bytes: int
    """What its mode frees while it is held; for a kept layer, what full checkpointing
    would free."""
    recompute_seconds: float
    """Extra time per optimizer step in its mode (all micro-steps); for a kept layer, what
    full checkpointing would add."""
    checkpointed: bool
    mode: str = "keep"
    """The plan's mode for it (memplan.modes): keep, selective, full or offload."""
    count: int = 1
    """Alike consecutive layers this row stands for (``name`` then names the run, e.g.
    ``blocks.2–9998 × 9,997``); the numbers are each one's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredTimeline:
    """Live bytes after every op of one measured optimizer step (the tracker's count)."""

    micro_steps: tuple[tuple[int, ...], ...]
    """Per micro-step, in order (the optimizer step excluded)."""
    optimizer_step: tuple[int, ...]
    forward_ops: tuple[int | None, ...] = ()
    """Per micro-step: its ops before the model's forward returned (None: not seen); they
    are drawn over the forward's bars, the rest over the loss and backward."""
    label: str = "measured"
    """E.g. 'measured (cpu)', 'measured, rank 1 of 2 (worst)'."""

    @property
    def peak_bytes(self) -> int:
        values = [v for step in self.micro_steps for v in step] + list(self.optimizer_step)
        return max(values, default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    title: str
    profile: Profile | None
    """None when only the plan could be read (see ``plan_only_report``)."""
    plan: Plan | None
    timeline: Timeline
    layers: tuple[LayerRow, ...]
    candidates: tuple[Candidate, ...] = ()
    budget_bytes: int | None = None
    usable_bytes: int | None = None
    """Budget less the safety margin."""
    notes: tuple[str, ...] = ()
    measured: MeasuredTimeline | None = None


def predicted_timeline(
    profile: Profile,
    micro_batch: int,
    checkpointed: frozenset[int] | dict[int, str],
    accumulation_steps: int,
    *,
    reserve: Reserve = memory.NO_RESERVE,
    sharding: Sharding = memory.SINGLE,
) -> Timeline:
    """Every point of one optimizer step (memory.step_points, whose first highest is the
    step peak). With accumulation the gradients-resident micro-step is drawn once
    (micro-steps 2..k are identical)."""
    # ``checkpointed``: a set (full) or a mapping of layer index to mode (memplan.modes).
    names = profile.layer_names
    k = accumulation_steps
    bars: list[TimelineBar] = []
    first_bwd = {
        phase: next((i for i, s in enumerate(segs) if s.active == "bwd"), len(segs))
        for phase, segs in profile.timeline.items()
    }

    def bar(phase: str, index: int | None, label: str, allocated: int) -> TimelineBar:
        reserve_bytes = reserve.bytes_for(allocated)
        parts = memory.breakdown_at(
            profile,
            phase,
            index,
            micro_batch,
            checkpointed,
            allocated,
            reserve_bytes,
            sharding=sharding,
            accumulation_steps=k,
        )
        if index is None:
            active, layer, ckpt, where, after = "none", None, False, "optimizer step", True
        else:
            segments = profile.timeline[phase]
            segment = segments[index]
            active = segment.active
            layer = names[segment.held] if active != "none" else None
            ckpt = active != "none" and segment.held in checkpointed
            where = memory.describe_segment(profile, phase, index, checkpointed)
            after = segment.held == len(names) or index >= first_bwd[phase]
        return TimelineBar(
            micro_step=label,
            phase=phase,
            segment_index=index,
            where=where,
            active=active,
            layer=layer,
            checkpointed=ckpt,
            after_forward=after,
            total_bytes=allocated + reserve_bytes,
            params=parts.params,
            grads=parts.grads,
            optimizer=parts.optimizer,
            activations=parts.activations,
            transient=parts.transient,
            reserve=parts.reserve,
        )

    points = memory.step_points(profile, micro_batch, checkpointed, k, sharding=sharding)
    for point, run in _highest_of_runs(profile, checkpointed, points):
        if point.index is None:
            label = "optimizer step"
        else:
            label = "micro-step 1" if point.phase == memory.PHASE_NO_GRADS else _later_steps(k)
        one = bar(point.phase, point.index, label, point.allocated_bytes)
        if run is not None:
            one = replace(one, where=f"{one.where} (the highest of {run})", layer=run)
        bars.append(one)
    best = max(b.total_bytes for b in bars)
    peak_index = next(i for i, b in enumerate(bars) if b.total_bytes == best)
    return Timeline(
        bars=tuple(bars), peak_index=peak_index, micro_batch=micro_batch, accumulation_steps=k
    )


def alike_layer_runs(
    profile: Profile, checkpointed: frozenset[int] | dict[int, str]
) -> list[runs.Run]:
    """Runs of consecutive layers alike in every measured number and in their mode."""
    modes = memory.layer_modes(profile, checkpointed)
    keys = [(replace(x, name=""), modes.get(i, KEEP)) for i, x in enumerate(profile.layers)]
    return runs.runs(keys)


def _highest_of_runs(
    profile: Profile, checkpointed: frozenset[int] | dict[int, str], points: Sequence[Any]
) -> list[tuple[Any, str | None]]:
    """The points to draw: consecutive points of one phase within one run of alike layers
    (10,000 identical blocks) become their first highest, labelled with the run; every
    other point is kept as it is. The step's peak is among them."""
    names = profile.layer_names
    run_of: dict[int, runs.Run] = {}
    for run in alike_layer_runs(profile, checkpointed):
        if run.count > 1:
            run_of.update({i: run for i in range(run.start, run.stop)})
    out: list[tuple[Any, str | None]] = []
    group: list[Any] = []
    group_run: runs.Run | None = None

    def flush() -> None:
        if group:
            best = max(group, key=lambda p: p.allocated_bytes)  # first highest
            label = runs.run_label(names, group_run) if len(group) > 1 else None
            out.append((best, label))
            group.clear()

    for point in points:
        held = None if point.index is None else profile.timeline[point.phase][point.index].held
        run = run_of.get(held) if held is not None else None
        if run is None or run is not group_run or (group and group[0].phase != point.phase):
            flush()
            group_run = run
            if run is None:
                out.append((point, None))
                continue
        group.append(point)
    flush()
    return out


def _later_steps(k: int) -> str:
    return "micro-step 2" if k == 2 else f"micro-steps 2-{k}"


def layer_rows(
    profile: Profile,
    micro_batch: int,
    accumulation_steps: int,
    checkpointed: frozenset[int] | dict[int, str],
    times: timing.MicroStepTimes,
) -> tuple[LayerRow, ...]:
    modes = memory.layer_modes(profile, checkpointed)
    savings = {
        mode: memory.mode_savings_bytes(profile, micro_batch, mode)
        for mode in {*modes.values(), FULL}
    }
    rows: list[LayerRow] = []
    for i, layer in enumerate(profile.layers):
        mode = modes.get(i, KEEP)
        shown = FULL if mode == KEEP else mode
        rows.append(
            LayerRow(
                name=layer.name,
                module_type=layer.module_type,
                held_bytes=memory.affine_bytes(layer.saved_bytes, micro_batch),
                savings_bytes=savings[shown][i],
                recompute_seconds=accumulation_steps * times.mode_seconds(i, shown)
                if shown != OFFLOAD or times.offload_seconds
                else math.nan,
                checkpointed=mode != KEEP,
                mode=mode,
            )
        )
    # alike neighbours share a row: blocks.2–9998 × 9,997, each holding the same
    keys = [replace(row, name="") for row in rows]
    names = [row.name for row in rows]
    return tuple(
        replace(rows[run.start], name=runs.run_label(names, run), count=run.count)
        for run in runs.runs(keys)
    )


def _mode_counts(checkpoint: dict[str, str], n_layers: int | None = None) -> str:
    """``{'h.0': 'full', 'h.1': 'full', 'h.2': 'selective'}`` of 4 layers -> ``layers: 2
    full, 1 selective, 1 kept``; without ``n_layers`` the kept ones are not counted."""
    counts: dict[str, int] = {}
    for mode in checkpoint.values():
        counts[mode] = counts.get(mode, 0) + 1
    parts = [f"{n} {m}" for m, n in sorted(counts.items())]
    if n_layers is not None:
        parts.append(f"{n_layers - len(checkpoint)} kept")
    return "layers: " + ", ".join(parts) if parts else "no layer checkpointed"


def plan_report(
    profile: Profile,
    plan: Plan,
    *,
    device_spec: DeviceSpec | None = None,
    candidates: Sequence[Candidate] = (),
    measured: MeasuredTimeline | None = None,
    notes: Sequence[str] = (),
    sharding: memory.Sharding | None = None,
) -> Report:
    """The report of a plan solved from ``profile``. Says so in ``notes`` when the profile
    no longer predicts the plan's peak (it changed since the plan was solved). With a
    layout, ``profile`` is one rank's (``memory.parallel.rank_profile``) and ``sharding``
    the layout's: the plan's modes of the other ranks' blocks are not drawn."""
    checkpoint = plan.checkpoint
    if sharding is not None:
        names = set(profile.layer_names)
        checkpoint = {name: mode for name, mode in checkpoint.items() if name in names}
    chosen = memory.layer_modes(profile, checkpoint)
    reserve = memory.reserve_for(profile, device_spec)
    sharding = sharding or memory.sharding_for(plan)
    line = predicted_timeline(
        profile,
        plan.micro_batch_size,
        chosen,
        plan.accumulation_steps,
        reserve=reserve,
        sharding=sharding,
    )
    extra = list(notes)
    if line.peak_bytes != plan.predicted.peak_bytes:
        extra.append(
            f"This profile predicts a peak of {line.peak_bytes:,} bytes for the plan, which "
            f"says {plan.predicted.peak_bytes:,}: the profile changed since the plan was "
            "solved, or another device spec was used. The charts show the profile's figures."
        )
    source, _ = retime.choose_timing_source(profile, device_spec, "auto")
    times = retime.micro_step_times(
        profile, plan.micro_batch_size, source=source, device_spec=device_spec
    )
    if OFFLOAD in chosen.values():  # timed as the solver times it: the host link's rate
        link, _ = host_link.host_link_bandwidth(device_spec)
        host = memory.offload_host_bytes(profile, plan.micro_batch_size)
        times = timing.with_offload(
            times, host_link.offload_seconds(host, link) if link > 0 else ()
        )
    per_rank = (
        f" · {plan.world_size} ranks ({plan.strategy}), per rank" if plan.world_size > 1 else ""
    )
    return Report(
        title=(
            f"{plan.model} · micro-batch {plan.micro_batch_size} × accumulation "
            f"{plan.accumulation_steps}{per_rank} · "
            f"{_mode_counts(plan.checkpoint, len(profile.layers))} · {plan.device} · "
            f"{plan.precision}"
        ),
        profile=profile,
        plan=plan,
        timeline=line,
        layers=layer_rows(profile, plan.micro_batch_size, plan.accumulation_steps, chosen, times),
        candidates=tuple(candidates),
        budget_bytes=plan.budget_bytes,
        usable_bytes=memory.usable_budget_bytes(plan.budget_bytes, plan.margin),
        notes=tuple(extra),
        measured=measured,
    )


def profile_report(profile: Profile, *, device_spec: DeviceSpec | None = None) -> Report:
    """A profile without a plan: one step at the largest probed micro-batch, no
    accumulation, nothing checkpointed, no budget."""
    micro = max(profile.micro_batches)
    line = predicted_timeline(
        profile, micro, frozenset(), 1, reserve=memory.reserve_for(profile, device_spec)
    )
    source, _ = retime.choose_timing_source(profile, device_spec, "auto")
    times = retime.micro_step_times(profile, micro, source=source, device_spec=device_spec)
    env = profile.environment
    return Report(
        title=(
            f"{profile.model.path} · micro-batch {micro}, nothing checkpointed (no plan) · "
            f"{env.device_name} · {env.precision}"
        ),
        profile=profile,
        plan=None,
        timeline=line,
        layers=layer_rows(profile, micro, 1, frozenset(), times),
        notes=(
            "No plan: this is the profile at its largest probed micro-batch with nothing "
            "checkpointed. Pass --target-batch and --budget (or a plan) to see a plan.",
        ),
    )


def plan_only_report(plan: Plan, why: str) -> Report:
    """A plan whose profile cannot be read: one bar, the plan's own predicted peak split as
    its breakdown says, and ``why`` the timeline is missing."""
    parts = plan.predicted.breakdown
    bar = TimelineBar(
        micro_step="peak",
        phase="peak",
        segment_index=None,
        where=plan.predicted.peak_phase or "the predicted peak",
        active="none",
        layer=None,
        checkpointed=False,
        after_forward=True,
        total_bytes=plan.predicted.peak_bytes,
        **{kind: getattr(parts, kind) for kind in KINDS},
    )
    return Report(
        title=(
            f"{plan.model} · micro-batch {plan.micro_batch_size} × accumulation "
            f"{plan.accumulation_steps} · {_mode_counts(plan.checkpoint)} · "
            f"{plan.device} · {plan.precision}"
        ),
        profile=None,
        plan=plan,
        timeline=Timeline(
            bars=(bar,),
            peak_index=0,
            micro_batch=plan.micro_batch_size,
            accumulation_steps=plan.accumulation_steps,
        ),
        layers=(),
        budget_bytes=plan.budget_bytes,
        usable_bytes=memory.usable_budget_bytes(plan.budget_bytes, plan.margin),
        notes=(why,),
    )


def coarser(report: Report) -> Report | None:
    """The report with half the detail, to fit the page's size limit: adjacent timeline
    bars of one micro-step merged into their first highest (the peak stays), else the
    layer table cut to its first and last rows; None when nothing is left to merge."""
    bars = report.timeline.bars
    if len(bars) > 64:
        merged: list[TimelineBar] = []
        i = 0
        while i < len(bars):
            pair = bars[i : i + 2]
            if len(pair) == 2 and pair[0].micro_step == pair[1].micro_step:
                merged.append(max(pair, key=lambda b: b.total_bytes))
                i += 2
            else:
                merged.append(bars[i])
                i += 1
        if len(merged) < len(bars):
            best = max(b.total_bytes for b in merged)
            line = replace(
                report.timeline,
                bars=tuple(merged),
                peak_index=next(k for k, b in enumerate(merged) if b.total_bytes == best),
            )
            return replace(report, timeline=line)
    rows = report.layers
    if len(rows) > 64:
        kept = (*rows[:32], *rows[-32:])
        note = (
            f"The layer table shows its first and last 32 of {len(rows):,} rows "
            "(the page stays under its size limit)."
        )
        return replace(report, layers=kept, notes=(*report.notes, note))
    return None
