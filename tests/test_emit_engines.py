"""The layout engines' outputs loaded by the engines' own parsers (issue 31): ``--format
torchtitan`` by torchtitan 0.3.0's ``ConfigManager`` (the one ``torchtitan.train`` runs), and
``--format megatron`` by Megatron-LM's ``add_megatron_arguments`` parser; the shell snippets
are read by bash, as a user's launch line reads them. Each part skips, saying why, where its
engine is not importable (torchtitan is in the dev extras; Megatron-LM's ``megatron.training``
is not in the megatron-core wheel: ``make megatron-check`` fetches it at the pinned
megatron-core's tag and fails, not skips, where it does not import)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from pathlib import Path

import pytest
from shell_snippets import shell_words

from memplan.emit import emit
from memplan.emit.torchtitan import CUDA_GRAPHS_NOTE, LLAMA3_CONFIGS, LOSS_NOTE, RELEASE
from memplan.parallel import Parallel
from memplan.plan import Breakdown, ModelFingerprint, Plan, Prediction, plan_to_yaml
from memplan.profile import Float8

BLOCKS = tuple(f"layers.{i}" for i in range(8))
ZERO = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)


def _plan(
    layout: Parallel,
    *,
    strategy: str = "fsdp",
    micro: int = 2,
    steps: int = 4,
    checkpoint: dict[str, str] | None = None,
    seq_len: int | None = None,
    blocks: tuple[str, ...] = BLOCKS,
    parameter_bytes: int = 1 << 20,
    float8: Float8 | None = None,
) -> Plan:
    return Plan(
        target_batch=micro * steps * layout.dp,
        micro_batch_size=micro,
        accumulation_steps=steps,
        world_size=layout.world_size,
        strategy=strategy,
        checkpoint=dict(checkpoint or {}),
        budget_bytes=1 << 40,
        predicted=Prediction(peak_bytes=1 << 30, step_seconds=1.0, breakdown=ZERO),
        model="m.py",
        model_fingerprint=ModelFingerprint(
            parameter_bytes=parameter_bytes, candidate_layers=blocks
        ),
        parallel=layout,
        seq_len=seq_len,
        float8=float8,
    )


# ---------------------------------------------------------------- torchtitan 0.3


@pytest.fixture(scope="module")
def titan():
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.distributed import activation_checkpoint as ac

        importlib.import_module("torchtitan.models.llama3.config_registry")
    except ImportError as exc:  # e.g. triton missing: its models import it
        pytest.skip(f"torchtitan's Llama 3 configs are not importable here: {exc}")
    import torchtitan

    version = getattr(torchtitan, "__version__", "")
    if version and not version.startswith(RELEASE.rsplit(".", 1)[0]):
        pytest.skip(f"torchtitan {version} installed; --format torchtitan writes for {RELEASE}")
    return ConfigManager, ac


def _titan_config(titan, plan: Plan, tmp_path: Path):
    config_manager, _ = titan
    _, text = emit(plan, "torchtitan", "m.py")
    args = shell_words(text, "TORCHTITAN_ARGS", tmp_path)
    assert args[:2] == ["--module", "llama3"], args
    return config_manager().parse_args(args), text


def _ac_class(titan, config):
    _, ac = titan
    value = config.activation_checkpoint
    if value is None:
        return None
    for cls in (ac.FullAC, ac.SelectiveAC, ac.MemoryBudgetAC):
        if type(value) is cls.Config:
            return cls
    raise AssertionError(type(value))


LAYOUT_CASES = [
    # (layout, strategy, checkpoint, seq_len, expected AC class name)
    (
        Parallel(dp_shard=2, tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2),
        "fsdp",
        dict.fromkeys(BLOCKS, "full"),
        4096,
        "FullAC",
    ),
    (Parallel(dp_replicate=4), "ddp", {}, None, None),
    (
        Parallel(dp_shard=2, tp=4, sequence_parallel=True, loss_parallel=True),
        "fsdp",
        dict.fromkeys(BLOCKS, "selective"),
        8192,
        "SelectiveAC",
    ),
    (
        Parallel(dp_replicate=2, dp_shard=2, pp=2, schedule="gpipe"),
        "fsdp",
        {"layers.0": "full", "layers.1": "selective"},
        1024,
        "FullAC",  # one policy for every block: the one that saves at least the plan's
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "strategy", "checkpoint", "seq_len", "ac_name"), LAYOUT_CASES)
def test_torchtitans_config_manager_loads_the_plans_numbers(
    titan, tmp_path, layout, strategy, checkpoint, seq_len, ac_name
):
    plan = _plan(layout, strategy=strategy, checkpoint=checkpoint, seq_len=seq_len)
    config, text = _titan_config(titan, plan, tmp_path)
    par, training = config.parallelism, config.training
    assert (
        par.data_parallel_replicate_degree,
        par.data_parallel_shard_degree,
        par.tensor_parallel_degree,
        par.pipeline_parallel_degree,
        par.context_parallel_degree,
    ) == (layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp, layout.cp)
    assert training.global_batch_size == plan.target_batch
    # gradients freed at zero_grad, as planned (CUDA graphs keep them: CUDA_GRAPHS_NOTE)
    assert training.disable_cuda_graphs is True
    if layout.pp > 1:  # one local batch a step, cut into the pipeline's micro-batches
        assert training.local_batch_size == plan.micro_batch_size * plan.accumulation_steps
        assert par.pipeline_parallel_microbatch_size == plan.micro_batch_size
        schedule = {"gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B"}[layout.schedule]
        assert par.pipeline_parallel_schedule == schedule
    else:  # the rest of the batch is torchtitan's gradient accumulation
        assert training.local_batch_size == plan.micro_batch_size
        accumulation = training.global_batch_size // (training.local_batch_size * layout.dp)
        assert accumulation == plan.accumulation_steps
    if layout.pp > 1:  # the plan's stages, not torchtitan's default split
        stages = [[f"layers.{i}" for i in r] for r in layout.stage_ranges(len(BLOCKS))]
        stages[0].insert(0, "tok_embeddings")
        stages[-1] += ["norm", "lm_head"]
        assert par.module_fqns_per_model_part == stages
        assert par.pipeline_parallel_layers_per_stage is None
    if layout.tp > 1:
        assert par.enable_sequence_parallel is layout.sequence_parallel
    assert training.seq_len == (seq_len if seq_len is not None else 2048)  # the config's own
    cls = _ac_class(titan, config)
    assert (cls.__name__ if cls else None) == ac_name
    # an 8-block toy is no torchtitan model: the comment says which config stands in
    assert "model: no torchtitan config is the planned model (8 blocks" in text
    assert "--config llama3_debugmodel " in text


@pytest.mark.slow
def test_a_plan_of_llama3_70b_names_its_config_and_torchtitan_builds_80_blocks(titan, tmp_path):
    blocks = tuple(f"layers.{i}" for i in range(80))
    plan = _plan(
        Parallel(dp_shard=4, tp=8, sequence_parallel=True, loss_parallel=True),
        micro=1,
        steps=2,
        checkpoint=dict.fromkeys(blocks, "full"),
        seq_len=8192,
        blocks=blocks,
        parameter_bytes=4 * 70_553_706_496,
    )
    config, text = _titan_config(titan, plan, tmp_path)
    assert "--config llama3_70b " in text and "as planned" in text
    assert len(config.model_spec.model.layers) == 80
    assert config.parallelism.tensor_parallel_degree == 8
    assert config.training.seq_len == 8192 and config.training.global_batch_size == 8
    assert _ac_class(titan, config).__name__ == "FullAC"


@pytest.mark.slow
def test_memplans_llama3_table_is_what_torchtitan_builds(titan):
    import torch
    from torchtitan.models.llama3 import model_registry

    flavors = {
        "llama3_debugmodel": "debugmodel",
        "llama3_8b": "8B",
        "llama3_70b": "70B",
        "llama3_405b": "405B",
    }
    for named in LLAMA3_CONFIGS:
        spec = model_registry(flavors[named.name])
        with torch.device("meta"):
            model = spec.model.build()
        parameters = sum(p.numel() for p in model.parameters())
        assert (len(spec.model.layers), parameters) == (named.blocks, named.parameters)


def test_the_loss_note_is_true_of_every_named_config(titan, monkeypatch):
    """What every ``--format torchtitan`` output says of the loss (``LOSS_NOTE``) holds for
    each config it can name: torchtitan's ConfigManager gives a ``ChunkedLossWrapper`` of 8
    chunks over a plain cross-entropy, and --compile.enable compiles the loss too; and a
    plan's snippet carries the note."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.quantization import float8 as titan_float8

    # llama3_405b() builds its float8 converter, which refuses a machine without sm89+
    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *a: True)
    config_manager, _ = titan
    for named in LLAMA3_CONFIGS:
        config = config_manager().parse_args(["--module", "llama3", "--config", named.name])
        assert isinstance(config.loss, ChunkedLossWrapper.Config), named.name
        assert config.loss.num_chunks == 8
        assert type(config.loss.loss_fn) is CrossEntropyLoss.Config
        assert "loss" in config.compile.components
    _, text = emit(_plan(Parallel(dp_shard=2, tp=2)), "torchtitan", "m.py")
    assert f"# {LOSS_NOTE}\n" in text


