"""Per-layer activation modes: what a candidate layer does with the tensors its forward
saves for backward. No torch here (memplan.run.checkpoint applies them).

* ``keep`` — nothing: the saved tensors stay on the device until its backward.
* ``selective`` — per-op selective activation checkpointing as torchtitan runs it: the
  outputs of attention ops and of every other matmul are kept (:data:`SAVE_OPS`), every
  other op (the remaining matmuls, pointwise ops, norms) is recomputed in backward
  (PyTorch's ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
* ``full`` — full checkpointing: only the layer's inputs are kept, its whole forward runs
  again in backward.
* ``offload`` — the saved tensors are copied to pinned host memory in forward and back in
  backward (``torch.autograd.graph.save_on_cpu``); CUDA only, timed from the host link.

Each mode of a layer is an option of (bytes it frees while the layer is held, bytes at the
peak while the layer runs, extra seconds per micro-step); memplan.memory and the solver
choose one per layer. The order of ``MODES`` is also the tie-break among plans of equal
time and equal number of non-keep layers: an earlier layer in a more saving mode wins
(``full`` before ``selective`` before ``offload`` before ``keep``), which for keep/full
alone is the rule memplan used before modes existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memplan.errors import BadInputError

Mode = Literal["keep", "selective", "full", "offload"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeSpec:
    """One per-layer mode: everything about it that is not how it runs (memplan.run),
    what it costs in bytes (memplan.memory) or seconds (memplan.timing)."""

    name: Mode
    tie_rank: int
    """Its place in the tie-break among plans of equal time and equal number of non-keep
    layers: at the earliest layer where two plans differ, the smaller rank wins."""
    label: str
    """How a table shows a layer in this mode."""


MODE_SPECS: tuple[ModeSpec, ...] = (
    ModeSpec(name="keep", tie_rank=3, label="kept"),
    ModeSpec(name="selective", tie_rank=1, label="selective"),
    ModeSpec(name="full", tie_rank=0, label="checkpointed (full)"),
    ModeSpec(name="offload", tie_rank=2, label="offloaded"),
)
"""The modes, in the order ``--modes`` lists them. Adding one: a spec here, how it runs
(memplan.run.checkpoint), what the probe measures for it (memplan.probe), its bytes
(memplan.memory.terms) and seconds (memplan.timing), and when a solve may offer it
(memplan.solver.options); the tie key below widens by itself."""

MODES: tuple[Mode, ...] = tuple(spec.name for spec in MODE_SPECS)
SPEC: dict[str, ModeSpec] = {spec.name: spec for spec in MODE_SPECS}
KEEP: Mode = "keep"
FULL: Mode = "full"
SELECTIVE: Mode = "selective"
OFFLOAD: Mode = "offload"

TIE_DIGIT: dict[str, int] = {spec.name: spec.tie_rank for spec in MODE_SPECS}
"""A layer's digit in the solver's tie key: a smaller digit at the earliest differing
layer wins."""
TIE_BITS = max(1, (len(MODE_SPECS) - 1).bit_length())
"""Bits per layer in the solver's tie key: enough for every mode's rank, so a fifth mode
widens the key instead of spilling into the next layer's digit."""
if sorted(TIE_DIGIT.values()) != list(range(len(MODE_SPECS))):
    raise AssertionError("modes.MODE_SPECS: tie ranks must be 0 .. len(MODE_SPECS) - 1")

SAVE_OPS = (
    # functorch's compute-intensive ops (torch 2.13
    # torch/_functorch/partitioners.py get_default_op_list().compute_intensive_ops)
    "mm",
    "addmm",
    "bmm",
    "convolution",
    "convolution_backward",
    "_scaled_mm",
    "upsample_bilinear2d",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    # torchtitan's additions (compute_ops and comm_ops of _get_default_save_ops)
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
    "max",
    "linear",
    "topk",
    "reduce_scatter_tensor",
    "all_to_all_single",
    # memplan's one addition: the CPU's fused attention kernel, which stands for the GPU's
    # flash kernel in a cpu probe, a meta probe for the CPU and a gloo verify
    "_scaled_dot_product_flash_attention_for_cpu",
)
"""``aten`` (and ``_c10d_functional``) ops whose outputs the ``selective`` mode keeps;
everything else in the layer is recomputed in backward. The policy of torchtitan's
``SelectiveAC`` (pytorch/torchtitan at b5bcd76,
torchtitan/distributed/activation_checkpoint.py ``_get_default_save_ops`` and
``SelectiveAC._wrap_block``), which torchtitan's Llama 3.1 8B recipes run: these ops are
saved, except that every second matmul (:data:`COUNTED_MATMULS`, counted per checkpointed
call from the first) is recomputed, so a Llama block keeps 4 of its 7 projections (q, v,
gate, down) and its attention output, and re-runs k, o and up with the pointwise ops."""

COUNTED_MATMULS = ("mm", "linear")
"""The matmuls torchtitan counts: the 2nd, 4th, ... of a checkpointed call are recomputed
(``mm_ops`` there: ``aten.mm`` and, on backends that keep it whole, ``aten.linear``)."""

RECOMPUTE_EVERY_NTH_MATMUL = 2
"""torchtitan: "recomputes every second matmul to balance memory and compute"."""


def parse_modes(text: str | tuple[str, ...] | list[str]) -> tuple[Mode, ...]:
    """``keep,full`` → ("keep", "full"), in MODES order. ``keep`` is always allowed (a
    layer may always be left alone), so it is added when missing."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    items = [t for t in items if t]
    unknown = [t for t in items if t not in MODES]
    if unknown or not items:
        raise BadInputError(
            f"--modes {','.join(items) or '(empty)'}: unknown mode(s) "
            f"{', '.join(map(repr, unknown)) or '(none given)'}.",
            hint=f"Choose among {', '.join(MODES)}, comma-separated, e.g. --modes keep,full.",
        )
    chosen = set(items) | {KEEP}
    return tuple(m for m in MODES if m in chosen)
