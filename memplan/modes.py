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

from typing import Literal

from memplan.errors import BadInputError

Mode = Literal["keep", "selective", "full", "offload"]
MODES: tuple[Mode, ...] = ("keep", "selective", "full", "offload")
KEEP: Mode = "keep"
FULL: Mode = "full"
SELECTIVE: Mode = "selective"
OFFLOAD: Mode = "offload"

TIE_DIGIT: dict[str, int] = {"full": 0, "selective": 1, "offload": 2, "keep": 3}
"""A layer's digit in the solver's tie key: a smaller digit at the earliest differing
layer wins."""
TIE_BITS = 2

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


def describe_mode(mode: str) -> str:
    return {
        "keep": "kept",
        "selective": "selective checkpointing (matmul/conv/attention outputs kept)",
        "full": "full checkpointing (recomputed in backward)",
        "offload": "offloaded to host memory",
    }[mode]
