"""The config emitters (``memplan solve --format``) against a hostile-user sweep: a float8
plan is trained in float8 by the scripts (``convert_for_plan``, as verify's ranks) and refused
by the formats with no float8 setting; Megatron-LM and torchtitan train the plan's precision;
a ``--format`` file's path refusals name ``--out-dir``; the hf config's DeepSpeed path loads
from the folder ``memplan solve`` ran in; an empty ``--format`` list is refused. Each test
loads the output with its consumer where one is installed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import yaml
from profiles_factory import uniform_chain
from shell_snippets import shell_words
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import FORMATS, emit, emit_all, emit_torch, emit_torchrun
from memplan.emit.files import plan_targets
from memplan.errors import BadInputError
from memplan.parallel import Parallel
from memplan.plan import Breakdown, ModelFingerprint, Plan, Prediction
from memplan.profile import Float8, profile_to_yaml

MODELS = Path(__file__).resolve().parent / "models"
FLOAT8_MODEL = MODELS / "float8_block.py"
ZERO = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)
F8 = Float8(recipe="tensorwise", fsdp_float8_all_gather=True, converted=6)
NO_GATHER = dataclasses.replace(F8, fsdp_float8_all_gather=False)
CONFIG_ONLY = ("hf", "deepspeed", "accelerate", "lightning")
"""The formats with no float8 setting memplan writes."""
runner = CliRunner()


def _plan(
    *,
    world: int = 1,
    strategy: str = "ddp",
    precision: str = "bf16",
    float8: Float8 | None = None,
    parallel: Parallel | None = None,
    micro: int = 2,
    steps: int = 1,
    model: str = "m.py",
    device: str = "cpu",
) -> Plan:
    dp = parallel.dp if parallel is not None else world
    return Plan(
        target_batch=micro * steps * dp,
        micro_batch_size=micro,
        accumulation_steps=steps,
        world_size=world,
        strategy=strategy,
        checkpoint={"layers.0": "full"},
        precision=precision,
        device=device,
        budget_bytes=1 << 30,
        predicted=Prediction(peak_bytes=1 << 20, step_seconds=0.01, breakdown=ZERO),
        model=model,
        model_fingerprint=ModelFingerprint(
            parameter_bytes=1 << 20, candidate_layers=("layers.0", "layers.1")
        ),
        parallel=parallel,
        float8=float8,
    )


def _float8_profile_file(tmp_path: Path) -> Path:
    profile = uniform_chain(2).profile()
    env = dataclasses.replace(
        profile.environment,
        precision="bf16",
        mixed_precision="params",
        param_dtype="bfloat16",
        float8=F8,
    )
    path = tmp_path / "f8.profile.yaml"
    path.write_text(profile_to_yaml(dataclasses.replace(profile, environment=env)))
    return path


def _said(result) -> str:
    return " ".join(result.output.split())


# ---------------------------------------------------------------- 1. float8 plans


def test_formats_without_float8_refuse_a_float8_plan_and_the_others_write_it() -> None:
    plan = _plan(world=2, strategy="fsdp", float8=F8)
    emitted = emit_all(plan, list(FORMATS))
    assert [fmt for fmt, _ in emitted.refused] == list(CONFIG_ONLY)
    assert [fmt for fmt, _, _ in emitted.files] == [f for f in FORMATS if f not in CONFIG_ONLY]
    for fmt, exc in emitted.refused:
        said = f"{exc.message} {exc.hint}"
        assert said.startswith(f"--format {fmt} cannot write a float8 plan")
        assert "6 linears" in said and "tensorwise" in said
        assert "--format torch, torchrun, torchtitan, torchtitan-toml, megatron" in said
        assert "memplan.integrations.accelerate.prepare_model(model, plan)" in said
        assert ("mixed_precision='fp8'" in said) is (fmt == "accelerate")
    # the same plan without float8: every format writes it
    gpu = dataclasses.replace(plan, float8=None, device="h100-80gb")  # Lightning: FSDP on GPUs
    assert emit_all(gpu, list(FORMATS)).refused == []


def test_a_zero2_float8_plan_is_told_which_strategy_the_float8_formats_write() -> None:
    plan = _plan(world=2, strategy="zero2", float8=F8)
    with pytest.raises(BadInputError) as caught:
        emit(plan, "deepspeed")
    assert "no --format of a zero2 plan" in caught.value.hint
    assert "--strategy fsdp or ddp" in caught.value.hint


def test_solve_writes_the_float8_formats_and_refuses_the_others_exit_2(tmp_path: Path) -> None:
    profile = _float8_profile_file(tmp_path)
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            *("solve", str(profile), "--target-batch", "8", "--budget", "8GiB"),
            *("--world-size", "2", "--strategy", "fsdp", "--out-dir", str(out)),
            *("--format", "plan,hf,deepspeed,accelerate,lightning,torch,torchrun,megatron"),
        ],
    )
    assert result.exit_code == 2, result.output
    said = _said(result)
    for fmt in CONFIG_ONLY:
        assert f"--format {fmt} cannot write a float8 plan" in said
    assert sorted(p.name for p in out.iterdir()) == [
        "megatron_args.sh",
        "plan.yaml",
        "train_memplan.py",
        "train_torchrun.py",
    ]
    plan_text = (out / "plan.yaml").read_text()
    for script in ("train_memplan.py", "train_torchrun.py"):
        code = (out / script).read_text().replace(plan_text, "")  # the code, not the plan
        assert "convert_for_plan(net, plan, device, reference=world == 1)" in code
        assert "6 linears as torchao's Float8Linear (tensorwise scaling)" in code


def test_scripts_convert_before_checkpointing_the_optimizer_and_sharding() -> None:
    text = emit_torch(_plan(float8=F8), model_path="m.py")
    order = [
        text.index(line)
        for line in (
            "net = model_file.build_model()",
            "convert_for_plan(net, plan, device",
            "memplan.apply(net, plan)",
            "compile_layers(net, plan)",
            "model, optimizer = wrap_for_plan(",
            "model, optimizer = net, make_optimizer(net)",
        )
    ]
    assert order == sorted(order)


@pytest.mark.parametrize("fmt", ["torch", "torchrun"])
def test_scripts_refuse_a_float8_plan_with_a_layout(fmt: str) -> None:
    layout = Parallel(dp_shard=2, tp=2)
    plan = _plan(world=4, strategy="fsdp", float8=F8, parallel=layout)
    with pytest.raises(BadInputError) as caught:
        emit(plan, fmt)
    assert "cannot run a float8 plan with dp 2 × tp 2" in caught.value.message
    assert "--format torchtitan or megatron" in caught.value.hint
    assert emit(dataclasses.replace(plan, float8=None), fmt)[0] == FORMATS[fmt].filename


def _linear_kinds(model) -> dict[str, str]:
    import torch

    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def test_torch_script_trains_the_float8_plans_linears_as_float8(tmp_path, monkeypatch, capsys):
    """The emitted script run in this process for one step: the model the Accumulator trains
    has the probe's 6 converted linears as Float8Linear (the 64x4 gates and the head left as
    torchtitan's filter leaves them); before, all 9 were nn.Linear."""
    pytest.importorskip("torchao.float8", reason="the 'float8' extra (torchao) is not installed")
    import runpy

    import memplan

    seen: list[dict[str, str]] = []
    accumulator = memplan.Accumulator

    class Spy(accumulator):
        def __init__(self, model, *args, **kwargs):
            seen.append(_linear_kinds(model))
            super().__init__(model, *args, **kwargs)

    monkeypatch.setattr(memplan, "Accumulator", Spy)
    plan = _plan(strategy="fsdp", world=1, float8=F8, model=str(FLOAT8_MODEL))
    script = tmp_path / "train_memplan.py"
    script.write_text(emit_torch(plan, model_path=str(FLOAT8_MODEL)))
    namespace = runpy.run_path(str(script), run_name="emitted")
    assert namespace["main"](["--steps", "1", "--device", "cpu"]) == 0
    assert "memplan-step step=1" in capsys.readouterr().out
    kinds = seen[0]
    float8 = sorted(name for name, kind in kinds.items() if kind == "Float8Linear")
    assert float8 == [f"layers.{i}.{w}" for i in (0, 1) for w in ("w1", "w2", "wq")]
    assert {kinds[n] for n in ("layers.0.gate", "layers.1.gate", "output")} == {"Linear"}


