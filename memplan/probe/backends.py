"""Where the probe runs: ``cpu`` (real tensors), ``cuda`` (real GPU) or ``meta`` (shapes
only; times from a device spec's roofline). Each backend builds the model, moves batches,
makes trackers and clocks, and enters autocast for the chosen precision, or, with
``mixed_precision="params"``, casts the parameters to it instead, as FSDP2's
``MixedPrecisionPolicy(param_dtype=...)`` does for compute (``cast_params``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from memplan.devices import (
    DeviceSpec,
    load_device,
    local_gpu,
    meta_device_name,
    spec_digest,
    spec_file_label,
)
from memplan.errors import BadInputError, CannotMeasureError, ModelFileError
from memplan.model.batch import batch_tensors, map_batch, move_batch
from memplan.model.loader import ModelFile
from memplan.probe import shadow
from memplan.probe.dedup import MetaOpCache
from memplan.probe.float8 import FLOAT8_DTYPES, Float8Conversion, time_casts_fused
from memplan.probe.meta_attention import CPU, CUDA, MetaAttention
from memplan.probe.meta_autocast import MetaAutocast
from memplan.probe.meta_kernels import CONV_TARGET
from memplan.probe.roofline import Roofline
from memplan.probe.settings import ProbeSettings
from memplan.probe.tracker import LiveTracker
from memplan.profile.data import TIMING_ROUNDS, timing_rounds_problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_META_SPEC = "h100-80gb"


def build_on_meta(model_file: ModelFile) -> torch.nn.Module:
    """The model built with every factory on meta, so no weight is allocated. A builder
    that reads values of tensors it makes (torchvision's RegNet: block widths from
    ``torch.arange(depth) * w_a + w_0`` and ``.tolist()``) fails there with "Cannot copy
    out of meta tensor", which is meta's limit and not the model file's fault: it is built
    again with CPU twins (memplan.probe.shadow) behind the small tensors its factories make,
    as a meta step has, so those values are read from the twins. A read of a value computed
    from a weight still fails: exit 3 naming the read, with --device cpu as the way out.
    Only a builder that failed on meta pays for the twins."""
    try:
        with torch.device("meta"):
            return model_file.build_model()
    except ModelFileError as exc:
        if not _meta_value_read(exc):
            raise
        first = exc
    try:
        with torch.device("meta"), shadow.PythonData(), LiveTracker(record=False, meta=True):
            model = model_file.build_model()
        for tensor in (*model.parameters(), *model.buffers()):
            shadow.forget(tensor)  # probed as a plain meta build's: no real copies kept
        return model
    except ModelFileError as exc:
        if not _meta_value_read(exc):
            raise
        raise CannotMeasureError(
            f"{first.message} The meta probe builds the model on meta, where a tensor "
            "computed from weights has no values to read.",
            hint="Probe with --device cpu (or cuda) instead, or compute those values in "
            "Python or from the config rather than from the module's tensors.",
        ) from exc


def _meta_value_read(exc: ModelFileError) -> bool:
    """Whether the builder failed reading a meta tensor's values (``.tolist()``,
    ``.item()``, ``int(t)``, a copy to the CPU), not by a fault of its own."""
    cause = str(exc.__cause__ or "")
    return (
        "meta tensor" in cause
        or "on meta tensors" in cause
        or "_local_scalar_dense" in cause
        or "data-independent" in cause  # nonzero(): its output's size is the values'
    )


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda", "meta"):
        raise BadInputError(f"device {device!r} is not one of auto, cpu, cuda, meta.")
    if device == "cuda" and not torch.cuda.is_available():
        raise CannotMeasureError(
            "--device cuda was asked for, but this machine has no usable CUDA GPU "
            f"(torch {torch.__version__}, CUDA available: no).",
            hint="Probe with --device cpu, or --device meta to time against a GPU spec.",
        )
    return device


@dataclass(kw_only=True)
class Backend:
    device: str
    precision: str
    spec: DeviceSpec | None = None
    """Device spec: meta timing, and capacity where the hardware cannot say."""
    spec_label: str | None = None
    """The spec file's absolute path when ``--device-profile`` named a file (what the profile
    records, so a plan solved from it names a spec that loads again); None for a name."""
    reuse_identical: bool = True
    """Meta only: reuse meta-kernel results across identical calls (memplan.probe.dedup)."""
    mixed_precision: str = "autocast"
    """``autocast`` over fp32 parameters, or ``params``: parameters (and floating inputs)
    in the compute dtype, no autocast (see ``memplan.profile.MixedPrecision``)."""
    float8_recipe: str = "tensorwise"
    """With precision ``float8``: torchao's recipe (memplan.probe.float8)."""
    float8_all_gather: bool = True
    """With a tensorwise float8 recipe: plans gather the converted weights in float8."""
    timing_rounds: int = TIMING_ROUNDS
    """cpu and cuda: interleaved timing rounds per probed size (memplan.probe.sizes)."""
    compiled: bool = False
    """Meta only: the training step's clock is torch.compile's (memplan.probe.tracker
    ``FusedRegion``); the optimizer step stays eager."""

    def __post_init__(self) -> None:
        self._batch_shapes: dict[Any, dict[int, tuple[Any, ...]]] = {}
        """The shapes of each size's batch, by sequence length (``_same_shapes_refused``)."""
        self.float8: Float8Conversion | None = None
        """With precision ``float8``: the linears run as torchao's ``Float8Linear``, the
        rest in bf16 parameters, as torchtitan trains under FSDP2's mixed-precision policy
        (memplan.probe.float8)."""
        if self.precision == "float8":
            self.float8 = Float8Conversion(
                recipe=self.float8_recipe, fsdp_float8_all_gather=self.float8_all_gather
            )
            self.precision, self.mixed_precision = "bf16", "params"
        if self.precision not in DTYPES:
            raise BadInputError(
                f"precision {self.precision!r} is not one of fp32, bf16, fp16, float8."
            )
        if self.mixed_precision not in ("autocast", "params"):
            raise BadInputError(
                f"mixed precision {self.mixed_precision!r} is not one of autocast, params."
            )
        if self.mixed_precision == "params" and self.precision == "fp32":
            raise BadInputError(
                "--mixed-precision params casts parameters to the compute dtype, and fp32 "
                "has none to cast to.",
                hint="Add --precision bf16 (or fp16).",
            )
        self.cast_params = self.mixed_precision == "params"
        self.op_cache: MetaOpCache | None = None
        """On meta: identical ops (identical blocks) reuse one meta-kernel result; see
        memplan.probe.dedup. ``None`` runs every kernel."""
        if self.device == "meta" and self.reuse_identical:
            self.op_cache = MetaOpCache()
        self.dtype = DTYPES[self.precision]
        self.torch_device = torch.device(self.device)
        self.roofline: Roofline | None = None
        self.attention_target = CUDA if self.spec and self.spec.memory_bytes is not None else CPU
        """Meta only: whose fused attention kernels the probe models (memplan.probe.
        meta_attention): a named GPU spec's, else the CPU's, which ``--device cpu`` checks."""
        self.attention_notes: list[str] = []
        """Meta only: what the spec could not decide about attention kernels (warnings)."""
        self.spec_given = self.spec is not None
        """Whether the user named the device spec. A meta probe without one is timed
        against ``DEFAULT_META_SPEC`` but plans for no device: its profile names none, so
        a plan adds no CUDA reserve unless solve is given ``--device-profile``."""
        if self.device == "meta":
            spec = self.spec or load_device(DEFAULT_META_SPEC)
            self.spec = spec
            # raise for unsupported precisions, float8 first (T4 has neither it nor bf16)
            fp8 = spec.peak_flops("float8") if self.float8 else None
            peak = spec.peak_flops(self.precision)
            by_dtype = {torch.float32: spec.fp32_flops}
            if fp8:  # matmuls on float8 operands (memplan.probe.tracker)
                by_dtype |= dict.fromkeys(FLOAT8_DTYPES, fp8)
            if spec.bf16_flops:
                by_dtype[torch.bfloat16] = spec.bf16_flops
            if spec.fp16_flops:
                by_dtype[torch.float16] = spec.fp16_flops
            self.roofline = Roofline(
                flops_by_dtype=by_dtype,
                default_flops=peak,
                memory_bandwidth=spec.memory_bandwidth,
                matmul_efficiency=spec.efficiency.matmul,
                attention_efficiency=spec.efficiency.attention,
                memory_efficiency=spec.efficiency.memory,
                attention_backward_efficiency=spec.efficiency.backward_attention,
                float8_matmul_efficiency=spec.efficiency.float8_matmul_efficiency,
                default_peak=self.precision,
            )

    # --------------------------------------------------------------------------- model
    def build(self, model_file: ModelFile) -> torch.nn.Module:
        if self.device == "meta":
            model = build_on_meta(model_file).to("meta")  # and what it made on CPU explicitly
        else:
            model = model_file.build_model().to(self.torch_device)
        if self.cast_params:
            cast_parameters(model, self.dtype)
            cast_forward_inputs(model, self.dtype)
        if self.float8:
            model = self.float8.convert(model)
            time_casts_fused()  # meta clocks only (memplan.probe.float8)
        return model

    def batch(self, model_file: ModelFile, size: int) -> Any:
        cpu = model_file.make_batch(size)
        _same_shapes_refused(self._batch_shapes, model_file, size, cpu)
        if self.device == "meta":  # laid out as on cpu, values kept (probe/shadow.py)
            batch = shadow.mirror_batch(cpu)
        else:
            batch = move_batch(cpu, self.torch_device)
        # The batch stays as make_batch gives it (fp32): training holds it through the step,
        # and with ``cast_params`` the model's forward casts it (``cast_forward_inputs``).
        return batch

    def tracker(self, *, record: bool = True, step: bool = False) -> LiveTracker:
        """``step``: a training micro-step (forward and backward), timed as compiled when
        the probe says so."""
        return LiveTracker(
            record=record,
            roofline=self.roofline,
            meta=self.device == "meta",
            op_cache=self.op_cache,
            fused=step and self.compiled,
            host_is_device=self.attention_target == CPU,
        )

    def guard(self) -> Any:
        """Around untracked steps: on meta, a tracker anyway, so that an op without a meta
        kernel is a CannotMeasureError naming the op, wherever it first runs."""
        return self.tracker(record=False) if self.device == "meta" else nullcontext()

    # --------------------------------------------------------------------------- timing
    def clock(self, tracker: LiveTracker | None = None) -> float:
        if self.device == "meta":
            return tracker.virtual_seconds if tracker is not None else 0.0
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------------- autocast
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """Around the forward (the loss): autocast at the chosen precision; on meta, also
        the target device's attention kernels."""
        if self.device == "meta":
            with self._meta_context():
                yield
        elif self.precision == "fp32" or self.cast_params:
            yield
        else:
            with torch.autocast(device_type=self.device, dtype=self.dtype):
                yield

    def checkpoint_context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        """For checkpoint's ``context_fn``: real autocast state is restored by checkpoint
        itself during recompute; the meta emulations (autocast, attention kernels) have to
        be entered again."""
        if self.device != "meta":
            return None
        return lambda: (nullcontext(), self._meta_context())

    @contextmanager
    def _meta_context(self) -> Iterator[None]:
        """The attention mode outside autocast, so that it sees the inputs autocast casts,
        as the device's kernel choice does (autocast runs above the SDPA dispatch)."""
        attention = MetaAttention(
            self.attention_target,
            self.spec.compute_capability if self.spec else None,
            self.attention_notes,
        )
        conv_target = CONV_TARGET.set(self.attention_target)
        try:
            with attention, shadow.PythonData():
                if self.precision == "fp32" or self.cast_params:
                    yield
                else:
                    with _meta_autocast(self.dtype):
                        yield
        finally:
            CONV_TARGET.reset(conv_target)

    def device_name(self) -> str:
        if self.device == "meta":
            return meta_device_name(self.spec.name if self.spec else None)
        if self.device == "cuda":
            return torch.cuda.get_device_name(self.torch_device)
        return "cpu"

    def capacity_bytes(self) -> int | None:
        if self.device == "cuda":
            info = local_gpu(self.torch_device.index or 0)
            return info.total_bytes if info else None
        return self.spec.memory_bytes if self.spec and self.spec_given else None

    def target_profile(self) -> str | None:
        """The device spec the profile is for: the one the user named, else none."""
        if not (self.spec and self.spec_given):
            return None
        return self.spec_label or self.spec.name

    def target_digest(self) -> str | None:
        """``target_profile``'s spec fingerprinted (devices.spec_digest); None without one."""
        return spec_digest(self.spec) if self.spec and self.spec_given else None


