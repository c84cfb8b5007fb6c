"""The zoo's cases, and the probes and measurements the zoo sections share.

Not a section itself: ``bench/zoo_accuracy.py`` and ``bench/zoo_plans.py`` import it. When
both run in one ``python -m bench.run`` process, a probe or a measured configuration is
made once and reused (probes and measurements are deterministic: fixed seeds, seeded
batches), which keeps the two sections inside their time budget."""

from __future__ import annotations

import csv
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from memplan import memory
from memplan.model.batch import move_batch
from memplan.model.loader import load_model_file
from memplan.probe import MeasuredRun, measure_training_peak, probe_model
from memplan.profile import Profile
from memplan.run.checkpoint import checkpointed

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "bench" / "zoo"
RESULTS = ROOT / "bench" / "results"

PROBED = (1, 2, 4)
"""Micro-batches every probe measures."""
TARGET = 16
"""Effective batch of the planning cases: 4x the largest probed micro-batch."""
MEASURE_STEPS = 1
"""Tracked optimizer steps per measurement, after measure_training_peak's warm-up step (the
steady state: optimizer state exists from the warm-up on)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    """Row label: the family, plus the precision or optimizer when not the default."""
    family: str
    file: str
    """Model file under bench/zoo/."""
    precision: str = "fp32"
    needs_transformers: bool = False
    plans: bool = True
    """Part of zoo_plans' plan-quality and tool tables (the variants only of the accuracy
    and budget tables, to keep the suite's time down)."""

    @property
    def path(self) -> str:
        return str(ZOO / self.file)


CASES = (
    Case(name="gpt_lm", family="GPT LM", file="gpt_lm.py"),
    Case(name="gpt_lm bf16", family="GPT LM", file="gpt_lm.py", precision="bf16", plans=False),
    Case(name="gpt_lm sgd", family="GPT LM", file="gpt_lm_sgd.py", plans=False),
    Case(name="vit", family="ViT dropout", file="vit.py"),
    Case(name="vit bf16", family="ViT dropout", file="vit.py", precision="bf16", plans=False),
    Case(name="resnet_bn", family="ResNet BN", file="resnet_bn.py"),
    Case(name="unet", family="U-Net", file="unet.py"),
    Case(name="lstm", family="LSTM", file="lstm.py"),
    Case(name="moe", family="MoE top-1", file="moe.py"),
    Case(name="lora", family="LoRA", file="lora.py"),
    Case(name="uneven_mlp", family="uneven MLP", file="uneven_mlp.py"),
    Case(name="hf_gpt2", family="HF GPT-2", file="hf_gpt2.py", needs_transformers=True),
    Case(name="hf_llama", family="HF Llama", file="hf_llama.py", needs_transformers=True),
    Case(
        name="hf_gpt2 default",
        family="HF GPT-2 cache on",
        file="hf_gpt2_default.py",
        needs_transformers=True,
        plans=False,
    ),
    Case(
        name="hf_lora_llama",
        family="PEFT LoRA Llama",
        file="hf_lora_llama.py",
        needs_transformers=True,
        plans=False,
    ),
    Case(
        name="hf_llama bf16",
        family="HF Llama",
        file="hf_llama.py",
        precision="bf16",
        needs_transformers=True,
        plans=False,
    ),
)


def available_cases() -> tuple[list[Case], list[str]]:
    """The cases this machine can run, and a note per skipped one."""
    have_hf = importlib.util.find_spec("transformers") is not None
    cases, skipped = [], []
    for case in CASES:
        if case.needs_transformers and not have_hf:
            skipped.append(f"{case.name}: skipped, transformers is not installed")
        else:
            cases.append(case)
    return cases, skipped


# --------------------------------------------------------------------------- probes
@dataclass(frozen=True, slots=True)
class Probed:
    profile: Profile
    seconds: float


_PROBES: dict[tuple[str, str, str], Probed] = {}


