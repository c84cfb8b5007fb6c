"""``memplan init-check``: a commented starter memplan.yaml with one check, its budget
either given or found by probing the model (25% above the least peak its target batch
needs)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from memplan.check.advice import suggested_budget
from memplan.check.config import CONFIG_VERSION
from memplan.check.isolate import ProbeRequest, probe_isolated
from memplan.devices import load_device
from memplan.errors import BadInputError
from memplan.memory import DEFAULT_MARGIN
from memplan.model.reference import model_arg, split_model_arg
from memplan.probe.settings import ProbeSettings
from memplan.solver import SolveRequest, least_peak
from memplan.units import parse_budget

DEVICES = ("meta", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
STARTER_HEADROOM = 0.25
"""How far above the least peak a probed starting budget sits."""


def starter_config(
    *,
    model: str,
    name: str,
    target_batch: int,
    budget: str,
    device: str = "meta",
    device_profile: str | None = None,
    precision: str = "fp32",
    baseline: str | None = None,
    layers: str | None = None,
) -> str:
    """A commented starter memplan.yaml with one check."""
    lines = [
        "# memplan check: the CI memory-budget gate (docs/ci.md). Run `memplan check`.",
        "# Paths are relative to this file. Sizes: 24GiB, 512MiB, or 80% of device_profile.",
        f"version: {CONFIG_VERSION}",
        "checks:",
        f"  - name: {json.dumps(name)}",
        f"    model: {json.dumps(model)}",
        f"    target_batch: {target_batch}          # effective batch (micro × accumulation × world)",
        f"    budget: {json.dumps(budget)}",
        f"    device: {device}               # how to probe in CI: meta (fast, no memory), cpu, cuda",
    ]
    if device_profile:
        lines.append(f"    device_profile: {device_profile}   # GPU spec: capacity and speed")
    else:
        lines.append(
            "    # device_profile: rtx4090     # GPU spec: capacity (for % budgets) and speed"
        )
    if device != "meta":
        lines.append(
            "    timing_rounds: 1             # timed runs per probed size: the verdict is "
            "memory's (5: steadier step times)"
        )
    lines += [
        f"    precision: {precision}           # fp32 | bf16 | fp16",
        "    world_size: 1",
        f"    margin: {DEFAULT_MARGIN}              # fraction of the budget kept free",
    ]
    if layers:
        lines.append(
            f"    layers: {json.dumps(layers)}   # checkpoint-candidate glob for the probe"
        )
    if baseline:
        lines.append(
            f"    baseline: {json.dumps(baseline)}   # write/refresh: memplan check --update-baseline"
        )
    else:
        lines.append(
            "    # baseline: memplan/baseline/model.profile.yaml   # then: memplan check --update-baseline"
        )
    return "\n".join(lines) + "\n"


def probe_least_peak(
    model: str,
    *,
    target_batch: int,
    device: str = "meta",
    precision: str = "fp32",
    device_profile: str | None = None,
    layers: str | None = None,
) -> int:
    """Probe ``model`` (in a child process) and return the least peak any plan for
    ``target_batch`` on one rank needs: bytes only, so a cpu or cuda probe times one round
    (``timing_rounds``), not five."""
    profile = probe_isolated(
        ProbeRequest(
            model_arg=model,
            settings=ProbeSettings(
                device=device,
                precision=precision,
                device_profile=device_profile,
                layers=layers,
                timing_rounds=1,
            ),
        )
    )
    spec = load_device(device_profile) if device_profile else None
    request = SolveRequest(target_batch=target_batch, budget_bytes=1, device_spec=spec)
    return least_peak(profile, request).peak_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Starter:
    """A starter config ready to write, and how its budget was found."""

    output: Path
    text: str
    budget: str
    min_peak_bytes: int | None
    """The probed least peak, when the budget was found by probing; None when given."""
    then: str
    """The command to run next."""


def make_starter(
    model: str,
    *,
    output: Path,
    budget: str | None = None,
    target_batch: int = 32,
    device: str = "meta",
    device_profile: str | None = None,
    precision: str = "fp32",
    name: str | None = None,
    baseline: str | None = None,
    layers: str | None = None,
) -> Starter:
    """Validate the options, find a budget when none is given, and return the config text.
    Bad options are BadInputError naming the option; nothing is written here."""
    if device not in DEVICES:
        raise BadInputError(f"--device {device!r} is not one of {', '.join(DEVICES)}.")
    if precision not in PRECISIONS:
        raise BadInputError(f"--precision {precision!r} is not one of {', '.join(PRECISIONS)}.")
    if target_batch < 1:
        raise BadInputError(f"--target-batch must be >= 1, got {target_batch}.")
    path_text, factory = split_model_arg(model)
    model_path = Path(path_text)
    if not model_path.is_file():
        raise BadInputError(
            f"Model file {model_path} does not exist.",
            hint="Pass a Python file that defines build_model() and make_batch().",
        )
    spec = load_device(device_profile) if device_profile else None
    min_peak = None
    if budget is None:
        min_peak = probe_least_peak(
            model,
            target_batch=target_batch,
            device=device,
            precision=precision,
            device_profile=device_profile,
            layers=layers,
        )
        budget = suggested_budget(int(min_peak * (1 + STARTER_HEADROOM)), DEFAULT_MARGIN)
    else:
        parse_budget(budget, capacity_bytes=spec.memory_bytes if spec else None, what="--budget")
    relative = os.path.relpath(model_path.resolve(), output.resolve().parent)
    text = starter_config(
        model=model_arg(Path(relative).as_posix(), factory),
        name=name or model_path.stem,
        target_batch=target_batch,
        budget=budget,
        device=device,
        device_profile=device_profile,
        precision=precision,
        baseline=baseline,
        layers=layers,
    )
    then = f"memplan check --config {output}" + (" --update-baseline" if baseline else "")
    return Starter(output=output, text=text, budget=budget, min_peak_bytes=min_peak, then=then)
