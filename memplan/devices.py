"""GPU specs (capacity, peak FLOP/s, bandwidth) from ``profiles/devices/*.yaml``, and what
the GPU in this machine says about itself (NVML, ``torch.cuda.mem_get_info``).

The spec files are data, not code, so a user can add one for their GPU; ``MEMPLAN_PROFILES``
points at another profiles folder. torch and pynvml are imported lazily and only by the
functions that ask the hardware."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import BadInputError, CannotMeasureError
from memplan.files import fast_yaml
from memplan.files.schema import from_data, load_yaml_file, safe_load, to_data
from memplan.units import parse_budget

MIN_EFFICIENCY = 1e-9
"""A measured rate below this fraction of the base's peak is a wrong base (or peak), not an
efficiency (``calibrated_spec``); a spec file's below it is refused when read (1e-300 made
every time absurd, blamed on memplan)."""
MIN_RATE = 1e6
"""The least peak FLOP/s or memory bandwidth (bytes/s) a spec may state: a CPU does ~1e11
FLOP/s and ~1e10 bytes/s, a 1990 i486 ~1e6 FLOP/s, so a smaller rate is a slip (TFLOP/s or
GB/s written where FLOP/s or bytes/s go). With ``MIN_EFFICIENCY`` the slowest clock is 1e-3
per second, whose times a plan still holds (1.0e-290 overflowed). A link is 0 (unknown) or
at least ``MIN_LINK_RATE``: it times only the bytes that cross it, 2**62 at most."""
MIN_LINK_RATE = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The fraction of the datasheet peaks a device reaches, per kind of op, from public
    measurements (each device file cites its own). 1.0: the peak itself, for devices with no
    published measurement. A meta probe's clock and the roofline re-timing of a meta profile
    (memplan.timing) divide by ``peak × efficiency``; a probe on real hardware measures."""

    matmul: float = 1.0
    """Large GEMMs (mm, addmm, bmm, ...) against the precision's peak FLOP/s."""
    attention: float = 1.0
    """Fused attention kernels' forward against the same peak (and their backward too when
    ``attention_backward`` is not given), on FLOPs counted as the attention papers count
    them: a causal call does half the full product's work."""
    attention_backward: float | None = None
    """Fused attention kernels' backward against the same peak; None: ``attention``'s. The
    backward kernels reach a lower fraction than the forward (FlashAttention-2 on A100: 73%
    forward, 63% backward, arXiv 2307.08691 §4.1)."""
    float8_matmul: float | None = None
    """GEMMs on float8 operands (``_scaled_mm``) against ``fp8_flops``; None: ``matmul``'s.
    Float8 GEMMs reach a lower fraction of their peak than bf16's (H100 SXM: 70.9% against
    80.3%, the same MAMF table)."""
    memory: float = 1.0
    """Memory-bound ops (elementwise, norms, copies, the optimizer) against
    ``memory_bandwidth``."""
    interconnect: float = 1.0
    """The fraction of ``interconnect_bandwidth`` NCCL's collectives reach: the bus bandwidth
    nccl-tests measures over the link's one-way line rate (memplan.timing.
    interconnect_bandwidth)."""

    def __post_init__(self) -> None:
        for name in (
            "matmul",
            "attention",
            "attention_backward",
            "float8_matmul",
            "memory",
            "interconnect",
        ):
            value = getattr(self, name)
            if value is None and name in ("attention_backward", "float8_matmul"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not 0.0 < value <= 1.0:
                raise ValueError(
                    f"{name} is {value!r}; an efficiency is a fraction of the datasheet "
                    "peak, above 0 and at most 1"
                )
            if value < MIN_EFFICIENCY:
                raise ValueError(
                    f"{name} is {value!r}, below {MIN_EFFICIENCY:g}, the least fraction of a "
                    "peak memplan calibrate accepts: no device runs that far below its "
                    "datasheet. Write the fraction this device reaches (e.g. 0.8), or "
                    "measure it with `memplan calibrate`"
                )

    @property
    def backward_attention(self) -> float:
        """The attention backward kernels' efficiency: ``attention_backward``, else
        ``attention``."""
        return self.attention if self.attention_backward is None else self.attention_backward

    @property
    def float8_matmul_efficiency(self) -> float:
        """Float8 GEMMs' efficiency: ``float8_matmul``, else ``matmul``."""
        return self.matmul if self.float8_matmul is None else self.float8_matmul


ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "4090": "rtx4090", "rtx-4090": "rtx4090"}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    name: str
    display_name: str
    memory_bytes: int | None
    """Usable device memory as nvidia-smi reports it; None for the CPU entry."""
    bf16_flops: float | None
    """Dense peak FLOP/s; None where the precision is not supported (T4 has no bf16)."""
    fp16_flops: float | None
    fp32_flops: float
    fp8_flops: float | None = None
    """Dense peak FLOP/s of float8 matmuls (E4M3/E5M2 tensor cores, Ada and Hopper on);
    None: no float8 tensor cores (A100, T4), so ``--precision float8`` is refused."""
    memory_bandwidth: float
    """Bytes per second."""
    interconnect_bandwidth: float = 0.0
    """Bytes per second per GPU to its peers (NVLink, else PCIe)."""
    host_link_bandwidth: float = 0.0
    """Bytes per second, one direction, between the GPU and host memory (its PCIe link):
    times the ``offload`` mode. 0: unknown (offload is not planned)."""
    compute_capability: float | None = None
    """CUDA compute capability (8.0 for A100, 9.0 for H100): which fused attention kernels
    a meta probe models (memplan.probe.meta_attention). None: undecided (math path)."""
    efficiency: Efficiency = Efficiency()
    """Achievable fractions of the peaks (:class:`Efficiency`); all 1.0 when not given."""

    def __post_init__(self) -> None:
        """Capacities, peaks and rates are above 0 (a link may be 0: unknown), the peaks and
        memory rate at least ``MIN_RATE``, a link 0 or at least ``MIN_LINK_RATE``; before, a
        spec with ``memory_bytes: -5`` was taken and 80% of it blamed ``budget_bytes``."""
        optional = ("memory_bytes", "bf16_flops", "fp16_flops", "fp8_flops", "compute_capability")
        for name in ("fp32_flops", "memory_bandwidth", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} is {value!r}; it must be a number above 0")
            if name in RATE_FIELDS and value < MIN_RATE:
                raise ValueError(_slow_rate(name, value, f"at least {MIN_RATE:g}"))
        for name in ("interconnect_bandwidth", "host_link_bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} is {value!r}; it must be 0 (unknown) or above")
            if 0 < value < MIN_LINK_RATE:
                raise ValueError(
                    _slow_rate(name, value, f"0 (unknown) or at least {MIN_LINK_RATE:g}")
                )

    def peak_flops(self, precision: str) -> float:
        value = {
            "bf16": self.bf16_flops,
            "fp16": self.fp16_flops,
            "fp32": self.fp32_flops,
            "float8": self.fp8_flops,
        }[precision]
        if value is None:
            if precision == "float8":
                raise BadInputError(
                    f"{self.display_name} ({self.name}) has no float8 tensor cores "
                    "(fp8_flops is not in its device profile), so float8 training does "
                    "not run on it (torchtitan refuses float8 below compute capability "
                    "8.9).",
                    hint="Plan it with --precision bf16, or name a GPU with float8 "
                    "(h100-80gb, h200, l4) in --device-profile.",
                )
            raise BadInputError(
                f"{self.display_name} does not support {precision}.",
                hint="Choose another --precision (fp16 or fp32).",
            )
        return value


