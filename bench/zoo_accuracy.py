"""Predicted against measured peaks on the model zoo (bench/zoo/), at configurations the
probe never ran.

Per case: probe at micro-batches 1, 2, 4; then for micro-batches 8 and 16 (up to 4x the
largest probed size), accumulation 1 and 2, and checkpoint sets none / all / alternate /
one random set (seeded), compare ``memory.step_peak`` (with the probe's reserve: none off
CUDA) with the peak of real training steps (``measure_training_peak``: memplan's
live-tensor tracker; on CUDA also ``torch.cuda.max_memory_allocated``). On CPU, a subset is
measured a second, independent way, with PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker``. Last, the same model probed on
``meta`` (no memory, no data) against the real measurement.

Raw rows: ``bench/results/<device>-zoo.csv``. Bar: median |error| <= 2%, every case <= 5%."""

from __future__ import annotations

import random
import statistics
import time

import torch

from bench import plot
from bench import zoo_common as zc
from memplan.errors import MemplanError

MICRO_BATCHES = (8, 16)
ACCUMULATION = (1, 2)
MEDIAN_BAR = 0.02
CASE_BAR = 0.05
MEMTRACKER_CONFIGS = ((16, 1, "none"), (16, 2, "random"))
"""The subset measured with MemTracker too: (micro-batch, accumulation, checkpoint set)."""
META_CONFIGS = ((16, 1, "none"), (16, 2, "all"))


