"""The layout search (memplan.solver.parallel) and the layout engines' configs
(memplan.emit.torchtitan, memplan.emit.megatron), on hand-made chain profiles."""

from __future__ import annotations

import dataclasses

import pytest
import tomllib
from profiles_factory import uniform_chain, with_tp_measurement
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import emit
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.memory.parallel import layout_peaks
from memplan.parallel import Parallel
from memplan.profile import profile_to_yaml
from memplan.solver import SolveRequest, least_peak
from memplan.solver.parallel import LayoutRequest, bubble_fraction, solve_layout


def _tp_profile(n: int = 8, fraction: float = 0.75):
    """A chain of ``n`` blocks with a TP measurement, as of a transformers decoder (its
    ``hf_blocks`` named), which memplan can split into pipeline stages."""
    profile = uniform_chain(n, saved=[4000] * n, output=[400] * n).profile()
    return with_tp_measurement(profile, fraction, hf_blocks=True)


def _request(budget: int, world: int = 8, target: int = 32, strategy: str = "fsdp"):
    return SolveRequest(
        target_batch=target, budget_bytes=budget, world_size=world, strategy=strategy
    )


def test_fixed_degrees_give_that_layout_and_the_plan_predicts_what_the_model_says():
    profile = _tp_profile()
    result = solve_layout(profile, _request(1 << 30), LayoutRequest(tp=2, pp=2))
    plan = result.plan
    assert (plan.parallel.tp, plan.parallel.pp, plan.parallel.dp) == (2, 2, 2)
    assert plan.world_size == 8 and plan.target_batch == 32
    assert plan.micro_batch_size * plan.accumulation_steps * 2 == 32
    peaks = layout_peaks(profile, plan)
    assert plan.predicted.peak_bytes == peaks.worst.peak.peak_bytes
    assert plan.predicted.stage_peak_bytes == tuple(s.peak.peak_bytes for s in peaks.stages)


def test_auto_finds_a_layout_that_fits_where_data_parallel_alone_does_not():
    profile = _tp_profile()
    budget = least_peak(profile, _request(1 << 30)).peak_bytes - 1  # DP alone never fits
    with pytest.raises(NoPlanFitsError):
        solve_layout(profile, _request(budget), LayoutRequest(tp=1, pp=1))
    plan = solve_layout(profile, _request(budget), LayoutRequest(auto=True)).plan
    p = plan.parallel
    assert p.dp * p.tp * p.pp * p.cp == 8
    assert max(p.tp, p.pp) > 1
    assert plan.predicted.peak_bytes <= budget
    assert layout_peaks(profile, plan).worst.peak.peak_bytes == plan.predicted.peak_bytes


def test_auto_keeps_tp_within_a_node():
    profile = _tp_profile()
    result = solve_layout(profile, _request(1 << 30), LayoutRequest(auto=True, gpus_per_node=2))
    assert all(o.parallel.tp <= 2 for o in result.options)
    assert {o.parallel.tp for o in result.options} == {1, 2}


def test_tp_degrees_that_split_heads_unevenly_are_never_planned():
    # 2 key/value heads: tp 4 would split a head (the runtime refuses it), so auto never
    # picks it, even where tp 4 would be the only way to fit, and a fixed --tp 4 is refused.
    profile = dataclasses.replace(_tp_profile(), tp_degree_divides=2)
    for budget in (1 << 30, least_peak(profile, _request(1 << 30)).peak_bytes - 1):
        try:
            plan = solve_layout(profile, _request(budget), LayoutRequest(auto=True)).plan
        except NoPlanFitsError:
            continue
        assert plan.parallel.tp in (1, 2)
    with pytest.raises(BadInputError, match="must divide 2"):
        solve_layout(profile, _request(1 << 30), LayoutRequest(tp=4))
    assert solve_layout(profile, _request(1 << 30), LayoutRequest(tp=2)).plan.parallel.tp == 2


def test_auto_turns_sequence_parallel_on_only_without_pipeline_stages():
    from memplan.solver.parallel import candidate_layouts

    layouts = candidate_layouts(_tp_profile(), 8, LayoutRequest(auto=True))
    assert any(p.sequence_parallel for p in layouts)
    assert all(not p.sequence_parallel for p in layouts if p.pp > 1)
    assert all(p.sequence_parallel == (p.tp > 1) for p in layouts if p.pp == 1)


