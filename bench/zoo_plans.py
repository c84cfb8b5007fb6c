"""memplan's plans on the model zoo: do they fit, are they the fastest, and what do the
tools people use today do instead.

Target effective batch 16 (4x the largest probed micro-batch), budgets at 40%, 60% and 80%
of the measured no-checkpoint peak of one micro-batch of 16.

* Budget safety: ``solve`` at each budget, run the plan (``measure_training_peak``),
  measured peak <= budget? Bar: always.
* Plan quality (60% budget): the plan's measured time per effective batch against the best
  of an exhaustive grid (every micro-batch dividing 16 × every prefix of the layers in
  execution order; every subset for the uneven MLP), and against full / no checkpointing
  at the largest micro-batch that fits. Times: median of interleaved steps.
* Today's tools (60% budget): the weights+gradients+Adam formula of ``accelerate
  estimate-memory``; a Lightning-style power-of-two batch-size search and Hugging Face-style
  shrink-on-OOM, where a trial "runs out of memory" when its measured peak exceeds the
  budget; memplan's probe+solve time against the time those trials take.

Raw rows: ``bench/results/<device>-zoo-plans.csv``."""

from __future__ import annotations

import itertools
import time

import torch

from bench import zoo_common as zc
from memplan import memory
from memplan.errors import NoPlanFitsError
from memplan.model.loader import load_model_file
from memplan.plan import Plan
from memplan.profile import Profile
from memplan.solver import SolveRequest, solve

FRACTIONS = (0.4, 0.6, 0.8)
QUALITY_FRACTION = 0.6
QUALITY_BAR = 0.95
"""The chosen plan's speed must be >= 95% of the grid's best (time ratio <= 1/0.95)."""
TIMING_ROUNDS = 5
BORDERLINE = 0.05
"""Grid points predicted within 5% of the budget are measured to decide whether they fit;
the others are decided by the prediction (section zoo_accuracy: errors well below 5%)."""
ALL_SUBSETS = ("uneven_mlp",)
"""Cases whose grid has every checkpoint subset, not only prefixes."""
# Lightning's BatchSizeFinder defaults (lightning.pytorch.callbacks.BatchSizeFinder):
# mode="power", init_val=2, steps_per_trial=3, max_trials=25.
LIGHTNING_INIT = 2
LIGHTNING_STEPS_PER_TRIAL = 3
LIGHTNING_MAX_TRIALS = 25
# accelerate.utils.find_executable_batch_size (what the HF Trainer's auto_find_batch_size
# uses): on an out-of-memory error, batch_size = int(batch_size * 0.9); the gradient
# accumulation steps are left as they are.
HF_SHRINK = 0.9


def held_bytes(run, device: str) -> int:
    """What a run holds against a budget: the tracker's peak off CUDA, the allocator's
    reserved peak on CUDA."""
    if device == "cuda" and run.cuda_max_reserved_bytes is not None:
        return run.cuda_max_reserved_bytes
    return run.peak_bytes


def base_peak_bytes(case: zc.Case, device: str) -> int:
    """The no-checkpoint peak of one micro-batch of TARGET: what the budgets are fractions of."""
    return held_bytes(zc.measured(case, device, zc.TARGET, 1, ()), device)


def solve_at(case: zc.Case, profile: Profile, budget: int) -> tuple[Plan | None, float, str]:
    """memplan's plan for TARGET at ``budget``, the solve time, and why none fits if so.
    Small BatchNorm micro-batches are allowed: the target itself is the BN floor (16)."""
    request = SolveRequest(
        target_batch=zc.TARGET,
        budget_bytes=budget,
        model_path=case.path,
        profile_path="(in memory)",
        allow_small_bn_micro=True,
    )
    started = time.perf_counter()
    try:
        plan = solve(profile, request).plan
        note = ""
    except NoPlanFitsError as exc:
        plan, note = None, str(exc).splitlines()[0]
    return plan, time.perf_counter() - started, note


