"""Per-layer modes: the plan schema (v2 ``checkpoint:`` mapping, v1 still read), --modes,
the solver's choice and its reasons on hand-computed chains, and memplan.apply in each
mode (gradients equal to the plain run's; offload refused off CUDA)."""

import copy
import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from profiles_factory import ChainSpec

from memplan import host_link, memory, timing
from memplan.errors import BadInputError, NoPlanFitsError, ProfileError
from memplan.modes import parse_modes
from memplan.plan import Breakdown, Plan, Prediction, load_plan, plan_to_yaml
from memplan.profile import Affine
from memplan.run import apply, checkpointed_modes, remove
from memplan.solver import SolveRequest, solve


def plan(**kwargs) -> Plan:
    base = {
        "target_batch": 8,
        "micro_batch_size": 4,
        "accumulation_steps": 2,
        "budget_bytes": 1000,
        "predicted": Prediction(
            peak_bytes=900,
            step_seconds=0.5,
            breakdown=Breakdown(
                params=100, grads=100, optimizer=200, activations=400, transient=100, reserve=0
            ),
        ),
        "model": "m.py",
    }
    return Plan(**{**base, **kwargs})


# --------------------------------------------------------------------------- plan schema
def test_v2_plan_writes_a_mapping_and_round_trips(tmp_path):
    p = plan(checkpoint={"h.0": "selective", "h.1": "keep", "h.2": "full"})
    assert p.checkpoint == {"h.0": "selective", "h.2": "full"}  # keep is not listed
    assert p.checkpoint_layers == ("h.0", "h.2")
    text = plan_to_yaml(p)
    assert "schema_version: 2" in text
    assert "checkpoint:\n  h.0: selective\n  h.2: full\n" in text
    assert "checkpoint_layers" not in text
    (tmp_path / "p.yaml").write_text(text)
    assert load_plan(tmp_path / "p.yaml") == p


def test_v1_plan_still_loads_as_full(tmp_path):
    v2 = plan(checkpoint={"h.0": "full", "h.3": "full"})
    v1 = plan_to_yaml(v2).replace("schema_version: 2", "schema_version: 1")
    v1 = v1.replace("checkpoint:\n  h.0: full\n  h.3: full\n", "checkpoint_layers: [h.0, h.3]\n")
    assert "checkpoint_layers: [h.0, h.3]" in v1
    (tmp_path / "v1.yaml").write_text(v1)
    loaded = load_plan(tmp_path / "v1.yaml")
    assert loaded.schema_version == 2
    assert loaded.checkpoint == {"h.0": "full", "h.3": "full"}
    assert loaded == v2


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("checkpoint:\n  h.0: half\n", "plan.checkpoint.h.0' is 'half'"),
        ("checkpoint: [h.0]\n", "must be a mapping"),
    ],
)
def test_bad_checkpoint_fields_name_the_field(tmp_path, text, needle):
    good = plan_to_yaml(plan(checkpoint={"h.0": "full"}))
    bad = good.replace("checkpoint:\n  h.0: full\n", text)
    (tmp_path / "p.yaml").write_text(bad)
    with pytest.raises(ProfileError, match=needle):
        load_plan(tmp_path / "p.yaml")


def test_a_list_next_to_the_mapping_names_the_layers(tmp_path):
    """As in the dataclass (and in plans as JSON, which carry the derived list)."""
    good = plan_to_yaml(plan(checkpoint={"h.0": "selective"}))
    both = good.replace(
        "checkpoint:\n  h.0: selective\n",
        "checkpoint:\n  h.0: selective\ncheckpoint_layers: [h.0, h.1]\n",
    )
    (tmp_path / "p.yaml").write_text(both)
    assert load_plan(tmp_path / "p.yaml").checkpoint == {"h.0": "selective", "h.1": "full"}


def test_old_callers_naming_layers_get_full_and_replace_keeps_modes():
    p = plan().with_checkpoint_layers(("a", "b"))
    assert p.checkpoint == {"a": "full", "b": "full"}
    q = plan(checkpoint={"a": "selective"}).with_checkpoint_layers(("a", "b"))
    assert q.checkpoint == {"a": "selective", "b": "full"}
    assert q.checkpoint_layers == ("a", "b")
    with pytest.raises(ValueError, match="duplicates"):
        plan().with_checkpoint_layers(("a", "a"))


