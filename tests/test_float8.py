"""Float8 training as torchao converts a model (issue 34): what a converted linear saves and
casts (bytes by hand), the meta probe against the cpu probe, the float8 matmul peak in the
meta roofline, FSDP2's float8 all-gather in the memory model, and the refusal on a GPU
without float8 tensor cores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8", reason="the 'float8' extra (torchao) is not installed")

from profile_bytes import assert_meta_equals_cpu  # noqa: E402

from memplan import memory  # noqa: E402
from memplan.devices import load_device  # noqa: E402
from memplan.errors import BadInputError  # noqa: E402
from memplan.files.schema import safe_load  # noqa: E402
from memplan.memory.sharding import Sharding  # noqa: E402
from memplan.probe import probe_model  # noqa: E402
from memplan.probe.backends import Backend  # noqa: E402
from memplan.probe.float8 import Float8Conversion  # noqa: E402
from memplan.probe.roofline import Roofline  # noqa: E402
from memplan.probe.tracker import LiveTracker  # noqa: E402
from memplan.profile import profile_from_data, profile_to_yaml  # noqa: E402

MODEL = str(Path(__file__).resolve().parent / "models" / "float8_block.py")
ROWS, DIM = 16, 64


def _linear(device: str, float8: bool) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM, bias=False)).to(device)
    model = model.to(torch.bfloat16)
    return Float8Conversion(skip=()).convert(model) if float8 else model


def _forward(model: torch.nn.Module, device: str) -> tuple[int, int]:
    """(peak bytes above the start during the forward, bytes autograd saved that are not
    the parameter's)."""
    x = torch.ones(ROWS, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = next(model.parameters())
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape == (ROWS, DIM):  # the input (the weight, or its transpose, is 64 x 64)
            saved.append(t.numel() * t.element_size())
        return t

    tracker = LiveTracker(meta=device == "meta")
    tracker.track([weight, x])
    start = tracker.live_bytes
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return tracker.peak_bytes - start, sum(saved)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_float8_linear_saves_its_input_in_bf16_and_casts_in_fp32(device):
    """torchao's matmul_with_hp_or_float8_args saves the high-precision input (2 bytes an
    element, as bf16 does; not the 1-byte cast). Its forward peak, by hand: the input's
    float8 bits (1 byte an element) and its fp32 scale (4 bytes), then the weight's dynamic
    cast (torchao float8_training_tensor.py ``_ToFloat8ConstrFunc``: ``tensor.to(float32) *
    scale``, clamped, then cast) holding the scaled fp32 copy, the clamped fp32 copy and the
    float8 bits at once (4 + 4 + 1 bytes an element), and its scale."""
    peak8, saved8 = _forward(_linear(device, True), device)
    peak16, saved16 = _forward(_linear(device, False), device)
    assert saved8 == saved16 == 2 * ROWS * DIM
    assert peak8 == ROWS * DIM * 1 + 4 + DIM * DIM * (4 + 4 + 1) + 4
    assert peak16 == 2 * ROWS * DIM  # the bf16 output, nothing else


def test_meta_roofline_times_float8_matmuls_at_the_float8_peak():
    """A FLOP-bound matmul on float8 operands is timed at the float8 peak: doubling that
    peak halves its time, and nothing else in the forward moves."""
    n = 4096

    def forward_seconds(fp8_peak: float) -> float:
        model = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False)).to("meta")
        model = Float8Conversion(skip=()).convert(model.to(torch.bfloat16))
        roofline = Roofline(
            flops_by_dtype={torch.bfloat16: 1e15, torch.float8_e4m3fn: fp8_peak},
            default_flops=1e15,
            memory_bandwidth=1e15,
        )
        x = torch.empty(n, n, device="meta", dtype=torch.bfloat16)
        tracker = LiveTracker(roofline=roofline, meta=True)
        with tracker:
            model(x)
        return tracker.virtual_seconds

    flops = 2 * n**3
    assert forward_seconds(2e15) - forward_seconds(4e15) == pytest.approx(flops / 4e15)


@pytest.fixture(scope="module")
def probes():
    return {
        device: probe_model(
            MODEL,
            device=device,
            micro_batches=(1, 2),
            precision="float8",
            timing_rounds=1 if device == "cpu" else 5,  # meta runs no rounds
        )
        for device in ("cpu", "meta")
    }


def test_probe_float8_converts_as_torchtitan_filters(probes):
    cpu = probes["cpu"]
    env = cpu.environment
    assert (env.precision, env.mixed_precision, env.param_dtype) == ("bf16", "params", "bfloat16")
    f8 = env.float8
    assert f8 is not None and f8.recipe == "tensorwise" and f8.fsdp_float8_all_gather
    assert f8.converted == 6  # wq, w1, w2 in each of the two blocks
    assert f8.skipped == (
        "layers.0.gate: 64x4 not divisible by 16",
        "layers.1.gate: 64x4 not divisible by 16",
        "output: filtered ('output')",
    )
    per_block = 2 * (DIM * DIM + DIM * 2 * DIM + 2 * DIM * DIM)  # bf16 weights
    assert [layer.float8_param_bytes for layer in cpu.layers] == [per_block, per_block]
    assert f8.converted_param_bytes == 2 * per_block
    assert all(part.float8_param_bytes == 0 for part in cpu.fixed)  # the head stays bf16
    back = profile_from_data(safe_load(profile_to_yaml(cpu)), source="<test>")
    assert back == cpu


