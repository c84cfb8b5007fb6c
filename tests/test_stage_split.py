"""How the blocks divide into pipeline stages (``Parallel.stage_split``, memplan.parallel
``split_stages``): memplan's own rule, torchtitan 9dec370's (December 2024) and torchtitan
0.3.0's (the rule since f64cf3c, April 2025), by hand; every block in exactly one stage; the
per-rank memory charging the rule's blocks; and ``--format torchtitan`` writing the stages
that torchtitan 0.3.0's own pipeline code then builds."""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plan_factory import hand_plan
from profiles_factory import uniform_chain

from memplan.emit import emit
from memplan.emit.torchtitan import stage_fqns
from memplan.errors import BadInputError
from memplan.memory.parallel import rank_profile, stage_blocks
from memplan.parallel import STAGE_SPLITS, Parallel, split_fits, split_stages
from memplan.plan import ModelFingerprint, Plan


def _sizes(n: int, stages: int, rule: str) -> list[int]:
    return [len(r) for r in split_stages(n, stages, rule)]


def test_126_blocks_in_8_stages_by_hand():
    # memplan: 126 = 8 × 15 + 6, the last 6 stages a block longer.
    assert _sizes(126, 8, "memplan") == [15, 15, 16, 16, 16, 16, 16, 16]
    # torchtitan 9dec370 generate_split_points: 126 // 8 = 15 on stage 0, 16 on the middle
    # stages while the remainder 6 lasts (stages 1-6), the rest (126 − 15 − 96 = 15) last.
    assert _sizes(126, 8, "torchtitan-2412") == [15, 16, 16, 16, 16, 16, 16, 15]
    # torchtitan 0.3.0: (126 + 1 + 1) / 8 = 16 weighted blocks a stage, no remainder; the
    # first holds the embeddings (one block's weight), the last the norm and head.
    assert _sizes(126, 8, "torchtitan-2504") == [15, 16, 16, 16, 16, 16, 16, 15]
    ranges = Parallel(pp=8, stage_split="torchtitan-2412").stage_ranges(126)
    assert (ranges[0], ranges[1], ranges[7]) == (range(0, 15), range(15, 31), range(111, 126))
    assert Parallel(pp=8).stage_ranges(126)[7] == range(110, 126)  # memplan: 16 on the last
    assert (
        Parallel(pp=8, stage_split="torchtitan-2412")
        .describe()
        .endswith("pp 8 (1f1b, torchtitan-2412 stages) × cp 1")
    )
    assert Parallel(pp=8).describe().endswith("pp 8 (1f1b) × cp 1")  # as before


def test_32_blocks_pp_4_interleaved_two_stages_a_rank_by_hand():
    layout = {
        rule: Parallel(pp=4, schedule="interleaved_1f1b", virtual_stages=2, stage_split=rule)
        for rule in STAGE_SPLITS
    }
    # 8 stages of 32: memplan and 9dec370 give 4 each; 0.3.0 (34 weighted blocks: 4 a stage,
    # the remainder 2 on stages 0 and 1) gives 5 − 1, 5, 4, …, 4 − 1.
    assert _sizes(32, 8, "memplan") == [4] * 8
    assert _sizes(32, 8, "torchtitan-2412") == [4] * 8
    assert _sizes(32, 8, "torchtitan-2504") == [4, 5, 4, 4, 4, 4, 4, 3]
    # rank r holds stages r and r + 4 (torchtitan's "loop" style, torch's interleaved 1F1B)
    _, own = stage_blocks(32, layout["torchtitan-2504"], 1)
    assert own == (*range(4, 9), *range(21, 25))  # stage 1: 4-8, stage 5: 21-24
    _, own = stage_blocks(32, layout["torchtitan-2504"], 3)
    assert own == (*range(13, 17), *range(29, 32))  # stage 3: 13-16, stage 7: 29-31
    _, own = stage_blocks(32, layout["memplan"], 3)
    assert own == (*range(12, 16), *range(28, 32))
    # 126 blocks in 16 stages (the published 405B interleaved run): 7, 8 × 14, 7 by torchtitan
    assert _sizes(126, 16, "torchtitan-2412") == [7] + [8] * 14 + [7]
    assert _sizes(126, 16, "torchtitan-2504") == [7] + [8] * 14 + [7]
    assert _sizes(126, 16, "memplan") == [7, 7] + [8] * 14


