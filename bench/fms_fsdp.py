"""A second engine's published runs: IBM's fms-fsdp training Llama 2 7B, beside memplan.

fms-fsdp (foundation-model-stack/fms-fsdp) trains IBM's FMS Llama with FSDP1 and SDPA's
FlashAttention-2, and publishes tokens per second per GPU for one recipe on two parts:
Llama 2 7B (hidden 4096, intermediate 11008, 32 layers of 32 heads, vocabulary 32000,
``fms_fsdp/utils/config_utils.py`` ``get_model_config("7b")``), sequence 4096 (its
``train_config.seq_length``), batch 2 per GPU, no activation checkpointing, HSDP (sharded
within each node of 8, replicated across nodes), bf16 parameters and reductions
(``policies/mixed_precision.py`` ``bfSixteen``), on 128 A100 80GB and 96 H100 80GB. The
README at 4ffb9bd (2024-03-21) gives the eager step (its ``use_torch_compile`` defaulted to
False); at ed74fd5 (2024-05-09, "update numbers with compile") the compiled one
(``torch.compile(model)`` over the FSDP units). It names the parts "A100 80G" and "H100
80G" and their network "400Gbps" and "800 Gbps", with no power limit, form factor, or
whether per node or per GPU: memplan takes the SXM parts at their datasheets (a100-80gb,
h100-80gb). The runs' larger models (13B with a checkpointing fraction the README does not
give; 34B and 70B sharded over every GPU, so across that network) are left out.

memplan: examples/llama70b.py ``build_llama2_7b`` (the same shapes) probed on meta for
each part (``--compiled`` for the compiled runs), FlashAttention-2's rates on the H100 (the
nightly torch of March-May 2024 ran it; cuDNN attention came first on sm90 only in 2.9),
solved as one node's shard group: FSDP over 8, micro-batch 2, nothing checkpointed. Left
out: the replicas' all-reduce across nodes, 1/8 of the gradients a GPU, which FSDP
overlaps with the backward (``replica_all_reduce_seconds``: its time were it exposed
whole, the network taken per node, the slower reading). Unlike torchtitan's H100s (bench
``published``), these ran under no published power cap: whether their H100 steps fall
short as those do, and by which kind of op, this says.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.gap import KINDS, Gap, consistency_line, gap_line, halved

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "llama70b.py"
FACTORY = "build_llama2_7b"
SEQ = 4096
LOCAL_BATCH = 2
SHARD_GROUP = 8
"""HSDP's shard group: one node of 8 GPUs."""
SOURCE = "foundation-model-stack/fms-fsdp README.md"


@dataclass(frozen=True)
class Run:
    device: str
    """memplan's device profile for the part."""
    compiled: bool
    tps: int
    """Published tokens per second per GPU."""
    gpus: int
    node_gbps: int
    """The network the README gives the cluster, per node (Gb/s)."""
    commit: str

    @property
    def step_seconds(self) -> float:
        return LOCAL_BATCH * SEQ / self.tps

    @property
    def label(self) -> str:
        part = "A100 80GB" if self.device == "a100-80gb" else "H100 80GB"
        return f"7B, {self.gpus} × {part}, {'compile' if self.compiled else 'eager'}"


RUNS = [
    Run("a100-80gb", False, 3700, 128, 400, "4ffb9bd"),
    Run("h100-80gb", False, 7500, 96, 800, "4ffb9bd"),
    Run("a100-80gb", True, 4550, 128, 400, "ed74fd5"),
    Run("h100-80gb", True, 9600, 96, 800, "ed74fd5"),
]


def spec_for(device: str):
    """The part's device profile; on the H100, attention at FlashAttention-2's measured
    rates (bench.published ``with_fa2``), which those runs' torch ran."""
    from bench.published import with_fa2
    from memplan.devices import load_device

    spec = load_device(device)
    return with_fa2(spec) if device == "h100-80gb" else spec


