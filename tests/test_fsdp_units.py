"""torchtitan's FSDP units outside the blocks (``Parallel.fsdp_units`` torchtitan-2507,
memplan.memory.edge_units; issue 31): the embeddings a unit resharded after their forward,
the norm + head a unit reduce-scattered after their backward. By hand on a probed Llama,
in memplan's runtime on 2 gloo ranks, and against torchtitan's own sharding
(tests/test_engines_torchtitan.py, bench/engines.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_llama import llama_reference

from memplan.memory.edge_units import edge_gathered
from memplan.memory.sharding import Sharding, fsdp_gathered_bytes, fsdp_grads_bytes
from memplan.parallel import Parallel
from memplan.profile import Segment

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN = 2048, 32
EMBEDDING = VOCAB * HIDDEN * 4
"""The embedding's fp32 bytes, and the head's (untied): a vocabulary 64× the hidden size so
that they are a tenth of a rank's peak."""


def _memplan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memplan.cli", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("units")
    model = llama_reference(folder / "llama", vocab_size=VOCAB)
    profile = folder / "p.yaml"
    result = _memplan("probe", model, "--timing-rounds", "1", "-o", str(profile))
    assert result.returncode == 0, result.stderr
    from memplan.profile import load_profile

    return model, profile, load_profile(profile)


def _segment(held: int, active: str) -> Segment:
    point = ((0.0, 0.0),)
    return Segment(held=held, active=active, points=point, ckpt_points=point)  # type: ignore[arg-type]


def test_edge_units_are_gathered_where_torchtitan_gathers_them():
    # a 4-block step as the probe records it: the embeddings' segment, the blocks' forwards
    # with segments between them, the head's segment, the backwards, the embeddings' last
    timeline = [_segment(0, "none")]
    for h in range(4):
        timeline += [_segment(h, "fwd"), _segment(h + 1, "none")]
    timeline += [_segment(h, "bwd") for h in (3, 2, 1, 0)] + [_segment(0, "none")]
    started = [False] * 9 + [True] * 5

    def gathered(prefetch: int) -> list[tuple[bool, bool]]:
        return [edge_gathered(timeline, i, 4, started[i], prefetch) for i in range(14)]

    lead_only, tail_only, neither = (True, False), (False, True), (False, False)
    one = gathered(1)
    assert one[0] == lead_only  # the embeddings' forward
    assert one[1:8] == [neither] * 7  # resharded: no block's forward holds them
    assert one[8] == tail_only  # the head: its forward, the loss, its backward
    assert one[9:12] == [neither] * 3  # resharded by its post_backward
    assert one[12] == lead_only  # prefetched when block 0's backward begins
    assert one[13] == lead_only  # their own backward
    two = gathered(2)
    assert two[11] == lead_only and two[10] == neither  # two ahead: from block 1's backward
    assert gathered(0)[12] == neither


def test_gathered_and_gradient_bytes_by_hand(probed):
    _, _, profile = probed
    lead, norm = EMBEDDING, HIDDEN * 4
    with_params = [p.name for p in profile.fixed if p.params_trainable_bytes]
    assert with_params == ["model.embed_tokens", "model.norm", "lm_head"]
    root = Sharding(strategy="fsdp", world_size=2)
    edge = Sharding(strategy="fsdp", world_size=2, edge_units=True)
    segments = profile.timeline["no_grads"]
    n = len(profile.layers)
    head = next(i for i, s in enumerate(segments) if s.held == n)
    for index, segment in enumerate(segments):
        difference = fsdp_gathered_bytes(profile, root, "no_grads", index) - fsdp_gathered_bytes(
            profile, edge, "no_grads", index
        )
        if index == head:  # the head's unit gathered, the embeddings resharded
            assert difference == lead, index
        elif index in (0, len(segments) - 1) or (segment.active == "bwd" and segment.held == 0):
            assert difference == EMBEDDING + norm, index  # only the embeddings gathered
        else:  # neither edge unit
            assert difference == 2 * EMBEDDING + norm, index
    # In the last block's backward the head's unit has reduce-scattered: its shard (half
    # of the head and norm, in fp32) and its reduce-scatter input (whole, kept until the
    # block's post_backward) in place of its unsharded gradients.
    last_bwd = head + 1
    assert segments[last_bwd].active == "bwd" and segments[last_bwd].held == n - 1
    tail = EMBEDDING + norm
    grads = {s: fsdp_grads_bytes(profile, s, "no_grads", last_bwd, 1) for s in (root, edge)}
    shard, scatter_input, unsharded = tail // 2, tail, tail
    assert grads[edge] - grads[root] == shard + scatter_input - unsharded