def test_parse_modes():
    assert parse_modes("full") == ("keep", "full")
    assert parse_modes("offload, selective,keep") == ("keep", "selective", "offload")
    with pytest.raises(BadInputError, match="'half'"):
        parse_modes("keep,half")
    with pytest.raises(BadInputError):
        parse_modes(" , ")


def test_core_modules_stay_torch_free():
    code = "import sys, memplan.modes, memplan.solver; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- the model
def selective_chain(selective_per_sample=(60, 60, 60, 60), selective_seconds=0.05):
    """A 4-layer chain (ChainSpec: saved 100 B/sample, output 10 B/sample, full checkpoint
    frees 90 B/sample for one forward, 0.25 s/sample) where selective frees
    ``selective_per_sample`` for ``selective_seconds`` per sample, and runs like the
    checkpointed layer plus what selective keeps of the running layer (90 − s B/sample).
    Normalised points (profile.py): the all-selective run's live bytes plus the held
    layers' selective savings, which equals the checkpointed layer's normalised points
    plus that difference."""
    spec = ChainSpec()
    profile = spec.profile()
    layers = tuple(
        dataclasses.replace(
            layer,
            selective_savings_bytes=Affine(intercept=0.0, slope=float(s)),
            selective_recompute_seconds=Affine(intercept=0.0, slope=selective_seconds),
            recompute_seconds=Affine(intercept=0.0, slope=0.25),
        )
        for layer, s in zip(profile.layers, selective_per_sample, strict=True)
    )
    timeline = {}
    for phase, segments in profile.timeline.items():
        timeline[phase] = tuple(
            dataclasses.replace(
                seg,
                selective_points=tuple(
                    (p[0], p[1] + (90 - selective_per_sample[seg.held])) for p in seg.ckpt_points
                )
                if seg.active != "none"
                else (),
            )
            for seg in segments
        )
    return dataclasses.replace(profile, layers=layers, timeline=timeline), spec


def test_selective_savings_enter_the_prefix_sum_by_hand():
    profile, _ = selective_chain()
    b = 64  # large enough that the peak is at the head, every layer held (not gradients)
    plain = memory.step_peak(profile, b, [], 1).allocated_bytes
    assert plain == 15500 + 458 * b
    one_sel = memory.step_peak(profile, b, {"h.0": "selective"}, 1).allocated_bytes
    one_full = memory.step_peak(profile, b, {"h.0": "full"}, 1).allocated_bytes
    # The peak is at the head with every layer held: h.0 frees 60 B/sample selective,
    # 90 B/sample full.
    assert plain - one_sel == 60 * b
    assert plain - one_full == 90 * b


def test_solver_picks_selective_where_it_is_enough_and_says_why():
    profile, _ = selective_chain()
    b = 64
    plain = memory.step_peak(profile, b, [], 1).allocated_bytes
    budget = plain - 2 * 60 * b  # two selective layers (or 2 full) are needed, not more
    result = solve(
        profile, SolveRequest(target_batch=b, budget_bytes=budget, margin=0.0, min_micro=b)
    )
    p = result.plan
    assert p.checkpoint == {"h.0": "selective", "h.1": "selective"}
    # selective costs 0.05 s/sample instead of 0.25: 2 × 4 × 0.2 s less than full
    full = solve(
        profile,
        SolveRequest(
            target_batch=b, budget_bytes=budget, margin=0.0, min_micro=b, modes="keep,full"
        ),
    ).plan
    assert full.checkpoint == {"h.0": "full", "h.1": "full"}
    # 2 layers × 64 samples × (0.25 − 0.05) s
    assert math.isclose(full.predicted.step_seconds - p.predicted.step_seconds, 25.6)
    lines = [r for r in p.reasons if r.startswith("h.0:")]
    assert len(lines) == 1 and "selective" in lines[0] and "keep would exceed" in lines[0]
    assert any(r.startswith("layer modes considered: keep, selective, full") for r in p.reasons)


