"""How long `memplan check` takes: per check of the repository's own memplan.yaml (the
bundled examples on meta; it runs on every push, so it has to be quick), and for a config of
20 checks of the GPT example at different target batches and budgets, which probe the model
the same way and so share one probe."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from memplan.check import DEFAULT_CONFIG, run_checks
from memplan.check.isolate import start_fork_server

ROOT = Path(__file__).resolve().parent.parent
MANY = 20


def time_checks(
    config: str | Path = DEFAULT_CONFIG, *, only: Sequence[str] | None = None
) -> dict[str, dict[str, float | str]]:
    """Run the checks of ``config`` and return, per check name, its status and the seconds
    spent probing and solving."""
    report = run_checks(config, only=only)
    return {
        r.name: {
            "status": r.status,
            "probe_seconds": r.probe_seconds,
            "solve_seconds": r.solve_seconds,
            "seconds": r.seconds,
        }
        for r in report.results
    }


def many_checks_config(folder: Path, n: int = MANY) -> Path:
    """``n`` checks of examples/gpt.py on meta (rtx4090, bf16), target batches 8, 16, ...,
    each with a budget of 4 GiB."""
    checks = [
        {
            "name": f"gpt-{i}",
            "model": str(ROOT / "examples" / "gpt.py"),
            "target_batch": 8 * (i + 1),
            "budget": "4GiB",
            "device": "meta",
            "device_profile": "rtx4090",
            "precision": "bf16",
        }
        for i in range(n)
    ]
    path = folder / "memplan.yaml"
    path.write_text(yaml.safe_dump({"checks": checks}, sort_keys=False), encoding="utf-8")
    return path


def run(device: str) -> str:
    del device  # checks probe on the device their config names (meta here)
    started = time.perf_counter()
    start_fork_server()  # imports torch once, as the old in-process check did before its clock
    server_seconds = time.perf_counter() - started
    timings = time_checks(ROOT / "memplan.yaml")
    lines = [
        "### `memplan check` speed (`bench/check_speed.py`)\n",
        "The repository's own `memplan.yaml`: each check probes its model on `meta` in a child "
        "process forked from a server that imported torch once "
        f"(starting it: {server_seconds:.1f} s, not counted in the rows) and solves.\n",
        "| check | result | probe | solve | total |",
        "|---|---|---|---|---|",
    ]
    for name, t in timings.items():
        lines.append(
            f"| {name} | {t['status']} | {t['probe_seconds']:.1f} s | "
            f"{t['solve_seconds'] * 1e3:.0f} ms | {t['seconds']:.1f} s |"
        )
        print(
            f"  {name}: {t['status']} in {t['seconds']:.1f} s "
            f"(probe {t['probe_seconds']:.1f} s, solve {t['solve_seconds'] * 1e3:.0f} ms)"
        )
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        many = time_checks(many_checks_config(Path(folder)))
        wall = time.perf_counter() - started
    passed = sum(t["status"] == "pass" for t in many.values())
    probe = sum(float(t["probe_seconds"]) for t in many.values())
    solve = sum(float(t["solve_seconds"]) for t in many.values())
    lines += [
        "",
        f"{MANY} checks of the GPT example (meta, rtx4090, bf16; target batch 8 to {8 * MANY}): "
        f"{passed}/{MANY} pass in {wall:.1f} s wall ({probe:.1f} s probing: one shared probe; "
        f"{solve:.1f} s solving).",
    ]
    print(f"  {MANY} checks of one model: {wall:.1f} s (probe {probe:.1f} s, solve {solve:.1f} s)")
    return "\n".join(lines) + "\n"