WRAPPED_MODEL = """
import collections, os, sys
sys.path.insert(0, {models!r})
import float8_block
from float8_block import build_model, make_batch

_said = []


def training_loss(model, batch):
    if not _said:
        _said.append(1)
        kinds = collections.Counter(
            type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__
        )
        rank = os.environ.get("RANK")
        # one file per rank: two ranks' lines on one shared stdout can interleave
        with open(f"linears-{{rank}}.txt", "w") as out:
            out.write(f"LINEARS {{rank}} {{sorted(kinds.items())}}")
    return float8_block.training_loss(model, batch)
"""


def _torchrun(tmp_path: Path, plan: Plan) -> subprocess.CompletedProcess:
    pytest.importorskip("torchao.float8", reason="the 'float8' extra (torchao) is not installed")
    model = tmp_path / "wrapped.py"
    model.write_text(textwrap.dedent(WRAPPED_MODEL.format(models=str(MODELS))))
    script = tmp_path / "train_torchrun.py"
    script.write_text(emit_torchrun(plan, model_path=str(model)))
    return subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc_per_node", "2", str(script), "--steps", "1", "--device", "cpu"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow  # two gloo ranks under torchrun
def test_torchrun_script_trains_float8_linears_on_every_rank(tmp_path: Path) -> None:
    plan = _plan(world=2, strategy="ddp", float8=NO_GATHER)
    result = _torchrun(tmp_path, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [(tmp_path / f"linears-{rank}.txt").read_text() for rank in (0, 1)]
    assert lines == [f"LINEARS {rank} [('Float8Linear', 6), ('Linear', 3)]" for rank in (0, 1)]


@pytest.mark.slow  # two gloo ranks under torchrun
def test_torchrun_script_refuses_float8_all_gather_on_gloo_as_verify_does(tmp_path: Path):
    result = _torchrun(tmp_path, _plan(world=2, strategy="fsdp", float8=F8))
    assert result.returncode != 0
    assert "gloo, the CPU backend, has no float8 dtype" in result.stderr
    assert not list(tmp_path.glob("linears-*.txt"))  # refused before any step


# ---------------------------------------------------------------- 2. precision


@pytest.mark.parametrize(
    ("precision", "flags"), [("bf16", ["--bf16"]), ("fp16", ["--fp16"]), ("fp32", [])]
)
def test_megatron_args_carry_the_plans_precision(precision, flags, tmp_path: Path) -> None:
    plan = _plan(world=2, precision=precision)
    args = shell_words(emit(plan, "megatron")[1], "MEMPLAN_ARGS", tmp_path)
    assert [a for a in args if a in ("--bf16", "--fp16")] == flags
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:
        return  # the megatron-core wheel has no megatron.training (make megatron-check)
    import argparse

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns, _ = parser.parse_known_args(args)
    assert (ns.bf16, ns.fp16) == (precision == "bf16", precision == "fp16")


@pytest.fixture(scope="module")
def config_manager():
    try:
        from torchtitan.config import ConfigManager

        __import__("torchtitan.models.llama3.config_registry")
    except ImportError as exc:
        pytest.skip(f"torchtitan's Llama 3 configs are not importable here: {exc}")
    return ConfigManager


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "bfloat16")]
)
def test_torchtitan_trains_the_plans_parameter_dtype(config_manager, precision, dtype, tmp_path):
    plan = _plan(world=2, strategy="fsdp", precision=precision)
    text = emit(plan, "torchtitan")[1]
    config = config_manager().parse_args(shell_words(text, "TORCHTITAN_ARGS", tmp_path))
    assert config.training.mixed_precision_param == dtype
    assert ("torchtitan has no float16" in text) is (precision == "fp16")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_torchtitan_toml_sets_float32_for_an_fp32_plan(precision: str) -> None:
    text = emit(_plan(world=2, strategy="fsdp", precision=precision), "torchtitan-toml")[1]
    training = tomllib.loads(text)["training"]
    expected = "float32" if precision == "fp32" else None  # the releases' default: bfloat16
    assert training.get("mixed_precision_param") == expected
    assert ("torchtitan has no float16" in text) is (precision == "fp16")