def test_probe_float8_meta_equals_cpu(probes):
    assert_meta_equals_cpu(probes["cpu"], probes["meta"])
    meta, cpu = probes["meta"].environment.float8, probes["cpu"].environment.float8
    assert dataclasses.replace(meta, modelled=()) == dataclasses.replace(cpu, modelled=())
    # the cpu clock is real; the meta clock charges the casts as compiled, and says so
    assert [m.split(" (")[0] for m in cpu.modelled] == [
        "FSDP2 float8 all-gather of the converted weights"
    ]
    assert meta.modelled[1].startswith("the dynamic float8 casts' time, as torch.compile fuses")


def test_fsdp_float8_all_gather_gathers_converted_weights_at_one_byte(probes):
    profile = probes["cpu"]
    per_block = profile.layers[0].float8_param_bytes
    whole = memory.unit_params_bytes(profile, 0)
    assert memory.gathered_unit_bytes(profile, 0) == whole - per_block // 2
    off = dataclasses.replace(
        profile,
        environment=dataclasses.replace(
            profile.environment,
            float8=dataclasses.replace(profile.environment.float8, fsdp_float8_all_gather=False),
        ),
    )
    assert memory.gathered_unit_bytes(off, 0) == whole
    fsdp = Sharding(strategy="fsdp", world_size=4)
    # In a block's forward the root and that block are gathered: the block at one byte a
    # converted element.
    fwd = next(i for i, s in enumerate(profile.timeline["no_grads"]) if s.active == "fwd")
    assert (
        memory.fsdp_gathered_bytes(profile, fsdp, "no_grads", fwd)
        == memory.fsdp_gathered_bytes(off, fsdp, "no_grads", fwd) - per_block // 2
    )


@pytest.mark.parametrize("device", ["a100-80gb", "t4"])
def test_float8_on_a_gpu_without_float8_is_refused_naming_it(device):
    with pytest.raises(BadInputError) as caught:
        Backend(device="meta", precision="float8", spec=load_device(device))
    assert device in caught.value.message and "float8" in caught.value.message
    assert load_device("h100-80gb").peak_flops("float8") == 1979e12


def _plan(profile, **options):
    from memplan.solver import SolveRequest, solve

    request = SolveRequest(
        target_batch=8, budget_bytes=1 << 30, world_size=2, strategy="fsdp", **options
    )
    return dataclasses.replace(solve(profile, request).plan, model=MODEL)


def test_verify_runs_the_float8_plan_on_two_gloo_ranks_as_predicted():
    """The float8 plan on 2 gloo ranks under FSDP2 (bf16 gather: gloo has no float8 dtype),
    every rank's measured peak against the prediction from the cpu probe; one block
    checkpointed, so the recompute's casts run too."""
    from memplan.verify.distributed import verify_distributed

    profile = probe_model(
        MODEL, device="cpu", micro_batches=(1, 2, 4), precision="float8", float8_all_gather=False
    )
    plan = _plan(profile, min_micro=4, always_checkpoint=("layers.0",), modes=("full",))
    assert plan.float8 is not None and plan.checkpoint == {"layers.0": "full"}
    result = verify_distributed(MODEL, plan, steps=1, timeout_s=120)
    assert result.gradient_check.status == "pass", result.gradient_check.reason
    for rank in range(2):
        assert abs(result.rank_error(rank)) < 0.01, (rank, result.rank_error(rank))


def test_verify_refuses_float8_all_gather_on_gloo_before_starting(probes):
    from memplan.verify.distributed import verify_distributed

    with pytest.raises(BadInputError, match="gloo, the CPU backend, has no float8 dtype"):
        verify_distributed(MODEL, _plan(probes["cpu"]), device="cpu", timeout_s=60)


def test_verify_refuses_a_float8_plan_with_tensor_parallel_before_starting(probes):
    """The layout ranks' TP code shards plain linears: a float8 plan under TP ran in bf16
    and its figures were set against the float8 prediction. Refused before any rank starts."""
    from memplan.parallel import Parallel
    from memplan.verify.distributed import verify_distributed

    plan = dataclasses.replace(
        _plan(probes["cpu"]), world_size=4, parallel=Parallel(dp_shard=2, tp=2)
    )
    with pytest.raises(BadInputError, match="verify cannot run a float8 plan with dp 2 × tp 2"):
        verify_distributed(MODEL, plan, device="cpu", timeout_s=60)
