"""What the layout search, the plan reader and verify refuse (#33 items 4-10 and 12): a
layout memplan cannot run, a target no layout splits, bad pipeline options, huge targets and
worlds (answered in seconds), a layout plan's report, edited layout plans, more ranks than
the machine can start, and profiles that would predict a negative peak or record a length
no plan may have. Every refusal is exit 2 with a message, never a traceback."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import uniform_chain
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import BadInputError, NoPlanFitsError, ProfileError
from memplan.files.schema import to_data
from memplan.model.reference import ModelRef
from memplan.parallel import pipeline_refusal_by_kind
from memplan.plan import plan_from_data, plan_to_yaml
from memplan.profile import profile_to_yaml
from memplan.report import report_for_plan
from memplan.solver import LayoutRequest, SolveRequest, SolveRequestError, solve
from memplan.solver.parallel import solve_layout
from memplan.units import format_bytes


def _profile(n: int = 4, *, hf: bool = True):
    """A chain of ``n`` blocks; ``hf``: as of a transformers decoder (its blocks named in
    ``hf_blocks``), which memplan's runtime splits into pipeline stages."""
    profile = uniform_chain(n, saved=[4000] * n, output=[400] * n).profile()
    return dataclasses.replace(profile, hf_blocks=profile.layer_names if hf else ())


def _request(target: int = 8, world: int = 2, **more) -> SolveRequest:
    return SolveRequest(target_batch=target, budget_bytes=1 << 30, world_size=world, **more)


def _cli(tmp_path, profile, *args: str):
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(profile))
    return CliRunner().invoke(app, ["solve", str(path), "--budget", "1GiB", *args])


# 4: pipeline stages only for a model memplan can split -------------------------------------


def test_pipeline_stages_are_never_planned_for_a_model_memplan_cannot_split():
    plain = _profile(hf=False)
    with pytest.raises(BadInputError, match="Hugging Face decoder models only"):
        solve_layout(plain, _request(), LayoutRequest(pp=2))
    auto = solve_layout(plain, _request(world=4), LayoutRequest(auto=True))
    assert {o.parallel.pp for o in auto.options} == {1}
    # the same profile as a transformers decoder: pp 2 is planned, and auto considers it
    assert solve_layout(_profile(), _request(), LayoutRequest(pp=2)).plan.parallel.pp == 2
    pps = {
        o.parallel.pp
        for o in solve_layout(_profile(), _request(world=4), LayoutRequest(auto=True)).options
    }
    assert pps == {1, 2, 4}


def test_pipeline_rule_reads_the_reference_and_the_transformers_blocks():
    assert pipeline_refusal_by_kind("model.py", ()) is not None
    assert pipeline_refusal_by_kind("model.py", ("model.layers.0",)) is None  # a file building one
    assert pipeline_refusal_by_kind("hf:cfg?task=causal-lm&seq-len=8", ("model.layers.0",)) is None
    why = pipeline_refusal_by_kind("hf:cfg?task=seq-cls&seq-len=8", ("model.layers.0",))
    assert why is not None and "seq-cls" in why


def test_cli_pp_on_a_plain_model_file_is_exit_2(tmp_path):
    result = _cli(
        tmp_path, _profile(hf=False), "--target-batch", "8", "--world-size", "2", "--pp", "2"
    )
    assert result.exit_code == 2, result.output
    assert "Hugging Face" in result.output and "Traceback" not in result.output


# 5: a target no layout splits is exit 2, with JSON -----------------------------------------


def test_a_target_no_layout_splits_is_exit_2_with_json(tmp_path):
    args = ["--world-size", "4", "--pp", "2", "--target-batch", "3", "--json"]
    result = _cli(tmp_path, _profile(), *args)
    assert result.exit_code == 2, result.output
    data = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert data["feasible"] is False and data["exit_code"] == 2
    assert "cannot be split" in data["error"]
    # as without a layout
    plain = _cli(tmp_path, _profile(), "--world-size", "4", "--target-batch", "3", "--json")
    assert plain.exit_code == 2
    assert json.loads(plain.stdout[: plain.stdout.rindex("}") + 1])["exit_code"] == 2


