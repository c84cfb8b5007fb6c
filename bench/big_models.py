"""Big models planned the way they are trained: Llama 2 7B, 13B and 70B shapes probed on
meta in bf16 with FSDP's mixed-precision policy (``--mixed-precision params``), solved for
FSDP on 8, 64 and 512 H100-80GB ranks, and compared with three published counts:

* the hand count of docs/big-models.md (sharded fp32 state, bf16 checkpoint inputs, one
  gathered unit and its prefetch, one layer's activations, the logits);
* DeepSpeed's ZeRO-3 estimator (``estimate_zero3_model_states_mem_needs`` in
  deepspeed/runtime/zero/stage3.py, no offload): 4 × largest layer's parameters + 18 bytes
  per parameter / GPUs — model states only;
* Megatron's activation formula (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", eq. 1): s·b·h·(34 + 5·a·s/h) bytes per layer,
  16-bit, attention scores materialised — next to memplan's measured bytes per layer.

Every probe runs in its own process, so its wall time and peak RSS are its own; the 7B and
70B shapes are also probed without reusing identical blocks (memplan.probe.dedup) for the
speed-up, in the same run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memplan import memory
from memplan.devices import load_device
from memplan.errors import NoPlanFitsError
from memplan.memory import Sharding
from memplan.profile import load_profile
from memplan.solver import SolveRequest, solve
from memplan.units import GiB

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "llama70b.py"
MODELS = [  # (name, factory, compare with a full probe)
    ("Llama-2-7B", "build_llama2_7b", True),
    ("Llama-2-13B", "build_llama2_13b", False),
    ("Llama-2-70B", "build_model", True),
]
WORLDS = (8, 64, 512)
SAMPLES_PER_RANK = 8
BUDGET = 80 * GiB
DEVICE = "h100-80gb"

_PROBE = """
import json, resource, sys, time
from memplan.probe.runner import probe_model
from memplan.profile import profile_to_yaml
start = time.perf_counter()
profile = probe_model(sys.argv[1], device="meta", precision="bf16", mixed_precision="params",
                      device_profile=sys.argv[4], reuse_identical=sys.argv[3] == "1")