def test_selective_no_faster_than_full_is_never_chosen_and_the_reason_says_so():
    """Selective at 0.25 s/sample (or more) costs what full does and frees less: it is not
    offered, the plan checkpoints in full only, and a reason names the barred layers. At
    0.2499 s/sample it is offered and chosen again."""
    b = 64
    for seconds in (0.25, 0.3):
        profile, _ = selective_chain(selective_seconds=seconds)
        plain = memory.step_peak(profile, b, [], 1).allocated_bytes
        budget = plain - 2 * 60 * b
        request = SolveRequest(target_batch=b, budget_bytes=budget, margin=0.0, min_micro=b)
        p = solve(profile, request).plan
        assert set(p.checkpoint.values()) == {"full"}
        assert any(r.startswith("selective not offered on 4 layer(s)") for r in p.reasons)
        times = timing.measured_times(profile, b)
        assert timing.selective_slower_layers(times) == (0, 1, 2, 3)
    # Just below full's cost it is offered again (and chosen: it is enough and cheaper).
    profile, _ = selective_chain(selective_seconds=0.2499)
    plain = memory.step_peak(profile, b, [], 1).allocated_bytes
    request = SolveRequest(target_batch=b, budget_bytes=plain - 2 * 60 * b, margin=0.0, min_micro=b)
    p = solve(profile, request).plan
    assert p.checkpoint == {"h.0": "selective", "h.1": "selective"}
    assert not any(r.startswith("selective not offered") for r in p.reasons)


def test_mode_seconds_are_medians_of_paired_round_differences():
    """Three rounds of (plain, moded) micro-steps over two layers; round 2 hit a slow
    spell (everything 10× slower). The cost per layer is the median of the per-round
    window differences plus half the median difference outside the layers."""
    from memplan.probe.recorder import LayerRecord, StepRecord
    from memplan.probe.sizes import mode_seconds

    def record(windows, outside, scale=1.0):
        layers, t = [], 0.0
        for fwd, bwd in windows:
            layers.append(
                LayerRecord(fwd_t0=t, fwd_t1=t + fwd * scale, bwd_t0=0.0, bwd_t1=bwd * scale)
            )
            t += fwd * scale
        total = sum((f + b) * scale for f, b in windows) + outside * scale
        return StepRecord(layers=layers, t_start=0.0, t_end=total)

    plain = [
        record([(1, 2), (1, 2)], 1),
        record([(1, 2), (1, 2)], 1, 10),
        record([(1, 2), (1, 2)], 1),
    ]
    moded = [
        record([(2, 4), (1, 5)], 2),
        record([(2, 4), (1, 5)], 2, 10),
        record([(2, 4), (1, 5)], 2),
    ]
    # layer 0: (6 − 3) = 3 per round (30 in the slow one): median 3; layer 1: 3; outside +1
    assert mode_seconds(plain, moded) == pytest.approx((3.5, 3.5))
    assert mode_seconds([], []) == ()


def test_modes_that_cannot_apply_are_refused_with_the_reason():
    profile, _ = selective_chain()
    with pytest.raises(BadInputError, match=r"offload.*CUDA only"):
        solve(profile, SolveRequest(target_batch=4, budget_bytes=10**9, modes="keep,offload"))
    bare = ChainSpec().profile()  # probed without selective
    with pytest.raises(BadInputError, match="selective: the profile has no measurement"):
        solve(bare, SolveRequest(target_batch=4, budget_bytes=10**9, modes="selective"))
    # the default leaves out what the profile lacks, and says so
    reasons = solve(bare, SolveRequest(target_batch=4, budget_bytes=10**9)).plan.reasons
    assert all("layer modes considered" not in r for r in reasons)  # nothing checkpointed


def test_offload_on_a_gpu_plan_is_timed_from_the_host_link_and_capped():
    from memplan.devices import load_device

    profile, _ = selective_chain(selective_per_sample=(0, 0, 0, 0))
    spec = load_device("h100")
    b = 64
    bounds = memory.step_bounds(profile, b, 1, modes=("keep", "offload"))
    assert bounds.host_bytes == (6400,) * 4  # saved 100 B/sample
    times = host_link.offload_seconds(bounds.host_bytes, spec.host_link_bandwidth)
    assert times[0] == pytest.approx(2 * 6400 / 64e9)
    reserve = memory.reserve_for(profile, spec)
    plain = memory.step_peak(profile, b, [], 1).allocated_bytes
    allocated = plain - 90 * b  # one layer must leave
    budget = math.ceil((allocated + reserve.bytes_for(allocated)) / 0.97) + 1
    request = SolveRequest(target_batch=b, budget_bytes=budget, min_micro=b, device_spec=spec)
    p = solve(profile, request).plan
    assert p.checkpoint == {"h.0": "offload"}  # 0.2 µs of copies beat a 16 s recompute
    capped = solve(profile, dataclasses.replace(request, host_memory_bytes=6399)).plan
    assert capped.checkpoint == {"h.0": "full"}
    with pytest.raises(NoPlanFitsError) as raised:
        solve(
            profile,
            dataclasses.replace(request, host_memory_bytes=6399, modes="keep,offload"),
        )
    # the closest plan and the least peak hold to the host cap: no layer's 6,400 B fits in
    # 6,399, so nothing is offloaded and the least peak is the plain one (before, the cap
    # was dropped there: the closest plan offloaded h.0 and the figure was 90·b lower)
    assert raised.value.closest.checkpoint == {}
    assert raised.value.min_peak_bytes == plain + reserve.bytes_for(plain)


