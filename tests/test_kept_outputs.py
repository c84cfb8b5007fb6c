"""Pipeline outputs an engine version keeps to the step's end (``Parallel.kept_outputs``,
memplan.memory.pipeline.kept_output_bytes): by hand on a chain profile, and measured on 2
gloo ranks with torch 2.13's ``schedule.step(..., return_outputs=True)`` against ``False``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from profiles_factory import uniform_chain, with_loss_part
from tiny_llama import llama_reference

from memplan.memory.parallel import rank_profile
from memplan.memory.pipeline import kept_output_bytes
from memplan.parallel import Parallel
from memplan.plan import Breakdown, Plan, Prediction
from memplan.profile import Affine

LOGITS = 50.0
"""Bytes per sample of the chain's logits: what its loss frees (the (loss) part's negative
saved bytes, memory.pipeline.stage_output_bytes)."""


def _chain():
    profile = uniform_chain(4, saved=[4000] * 4, output=[400] * 4).profile()
    return with_loss_part(profile, LOGITS)


def test_kept_outputs_are_the_last_stage_logits_or_every_stage_output():
    profile = _chain()
    none, last, every = (Parallel(pp=2, kept_outputs=k) for k in ("none", "last", "all"))
    zero = Affine.zero()
    assert kept_output_bytes(profile, none, 1) == (zero, zero)
    # the last stage keeps its logits and merges them; the first keeps nothing under 'last'
    assert kept_output_bytes(profile, last, 1) == (
        Affine(intercept=0.0, slope=LOGITS),
        Affine(intercept=0.0, slope=LOGITS),
    )
    assert kept_output_bytes(profile, last, 0) == (zero, zero)
    # before pytorch#153383 every stage kept its output: stage 0 the hidden state it sends
    assert kept_output_bytes(profile, every, 0) == (Affine(intercept=0.0, slope=400.0), zero)


def test_finished_micro_batches_keep_their_outputs_while_later_ones_run():
    # 1F1B, pp 2, m = 4 micro-batches: the last stage holds one in flight (k = 1), so while
    # gradients are resident up to m − 1 = 3 micro-batches have finished and kept their
    # logits: every grads-resident point of the last stage rises by 3 × 50 B per sample, the
    # first-micro-batch points not at all; stage 0 (k = 2, so m − 2 = 2 finished) keeps its
    # 400 B hidden state per sample only under 'all'.
    profile = _chain()
    m = 4
    base = {stage: rank_profile(profile, Parallel(pp=2), stage, m) for stage in (0, 1)}
    for kept, rises in (("last", {0: 0.0, 1: 3 * LOGITS}), ("all", {0: 2 * 400.0, 1: 3 * LOGITS})):
        for stage in (0, 1):
            rank = rank_profile(profile, Parallel(pp=2, kept_outputs=kept), stage, m)
            for phase, want in (("no_grads", 0.0), ("grads_resident", rises[stage])):
                for old, new in zip(base[stage].timeline[phase], rank.timeline[phase], strict=True):
                    for p, q in zip(old.points, new.points, strict=True):
                        assert q[1] - p[1] == pytest.approx(want), (kept, stage, phase)
                        assert q[0] == pytest.approx(p[0])
    # the optimizer step still holds all m; the merged copy (m more) comes before it
    last = rank_profile(profile, Parallel(pp=2, kept_outputs="last"), 1, m)
    plain = base[1].optimizer_step_peak_bytes
    assert last.optimizer_step_peak_bytes.slope - plain.slope == pytest.approx(2 * m * LOGITS)


def test_kept_outputs_round_trip_through_a_plan_file():
    from yaml import safe_load

    from memplan.plan import plan_from_data, plan_to_yaml

    def plan(parallel: Parallel) -> Plan:
        zero = Breakdown(params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0)
        return Plan(
            target_batch=8,
            micro_batch_size=2,
            accumulation_steps=4,
            world_size=2,
            budget_bytes=1 << 40,
            predicted=Prediction(peak_bytes=0, step_seconds=0.0, breakdown=zero),
            model="m.py",
            parallel=parallel,
        )

    kept = plan(Parallel(pp=2, kept_outputs="last"))
    text = plan_to_yaml(kept)
    assert "kept_outputs: last" in text
    assert plan_from_data(safe_load(text)) == kept
    assert "kept_outputs" not in plan_to_yaml(plan(Parallel(pp=2)))  # plans read as before
    with pytest.raises(ValueError, match="kept_outputs"):
        Parallel(pp=2, kept_outputs="some")


@pytest.mark.slow
def test_return_outputs_measured_on_two_gloo_ranks_within_three_percent(tmp_path):
    # A tiny Llama whose logits outweigh its blocks (vocabulary 4096, hidden 32), pp 2 (1F1B),
    # 4 micro-batches of 2, every block fully checkpointed; verified on 2 gloo ranks as
    # torch 2.13 runs it with return_outputs=False ('none') and True ('last'). Without the
    # rule the 'last' plan predicted the last stage at 4,543,096 B against 6,610,572 B
    # measured (−31.3%); counting the merged copy at the optimizer step whole, 7,142,509 B
    # (+8.0%): the step's merge comes before the optimizer's temporaries.
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.plan import plan_to_yaml
    from memplan.profile import load_profile
    from memplan.solver import SolveRequest
    from memplan.solver.parallel import LayoutRequest, solve_layout

    model = llama_reference(tmp_path / "llama", vocab_size=4096)
    profile_path = tmp_path / "p.yaml"
    runner = CliRunner()
    result = runner.invoke(app, ["probe", model, "--timing-rounds", "1", "-o", str(profile_path)])
    assert result.exit_code == 0, result.output
    profile = load_profile(profile_path)
    request = SolveRequest(
        target_batch=8,
        budget_bytes=1 << 30,
        world_size=2,
        strategy="ddp",
        min_micro=2,
        max_micro=2,
        always_checkpoint=("model.layers.*",),
        modes=("full",),
    )
    last_stage = {}
    for kept in ("none", "last"):
        plan = solve_layout(profile, request, LayoutRequest(pp=2, kept_outputs=kept)).plan
        assert plan.parallel.kept_outputs == kept and plan.accumulation_steps == 4
        path = tmp_path / f"plan-{kept}.yaml"
        path.write_text(plan_to_yaml(dataclasses.replace(plan, profile=str(profile_path))))
        verify = ["verify", model, str(path), "--world-size", "2", "--steps", "1", "--json"]
        result = runner.invoke(app, verify)
        assert result.exit_code in (0, 1), result.output  # 1: a rank outside tolerance
        data = json.loads(result.stdout[result.stdout.index("{") :])
        predicted = data["predicted_rank_peaks"][1]
        measured = data["ranks"][1]["peak_bytes"]
        assert abs(predicted / measured - 1) < 0.03, (kept, predicted, measured)
        last_stage[kept] = measured
    # the kept and merged logits: 2 × 4 micro-batches × 2 samples × 16 × 4096 fp32, beside
    # what the run held anyway; at least the four kept ones
    assert last_stage["last"] - last_stage["none"] > 4 * 2 * 16 * 4096 * 4 * 0.9