def probed(case: Case, device: str) -> Probed:
    """The case's profile at micro-batches PROBED on ``device`` (made once per process)."""
    key = (case.file, case.precision, device)
    if key not in _PROBES:
        started = time.perf_counter()
        profile = probe_model(
            case.path, device=device, micro_batches=PROBED, precision=case.precision
        )
        _PROBES[key] = Probed(profile, time.perf_counter() - started)
    return _PROBES[key]


def predicted_allocated_bytes(
    profile: Profile, micro: int, accumulation: int, layers: Iterable[str]
) -> int:
    """Predicted peak of live tensor bytes, without the CUDA reserve: what the tracker and
    torch.cuda.max_memory_allocated measure."""
    return memory.step_peak(profile, micro, list(layers), accumulation).allocated_bytes


def predicted_peak_bytes(
    profile: Profile, micro: int, accumulation: int, layers: Iterable[str]
) -> int:
    """Predicted peak with the profile's reserve (none off CUDA): what a budget holds."""
    reserve = memory.reserve_for(profile)
    return memory.step_peak(profile, micro, list(layers), accumulation, reserve=reserve).peak_bytes


# --------------------------------------------------------------------------- measuring
_RUNS: dict[tuple, MeasuredRun] = {}


def measured(
    case: Case, device: str, micro: int, accumulation: int, layers: Sequence[str]
) -> MeasuredRun:
    """Real steps of one configuration, measured by memplan's tracker (made once)."""
    key = (case.file, case.precision, device, micro, accumulation, tuple(sorted(layers)))
    if key not in _RUNS:
        _RUNS[key] = measure_training_peak(
            case.path,
            device=device,
            micro_batch=micro,
            accumulation_steps=accumulation,
            checkpoint_layers=tuple(layers),
            precision=case.precision,
            steps=MEASURE_STEPS,
        )
    return _RUNS[key]


def relative_error(predicted: float, actual: float) -> float:
    """(predicted − measured) / measured: negative means under-predicted."""
    return (predicted - actual) / max(actual, 1)


# --------------------------------------------------------------------------- a training step
@dataclass
class Trainer:
    """One configuration, built and ready to step: the model file's model and optimizer,
    the named layers checkpointed (non-reentrant, as memplan.apply does), one batch."""

    case: Case
    micro: int
    accumulation: int
    layers: tuple[str, ...]
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.model_file = load_model_file(self.case.path)
        self.model = self.model_file.build_model().to(self.device)
        self.optimizer = self.model_file.make_optimizer(self.model)
        self.batch = move_batch(self.model_file.make_batch(self.micro), torch.device(self.device))
        modules = dict(self.model.named_modules())
        self.checkpointed = [modules[name] for name in self.layers]

    def checkpointing(self):
        return checkpointed(self.checkpointed)

    def autocast(self):
        if self.case.precision == "fp32":
            return nullcontext()
        return torch.autocast(device_type=self.device, dtype=DTYPES[self.case.precision])

    def step(self, before_micro_step: Callable[[], None] | None = None) -> None:
        """One optimizer step: ``accumulation`` micro-steps, loss scaled by 1/accumulation.
        Call inside ``checkpointing()``."""
        self.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.accumulation):
            if before_micro_step is not None:
                before_micro_step()
            with self.autocast():
                loss = self.model_file.loss(self.model, self.batch)
                if self.accumulation > 1:
                    loss = loss / self.accumulation
            loss.backward()
            del loss
        self.optimizer.step()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_step_seconds(trainers: Sequence[Trainer], rounds: int) -> list[float]:
    """Median wall time of one optimizer step per trainer, over ``rounds`` rounds that
    step every trainer once in turn (interleaved, so a slow spell of the machine hits all
    configurations alike), after one untimed warm-up round."""
    times: list[list[float]] = [[] for _ in trainers]
    with ExitStack() as stack:
        for trainer in trainers:
            stack.enter_context(trainer.checkpointing())
        for round_index in range(rounds + 1):
            for i, trainer in enumerate(trainers):
                _sync(trainer.device)
                started = time.perf_counter()
                trainer.step()
                _sync(trainer.device)
                if round_index > 0:
                    times[i].append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


# --------------------------------------------------------------------------- reporting
def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.2f} MiB"
