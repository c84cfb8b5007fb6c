"""On meta, ``scaled_dot_product_attention`` runs the fused kernel the target device would pick.

Meta tensors have no fused attention kernel of their own: ATen's ``_fused_sdp_choice`` for
the Meta key answers "math" unless a CUDA build sees CUDA tensors
(aten/src/ATen/native/transformers/attention.cpp), so the math path runs and saves the
attention probabilities, O(seq²) per head, for backward. A real CPU or GPU runs a fused
kernel that saves only the output and the log-sum-exp. This mode (a ``TorchFunctionMode``,
entered only around meta forwards and recomputes) decides, call by call, which kernel the
target would run and calls that kernel's aten op, whose meta registration
(torch/_meta_registrations.py) gives the shapes and dtypes the device would allocate; the
op's derivative formula then saves what the device saves.

- ``cpu`` target: PyTorch's own CPU dispatcher decides. ``torch._fused_sdp_choice`` is asked
  about CPU stand-ins that carry each input's sizes, dtype, last-dim stride and
  requires_grad but almost no storage, so every rule of
  aten/src/ATen/native/transformers/sdp_utils_cpp.{h,cpp} applies (dtype, dropout, 4-D
  dense inputs, batch/heads and ``enable_gqa``, mask shape and mask requires_grad, equal
  head dims, non-empty sequences, unit last stride, kernels disabled by
  ``torch.nn.attention.sdpa_kernel``), as it does on the CPU.
- ``cuda`` target: no CUDA here to ask, so the rules of
  aten/src/ATen/native/transformers/cuda/sdp_utils.cpp are followed as far as the device
  spec decides them (compute capability, dtype, head dim, mask, dropout, causal shape).
  cuDNN attention, which recent builds put first on sm90/sm100, saves what flash saves
  (output and a float32 log-sum-exp per query row) and no more than memory-efficient
  attention, so flash (or memory-efficient with a mask) stands for it, and a note says so.
  Anything the spec cannot decide keeps the math path, the higher one, with a note.

Whatever the choice, the bytes must be the device's: a boolean mask is turned into an
additive one exactly as the composite does (``where(mask, 0, -inf)`` in the query's dtype,
attention.cpp ``convert_boolean_attn_mask``), and CUDA flash pads head dims to a multiple of
8 before the kernel (attention.cpp ``pad_last_dim``). Calls the target would run on the math
path, and non-meta calls, go to PyTorch unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from memplan.errors import MemplanError, internal_failure
from memplan.probe.meta_nested import BODY_CALLS, run_body

SDPA = F.scaled_dot_product_attention
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
_POSITIONAL = 6  # scale and enable_gqa are keyword-only (native_functions.yaml schema)
_LOW = (torch.float16, torch.bfloat16)

CPU = "cpu"
CUDA = "cuda"
FLASH = "flash"
EFFICIENT = "efficient"
MATH = "math"


@dataclass(frozen=True, slots=True)
class SdpaCall:
    """One ``scaled_dot_product_attention`` call, its arguments by name."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool

    @classmethod
    def bind(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SdpaCall | None:
        """The call's arguments by name, or None for a call this module does not model (an
        unknown keyword, too many arguments: PyTorch will say what is wrong with it)."""
        if len(args) > _POSITIONAL or set(kwargs) - set(_PARAMS):
            return None
        named = dict(_DEFAULTS, enable_gqa=False) | dict(zip(_PARAMS, args, strict=False))
        if set(kwargs) & set(_PARAMS[: len(args)]):
            return None
        named |= kwargs
        if not all(isinstance(named[n], torch.Tensor) for n in _PARAMS[:3]):
            return None
        return cls(**named)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        qkv = (self.query, self.key, self.value)
        return qkv if self.attn_mask is None else (*qkv, self.attn_mask)

    @property
    def requires_grad(self) -> bool:
        """Inputs require grad with grad mode on (sdp_utils_cpp.h ``input_requires_grad``)."""
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.query, self.key, self.value)
        )


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with ``tensor``'s sizes, dtype and requires_grad, and a last-dim stride
    that is 1 exactly when ``tensor``'s is; every other stride 0, so its storage holds one
    row at most. That is all ``_fused_sdp_choice`` reads of a dense input."""
    last = tensor.stride(-1) if tensor.dim() else 1
    strides = [0] * tensor.dim()
    if strides:
        strides[-1] = min(last, 2)
    stand_in = torch.empty_strided(tuple(tensor.shape), strides, dtype=tensor.dtype)
    if tensor.requires_grad and stand_in.is_floating_point():
        stand_in.requires_grad_(True)
    return stand_in


def cpu_kernel(call: SdpaCall) -> str:
    """``flash`` or ``math``: what SDPA on the CPU runs for ``call``, decided by PyTorch's
    CPU dispatcher itself (``torch._fused_sdp_choice``)."""
    if any(t.is_nested for t in call.tensors):
        return MATH  # sdp_utils_cpp.h check_nested_tensor
    with _disable_current_modes():  # the stand-ins are no part of the probed step
        mask = None if call.attn_mask is None else _stand_in(call.attn_mask)
        try:
            choice = _cpu_choice(call, mask)
        except RuntimeError:  # a call PyTorch refuses: the original call will say why
            return MATH
    return FLASH if choice == int(SDPBackend.FLASH_ATTENTION) else MATH


def _cpu_choice(call: SdpaCall, mask: torch.Tensor | None) -> int:
    return torch._fused_sdp_choice(
        _stand_in(call.query),
        _stand_in(call.key),
        _stand_in(call.value),
        mask,
        call.dropout_p,
        call.is_causal,
        scale=call.scale,
        enable_gqa=call.enable_gqa,
    )


@dataclass(frozen=True, slots=True)
class CudaChoice:
    kernel: str
    """``flash``, ``efficient`` or ``math``."""
    note: str | None = None
    """What the spec could not decide, for the profile's warnings."""