seconds = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
open(sys.argv[2], "w").write(profile_to_yaml(profile))
print(json.dumps({"seconds": seconds, "cpu": usage.ru_utime + usage.ru_stime,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "reused": len(profile.deduplicated_layers)}))
"""


def probe(factory: str, out: Path, reuse: bool) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, f"{MODEL}:{factory}", str(out), "1" if reuse else "0",
         DEVICE],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- published counts
def shape_of(factory: str):
    sys.path.insert(0, str(MODEL.parent))
    try:
        import llama70b
    finally:
        sys.path.pop(0)
    return {
        "build_model": llama70b.LLAMA2_70B,
        "build_llama2_13b": llama70b.LLAMA2_13B,
        "build_llama2_7b": llama70b.LLAMA2_7B,
    }[factory]


def layer_params(s) -> int:
    attention = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2
    return attention + 3 * s.hidden * s.intermediate + 2 * s.hidden


def total_params(s) -> int:
    return s.layers * layer_params(s) + 2 * s.vocab * s.hidden + s.hidden


def megatron_layer_bytes(s, b: int) -> float:
    """Korthikanti et al. 2022, eq. 1: activations one transformer layer saves, 16-bit."""
    return s.seq_len * b * s.hidden * (34 + 5 * s.heads * s.seq_len / s.hidden)


def deepspeed_zero3_bytes(s, world: int) -> float:
    """DeepSpeed's estimate_zero3_model_states_mem_needs, no offload: the largest layer's
    (one module's own) parameters at 4 bytes, plus 18 bytes per parameter over the GPUs."""
    largest = max(s.vocab * s.hidden, s.hidden * s.intermediate, s.hidden * s.heads * s.head_dim)
    return 4 * largest + 18 * total_params(s) / world


def hand_count_bytes(s, world: int, b: int = 1) -> dict[str, float]:
    """docs/big-models.md, "The hand count": micro-batch b, every layer checkpointed."""
    psi = total_params(s)
    terms = {
        "state": 16 * psi / world,  # fp32 params, fp32 grads, Adam m and v, sharded
        "checkpoints": 2 * s.layers * s.seq_len * b * s.hidden,  # bf16 layer inputs
        "gathered": 2 * 2 * layer_params(s),  # one bf16 unit and its prefetch
        "recompute": megatron_layer_bytes(s, b),  # one layer's activations, recomputed
        "logits": 2 * 4 * s.seq_len * b * s.vocab,  # fp32 logits and their gradient
    }
    terms["total"] = sum(terms.values())
    return terms


# --------------------------------------------------------------------------- memplan
def least_allocated_bytes(profile, world: int, k: int) -> int:
    """The least allocated peak any checkpoint set reaches at micro-batch 1, either sync."""
    best = None
    for sync in ("last_micro_step", "every_micro_step"):
        sharding = Sharding(strategy="fsdp", world_size=world, grad_sync=sync)
        bounds = memory.step_bounds(profile, 1, k, sharding)
        least = memory.min_allocated_bytes(bounds)
        best = least if best is None else min(best, least)
    return best


def _gib(value: float) -> str:
    return f"{value / GiB:.1f}"


def run(device: str) -> str:
    del device  # meta probes: the machine only sets the probe's wall time
    spec = load_device(DEVICE)
    probe_rows, plan_rows = [], []
    with tempfile.TemporaryDirectory(prefix="memplan-big-") as tmp:
        for name, factory, compare in MODELS:
            s = shape_of(factory)
            out = Path(tmp) / f"{factory}.yaml"
            reused = probe(factory, out, reuse=True)
            full = probe(factory, Path(tmp) / "full.yaml", reuse=False) if compare else None
            profile = load_profile(out)
            layer = profile.layers[len(profile.layers) // 2]
            measured = layer.saved_bytes.at(1)
            megatron = megatron_layer_bytes(s, 1)
            speed = (
                f"{full['seconds']:.1f} s, {full['cpu']:.1f} s CPU "
                f"({full['cpu'] / reused['cpu']:.1f}× the CPU)"
                if full
                else "—"
            )
            took = f"{reused['seconds']:.1f} s ({reused['cpu']:.1f} s CPU)"
            print(
                f"big_models: {name} probe {took}, {reused['rss'] / GiB:.2f} GiB RSS, "
                f"{reused['reused']} layers reused; full {speed}",
                flush=True,
            )
            probe_rows.append(
                f"| {name} | {total_params(s) / 1e9:.2f} B | {s.layers} | {took} | "
                f"{reused['rss'] / GiB:.2f} GiB | {reused['reused']} of {s.layers} | {speed} | "
                f"{_gib(measured)} | {_gib(megatron)} | {measured / megatron:.2f} |"
            )
            for world in WORLDS:
                target = SAMPLES_PER_RANK * world
                started = time.perf_counter()
                request = SolveRequest(
                    target_batch=target, world_size=world, strategy="fsdp",
                    budget_bytes=BUDGET, device_spec=spec,
                )  # fmt: skip
                try:
                    plan = solve(profile, request).plan
                except NoPlanFitsError as error:  # 70B on 8 ranks: the state alone is too big
                    plan, least_fit = None, error.min_peak_bytes
                seconds = time.perf_counter() - started
                least = least_allocated_bytes(profile, world, SAMPLES_PER_RANK)
                hand = hand_count_bytes(s, world)["total"]
                states = sum(
                    memory.rank_state_bytes(profile, Sharding(strategy="fsdp", world_size=world))
                )
                ds = deepspeed_zero3_bytes(s, world)
                if plan is None:
                    chosen = f"no plan fits (needs {_gib(least_fit)} GiB) | — | — | —"
                else:
                    sync = "every" if plan.grad_sync == "every_micro_step" else "last"
                    chosen = (
                        f"{plan.micro_batch_size} × {plan.accumulation_steps} | "
                        f"{len(plan.checkpoint_layers)} | {sync} | "
                        f"{_gib(plan.predicted.peak_bytes)}"
                    )
                print(
                    f"big_models: {name} on {world}: {chosen}; least {_gib(least)}; hand "
                    f"{_gib(hand)}; solve {seconds:.2f} s",
                    flush=True,
                )
                plan_rows.append(
                    f"| {name} | {world} | {target} | {chosen} | {_gib(least)} | {_gib(hand)} | "
                    f"{least / hand:.2f} | {_gib(states)} | {_gib(ds)} | {seconds:.2f} s |"
                )
    return (
        "\n".join(
            [
                "### Big models: FSDP with mixed precision\n",
                "Llama 2 shapes (examples/llama70b.py and its 7B/13B factories) probed on meta in "
                "bf16 with `--mixed-precision params`, each probe in its own process (wall time "
                "on a shared machine; CPU time of the process, torch import included); *full* "
                "is the same probe without reusing identical blocks (memplan.probe.dedup), in "
                "the same run. Activations: bytes one middle layer saves per "
                "sample, measured, next to Megatron's s·b·h·(34 + 5as/h) (Korthikanti et al. "
                "2022, eq. 1; it counts dropout masks this model lacks, and materialised "
                "attention scores, 5as/h, which the H100's flash attention, the kernel the meta "
                "probe runs for it (memplan.probe.meta_attention), does not keep).\n",
                "| model | params | layers | probe (wall, CPU) | peak RSS | layers reused | full probe | "
                "activations/layer (GiB) | Megatron (GiB) | ratio |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                *probe_rows,
                "",
                f"FSDP plans: {SAMPLES_PER_RANK} samples per rank, {BUDGET // GiB} GiB budget on "
                f"{DEVICE}; GiB per rank. *least*: the least allocated peak at micro-batch 1 "
                "(any checkpoint set, either gradient sync); *hand*: docs/big-models.md's hand "
                "count for the same configuration; *states*: memplan's sharded fp32 params, "
                "grads and Adam state; *DeepSpeed*: its ZeRO-3 model-states estimator (no "
                "offload), which counts 18 bytes per parameter and the largest layer.\n",
                "| model | ranks | target | plan | ckpt | sync | peak | least | hand | "
                "least/hand | states | DeepSpeed | solve |",
                "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
                *plan_rows,
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    print(run("cpu"))
