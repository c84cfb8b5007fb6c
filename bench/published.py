"""memplan beside torchtitan's published Llama 3.1 runs on H100s (issue 31).

The published figures: torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (pytorch/
torchtitan, read at commit b5bcd76; the runs used torchtitan 9dec370, torch 1963fc8,
December 2024): Llama 3.1 8B, 70B and 405B, sequence 8192, bf16, on 96 GB HBM2e H100s at
500 W, 8 per host. Their memory is ``torch.cuda.max_memory_reserved`` (torchtitan's
``DeviceMemoryMonitor``, torchtitan/components/metrics.py: ``max_reserved_gib``), the
maximum over all GPUs; their throughput is tokens per second per GPU at step 90, so one
step takes ``local tokens per GPU / TPS``.

memplan's side: the shapes of examples/llama31.py probed on meta (bf16 under FSDP's
mixed-precision policy, timed against the published parts (run_spec), the blocks measured under TP
2 on a fake process group), then the *published* layout solved with its degrees, its local
batch and its activation checkpointing fixed. The per-GPU memory compared is memplan's
allocated peak plus its allocator reserve (what ``max_memory_reserved`` counts: no CUDA
context, no NCCL buffers). Rows published with Float8 (``precision="float8"``: the 70B and
405B recipes, and the 8B float8 rows of Tables 1 and 3) are predicted from a ``--precision
float8`` probe (issue 34), and each is solved again from the bf16 probe for the same layout.
memplan's bytes are eager torchao's; its meta clock charges the float8 casts as
torch.compile fuses them (memplan.probe.float8). A run that compiled (``Published.compiled``:
'compile' among its techniques) is probed with ``--compiled``: the meta clock charges its
memory-bound ops as inductor's fused kernels move bytes (memplan.probe.tracker
``FusedRegion``); the eager runs, one kernel an op.

Times are memplan's meta clock against the device spec's peaks times its measured
efficiencies (profiles/devices/*.yaml ``efficiency``, each cited there; none taken from these
runs). The runs' software decides one of them: torch of December 2024 ran SDPA's
FlashAttention-2 path on H100 (pytorch/pytorch#142132, measured on the nightly of 2024-12-04:
329.5 TFLOP/s, where cuDNN attention, torch's first choice on sm90 only from 2.9, reached
631.3), so the H100 rows are probed with the H100 spec's attention efficiency set to that
FlashAttention-2 measurement (``FA2_H100``), its backward's to FlashAttention-2's backward on
H100 in the FlashAttention-3 paper (``FA2_H100_BACKWARD``); so are the H200 rows of June 2025,
whose torchtitan kept cuDNN attention for B200 (``run_spec``). The A100 rows (Llama 3 8B and 70B
on 64 A100 80GB, FSDP only, local batch 1, sequence 8192, bf16 eager, April 2024): torchtitan's
docs/performance.md (read at commit 4d88a8a, added in 395a526; removed since), which gives
tokens per second per GPU and MFU but no memory; their AC: "selective layer" is torchtitan's
option ``'2'`` (every second block fully checkpointed, the default of its config_manager.py
then), "selective op" its per-op policy, 70B full.

The context-parallel rows (Tables 2 and 6: 8B on 8 GPUs, FSDP × CP, local batch 1; 405B on
512, FSDP × TP 8 × PP 8 × CP, 1F1B, local batch 8; both full AC, compile and float8,
sequences of 32,768 to 262,144 tokens with ``cp`` from 1 to 8, so every rank runs 32,768
tokens a sample): each probed at its own sequence (``CP_ROWS``), solved with ``--cp``.
Their published TPS divides the local batch's tokens by cp·tp·pp (``Published.step_seconds``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench import layouts
from bench.gap import (
    KINDS,
    Gap,
    consistency_line,
    gap_line,
    halved,
    kind_factors,
)
from bench.published_checks import (
    SAME_SHAPES,
    op_mix_line,
    op_mix_section,
    same_shapes_line,
    verdict_sentence,
    with_titan_ops,
)
from memplan.devices import load_device
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.files.schema import to_data
from memplan.memory.budget import (
    DEFAULT_CONTEXT_BYTES,
    DEFAULT_MARGIN,
    NCCL_COMMUNICATOR_BYTES,
    usable_budget_bytes,
)
from memplan.memory.parallel import communicators
from memplan.parallel import KeptOutputs, StageSplit
from memplan.profile import load_profile
from memplan.solver import SolveRequest
from memplan.solver.parallel import LayoutRequest, solve_layout
from memplan.units import GiB

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "llama31.py"
DEVICE = "h100-80gb"
SOURCE = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
SEQ = 8192


@dataclass(frozen=True)
class Published:
    model: str
    factory: str
    table: str
    gpus: int
    tp: int
    pp: int
    local_batch: int
    """Per data-parallel rank (torchtitan's ``local_batch_size``)."""
    micro: int
    """Per micro-step: the local batch, or the pipeline micro-batch size (local batch / pp)."""
    ac: str
    """``full``, ``op-sac`` (per-op selective) as published."""
    memory_gib: float
    tps: int
    techniques: str
    schedule: str = "1f1b"
    virtual_stages: int = 1
    device: str = DEVICE
    """The device profile the run is predicted on."""
    source: str = SOURCE
    precision: str = "bf16"
    """``float8``: the published run used torchao's Float8 linears (its techniques say so),
    predicted from a ``--precision float8`` probe (issue 34)."""
    cp: int = 1
    """Context-parallel degree (Tables 2 and 6): the sequence split over ``cp`` ranks."""
    seq: int = SEQ
    """Tokens per sample: the run's ``training.seq_len``."""
    kept_outputs: KeptOutputs = "all"
    """Which pipeline stages the run's torch kept every micro-batch's output on to the step's
    end (``Parallel.kept_outputs``). The December 2024 runs: torch 1963fc8 (2024-12-23),
    before pytorch/pytorch#153383 (May 2025: only the last stage keeps them); its
    ``PipelineStage.forward_one_chunk`` appends every stage's output to ``output_chunks``
    (read in torch 2.6.0's torch/distributed/pipelining/stage.py, git 2236df1, branched
    from main that month), and torchtitan 9dec370's train.py calls ``pp_schedule.step``
    without ``return_outputs`` (added to torch by #165822, passed False by torchtitan
    e5ef99a, October 2025), so the last stage also merged them at the step's end."""
    stage_split: StageSplit = "torchtitan-2412"
    """How the run's torchtitan divided the blocks into pipeline stages
    (``Parallel.stage_split``): 9dec370's ``generate_split_points``
    (torchtitan/parallelisms/pipelining_utils.py), no split points being given; read for the
    rows with ``pp`` > 1 only."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def eager_bf16(self) -> bool:
        return self.techniques == "eager"

    @property
    def compiled(self) -> bool:
        """The run compiled its blocks (``training.compile``): probed with ``--compiled``,
        its meta clock inductor's fused memory-bound kernels (memplan.probe.tracker
        ``FusedRegion``)."""
        return "compile" in self.techniques

    @property
    def step_seconds(self) -> float:
        # torchtitan 9dec370 train.py: tps = the local batch's labels.numel() (counted before
        # CP splits them) / (time × cp·tp·pp, ``non_data_parallel_size``)
        tokens_per_gpu = self.local_batch * self.seq * self.dp / self.gpus
        return tokens_per_gpu / self.tps


A100_SOURCE = "torchtitan docs/performance.md at 4d88a8a (64 A100 80GB, April 2024)"
A100_ROWS = [  # (memory: not published, 0.0)
    Published(
        "8B", "build_8b", "64 A100, selective layer", 64, 1, 1, 1, 1, "every-2nd", 0.0, 2904, "eager",
        device="a100-80gb", source=A100_SOURCE,
    ),
    Published(
        "8B", "build_8b", "64 A100, selective op", 64, 1, 1, 1, 1, "op-sac", 0.0, 2973, "eager",
        device="a100-80gb", source=A100_SOURCE,
    ),
    Published(
        "70B", "build_70b", "64 A100, full AC", 64, 1, 1, 1, 1, "full", 0.0, 331, "eager",
        device="a100-80gb", source=A100_SOURCE,
    ),
]  # fmt: skip

H200_SOURCE = (
    "torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, June 2025: torch "
    "2.8.0a0+5228986c39, torchao 0afa4c1, torchtitan e7c0cae)"
)
H200_ROWS = [
    # llama3_8b.toml (per-op SAC, seq 8192) on 4 and 8 hosts of 8 H200s, FSDP over all of
    # them, --training.local_batch_size=2 --training.compile --model.converters=float8 with
    # FSDP's float8 all-gather: that torchtitan compiles the loss too (build_cross_entropy_loss
    # at e7c0cae), hence the factory with the compiled loss's bytes.
    Published(
        "8B", "build_8b_compiled_loss", "H200, 4 hosts", 32, 1, 1, 2, 2, "op-sac", 47.96,
        10938, "compile+float8", device="h200", source=H200_SOURCE, precision="float8",
    ),
    Published(
        "8B", "build_8b_compiled_loss", "H200, 8 hosts", 64, 1, 1, 2, 2, "op-sac", 46.97,
        10753, "compile+float8", device="h200", source=H200_SOURCE, precision="float8",
    ),
]  # fmt: skip

ASYNC_TP_SOURCE = (
    "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025, the same "
    "96 GB HBM2e H100s at 500 W: torch 38410cf9, torchtitan 820504e; Average TPS only)"
)
ASYNC_TP_ROWS = [
    # Its vanilla-TP rows (memplan charges TP's collectives unoverlapped, as vanilla TP runs
    # them; async TP hides them), bf16 and float8 tensorwise (the rowwise baseline is a
    # known slow path, pytorch/torchtitan#1207). All compiled, so the 8B loss is compiled
    # too; 70B takes the eager-loss factory: under loss parallel its loss is 0.1% of the step.
    Published(
        "70B", "build_70b", "asyncTP 2025-06, vanilla TP", 256, 8, 1, 16, 16, "full", 0.0,
        597, "compile", source=ASYNC_TP_SOURCE,
    ),
    Published(
        "70B", "build_70b", "asyncTP 2025-06, vanilla TP", 256, 8, 1, 16, 16, "full", 0.0,
        810, "compile+float8", source=ASYNC_TP_SOURCE, precision="float8",
    ),
    Published(
        "8B", "build_8b_compiled_loss", "asyncTP 2025-06, vanilla TP", 64, 8, 1, 12, 12,
        "op-sac", 0.0, 4378, "compile", source=ASYNC_TP_SOURCE,
    ),
    Published(
        "8B", "build_8b_compiled_loss", "asyncTP 2025-06, vanilla TP", 64, 8, 1, 12, 12,
        "op-sac", 0.0, 5078, "compile+float8", source=ASYNC_TP_SOURCE, precision="float8",
    ),
]  # fmt: skip

# PyTorch's FlashAttention-2 path on H100, measured by pytorch/pytorch#142132 on the nightly
# of 2024-12-04 (the torch of the December 2024 H100 runs): 329.5 of 989 TFLOP/s.
FA2_H100 = 329.5 / 989
# Its backward on H100: 318 of 989 TFLOP/s (bf16, head dim 128, sequence 8k, non-causal), the
# FlashAttention-2 bars of FlashAttention-3's figure "Attention backward speed, head dim 128
# (H100 80GB SXM5)" (Shah et al. 2024, arXiv 2407.08608).
FA2_H100_BACKWARD = 318 / 989
# The published H100s are not the h100-80gb part (the source's "Hardware" and footnote 2): 96 GB
# of HBM2e at 2.4 TB/s peak (the SXM5 80 GB part: 3.35 TB/s of HBM3), run at the default 500 W
# limit, whose bf16 peak "is between SXM and NVL" and unknown to its authors. So the rows take
# the published capacity and bandwidth, the SXM compute peaks (the NVL part's dense bf16 is 835
# TFLOP/s by NVIDIA's H100 datasheet), and, as fractions of those, the rates torchao measured
# on the parts (below).
GRAND_TETON_BANDWIDTH = 2.4e12
GRAND_TETON_MEMORY = 96 * 10**9
# What those parts reach, measured by torchao's authors on them (pytorch/ao at 0598012,
# torchao/testing/training/roofline_utils.py, ``gpu_name_to_specs["NVIDIA H100"]``: "2.4 TB
# per second, custom to Meta's H100 variant"): large GEMMs at 0.78 of the 989 TFLOP/s dense
# bf16 peak ("based on experimental observation with sample large inputs"; the SXM part at
# 700 W reaches 0.803, its MAMF), pointwise Triton kernels at 0.92 of the 2.4 TB/s ("about
# 2.2k GBPS on Meta's H100 variant"): the kernels inductor writes, so a compiled run's
# memory-bound ops take it, and an eager run's (ATen's kernels) keep the spec's 0.84. Their
# float8 GEMMs stay at the SXM part's measured 0.709 of 1,979 (torchao's roofline assumes the
# bf16 fraction for them: no measurement).
TORCHAO_H100_MATMUL = 0.78
TORCHAO_H100_MEMORY = 0.92
# The other end of footnote 2's range: the H100 NVL part's dense peaks (NVIDIA H100 NVL
# datasheet: BF16 1,671 and FP8 3,341 TFLOP/s with sparsity, half that dense).
NVL_BF16_FLOPS = 835e12
NVL_FP8_FLOPS = 1671e12
# The H200 rows' torchtitan (e7c0cae, June 2025) chose SDPA's backends itself:
# torchtitan/models/attention.py ``ScaledDotProductAttention._init_backend`` lists FLASH,
# EFFICIENT, MATH and puts CUDNN_ATTENTION first only on compute capability 10.0 (B200;
# pytorch/torchtitan#1196, May 2025), and its torch (2.8.0a0) predates cuDNN's first place on
# sm90 (pytorch/pytorch#162073, for 2.9). So those runs ran FlashAttention-2, whose H100 SXM
# rates above hold for the H200's same GH100 compute (132 SMs, 989 dense bf16 TFLOP/s by
# both datasheets): at sequence 8192 the kernel is bound by its compute, not its memory.


def with_fa2(spec):
    """``spec`` (an H100 or H200) with attention at FlashAttention-2's measured rates on
    the H100 (``FA2_H100``, ``FA2_H100_BACKWARD``), under the name ``<name>-fa2``: what
    SDPA ran on sm90 before torch 2.9 put cuDNN attention first."""
    return dataclasses.replace(
        spec,
        name=f"{spec.name}-fa2",
        display_name=f"{spec.display_name}, FlashAttention-2 SDPA",
        efficiency=dataclasses.replace(
            spec.efficiency,
            attention=round(FA2_H100, 3),
            attention_backward=round(FA2_H100_BACKWARD, 3),
        ),
    )


def run_spec(row: Published, peaks: str = "sxm"):
    """The device spec the run is predicted on: its device profile, with the attention
    efficiency of the kernel the run ran (FlashAttention-2's on the H100 and H200 rows,
    above) and, for the December 2024 table, the published parts' memory and bandwidth
    (module doc) and the GEMM and pointwise rates torchao measured on them
    (``TORCHAO_H100_MATMUL``, ``TORCHAO_H100_MEMORY``); ``peaks="nvl"``: with the NVL part's
    compute peaks instead of the SXM part's, the other end of the range the source gives
    (every efficiency, attention's too, a fraction of the lower peak)."""
    spec = load_device(row.device)
    if row.device == "h200":  # June 2025: torchtitan e7c0cae ran SDPA's FlashAttention-2
        return with_fa2(spec)
    if row.device == DEVICE:  # the December 2024 H100 table
        nvl = peaks == "nvl"
        # the parts' own rates, where torchao measured them (fractions of the SXM peaks);
        # the NVL end keeps the SXM part's fractions of its own peaks
        measured: dict[str, float] = {}
        if not nvl:
            measured["matmul"] = TORCHAO_H100_MATMUL
            if row.compiled:  # Triton's pointwise kernels: inductor's
                measured["memory"] = TORCHAO_H100_MEMORY
        spec = dataclasses.replace(
            spec,
            name="h100-96gb-hbm2e-fa2" + ("-nvl-peaks" if nvl else ""),
            display_name=f"NVIDIA H100 96GB HBM2e 500 W ({'NVL' if nvl else 'SXM'} peaks), "
            "FlashAttention-2 SDPA",
            memory_bytes=GRAND_TETON_MEMORY,
            memory_bandwidth=GRAND_TETON_BANDWIDTH,
            efficiency=dataclasses.replace(
                spec.efficiency,
                attention=round(FA2_H100, 3),
                attention_backward=round(FA2_H100_BACKWARD, 3),
                **measured,
            ),
            bf16_flops=NVL_BF16_FLOPS if nvl else spec.bf16_flops,
            fp16_flops=NVL_BF16_FLOPS if nvl else spec.fp16_flops,
            fp8_flops=NVL_FP8_FLOPS if nvl else spec.fp8_flops,
        )
    return spec


def spec_file(spec, folder: Path) -> Path:
    """``spec`` as a device profile file the probe's subprocess reads."""
    path = folder / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(to_data(spec), sort_keys=False))
    return path


