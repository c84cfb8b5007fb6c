"""``memplan calibrate``: FLOPs counted as memplan's roofline counts them (by hand here), rates
and efficiencies from a timer (a test's, then the real one on this CPU), the spec written
only when it is one memplan reads back, and bad input refused before a minute of measuring."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.cli import app
from memplan.devices import (
    MIN_RATE,
    DeviceSpec,
    Efficiency,
    Measurement,
    calibrated_spec,
    calibrated_yaml,
    load_device,
)
from memplan.errors import BadInputError, CannotMeasureError
from memplan.files.schema import to_data
from memplan.probe.calibrate import Sizes, counted_flops, measure

runner = CliRunner()

BIG_PEAKS = """name: big
display_name: a CPU with generous peaks
memory_bytes: null
bf16_flops: 1.0e+14
fp16_flops: 1.0e+14
fp32_flops: 1.0e+14
memory_bandwidth: 1.0e+13
interconnect_bandwidth: 10.0e+9
efficiency: {interconnect: 0.5}
"""


def _base(tmp_path: Path, text: str = BIG_PEAKS) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(text)
    return path


def invoke(*args: object):
    return runner.invoke(app, ["calibrate", *map(str, args)], catch_exceptions=False)


# ------------------------------------------------------------------ FLOPs, rates, the best


def test_flops_are_counted_as_the_roofline_counts_them():
    n = 64
    a, b = torch.randn(n, n), torch.randn(n, n)
    assert counted_flops(lambda: torch.mm(a, b)) == 2 * n**3
    batch, heads, seq, dim = 2, 3, 32, 16
    q, k, v = (torch.randn(batch, heads, seq, dim, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # forward: QKᵀ and PV, 2·s·s·d FLOPs each per head (the CPU flash kernel: memplan's alias)
    assert counted_flops(lambda: sdpa(q, k, v)) == 4 * batch * heads * seq * seq * dim
    out = sdpa(q, k, v)
    grad = torch.randn_like(out)
    # backward: the scores again, then dV, dP, dQ and dK: five such products (2.5 forwards)
    backward = counted_flops(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    assert backward == 10 * batch * heads * seq * seq * dim


def test_rates_are_counted_work_over_the_timers_seconds_and_the_best_size_wins():
    sizes = Sizes(matmul=(16, 32), attention=((1, 2, 16, 8), (1, 2, 32, 8)), copy_bytes=4096)
    seconds = {  # the larger GEMM slower per call but faster per FLOP; the smaller attention wins
        ("matmul", "16x16x16 fp32"): 1e-3,
        ("matmul", "32x32x32 fp32"): 4e-3,
        ("attention", "batch 1 x 2 heads x 16 x head dim 8 fp32"): 1e-4,
        ("attention", "batch 1 x 2 heads x 32 x head dim 8 fp32"): 1e-3,
        ("attention_backward", "batch 1 x 2 heads x 16 x head dim 8 fp32"): 5e-4,
        ("attention_backward", "batch 1 x 2 heads x 32 x head dim 8 fp32"): 2e-3,
        ("memory", "copy of 4,096 B"): 2e-6,
    }
    heard = []
    found = measure(
        torch.device("cpu"),
        "fp32",
        sizes,
        timer=lambda run, kind, shape: (run(), seconds[(kind, shape)])[1],
        on_done=heard.append,
    )
    assert found == heard
    rate = {m.kind: (m.rate, m.shape) for m in found}
    assert rate["matmul"] == (2 * 32**3 / 4e-3, "32x32x32 fp32")  # 16.4 > 8.2 MFLOP/s
    small = 4 * 2 * 16 * 16 * 8  # FLOPs of the 16-token forward
    assert rate["attention"][0] == pytest.approx(small / 1e-4)
    assert rate["attention"][1].endswith("x 16 x head dim 8 fp32")
    assert rate["attention_backward"][0] == pytest.approx(2.5 * small / 5e-4)
    assert rate["memory"] == (2 * 4096 / 2e-6, "copy of 4,096 B")  # read and write


def test_a_timer_that_gives_no_time_is_memplans_failure():
    sizes = Sizes(matmul=(8,), attention=((1, 1, 8, 8),), copy_bytes=64)
    with pytest.raises(CannotMeasureError, match="timing matmul"):
        measure(torch.device("cpu"), "fp32", sizes, timer=lambda run, kind, shape: 0.0)
    with pytest.raises(CannotMeasureError, match="timing matmul"):
        measure(torch.device("cpu"), "fp32", sizes, timer=lambda run, kind, shape: math.nan)


# ------------------------------------------------------------------ the spec


def _spec(**peaks: float) -> DeviceSpec:
    return DeviceSpec(
        name="base",
        display_name="Base GPU",
        memory_bytes=80 << 30,
        bf16_flops=peaks.get("bf16", 1000e12),
        fp16_flops=1000e12,
        fp32_flops=60e12,
        memory_bandwidth=peaks.get("memory", 3e12),
        interconnect_bandwidth=450e9,
        efficiency=Efficiency(matmul=0.8, interconnect=0.8),
    )


def _measured(matmul: float, attention: float, backward: float, memory: float):
    return [
        Measurement(kind="matmul", rate=matmul, shape="m"),
        Measurement(kind="attention", rate=attention, shape="a"),
        Measurement(kind="attention_backward", rate=backward, shape="b"),
        Measurement(kind="memory", rate=memory, shape="c"),
    ]


def _calibrate(measured, base=None, label="b"):
    return calibrated_spec(
        base or _spec(),
        measured,
        precision="bf16",
        name="x",
        display_name="x",
        base_label=label,
    )


def test_the_spec_keeps_the_base_and_takes_the_measured_fractions():
    base = _spec()
    spec = calibrated_spec(
        base,
        _measured(700e12, 400e12, 300e12, 2.4e12),
        precision="bf16",
        name="mine",
        display_name="Base GPU, calibrated",
        base_label="base",
    )
    assert spec.efficiency == Efficiency(
        matmul=0.7, attention=0.4, attention_backward=0.3, memory=0.8, interconnect=0.8
    )
    assert (spec.name, spec.memory_bytes, spec.bf16_flops) == ("mine", 80 << 30, 1000e12)
    assert spec.interconnect_bandwidth == base.interconnect_bandwidth
    text = calibrated_yaml(spec, ["measured here", "", "  matmul: 7e+14 FLOP/s at m"])
    assert text.startswith("# measured here\n#\n#   matmul: 7e+14 FLOP/s at m\n")


def test_a_rate_above_the_bases_peak_is_refused_naming_the_peak():
    with pytest.raises(BadInputError, match=r"bf16_flops is 1e\+15") as info:
        _calibrate(_measured(1.2e15, 400e12, 300e12, 2.4e12), label="profiles/devices/base.yaml")
    assert "not this device's" in str(info.value)
    with pytest.raises(BadInputError, match="memory_bandwidth"):
        _calibrate(_measured(1e14, 1e14, 1e14, 4e12), label="b")


def test_a_missing_or_non_finite_measurement_is_memplans_failure():
    with pytest.raises(CannotMeasureError, match="no memory"):
        _calibrate(_measured(1e14, 1e14, 1e14, 1e12)[:3], label="b")
    with pytest.raises(CannotMeasureError, match="attention rate is nan"):
        _calibrate(_measured(1e14, math.nan, 1e14, 1e12), label="b")


rates = st.floats(min_value=1e-300, max_value=1e29, allow_nan=False, allow_infinity=False)
# a base spec memplan reads has its peaks below 1e30 (files.schema.LARGEST_FLOAT) and at
# least devices.MIN_RATE
peaks = st.floats(min_value=MIN_RATE, max_value=1e29, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(rates, rates, rates, rates, peaks, peaks)
def test_any_rates_give_a_readable_spec_or_a_refusal(matmul, attention, backward, memory, peak, bw):
    base = _spec(bf16=peak, memory=bw)
    try:
        spec = calibrated_spec(
            base,
            _measured(matmul, attention, backward, memory),
            precision="bf16",
            name="x",
            display_name="x",
            base_label="b",
        )
    except BadInputError:  # over the peak, or too small a fraction of it to be this device's
        fractions = (matmul / peak, attention / peak, backward / peak, memory / bw)
        assert max(fractions) > 1 or min(fractions) < 1e-9
        return
    for kind, rate, over in (
        ("matmul", matmul, peak),
        ("attention", attention, peak),
        ("attention_backward", backward, peak),
        ("memory", memory, bw),
    ):
        value = getattr(spec.efficiency, kind)
        assert 0 < value <= 1
        assert value == pytest.approx(rate / over, rel=5e-4)  # 4 significant digits
    calibrated_yaml(spec, ["x"])  # reads back


# ------------------------------------------------------------------ the command on this CPU


def test_calibrate_on_this_cpu_writes_a_spec_memplan_reads_back(tmp_path):
    base = _base(tmp_path)
    out = tmp_path / "mine.yaml"
    result = invoke(base, "-o", out, "--device", "cpu", "--precision", "fp32", "--quick", "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    spec = load_device(str(out))
    assert spec.name == "mine" and spec.fp32_flops == 1e14 and spec.memory_bandwidth == 1e13
    assert spec.efficiency.interconnect == 0.5  # not measured: the base's
    for m in shown["measured"]:
        peak = spec.memory_bandwidth if m["kind"] == "memory" else spec.fp32_flops
        assert getattr(spec.efficiency, m["kind"]) * peak == pytest.approx(m["rate"], rel=5e-4)
        assert 0 < m["rate"] < peak
    assert shown["spec"]["efficiency"] == to_data(spec.efficiency)
    text = out.read_text()
    assert text.startswith("# a CPU with generous peaks, calibrated on this machine's CPU")


def test_calibrate_refuses_bad_input_before_measuring(tmp_path):
    base = _base(tmp_path)
    out = tmp_path / "mine.yaml"
    out.write_text("mine\n")
    result = invoke(base, "-o", out, "--device", "cpu", "--quick")
    assert result.exit_code == 2 and "already exists" in result.output
    assert out.read_text() == "mine\n"
    for args, said in (
        (("nope-gpu", "-o", tmp_path / "a.yaml"), "Unknown device profile"),
        ((base, "-o", tmp_path / "a"), "ends in .yaml or .yml"),
        ((base, "-o", tmp_path), "is a directory, not a regular file"),
        ((tmp_path / "nothing.yaml", "-o", tmp_path / "a.yaml"), "nothing.yaml does not exist"),
        ((base, "-o", tmp_path / "a.yaml", "--precision", "int8"), "--precision 'int8'"),
        ((base, "-o", tmp_path / "a.yaml", "--device", "tpu"), "--device 'tpu'"),
        (("t4", "-o", tmp_path / "a.yaml", "--precision", "bf16"), "does not support bf16"),
    ):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert said in " ".join(result.output.split())  # as rich wrapped it
        assert not (tmp_path / "a.yaml").exists()
    if not torch.cuda.is_available():
        result = invoke(base, "-o", tmp_path / "a.yaml", "--device", "cuda")
        assert result.exit_code == 3 and "no CUDA device" in result.output  # as probe's


def test_a_base_slower_than_this_cpu_is_refused_and_nothing_written(tmp_path):
    slow = BIG_PEAKS.replace("1.0e+14", "1.0e+6")  # 1 MFLOP/s: any CPU beats it
    out = tmp_path / "mine.yaml"
    result = invoke(
        _base(tmp_path, slow), "-o", out, "--device", "cpu", "--precision", "fp32", "--quick"
    )
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "fp32_flops is 1e+06" in said and "not this device's" in said
    assert not out.exists()


# ------------------------------------------------------------------ float8 GEMMs


def test_float8_gemms_are_timed_as_scaled_mm_and_kept_apart_from_bf16s():
    sizes = Sizes(matmul=(16, 32), attention=((1, 1, 8, 8),), copy_bytes=64)
    seconds = {"16x16x16 float8_e4m3fn": 1e-4, "32x32x32 float8_e4m3fn": 4e-4}
    found = measure(
        torch.device("cpu"),
        "fp32",
        sizes,
        timer=lambda run, kind, shape: (run(), seconds.get(shape, 1e-3))[1],
        float8=True,
    )
    rate = {m.kind: (m.rate, m.shape) for m in found}
    assert rate["float8_matmul"] == (2 * 32**3 / 4e-4, "32x32x32 float8_e4m3fn")
    assert rate["matmul"][0] == 2 * 32**3 / 1e-3
    base = dataclasses.replace(_spec(), fp8_flops=2000e12)
    measured = [*_measured(700e12, 400e12, 300e12, 2.4e12)]
    kept = _calibrate(measured, base=base)
    assert kept.efficiency.float8_matmul is None  # not measured: the base's (none)
    assert kept.efficiency.float8_matmul_efficiency == 0.7  # ... so matmul's stands
    both = [*measured, Measurement(kind="float8_matmul", rate=1400e12, shape="f")]
    spec = _calibrate(both, base=base)
    assert (spec.efficiency.matmul, spec.efficiency.float8_matmul) == (0.7, 0.7)
    over = [*measured, Measurement(kind="float8_matmul", rate=2100e12, shape="f")]
    with pytest.raises(BadInputError, match=r"fp8_flops is 2e\+15"):
        _calibrate(over, base=base)


def test_the_roofline_times_float8_gemms_at_their_own_efficiency():
    from memplan.probe.roofline import Roofline
    from memplan.timing import achievable_flops

    mm = torch.ops.aten.mm.default
    roofline = Roofline(
        flops_by_dtype={torch.float8_e4m3fn: 2e15, torch.bfloat16: 1e15},
        default_flops=1e15,
        memory_bandwidth=1e12,
        matmul_efficiency=0.8,
        float8_matmul_efficiency=0.5,
    )
    assert roofline.seconds(1e12, 0, torch.float8_e4m3fn, mm) == pytest.approx(1e-3)
    assert roofline.seconds(1e12, 0, torch.bfloat16, mm) == pytest.approx(1.25e-3)
    unset = Roofline(
        flops_by_dtype={}, default_flops=2e15, memory_bandwidth=1e12, matmul_efficiency=0.8
    )
    assert unset.seconds(1e12, 0, torch.float8_e4m3fn, mm) == pytest.approx(1 / 1.6e3)
    with pytest.raises(ValueError, match=r"float8_matmul is 1\.5"):
        Efficiency(float8_matmul=1.5)
    h100 = load_device("h100-80gb")
    spec = dataclasses.replace(
        h100, efficiency=dataclasses.replace(h100.efficiency, float8_matmul=0.5)
    )
    assert achievable_flops(spec, "float8") == 1979e12 * 0.5
    assert achievable_flops(spec, "bf16") == 989e12 * h100.efficiency.matmul


def test_a_spec_files_float8_efficiency_reaches_the_meta_clock(tmp_path):
    from memplan.devices import profiles_dir
    from memplan.probe.backends import make_backend

    text = (profiles_dir() / "devices" / "h100-80gb.yaml").read_text()
    path = tmp_path / "mine.yaml"
    path.write_text(text.replace("  float8_matmul: 0.709\n", "  float8_matmul: 0.5\n"))
    assert make_backend("meta", "float8", str(path)).roofline.float8_matmul_efficiency == 0.5
    # the shipped spec's: the H100 SXM's FP8 MAMF, 1402.6 of 1979 TFLOP/s (its comment)
    assert make_backend("meta", "float8", "h100-80gb").roofline.float8_matmul_efficiency == 0.709
    path.write_text(text.replace("  float8_matmul: 0.709\n", ""))  # unset: matmul's
    assert make_backend("meta", "float8", str(path)).roofline.float8_matmul_efficiency == 0.803


def test_calibrate_measures_float8_gemms_where_the_base_has_a_float8_peak(tmp_path):
    base = _base(
        tmp_path, BIG_PEAKS.replace("memory_bandwidth", "fp8_flops: 2.0e+14\nmemory_bandwidth")
    )
    out = tmp_path / "mine.yaml"
    result = invoke(base, "-o", out, "--device", "cpu", "--precision", "fp32", "--quick", "--json")
    assert result.exit_code == 0, result.output
    measured = {m["kind"]: m["rate"] for m in json.loads(result.stdout)["measured"]}
    spec = load_device(str(out))
    assert spec.efficiency.float8_matmul * 2e14 == pytest.approx(
        measured["float8_matmul"], rel=5e-4
    )


@pytest.mark.parametrize("output", [".", "/", ""])
def test_a_folder_as_output_is_refused_before_measuring(output):
    """`-o .` (or `/`, or an empty path) raised ValueError ('has an empty name') with a
    traceback and exit 1, where every other command refuses a folder with exit 2."""
    result = invoke("h100-80gb", "-o", output, "--device", "cpu", "--quick")
    assert result.exit_code == 2
    assert "is a directory, not a regular file" in result.output