def _dense_4d_ok(call: SdpaCall, *, ignore_singleton: bool) -> bool:
    """The dense-input gates every CUDA fused kernel shares (sdp_utils_cpp.h:
    check_tensor_shapes, check_batch_size_and_num_heads_dense with GQA,
    check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense)."""
    q, k, v = call.query, call.key, call.value
    if not (q.dim() == k.dim() == v.dim() == 4) or any(t.is_nested for t in call.tensors):
        return False
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    heads_q, heads_k, heads_v = q.shape[1], k.shape[1], v.shape[1]
    if call.enable_gqa:
        if heads_k != heads_v or heads_q % heads_k:
            return False
    elif not heads_q == heads_k == heads_v:
        return False
    if q.shape[2] == 0 or k.shape[2] == 0:
        return False
    unit = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.shape[-1] == 1)
    mask = call.attn_mask
    return unit and (mask is None or mask.stride(-1) == 1)


def _mask_shape_ok(call: SdpaCall) -> bool:
    """sdp_utils_cpp.h check_attn_mask_shape."""
    mask = call.attn_mask
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    q, k = call.query, call.key
    if mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.shape[0] in (1, q.shape[0]) and mask.shape[1] in (1, q.shape[1])


def cuda_kernel(call: SdpaCall, capability: float | None) -> CudaChoice:
    """What SDPA on a CUDA GPU of ``capability`` (e.g. 8.0, 9.0) runs for ``call``, following
    cuda/sdp_utils.cpp's can_use_flash_attention then can_use_mem_efficient_attention; see
    the module docstring for what cannot be decided from a spec."""
    if capability is None:
        return CudaChoice(
            MATH,
            "The device spec names no compute_capability, so which fused attention kernel "
            "the GPU runs cannot be decided: the meta probe keeps the math path for "
            "scaled_dot_product_attention, which saves the attention probabilities "
            "(higher than any fused kernel). Add compute_capability to the spec.",
        )
    major = int(capability)
    minor = round((capability - major) * 10)
    q, k, v = call.query, call.key, call.value
    dtypes_equal = q.dtype == k.dtype == v.dtype
    head_qk, head_v = q.shape[-1], v.shape[-1]
    dense = _dense_4d_ok(call, ignore_singleton=True)
    flash = (
        torch.backends.cuda.flash_sdp_enabled()
        and dense
        and call.attn_mask is None
        and head_qk == k.shape[-1] == head_v <= 256
        and (8, 0) <= (major, minor) <= (12, 1)
        and not _flash_backward_refuses(call, major, minor)
        and not (call.is_causal and q.shape[2] != k.shape[2])
        and dtypes_equal
        and q.dtype in (_LOW if major >= 8 else (torch.float16,))
    )
    cudnn_first = major in (9, 10)
    if flash:
        note = None
        if cudnn_first:
            note = (
                "On sm90/sm100, recent PyTorch builds run cuDNN attention before flash where it "
                "applies (depending on the cuDNN version); it saves the same output and "
                "log-sum-exp, so the meta probe models flash attention."
            )
        return CudaChoice(FLASH, note)
    # can_use_mem_efficient_attention (CUDA, not ROCm): sm50..sm121, alignment of the head
    # dims to minimum_gemm_alignment, GQA supported, any mask of a valid shape.
    half = q.dtype in _LOW
    tensor_cores = major >= 8 or (major >= 7 and half)
    alignment = max(4 if major >= 8 else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    allowed = (*_LOW, torch.float32) if major >= 8 else (torch.float16, torch.float32)
    efficient = (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and (5, 0) <= (major, minor) <= (12, 1)
        and q.dim() == k.dim() == v.dim() == 4
        and head_qk == k.shape[-1]
        and head_qk > 0
        and head_v > 0
        and head_qk % alignment == 0
        and head_v % alignment == 0
        and _dense_4d_ok(call, ignore_singleton=False)
        and _mask_shape_ok(call)
        and dtypes_equal
        and q.dtype in allowed
        and (major < 8 or all(t.numel() == 0 or t.storage_offset() % alignment == 0
                              for t in (q, k, v)))  # check_data_ptr_alignment_mem_efficient
    )  # fmt: skip
    if efficient:
        note = None
        if cudnn_first and call.attn_mask is not None:
            note = (
                "On sm90/sm100 cuDNN attention may run instead of memory-efficient attention "
                "for a masked call; the meta probe models memory-efficient attention, which "
                "saves at least as much."
            )
        return CudaChoice(EFFICIENT, note)
    return CudaChoice(MATH)


def _flash_backward_refuses(call: SdpaCall, major: int, minor: int) -> bool:
    """cuda/sdp_utils.cpp check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120."""
    if not call.requires_grad:
        return False
    if not ((8, 6) <= (major, minor) <= (8, 9) or (12, 0) <= (major, minor) <= (12, 1)):
        return False
    head = call.query.shape[-1]
    return not (head <= 192 or (call.dropout_p == 0.0 and head > 224))


def _additive_mask(call: SdpaCall) -> torch.Tensor | None:
    """A boolean mask as the composite turns it into an additive one, in the query's dtype
    (attention.cpp convert_boolean_attn_mask: where(mask, 0, -inf)); others as they are."""
    mask = call.attn_mask
    if mask is None or mask.dtype != torch.bool:
        return mask
    dtype = call.query.dtype
    minus_inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, minus_inf)