ROWS = [
    Published("8B", "build_8b", "Table 1", 8, 1, 1, 2, 2, "op-sac", 82.4, 5762, "eager"),
    Published("8B", "build_8b", "Table 1", 8, 1, 1, 2, 2, "op-sac", 77.0, 6667, "compile"),
    Published(
        "8B",
        "build_8b",
        "Table 1",
        8,
        1,
        1,
        2,
        2,
        "op-sac",
        76.8,
        8532,
        "compile+float8",
        precision="float8",
    ),
    Published("8B", "build_8b", "Table 3", 128, 1, 1, 2, 2, "op-sac", 67.0, 5605, "eager"),
    Published(
        "8B",
        "build_8b",
        "Table 3",
        128,
        1,
        1,
        2,
        2,
        "op-sac",
        61.8,
        8380,
        "compile+float8",
        precision="float8",
    ),
    Published(
        "70B",
        "build_70b",
        "Table 4",
        256,
        8,
        1,
        16,
        16,
        "full",
        71.9,
        829,
        "compile+float8",
        precision="float8",
    ),
    # The pipeline splits the local batch into pp micro-batches unless told otherwise
    # (torchtitan 9dec370, torchtitan/parallelisms/pipeline_llama.py: ``microbatches =
    # pipeline_parallel_microbatches or parallel_dims.pp``; pipelining_utils.py
    # build_pipeline_schedule, the same default): 8 micro-batches of 4, not 32 of 1.
    Published(
        "405B",
        "build_405b",
        "Table 5",
        512,
        8,
        8,
        32,
        4,
        "full",
        82.5,
        100,
        "compile+float8+asyncTP",
        precision="float8",
    ),
    Published(
        "405B",
        "build_405b",
        "Table 5",
        512,
        8,
        8,
        32,
        4,
        "full",
        72.7,
        128,
        "compile+float8+asyncTP",
        schedule="interleaved_1f1b",
        virtual_stages=2,
        precision="float8",
    ),
]


