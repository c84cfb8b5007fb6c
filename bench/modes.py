"""Per-layer modes (memplan.modes) on the model zoo: does choosing keep / selective / full
per layer beat keep-or-full at a binding budget, and is its peak still predicted?

Target effective batch 16, budget 70% of the measured no-checkpoint peak of one micro-batch
of 16 (binding: the plain plan at micro-batch 16 does not fit). Per family:

* the best plan with every mode the profile supports (on CPU: keep, selective, full;
  offload is CUDA only), the best keep/full plan (``--modes keep,full``: what memplan chose
  before modes), and full checkpointing (every layer full, best micro-batch);
* their step times measured in one run with interleaved repeats (``median_step_seconds``:
  every configuration steps once per round, so a slow spell hits all alike); identical
  plans are measured once;
* the all-modes plan's peak measured by an independent run that applies it with
  ``memplan.apply`` (``memplan.verify.verify_plan``), against its prediction and the budget.

Bar: all-modes ≥ 0.98× the keep/full plan's speed on every family and ≥ 1.05× on at least
one; peak within 5% of the prediction and within the budget. Raw rows:
``bench/results/<device>-modes.csv``."""

from __future__ import annotations

import time
from contextlib import ExitStack

from bench import zoo_common as zc
from memplan import memory, timing
from memplan.errors import NoPlanFitsError
from memplan.plan import Plan
from memplan.profile import Profile
from memplan.run.checkpoint import in_mode
from memplan.solver import SolveRequest, solve
from memplan.verify import verify_plan

FAMILIES = ("gpt_lm", "vit", "unet", "lora", "uneven_mlp", "resnet_bn")
WIDE = zc.Case(name="gpt_wide", family="GPT LM, d_model 512", file="gpt_wide.py")
"""This section's own family (not in the zoo's CASES): blocks whose matmuls dominate, where
selective checkpointing is really cheaper than full on a CPU (bench/zoo/gpt_wide.py)."""
FRACTION = 0.7
ROUNDS = 9
WARM_STEPS = 2
"""Untimed steps per configuration first: a new model's first steps are slow (allocator
and oneDNN warm-up) for longer than median_step_seconds' one warm-up round."""
SPEED_FLOOR = 0.98
SPEED_GAIN = 1.05
PEAK_TOLERANCE = 0.05


class ModeTrainer(zc.Trainer):
    """zoo_common's Trainer with each layer in its plan's mode."""

    def __init__(self, case: zc.Case, plan: Plan, device: str) -> None:
        self.modes = dict(plan.checkpoint)
        super().__init__(
            case=case,
            micro=plan.micro_batch_size,
            accumulation=plan.accumulation_steps,
            layers=tuple(self.modes),
            device=device,
        )

    def checkpointing(self):
        stack = ExitStack()
        modules = dict(self.model.named_modules())
        for mode in sorted(set(self.modes.values())):
            stack.enter_context(
                in_mode([modules[n] for n, m in self.modes.items() if m == mode], mode)
            )
        return stack


def _solve(case: zc.Case, profile: Profile, budget: int, min_micro: int, **kwargs) -> Plan | None:
    request = SolveRequest(
        min_micro=min_micro,
        target_batch=zc.TARGET,
        budget_bytes=budget,
        model_path=case.path,
        profile_path="(in memory)",
        allow_small_bn_micro=True,
        **kwargs,
    )
    try:
        return solve(profile, request).plan
    except NoPlanFitsError:
        return None


def _key(plan: Plan) -> tuple:
    return (plan.micro_batch_size, tuple(sorted(plan.checkpoint.items())))


def _describe(plan: Plan | None) -> str:
    if plan is None:
        return "none fits"
    counts: dict[str, int] = {}
    for mode in plan.checkpoint.values():
        counts[mode] = counts.get(mode, 0) + 1
    modes = ", ".join(f"{n} {m}" for m, n in sorted(counts.items())) or "all kept"
    return f"{plan.micro_batch_size}×{plan.accumulation_steps}, {modes}"


