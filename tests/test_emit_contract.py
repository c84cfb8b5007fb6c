"""The emitters' capability contract: each format declares the plan strategies it writes
(``Format.strategies``, from its module's ``STRATEGIES``); for those, the strategy is in
the text; for any other, ``emit`` refuses (exit 2) naming the formats that can. One test
over every format and strategy, so a new format or strategy cannot slip through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
import yaml
from profiles_factory import uniform_chain
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import FORMATS, emit, emit_all
from memplan.errors import BadInputError
from memplan.plan import STRATEGIES, Breakdown, Plan, Prediction
from memplan.profile import profile_to_yaml


def strategy_plan(strategy: str) -> Plan:
    sharded = strategy == "fsdp"
    return Plan(
        target_batch=32,
        micro_batch_size=4,
        accumulation_steps=4,
        world_size=2,
        strategy=strategy,
        shard_units=("h.0", "h.1") if sharded else (),
        shard_unit_types=("Block",) if sharded else (),
        budget_bytes=1 << 30,
        model="m.py",
        device="h100-80gb",  # Lightning runs FSDP on GPUs only
        predicted=Prediction(
            peak_bytes=1 << 29,
            step_seconds=1.0,
            breakdown=Breakdown(
                params=1, grads=1, optimizer=1, activations=1, transient=1, reserve=0
            ),
        ),
    )


EXPECTED = {  # what each format must say for each strategy it claims
    "hf": {
        "ddp": lambda d: "deepspeed" not in d and "fsdp" not in d,
        "zero1": lambda d: d["deepspeed"] == "ds_config.json",
        "zero2": lambda d: d["deepspeed"] == "ds_config.json",
        "fsdp": lambda d: (
            d["fsdp"] == "full_shard auto_wrap"
            and d["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["Block"]
        ),
    },
    "deepspeed": {
        s: lambda d, stage=stage: d["zero_optimization"]["stage"] == stage
        for s, stage in {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}.items()
    },
    "accelerate": {
        "ddp": lambda d: d["distributed_type"] in ("MULTI_GPU", "MULTI_CPU"),
        "zero1": lambda d: (
            d["distributed_type"] == "DEEPSPEED" and d["deepspeed_config"]["zero_stage"] == 1
        ),
        "zero2": lambda d: (
            d["distributed_type"] == "DEEPSPEED" and d["deepspeed_config"]["zero_stage"] == 2
        ),
        "fsdp": lambda d: d["distributed_type"] == "FSDP",
    },
    "lightning": {
        **{
            s: lambda d, name=name: d["trainer"]["strategy"] == name
            for s, name in {
                "ddp": "ddp",
                "zero1": "deepspeed_stage_1",
                "zero2": "deepspeed_stage_2",
            }.items()
        },
        # FSDPStrategy with the plan's units (a bare "fsdp" wraps the root alone)
        "fsdp": lambda d: (
            d["trainer"]["strategy"]
            == {
                "class_path": "lightning.pytorch.strategies.FSDPStrategy",
                "init_args": {
                    "auto_wrap_policy": {
                        "class_path": "memplan.wrap.PlanUnits",
                        "init_args": {"class_names": ["Block"]},
                    }
                },
            }
        ),
    },
    "plan": {s: lambda d, s=s: d["strategy"] == s for s in STRATEGIES},
    "torch": {s: lambda text, s=s: f"strategy: {s}" in text for s in ("ddp", "zero1", "fsdp")},
    "torchrun": {s: lambda text, s=s: f"strategy: {s}" in text for s in ("ddp", "zero1", "fsdp")},
    # A data-parallel plan (world 2): torchtitan replicates (DDP) or shards (FSDP2); it has
    # no optimizer-only sharding, so it refuses ZeRO-1.
    "torchtitan": {
        "ddp": lambda text: (
            "--parallelism.data_parallel_replicate_degree 2 " in text
            and "--parallelism.data_parallel_shard_degree 1 " in text
        ),
        "fsdp": lambda text: (
            "--parallelism.data_parallel_shard_degree 2 " in text
            and "--parallelism.data_parallel_replicate_degree 1 " in text
        ),
    },
    "torchtitan-toml": {
        "ddp": lambda d: d["parallelism"]["data_parallel_replicate_degree"] == 2,
        "fsdp": lambda d: d["parallelism"]["data_parallel_shard_degree"] == 2,
    },
    "megatron": {
        "ddp": lambda text: "--use-distributed-optimizer" not in text and "fsdp" not in text,
        "zero1": lambda text: "--use-distributed-optimizer" in text,
        "fsdp": lambda text: "--use-torch-fsdp2" in text,
    },
}


def _parse(fmt: str, text: str):
    if fmt == "deepspeed":
        return json.loads(text)
    if fmt in ("torch", "torchrun", "megatron", "torchtitan"):
        return text
    if fmt == "torchtitan-toml":
        return tomllib.loads(text)
    return yaml.safe_load(text)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_format_writes_or_refuses_every_strategy(fmt: str, strategy: str) -> None:
    plan = strategy_plan(strategy)
    spec = FORMATS[fmt]
    assert set(EXPECTED[fmt]) == set(spec.strategies), "claims and checks differ"
    if strategy in spec.strategies:
        _, text = emit(plan, fmt, "m.py")
        assert EXPECTED[fmt][strategy](_parse(fmt, text)), text
    else:
        with pytest.raises(BadInputError) as err:
            emit(plan, fmt, "m.py")
        able = [f for f, s in FORMATS.items() if strategy in s.strategies]
        assert err.value.exit_code == 2
        assert f"cannot write a {strategy} plan" in err.value.message
        assert ", ".join(able) in err.value.hint


def test_one_refusal_does_not_stop_the_other_formats(tmp_path: Path) -> None:
    emitted = emit_all(
        strategy_plan("zero2"),
        ["hf", "deepspeed", "accelerate", "lightning", "torch", "torchrun"],
        "m.py",
    )
    assert [f for f, _, _ in emitted.files] == ["hf", "deepspeed", "accelerate", "lightning"]
    assert [f for f, _ in emitted.refused] == ["torch", "torchrun"]  # ZeRO-2 needs DeepSpeed
    profile = tmp_path / "chain.profile.yaml"
    profile.write_text(profile_to_yaml(uniform_chain(2).profile()))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            *("solve", str(profile), "--target-batch", "64", "--budget", "8GiB"),
            *("--world-size", "8", "--strategy", "zero2", "-o", str(out / "plan.yaml")),
            *("--format", "hf,deepspeed,accelerate,lightning,torch,torchrun"),
        ],
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--format torch cannot write a zero2 plan" in text
    assert "--format torchrun cannot write a zero2 plan" in text
    # a plan for the cpu (no --device-profile): Lightning runs DeepSpeed on CUDA GPUs only
    assert "--format lightning cannot write a zero2 plan for the cpu" in text
    written = sorted(p.name for p in out.iterdir())
    assert written == [
        "accelerate_config.yaml",
        "ds_config.json",
        "hf_training_args.yaml",
        "plan.yaml",
    ]
    hf_args = yaml.safe_load((out / "hf_training_args.yaml").read_text())
    # the DeepSpeed file's path as the command named its folder (here absolute, from -o)
    assert hf_args["deepspeed"] == (out / "ds_config.json").as_posix()