def test_auto_with_a_given_cp_lets_the_cp_group_span_nodes_as_torchtitan_runs_it():
    """torchtitan's 405B context-parallel runs are tp 8 × cp 2..8 on 8-GPU nodes: the search
    with --cp keeps tp within a node and lets cp leave it (its exchange then at the
    inter-node link), where it once kept tp × cp within a node and so never saw them."""
    from memplan.solver.parallel import candidate_layouts

    layouts = candidate_layouts(_tp_profile(), 64, LayoutRequest(auto=True, cp=2))
    assert {(p.tp, p.cp) for p in layouts} == {(1, 2), (2, 2), (4, 2), (8, 2)}
    assert any(p.tp == 8 and p.pp == 4 and p.dp == 1 for p in layouts)


def test_bubble_is_pp_minus_one_over_m_plus_pp_minus_one():
    assert bubble_fraction(Parallel(pp=4), 8) == pytest.approx(3 / 11)
    assert bubble_fraction(Parallel(pp=1), 8) == 0.0
    interleaved = Parallel(pp=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert bubble_fraction(interleaved, 8) == pytest.approx(1.5 / 9.5)


def test_degrees_that_do_not_divide_the_world_are_refused_with_what_to_do():
    with pytest.raises(BadInputError, match="no layout of 8 ranks"):
        solve_layout(_tp_profile(), _request(1 << 30), LayoutRequest(tp=3))


def test_fixed_tp_on_a_profile_without_a_tp_measurement_says_so_and_how_to_get_one(tmp_path):
    # issue 31: not "no layout fits the asked degrees", whose reasons all hold
    plain = uniform_chain(8, saved=[4000] * 8, output=[400] * 8).profile()
    assert all(layer.tp_saved_fraction is None for layer in plain.layers)
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(plain))
    for extra in ([], ["--pp", "2"], ["--layout", "auto"]):
        args = ["solve", str(path), "--budget", "1GiB", "--target-batch", "32", "--tp", "2"]
        result = CliRunner().invoke(app, [*args, "--world-size", "8", *extra])
        out = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert "has no tensor-parallel measurement" in out
        assert "no layout" not in out
        assert "memplan probe" in out and "TP_PLAN" in out and "base_model_tp_plan" in out
    assert solve_layout(_tp_profile(), _request(1 << 30), LayoutRequest(tp=2)).plan.parallel.tp == 2


def test_torchtitan_toml_parses_and_names_the_degrees_and_batches():
    profile = _tp_profile()
    plan = solve_layout(profile, _request(1 << 30), LayoutRequest(tp=2, pp=2)).plan
    _, text = emit(plan, "torchtitan-toml", "m.py")
    data = tomllib.loads(text)
    par = data["parallelism"]
    assert par["tensor_parallel_degree"] == 2 and par["pipeline_parallel_degree"] == 2
    assert par["data_parallel_shard_degree"] == 2 and par["context_parallel_degree"] == 1
    assert par["pipeline_parallel_microbatch_size"] == plan.micro_batch_size
    assert data["training"]["global_batch_size"] == 32
    assert data["training"]["local_batch_size"] == plan.micro_batch_size * plan.accumulation_steps
    assert data["activation_checkpoint"]["mode"] in ("none", "full", "selective")


def test_megatron_arguments_and_data_parallel_formats_refuse_a_layout():
    plan = solve_layout(_tp_profile(), _request(1 << 30), LayoutRequest(tp=2, pp=2)).plan
    _, text = emit(plan, "megatron", "m.py")
    for flag in (
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
        "--context-parallel-size 1",
        f"--micro-batch-size {plan.micro_batch_size}",
        "--global-batch-size 32",
        "--use-torch-fsdp2",
    ):
        assert flag in text
    with pytest.raises(BadInputError, match="cannot write a plan with tensor"):
        emit(plan, "deepspeed", "m.py")


def test_cli_solves_a_layout_and_writes_torchtitan(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(_tp_profile()))
    out = tmp_path / "o"
    result = CliRunner().invoke(
        app,
        [
            "solve",
            str(path),
            "--budget",
            "1GiB",
            "--target-batch",
            "32",
            "--world-size",
            "8",
            "--tp",
            "2",
            "--strategy",
            "fsdp",
            "-o",
            str(out / "plan.yaml"),
            "--format",
            "torchtitan,torchtitan-toml",
        ],
    )
    assert result.exit_code == 0, result.output
    data = tomllib.loads((out / "torchtitan.toml").read_text())
    assert data["parallelism"]["tensor_parallel_degree"] == 2
    assert "--parallelism.tensor_parallel_degree 2 " in (out / "torchtitan_args.sh").read_text()
    bad = CliRunner().invoke(
        app,
        [
            "solve",
            str(path),
            "--budget",
            "1GiB",
            "--target-batch",
            "32",
            "--world-size",
            "8",
            "--layout",
            "manual",
        ],
    )
    assert bad.exit_code == 2 and "--layout takes auto" in bad.output