def test_more_stages_than_blocks_is_refused_naming_the_field():
    for rule in STAGE_SPLITS:
        with pytest.raises(BadInputError, match=r"parallel\.pp × parallel\.virtual_stages"):
            split_stages(6, 8, rule)
        assert not split_fits(6, 8, rule)
    with pytest.raises(BadInputError, match=r"parallel\.stage_split"):
        Parallel(pp=4, virtual_stages=2, schedule="interleaved_1f1b").stage_ranges(7)
    # 0.3.0 with 5 blocks in 4 stages: 7 weighted blocks, 1 a stage and 3 over, so the last
    # stage holds the norm and head alone (torchtitan allows it; memplan's stages need a block)
    with pytest.raises(BadInputError, match="stage_split torchtitan-2504 gives pipeline stage 3"):
        split_stages(5, 4, "torchtitan-2504")
    assert _sizes(5, 4, "torchtitan-2412") == [1, 2, 1, 1]
    with pytest.raises(ValueError, match="stage_split"):
        Parallel(pp=2, stage_split="megatron")  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=300),
    pp=st.integers(min_value=1, max_value=16),
    v=st.integers(min_value=1, max_value=4),
    rule=st.sampled_from(STAGE_SPLITS),
)
def test_every_block_in_exactly_one_stage_in_order(n, pp, v, rule):
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    layout = Parallel(pp=pp, virtual_stages=v, schedule=schedule, stage_split=rule)
    if not split_fits(n, layout.stages, rule):
        assert layout.stages > n or rule == "torchtitan-2504"
        return
    ranges = layout.stage_ranges(n)
    assert len(ranges) == layout.stages and all(len(r) >= 1 for r in ranges)
    assert [j for r in ranges for j in r] == list(range(n))  # contiguous, in order, once
    # the interleaved ranks together hold every block once
    held = sorted(j for rank in range(pp) for j in stage_blocks(n, layout, rank)[1])
    assert held == list(range(n))


def test_the_rank_model_charges_the_rules_blocks():
    # 6 blocks of distinct sizes, pp 4: memplan splits 1, 1, 2, 2 and torchtitan 1, 2, 2, 1,
    # so stage 1 holds block 1 alone under memplan and blocks 1-2 under torchtitan.
    profile = uniform_chain(6, params=[1000, 2000, 3000, 4000, 5000, 6000]).profile()
    own = {
        rule: rank_profile(profile, Parallel(pp=4, stage_split=rule), 1, 4)
        for rule in ("memplan", "torchtitan-2412")
    }
    assert own["memplan"].totals.params_trainable_bytes == 2000
    assert own["torchtitan-2412"].totals.params_trainable_bytes == 2000 + 3000
    # the last stage: block 5 and the head by torchtitan, blocks 4-5 and the head by memplan
    last = {
        rule: rank_profile(profile, Parallel(pp=4, stage_split=rule), 3, 4).totals
        for rule in ("memplan", "torchtitan-2412")
    }
    mine, theirs = last["memplan"], last["torchtitan-2412"]
    assert mine.params_trainable_bytes - theirs.params_trainable_bytes == 5000  # block 4


def _plan(layout: Parallel, blocks: int = 6) -> Plan:
    names = tuple(f"layers.{i}" for i in range(blocks))
    return hand_plan(
        "m.py",
        micro=2,
        k=4,
        peak=1 << 30,
        budget=1 << 40,
        full=names,
        strategy="fsdp",
        model_fingerprint=ModelFingerprint(parameter_bytes=1 << 20, candidate_layers=names),
        parallel=layout,
    )


