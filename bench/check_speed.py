"""How long `memplan check` takes per check of the repository's own memplan.yaml (the
bundled examples on meta): it runs on every push, so it has to be quick."""

from __future__ import annotations

from pathlib import Path

from memplan.check import time_checks

ROOT = Path(__file__).resolve().parent.parent


def run(device: str) -> str:
    del device  # checks probe on the device their config names (meta here)
    timings = time_checks(ROOT / "memplan.yaml")
    lines = [
        "### `memplan check` speed (`bench/check_speed.py`)\n",
        "The repository's own `memplan.yaml`: each check probes its model on `meta` and solves.\n",
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
    return "\n".join(lines) + "\n"
