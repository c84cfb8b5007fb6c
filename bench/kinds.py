"""Each kind of op's time in a measured step beside memplan's meta clock (bench section
``kinds``, in ``make gpu-check`` too).

bench ``published`` and ``fms_fsdp`` find memplan's H100 steps short of the published ones
and ask which kind of op is slower than charged (bench/gap.py). This section measures it:
a Llama (examples/llama70b.py's code; on a GPU two blocks of Llama 3.1 8B's shapes, batch 2
× 8192 tokens, bf16 parameters; on the CPU a small one in fp32) runs forward and backward
under ``torch.profiler``, and each kernel's time (on the CPU each aten op's own time) is
summed by kind: GEMMs, fused attention, everything else (the memory-bound ops). memplan's
part of each kind is what its meta clock gains when that kind's rate halves (bench/gap.py
``halved``), for the same model file probed on meta with the device's shipped spec.
Measured ÷ memplan is the factor the spec's rate for that kind is off by on this device.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.gap import KINDS, halved

ROOT = Path(__file__).resolve().parent.parent
GPU_SPECS = {"H200": "h200", "H100": "h100-80gb", "A100": "a100-80gb", "L4": "l4", "T4": "t4"}
"""Shipped device profiles by a substring of ``torch.cuda.get_device_name`` (as bench
``calibrate`` finds them)."""

SHAPES = {
    # (layers, hidden, intermediate, heads, kv_heads, vocab, seq), batch
    "cuda": ((2, 4096, 14336, 32, 8, 128256, 8192), 2),
    "cpu": ((2, 256, 688, 8, 2, 2048, 256), 2),
}
MODEL_TEXT = """
import sys
sys.path.insert(0, {examples!r})
import torch
from llama70b import Llama, Shape

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB, SEQ = {shape!r}
SHAPE = Shape(layers=LAYERS, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=HEADS,
              kv_heads=KV_HEADS, vocab=VOCAB, seq_len=SEQ)


def build_model():
    return Llama(SHAPE)


