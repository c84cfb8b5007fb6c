"""The step-time model: measured affine times, recompute, roofline for meta profiles."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from profiles_factory import ChainSpec

from memplan import retime, timing
from memplan.devices import DeviceSpec, Efficiency, load_device
from memplan.errors import BadInputError, ProfileError
from memplan.profile import Affine, Environment

GPU = DeviceSpec(
    name="testgpu",
    display_name="Test GPU",
    memory_bytes=10**10,
    bf16_flops=2e12,
    fp16_flops=2e12,
    fp32_flops=1e12,
    memory_bandwidth=1e11,
)


def spec(**kwargs):
    defaults = {
        "fwd_seconds": [0.25, 0.5, 0.125],
        "params": [1, 1, 1],
        "saved": [100] * 3,
        "output": [10] * 3,
        "fixed_seconds": 0.125,
        "optimizer_seconds": 0.5,
    }
    defaults.update(kwargs)
    return ChainSpec(**defaults)


def test_step_seconds_by_hand():
    profile = spec().profile()
    times = retime.micro_step_times(profile, 4)
    # fwd per layer: 1, 2, 0.5 s at b = 4; bwd twice that; fixed 0.125; optimizer 0.5.
    assert times.fwd_seconds == (1.0, 2.0, 0.5)
    assert times.bwd_seconds == (2.0, 4.0, 1.0)
    assert timing.micro_step_seconds(times) == 0.125 + 3.5 + 7.0
    assert timing.recompute_seconds(times, [0, 2]) == 1.5
    # k × (fixed + Σ(fwd + bwd) + recompute) + optimizer
    assert timing.step_seconds(times, 3, [0, 2]) == 3 * (0.125 + 10.5 + 1.5) + 0.5
    assert timing.step_picoseconds(times, 3, [0, 2]) == round((3 * 12.125 + 0.5) * 1e12)


def test_negative_fitted_time_is_clamped_to_zero():
    profile = dataclasses.replace(
        spec().profile(), step_fixed_seconds=Affine(intercept=-1.0, slope=0.1)
    )
    assert retime.micro_step_times(profile, 2).fixed_seconds == 0.0


def test_auto_uses_measured_times():
    profile = spec().profile()
    source, reason = retime.choose_timing_source(profile, GPU)
    assert source == "measured"
    assert "measured" in reason


def meta_profile(device_profile="a100-80gb"):
    profile = spec().profile()
    env = Environment(
        torch_version="t",
        memplan_version="t",
        device="meta",
        device_name="meta",
        device_profile=device_profile,
    )
    return dataclasses.replace(profile, environment=env)


def test_meta_profile_for_another_device_is_timed_by_roofline():
    source, reason = retime.choose_timing_source(meta_profile(), GPU)
    assert source == "roofline"
    assert "Test GPU" in reason
    # Same spec as the probe used: its times stand.
    assert retime.choose_timing_source(meta_profile("testgpu"), GPU)[0] == "measured"
    assert retime.choose_timing_source(meta_profile(), None)[0] == "measured"


def test_the_roofline_reason_names_the_default_spec_a_bare_meta_probe_was_timed_against():
    # probed on meta without --device-profile: timed against memplan's default spec (the
    # profile's device_name says which), planned for no device. Before, the reason said it
    # was "timed against no device".
    bare = meta_profile(None)
    bare = dataclasses.replace(
        bare,
        environment=dataclasses.replace(bare.environment, device_name="meta (timed as h100-80gb)"),
    )
    source, reason = retime.choose_timing_source(bare, GPU)
    assert source == "roofline"
    assert reason.endswith(
        "timed against memplan's default spec, h100-80gb (the probe was given no --device-profile)"
    ), reason
    assert retime.choose_timing_source(meta_profile(None), GPU)[1].endswith(
        "timed against no device spec"
    )


def test_a_meta_profile_knows_its_spec_by_its_numbers_wherever_the_file_is():
    # A spec file's path recorded by the probe no longer exists (moved, another checkout):
    # the recorded fingerprint of the spec's numbers still names it; its name does not count.
    from memplan.devices import spec_digest

    gone = "/nowhere/lab-gpu.yaml"
    renamed = dataclasses.replace(GPU, name="other", display_name="Other")
    profile = meta_profile(gone)
    with_digest = dataclasses.replace(
        profile,
        environment=dataclasses.replace(profile.environment, device_spec_digest=spec_digest(GPU)),
    )
    assert retime.choose_timing_source(profile, GPU)[0] == "roofline"
    assert retime.choose_timing_source(with_digest, GPU)[0] == "measured"
    assert retime.choose_timing_source(with_digest, renamed)[0] == "measured"
    slower = dataclasses.replace(GPU, efficiency=Efficiency(matmul=0.5))
    assert retime.choose_timing_source(with_digest, slower)[0] == "roofline"


@given(
    field=st.sampled_from(
        ["bf16_flops", "fp16_flops", "fp32_flops", "fp8_flops", "memory_bandwidth"]
    ),
    factor=st.floats(min_value=1.0001, max_value=1e6),
    name=st.text(max_size=20),
)
def test_spec_digest_follows_the_numbers_not_the_name(field, factor, name):
    from memplan.devices import spec_digest

    value = getattr(GPU, field) or 1e12  # fp8_flops: none on this GPU, then a figure
    changed = value * factor if isinstance(value, float) else int(value * factor) + 1
    assert spec_digest(dataclasses.replace(GPU, name=name, display_name=name)) == spec_digest(GPU)
    assert spec_digest(dataclasses.replace(GPU, **{field: changed})) != spec_digest(GPU)


@given(
    field=st.sampled_from(["memory_bytes", "interconnect_bandwidth", "host_link_bandwidth"]),
    factor=st.floats(min_value=1.0001, max_value=1e6),
    share=st.floats(min_value=0.01, max_value=1.0),
)
def test_spec_digest_leaves_out_what_the_solver_reads_itself(field, factor, share):
    # A meta probe's clock takes the peaks, the memory bandwidth, the compute capability
    # and the efficiencies; the solver reads the links, the capacity and NCCL's share of
    # the link from the spec it is given. A spec differing only there keeps the clock.
    from memplan.devices import spec_digest, whole_spec_digest

    value = getattr(GPU, field) or 1e9  # a link of 0 (unknown): a rate (devices.MIN_RATE up)
    other = dataclasses.replace(
        GPU,
        **{field: int(value * factor) + 1 if field == "memory_bytes" else value * factor},
        efficiency=dataclasses.replace(GPU.efficiency, interconnect=share),
    )
    assert spec_digest(other) == spec_digest(GPU)
    assert whole_spec_digest(other) != whole_spec_digest(GPU)
    # a capacity at all is a GPU's, whose attention kernels a meta probe models
    assert spec_digest(dataclasses.replace(GPU, memory_bytes=None)) != spec_digest(GPU)
    assert spec_digest(dataclasses.replace(GPU, compute_capability=8.0)) != spec_digest(
        dataclasses.replace(GPU, compute_capability=9.0)
    )
    slower = dataclasses.replace(GPU.efficiency, memory=GPU.efficiency.memory / 2)
    assert spec_digest(dataclasses.replace(GPU, efficiency=slower)) != spec_digest(GPU)


def test_a_meta_clock_survives_a_spec_with_another_interconnect(tmp_path):
    # The profile was timed against a spec file since moved: a copy of the spec with
    # another link rate and NCCL share is the same clock, so its times stand (before: the
    # whole spec was fingerprinted and the profile was re-timed by roofline from FLOPs).
    # A profile written before carries the whole-spec digest, still recognised.
    from memplan.devices import spec_digest, whole_spec_digest

    pcie = dataclasses.replace(
        GPU,
        name="lab-pcie",
        interconnect_bandwidth=64e9,
        efficiency=dataclasses.replace(GPU.efficiency, interconnect=0.5),
    )
    profile = meta_profile(str(tmp_path / "gone.yaml"))
    for digest in (spec_digest(GPU), whole_spec_digest(GPU)):
        recorded = dataclasses.replace(
            profile,
            environment=dataclasses.replace(profile.environment, device_spec_digest=digest),
        )
        assert retime.choose_timing_source(recorded, GPU)[0] == "measured"
    recorded = dataclasses.replace(
        profile,
        environment=dataclasses.replace(profile.environment, device_spec_digest=spec_digest(GPU)),
    )
    assert retime.choose_timing_source(recorded, pcie)[0] == "measured"
    faster = dataclasses.replace(pcie, bf16_flops=2 * GPU.bf16_flops)
    assert retime.choose_timing_source(recorded, faster)[0] == "roofline"


def test_roofline_times_by_hand():
    profile = meta_profile()  # fp32, layer 0: 0.25e9 FLOPs per sample, 1 param byte
    times = retime.micro_step_times(profile, 4, source="roofline", device_spec=GPU)
    flops = 1e9 * 4 * 0.25
    compute = flops / 1e12  # GPU has no efficiency: the datasheet peak itself
    moved = 1 + 4 * 8 + 4 * 100  # params + input (embedding output) + saved
    memory_s = moved / 1e11
    assert times.fwd_seconds[0] == pytest.approx(max(compute, memory_s))
    assert times.bwd_seconds[0] == pytest.approx(2 * times.fwd_seconds[0])
    assert times.source == "roofline"
    assert times.optimizer_step_seconds > 0


def test_roofline_without_a_spec_is_a_bad_input():
    with pytest.raises(BadInputError):
        retime.choose_timing_source(spec().profile(), None, "roofline")


def test_bf16_on_a_device_without_it_is_a_bad_input():
    no_bf16 = dataclasses.replace(GPU, bf16_flops=None)
    profile = meta_profile()
    env = dataclasses.replace(profile.environment, precision="bf16")
    profile = dataclasses.replace(profile, environment=env)
    with pytest.raises(BadInputError, match="bf16"):
        retime.micro_step_times(profile, 2, source="roofline", device_spec=no_bf16)


def test_identical_layers_share_their_mean_time():
    # Three blocks doing the same work (equal FLOPs, params, bytes) timed 0.25, 0.5, 0.125 s
    # per sample by a noisy clock: each is planned with the mean, so noise cannot pick
    # which block to checkpoint.
    profile = spec().profile()
    same = profile.layers[0].fwd_flops
    layers = tuple(dataclasses.replace(layer, fwd_flops=same) for layer in profile.layers)
    times = retime.micro_step_times(dataclasses.replace(profile, layers=layers), 4)
    mean_fwd = (0.25 + 0.5 + 0.125) / 3 * 4
    assert times.fwd_seconds == pytest.approx((mean_fwd,) * 3)
    assert times.bwd_seconds == pytest.approx((2 * mean_fwd,) * 3)


def test_measured_checkpoint_cost_replaces_one_forward():
    # With measured recompute times (forward + backward checkpointed − plain), the cost of
    # checkpointing a layer is that measurement, not one more forward: 0.75 s per sample for
    # layer 0 against its 0.25 s forward.
    profile = spec().profile()
    costs = [0.75, 0.5, 0.25]
    layers = tuple(
        dataclasses.replace(layer, recompute_seconds=Affine(intercept=0.0, slope=cost))
        for layer, cost in zip(profile.layers, costs, strict=True)
    )
    times = retime.micro_step_times(dataclasses.replace(profile, layers=layers), 4)
    assert times.recompute_seconds == (3.0, 2.0, 1.0)
    assert timing.recompute_seconds(times, [0, 2]) == 4.0
    assert timing.step_seconds(times, 2, [0]) == 2 * (0.125 + 3.5 + 7.0 + 3.0) + 0.5
    # Without them (meta, older profiles): one forward, as before.
    assert timing.recompute_seconds(retime.micro_step_times(profile, 4), [0, 2]) == 1.5


# A GPU whose large GEMMs reach half its 1 TFLOP/s fp32 peak and whose memory-bound ops reach
# 80% of its 100 GB/s (memplan.devices.Efficiency; the values here are round, not measured).
HALF = dataclasses.replace(GPU, efficiency=Efficiency(matmul=0.5, attention=0.25, memory=0.8))


def test_roofline_step_time_by_hand_with_device_efficiency():
    # ChainSpec's profile at micro-batch 4, fp32, per sample: layer FLOPs 0.25e9, 0.5e9,
    # 0.125e9 (fwd_seconds × 1e9); each layer moves 1 param byte + its input + 100 saved
    # bytes per sample. Compute time = FLOPs / (1e12 × 0.5): 2 ms, 4 ms, 1 ms forward.
    # Memory time = bytes / (1e11 × 0.8): ~5 ns, far below: every layer is compute-bound.
    profile = meta_profile()
    times = retime.micro_step_times(profile, 4, source="roofline", device_spec=HALF)
    assert times.fwd_seconds == pytest.approx((2e-3, 4e-3, 1e-3), rel=1e-12)
    assert times.bwd_seconds == pytest.approx((4e-3, 8e-3, 2e-3), rel=1e-12)
    # The optimizer step is memory-bound: 2·params + grads + 2·state bytes at 80 GB/s.
    totals = profile.totals
    optimizer_bytes = (
        2 * totals.params_trainable_bytes + totals.grad_bytes + 2 * totals.optimizer_state_bytes
    )
    assert times.optimizer_step_seconds == pytest.approx(optimizer_bytes / 8e10, rel=1e-12)
    # The fixed parts count no FLOPs: memory-bound at 80 GB/s. Embedding: 500 param bytes +
    # 8 saved per sample; head: 500 + 20 per sample; backward moves twice a forward's bytes.
    fixed_bytes = (500 + 8 * 4) + (500 + 20 * 4)
    assert times.fixed_seconds == pytest.approx(3 * fixed_bytes / 8e10, rel=1e-12)
    # Three micro-steps, layers 0 and 2 recomputed (one more forward each).
    micro = times.fixed_seconds + (2e-3 + 4e-3 + 1e-3) * 3 + (2e-3 + 1e-3)
    expected = 3 * micro + optimizer_bytes / 8e10
    assert timing.step_seconds(times, 3, [0, 2]) == pytest.approx(expected, rel=1e-12)
    # Against the datasheet peaks the same step is exactly the compute half as long.
    peak = retime.micro_step_times(profile, 4, source="roofline", device_spec=GPU)
    assert peak.fwd_seconds == pytest.approx((1e-3, 2e-3, 5e-4), rel=1e-12)


def test_shipped_gpu_profiles_carry_a_cited_efficiency():
    # The shipped A100 and H100 files give every efficiency below 1 (each cited in the file);
    # an A100's bf16 matmul at 271.2 of 312 TFLOP/s (the measured MAMF) is 0.869.
    a100 = load_device("a100-80gb")
    assert a100.efficiency == Efficiency(
        matmul=0.869, attention=0.73, attention_backward=0.63, memory=0.88, interconnect=0.767
    )
    assert timing.achievable_flops(a100, "bf16") == pytest.approx(271.128e12)
    h100 = load_device("h100-80gb")
    assert timing.achievable_flops(h100, "bf16") == pytest.approx(794.167e12)
    assert timing.achievable_bandwidth(h100) == pytest.approx(2.814e12)
    # NCCL's bus bandwidth: 230 of the A100's 300 GB/s, 360 of the H100's 450 (nccl-tests
    # issues #149 and #326), the rate the collectives are timed at.
    assert timing.interconnect_bandwidth(a100)[0] == pytest.approx(230.1e9)
    assert timing.interconnect_bandwidth(h100)[0] == pytest.approx(360e9)
    assert timing.communication_seconds(720e9, timing.interconnect_bandwidth(h100)[0]) == (
        pytest.approx(2.0)
    )
    # A file without the field plans at the peaks, as before; attention's backward at its
    # forward's rate where a file gives none.
    assert load_device("l4").efficiency == Efficiency()
    assert timing.interconnect_bandwidth(load_device("l4"))[0] == 32e9
    assert Efficiency(attention=0.6).backward_attention == 0.6
    assert Efficiency(attention=0.6, attention_backward=0.5).backward_attention == 0.5


@pytest.mark.parametrize(
    ("block", "problem"),
    [
        ("efficiency:\n  matmul: 1.3\n", "matmul is 1.3"),
        ("efficiency:\n  memory: 0\n", "memory is 0"),
        ("efficiency:\n  attention_backward: 1.5\n", "attention_backward is 1.5"),
        ("efficiency:\n  interconnect: 0\n", "interconnect is 0"),
        ("efficiency:\n  interconnect: fast\n", "interconnect"),
        ("efficiency:\n  matmull: 0.8\n", "unknown key(s) matmull"),
        ("efficiency: 0.8\n", "must be a mapping"),
    ],
)
def test_bad_efficiency_in_a_device_file_names_the_field(tmp_path, block, problem):
    path = tmp_path / "gpu.yaml"
    path.write_text(
        "name: gpu\ndisplay_name: GPU\nmemory_bytes: 100\nbf16_flops: 1.0e+12\n"
        "fp16_flops: 1.0e+12\nfp32_flops: 1.0e+12\nmemory_bandwidth: 1.0e+9\n" + block
    )
    with pytest.raises(ProfileError) as caught:
        load_device(str(path))
    assert "device.efficiency" in caught.value.message
    assert problem in caught.value.message
    assert str(path) in caught.value.message
    assert caught.value.exit_code == 2


def test_a_spec_of_the_profiles_name_with_other_numbers_is_another_clock():
    # A meta profile timed against GPU (its name and its numbers recorded). The same name
    # with other efficiencies (a later memplan's shipped spec, or an edited copy) is not
    # the profile's clock: re-timed by roofline, and the reason says why. Before, the name
    # alone kept the old clock's times.
    from memplan.devices import spec_digest

    profile = meta_profile(GPU.name)
    recorded = dataclasses.replace(
        profile,
        environment=dataclasses.replace(profile.environment, device_spec_digest=spec_digest(GPU)),
    )
    assert retime.choose_timing_source(recorded, GPU)[0] == "measured"
    newer = dataclasses.replace(GPU, efficiency=Efficiency(matmul=0.5))
    source, reason = retime.choose_timing_source(recorded, newer)
    assert source == "roofline"
    assert f"timed against {GPU.name} with other numbers" in reason
    assert "probe again against this spec" in reason
    # a copy with another interconnect only is the same clock
    linked = dataclasses.replace(GPU, interconnect_bandwidth=1e9)
    assert retime.choose_timing_source(recorded, linked)[0] == "measured"
    # a profile that records no numbers is known by its spec's name, as before
    assert retime.choose_timing_source(profile, newer)[0] == "measured"


@pytest.mark.parametrize(
    ("line", "where", "problem", "hint"),
    [
        # before: taken, and a budget of 80% of it blamed budget_bytes
        ("memory_bytes: -5", "'device'", "memory_bytes is -5; it must be a number above 0", None),
        ("memory_bytes: 0", "'device'", "memory_bytes is 0", None),
        ("memory_bandwidth: 0.0", "'device'", "memory_bandwidth is 0.0", None),
        ("interconnect_bandwidth: -1.0", "'device'", "interconnect_bandwidth is -1.0", None),
        # YAML 1.1 reads an exponent without a dot and a sign as text: say so, and how
        ("fp32_flops: 1e12", "'device.fp32_flops'", "must be a number", "Write 1000000000000."),
        ("memory_bytes: 8e10", "'device.memory_bytes'", "must be an integer", "Write 80000000000."),
        ("efficiency:\n  matmul: 8e-1", "'device.efficiency.matmul'", "number", "Write 0.8."),
        # a quoted number has no exponent to blame: the quotes are what to remove
        (
            'memory_bytes: "80000000000"',
            "'device.memory_bytes'",
            "must be an integer",
            "It is the quoted text '80000000000', not a number. Write 80000000000 without quotes.",
        ),
        (
            'efficiency:\n  matmul: "0.8"',
            "'device.efficiency.matmul'",
            "number",
            "Write 0.8 without quotes.",
        ),
    ],
)
def test_a_device_file_with_an_impossible_number_names_it(tmp_path, line, where, problem, hint):
    fields = {
        "name": "gpu",
        "display_name": "GPU",
        "memory_bytes": "100",
        "bf16_flops": "1.0e+12",
        "fp16_flops": "1.0e+12",
        "fp32_flops": "1.0e+12",
        "memory_bandwidth": "1.0e+9",
    }
    key = line.split(":")[0]
    text = "".join(f"{k}: {v}\n" for k, v in fields.items() if k != key) + line + "\n"
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError) as caught:
        load_device(str(path))
    assert f"field {where}" in caught.value.message and problem in caught.value.message
    assert caught.value.exit_code == 2
    if hint is not None:
        assert caught.value.hint is not None and caught.value.hint.endswith(hint)