def _fixed_budget(profile: Profile, base: int) -> int:
    """Halfway between the least peak any plan of micro-batch TARGET needs (every mode
    allowed) and its measured no-checkpoint peak, before the solver's 3% margin."""
    bounds = memory.step_bounds(profile, zc.TARGET, 1, modes=memory.available_modes(profile))
    least = memory.min_allocated_bytes(bounds)
    return int((least + 0.5 * (base - least)) / (1 - memory.DEFAULT_MARGIN))


def _selective_over_full(profile: Profile, micro_batch: int) -> float | None:
    """What selective checkpointing costs per micro-step over what full costs, summed over
    the layers, as the probe measured it (None without a selective measurement)."""
    times = timing.measured_times(profile, micro_batch)
    if not times.selective_seconds:
        return None
    full = sum(times.mode_seconds(i, "full") for i in range(len(times.fwd_seconds)))
    return sum(times.selective_seconds) / full if full > 0 else None


def _seconds_per_mib(profile: Profile, micro_batch: int, mode: str) -> float | None:
    """What ``mode`` on every layer adds to a micro-step, per MiB it frees while the layers
    are held, as the probe measured both (None without a measurement, or when it frees
    nothing). An exact solver prefers the mode of the lower figure wherever the budget
    needs many bytes: it buys them cheaper."""
    times = timing.measured_times(profile, micro_batch)
    if mode == "selective" and not times.selective_seconds:
        return None
    n = len(times.fwd_seconds)
    seconds = sum(times.mode_seconds(i, mode) for i in range(n))
    freed = 0.0
    for layer in profile.layers:
        fit = layer.savings_bytes if mode == "full" else layer.selective_savings_bytes
        if fit is None:
            return None
        freed += fit.at(micro_batch)
    return seconds / (freed / 2**20) if freed > 0 else None