def test_no_fit_names_a_plan_within_the_host_where_a_forced_offload_outgrows_it():
    # h.0 must be offloaded (always checkpointed, modes keep and offload): 100 B a sample of
    # host memory, so a micro-batch over 40 outgrows a 4,000 B host. The least peak of all
    # was such a micro-batch's, named with the host limit dropped (found by the brute-force
    # oracle); it is now the least within the host.
    from memplan.devices import load_device

    profile, _ = selective_chain(selective_per_sample=(0, 0, 0, 0))
    spec = load_device("h100")
    request = SolveRequest(
        target_batch=64,
        budget_bytes=1 << 20,
        device_spec=spec,
        modes="keep,offload",
        always_checkpoint=("h.0",),
        host_memory_bytes=4000,
    )
    with pytest.raises(NoPlanFitsError) as raised:
        solve(profile, request)
    closest = raised.value.closest
    assert closest.checkpoint["h.0"] == "offload"
    offloaded = sum(mode == "offload" for mode in closest.checkpoint.values())
    assert 100 * closest.micro_batch_size * offloaded <= 4000  # within the host
    assert raised.value.min_peak_bytes == closest.predicted.peak_bytes


# --------------------------------------------------------------------------- apply
class Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc(self.ln(x)))))


def grads(model, x):
    torch.manual_seed(3)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_apply_runs_each_mode_with_the_plain_gradients():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[Block() for _ in range(3)])
    x = torch.randn(4, 8, 32)
    expected = grads(copy.deepcopy(net), x)
    model = copy.deepcopy(net)
    p = plan(checkpoint={"0": "selective", "1": "full"})
    assert apply(model, p) == ["0", "1"]
    assert checkpointed_modes(model) == {"0": "selective", "1": "full"}
    got = grads(model, x)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    apply(model, {"1": "selective", "2": "selective"})  # idempotent: modes change, 0 restored
    assert checkpointed_modes(model) == {"1": "selective", "2": "selective"}
    assert remove(model) == ["1", "2"]


def test_selective_keeps_matmul_outputs_and_frees_the_rest():
    """Live bytes after the block's forward (memplan's tracker): selective keeps the two
    Linear outputs (addmm: 16·8·128 + 16·8·32 floats) beyond what full checkpointing keeps,
    and recomputes LayerNorm, GELU and dropout, so it keeps less than the plain run."""
    from memplan.probe.tracker import LiveTracker
    from memplan.run.checkpoint import in_mode

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(16, 8, 32, requires_grad=True)

    def held_bytes(mode):
        tracker = LiveTracker(record=False)
        with tracker:
            with in_mode([block], mode):
                y = block(x)
            held = tracker.live_bytes
        del y
        return held

    keep, selective, full = held_bytes("keep"), held_bytes("selective"), held_bytes("full")
    assert selective - full == 4 * 16 * 8 * (128 + 32)
    assert full < selective < keep


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_offload_is_refused_without_cuda():
    model = torch.nn.Sequential(Block())
    with pytest.raises(BadInputError, match="needs a CUDA device"):
        apply(model, {"0": "offload"})
    assert checkpointed_modes(model) == {}


def test_emitted_files_name_each_layers_mode():
    from memplan.emit import emit

    p = plan(checkpoint={"h.0": "selective", "h.1": "full"}, device="cuda")
    _, hf = emit(p, "hf", model_path="m.py")
    assert "2 layers (h.0 selective, h.1 full)" in hf
    assert "gradient_checkpointing: false" in hf
    _, script = emit(p, "torch", model_path="m.py")
    assert "h.0: selective" in script  # the embedded plan, which memplan.apply reads
    _, plain = emit(plan(checkpoint={"h.0": "full"}), "lightning", model_path="m.py")
    assert "1 layer (h.0)" in plain


