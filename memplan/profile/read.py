"""Reading and writing a profile: the one strict YAML path (schema-versioned, unknown keys
refused) and the rules a probe's output always keeps, checked on every read
(``profile_problem``). No torch."""

from __future__ import annotations

import re
from pathlib import Path

from memplan.errors import CannotMeasureError, ProfileError
from memplan.files import fast_yaml
from memplan.files.schema import from_data, gc_paused, load_yaml_file, read_back, to_data
from memplan.profile.data import (
    BOUNDARIES_DIFFERED,
    LOSS_NOT_FINITE,
    PROFILE_SCHEMA_VERSION,
    Affine,
    ClockShare,
    Profile,
    point_at,
    timing_rounds_problem,
)


def _check_version(data: dict, source: str) -> None:
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ProfileError(
            f"{source}: 'schema_version' is missing or not an integer; "
            "this is not a memplan profile.",
            hint="Write one with `memplan probe model.py -o FILE`.",
        )
    if version > PROFILE_SCHEMA_VERSION:
        raise ProfileError(
            f"{source} has schema_version {version}, newer than this memplan understands "
            f"({PROFILE_SCHEMA_VERSION}).",
            hint="Upgrade memplan, or probe the model again.",
        )
    if version == 1:  # schema 1 is schema 2 without seq_len and seq
        newer = [key for key in ("seq_len", "seq") if key in data]
        if newer:  # as a schema 1 plan with schema 2's ``checkpoint`` is (memplan.plan)
            raise ProfileError(
                f"{source}: '{newer[0]}' is a schema {PROFILE_SCHEMA_VERSION} field, but the "
                "profile says schema_version 1.",
                hint=f"Set schema_version: {PROFILE_SCHEMA_VERSION}, or probe the model again.",
            )
        data["schema_version"] = PROFILE_SCHEMA_VERSION
        return
    if version < PROFILE_SCHEMA_VERSION:  # migrations by version go here as the schema moves
        raise ProfileError(
            f"{source} has schema_version {version}, which is no longer read.",
            hint="Probe the model again.",
        )


def profile_from_data(data: dict, *, source: str = "<profile>") -> Profile:
    _check_version(data, source)
    profile = from_data(Profile, data, source=source, path="profile")
    problem = profile_problem(profile)
    if problem is not None:
        raise ProfileError(
            f"{source}: field '{problem[0]}' {problem[1]}.",
            hint="A probe never writes that: the file was edited or corrupted; probe the "
            "model again.",
        )
    return profile


# Affine quantities that may be negative: a checkpoint can keep more than the plain run
# (savings < 0, e.g. LoRA inputs), a fixed part can free more than it keeps (the loss:
# saved_bytes < 0 in examples/ci/baselines/gpt.profile.yaml) and a recompute can be
# measured as cheaper than noise. The rest are sizes, times and FLOPs.
_SIGNED_AFFINE = {
    "savings_bytes",
    "recompute_seconds",
    "saved_bytes",
    # selective keeps matmul outputs (every second one) also where the plain run does not
    # keep them (a frozen LoRA base, a U-Net skip): its savings can be negative, measured.
    "selective_savings_bytes",
    "selective_recompute_seconds",
}
LONGEST_SECONDS = 1e9
"""No layer of a real model takes 31 years: a time past it is an edit, and summed over a
step it passed the files' own limit, so solve's plan failed to read back (exit 3, named
as memplan's failure; two layers of 9e29 s)."""
_COUNT_FIELDS = (
    "params_trainable_bytes",
    "params_frozen_bytes",
    "buffer_bytes",
    "cached_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
)


_SIZE_AFFINE_BYTES = ("input_bytes", "output_bytes", "saved_bytes")
"""A layer's byte quantities that are tensor sizes, proportional to the micro-batch: the
solver evaluates them at every micro-batch from 1 up (extrapolating past the probed sizes),
so each fit must be non-negative there: a slope >= 0 and a value >= 0 at 1 sample. (The
transients are peaks of an allocator's workspace and are measured with small negative
slopes, e.g. -32 B per sample on CPU: they are held to >= 0 at the probed sizes.)"""


