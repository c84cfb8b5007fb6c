"""Parallel layouts for Llama shapes (issue 25): Llama 2 7B and 70B and Llama 3.1 405B
(examples/llama70b.py) probed on meta in bf16 under FSDP's mixed-precision policy, with the
blocks measured under TP 2 on a fake process group, then ``solve --layout auto`` on 8, 64,
512 and 2048 H100-80GB ranks (TP within a node of 8). Beside each: Megatron's
``report_theoretical_memory`` for the same layout (megatron/training/theoretical_memory_usage.py,
with SP and selective recompute: 18 bytes per parameter of the most loaded shard, or
6 + 12/dp with the distributed optimizer; activations s·b·h·(18 + 4·ffn/h) per layer, all L
layers' worth on the first stage, divided by tp), and the layout of torchtitan's published
recipe for the nearest model (torchtitan/models/llama3/train_configs: 8B on 8 × tp 1,
selective op AC; 70B on 64 × tp 8, full AC; 405B on 128 × tp 8, full AC; all pp 1, FSDP
over the rest). The step times are memplan's model (compute from the H100 roofline,
collectives unoverlapped): a ranking, not a measurement.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memplan.devices import load_device
from memplan.errors import NoPlanFitsError
from memplan.profile import load_profile
from memplan.solver import SolveRequest
from memplan.solver.parallel import LayoutRequest, solve_layout
from memplan.units import GiB

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "llama70b.py"
MODELS = [  # (name, factory, shape name, torchtitan recipe)
    ("Llama-2-7B", "build_llama2_7b", "LLAMA2_7B", "8B: 8 ranks, tp 1, pp 1, AC selective (op)"),
    ("Llama-2-70B", "build_model", "LLAMA2_70B", "70B: 64 ranks, tp 8, pp 1, AC full"),
    (
        "Llama-3.1-405B",
        "build_llama31_405b",
        "LLAMA31_405B",
        "405B: 128 ranks, tp 8, pp 1, AC full",
    ),
]
WORLDS = (8, 64, 512, 2048)
BUDGET = 80 * GiB
DEVICE = "h100-80gb"

_PROBE = """
import json, sys, time
from memplan.probe.runner import probe_model
from memplan.profile import profile_to_yaml
start = time.perf_counter()
precision = sys.argv[4] if len(sys.argv) > 4 else "bf16"
profile = probe_model(sys.argv[1], device="meta", precision=precision, mixed_precision="params",
                      device_profile=sys.argv[3])
open(sys.argv[2], "w").write(profile_to_yaml(profile))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def probe(
    factory: str,
    out: Path,
    model: Path = MODEL,
    device: str = DEVICE,
    precision: str = "bf16",
) -> dict:
    """Probe ``model:factory`` on meta for ``device`` (a device profile name or spec file)
    in a fresh process (bf16 under FSDP's mixed-precision policy, or ``float8``: torchao's
    Float8Linear besides); its seconds."""
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, f"{model}:{factory}", str(out), device, precision],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])


def shape(name: str):
    sys.path.insert(0, str(MODEL.parent))
    import llama70b

    return getattr(llama70b, name)


def megatron_gib(s, parallel, micro: int, m: int) -> float:
    """Megatron's report_theoretical_memory for this layout (SP + selective recompute, the
    distributed optimizer), in GiB, first pipeline stage."""
    h, L, ffn, v = s.hidden, s.layers, s.intermediate, s.vocab
    kv = s.kv_heads / s.heads
    layer_params = 2 * h * (ffn * 3 / 2 + 1) + 2 * h * h * (1 + kv)
    embedding = h * v
    block = layer_params * L + h
    shard = (block / parallel.pp + embedding) / parallel.tp
    if parallel.pp == 1:
        shard += embedding / parallel.tp  # untied output layer
    weights = shard * (6 + 12 / parallel.dp)
    seq = s.seq_len
    act = seq * micro * h * (18 + 4 * ffn / h) * L
    act += 8 * seq * micro * parallel.pp + seq * micro * h * parallel.pp
    if parallel.pp > 1:
        act *= min(1, m / parallel.pp)
    else:
        act += seq * micro * h * 4 * (1 + v / h)
    return (weights + act / parallel.tp) / GiB


