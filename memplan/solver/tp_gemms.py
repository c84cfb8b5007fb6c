"""A TP rank's GEMMs at their own shapes (issue 31). No torch.

A rank of TP degree t is charged 1/t of each block's time (memplan.memory.parallel), which
holds for a GEMM only while it stays compute-bound. A split linear's three GEMMs each take
1/t of the FLOPs but still move the activation operand TP leaves whole (``Layer.tp_gemms``,
memplan.probe.tp_gemms), so a narrow one turns memory-bound: Llama 3.1 8B's key and value
projections at TP 8 are 128 wide on a rank, and their GEMMs read the whole 4,096-wide input
to do 1/8 of the work. Each GEMM is re-timed here on the device spec's roofline (as a meta
probe's clock times it, memplan.probe.roofline.Roofline: max of FLOPs at the GEMM rate and
bytes at the memory rate) at the rank's shape, and what that adds to 1/t of its whole time
is added to the block's forward (the forward GEMM), backward (input and weight gradients),
full recompute (the forward again) and selective recompute (the GEMMs the policy re-runs).

Per sample, at degree t and context-parallel degree c (which splits every operand's rows)::

    whole GEMM  = max(F / R, (W·e_w + S·e_s) / B)
    rank GEMM   = max(F / (t·R), (W·e_w + S·e_s / t) / B)
    added       = (rank GEMM − whole GEMM / t) / c ≥ 0

with F its FLOPs, W and S the elements of the whole and the split operand, e their bytes
an element (a float8 GEMM reads float8 and writes bf16), R the spec's GEMM rate (its float8
one for float8 GEMMs) and B its memory rate. Weights are left out: they are a small part of
such a GEMM's bytes, and without them the term is linear in the micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools

from memplan import retime, timing
from memplan.devices import DeviceSpec, load_device, meta_timed_spec
from memplan.errors import BadInputError
from memplan.parallel import Parallel
from memplan.profile import Affine, Layer, Profile, TpGemm


def _operand_bytes(gemm: TpGemm, t: int) -> tuple[float, float, float]:
    """Bytes per sample of the forward, input-gradient and weight-gradient GEMMs on a rank
    of degree ``t``: which operand each reads (at the input size) and writes (at the
    output size). Colwise: forward reads the whole input and writes the split output;
    input gradient reads the split output's gradient and writes the whole input's; weight
    gradient reads both. Rowwise: the other way round."""
    whole, split = gemm.whole, gemm.split / t
    i, o = gemm.input_size, gemm.output_size
    if gemm.style == "colwise":
        return whole * i + split * o, split * i + whole * o, (whole + split) * i
    return split * i + whole * o, whole * i + split * o, (whole + split) * i


def added_seconds(gemm: TpGemm, t: int, spec: DeviceSpec, precision: str) -> tuple[float, ...]:
    """Seconds per sample a rank of degree ``t`` spends in the forward, input-gradient and
    weight-gradient GEMMs of ``gemm`` beyond 1/t of the whole GEMMs' (module docstring)."""
    if t <= 1:
        return (0.0, 0.0, 0.0)
    kind = "float8" if gemm.float8 else precision

    def seconds(flops: float, moved: float) -> float:  # the solver's roofline
        return timing.roofline_seconds(flops, moved, spec, kind)

    return tuple(
        max(seconds(gemm.flops / t, rank) - seconds(gemm.flops, whole) / t, 0.0)
        for rank, whole in zip(_operand_bytes(gemm, t), _operand_bytes(gemm, 1), strict=True)
    )


def _add(value: Affine | None, slope: float) -> Affine | None:
    if value is None or slope == 0.0:
        return value
    return dataclasses.replace(value, slope=value.slope + slope)


def with_rank_gemms(
    layer: Layer,
    parallel: Parallel,
    spec: DeviceSpec | None,
    precision: str,
    rescaled: bool = False,
) -> Layer:
    """``layer`` as a rank of ``parallel`` runs it (memplan.memory.parallel's ``_rank_layer``)
    with its split linears' GEMMs re-timed at the rank's shapes on ``spec``; unchanged
    without a spec, TP or measured GEMMs. ``rescaled``: the layer's times are its meta
    clock's, which memplan.retime rescales to ``spec`` by the layer's bins, so the added
    seconds go in divided by that factor and come out as ``spec``'s (before, they were
    rescaled a second time: 0.6% on Llama 3.1 8B at TP 8, an H100 profile for an A100)."""
    if spec is None or parallel.tp <= 1 or not layer.tp_gemms:
        return layer
    fwd = bwd = selective = 0.0
    for gemm in layer.tp_gemms:
        forward, input_grad, weight_grad = added_seconds(gemm, parallel.tp, spec, precision)
        fwd += forward
        bwd += input_grad + weight_grad
        selective += forward if gemm.recomputed else 0.0
    if fwd == bwd == 0.0:
        return layer
    if rescaled and layer.fwd_clock:
        into_fwd = retime.clock_factor(layer.fwd_clock[-1].bins, spec)
        into_bwd = retime.clock_factor(layer.bwd_clock[-1].bins, spec) if layer.bwd_clock else 1.0
        into_sel = (
            retime.clock_factor(layer.selective_clock[-1].bins, spec)
            if layer.selective_clock
            else into_fwd
        )
        fwd, bwd, selective = fwd / into_fwd, bwd / into_bwd, selective / into_sel
    c = parallel.cp
    return dataclasses.replace(
        layer,
        fwd_seconds=_add(layer.fwd_seconds, fwd / c),
        bwd_seconds=_add(layer.bwd_seconds, bwd / c),
        recompute_seconds=_add(layer.recompute_seconds, fwd / c),
        selective_recompute_seconds=_add(layer.selective_recompute_seconds, selective / c),
    )


def rank_gemms_profile(rank: Profile, parallel: Parallel, spec: DeviceSpec | None) -> Profile:
    """A rank's profile (memplan.memory.parallel.rank_profile) with every block's split
    GEMMs re-timed at the rank's shapes (``with_rank_gemms``)."""
    if spec is None or parallel.tp <= 1:
        return rank
    precision = rank.environment.precision
    rescaled = retime.choose_timing_source(rank, spec)[0] == "rescaled"
    layers = tuple(
        with_rank_gemms(layer, parallel, spec, precision, rescaled) for layer in rank.layers
    )
    return dataclasses.replace(rank, layers=layers)


@functools.lru_cache(maxsize=8)
def _clock_spec(name: str) -> DeviceSpec | None:
    try:
        return load_device(name)
    except BadInputError:  # a spec file moved or changed since the probe
        return None


def gemm_spec(profile: Profile, spec: DeviceSpec | None) -> DeviceSpec | None:
    """The spec a rank's GEMMs are re-timed on: the one solved for; without one, a meta
    profile's clock (the spec it was timed against, ``--device-profile`` or memplan's
    default); else none, and a measured profile's rank is charged 1/t of its blocks."""
    if spec is not None:
        return spec
    env = profile.environment
    if env.device != "meta":
        return None
    name = env.device_profile or meta_timed_spec(env.device_name)
    return None if name is None else _clock_spec(name)