# 6: pipeline options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--virtual-stages", "0"], "--virtual-stages must be a positive integer"),
        (["--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved_1f1b"),
        (["--schedule", "zigzag"], "--schedule must be one of"),
        (["--layout", "manual"], "--layout takes auto"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a positive integer"),
    ],
)
def test_bad_pipeline_options_are_exit_2_naming_the_flag(tmp_path, args, words):
    result = _cli(
        tmp_path, _profile(), "--target-batch", "8", "--world-size", "2", "--pp", "2", *args
    )
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split()), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_layout_request_validates_itself():
    with pytest.raises(SolveRequestError, match="virtual-stages"):
        LayoutRequest(pp=2, virtual_stages=0)
    with pytest.raises(SolveRequestError, match="interleaved_1f1b"):
        LayoutRequest(pp=2, virtual_stages=2)
    assert LayoutRequest(pp=2, virtual_stages=2, schedule="interleaved_1f1b").virtual_stages == 2
    with pytest.raises(SolveRequestError, match="not yet planned with a parallel layout"):
        _request(seq_len=64, layout=LayoutRequest(pp=2))
    with pytest.raises(SolveRequestError, match="effective batch once"):
        SolveRequest(target_batch=8, tokens_per_batch=64, budget_bytes=1)


# 7: huge targets and worlds answer in seconds ----------------------------------------------


def test_huge_targets_and_worlds_answer_quickly():
    start = time.monotonic()
    plan = solve_layout(_profile(), _request(target=10**5), LayoutRequest(pp=2)).plan
    assert plan.target_batch == 10**5 and plan.parallel.pp == 2
    # 10^11 samples through 2 stages: torch.distributed.pipelining allocates a receive
    # buffer per micro-batch (memory.pipeline.pipeline_buffers), 400 B per sample here, so
    # no micro-batch fits 1 GiB; the answer (a refusal naming the least peak) is quick too
    with pytest.raises(NoPlanFitsError) as refused:
        solve_layout(_profile(), _request(target=10**11), LayoutRequest(pp=2))
    assert refused.value.min_peak_bytes >= 10**11 * 400
    with pytest.raises(BadInputError, match="cannot be split"):
        solve_layout(_profile(), _request(world=1_000_000_007), LayoutRequest(auto=True))
    huge = solve_layout(_profile(), _request(target=2**40, world=2**40), LayoutRequest(auto=True))
    assert huge.plan.world_size == 2**40 and huge.plan.parallel.pp <= 4
    assert time.monotonic() - start < 20


# 8: the report of a layout plan charts that plan -------------------------------------------


def test_report_of_a_pipeline_plan_charts_its_worst_stage_without_a_false_warning():
    profile = _profile(8)
    plan = solve_layout(profile, _request(target=16), LayoutRequest(pp=2)).plan
    report = report_for_plan(plan, profile)
    assert report.timeline.peak_bytes == plan.predicted.peak_bytes
    assert not any("changed since" in note for note in report.notes)
    assert any("pipeline stage" in note for note in report.notes)
    assert len(report.profile.layers) == 4  # one stage's blocks


# 9: edited layout plans; ranks verify would start ------------------------------------------


def _layout_plan_data():
    plan = solve_layout(_profile(), _request(), LayoutRequest(pp=2)).plan
    return json.loads(json.dumps(to_data(plan)))


@pytest.mark.parametrize("pp", [8, 2**40])
def test_a_plan_with_more_stages_than_blocks_is_refused_on_load(pp):
    data = _layout_plan_data()
    data["parallel"]["pp"] = pp
    data["world_size"] = pp  # dp 1: still consistent
    with pytest.raises(ProfileError, match=f"is {pp} pipeline stages, but the model has 4 blocks"):
        plan_from_data(data)
    assert plan_from_data(_layout_plan_data()).parallel.pp == 2


def test_verify_refuses_more_ranks_than_the_machine_can_start_before_starting_any():
    from memplan.verify.distributed import verify_distributed
    from memplan.verify.rank_lifetime import startable_cpu_ranks

    most = startable_cpu_ranks()
    data = _layout_plan_data()
    data.update(world_size=2 * (most + 1), target_batch=2 * (most + 1) * 4)
    data["parallel"].update(dp_shard=most + 1)
    plan = plan_from_data(data)
    start = time.monotonic()
    with pytest.raises(
        BadInputError,
        match=f"would start {plan.world_size:,} ranks; this machine can start at most {most:,}",
    ):
        verify_distributed("model.py", plan, device="cpu")
    assert time.monotonic() - start < 5


