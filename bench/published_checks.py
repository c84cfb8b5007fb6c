"""Two checks of bench ``published`` that set memplan against the published runs' own data
(issue 31): what the example model's op mix does to the eager 8B rows, and which 405B
memory figures the same per-rank shapes gave.

**Op mix.** examples/llama31.py's blocks are transformers-style (two fp32 copies in its
RMSNorm, ``rotate_half``, SDPA sharing the key/value heads). torchtitan's own Llama (9dec370,
torchtitan/models/llama/model.py and models/norms.py) runs other memory-bound ops on the
same shapes: rotary embeddings on complex pairs in fp32, key/value heads repeated into
full-size copies before SDPA, one fp32 copy in its RMSNorm. ``build_8b_torchtitan_ops``
(examples/llama70b.py ``TitanDecoderLayer``; tests/test_titan_ops.py: the same function)
builds those, and the eager 8B rows are predicted from both: the eager rows are where
memplan's clock charges every op its own kernel, so where an op mix would show.

**Same shapes.** Table 5's 1F1B run and Table 6's first run (sequence 32,768, cp 1) have
the same layout (FSDP 8 × TP 8 × PP 8, 1F1B, full AC, float8, compiled), the same
micro-batch count (8) and the same tokens a micro-batch (4 × 8,192 and 1 × 32,768):
every tensor of a rank has the same number of elements in both, so a model of shapes
predicts one figure for both. Their published memories differ; the predictions within 10%
of both lie in ``within_both``'s window.
"""

from __future__ import annotations

import dataclasses

TITAN_OPS = {"build_8b": "build_8b_torchtitan_ops"}
"""The factory of each example model with torchtitan's own ops."""

SAME_SHAPES = (("405B", "Table 5", "1f1b"), ("405B", "Table 6, seq 32,768", "1f1b"))
"""(model, table, schedule) of the rows with the same per-rank shapes (module doc)."""

TOLERANCE = 0.10
"""The band a memory prediction is held to (#34: within 10%)."""


def with_titan_ops(row):
    """The row probed from the example with torchtitan's own ops, or None where there is no
    such factory."""
    factory = TITAN_OPS.get(row.factory)
    return dataclasses.replace(row, factory=factory) if factory else None


def op_mix_line(row, ours, titan) -> str:
    """One table line: the row's published step and memory, memplan's from the example's
    ops (``ours``) and from torchtitan's (``titan``), each with its ratio."""
    step = row.step_seconds

    def cells(plan, reserved: float) -> str:
        seconds = plan.predicted.step_seconds
        memory = f"{reserved:.1f}" + (
            f" ({reserved / row.memory_gib:.2f})" if row.memory_gib else ""
        )
        return f"{seconds:.2f} s ({seconds / step:.2f}) | {memory}"

    published_memory = f"{row.memory_gib:.1f}" if row.memory_gib else "—"
    return (
        f"| {row.model} | {row.table}, {row.techniques} | {row.device} | {step:.2f} s | "
        f"{published_memory} | {cells(*ours)} | {cells(*titan)} |"
    )


def op_mix_section(lines: list[str]) -> list[str]:
    return [
        "**The example's op mix against torchtitan's** (bench/published_checks.py). The "
        "eager 8B rows again, probed from `build_8b_torchtitan_ops`: the same shapes with "
        "the memory-bound ops torchtitan 9dec370's Llama ran (rotary on complex pairs in "
        "fp32, key/value heads repeated into full copies, one fp32 copy in its RMSNorm), "
        "where examples/llama31.py has transformers' (`rotate_half`, SDPA sharing the "
        "heads, two fp32 copies). Step (ratio to published) and GiB (ratio).\n",
        "| model | published run | device | published step | published GiB | "
        "example's ops: step | GiB | torchtitan's ops: step | GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        *lines,
    ]


def same_shapes(a, b) -> bool:
    """Whether two published rows give every rank tensors of the same sizes: the same
    layout, checkpointing, precision and schedule, the same micro-batch count and the same
    tokens a micro-batch (micro-batch × sequence, whichever way they are split)."""
    return (
        (a.tp, a.pp, a.cp, a.dp, a.schedule, a.virtual_stages, a.ac, a.precision)
        == (b.tp, b.pp, b.cp, b.dp, b.schedule, b.virtual_stages, b.ac, b.precision)
        and a.techniques == b.techniques
        and a.micro * a.seq == b.micro * b.seq
        and a.local_batch // a.micro == b.local_batch // b.micro
    )


def within_both(memories: list[float], tolerance: float = TOLERANCE) -> tuple[float, float]:
    """The predictions within ``tolerance`` of every published figure: ``(low, high)``,
    empty (low > high) when none is."""
    return max(memories) * (1 - tolerance), min(memories) * (1 + tolerance)


def verdict_sentence(devices: list[tuple[str, float]], capacity_gib: float) -> str:
    """What one prediction for every run of a shape does to the 80 GB verdict: ``devices``
    holds each run's table and its published device memory (reserved plus what the
    allocator does not count), against the card's ``capacity_gib``."""
    fit = [table for table, gib in devices if gib <= capacity_gib]
    over = [table for table, gib in devices if gib > capacity_gib]
    amounts = ", ".join(f"{table} {gib:.1f} GiB" for table, gib in devices)
    if fit and over:
        return (
            f" On an 80 GB H100 ({capacity_gib:.1f} GiB) {' and '.join(fit)} fits and "
            f"{' and '.join(over)} does not ({amounts}, with the context and NCCL's buffers): "
            "one prediction gives both runs one verdict, so one of the two is wrong whichever "
            "it is."
        )
    return ""


def same_shapes_line(pairs: list[tuple[object, float]], verdict: str = "") -> str:
    """The paragraph for rows of one shape: ``(row, memplan's GiB)`` each, and the verdict
    sentence (``verdict_sentence``)."""
    rows = [row for row, _ in pairs]
    for row in rows[1:]:
        if not same_shapes(rows[0], row):
            raise ValueError(f"{rows[0].table} and {row.table} do not have the same shapes")
    low, high = within_both([row.memory_gib for row in rows])
    published = " and ".join(f"{row.table} {row.memory_gib:.1f} GiB" for row in rows)
    ours = " and ".join(f"{gib:.1f}" for _, gib in pairs)
    shapes = " and ".join(f"{row.micro} × {row.seq:,}" for row in rows)
    spread = max(r.memory_gib for r in rows) - min(r.memory_gib for r in rows)
    where = (
        "inside it"
        if all(low <= gib <= high for _, gib in pairs)
        else f"{low - max(gib for _, gib in pairs):.1f} GiB below it"
        if all(gib < low for _, gib in pairs)
        else "outside it"
    )
    window = f"{low:.1f}–{high:.1f} GiB" if low <= high else "no figure"
    return (
        f"**Same shapes, two published memories** (bench/published_checks.py). "
        f"{rows[0].model} {', '.join(row.table for row in rows)}: the same layout, "
        f"checkpointing and techniques, {rows[0].local_batch // rows[0].micro} micro-batches "
        f"of the same tokens ({shapes}), so every rank holds tensors of the same sizes in "
        f"each. Published: {published} ({spread:.1f} GiB apart); memplan {ours}. A "
        f"prediction within {TOLERANCE:.0%} of both must lie in {window}; memplan's is "
        f"{where}. What separates the two runs is nothing their recipes state, so no term "
        f"of the shapes can follow it.{verdict}"
    )
