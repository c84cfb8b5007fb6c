"""What fusing RMSNorm gains, memplan beside the gain torchtitan published (issue 31): a
public measurement of how much of an eager step the memory-bound ops of one kind take.

The published figure: pytorch/torchtitan#364 (XilunWu, May 2024: "enable TritonFusedRMSNorm
with local_map annotation"): "7%-8% performance gain compared to RMSNorm with TP", running
train_configs/llama3_8b.toml on 8 GPUs with ``tensor_parallel_degree = 4`` (so FSDP over 2),
``batch_size = 4``, ``seq_len = 8192``, ``compile = false``, no float8; that file's
activation checkpointing then was per-op selective (``mode = 'selective'``,
``selective_ac_option = 'op'``, torchtitan e593e7d of 2024-05-23). Its H100s are not named;
they are predicted on the December 2024 table's parts (bench.published ``run_spec``).

memplan's side: bench/fused_norm_model.py's Llama 3 8B with torchtitan's own ops, its
RMSNorm eager and fused (a stand-in that moves the Triton kernels' bytes), each probed on
meta and solved for that layout, batch and checkpointing; the gain is the eager step over
the fused one. Beside it, the gain were every memory-bound op 1.5× what memplan charges
(the regularity docs/design.md leaves unadopted, "Where the 8B rows' gap lies"): each
step plus half its memory-bound part, read from a probe with that kind at half rate
(bench.gap ``halved``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from bench.gap import halved
from bench.published import ROWS, VARIANTS, predict, probed, run_spec

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "bench" / "fused_norm_model.py"
SOURCE = "pytorch/torchtitan#364 (May 2024)"
PUBLISHED = (0.07, 0.08)
"""The published gain, "7%-8%": the fused run's throughput over the eager one's, less 1."""

SLOWER = 1.5
"""The regularity's factor on the memory-bound ops (docs/design.md)."""

MEMORY_BOUND = "memory-bound ops"


def layout():
    """The published run as a bench.published row: 8 GPUs, TP 4 (FSDP 2), local batch 4 in
    one micro-batch, per-op SAC, eager bf16 (its TPS unpublished: 1)."""
    eager = next(r for r in ROWS if r.model == "8B" and r.techniques == "eager")
    return dataclasses.replace(
        eager,
        factory="build_eager",
        table=SOURCE,
        gpus=8,
        tp=4,
        local_batch=4,
        micro=4,
        memory_gib=0.0,
        tps=1,
    )


def gain(eager: float, fused: float) -> float:
    """The fused run's throughput over the eager run's, less 1 (``eager`` and ``fused``:
    step seconds)."""
    return eager / fused - 1


def slowed(step: float, memory_bound_part: float, factor: float = SLOWER) -> float:
    """The step were its memory-bound ops ``factor`` times what memplan charges."""
    return step + (factor - 1) * memory_bound_part


def step_of(factory: str, spec, probes: dict, tmp: Path) -> float:
    """memplan's step for the layout with ``factory``'s norm, on ``spec``: the model probed
    once on meta (``bench.published.probed``, kept as the published section keeps its own)."""
    row = dataclasses.replace(layout(), factory=factory)
    profile = probed(probes, str(tmp), row, spec, "bf16", model=MODEL)
    _, modes, every = VARIANTS[row.ac][0]
    return predict(profile, row, spec, modes, every).predicted.step_seconds


def run(device: str) -> str:
    del device  # meta probes
    row = layout()
    spec = run_spec(row)
    slow = halved(spec, MEMORY_BOUND)
    steps: dict[str, tuple[float, float]] = {}
    probes: dict = {}
    with tempfile.TemporaryDirectory(prefix="memplan-fused-norm-") as folder:
        tmp = Path(folder)
        for factory in ("build_eager", "build_fused"):
            step = step_of(factory, spec, probes, tmp)
            part = step_of(factory, slow, probes, tmp) - step  # the memory-bound ops' part
            steps[factory] = (step, part)
            print(
                f"fused_norm: {factory}: step {step:.3f} s, memory-bound {part:.3f} s", flush=True
            )
    (eager, eager_part), (fused, fused_part) = steps["build_eager"], steps["build_fused"]
    ours = gain(eager, fused)
    regular = gain(slowed(eager, eager_part), slowed(fused, fused_part))
    low, high = PUBLISHED
    return "\n".join(
        [
            "### Fusing RMSNorm: memplan beside torchtitan's published gain\n",
            f'Source: {SOURCE}, "7%-8% performance gain" of torchtitan\'s Triton fused '
            "RMSNorm over its eager RMSNorm: Llama 3 8B on 8 GPUs, TP 4 with sequence "
            "parallelism and FSDP 2, batch 4 × 8192, per-op SAC, eager bf16. memplan: "
            "bench/fused_norm_model.py (torchtitan's own ops; the fused norm a stand-in that "
            "moves the Triton kernels' bytes) probed on meta and solved for that layout on "
            f"{spec.display_name}. The last column: both steps were every memory-bound op "
            f"{SLOWER}× what memplan charges (the regularity docs/design.md leaves "
            "unadopted), each step plus half its memory-bound part.\n",
            "| run | memplan eager step | memory-bound part | fused step | memory-bound "
            "part | memplan's gain | published gain | gain at 1.5× memory-bound |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            f"| {SOURCE}: 8B, TP 4 × FSDP 2, batch 4 × 8192, per-op SAC | {eager:.3f} s | "
            f"{eager_part:.3f} s | {fused:.3f} s | {fused_part:.3f} s | {ours:+.1%} | "
            f"+{low:.0%} to +{high:.0%} | {regular:+.1%} |",
            "",
            verdict(eager, fused, regular),
        ]
    )


def verdict(eager: float, fused: float, regular: float) -> str:
    """Where memplan's gain and the regularity's fall against the published range, and what
    memplan's saving would need of the fused step to give the published gain's middle."""
    low, high = PUBLISHED
    ours, middle = gain(eager, fused), (low + high) / 2
    if low <= ours <= high:
        return (
            f"memplan's gain is within the published range; with the memory-bound ops at "
            f"{SLOWER}× it is {regular:+.1%}."
        )
    needed = (eager - fused) / middle  # the fused step at which the saving is the middle
    away = "further from" if abs(regular - middle) > abs(ours - middle) else "nearer to"
    return (
        f"memplan's gain is {ours / middle:.1f}× the published range's middle; with the "
        f"memory-bound ops at {SLOWER}× it is {away} it ({regular:+.1%}). Either memplan's "
        f"saving ({eager - fused:.3f} s a step) is too large, or its steps too short: with "
        f"that saving the published {middle:.1%} needs a fused step of {needed:.2f} s, "
        f"{needed / fused:.2f}× memplan's. So this measurement gives the unadopted "
        "regularity no support: it would make the saving larger still."
    )
