"""A meta profile's step times on another device spec, from its own clock. No torch.

A meta probe's clock (memplan.probe.roofline.Roofline) charges each op the longer of its
FLOPs at its kind's rate and its bytes at the memory rate, and files it in a bin: per FLOP
kind and peak, the ops whose FLOPs' and bytes' seconds stand within 2^(1/4) of one ratio,
with both sums; and the ops with no FLOPs. The profile keeps the bins of each layer's
forward, backward and selective change (``Layer.fwd_clock``, ``bwd_clock``,
``selective_clock``) and of the rest of the step (``Profile.fixed_clock``) at the smallest
and the largest probed micro-batch. On another spec a bin's FLOPs take the ratio of the two
specs' rates for that kind and peak, its bytes the ratio of their memory rates, and the bin
the longer of the two:

    factor = Σ max(compute × flop_rate / spec's, memory × memory_rate / spec's)
             ÷ Σ max(compute, memory)

which each of those times is multiplied by (its own spec gives 1) at both probed sizes,
and taken on the line through the two between and beyond them. A bin's ops stand on one
side of their ridge on the clock, so the bin's longer sum is each op's longer one, exactly
except for the bin whose ops sit at the new spec's ridge point (to within the bin's width).
The optimizer step, which moves bytes and computes nothing on the clock, scales by the
memory rates alone.

Before profiles recorded the bins, another spec re-timed a meta profile from FLOPs and
bytes summed per layer (``roofline_times``, which older profiles and ``--timing roofline``
still take): a layer's bytes there are its inputs, weights and saved tensors, not every
op's reads and writes, and its step came out at 0.34 to 1.03 of a probe against that spec
itself on the example GPT and MLP and Llama 3.1 8B (bench ``retime``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.devices import DeviceSpec, meta_timed_spec, names_spec
from memplan.errors import BadInputError
from memplan.memory.memo import by_identity
from memplan.profile import Affine, ClockMix, ClockShare, Profile
from memplan.profile.arrays import layer_ints, layer_values
from memplan.timing import (
    MicroStepTimes,
    TimingMode,
    TimingSource,
    achievable_bandwidth,
    achievable_flops,
    layer_groups,
    measured_times,
    roofline_seconds,
    seconds_at,
)


def flop_rate(spec: DeviceSpec, share: ClockShare) -> float:
    """The FLOP/s ``spec`` runs ``share``'s FLOPs at: its peak for their dtype times its
    efficiency for their kind (BadInputError when the spec has no such peak: bf16 on a
    T4)."""
    efficiency = spec.efficiency
    assert share.peak is not None  # a FLOP kind names its peak
    by_kind = {
        "matmul": efficiency.matmul,
        "float8_matmul": efficiency.float8_matmul_efficiency,
        "attention": efficiency.attention,
        "attention_backward": efficiency.backward_attention,
    }
    return spec.peak_flops(share.peak) * by_kind[share.kind]


def memory_rate(spec: DeviceSpec) -> float:
    """Bytes/s ``spec``'s memory-bound ops reach: its bandwidth times its efficiency."""
    return spec.memory_bandwidth * spec.efficiency.memory


def clock_factor(mix: tuple[ClockShare, ...], spec: DeviceSpec) -> float:
    """How many times the clock's seconds the ops of ``mix`` take on ``spec`` (module
    docstring); 1 for a stretch with no seconds."""
    memory = memory_rate(spec)
    on_spec = on_clock = 0.0
    for s in mix:
        compute = s.compute * s.flop_rate / flop_rate(spec, s) if s.compute else 0.0
        on_spec += max(compute, s.memory * s.memory_rate / memory)
        on_clock += max(s.compute, s.memory)
    return on_spec / on_clock if on_clock > 0 else 1.0


def memory_factor(profile: Profile, spec: DeviceSpec) -> float:
    """The same for work that only moves bytes (the optimizer step): the clock's memory
    rate (every bin records it) over the spec's."""
    return step_bins(profile)[0].memory_rate / memory_rate(spec)


def has_clock(profile: Profile) -> bool:
    """Whether the profile's clock is in bins: the rest of the step and every layer's
    forward (a layer with no backward has no backward bins)."""
    return bool(profile.fixed_clock) and all(layer.fwd_clock for layer in profile.layers)


def step_bins(profile: Profile) -> tuple[ClockShare, ...]:
    """The whole micro-step's bins at the largest probed size: the rest's and every
    layer's forward and backward."""
    out = list(profile.fixed_clock[-1].bins)
    for layer in profile.layers:
        for clock in (layer.fwd_clock, layer.bwd_clock):
            if clock:
                out.extend(clock[-1].bins)
    return tuple(out)