def _affine_problem(profile: Profile) -> tuple[str, str] | None:
    """A byte fit negative over the sizes the solver uses (b >= 1), savings growing faster
    than what the layer keeps, or full savings shrinking faster than its inputs grow (all a
    full checkpoint keeps). Selective savings have no floor: selective keeps matmul outputs
    (every second one) also where the plain run frees them at once (a frozen LoRA base's,
    in bf16: docs/design.md, "The profile")."""
    for i, layer in enumerate(profile.layers):
        path = f"profile.layers[{i}]"
        for name in _SIZE_AFFINE_BYTES:
            fit: Affine = getattr(layer, name)
            if fit.slope < 0:
                return f"{path}.{name}.slope", f"is {fit.slope:.4g}, negative bytes per sample"
            if fit.at(1) < 0:
                return f"{path}.{name}", f"is negative at micro-batch 1 ({fit.at(1):.4g})"
        for name in ("savings_bytes", "selective_savings_bytes"):
            fit_or_none: Affine | None = getattr(layer, name)
            if fit_or_none is None:
                continue
            if fit_or_none.slope > layer.saved_bytes.slope:
                return (
                    f"{path}.{name}.slope",
                    f"is {fit_or_none.slope:.4g} bytes per sample, more than the "
                    f"{layer.saved_bytes.slope:.4g} its saved_bytes grow by",
                )
            if name == "savings_bytes" and fit_or_none.slope < -layer.input_bytes.slope:
                return (
                    f"{path}.{name}.slope",
                    f"is {fit_or_none.slope:.4g} bytes per sample: full checkpointing would keep "
                    f"more per sample than the layer's inputs ({layer.input_bytes.slope:.4g})",
                )
    return None


def _grid_problem(profile: Profile) -> tuple[str, str] | None:
    """A seq grid whose sub-profiles do not describe one model at its lengths, in order."""
    grid = profile.seq
    if grid is None:
        return None
    if profile.seq_len is not None and profile.seq_len not in grid.seq_lens:
        return "profile.seq_len", f"is {profile.seq_len}, not one of seq.seq_lens {grid.seq_lens}"
    for i, (length, inner) in enumerate(zip(grid.seq_lens, grid.profiles, strict=True)):
        path = f"profile.seq.profiles[{i}]"
        if inner.seq_len is not None and inner.seq_len != length:
            return f"{path}.seq_len", f"is {inner.seq_len}, but seq.seq_lens[{i}] is {length}"
        if (inner.model.path, inner.model.factory) != (profile.model.path, profile.model.factory):
            return f"{path}.model", f"names {inner.model.spec}, not {profile.model.spec}"
        if inner.layer_names != profile.layer_names:
            return f"{path}.layers", "name other layers than the profile's"
        if inner.max_seq_len != profile.max_seq_len:
            return f"{path}.max_seq_len", f"is {inner.max_seq_len}, not {profile.max_seq_len}"
    # Memory grows with the length: a longer sequence never keeps fewer bytes per sample.
    for i in range(1, len(grid.profiles)):
        shorter, longer = grid.profiles[i - 1], grid.profiles[i]
        for j, (a, b) in enumerate(zip(shorter.layers, longer.layers, strict=True)):
            if b.saved_bytes.slope < a.saved_bytes.slope:
                return (
                    f"profile.seq.profiles[{i}].layers[{j}].saved_bytes.slope",
                    f"is {b.saved_bytes.slope:.4g} at {grid.seq_lens[i]} tokens, less than "
                    f"{a.saved_bytes.slope:.4g} at {grid.seq_lens[i - 1]} tokens",
                )
    return None


def _clock_problem(profile: Profile) -> tuple[str, str] | None:
    """A clock in bins no meta clock records (``fixed_clock``, each layer's ``_CLOCKS``):
    sizes not ascending, a rate at or below zero, negative seconds, or
    a FLOP kind without its peak (or ``memory`` with FLOPs)."""
    clocks = [("profile.fixed_clock", profile.fixed_clock)]
    for j, layer in enumerate(profile.layers):
        clocks += [(f"profile.layers[{j}].{n}", getattr(layer, n)) for n in _CLOCKS]
    for path, clock in clocks:
        sizes = [mix.micro_batch for mix in clock]
        if sizes != sorted(set(sizes)) or (sizes and sizes[0] < 1):
            return path, f"has micro-batches {sizes}, not ascending sizes"
        for m, mix in enumerate(clock):
            for i, share in enumerate(mix.bins):
                problem = _bin_problem(share)
                if problem is not None:
                    return f"{path}[{m}].bins[{i}]{problem[0]}", problem[1]
    return None


