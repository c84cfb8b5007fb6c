"""Run memplan's benchmark suite and rewrite BENCHMARKS.md.

    python -m bench.run --device cpu            # make bench
    python -m bench.run --device cuda           # make gpu-check
    python -m bench.run --device cpu --only solver_speed

Each section module has ``run(device) -> str`` returning markdown (and printing its figures
as it goes). The markdown of a device's run is kept in ``bench/results/<device>.md``;
BENCHMARKS.md is composed from every device's latest results, so a CPU run does not erase
the GPU figures recorded on another machine."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SECTIONS = [
    "accuracy",
    "zoo_accuracy",
    "zoo_plans",
    "distributed",
    "probe_overhead",
    "solver_speed",
    "check_speed",
]


def _machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    import os

    return (
        f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def compose() -> str:
    parts = [
        "# memplan benchmarks\n",
        "Written by `make bench` (CPU) and `make gpu-check` (CUDA) — do not edit by hand. "
        "Each figure below is measured in the run that wrote it; ratios are taken within one "
        "run. Raw rows are in `bench/results/*.csv`.\n",
    ]
    for device in ("cpu", "cuda"):
        file = RESULTS / f"{device}.md"
        if file.exists():
            parts.append(file.read_text(encoding="utf-8"))
        elif device == "cuda":
            parts.append(
                "## CUDA\n\nNot run yet: no GPU was available to the session that "
                "wrote this file. Run `make gpu-check` on a GPU machine.\n"
            )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        help="run only these sections (repeatable); results are not saved",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench: --device cuda needs a CUDA GPU; none is visible.", file=sys.stderr)
            return 3
    sections = args.only or SECTIONS
    started = time.perf_counter()
    body = [
        f"## {args.device.upper()}\n",
        f"Run {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {_machine(args.device)}.\n",
    ]
    for name in sections:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"bench.{name}")
        body.append(module.run(args.device))
    elapsed = time.perf_counter() - started
    body.append(f"_Suite wall time: {elapsed:.0f} s._\n")
    print(f"== done in {elapsed:.0f} s")
    if args.only:
        print("\n".join(body))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.device}.md").write_text("\n".join(body), encoding="utf-8")
    (ROOT / "BENCHMARKS.md").write_text(compose(), encoding="utf-8")
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