def make_backend(
    device: str,
    precision: str,
    device_profile: str | None,
    mixed_precision: str = "autocast",
    reuse_identical: bool = True,
    float8_recipe: str = "tensorwise",
    float8_all_gather: bool = True,
    compiled: bool = False,
    timing_rounds: int = TIMING_ROUNDS,
) -> Backend:
    resolved = resolve_device(device)
    if problem := timing_rounds_problem(timing_rounds):
        raise BadInputError(
            f"--timing-rounds: {problem}: the timing rounds per probed size.",
            hint=f"Leave it out for {TIMING_ROUNDS} (medians that a slow spell of a shared "
            "machine does not move), or give 1 for a quick probe whose times are one run's.",
        )
    if compiled and resolved != "meta":
        raise BadInputError(
            f"--compiled times the step as torch.compile's fused kernels move bytes, on the "
            f"meta clock; a {resolved} probe times the eager ops it really runs.",
            hint="Probe with --device meta (and --device-profile for the GPU), or drop --compiled.",
        )
    spec = load_device(device_profile) if device_profile else None
    return Backend(
        device=resolved,
        precision=precision,
        spec=spec,
        spec_label=spec_file_label(device_profile),
        mixed_precision=mixed_precision,
        reuse_identical=reuse_identical,
        float8_recipe=float8_recipe,
        float8_all_gather=float8_all_gather,
        compiled=compiled,
        timing_rounds=timing_rounds,
    )