def test_torchtitan_keeps_gradients_between_steps_unless_cuda_graphs_are_off(titan):
    """What ``CUDA_GRAPHS_NOTE`` says, read from the installed release: CUDA graphs are on
    by default, and the trainer frees gradients at zero_grad only with them off; every
    output turns them off (the 0.3.0 trainer's own line, not memplan's reading of it)."""
    import inspect

    from torchtitan.trainer import Trainer

    config_manager, _ = titan
    default = config_manager().parse_args(["--module", "llama3", "--config", "llama3_8b"])
    assert default.training.disable_cuda_graphs is False
    source = inspect.getsource(Trainer.train_step)
    assert "zero_grad(set_to_none=self.config.training.disable_cuda_graphs)" in source
    _, text = emit(_plan(Parallel(dp_shard=2, tp=2)), "torchtitan", "m.py")
    assert "--training.disable_cuda_graphs" in text and f"# {CUDA_GRAPHS_NOTE}\n" in text


def test_a_compiled_plan_compiles_under_torchtitan_and_an_eager_one_says_so(titan, tmp_path):
    """A plan timed as compiled (``probe --compiled``) runs compiled: torchtitan's
    ConfigManager reads ``compile.enable`` (model and loss, 0.3's default components); an
    eager plan leaves it off and says that torchtitan compiled would run faster."""
    import dataclasses

    eager = _plan(Parallel(dp_shard=2))
    compiled = dataclasses.replace(eager, compiled=True)
    config, text = _titan_config(titan, compiled, tmp_path)
    assert config.compile.enable is True and config.compile.components == ["model", "loss"]
    assert "faster than planned" not in text
    assert "compiled: true" in plan_to_yaml(compiled)
    assert "compiled" not in plan_to_yaml(eager)  # the default: plans read as before
    config, text = _titan_config(titan, eager, tmp_path)
    assert config.compile.enable is False
    assert "runs faster than planned: probe with --device meta --compiled" in text