def test_stage_split_round_trips_through_a_plan_file():
    from yaml import safe_load

    from memplan.plan import plan_from_data, plan_to_yaml

    plan = _plan(Parallel(dp_shard=2, pp=2, stage_split="torchtitan-2412"))
    text = plan_to_yaml(plan)
    assert "stage_split: torchtitan-2412" in text
    assert plan_from_data(safe_load(text)) == plan
    assert "stage_split" not in plan_to_yaml(_plan(Parallel(dp_shard=2, pp=2)))  # as before


def test_solve_with_a_stage_split_plans_the_rules_stages(tmp_path):
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.plan import load_plan
    from memplan.profile import profile_to_yaml

    chain = uniform_chain(6, params=[1000, 2000, 3000, 4000, 5000, 6000]).profile()
    # a decoder's blocks, as a Hugging Face model's pipeline plan names them (the solver
    # splits those only)
    chain = dataclasses.replace(chain, hf_blocks=chain.layer_names)
    profile = tmp_path / "p.yaml"
    profile.write_text(profile_to_yaml(chain))
    plans = {}
    for rule in ("memplan", "torchtitan-2412"):
        out = tmp_path / f"{rule}.yaml"
        args = ["solve", str(profile), "--target-batch", "8", "--budget", "1GiB"]
        args += ["--world-size", "4", "--pp", "4", "--stage-split", rule, "-o", str(out)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        plans[rule] = load_plan(out)
    assert plans["torchtitan-2412"].parallel.stage_split == "torchtitan-2412"
    assert plans["memplan"].parallel.stage_split == "memplan"
    # the same layout, other blocks on each stage: other per-stage peaks
    peaks = {rule: plan.predicted.stage_peak_bytes for rule, plan in plans.items()}
    assert len(peaks["memplan"]) == 4 and peaks["memplan"] != peaks["torchtitan-2412"]
    bad = CliRunner().invoke(
        app, ["solve", str(profile), "--target-batch", "8", "--budget", "1GiB", "--world-size",
              "4", "--pp", "4", "--stage-split", "even"],
    )  # fmt: skip
    assert bad.exit_code == 2 and "--stage-split must be one of" in bad.output


def test_torchtitan_args_and_toml_carry_the_plans_stages():
    layout = Parallel(dp_shard=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2)
    plan = _plan(layout)
    args = " ".join(emit(plan, "torchtitan", "m.py")[1].split())
    # memplan's 6 blocks in 4 stages: 1, 1, 2, 2
    want = "tok_embeddings,layers.0 layers.1 layers.2,layers.3 layers.4,layers.5,norm,lm_head"
    assert f"--parallelism.module_fqns_per_model_part {want} " in args
    assert "layers_per_stage" not in args
    titan = _plan(Parallel(dp_shard=2, pp=4, stage_split="torchtitan-2412"))
    assert stage_fqns(titan.parallel, 6, head="output") == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4"],
        ["layers.5", "norm", "output"],
    ]
    import tomllib

    text = emit(titan, "torchtitan-toml", "m.py")[1]
    parallelism = tomllib.loads(text)["parallelism"]
    assert parallelism["module_fqns_per_model_part"] == stage_fqns(titan.parallel, 6, "output")
    assert 'pipeline_parallel_split_points = ["layers.1", "layers.3", "layers.5"]' in text


# ---------------------------------------------------------------- torchtitan 0.3.0 itself


@pytest.fixture(scope="module")
def titan():
    try:
        from torchtitan.config import ConfigManager
        from torchtitan.distributed import pipeline_parallel

        importlib.import_module("torchtitan.models.llama3.config_registry")
    except ImportError as exc:  # e.g. triton missing: its models import it
        pytest.skip(f"torchtitan 0.3's pipeline code is not importable here: {exc}")
    if not hasattr(pipeline_parallel, "_generate_llm_fqn_per_model_part"):
        pytest.skip("not torchtitan 0.3.0's pipeline_parallel module")
    return ConfigManager, pipeline_parallel


