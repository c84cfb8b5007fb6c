"""memplan.emit: every format against a golden file, each ecosystem's own parser where it is
installed, DeepSpeed's batch rule for any world size, and the torch script run for real.

Regenerate the golden files after an intended change with
    MEMPLAN_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_emit.py
and review the diff of tests/golden/ before committing it."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.emit import FORMATS, emit, emit_deepspeed, emit_hf, emit_lightning, emit_torch
from memplan.emit.lightning import LIGHTNING_PRECISION
from memplan.emit.script import STEP_LINE
from memplan.errors import BadInputError
from memplan.plan import Breakdown, Plan, Prediction, plan_from_data

GOLDEN = Path(__file__).parent / "golden"
MODELS = Path(__file__).parent / "models"
UPDATE = os.environ.get("MEMPLAN_UPDATE_GOLDEN") == "1"
GiB, MiB = 1024**3, 1024**2

PLAN = Plan(
    target_batch=64,
    micro_batch_size=8,
    accumulation_steps=4,
    world_size=2,
    checkpoint=dict.fromkeys(("transformer.h.0", "transformer.h.1", "transformer.h.2"), "full"),
    precision="bf16",
    device="cuda",
    budget_bytes=24 * GiB,
    margin=0.05,
    predicted=Prediction(
        peak_bytes=21 * GiB,
        step_seconds=1.5,
        breakdown=Breakdown(
            params=2 * GiB,
            grads=2 * GiB,
            optimizer=4 * GiB,
            activations=11 * GiB,
            transient=1 * GiB,
            reserve=1 * GiB,
        ),
        peak_phase="backward of transformer.h.3",
    ),
    model="examples/gpt.py",
    profile="profiles/models/gpt.yaml",
    reasons=(
        "micro-batch 8: the largest that fits with 3 checkpointed layers",
        "checkpointing transformer.h.0-2: least recompute time that fits 24 GiB",
    ),
    warnings=(),
)
LAYERS = tuple(f"transformer.h.{i}" for i in range(6))


def golden_name(fmt: str) -> str:
    name = FORMATS[fmt].filename
    return name + ".txt" if name.endswith(".py") else name  # keep ruff off generated code


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_golden(fmt: str) -> None:
    filename, text = emit(PLAN, fmt, "examples/gpt.py")
    assert filename == FORMATS[fmt].filename
    path = GOLDEN / golden_name(fmt)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; run with MEMPLAN_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), (
        f"{fmt} output differs from {path}; if intended, regenerate with MEMPLAN_UPDATE_GOLDEN=1"
    )


def test_importing_emit_imports_neither_torch_nor_rich() -> None:
    code = (
        "import sys, memplan.emit, memplan.emit.script\n"
        "bad = sorted(m for m in ('torch', 'rich') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_format() -> None:
    with pytest.raises(BadInputError, match=r"Did you mean deepspeed\?.*Formats: plan, hf"):
        emit(PLAN, "deepspeeed")


def test_plan_format_round_trips() -> None:
    _, text = emit(PLAN, "plan")
    assert plan_from_data(yaml.safe_load(text)) == PLAN


# --------------------------------------------------------------------------- hf


def _hf_data(plan: Plan, **kw) -> dict:
    return yaml.safe_load(emit_hf(plan, model_path="m.py", **kw))


def test_hf_fields_and_checkpointing_decision() -> None:
    data = _hf_data(PLAN)
    assert data == {
        "output_dir": "memplan-output",
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "gradient_checkpointing": False,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "bf16": True,
        "fp16": False,
    }
    text = emit_hf(PLAN, model_path="m.py")
    assert 'memplan.apply(model, memplan.load_plan("plan.yaml"))' in text
    # a subset of the candidates: still all-or-nothing false
    assert _hf_data(PLAN, candidate_layers=LAYERS)["gradient_checkpointing"] is False
    # every candidate checkpointed: Trainer's own flag matches the plan
    full = PLAN.with_checkpoint_layers(LAYERS)
    assert _hf_data(full, candidate_layers=LAYERS)["gradient_checkpointing"] is True
    none = replace(PLAN.with_checkpoint_layers(()), precision="fp16")
    data = _hf_data(none)
    assert data["gradient_checkpointing"] is False and data["fp16"] is True and not data["bf16"]
    assert "memplan.apply" not in emit_hf(none, model_path="m.py")


HF_PLANS = [
    PLAN,
    replace(PLAN.with_checkpoint_layers(LAYERS), precision="fp32"),
    replace(PLAN.with_checkpoint_layers(LAYERS), precision="fp16"),
    replace(PLAN, target_batch=6, micro_batch_size=3, accumulation_steps=2, world_size=1),
    replace(PLAN, device="cpu", precision="bf16"),
    replace(PLAN, device="cpu", precision="fp32", compiled=True),
]


@pytest.mark.parametrize("plan", HF_PLANS)
def test_hf_keys_are_training_arguments_fields(plan: Plan) -> None:
    transformers = pytest.importorskip("transformers")
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(_hf_data(plan)) <= fields


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renamed the flags
@pytest.mark.parametrize("plan", HF_PLANS)
def test_hf_loads_with_hf_argument_parser(plan: Plan, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # TrainingArguments needs it to resolve the device
    if plan.device != "cpu" and plan.precision != "fp32":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("TrainingArguments refuses bf16/fp16 for a GPU plan without a GPU")
    path = tmp_path / "args.yaml"
    path.write_text(emit_hf(plan, model_path="m.py", candidate_layers=LAYERS), encoding="utf-8")
    parser = transformers.HfArgumentParser((transformers.TrainingArguments,))
    (args,) = parser.parse_yaml_file(str(path))  # allow_extra_keys=False: strict
    assert args.per_device_train_batch_size == plan.micro_batch_size
    assert args.gradient_accumulation_steps == plan.accumulation_steps
    assert args.bf16 is (plan.precision == "bf16")
    assert args.fp16 is (plan.precision == "fp16")
    assert args.gradient_checkpointing is (set(plan.checkpoint_layers) == set(LAYERS))
    assert args.torch_compile is plan.compiled  # timed as compiled: trained compiled


# --------------------------------------------------------------------------- deepspeed


def _data_parallel_plan(
    micro: int, k: int, world: int, precision: str, strategy: str = "ddp"
) -> Plan:
    """PLAN at micro-batch ``micro`` × ``k`` steps on ``world`` data-parallel ranks."""
    return replace(
        PLAN,
        target_batch=micro * k * world,
        micro_batch_size=micro,
        accumulation_steps=k,
        world_size=world,
        strategy=strategy,
        precision=precision,
    )


@settings(max_examples=200, deadline=None)
@given(
    micro=st.integers(1, 512),
    k=st.integers(1, 256),
    world=st.integers(1, 4096),
    precision=st.sampled_from(["fp32", "bf16", "fp16"]),
)
def test_deepspeed_batch_rule(micro: int, k: int, world: int, precision: str) -> None:
    plan = _data_parallel_plan(micro, k, world, precision)
    config = json.loads(emit_deepspeed(plan))
    assert config["train_micro_batch_size_per_gpu"] == micro
    assert config["gradient_accumulation_steps"] == k
    assert (
        config["train_batch_size"]
        == config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * world
    )
    assert config["train_batch_size"] == plan.target_batch
    assert config["bf16"]["enabled"] is (precision == "bf16")
    assert config["fp16"]["enabled"] is (precision == "fp16")
    assert not (config["bf16"]["enabled"] and config["fp16"]["enabled"])
    assert config["gradient_clipping"] == 1.0
    assert config["zero_optimization"] == {"stage": 0}


# DeepSpeed's own config class (deepspeed.runtime.config.DeepSpeedConfig) reads each file in
# a subprocess: it needs deepspeed.comm initialised (one gloo rank here), and it takes the
# data-parallel size from an ``mpu`` object, as Megatron hands it over.
_DEEPSPEED_READER = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0")
import deepspeed.comm as dist
from deepspeed.runtime.config import DeepSpeedConfig
dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)


class DataParallel:
    def __init__(self, size):
        self.size = size

    def get_data_parallel_world_size(self):
        return self.size


read = []
for path, world in json.loads(sys.argv[2]):
    try:
        c = DeepSpeedConfig(path, mpu=DataParallel(world))
    except Exception as exc:
        read.append({"refused": f"{type(exc).__name__}: {exc}"})
        continue
    z = c.zero_config
    read.append({
        "train_batch_size": c.train_batch_size, "micro": c.train_micro_batch_size_per_gpu,
        "accumulation": c.gradient_accumulation_steps, "stage": c.zero_optimization_stage,
        "bf16": c.bfloat16_config.enabled, "fp16": c.float16_config.enabled,
        "clipping": c.gradient_clipping, "reduce_bucket_size": z.reduce_bucket_size,
        "overlap_comm": z.overlap_comm, "contiguous_gradients": z.contiguous_gradients,
    })
print("READ " + json.dumps(read))
"""


