"""How long `memplan solve` takes on large synthetic profiles (pure Python, no torch).

The solver is exact (a DP over layers with branch and bound); its cost grows with the
number of layers and with the number of micro-batches that divide the target. Two shapes:
*uniform* (identical blocks, as in a transformer) and *varied* (every layer a different
size and speed, the hard case for the DP: many near-equal subsets). The budget is set so
that larger micro-batches need about half of the layers checkpointed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random
import statistics
import sys
import time
from pathlib import Path

from memplan import memory
from memplan.solver import SolveRequest, solve

ROOT = Path(__file__).resolve().parent.parent


def _factory():
    """tests/profiles_factory.py, loaded by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "memplan_profiles_factory", ROOT / "tests" / "profiles_factory.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def synthetic_profile(n_layers: int, varied: bool, seed: int = 0):
    """A GPT-like chain: 10 MB of parameters per block, activations in bytes per sample."""
    rng = random.Random(seed)
    if varied:
        saved = [rng.randint(50, 400) * 1000 for _ in range(n_layers)]
        output = [rng.randint(5, 40) * 1000 for _ in range(n_layers)]
        fwd = [rng.uniform(1e-6, 5e-6) for _ in range(n_layers)]
    else:
        saved, output, fwd = [200_000] * n_layers, [20_000] * n_layers, [2e-6] * n_layers
    spec = _factory().ChainSpec(
        params=[10**7] * n_layers,
        saved=saved,
        output=output,
        fwd_seconds=fwd,
        fixed_seconds=0.01,
        optimizer_seconds=0.05,
        head_saved=500_000,
        loss_transient=1_000_000,
    )
    return spec.profile()


def with_selective(profile, seed: int = 1):
    """``profile`` with a selective-checkpointing measurement on every layer, as a CPU or
    GPU probe records one: each layer frees 30–70% of what full checkpointing frees, at
    15–85% of full's cost per byte freed, and its active segments peak as under full."""
    rng = random.Random(seed)

    def scaled(fit, factor):
        return dataclasses.replace(fit, intercept=fit.intercept * factor, slope=fit.slope * factor)

    layers = []
    for layer in profile.layers:
        recompute = layer.recompute_seconds or layer.fwd_seconds
        freed = rng.uniform(0.3, 0.7)
        layers.append(
            dataclasses.replace(
                layer,
                selective_savings_bytes=scaled(layer.savings_bytes, freed),
                selective_recompute_seconds=scaled(recompute, freed * rng.uniform(0.15, 0.85)),
            )
        )
    timeline = {
        phase: tuple(
            dataclasses.replace(seg, selective_points=seg.ckpt_points)
            if seg.active != "none"
            else seg
            for seg in segments
        )
        for phase, segments in profile.timeline.items()
    }
    return dataclasses.replace(profile, layers=tuple(layers), timeline=timeline)


def _budget(profile) -> int:
    """The solves' budget: the peak at micro-batch 64 with every other layer checkpointed."""
    return memory.step_peak(profile, 64, range(0, len(profile.layers), 2), 2).peak_bytes


def _time_solve(
    profile, target: int, repeats: int, modes: str | None = None
) -> tuple[float, object]:
    request = SolveRequest(target_batch=target, budget_bytes=_budget(profile), modes=modes)
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = solve(profile, request)
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


CASES = [  # (layers, varied, target batch, repeats)
    (200, False, 4096, 3),
    (200, True, 4096, 3),
    (200, False, 5040, 1),
    (200, True, 5040, 1),
    (500, False, 4096, 1),
    (500, True, 4096, 1),
]