# Tables 2 and 6: context parallel, as torchtitan 9dec370 ran it (train.py,
# utils.create_context_parallel_ctx; torch's torch/distributed/tensor/experimental/
# _attention.py at the runs' 1963fc8): the data loader gives each data-parallel rank its
# local batch at the full sequence; torch's ``context_parallel`` then splits the sequence
# dimension of the tokens, the labels and the rotary table over the cp ranks (round-robin
# chunks for the causal load balance), so every op but attention runs on S/cp tokens, and
# SDPA becomes ring attention (K/V all-gathered over cp, the default
# ``context_parallel_rotate_method``). FSDP shards over dp × cp (``dp_shard_cp``). With
# pipeline stages (Table 6) the split happens before the schedule cuts the local batch of 8
# into pp = 8 micro-batches of 1. Each row is probed at its own sequence length.
CP_ROWS = [
    Published(
        "8B", f"build_8b_{k}k", f"Table 2, seq {seq:,}", 8, 1, 1, 1, 1, "full", memory, tps,
        "compile+float8", precision="float8", cp=cp, seq=seq,
    )
    for k, seq, cp, tps, memory in (
        (32, 32768, 1, 3890, 83.9),
        (64, 65536, 2, 2540, 84.2),
        (128, 131072, 4, 1071, 84.0),
        (256, 262144, 8, 548, 84.5),
    )
] + [
    Published(
        "405B", f"build_405b_{k}k", f"Table 6, seq {seq:,}", 512, 8, 8, 8, 1, "full", memory,
        tps, "compile+float8+asyncTP", precision="float8", cp=cp, seq=seq,
    )
    for k, seq, cp, tps, memory in (
        (32, 32768, 1, 76, 75.3),
        (64, 65536, 2, 47, 75.9),
        (128, 131072, 4, 31, 77.1),
        (256, 262144, 8, 16, 84.9),
    )
]  # fmt: skip