def _pad_head_dim(tensor: torch.Tensor) -> torch.Tensor:
    """attention.cpp pad_last_dim<8>: CUDA flash pads head dims to a multiple of 8."""
    extra = -tensor.shape[-1] % 8
    return tensor if extra == 0 else F.pad(tensor, (0, extra))


def run_cpu_flash(call: SdpaCall) -> torch.Tensor:
    mask = _additive_mask(call)
    out, _logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        call.query,
        call.key,
        call.value,
        call.dropout_p,
        call.is_causal,
        attn_mask=mask,
        scale=call.scale,
    )
    return out


def run_cuda_flash(call: SdpaCall) -> torch.Tensor:
    head = call.query.shape[-1]
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(head)  # of the unpadded dim
    q, k, v = (_pad_head_dim(t) for t in (call.query, call.key, call.value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, call.dropout_p, call.is_causal, False, scale=scale
    )[0]
    return out if out.shape[-1] == head else out[..., :head]


def run_cuda_efficient(call: SdpaCall) -> torch.Tensor:
    mask = _additive_mask(call)
    if mask is not None:  # a (batch, heads, q, k) bias: attention.cpp preprocess_mask
        mask = mask.expand(
            call.query.shape[0], call.query.shape[1], call.query.shape[2], call.key.shape[2]
        )
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        call.query,
        call.key,
        call.value,
        mask,
        call.requires_grad,
        call.dropout_p,
        call.is_causal,
        scale=call.scale,
    )[0]


class MetaAttention(TorchFunctionMode):
    """Routes meta SDPA calls to the ``target`` device's fused kernel (module docstring).
    ``capability`` is the CUDA target's compute capability; ``notes`` collects, once each,
    what could not be decided, for the profile's warnings."""

    def __init__(self, target: str, capability: float | None, notes: list[str]) -> None:
        super().__init__()
        if target not in (CPU, CUDA):
            raise ValueError(f"unknown attention target {target!r}")
        self.target = target
        self.capability = capability
        self.notes = notes

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in BODY_CALLS:  # nn.MultiheadAttention: its SDPA is in a Python body
            return run_body(self, func, args, kwargs)
        if func is not SDPA:
            return func(*args, **kwargs)
        return self._attend(args, kwargs)

    def _attend(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """One SDPA call, run as the target runs it."""
        try:  # memplan's routing and kernel emulation: a failure is memplan's own
            route = self._route(args, kwargs)
            if route is not None:
                return route()
        except MemplanError:
            raise
        except Exception as exc:
            raise internal_failure("meta attention (probe/meta_attention.py)", SDPA, exc) from exc
        return SDPA(*args, **kwargs)  # the user's call, as PyTorch runs it

    def _route(self, args: tuple, kwargs: dict) -> Callable[[], torch.Tensor] | None:
        """The fused kernel this call runs on the target (a thunk running its meta
        emulation), or None: PyTorch's own SDPA (math, or a call PyTorch refuses)."""
        call = SdpaCall.bind(args, kwargs)
        if call is None or not all(t.device.type == "meta" for t in call.tensors):
            return None
        mask = call.attn_mask
        if mask is not None and mask.dtype not in (torch.bool, call.query.dtype):
            return None  # PyTorch refuses it; let it say so
        if self.target == CPU:
            return (lambda: run_cpu_flash(call)) if cpu_kernel(call) == FLASH else None
        choice = cuda_kernel(call, self.capability)
        if choice.note and choice.note not in self.notes:
            self.notes.append(choice.note)
        if choice.kernel == FLASH:
            return lambda: run_cuda_flash(call)
        if choice.kernel == EFFICIENT:
            return lambda: run_cuda_efficient(call)
        return None