def residual_profile(n_layers: int):
    """Identical tiny residual blocks, the shape of issue 26's 10,000-block model
    (tests/models/deep_residual.py: ``Linear(4, 4)`` blocks): 80 bytes of parameters, 16
    bytes saved per sample, all of it the output, so checkpointing frees nothing."""
    spec = _factory().ChainSpec(
        params=[80] * n_layers,
        saved=[16] * n_layers,
        output=[16] * n_layers,
        fwd_transient=[32] * n_layers,
        bwd_transient=[16] * n_layers,
        fwd_seconds=[2.4e-11] * n_layers,
        fixed_seconds=1e-6,
        optimizer_seconds=1e-5,
        embed_params=80,
        head_params=80,
        embed_saved=16,
        head_saved=16,
        loss_transient=32,
    )
    return spec.profile()


def _command(path: Path, args: list[str], repeats: int) -> tuple[float, float]:
    """``memplan solve PATH ARGS --json`` as a new process: median wall and CPU (user +
    system) seconds over ``repeats`` runs."""
    import resource
    import subprocess

    command = [sys.executable, "-m", "memplan.cli", "solve", str(path), *args, "--json"]
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


@dataclasses.dataclass(frozen=True)
class _Case:
    what: str
    make: object
    modes: str | None  # --modes (None: the default)
    shown: str  # the modes the solve chooses from
    target: int
    budget_at: tuple[int, int, int]  # step peak at (micro-batch, every k-th layer, accumulation)
    repeats: int
    goal: float | None  # seconds, wall


def _200_varied():
    return with_selective(synthetic_profile(200, True))


END_TO_END = [
    _Case("200 varied layers", _200_varied, "keep,full", "keep/full", 4096, (64, 2, 2), 3, None),
    _Case(
        "200 varied layers",
        _200_varied,
        None,
        "keep/selective/full (the default)",
        4096,
        (64, 2, 2),
        3,
        1.0,
    ),
    _Case(
        "10,000 identical small blocks",
        lambda: residual_profile(10_000),
        None,
        "keep/full (the default: no selective measured)",
        65536,
        (4096, 0, 16),
        2,
        10.0,
    ),
]


def end_to_end() -> str:
    """``memplan solve PROFILE --target-batch T --budget B --json`` as a user runs it (a new
    process: Python start, imports, reading the YAML, solving, printing), with its parts
    measured in-process in the same run, for the issue's two goals: 200 varied layers with
    every mode (keep/selective/full) under 1 s, next to keep/full, and a 10,000-layer
    profile under 10 s."""
    import os
    import subprocess
    import tempfile

    from memplan.profile import load_profile, profile_to_yaml

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, case in enumerate(END_TO_END):
            what, modes, target, repeats, goal = (
                case.what,
                case.modes,
                case.target,
                case.repeats,
                case.goal,
            )
            profile = case.make()
            micro, every, accumulation = case.budget_at
            n = len(profile.layers)
            chosen = range(0, n, every) if every else ()
            budget = memory.step_peak(profile, micro, chosen, accumulation).peak_bytes
            path = Path(tmp) / f"profile{index}.yaml"
            path.write_text(profile_to_yaml(profile), encoding="utf-8")
            args = ["--target-batch", str(target), "--budget", str(budget)]
            args += ["--modes", modes] if modes else []
            wall, cpu = _command(path, args, repeats)
            started, cpu_started = time.perf_counter(), time.process_time()
            loaded = load_profile(path)
            load = time.perf_counter() - started, time.process_time() - cpu_started
            started, cpu_started = time.perf_counter(), time.process_time()
            result = solve(
                loaded, SolveRequest(target_batch=target, budget_bytes=budget, modes=modes)
            )
            solved = time.perf_counter() - started, time.process_time() - cpu_started
            plan = result.plan
            counts = ", ".join(
                f"{sum(1 for v in plan.checkpoint.values() if v == m)} {m}"
                for m in sorted(set(plan.checkpoint.values()))
            )
            size = path.stat().st_size / 2**20
            shown = case.shown
            verdict = (
                "—"
                if goal is None
                else (f"< {goal:g} s: {'met' if wall < goal else 'not met'} (wall)")
            )
            print(
                f"solver: end to end, {what} ({shown}): {wall:.2f} s wall, {cpu:.2f} s CPU; "
                f"load {load[0]:.2f} s, solve {solved[0]:.2f} s",
                flush=True,
            )
            rows.append(
                f"| {what} | {shown} | {size:.1f} MiB | {wall:.2f} s | {cpu:.2f} s | "
                f"{load[0]:.2f} s ({load[1]:.2f} s) | {solved[0]:.2f} s ({solved[1]:.2f} s) | "
                f"{plan.micro_batch_size} × {plan.accumulation_steps}, {counts or 'all kept'} | "
                f"{verdict} |"
            )
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import memplan.cli"], check=True)
        imports = time.perf_counter() - started
    load_average = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join(
        [
            "\n#### `memplan solve` end to end\n",
            "`memplan solve PROFILE --target-batch T --budget B --json` run as a new process "
            "(Python start, imports, reading the YAML, solving, printing): median wall and "
            "CPU (user + system) time; then, in-process in the same run, reading the profile "
            "and solving it (wall, CPU in brackets). The 200-layer rows are one profile, the "
            "*varied* shape with a selective measurement on every layer, budget the peak at "
            "micro-batch 64 with every other layer checkpointed, target 4096. The 10,000-"
            "layer profile has identical blocks shaped like issue 26's model (80 B of "
            "parameters, checkpointing frees nothing), target 65536. Goals: all three modes "
            f"on 200 layers under 1 s, 10,000 layers under 10 s. Python start + `import "
            f"memplan.cli`: {imports * 1e3:.0f} ms. Load average during the run: "
            f"{load_average} (on the machine's {os.cpu_count()} cores; CPU time is the "
            "steadier figure on a busy machine).\n",
            "| profile | modes | YAML | command (wall) | command (CPU) | read profile | "
            "solve | plan | goal |",
            "|---|---|---:|---:|---:|---:|---:|---|---|",
            *rows,
            "",
        ]
    )