def test_verify_refuses_pipeline_stages_of_a_model_it_cannot_split_before_starting_ranks():
    from memplan.verify.distributed import verify_distributed

    data = _layout_plan_data()
    data["model_fingerprint"]["hf_blocks"] = []
    with pytest.raises(BadInputError, match="Hugging Face decoder models only"):
        verify_distributed("model.py", plan_from_data(data), device="cpu")


# 10: a profile that predicts a negative peak ----------------------------------------------


def test_huge_optimizer_state_never_solves_to_a_negative_peak():
    profile = _profile(hf=False)
    totals = dataclasses.replace(profile.totals, optimizer_state_bytes=10**12)
    edited = dataclasses.replace(profile, totals=totals)
    with pytest.raises(BadInputError, match="negative peak per rank"):
        solve(edited, _request(strategy="zero1"))


@settings(max_examples=30, deadline=None)
@given(
    state=st.integers(0, 2**62),
    world=st.sampled_from([1, 2, 4]),
    strategy=st.sampled_from(["ddp", "zero1", "zero2", "fsdp"]),
)
def test_any_optimizer_state_solves_to_a_readable_plan_or_a_refusal(state, world, strategy):
    profile = _profile(hf=False)
    edited = dataclasses.replace(
        profile, totals=dataclasses.replace(profile.totals, optimizer_state_bytes=state)
    )
    try:
        plan = solve(edited, _request(target=8, world=world, strategy=strategy)).plan
    except BadInputError:
        return
    except Exception as exc:  # NoPlanFitsError: no plan written
        assert type(exc).__name__ == "NoPlanFitsError"
        return
    assert plan.predicted.peak_bytes >= 0
    assert plan_from_data(json.loads(json.dumps(to_data(plan)))) is not None
    assert plan_to_yaml(plan)


# 12: a profile's seq_len ---------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    length=st.one_of(
        st.integers(-(2**62), 2**62), st.sampled_from([0, -5, 2**40, 2**24, 2**24 + 1, 1])
    )
)
def test_a_profile_seq_len_solves_to_a_readable_plan_or_is_refused(length):
    profile = dataclasses.replace(_profile(hf=False), seq_len=length)
    try:
        plan = solve(profile, _request()).plan
    except BadInputError as exc:
        assert "seq_len" in str(exc)
        assert not 1 <= length <= 2**24
        return
    assert plan.seq_len == length
    from memplan.plan import load_plan  # noqa: F401  (the reader of plan files)

    assert plan_from_data(json.loads(json.dumps(to_data(plan)))).seq_len == length


def test_profile_model_reference_is_kept():
    assert _profile().model == ModelRef(path="synthetic.py")


# 13: when no layout fits, what was not searched and what to try --------------------------


def _refusal(profile, request, ask) -> str:
    with pytest.raises(NoPlanFitsError) as refused:
        solve_layout(profile, request, ask)
    return " ".join(refused.value.hint.split())


def _tp_profile(n: int = 4, **more):
    from profiles_factory import with_tp_measurement

    profile = with_tp_measurement(_profile(n), 0.75, hf_blocks=True)
    return dataclasses.replace(profile, **more)


def test_a_prime_world_says_neither_tp_nor_stages_could_divide_it():
    # 11 ranks: no TP degree from 2 to 8 and no pipeline degree from 2 to 4 blocks divides
    # them, so only dp 11 was searched; --layout auto was given, so it is not suggested
    tiny = dataclasses.replace(_request(target=11, world=11), budget_bytes=1)
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(auto=True))
    assert "no degree from 2 to --gpus-per-node 8 divides 11 ranks; a multiple of 8" in hint
    assert "no degree from 2 to the model's 4 blocks divides 11 ranks" in hint
    assert "--layout auto" not in hint and "larger --tp" not in hint
    # 22 ranks let TP 2 split the blocks: offered with what they would need; at a budget of
    # 1 byte no smaller target helps, so none is offered
    assert "Try more ranks (22 need " in hint and hint.endswith("a rank); a larger --budget.")
    assert "--target-batch" not in hint and "DDP keeps" not in hint