_CLOCKS = ("fwd_clock", "bwd_clock", "selective_clock")


def _bin_problem(share: ClockShare) -> tuple[str, str] | None:
    memory = share.kind == "memory"
    if not share.memory_rate > 0:
        return ".memory_rate", f"is {share.memory_rate}, not a rate"
    if memory != (share.peak is None) or (memory and (share.flop_rate or share.compute)):
        return "", f"is {share.kind} with peak {share.peak} and FLOPs' seconds"
    if not memory and not share.flop_rate > 0:
        return ".flop_rate", f"is {share.flop_rate}, not a rate"
    for name in ("compute", "memory"):
        if getattr(share, name) < 0:
            return f".{name}", f"is {getattr(share, name)}, negative seconds"
    return None


def profile_problem(profile: Profile) -> tuple[str, str] | None:
    """``(field path, what is wrong)`` for the first value no measurement can produce —
    negative bytes or times, an empty timeline, a byte fit negative at sizes the solver
    uses, a seq grid out of order or of another model — else None. The schema has
    already refused NaN, infinity and absurd magnitudes."""
    if profile.seq is not None:
        for i, inner in enumerate(profile.seq.profiles):
            problem = profile_problem(inner)
            if problem is not None:
                return problem[0].replace("profile.", f"profile.seq.profiles[{i}].", 1), problem[1]
    if profile.max_seq_len is not None:
        if profile.max_seq_len < 1:
            return "profile.max_seq_len", f"is {profile.max_seq_len}, not a length"
        if profile.seq_len is not None and profile.seq_len > profile.max_seq_len:
            return "profile.seq_len", f"is {profile.seq_len}, past max_seq_len"
    problem = _grid_problem(profile) or _affine_problem(profile) or _clock_problem(profile)
    if problem is not None:
        return problem
    rounds = profile.environment.timing_rounds
    if rounds is not None and (problem := timing_rounds_problem(rounds)):
        return "profile.environment.timing_rounds", f"{problem}, not a count of timing rounds"
    sizes = profile.micro_batches
    if list(sizes) != sorted(set(sizes)):
        return "profile.micro_batches", f"is {list(sizes)}, not distinct sizes in ascending order"
    largest = max(sizes)
    parts = [("profile.totals", profile.totals)]
    parts += [(f"profile.layers[{i}]", layer) for i, layer in enumerate(profile.layers)]
    parts += [(f"profile.fixed[{i}]", part) for i, part in enumerate(profile.fixed)]
    for path, part in parts:
        for name in _COUNT_FIELDS:
            value = getattr(part, name, 0)
            if value < 0:
                return f"{path}.{name}", f"is {value}, a negative number of bytes"
        if path == "profile.totals":
            continue
        for g, gemm in enumerate(getattr(part, "tp_gemms", ())):
            for name in ("flops", "whole", "split", "input_size", "output_size"):
                if getattr(gemm, name) < 0:
                    return f"{path}.tp_gemms[{g}].{name}", "is negative"
        for name in part.__slots__:
            value = getattr(part, name)
            if (
                isinstance(value, Affine)
                and name.endswith("_seconds")
                and max(abs(value.intercept), abs(value.slope)) > LONGEST_SECONDS
            ):
                return (
                    f"{path}.{name}",
                    f"is {value.intercept:.4g} s + {value.slope:.4g} s a sample, past "
                    f"{LONGEST_SECONDS:.0e} s (31 years) a layer",
                )
            if isinstance(value, Affine) and name not in _SIGNED_AFFINE:
                at = value.at(largest)
                if at < 0:
                    return (
                        f"{path}.{name}",
                        f"is negative at micro-batch {largest} ({at:.4g})",
                    )
    for name in ("optimizer_step_peak_bytes", "optimizer_step_seconds", "step_fixed_seconds"):
        at = getattr(profile, name).at(largest)
        if at < 0:
            return f"profile.{name}", f"is negative at micro-batch {largest} ({at:.4g})"
    for name in ("allocator_reserve_bytes", "context_bytes"):
        value = getattr(profile, name)
        if value is not None and value < 0:
            return f"profile.{name}", f"is {value}, a negative number of bytes"
    for phase, segments in profile.timeline.items():
        if not segments:
            return f"profile.timeline.{phase}", "is empty (no live-byte points were recorded)"
        for j, seg in enumerate(segments):
            for kind in ("points", "ckpt_points"):
                for point in getattr(seg, kind):
                    low = min(point_at(point, b) for b in sizes)
                    if low < 0:
                        return (
                            f"profile.timeline.{phase}[{j}].{kind}",
                            f"holds a negative live-byte count ({low:.4g})",
                        )
    return _timeline_problem(profile) or _state_problem(profile)


