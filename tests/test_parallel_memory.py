"""Per-rank memory of parallel layouts (memplan.memory.parallel) on hand-made chain profiles:
every number below is computed by hand from the chain's sizes."""

from __future__ import annotations

import dataclasses

import pytest
from profiles_factory import uniform_chain, with_loss_part, with_tp_measurement

from memplan.errors import BadInputError
from memplan.memory import plan_peak
from memplan.memory.parallel import layout_peaks, rank_profile, stage_of_rank
from memplan.parallel import Parallel, in_flight, stage_layers
from memplan.plan import Breakdown, Plan, Prediction
from memplan.profile import Affine


def _plan(**kwargs) -> Plan:
    base = {
        "target_batch": 8,
        "micro_batch_size": 2,
        "accumulation_steps": 2,
        "world_size": 2,
        "budget_bytes": 1 << 40,
        "predicted": Prediction(
            peak_bytes=0,
            step_seconds=0.0,
            breakdown=Breakdown(
                params=0, grads=0, optimizer=0, activations=0, transient=0, reserve=0
            ),
        ),
        "model": "m.py",
    }
    base.update(kwargs)
    return Plan(**base)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_a_layout_of_data_parallel_alone_is_todays_model_to_the_byte(strategy):
    profile = uniform_chain(4).profile()
    plain = _plan(strategy=strategy)
    dp = Parallel(dp_replicate=2) if strategy == "ddp" else Parallel(dp_shard=2)
    laid = dataclasses.replace(plain, parallel=dp)
    for plan in (plain, laid):
        assert layout_peaks(profile, plan).worst.peak.allocated_bytes == (
            plan_peak(profile, plain).allocated_bytes
        )


def test_plan_with_layout_counts_samples_over_dp_only():
    plan = _plan(world_size=8, target_batch=8, parallel=Parallel(dp_shard=2, tp=2, pp=2))
    assert plan.data_parallel_ranks == 2
    with pytest.raises(ValueError, match="multiply to 8, not world_size 4"):
        _plan(world_size=4, target_batch=4, parallel=Parallel(dp_shard=2, tp=2, pp=2))


def test_stages_are_contiguous_and_later_stages_take_the_extra_layers():
    assert stage_layers(5, 2) == (range(0, 2), range(2, 5))
    assert stage_layers(8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))


