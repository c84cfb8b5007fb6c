"""Per-rank memory of the data-parallel strategies, term by term on hand-made profiles; the
solver's strategy search; the emitters' strategy sections. No torch, no processes."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles_factory import uniform_chain

from memplan import memory, retime, timing
from memplan.collective import Collective
from memplan.devices import DeviceSpec, Efficiency, load_device
from memplan.emit import emit
from memplan.emit.deepspeed import deepspeed_config
from memplan.errors import BadInputError, NoPlanFitsError
from memplan.files.schema import to_data
from memplan.memory import Sharding
from memplan.plan import Breakdown, Plan, Prediction, plan_from_data
from memplan.solver import SolveRequest, SolveRequestError, solve

# uniform_chain(4): layers of 1000 parameter bytes, embedding and head of 500 each:
# params P = 5000 (root unit 1000), gradients G = 5000, AdamW state S = 10000, fp32.
P, G, S, ROOT, UNIT = 5000, 5000, 10000, 1000, 1000


def chain():
    return uniform_chain(4).profile()


def segment_index(profile, phase, where):
    """The first segment whose description is ``where``."""
    for index in range(len(profile.timeline[phase])):
        if memory.describe_segment(profile, phase, index).split(" (")[0] == where:
            return index
    raise AssertionError(f"no segment {where!r}")


# --------------------------------------------------------------------------- terms
def test_shard_bytes_pads_elements_to_a_multiple_of_the_world():
    assert memory.shard_bytes(4000, 2, 4) == 2000
    assert memory.shard_bytes(4000, 3, 4) == 334 * 4  # 1000 elements → 334 per rank
    assert memory.shard_bytes(10, 4, 4) == 4  # 3 elements (rounded up) → 1 per rank
    assert memory.shard_bytes(4000, 1, 4) == 4000


def test_rank_state_by_strategy():
    profile = chain()
    assert memory.root_params_bytes(profile) == ROOT
    for strategy, expected in {
        "ddp": (P, G, S),
        "zero1": (P, G, S // 2),
        "zero2": (P, G // 2, S // 2),
        "fsdp": (P // 2, G // 2, S // 2),
    }.items():
        sharding = Sharding(strategy=strategy, world_size=2)
        assert memory.rank_state_bytes(profile, sharding) == expected, strategy
        assert memory.ddp_bucket_bytes(profile, sharding) == (
            G if strategy in ("ddp", "zero1") else 0
        )


def test_one_rank_of_ddp_is_todays_single_process_model():
    profile = chain()
    for k in (1, 2, 3):
        for b in (1, 4):
            single = memory.step_peak(profile, b, ["h.1"], k)
            one = memory.step_peak(profile, b, ["h.1"], k, sharding=Sharding(world_size=1))
            assert one == single


def test_ddp_buckets_are_resident_in_every_micro_step():
    profile = chain()
    ddp = Sharding(strategy="ddp", world_size=2)
    # Accumulating: the buckets sit beside the accumulated gradients all micro-step long.
    for phase in ("no_grads", "grads_resident"):
        for index in range(len(profile.timeline[phase])):
            assert memory.segment_adjust_bytes(profile, ddp, phase, index, 2) == G
    # One micro-step: every gradient is copied into its bucket view and freed, so the
    # buckets replace the gradients the probe saw appearing.
    for index in range(len(profile.timeline["no_grads"])):
        held = memory.grads_at_bytes(profile, "no_grads", index)
        assert memory.segment_adjust_bytes(profile, ddp, "no_grads", index, 1) == G - held
    # The optimizer steps on the bucket views: no second copy.
    assert memory.optimizer_adjust_bytes(profile, ddp) == 0
    assert (
        memory.optimizer_adjust_bytes(
            profile, Sharding(world_size=2, gradient_as_bucket_view=False)
        )
        == G
    )
    single = memory.step_peak(profile, 4, [], 2).allocated_bytes
    assert memory.step_peak(profile, 4, [], 2, sharding=ddp).allocated_bytes == single + G


def test_zero1_removes_half_the_optimizer_state_on_two_ranks():
    profile = chain()
    zero1 = Sharding(strategy="zero1", world_size=2)
    index = segment_index(profile, "grads_resident", "backward of h.2")
    adjust = memory.segment_adjust_bytes(profile, zero1, "grads_resident", index, 2)
    assert adjust == G - S // 2  # buckets in, half the state out
    # The step's foreach temporaries scale with the parameters a rank updates.
    transient = memory.optimizer_transient_bytes(profile)
    assert memory.optimizer_adjust_bytes(profile, zero1) == -(S // 2) - (transient - transient // 2)


def test_fsdp_by_hand_without_accumulation():
    profile = chain()
    fsdp = Sharding(strategy="fsdp", world_size=2)
    resident_out = (P - P // 2) + (S - S // 2)
    # Forward of h.1: the root and h.1 are gathered; no gradients yet.
    fwd = segment_index(profile, "no_grads", "forward of h.1")
    assert memory.segment_adjust_bytes(profile, fsdp, "no_grads", fwd, 1) == (
        -resident_out + ROOT + UNIT
    )
    # Backward of h.2: the probe held h.3's and the root's gradients (2000 B). A rank holds
    # h.3's shard (500) and its reduce-scatter input, kept until h.2's post_backward
    # (1000), and the root's whole (1000: the root reduces at the end); the root, h.2 and
    # the prefetched h.1 are gathered.
    bwd = segment_index(profile, "no_grads", "backward of h.2")
    assert memory.grads_at_bytes(profile, "no_grads", bwd) == 2000
    assert memory.segment_adjust_bytes(profile, fsdp, "no_grads", bwd, 1) == (
        -resident_out + (ROOT + 2 * UNIT) + (500 + 1000 + 1000) - 2000
    )
    # At the loss the backward begins: the root prefetches the last layer.
    loss = segment_index(profile, "no_grads", "head and loss after h.3")
    assert memory.fsdp_gathered_bytes(profile, fsdp, "no_grads", loss) == ROOT + UNIT
    first = segment_index(profile, "no_grads", "forward before h.0")
    assert memory.fsdp_gathered_bytes(profile, fsdp, "no_grads", first) == ROOT


def test_fsdp_accumulates_unsharded_gradients():
    profile = chain()
    fsdp = Sharding(strategy="fsdp", world_size=2)
    bwd = segment_index(profile, "no_grads", "backward of h.2")
    # With accumulation the first micro-step does not reduce-scatter (no_sync): gradients
    # stay whole and there is no reduce-scatter copy.
    assert memory.segment_adjust_bytes(profile, fsdp, "no_grads", bwd, 2) == (
        -(P - P // 2) - (S - S // 2) + ROOT + 2 * UNIT
    )
    # The optimizer step holds half of everything.
    transient = memory.optimizer_transient_bytes(profile)
    assert memory.optimizer_adjust_bytes(profile, fsdp) == -(P + G + S) // 2 - (
        transient - transient // 2
    )


def test_sharding_lowers_the_peak_in_order():
    profile = chain()
    peaks = [
        memory.step_peak(profile, 4, [], 2, sharding=Sharding(strategy=s, world_size=4)).peak_bytes
        for s in ("ddp", "zero1", "fsdp")
    ]
    assert peaks == sorted(peaks, reverse=True)


def test_breakdown_sums_to_the_peak_per_rank():
    profile = chain()
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        for k in (1, 2):
            peak = memory.step_peak(
                profile, 4, ["h.0"], k, sharding=Sharding(strategy=strategy, world_size=2)
            )
            assert peak.breakdown.total == peak.peak_bytes


# --------------------------------------------------------------------------- time
def test_communication_bytes_per_strategy():
    kw = {"params_bytes": 100, "grads_bytes": 100, "accumulation_steps": 3}
    each = Collective(**kw)
    assert timing.communication_bytes("ddp", 1, each) == 0
    assert timing.communication_bytes("ddp", 4, each) == pytest.approx(150)  # 2 × 3/4 × G
    assert timing.communication_bytes("zero1", 4, each) == pytest.approx(225)
    assert timing.communication_bytes("zero2", 4, each) == pytest.approx(300)
    assert timing.communication_bytes("fsdp", 4, each) == pytest.approx(525)  # 2k AG + RS
    # a pipeline stage's FSDP: gathered once per step, reduced once: (1 + 1) × 3/4 × 100
    once = timing.communication_bytes("fsdp", 4, Collective(**kw, gathered_once=True))
    assert once == pytest.approx(150)


def test_a_pipeline_stages_fsdp_is_charged_one_all_gather_per_step():
    # FSDP over 2 ranks, 4 micro-steps, bandwidth 1e9 B/s: with no reshard after forward
    # and the gradients reduced after the schedule (a pipeline stage's rank, as torch's
    # PipelineStage drives FSDP2) the parameters are gathered once, not 2 × 4 times:
    # 7 all-gathers of ½ × P fewer. Before, the stage solve charged all 8.
    profile = uniform_chain(4).profile()
    ask = request(target_batch=8, world_size=2, strategy="fsdp", min_micro=1, max_micro=1)
    ask = dataclasses.replace(ask, modes=("keep",), data_parallel_bandwidth=1e9)
    per_micro = dataclasses.replace(ask, reduce_after_schedule=True)
    once = dataclasses.replace(per_micro, reshard_after_forward=False)
    steps = [solve(profile, r).plan.predicted.step_seconds for r in (per_micro, once)]
    gathered = memory.gathered_params_bytes(profile)
    assert gathered == 5000  # 4 × 1000 B blocks, 500 B embedding and head
    assert steps[0] - steps[1] == pytest.approx(7 * 0.5 * gathered / 1e9)


def test_fsdp_copy_bytes_by_hand():
    # FSDP2's copy-in (2·P/w), copy-out (2·P) per all-gather and the reduce-scatter's copy-in
    # (2·G) per reduction (torch _fsdp_collectives.py): P = G = 100 B, w = 4, k = 3.
    kw = {"params_bytes": 100, "grads_bytes": 100, "accumulation_steps": 3}
    # 2k = 6 all-gathers × 2 × (100 + 25) + one reduce-scatter × 2 × 100
    every = Collective(**kw, reduce_every_micro_step=True)
    once = Collective(**kw, gathered_once=True)
    assert timing.fsdp_copy_bytes(4, Collective(**kw)) == pytest.approx(6 * 250 + 200)
    assert timing.fsdp_copy_bytes(4, every) == pytest.approx(2100)
    assert timing.fsdp_copy_bytes(4, once) == pytest.approx(250 + 200)
    assert timing.fsdp_copy_bytes(1, Collective(**kw)) == 0.0
    spec = dataclasses.replace(
        load_device("a100-80gb"), memory_bandwidth=1e9, efficiency=Efficiency(memory=0.5)
    )
    assert timing.fsdp_copy_seconds(1700.0, spec) == pytest.approx(1700 / 5e8)
    assert timing.fsdp_copy_seconds(1700.0, None) == 0.0


def test_an_fsdp_plan_on_a_spec_pays_its_copies_and_the_nccl_bus_bandwidth():
    # FSDP over 2 ranks, micro-batch 1, 4 micro-steps, on a spec whose link is 1 GB/s of
    # which NCCL reaches 80% and whose memory-bound ops reach 50% of 1 GB/s. Per step:
    # collectives (2k = 8 all-gathers of P + one reduce-scatter of G) × ½ at 0.8 GB/s, and
    # the copies: 8 × 2 × (P + P/2) + 2·G at 0.5 GB/s. Before, 1 GB/s and no copies.
    profile = uniform_chain(4).profile()
    spec = DeviceSpec(
        name="tiny",
        display_name="Tiny",
        memory_bytes=10**10,
        bf16_flops=1e12,
        fp16_flops=1e12,
        fp32_flops=1e12,
        memory_bandwidth=1e9,
        interconnect_bandwidth=1e9,
        efficiency=Efficiency(memory=0.5, interconnect=0.8),
    )
    ask = request(target_batch=8, world_size=2, strategy="fsdp", min_micro=1, max_micro=1)
    ask = dataclasses.replace(ask, modes=("keep",), device_spec=spec)
    result = solve(profile, ask)
    assert result.plan.accumulation_steps == 4
    params = memory.gathered_params_bytes(profile)
    grads = profile.totals.grad_bytes
    assert (params, grads) == (5000, 5000)  # fp32 throughout: gathered and reduced as kept
    collectives = (8 * 0.5 * params + 0.5 * grads) / 0.8e9
    copies = (8 * 2 * (params + params / 2) + 2 * grads) / 0.5e9
    optimizer = timing.measured_times(profile, 1).optimizer_step_seconds / 2
    assert result.once_seconds == pytest.approx(optimizer + collectives + copies, rel=1e-9)
    # the plan's communication reason names both parts (28.1 µs and 260 µs)
    (reason,) = [r for r in result.plan.reasons if r.startswith("communication:")]
    assert "at 0.8 GB/s (Tiny interconnect at 80% of its line rate" in reason
    assert "FSDP's copy-in/copy-out at memory bandwidth +" in reason


# --------------------------------------------------------------------------- solver
def request(**kwargs):
    defaults = {"target_batch": 8, "budget_bytes": 10**9, "world_size": 2, "margin": 0.0}
    defaults.update(kwargs)
    return SolveRequest(**defaults)


def test_auto_picks_ddp_when_it_fits():
    result = solve(chain(), request(strategy="auto"))
    assert result.plan.strategy == "ddp"
    assert result.plan.shard_units == ()
    assert any("strategy ddp (auto)" in r for r in result.plan.reasons)
    assert {c.strategy for c in result.candidates} == {"ddp", "zero1", "zero2", "fsdp"}


def test_auto_shards_when_ddp_does_not_fit():
    profile = chain()
    ddp_least = min(
        memory.step_peak(
            profile, b, [0, 1, 2, 3], 4 // b, sharding=Sharding(world_size=2)
        ).peak_bytes
        for b in (1, 2, 4)
    )
    result = solve(profile, request(strategy="auto", budget_bytes=ddp_least - 1))
    plan = result.plan
    assert plan.strategy != "ddp"
    assert plan.predicted.peak_bytes < ddp_least
    assert any("ddp needs" in r for r in plan.reasons)
    assert plan.micro_batch_size * plan.accumulation_steps * plan.world_size == 8
    # The same budget with DDP only: nothing fits, and the message says per rank.
    with pytest.raises(NoPlanFitsError, match="per rank"):
        solve(profile, request(strategy="ddp", budget_bytes=ddp_least - 1))


def test_fsdp_plan_names_its_units_and_one_rank_auto_is_ddp():
    plan = solve(chain(), request(strategy="fsdp")).plan
    assert plan.shard_units == ("h.0", "h.1", "h.2", "h.3")
    assert plan.shard_unit_types == ("Block",)
    one = solve(chain(), request(strategy="auto", world_size=1)).plan
    assert one.strategy == "ddp"


def test_single_rank_plans_keep_todays_numbers():
    profile = chain()
    today = solve(profile, request(world_size=1, budget_bytes=30_000))
    assert (
        today.plan.predicted.peak_bytes
        == memory.step_peak(
            profile,
            today.plan.micro_batch_size,
            today.plan.checkpoint_layers,
            today.plan.accumulation_steps,
        ).peak_bytes
    )


def test_bad_strategy_is_a_field_error():
    with pytest.raises(SolveRequestError, match="strategy"):
        request(strategy="zero3")


# --------------------------------------------------------------------------- plan file
def make_plan(**kwargs):
    fields = {
        "target_batch": 32,
        "micro_batch_size": 4,
        "accumulation_steps": 4,
        "world_size": 2,
        "budget_bytes": 1 << 30,
        "model": "m.py",
        "predicted": Prediction(
            peak_bytes=1 << 29,
            step_seconds=1.0,
            breakdown=Breakdown(
                params=1, grads=1, optimizer=1, activations=1, transient=1, reserve=0
            ),
        ),
    }
    fields.update(kwargs)
    return Plan(**fields)


def test_plans_without_a_strategy_still_load_as_ddp():
    data = to_data(make_plan())
    for key in ("strategy", "shard_units", "shard_unit_types"):
        data.pop(key)
    assert plan_from_data(data).strategy == "ddp"
    with pytest.raises(ValueError, match="strategy"):
        make_plan(strategy="zero9")


# --------------------------------------------------------------------------- emitters
@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(1, 4096),
    micro=st.integers(1, 512),
    k=st.integers(1, 64),
    strategy=st.sampled_from(["ddp", "zero1", "zero2", "fsdp"]),
)
def test_deepspeed_batch_rule_for_every_world_size(world, micro, k, strategy):
    plan = make_plan(
        target_batch=micro * k * world,
        micro_batch_size=micro,
        accumulation_steps=k,
        world_size=world,
        strategy=strategy,
    )
    config = json.loads(emit(plan, "deepspeed")[1])
    assert config == deepspeed_config(plan)
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * world
    )
    assert (
        config["zero_optimization"]["stage"]
        == {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}[strategy]
    )


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_accelerate_sections_load(strategy, tmp_path):
    plan = make_plan(
        strategy=strategy,
        device="h100-80gb",
        shard_units=("h.0",) if strategy == "fsdp" else (),
        shard_unit_types=("Block",) if strategy == "fsdp" else (),
    )
    _, text = emit(plan, "accelerate", "m.py")
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    loaded = config_args.ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys
    if strategy == "fsdp":
        assert str(loaded.distributed_type).endswith("FSDP")
        assert loaded.fsdp_config["fsdp_version"] == 2
        assert loaded.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    else:
        assert str(loaded.distributed_type).endswith("DEEPSPEED")
        assert loaded.deepspeed_config["zero_stage"] == int(strategy[-1])
        assert loaded.deepspeed_config["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("units", [(), ("h.0",)], ids=["root-only", "one-block-class"])
def test_accelerate_and_hf_fsdp_wrap_what_the_plan_shards(units, tmp_path, monkeypatch):
    # A model with no layers is planned as FSDP's root unit alone. Before, accelerate was
    # given TRANSFORMER_BASED_WRAP with an empty class list and refused the model ("Could
    # not find the transformer layer class  in the model"); TrainingArguments got an empty
    # transformer_layer_cls_to_wrap under "auto_wrap".
    import torch

    plan = make_plan(
        strategy="fsdp", shard_units=units, shard_unit_types=("Linear",) if units else ()
    )
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    from accelerate.utils import FullyShardedDataParallelPlugin

    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(plan, "accelerate", "m.py")[1])
    fsdp = config_args.ClusterConfig.from_yaml_file(str(path)).fsdp_config
    # as `accelerate launch` passes the file's fsdp_config to the processes
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", fsdp["fsdp_auto_wrap_policy"])
    monkeypatch.setenv(
        "FSDP_TRANSFORMER_CLS_TO_WRAP", fsdp.get("fsdp_transformer_layer_cls_to_wrap", "")
    )
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_auto_wrap_policy(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert (plugin.auto_wrap_policy is None) is (not units)

    import yaml

    hf = yaml.safe_load(emit(plan, "hf", "m.py")[1])
    assert hf["fsdp"] == ("full_shard auto_wrap" if units else "full_shard")
    assert hf["fsdp_config"].get("transformer_layer_cls_to_wrap", []) == (
        ["Linear"] if units else []
    )


def test_torchrun_script_launch_lines_and_strategy():
    plan = make_plan(target_batch=4 * 4 * 16, world_size=16, strategy="fsdp", shard_units=("h.0",))
    _, text = emit(plan, "torchrun", "m.py")
    compile(text, "train_torchrun.py", "exec")
    assert "torchrun --standalone --nproc_per_node 16" in text
    assert "--nnodes 2 --nproc_per_node 8" in text
    # The script shards with memplan's own wrapping code, the code verify runs: no copy.
    assert "from memplan.wrap import wrap_for_plan" in text
    assert "wrap_for_plan(net, plan, make_optimizer, device)" in text
    for copied in ("fully_shard", "set_requires_gradient_sync", "DistributedDataParallel("):
        assert copied not in text
    # The torch script is the same template and loop, with its own docstring.
    _, single = emit(plan, "torch", "m.py")
    body = text[text.index("from __future__") :].replace("train_torchrun", "train_memplan")
    assert single[single.index("from __future__") :] == body
    with pytest.raises(BadInputError, match="cannot write a zero2 plan"):
        emit(make_plan(strategy="zero2"), "torchrun", "m.py")


def test_torchruns_own_parser_reads_the_launch_lines():
    """The docstring's commands, as a user pastes them into a shell (node R = 1, HOST =
    node0), through torch.distributed.run's own argument parser: every rank of the plan is
    launched. The multi-node command ended its first line in two backslashes in the file,
    which a shell reads as a literal backslash, not a continuation."""
    import shlex

    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    plan = make_plan(target_batch=4 * 4 * 16, world_size=16, strategy="fsdp", shard_units=("h.0",))
    _, text = emit(plan, "torchrun", "m.py")
    pasted = text.replace("--node_rank R", "--node_rank 1").replace("HOST", "node0")
    launched = []
    lines = pasted[pasted.index("Launch it:") : pasted.index("Each optimizer")]
    for command in lines.replace("\\\n", " ").splitlines():
        words = shlex.split(command, comments=True)
        if words[:1] != ["torchrun"]:
            continue
        args = get_args_parser().parse_args(words[1:])
        assert (args.training_script, args.training_script_args) == (
            "train_torchrun.py",
            ["--steps", "100"],
        )
        nodes, most = parse_min_max_nnodes(args.nnodes)
        assert nodes == most  # a fixed number of nodes, not elastic
        launched.append(nodes * int(args.nproc_per_node))
        if nodes > 1:
            assert (args.node_rank, args.rdzv_endpoint) == (1, "node0:29500")
    assert launched == [16, 16]


# --------------------------------------------------------------------------- CLI
def test_cli_solve_with_a_strategy_and_verify_refuses_another_world(tmp_path):
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.profile import profile_to_yaml

    profile_path = tmp_path / "chain.profile.yaml"
    profile_path.write_text(profile_to_yaml(chain()))
    runner = CliRunner()
    plan_path = tmp_path / "plan.yaml"
    args = ["solve", str(profile_path), "--target-batch", "8", "--budget", "1GiB"]
    result = runner.invoke(
        app, [*args, "--world-size", "2", "--strategy", "auto", "--json", "-o", str(plan_path)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["strategy"] == "ddp"
    result = runner.invoke(app, [*args, "--strategy", "zero3"])
    assert result.exit_code == 2 and "strategy" in result.output
    result = runner.invoke(app, ["verify", "m.py", str(plan_path), "--world-size", "3"])
    assert result.exit_code == 2 and "--world-size 3" in result.output


def test_a_sharded_rank_steps_its_share_of_the_optimizer():
    # uniform_chain: the optimizer step takes 0.5 s for the whole state. A DDP rank steps
    # all of it; a ZeRO-1, ZeRO-2 or FSDP rank of 4 steps its quarter, 0.125 s. The same
    # micro-steps otherwise: the step times differ by the optimizer's 0.375 s and the
    # collectives' bytes (hundreds of bytes at 10 GB/s: nanoseconds).
    profile = chain()
    steps = {}
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        plan = solve(
            profile, request(strategy=strategy, world_size=4, min_micro=2, max_micro=2)
        ).plan
        assert (plan.micro_batch_size, plan.accumulation_steps) == (2, 1)
        assert plan.checkpoint == {} or not plan.checkpoint
        steps[strategy] = plan.predicted.step_seconds
    for strategy in ("zero1", "zero2", "fsdp"):
        assert steps["ddp"] - steps[strategy] == pytest.approx(0.375, abs=1e-6)
    assert timing.with_optimizer_share(
        retime.micro_step_times(profile, 1), 4, sharded=False
    ).optimizer_step_seconds == pytest.approx(0.5)
