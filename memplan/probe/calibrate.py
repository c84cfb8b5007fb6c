"""``memplan calibrate``'s measurements: what this machine's device reaches on the kinds of op
a device spec's efficiencies describe (memplan.devices.Efficiency), measured with the torch
the user trains with, so a spec of one's own replaces the shipped one's public figures where
the part differs from the datasheet's (a power cap, another memory, another torch's kernels).

- matmul: square GEMMs of the precision's dtype, the best of a size sweep (as the Maximum
  Achievable Matmul FLOPS of stas00/ml-engineering's compute/accelerator/README.md, which the
  shipped specs cite, is the best of a shape sweep);
- attention and attention_backward: ``F.scaled_dot_product_attention`` (non-causal, the
  kernel this torch picks for the shape), its forward, then its backward alone
  (``torch.autograd.grad`` on a kept graph);
- memory: ``copy_`` between two large buffers, read and write bytes counted.

FLOPs are counted by torch.utils.flop_counter with the formulas memplan's own roofline
divides by (memplan.probe.tracker: the CPU flash kernel's too), so a calibrated efficiency
times the spec's peak gives back the rate this machine measured. The interconnect is not
measured (one device): the base spec's figure is kept."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from memplan.devices import Measurement, nvml_handle
from memplan.errors import BadInputError, CannotMeasureError
from memplan.probe.roofline import ROOFLINE_FLOP_FORMULAS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    """What runs: GEMM sizes (``n`` for n × n × n), attention shapes (batch, heads,
    sequence, head dim) and the bytes of each buffer of the copy."""

    matmul: tuple[int, ...]
    attention: tuple[tuple[int, int, int, int], ...]
    copy_bytes: int


GPU_SIZES = Sizes(
    matmul=(2048, 4096, 8192, 16384),
    attention=((4, 16, 4096, 128), (1, 32, 8192, 128)),
    copy_bytes=1 << 30,
)
CPU_SIZES = Sizes(matmul=(256, 512, 1024), attention=((1, 8, 1024, 64),), copy_bytes=64 << 20)
QUICK_GPU_SIZES = Sizes(matmul=(4096, 8192), attention=((4, 16, 4096, 128),), copy_bytes=256 << 20)
QUICK_CPU_SIZES = Sizes(matmul=(256,), attention=((1, 4, 256, 64),), copy_bytes=8 << 20)


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """Where calibrate measures, as its spec file names it."""

    device: torch.device
    name: str
    """The GPU's name, or "this machine's CPU"."""
    torch_version: str
    power_note: str | None
    """The GPU's enforced power limit as NVML reports it (a capped part computes less)."""