RATE_FIELDS = ("bf16_flops", "fp16_flops", "fp32_flops", "fp8_flops", "memory_bandwidth")


def _slow_rate(name: str, value: float, need: str) -> str:
    """Why a peak or rate below its floor (``need``) is refused, and how to write it."""
    if "flops" in name:
        unit, big, example = "FLOP/s", "TFLOP/s", "989 TFLOP/s is 989.0e+12"
    else:
        unit, big, example = "bytes/s", "GB/s", "300 GB/s is 300.0e+9"
    return (
        f"{name} is {value!r}; it must be {need} {unit}: no device is that "
        f"slow. Write it in {unit}, not {big} ({example})"
    )


def profiles_dir() -> Path:
    """The profiles/ folder: $MEMPLAN_PROFILES, else the one beside the memplan package."""
    env = os.environ.get("MEMPLAN_PROFILES")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "profiles"


def list_devices() -> list[str]:
    folder = profiles_dir() / "devices"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


_META_TIMED = ("meta (timed as ", ")")


def meta_device_name(spec_name: str | None) -> str:
    """A meta profile's ``device_name``: the spec its clock was timed against, named."""
    prefix, suffix = _META_TIMED
    return f"{prefix}{spec_name}{suffix}" if spec_name else "meta"


def meta_timed_spec(device_name: str) -> str | None:
    """The spec a meta profile's clock was timed against, read back from its
    ``device_name`` (``meta_device_name``); None when it names none."""
    prefix, suffix = _META_TIMED
    if device_name.startswith(prefix) and device_name.endswith(suffix):
        return device_name[len(prefix) : -len(suffix)]
    return None


