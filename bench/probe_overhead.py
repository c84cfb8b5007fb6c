"""Probe cost: (a) the probe's overhead on the GPT example over the plain training steps it
runs, (b) a meta probe of the Llama-7B example: wall time and peak RSS (bar: < 60 s and
< 2 GiB on a 2-core machine).

    python -m bench.probe_overhead --device cpu
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from memplan.probe.runner import TIMING_EXTRA_FACTOR, TIMING_ROUNDS

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "gpt.py"
LLAMA = ROOT / "examples" / "llama7b.py"
SIZES = (1, 2, 4)
TIMED_PER_SIZE = 3 * TIMING_ROUNDS
"""Untracked timing micro-steps per size: TIMING_ROUNDS rounds of plain, all-checkpointed
and all-selective (memplan.probe.runner.time_size)."""
MICRO_STEPS_PER_SIZE = 6 + TIMED_PER_SIZE
"""What the probe runs per size: no_grads and grads_resident, both again checkpointed and
again selective, and the timing rounds (plus optimizer steps, which the plain step below
includes)."""
EXTRA_SIZE = TIMING_EXTRA_FACTOR * max(SIZES)
"""And TIMED_PER_SIZE untracked timing micro-steps at this size, for the time fits."""

META_SCRIPT = """
import json, resource, sys, time
t0 = time.perf_counter()
from memplan.probe import probe_model
profile = probe_model(sys.argv[1], device="meta", micro_batches=(1, 2), precision="bf16")
print(json.dumps({
    "seconds": time.perf_counter() - t0,
    "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "params_bytes": profile.totals.params_trainable_bytes,
    "layers": len(profile.layers),
}))
"""


def _plain_step_seconds(device: str, batch_size: int, repeats: int = 3) -> float:
    import torch

    from memplan.model.batch import move_batch
    from memplan.model.loader import load_model_file

    mf = load_model_file(str(GPT))
    model = mf.build_model().to(device)
    optimizer = mf.make_optimizer(model)
    batch = move_batch(mf.make_batch(batch_size), device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        mf.loss(model, batch).backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def probe_overhead(device: str) -> dict[str, float]:
    from memplan.probe import probe_model

    t0 = time.perf_counter()
    probe_model(str(GPT), device=device, micro_batches=SIZES)
    probe_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    probe_model(str(GPT), device=device, micro_batches=SIZES, timing_rounds=1)
    one_round_seconds = time.perf_counter() - t0
    plain = {b: _plain_step_seconds(device, b) for b in (*SIZES, EXTRA_SIZE)}
    plain_total = sum(MICRO_STEPS_PER_SIZE * plain[b] for b in SIZES)
    plain_total += TIMED_PER_SIZE * plain[EXTRA_SIZE]
    return {
        "probe_seconds": probe_seconds,
        "plain_seconds": plain_total,
        "ratio": probe_seconds / plain_total,
        "one_round_seconds": one_round_seconds,
        **{f"step_b{b}": s for b, s in plain.items()},
    }


def meta_7b() -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", META_SCRIPT, str(LLAMA)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(device: str) -> str:
    over = probe_overhead("cuda" if device == "cuda" else "cpu")
    meta = meta_7b()
    gib = meta["max_rss_bytes"] / 2**30
    ok = meta["seconds"] < 60 and gib < 2
    lines = [
        "### Probe overhead",
        "",
        f"GPT example ({GPT.name}) probed on {device} at micro-batches {', '.join(map(str, SIZES))}: "
        f"{over['probe_seconds']:.2f} s of probe against {over['plain_seconds']:.2f} s for the "
        f"{MICRO_STEPS_PER_SIZE} plain training steps per size it stands for, and "
        f"{TIMED_PER_SIZE} at micro-batch {EXTRA_SIZE} timed only "
        f"(best of 3 per size: "
        + ", ".join(f"b={b} {over[f'step_b{b}'] * 1e3:.0f} ms" for b in (*SIZES, EXTRA_SIZE))
        + f") — overhead ×{over['ratio']:.1f}. With `--timing-rounds 1` (one timing "
        f"round per size, not {TIMING_ROUNDS}; the same bytes): "
        f"{over['one_round_seconds']:.2f} s, {over['one_round_seconds'] / over['probe_seconds']:.2f}"
        " of the default probe's time in the same run.",
        "",
        f"Meta probe of {LLAMA.name} (bf16, micro-batches 1, 2; {meta['layers']} layers, "
        f"{meta['params_bytes'] / 4 / 1e9:.2f} B parameters): {meta['seconds']:.1f} s wall, "
        f"{gib:.2f} GiB peak RSS — bar < 60 s and < 2 GiB: {'met' if ok else 'NOT met'}.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    run(parser.parse_args().device)