def _timeline_problem(profile: Profile) -> tuple[str, str] | None:
    """A timeline without a segment every probe records (docs/design.md, "The profile"):
    the layers run once each, in order, after the warm-up re-hooks them so, and the
    recorder marks every boundary (``probe.recorder``), so each phase begins with the
    step's start (0, none) and then, per layer i, its forward (i, fwd) and what follows it
    (i + 1, none); and a layer whose parameters got gradients through its output had a
    backward (i, bwd) after that. A segment left out takes its live bytes out of every
    peak (the truncated timeline of sweep F predicted a third of the measured peak)."""
    if any(w.startswith(BOUNDARIES_DIFFERED) for w in profile.warnings):
        return None
    names = profile.layer_names
    forward: list[tuple[int, str, str]] = [(0, "none", "the start of the step")]
    for i, name in enumerate(names):
        forward.append((i, "fwd", f"the forward of layer {i} ({name})"))
        forward.append((i + 1, "none", f"what follows the forward of layer {i} ({name})"))
    largest = max(profile.micro_batches)
    for phase, segments in profile.timeline.items():
        path = f"profile.timeline.{phase}"
        for j, (held, active, what) in enumerate(forward):
            seg = segments[j] if j < len(segments) else None
            if seg is None or (seg.held, seg.active) != (held, active):
                return path, (
                    f"lacks segment {j} (held {held}, {active}: {what}), which every probe records"
                )
        backward = {seg.held for seg in segments[len(forward) :] if seg.active == "bwd"}
        for i, layer in enumerate(profile.layers):
            has_grads = layer.grad_bytes > 0 and layer.output_bytes.at(largest) > 0
            if has_grads and i not in backward:
                return path, (
                    f"lacks the backward of layer {i} ({layer.name}: a segment held {i}, bwd), "
                    "which every probe records for a layer whose parameters have gradients"
                )
    return None


STATE_TOLERANCE = 0.01
"""What the live bytes at a micro-step's start may fall short of the optimizer state (and
gradients) ``totals`` counts: the fit of a point through the probed sizes (a segment's
maxima where the op sequence differed)."""


