"""The Plan: the decision memplan made, why, and what it predicts. Source of truth for
every emitted config and for ``verify``. No torch here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from memplan.errors import ProfileError
from memplan.files.schema import dump_yaml, from_data, load_yaml_file, read_back, to_data
from memplan.modes import FULL, KEEP, MODES, Mode
from memplan.parallel import Parallel
from memplan.profile import Float8, MixedPrecision, Precision

PLAN_SCHEMA_VERSION = 2
"""2: ``checkpoint`` maps each layer not kept to its mode. 1 (still read): the list
``checkpoint_layers``, every one fully checkpointed."""

Strategy = Literal["ddp", "zero1", "zero2", "fsdp"]
STRATEGIES: tuple[Strategy, ...] = ("ddp", "zero1", "zero2", "fsdp")
"""Data-parallel strategies, least to most sharded (``auto`` prefers them in this order)."""

GradSync = Literal["last_micro_step", "every_micro_step"]
"""When an accumulating step synchronises gradients across ranks: only on the last
micro-step (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync(False)``, which keeps
*unsharded* gradients until then), or on every micro-step (FSDP2 reduce-scatters each
micro-step's gradients into sharded ones: less memory, k times the reduce-scatters)."""
GRAD_SYNCS: tuple[GradSync, ...] = ("last_micro_step", "every_micro_step")


@dataclass(frozen=True, kw_only=True, slots=True)
class Breakdown:
    """Predicted bytes at the peak, by what holds them. Sums to ``Prediction.peak_bytes``."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    reserve: int

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.transient
            + self.reserve
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    peak_bytes: int
    """Predicted peak device memory of one optimizer step, reserve and margin included."""
    step_seconds: float
    """Predicted time of one optimizer step (all accumulation micro-steps)."""
    breakdown: Breakdown
    peak_phase: str = ""
    """Where the peak happens: e.g. 'backward of transformer.h.0', 'optimizer step'."""
    stage_peak_bytes: tuple[int, ...] = ()
    """With a pipeline layout: every stage's predicted peak per rank, stage 0 first (the
    ranks of a stage are alike; ``memplan.memory.parallel.stage_of_rank`` maps a rank to its
    stage). ``peak_bytes`` is their maximum. Empty without pipelining."""

    def rank_peak_bytes(self, stage: int) -> int:
        """The predicted peak of a rank of pipeline stage ``stage``."""
        return self.stage_peak_bytes[stage] if self.stage_peak_bytes else self.peak_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelFingerprint:
    """What the plan knows of the model it was made for, so ``verify`` can refuse to run it
    on another model (whose memory it does not describe)."""

    parameter_bytes: int
    """Bytes of all parameters (trainable and frozen), each storage counted once."""
    candidate_layers: tuple[str, ...] = ()
    """The checkpoint candidates of the profile, by fully-qualified module name."""
    hf_blocks: tuple[str, ...] = ()
    """The blocks Hugging Face's ``gradient_checkpointing_enable()`` checkpoints
    (``Profile.hf_blocks``); empty for a model that is not a transformers model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    schema_version: int = PLAN_SCHEMA_VERSION
    target_batch: int
    """Effective batch: micro_batch_size × accumulation_steps × data-parallel ranks (the
    world size, or ``parallel.dp`` with a layout)."""
    micro_batch_size: int
    accumulation_steps: int
    world_size: int = 1
    strategy: Strategy = "ddp"
    """How ranks share the model: ``ddp`` replicas, ``zero1`` optimizer state sharded,
    ``zero2`` and gradients, ``fsdp`` and parameters (FSDP2 ``fully_shard`` / ZeRO-3).
    Memory figures are per rank."""
    checkpoint: dict[str, Mode] = field(default_factory=dict)
    """Fully-qualified module name -> mode (``selective``, ``full`` or ``offload``; see
    memplan.modes) for every layer not kept, in layer order."""
    shard_units: tuple[str, ...] = ()
    """For ``fsdp``: modules to ``fully_shard`` one by one (the probe's candidate layers),
    before the root. Empty otherwise."""
    shard_unit_types: tuple[str, ...] = ()
    """Class names of ``shard_units`` (for wrap policies that name classes: Accelerate)."""
    precision: Precision = "fp32"
    mixed_precision: MixedPrecision = "autocast"
    """How bf16/fp16 runs: ``autocast`` over fp32 parameters, or ``params``: the engine's
    mixed-precision policy (FSDP2 ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``:
    parameters gathered in the compute dtype, fp32 master shards, gradients reduced in fp32)."""
    float8: Float8 | None = None
    """The linears run in float8 as the profile's probe converted them (torchao's
    ``Float8Linear``; the emitters write the engine's float8 settings); None: no float8."""
    compiled: bool = False
    """The step time is torch.compile's (a ``probe --compiled`` profile): ``--format
    torchtitan`` compiles the model (``--compile.enable``)."""
    grad_sync: GradSync = "last_micro_step"
    """For ``fsdp`` with accumulation: reduce-scatter only on the last micro-step (unsharded
    gradients held until then) or on every micro-step (sharded gradients). See ``GradSync``."""
    device: str = "cpu"
    """Device the plan is for: cpu, cuda, or a device profile name."""
    budget_bytes: int
    margin: float = 0.0
    """Safety margin the plan was solved with (fraction of the budget kept free)."""
    predicted: Prediction
    model: str
    """The model file (``path`` or ``path:factory``)."""
    model_fingerprint: ModelFingerprint | None = None
    """Of the profiled model; None in plans written before memplan recorded it."""
    profile: str = ""
    """The profile the plan was solved from."""
    reasons: tuple[str, ...] = ()
    """One line per decision: why this micro-batch, this accumulation, these layers."""
    warnings: tuple[str, ...] = ()
    parallel: Parallel | None = None
    """The parallel layout (issue 25): data-parallel replicas and shards, tensor, pipeline
    and context parallel degrees (their product is ``world_size``). With ``pp`` > 1 the
    ``accumulation_steps`` are the pipeline's micro-batches per step. None: every rank holds
    the model under ``strategy`` (data parallelism alone; plans written before layouts)."""
    seq_len: int | None = None
    """Tokens per sample the plan is for (``memplan solve --seq-len``; issue 13): verify and
    the emitted configs make batches of this length. None: the model file's own batches
    (not written to plan files)."""

    def __post_init__(self) -> None:
        for name in ("target_batch", "micro_batch_size", "accumulation_steps", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        layout = self.parallel
        if layout is not None and layout.world_size != self.world_size:
            raise ValueError(
                f"parallel degrees multiply to {layout.world_size}, not world_size "
                f"{self.world_size}"
            )
        dp = self.data_parallel_ranks
        product = self.micro_batch_size * self.accumulation_steps * dp
        if product != self.target_batch:
            what = "world_size" if layout is None else "parallel.dp"
            raise ValueError(
                f"target_batch {self.target_batch} != micro_batch_size × accumulation_steps × "
                f"{what} = {self.micro_batch_size} × {self.accumulation_steps} × "
                f"{dp} = {product}"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if self.mixed_precision == "params" and (
            self.precision == "fp32" or self.strategy != "fsdp"
        ):
            raise ValueError(
                "mixed_precision 'params' needs precision bf16 or fp16 and strategy fsdp, got "
                f"{self.precision} and {self.strategy}"
            )
        if (
            self.parallel is not None
            and self.parallel.fsdp_units != "memplan"
            and self.strategy != "fsdp"
        ):
            raise ValueError(
                f"parallel.fsdp_units {self.parallel.fsdp_units!r} needs strategy fsdp, got "
                f"{self.strategy} (only FSDP groups parameters into units)"
            )
        bad = {name: mode for name, mode in self.checkpoint.items() if mode not in MODES}
        if bad:
            name, mode = next(iter(bad.items()))
            raise ValueError(f"checkpoint.{name}: mode {mode!r} is not one of {', '.join(MODES)}")
        modes = {name: mode for name, mode in self.checkpoint.items() if mode != KEEP}
        object.__setattr__(self, "checkpoint", modes)
        if self.budget_bytes < 1:
            raise ValueError("budget_bytes must be positive")

    @property
    def data_parallel_ranks(self) -> int:
        """Ranks the samples of a step are split over: ``world_size`` without a layout,
        ``parallel.dp`` with one (tensor, pipeline and context ranks share samples)."""
        return self.world_size if self.parallel is None else self.parallel.dp

    @property
    def samples_per_second(self) -> float:
        step = self.predicted.step_seconds
        return self.target_batch / step if step > 0 else float("inf")

    @property
    def checkpoint_layers(self) -> tuple[str, ...]:
        """The layers not kept (the names in ``checkpoint``), in layer order."""
        return tuple(self.checkpoint)

    def with_checkpoint_layers(self, names: Iterable[str]) -> Plan:
        """This plan with exactly ``names`` not kept, each in its mode from ``checkpoint``,
        else ``full`` (how schema 1 plans and ``--json`` output name the layers)."""
        names = tuple(names)
        if len(set(names)) != len(names):
            raise ValueError("checkpoint_layers has duplicates")
        return replace(self, checkpoint={n: self.checkpoint.get(n, FULL) for n in names})

    def layers_in(self, mode: str) -> tuple[str, ...]:
        """The layers in ``mode`` (not ``keep``), in layer order."""
        return tuple(name for name, m in self.checkpoint.items() if m == mode)


class _BlockMap(dict):
    """A mapping written one entry per line (``layer: mode``), readable in a diff."""


class _PlanDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True  # memplan's loader refuses anchors and aliases


_PlanDumper.add_representer(
    _BlockMap,
    lambda dumper, data: dumper.represent_mapping(
        "tag:yaml.org,2002:map", data.items(), flow_style=False
    ),
)


def plan_to_data(plan: Plan) -> dict[str, Any]:
    """The plan as ``--json`` prints it: the file's fields, with the derived
    ``checkpoint_layers`` after ``checkpoint``."""
    data: dict[str, Any] = {}
    for key, value in to_data(plan).items():
        data[key] = value
        if key == "checkpoint":
            data["checkpoint_layers"] = list(plan.checkpoint_layers)
    return data


WRITTEN = "<the plan memplan made>"
"""The source a read-back names: the text is not in a file yet."""


def plan_to_yaml(plan: Plan) -> str:
    """The plan file: schema 2, layers under ``checkpoint:`` one per line
    (``checkpoint_layers`` is derived and not written), read back as ``load_plan`` reads a
    file: every writer of a plan (``solve -o``, the ``plan`` format, the scripts that embed
    it) takes its text from here, so one that would be refused is exit 3 and never written
    (``files.schema.read_back``)."""
    text = _plan_text(plan)
    read_back(text, "plan", lambda data: plan_from_data(data, source=WRITTEN))
    return text


def _plan_text(plan: Plan) -> str:
    data = yaml.safe_load(dump_yaml(plan))
    if data.get("seq_len") is None:
        data.pop("seq_len", None)
    if data.get("parallel") is None:
        data.pop("parallel", None)
    elif not data["parallel"].get("loss_parallel"):
        data["parallel"].pop("loss_parallel", None)  # the default: plans read as before
    if data.get("parallel") is not None and data["parallel"].get("kept_outputs") == "none":
        data["parallel"].pop("kept_outputs", None)  # the default: plans read as before
    if data.get("parallel") is not None and data["parallel"].get("stage_split") == "memplan":
        data["parallel"].pop("stage_split", None)  # the default: plans read as before
    if data.get("parallel") is not None and data["parallel"].get("fsdp_units") == "memplan":
        data["parallel"].pop("fsdp_units", None)  # the default: plans read as before
    if not data.get("compiled"):
        data.pop("compiled", None)  # the default: plans read as before
    if not data["predicted"].get("stage_peak_bytes"):
        data["predicted"].pop("stage_peak_bytes", None)
    data["checkpoint"] = _BlockMap(data["checkpoint"] or {})
    return yaml.dump(data, Dumper=_PlanDumper, sort_keys=False, default_flow_style=None, width=100)


def _migrate(data: dict, version: int, source: str) -> dict:
    """Plan data of an older schema as the current one: schema 1's ``checkpoint_layers``
    (every layer fully checkpointed) becomes ``checkpoint: {layer: full}``."""
    if version >= PLAN_SCHEMA_VERSION:
        return data
    data = dict(data)
    layers = data.pop("checkpoint_layers", None) or []
    if "checkpoint" in data:
        raise ProfileError(
            f"{source}: 'checkpoint' is a schema {PLAN_SCHEMA_VERSION} field, but the plan "
            f"says schema_version {version}.",
            hint=f"Set schema_version: {PLAN_SCHEMA_VERSION}.",
        )
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise ProfileError(f"{source}: field 'plan.checkpoint_layers' must be a list of names.")
    if len(set(layers)) != len(layers):
        raise ProfileError(f"{source}: field 'plan.checkpoint_layers' has duplicates.")
    data["checkpoint"] = dict.fromkeys(layers, FULL)
    data["schema_version"] = PLAN_SCHEMA_VERSION
    return data


def plan_from_data(data: dict, *, source: str = "<plan>") -> Plan:
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or "target_batch" not in data:
        raise ProfileError(
            f"{source} is not a memplan plan (no schema_version/target_batch).",
            hint="Write one with `memplan solve PROFILE -o plan.yaml`.",
        )
    if version > PLAN_SCHEMA_VERSION:
        raise ProfileError(
            f"{source} has plan schema_version {version}, newer than this "
            f"memplan understands ({PLAN_SCHEMA_VERSION}).",
            hint="Upgrade memplan.",
        )
    data = dict(_migrate(data, version, source))
    # ``--json`` output carries the derived list too: it names the layers not kept, each in
    # its mode from ``checkpoint`` (``Plan.with_checkpoint_layers``).
    named = data.pop("checkpoint_layers", None)
    if named is not None and (
        not isinstance(named, list) or not all(isinstance(n, str) for n in named)
    ):
        raise ProfileError(f"{source}: field 'plan.checkpoint_layers' must be a list of names.")
    if named is not None and len(set(named)) != len(named):
        raise ProfileError(f"{source}: field 'plan.checkpoint_layers' has duplicates.")
    plan = from_data(Plan, data, source=source, path="plan")
    if named is not None:
        plan = plan.with_checkpoint_layers(named)
    problem = plan_problem(plan)
    if problem is None and plan.checkpoint and not _candidates(plan):
        # no fingerprint: the layers of the profile the plan names, as written or beside
        # the plan file (``source``), where it is found and reads
        problem = _names_problem(plan, _profile_layer_names(plan, Path(source)))
    if problem is not None:
        raise ProfileError(
            f"{source}: field '{problem[0]}' {problem[1]}.",
            hint="The plan was edited or corrupted: solve again with `memplan solve`.",
        )
    return plan


PLAN_DEVICES = ("cpu", "cuda", "meta")


def plan_problem(plan: Plan) -> tuple[str, str] | None:
    """``(field path, what is wrong)`` for the first value ``solve`` never writes, else None.
    The schema has already refused NaN, infinity and absurd magnitudes."""
    from memplan.devices import ALIASES, list_devices, names_spec_file

    predicted = plan.predicted
    if predicted.peak_bytes < 0:
        return "plan.predicted.peak_bytes", f"is {predicted.peak_bytes}, negative"
    if predicted.step_seconds < 0:
        return "plan.predicted.step_seconds", f"is {predicted.step_seconds}, negative"
    if not 0 <= plan.margin < 1:
        return "plan.margin", f"is {plan.margin}, not a fraction in [0, 1)"
    known = {*PLAN_DEVICES, *list_devices(), *ALIASES}
    spec_file = names_spec_file(plan.device)  # solve --device-profile FILE
    if plan.device.lower() not in known and not spec_file:
        return "plan.device", (
            f"is {plan.device!r}, not one of {', '.join(PLAN_DEVICES)}, a device profile "
            f"({', '.join(list_devices())}) or a device profile file"
        )
    if plan.seq_len is not None and not 1 <= plan.seq_len <= 2**24:
        return "plan.seq_len", f"is {plan.seq_len}, not a length from 1 to {2**24} tokens"
    if plan.model_fingerprint is not None and plan.model_fingerprint.parameter_bytes < 0:
        return "plan.model_fingerprint.parameter_bytes", "is negative"
    return _breakdown_problem(predicted) or _layout_problem(plan) or _checkpoint_problem(plan)


def _breakdown_problem(predicted: Prediction) -> tuple[str, str] | None:
    """A breakdown ``solve`` never writes: it splits the peak (``memory.peak.breakdown_at``:
    each part takes what it asks for while the allocated peak lasts, the transient the
    rest, and the reserve), so no part is negative and they add up to the peak."""
    breakdown = predicted.breakdown
    for name in ("params", "grads", "optimizer", "activations", "transient", "reserve"):
        value = getattr(breakdown, name)
        if value < 0:
            return f"plan.predicted.breakdown.{name}", f"is {value}, a negative number of bytes"
    if breakdown.total > predicted.peak_bytes:
        return "plan.predicted.breakdown", (
            f"adds up to {breakdown.total} bytes, more than the predicted peak_bytes "
            f"{predicted.peak_bytes} it splits"
        )
    return None


def _layout_problem(plan: Plan) -> tuple[str, str] | None:
    """A layout ``solve`` never writes: more pipeline stages (× virtual stages) than the
    model has blocks to split among them (each stage holds at least one block)."""
    layout, fingerprint = plan.parallel, plan.model_fingerprint
    if layout is None or layout.pp == 1 or fingerprint is None:
        return None
    blocks = len(fingerprint.candidate_layers)
    if layout.stages > blocks:
        stages = (
            f"{layout.pp} × {layout.virtual_stages} virtual"
            if layout.virtual_stages > 1
            else str(layout.pp)
        )
        return "plan.parallel.pp", (
            f"is {stages} pipeline stages, but the model has {blocks} blocks to split "
            "among them (solve plans at most one stage per block)"
        )
    return None


def _checkpoint_problem(plan: Plan) -> tuple[str, str] | None:
    """A checkpointed layer ``solve`` never chooses: the root module (``''``: the whole
    model recomputed in the backward, which no plan's prediction describes), or a module
    that is not one of the profile's candidates (a container such as ``blocks``, whose
    candidates are its children, or a non-candidate such as ``head``): the prediction
    has no numbers for it, so ``verify`` and the emitted configs would run a plan nobody
    predicted."""
    return _names_problem(plan, _candidates(plan))


def _candidates(plan: Plan) -> tuple[str, ...]:
    """The profile's checkpoint candidates as the plan records them: its fingerprint's; in
    a plan without one (written before memplan recorded it) an FSDP plan's ``shard_units``
    (``solve`` writes the candidates there); else none known (``plan_problem`` then takes
    the layers of the profile the plan names, ``_profile_layer_names``)."""
    if plan.model_fingerprint is not None:
        return plan.model_fingerprint.candidate_layers
    if plan.strategy == "fsdp" and plan.shard_units:
        return plan.shard_units
    return ()


def _names_problem(plan: Plan, candidates: tuple[str, ...]) -> tuple[str, str] | None:
    for name in plan.checkpoint:
        where = f"plan.checkpoint.{name}"
        if name == "":
            return where, "names the root module (''), which memplan never checkpoints"
        if candidates and name not in candidates:
            shown = ", ".join(candidates[:6]) + (", ..." if len(candidates) > 6 else "")
            inside = [c for c in candidates if c.startswith(name + ".")]
            what = (
                f"a container of {len(inside)} candidate layers, not a candidate itself"
                if inside
                else "not one of the profile's checkpoint candidates"
            )
            return where, f"is {what} (candidates: {shown})"
    return None


def load_plan(path: str | Path) -> Plan:
    """Read a plan YAML written by ``memplan solve``."""
    return plan_from_data(load_yaml_file(path, what="plan"), source=str(path))


def _profile_layer_names(plan: Plan, plan_path: Path) -> tuple[str, ...]:
    """The candidate layers of the profile ``plan`` names (as written, or beside the plan),
    or () when it is not found or does not read: the plan still loads, as before."""
    from memplan.errors import MemplanError
    from memplan.profile import load_profile

    if not plan.profile:
        return ()
    written = Path(plan.profile)
    for found in (written, plan_path.parent / written):
        if found.is_file():
            try:
                return load_profile(found).layer_names
            except (MemplanError, OSError, ValueError):
                return ()
    return ()