def clock_ends(mixes: tuple[ClockMix, ...], spec: DeviceSpec) -> tuple[tuple[int, float], ...]:
    """(micro-batch, ``clock_factor``) at the stretch's probed sizes, the smallest and the
    largest (one pair when one size was probed): the mix moves with the size (weights read
    once a step weigh more in a small one), so a time is rescaled at both and taken on the
    line through them (``time_at``)."""
    return tuple((m.micro_batch, clock_factor(m.bins, spec)) for m in mixes)


def time_at(b: int, ends: tuple[tuple[int, float], ...], values: tuple[float, ...]) -> float:
    """A time at micro-batch ``b`` on the new spec, from its clock ``values`` at the
    ``ends``' sizes: each rescaled by its end's factor, and the line through them (a time
    is affine in the micro-batch); never below zero."""
    if len(ends) == 1:
        return ends[0][1] * values[0]
    (b0, f0), (b1, f1) = ends
    y0, y1 = f0 * values[0], f1 * values[1]
    return max(y0 + (b - b0) * (y1 - y0) / (b1 - b0), 0.0)


def mix_text(mix: tuple[ClockShare, ...]) -> str:
    """The clock's step by what bounded its ops, largest part first: "memory-bound ops
    55%, fp32 GEMMs 45%" (an op is bound by its longer side)."""
    names = {
        "matmul": "GEMMs",
        "float8_matmul": "GEMMs",
        "attention": "attention",
        "attention_backward": "attention backward",
    }
    parts: dict[str, float] = {}
    for s in mix:
        name = "memory-bound ops" if s.memory >= s.compute else f"{s.peak} {names[s.kind]}"
        parts[name] = parts.get(name, 0.0) + max(s.compute, s.memory)
    total = sum(parts.values())
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {value / total:.0%}" for name, value in ranked)


def choose_timing_source(
    profile: Profile, device_spec: DeviceSpec | None, mode: TimingMode = "auto"
) -> tuple[TimingSource, str]:
    """Which times to use, and why (one line for the plan's reasons).

    ``auto`` uses measured times, except for a ``meta`` profile planned for a device spec
    other than the one the probe timed it against: its times are then recomputed from
    FLOPs by roofline against the spec."""
    if mode == "measured":
        return (
            "measured",
            f"step times as the probe recorded them on {profile.environment.device_name}",
        )
    if mode == "roofline":
        if device_spec is None:
            raise BadInputError(
                "Roofline timing needs a device spec.",
                hint="Pass --device-profile NAME (see `memplan devices`).",
            )
        return (
            "roofline",
            f"step times by roofline from FLOPs against {device_spec.display_name} (as requested)",
        )
    env = profile.environment
    if (
        env.device == "meta"
        and device_spec is not None
        and not names_spec(env.device_profile, device_spec, env.device_spec_digest)
    ):
        timed = env.device_profile or _default_clock(env.device_name)
        if env.device_profile == device_spec.name:  # the name, with other numbers
            timed += f" with other numbers ({_OTHER_NUMBERS})"
        if has_clock(profile):
            step = step_bins(profile)
            factor = clock_factor(step, device_spec)
            return "rescaled", (
                f"step times from the meta clock, which was timed against {timed}, rescaled "
                f"to {device_spec.display_name}'s rates by what bounded its ops (at "
                f"micro-batch {profile.fixed_clock[-1].micro_batch}: "
                f"{mix_text(step)}; {factor:.2f}× its times)"
            )
        return "roofline", (
            f"step times by roofline from FLOPs and bytes per layer against "
            f"{device_spec.display_name} (the profile keeps no clock in bins, which a probe "
            f"by this memplan writes and which rescales closer): the meta profile was timed "
            f"against {timed}"
        )
    where = env.device_name or env.device
    return "measured", f"step times measured on {where}"


_OTHER_NUMBERS = (
    "that spec as it was when the profile was made, or an edited copy of the same name); "
    "probe again against this spec for its own clock"
)


def _default_clock(device_name: str) -> str:
    """What a meta profile probed without ``--device-profile`` was timed against, from its
    ``device_name`` (``devices.meta_timed_spec``): memplan's default spec, named."""
    spec = meta_timed_spec(device_name)
    if spec is None:
        return "no device spec"
    return f"memplan's default spec, {spec} (the probe was given no --device-profile)"