def _state_problem(profile: Profile) -> tuple[str, str] | None:
    """``totals`` counting more gradients or optimizer state than the probe saw live.
    Gradients: autograd makes each of a trainable parameter's shape and dtype, so a part's
    (and the model's) are at most its trainable parameters' bytes. Timeline points are
    absolute live bytes: the tracker counts every gradient and optimizer-state storage
    from the start of each micro-step (``probe.tracker.resident_tensors``; the state
    exists after the warm-up step, the gradients in ``grads_resident``), so the first point
    of each phase holds at least the state (and the gradients). A per-rank plan takes the
    shards a rank does not hold off those measured bytes, so a larger total lowered the
    prediction (sweep F: optimizer state tripled, ZeRO-1's peak per rank fell 17.6 to 13.8
    MB). Parameters are not held to it: two parameters sharing one storage (a head tied
    by ``.data``) are counted twice in ``totals`` and once live."""
    t = profile.totals
    parts = [("profile.totals", t)]
    parts += [(f"profile.layers[{i}]", layer) for i, layer in enumerate(profile.layers)]
    parts += [(f"profile.fixed[{i}]", part) for i, part in enumerate(profile.fixed)]
    for path, part in parts:
        if part.grad_bytes > part.params_trainable_bytes:
            return f"{path}.grad_bytes", (
                f"is {part.grad_bytes}, more than the {part.params_trainable_bytes} bytes of "
                "trainable parameters whose gradients it counts"
            )
    floors = (
        ("no_grads", "optimizer_state_bytes", t.optimizer_state_bytes, "optimizer state"),
        (
            "grads_resident",
            "grad_bytes",
            t.optimizer_state_bytes + t.grad_bytes,
            "optimizer state and gradients",
        ),
    )
    for phase, field, floor, what in floors:
        segments = profile.timeline.get(phase)
        if not segments:
            continue
        for b in profile.micro_batches:
            live = max(point_at(point, b) for point in segments[0].points)
            if live < floor * (1 - STATE_TOLERANCE):
                if t.optimizer_state_bytes > live * (1 + STATE_TOLERANCE):
                    field = "optimizer_state_bytes"
                return f"profile.totals.{field}", (
                    f"adds up to {floor} bytes of {what}, more than the {live:.0f} bytes live "
                    f"at the start of a {phase} micro-step of {b} (timeline.{phase}[0]), "
                    "where all of them are live"
                )
    return None


def load_profile(path: str | Path) -> Profile:
    """Read a profile YAML (``yaml.safe_load`` only; unknown keys rejected with a hint)."""
    with gc_paused():
        data = load_yaml_file(path, what="profile")
        if "target_batch" in data:
            raise ProfileError(
                f"{path} is a plan, not a profile.",
                hint="Pass the profile written by `memplan probe`.",
            )
        return profile_from_data(data, source=str(path))


WRITTEN = "<the profile memplan made>"
"""The source a read-back names: the text is not in a file yet."""


def profile_to_yaml(profile: Profile) -> str:
    """The profile's YAML (memplan.files.fast_yaml: a 10,000-layer profile in seconds), read
    back as ``load_profile`` reads a file (``files.schema.read_back``): every writer of a
    profile takes its text from here, so a profile memplan would refuse (its schema, or
    ``profile_problem``) is ``UnreadableOutputError`` (exit 3, naming the field) and is
    never written."""
    problem = None if profile.op_sequence_stable else profile_problem(profile)
    if problem is not None:
        raise _other_paths(profile, *problem)
    text = fast_yaml.dump(to_data(profile))
    with gc_paused():
        read_back(text, "profile", lambda data: profile_from_data(data, source=WRITTEN))
    return text


def _other_paths(profile: Profile, field: str, what: str) -> CannotMeasureError:
    """The refusal of a profile whose probed sizes ran different op sequences and whose
    lines through them give a value no measurement can (an LSTM over a packed batch sorts
    2 sequences and not 1: negative saved bytes per sample through micro-batches 1 and 2).
    With three sizes or more the size that differs is left out of the fits
    (``probe.alignment.consistent_runs``); with two nothing is left to fit. The fault is
    the sizes probed, not memplan's (``UnreadableOutputError``), so it says which to probe."""
    index = re.match(r"profile\.(layers|fixed)\[(\d+)\]", field)
    if index:  # name the module
        field = f"{field} ({getattr(profile, index[1])[int(index[2])].name})"
    sizes = profile.micro_batches
    loss = [w for w in profile.warnings if w.startswith(LOSS_NOT_FINITE)]
    also = f" The probe also saw: {loss[0]}" if loss else ""  # a NaN step's other path
    return CannotMeasureError(
        f"{profile.model.path}: micro-batches {', '.join(map(str, sizes))} ran different op "
        "sequences (a path the batch takes at one size only), and the lines fitted through "
        f"them are no measurement: {field} {what}.{also}",
        hint=f"Probe {'three or more' if len(sizes) < 3 else 'other'} sizes (e.g. "
        f"--micro-batches {'2,4,8' if sizes[0] < 2 else '4,8,16'}): sizes that take one "
        "path are fitted and a size that takes another is left out. Or have make_batch "
        "return batches that take one path at every size.",
    )