# --------------------------------------------------------------------------- budget safety
def budget_rows(case: zc.Case, device: str) -> list[dict]:
    profile = zc.probed(case, device).profile
    base = base_peak_bytes(case, device)
    rows = []
    for fraction in FRACTIONS:
        budget = int(fraction * base)
        plan, solve_s, note = solve_at(case, profile, budget)
        row = {
            "table": "budget",
            "case": case.name,
            "fraction": fraction,
            "budget_bytes": budget,
            "solve_s": solve_s,
            "no_plan": note,
        }
        if plan is not None:
            run = zc.measured(
                case, device, plan.micro_batch_size, plan.accumulation_steps, plan.checkpoint_layers
            )
            row.update(
                micro_batch=plan.micro_batch_size,
                accumulation=plan.accumulation_steps,
                checkpointed=len(plan.checkpoint_layers),
                layers=len(profile.layer_names),
                predicted_bytes=plan.predicted.peak_bytes,
                measured_bytes=held_bytes(run, device),
                within_budget=held_bytes(run, device) <= budget,
            )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- plan quality
def divisors(n: int) -> list[int]:
    return [b for b in range(1, n + 1) if n % b == 0]


def checkpoint_choices(case: zc.Case, names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Prefixes in execution order (0 .. all layers), or every subset, fewest layers first."""
    if case.name in ALL_SUBSETS:
        return [
            subset
            for size in range(len(names) + 1)
            for subset in itertools.combinations(names, size)
        ]
    return [names[:count] for count in range(len(names) + 1)]


def fits(case: zc.Case, device: str, profile: Profile, micro: int, layers, budget: int) -> bool:
    """Whether a grid point's measured peak stays within the budget: measured when the
    prediction is within BORDERLINE of the budget, else decided by the prediction."""
    predicted = zc.predicted_peak_bytes(profile, micro, zc.TARGET // micro, layers)
    if abs(predicted / budget - 1) > BORDERLINE:
        return predicted <= budget
    run = zc.measured(case, device, micro, zc.TARGET // micro, layers)
    return held_bytes(run, device) <= budget


def grid(case: zc.Case, device: str, profile: Profile, budget: int) -> dict[str, list]:
    """The configurations worth timing, by role. Within one micro-batch, checkpointing a
    superset of layers only adds recompute, so when nothing needs checkpointing only the
    empty set is kept, and of the prefixes only the shortest that fits."""
    names = profile.layer_names
    timed: list[tuple[int, tuple[str, ...]]] = []
    largest_plain = largest_full = None
    for micro in divisors(zc.TARGET):
        feasible = [
            layers
            for layers in checkpoint_choices(case, names)
            if fits(case, device, profile, micro, layers, budget)
        ]
        if not feasible:
            continue
        if () in feasible:
            timed.append((micro, ()))
            largest_plain = micro
        elif case.name in ALL_SUBSETS:
            timed.extend((micro, layers) for layers in feasible)
        else:
            timed.append((micro, feasible[0]))
        if names in feasible:
            largest_full = micro
    return {"timed": timed, "plain": largest_plain, "full": largest_full}


def quality_row(case: zc.Case, device: str) -> dict:
    """The plan's measured time against the grid's best, twice: the grid of everything whose
    measured peak fits the budget, and the grid that keeps memplan's safety margin (what a
    plan is allowed to use: the budget less ``SolveRequest.margin``)."""
    profile = zc.probed(case, device).profile
    names = profile.layer_names
    budget = int(QUALITY_FRACTION * base_peak_bytes(case, device))
    usable = memory.usable_budget_bytes(budget, SolveRequest.__dataclass_fields__["margin"].default)
    plan, _, note = solve_at(case, profile, budget)
    row = {"table": "quality", "case": case.name, "budget_bytes": budget, "no_plan": note}
    if plan is None:
        return row
    full_grid = grid(case, device, profile, budget)
    kept_grid = grid(case, device, profile, usable)
    chosen = (plan.micro_batch_size, tuple(plan.checkpoint_layers))
    named = {}
    if full_grid["full"] is not None:
        named["full"] = (full_grid["full"], names)
    if full_grid["plain"] is not None:
        named["plain"] = (full_grid["plain"], ())
    configs = list(
        dict.fromkeys([chosen, *full_grid["timed"], *kept_grid["timed"], *named.values()])
    )
    trainers = [
        zc.Trainer(case=case, micro=m, accumulation=zc.TARGET // m, layers=layers, device=device)
        for m, layers in configs
    ]
    seconds = dict(zip(configs, zc.median_step_seconds(trainers, TIMING_ROUNDS), strict=True))
    best = min(full_grid["timed"], key=seconds.get)
    best_kept = min(kept_grid["timed"], key=seconds.get)
    row.update(
        micro_batch=plan.micro_batch_size,
        accumulation=plan.accumulation_steps,
        checkpointed=len(plan.checkpoint_layers),
        layers=len(names),
        chosen_s=seconds[chosen],
        best_micro_batch=best[0],
        best_checkpointed=len(best[1]),
        best_s=seconds[best],
        chosen_over_best=seconds[chosen] / seconds[best],
        best_kept_micro_batch=best_kept[0],
        best_kept_checkpointed=len(best_kept[1]),
        best_kept_s=seconds[best_kept],
        chosen_over_best_kept=seconds[chosen] / seconds[best_kept],
        grid_timed=len(configs),
    )
    for label, config in named.items():
        row[f"{label}_micro_batch"] = config[0]
        row[f"{label}_s"] = seconds[config]
    return row


# --------------------------------------------------------------------------- today's tools
def accelerate_estimate_bytes(case: zc.Case) -> int | None:
    """``accelerate estimate-memory``'s "Training using Adam" figure for the model: the
    largest of accelerate.commands.estimate.estimate_training_usage's terms over the size of
    the model's parameters and buffers (accelerate.utils.calculate_maximum_sizes). For
    float32 that is 4 × the model's bytes (model 1×, gradients 1×, Adam 2×, "step" 4×);
    for bfloat16, 2 ×. None when accelerate is not installed."""
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:
        return None
    model = load_model_file(case.path).build_model()
    total_bytes, _ = calculate_maximum_sizes(model)
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[case.precision]
    return int(max(estimate_training_usage(total_bytes, dtype).values()))


def lightning_power_search(case: zc.Case, device: str, budget: int) -> dict:
    """Lightning's BatchSizeFinder, mode "power": from init_val, double the batch size after
    each trial that fits; at the first trial that does not, halve it and stop (if nothing
    fitted yet, keep halving). Each trial that fits runs steps_per_trial steps; one that
    runs out of memory costs (at most) its first step."""
    size, last_fit, trials, ooms, seconds = LIGHTNING_INIT, None, 0, 0, 0.0
    while trials < LIGHTNING_MAX_TRIALS and size >= 1:
        trials += 1
        run = zc.measured(case, device, size, 1, ())
        if held_bytes(run, device) > budget:
            ooms += 1
            seconds += run.seconds_per_step
            size //= 2
            if last_fit is not None:
                break
        else:
            seconds += LIGHTNING_STEPS_PER_TRIAL * run.seconds_per_step
            last_fit = size
            size *= 2
    return {"trials": trials, "ooms": ooms, "batch": last_fit, "seconds": seconds}


def hf_shrink_on_oom(case: zc.Case, device: str, budget: int) -> dict:
    """Hugging Face Trainer's auto_find_batch_size: start at the configured per-device batch
    (the target, accumulation 1) and multiply by 0.9 after each out-of-memory error. The
    accumulation steps stay at 1, so the effective batch becomes whatever size first fits."""
    size, ooms, seconds = zc.TARGET, 0, 0.0
    while size >= 1:
        run = zc.measured(case, device, size, 1, ())
        if held_bytes(run, device) <= budget:
            return {"ooms": ooms, "batch": size, "seconds": seconds}
        ooms += 1
        seconds += run.seconds_per_step
        size = int(size * HF_SHRINK)
    return {"ooms": ooms, "batch": None, "seconds": seconds}


def tools_row(case: zc.Case, device: str) -> dict:
    probe = zc.probed(case, device)
    budget = int(QUALITY_FRACTION * base_peak_bytes(case, device))
    plan, solve_s, _ = solve_at(case, probe.profile, budget)
    at_one = held_bytes(zc.measured(case, device, 1, 1, ()), device)
    at_target = base_peak_bytes(case, device)
    estimate = accelerate_estimate_bytes(case)
    row = {
        "table": "tools",
        "case": case.name,
        "budget_bytes": budget,
        "measured_b1_bytes": at_one,
        "measured_target_bytes": at_target,
        "accelerate_bytes": estimate,
        "memplan_probe_s": probe.seconds,
        "memplan_solve_s": solve_s,
        "memplan_effective_batch": zc.TARGET if plan is not None else None,
    }
    if estimate is not None:
        row["accelerate_error_b1"] = zc.relative_error(estimate, at_one)
        row["accelerate_error_target"] = zc.relative_error(estimate, at_target)
    if case.plans:
        lightning = lightning_power_search(case, device, budget)
        hf = hf_shrink_on_oom(case, device, budget)
        row.update({f"lightning_{k}": v for k, v in lightning.items()})
        row.update({f"hf_{k}": v for k, v in hf.items()})
    return row


# --------------------------------------------------------------------------- report
def _budget_table(rows: list[dict]) -> list[str]:
    lines = [
        "| case | budget | plan (micro × accum) | checkpointed | predicted | measured | "
        "within budget |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['fraction']:.0%} = {zc.mib(r['budget_bytes'])}"
        if r["no_plan"]:
            lines.append(f"| {r['case']} | {budget} | no plan fits: {r['no_plan']} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {budget} | {r['micro_batch']} × {r['accumulation']} "
            f"| {r['checkpointed']}/{r['layers']} | {zc.mib(r['predicted_bytes'])} "
            f"| {zc.mib(r['measured_bytes'])} | {'yes' if r['within_budget'] else '**no**'} |"
        )
    return lines


def _config(row: dict, prefix: str) -> str:
    micro = row[f"{prefix}_micro_batch"]
    return f"{micro} × {zc.TARGET // micro}, ckpt {row[f'{prefix}_checkpointed']}/{row['layers']}"


def _quality_table(rows: list[dict]) -> list[str]:
    lines = [
        "| case | budget | memplan's plan | its time | grid best within the margin | "
        "memplan ÷ it | grid best within the budget | memplan ÷ it | full ckpt at largest "
        "fitting micro | no ckpt at largest fitting micro | configurations timed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["no_plan"]:
            lines.append(
                f"| {r['case']} | {zc.mib(r['budget_bytes'])} | no plan fits | " + "| " * 7
            )
            continue
        verdict = "" if r["chosen_over_best_kept"] <= 1 / QUALITY_BAR else " **(miss)**"
        cells = []
        for label in ("full", "plain"):
            if f"{label}_s" in r:
                cells.append(
                    f"{r[f'{label}_micro_batch']} × {zc.TARGET // r[f'{label}_micro_batch']}: "
                    f"{r[f'{label}_s'] * 1e3:.0f} ms ({r[f'{label}_s'] / r['chosen_s']:.2f}×)"
                )
            else:
                cells.append("does not fit")
        lines.append(
            f"| {r['case']} | {zc.mib(r['budget_bytes'])} "
            f"| {r['micro_batch']} × {r['accumulation']}, ckpt {r['checkpointed']}/{r['layers']} "
            f"| {r['chosen_s'] * 1e3:.0f} ms "
            f"| {_config(r, 'best_kept')}: {r['best_kept_s'] * 1e3:.0f} ms "
            f"| {r['chosen_over_best_kept']:.3f}{verdict} "
            f"| {_config(r, 'best')}: {r['best_s'] * 1e3:.0f} ms | {r['chosen_over_best']:.3f} "
            f"| {cells[0]} | {cells[1]} | {r['grid_timed']} |"
        )
    return lines


def _tools_table(rows: list[dict]) -> list[str]:
    lines = [
        "| case | measured peak b=1 / b=16 | accelerate estimate | its error b=1 / b=16 "
        "| Lightning power search: trials (OOM) → batch, time | HF shrink-on-OOM: OOMs → "
        "effective batch, time | memplan: probe + solve → effective batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["accelerate_bytes"] is None:
            estimate, errors = "accelerate not installed", ""
        else:
            estimate = zc.mib(r["accelerate_bytes"])
            errors = f"{r['accelerate_error_b1']:+.0%} / {r['accelerate_error_target']:+.0%}"
        lightning = hf = "(not run)"
        if "lightning_trials" in r:
            lightning = (
                f"{r['lightning_trials']} ({r['lightning_ooms']}) → {r['lightning_batch']}, "
                f"{r['lightning_seconds']:.2f} s"
            )
            hf = f"{r['hf_ooms']} → {r['hf_batch']}, {r['hf_seconds']:.2f} s"
        memplan = (
            f"{r['memplan_probe_s']:.1f} s + {r['memplan_solve_s'] * 1e3:.0f} ms → "
            f"{r['memplan_effective_batch'] or 'no plan'}"
        )
        lines.append(
            f"| {r['case']} | {zc.mib(r['measured_b1_bytes'])} / "
            f"{zc.mib(r['measured_target_bytes'])} | {estimate} | {errors} | {lightning} "
            f"| {hf} | {memplan} |"
        )
    return lines


def run(device: str) -> str:
    started = time.perf_counter()
    torch.manual_seed(0)
    cases, skipped = zc.available_cases()
    budgets, quality, tools = [], [], []
    for case in cases:
        budgets.extend(budget_rows(case, device))
        inside = [
            r["within_budget"] for r in budgets if r["case"] == case.name and not r["no_plan"]
        ]
        print(f"  {case.name}: within budget {sum(inside)}/{len(inside)}", flush=True)
        if case.plans:
            row = quality_row(case, device)
            quality.append(row)
            if "chosen_over_best" in row:
                print(
                    f"  {case.name}: chosen ÷ best {row['chosen_over_best_kept']:.3f} (within "
                    f"the margin), {row['chosen_over_best']:.3f} (within the budget)",
                    flush=True,
                )
        tools.append(tools_row(case, device))
    zc.write_csv(zc.RESULTS / f"{device}-zoo-plans.csv", budgets + quality + tools)
    elapsed = time.perf_counter() - started

    ran = [r for r in budgets if not r["no_plan"]]
    inside = sum(r["within_budget"] for r in ran)
    ratios = [r["chosen_over_best_kept"] for r in quality if "chosen_over_best_kept" in r]
    within_bar = sum(ratio <= 1 / QUALITY_BAR for ratio in ratios)
    lines = [
        "### Plans on the model zoo (`bench/zoo_plans.py`)\n",
        f"Target effective batch {zc.TARGET}; budgets are fractions of the measured "
        f"no-checkpoint peak of one micro-batch of {zc.TARGET}. Plans come from "
        "`memplan solve` on the probe of `zoo_accuracy` (micro-batches 1, 2, 4), small "
        "BatchNorm micro-batches allowed. Raw rows: "
        f"`bench/results/{device}-zoo-plans.csv`.\n",
        "#### Budget safety\n",
        *_budget_table(budgets),
        f"\nMeasured peak within budget in **{inside}/{len(ran)}** plan runs "
        f"({len(budgets) - len(ran)} budget(s) where no plan fits). Bar: all.\n",
        f"#### Plan quality at {QUALITY_FRACTION:.0%} of the no-checkpoint peak\n",
        "Measured time per effective batch (median of "
        f"{TIMING_ROUNDS} interleaved steps after a warm-up round). The grid: every "
        f"micro-batch dividing {zc.TARGET} × every prefix of the layers in execution order "
        f"(every subset for {', '.join(ALL_SUBSETS)}) whose measured peak fits the budget "
        f"(measured where the prediction is within {BORDERLINE:.0%} of it); within one "
        "micro-batch a superset only adds recompute, so the empty set, else the shortest "
        "fitting prefix, is timed. Two grids: configurations within the budget less "
        "memplan's 3% safety margin (what a plan may use: the bar applies here) and within "
        "the whole budget. Bar: memplan ÷ best ≤ "
        f"{1 / QUALITY_BAR:.3f} (≥ {QUALITY_BAR:.0%} of the best speed). CPU step times "
        "on a shared 2-core machine are noisy by several percent.\n",
        *_quality_table(quality),
        f"\nWithin the bar in {within_bar}/{len(ratios)} cases.\n",
        f"#### Against today's tools, budget {QUALITY_FRACTION:.0%} of the no-checkpoint peak\n",
        "- **accelerate estimate-memory** (`accelerate.commands.estimate."
        "estimate_training_usage`): for float32, max(model, gradients = model, Adam = 2 × "
        "model, step = 4 × model) = 4 × the bytes of parameters and buffers (16 B per fp32 "
        "parameter); for bfloat16, 2 ×. No activations, so its error depends on the batch.",
        '- **Lightning** `BatchSizeFinder(mode="power")`: from 2, double until a trial runs '
        "out of memory (measured peak > budget), keep the last that fitted; 3 steps per "
        "trial. It tunes the micro-batch only: the effective batch is what it ends at.",
        "- **Hugging Face** `auto_find_batch_size` (accelerate's `find_executable_batch_size`"
        f"): from {zc.TARGET}, × 0.9 on each out-of-memory error, accumulation unchanged: "
        "the effective batch silently becomes the size that first fits.",
        "- **memplan**: one probe (three micro-batches, tracked) and one solve; the effective "
        f"batch stays {zc.TARGET}. Trial times are untracked step times (an out-of-memory "
        "trial is charged one step), the probe's time includes its tracker's overhead.\n",
        *_tools_table(tools),
        "",
    ]
    lines.extend(f"- {note}" for note in skipped)
    lines.append(f"\n_Section time: {elapsed:.0f} s._\n")
    return "\n".join(lines) + "\n"