# ---------------------------------------------------------------- 3. output paths


def _solve(profile: Path, *args: str):
    return runner.invoke(
        app, ["solve", str(profile), "--target-batch", "8", "--budget", "8GiB", *args]
    )


def test_refusals_of_a_format_file_name_out_dir_not_o(tmp_path: Path) -> None:
    profile = tmp_path / "chain.profile.yaml"
    profile.write_text(profile_to_yaml(uniform_chain(2).profile()))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "hf_training_args.yaml").write_text("mine\n")
    result = _solve(profile, "--format", "hf", "--out-dir", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    said = _said(result)
    assert "hf_training_args.yaml already exists" in said
    assert "Pass --force to replace it, or choose another path with --out-dir." in said
    assert "with -o" not in said
    (tmp_path / "afile").write_text("")
    result = _solve(profile, "--format", "hf", "--out-dir", str(tmp_path / "afile"))
    assert result.exit_code == 2, result.output
    said = _said(result)
    assert "afile is not a directory. Choose another path with --out-dir." in said
    assert "with -o" not in said
    # the plan YAML's own path is still -o's
    (tmp_path / "plan.yaml").write_text("mine\n")
    result = _solve(profile, "-o", str(tmp_path / "plan.yaml"), "--format", "hf")
    assert "choose another path with -o" in _said(result)


# ---------------------------------------------------------------- 4. hf + DeepSpeed


LOAD_HF = """
import sys, warnings
warnings.filterwarnings("ignore")
from memplan.model.loader import settle_torchvision
settle_torchvision()
import transformers
(args,) = transformers.HfArgumentParser((transformers.TrainingArguments,)).parse_yaml_file(
    sys.argv[1]
)
print("DEEPSPEED", args.deepspeed, args.hf_deepspeed_config.config["zero_optimization"]["stage"])
"""


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_hf_config_names_the_deepspeed_file_from_where_solve_ran(
    strategy, tmp_path: Path, monkeypatch
) -> None:
    """TrainingArguments opens ``deepspeed:`` against the working directory: written as a
    path from the folder solve ran in, the YAML loads from there (the project's folder),
    where before ``ds_config.json`` alone was refused by TrainingArguments."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    profile = tmp_path / "chain.profile.yaml"
    profile.write_text(profile_to_yaml(uniform_chain(2).profile()))
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(
        app,
        [
            *("solve", "chain.profile.yaml", "--target-batch", "8", "--budget", "8GiB"),
            *("--world-size", "2", "--strategy", strategy),
            *("--format", "hf,deepspeed", "--out-dir", "configs"),
        ],
    )
    assert result.exit_code == 0, result.output
    text = (tmp_path / "configs" / "hf_training_args.yaml").read_text()
    assert yaml.safe_load(text)["deepspeed"] == "configs/ds_config.json"
    assert "run training from that folder" in " ".join(text.split())
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_HF, "configs/hf_training_args.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert f"DEEPSPEED configs/ds_config.json {strategy[-1]}" in loaded.stdout


def test_hf_emitted_alone_keeps_the_bare_deepspeed_name() -> None:
    plan = _plan(world=2, strategy="zero1")
    assert yaml.safe_load(emit(plan, "hf")[1])["deepspeed"] == "ds_config.json"
    written = emit_all(plan, ["hf"], folder=Path("a b") / "c").files[0][2]
    assert yaml.safe_load(written)["deepspeed"] == "a b/c/ds_config.json"


# ---------------------------------------------------------------- 5. empty --format


@pytest.mark.parametrize("spelled", [" , ", "", ",", "  "])
def test_an_empty_format_list_is_refused(spelled: str, tmp_path: Path) -> None:
    with pytest.raises(BadInputError) as caught:
        plan_targets(None, spelled, None, force=False)
    assert caught.value.message.startswith(f"--format {spelled!r} names no format")
    assert ", ".join(FORMATS) in caught.value.hint
    profile = tmp_path / "chain.profile.yaml"
    profile.write_text(profile_to_yaml(uniform_chain(2).profile()))
    result = _solve(profile, "-o", str(tmp_path / "plan.yaml"), "--format", spelled)
    assert result.exit_code == 2, result.output
    assert "names no format" in _said(result)
    assert not (tmp_path / "plan.yaml").exists()  # refused before anything is written