def test_torchtitan_snippet_without_torchtitan(tmp_path):
    """The snippet's words, checked without torchtitan: every flag once, the AC subcommand
    last, the plan's seq_len carried."""
    layout = Parallel(dp_shard=2, tp=2, pp=2)
    plan = _plan(layout, checkpoint=dict.fromkeys(BLOCKS, "full"), seq_len=2048 + 1)
    args = shell_words(emit(plan, "torchtitan", "m.py")[1], "TORCHTITAN_ARGS", tmp_path)
    flags = [a for a in args if a.startswith("--")]
    assert len(flags) == len(set(flags))
    assert args[-1] == "activation_checkpoint:full"
    assert args[args.index("--training.seq_len") + 1] == "2049"
    assert args[args.index("--parallelism.tensor_parallel_degree") + 1] == "2"
    assert "--parallelism.no_enable_sequence_parallel" in args  # the plan has no SP


# ---------------------------------------------------------------- Megatron-LM


@pytest.fixture(scope="module")
def megatron_parser():
    try:
        arguments = importlib.import_module("megatron.training.arguments")
    except ImportError as exc:
        why = (
            "Megatron-LM's argument parser (megatron.training.arguments) is not importable: "
            "the megatron-core wheel ships megatron/core only; `make megatron-check` fetches "
            f"Megatron-LM's source at the pinned megatron-core's tag and runs this ({exc})"
        )
        if os.environ.get("MEMPLAN_REQUIRE_MEGATRON"):
            pytest.fail(why)
        pytest.skip(why)
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


MEGATRON_CASES = [
    (Parallel(dp_replicate=2, tp=2, pp=2, sequence_parallel=True), "zero1", 4096),
    (Parallel(dp_shard=2, tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2), "fsdp", None),
    (Parallel(dp_replicate=4, cp=2), "ddp", 8192),
]


