"""Per-layer activation modes: what a candidate layer does with the tensors its forward
saves for backward. No torch here (memplan.run.checkpoint applies them).

* ``keep`` — nothing: the saved tensors stay on the device until its backward.
* ``selective`` — selective activation checkpointing: the outputs of matmul, convolution
  and attention ops are kept, every other op (pointwise, norms, softmax) is recomputed in
  backward (PyTorch's ``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
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
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",
    "convolution",
    "_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_efficient_attention_forward",
    "_flash_attention_forward",
)
"""``aten`` ops whose outputs the ``selective`` mode keeps (the expensive ones: matmul,
convolution, attention); everything else in the layer is recomputed. The list follows the
policy torchtitan's selective AC uses (``_save_list`` in its
``distributed/activation_checkpoint.py``), without its every-other-matmul rule."""


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