def checkpoint_sets(case: zc.Case, names: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """none, all, every other layer, and one random non-empty proper subset (seeded by the
    case name, so each run picks the same set)."""
    rng = random.Random(f"zoo-accuracy:{case.name}")
    size = rng.randint(1, max(1, len(names) - 1))
    picked = sorted(rng.sample(range(len(names)), size))
    return {
        "none": (),
        "all": names,
        "alternate": names[::2],
        "random": tuple(names[i] for i in picked),
    }


def accuracy_rows(case: zc.Case, device: str) -> list[dict]:
    """One row per configuration: predicted and measured peak, and the error."""
    probe = zc.probed(case, device)
    profile = probe.profile
    sets = checkpoint_sets(case, profile.layer_names)
    rows = []
    for micro in MICRO_BATCHES:
        for accumulation in ACCUMULATION:
            for set_name, layers in sets.items():
                run = zc.measured(case, device, micro, accumulation, layers)
                allocated = zc.predicted_allocated_bytes(profile, micro, accumulation, layers)
                row = {
                    "case": case.name,
                    "family": case.family,
                    "precision": case.precision,
                    "optimizer": profile.environment.optimizer_class,
                    "device": device,
                    "micro_batch": micro,
                    "accumulation": accumulation,
                    "checkpoint_set": set_name,
                    "checkpointed": len(layers),
                    "layers": len(profile.layer_names),
                    "predicted_bytes": allocated,
                    "measured_bytes": run.peak_bytes,
                    "error": zc.relative_error(allocated, run.peak_bytes),
                    "memtracker_bytes": "",
                    "memtracker_note": "",
                    "op_sequence_stable": profile.op_sequence_stable,
                }
                if device == "cuda":
                    with_reserve = zc.predicted_peak_bytes(profile, micro, accumulation, layers)
                    row["cuda_max_allocated_bytes"] = run.cuda_max_allocated_bytes
                    row["cuda_allocated_error"] = zc.relative_error(
                        allocated, run.cuda_max_allocated_bytes or 0
                    )
                    row["predicted_with_reserve_bytes"] = with_reserve
                    row["cuda_max_reserved_bytes"] = run.cuda_max_reserved_bytes
                    row["cuda_reserved_error"] = zc.relative_error(
                        with_reserve, run.cuda_max_reserved_bytes or 0
                    )
                rows.append(row)
    return rows


def memtracker_peak_bytes(case: zc.Case, micro: int, accumulation: int, layers) -> int:
    """The peak of one optimizer step (after a warm-up step) as PyTorch's MemTracker counts
    it: parameters, buffers and optimizer state registered with ``track_external``, the
    batch too; every tensor created inside its context (activations, gradients, temporaries,
    optimizer-step transients) as ops return them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from memplan.model.batch import batch_tensors

    trainer = zc.Trainer(case=case, micro=micro, accumulation=accumulation, layers=tuple(layers))
    with trainer.checkpointing():
        trainer.step()  # warm-up: optimizer state exists from here on
        trainer.optimizer.zero_grad(set_to_none=True)
        tracker = MemTracker()
        tracker.track_external(trainer.model, trainer.optimizer, *batch_tensors(trainer.batch))
        with tracker:
            # MemTracker refuses a second forward of the root module in one context unless
            # its per-module statistics are reset; the global peak it keeps is unaffected.
            trainer.step(before_micro_step=tracker.reset_mod_stats)
    snapshot = tracker.get_tracker_snapshot("peak")
    return sum(per_device["Total"] for per_device in snapshot.values())


def add_memtracker(case: zc.Case, rows: list[dict]) -> None:
    """Fill ``memtracker_bytes`` for the MEMTRACKER_CONFIGS rows (CPU only)."""
    for row in rows:
        key = (row["micro_batch"], row["accumulation"], row["checkpoint_set"])
        if key not in MEMTRACKER_CONFIGS:
            continue
        profile = zc.probed(case, "cpu").profile
        layers = checkpoint_sets(case, profile.layer_names)[row["checkpoint_set"]]
        try:
            row["memtracker_bytes"] = memtracker_peak_bytes(
                case, row["micro_batch"], row["accumulation"], layers
            )
        except Exception as exc:  # MemTracker's own limits, reported, not fatal
            cause = exc.__cause__ or exc
            row["memtracker_note"] = f"{type(cause).__name__}: {str(cause).splitlines()[0]}"


def meta_rows(case: zc.Case, device: str) -> list[dict]:
    """A meta probe's prediction against the real measurement, at META_CONFIGS."""
    started = time.perf_counter()
    try:
        profile = zc.probe_model(
            case.path, device="meta", micro_batches=zc.PROBED, precision=case.precision
        )
    except MemplanError as exc:
        return [{"case": case.name, "config": "-", "cannot_measure": str(exc).splitlines()[0]}]
    seconds = time.perf_counter() - started
    real = zc.probed(case, device).profile
    rows = []
    for micro, accumulation, set_name in META_CONFIGS:
        layers = checkpoint_sets(case, real.layer_names)[set_name]
        measured = zc.measured(case, device, micro, accumulation, layers).peak_bytes
        predicted = zc.predicted_allocated_bytes(profile, micro, accumulation, layers)
        rows.append(
            {
                "case": case.name,
                "config": f"{micro}×{accumulation} {set_name}",
                "meta_probe_s": seconds,
                "meta_predicted_bytes": predicted,
                "measured_bytes": measured,
                "error": zc.relative_error(predicted, measured),
                "cannot_measure": "",
            }
        )
    return rows


# --------------------------------------------------------------------------- report
def _summary(errors: list[float]) -> tuple[float, float, float]:
    magnitudes = [abs(e) for e in errors]
    return (
        statistics.median(magnitudes),
        zc.percentile(magnitudes, 0.95),
        max(magnitudes),
    )


def _verdict(median: float, worst: float) -> str:
    return "yes" if median <= MEDIAN_BAR and worst <= CASE_BAR else "**no**"


def _accuracy_table(cases: list[zc.Case], rows: list[dict], device: str) -> list[str]:
    lines = [
        "| case | optimizer | precision | layers | probe | configs | median \\|err\\| | "
        "p95 \\|err\\| | max \\|err\\| | worst configuration | meets bar |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        mine = [r for r in rows if r["case"] == case.name]
        median, p95, worst = _summary([r["error"] for r in mine])
        bad = max(mine, key=lambda r: abs(r["error"]))
        probe_s = zc.probed(case, device).seconds
        lines.append(
            f"| {case.name} | {mine[0]['optimizer']} | {case.precision} | {mine[0]['layers']} "
            f"| {probe_s:.1f} s | {len(mine)} | {median:.2%} | {p95:.2%} | {worst:.2%} "
            f"| {bad['micro_batch']}×{bad['accumulation']} {bad['checkpoint_set']} "
            f"({bad['error']:+.2%}) | {_verdict(median, worst)} |"
        )
    median, p95, worst = _summary([r["error"] for r in rows])
    lines.append(
        f"| **all** | | | | | {len(rows)} | {median:.2%} | {p95:.2%} | {worst:.2%} | | "
        f"{_verdict(median, worst)} |"
    )
    return lines


def _family_table(rows: list[dict]) -> list[str]:
    lines = [
        "| family | configs | median \\|err\\| | p95 \\|err\\| | max \\|err\\| |",
        "|---|---|---|---|---|",
    ]
    for family in dict.fromkeys(r["family"] for r in rows):
        errors = [r["error"] for r in rows if r["family"] == family]
        median, p95, worst = _summary(errors)
        lines.append(f"| {family} | {len(errors)} | {median:.2%} | {p95:.2%} | {worst:.2%} |")
    return lines


def _misses(rows: list[dict]) -> list[str]:
    missed = [r for r in rows if abs(r["error"]) > CASE_BAR]
    if not missed:
        return [f"Every configuration is within {CASE_BAR:.0%}.\n"]
    lines = [
        f"**{len(missed)} configuration(s) miss the {CASE_BAR:.0%} bar:**\n",
        "| case | micro × accum | checkpointed | predicted | measured | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in missed:
        lines.append(
            f"| {r['case']} | {r['micro_batch']} × {r['accumulation']} "
            f"| {r['checkpoint_set']} ({r['checkpointed']}/{r['layers']}) "
            f"| {zc.mib(r['predicted_bytes'])} | {zc.mib(r['measured_bytes'])} "
            f"| {r['error']:+.2%} |"
        )
    return lines


def _memtracker_table(rows: list[dict]) -> list[str]:
    checked = [r for r in rows if r["memtracker_bytes"] != ""]
    failed = [r for r in rows if r["memtracker_note"]]
    if not checked and not failed:
        return []
    agree = sum(r["memtracker_bytes"] == r["measured_bytes"] for r in checked)
    lines = [
        "#### Second instrument: PyTorch's MemTracker\n",
        "`torch.distributed._tools.mem_tracker.MemTracker` (a `TorchDispatchMode` in PyTorch "
        "itself) measures the same step independently: model and optimizer registered with "
        "`track_external`, everything else counted as ops create it. CPU byte counts are "
        "exact storage sizes in both (MemTracker rounds to 512 B only on CUDA).\n",
        "| case | micro × accum | checkpoint set | memplan tracker | MemTracker | "
        "tracker − MemTracker | prediction vs MemTracker |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in checked:
        diff = r["measured_bytes"] - r["memtracker_bytes"]
        lines.append(
            f"| {r['case']} | {r['micro_batch']} × {r['accumulation']} | {r['checkpoint_set']} "
            f"| {zc.mib(r['measured_bytes'])} | {zc.mib(r['memtracker_bytes'])} | {diff:+d} B "
            f"| {zc.relative_error(r['predicted_bytes'], r['memtracker_bytes']):+.2%} |"
        )
    for r in failed:
        lines.append(
            f"| {r['case']} | {r['micro_batch']} × {r['accumulation']} | {r['checkpoint_set']} "
            f"| {zc.mib(r['measured_bytes'])} | cannot measure: {r['memtracker_note']} | | |"
        )
    lines.append(
        f"\nThe two instruments agree to the byte on {agree}/{len(checked)} configurations"
        + (f"; MemTracker could not measure {len(failed)}" if failed else "")
        + ".\n"
    )
    return lines


def _meta_table(rows: list[dict], device: str) -> list[str]:
    lines = [
        f"#### meta probe vs real ({device}) measurement\n",
        'The same model probed with `device="meta"` (shapes only, nothing allocated), its '
        "prediction against the real measured peak.\n",
        "| case | configuration | meta probe | meta prediction | measured | error |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["cannot_measure"]:
            lines.append(f"| {r['case']} | | cannot measure: {r['cannot_measure']} | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['config']} | {r['meta_probe_s']:.1f} s "
            f"| {zc.mib(r['meta_predicted_bytes'])} | {zc.mib(r['measured_bytes'])} "
            f"| {r['error']:+.2%} |"
        )
    return lines


def run(device: str) -> str:
    started = time.perf_counter()
    torch.manual_seed(0)
    cases, skipped = zc.available_cases()
    rows: list[dict] = []
    meta: list[dict] = []
    for case in cases:
        case_rows = accuracy_rows(case, device)
        if device == "cpu":
            add_memtracker(case, case_rows)
        rows.extend(case_rows)
        median, _, worst = _summary([r["error"] for r in case_rows])
        print(
            f"  {case.name}: {len(case_rows)} configs, median |err| {median:.2%}, "
            f"max {worst:.2%} (probe {zc.probed(case, device).seconds:.1f} s)",
            flush=True,
        )
        meta.extend(meta_rows(case, device))
    zc.write_csv(zc.RESULTS / f"{device}-zoo.csv", rows)
    zc.write_csv(zc.RESULTS / f"{device}-zoo-meta.csv", meta)
    scatter = plot.plot(device)
    elapsed = time.perf_counter() - started

    lines = [
        "### Peak prediction on the model zoo (`bench/zoo_accuracy.py`)\n",
        f"Each case is probed at micro-batches {', '.join(map(str, zc.PROBED))} on {device}, "
        f"then predicted and run at micro-batches {', '.join(map(str, MICRO_BATCHES))} "
        f"(up to 4× the largest probed size) × accumulation "
        f"{', '.join(map(str, ACCUMULATION))} × checkpoint sets none / all / alternate / "
        "random (seeded): configurations the probe never ran. Measured: memplan's live-tensor "
        "tracker over real optimizer steps"
        + (" and `torch.cuda.max_memory_allocated`" if device == "cuda" else "")
        + ". Error = (predicted − measured) / measured. "
        f"Bar: median |error| ≤ {MEDIAN_BAR:.0%} and every configuration ≤ {CASE_BAR:.0%}. "
        f"Raw rows: `bench/results/{device}-zoo.csv`.\n",
        *_accuracy_table(cases, rows, device),
        "",
        *([f"![predicted vs measured peak](bench/results/{scatter.name})\n"] if scatter else []),
        "Per family (variants pooled):\n",
        *_family_table(rows),
        "",
        *_misses(rows),
        "",
        *_memtracker_table(rows),
        *_meta_table(meta, device),
        "",
    ]
    lines.extend(f"- {note}" for note in skipped)
    lines.append(f"\n_Section time: {elapsed:.0f} s._\n")
    return "\n".join(lines) + "\n"