def backend_for(settings: ProbeSettings) -> Backend:
    """The backend a probe with ``settings`` measures on."""
    return make_backend(
        settings.device,
        settings.precision,
        settings.device_profile,
        mixed_precision=settings.mixed_precision,
        reuse_identical=settings.reuse_identical,
        float8_recipe=settings.float8_recipe,
        float8_all_gather=settings.float8_all_gather,
        compiled=settings.compiled,
        timing_rounds=settings.timing_rounds,
    )


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters to ``dtype`` in place, buffers left as they are: what
    FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype)`` computes with (it casts parameters
    only; torch.distributed.fsdp.MixedPrecisionPolicy docs). Shared parameters stay shared."""
    for param in {id(p): p for p in model.parameters()}.values():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def cast_forward_inputs(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the root module's floating-point inputs to ``dtype`` as its forward begins, as
    FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` (its default) does: the root's
    ``FSDPState._pre_forward`` calls ``_cast_forward_inputs``, which applies
    ``_fsdp_common._cast_fp_tensor`` (``x.to(param_dtype)`` for a floating tensor of another
    dtype) to every tensor of the args and kwargs (torch/distributed/fsdp/_fully_shard/
    _fsdp_state.py). The batch ``make_batch`` gave is left as it is: the training loop holds
    it, fp32, beside its cast (before, the probe cast the batch itself and counted only the
    cast: 2 KiB a sample short on a 16 × 32 fp32 input)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    def pre_forward(
        _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return map_batch(args, cast), map_batch(kwargs, cast)

    model.register_forward_pre_hook(pre_forward, with_kwargs=True)


@contextmanager
def _meta_autocast(dtype: torch.dtype) -> Iterator[None]:
    mode = MetaAutocast(dtype)
    mode.caching = True  # as autocast caches parameter casts for the region it covers
    try:
        with mode:
            yield
    finally:
        mode.clear_cache()


def _same_shapes_refused(
    seen: dict[Any, dict[int, tuple[Any, ...]]], model_file: ModelFile, size: int, batch: Any
) -> None:
    """Refuse a batch function that ignores its size: two sizes whose batches have the same
    tensors' shapes (at one sequence length). Every size would be measured from the same
    samples, the plan's bytes a sample scaled wrong without a word: a ``lambda n:
    first_batch`` planned micro-batch 64 at 1/15.6 of its peak."""
    shapes = tuple(tuple(t.shape) for t in batch_tensors(batch))
    at_length = seen.setdefault(model_file.seq_len, {})
    for other, known in at_length.items():
        if other != size and known == shapes:
            fn = model_file.batch_text or model_file.named("make_batch")
            raise ModelFileError(
                f"{model_file.path}: {fn} made batches of the same shapes for batch sizes "
                f"{min(other, size)} and {max(other, size)} ("
                + ", ".join("×".join(map(str, s)) or "scalar" for s in shapes[:4])
                + "): memplan measures each micro-batch size from the batch made for it, so "
                "a batch of n samples must hold n (along the first dimension, or any that "
                "grows with n).",
                hint=f"Make {fn} return as many samples as it is asked for (slice or repeat "
                "the data to that many).",
            )
    at_length[size] = shapes