def test_layout_search_and_plan_count_the_same_nccl_communicators():
    # tp 2 × pp 2 × dp 2 on an H100: a rank belongs to three NCCL communicators (shard,
    # tensor, pipeline), 128 MiB each. The stage solve counted one (its data-parallel
    # world), the plan's peak three: every stage 256 MiB apart. With every block fully
    # checkpointed the search's stage peaks are the plan's exactly.
    from memplan.devices import load_device
    from memplan.memory.budget import NCCL_COMMUNICATOR_BYTES
    from memplan.units import MiB

    assert 128 * MiB == NCCL_COMMUNICATOR_BYTES
    profile = _tp_profile()
    request = dataclasses.replace(
        _request(1 << 40),
        device_spec=load_device("h100-80gb"),
        always_checkpoint=("h.*",),
        modes=("full",),
    )
    result = solve_layout(profile, request, LayoutRequest(tp=2, pp=2))
    option = next(o for o in result.options if o.micro_batch == result.plan.micro_batch_size)
    assert all(s.reserve.nccl_bytes == 3 * 128 * MiB for s in option.stages)
    searched = tuple(s.plan.predicted.peak_bytes for s in option.stages)
    assert searched == result.plan.predicted.stage_peak_bytes


def test_data_parallel_collectives_run_at_the_groups_bandwidth():
    # Ranks numbered tp innermost: a data-parallel group takes every tp-th rank. Within a
    # node of 8 it runs on NVLink (450 GB/s); across nodes each of its ranks on a node
    # brings its own 50 GB/s NIC: tp 8 leaves one a node (50 GB/s), tp 2 four (200), tp 1
    # eight (400, under NVLink's 450). FSDP spans cp too (dp_shard × cp, torchtitan's
    # dp_shard_cp): dp 16 × cp 2 at tp 2 is a group of 32, four a node (200); DDP's
    # replicas take every (tp·cp)-th rank: two a node (100).
    from memplan.solver.parallel import data_parallel_bandwidth

    nvlink = 450e9
    cases = {
        Parallel(dp_shard=32, tp=8): 50e9,
        Parallel(dp_shard=128, tp=2): 200e9,
        Parallel(dp_shard=256): 400e9,
        Parallel(dp_shard=4, tp=2): nvlink,
        Parallel(dp_shard=8, pp=4): nvlink,
        Parallel(dp_shard=16, tp=2, cp=2): 200e9,
        Parallel(dp_shard=2, cp=4): nvlink,
    }
    for parallel, want in cases.items():
        assert data_parallel_bandwidth(parallel, nvlink, 8) == want, parallel
    replicas = Parallel(dp_replicate=16, tp=2, cp=2)
    assert data_parallel_bandwidth(replicas, nvlink, 8, sharded=False) == 100e9


def test_a_fully_checkpointed_block_repeats_its_tp_collectives_in_its_recompute():
    # 8 blocks whose first input is 8 B a sample, micro-batch 2, tp 4, 3 micro-batches:
    # each collective moves ring(16 B, 4) = 2·3/4·16 = 24 B; 4 per block plain, 6 when
    # fully checkpointed: (4·8 + 2·5)·3·24 B at 450 GB/s.
    from memplan.solver.layout_time import INTRA_NODE_BYTES_PER_SECOND, layout_comm_seconds

    profile = _tp_profile()
    assert profile.layers[0].input_bytes.slope == 8
    parallel = Parallel(tp=4, dp_shard=2)
    plain = layout_comm_seconds(profile, parallel, 2, 3, 8)["tp"]
    recomputed = layout_comm_seconds(profile, parallel, 2, 3, 8, recomputed=5)["tp"]
    assert plain == pytest.approx(32 * 3 * 24 / INTRA_NODE_BYTES_PER_SECOND)
    assert recomputed == pytest.approx(42 * 3 * 24 / INTRA_NODE_BYTES_PER_SECOND)