def test_in_flight_micro_batches_by_schedule():
    one_f = Parallel(pp=4)
    assert [in_flight(one_f, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(one_f, 0, 2) == 2  # capped by the micro-batches of a step
    gpipe = Parallel(pp=4, schedule="gpipe")
    assert [in_flight(gpipe, s, 8) for s in range(4)] == [8, 8, 8, 8]


def test_pipeline_stage_holds_its_own_layers_and_k_micro_batches():
    # 4 layers of 1000 B params (grads alike, AdamW 2×), embed 500 B, head 500 B; each
    # layer saves 100 B per sample. pp 2: stage 0 holds layers 0-1 and the embedding.
    spec = uniform_chain(4)
    profile = spec.profile()
    stage0 = rank_profile(profile, Parallel(pp=2), 0, 1)
    assert stage0.layer_names == ("h.0", "h.1")
    assert stage0.totals.params_trainable_bytes == 2 * 1000 + 500
    # 1F1B with 4 micro-batches: stage 0 holds 2 of them, GPipe all 4. Both peak in a
    # later backward, gradients resident, when one has drained under GPipe (3 held; 1F1B
    # still 2): the peak moves by exactly one micro-batch's saved bytes, 2 layers × 100 B × b.
    b = 2
    sizes = {"world_size": 2, "target_batch": 8, "micro_batch_size": b, "accumulation_steps": 4}
    gpipe_layout = Parallel(pp=2, schedule="gpipe")
    peaks_1f1b = layout_peaks(profile, _plan(**sizes, parallel=Parallel(pp=2)))
    peaks_gpipe = layout_peaks(profile, _plan(**sizes, parallel=gpipe_layout))
    assert peaks_1f1b.stages[0].in_flight == 2 and peaks_gpipe.stages[0].in_flight == 4
    diff = peaks_gpipe.stages[0].peak.allocated_bytes - peaks_1f1b.stages[0].peak.allocated_bytes
    assert diff == (3 - 2) * 2 * 100 * b
    assert stage_of_rank(Parallel(pp=2), 0) == 0 and stage_of_rank(Parallel(pp=2), 1) == 1


def test_tensor_parallel_halves_sharded_state_and_the_inside_activations():
    # Every layer's params TP-sharded; 60% of its saved bytes inside the TP region. At tp 2
    # a rank holds half of each layer's 1000 B, and 100·(0.4 + 0.6/2) = 70 B per sample.
    profile = with_tp_measurement(uniform_chain(4).profile(), 0.6)
    rank = rank_profile(profile, Parallel(tp=2), 0, 1)
    assert [layer.params_trainable_bytes for layer in rank.layers] == [500] * 4
    assert rank.layers[0].saved_bytes.at(1) == pytest.approx(70.0)
    # Sequence parallel splits the rest by sequence too, but keeps the two TP regions'
    # all-gathered inputs whole: 2 × output (10 B/sample) = 20% of the 100 B saved, so
    # 100·(1/2 + 0.2·(1 − 1/2)) = 60 B per sample (Megatron's everything/tp would say 50).
    assert profile.layers[0].output_bytes.at(1) - profile.layers[0].output_bytes.at(0) == 10
    sp = rank_profile(profile, Parallel(tp=2, sequence_parallel=True), 0, 1)
    assert sp.layers[0].saved_bytes.at(1) == pytest.approx(60.0)


def test_tensor_parallel_without_a_measurement_is_refused_with_what_to_do():
    profile = uniform_chain(4).profile()
    with pytest.raises(BadInputError, match="no tensor-parallel measurement"):
        rank_profile(profile, Parallel(tp=2), 0, 1)
    with pytest.raises(BadInputError, match="5 stages"):
        rank_profile(profile, Parallel(pp=5), 0, 1)


def test_plan_file_round_trips_its_layout_and_old_plans_load_without_one():
    from memplan.files.schema import safe_load
    from memplan.plan import plan_from_data, plan_to_yaml

    layout = Parallel(dp_shard=2, tp=2, pp=2, sequence_parallel=True, schedule="gpipe")
    plan = _plan(world_size=8, target_batch=8, parallel=layout)
    text = plan_to_yaml(plan)
    assert "parallel:" in text and "sequence_parallel: true" in text
    assert plan_from_data(safe_load(text)) == plan
    old = plan_to_yaml(_plan())
    assert "parallel" not in old and plan_from_data(safe_load(old)).parallel is None


def test_last_stage_keeps_its_output_until_backward():
    # torch.distributed.pipelining keeps the last stage's output (the logits the loss would
    # free: the (loss) part's negative saved bytes, 50 B per sample here) per micro-batch in
    # flight; the last stage of 1F1B holds one: every micro-step point rises by 50 × b.
    profile = uniform_chain(4).profile()
    with_loss = with_loss_part(profile, 50.0)
    b = 2
    sizes = {"world_size": 2, "target_batch": 4, "micro_batch_size": b, "accumulation_steps": 2}
    plan = _plan(**sizes, parallel=Parallel(pp=2))
    before = layout_peaks(profile, plan).stages[1].peak.allocated_bytes
    after = layout_peaks(with_loss, plan).stages[1].peak.allocated_bytes
    assert after - before == 50 * b
    first = layout_peaks(profile, plan).stages[0].peak.allocated_bytes
    assert layout_peaks(with_loss, plan).stages[0].peak.allocated_bytes == first


def test_interleaved_ranks_hold_as_many_blocks_as_their_chunks():
    # 8 blocks, pp 2 × 2 virtual stages: chunks of 2; rank 0 holds chunks 0 and 2 (4 blocks,
    # modelled as blocks 0-3 with the embedding), rank 1 chunks 1 and 3 (blocks 4-7, head).
    profile = uniform_chain(8).profile()
    layout = Parallel(pp=2, schedule="interleaved_1f1b", virtual_stages=2)
    zero, one = (rank_profile(profile, layout, s, 4) for s in (0, 1))
    assert zero.layer_names == ("h.0", "h.1", "h.2", "h.3")
    assert one.layer_names == ("h.4", "h.5", "h.6", "h.7")
    assert [f.name for f in zero.fixed] == ["embed"] and [f.name for f in one.fixed] == ["head"]


def test_a_stage_rank_is_timed_for_its_own_fixed_parts_and_optimizer_share():
    # The whole model's fixed parts take 0.1 s + 0.4 s per sample (embedding 100 FLOPs per
    # sample, head 300, the head split by vocabulary under TP) and its optimizer step 0.5 s.
    # Before, every stage's rank was charged both whole (the 405B pipeline rows: the full
    # head and the whole model's optimizer step on each of 8 stages, 1.40× the published).
    whole = with_tp_measurement(uniform_chain(4).profile(), 0.6)
    embed, head = whole.fixed
    profile = dataclasses.replace(
        whole,
        fixed=(
            dataclasses.replace(embed, fwd_flops=Affine(intercept=0.0, slope=100.0)),
            dataclasses.replace(
                head, fwd_flops=Affine(intercept=0.0, slope=300.0), tp_sharded_bytes=500
            ),
        ),
        step_fixed_seconds=Affine(intercept=0.1, slope=0.4),
        optimizer_step_seconds=Affine(intercept=0.5, slope=0.0),
    )
    # pp 2: stage 0 holds 2 of 4 layers + embedding (2500 of 5000 B params, grads and
    # 5000 of 10000 B AdamW state: half), so half the optimizer step; 100/400 of the fixed.
    zero, one = (rank_profile(profile, Parallel(pp=2), s, 2) for s in (0, 1))
    assert zero.optimizer_step_seconds.at(1) == pytest.approx(0.25)
    assert one.optimizer_step_seconds.at(1) == pytest.approx(0.25)
    assert (zero.step_fixed_seconds.intercept, zero.step_fixed_seconds.slope) == pytest.approx(
        (0.025, 0.1)
    )
    assert (one.step_fixed_seconds.intercept, one.step_fixed_seconds.slope) == pytest.approx(
        (0.075, 0.3)
    )
    # pp 2 × tp 2, stage 1: 2 layers × 500 B + half the head (250 B) = 1250 of 5000 B
    # (state alike): a quarter of the optimizer step; the head's 300 FLOPs halved: 150/400.
    last = rank_profile(profile, Parallel(pp=2, tp=2), 1, 2)
    assert last.optimizer_step_seconds.at(1) == pytest.approx(0.125)
    assert last.step_fixed_seconds.slope == pytest.approx(0.4 * 150 / 400)