def _deepspeed_reads(files: list[tuple[Path, int]]) -> list[dict]:
    import importlib.util

    from memplan.verify.distributed import free_port

    if importlib.util.find_spec("deepspeed") is None:  # not imported here: one rank's setup
        pytest.skip("deepspeed is not installed (pip install -e '.[dev]' installs it)")
    pairs = json.dumps([[str(path), world] for path, world in files])
    return _read_back(_DEEPSPEED_READER, str(free_port()), pairs)


def _read_back(reader: str, *args: str) -> list[dict]:
    """What an engine's parser, run by ``reader`` in a fresh interpreter, read from the
    files its arguments name: the JSON list after ``READ`` on its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", reader, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("READ ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("READ ") :])


def test_deepspeeds_own_config_reads_the_plans_numbers(tmp_path: Path) -> None:
    """Every strategy and precision, on 1, 2 and 24 data-parallel ranks: DeepSpeed's config
    class accepts the file (its batch rule against the ranks it is launched on, its ZeRO
    section's fields, bf16 and fp16 never both) and reads back the plan's numbers. A file
    whose batch leaves the ranks out is refused, so the check can fail."""
    cases = []
    for i, (strategy, precision, world) in enumerate(
        [
            ("ddp", "fp32", 1),
            ("zero1", "bf16", 2),
            ("zero2", "bf16", 24),
            ("zero2", "fp16", 2),
            ("fsdp", "bf16", 24),
            ("fsdp", "fp32", 2),
        ]
    ):
        plan = _data_parallel_plan(3, 5, world, precision, strategy)
        path = tmp_path / f"ds_{i}.json"
        path.write_text(emit_deepspeed(plan), encoding="utf-8")
        cases.append((plan, path))
    wrong = json.loads(cases[2][1].read_text(encoding="utf-8"))
    wrong["train_batch_size"] = wrong["train_micro_batch_size_per_gpu"] * 5  # ranks left out
    (tmp_path / "wrong.json").write_text(json.dumps(wrong), encoding="utf-8")

    read = _deepspeed_reads(
        [(path, plan.world_size) for plan, path in cases] + [(tmp_path / "wrong.json", 24)]
    )
    for (plan, _), got in zip(cases, read, strict=False):
        assert "refused" not in got, (plan.strategy, plan.precision, got)
        assert got["train_batch_size"] == plan.target_batch
        assert (got["micro"], got["accumulation"]) == (3, 5)
        assert got["stage"] == {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}[plan.strategy]
        assert (got["bf16"], got["fp16"]) == (plan.precision == "bf16", plan.precision == "fp16")
        assert got["clipping"] == 1.0
        if plan.strategy == "zero2":  # the bucket memplan's ZeRO-2 model assumes
            assert got["reduce_bucket_size"] == 500_000_000
            assert (got["overlap_comm"], got["contiguous_gradients"]) == (False, True)
    assert "train_batch_size is not equal" in read[-1]["refused"]


# --------------------------------------------------------------------------- accelerate


@pytest.mark.parametrize(
    ("world", "device", "precision", "distributed", "mixed"),
    [
        (1, "cuda", "fp32", "NO", "no"),
        (2, "cuda", "bf16", "MULTI_GPU", "bf16"),
        (4, "cpu", "fp16", "MULTI_CPU", "fp16"),
    ],
)
def test_accelerate_config(world, device, precision, distributed, mixed, tmp_path: Path) -> None:
    plan = replace(
        PLAN, target_batch=8 * 4 * world, world_size=world, device=device, precision=precision
    )
    _, text = emit(plan, "accelerate", "m.py")
    data = yaml.safe_load(text)
    assert data["compute_environment"] == "LOCAL_MACHINE"
    assert data["distributed_type"] == distributed
    assert data["mixed_precision"] == mixed
    assert data["num_processes"] == world
    assert data["use_cpu"] is (device == "cpu")
    assert "Accelerator(gradient_accumulation_steps=4)" in text
    assert "batch_size=8" in text
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    path = tmp_path / "accelerate.yaml"
    path.write_text(text, encoding="utf-8")
    loaded = config_args.ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys
    assert loaded.num_processes == world
    assert loaded.mixed_precision == mixed


# --------------------------------------------------------------------------- lightning


@pytest.mark.parametrize(
    ("precision", "spelled"), [("fp32", "32-true"), ("bf16", "bf16-mixed"), ("fp16", "16-mixed")]
)
def test_lightning_trainer_section(precision: str, spelled: str) -> None:
    plan = replace(PLAN, precision=precision)
    text = emit_lightning(plan, model_path="m.py")
    assert yaml.safe_load(text) == {
        "trainer": {
            "accelerator": "gpu",
            "devices": 2,
            "strategy": "ddp",
            "precision": spelled,
            "accumulate_grad_batches": 4,
        }
    }
    assert "batch_size: 8" in text
    assert 'memplan.apply(self.model, memplan.load_plan("plan.yaml"))' in text
    assert LIGHTNING_PRECISION[precision] == spelled


# LightningCLI's own parser (jsonargparse over the Trainer's signature) reads each file in a
# subprocess, parse only: a GPU plan's Trainer cannot be built on this CPU, and the parse is
# what `python main.py fit --config lightning_config.yaml` does first.
_LIGHTNING_READER = """
import json, sys
from memplan.model.loader import settle_torchvision
settle_torchvision()
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.strategies import StrategyRegistry


class ParseOnly(LightningCLI):
    def instantiate_classes(self):
        pass


read = []
for path in sys.argv[1:]:
    try:
        cli = ParseOnly(BoringModel, BoringDataModule, run=False, args=["--config", path])
    except SystemExit:  # jsonargparse reports on stderr and exits 2
        read.append({"refused": True})
        continue
    t = cli.config.trainer
    read.append({
        "accelerator": t.accelerator, "devices": t.devices, "strategy": t.strategy,
        "registered": t.strategy in StrategyRegistry.available_strategies(),
        "precision": t.precision, "accumulate_grad_batches": t.accumulate_grad_batches,
    })
print("READ " + json.dumps(read))
"""


def test_lightning_clis_own_parser_reads_the_plans_trainer(tmp_path: Path) -> None:
    """Every strategy and precision, GPU and CPU plans: LightningCLI's parser takes the
    trainer section (its keys are the Trainer's arguments, its precision one of the
    Trainer's literals) and reads back the plan's numbers; the strategy is a name in
    Lightning's StrategyRegistry. A misspelt precision and an unknown key are refused, so
    the check can fail."""
    pytest.importorskip("jsonargparse", reason="pip install -e '.[dev]' installs it")
    cases = []
    for i, (strategy, precision, world, device) in enumerate(
        [
            ("ddp", "fp32", 1, "cpu"),
            ("ddp", "bf16", 2, "cuda"),
            ("zero1", "fp16", 2, "cuda"),
            ("zero2", "bf16", 8, "cuda"),
            ("fsdp", "bf16", 4, "cuda"),
        ]
    ):
        plan = replace(_data_parallel_plan(3, 5, world, precision, strategy), device=device)
        path = tmp_path / f"lightning_{i}.yaml"
        path.write_text(emit_lightning(plan, model_path="m.py"), encoding="utf-8")
        cases.append((plan, path))
    text = cases[1][1].read_text(encoding="utf-8")
    bad = [tmp_path / "misspelt.yaml", tmp_path / "unknown.yaml"]
    bad[0].write_text(text.replace("bf16-mixed", "bf16-mixd"), encoding="utf-8")
    bad[1].write_text(text.replace("accumulate_grad_batches", "accumulate_batches"), "utf-8")

    read = _read_back(_LIGHTNING_READER, *(str(p) for _, p in cases), *map(str, bad))
    for (plan, _), got in zip(cases, read, strict=False):
        assert "refused" not in got, (plan.strategy, plan.precision, got)
        assert got["accelerator"] == ("cpu" if plan.device == "cpu" else "gpu")
        assert got["devices"] == plan.world_size
        assert got["precision"] == LIGHTNING_PRECISION[plan.precision]
        assert got["accumulate_grad_batches"] == 5
        if plan.strategy != "ddp" or plan.world_size > 1:
            assert got["registered"], got["strategy"]
    assert read[-2:] == [{"refused": True}, {"refused": True}]


_LIGHTNING_FSDP = """
import json, sys
from memplan.model.loader import settle_torchvision
settle_torchvision()
import torch.nn as nn
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel


class ParseOnly(LightningCLI):
    def instantiate_classes(self):
        pass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)


cli = ParseOnly(BoringModel, BoringDataModule, run=False, args=["--config", sys.argv[1]])
strategy = cli.parser.instantiate(cli.config).trainer.strategy  # what fit() is handed
policy = strategy.kwargs["auto_wrap_policy"]
net = nn.Sequential(Block(), nn.Linear(2, 2), Block())
units = policy._run_policy(net, set(), {})  # what FSDP1 wraps as its own units
print("READ " + json.dumps([type(strategy).__name__, [n for n, m in net.named_modules() if m in units]]))
"""


def test_lightning_fsdp_config_shards_the_plans_units(tmp_path: Path) -> None:
    """LightningCLI builds the FSDPStrategy the file names, whose auto-wrap policy makes a
    unit of each module of the plan's block class (memplan.wrap.PlanUnits). Before, the file
    said strategy fsdp, which wraps the root alone: every parameter gathered at once."""
    pytest.importorskip("jsonargparse", reason="pip install -e '.[dev]' installs it")
    plan = replace(
        _data_parallel_plan(3, 5, 4, "bf16", "fsdp"),
        device="cuda",
        shard_units=("h.0", "h.1"),
        shard_unit_types=("Block",),
    )
    path = tmp_path / "lightning.yaml"
    path.write_text(emit_lightning(plan, model_path="m.py"), encoding="utf-8")
    assert "one per Block, by memplan.wrap.PlanUnits" in " ".join(
        line.lstrip("# ") for line in path.read_text().splitlines()
    )
    assert _read_back(_LIGHTNING_FSDP, str(path)) == ["FSDPStrategy", ["0", "2"]]
    for strategy, engine in (("fsdp", "FSDP"), ("zero1", "DeepSpeed"), ("zero2", "DeepSpeed")):
        with pytest.raises(BadInputError, match=f"Lightning runs {engine} on CUDA GPUs only"):
            emit_lightning(replace(plan, device="cpu", strategy=strategy), model_path="m.py")


def test_yaml_comments_are_comments() -> None:
    for fmt in ("hf", "accelerate", "lightning"):
        _, text = emit(PLAN, fmt)
        lines = text.splitlines()
        assert lines[0].startswith("# Generated by memplan for examples/gpt.py")
        body = [line for line in lines if not line.startswith("#")]
        assert body and all(not line.startswith(" ") or line.strip() for line in body)
        assert "effective batch 64" in text


# --------------------------------------------------------------------------- torch script


def _run_script(
    tmp_path: Path, plan: Plan, model_spec: str, *args: str
) -> subprocess.CompletedProcess:
    script = tmp_path / "train_memplan.py"
    script.write_text(emit_torch(plan, model_path=model_spec), encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _small_plan(**changes) -> Plan:
    base = replace(
        PLAN,
        target_batch=6,
        micro_batch_size=2,
        accumulation_steps=3,
        world_size=1,
        device="cpu",
        precision="fp32",
        checkpoint={"blocks.0": "full", "blocks.1": "full"},
    )
    layers = changes.pop("checkpoint_layers", None)
    if layers is not None:
        base = base.with_checkpoint_layers(layers)
    return replace(base, **changes)


@pytest.mark.slow  # runs the emitted script: a training run, not in the quick loop
def test_torch_script_runs_exactly_the_requested_steps(tmp_path: Path) -> None:
    plan = _small_plan()
    result = _run_script(
        tmp_path, plan, str(MODELS / "tiny_emit_mlp.py"), "--steps", "2", "--device", "cpu"
    )
    assert result.returncode == 0, result.stderr
    steps = STEP_LINE.findall(result.stdout)
    assert [int(s[0]) for s in steps] == [1, 2]
    assert all(int(s[2]) == plan.target_batch for s in steps)
    assert all(float(s[1]) == float(s[1]) for s in steps)  # finite-ish: not NaN


@pytest.mark.slow  # runs the emitted script: a training run, not in the quick loop
def test_torch_script_factory_dict_batch_training_loss(tmp_path: Path) -> None:
    # path:factory, relative model path beside the script, bf16 autocast on CPU
    (tmp_path / "tiny_emit_mlp.py").write_text((MODELS / "tiny_emit_mlp.py").read_text())
    plan = _small_plan(precision="bf16", checkpoint_layers=("blocks.2",))
    result = _run_script(tmp_path, plan, "tiny_emit_mlp.py:build_wide", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert [int(s[0]) for s in STEP_LINE.findall(result.stdout)] == [1, 2, 3]

    # a dict batch, training_loss and make_optimizer from the model file
    plan = _small_plan(checkpoint_layers=("0",), accumulation_steps=1, target_batch=2)
    result = _run_script(
        tmp_path, plan, str(MODELS / "tiny_emit_dict.py"), "--steps", "2", "--device", "cpu"
    )
    assert result.returncode == 0, result.stderr
    assert "make_optimizer called" in result.stdout
    steps = STEP_LINE.findall(result.stdout)
    assert [(int(s[0]), int(s[2])) for s in steps] == [(1, 2), (2, 2)]


def test_torch_script_is_valid_python_with_odd_paths() -> None:
    for model_path in ('dir with "quotes"/m.py', "C:\\models\\m.py:factory", "m.py"):
        text = emit_torch(PLAN, model_path=model_path)
        compile(text, "train_memplan.py", "exec")
        line = next(line for line in text.splitlines() if line.startswith("MODEL = "))
        assert ast.literal_eval(line.removeprefix("MODEL = ")) == model_path


@pytest.mark.slow  # runs the emitted script: a training run, not in the quick loop
def test_torch_script_names_training_loss_when_the_output_is_not_a_loss(tmp_path: Path) -> None:
    (tmp_path / "bad_model.py").write_text(
        "import torch\n"
        "def build_model(): return torch.nn.Linear(4, 2)\n"
        "def make_batch(n): return torch.randn(n, 4)\n"
    )
    plan = _small_plan(checkpoint_layers=())
    result = _run_script(tmp_path, plan, "bad_model.py", "--steps", "1", "--device", "cpu")
    assert result.returncode == 1
    assert "not a scalar loss" in result.stderr
    assert "Define training_loss(model, batch)" in result.stderr
    assert not STEP_LINE.findall(result.stdout)
