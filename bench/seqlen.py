"""Planning the sequence length (issue 13): from a probe at two short lengths, how close
are the predicted peaks at 2×, 4× and 8× the longest probed length, and does
``--seq-len max`` answer with a length that runs within the budget while the next step
does not?

Models (``bench/seq_models.py``, built from code and configs, no weights): a GPT with eager
attention (the ``s × s`` scores are kept: memory quadratic in the length), the same GPT with
SDPA (linear on CPU), and a Hugging Face ``LlamaForCausalLM`` from a config (rotary
positions, transformers' default SDPA attention and masks). Each is probed at lengths 64 and
128, micro-batches 2 and 4 (``memplan probe --seq-lens 64,128 --micro-batches 2,4``), then
planned at 256, 512 and 1024 with no checkpoint and with every block checkpointed, at
micro-batch 2 (effective batch 4). Each prediction is compared with an independent run
(``measure_training_peak``: real optimizer steps under the probe's tracker, the plan's
layers checkpointed).

``--seq-len max``: budget halfway between the least peak any plan needs at 512 and the
unconstrained plan's peak there (margin 0); the answer L is run (within budget, within 5%),
and the least-memory plan at L + 64 is run too: its measured peak must exceed the budget.

Bar: |error| ≤ 5% at every length, the ``max`` run within budget, the next step over it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from memplan.model.loader import load_model_file
from memplan.probe import measure_training_peak
from memplan.probe.seqgrid import probe_seq_grid
from memplan.profile.seqlen import profile_at
from memplan.solver import SolveRequest, least_peak, solve
from memplan.solver.seqlen import solve_seq
from memplan.units import format_bytes

MODELS = Path(__file__).resolve().parent / "seq_models.py"
CASES = (
    ("GPT, eager attention", "build_eager"),
    ("GPT, SDPA", "build_sdpa"),
    ("HF Llama (config), SDPA", "build_llama"),
)
PROBED = (64, 128)
MICRO = (2, 4)
TARGET = 4
FACTORS = (2, 4, 8)
TOLERANCE = 0.05


def _measure(spec: str, seq_len: int, plan) -> int:
    mf = load_model_file(spec).at_seq_len(seq_len)
    run = measure_training_peak(
        mf,
        "cpu",
        plan.micro_batch_size,
        plan.accumulation_steps,
        checkpoint_modes=plan.checkpoint,
        steps=1,
    )
    return run.peak_bytes


def build_plan(profile, seq_len: int, checkpoint_all: bool):
    at = profile_at(profile, seq_len)
    request = SolveRequest(
        target_batch=TARGET,
        budget_bytes=10**15,
        margin=0,
        min_micro=2,
        max_micro=2,
        always_checkpoint=at.layer_names if checkpoint_all else (),
        modes=("keep", "full"),
    )
    return dataclasses.replace(solve(at, request).plan, seq_len=seq_len)


def run(device: str) -> str:
    if device != "cpu":
        return "### Sequence length (`bench/seqlen.py`)\n\nCPU only for now.\n"
    from memplan.model.loader import settle_torchvision

    settle_torchvision()  # transformers imports torchvision (bench/seq_models.py: Llama)
    lines = [
        "### Sequence length: probed at 64 and 128, planned longer (`bench/seqlen.py`)\n",
        f"Probe: lengths {', '.join(map(str, PROBED))}, micro-batches "
        f"{', '.join(map(str, MICRO))}. Plans: micro-batch 2 × 2 steps at each length, no "
        "checkpoint and every block checkpointed; each measured by an independent run.\n",
        "| model | length | × probed | checkpoint | predicted | measured | error |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    probe_seconds = {}
    profiles = {}
    for name, factory in CASES:
        spec = f"{MODELS}:{factory}"
        started = time.perf_counter()
        profile = probe_seq_grid(spec, PROBED, device="cpu", micro_batches=MICRO)
        probe_seconds[name] = time.perf_counter() - started
        profiles[name] = profile
        for factor in FACTORS:
            seq_len = factor * PROBED[-1]
            for checkpoint_all in (False, True):
                plan = build_plan(profile, seq_len, checkpoint_all)
                measured = _measure(spec, seq_len, plan)
                error = plan.predicted.peak_bytes / measured - 1
                worst = max(worst, abs(error))
                lines.append(
                    f"| {name} | {seq_len} | {factor}× | {'all' if checkpoint_all else 'none'} "
                    f"| {format_bytes(plan.predicted.peak_bytes)} | {format_bytes(measured)} "
                    f"| {error:+.2%} |"
                )
                print(lines[-1], flush=True)
    lines.append("")
    lines.append(
        f"Worst |error|: **{worst:.2%}** (bar {TOLERANCE:.0%}). Probe wall time (two lengths): "
        + ", ".join(f"{name} {s:.0f} s" for name, s in probe_seconds.items())
        + ".\n"
    )
    lines += _max_rows(profiles)
    return "\n".join(lines)


def _max_rows(profiles) -> list[str]:
    lines = [
        "**`--seq-len max`** (steps of 64, effective batch 4, margin 0; budget halfway "
        "between the least peak at 512 and the unconstrained plan's there):\n",
        "| model | budget | answer | plan | predicted | measured | within budget | next step "
        "| its least plan | predicted | measured | over budget |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for name, factory in CASES:
        spec = f"{MODELS}:{factory}"
        profile = profiles[name]
        loose = SolveRequest(target_batch=TARGET, budget_bytes=10**15, margin=0)
        at_512 = profile_at(profile, 512)
        low = least_peak(at_512, loose).peak_bytes
        high = solve(at_512, loose).plan.predicted.peak_bytes
        budget = (low + high) // 2
        found = solve_seq(profile, dataclasses.replace(loose, budget_bytes=budget), None)
        plan = found.result.plan
        measured = _measure(spec, plan.seq_len, plan)
        error = plan.predicted.peak_bytes / measured - 1
        within = measured <= budget
        next_len = found.next_len
        assert next_len is not None
        nxt = dataclasses.replace(
            least_peak(profile_at(profile, next_len), loose).plan, seq_len=next_len
        )
        next_measured = _measure(spec, next_len, nxt)
        over = next_measured > budget
        ok &= within and over and abs(error) <= TOLERANCE
        describe = f"{plan.micro_batch_size}×{plan.accumulation_steps}, ckpt {len(plan.checkpoint)}"
        lines.append(
            f"| {name} | {format_bytes(budget)} | {plan.seq_len} | {describe} "
            f"| {format_bytes(plan.predicted.peak_bytes)} | {format_bytes(measured)} ({error:+.2%}) "
            f"| {'yes' if within else '**no**'} | {next_len} "
            f"| {nxt.micro_batch_size}×{nxt.accumulation_steps}, ckpt {len(nxt.checkpoint)} "
            f"| {format_bytes(nxt.predicted.peak_bytes)} | {format_bytes(next_measured)} "
            f"| {'yes' if over else '**no**'} |"
        )
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"`--seq-len max` bar: {'met' if ok else '**not met**'}.\n")
    return lines