# Roofline: a kernel takes max(FLOPs / FLOP/s, bytes / bandwidth), against the device spec's
# datasheet peaks times its measured efficiencies (memplan.devices.Efficiency: the fraction
# of peak that large GEMMs and memory-bound ops reach on that device, from public
# measurements cited in each profiles/devices file). Per layer, not per op: a layer's FLOPs
# and bytes are summed before taking the max, and every FLOP is taken at the GEMM efficiency
# (a layer's attention FLOPs are not told apart here; a meta probe's own clock,
# memplan.probe.roofline.Roofline, times each op by its kind, so probing against the target
# spec is the closer estimate).
# Backward computes gradients for both inputs and weights: two matmuls per forward matmul.
BACKWARD_FLOPS_FACTOR = 2.0


def _roofline_layer_seconds(
    profile: Profile, micro_batch: int, spec: DeviceSpec
) -> tuple[list[float], list[float]] | None:
    """``roofline_times``'s per-layer forward and backward seconds in array operations (the
    same IEEE operations in the same order; ``np.maximum`` keeps its first argument on a
    tie as ``max`` does), or None where memplan.profile.arrays cannot give the values."""
    flops = layer_values(profile, "fwd_flops", micro_batch)
    inputs = layer_values(profile, "input_bytes", micro_batch)
    saved = layer_values(profile, "saved_bytes", micro_batch)
    if flops is None or inputs is None or saved is None:
        return None
    params = layer_ints(profile, "params_trainable_bytes")
    frozen = layer_ints(profile, "params_frozen_bytes")
    if not (np.abs(params).max(initial=0.0) < 2**52 and np.abs(frozen).max(initial=0.0) < 2**52):
        return None  # their sum as ints, then as a float, could differ from this one
    flops = np.maximum(flops, 0.0)
    moved = params + frozen + np.maximum(inputs, 0.0) + np.maximum(saved, 0.0)
    peak = achievable_flops(spec, profile.environment.precision)
    bandwidth = achievable_bandwidth(spec)

    def seconds(flops: np.ndarray, moved: np.ndarray) -> list[float]:
        return np.maximum(np.maximum(flops / peak, moved / bandwidth), 0.0).tolist()

    return (
        seconds(flops, moved),
        seconds(BACKWARD_FLOPS_FACTOR * flops, BACKWARD_FLOPS_FACTOR * moved),
    )


def roofline_times(profile: Profile, micro_batch: int, spec: DeviceSpec) -> MicroStepTimes:
    """Times from FLOPs and bytes. A layer's forward reads its weights and input and writes
    what it saves; its backward does twice the FLOPs and moves about twice the bytes. The
    optimizer step is memory-bound: it reads params, grads and state and writes params and
    state."""
    precision = profile.environment.precision
    b = micro_batch
    fast = _roofline_layer_seconds(profile, b, spec)
    fwd, bwd = fast if fast is not None else ([], [])
    for layer in profile.layers if fast is None else ():
        flops = max(layer.fwd_flops.at(b), 0.0)
        moved = (
            layer.params_trainable_bytes
            + layer.params_frozen_bytes
            + max(layer.input_bytes.at(b), 0.0)
            + max(layer.saved_bytes.at(b), 0.0)
        )
        fwd.append(roofline_seconds(flops, moved, spec, precision))
        bwd.append(
            roofline_seconds(
                BACKWARD_FLOPS_FACTOR * flops, BACKWARD_FLOPS_FACTOR * moved, spec, precision
            )
        )
    fixed = 0.0
    for part in profile.fixed:
        flops = max(part.fwd_flops.at(b), 0.0)
        moved = (
            part.params_trainable_bytes
            + part.params_frozen_bytes
            + max(part.saved_bytes.at(b), 0.0)
        )
        fixed += roofline_seconds(flops, moved, spec, precision) + roofline_seconds(
            BACKWARD_FLOPS_FACTOR * flops, BACKWARD_FLOPS_FACTOR * moved, spec, precision
        )
    totals = profile.totals
    optimizer_bytes = (
        2 * totals.params_trainable_bytes + totals.grad_bytes + 2 * totals.optimizer_state_bytes
    )
    return MicroStepTimes(
        micro_batch=b,
        fixed_seconds=fixed,
        fwd_seconds=tuple(fwd),
        bwd_seconds=tuple(bwd),
        optimizer_step_seconds=roofline_seconds(0.0, optimizer_bytes, spec, precision),
        source="roofline",
        selective_seconds=_roofline_selective(profile, b, fwd),
    )


