"""What one rank's data-parallel collectives move in an optimizer step. No torch.

The solver builds one :class:`Collective` per option (memplan.solver.options) and hands the
same one to ``timing.communication_bytes`` (the collectives' bytes) and
``timing.fsdp_copy_bytes`` (FSDP2's copies around them), so the two count alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective:
    """One rank's data-parallel traffic per optimizer step, before the strategy and the
    world size say how much of it crosses the link."""

    params_bytes: int
    """What the parameter all-gathers move (bf16 under a mixed-precision policy)."""
    grads_bytes: int
    """What the gradient reductions move (fp32 under ``reduce_dtype=float32``)."""
    accumulation_steps: int
    """Micro-steps per optimizer step."""
    reduce_every_micro_step: bool = False
    """FSDP reduce-scatters the gradients every micro-step, not once."""
    gathered_once: bool = False
    """A pipeline stage's FSDP: the parameters gathered once per step (no reshard after
    forward, the gradients reduced after the schedule)."""

    @property
    def gathers(self) -> int:
        """Parameter all-gathers a step: one per forward and one per backward of each
        micro-step, or one for the step when ``gathered_once``."""
        return 1 if self.gathered_once else 2 * self.accumulation_steps

    @property
    def reductions(self) -> int:
        """Gradient reductions a step: one per micro-step when ``reduce_every_micro_step``,
        else one."""
        return self.accumulation_steps if self.reduce_every_micro_step else 1
