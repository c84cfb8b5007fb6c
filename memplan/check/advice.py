"""What a check's result says in words, and what to do about a failing one.

``verdict``, ``plan_text``, ``describe_growth`` and ``failure_text`` are the sentences every
output (terminal, JUnit, Markdown) shares; ``advise`` lists what would make a failing check
pass, most direct first; ``suggested_budget`` spells a round budget that fits.
"""

from __future__ import annotations

import math

from memplan.check.config import ResolvedCheck
from memplan.check.result import CheckResult, Growth, PlanSummary, Quantity
from memplan.units import GiB, KiB, MiB, format_bytes, parse_size

_QUANTITY_LABELS: dict[Quantity, str] = {
    "params_bytes": "params",
    "activation_bytes_per_sample": "activations/sample",
    "grad_bytes": "grads",
    "optimizer_state_bytes": "optimizer state",
}


def suggested_budget(min_peak_bytes: int, margin: float) -> str:
    """A round budget that fits ``min_peak_bytes`` after the margin, as memplan.yaml would
    spell it: rounded up to two significant figures in GiB, MiB or KiB (``22GiB``,
    ``2.9MiB``)."""
    need = max(min_peak_bytes, 1) / (1 - margin)
    unit, scale = next(
        ((u, v) for u, v in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)) if need >= v), ("KiB", KiB)
    )
    value = need / scale
    step = 1.0 if value >= 10 else 0.1
    rounded = math.ceil(round(value / step, 9)) * step
    text = f"{rounded:.0f}" if step == 1.0 else f"{rounded:.1f}"
    if parse_size(f"{text}{unit}") * (1 - margin) < min_peak_bytes:  # float rounding
        rounded += step
        text = f"{rounded:.0f}" if step == 1.0 else f"{rounded:.1f}"
    return f"{text}{unit}"


def advise(result: CheckResult, check: ResolvedCheck, n_layers: int) -> tuple[str, ...]:
    """What to do about a failing check, most direct first. The closest plan is the plan of
    least peak, so the advice follows what holds its peak: accumulation and checkpointing
    only help when activations do and the plan has room left to use them."""
    where = f"{check.field_path}.budget"
    tips = []
    if result.min_peak_bytes is not None:
        tips.append(
            f"raise the budget in memplan.yaml: {where}: "
            f"{suggested_budget(result.min_peak_bytes, result.margin)} would fit "
            f"(margin {result.margin:.0%} kept free)"
        )
    else:
        tips.append(f"raise the budget in memplan.yaml ({where})")
    plan = result.plan
    parts = dict(plan.breakdown) if plan is not None else {}
    state = parts.get("params", 0) + parts.get("grads", 0) + parts.get("optimizer", 0)
    batch_bytes = parts.get("activations", 0) + parts.get("transient", 0)
    if plan is None or not parts:
        tips.append("more accumulation (a smaller micro-batch), or checkpoint more layers")
    else:
        tips.append(
            f"the least-peak plan runs micro-batch {plan.micro_batch_size} × "
            f"{plan.accumulation_steps} accumulation, checkpoints {plan.checkpointed} of "
            f"{n_layers} layers and peaks during {plan.peak_phase or 'the step'}: "
            + ", ".join(f"{name} {format_bytes(value)}" for name, value in plan.breakdown if value)
        )
        reserve = parts.get("reserve", 0)
        if reserve > max(state, batch_bytes):
            tips.append(
                f"the CUDA context and allocator reserve ({format_bytes(reserve)}) is most of "
                "the peak; no plan shrinks it. If it is the 512 MiB default, a profile probed "
                "on the GPU (device: cuda) measures the real one"
            )
        elif batch_bytes >= state:
            if plan.micro_batch_size > 1:
                tips.append(
                    f"more accumulation: micro-batch {plan.micro_batch_size} is the "
                    "smallest allowed here; a target_batch with a smaller divisor (or "
                    "a lower BatchNorm floor) allows a smaller one"
                )
            if plan.checkpointed < n_layers:
                tips.append(
                    "checkpoint more: finer checkpoint candidates (`layers:` glob) "
                    "let the solver save more activations"
                )
            else:
                tips.append(
                    f"all {n_layers} candidate layers are checkpointed already; finer "
                    "candidates (`layers:` glob) can save more"
                )
        else:
            tips.append(
                f"the model state (params, grads, optimizer: {format_bytes(state)}) "
                "holds most of the peak, which accumulation and checkpointing do not "
                "shrink: train fewer parameters (e.g. LoRA), use a lighter optimizer, "
                "or shard the state (FSDP / ZeRO)"
            )
    if result.precision == "fp32":
        tips.append("lower precision: precision: bf16 (autocast) roughly halves activations")
    grown = result.grown
    if grown:
        top = grown[0]
        tips.append(
            f"or undo the growth since the baseline (largest: {top.name} "
            f"{_QUANTITY_LABELS[top.quantity]} +{format_bytes(top.delta)}); if it is "
            "intended, raise the budget and run `memplan check --update-baseline`"
        )
    return tuple(tips)


def describe_growth(growth: Growth) -> str:
    """``transformer.h.3: params 2.0 MiB → 8.0 MiB (+6.0 MiB)``."""
    label = _QUANTITY_LABELS[growth.quantity]
    if growth.baseline is None:
        return f"{growth.name}: new, {label} {format_bytes(growth.current or 0)}"
    if growth.current is None:
        return f"{growth.name}: removed (had {label} {format_bytes(growth.baseline)})"
    sign = "+" if growth.delta >= 0 else "-"
    change = f" ({sign}{format_bytes(abs(growth.delta))}"
    if growth.baseline:
        change += f", {growth.delta / growth.baseline:+.0%}"
    change += ")"
    return (
        f"{growth.name}: {label} {format_bytes(growth.baseline)} → "
        f"{format_bytes(growth.current)}{change}"
    )


def verdict(result: CheckResult) -> str:
    """One line: ``fits with 3.1 GiB headroom (13%)`` / ``exceeded by 1.2 GiB``."""
    if result.status == "error":
        return "could not check: " + result.message
    if result.min_peak_bytes is None:
        return "passes" if result.status == "pass" else ("no plan fits: " + result.message)
    headroom = result.headroom_bytes or 0
    if headroom >= 0:
        fraction = headroom / result.budget_bytes if result.budget_bytes else 0.0
        return f"fits with {format_bytes(headroom)} headroom ({fraction:.0%} of the budget)"
    return (
        f"exceeded by {format_bytes(-headroom)} (minimum peak "
        f"{format_bytes(result.min_peak_bytes)} vs {format_bytes(result.usable_budget_bytes)}"
        f" usable of {format_bytes(result.budget_bytes)})"
    )


def plan_text(plan: PlanSummary | None) -> str:
    """``8×4, ckpt 3/12``: micro-batch × accumulation (× world), checkpointed of candidates."""
    if plan is None:
        return "-"
    return (
        f"{plan.micro_batch_size}×{plan.accumulation_steps}"
        + (f"×{plan.world_size}" if plan.world_size > 1 else "")
        + f", ckpt {plan.checkpointed}/{plan.n_layers}"
    )


def failure_text(result: CheckResult) -> str:
    """The failure paragraph: verdict, what grew, what to do."""
    lines = [verdict(result)]
    grown = result.grown
    if grown:
        lines.append("grew since the baseline:")
        lines += [f"  {describe_growth(g)}" for g in grown]
    if result.baseline_note:
        lines.append(f"note: {result.baseline_note}")
    if result.advice:
        lines.append("what to do:")
        lines += [f"  - {tip}" for tip in result.advice]
    return "\n".join(lines)
