"""memplan.yaml: the checks file, read strictly and resolved against its own folder.

``memplan.yaml``::

    version: 1                      # optional
    checks:
      - name: gpt-finetune-4090     # unique; what --only selects
        model: train/model.py       # relative to memplan.yaml; model.py:factory allowed
        target_batch: 64
        budget: 24GiB               # a size, or N% of device_profile's memory; optional
                                    # with device_profile (then: all of its memory)
        device: meta                # how to probe: meta | cpu | cuda
        device_profile: rtx4090     # optional GPU spec: capacity (for %) and speed (meta)
        precision: bf16             # fp32 | bf16 | fp16
        micro_batches: [1, 2, 4]    # optional: sizes the probe measures
        world_size: 1
        margin: 0.03                # fraction of the budget kept free
        baseline: memplan/baseline/gpt.profile.yaml   # optional committed profile
        layers: "transformer.h.*"   # optional checkpoint-candidate glob for the probe
        timeout: 600                # optional: seconds the probe may take (--timeout)
        timing_rounds: 1            # optional, cpu/cuda: timing rounds per size (default 5)

The whole file goes through ``memplan.files.schema`` (unknown keys at any level are rejected with
the dotted path and a did-you-mean); what the schema cannot say (a model file that does not
exist, a percentage without a device, a duplicate name) is checked here, naming the field.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from memplan.devices import DeviceSpec, capacity_bytes, load_device, names_spec_file
from memplan.errors import BadInputError, MemplanError
from memplan.files.schema import LARGEST_INT, TOP_LEVEL, from_data, load_yaml_file
from memplan.memory import DEFAULT_MARGIN, margin_problem
from memplan.profile.data import timing_rounds_problem
from memplan.units import parse_budget

CONFIG_VERSION = 1
DEFAULT_CONFIG = "memplan.yaml"
DEFAULT_TIMEOUT_S = 900.0
"""Seconds a check's probe may take unless ``--timeout`` or its ``timeout:`` says otherwise:
a meta probe of a large model takes seconds, a CPU probe minutes; a hang takes forever."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckSpec:
    """One entry of ``checks:`` in memplan.yaml, as written (sizes still strings)."""

    name: str
    """Unique name; shown in every row and selected by ``--only``."""
    model: str
    """Model file relative to memplan.yaml (``model.py`` or ``model.py:factory``)."""
    target_batch: int
    """Effective batch: micro-batch × accumulation × world_size."""
    budget: str | int | None = None
    """``24GiB``, bytes, or ``80%`` of ``device_profile``'s memory; omitted: all of it."""
    device: Literal["meta", "cpu", "cuda"] = "meta"
    """How to probe: ``meta`` (shapes only, no memory; fast), ``cpu`` or ``cuda``."""
    device_profile: str | None = None
    """GPU spec from profiles/devices/ (e.g. ``rtx4090``): capacity and speed."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch sizes the probe measures (at least two); default the probe's."""
    world_size: int = 1
    margin: float = DEFAULT_MARGIN
    """Fraction of the budget kept free."""
    baseline: str | None = None
    """Committed profile (relative to memplan.yaml) to compare a new profile with."""
    layers: str | None = None
    """Glob of checkpoint candidates for the probe (default: the repeated blocks)."""
    seq_len: int | None = None
    """Tokens per sample: the probe calls ``make_batch(batch_size, seq_len)`` and the plan
    is for that length (issue 13); omitted: the model file's own batches."""
    timeout: float | None = None
    """Seconds this check's probe may take (then the check is an ``error`` naming the phase
    it was in); omitted: ``memplan check --timeout`` (default ``DEFAULT_TIMEOUT_S``)."""
    timing_rounds: int | None = None
    """cpu and cuda: the probe's timing rounds per size (``probe --timing-rounds``); 1
    takes about a quarter of a CPU probe's time, and the verdict is memory's alone;
    omitted: the probe's 5."""

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name must not be empty")
        if self.target_batch < 1:
            raise ValueError(f"target_batch must be >= 1, got {self.target_batch}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.target_batch % self.world_size:
            raise ValueError(
                f"target_batch {self.target_batch} is not divisible by world_size {self.world_size}"
            )
        if self.baseline is not None and not self.baseline.strip():
            raise ValueError("baseline must be a path, not empty")
        if problem := margin_problem(self.margin):
            raise ValueError(problem)
        if self.timeout is not None and not 0 < self.timeout <= MAX_TIMEOUT_S:
            raise ValueError(
                f"timeout must be seconds above 0 and at most {MAX_TIMEOUT_S}, got {self.timeout}"
            )
        if self.timing_rounds is not None:
            if problem := timing_rounds_problem(self.timing_rounds):
                raise ValueError(f"timing_rounds: {problem}")
            if self.device == "meta":
                raise ValueError(
                    "timing_rounds counts a cpu or cuda probe's timed runs; a meta probe "
                    "runs none (drop it, or probe with device: cpu)"
                )
        if self.seq_len is not None and not 1 <= self.seq_len <= 2**24:
            raise ValueError(
                f"seq_len must be a length from 1 to {2**24} tokens, got {self.seq_len}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckFile:
    """The whole memplan.yaml, as the schema reads it."""

    version: Literal[1] = CONFIG_VERSION
    """Format version; this memplan reads version 1."""
    checks: tuple[CheckSpec, ...]
    """At least one check."""

    def __post_init__(self) -> None:
        if not self.checks:
            raise ValueError("checks must be a non-empty list of checks")


@dataclass(frozen=True, kw_only=True, slots=True)
class ResolvedCheck:
    """A validated check: paths resolved against memplan.yaml, budget in bytes."""

    index: int
    spec: CheckSpec
    model_path: Path
    """The model file, resolved."""
    model_arg: str
    """What the probe gets: the resolved path, with ``:factory`` when one was given."""
    budget_bytes: int
    baseline_path: Path | None
    device_spec: DeviceSpec | None = None
    device_profile: str | None = None
    """What probe and solve get for ``device_profile``: a spec's name as written, a spec
    file's path resolved against the config's folder (``resolve_device_profile``)."""
    root: Path = Path()
    """The config's folder: a baseline is only ever written inside it."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def field_path(self) -> str:
        return f"checks[{self.index}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    path: Path
    checks: tuple[ResolvedCheck, ...]


def config_error(
    source: str, field_path: str, problem: str, hint: str | None = None
) -> BadInputError:
    return BadInputError(f"{source}: field '{field_path}' {problem.rstrip('.')}.", hint=hint)


def load_config(path: str | os.PathLike[str] = DEFAULT_CONFIG) -> CheckConfig:
    """Read and validate memplan.yaml. Every problem is a ``BadInputError`` (exit 2) naming
    the file and the field path (``checks[0].budget``); nothing is probed yet."""
    config_path = Path(path)
    source = str(config_path)
    if config_path.is_dir():
        raise BadInputError(
            f"config file {config_path} is a folder.",
            hint=f"Pass its memplan.yaml: --config {config_path / 'memplan.yaml'}.",
        )
    if not config_path.is_file():
        raise BadInputError(
            f"config file {config_path} does not exist.",
            hint="Write a starter with `memplan init-check model.py`, or pass --config PATH.",
        )
    data = load_yaml_file(config_path, what="memplan.yaml config")
    checks = data.get("checks")
    for index, raw in enumerate(checks if isinstance(checks, list) else ()):
        check_raw_fields(raw, source, f"checks[{index}]")
    parsed = from_data(CheckFile, data, source=source, path=TOP_LEVEL)
    base = config_path.resolve().parent
    resolved: list[ResolvedCheck] = []
    seen: dict[str, int] = {}
    for index, spec in enumerate(parsed.checks):
        if spec.name in seen:
            raise config_error(
                source,
                f"checks[{index}].name",
                f"{spec.name!r} repeats checks[{seen[spec.name]}].name",
                hint="Give each check a unique name.",
            )
        seen[spec.name] = index
        resolved.append(resolve_check(spec, index, base, source))
    _refuse_shared_baselines(resolved, source)
    return CheckConfig(path=config_path, checks=tuple(resolved))


def _refuse_shared_baselines(checks: list[ResolvedCheck], source: str) -> None:
    """Two checks naming one baseline file (``b.profile.yaml`` and ``./b.profile.yaml``, or a
    symlink to it): ``--update-baseline`` would write one check's profile over the other's,
    and every later run would compare a model with another model's profile."""
    seen: dict[Path, ResolvedCheck] = {}
    for check in checks:
        if check.baseline_path is None:
            continue
        target = check.baseline_path.resolve()
        other = seen.get(target)
        if other is None:
            for path, earlier in seen.items():
                with contextlib.suppress(OSError):
                    if os.path.samefile(path, target):  # a hard link to the same file
                        other = earlier
                        break
        if other is not None:
            raise config_error(
                source,
                f"{check.field_path}.baseline",
                f"names {check.spec.baseline!r}, the same file as "
                f"{other.field_path}.baseline ({other.spec.baseline!r}) of check "
                f"{other.name!r}: --update-baseline would write one check's profile over the "
                "other's, and each would then be compared with another model's profile",
                hint=f"Give each check its own baseline file, e.g. "
                f"memplan/baseline/{check.name}.profile.yaml.",
            )
        seen[target] = check


def check_raw_fields(raw: object, source: str, where: str) -> None:
    """What the schema would name but say wrongly, checked on one check's entry as YAML
    read it: a budget that is a number but no size memplan can take (too large for any
    device, not finite, or a fraction of a byte). A number written in quotes
    (``target_batch: "32"``) the schema itself says is quoted text (``files/schema``)."""
    if not isinstance(raw, dict):
        return
    budget = raw.get("budget")
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        return
    field_path = f"{where}.budget"
    if isinstance(budget, float) and not math.isfinite(budget):
        raise config_error(
            source,
            field_path,
            f"is {budget}, not a finite size",
            hint="Write a size such as 24GiB, or whole bytes.",
        )
    if budget < -LARGEST_INT:
        raise config_error(
            source, field_path, "is negative", hint="A budget is a size above 0, e.g. 24GiB."
        )
    if budget > LARGEST_INT:
        shown = f"{budget:.3g}" if isinstance(budget, float) else f"{budget:.3e}"
        raise config_error(
            source,
            field_path,
            f"is {shown} bytes, larger than any device's memory (memplan takes at most "
            "2**62 bytes)",
            hint="Check the number; write a size with a unit, e.g. 80GiB.",
        )
    if isinstance(budget, float):
        whole = f" ({int(budget)})" if budget.is_integer() and budget > 0 else ""
        raise config_error(
            source,
            field_path,
            f"is the floating-point number {budget!r}, not a size",
            hint=f"Write whole bytes{whole} or a size with a unit, e.g. 24GiB.",
        )


def resolve_device_profile(name: str | None, base: Path) -> str | None:
    """A check's ``device_profile`` as probe and solve take it: a spec file's path (it ends
    in .yaml or .yml) relative to the config's folder ``base`` like every path in the file,
    made absolute; a shipped spec's name unchanged."""
    if name is None or not names_spec_file(name) or Path(name).is_absolute():
        return name
    return str((base / name).resolve())


def resolve_check(spec: CheckSpec, index: int, base: Path, source: str) -> ResolvedCheck:
    """Resolve ``spec``'s paths against ``base`` and its budget to bytes."""
    where = f"checks[{index}]"
    from memplan.model.reference import (
        is_hf_reference,
        reference_path,
        resolve_model_reference,
        split_model_arg,
    )

    if not is_hf_reference(spec.model):
        folder = base / split_model_arg(spec.model)[0]
        if folder.is_dir():
            raise config_error(
                source,
                f"{where}.model",
                f"names {spec.model!r}, and {folder} is a folder, not a model file",
                hint="Name the model's .py file in it (e.g. "
                f"{split_model_arg(spec.model)[0].rstrip('/')}/model.py); paths are relative "
                "to the config file.",
            )
    try:  # a model file or an hf: reference, relative paths against the config's folder
        resolved_model = resolve_model_reference(spec.model, base)
    except MemplanError as exc:
        raise config_error(source, f"{where}.model", exc.message, hint=exc.hint) from None
    model_path = reference_path(resolved_model)

    device_spec = None
    device_profile = resolve_device_profile(spec.device_profile, base)
    if device_profile is not None:
        try:
            device_spec = load_device(device_profile)
        except MemplanError as exc:
            raise config_error(
                source, f"{where}.device_profile", f"is invalid: {exc.message}", hint=exc.hint
            ) from None
    capacity = capacity_bytes(device_spec, None)  # no probe yet: only a spec gives one

    budget = spec.budget
    if budget is None:
        if capacity is None:
            raise config_error(
                source,
                f"{where}.budget",
                "is missing",
                hint="Give a size (e.g. 24GiB), or a device_profile whose memory is the budget.",
            )
        budget_bytes = int(capacity)
    elif isinstance(budget, str) and budget.strip().lower() == "auto":
        raise config_error(
            source,
            f"{where}.budget",
            "is 'auto', which depends on the machine that runs the check",
            hint="Write a size such as 24GiB, or a percentage with device_profile.",
        )
    elif isinstance(budget, str) and budget.strip().endswith("%") and capacity is None:
        raise config_error(
            source,
            f"{where}.budget",
            f"is {budget!r}, a percentage of a device's memory, and the check names no "
            "device_profile to take it of",
            hint="Add `device_profile: NAME` to this check (see profiles/devices/), or give a "
            "size such as 24GiB.",
        )
    else:
        try:
            budget_bytes = parse_budget(budget, capacity_bytes=capacity, what="budget")
        except BadInputError as exc:
            raise config_error(
                source, f"{where}.budget", f"is invalid: {exc.message}", hint=exc.hint
            ) from None

    if spec.micro_batches is not None:
        sizes = spec.micro_batches
        if len(set(sizes)) < 2 or min(sizes) < 1:
            raise config_error(
                source,
                f"{where}.micro_batches",
                f"is {list(sizes)}; it must list at least two distinct positive sizes",
                hint="e.g. [1, 2, 4].",
            )

    baseline_path = None
    if spec.baseline is not None:
        baseline_path = Path(spec.baseline)
        if not baseline_path.is_absolute():
            baseline_path = base / baseline_path
    return ResolvedCheck(
        index=index,
        spec=spec,
        model_path=model_path,
        model_arg=resolved_model,
        budget_bytes=budget_bytes,
        baseline_path=baseline_path,
        device_spec=device_spec,
        device_profile=device_profile,
        root=base,
    )
