"""Cases for the test that ``--modes keep,full`` reproduces the plans memplan chose before
per-layer modes existed. ``python tests/keep_full_cases.py`` wrote
tests/golden/keep_full_plans.json with the solver as it was (commit cc2edd0); the test
solves the same cases now and compares every decision and figure.

Profiles: the two committed CI baselines (meta: GPT and Llama-7B) and seeded random raw
profiles (need not be physical, so the solver's corners are reached)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from profiles_factory import ChainSpec, raw_profile  # noqa: E402

from memplan import memory, retime, timing  # noqa: E402
from memplan.errors import NoPlanFitsError  # noqa: E402
from memplan.profile import Affine, Segment, load_profile  # noqa: E402
from memplan.solver import SolveRequest, least_recompute_set, solve  # noqa: E402

ROOT = HERE.parent
GOLDEN = HERE / "golden" / "keep_full_plans.json"
BASELINES = ("examples/ci/baselines/gpt.profile.yaml", "examples/ci/baselines/llama7b.profile.yaml")


def random_profile(seed: int):
    rng = random.Random(seed)
    n = rng.randint(1, 10)

    def segs():
        out = []
        for _ in range(rng.randint(1, 2 * n + 3)):
            held = rng.randint(0, n)
            active = "none" if held == n else rng.choice(["none", "fwd", "bwd"])
            pts = tuple(
                (rng.randint(0, 3000), rng.randint(0, 120)) for _ in range(rng.randint(1, 3))
            )
            ck = (
                ()
                if active == "none"
                else tuple(
                    (rng.randint(0, 3000), rng.randint(0, 120)) for _ in range(rng.randint(1, 2))
                )
            )
            out.append(Segment(held=held, active=active, points=pts, ckpt_points=ck))
        return out

    times = [0.0, 0.125, 0.25, 0.5]
    return raw_profile(
        savings=[
            Affine(intercept=rng.randint(-30, 300), slope=rng.randint(-3, 40)) for _ in range(n)
        ],
        fwd_seconds=[
            Affine(intercept=rng.choice(times), slope=rng.choice(times)) for _ in range(n)
        ],
        bwd_seconds=[
            Affine(intercept=rng.choice(times), slope=rng.choice(times)) for _ in range(n)
        ],
        timeline={"no_grads": segs(), "grads_resident": segs()},
        optimizer_peak=Affine(intercept=rng.randint(0, 3000), slope=rng.randint(0, 20)),
        step_fixed_seconds=Affine(intercept=rng.choice(times), slope=rng.choice(times)),
        optimizer_seconds=rng.choice(times),
        names=[f"blocks.{i}" for i in range(n)],
    )


def cases():
    """(label, profile, SolveRequest kwargs) for every case."""
    for path in BASELINES:
        profile = load_profile(ROOT / path)
        plain = memory.step_peak(profile, 1, [], 1).peak_bytes
        for target in (8, 32, 64):
            for fraction in (0.5, 0.8, 1.0, 1.5, 3.0):
                yield path, profile, {"target_batch": target, "budget_bytes": int(plain * fraction)}
    for seed in range(80):
        profile = random_profile(seed)
        ref = memory.step_peak(profile, 1, [], 2).peak_bytes
        rng = random.Random(1000 + seed)
        for _ in range(3):
            yield (
                f"seed {seed}",
                profile,
                {
                    "target_batch": rng.choice([1, 2, 4, 6, 8, 12, 16, 24]),
                    "budget_bytes": rng.randint(max(1, ref // 2), max(2, 3 * ref)),
                    "margin": rng.choice([0.0, 0.03]),
                },
            )
    yield from chain_cases()


def chain_profile(seed: int):
    rng = random.Random(5000 + seed)
    n = rng.randint(3, 12)
    return ChainSpec(
        params=[1000] * n,
        saved=[rng.randint(20, 400) for _ in range(n)],
        output=[rng.randint(1, 19) for _ in range(n)],
        fwd_seconds=[rng.choice([0.125, 0.25, 0.375, 0.5, 1.0]) for _ in range(n)],
    ).profile()


def chain_cases():
    for seed in range(60):
        profile = chain_profile(seed)
        rng = random.Random(7000 + seed)
        target = rng.choice([4, 8, 16])
        low = memory.min_allocated_bytes(memory.step_bounds(profile, 1, target))
        high = memory.step_peak(profile, target, [], 1).peak_bytes
        for fraction in (0.2, 0.5, 0.8):
            budget = max(1, int(low + fraction * (high - low)))
            yield f"chain {seed}", profile, {"target_batch": target, "budget_bytes": budget}


def decision(profile, kwargs, modes=None):
    extra = {} if modes is None else {"modes": modes}
    try:
        plan = solve(profile, SolveRequest(**kwargs, **extra)).plan
    except NoPlanFitsError as exc:
        return {"fits": False, "min_peak_bytes": exc.min_peak_bytes}
    return {
        "fits": True,
        "micro_batch_size": plan.micro_batch_size,
        "accumulation_steps": plan.accumulation_steps,
        "checkpoint_layers": list(plan.checkpoint_layers),
        "peak_bytes": plan.predicted.peak_bytes,
        "step_seconds": plan.predicted.step_seconds,
    }


def set_cases():
    """(seed, b, k, limit) for least_recompute_set on chain profiles between the least and
    the plain peak."""
    for seed in range(60):
        profile = chain_profile(seed)
        for b, k in ((1, 1), (4, 2), (16, 1)):
            bounds = memory.step_bounds(profile, b, k)
            low = memory.min_allocated_bytes(bounds)
            high = memory.bounds_peak_bytes(bounds, [])
            for i in range(8):
                yield seed, b, k, low - 1 + (high - low + 1) * i // 7


def least_set(seed, b, k, limit):
    profile = chain_profile(seed)
    times = retime.micro_step_times(profile, b)
    cost = [timing.to_picoseconds(times.checkpoint_seconds(i)) for i in range(len(profile.layers))]
    chosen = least_recompute_set(memory.step_bounds(profile, b, k), limit, cost)
    return None if chosen is None else list(chosen)


if __name__ == "__main__":
    out = [
        {"label": label, "request": kwargs, "plan": decision(profile, kwargs)}
        for label, profile, kwargs in cases()
    ]
    out += [
        {
            "label": f"chain {seed} set",
            "set": [seed, b, k, limit],
            "chosen": least_set(seed, b, k, limit),
        }
        for seed, b, k, limit in set_cases()
    ]
    GOLDEN.write_text("[\n" + ",\n".join(json.dumps(case) for case in out) + "\n]\n")
    print(f"wrote {len(out)} cases to {GOLDEN}")
