"""Per-rank memory of the data-parallel strategies, predicted vs measured on real ranks.

The GPT example is probed once on one process; plans for 2 ranks are solved with each
strategy memplan can run with torch engines (DDP, ZeRO-1 via ZeroRedundancyOptimizer, FSDP2
``fully_shard``), and each plan is run by ``memplan verify --world-size 2``: two processes
joined with gloo (CPU) or NCCL (CUDA), every rank's peak measured with the probe's tracker.
Two shapes per strategy: accumulation with one layer checkpointed, and one larger
micro-batch with no accumulation (gradients then appear during backward, and FSDP
reduce-scatters them in every micro-step). Then FSDP under its mixed-precision policy
(bf16 parameters, fp32 masters and reductions) from a ``--mixed-precision params`` probe,
accumulating with each ``grad_sync``.
"""

from __future__ import annotations

import time
from pathlib import Path

from memplan.probe import probe_model
from memplan.solver import SolveRequest, solve
from memplan.units import format_bytes
from memplan.verify.distributed import verify_distributed

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples/gpt.py"
WORLD = 2
STRATEGIES = ("ddp", "zero1", "fsdp")
# (target batch, largest micro-batch, layers always checkpointed)
SHAPES = ((16, 4, ("blocks.1",)), (16, 8, ()))
STEPS = 2


def run(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.device_count() < WORLD:
        return (
            "### Data-parallel strategies (per rank)\n\n"
            f"Not run: {WORLD} GPUs are needed, this machine has {torch.cuda.device_count()}.\n"
        )
    model = str(ROOT / EXAMPLE)
    started = time.perf_counter()
    profile = probe_model(model, device=device, micro_batches=(1, 2, 4))
    print(f"{EXAMPLE}: probed in {time.perf_counter() - started:.1f} s", flush=True)
    lines = [
        "### Data-parallel strategies (per rank)\n",
        f"`{EXAMPLE}` probed on one process ({device}); plans for {WORLD} ranks solved per "
        f"strategy and run on {WORLD} real processes "
        f"({'NCCL' if device == 'cuda' else 'gloo'}), {STEPS} optimizer steps each. "
        "Predicted = the plan's per-rank peak; measured = each rank's live-tensor peak. "
        "Grad check: the ranks' accumulated gradient vs one process's full-batch gradient.\n",
        "| strategy | micro × accum × ranks | checkpointed | predicted / rank | "
        "rank 0 measured | rank 1 measured | worst error | grad check |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for strategy in STRATEGIES:
        for target, max_micro, always in SHAPES:
            request = SolveRequest(
                target_batch=target,
                budget_bytes=1 << 30,
                world_size=WORLD,
                strategy=strategy,
                max_micro=max_micro,
                always_checkpoint=always,
                model_path=model,
            )
            plan = solve(profile, request).plan
            result = verify_distributed(model, plan, steps=STEPS, device=device)
            measured = [r.peak_bytes for r in result.ranks]
            grad = result.gradient_check
            grad_text = grad.status + (
                f" ({grad.relative_error:.0e})" if grad.relative_error is not None else ""
            )
            shape = f"{plan.micro_batch_size} × {plan.accumulation_steps} × {WORLD}"
            print(
                f"  {strategy} {shape}: predicted {result.predicted_peak_bytes} B, measured "
                f"{measured} B, worst error {result.peak_error:+.2%}, grad {grad_text}",
                flush=True,
            )
            lines.append(
                f"| {strategy} | {shape} | {len(plan.checkpoint_layers)} | "
                f"{format_bytes(result.predicted_peak_bytes, precision=2)} | "
                + " | ".join(format_bytes(m, precision=2) for m in measured)
                + f" | {result.peak_error:+.2%} | {grad_text} |"
            )
    lines += _mixed_precision_rows(model, device)
    lines.append("")
    return "\n".join(lines) + "\n"


def _mixed_precision_rows(model: str, device: str) -> list[str]:
    """FSDP under MixedPrecisionPolicy(bf16, fp32) from a ``--mixed-precision params``
    probe, accumulating with each way of reducing gradients."""
    import dataclasses

    from memplan import memory

    profile = probe_model(
        model, device=device, precision="bf16", mixed_precision="params", micro_batches=(1, 2, 4)
    )
    target, max_micro, always = SHAPES[0]
    request = SolveRequest(
        target_batch=target,
        budget_bytes=1 << 30,
        world_size=WORLD,
        strategy="fsdp",
        max_micro=max_micro,
        always_checkpoint=always,
        model_path=model,
    )
    base = solve(profile, request).plan
    rows = []
    for sync in ("last_micro_step", "every_micro_step"):
        plan = dataclasses.replace(base, grad_sync=sync)
        peak = memory.plan_peak(profile, plan).peak_bytes
        plan = dataclasses.replace(
            plan, predicted=dataclasses.replace(plan.predicted, peak_bytes=peak)
        )
        result = verify_distributed(model, plan, steps=STEPS, device=device)
        measured = [r.peak_bytes for r in result.ranks]
        shape = f"{plan.micro_batch_size} × {plan.accumulation_steps} × {WORLD}"
        print(
            f"  fsdp bf16 {sync} {shape}: predicted {result.predicted_peak_bytes} B, measured "
            f"{measured} B, worst error {result.peak_error:+.2%}",
            flush=True,
        )
        grad = result.gradient_check
        rows.append(
            f"| fsdp bf16 params, {sync} | {shape} | {len(plan.checkpoint_layers)} | "
            f"{format_bytes(result.predicted_peak_bytes, precision=2)} | "
            + " | ".join(format_bytes(m, precision=2) for m in measured)
            + f" | {result.peak_error:+.2%} | {grad.status} |"
        )
    return rows


if __name__ == "__main__":
    import sys

    print(run(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
