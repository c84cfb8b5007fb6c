"""Predicted against measured, on the bundled examples, with plans memplan chose itself.

For each example: probe it (micro-batches 1, 2, 4), then solve at two budgets — one that
forces activation checkpointing (below the plain peak of the largest micro-batch) and one
that forces accumulation (below what even full checkpointing needs at the largest
micro-batch) — and run every plan with ``memplan.verify``: measured peak (the probe's
tracker on CPU, torch.cuda on GPU) against predicted, measured step time against predicted.
The largest verified micro-batch is 4× or more the largest probed size, so the fit is tested
by extrapolation, not interpolation.

For the GPT example it also measures plan quality at the checkpoint-forcing budget: the
chosen plan's measured step time against full checkpointing and against no checkpointing,
each at the largest micro-batch that fits the same budget."""

from __future__ import annotations

import csv
import dataclasses
import time
from pathlib import Path

from memplan.errors import NoPlanFitsError
from memplan.plan import Plan
from memplan.probe import probe_model
from memplan.solver import SolveRequest, solve
from memplan.units import format_bytes
from memplan.verify import verify_plan

ROOT = Path(__file__).resolve().parent.parent
# (example, target batch): targets chosen so the largest micro-batch is >= 4x the probed 4.
CASES = [("examples/gpt.py", 16), ("examples/mlp.py", 64), ("examples/cnn_bn.py", 64)]
STEPS = 2


def _solve(profile, model: str, target: int, budget: int, **extra) -> Plan | None:
    request = SolveRequest(
        target_batch=target,
        budget_bytes=budget,
        model_path=model,
        profile_path="(in memory)",
        **extra,
    )
    try:
        return solve(profile, request).plan
    except NoPlanFitsError:
        return None


def _peak_at(profile, model: str, target: int, micro: int, *, all_ckpt: bool) -> int:
    """Predicted peak at one micro-batch with no or all layers checkpointed."""
    names = profile.layer_names
    extra = {"always_checkpoint": names} if all_ckpt else {"never_checkpoint": names}
    plan = _solve(
        profile,
        model,
        target,
        1 << 50,
        min_micro=micro,
        max_micro=micro,
        allow_small_bn_micro=True,
        **extra,
    )
    return plan.predicted.peak_bytes


def _budgets(profile, model: str, target: int) -> dict[str, tuple[int, Plan]]:
    """Two budgets and the plans memplan picks there.

    * forces checkpointing: halfway between the all-checkpointed and the plain peak of the
      smallest allowed micro-batch, so *every* plan has to checkpoint something;
    * forces accumulation: 90% of the all-checkpointed peak at micro-batch = target, so no
      plan can run the target in one micro-batch.
    Budgets are divided by (1 − margin) so the usable part is exactly that figure."""
    usable = 1 - SolveRequest.__dataclass_fields__["margin"].default
    smallest = 16 if profile.has_batchnorm else 1
    plain_small = _peak_at(profile, model, target, smallest, all_ckpt=False)
    ckpt_small = _peak_at(profile, model, target, smallest, all_ckpt=True)
    ckpt_full = _peak_at(profile, model, target, target, all_ckpt=True)
    wanted = {"checkpointing": (plain_small + ckpt_small) / 2, "accumulation": 0.9 * ckpt_full}
    found: dict[str, tuple[int, Plan]] = {}
    for kind, limit in wanted.items():
        budget = int(limit / usable)
        plan = _solve(profile, model, target, budget)
        if plan is not None:
            found[kind] = (budget, plan)
        else:
            print(f"  no plan fits the {kind}-forcing budget {format_bytes(budget)}")
    return found


def _largest_fitting(
    profile, model: str, target: int, budget: int, *, all_ckpt: bool
) -> Plan | None:
    names = profile.layer_names
    for micro in sorted((b for b in range(1, target + 1) if target % b == 0), reverse=True):
        extra = {"always_checkpoint": names} if all_ckpt else {"never_checkpoint": names}
        plan = _solve(
            profile,
            model,
            target,
            budget,
            min_micro=micro,
            max_micro=micro,
            allow_small_bn_micro=True,
            **extra,
        )
        if plan is not None:
            return plan
    return None