@pytest.mark.slow
def test_torchtitans_own_default_split_is_torchtitan_2504(titan):
    _, pipeline = titan
    for n, stages in ((126, 8), (126, 16), (80, 8), (32, 8), (6, 4), (61, 7), (33, 2)):
        theirs = pipeline._generate_llm_fqn_per_model_part(stages, n, 1, 1)
        ours = stage_fqns(Parallel(pp=stages, stage_split="torchtitan-2504"), n)
        assert theirs == ours, (n, stages)


@pytest.mark.slow
@pytest.mark.parametrize("rule", STAGE_SPLITS)
@pytest.mark.parametrize("v", [1, 2])
def test_torchtitan_builds_the_emitted_stages_on_every_rank(titan, tmp_path, rule, v):
    """torchtitan 0.3.0's ConfigManager reads the emitted words; its own pipeline code
    (``_get_pp_rank_to_stage_indices_mapping``, ``_split_module``, as ``pipeline_llm`` calls
    them) then gives each rank of its 6-block debug model memplan's blocks for that rank."""
    import torch
    from torchtitan.models.llama3 import model_registry

    if shutil.which("bash") is None:
        pytest.skip("bash is not installed: the emitted snippet is a bash snippet")
    config_manager, pipeline = titan
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    layout = Parallel(dp_shard=2, pp=2, schedule=schedule, virtual_stages=v, stage_split=rule)
    path = tmp_path / "snippet.sh"
    path.write_text(emit(_plan(layout), "torchtitan", "m.py")[1])
    words = subprocess.run(
        ["bash", "-c", '. "$1" && printf "%s\\0" $TORCHTITAN_ARGS', "_", str(path)],
        check=True, capture_output=True, text=True, timeout=30, cwd=tmp_path,
    ).stdout.split("\0")[:-1]  # fmt: skip
    config = config_manager().parse_args(words)
    par = config.parallelism
    assert par.module_fqns_per_model_part == stage_fqns(layout, 6)
    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    assert len(model.layers) == 6
    for rank in range(layout.pp):
        indices = pipeline._get_pp_rank_to_stage_indices_mapping(
            rank, par.pipeline_parallel_degree, par.pipeline_parallel_schedule, layout.stages
        )
        held = []
        for index in indices:
            chunk = pipeline._split_module(model, par.module_fqns_per_model_part[index])
            held += [int(name) for name in chunk.layers]
            assert (chunk.tok_embeddings is not None) == (index == 0)
            assert (chunk.lm_head is not None) == (index == layout.stages - 1)
        assert tuple(held) == stage_blocks(6, layout, rank)[1], (rule, v, rank)


@pytest.mark.slow
def test_memplans_runtime_runs_the_rules_stages_on_two_gloo_ranks(tmp_path):
    """memplan's runtime (``verify --world-size``) splits the stages by the plan's rule: 5
    blocks in 2 stages are 2 + 3 by memplan's rule and 3 + 2 by torchtitan 0.3.0's, so the
    first rank holds one block more and the second one fewer, and the split still computes
    the whole model's gradients."""
    from tiny_llama import llama_reference

    from memplan.verify.distributed import verify_distributed

    model = llama_reference(tmp_path / "llama", num_hidden_layers=5)
    peaks = {}
    for rule in ("memplan", "torchtitan-2504"):
        layout = Parallel(pp=2, stage_split=rule)
        assert [len(r) for r in layout.stage_ranges(5)] == ([2, 3] if rule == "memplan" else [3, 2])
        plan = hand_plan(model, micro=2, k=2, peak=1 << 20, budget=1 << 40, parallel=layout)
        assert (plan.target_batch, plan.world_size, plan.strategy) == (4, 2, "ddp")
        result = verify_distributed(model, plan, steps=1, timeout_s=600)
        assert result.gradient_check.status == "pass", result.gradient_check
        peaks[rule] = [r.peak_bytes for r in result.ranks]
    assert peaks["torchtitan-2504"][0] > peaks["memplan"][0]
    assert peaks["torchtitan-2504"][1] < peaks["memplan"][1]