def names_spec_file(name: str | Path) -> bool:
    """Whether a device profile argument names a spec file rather than a shipped spec: its
    name ends in .yaml or .yml, in any case (whether or not the file exists; no shipped
    spec's name has a suffix)."""
    return Path(name).suffix.lower() in (".yaml", ".yml")


def _spec_file(name: str) -> Path | None:
    """``name`` as a device spec file (a YAML file that exists), else None (a profile name)."""
    path = Path(name)
    return path if names_spec_file(path) and path.is_file() else None


def load_device(name: str) -> DeviceSpec:
    """The spec named ``name`` (file stem, case-insensitive, common aliases accepted) or a
    path to a spec file."""
    path = _spec_file(name)
    if path is None and names_spec_file(name):
        if Path(name).is_dir():
            raise _folder_given(name)
        raise BadInputError(
            f"Device spec file {name} does not exist (or is not a file).",
            hint="Check the path (a relative one is relative to the working directory, or in "
            "memplan.yaml to that file's folder), or name a shipped spec (`memplan devices`).",
        )
    if path is None:
        key = ALIASES.get(name.lower(), name.lower())
        path = profiles_dir() / "devices" / f"{key}.yaml"
        if not path.is_file():
            given = Path(name)
            if given.is_dir():
                raise _folder_given(name)
            if given.exists():  # a file, but no .yaml: read as a shipped spec's name
                raise BadInputError(
                    f"Device spec file {name} does not end in .yaml or .yml, which is how a "
                    "device profile tells a spec file from a shipped spec's name.",
                    hint=f"Rename or copy it to {given.name}.yaml and pass that path.",
                )
            known = ", ".join(list_devices()) or "(none found)"
            raise BadInputError(
                f"Unknown device profile {name!r}.",
                hint=f"Known device profiles: {known}; or pass a spec file path.",
            )
    return from_data(
        DeviceSpec, load_yaml_file(path, what="device profile"), source=str(path), path="device"
    )


def _folder_given(name: str) -> BadInputError:
    """A folder passed where a device spec goes: say so, not that no spec has its name."""
    return BadInputError(
        f"Device spec {name} is a folder, not a spec file.",
        hint="Pass the spec file itself (a .yaml file, e.g. one `memplan calibrate` wrote), "
        "or name a shipped spec (`memplan devices`).",
    )


def spec_file_label(name: str | None) -> str | None:
    """The plan's ``device`` for a ``--device-profile`` given as a spec file: its absolute
    path (``load_device`` reads it back), so a plan solved for a spec of one's own names
    it; None for a shipped profile's name (the plan names the spec)."""
    path = None if name is None else _spec_file(name)
    return None if path is None else str(path.resolve())