@pytest.mark.slow
def test_memplan_runs_torchtitans_units_and_predicts_them_within_three_percent(probed, tmp_path):
    # probe → solve (FSDP on 2 ranks, each rule) → verify on 2 gloo ranks: memplan's runtime
    # shards as the plan says, and each rank's peak is within 3% of the prediction.
    model, profile, _ = probed
    runs = {}
    for units in ("memplan", "torchtitan-2507"):
        plan = tmp_path / f"plan-{units}.yaml"
        solved = _memplan(
            "solve", str(profile), "--budget", "1GiB", "--target-batch", "8",
            "--world-size", "2", "--strategy", "fsdp", "--fsdp-units", units, "-o", str(plan),
        )  # fmt: skip
        assert solved.returncode == 0, solved.stderr
        verified = _memplan(
            "verify", model, str(plan), "--world-size", "2", "--steps", "1", "--json"
        )
        assert verified.returncode == 0, verified.stderr
        runs[units] = json.loads(verified.stdout)
    for units, data in runs.items():
        assert data["gradient_check"]["status"] == "pass", units
        assert all(abs(e) <= 0.03 for e in data["rank_errors"]), (units, data["rank_errors"])
    # the prediction differs by the embeddings' gathered bytes at the peak (the head's
    # segment), and the ranks really hold less: the runtime sharded them so
    root, edge = runs["memplan"], runs["torchtitan-2507"]
    assert root["predicted_peak_bytes"] - edge["predicted_peak_bytes"] == EMBEDDING
    assert root["measured_peak_bytes"] - edge["measured_peak_bytes"] >= EMBEDDING


def test_edge_modules_of_a_llama_and_of_a_tied_gpt2():
    import transformers

    from memplan.run.wrap import edge_modules

    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128,
        )
    )  # fmt: skip
    units = ("model.layers.0", "model.layers.1")
    lead, tail = edge_modules(llama, units)
    assert lead == [llama.model.embed_tokens]
    assert tail == [llama.model.norm, llama.lm_head]
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    )
    lead, tail = edge_modules(gpt2, ("transformer.h.0", "transformer.h.1"))
    assert lead == [gpt2.transformer.wte, gpt2.transformer.wpe]
    assert tail == [gpt2.transformer.ln_f, gpt2.lm_head]
    # the tied head shares the embeddings' weight: memplan's runtime makes one unit of them
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight


