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
the most any rank holds equals these, exactly from cp 3 on (at cp 2 the backward holds up
to one ``w`` less).
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
    gathered = 2 * cp * w
    cast = a if w < a else 0  # each step's output to fp32 (the same tensor when w == a)
    forward = gathered + max(5 * w, w + 3 * a) + cast - w
    backward = gathered + 3 * a + 4 * a + 3 * w + 4 * w + 2 * w - 3 * w
    return forward, backward


def ring_held_slopes(profile: Profile, layer: Layer, parallel: Parallel) -> tuple[float, float]:
    """``ring_held_bytes`` for a block of the profile on one rank of ``parallel``, per sample
    (the block's input per sample is ``S × d_model × w``: a rank's K after repeat_kv is
    ``1/(cp·tp)`` of its elements): ``(forward, backward)``; zeros without context
    parallel."""
    if parallel.cp <= 1:
        return 0.0, 0.0
    w = activation_itemsize(profile)
    elements = layer.input_bytes.slope / (w * parallel.cp * parallel.tp)
    forward, backward = ring_held_bytes(parallel.cp, w)
    return forward * elements, backward * elements