def test_auto_says_why_tp_and_stages_were_not_searched_on_this_profile():
    tiny = dataclasses.replace(_request(target=8, world=8), budget_bytes=1)
    # a profile without a TP measurement, of a model memplan cannot split into stages
    hint = _refusal(_profile(hf=False), tiny, LayoutRequest(auto=True))
    assert "the profile has no TP measurement" in hint
    why = pipeline_refusal_by_kind(_profile(hf=False).model.spec, ())
    assert f"Pipeline stages were not searched ({why.rstrip('.')})" in hint
    # TP measured, but its heads' divisor is 3: none of 2, 4, 8 divides it
    hint = _refusal(_tp_profile(tp_degree_divides=3), tiny, LayoutRequest(auto=True))
    assert "the degrees that divide 8 ranks within a node (2, 4, 8) do not divide the " in hint
    assert "model's 3" in hint
    assert "Pipeline stages" not in hint  # they were searched (and did not fit)


def test_fixed_degrees_suggest_the_search_and_a_larger_degree_only_where_one_runs():
    tiny = dataclasses.replace(_request(target=8, world=8), budget_bytes=1)
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(tp=2))
    assert "Try --layout auto, to search every tp × pp × dp of the ranks;" in hint
    assert "a larger --tp" in hint and "a larger --pp" not in hint
    # tp 8 is the node: no larger TP; pp 2 of 4 blocks on 8 ranks: pp 4 would run
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(tp=8))
    assert "a larger --tp" not in hint
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(pp=2))
    assert "a larger --pp" in hint
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(pp=4))
    assert "a larger --pp" not in hint


def test_the_cli_prints_the_hint_with_exit_1(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(_tp_profile()))
    args = ["solve", str(path), "--budget", "1KiB", "--target-batch", "11", "--world-size", "11"]
    result = CliRunner().invoke(app, [*args, "--layout", "auto"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "no layout of 11 ranks fits" in out
    assert "Tensor parallelism was not searched: no degree from 2 to --gpus-per-node 8" in out


def test_collectives_beside_another_degree_read_as_more_or_less():
    from memplan.solver.layout_explain import collectives_difference

    assert collectives_difference(2.237) == "its collectives take 2237.0 ms more per step"
    assert collectives_difference(-2.237) == "its collectives take 2237.0 ms less per step"
    assert "same time" in collectives_difference(-0.00004)


def test_beside_a_fixed_cp_tp_is_judged_on_the_ranks_cp_leaves():
    # 8 ranks at cp 8 leave 1 for TP: not "no degree divides 8 ranks", which one does
    tiny = dataclasses.replace(_request(target=8, world=8), budget_bytes=1)
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(auto=True, cp=8))
    assert "divides the 1 of 8 ranks that --cp 8 leaves; a multiple of 64 ranks lets" in hint


def test_a_larger_fixed_degree_is_suggested_only_where_the_other_fixed_ones_leave_room():
    # 8 ranks at pp 4 leave 2: tp 2 is all there is, so no "a larger --tp"
    tiny = dataclasses.replace(_request(target=8, world=8), budget_bytes=1)
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(tp=2, pp=4))
    assert "a larger --tp" not in hint and "a larger --pp" not in hint
    hint = _refusal(_tp_profile(), tiny, LayoutRequest(tp=2, pp=2))
    assert "a larger --tp" in hint and "a larger --pp" in hint


# a layout every combination of degrees leaves out says why, per combination ----------------


def test_one_shard_of_a_params_profile_is_named_not_the_divisibility_rules(tmp_path):
    # probed with bf16 parameters (FSDP's mixed-precision policy): tp 8 on 8 ranks leaves
    # one shard. Before, the refusal told the user to make the degrees divide the world and
    # keep tp within a node, which they did.
    profile = _tp_profile(8)
    env = dataclasses.replace(profile.environment, precision="bf16", mixed_precision="params")
    params = dataclasses.replace(profile, environment=env)
    for args in (["--world-size", "8", "--tp", "8"], ["--world-size", "1", "--layout", "auto"]):
        result = _cli(tmp_path, params, "--target-batch", "8", "--strategy", "fsdp", *args)
        text = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert "leaves 1 data-parallel shard" in text and "--mixed-precision params" in text
        assert "Make the degrees divide" not in text
    # degrees that do not divide the world still say so, and the rules stand in the hint
    with pytest.raises(BadInputError, match=r"tp 2 × pp 1 × cp 1 does not divide 3 ranks"):
        solve_layout(profile, _request(target=3, world=3), LayoutRequest(tp=2))