def test_fsdp_units_in_the_layout_the_plan_file_and_the_command_line(probed, tmp_path):
    from plan_factory import hand_plan

    from memplan.emit import emit
    from memplan.plan import load_plan, plan_to_yaml

    with pytest.raises(ValueError, match="fsdp_units must be one of memplan, torchtitan-2507"):
        Parallel(dp_shard=2, fsdp_units="torchtitan")  # type: ignore[arg-type]
    layout = Parallel(dp_shard=2, fsdp_units="torchtitan-2507")
    assert "dp 2 (torchtitan-2507 units)" in layout.describe()
    plan = hand_plan("m.py", parallel=layout, strategy="fsdp")
    text = plan_to_yaml(plan)
    assert "fsdp_units: torchtitan-2507" in text
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    assert load_plan(path).parallel.fsdp_units == "torchtitan-2507"
    default = hand_plan("m.py", parallel=Parallel(dp_shard=2), strategy="fsdp")
    assert "fsdp_units" not in plan_to_yaml(default)  # plans read as before
    # --format torchtitan says what a plan with memplan's units leaves out
    _, note = emit(default, "torchtitan", "m.py")
    assert "--fsdp-units torchtitan-2507" in note
    _, none = emit(plan, "torchtitan", "m.py")
    assert "--fsdp-units torchtitan-2507" not in none
    # a bad value on the command line: exit 2, naming the option, nothing written
    out = tmp_path / "bad.yaml"
    result = _memplan(
        "solve", str(probed[1]), "--budget", "1GiB",
        "--target-batch", "4", "--world-size", "2", "--strategy", "fsdp",
        "--fsdp-units", "torchtitan", "-o", str(out),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--fsdp-units must be one of memplan, torchtitan-2507" in result.stderr
    assert not out.exists()
    # units are FSDP's: with DDP or ZeRO-2 the option is refused (it changed no byte, yet
    # the plan recorded it and its layout read "torchtitan-2507 units"), and so is a plan
    # file that pairs them
    for strategy in ("ddp", "zero2"):
        result = _memplan(
            "solve", str(probed[1]), "--budget", "1GiB",
            "--target-batch", "4", "--world-size", "2", "--strategy", strategy,
            "--fsdp-units", "torchtitan-2507", "-o", str(out),
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        message = " ".join(result.stderr.split())  # rich wraps at the terminal's width
        assert f"strategy is {strategy}, which has no FSDP units" in message
        assert not out.exists()
    with pytest.raises(ValueError, match="fsdp_units 'torchtitan-2507' needs strategy fsdp"):
        hand_plan("m.py", parallel=layout, strategy="zero2")


def test_no_embeddings_by_name_is_refused_and_a_tied_head_is_one_unit(probed, tmp_path):
    import dataclasses

    from memplan.memory.edge_units import edge_refusal
    from memplan.memory.sharding import gathered_edge_bytes
    from memplan.profile import profile_to_yaml

    _, _, profile = probed
    assert edge_refusal(profile) is None
    assert gathered_edge_bytes(profile) == (EMBEDDING, EMBEDDING + HIDDEN * 4)
    renamed = dataclasses.replace(
        profile,
        fixed=tuple(
            dataclasses.replace(p, name="model.lut") if p.name == "model.embed_tokens" else p
            for p in profile.fixed
        ),
    )
    said = edge_refusal(renamed)
    assert said is not None and "model.lut, model.norm, lm_head" in said
    assert gathered_edge_bytes(renamed) is None
    path = tmp_path / "renamed.yaml"
    path.write_text(profile_to_yaml(renamed))
    out = tmp_path / "plan.yaml"
    result = _memplan(
        "solve", str(path), "--budget", "1GiB", "--target-batch", "8", "--world-size", "2",
        "--strategy", "fsdp", "--fsdp-units", "torchtitan-2507", "-o", str(out),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "named like embeddings" in result.stderr and "--fsdp-units memplan" in result.stderr
    assert not out.exists()
    # a head tied to the embeddings is counted in both parts: one unit, as the root, as
    # torchtitan (enable_weight_tying) and memplan's runtime group them
    tied = dataclasses.replace(
        profile,
        fixed=tuple(
            dataclasses.replace(p, params_trainable_bytes=EMBEDDING + HIDDEN * 4)
            if p.name == "model.norm"
            else p
            for p in profile.fixed
        ),
    )
    assert gathered_edge_bytes(tied) is None
    root = Sharding(strategy="fsdp", world_size=2)
    edge = Sharding(strategy="fsdp", world_size=2, edge_units=True)
    for index in range(len(tied.timeline["no_grads"])):
        assert fsdp_gathered_bytes(tied, edge, "no_grads", index) == fsdp_gathered_bytes(
            tied, root, "no_grads", index
        )


@pytest.mark.slow
def test_a_tied_gpt2_on_fsdp_counts_its_head_once(tmp_path):
    # GPT-2 ties its head to the embeddings: the probe counts the weight in both parts. A
    # layout rank's totals (memory.pipeline.rank_totals) had it twice, and FSDP 2 was
    # planned 11.7% over (1,563,972 B predicted, 1,400,212 measured).
    from memplan.memory.parallel import rank_profile
    from memplan.profile import load_profile

    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32,
        "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 64,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    model = f"hf:{folder}?task=causal-lm&seq-len=16"
    profile_path, plan = tmp_path / "p.yaml", tmp_path / "plan.yaml"
    assert _memplan("probe", model, "--timing-rounds", "1", "-o", str(profile_path)).returncode == 0
    profile = load_profile(profile_path)
    head = 512 * 32 * 4
    counted = sum(p.params_trainable_bytes for p in (*profile.layers, *profile.fixed))
    assert counted - profile.totals.params_trainable_bytes == head  # the tied weight twice
    rank = rank_profile(profile, Parallel(dp_shard=2), 0, 1)
    assert rank.totals.params_trainable_bytes == profile.totals.params_trainable_bytes
    assert rank.totals.grad_bytes == profile.totals.grad_bytes
    solved = _memplan(
        "solve", str(profile_path), "--budget", "1GiB", "--target-batch", "8",
        "--world-size", "2", "--strategy", "fsdp", "--tp", "1", "-o", str(plan),
    )  # fmt: skip
    assert solved.returncode == 0, solved.stderr
    verified = _memplan("verify", model, str(plan), "--world-size", "2", "--steps", "1", "--json")
    assert verified.returncode == 0, verified.stderr
    data = json.loads(verified.stdout)
    assert all(abs(e) <= 0.03 for e in data["rank_errors"]), data["rank_errors"]