def test_the_bubble_stretches_the_micro_batches_not_the_optimizer_step():
    # 4 blocks (forward 0.25 s, backward 0.5 s per sample), fixed parts 0.125 s (embedding
    # and head: 500 B of parameters each, no FLOPs recorded: split by parameters), optimizer
    # step 0.5 s. pp 2 on 2 ranks, 4 micro-batches of 1: each stage 2 blocks and one fixed
    # part, 2 × 0.75 + 0.0625 = 1.5625 s a micro-batch, and half the state: 0.25 s optimizer.
    # 1F1B: (m + pp − 1)/m × 4 × 1.5625 + 0.25 = 8.0625 s, plus the activations sent between
    # stages. Before, the bubble stretched the optimizer step too: 5/4 × 6.5 = 8.125 s.
    profile = _tp_profile(4)
    request = dataclasses.replace(_request(1 << 40, world=2, target=4), modes=("keep",))
    result = solve_layout(profile, request, LayoutRequest(pp=2))
    (option,) = [o for o in result.options if o.micro_batch == 1]
    assert option.micro_batches == 4 and option.stages[0].once_seconds == pytest.approx(0.25)
    assert option.step_seconds - option.comm_seconds["pp"] == pytest.approx(8.0625)


def test_a_pipeline_stage_takes_the_names_of_its_own_blocks():
    """``--always-checkpoint h.6`` with --pp 2: stage 0 holds h.0-h.3 and refused h.6 as an
    unknown layer (exit 2), and stage 1 refused h.1. Each stage now takes its own names; a
    name on no stage is still refused."""
    profile = _tp_profile()
    ask = LayoutRequest(tp=2, pp=2)
    for names in (("h.6",), ("h.1",), ("h.1", "h.6")):
        request = dataclasses.replace(_request(1 << 30), always_checkpoint=names)
        plan = solve_layout(profile, request, ask).plan
        assert {n for n, mode in plan.checkpoint.items() if mode == "full"} >= set(names)
    request = dataclasses.replace(_request(1 << 30), never_checkpoint=("h.6",))
    assert "h.6" not in solve_layout(profile, request, ask).plan.checkpoint
    with pytest.raises(BadInputError, match=r"always_checkpoint names unknown layer.*'h\.9'"):
        solve_layout(
            profile, dataclasses.replace(_request(1 << 30), always_checkpoint=("h.9",)), ask
        )
    both = dataclasses.replace(
        _request(1 << 30), always_checkpoint=("h.1",), never_checkpoint=("h.*",)
    )
    with pytest.raises(BadInputError, match=r"both match h\.1"):
        solve_layout(profile, both, ask)


def test_a_pipeline_never_checkpoints_a_block_it_was_told_never_to():
    """With pipeline stages the solver also tries every block fully checkpointed; that try
    dropped --never-checkpoint, so at a budget only it fits the plan checkpointed every
    block the user forbade (exit 0). Now no plan fits, as without pipeline stages."""
    profile = _tp_profile()
    ask = LayoutRequest(tp=2, pp=2)
    free = dataclasses.replace(_request(1 << 40), always_checkpoint=("h.*",), modes=("full",))
    all_full = solve_layout(profile, free, ask).plan.predicted.peak_bytes
    none = dataclasses.replace(_request(1 << 40), never_checkpoint=("h.*",))
    unchecked = solve_layout(profile, none, ask).plan.predicted.peak_bytes
    assert all_full < unchecked
    between = dataclasses.replace(_request(1 << 40), budget_bytes=(all_full + unchecked) // 2)
    assert solve_layout(profile, between, ask).plan.checkpoint  # fits by checkpointing
    with pytest.raises(NoPlanFitsError):
        solve_layout(profile, dataclasses.replace(between, never_checkpoint=("h.*",)), ask)


def test_pipeline_options_without_a_layout_are_checked_together():
    """Without a degree, --schedule interleaved_1f1b --virtual-stages 2 was told to 'add
    --schedule interleaved_1f1b' (checked against the default schedule), and --stage-split
    bogus passed unchecked."""
    from memplan.solver import SolveRequestError
    from memplan.solver.request import layout_request

    assert layout_request(None, schedule="interleaved_1f1b", virtual_stages=2) is None
    with pytest.raises(SolveRequestError, match="--stage-split must be one of"):
        layout_request(None, stage_split="bogus")
    with pytest.raises(SolveRequestError, match="--virtual-stages 2 needs --schedule"):
        layout_request(None, virtual_stages=2)


def test_an_interleaved_split_counts_every_virtual_stage():
    """5 blocks at pp 2 × 3 virtual stages: the refusal said 'do not split into 2 stages'."""
    profile = _tp_profile(n=5)
    ask = LayoutRequest(pp=2, schedule="interleaved_1f1b", virtual_stages=3)
    with pytest.raises(BadInputError) as raised:
        solve_layout(profile, _request(1 << 40, world=2, target=8), ask)
    assert "5 blocks do not split into 6 stages as asked" in str(raised.value)