def run(device: str) -> str:
    rows: list[dict] = []
    quality: list[str] = []
    for example, target in CASES:
        model = str(ROOT / example)
        started = time.perf_counter()
        profile = probe_model(model, device=device, micro_batches=(1, 2, 4))
        probe_s = time.perf_counter() - started
        print(f"{example}: probed in {probe_s:.1f} s", flush=True)
        for kind, (budget, plan) in _budgets(profile, model, target).items():
            result = verify_plan(model, plan, steps=STEPS, device=device)
            row = {
                "example": example,
                "budget_kind": kind,
                "budget_bytes": budget,
                "micro_batch": plan.micro_batch_size,
                "accumulation": plan.accumulation_steps,
                "checkpointed": len(plan.checkpoint_layers),
                "layers": len(profile.layers),
                "predicted_peak_bytes": result.predicted_peak_bytes,
                "measured_peak_bytes": result.measured_peak_bytes,
                "peak_error": result.peak_error,
                "within_budget": result.within_budget,
                "predicted_step_s": result.predicted_step_seconds,
                "measured_step_s": result.measured_step_seconds,
                "time_error": result.time_error,
                "grad_check": result.gradient_check.status,
            }
            rows.append(row)
            print(
                f"  {kind}: b={plan.micro_batch_size}×{plan.accumulation_steps} "
                f"ckpt {row['checkpointed']}/{row['layers']}: predicted "
                f"{format_bytes(row['predicted_peak_bytes'])}, measured "
                f"{format_bytes(row['measured_peak_bytes'])} ({row['peak_error']:+.2%}), "
                f"within budget: {row['within_budget']}",
                flush=True,
            )
            if example.endswith("gpt.py") and kind == "checkpointing":
                quality.append(_quality(profile, model, target, budget, plan, result, device))

    out = ROOT / "bench" / "results" / f"{device}-accuracy.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    lines = [
        "### Peak prediction on the bundled examples (`bench/accuracy.py`)\n",
        "Plans chosen by `memplan solve` from a probe at micro-batches 1, 2, 4, then run "
        f"for {STEPS} optimizer steps by `memplan verify` (measured: the live-tensor "
        "tracker on CPU). Error = (predicted − measured) / measured.\n",
        "| example | budget forces | budget | plan (micro × accum) | checkpointed | "
        "predicted peak | measured peak | error | within budget | predicted step | "
        "measured step | grad check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {Path(r['example']).name} | {r['budget_kind']} | {format_bytes(r['budget_bytes'])} "
            f"| {r['micro_batch']} × {r['accumulation']} | {r['checkpointed']}/{r['layers']} "
            f"| {format_bytes(r['predicted_peak_bytes'])} | {format_bytes(r['measured_peak_bytes'])} "
            f"| {r['peak_error']:+.2%} | {'yes' if r['within_budget'] else '**no**'} "
            f"| {r['predicted_step_s'] * 1e3:.0f} ms | {r['measured_step_s'] * 1e3:.0f} ms "
            f"| {r['grad_check']} |"
        )
    worst = max(abs(r["peak_error"]) for r in rows)
    inside = sum(r["within_budget"] for r in rows)
    lines.append(
        f"\nWorst |peak error| {worst:.2%} over {len(rows)} plans; measured peak within "
        f"budget in {inside}/{len(rows)}.\n"
    )
    lines.extend(quality)
    return "\n".join(lines) + "\n"


def _quality(
    profile, model: str, target: int, budget: int, chosen: Plan, chosen_result, device: str
) -> str:
    """Chosen plan vs full / no checkpointing at the largest micro-batch fitting the budget."""
    rows = [("memplan's plan", chosen, chosen_result.measured_step_seconds)]
    for label, all_ckpt in (("full checkpointing", True), ("no checkpointing", False)):
        plan = _largest_fitting(profile, model, target, budget, all_ckpt=all_ckpt)
        if plan is None:
            rows.append((label, None, None))
            continue
        plan = dataclasses.replace(plan, budget_bytes=budget)
        result = verify_plan(model, plan, steps=STEPS, device=device, check_gradients=False)
        rows.append((label, plan, result.measured_step_seconds))
    base = rows[0][2]
    lines = [
        f"### Plan quality: GPT example, target batch {target}, budget {format_bytes(budget)}\n",
        "Measured time per optimizer step in one run (lower is better); speed-up = "
        "that configuration's time ÷ memplan's.\n",
        "| configuration | micro × accum | checkpointed | measured step | memplan's speed-up |",
        "|---|---|---|---|---|",
    ]
    for label, plan, seconds in rows:
        if plan is None:
            lines.append(f"| {label} | does not fit | | | |")
            continue
        lines.append(
            f"| {label} | {plan.micro_batch_size} × {plan.accumulation_steps} | "
            f"{len(plan.checkpoint_layers)}/{len(profile.layers)} | {seconds * 1e3:.0f} ms | "
            f"{seconds / base:.2f}× |"
        )
        print(f"  quality: {label}: {seconds * 1e3:.0f} ms ({seconds / base:.2f}× memplan's)")
    return "\n".join(lines) + "\n"