def _roofline_selective(profile: Profile, b: int, fwd: list[float]) -> tuple[float, ...]:
    """Per layer: selective checkpointing's extra time on the roofline, the measured share
    of a forward that the ops its recompute re-runs take (a meta probe's clock: the matmuls
    the policy does not keep and the pointwise ops) times this spec's forward; empty when
    the profile has no selective times."""
    measured = [layer.selective_recompute_seconds for layer in profile.layers]
    if not measured or any(m is None for m in measured):
        return ()
    out = []
    for layer, extra, seconds in zip(profile.layers, measured, fwd, strict=True):
        forward = layer.fwd_seconds.at(b)
        out.append(seconds * max(extra.at(b), 0.0) / forward if forward > 0 else 0.0)  # type: ignore[union-attr]
    return tuple(out)


def micro_step_times(
    profile: Profile,
    micro_batch: int,
    *,
    source: TimingSource = "measured",
    device_spec: DeviceSpec | None = None,
) -> MicroStepTimes:
    if source in ("roofline", "rescaled"):
        if device_spec is None:
            raise BadInputError("Roofline timing needs a device spec.")
        if source == "rescaled":
            return rescaled_times(profile, micro_batch, device_spec)
        return roofline_times(profile, micro_batch, device_spec)
    return measured_times(profile, micro_batch)


@dataclass(frozen=True, slots=True)
class _Rescale:
    """What ``rescaled_times`` needs of a profile and a spec at any micro-batch: each
    stretch's (size, factor) ends, the layers' groups and the memory rates' factor."""

    sizes: tuple[int, ...]
    fixed: Ends
    fwd: tuple[Ends, ...]
    bwd: tuple[Ends, ...]
    selective: tuple[Ends, ...]
    groups: tuple[tuple[int, ...], ...]
    memory: float


Ends = tuple[tuple[int, float], ...]


@by_identity(64)
def _rescale(profile: Profile, spec: DeviceSpec) -> _Rescale:
    """The factors once per profile and spec (the solver asks for the times at every
    micro-batch of every layout's rank profile)."""
    sizes = tuple(m.micro_batch for m in profile.fixed_clock)

    def ends(clock: tuple[ClockMix, ...]) -> Ends:
        return clock_ends(clock, spec) or tuple((size, 1.0) for size in sizes)

    layers = profile.layers
    return _Rescale(
        sizes=sizes,
        fixed=ends(profile.fixed_clock),
        fwd=tuple(ends(x.fwd_clock) for x in layers),
        bwd=tuple(ends(x.bwd_clock) for x in layers),
        selective=tuple(ends(x.selective_clock or x.fwd_clock) for x in layers),
        groups=tuple(tuple(g) for g in layer_groups(profile)),
        memory=memory_factor(profile, spec),
    )


def rescaled_times(profile: Profile, micro_batch: int, spec: DeviceSpec) -> MicroStepTimes:
    """A meta profile's clock times on ``spec`` (memplan.retime): each layer's forward (and
    so its recompute), its backward and the rest of the step rescaled by their own bins at
    the end sizes and taken on the line through them, then pooled over identical layers as
    ``measured_times`` pools; the optimizer step by the memory rates."""
    b = micro_batch
    r = _rescale(profile, spec)

    def at(ends: Ends, value: Affine | None) -> float:
        if value is None:
            return 0.0
        return time_at(b, ends, tuple(seconds_at(value, size) for size in r.sizes))

    layers = profile.layers
    fwd = [at(e, x.fwd_seconds) for e, x in zip(r.fwd, layers, strict=True)]
    bwd = [at(e, x.bwd_seconds) for e, x in zip(r.bwd, layers, strict=True)]
    recompute = [at(e, x.recompute_seconds) for e, x in zip(r.fwd, layers, strict=True)]
    selective = [
        at(e, x.selective_recompute_seconds) for e, x in zip(r.selective, layers, strict=True)
    ]
    for series in (fwd, bwd, recompute, selective):
        for members in r.groups:
            mean = sum(series[i] for i in members) / len(members)
            for i in members:
                series[i] = mean
    has_recompute = all(x.recompute_seconds is not None for x in layers)
    has_selective = bool(layers) and all(x.selective_recompute_seconds is not None for x in layers)
    return MicroStepTimes(
        micro_batch=b,
        fixed_seconds=at(r.fixed, profile.step_fixed_seconds),
        fwd_seconds=tuple(fwd),
        bwd_seconds=tuple(bwd),
        recompute_seconds=tuple(recompute) if has_recompute else (),
        selective_seconds=tuple(selective) if has_selective else (),
        optimizer_step_seconds=seconds_at(profile.optimizer_step_seconds, b) * r.memory,
        source="rescaled",
    )