_PROBE_AT = """
import json, sys, time
from memplan.model.loader import load_model_file
from memplan.probe.runner import probe_model
from memplan.profile import profile_to_yaml
start = time.perf_counter()
spec, out, device, precision, seq, compiled = sys.argv[1:7]
model = load_model_file(spec)
model = model.at_seq_len(int(seq)) if int(seq) else model
profile = probe_model(model, device="meta", precision=precision, mixed_precision="params",
                      device_profile=device, compiled=compiled == "compiled")
open(out, "w").write(profile_to_yaml(profile))
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def probe(
    factory: str,
    out: Path,
    device: str = DEVICE,
    precision: str = "bf16",
    seq: int = SEQ,
    compiled: bool = False,
    model: Path = MODEL,
) -> float:
    """Probe ``model:factory`` on meta; at ``seq`` tokens a sample (``probe --seq-len``) when
    the run's sequence is not the example's own (``SEQ``: the model file's own length);
    ``compiled``: ``probe --compiled``."""
    if seq == SEQ and not compiled:
        return layouts.probe(factory, out, model, device, precision)["seconds"]
    run = subprocess.run(
        [sys.executable, "-c", _PROBE_AT, f"{model}:{factory}", str(out), device, precision,
         str(seq if seq != SEQ else 0), "compiled" if compiled else "eager"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(run.stdout.strip().splitlines()[-1])["seconds"]


PROBES_ENV = "MEMPLAN_BENCH_PROBES"
"""A folder that keeps this section's probes between runs (``{factory}-{spec}-{precision}
.yaml``, each beside a ``.key`` file): a kept probe is read instead of probing again (the 405B
float8 probe takes 5-15 minutes here) when ``kept_probe_matches``, and a new probe is saved
there. Unset: every probe is run and none is kept. A folder that cannot be made or written
stops the section before its first probe (``kept_probes_folder``)."""

PROBE_CODE = ("probe", "profile", "model", "run", "files", "devices.py", "modes.py", "units.py")
"""memplan's sources (under the package) that make a probe's bytes and its meta clock."""

MODEL_CODE = (MODEL, ROOT / "examples" / "llama70b.py")
"""The example code the probed model files load: examples/llama31.py (itself a model file,
and loaded by bench/fused_norm_model.py, whose kept probes' profiles hash only that file)
and examples/llama70b.py, where llama31.py builds its blocks. A kept probe is of today's
blocks only if these bytes are part of its key. Before, a change to llama70b.py's blocks
kept the old probes."""


def kept_probes_folder() -> Path | None:
    """The ``PROBES_ENV`` folder, made if missing and proven writable (a file written and
    removed there), or None when the variable is unset or empty. One that cannot be made or
    written ends the run with a message naming the variable and the path: asked to keep the
    probes, the section fails before probing rather than probe for minutes and lose them."""
    folder = os.environ.get(PROBES_ENV)
    if not folder:
        return None
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, trial = tempfile.mkstemp(dir=path, prefix=".write-check.")
        os.close(handle)
        os.unlink(trial)
    except OSError as exc:
        raise SystemExit(
            f"bench published: {PROBES_ENV}={folder} names a folder the probes cannot be kept "
            f"in ({exc.strerror or exc}: {exc.filename or path}). Point {PROBES_ENV} at a "
            f"folder you can write (it is made if missing, e.g. /tmp/memplan-probes), or unset "
            f"it to probe every model again and keep nothing."
        ) from None
    return path


def probe_key(spec, precision: str, seq: int, compiled: bool = False) -> str:
    """What a kept probe must have been made with besides the model file and torch, which its
    profile records: memplan's probing code (``PROBE_CODE``, every file's path and bytes),
    the model code the model file loads (``MODEL_CODE``),
    the device spec (its efficiencies time the meta clock, and a spec's name does not change
    with them), the precision, the sequence length and the compiled clock. A sha256."""
    import hashlib

    import memplan

    root = Path(memplan.__file__).resolve().parent
    digest = hashlib.sha256()
    for entry in PROBE_CODE:
        path = root / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(root).as_posix().encode() + b"\0")
            digest.update(file.read_bytes())
    for file in MODEL_CODE:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    digest.update(f"{spec!r}|{precision}|{seq}".encode() + (b"|compiled" if compiled else b""))
    return digest.hexdigest()


def kept_probe_matches(path: Path, key: str, model: Path = MODEL) -> bool:
    """Whether a kept probe (``PROBES_ENV``) may stand for a new one: it exists, is of
    today's ``model`` (examples/llama31.py unless told: the profile's sha256 of the model
    file) and today's torch, and its ``.key`` file holds ``key`` (``probe_key``: today's
    probing code and spec)."""
    sidecar = path.with_suffix(".key")
    if not path.is_file() or not sidecar.is_file() or sidecar.read_text().strip() != key:
        return False
    import hashlib

    import torch

    kept = load_profile(path)
    return (
        kept.model.sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
        and kept.environment.torch_version == torch.__version__
    )


def keep_probe(probed_file: Path, kept: Path, key: str) -> None:
    """Save a new probe into the ``PROBES_ENV`` folder: the profile, then its ``.key``, each
    written whole (a temporary file renamed), so a run stopped midway leaves no key beside a
    torn or older profile."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    for target, text in ((kept, probed_file.read_text()), (kept.with_suffix(".key"), key)):
        handle, temporary = tempfile.mkstemp(dir=kept.parent, prefix=f".{target.name}.")
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, target)


def probed(probes: dict, tmp: str, row: Published, spec, precision: str, model: Path = MODEL):
    """The meta profile of the row's model (``model``'s ``row.factory``) for ``spec`` at
    ``precision``, probed once (with ``--compiled`` for a compiled run), or read from the
    kept probes."""
    key = (model, row.factory, spec.name, precision, row.compiled)
    if key not in probes:
        stem = "" if model == MODEL else f"{model.stem}-"
        name = (
            f"{stem}{row.factory}-{spec.name}-{precision}{'-compiled' if row.compiled else ''}.yaml"
        )
        out = Path(tmp) / name
        folder = kept_probes_folder()
        kept = folder / name if folder else None
        code = probe_key(spec, precision, row.seq, row.compiled)
        if kept is not None and kept_probe_matches(kept, code, model):  # probed before
            out, seconds = kept, 0.0
        else:
            if kept is not None:  # stale or torn: its key goes first, so it is never read
                kept.with_suffix(".key").unlink(missing_ok=True)
            seconds = probe(
                row.factory,
                out,
                str(spec_file(spec, Path(tmp))),
                precision,
                row.seq,
                row.compiled,
                model=model,
            )
            if kept is not None:
                keep_probe(out, kept, code)
        # examples/llama31.py is not a transformers decoder, so memplan's runtime cannot
        # split it into stages (the probe records that, and the solver's model-kind rule
        # reads hf_blocks); the published pipeline layouts are modelled here, not run: both
        # refusals are lifted for the comparison.
        loaded = load_profile(out)
        probes[key] = dataclasses.replace(
            loaded, pipeline_refused=None, hf_blocks=loaded.layer_names
        )
        print(
            f"published: {row.model} {precision} for {spec.name}: "
            + (f"probed in {seconds:.0f} s" if seconds else f"read from {out}"),
            flush=True,
        )
    return probes[key]


def reserved_gib(plan) -> float:
    """memplan's allocated peak plus allocator reserve, less what max_memory_reserved does
    not count: the CUDA context and NCCL's buffers."""
    outside = DEFAULT_CONTEXT_BYTES + communicators(plan.parallel) * NCCL_COMMUNICATOR_BYTES
    return (plan.predicted.peak_bytes - outside) / GiB


