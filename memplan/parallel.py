"""The parallel layout of a plan (issue 25): how the world's ranks divide into data-parallel
replicas and shards, and tensor-, pipeline- and context-parallel groups, as torchtitan's
``ParallelDims`` composes them (world = dp_replicate × dp_shard × cp × tp × pp). No torch.

A plan without a layout (``Plan.parallel is None``) is today's data parallelism: its
``world_size`` ranks all hold the model under its ``strategy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
"""Pipeline schedules: GPipe (all forwards, then all backwards), 1F1B (the first stage holds
up to pp micro-batches in flight), interleaved 1F1B (``virtual_stages`` stages per rank)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel:
    """Degrees of each parallel dimension; their product is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or HSDP's replicate dimension)."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2 ``fully_shard`` over this many ranks)."""
    tp: int = 1
    """Tensor-parallel degree: the attention and MLP projections split colwise/rowwise."""
    pp: int = 1
    """Pipeline stages (ranks in a pipeline)."""
    cp: int = 1
    """Context-parallel degree: the sequence split across ranks, K/V exchanged."""
    sequence_parallel: bool = False
    """With ``tp``: the norm/dropout regions sharded by sequence too (Megatron's SP)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule (only meaningful with ``pp`` > 1)."""
    virtual_stages: int = 1
    """Stages per pipeline rank; more than 1 only with ``interleaved_1f1b``."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs tp > 1")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ValueError("parallel.virtual_stages > 1 needs schedule interleaved_1f1b")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: samples of the effective batch are split over these."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp


def stage_layers(n_layers: int, stages: int) -> tuple[range, ...]:
    """The contiguous layers of each pipeline stage: ``n_layers // stages`` each, and the
    remainder one more on each of the *last* stages, because under 1F1B the first stage
    holds the most micro-batches in flight (pp of them) and the last only one. E.g. 5 layers
    on 2 stages: layers 0-1, then 2-4."""
    if stages < 1 or n_layers < stages:
        raise ValueError(f"{n_layers} layers cannot fill {stages} pipeline stages")
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for stage in range(stages):
        size = base + (1 if stage >= stages - extra else 0)
        out.append(range(start, start + size))
        start += size
    return tuple(out)