def _least(profile, request, ask):
    from memplan.solver.parallel import least_layout_peak

    return least_layout_peak(profile, request, ask)[0]


def test_more_ranks_and_a_smaller_target_are_offered_only_where_they_help():
    # Before, every refusal ended "Try more ranks, a larger --budget, or a smaller
    # --target-batch", tried or not: a user took them and got the same refusal.
    profile = _profile(4, hf=False)  # no TP measurement, no stages: dp alone
    ddp = _request(target=16, world=2)  # DDP replicas: the model state whole on each
    least = _least(profile, ddp, LayoutRequest(auto=True))
    fewer = _least(profile, dataclasses.replace(ddp, target_batch=2), LayoutRequest(auto=True))
    assert fewer < least  # micro-batch 1 instead of 8: a smaller target needs less
    between = dataclasses.replace(ddp, budget_bytes=(fewer + least) // 2, margin=0.0)
    hint = _refusal(profile, between, LayoutRequest(auto=True))
    assert f"a smaller --target-batch (2 needs {format_bytes(fewer)})" in hint
    # DDP: 4 ranks keep the same state a rank and the same batch a rank: not offered
    assert "Try more ranks" not in hint and "; more ranks" not in hint
    assert "DDP keeps every parameter, gradient and optimizer state whole" in hint
    # below what micro-batch 1 needs, a smaller target is not offered either
    below = dataclasses.replace(ddp, budget_bytes=fewer // 2, margin=0.0)
    hint = _refusal(profile, below, LayoutRequest(auto=True))
    assert "--target-batch" not in hint and hint.endswith("Try a larger --budget.")
    # FSDP over twice the ranks shards the state further: offered, with its figure
    fsdp = dataclasses.replace(below, strategy="fsdp")
    twice = dataclasses.replace(fsdp, world_size=4, target_batch=32)
    more = _least(profile, twice, LayoutRequest(auto=True))
    assert more < _least(profile, fsdp, LayoutRequest(auto=True))
    hint = _refusal(profile, fsdp, LayoutRequest(auto=True))
    assert f"more ranks (4 need {format_bytes(more)} a rank)" in hint and "DDP" not in hint


def test_auto_strategy_searches_ddp_layouts_for_an_autocast_profile():
    # bf16 autocast over fp32 parameters: FSDP's mixed-precision memory is not measured, so
    # --layout auto --strategy auto searches DDP layouts. Before, it refused the profile
    # ("probe again with --mixed-precision params") where --strategy auto alone planned it.
    profile = _tp_profile(4)
    env = dataclasses.replace(profile.environment, precision="bf16", mixed_precision="autocast")
    autocast = dataclasses.replace(profile, environment=env)
    result = solve_layout(
        autocast, _request(target=8, world=4, strategy="auto"), LayoutRequest(auto=True)
    )
    assert result.plan.strategy == "ddp"
    assert {o.parallel.dp_shard for o in result.options} == {1}


def test_a_budget_the_cuda_reserve_takes_whole_is_said_as_that():
    """60 MiB on an H100 spec: the CUDA reserve (over 500 MiB) takes it all. The hint said
    'the model state alone (… 20 MiB) exceeds the budget: shard it across ranks', which
    cannot help, and never named the reserve."""
    from memplan.devices import load_device
    from memplan.solver import least_peak

    profile = uniform_chain(4, saved=[4000] * 4).profile()
    request = SolveRequest(
        target_batch=4, budget_bytes=60 << 20, device_spec=load_device("h100-80gb")
    )
    least = least_peak(profile, dataclasses.replace(request, budget_bytes=1 << 40))
    reserve = least.plan.predicted.breakdown.reserve
    assert reserve > 60 << 20
    with pytest.raises(NoPlanFitsError) as raised:
        solve(profile, request)
    hint = raised.value.hint
    assert f"the CUDA reserve alone ({format_bytes(reserve)}" in hint, hint
    assert "the model state alone" not in hint and "shard it" not in hint