def predict(profile, row: Published, spec, modes: tuple[str, ...], every: int = 1):
    """memplan's plan for the published layout, batch and checkpointing (``every``: the
    blocks checkpointed, every n-th; ``modes``: the mode they take)."""
    names = profile.layer_names
    pinned = tuple(n for i, n in enumerate(names) if every and i % every == every - 1)
    if every == 1:  # a pattern: each pipeline stage's solve sees its own blocks only
        pinned = ("layers.*",)
    request = SolveRequest(
        target_batch=row.local_batch * row.dp,
        budget_bytes=1 << 45,  # the published layout whatever it needs: compared, not fitted
        world_size=row.gpus,
        strategy="fsdp",
        device_spec=spec,
        min_micro=row.micro,
        max_micro=row.micro,
        always_checkpoint=pinned,
        never_checkpoint=() if every == 1 else tuple(n for n in names if n not in pinned),
        modes=modes,
    )
    ask = LayoutRequest(
        tp=row.tp,
        pp=row.pp,
        cp=row.cp,
        schedule=row.schedule,
        virtual_stages=row.virtual_stages,
        sequence_parallel=row.tp > 1,
        kept_outputs=row.kept_outputs,
        stage_split=row.stage_split if row.pp > 1 else "memplan",
    )
    return solve_layout(profile, request, ask).plan


def ranked_first(profile, row: Published, spec):
    """The plan memplan's layout search ranks first for the run's GPUs and global batch,
    within the device's memory (``solve --layout auto --strategy fsdp``; the published
    context-parallel degree kept: ``--cp``), or the reason none fits."""
    request = SolveRequest(
        target_batch=row.local_batch * row.dp,
        budget_bytes=spec.memory_bytes,
        world_size=row.gpus,
        strategy="fsdp",
        device_spec=spec,
    )
    try:
        return solve_layout(profile, request, LayoutRequest(auto=True, cp=row.cp)).plan
    except (NoPlanFitsError, BadInputError) as exc:  # none fits, or none splits the batch
        return exc.message


VARIANTS = {
    "full": [("full AC", ("full",), 1)],
    "every-2nd": [("every 2nd block full (torchtitan's layer option 2)", ("full",), 2)],
    # memplan's selective mode is torchtitan's SelectiveAC (memplan.modes)
    "op-sac": [("per-op SAC", ("selective",), 1)],
}
"""Each published AC as memplan solves it: (label, modes, every n-th block checkpointed)."""