def machine(device: str) -> Machine:
    """``device`` (``auto``: cuda where torch sees a GPU, else cpu); no GPU for ``cuda`` is
    exit 3, as ``probe --device cuda``'s."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise CannotMeasureError(
            "--device cuda: this torch sees no CUDA device.",
            hint="Calibrate on the machine with the GPU, or measure the CPU with --device cpu.",
        )
    where = torch.device(device)
    if where.type != "cuda":
        return Machine(
            device=where,
            name="this machine's CPU",
            torch_version=torch.__version__,
            power_note=None,
        )
    return Machine(
        device=where,
        name=torch.cuda.get_device_name(where),
        torch_version=torch.__version__,
        power_note=_power_note(torch.cuda.current_device()),
    )


def _power_note(index: int) -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = nvml_handle(pynvml, index)
            if handle is None:
                return None
            watts = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: the note is left out
        return None
    return f"Enforced power limit while measuring: {watts:g} W (NVML, device {index})."


def sizes_for(device: torch.device, quick: bool) -> Sizes:
    if device.type == "cuda":
        return QUICK_GPU_SIZES if quick else GPU_SIZES
    return QUICK_CPU_SIZES if quick else CPU_SIZES


Timer = Callable[[Callable[[], object], str, str], float]
"""``timer(run, kind, shape)``: seconds one call of ``run`` takes (``kind`` and ``shape`` name
what runs, for a test's timer)."""


def seconds_per_call(
    sync: Callable[[], None], *, rounds: int = 5, round_seconds: float = 0.05
) -> Timer:
    """A timer: one warm-up call, then as many calls per round as make a round last
    ``round_seconds``, the best of ``rounds`` rounds (the least disturbed)."""

    def timer(run: Callable[[], object], kind: str, shape: str) -> float:
        run()
        sync()
        calls = 1
        while True:
            start = time.perf_counter()
            for _ in range(calls):
                run()
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= round_seconds or calls >= 1 << 16:
                break
            calls *= 2
        best = elapsed / calls
        for _ in range(rounds - 1):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            sync()
            best = min(best, (time.perf_counter() - start) / calls)
        return best

    return timer


def _as_given(formula: Callable[..., int]) -> Callable[..., int]:
    """``formula`` (already taking the op's arguments and ``out_val``) as one FlopCounterMode
    calls unwrapped."""

    def given(*args: object, **kwargs: object) -> int:
        return formula(*args, **kwargs)

    given._get_raw = True  # type: ignore[attr-defined]
    return given


_EXTRA_FORMULAS = {
    op: _as_given(f) for op, f in ROOFLINE_FLOP_FORMULAS.items() if op not in flop_registry
}
"""The formulas memplan's roofline has beyond torch's (the CPU flash attention kernel's)."""


def counted_flops(run: Callable[[], object]) -> int:
    """FLOPs of one call of ``run`` as memplan's roofline counts them."""
    with FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as counter:
        run()
    return int(counter.get_total_flops())


def _rate(amount: float, seconds: float, kind: str, shape: str) -> float:
    if not (math.isfinite(seconds) and seconds > 0 and amount > 0):
        raise CannotMeasureError(
            f"memplan calibrate: timing {kind} ({shape}) gave {seconds!r} s for {amount:g} "
            "FLOPs or bytes, no rate.",
            hint="This is memplan's failure, not the device's: report it with --debug's output.",
        )
    return amount / seconds


def measure(
    device: torch.device,
    precision: str,
    sizes: Sizes,
    *,
    timer: Timer | None = None,
    on_done: Callable[[Measurement], None] | None = None,
    float8: bool = False,
) -> list[Measurement]:
    """The best rate of each kind of op on ``device`` (module doc); ``on_done`` hears of
    each as it is measured. ``float8``: also ``float8_matmul``, ``torch._scaled_mm`` on
    float8_e4m3fn operands at the same sizes (bf16 out, unit scales), as torchao's
    tensorwise recipe calls it; left out where this device's torch cannot run it."""
    dtype = DTYPES[precision]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timer = timer or seconds_per_call(sync)
    found: list[Measurement] = []

    def best(kind: str, trials: list[tuple[str, float, Callable[[], object]]]) -> None:
        rates = [
            (_rate(amount, timer(run, kind, shape), kind, shape), shape)
            for shape, amount, run in trials
        ]
        rate, shape = max(rates)
        found.append(Measurement(kind=kind, rate=rate, shape=shape))
        if on_done is not None:
            on_done(found[-1])

    try:
        trials = []
        for n in sizes.matmul:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            run = functools.partial(torch.mm, a, b)
            trials.append((f"{n}x{n}x{n} {precision}", counted_flops(run), run))
        best("matmul", trials)
        del trials, a, b, run

        forward, backward = [], []
        for b_, h, s, d in sizes.attention:
            q, k, v = (
                torch.randn(b_, h, s, d, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            shape = f"batch {b_} x {h} heads x {s} x head dim {d} {precision}"
            # with autograd recording, as in training (the kernel keeps what backward needs)
            fwd = functools.partial(F.scaled_dot_product_attention, q, k, v)
            forward.append((shape, counted_flops(fwd), fwd))
            out = F.scaled_dot_product_attention(q, k, v)
            grad = torch.randn_like(out)
            bwd = functools.partial(torch.autograd.grad, out, (q, k, v), grad, retain_graph=True)
            backward.append((shape, counted_flops(bwd), bwd))
        best("attention", forward)
        best("attention_backward", backward)
        del forward, backward

        numel = max(1, sizes.copy_bytes // 4)
        src = torch.ones(numel, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        moved = 2 * numel * 4
        best("memory", [(f"copy of {numel * 4:,} B", moved, functools.partial(dst.copy_, src))])
        del src, dst
        if float8:
            trials = _float8_trials(device, sizes)
            if trials:
                best("float8_matmul", trials)
    except torch.OutOfMemoryError as exc:
        raise BadInputError(
            f"memplan calibrate ran out of device memory on {device}: {exc}",
            hint="Free the device (another process holds it) or calibrate with --quick.",
        ) from None
    return found


def _float8_trials(
    device: torch.device, sizes: Sizes
) -> list[tuple[str, float, Callable[[], object]]]:
    """The float8 GEMMs to time, or none where ``_scaled_mm`` does not run here (a GPU
    below compute capability 8.9)."""
    trials = []
    one = torch.ones((), device=device)
    for n in sizes.matmul:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major
        run = functools.partial(
            torch._scaled_mm, a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        )
        try:
            flops = counted_flops(run)
        except RuntimeError:  # no float8 GEMM on this device
            return []
        trials.append((f"{n}x{n}x{n} float8_e4m3fn", flops, run))
    return trials