def test_cli_modes(tmp_path):
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.profile import profile_to_yaml

    profile, _ = selective_chain()
    path = tmp_path / "p.yaml"
    path.write_text(profile_to_yaml(profile))
    b = 64
    budget = memory.step_peak(profile, b, [], 1).allocated_bytes - 2 * 60 * b
    common = ["solve", str(path), "--target-batch", "64", "--budget", str(budget)]
    common += ["--margin", "0", "--min-micro", "64"]

    def run(*extra):
        return CliRunner().invoke(app, [*common, *extra])

    out = tmp_path / "plan.yaml"
    result = run("-o", str(out))
    assert result.exit_code == 0, result.output
    assert load_plan(out).checkpoint == {"h.0": "selective", "h.1": "selective"}
    result = run("--modes", "keep,full", "-o", str(tmp_path / "kf.yaml"))
    assert result.exit_code == 0, result.output
    assert load_plan(tmp_path / "kf.yaml").checkpoint == {"h.0": "full", "h.1": "full"}
    for bad, needle in (("keep,offload", "CUDA only"), ("keep,half", "unknown mode")):
        result = run("--modes", bad)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert needle in " ".join(result.output.split())
    result = run("--host-memory", "lots")
    assert result.exit_code == 2 and "--host-memory" in result.output


def test_the_plan_panel_report_and_check_summary_name_each_layers_mode():
    """A plan mixing modes: the solve panel groups the layers by mode, the report's layer
    table shows each layer's mode with that mode's saving and cost, and check's plan summary
    (and its JSON) records the mode of every layer."""
    from memplan.check.run import _summarise
    from memplan.render import checkpoint_names
    from memplan.report.data import layer_rows
    from memplan.report.page import _layer_table

    profile, _ = selective_chain(selective_per_sample=(60, 30, 30, 30), selective_seconds=0.2)
    b = 64
    plain = memory.step_peak(profile, b, [], 1).allocated_bytes
    budget = plain - 150 * b  # 90 + 60: one full and h.0 selective (0.45 s/sample) is least
    p = solve(
        profile, SolveRequest(target_batch=b, budget_bytes=budget, margin=0.0, min_micro=b)
    ).plan
    assert p.checkpoint == {"h.0": "selective", "h.1": "full"}
    assert checkpoint_names(p) == "h.0 selective, h.1 full"

    times = timing.measured_times(profile, b)
    rows = layer_rows(profile, b, 1, memory.layer_modes(profile, p.checkpoint), times)
    assert [r.mode for r in rows] == ["selective", "full", "keep", "keep"]
    assert [r.savings_bytes for r in rows] == [60 * b, 90 * b, 90 * b, 90 * b]
    assert [r.recompute_seconds for r in rows] == pytest.approx([0.2 * b] + [0.25 * b] * 3)
    table = _layer_table(dataclasses.replace(_report_stub(), layers=rows))
    assert table.count(">selective<") == 1 and table.count(">checkpointed (full)<") == 1
    assert table.count(">kept<") == 2

    summary = _summarise(p, len(profile.layers))
    assert summary.checkpoint == (("h.0", "selective"), ("h.1", "full"))
    assert summary.checkpoint_layers == ("h.0", "h.1")


def _report_stub():
    from memplan.report.data import Report

    fields = {f.name: None for f in dataclasses.fields(Report)}
    return Report(**fields)


def test_the_tie_key_has_room_for_every_mode_and_a_fifth_widens_it():
    from memplan import modes

    # every rank fits in TIE_BITS, the ranks are a permutation, and the width is derived
    assert sorted(modes.TIE_DIGIT.values()) == list(range(len(modes.MODES)))
    assert max(modes.TIE_DIGIT.values()) < 1 << modes.TIE_BITS
    assert max(1, (len(modes.MODE_SPECS) - 1).bit_length()) == modes.TIE_BITS
    # with a fifth mode the rank 4 needs 3 bits: a fixed 2 would spill into the next layer
    assert (5 - 1).bit_length() == 3 > 2
    assert [modes.SPEC[m].name for m in modes.MODES] == list(modes.MODES)