def family_row(case: zc.Case, device: str, min_micro: int = 1) -> dict:
    started = time.perf_counter()
    profile = zc.probed(case, device).profile
    base = zc.measured(case, device, zc.TARGET, 1, ()).peak_bytes
    budget = int(FRACTION * base) if min_micro == 1 else _fixed_budget(profile, base)
    plans = {
        "all modes": _solve(case, profile, budget, min_micro),
        "keep/full": _solve(case, profile, budget, min_micro, modes="keep,full"),
        "full ckpt": _solve(
            case,
            profile,
            budget,
            min_micro,
            modes="keep,full",
            always_checkpoint=profile.layer_names,
        ),
    }
    row: dict = {
        "case": case.name,
        "micro_batch": "any" if min_micro == 1 else f"{min_micro} (fixed)",
        "layers": len(profile.layer_names),
        "budget_bytes": budget,
        "base_bytes": base,
        "selective/full": _selective_over_full(profile, zc.TARGET),
        "full s/MiB": _seconds_per_mib(profile, zc.TARGET, "full"),
        "selective s/MiB": _seconds_per_mib(profile, zc.TARGET, "selective"),
        "selective barred": len(
            timing.selective_slower_layers(timing.measured_times(profile, zc.TARGET))
        ),
        **{f"plan {name}": _describe(plan) for name, plan in plans.items()},
    }
    distinct: dict[tuple, Plan] = {}
    for plan in plans.values():
        if plan is not None:
            distinct.setdefault(_key(plan), plan)
    trainers = [ModeTrainer(case, plan, device) for plan in distinct.values()]
    for trainer in trainers:
        with trainer.checkpointing():
            for _ in range(WARM_STEPS):
                trainer.step()
    seconds = dict(zip(distinct, zc.median_step_seconds(trainers, ROUNDS), strict=True))
    for name, plan in plans.items():
        row[f"s {name}"] = seconds[_key(plan)] if plan is not None else None
    best = plans["all modes"]
    if best is not None:
        kf, fc = row["s keep/full"], row["s full ckpt"]
        row["speedup vs keep/full"] = kf / row["s all modes"] if kf else None
        row["speedup vs full ckpt"] = fc / row["s all modes"] if fc else None
        verified = verify_plan(case.path, best, steps=1, device=device, check_gradients=False)
        row["predicted_bytes"] = best.predicted.peak_bytes
        row["measured_bytes"] = verified.measured_peak_bytes
        row["peak_error"] = zc.relative_error(
            best.predicted.peak_bytes, verified.measured_peak_bytes
        )
        row["within_budget"] = verified.measured_peak_bytes <= budget
    row["seconds"] = time.perf_counter() - started
    print(
        f"  {case.name}: {row.get('plan all modes')} vs {row.get('plan keep/full')}: "
        f"×{row.get('speedup vs keep/full') or float('nan'):.3f}, peak error "
        f"{row.get('peak_error', float('nan')):+.2%} ({row['seconds']:.0f} s)",
        flush=True,
    )
    return row


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ms_per_mib(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def _line(r: dict) -> str:
    return (
        f"| {r['case']} | {_fmt(r.get('selective/full'), '.2f')} | "
        f"{_ms_per_mib(r.get('full s/MiB'))} | {_ms_per_mib(r.get('selective s/MiB'))} | "
        f"{r['plan all modes']} | {r['plan keep/full']} | "
        f"{r['plan full ckpt']} | {_fmt(r.get('speedup vs keep/full'), '.3f')} | "
        f"{_fmt(r.get('speedup vs full ckpt'), '.3f')} | "
        f"{zc.mib(r['predicted_bytes']) if 'predicted_bytes' in r else '–'} | "
        f"{zc.mib(r['measured_bytes']) if 'measured_bytes' in r else '–'} | "
        f"{_fmt(r.get('peak_error'), '+.2%')} | {r.get('within_budget', '–')} |"
    )


def run(device: str) -> str:
    cases, skipped = zc.available_cases()
    chosen = [c for c in cases if c.name in FAMILIES] + [WIDE]
    rows = [family_row(case, device) for case in chosen]
    fixed = [family_row(case, device, min_micro=zc.TARGET) for case in chosen]
    zc.write_csv(zc.RESULTS / f"{device}-modes.csv", rows + fixed)
    measured = [r for r in rows if r.get("speedup vs keep/full") is not None]
    floor_ok = all(r["speedup vs keep/full"] >= SPEED_FLOOR for r in measured)
    gains = [r["case"] for r in measured if r["speedup vs keep/full"] >= SPEED_GAIN]
    peaks_ok = all(abs(r["peak_error"]) <= PEAK_TOLERANCE and r["within_budget"] for r in measured)
    header = [
        "| family | sel÷full (probe) | full ms/MiB | sel ms/MiB | all modes | keep/full | full ckpt | × vs keep/full | "
        "× vs full ckpt | predicted | measured | error | within budget |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        "### Per-layer modes at a binding budget (`bench/modes.py`)\n",
        f"Target batch {zc.TARGET}, budget {FRACTION:.0%} of the measured no-checkpoint peak of "
        f"micro-batch {zc.TARGET}. Plans: every mode the profile supports (on {device}: "
        + ("keep, selective, full" if device == "cpu" else "keep, selective, full, offload")
        + "), the best keep/full plan (`--modes keep,full`), and every layer fully "
        "checkpointed. Times: median of "
        f"{ROUNDS} interleaved steps in one run (identical plans measured once). Peak: an "
        "independent `verify_plan` run applying the all-modes plan with `memplan.apply`. "
        "`sel÷full (probe)`: what selective checkpointing of every layer adds to a "
        f"micro-step of {zc.TARGET} over what full checkpointing adds, as the probe measured "
        "it (interleaved rounds, medians of paired differences, forward overhead "
        "included); where a layer's ratio is ≥ 1 the solver does not offer selective "
        "there. `gpt_wide` (d_model 512, matmul-bound blocks) is this section's own "
        "family, added because on this CPU selective checkpointing only pays off where "
        "the matmuls it saves outweigh its per-op Python dispatch. `full ms/MiB`, `sel "
        "ms/MiB`: what the mode on every layer adds to a micro-step, per MiB it frees while "
        "the layers are held (the probe's figures at micro-batch "
        f"{zc.TARGET}): the price of a byte in each mode, which decides what an exact "
        "solver buys.\n",
        "**The bar's setting: any micro-batch dividing 16.**\n",
        *header,
    ]
    lines += [_line(r) for r in rows]
    priced = [r for r in rows if r.get("full s/MiB") and r.get("selective s/MiB")]
    dearer = [r["case"] for r in priced if r["selective s/MiB"] > r["full s/MiB"]]
    if priced:
        lines += [
            "",
            f"A MiB freed by selective checkpointing cost more than one freed by full "
            f"recompute on {len(dearer)} of {len(priced)} families"
            + (f" ({', '.join(dearer)})" if dearer else "")
            + ". Where it does, the exact solver takes selective only where a layer's "
            "whole full saving is more than the budget needs (a knapsack edge), never "
            "as the main way to fit.",
        ]
    all_kept = [r["case"] for r in rows if r.get("plan keep/full", "").endswith("all kept")]
    if all_kept:
        lines += [
            "",
            f"Where the keep/full plan checkpoints nothing ({', '.join(all_kept)}), a smaller "
            "micro-batch with every layer kept fits the budget, and on a CPU a smaller "
            "micro-batch costs little: no mode can be faster than keeping everything, so "
            "1.000 is the most these rows can show. The modes decide only where a "
            "micro-batch must be checkpointed, which the second table forces.",
        ]
    lines += [
        "",
        f"**Micro-batch fixed at {zc.TARGET}** (`--min-micro {zc.TARGET}`: e.g. for "
        "BatchNorm statistics), budget halfway between the least peak any plan of "
        f"micro-batch {zc.TARGET} needs and its no-checkpoint peak: only checkpointing can "
        "make it fit, so the modes decide the speed.\n",
        *header,
    ]
    lines += [_line(r) for r in fixed]
    fixed_measured = [r for r in fixed if r.get("speedup vs keep/full") is not None]
    if fixed_measured:
        ratios = [r["speedup vs keep/full"] for r in fixed_measured]
        lines += [
            "",
            f"Fixed micro-batch: all modes vs keep/full ×{min(ratios):.3f} to "
            f"×{max(ratios):.3f}; ≥ {SPEED_GAIN}×: "
            + (
                ", ".join(
                    r["case"] for r in fixed_measured if r["speedup vs keep/full"] >= SPEED_GAIN
                )
                or "none"
            )
            + f"; below {SPEED_FLOOR}×: "
            + (
                ", ".join(
                    r["case"] for r in fixed_measured if r["speedup vs keep/full"] < SPEED_FLOOR
                )
                or "none"
            )
            + f"; peaks within {PEAK_TOLERANCE:.0%} and budget: "
            + (
                "yes"
                if all(
                    abs(r["peak_error"]) <= PEAK_TOLERANCE and r["within_budget"]
                    for r in fixed_measured
                )
                else "NO"
            )
            + ".",
        ]
    lines += [
        "",
        f"Bar (first table): all modes ≥ {SPEED_FLOOR}× keep/full everywhere: "
        f"{'PASS' if floor_ok and measured else 'FAIL'}; ≥ {SPEED_GAIN}× on at least one "
        f"family: {'PASS (' + ', '.join(gains) + ')' if gains else 'FAIL'}; peak within "
        f"{PEAK_TOLERANCE:.0%} of the prediction and within budget: "
        f"{'PASS' if peaks_ok and measured else 'FAIL'}.",
    ]
    lines += [f"- {note}" for note in skipped]
    return "\n".join(lines) + "\n"
