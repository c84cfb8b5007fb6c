"""A plan timed compiled (``probe --compiled``) trains compiled in every output that can say
so: the scripts compile the plan's layers (memplan.run.compile_layers) and train to the
eager run's losses; Accelerate's config is read by ``accelerate launch`` into its dynamo
settings; the Lightning config says how; DeepSpeed's JSON, which takes no comments, has
its note printed by ``memplan solve``. An eager plan compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import emit, emit_all, emit_torch
from memplan.emit.script import STEP_LINE
from memplan.errors import BadInputError
from memplan.plan import Breakdown, ModelFingerprint, Plan, Prediction
from memplan.run.compile import compile_layers

ROOT = Path(__file__).resolve().parents[1]

PLAN = Plan(
    target_batch=6,
    micro_batch_size=2,
    accumulation_steps=3,
    checkpoint={"blocks.0": "full"},
    precision="fp32",
    device="cpu",
    budget_bytes=2**30,
    predicted=Prediction(
        peak_bytes=2**20,
        step_seconds=0.01,
        breakdown=Breakdown(params=1, grads=1, optimizer=1, activations=1, transient=1, reserve=0),
    ),
    model="model.py",
    model_fingerprint=ModelFingerprint(
        parameter_bytes=1, candidate_layers=("blocks.0", "blocks.1")
    ),
    compiled=True,
)
EAGER = replace(PLAN, compiled=False)

MODEL_FILE = '''\
"""No dropout: inductor's RNG is not eager's, and the losses are compared."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(2)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size)
'''


def _net() -> torch.nn.Module:
    namespace: dict = {}
    exec(compile(MODEL_FILE, "model.py", "exec"), namespace)  # the test's own model text
    return namespace["Net"]()


def test_compile_layers_compiles_exactly_the_plans_layers():
    net = _net()
    assert compile_layers(net, EAGER) == []
    assert all(m._compiled_call_impl is None for m in net.modules())
    assert compile_layers(net, PLAN) == ["blocks.0", "blocks.1"]
    compiled = {name for name, m in net.named_modules() if m._compiled_call_impl is not None}
    assert compiled == {"blocks.0", "blocks.1"}
    assert list(net.state_dict()) == list(_net().state_dict())  # names unchanged


def test_compile_layers_without_a_fingerprint_compiles_the_model():
    net = _net()
    assert compile_layers(net, replace(PLAN, model_fingerprint=None)) == [""]
    assert net._compiled_call_impl is not None
    assert all(m._compiled_call_impl is None for m in net.modules() if m is not net)


def test_compile_layers_refuses_a_plan_for_another_model():
    other = ModelFingerprint(parameter_bytes=1, candidate_layers=("layers.0",))
    with pytest.raises(BadInputError, match=r"'layers\.0' is not a module of this model"):
        compile_layers(_net(), replace(PLAN, model_fingerprint=other))


def _train(tmp_path: Path, plan: Plan, name: str) -> tuple[list[float], list[Path]]:
    (tmp_path / "model.py").write_text(MODEL_FILE, encoding="utf-8")
    script = tmp_path / f"{name}.py"
    script.write_text(emit_torch(plan, model_path="model.py"), encoding="utf-8")
    cache = tmp_path / f"inductor-{name}"
    result = subprocess.run(
        [sys.executable, str(script), "--steps", "2", "--device", "cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(loss) for _, loss, _, _ in STEP_LINE.findall(result.stdout)]
    return losses, sorted(cache.rglob("*.py")) if cache.exists() else []


@pytest.mark.slow  # two training runs, one compiled by inductor (g++ on the CPU)
def test_the_script_of_a_compiled_plan_trains_compiled_to_the_eager_losses(tmp_path):
    eager, eager_kernels = _train(tmp_path, EAGER, "eager")
    compiled, kernels = _train(tmp_path, PLAN, "compiled")
    assert eager_kernels == [] and kernels  # inductor generated code for the compiled run only
    assert len(eager) == len(compiled) == 2
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_accelerate_launch_reads_the_compiled_plans_dynamo_settings(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    env = {}
    for plan in (PLAN, EAGER):
        path = tmp_path / f"{plan.compiled}.yaml"
        path.write_text(emit(plan, "accelerate", "model.py")[1], encoding="utf-8")
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        _validate_launch_command(args)
        _, env[plan.compiled] = prepare_simple_launcher_cmd_env(args)
    assert env[True]["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"
    assert env[True]["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"
    assert env[False]["ACCELERATE_DYNAMO_BACKEND"] == "NO"


def test_the_in_script_accelerator_of_a_compiled_plan_compiles():
    accelerate = pytest.importorskip("accelerate")
    from memplan.integrations.accelerate import accelerator_kwargs

    assert accelerator_kwargs(PLAN)["dynamo_backend"] == "inductor"
    assert "dynamo_backend" not in accelerator_kwargs(EAGER)
    from accelerate.state import AcceleratorState, GradientState

    try:
        acc = accelerate.Accelerator(**accelerator_kwargs(PLAN), cpu=True)
        assert acc.state.dynamo_plugin.backend == accelerate.utils.DynamoBackend.INDUCTOR
    finally:  # Accelerate's state is a process-wide singleton: a later test's must not compile
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_lightning_and_deepspeed_say_how_to_compile():
    lightning = emit(PLAN, "lightning", "model.py")[1]
    assert "    model = torch.compile(model)" in lightning
    assert yaml.safe_load(lightning) == yaml.safe_load(emit(EAGER, "lightning", "model.py")[1])
    assert "torch.compile" not in emit(EAGER, "lightning", "model.py")[1]
    notes = emit_all(PLAN, ["deepspeed", "hf"]).notes
    assert [fmt for fmt, _ in notes] == ["deepspeed", "deepspeed"]
    assert "memplan.apply" in notes[0][1] and "model_engine.compile()" in notes[1][1]
    assert emit_all(replace(EAGER, checkpoint={}), ["deepspeed"]).notes == []
    json.loads(emit(PLAN, "deepspeed")[1])  # still plain JSON


def test_memplan_solve_prints_the_deepspeed_note(tmp_path):
    probe = CliRunner().invoke(
        app,
        [
            "probe",
            "examples/gpt.py",
            "--device",
            "meta",
            "--compiled",
            "-o",
            str(tmp_path / "p.yaml"),
            "--micro-batches",
            "1,2",
        ],
    )
    assert probe.exit_code == 0, probe.output
    result = CliRunner().invoke(
        app,
        [
            "solve",
            str(tmp_path / "p.yaml"),
            "--target-batch",
            "4",
            "--budget",
            "80GiB",
            "--device-profile",
            "h100-80gb",
            "--format",
            "deepspeed",
            "--out-dir",
            str(tmp_path),
        ],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 0, result.output
    folded = " ".join(result.output.split())
    assert f"{tmp_path / 'ds_config.json'}: the step was timed as torch.compile runs it" in folded