@pytest.mark.parametrize(("layout", "strategy", "seq_len"), MEGATRON_CASES)
def test_megatrons_parser_reads_the_plans_numbers(
    megatron_parser, tmp_path, layout, strategy, seq_len
):
    checkpoint = {"layers.0": "full", "layers.1": "full", "layers.4": "full"}
    plan = _plan(layout, strategy=strategy, checkpoint=checkpoint, seq_len=seq_len)
    args = shell_words(emit(plan, "megatron", "m.py")[1], "MEMPLAN_ARGS", tmp_path)
    ns = megatron_parser.parse_args(args)
    assert (
        ns.tensor_model_parallel_size,
        ns.pipeline_model_parallel_size,
        ns.context_parallel_size,
    ) == (layout.tp, layout.pp, layout.cp)
    assert (ns.micro_batch_size, ns.global_batch_size) == (2, plan.target_batch)
    assert ns.seq_length == seq_len
    assert ns.sequence_parallel is layout.sequence_parallel
    assert ns.use_distributed_optimizer is (strategy == "zero1")
    assert ns.use_torch_fsdp2 is (strategy == "fsdp")
    assert (ns.recompute_granularity, ns.recompute_method) == ("full", "block")
    # the most any stage checkpoints: 3 of 8 blocks in one stage; with stages of 4 or 2
    # blocks, stage 0 checkpoints layers.0 and .1
    assert ns.recompute_num_layers == (3 if layout.stages == 1 else 2)
    if layout.pp > 1:  # the plan's stages, one character a layer (emit.megatron)
        stages = "|".join(
            ["Ett", "tt", "tt", "ttL"] if layout.virtual_stages > 1 else ["Etttt", "ttttL"]
        )
        assert ns.pipeline_model_parallel_layout == stages
        assert ns.num_layers_per_virtual_pipeline_stage is None


@pytest.mark.parametrize(
    ("blocks", "layout"),
    [
        (8, Parallel(pp=2)),
        (8, Parallel(pp=2, schedule="interleaved_1f1b", virtual_stages=2)),
        (126, Parallel(pp=8)),
        (126, Parallel(pp=8, stage_split="torchtitan-2412")),
        (126, Parallel(pp=8, schedule="interleaved_1f1b", virtual_stages=2)),
        (
            126,
            Parallel(
                pp=8, schedule="interleaved_1f1b", virtual_stages=2, stage_split="torchtitan-2504"
            ),
        ),
        (
            32,
            Parallel(
                pp=4, schedule="interleaved_1f1b", virtual_stages=2, stage_split="torchtitan-2504"
            ),
        ),
    ],
)
def test_megatrons_own_layout_parser_builds_the_plans_stages(tmp_path, monkeypatch, blocks, layout):
    # megatron-core's PipelineParallelLayerLayout (0.16.1, the class Megatron-LM's
    # TransformerConfig turns --pipeline-model-parallel-layout into) validates the emitted
    # layout for the model's block count and gives every (pipeline rank, virtual stage) the
    # blocks memplan planned there: uneven splits too, which Megatron's default even split
    # refuses (126 blocks over 8 stages).
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    names = tuple(f"layers.{i}" for i in range(blocks))
    plan = _plan(layout, strategy="fsdp", blocks=names)
    args = shell_words(emit(plan, "megatron", "m.py")[1], "MEMPLAN_ARGS", tmp_path)
    text = args[args.index("--pipeline-model-parallel-layout") + 1]
    parsed = PipelineParallelLayerLayout(text, layout.pp)
    parsed.validate_layer_layout(blocks, None)
    v = layout.virtual_stages
    monkeypatch.setattr(
        parallel_state, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", v if v > 1 else None
    )
    ranges = layout.stage_ranges(blocks)
    for stage, expected in enumerate(ranges):
        built = parsed.get_layer_id_list(vp_stage=stage // layout.pp, pp_rank=stage % layout.pp)
        assert built == list(expected), (stage, built, expected)
    assert parsed.virtual_pipeline_model_parallel_size == v


def test_megatron_snippet_carries_seq_length(tmp_path):
    plan = _plan(Parallel(dp_replicate=2, tp=2), strategy="ddp", seq_len=3000)
    _, text = emit(plan, "megatron", "m.py")
    args = shell_words(text, "MEMPLAN_ARGS", tmp_path)
    assert args[args.index("--seq-length") + 1] == "3000"
    assert "--max-position-embeddings >= 3000" in text
    no_len = _plan(Parallel(dp_replicate=2, tp=2), strategy="ddp")
    assert "--seq-length" not in emit(no_len, "megatron", "m.py")[1]


# ---------------------------------------------------------------- float8 (issue 34)

FLOAT8 = Float8(
    recipe="tensorwise",
    fsdp_float8_all_gather=True,
    converted=560,
    skipped=("output: filtered ('output')",),
)
BLOCKS_70B = tuple(f"layers.{i}" for i in range(80))


def _plan_70b(float8: Float8 | None, blocks: tuple[str, ...] = BLOCKS_70B, params: int = 0):
    return _plan(
        Parallel(dp_shard=32, tp=8, sequence_parallel=True, loss_parallel=True),
        micro=16,
        steps=1,
        checkpoint=dict.fromkeys(blocks, "full"),
        seq_len=8192,
        blocks=blocks,
        parameter_bytes=params or 2 * 70_553_706_496,
        float8=float8,
    )


def _linear_kinds(config) -> dict[str, str]:
    from torchtitan.models.common.linear import Linear

    return {
        fqn: type(linear).__qualname__
        for fqn, linear, _, _ in config.model_spec.model.traverse(Linear.Config)
    }


@pytest.mark.slow
def test_torchtitan_builds_the_float8_plans_converter(titan, tmp_path, monkeypatch):
    """A float8 plan of Llama 3 70B: the snippet writes a config_registry function whose
    model_spec has torchtitan's Float8LinearConverter (its only recipe, rowwise), torchtitan's
    ConfigManager loads it by --module/--config, and every block's linears are float8 while
    the head stays bf16."""
    from torchtitan.components.quantization import float8 as titan_float8

    # the converter refuses a machine without an sm89+ GPU when it is built: this one has none
    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *a: True)
    monkeypatch.syspath_prepend(str(tmp_path))
    config, text = _titan_config_any(titan, _plan_70b(FLOAT8), tmp_path)
    assert "--module memplan_titan_precision" in text and "--config llama3_70b_float8" in text
    kinds = _linear_kinds(config)
    assert kinds.pop("lm_head") == "Linear.Config"
    # torchtitan 0.3's block: fused wqkv, wo, w1, w2, w3
    assert len(kinds) == 80 * 5 and set(kinds.values()) == {"Float8Linear.Config"}
    assert "torchtitan 0.3.0 has only the rowwise recipe" in text
    assert config.parallelism.tensor_parallel_degree == 8
    assert config.training.local_batch_size == 16