def run(device: str) -> str:
    del device  # the solver is pure Python: the device under test does not matter
    rows = []
    for n_layers, varied, target, repeats in CASES:
        profile = synthetic_profile(n_layers, varied)
        seconds, result = _time_solve(profile, target, repeats)
        plan = result.plan
        micro = len(result.candidates)
        shape = "varied" if varied else "uniform"
        print(
            f"solver: {n_layers} layers ({shape}), target {target}: {seconds * 1e3:.0f} ms "
            f"over {micro} micro-batches -> micro {plan.micro_batch_size}, "
            f"{len(plan.checkpoint_layers)} checkpointed",
            flush=True,
        )
        rows.append(
            f"| {n_layers} | {shape} | {target} | {micro} | {seconds * 1e3:.0f} ms | "
            f"{seconds / micro * 1e3:.1f} ms | {plan.micro_batch_size} × "
            f"{plan.accumulation_steps} | {len(plan.checkpoint_layers)} |"
        )
    header = [
        "### Solver speed\n",
        "Exact solve (every micro-batch dividing the target, least-recompute checkpoint set "
        "for each) on synthetic chain profiles; median wall time of `memplan.solver.solve` "
        "in one process. *uniform*: identical blocks; *varied*: every block a different "
        "size and speed. 4096 has 13 divisors, 5040 has 60.\n",
        "| layers | shape | target | micro-batches | solve time | per micro-batch | plan | "
        "checkpointed |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    return "\n".join(header + rows) + "\n" + with_modes() + sharded() + end_to_end()


MODE_CASES = [(200, True, 4096, 3), (200, True, 5040, 1)]


def with_modes() -> str:
    """The same solves with a selective measurement on every layer: keep/full against
    keep/selective/full (a DP over layers × modes), timed in one run."""
    rows = []
    for n_layers, varied, target, repeats in MODE_CASES:
        profile = with_selective(synthetic_profile(n_layers, varied))
        timed = {m: _time_solve(profile, target, repeats, m) for m in MODES_COMPARED}
        two, three = (timed[m][0] for m in MODES_COMPARED)
        plan = timed[MODES_COMPARED[1]][1].plan
        modes = sorted(set(plan.checkpoint.values()))
        counts = ", ".join(
            f"{sum(1 for v in plan.checkpoint.values() if v == m)} {m}" for m in modes
        )
        print(
            f"solver: {n_layers} layers with selective, target {target}: keep/full "
            f"{two * 1e3:.0f} ms, three modes {three * 1e3:.0f} ms",
            flush=True,
        )
        rows.append(
            f"| {n_layers} | {target} | {two * 1e3:.0f} ms | {three * 1e3:.0f} ms | "
            f"×{three / two:.1f} | {plan.micro_batch_size} × {plan.accumulation_steps}, "
            f"{counts or 'all kept'} |"
        )
    return "\n".join(
        [
            "",
            "#### With per-layer modes",
            "",
            "The *varied* profiles with a selective measurement on every layer (each frees "
            "30–70% of what full frees, at 15–85% of full's cost per byte freed; seeded), "
            "solved with `--modes keep,full` and `--modes keep,selective,full` in one run.",
            "",
            "| layers | target | keep/full | keep/selective/full | ratio | plan (three modes) |",
            "|---:|---:|---:|---:|---:|---|",
            *rows,
            "",
        ]
    )


MODES_COMPARED = ("keep,full", "keep,selective,full")

SHARDED_CASES = [(200, False), (200, True), (500, False), (500, True), (2000, False)]
SHARDED_WORLD, SHARDED_TARGET = 8, 4096


def sharded() -> str:
    """The same profiles solved for FSDP over 8 ranks: every segment's per-rank bytes
    (gathered units, reduce-scatter buffers) at every micro-batch. Before those terms were
    remembered per profile (memplan.memory.memo), each segment summed every unit, and a
    solve grew as the square of the layers."""
    rows, seconds_by_layers = [], {}
    for n_layers, varied in SHARDED_CASES:
        profile = synthetic_profile(n_layers, varied)
        request = SolveRequest(
            target_batch=SHARDED_TARGET,
            budget_bytes=_budget(profile) // SHARDED_WORLD,
            world_size=SHARDED_WORLD,
            strategy="fsdp",
        )
        started = time.perf_counter()
        result = solve(profile, request)
        seconds = time.perf_counter() - started
        plan = result.plan
        shape = "varied" if varied else "uniform"
        seconds_by_layers.setdefault(shape, {})[n_layers] = seconds
        print(
            f"solver: {n_layers} layers ({shape}), FSDP {SHARDED_WORLD}: {seconds:.2f} s",
            flush=True,
        )
        rows.append(
            f"| {n_layers} | {shape} | {seconds:.2f} s | {plan.micro_batch_size} × "
            f"{plan.accumulation_steps} | {len(plan.checkpoint_layers)} |"
        )
    growth = [
        f"{shape}: layers^{math.log(t[max(t)] / t[min(t)]) / math.log(max(t) / min(t)):.2f} "
        f"({min(t):,}→{max(t):,})"
        for shape, t in seconds_by_layers.items()
        if len(t) > 1
    ]
    return "\n".join(
        [
            "#### Sharded: FSDP over 8 ranks",
            "",
            f"The same synthetic profiles solved with `--strategy fsdp --world-size "
            f"{SHARDED_WORLD}`, target {SHARDED_TARGET}, the budget an eighth of the "
            "single-process peak at micro-batch 64 with every other layer checkpointed; one "
            "solve each, wall time. Grows as " + "; ".join(growth) + " (the varied "
            "profiles' cost is the per-layer checkpoint search, as unsharded; the per-rank "
            "terms are remembered per profile, `memplan/memory/memo.py`: before, each "
            "segment summed every FSDP unit: 200 and 500 uniform layers took 25.8 s and 178.7 s, "
            "the same plans, measured in one run against 41ab6b2).",
            "",
            "| layers | shape | solve time | plan | checkpointed |",
            "|---:|---|---:|---|---:|",
            *rows,
            "",
        ]
    )


if __name__ == "__main__":
    print(run("cpu"))
