"""Each kind of op's time in a measured step beside memplan's meta clock (bench section
``kinds``, in ``make gpu-check`` too).

bench ``published`` and ``fms_fsdp`` find memplan's H100 steps short of the published ones
and ask which kind of op is slower than charged (bench/gap.py). This section measures it:
a Llama (examples/llama70b.py's code; on a GPU two blocks of Llama 3.1 8B's shapes, batch 2
× 8192 tokens, bf16 parameters, eager and under ``torch.compile``; on the CPU a small one in
fp32, eager) runs forward and backward under ``torch.profiler``, and each kernel's time (on the CPU each aten op's own time) is
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

_GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|wgmma|triton_tem_fused_.*mm", re.IGNORECASE)
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|_attn", re.IGNORECASE)
_CPU_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}


def kind_of_kernel(name: str) -> str:
    """A CUDA kernel's kind by its name: fused attention (FlashAttention's ``flash_fwd_
    kernel``, the memory-efficient ``fmha_cutlassF_*``, cuDNN's ``*sdpa*``) before GEMMs
    (cuBLAS's ``sm90_xmma_gemm_*`` and ``nvjet_*``, CUTLASS, inductor's ``triton_tem_fused_
    *mm*`` templates), else a memory-bound op (inductor's ``triton_poi_*``/``triton_red_*``
    among them)."""
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
compiled = sys.argv[5] == "compiled"
torch.manual_seed(0)
mf = load_model_file(path)
model = mf.build_model().to(device)
if device == "cuda":
    model = model.to(torch.bfloat16)
if compiled:
    model = torch.compile(model)
inputs = [t.to(device) for t in mf.make_batch(batch)]

def step():
    model(*inputs).backward()
    for p in model.parameters():
        p.grad = None

for _ in range(3):  # a compiled model compiles its forward and backward here
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


def measure(model: Path, device: str, batch: int, compiled: bool, steps: int = 3) -> dict:
    """One step's wall time and each kind's seconds, in a fresh process (``compiled``: the
    model under ``torch.compile``)."""
    import json

    done = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(root=str(ROOT)), str(model), device,
         str(batch), str(steps), "compiled" if compiled else "eager"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


_PROBE = """
import sys
from memplan.probe.runner import probe_model
from memplan.profile import profile_to_yaml
model, out, spec, precision, compiled = sys.argv[1:6]
mixed = "params" if precision == "bf16" else "autocast"  # bf16: bf16 parameters, as measured
profile = probe_model(model, device="meta", precision=precision, mixed_precision=mixed,
                      device_profile=spec, compiled=compiled == "compiled")
open(out, "w").write(profile_to_yaml(profile))
"""


def clock(model: Path, spec, precision: str, batch: int, folder: Path, compiled: bool) -> float:
    """memplan's meta clock of one forward and backward at ``batch`` (``compiled``: ``probe
    --compiled``'s): every layer's and fixed part's seconds (the profile's fit there)."""
    from bench.published import spec_file
    from memplan.profile import load_profile

    out = folder / f"{spec.name}-{'compiled' if compiled else 'eager'}.profile.yaml"
    subprocess.run(
        [sys.executable, "-c", _PROBE, str(model), str(out), str(spec_file(spec, folder)),
         precision, "compiled" if compiled else "eager"],
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
    # torch.compile on the CPU needs a C++ toolchain and minutes of inductor: GPU only
    modes = (False, True) if device == "cuda" else (False,)
    layers, hidden, intermediate, heads, kv, vocab, seq = shape
    out = [
        "### Time by kind of op (`bench/kinds.py`)\n",
        __doc__.split("\n\n")[1].replace("\n", " ") + "\n",
        f"On {gpu} (memplan's spec: {spec.display_name}, {precision}): {layers} blocks of "
        f"hidden {hidden}, intermediate {intermediate}, {heads} heads over {kv} K/V heads, "
        f"vocabulary {vocab}, batch {batch} × {seq} tokens; one forward and backward"
        + (", eager and under torch.compile (memplan's `probe --compiled` clock)." if
           len(modes) > 1 else ", eager (compiled only on a GPU).")
        + "\n",
        "| step | kind | measured | memplan | measured ÷ memplan |",
        "|---|---|---:|---:|---:|",
    ]  # fmt: skip
    totals = []
    with tempfile.TemporaryDirectory(prefix="memplan-kinds-") as tmp:
        folder = Path(tmp)
        model = folder / "llama_kinds.py"
        model.write_text(MODEL_TEXT.format(examples=str(ROOT / "examples"), shape=shape))
        for compiled in modes:
            step = "compiled" if compiled else "eager"
            measured = measure(model, device, batch, compiled)
            base = clock(model, spec, precision, batch, folder, compiled)
            for kind in KINDS:
                ours = clock(model, halved(spec, kind), precision, batch, folder, compiled) - base
                theirs = measured["kinds"].get(kind, 0.0)
                print(f"kinds: {step} {kind}: measured {theirs:.4f} s, memplan {ours:.4f} s",
                      flush=True)  # fmt: skip
                ratio = f"{theirs / ours:.2f}" if ours > 0 else "—"
                out.append(f"| {step} | {kind} | {theirs:.4f} s | {ours:.4f} s | {ratio} |")
            totals.append(
                f"{step}: {measured['wall']:.4f} s measured wall "
                f"({sum(measured['kinds'].values()):.4f} s in profiled "
                f"{'kernels' if device == 'cuda' else 'aten ops'}), memplan's meta clock "
                f"{base:.4f} s"
            )
    return "\n".join([*out, "", "Whole steps: " + "; ".join(totals) + "."])


if __name__ == "__main__":
    print(run(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
