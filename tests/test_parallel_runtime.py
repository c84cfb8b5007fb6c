"""The parallel-layout runtime (issue 25, memplan.run.parallel): pipeline stage splits,
mesh coordinates, TP style mapping and refusals, in one process; and real 4-rank gloo runs
of a tiny Hugging Face Llama (tp 2 × dp 2, pp 2 × dp 2, tp 2 × fsdp 2) whose gradients
must equal one process's gradient of the whole batch."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from memplan.errors import BadInputError
from memplan.parallel import Parallel, stage_layers

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _llama_ref(tmp_path, **overrides):
    folder = tmp_path / "llama"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **overrides}))
    return f"hf:{folder}?task=causal-lm&seq-len=16"


def test_stage_layers_by_hand():
    assert stage_layers(4, 2) == (range(0, 2), range(2, 4))
    assert stage_layers(5, 2) == (range(0, 2), range(2, 5))  # the extra layer goes last
    assert stage_layers(7, 3) == (range(0, 2), range(2, 4), range(4, 7))


@given(st.integers(1, 200), st.integers(1, 64))
def test_stage_layers_cover_every_layer_once_in_order(n_layers, stages):
    if n_layers < stages:
        return
    ranges = stage_layers(n_layers, stages)
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes)  # never more layers on an earlier stage


def test_mesh_coordinates_put_tp_innermost():
    from memplan.run.parallel import data_rank, mesh_coordinates

    layout = Parallel(pp=2, dp_replicate=2, tp=2)
    assert mesh_coordinates(layout, 5) == {
        "pp": 1,
        "dp_replicate": 0,
        "dp_shard": 0,
        "cp": 0,
        "tp": 1,
    }
    # the two ranks of a TP group feed the same samples; a pipeline's stages too
    assert [data_rank(layout, r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_transformers_style_names_map_to_torch_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from memplan.run.parallel import parallel_style

    gathered = parallel_style("colwise_gather_output")
    assert isinstance(gathered, ColwiseParallel)
    assert gathered.output_layouts == (Replicate(),)
    embedding = parallel_style("embedding_rowwise")
    assert isinstance(embedding, RowwiseParallel)
    assert embedding.input_layouts == (Replicate(),)
    assert parallel_style("colwise").output_layouts == (Shard(-1),)
    with pytest.raises(BadInputError, match="packed_colwise"):
        parallel_style("packed_colwise")


def test_two_pipeline_stages_compose_to_the_whole_model(tmp_path):
    import copy

    from memplan.model.loader import load_model_file
    from memplan.run.parallel import make_stage_module, pipeline_parts

    mf = load_model_file(_llama_ref(tmp_path))
    net = mf.build_model()
    parts = pipeline_parts(net)
    assert (parts.embed, parts.layers, parts.norm, parts.head) == (
        "model.embed_tokens",
        "model.layers",
        "model.norm",
        "lm_head",
    )
    batch = mf.make_batch(2)
    whole = net(**batch).logits
    ranges = stage_layers(3, 2)
    first = make_stage_module(copy.deepcopy(net), parts, ranges[0], first=True, last=False)
    last = make_stage_module(copy.deepcopy(net), parts, ranges[1], first=False, last=True)
    assert torch.equal(last(first(batch["input_ids"])), whole)
    # each stage holds its own layers only, under the names of the whole model
    names = {n.split(".weight")[0] for n, _ in first.named_parameters()}
    assert "model.embed_tokens" in names and "lm_head" not in names
    assert not any(n.startswith("model.layers.1.") for n, _ in first.named_parameters())
    assert any(n.startswith("model.layers.2.") for n, _ in last.named_parameters())
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32  # attention, MLP, two norms
    assert sum(p.numel() for p in first.parameters()) == 128 * 32 + layer  # embedding, layer 0


def test_pipeline_refuses_tied_embeddings_and_models_without_a_pipeline_plan(tmp_path):
    from memplan.model.loader import load_model_file
    from memplan.run.parallel import pipeline_parts

    tied = load_model_file(_llama_ref(tmp_path, tie_word_embeddings=True)).build_model()
    with pytest.raises(BadInputError, match="ties its head"):
        pipeline_parts(tied)
    with pytest.raises(BadInputError, match="--pp 1"):
        pipeline_parts(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_tp_degree_must_divide_the_heads(tmp_path):
    from memplan.model.loader import load_model_file
    from memplan.run.parallel import check_tp_divisible
    from memplan.run.tp_plan import hf_tp_plan, tp_modules

    net = load_model_file(_llama_ref(tmp_path)).build_model()
    modules = tp_modules(net, hf_tp_plan(net))
    check_tp_divisible(net, modules, 2)
    with pytest.raises(BadInputError, match="num_key_value_heads"):
        check_tp_divisible(net, modules, 4)  # 2 kv heads


def test_sequence_parallel_plan_splits_norms_and_gathers_each_tp_region(tmp_path):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    from memplan.model.loader import load_model_file
    from memplan.run.sequence_parallel import gather_sequence, sequence_parallel_plan
    from memplan.run.tp_plan import hf_tp_plan, tp_modules

    net = load_model_file(_llama_ref(tmp_path)).build_model()
    plan, regions, norms = sequence_parallel_plan(net, tp_modules(net, hf_tp_plan(net)))
    blocks = [f"model.layers.{i}" for i in range(3)]
    assert regions == [f"{b}.{r}" for b in blocks for r in ("mlp", "self_attn")]
    assert norms == [
        *(f"{b}.{n}" for b in blocks for n in ("input_layernorm", "post_attention_layernorm")),
        "model.norm",
    ]
    assert all(isinstance(plan[n], SequenceParallel) for n in norms)
    out = plan["model.layers.0.self_attn.o_proj"]
    assert isinstance(out, RowwiseParallel) and out.output_layouts == (Shard(1),)
    assert not out.use_local_output  # the residual stream stays a (global-shape) DTensor
    head = plan["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.input_layouts == (Shard(1),)
    assert head.output_layouts == (Replicate(),)
    embed = plan["model.embed_tokens"]
    assert embed.input_layouts == (Replicate(),) and embed.output_layouts == (Shard(1),)
    # a plain tensor passes the gather hook untouched, by position or by keyword
    x = torch.ones(2, 3)
    assert gather_sequence(net, (x,), {})[0][0] is x
    assert gather_sequence(net, (), {"hidden_states": x})[1]["hidden_states"] is x


def test_sequence_parallel_refuses_pipeline_stages_and_odd_plans(tmp_path):
    from memplan.model.loader import load_model_file
    from memplan.run.parallel import build_layout
    from memplan.run.sequence_parallel import sequence_parallel_plan

    net = load_model_file(_llama_ref(tmp_path)).build_model()
    layout = Parallel(tp=2, pp=2, sequence_parallel=True)
    with pytest.raises(BadInputError, match="pipeline stages"):  # before any process group
        build_layout(net, _layout_plan("m", layout), layout, None, torch.device("cpu"))
    with pytest.raises(BadInputError, match="without --sequence-parallel"):
        sequence_parallel_plan(net, {"model.layers.0.mlp.up_proj": "colwise"})  # no rowwise


def _layout_plan(model, parallel, strategy="ddp", units=()):
    from memplan.plan import Breakdown, Plan, Prediction

    micro, k = 2, 2
    zero = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)
    return Plan(
        target_batch=micro * k * parallel.dp,
        micro_batch_size=micro,
        accumulation_steps=k,
        world_size=parallel.world_size,
        strategy=strategy,
        shard_units=units,
        budget_bytes=1 << 40,
        predicted=Prediction(peak_bytes=1 << 20, step_seconds=1.0, breakdown=zero),
        model=model,
        parallel=parallel,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "strategy"),
    [
        (Parallel(tp=2, dp_replicate=2), "ddp"),
        (Parallel(pp=2, dp_replicate=2), "ddp"),
        (Parallel(tp=2, dp_shard=2), "fsdp"),
        (Parallel(tp=2, dp_replicate=2, sequence_parallel=True), "ddp"),
    ],
    ids=["tp2-ddp2", "pp2-ddp2", "tp2-fsdp2", "tp2sp-ddp2"],
)
def test_four_gloo_ranks_run_the_layout_and_match_one_process_gradient(
    parallel, strategy, tmp_path
):
    from memplan.verify.distributed import verify_distributed

    model = _llama_ref(tmp_path, num_hidden_layers=4)
    units = tuple(f"model.layers.{i}" for i in range(4)) if strategy == "fsdp" else ()
    result = verify_distributed(
        model, _layout_plan(model, parallel, strategy, units), steps=1, timeout_s=900
    )
    assert result.gradient_check.status == "pass", result.gradient_check
    peaks = [r.peak_bytes for r in result.ranks]
    if parallel.pp == 1:  # every rank holds the same share
        assert len(set(peaks)) == 1
    else:  # ranks 0, 1 are stage 0 (embeddings), ranks 2, 3 stage 1 (head and loss)
        assert peaks[0] == peaks[1] and peaks[2] == peaks[3] and peaks[0] != peaks[2]
    assert all(r.effective_batch == 2 * 2 * parallel.dp for r in result.ranks)


@pytest.mark.slow
def test_sequence_parallel_plan_from_probe_to_four_ranks_within_five_percent(tmp_path):
    # The whole path a user takes: probe (which measures the TP split), solve --tp 2
    # --sequence-parallel, verify on 4 gloo ranks. Each rank's tracker peak within 5% of
    # the plan's prediction, and each rank's gradient shard equal to one process's.
    from typer.testing import CliRunner

    from memplan.cli import app

    model = _llama_ref(tmp_path, num_hidden_layers=4)
    profile, plan = tmp_path / "p.yaml", tmp_path / "out" / "plan.yaml"
    runner = CliRunner()
    steps = [
        ["probe", model, "--timing-rounds", "1", "-o", str(profile)],
        [
            *("solve", str(profile), "--budget", "1GiB", "--target-batch", "8"),
            *("--world-size", "4", "--tp", "2", "--sequence-parallel", "-o", str(plan)),
        ],
        ["verify", model, str(plan), "--world-size", "4", "--steps", "1", "--json"],
    ]
    for args in steps:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"], data
    assert abs(data["peak_error"]) < 0.05
    assert data["gradient_check"]["status"] == "pass"
    assert "sequence_parallel: true" in plan.read_text()


def test_layout_gradient_check_reads_as_the_distributed_check():
    # Each rank's layout gradient error becomes the plan check verify_distributed reads
    # (a crash before: the layout path returned a bare float).
    from memplan.verify.distributed_grads import gradient_check
    from memplan.verify.parallel import layout_gradient_check

    layout = Parallel(tp=2, dp_replicate=2)
    plan = _layout_plan("m", layout)
    rows = [layout_gradient_check(e, plan, layout) for e in (1e-7, 3e-5, 2e-7, 1e-6)]
    check, couple = gradient_check(plan, rows, True, 4)
    assert (check.status, check.relative_error) == ("pass", 3e-5)
    assert couple.status == "skipped" and "parallel layout" in couple.reason
    bad = [layout_gradient_check(e, plan, layout) for e in (1e-7, float("nan"), 2e-4, "x")]
    assert [r["check"]["status"] for r in bad] == ["pass", "fail", "fail", "fail"]
    assert bad[1]["check"]["relative_error"] is None and bad[3]["check"]["reason"] == "x"