def _file_spec(label: str) -> DeviceSpec | None:
    """The spec in the file a profile's ``device_profile`` names; None when it names no
    file that loads (a shipped spec's name, or a file changed or gone since)."""
    if _spec_file(label) is None:
        return None
    try:
        return load_device(label)
    except BadInputError:
        return None


CLOCK_FIELDS = (
    "bf16_flops",
    "fp16_flops",
    "fp32_flops",
    "fp8_flops",
    "memory_bandwidth",
    "compute_capability",
)
"""What a meta probe takes from its spec (memplan.probe.backends, memplan.probe.tracker's
``Roofline``): the peaks and memory bandwidth its clock divides by, and the compute
capability its attention kernels follow; with the efficiencies but the interconnect's, and
whether the spec has a capacity (a GPU's: the attention target). The links, the capacity's
value and the interconnect's efficiency are read by the solver from the spec it is given."""


def _fingerprint(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def spec_digest(spec: DeviceSpec) -> str:
    """A fingerprint of the numbers a meta probe's clock takes from ``spec``
    (``CLOCK_FIELDS``): a profile records it, so the spec file it was timed against is known
    again after the file is moved, renamed or checked out under another path, and a spec
    that differs only in what the solver reads itself (its links, capacity, NCCL's share of
    the link) keeps the profile's clock. Before, every field counted: a copy of the spec with
    another interconnect re-timed a meta profile by roofline from FLOPs, which has no
    float8 or compiled clock: the 70B float8 Table 4 row (bench ``published``, 17.62 s) on a
    copy of its spec with half the link rate came out 24.72 s, 2.10 s of it the roofline's,
    where TP's doubled collectives alone make it 22.63 s."""
    efficiency = dataclasses.asdict(spec.efficiency)
    del efficiency["interconnect"]
    fields = {name: getattr(spec, name) for name in CLOCK_FIELDS}
    fields["gpu"] = spec.memory_bytes is not None
    fields["efficiency"] = efficiency
    return _fingerprint(fields)


def whole_spec_digest(spec: DeviceSpec) -> str:
    """The fingerprint profiles written before ``CLOCK_FIELDS`` recorded: every field but
    the name and display name. Still recognised (``names_spec``)."""
    fields = dataclasses.asdict(spec)
    del fields["name"], fields["display_name"]
    return _fingerprint(fields)


def names_spec(label: str | None, spec: DeviceSpec, digest: str | None = None) -> bool:
    """Whether a profile's ``device_profile`` (a spec's name, or a spec file's path) is
    ``spec`` as its clock sees it: the same clock numbers wherever the file now is
    (``digest``, the profile's ``device_spec_digest``, or the whole-spec one older profiles
    carry), the same name where the profile records no numbers, or a file that loads as a
    spec with the same clock. A name is not enough where the numbers say otherwise: a shipped
    spec whose efficiencies a later memplan changed, or a spec file of one's own edited
    under the same name, is another clock (before, the name alone kept the profile's)."""
    if digest is not None and digest in (spec_digest(spec), whole_spec_digest(spec)):
        return True
    if label == spec.name:
        return digest is None
    loaded = _file_spec(label) if label is not None else None
    return loaded is not None and spec_digest(loaded) == spec_digest(spec)


def label_has_capacity(label: str | None) -> bool:
    """Whether the spec a profile names (``device_profile``) is a GPU's, with a capacity: not
    none, not the CPU entry, nor a spec file without ``memory_bytes``. A shipped GPU's name,
    or a spec file that no longer loads, counts as a GPU's (its plan keeps the CUDA
    reserve)."""
    if label in (None, "", "cpu"):
        return False
    loaded = _file_spec(label)
    return loaded is None or loaded.memory_bytes is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int
    process_used_bytes: int | None = None
    """Memory NVML attributes to this process (context + allocator), when it can tell."""


def nvml_handle(pynvml, index: int):
    """NVML's handle for CUDA device ``index``, or None where which GPU that is cannot be told
    (the caller then asks torch). NVML numbers every GPU on the machine and ignores
    ``CUDA_VISIBLE_DEVICES``; CUDA numbers the visible ones only (NVML's docs, "nvmlDevice
    GetHandleByIndex": the order "may not correlate with ... CUDA"). So: the device's UUID
    from torch where torch is loaded and sees CUDA (exact); else ``CUDA_VISIBLE_DEVICES``'s
    entry for ``index``, an NVML index or a ``GPU-`` UUID (a ``MIG-`` or partial one: None);
    else ``index`` itself."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    entries = [entry.strip() for entry in visible.split(",")]
    entry = entries[index] if 0 <= index < len(entries) else ""
    if entry.isascii() and entry.isdigit():  # not str.isdigit alone: '²' is a digit to it
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    if entry.startswith("GPU-") and len(entry) == 40:  # "GPU-" and a full 36-character UUID
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    return None


def local_gpu(index: int = 0) -> GpuInfo | None:
    """The local GPU's name and memory, or None when there is no usable GPU. NVML first
    (it sees memory other processes hold); ``torch.cuda.mem_get_info`` as a fallback."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = nvml_handle(pynvml, index)
            if handle is None:
                raise LookupError(f"CUDA device {index} has no NVML index")
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            used = None
            try:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                        used = int(proc.usedGpuMemory)
            except pynvml.NVMLError:
                pass
            return GpuInfo(
                name=name if isinstance(name, str) else name.decode(),
                total_bytes=int(memory.total),
                free_bytes=int(memory.free),
                process_used_bytes=used,
            )
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library, no GPU: all mean "ask torch, then give up"
        pass
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(index)
            return GpuInfo(
                name=torch.cuda.get_device_name(index), total_bytes=int(total), free_bytes=int(free)
            )
    except Exception:
        pass
    return None


def host_available_bytes() -> int | None:
    """Memory the host can still give this process: ``MemAvailable`` from /proc/meminfo
    (Linux), else free physical pages; None when the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def capacity_bytes(device_spec: DeviceSpec | None, probed_capacity_bytes: int | None) -> int | None:
    """The memory a percentage budget is a share of: the device spec's, else the probed
    device's (None: neither is known)."""
    return device_spec.memory_bytes if device_spec else probed_capacity_bytes


def resolve_budget(
    budget: str,
    *,
    device_spec: DeviceSpec | None,
    probed_capacity_bytes: int | None,
    what: str = "--budget",
) -> int:
    """``--budget`` in bytes: a size, a percentage of the device's memory (the spec's, else the
    probed device's, else the local GPU's when ``auto``) or ``auto`` (the local GPU's free
    memory, which only a visible GPU can answer). ``what`` names it in errors."""
    capacity = capacity_bytes(device_spec, probed_capacity_bytes)
    free = None
    text = str(budget).strip()
    if text.lower() == "auto":
        gpu = local_gpu()
        free = gpu.free_bytes if gpu else None
        capacity = capacity or (gpu.total_bytes if gpu else None)
    percent = text.endswith("%")
    if percent and device_spec is not None and device_spec.memory_bytes is None:
        # before: "Add --device-profile NAME" to one who had given --device-profile cpu
        raise BadInputError(
            f"{what} {text!r} is a percentage of device memory, but the device spec "
            f"{device_spec.name} has no memory size (no memory_bytes: a CPU's).",
            hint=f"Give {what} in bytes, e.g. 24GiB.",
        )
    size = parse_budget(budget, capacity_bytes=capacity, free_bytes=free, what=what)
    if percent and size < 1:  # before: "budget_bytes must be a positive integer, got 0"
        whose = f"device spec {device_spec.name}" if device_spec else "probed device"
        raise BadInputError(
            f"{what} {text!r} of the {whose}'s memory ({capacity} bytes) is 0 bytes.",
            hint="Check the device spec's memory_bytes (the device's memory in bytes), or "
            f"give {what} as a size, e.g. 24GiB.",
        )
    return size


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """What ``memplan calibrate`` measured for one kind of op (memplan.probe.calibrate)."""

    kind: str
    """An :class:`Efficiency` field: matmul, attention, attention_backward or memory."""
    rate: float
    """FLOP/s (FLOPs as memplan's roofline counts them), or bytes/s for memory."""
    shape: str
    """What ran at that rate (the best of the sizes tried)."""

    @property
    def unit(self) -> str:
        return "B/s" if self.kind == "memory" else "FLOP/s"


CALIBRATED_KINDS = ("matmul", "attention", "attention_backward", "memory")
OPTIONAL_KINDS = ("float8_matmul",)
"""Measured where the base has ``fp8_flops`` and the device runs ``_scaled_mm``."""


def calibrated_spec(
    base: DeviceSpec,
    measurements: Sequence[Measurement],
    *,
    precision: str,
    name: str,
    display_name: str,
    base_label: str,
) -> DeviceSpec:
    """``base`` with the efficiencies this machine measured: each rate over the base's peak
    for it (``precision``'s FLOP/s, or ``memory_bandwidth``); the interconnect's is kept. A
    rate above the peak means the base is not this device's spec (or its peak is wrong),
    and is refused rather than written as an efficiency over 1."""
    found = {m.kind: m for m in measurements}
    missing = [k for k in CALIBRATED_KINDS if k not in found]
    if missing:
        raise CannotMeasureError(
            f"memplan calibrate measured no {', '.join(missing)}.",
            hint="This is memplan's failure: report it with --debug's output.",
        )
    values = {}
    optional = [k for k in OPTIONAL_KINDS if k in found]
    for kind in (*CALIBRATED_KINDS, *optional):
        m = found[kind]
        peak, field = _peak_for(base, kind, precision)
        if not (math.isfinite(m.rate) and m.rate > 0):
            raise CannotMeasureError(
                f"memplan calibrate's {kind} rate is {m.rate!r} ({m.shape}).",
                hint="This is memplan's failure: report it with --debug's output.",
            )
        fraction = m.rate / peak
        if fraction < MIN_EFFICIENCY:
            raise BadInputError(
                f"{kind} ran at {m.rate:.4g} here ({m.shape}), {fraction:.3g} of the peak "
                f"of the base spec {base_label} ({field} {peak:.4g}): too small a fraction "
                "to be this device's.",
                hint="Name the spec of this device as the base (`memplan devices` lists them).",
            )
        if fraction > 1.0:
            raise BadInputError(
                f"{kind} ran at {m.rate:.4g} {m.unit} here ({m.shape}), above the peak of the "
                f"base spec {base_label}: its {field} is {peak:.4g}. An efficiency is a "
                "fraction of the device's datasheet peak, so that base is not this device's "
                "spec, or its peak is wrong.",
                hint="Name the spec of this device as the base (`memplan devices` lists them), "
                "or copy one, set its peaks from the datasheet, and pass its path.",
            )
        values[kind] = float(f"{fraction:.4g}")  # at most 1: rounding cannot pass it
    if "float8_matmul" not in values:  # not measured: the base's, if it has one
        values["float8_matmul"] = base.efficiency.float8_matmul
    efficiency = Efficiency(**values, interconnect=base.efficiency.interconnect)
    return dataclasses.replace(base, name=name, display_name=display_name, efficiency=efficiency)


def _peak_for(base: DeviceSpec, kind: str, precision: str) -> tuple[float, str]:
    """The base's peak a ``kind`` of measurement is a fraction of, and its field's name."""
    if kind == "memory":
        return base.memory_bandwidth, "memory_bandwidth"
    if kind == "float8_matmul":
        return base.peak_flops("float8"), "fp8_flops"
    return base.peak_flops(precision), f"{precision}_flops"


def calibrated_yaml(spec: DeviceSpec, header: Sequence[str]) -> str:
    """The spec file: ``header`` as comments (what was measured, where and how), then the
    spec as ``load_device`` reads it back (checked here, so a spec memplan would refuse is
    never written)."""
    text = "".join(f"# {line}\n" if line else "#\n" for line in header)
    text += fast_yaml.dump(to_data(spec))
    from_data(DeviceSpec, safe_load(text), source="<the calibrated spec>", path="device")
    return text