@pytest.mark.slow
def test_a_bf16_plan_of_405b_trains_torchtitans_405b_without_float8(titan, tmp_path, monkeypatch):
    """torchtitan 0.3's llama3_405b converts to float8 by itself: a bf16 plan of it gets a
    config function without the converter."""
    from torchtitan.components.quantization import float8 as titan_float8

    # llama3_405b() builds its own converter first, which refuses a machine without sm89+
    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *a: True)
    monkeypatch.syspath_prepend(str(tmp_path))
    blocks = tuple(f"layers.{i}" for i in range(126))
    plan = _plan_70b(None, blocks, params=2 * 405_853_388_800)
    config, text = _titan_config_any(titan, plan, tmp_path)
    assert "--config llama3_405b_bf16" in text
    assert set(_linear_kinds(config).values()) == {"Linear.Config"}


def _titan_config_any(titan, plan: Plan, tmp_path: Path):
    import sys

    sys.modules.pop("memplan_titan_precision", None)  # each test's snippet writes its own
    config_manager, _ = titan
    _, text = emit(plan, "torchtitan", "m.py")
    args = shell_words(text, "TORCHTITAN_ARGS", tmp_path)
    return config_manager().parse_args(args), text


def test_torchtitan_toml_carries_float8_for_both_releases(tmp_path):
    import tomllib

    _, text = emit(_plan_70b(FLOAT8), "torchtitan-toml", "m.py")
    data = tomllib.loads(text)
    assert data["model"]["converters"] == ["quantize.linear.float8"]
    for section in (data["float8"], data["quantize"]["linear"]["float8"]):
        assert section == {
            "enable_fsdp_float8_all_gather": True,
            "precompute_float8_dynamic_scale_for_fsdp": True,
            "recipe_name": "tensorwise",
            "filter_fqns": ["output"],
        }
    assert "float8" not in tomllib.loads(emit(_plan_70b(None), "torchtitan-toml", "m.py")[1])


