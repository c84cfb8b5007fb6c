"""``memplan calibrate`` checked against a measured run: bench/wide_blocks.py (two wide
transformer blocks, matmul- and attention-bound) probed on this device, whose measured clock
is the truth, and probed on meta twice, timed by the roofline on the spec ``calibrate`` wrote
here and on the shipped spec. Each profile solved at micro-batch 2 with no block
checkpointed and with both fully checkpointed; the step times side by side.

On a CPU the base spec has peaks above any CPU (a CPU has no datasheet peak to take a
fraction of): the roofline's time is FLOPs over peak × efficiency, which is FLOPs over the
rate calibrate measured whatever the peak. On a GPU the base is the shipped spec of its
name, when there is one."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "bench" / "wide_blocks.py"
CPU_BASE = """name: cpu-no-datasheet
display_name: this CPU (peaks above any CPU's)
memory_bytes: null
bf16_flops: 1.0e+15
fp16_flops: 1.0e+15
fp32_flops: 1.0e+15
memory_bandwidth: 1.0e+13
"""
GPU_SPECS = {"H200": "h200", "H100": "h100-80gb", "A100": "a100-80gb", "L4": "l4", "T4": "t4"}


def _memplan(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"memplan {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done.stdout


def _step(profile: Path, modes: list[str]) -> float:
    out = _memplan(
        "solve", str(profile), "--target-batch", "2", "--budget", "1000GiB",
        "--min-micro", "2", "--max-micro", "2", *modes, "--json",
    )  # fmt: skip
    return json.loads(out)["plan"]["predicted"]["step_seconds"]


def run(device: str) -> str:
    import torch

    precision = "bf16" if device == "cuda" else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if device == "cuda":
            gpu = torch.cuda.get_device_name(0)
            base = next((spec for key, spec in GPU_SPECS.items() if key in gpu), None)
            if base is None:
                return f"### Calibrated device specs\n\nNo shipped spec for {gpu}: not run.\n"
        else:
            base = str(folder / "base.yaml")
            Path(base).write_text(CPU_BASE)
        spec = folder / "calibrated.yaml"
        args = ["calibrate", base, "-o", str(spec), "--device", device, "--precision", precision]
        shown = json.loads(_memplan(*args, "--json"))
        for m in shown["measured"]:
            print(f"calibrate: {m['kind']} {m['rate']:.4g} at {m['shape']}", flush=True)
        profiles = {}
        for label, args in (
            ("measured", ["--device", device, "--timing-rounds", "3"]),
            ("calibrated", ["--device", "meta", "--device-profile", str(spec)]),
            (
                "shipped",
                ["--device", "meta", "--device-profile", "cpu" if device == "cpu" else base],
            ),
        ):
            path = folder / f"{label}.profile.yaml"
            _memplan("probe", str(MODEL), *args, "--precision", precision,
                     "--micro-batches", "1,2", "-o", str(path))  # fmt: skip
            profiles[label] = path
        rows = []
        for name, modes in (
            ("no block checkpointed", ["--never-checkpoint", "blocks.*"]),
            (
                "both fully checkpointed",
                ["--always-checkpoint", "blocks.*", "--modes", "keep,full"],
            ),
        ):
            steps = {label: _step(path, modes) for label, path in profiles.items()}
            print(f"calibrate: {name}: {steps}", flush=True)
            rows.append((name, steps))
    shipped = (
        "cpu (100 GFLOP/s, 20 GB/s: a generic 2-core CPU's rough figures)"
        if device == "cpu"
        else base
    )
    lines = [
        "### Calibrated device specs (`memplan calibrate`)\n",
        __doc__.split("\n\n")[0].replace("\n", " ") + "\n",
        f"Rates measured by `memplan calibrate` ({precision}):\n",
        "| op | rate | at |",
        "|---|---:|---|",
        *(
            f"| {m['kind']} | {m['rate'] / 1e9:,.1f} {'GB/s' if m['kind'] == 'memory' else 'GFLOP/s'} | {m['shape']} |"
            for m in shown["measured"]
        ),
        "",
        f"Step at micro-batch 2 (`solve --min-micro 2 --max-micro 2`); meta clocks against the "
        f"measured one. Shipped spec: {shipped}.\n",
        "| plan | measured clock | meta, calibrated spec | ratio | meta, shipped spec | ratio |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {name} | {s['measured']:.3f} s | {s['calibrated']:.3f} s | "
            f"{s['calibrated'] / s['measured']:.2f} | {s['shipped']:.3f} s | "
            f"{s['shipped'] / s['measured']:.2f} |"
            for name, s in rows
        ),
    ]
    return "\n".join(lines) + "\n"