def run(device: str) -> str:
    del device  # meta probes
    kept_probes_folder()  # a folder that cannot keep the probes fails before the first one
    lines = []
    search_lines = []
    bracket_lines = []
    float8_lines: list[str] = []
    peak_lines: list[str] = []
    fit_lines: list[str] = []
    probes: dict = {}
    searches: dict[tuple, object] = {}
    a100_steps: dict[str, tuple[float, float]] = {}
    steps: dict[tuple[str, str, str], tuple[float, float]] = {}
    gaps: dict[str, list[Gap]] = {}
    op_lines: list[str] = []
    shapes: list[tuple[Published, float, object]] = []
    with tempfile.TemporaryDirectory(prefix="memplan-published-") as tmp:
        for row in ROWS + CP_ROWS + A100_ROWS + H200_ROWS + ASYNC_TP_ROWS:
            spec = run_spec(row)
            profile = probed(probes, tmp, row, spec, row.precision)
            published_plan = None
            for label, modes, every in VARIANTS[row.ac]:
                try:
                    plan = predict(profile, row, spec, modes, every)
                except NoPlanFitsError as exc:
                    lines.append(f"| {row.model} | {row.table} | … | {label}: {exc.message} |")
                    continue
                published_plan = published_plan or plan
                if plan is published_plan:
                    key = (row.model, row.table, row.techniques)
                    steps[key] = (plan.predicted.step_seconds, row.step_seconds)
                if row in A100_ROWS:
                    a100_steps[row.ac] = (plan.predicted.step_seconds, row.step_seconds)
                reserved = reserved_gib(plan)
                step = plan.predicted.step_seconds
                layout = f"{row.gpus} GPUs: {plan.parallel.describe()}"
                memory = (
                    f"{row.memory_gib:.1f} | {reserved:.1f} | {reserved / row.memory_gib:.2f}"
                    if row.memory_gib
                    else f"— | {reserved:.1f} | —"
                )
                if row.memory_gib and plan is published_plan and row.device == DEVICE:
                    fit_lines.append(fit_line(row, plan))
                lines.append(
                    f"| {row.model} | {row.table}, {row.techniques} | {spec.display_name}"
                    f"{', float8' if row.precision == 'float8' else ''} | {layout} | "
                    f"{row.local_batch} ({row.micro} × {plan.accumulation_steps}) | {label} | "
                    f"{memory} | "
                    f"{row.step_seconds:.2f} s ({row.tps:,} TPS) | {step:.2f} s | "
                    f"{step / row.step_seconds:.2f} |"
                )
                print(f"published: {lines[-1]}", flush=True)
                if row.precision == "float8":  # the same layout from the bf16 probe
                    same = predict(probed(probes, tmp, row, spec, "bf16"), row, spec, modes, every)
                    float8_lines.append(
                        f"| {row.model} | {row.table}, {row.techniques} | {layout} | {label} | "
                        f"{reserved:.1f} | {reserved_gib(same):.1f} | {step:.2f} s | "
                        f"{same.predicted.step_seconds:.2f} s | "
                        f"{same.predicted.step_seconds / step:.2f} |"
                    )
                    print(f"published: {float8_lines[-1]}", flush=True)
            if row.ac == "op-sac":  # per-op SAC lies between these two
                bracket_lines.append(bracket(profile, row, spec))
                print(f"published: {bracket_lines[-1]}", flush=True)
            if published_plan is None:
                continue
            if row in ROWS + ASYNC_TP_ROWS and row.device == DEVICE:  # the H100 peaks (no CP)
                peak_lines.append(peak_range_line(probes, tmp, row, published_plan))
                print(f"published: {peak_lines[-1]}", flush=True)
            where = (row.factory, spec.name, row.gpus, row.local_batch * row.dp, row.cp)
            if where not in searches:
                searches[where] = ranked_first(profile, row, spec)
            search_lines.append(search_line(row, published_plan, searches[where]))
            print(f"published: {search_lines[-1]}", flush=True)
            if row in gap_rows():
                gap = gap_of(probes, tmp, row, spec, published_plan.predicted.step_seconds)
                gaps.setdefault(gap_part(row), []).append(gap)
                print(f"published: {gap_line(gap)}", flush=True)
            titan = with_titan_ops(row) if row.eager_bf16 else None
            if titan is not None:  # the same run from torchtitan's own ops
                _, modes, every = VARIANTS[row.ac][0]
                other = predict(
                    probed(probes, tmp, titan, spec, row.precision), titan, spec, modes, every
                )
                op_lines.append(
                    op_mix_line(
                        row,
                        (published_plan, reserved_gib(published_plan)),
                        (other, reserved_gib(other)),
                    )
                )
                print(f"published: {op_lines[-1]}", flush=True)
            if (row.model, row.table, row.schedule) in SAME_SHAPES:
                shapes.append((row, reserved_gib(published_plan), published_plan))
    return "\n".join(
        [
            "### Published torchtitan runs (Llama 3.1 on H100 and H200, Llama 3 on A100)\n",
            f"Source of every *published* figure: {SOURCE} (pytorch/torchtitan at b5bcd76; "
            "runs of December 2024 on 96 GB HBM2e H100s at 500 W), and for the A100 rows "
            f"{A100_SOURCE} (tokens/s/GPU only: no memory published): memory is torchtitan's "
            "`max_reserved_gib` (`torch.cuda.max_memory_reserved`, the most of any GPU), time "
            "is local tokens per GPU ÷ published tokens/s/GPU. *memplan*: the shapes of "
            "examples/llama31.py probed on meta (bf16, FSDP's mixed-precision policy), the "
            "published layout, local batch and activation checkpointing solved as given "
            "(`solve --tp --pp --min-micro --max-micro --always-checkpoint`), on the "
            "published H100 parts (the h100-80gb spec with their 96 GB and 2.4 TB/s of HBM2e, "
            "the SXM part's compute peaks, and the rates torchao's authors measured on these "
            "500 W parts: large bf16 GEMMs at 0.78 of the 989 TFLOP/s peak, Triton's pointwise "
            "kernels (a compiled run's) at 0.92 of the 2.4 TB/s, pytorch/ao 0598012 "
            "torchao/testing/training/"
            "roofline_utils.py; float8 GEMMs at the SXM part's 0.709, which nobody measured "
            "on these parts) or a100-80gb; memory = allocated peak + allocator reserve "
            "(what `max_memory_reserved` counts; no CUDA context), worst rank. Step time = "
            "memplan's meta clock at each device's measured efficiency (large bf16 GEMMs, "
            "attention, memory-bound ops; profiles/devices/*.yaml cites each, none is taken "
            "from these runs), attention at FlashAttention-2's measured rates on H100 "
            f"({FA2_H100:.3f} of peak forward, pytorch/pytorch#142132: the December 2024 torch "
            f"ran it; {FA2_H100_BACKWARD:.3f} backward, arXiv 2407.08608) and on A100, plus "
            "memplan's unoverlapped collectives at NCCL's bus bandwidth and FSDP's copies "
            "around them at memory bandwidth. Float8 rows (', float8' "
            "after the spec) are predicted from a float8 probe (below), its casts timed as "
            "compiled. A run with torch.compile ('compile' among its techniques) is probed with "
            "`probe --compiled`: its memory-bound ops timed as inductor's fused kernels move "
            "bytes, each input read once and what outlives them written (docs/design.md, "
            "'A compiled step'); before, every run's clock was eager's, one kernel an op. "
            "The example model "
            "is no transformers decoder, so memplan's runtime would refuse its pipeline stages: "
            "the 405B rows are modelled, not run. Their local batch of 32 runs as 8 "
            "micro-batches of 4 (torchtitan splits it into pp unless told otherwise); the "
            "runs' torch (1963fc8, before pytorch/pytorch#153383) kept every stage's output of "
            "every micro-batch to the step's end, and merged the last stage's logits "
            "(`return_outputs` was on: torchtitan turns it off since e5ef99a, as memplan's "
            "runtime does), so these rows are solved with `kept_outputs: all`, and with their "
            "blocks in the stages that torchtitan (9dec370, `generate_split_points`) made "
            "(`stage_split: torchtitan-2412`: 15, 16 × 6, 15 blocks; interleaved 7, 8 × 14, 7). "
            "Tables 2 and 6 (context parallel, 'seq' in the run's name): each probed at the "
            "run's sequence (`probe --seq-len`), solved with `--cp`; torchtitan shards FSDP "
            "over dp × cp and splits every op's sequence over cp (ring attention for SDPA, "
            "whose buffers memplan charges while a block runs as torch's ring holds them: "
            "every cp rank's K/V gathered and its fp32 accumulators, bytes measured on gloo, "
            "memplan.memory.ring; and whose step time it "
            "charges as torch's ring runs: K/V all-gathers forward, in the recompute and "
            "backward, fp32 dK/dV permutes, at 50 GB/s once tp·cp leaves the node, and the "
            "last rank's fp32 merges at memory bandwidth, bytes measured on gloo, "
            "memplan.solver.ring); the published "
            "TPS/GPU counts the local batch's tokens over cp·tp·pp GPUs. The H200 rows: "
            f"{H200_SOURCE}, memory and TPS/GPU at the 100th step, on the h200 profile (its "
            "datasheet peaks and efficiencies) with attention at FlashAttention-2's measured "
            "rates, which that torchtitan ran (its ScaledDotProductAttention put cuDNN first on "
            "B200 only; torch put it first on sm90 from 2.9, pytorch/pytorch#162073; before "
            "this the rows were timed at cuDNN's rates, 0.99/0.97 of the published step); "
            "that torchtitan compiles the loss "
            "under `training.compile` (the December 2024 one left it eager), so they are "
            "probed from `build_8b_compiled_loss`, whose loss has the compiled loss's bytes "
            "(`memplan.run.losses.compiled_cross_entropy`: no fp32 copy of the logits). The "
            f"'asyncTP 2025-06' rows: {ASYNC_TP_SOURCE}, its vanilla-TP runs in bf16 and float8 "
            "tensorwise, TPS only, on the December table's H100 spec.\n",
            "| model | published run | device spec | layout | local batch (micro × m) | AC | "
            "published GiB | memplan GiB | ratio | published step | memplan step | ratio |",
            "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
            *lines,
            "",
            "Per-op SAC rows, bracketed: memplan's step time for the same layout with every "
            "block fully checkpointed and with none, against the published step (per-op SAC "
            "re-runs some of a block's ops, so its step lies between the two).\n",
            "| model | published run | device spec | published step | full AC | ratio | no AC "
            "| ratio |",
            "|---|---|---|---:|---:|---:|---:|---:|",
            *bracket_lines,
            "",
            sac_ranking(a100_steps),
            "",
            same_recipe_line(steps),
            "",
            *gap_section(gaps),
            "",
            *op_mix_section(op_lines),
            "",
            same_shapes_line(
                [(row, gib) for row, gib, _ in shapes],
                verdict_sentence(
                    [(row.table, device_gib(row, plan)) for row, _, plan in shapes],
                    H100_80GB / GiB,
                ),
            ),
            "",
            "**Would the recipe fit an 80 GB H100?** The published runs had 96 GB parts. "
            "Their device memory: the published reserved GiB plus what max_memory_reserved "
            "leaves out, the CUDA context and NCCL's buffers as memplan counts them; an "
            "80 GB H100 holds 79.6 GiB (85,520,809,984 B, profiles/devices/h100-80gb.yaml). "
            "memplan's verdict: its predicted peak within that capacity less the default "
            "3% margin (what `solve --budget` on that card would accept). A recipe whose "
            "published memory does not fit must not be called fitting.\n",
            "| model | published run | published + context + NCCL GiB | fits 80 GB? | "
            "memplan peak GiB | memplan says |",
            "|---|---|---:|---|---:|---|",
            *fit_lines,
            "",
            "**The H100 rows' unknown peak, both ends.** The published parts' dense bf16 "
            "peak \"is between SXM and NVL\" and unknown to the runs' authors (the source's "
            "footnote 2), so each row's step is predicted at both ends: the SXM part's "
            "989 / 1,979 TFLOP/s (bf16 / FP8) at the rates torchao measured on these parts "
            "(the table above), and the NVL part's 835 / 1,671 (NVIDIA H100 NVL datasheet) "
            "at the SXM part's fractions of them (bf16 GEMMs 0.803 of 835: 671 TFLOP/s, "
            "below the 771 torchao measured on these parts, so the NVL end overstates what "
            "the cap takes). None is fitted.\n",
            "| model | published run | published step | memplan, SXM peaks | ratio | "
            "memplan, NVL peaks | ratio |",
            "|---|---|---:|---:|---:|---:|---:|",
            *peak_lines,
            "",
            "**The layout search beside the published recipes.** For each run: memplan's "
            "predicted step for the published layout (as above), and the plan its search "
            "ranks first on the same GPUs and global batch within the device's memory "
            "(`solve --layout auto --strategy fsdp --budget <device memory>`: degrees, "
            "micro-batch and checkpointing all searched), its step time, and the ratio of "
            "the two (below 1: memplan ranks its own choice faster).\n",
            "| model | published run | published step | published layout | memplan step "
            "| ratio to published | memplan's first | its peak GiB | its step | first ÷ "
            "published layout |",
            "|---|---|---:|---|---:|---:|---|---:|---:|---:|",
            *search_lines,
            "",
            "**float8 against bf16 for the same layout** (issue 34). Each float8 row above "
            "(`probe --precision float8`: torchao's Float8Linear on every linear but the head, "
            "tensorwise scaling, FSDP2 gathering those weights in float8, as torchtitan "
            "9dec370 ran them; float8 matmuls at the spec's `fp8_flops`, 1979 TFLOP/s dense "
            "on H100 SXM by its datasheet, times its `float8_matmul` efficiency, 0.709 on H100 "
            "and 0.734 on H200: the public FP8 MAMF, stas00/ml-engineering 744d01e), solved again from the bf16 probe with the same "
            "layout, batch and checkpointing. memplan's bytes are eager torchao's (its "
            "dynamic casts hold fp32 copies a compiled step does not), its times charge each "
            "cast as torch.compile fuses it (one pass: read twice, write the float8 bits). "
            "Published, for "
            "the pairs measured alike (8B, both compiled): Table 1 bf16 6,667 → float8 8,532 "
            "TPS (×1.28), 77.0 → 76.8 GiB; Table 3 6,514 → 8,380 TPS (×1.29), 62.0 → 61.8 "
            "GiB.\n",
            "| model | published run | layout | AC | memplan float8 GiB | memplan bf16 GiB | "
            "memplan float8 step | memplan bf16 step | bf16 ÷ float8 step |",
            "|---|---|---|---|---:|---:|---:|---:|---:|",
            *float8_lines,
        ]
    )


