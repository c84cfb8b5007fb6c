"""Run memplan's benchmark suite and rewrite BENCHMARKS.md.

    python -m bench.run --device cpu            # make bench
    python -m bench.run --device cuda           # make gpu-check
    python -m bench.run --device cpu --only solver_speed

Each section module has ``run(device) -> str`` returning markdown (and printing its figures
as it goes). Each section's markdown is kept in ``bench/results/<device>/<section>.md``, so
``--only`` refreshes one section without erasing the others; BENCHMARKS.md is composed from
every device's latest section results, so a CPU run does not erase the GPU figures recorded
on another machine, and each section says when and where it was run."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import platform
import sys
import time
from pathlib import Path

from memplan import render

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
    "report",
    "big_models",
    "real_models",
    "modes",
    "seqlen",
    "scale",
    "layouts",
    "retime",
    "calibrate",
    "kinds",
    "published",
    "fms_fsdp",
    "fused_norm",
    "engines",
    "hf_sweep",
    "vision_sweep",
    "timm_sweep",
    "peft_sweep",
]
GPU_SECTIONS = (
    "accuracy",
    "zoo_accuracy",
    "zoo_plans",
    "distributed",
    "probe_overhead",
    "modes",
    "calibrate",
    "kinds",
)
"""The sections that measure on the device under test. ``make gpu-check`` (``--device cuda``
without ``--only``) runs these alone: the others probe on meta, time the solver or run gloo
ranks on the CPU, or are CPU-only sweeps, so on a GPU machine they would spend its time
repeating their CPU figures (the published section alone probes for minutes)."""


def sections_for(device: str, only: list[str] | None) -> list[str]:
    """The sections a run measures: those asked for by ``--only``, else every section on
    the CPU and ``GPU_SECTIONS`` on a GPU, in ``SECTIONS`` order."""
    if only:
        return [name for name in SECTIONS if name in only]
    if device == "cuda":
        return [name for name in SECTIONS if name in GPU_SECTIONS]
    return list(SECTIONS)


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
        files = [RESULTS / device / f"{name}.md" for name in SECTIONS]
        files = [f for f in files if f.exists()]
        if files:
            parts.append(f"## {device.upper()}\n")
            parts.extend(f.read_text(encoding="utf-8") for f in files)
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
        help="run only these sections (repeatable); the others keep their saved results",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench: --device cuda needs a CUDA GPU; none is visible.", file=sys.stderr)
            return 3
    sections = sections_for(args.device, args.only)
    if len(sections) < len(SECTIONS) and not args.only:
        print(
            f"bench: {len(SECTIONS) - len(sections)} sections measure nothing on the GPU and "
            "keep their CPU results (bench.run.GPU_SECTIONS; --only runs any of them here)",
            flush=True,
        )
    machine = _machine(args.device)
    out_dir = RESULTS / args.device
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for name in sections:
        print(f"== {name}", flush=True)
        section_started = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        with render.progress(f"bench {name}") as on_progress:
            on_progress(0, 0, f"section {sections.index(name) + 1} of {len(sections)}")
            markdown = module.run(args.device)
        seconds = time.perf_counter() - section_started
        stamp = (
            f"_Run {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC on {machine}; "
            f"section wall time {seconds:.0f} s._\n"
        )
        (out_dir / f"{name}.md").write_text(f"{markdown.rstrip()}\n\n{stamp}", encoding="utf-8")
    elapsed = time.perf_counter() - started
    print(f"== done in {elapsed:.0f} s")
    (ROOT / "BENCHMARKS.md").write_text(compose(), encoding="utf-8")
    print(f"wrote {ROOT / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
