"""What context parallel's ring attention holds on a rank beside a block's own activations:
the bytes alive at the ring's peak that a plain SDPA call over the rank's query would not
hold. No torch.

torch runs it (torch/distributed/tensor/experimental/_attention.py; 2.13's
``_context_parallel/_attention.py``; the December 2024 runs through torchtitan's
``context_parallel``) with K and V all-gathered once a call (``_AllGatherRotater``, the
default rotation) and fp32 outputs and gradients (``convert_to_f32``). For ``E`` elements of
one rank's K after torchtitan's ``repeat_kv`` (``b · S/cp`` tokens × ``d_model/tp`` for Llama,
as memplan.solver.ring counts it), activations of ``w`` bytes and accumulators of ``a = 4``:

- forward: the gathered K and V of every rank (``2 · cp · w``) all the call, with either step
  0's K/V contiguous copies, their concatenation for the gather and its output (``5w``), or a
  later step's running fp32 output, that step's output, the two fp32 temporaries of the merge
  (``_SDPAMerger``: ``out − block_out``, its product with ``sigmoid(Δlse)``) (``w + 3a``),
  and under bf16/fp16 the step output's fp32 copy (``a``);
- backward, from cp 3 on: the gathered K and V, the fp32 dQ/dK/dV accumulators (``3a``), the
  dK/dV concatenation sent and the permute's buffer received (``4a``), the previous step's
  dQ/dK/dV (``3w``) and K/V concatenations of this step and the last (``4w``) and the K/V
  contiguous copies (``2w``), at the concatenation of a step's K/V; at cp 2, which has no
  such step, it is at most that.

Less what the probe already measured in the block: the plain call's output (``w``) forward,
dQ, dK and dV (``3w``) backward. Log-sum-exp tensors (``1/head_dim`` of these) are left out.
Measured (tests/test_ring_attention.py): torch's own ring forward and backward on 2, 4 and 8
gloo ranks with the CPU flash kernel, every live tensor counted at every op, bf16 and fp32:
the most any rank holds equals these, exactly from cp 3 on. At cp 2 the backward holds
less, so memplan over-counts there: in bf16 one ``w`` an element less (46 of 48 bytes), in
fp32 5.875 of 68 less (62.125), the most of either rank, measured by the same count.
"""

from __future__ import annotations

from memplan.parallel import Parallel
from memplan.profile import Layer, Profile

ACCUM_BYTES = 4
"""torch's ring attention accumulates outputs and gradients in fp32
(``_ContextParallelOptions.convert_to_f32 = True``)."""


def activation_itemsize(profile: Profile) -> int:
    """Bytes of one activation element: 2 under bf16/fp16, else 4."""
    return 2 if profile.environment.precision in ("bf16", "fp16") else 4


def ring_held_bytes(cp: int, w: int, a: int = ACCUM_BYTES) -> tuple[int, int]:
    """Bytes per element of one rank's K that the ring holds at its peak beyond a plain SDPA
    call's own: ``(forward, backward)`` (module docstring); none without context parallel."""
    if cp <= 1:
        return 0, 0
    gathered = 2 * cp * w  # every rank's K and V, all the call
    cast = a if w < a else 0  # each step's output to fp32 (the same tensor when w == a)
    forward = (
        gathered
        + max(5 * w, w + 3 * a)  # step 0's copies and gather input, or a later step's merge
        + cast
        - w  # the plain call's output, in the probed block
    )
    backward = (
        gathered
        + 3 * a  # dQ/dK/dV accumulators
        + 4 * a  # dK/dV concatenation sent, the permute's buffer received
        + 3 * w  # the previous step's dQ/dK/dV
        + 4 * w  # K/V concatenations of this step and the last
        + 2 * w  # K/V contiguous copies
        - 3 * w  # the plain call's dQ/dK/dV, in the probed block
    )
    return forward, backward


def rank_k_elements(profile: Profile, layer: Layer, parallel: Parallel) -> float:
    """Elements of one rank's K after repeat_kv, per sample: ``S/cp`` tokens × ``d_model/tp``
    for Llama, as many as the block's input per sample (``S × d_model × w``) has over
    ``cp · tp``. The ring's memory (here) and its time (memplan.solver.ring) scale by it."""
    w = activation_itemsize(profile)
    return layer.input_bytes.slope / (w * parallel.cp * parallel.tp)


def ring_held_slopes(profile: Profile, layer: Layer, parallel: Parallel) -> tuple[float, float]:
    """``ring_held_bytes`` for a block of the profile on one rank of ``parallel``, per sample
    (``rank_k_elements``): ``(forward, backward)``; zeros without context parallel."""
    if parallel.cp <= 1:
        return 0.0, 0.0
    elements = rank_k_elements(profile, layer, parallel)
    forward, backward = ring_held_bytes(parallel.cp, activation_itemsize(profile))
    return forward * elements, backward * elements
