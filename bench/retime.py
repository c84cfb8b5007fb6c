"""A meta profile planned for another GPU than its clock's (memplan.retime), against a
probe against that GPU itself.

Each model is probed on meta against each spec (micro-batches 1 and 4). For every ordered
pair, the profile probed against the first is timed for the second, rescaled from its
clock's bins, and compared with the second's own probe: the micro-step at micro-batches 1,
2, 4 and 16 (16 past the probed sizes: the line through them), and the worst of its parts
(each layer's forward, backward and selective change, the rest of the step). The per-layer
roofline that re-timed such a profile before (``retime.roofline_times``) is shown beside.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from memplan import retime, timing
from memplan.devices import load_device
from memplan.probe import probe_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

CASES = [  # (label, model, probe options, specs)
    ("example GPT, fp32", f"{EXAMPLES / 'gpt.py'}", {}, ("h100-80gb", "a100-80gb", "l4", "t4")),
    ("example MLP, fp32", f"{EXAMPLES / 'mlp.py'}", {}, ("h100-80gb", "l4")),
    (
        "Llama 3.1 8B, bf16",
        f"{EXAMPLES / 'llama31.py'}:build_8b",
        {"precision": "bf16", "mixed_precision": "params"},
        ("h100-80gb", "h200", "a100-80gb", "l4"),
    ),
    (
        "Llama 3.1 8B, float8",
        f"{EXAMPLES / 'llama31.py'}:build_8b",
        {"precision": "float8", "mixed_precision": "params"},
        ("h100-80gb", "h200", "l4"),
    ),
]
SIZES = (1, 2, 4, 16)


def _parts(times: timing.MicroStepTimes) -> list[float]:
    return [
        times.fixed_seconds,
        *times.fwd_seconds,
        *times.bwd_seconds,
        *times.selective_seconds,
    ]


def run(device: str) -> str:
    del device  # meta probes: the same on any machine
    rows = []
    for label, model, options, specs in CASES:
        profiles = {
            spec: probe_model(
                model, device="meta", micro_batches=(1, 4), device_profile=spec, **options
            )
            for spec in specs
        }
        for probed, target in itertools.permutations(specs, 2):
            spec = load_device(target)
            source, _ = retime.choose_timing_source(profiles[probed], spec)
            assert source == "rescaled", (label, probed, target, source)
            ratios, worst = [], 0.0
            for b in SIZES:
                own = retime.micro_step_times(profiles[target], b)
                rescaled = retime.rescaled_times(profiles[probed], b, spec)
                ratios.append(timing.micro_step_seconds(rescaled) / timing.micro_step_seconds(own))
                worst = max(
                    [worst]
                    + [
                        abs(got / want - 1)
                        for got, want in zip(_parts(rescaled), _parts(own), strict=True)
                        if want > 0
                    ]
                )
            own4 = timing.micro_step_seconds(retime.micro_step_times(profiles[target], 4))
            old = retime.roofline_times(profiles[probed], 4, spec)
            old_ratio = timing.micro_step_seconds(old) / own4
            print(
                f"retime: {label}, {probed} -> {target}: "
                + ", ".join(f"b={b} {r:.4f}" for b, r in zip(SIZES, ratios, strict=True))
                + f", worst part {worst:.2%}; per-layer roofline {old_ratio:.2f}",
                flush=True,
            )
            rows.append(
                f"| {label} | {probed} | {target} | "
                + " | ".join(f"{r:.4f}" for r in ratios)
                + f" | {worst:.2%} | {old_ratio:.2f} |"
            )
    return "\n".join(
        [
            "### Another GPU than the clock's (`bench/retime.py`)",
            "",
            __doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
            "Ratios are the rescaled time over the target's own probe (1 is exact).",
            "",
            "| model | probed against | planned for | micro-step, b=1 | b=2 | b=4 | b=16 "
            "| worst part | per-layer roofline, b=4 |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