@pytest.mark.parametrize(
    ("recipe", "strategy", "expected"),
    [
        ("tensorwise", "fsdp", ["hybrid", "tensorwise", True]),
        ("tensorwise", "ddp", ["hybrid", "tensorwise", False]),
        ("rowwise", "fsdp", ["hybrid", "blockwise", False]),
    ],
)
def test_megatron_float8_flags(tmp_path, recipe, strategy, expected):
    float8 = Float8(recipe=recipe, fsdp_float8_all_gather=recipe == "tensorwise")
    layout = Parallel(dp_shard=2) if strategy == "fsdp" else Parallel(dp_replicate=2)
    plan = _plan(layout, strategy=strategy, float8=float8)
    text = emit(plan, "megatron", "m.py")[1]
    args = shell_words(text, "MEMPLAN_ARGS", tmp_path)
    fmt = args[args.index("--fp8-format") + 1]
    got = [fmt, args[args.index("--fp8-recipe") + 1], "--fp8-param-gather" in args]
    assert got == expected
    assert ("no rowwise recipe" in text) is (recipe == "rowwise")
    assert "--fp8-format" not in emit(_plan(layout, strategy=strategy), "megatron", "m.py")[1]


def test_megatrons_parser_reads_the_float8_flags(megatron_parser, tmp_path):
    plan = _plan(Parallel(dp_shard=2, tp=2), strategy="fsdp", float8=FLOAT8)
    ns = megatron_parser.parse_args(
        shell_words(emit(plan, "megatron", "m.py")[1], "MEMPLAN_ARGS", tmp_path)
    )
    assert (ns.fp8, ns.fp8_recipe, ns.fp8_param_gather) == ("hybrid", "tensorwise", True)


def test_a_transformers_model_probed_on_some_blocks_is_emitted_with_all_of_them():
    # A Llama of 8 decoder blocks probed with --layers on 2 of them, both planned full: its
    # blocks are the 8 transformers checkpoints (hf_blocks), not the 2 candidates. Before,
    # the 2 candidates were the model: FullAC on every block was written as the plan's own
    # choice, and Megatron's per-stage count read the candidates' positions.
    from memplan.emit._common import plan_block_names, plan_blocks
    from memplan.emit.torchtitan import torchtitan_args

    every = tuple(f"model.layers.{i}" for i in range(8))
    some = every[:2]
    plan = _plan(Parallel(dp_shard=2), blocks=some, checkpoint=dict.fromkeys(some, "full"))
    plan = dataclasses.replace(
        plan,
        model_fingerprint=dataclasses.replace(plan.model_fingerprint, hf_blocks=every),
    )
    assert plan_block_names(plan) == every and plan_blocks(plan) == 8
    assert torchtitan_args(plan)[-1] == "activation_checkpoint:full"
    _, text = emit(plan, "torchtitan", "m.py")
    assert "the plan checkpoints 2 of 8 blocks (full)" in " ".join(text.split())
    # without hf_blocks (not a transformers model) the candidates stay the blocks
    bare = _plan(Parallel(dp_shard=2), blocks=some, checkpoint=dict.fromkeys(some, "full"))
    assert plan_blocks(bare) == 2
    assert "of 2 blocks" not in " ".join(emit(bare, "torchtitan", "m.py")[1].split())


def test_every_block_is_read_by_name_not_by_count():
    # 7 of 8 blocks and the head checkpointed: as many layers as blocks, but not every block.
    # Before, the count matched and torchtitan's FullAC was written as the plan's own choice.
    from memplan.emit._common import checkpoints_every_block

    layers = (*BLOCKS[:7], "lm_head")
    plan = _plan(Parallel(dp_shard=2), checkpoint=dict.fromkeys(layers, "full"))
    assert len(plan.checkpoint) == len(BLOCKS) and not checkpoints_every_block(plan)
    _, text = emit(plan, "torchtitan", "m.py")
    assert "the plan checkpoints 7 of 8 blocks (full)" in " ".join(text.split())
    whole = _plan(Parallel(dp_shard=2), checkpoint=dict.fromkeys(BLOCKS, "full"))
    assert checkpoints_every_block(whole)
    assert "blocks (full)" not in " ".join(emit(whole, "torchtitan", "m.py")[1].split())


def test_a_plan_checkpointing_no_block_gets_every_block_in_torchtitans_toml():
    # only the head checkpointed: the 0.1-0.2 TOML's nth-block option is 1 (every block: no
    # more memory than planned); before, the head counted as a block: "8", one block
    plan = _plan(Parallel(dp_shard=2), checkpoint={"lm_head": "full"})
    _, text = emit(plan, "torchtitan-toml", "m.py")
    assert 'selective_ac_option = "1"' in text
    assert "the plan checkpoints 0 of 8 blocks (full)" in " ".join(text.split())