H100_80GB = 85_520_809_984


def device_gib(row: Published, plan) -> float:
    """The published run's device memory: its reserved GiB plus what max_memory_reserved
    leaves out, the CUDA context and NCCL's buffers as memplan counts them for ``plan``."""
    outside = DEFAULT_CONTEXT_BYTES + communicators(plan.parallel) * NCCL_COMMUNICATOR_BYTES
    return (row.memory_gib * GiB + outside) / GiB


def fit_line(row: Published, plan) -> str:
    """One line: whether the published run's memory, and memplan's prediction of it, fit an
    80 GB H100 (module doc; the table's header says how each is counted)."""
    published = device_gib(row, plan) * GiB
    ours = plan.predicted.peak_bytes
    usable = usable_budget_bytes(H100_80GB, DEFAULT_MARGIN)
    return (
        f"| {row.model} | {row.table}, {row.techniques} | {published / GiB:.1f} | "
        f"{'yes' if published <= H100_80GB else 'no'} | {ours / GiB:.1f} | "
        f"{'fits' if ours <= usable else 'does not fit'} |"
    )


def peak_range_line(probes: dict, tmp: str, row: Published, plan) -> str:
    """One line: the row's step at the SXM part's peaks (``plan``) and at the NVL part's."""
    spec = run_spec(row, peaks="nvl")
    profile = probed(probes, tmp, row, spec, row.precision)
    _, modes, every = VARIANTS[row.ac][0]
    nvl = predict(profile, row, spec, modes, every).predicted.step_seconds
    sxm = plan.predicted.step_seconds
    published = row.step_seconds
    return (
        f"| {row.model} | {row.table}, {row.techniques} | {published:.2f} s | {sxm:.2f} s | "
        f"{sxm / published:.2f} | {nvl:.2f} s | {nvl / published:.2f} |"
    )


def sac_ranking(steps: dict[str, tuple[float, float]]) -> str:
    """Per-op SAC against every second block fully checkpointed on the A100 8B rows: how
    much faster each makes it, published and memplan's."""
    (ours_op, theirs_op), (ours_layer, theirs_layer) = steps["op-sac"], steps["every-2nd"]
    return (
        "**Per-op SAC ranked against every second block fully checkpointed** (the A100 8B "
        f"rows): published {theirs_layer / theirs_op - 1:+.1%} faster, memplan "
        f"{ours_layer / ours_op - 1:+.1%} faster (its selective cost is the roofline of the "
        "ops the recompute re-runs: the matmuls the policy does not keep and the pointwise "
        'ops; docs/design.md, "Per-layer modes").'
    )


SAME_RECIPE = (
    ("8B", "Table 1", "compile+float8"),  # 8 H100s at 500 W, December 2024
    ("8B", "H200, 4 hosts", "compile+float8"),  # 32 H200s at 700 W, June 2025
)
"""One recipe published on both parts: Llama 3.1 8B, local batch 2, sequence 8192, per-op
SAC, compiled, float8 linears, FSDP over every GPU."""


def same_recipe_line(steps: dict[tuple[str, str, str], tuple[float, float]]) -> str:
    """How much slower the published H100 step is than the H200 one for the same recipe,
    against how much slower memplan predicts it: what memplan does not model of the
    difference between the runs (the H100s' 500 W cap among it) is their quotient."""
    (ours_h100, theirs_h100), (ours_h200, theirs_h200) = (steps[k] for k in SAME_RECIPE)
    published, predicted = theirs_h100 / theirs_h200, ours_h100 / ours_h200
    left_out = published / predicted - 1
    short = sorted(
        1 - ours / theirs
        for (model, table, techniques), (ours, theirs) in steps.items()
        if model == "8B" and table in ("Table 1", "Table 3") and "float8" not in techniques
    )
    verdict = (
        f"under half the {short[0]:.0%} to {short[-1]:.0%} by which memplan's bf16 8B "
        "H100 rows (eager and compiled) are short of their published steps: the cap alone "
        "does not explain those rows"
        if short and left_out < short[0] / 2
        else "as much as memplan's bf16 8B H100 rows are short: the cap may explain them"
    )
    return (
        "**One recipe on both parts** (8B, local batch 2, per-op SAC, compile+float8, FSDP "
        "over every GPU: Table 1 on 8 of the 500 W H100s, and the H200 table's 4 hosts of 8 "
        f"at 700 W): the published H100 step is {published:.2f}× the H200's, memplan's "
        f"{predicted:.2f}× (the H100s have half the memory bandwidth, the same peaks). What "
        "memplan leaves out of the difference (it has the GEMM and pointwise rates "
        f"torchao measured on these H100s) costs the H100 run {left_out:+.1%}: the rest "
        "of the cap's effect, and everything else that differs (torch and torchao six "
        "months apart, 8 against 32 ranks). So on this float8 run the cap costs at most "
        f"about that much beyond those rates, {verdict}."
    )


