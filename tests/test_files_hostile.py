"""Hand-edited profiles and plans that memplan never writes (sweep F): each is exit 2 naming
the field, and everything memplan writes still loads.

* A: a timeline without segments every probe records (the backward cut off, one layer's
  backward deleted) predicted a third of the measured peak.
* B: ``totals`` counting more optimizer state or gradients than the probe saw live
  lowered a sharded plan's peak per rank.
* H: a plan without a fingerprint escaped the checkpoint-candidate check.
* I: a breakdown with negative parts, or parts past the peak they split.
* Q: a schema 1 profile with schema 2 fields (as a schema 1 plan with them is refused).
* S: probed micro-batches not distinct and ascending.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from profiles_factory import ChainSpec
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import ProfileError
from memplan.plan import load_plan, plan_from_data, plan_to_yaml
from memplan.profile import BOUNDARIES_DIFFERED, load_profile, profile_from_data, profile_to_yaml

ROOT = Path(__file__).resolve().parent.parent
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
LLAMA_PROFILE = ROOT / "examples" / "ci" / "baselines" / "llama7b.profile.yaml"
runner = CliRunner()


def gpt_data() -> dict:
    return yaml.safe_load(GPT_PROFILE.read_text())


def written(tmp_path: Path, data: dict, name: str = "edited.profile.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def refusal(data: dict) -> str:
    with pytest.raises(ProfileError) as caught:
        profile_from_data(data, source="p.yaml")
    return str(caught.value)


# ------------------------------------------------------------------ A: the timeline
def test_a_timeline_cut_to_its_first_segment_is_exit_2_naming_the_forward(tmp_path):
    data = gpt_data()
    for phase in ("no_grads", "grads_resident"):
        data["timeline"][phase] = data["timeline"][phase][:1]
    result = runner.invoke(app, ["solve", str(written(tmp_path, data)), "--target-batch", "16",
                                 "--budget", "64GiB"])  # fmt: skip
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "profile.timeline.no_grads" in text
    assert "lacks segment 1 (held 0, fwd: the forward of layer 0 (blocks.0))" in text
    assert "probe the model again" in text


def test_a_one_deleted_backward_segment_is_refused_naming_the_layer():
    data = gpt_data()
    for phase in ("no_grads", "grads_resident"):
        data["timeline"][phase] = [
            s for s in data["timeline"][phase] if (s["held"], s["active"]) != (3, "bwd")
        ]
    message = refusal(data)
    assert "'profile.timeline.no_grads'" in message
    assert "lacks the backward of layer 3 (blocks.3: a segment held 3, bwd)" in message


def test_a_deleted_segment_after_the_last_forward_is_refused():
    data = gpt_data()
    segments = data["timeline"]["grads_resident"]
    data["timeline"]["grads_resident"] = [
        s for s in segments if (s["held"], s["active"]) != (4, "none")
    ]
    message = refusal(data)
    assert "'profile.timeline.grads_resident' lacks segment 8 (held 4, none" in message


def test_a_profiles_memplan_wrote_and_writes_still_load(tmp_path):
    assert load_profile(GPT_PROFILE).schema_version == 2  # schema 1, meta
    assert len(load_profile(LLAMA_PROFILE).layers) == 32
    chain = ChainSpec().profile()  # the tests' hand-made probe output
    assert profile_from_data(yaml.safe_load(profile_to_yaml(chain))) == chain


def test_a_the_one_warning_that_lets_a_timeline_lack_segments_is_the_probes():
    """A probe leaves segments out only where the sizes ran different layer boundaries
    (``fit_timeline``), and says so in a warning that begins with the words read.py keys
    on: one constant, memplan.profile.BOUNDARIES_DIFFERED."""
    source = (ROOT / "memplan" / "probe" / "alignment.py").read_text()
    assert 'f"{BOUNDARIES_DIFFERED}; segments were aligned by occurrence."' in source
    data = gpt_data()
    for phase in ("no_grads", "grads_resident"):
        data["timeline"][phase] = [s for s in data["timeline"][phase] if s["active"] != "bwd"]
    data["warnings"] = [*data.get("warnings", []), BOUNDARIES_DIFFERED + "; segments were aligned"]
    assert profile_from_data(data).layer_names[0] == "blocks.0"


# ------------------------------------------------------------------ B: totals
def test_b_tripled_optimizer_state_is_refused_against_the_live_bytes():
    data = gpt_data()
    state = data["totals"]["optimizer_state_bytes"]
    data["totals"]["optimizer_state_bytes"] = 3 * state
    message = refusal(data)
    assert f"'profile.totals.optimizer_state_bytes' adds up to {3 * state} bytes" in message
    assert "live at the start of a no_grads micro-step of 1" in message


def test_b_gradients_past_the_trainable_parameters_are_refused():
    data = gpt_data()
    layer = data["layers"][1]
    layer["grad_bytes"] = layer["params_trainable_bytes"] + 1
    message = refusal(data)
    assert "'profile.layers[1].grad_bytes' is" in message
    assert "more than the" in message and "trainable parameters" in message


def test_b_totals_below_the_parts_sum_still_load():
    """A parameter two parts share (a tied head) is in both parts and once in totals."""
    data = gpt_data()
    data["totals"]["optimizer_state_bytes"] //= 2
    data["totals"]["grad_bytes"] //= 2
    data["totals"]["params_trainable_bytes"] //= 2
    assert profile_from_data(data).totals.grad_bytes == gpt_data()["totals"]["grad_bytes"] // 2


# ------------------------------------------------------------------ plans
@pytest.fixture(scope="module")
def solved(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("plans")
    plan = folder / "plan.yaml"
    result = runner.invoke(app, ["solve", str(GPT_PROFILE), "--target-batch", "16", "--budget",
                                 "64GiB", "-o", str(plan)])  # fmt: skip
    assert result.exit_code == 0, result.output
    return plan, yaml.safe_load(plan.read_text())


def plan_refusal(data: dict, tmp_path: Path) -> tuple[int, str]:
    path = tmp_path / "edited.plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = runner.invoke(app, ["show", str(path)])
    return result.exit_code, " ".join(result.output.split())


def test_h_a_plan_without_fingerprint_is_held_to_its_profiles_candidates(solved, tmp_path):
    _, base = solved
    for name, what in (("blocks", "is a container of 4 candidate layers"),
                       ("head", "is not one of the profile's checkpoint candidates")):  # fmt: skip
        data = dict(base, model_fingerprint=None, checkpoint={name: "full"})
        code, text = plan_refusal(data, tmp_path)
        assert code == 2, text
        assert f"plan.checkpoint.{name}' {what}" in text
    # a candidate, or a plan whose profile is not found, loads as before
    ok = dict(base, model_fingerprint=None, checkpoint={"blocks.1": "full"})
    assert plan_from_data(ok).checkpoint == {"blocks.1": "full"}
    lost = dict(base, model_fingerprint=None, checkpoint={"blocks": "full"}, profile="gone.yaml")
    assert plan_from_data(lost).checkpoint == {"blocks": "full"}


def test_h_an_fsdp_plan_without_fingerprint_is_held_to_its_shard_units(solved):
    _, base = solved
    data = dict(base, model_fingerprint=None, checkpoint={"blocks": "full"}, strategy="fsdp",
                shard_units=["blocks.0", "blocks.1"], profile="")  # fmt: skip
    with pytest.raises(ProfileError, match=r"plan\.checkpoint\.blocks' is a container of 2"):
        plan_from_data(data)


def test_i_a_negative_breakdown_part_is_exit_2_naming_it(solved, tmp_path):
    _, base = solved
    data = dict(base, predicted=dict(base["predicted"]))
    data["predicted"]["breakdown"] = dict(base["predicted"]["breakdown"], params=-(10**9))
    code, text = plan_refusal(data, tmp_path)
    assert code == 2
    assert "'plan.predicted.breakdown.params' is -1000000000, a negative number of bytes" in text


def test_i_a_breakdown_past_the_peak_is_refused_and_solves_sum_to_it(solved, tmp_path):
    path, base = solved
    plan = load_plan(path)
    assert plan.predicted.breakdown.total == plan.predicted.peak_bytes  # what solve writes
    data = dict(base, predicted=dict(base["predicted"]))
    data["predicted"]["breakdown"] = dict(base["predicted"]["breakdown"], params=10**10)
    code, text = plan_refusal(data, tmp_path)
    assert code == 2
    assert "'plan.predicted.breakdown' adds up to" in text
    assert f"more than the predicted peak_bytes {plan.predicted.peak_bytes}" in text
    assert plan_from_data(yaml.safe_load(plan_to_yaml(plan))) == plan


# ------------------------------------------------------------------ Q, S
def test_q_a_schema_1_profile_with_schema_2_fields_is_refused_as_a_plan_is(solved, tmp_path):
    data = gpt_data()
    data["seq_len"] = 64
    message = refusal(data)
    assert "'seq_len' is a schema 2 field, but the profile says schema_version 1" in message
    _, base = solved
    code, text = plan_refusal(dict(base, schema_version=1), tmp_path)
    assert code == 2 and "'checkpoint' is a schema 2 field" in text
    assert load_profile(GPT_PROFILE).seq_len is None  # schema 1 without them: unchanged


@pytest.mark.parametrize("sizes", [[1, 1, 1], [4, 2, 1]])
def test_s_micro_batches_not_ascending_are_refused(sizes, tmp_path):
    data = gpt_data()
    data["micro_batches"] = sizes
    result = runner.invoke(app, ["solve", str(written(tmp_path, data)), "--target-batch", "16",
                                 "--budget", "64GiB"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"'profile.micro_batches' is {sizes}, not distinct sizes in ascending order" in " ".join(
        result.output.split()
    )


# ---------------------------------------------------------------- K. not a file, too large
def test_a_device_a_pipe_and_a_huge_file_are_named_as_such(tmp_path: Path) -> None:
    # /dev/zero and a named pipe were "does not exist"; a 2 GiB sparse file was read whole
    # (15 s, 4 GB of memory) before it was found not to be YAML
    import os

    from memplan.files.schema import MAX_FILE_BYTES

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as out:
        out.truncate(MAX_FILE_BYTES + 1)
    said = {}
    for path in ("/dev/zero", str(fifo), str(huge)):
        done = CliRunner().invoke(app, ["show", path])
        assert done.exit_code == 2, done.output
        said[path] = " ".join(done.output.split())
    assert "/dev/zero is not a regular file (a device, a pipe or a socket)" in said["/dev/zero"]
    assert "pipe.yaml is not a regular file" in said[str(fifo)]
    assert f"holds {MAX_FILE_BYTES + 1:,} bytes, more than any memplan" in said[str(huge)]


# ---------------------------------------------------------------- E. absurd seconds
def test_a_layer_time_past_31_years_is_refused_not_memplans_failure(tmp_path: Path) -> None:
    # two layers of 9e29 s each passed the file's own limit (1e30) one by one; their sum,
    # the plan's step time, did not, and solve failed its read-back: exit 3, "memplan's"
    data = gpt_data()
    for layer in data["layers"][:2]:
        layer["fwd_seconds"]["intercept"] = 9e29
    assert "profile.layers[0].fwd_seconds" in refusal(data)
    assert "past 1e+09 s (31 years) a layer" in refusal(data)
    done = runner.invoke(
        app, ["solve", str(written(tmp_path, data)), "--target-batch", "8", "--budget", "8GiB"]
    )
    assert done.exit_code == 2, done.output