def replica_all_reduce_seconds(gradient_bytes: float, run: Run) -> float:
    """HSDP's all-reduce of each GPU's gradient shard (``gradient_bytes`` / 8) across the
    ``gpus / 8`` nodes, a ring (2 (n − 1) / n of the bytes), the node's network shared by
    its 8 GPUs: what the step would gain were it not overlapped."""
    nodes = run.gpus // SHARD_GROUP
    per_gpu = run.node_gbps * 1e9 / 8 / SHARD_GROUP  # bytes per second
    return 2 * (nodes - 1) / nodes * gradient_bytes / SHARD_GROUP / per_gpu


def probe(out: Path, spec, compiled: bool):
    """The 7B's meta profile for ``spec`` (``compiled``: ``probe --compiled``), written to
    ``out`` and read back."""
    from bench import published
    from memplan.profile import load_profile

    published.probe(FACTORY, out, str(published.spec_file(spec, out.parent)), "bf16",
                    compiled=compiled, model=MODEL)  # fmt: skip
    return load_profile(out)


def step(profile, spec) -> float:
    """memplan's step for one node's shard group: FSDP over 8, micro-batch 2, no AC."""
    from memplan.solver import SolveRequest
    from memplan.solver.parallel import LayoutRequest, solve_layout

    request = SolveRequest(
        target_batch=LOCAL_BATCH * SHARD_GROUP,
        budget_bytes=1 << 45,  # the published recipe whatever it needs: compared, not fitted
        world_size=SHARD_GROUP,
        strategy="fsdp",
        device_spec=spec,
        min_micro=LOCAL_BATCH,
        max_micro=LOCAL_BATCH,
        never_checkpoint=tuple(profile.layer_names),
    )
    plan = solve_layout(profile, request, LayoutRequest(tp=1, pp=1, cp=1)).plan
    assert not plan.checkpoint and plan.accumulation_steps == 1, plan
    return plan.predicted.step_seconds


def run(device: str) -> str:
    del device  # meta probes
    rows, gaps = [], []
    with tempfile.TemporaryDirectory(prefix="memplan-fms-") as tmp:
        for r in RUNS:
            spec = spec_for(r.device)
            steps, base = [], None
            for kind in (None, *KINDS):
                variant = spec if kind is None else halved(spec, kind)
                out = Path(tmp) / f"{variant.name}-{'compiled' if r.compiled else 'eager'}.yaml"
                # each halved kind is solved from the base probe: the meta clock's kinds
                # rescaled to the variant's rates (memplan.retime), the solver's timed by it
                profile = base or probe(out, variant, r.compiled)
                base = profile
                steps.append(step(profile, variant))
                print(f"fms_fsdp: {r.label} at {variant.name}: {steps[-1]:.3f} s", flush=True)
            ours = steps[0]
            exposed = replica_all_reduce_seconds(base.totals.grad_bytes, r)  # bf16, as reduced
            rows.append(
                f"| {r.label} | {spec.display_name} | {SOURCE} at {r.commit} | "
                f"{r.step_seconds:.3f} s ({r.tps:,} TPS) | {ours:.3f} s | "
                f"{ours / r.step_seconds:.2f} | {exposed:.2f} s |"
            )
            gaps.append(Gap(r.label, r.step_seconds, ours, tuple(s - ours for s in steps[1:])))
    h100 = [g for g, r in zip(gaps, RUNS, strict=True) if r.device == "h100-80gb"]
    kinds = " | ".join(KINDS)
    return "\n".join(
        [
            "### A second engine: fms-fsdp's Llama 2 7B on A100 and H100\n",
            *(f"{part.replace(chr(10), ' ')}\n" for part in __doc__.split("\n\n")[1:]),
            "| run | device spec | source | published step | memplan step | ratio | "
            "replicas' all-reduce, were it exposed (network per node) |",
            "|---|---|---|---:|---:|---:|---:|",
            *rows,
            "",
            "Where each run's gap lies (bench/gap.py, as in `published`: each kind of op at "
            "half its rate; its part of the step, and the k − 1 it alone would need):\n",
            f"| run | published step | memplan step | gap | part: {kinds} | k − 1: {kinds} |",
            "|---|---:|---:|---:|" + "---:|" * (2 * len(KINDS)),
            *(gap_line(g) for g in gaps),
            "",
            consistency_line(h100, "the H100 80GB runs (eager and compiled)"),
        ]
    )


if __name__ == "__main__":
    print(run("cpu"))
