"""How a probe measures: the settings every stage of it reads (the entry, the identical-block
shortcut, each probed size, the backend), in one frozen value. No torch: ``memplan check``'s
parent process keys its shared probes by it."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.profile.data import TIMING_ROUNDS

__all__ = ["TIMING_ROUNDS", "ProbeSettings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeSettings:
    device: str = "auto"
    """cpu, cuda or meta; ``auto``: cuda when there is one, else cpu."""
    micro_batches: tuple[int, ...] = (1, 2, 4)
    """The micro-batch sizes probed (two at least: affine fits need two, three give a
    residual)."""
    precision: str = "fp32"
    """fp32, bf16, fp16, or float8: torchao's Float8Linear for the linears, bf16 parameters
    for the rest (memplan.probe.float8)."""
    float8_recipe: str = "tensorwise"
    """With float8: torchao's recipe, tensorwise or rowwise."""
    float8_all_gather: bool = True
    """With float8 tensorwise: FSDP2 gathers the converted weights in float8."""
    compiled: bool = False
    """Meta only: time the training step as torch.compile runs it (memory-bound ops
    fused, memplan.probe.tracker ``FusedRegion``); the bytes stay eager's."""
    layers: str | None = None
    """Checkpoint candidates: comma-separated globs of module names; None: the repeated
    blocks memplan finds."""
    device_profile: str | None = None
    """The GPU spec a meta probe is for (memplan.devices); None: none named."""
    mixed_precision: str = "autocast"
    """How bf16/fp16 runs: autocast over fp32 parameters, or ``params`` (FSDP2's policy)."""
    timing_rounds: int = TIMING_ROUNDS
    """cpu and cuda: interleaved timing rounds per size (``probe --timing-rounds``); each
    time is a median over them. Meta times on its clock and runs none."""
    reuse_identical: bool = True
    """On meta, identical blocks reuse their representative's results (memplan.probe.dedup),
    and a long run of them is probed short and extrapolated (memplan.probe.repeats)."""