def gap_rows() -> list[Published]:
    """The runs whose step gap ``bench.gap`` takes apart: Llama 3.1 8B (and Llama 3 8B on
    A100) at sequence 8192 with FSDP alone, so one part's runs differ only in technique,
    checkpointing or scale; the H100 runs with TP 8 and no stages or CP (70B and 8B,
    December 2024 and June 2025), whose TP collectives are a part of their own; and the
    405B pipeline runs (Table 5: 1F1B and interleaved)."""
    return [
        row
        for row in ROWS + A100_ROWS + H200_ROWS + ASYNC_TP_ROWS
        if row.seq == SEQ
        and row.cp == 1
        and (
            (row.model == "8B" and row.tp == row.pp == 1)
            or (row.device == DEVICE and (row.tp > 1 or row.pp > 1))
        )
    ]


def gap_part(row: Published) -> str:
    """The part a gap row's verdict groups it in (``PARTS``): its device, the H100s' TP
    runs, or their pipeline runs."""
    if row.pp > 1:
        return PP_PART
    return TP_PART if row.tp > 1 else row.device


def gap_of(probes: dict, tmp: str, row: Published, spec, step: float) -> Gap:
    """The row's published and predicted steps, and what each kind of op adds to the
    prediction when its rate halves (``bench.gap.halved``), each solved from the row's own
    probe: the kinds the meta clock charges are rescaled to the halved spec's rates from the
    clock's own bins (memplan.retime, as a probe against that spec times them: the 8B Table
    1 rows' parts agree with such probes to 0.02%), the ones the solver times
    (``SOLVED_KINDS``) are timed by it."""
    _, modes, every = VARIANTS[row.ac][0]
    profile = probed(probes, tmp, row, spec, row.precision)
    added = []
    for kind in KINDS:
        slower = halved(spec, kind)
        added.append(predict(profile, row, slower, modes, every).predicted.step_seconds - step)
    schedule = f", {row.schedule}" if row.pp > 1 else ""
    label = f"{row.model} {row.table}, {row.techniques}{schedule}"
    return Gap(label, row.step_seconds, step, tuple(added))


TP_PART = f"{DEVICE} tp"
PP_PART = f"{DEVICE} pp"

PARTS = {
    DEVICE: "the 500 W H100s (December 2024)",
    TP_PART: "the 500 W H100s' TP 8 runs (December 2024 and June 2025)",
    PP_PART: "the 500 W H100s' 405B pipeline runs (December 2024)",
    "a100-80gb": "the A100s (April 2024)",
    "h200": "the H200s (June 2025)",
}


def gap_section(gaps: dict[str, list[Gap]]) -> list[str]:
    """The paragraph, table and one verdict a part: where each run's gap lies."""
    rows = [gap_line(g) for part in PARTS for g in gaps.get(part, [])]

    def gemms(part: str) -> str:  # the part's GEMMs' k − 1, run by run
        return ", ".join(f"{v:+.2f}" for v in kind_factors(gaps[part], "GEMMs"))

    verdicts = [
        consistency_line(gaps[part], PARTS[part])
        for part in (DEVICE, TP_PART)
        if len(gaps.get(part, [])) > 1
    ]
    if gaps.get(PP_PART):  # one model and layout in two schedules: every kind agrees there
        verdicts.append(
            f"On {PARTS[PP_PART]}, which differ only in schedule (so every kind's factors "
            f"agree across them), GEMMs' k − 1 is {gemms(PP_PART)}."
        )
    others = [
        f"{gemms(part)} on {PARTS[part]}"
        for part in PARTS
        if part not in (DEVICE, TP_PART, PP_PART) and gaps.get(part)
    ]
    if others:
        verdicts.append(
            "The same arithmetic on the other parts (no power cap published), whose runs "
            f"differ only in checkpointing or scale: GEMMs' k − 1 "
            f"{' and '.join(others)}."
        )
    kinds = " | ".join(KINDS)
    return [
        "**Where the rows' gap lies** (bench/gap.py). Each 8B run with FSDP alone, each "
        "H100 run with TP 8 and no pipeline or CP, and the 405B pipeline runs are predicted "
        "again with one kind of op "
        "at half its rate, solved again from the run's own probe: GEMMs (bf16 and float8), "
        "attention and memory-bound ops (the meta clock charges them: its ops rescaled to "
        "that rate from the clock's bins, memplan.retime, which the 8B Table 1 rows' probes "
        "against each halved spec match to 0.02%), and the collectives on NVLink (the "
        "solver times them; TP's, and FSDP's within a node). What the step gains is that kind's part of it. Were "
        "one kind alone slower than memplan charges by a factor k, the step would grow by "
        "(k − 1) × its part, so each run's gap ÷ each part is the k − 1 that kind would "
        "need. One cause needs about the same k in every run of a part. Nothing here "
        "enters a prediction: it says what to measure.\n",
        f"| run | published step | memplan step | gap | part: {kinds} | k − 1: {kinds} |",
        "|---|---:|---:|---:|" + "---:|" * (2 * len(KINDS)),
        *rows,
        *(line for verdict in verdicts for line in ("", verdict)),
    ]


def bracket(profile, row: Published, spec) -> str:
    """One line: the published layout's step with every block full and with none."""
    cells = []
    for modes, every in ((("full",), 1), (("full",), 0)):
        step = predict(profile, row, spec, modes, every).predicted.step_seconds
        cells.append(f"{step:.2f} s | {step / row.step_seconds:.2f}")
    return (
        f"| {row.model} | {row.table}, {row.techniques} | {spec.display_name} | "
        f"{row.step_seconds:.2f} s | {' | '.join(cells)} |"
    )


def search_line(row: Published, published, first) -> str:
    step = published.predicted.step_seconds
    head = (
        f"| {row.model} | {row.table}, {row.techniques}, {row.device} | "
        f"{row.step_seconds:.2f} s | {published.parallel.describe()}, {row.micro} × "
        f"{published.accumulation_steps}, {len(published.checkpoint)} blocks checkpointed | "
        f"{step:.2f} s | {step / row.step_seconds:.2f} |"
    )
    if isinstance(first, str):
        return head + f" none fits: {first} | | | |"
    ours = first.predicted.step_seconds
    return head + (
        f" {first.parallel.describe()}, {first.micro_batch_size} × "
        f"{first.accumulation_steps}, {len(first.checkpoint)} blocks checkpointed | "
        f"{first.predicted.peak_bytes / GiB:.1f} | {ours:.2f} s | {ours / step:.2f} |"
    )


if __name__ == "__main__":
    print(run("cpu"))