def make_batch(batch_size):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()
"""

_GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|wgmma", re.IGNORECASE)
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|_attn", re.IGNORECASE)
_CPU_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}


def kind_of_kernel(name: str) -> str:
    """A CUDA kernel's kind by its name: fused attention (FlashAttention's ``flash_fwd_
    kernel``, the memory-efficient ``fmha_cutlassF_*``, cuDNN's ``*sdpa*``) before GEMMs
    (cuBLAS's ``sm90_xmma_gemm_*`` and ``nvjet_*``, CUTLASS), else a memory-bound op."""
    names = list(KINDS)
    if _ATTENTION.search(name):
        return names[1]
    if _GEMM.search(name):
        return names[0]
    return names[2]


def kind_of_cpu_op(name: str) -> str | None:
    """An aten op's kind on the CPU (its own time: BLAS for the matmuls, the CPU flash
    kernel for SDPA); None for what is not an aten op (autograd's and the profiler's own)."""
    names = list(KINDS)
    if not name.startswith("aten::"):
        return None
    if name in _CPU_GEMM:
        return names[0]
    if "scaled_dot_product" in name or "flash_attention" in name:
        return names[1]
    return names[2]


_MEASURE = """
import json, sys, time
import torch
from memplan.model.loader import load_model_file
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, {root!r})
from bench.kinds import kind_of_cpu_op, kind_of_kernel

path, device, batch, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
mf = load_model_file(path)
model = mf.build_model().to(device)
if device == "cuda":
    model = model.to(torch.bfloat16)
inputs = [t.to(device) for t in mf.make_batch(batch)]

def step():
    model(*inputs).backward()
    for p in model.parameters():
        p.grad = None

for _ in range(2):
    step()
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
sync()
start = time.perf_counter()
for _ in range(steps):
    step()
sync()
wall = (time.perf_counter() - start) / steps
activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
with profile(activities=[activity]) as prof:
    for _ in range(steps):
        step()
    sync()
seconds = {{}}
for e in prof.events():
    if device == "cuda":
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kind, us = kind_of_kernel(e.name), e.device_time_total
    else:
        kind, us = kind_of_cpu_op(e.name), e.self_cpu_time_total
    if kind is not None:
        seconds[kind] = seconds.get(kind, 0.0) + us / 1e6 / steps
print(json.dumps({{"wall": wall, "kinds": seconds}}))
"""


def measure(model: Path, device: str, batch: int, steps: int = 3) -> dict:
    """One step's wall time and each kind's seconds, in a fresh process."""
    import json

    done = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(root=str(ROOT)), str(model), device,
         str(batch), str(steps)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


_PROBE = """
import sys
from memplan.probe.runner import probe_model
from memplan.profile import profile_to_yaml
model, out, spec, precision = sys.argv[1:5]
mixed = "params" if precision == "bf16" else "autocast"  # bf16: bf16 parameters, as measured
profile = probe_model(model, device="meta", precision=precision, mixed_precision=mixed,
                      device_profile=spec)
open(out, "w").write(profile_to_yaml(profile))
"""


def clock(model: Path, spec, precision: str, batch: int, folder: Path) -> float:
    """memplan's meta clock of one forward and backward at ``batch``: every layer's and
    fixed part's seconds (the profile's fit at that micro-batch)."""
    from bench.published import spec_file
    from memplan.profile import load_profile

    out = folder / f"{spec.name}.profile.yaml"
    subprocess.run(
        [sys.executable, "-c", _PROBE, str(model), str(out), str(spec_file(spec, folder)),
         precision],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    profile = load_profile(out)
    return sum(
        part.fwd_seconds.at(batch) + part.bwd_seconds.at(batch)
        for part in (*profile.layers, *profile.fixed)
    )


def run(device: str) -> str:
    import torch

    from memplan.devices import load_device

    shape, batch = SHAPES[device]
    if device == "cuda":
        gpu = torch.cuda.get_device_name(0)
        name = next((spec for key, spec in GPU_SPECS.items() if key in gpu), None)
        if name is None:
            return f"### Time by kind of op\n\nNo shipped spec for {gpu}: not run.\n"
        precision = "bf16"
    else:
        gpu, name, precision = "this CPU", "cpu", "fp32"
    spec = load_device(name)
    with tempfile.TemporaryDirectory(prefix="memplan-kinds-") as tmp:
        folder = Path(tmp)
        model = folder / "llama_kinds.py"
        model.write_text(MODEL_TEXT.format(examples=str(ROOT / "examples"), shape=shape))
        measured = measure(model, device, batch)
        base = clock(model, spec, precision, batch, folder)
        parts = {kind: clock(model, halved(spec, kind), precision, batch, folder) - base
                 for kind in KINDS}  # fmt: skip
    for kind in KINDS:
        print(f"kinds: {kind}: measured {measured['kinds'].get(kind, 0.0):.4f} s, "
              f"memplan {parts[kind]:.4f} s", flush=True)  # fmt: skip
    rows = []
    for kind in KINDS:
        ours, theirs = parts[kind], measured["kinds"].get(kind, 0.0)
        ratio = f"{theirs / ours:.2f}" if ours > 0 else "—"
        rows.append(f"| {kind} | {theirs:.4f} s | {ours:.4f} s | {ratio} |")
    total = sum(measured["kinds"].values())
    layers, hidden, intermediate, heads, kv, vocab, seq = shape
    return "\n".join(
        [
            "### Time by kind of op (`bench/kinds.py`)\n",
            __doc__.split("\n\n")[1].replace("\n", " ") + "\n",
            f"On {gpu} (memplan's spec: {spec.display_name}, {precision}): {layers} blocks of "
            f"hidden {hidden}, intermediate {intermediate}, {heads} heads over {kv} K/V "
            f"heads, vocabulary {vocab}, batch {batch} × {seq} tokens; one forward and "
            f"backward, {measured['wall']:.4f} s measured wall ({total:.4f} s in profiled "
            f"{'kernels' if device == 'cuda' else 'aten ops'}), memplan's meta clock "
            f"{base:.4f} s.\n",
            "| kind | measured | memplan | measured ÷ memplan |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )


if __name__ == "__main__":
    print(run(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