def run(device: str) -> str:
    del device  # meta probes
    spec = load_device(DEVICE)
    rows = []
    with tempfile.TemporaryDirectory(prefix="memplan-layouts-") as tmp:
        for name, factory, shape_name, recipe in MODELS:
            out = Path(tmp) / f"{factory}.yaml"
            took = probe(factory, out)["seconds"]
            profile = load_profile(out)
            s = shape(shape_name)
            print(f"layouts: {name} probed in {took:.1f} s", flush=True)
            for world in WORLDS:
                target = max(1024, world)
                request = SolveRequest(
                    target_batch=target,
                    budget_bytes=BUDGET,
                    world_size=world,
                    strategy="fsdp",
                    device_spec=spec,
                )
                start = time.perf_counter()
                try:
                    result = solve_layout(profile, request, LayoutRequest(auto=True))
                except NoPlanFitsError:
                    seconds = time.perf_counter() - start
                    rows.append(
                        f"| {name} | {world} | {target} | no layout fits | | | | | "
                        f"{seconds:.1f} s | {recipe} |"
                    )
                    continue
                seconds = time.perf_counter() - start
                plan = result.plan
                p = plan.parallel
                stages = plan.predicted.stage_peak_bytes or (plan.predicted.peak_bytes,)
                stage_text = " / ".join(f"{b / GiB:.1f}" for b in stages[:4])
                if len(stages) > 4:
                    stage_text += f" … ({len(stages)} stages)"
                mega = megatron_gib(s, p, plan.micro_batch_size, plan.accumulation_steps)
                ckpt = f"{len(plan.checkpoint)}/{s.layers}"
                print(f"layouts: {name} on {world}: {p.describe()} in {seconds:.1f} s", flush=True)
                rows.append(
                    f"| {name} | {world} | {target} | {p.describe()} | "
                    f"{plan.micro_batch_size} × {plan.accumulation_steps} | {ckpt} | "
                    f"{stage_text} | {mega:.1f} | {seconds:.1f} s | {recipe} |"
                )
    return (
        "\n".join(
            [
                "### Parallel layouts (TP, SP, PP with FSDP)\n",
                "Llama shapes (examples/llama70b.py) probed on meta, bf16, FSDP's mixed-"
                "precision policy, blocks measured under TP 2 on a fake process group; "
                f"`solve --layout auto --strategy fsdp --budget 80GiB` on {DEVICE}, target "
                "max(1024, ranks) sequences of 4096 tokens. *peak*: every pipeline stage's "
                "predicted peak per rank (GiB, reserve included). *Megatron*: its "
                "report_theoretical_memory for the same layout and micro-batch (SP + selective "
                "recompute, distributed optimizer; it leaves out FSDP's gathered units, the "
                "allocator reserve, the CUDA context and what full recompute keeps; it counts "
                "dropout-free Llama activations with GPT constants). *torchtitan recipe*: the "
                "published layout for the nearest model (8B/70B/405B, seq 8192, float8 for "
                "405B); its published memory per GPU (torchtitan's benchmarks/"
                "llama3_h100_202412_torchtitan.md) is set beside memplan's in the section "
                "*Published torchtitan runs* below. Step times rank layouts by memplan's model "
                "(roofline compute, unoverlapped collectives within a node at NVLink's NCCL "
                "bus bandwidth, 360 of 450 GB/s, and at 50 GB/s per GPU between nodes; a "
                "pipeline's bubble stretches each micro-batch's collectives with its compute): "
                "without a GPU, overlap and small-shape kernel efficiency are unknown.\n",
                "| model | ranks | target | layout | micro × m | ckpt | peak (GiB) | Megatron "
                "(GiB) | solve | torchtitan recipe |",
                "|---|---:|---:|---|---|---:|---|---:|---:|---|",
                *rows,
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    print(run("cpu"))
